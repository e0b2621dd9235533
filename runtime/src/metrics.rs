//! The Prometheus metrics of every service, in one registry, served as
//! OpenMetrics text. Each service moves the counters that concern it; the
//! rest stay at zero. Beside them: `sas_build_info` and the standard
//! process metrics ([`process`]).

pub mod process;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Label sets are small `(name, value)` lists.
pub type Labels = Vec<(String, String)>;

/// A histogram family whose buckets suit durations from a millisecond to hours.
pub type Durations = Family<Labels, Histogram, fn() -> Histogram>;

fn duration_buckets() -> Histogram {
    // 1 ms … about 2.3 h, doubling: re-attempts wait minutes to an hour,
    // and long-running steps may take an hour.
    Histogram::new(exponential_buckets(0.001, 2.0, 24))
}

/// The counters of sas.
pub struct Metrics {
    /// Orders that ended, by `state` (`processed`, `compensated`, `error`)
    /// and `workflow`.
    pub orders_finished: Family<Labels, Counter>,
    /// Seconds from submission to the end, by `state` and `workflow`.
    pub order_latency_seconds: Durations,
    /// 1, labelled with the `version` and the `service`.
    pub build_info: Family<Labels, Gauge>,
    /// Seconds an agent spent on a step request, by `agent` and `outcome`.
    pub agent_step_duration_seconds: Durations,
    /// Seconds one supervisor sweep took.
    pub supervisor_sweep_duration_seconds: Histogram,
    /// Outbox messages waiting to be published, as last counted by this process.
    pub outbox_backlog: Gauge,
    registry: Registry,
    /// Orders stored by the submission.
    pub orders_received: Counter,
    /// Submissions of an order id that already existed.
    pub orders_duplicate: Counter,
    /// Submissions dead-lettered, by `reason`.
    pub orders_rejected: Family<Labels, Counter>,
    /// Replay requests (contract §9), by `outcome`: `replayed`, `truncated`
    /// (cut at `submission.max_replay_events`) or the reason it was
    /// dead-lettered.
    pub replays: Family<Labels, Counter>,
    /// Signals (contract §4d), by `outcome`: `applied` or the reason it was
    /// dead-lettered (`not_waiting`, `unknown_order`, …).
    pub signals: Family<Labels, Counter>,
    /// Orders claimed by a scheduler.
    pub orders_claimed: Counter,
    /// Agent replies, by `outcome` (`applied`, `stale`, `malformed`, `failed`:
    /// not applied for a reason of its own, retried a bounded number of times).
    pub replies: Family<Labels, Counter>,
    /// Remote calls, by `agent` and `outcome`.
    pub agent_calls: Family<Labels, Counter>,
    /// Requests an agent worked on, by `agent` and `outcome`
    /// (`succeeded`, `failed`, `expired`, `malformed`, `handed_back`).
    pub agent_requests: Family<Labels, Counter>,
    /// Messages of replies an agent published: a pack of replies counts
    /// once (so replies per message = requests answered / this).
    pub reply_messages: Counter,
    /// Expired orders the supervisor recovered, by `action` (`requeued`,
    /// `held`, `gave_up`, `woke`: `rules::supervisor::Recovery::label`).
    pub supervisor_recoveries: Family<Labels, Counter>,
    /// Supervisor sweeps.
    pub supervisor_sweeps: Counter,
    /// Circuit breaker per agent: 0 closed, 1 half-open, 2 open.
    pub agent_breaker_state: Family<Labels, Gauge>,
    /// Whether this supervisor is the leader (1) or standing by (0).
    pub supervisor_leader: Gauge,
    /// The partitions of the orders this supervisor sweeps.
    pub supervisor_partitions: Gauge,
    /// Orders past the first rung of their deadline ladder, by why they
    /// are stuck (`reason`); counted by the leading supervisor.
    pub orders_stuck: Family<Labels, Gauge>,
    /// Outbox messages confirmed by the broker, by `kind`.
    pub outbox_published: Family<Labels, Counter>,
    /// Status events dropped because the application's queue does not exist,
    /// and messages no broker could take (a name longer than AMQP allows).
    pub outbox_unroutable: Counter,
    /// Message handlers that panicked (each delivery dead-lettered with
    /// reason `internal_error`).
    pub handler_panics: Counter,
    /// Ended orders deleted by retention (contract §10).
    pub orders_pruned: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new("sas")
    }
}

impl Metrics {
    /// The metrics of `service` (its name in `sas_build_info`).
    pub fn new(service: &str) -> Self {
        let mut root = Registry::default();
        root.register_collector(Box::new(process::Process));
        let registry = root.sub_registry_with_prefix("sas");
        let m = Self {
            orders_finished: Family::default(),
            order_latency_seconds: Family::new_with_constructor(duration_buckets),
            build_info: Family::default(),
            agent_step_duration_seconds: Family::new_with_constructor(duration_buckets),
            supervisor_sweep_duration_seconds: duration_buckets(),
            outbox_backlog: Gauge::default(),
            orders_received: Counter::default(),
            orders_duplicate: Counter::default(),
            orders_rejected: Family::default(),
            replays: Family::default(),
            signals: Family::default(),
            orders_claimed: Counter::default(),
            replies: Family::default(),
            agent_calls: Family::default(),
            agent_requests: Family::default(),
            reply_messages: Counter::default(),
            supervisor_recoveries: Family::default(),
            supervisor_sweeps: Counter::default(),
            agent_breaker_state: Family::default(),
            supervisor_leader: Gauge::default(),
            supervisor_partitions: Gauge::default(),
            orders_stuck: Family::default(),
            outbox_published: Family::default(),
            outbox_unroutable: Counter::default(),
            handler_panics: Counter::default(),
            orders_pruned: Counter::default(),
            registry: Registry::default(),
        };
        m.build_info
            .get_or_create(&labels(&[
                ("version", env!("CARGO_PKG_VERSION")),
                ("service", service),
            ]))
            .set(1);
        registry.register(
            "build_info",
            "1, labelled with the version and the service",
            m.build_info.clone(),
        );
        registry.register(
            "orders_received",
            "Orders stored",
            m.orders_received.clone(),
        );
        registry.register(
            "orders_duplicate",
            "Submissions of an existing order id",
            m.orders_duplicate.clone(),
        );
        registry.register(
            "orders_rejected",
            "Submissions dead-lettered, by reason",
            m.orders_rejected.clone(),
        );
        registry.register(
            "replays",
            "Replay requests served or dead-lettered, by outcome",
            m.replays.clone(),
        );
        registry.register(
            "signals",
            "Signals applied or dead-lettered, by outcome",
            m.signals.clone(),
        );
        registry.register(
            "handler_panics",
            "Message handlers that panicked; each delivery was dead-lettered (internal_error)",
            m.handler_panics.clone(),
        );
        registry.register(
            "orders_claimed",
            "Orders claimed by a scheduler",
            m.orders_claimed.clone(),
        );
        registry.register("replies", "Agent replies, by outcome", m.replies.clone());
        registry.register(
            "agent_calls",
            "Remote calls, by agent and outcome",
            m.agent_calls.clone(),
        );
        registry.register(
            "agent_requests",
            "Step requests handled, by agent and outcome",
            m.agent_requests.clone(),
        );
        registry.register(
            "reply_messages",
            "Messages of replies an agent published (a pack counts once)",
            m.reply_messages.clone(),
        );
        registry.register(
            "supervisor_recoveries",
            "Expired orders recovered, by action",
            m.supervisor_recoveries.clone(),
        );
        registry.register(
            "supervisor_sweeps",
            "Supervisor sweeps",
            m.supervisor_sweeps.clone(),
        );
        registry.register(
            "orders_finished",
            "Orders that ended, by state",
            m.orders_finished.clone(),
        );
        registry.register(
            "order_latency_seconds",
            "Seconds from submission to the end of an order, by state",
            m.order_latency_seconds.clone(),
        );
        registry.register(
            "agent_step_duration_seconds",
            "Seconds an agent spent on a step request, by agent and outcome",
            m.agent_step_duration_seconds.clone(),
        );
        registry.register(
            "supervisor_sweep_duration_seconds",
            "Seconds one supervisor sweep took",
            m.supervisor_sweep_duration_seconds.clone(),
        );
        registry.register(
            "outbox_backlog",
            "Outbox messages waiting to be published",
            m.outbox_backlog.clone(),
        );
        registry.register(
            "agent_breaker_state",
            "Circuit breaker per agent: 0 closed, 1 half-open, 2 open",
            m.agent_breaker_state.clone(),
        );
        registry.register(
            "orders_stuck",
            "Orders past the first rung of their deadline ladder, by why they are stuck",
            m.orders_stuck.clone(),
        );
        registry.register(
            "supervisor_partitions",
            "The partitions of the orders this supervisor sweeps",
            m.supervisor_partitions.clone(),
        );
        registry.register(
            "supervisor_leader",
            "1 when this supervisor holds the leader lease",
            m.supervisor_leader.clone(),
        );
        registry.register(
            "outbox_published",
            "Outbox messages confirmed, by kind and by path (handed over by the transition, or taken by a pass of the relay)",
            m.outbox_published.clone(),
        );
        registry.register(
            "orders_pruned",
            "Ended orders deleted by retention",
            m.orders_pruned.clone(),
        );
        registry.register(
            "outbox_unroutable",
            "Status events dropped: no such status queue",
            m.outbox_unroutable.clone(),
        );
        Self {
            registry: root,
            ..m
        }
    }

    /// Counts an order of `workflow` that ended in `state`, `age` after it
    /// was submitted (when known).
    pub fn finished(
        &self,
        workflow: &str,
        state: crate::state::ProcessState,
        age: Option<std::time::Duration>,
    ) {
        let l = labels(&[("state", state.as_str()), ("workflow", workflow)]);
        self.orders_finished.get_or_create(&l).inc();
        if let Some(age) = age {
            self.order_latency_seconds
                .get_or_create(&l)
                .observe(age.as_secs_f64());
        }
    }

    /// The metrics in OpenMetrics text format ([`CONTENT_TYPE`]).
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A label set from pairs.
pub fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

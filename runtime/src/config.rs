//! Settings: built-in defaults, then the TOML file named by `--config` or
//! `SAS_CONFIG`, then `SAS__SECTION__KEY` environment variables (contract §6).
//!
//! Every key has a working default except the workflows and agents, so a
//! service starts against a local Postgres and RabbitMQ with no configuration.
//! Durations are human strings (`"250ms"`, `"3s"`, `"5m"`), parsed once here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

pub use crate::spec::{
    ApplicationSpec, RetrySpec, ScheduleSpec, StepSpec, SupervisorSettings, WorkflowSpec,
};
use crate::workflow::{Workflow, WorkflowError};

mod dashboard;
mod retention;
mod schedules;

pub use dashboard::{
    Cidr, CidrError, DashboardAuth, DashboardSettings, DashboardToken, DashboardUser, Role, Secret,
    valid_name,
};
pub use retention::{MAX_BATCH as MAX_RETENTION_BATCH, RetentionSettings, parse_ended_after};
pub use sas_broker::{BrokerSettings, Durability, QueueType};
pub use sas_store::{DatabaseSettings, Hosts, HostsError, query_param};

/// Whether `t` is a token kept hashed: `sha256:` and 64 hex digits.
fn is_token_hash(t: &str) -> bool {
    t.strip_prefix("sha256:")
        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Why the configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The layers could not be read or did not fit the settings' shape.
    #[error("bad configuration: {0}")]
    Load(#[from] config::ConfigError),
    /// The values are well-formed but make no sense together.
    #[error("bad configuration: {0}")]
    Invalid(String),
    /// A workflow is malformed.
    #[error("bad configuration: {0}")]
    Workflow(#[from] WorkflowError),
    /// A schedule is malformed.
    #[error("bad configuration: {0}")]
    Schedule(#[from] crate::rules::schedule::ScheduleError),
}

/// All of sas's settings; each service reads the sections it needs.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Settings {
    pub database: DatabaseSettings,
    pub broker: BrokerSettings,
    pub http: HttpSettings,
    pub log: LogSettings,
    /// `[telemetry]`: OpenTelemetry export of the traces.
    pub telemetry: TelemetrySettings,
    pub submission: SubmissionSettings,
    pub scheduler: SchedulerSettings,
    pub agent: AgentSettings,
    pub supervisor: SupervisorSettings,
    pub outbox: OutboxSettings,
    pub shutdown: ShutdownSettings,
    pub dashboard: DashboardSettings,
    /// `[retention]`: how long ended orders are kept (contract §10).
    pub retention: RetentionSettings,
    /// Workflows by name: the steps an order of that workflow runs.
    pub workflows: BTreeMap<String, WorkflowSpec>,
    /// Agents by name: the remote endpoint each one wraps.
    pub agents: BTreeMap<String, AgentSpec>,
    /// Recurring orders by name (contract §4b).
    pub schedules: BTreeMap<String, ScheduleSpec>,
    /// Application identities by name (contract §1b); none: anyone who can
    /// publish to the orders queue submits, as before.
    pub applications: BTreeMap<String, ApplicationSpec>,
}

/// `[http]`: the health and metrics endpoint of every service (and the
/// submission's HTTP API, contract §9a).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct HttpSettings {
    pub host: String,
    /// `None` means the service's own default port; `0` picks a free one.
    pub port: Option<u16>,
    /// Whether the submission's HTTP API (`/v1`) answers a request without
    /// a token when it comes from this host (a loopback peer, addressed to
    /// a loopback `Host`, with no `Origin`: not a web page's) and no
    /// `[applications]` are configured. With applications, every request
    /// needs one of their tokens, loopback or not.
    pub api_loopback_open: bool,
}

impl Default for HttpSettings {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: None,
            api_loopback_open: true,
        }
    }
}

/// `[log]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct LogSettings {
    /// `pretty` or `json`.
    pub format: LogFormat,
    /// A `tracing` filter such as `info` or `sas=debug,info`; `RUST_LOG` wins.
    pub level: String,
}

/// `[telemetry]`: where spans go over OTLP (HTTP, protobuf). The standard
/// `OTEL_EXPORTER_OTLP_ENDPOINT` (or `…_TRACES_ENDPOINT`) and
/// `OTEL_SERVICE_NAME` variables win over these keys; with no endpoint at
/// all, nothing is exported.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetrySettings {
    /// The collector's OTLP/HTTP base URL, e.g. `http://jaeger:4318`
    /// (`/v1/traces` is appended).
    pub endpoint: Option<String>,
    /// The `service.name` of this process's spans (default: the service's
    /// own name, e.g. `scheduler`).
    pub service_name: Option<String>,
}

impl Default for LogSettings {
    fn default() -> Self {
        Self {
            format: LogFormat::Pretty,
            level: "info".into(),
        }
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Pretty,
    Json,
}

/// `[submission]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct SubmissionSettings {
    /// Bodies larger than this are dead-lettered unread.
    pub max_body_bytes: usize,
    /// Most status events one replay request (contract §9) publishes: a
    /// replay is one query and one burst of publishes, so a request for a
    /// busy queue's whole history must not hold the submission for long.
    pub max_replay_events: u32,
    /// HTTP event streams (contract §9a) open at once in this instance.
    pub max_streams: u32,
    /// HTTP event streams one application may have open at once, so that
    /// one cannot shut the others out (callers of no application share
    /// `max_streams`).
    pub max_streams_per_application: u32,
    /// How long an HTTP event stream stays open at most; it then ends, and
    /// the client resumes with `Last-Event-ID`.
    #[serde(with = "humantime_serde")]
    pub stream_lifetime: Duration,
    /// How often an idle HTTP event stream sends a comment line, so that
    /// proxies and clients do not take it for dead.
    #[serde(with = "humantime_serde")]
    pub stream_heartbeat: Duration,
    /// Whether a new order whose first steps may go now (due, their agents
    /// under no open breaker nor flow control, and fewer orders held
    /// deployment-wide than `scheduler.max_in_flight`) starts in the
    /// write-back that stores it, its first requests sent by the
    /// submission, rather than waiting, pending, for a scheduler to read it
    /// back and claim it.
    pub start_orders: bool,
    /// How long the room a start's write-back read (breakers, flow
    /// control, orders held) stands for the room now: the next starts
    /// within it read it no more. Zero: each start reads it first.
    #[serde(with = "humantime_serde")]
    pub room_fresh_for: Duration,
}

impl Default for SubmissionSettings {
    fn default() -> Self {
        Self {
            max_body_bytes: 1024 * 1024,
            max_replay_events: 10_000,
            max_streams: 256,
            max_streams_per_application: 64,
            stream_lifetime: Duration::from_secs(30 * 60),
            stream_heartbeat: Duration::from_secs(15),
            start_orders: true,
            room_fresh_for: Duration::from_millis(100),
        }
    }
}

/// `[scheduler]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct SchedulerSettings {
    /// The `locked_by` value of this instance; a fresh one per process when unset.
    pub instance_id: Option<String>,
    /// The slow poll beside the wake-up notifications (for `not_before` and re-attempts).
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// Orders claimed per claim transaction: like `database.batch_size`,
    /// a claim costs about the same round trips whatever its size.
    pub claim_batch: u32,
    /// A claim stops deciding once the orders it claimed have this many
    /// step requests to send, and claims the rest at once in another: a
    /// burst of fan-out orders (many requests each) then never holds
    /// `claim_batch` times its fan-out in memory. At the default, equal to
    /// `claim_batch`, orders of one request each never reach it.
    pub claim_messages: u32,
    /// Most orders this instance holds at once (claimed and not yet ended).
    /// Beyond it, orders wait as `pending` in the state store rather than as
    /// requests in the agents' queues, where they would outlive complete-by.
    pub max_in_flight: u32,
    /// Most orders waiting for a reply that the scheduler keeps in memory
    /// at the row versions its write-backs left them, so that their replies
    /// are applied without loading them again (a write-back refused because
    /// another process wrote the order since loads it). Zero: keep none.
    pub keep_orders: u32,
}

impl Default for SchedulerSettings {
    fn default() -> Self {
        Self {
            instance_id: None,
            poll_interval: Duration::from_millis(500),
            claim_batch: 256,
            claim_messages: 256,
            max_in_flight: 1000,
            keep_orders: 1000,
        }
    }
}

/// `[agent]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct AgentSettings {
    /// Requests worked on at once per agent (the consumer's prefetch).
    pub concurrency: u16,
    /// First retry wait; doubles per retry, with full jitter.
    #[serde(with = "humantime_serde")]
    pub backoff_initial: Duration,
    /// Longest retry wait.
    #[serde(with = "humantime_serde")]
    pub backoff_max: Duration,
    /// Time to establish a TCP connection to a remote service.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Consecutive transient failures that open an endpoint's circuit breaker.
    pub breaker_threshold: u32,
    /// How long an open breaker waits before letting one probe through.
    #[serde(with = "humantime_serde")]
    pub breaker_cooldown: Duration,
    /// A PEM file of CA certificates that `https://` remotes' certificates
    /// may chain to, trusted beside the system's roots, for every agent.
    pub ca_file: Option<PathBuf>,
}

impl Default for AgentSettings {
    fn default() -> Self {
        Self {
            concurrency: 64,
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            breaker_threshold: 5,
            breaker_cooldown: Duration::from_secs(5),
            ca_file: None,
        }
    }
}

/// `[outbox]`: the relay of status events, step requests and alerts.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct OutboxSettings {
    /// How often the relay looks for rows another process left behind.
    #[serde(with = "humantime_serde")]
    pub sweep_interval: Duration,
    /// Age at which a row counts as left behind.
    #[serde(with = "humantime_serde")]
    pub sweep_age: Duration,
    /// Orders relayed per transaction.
    pub batch: usize,
}

impl Default for OutboxSettings {
    fn default() -> Self {
        Self {
            sweep_interval: Duration::from_secs(1),
            sweep_age: Duration::from_secs(2),
            batch: 128,
        }
    }
}

/// `[shutdown]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct ShutdownSettings {
    /// How long in-flight work may take to finish after SIGTERM before it is handed back.
    #[serde(with = "humantime_serde")]
    pub grace: Duration,
}

impl Default for ShutdownSettings {
    fn default() -> Self {
        Self {
            grace: Duration::from_secs(10),
        }
    }
}

/// `[agents.<name>]`: the remote endpoint an agent wraps.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSpec {
    pub url: String,
    /// Bound on one HTTP call; the step's complete-by bounds it anyway.
    #[serde(with = "humantime_serde", default)]
    pub timeout: Option<Duration>,
    /// Longest answer read from the remote; a longer one is a permanent
    /// failure of the step (contract §1a).
    #[serde(default = "default_max_response_bytes")]
    pub max_response_bytes: usize,
    /// Consecutive transient failures (all instances together) that open
    /// this agent's shared breaker; default `agent.breaker_threshold`.
    #[serde(default)]
    pub breaker_threshold: Option<u32>,
    /// How long its open breaker waits before one probe; default
    /// `agent.breaker_cooldown`.
    #[serde(with = "humantime_serde", default)]
    pub breaker_cooldown: Option<Duration>,
    /// How long an order may be held for its open breaker before the hold
    /// is handled as a failure (contract §8).
    #[serde(with = "humantime_serde", default = "default_max_hold")]
    pub max_hold: Duration,
    /// Steps dispatched to this agent and not yet answered, at most, over
    /// the whole deployment (contract §4b); unset: no bound.
    #[serde(default)]
    pub max_in_flight: Option<u32>,
    /// Dispatches to this agent per unit of time over the whole deployment
    /// (contract §4b), e.g. `"100/s"`, `"600/m"`, `"1000/h"`; unset: no limit.
    #[serde(default)]
    pub rate_limit: Option<String>,
    /// Whether the remote's redirects are followed (contract §1b): a remote
    /// must not send the agent, and the answer it publishes, to another host.
    #[serde(default)]
    pub follow_redirects: FollowRedirects,
    /// Shortest time between two polls of a long-running operation
    /// (contract §1b), whatever the remote's `Retry-After` says: a remote
    /// cannot make the agent poll it, and tell of it, in a tight loop.
    #[serde(with = "humantime_serde", default = "default_min_poll")]
    pub min_poll: Duration,
}

/// Whether an agent follows its remote's redirects (`agents.<name>.follow_redirects`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(try_from = "String")]
pub enum FollowRedirects {
    /// `"none"`: a `3xx` answer is a permanent failure of the step.
    #[default]
    None,
    /// `"same-origin"`: redirects on the origin (scheme, host, port) of the
    /// agent's URL are followed; one to another origin is a permanent
    /// failure of the step.
    SameOrigin,
}

impl FollowRedirects {
    /// The setting's value as written in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::SameOrigin => "same-origin",
        }
    }
}

/// A `follow_redirects` that is none of its values.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is neither \"none\" nor \"same-origin\"")]
pub struct UnknownRedirectPolicy(String);

impl TryFrom<String> for FollowRedirects {
    type Error = UnknownRedirectPolicy;

    fn try_from(value: String) -> Result<Self, Self::Error> {
        match value.as_str() {
            "none" => Ok(Self::None),
            "same-origin" => Ok(Self::SameOrigin),
            _ => Err(UnknownRedirectPolicy(value)),
        }
    }
}

/// The shortest `agents.<name>.min_poll` accepted: a floor that still
/// bounds how often one step can poll (ten times a second).
pub const MIN_POLL_FLOOR: Duration = Duration::from_millis(100);

fn default_min_poll() -> Duration {
    Duration::from_secs(1)
}

fn default_max_response_bytes() -> usize {
    1024 * 1024
}

fn default_max_hold() -> Duration {
    Duration::from_secs(24 * 3600)
}

/// A rate as `<count>/<s|m|h>` (e.g. `"100/s"`), in dispatches per second.
pub fn parse_rate(text: &str) -> Result<f64, String> {
    let (count, per) = text
        .split_once('/')
        .ok_or_else(|| format!("{text:?} is not <count>/<s|m|h>, e.g. \"100/s\""))?;
    let count: f64 = count
        .trim()
        .parse()
        .map_err(|_| format!("{text:?}: {count:?} is not a number"))?;
    let seconds = match per.trim() {
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        other => return Err(format!("{text:?}: the unit {other:?} is not s, m or h")),
    };
    if !(count.is_finite() && count > 0.0) {
        return Err(format!("{text:?}: the count must be more than 0"));
    }
    Ok(count / seconds)
}

impl AgentSpec {
    /// The agent's `rate_limit` in dispatches per second (checked at start-up).
    pub fn rate_per_sec(&self) -> Option<f64> {
        self.rate_limit.as_deref().and_then(|r| parse_rate(r).ok())
    }

    /// The breaker's threshold, cool-down and max hold for this agent,
    /// its own or `agent`'s.
    pub fn breaker_policy(&self, agent: &AgentSettings) -> (u32, Duration, Duration) {
        (
            self.breaker_threshold.unwrap_or(agent.breaker_threshold),
            self.breaker_cooldown.unwrap_or(agent.breaker_cooldown),
            self.max_hold,
        )
    }
}

/// Whether `host` (a name or an address, IPv6 in brackets or not) is this
/// machine's loopback.
fn is_loopback_host(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl Settings {
    /// Loads the layers: defaults, then `file` (or `SAS_CONFIG`), then `SAS__*` variables.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_with(file, None)
    }

    /// Like [`Settings::load`], reading the variables from `env` instead of
    /// the process's environment when given (for tests).
    pub fn load_with(
        file: Option<&Path>,
        env: Option<std::collections::HashMap<String, String>>,
    ) -> Result<Self, ConfigError> {
        let file: Option<PathBuf> = file
            .map(Path::to_path_buf)
            .or_else(|| std::env::var_os("SAS_CONFIG").map(PathBuf::from));
        let mut builder = config::Config::builder();
        if let Some(file) = file {
            if !file.exists() {
                return Err(ConfigError::Invalid(format!(
                    "configuration file {} does not exist",
                    file.display()
                )));
            }
            builder = builder.add_source(config::File::from(file).format(config::FileFormat::Toml));
        }
        builder = builder.add_source(
            config::Environment::with_prefix("SAS")
                .prefix_separator("__")
                .separator("__")
                .list_separator(",")
                .with_list_parse_key("supervisor.retry_schedule")
                .with_list_parse_key("supervisor.warn_at")
                .with_list_parse_key("dashboard.trusted_proxies")
                .with_list_parse_key("dashboard.allowed_hosts")
                .try_parsing(true)
                .source(env.map(|m| m.into_iter().collect())),
        );
        let settings: Settings = builder.build()?.try_deserialize()?;
        settings.validate()?;
        Ok(settings)
    }

    /// Settings that work but cost throughput, each as a line to log at
    /// start-up: a consumer's `broker.prefetch` caps how many deliveries can
    /// wait for the next batch, so one below twice `database.batch_size`
    /// keeps batches from filling while the one before commits.
    pub fn advice(&self) -> Vec<String> {
        let mut advice: Vec<String> = self.unguarded_exposure().into_iter().collect();
        let (prefetch, batch) = (usize::from(self.broker.prefetch), self.database.batch_size);
        if prefetch < 2 * batch {
            advice.push(format!(
                "broker.prefetch ({prefetch}) is below twice database.batch_size ({batch}): \
                 batches cannot fill while the one before commits; raise broker.prefetch \
                 to {} or lower database.batch_size",
                2 * batch
            ));
        }
        advice
    }

    /// What is open to anyone who reaches this deployment, if anything:
    /// without `[applications]` (contract §1b, §9), any publisher may
    /// replay any order's events and take another's order id, which is
    /// fine on one machine and not beyond it. Said when the HTTP port or a
    /// broker node is not on loopback; every service logs it at start and
    /// the dashboard shows it.
    pub fn unguarded_exposure(&self) -> Option<String> {
        if !self.applications.is_empty() {
            return None;
        }
        let mut exposed = Vec::new();
        if !is_loopback_host(&self.http.host) {
            exposed.push(format!("the HTTP port on {}", self.http.host));
        }
        let brokers = self
            .broker
            .nodes()
            .into_iter()
            .filter_map(|node| sas_client::connect::parse_node(node, crate::tls::redact_url).ok())
            .map(|uri| uri.authority.host)
            .filter(|host| !is_loopback_host(host))
            .collect::<Vec<_>>();
        if !brokers.is_empty() {
            exposed.push(format!("the broker at {}", brokers.join(", ")));
        }
        (!exposed.is_empty()).then(|| {
            format!(
                "no [applications] are configured while {} is beyond loopback: any publisher \
                 can replay any order's events and take another's order id; declare each \
                 application's identity (docs/security.md)",
                exposed.join(" and ")
            )
        })
    }

    /// Checks what serde cannot: names, ranges and references between sections.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if let Some(problem) = crate::workflow::child_problem(&self.workflows) {
            return invalid(problem);
        }
        let streams = &self.submission;
        if streams.max_streams == 0
            || streams.max_streams_per_application == 0
            || streams.stream_lifetime.is_zero()
            || streams.stream_heartbeat.is_zero()
        {
            return invalid(
                "submission.max_streams, max_streams_per_application, stream_lifetime and stream_heartbeat must be above zero"
                    .into(),
            );
        }
        if self.broker.prefix.is_empty()
            || !self
                .broker
                .prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return invalid(format!(
                "broker.prefix {:?} must be non-empty ASCII letters, digits, '-', '_' or '.'",
                self.broker.prefix
            ));
        }
        if self.broker.prefetch == 0 {
            return invalid("broker.prefetch must be at least 1".into());
        }
        if self.agent.concurrency == 0 {
            return invalid("agent.concurrency must be at least 1".into());
        }
        if self.supervisor.max_failures == 0 {
            return invalid("supervisor.max_failures must be at least 1".into());
        }
        let rungs = &self.supervisor.warn_at;
        if rungs.iter().any(|f| !(*f > 0.0 && *f < 1.0)) || rungs.windows(2).any(|w| w[0] >= w[1]) {
            return invalid(format!(
                "supervisor.warn_at must be ascending fractions between 0 and 1, got {rungs:?}"
            ));
        }
        if self.supervisor.partitions == 0 || self.supervisor.partitions > 1024 {
            return invalid("supervisor.partitions must be between 1 and 1024".into());
        }
        if self.supervisor.interval.is_zero() {
            return invalid("supervisor.interval must be more than 0".into());
        }
        if self.scheduler.max_in_flight == 0 {
            return invalid("scheduler.max_in_flight must be at least 1".into());
        }
        if self.scheduler.claim_batch == 0 {
            return invalid("scheduler.claim_batch must be at least 1".into());
        }
        if self.scheduler.claim_messages == 0 {
            return invalid("scheduler.claim_messages must be at least 1".into());
        }
        if self.database.max_connections == 0 {
            return invalid("database.max_connections must be at least 1".into());
        }
        if self.database.batch_size == 0 || self.database.batch_workers == 0 {
            return invalid(
                "database.batch_size and database.batch_workers must be at least 1".into(),
            );
        }
        self.validate_tls()?;
        for (name, agent) in &self.agents {
            if agent.max_in_flight == Some(0) {
                return invalid(format!("agents.{name}.max_in_flight must be at least 1"));
            }
            if let Some(Err(e)) = agent.rate_limit.as_deref().map(parse_rate) {
                return invalid(format!("agents.{name}.rate_limit: {e}"));
            }
            if agent.min_poll < MIN_POLL_FLOOR {
                return invalid(format!(
                    "agents.{name}.min_poll ({:?}) must be at least {MIN_POLL_FLOOR:?}",
                    agent.min_poll
                ));
            }
            if !(agent.url.starts_with("http://") || agent.url.starts_with("https://")) {
                return invalid(format!(
                    "agents.{name}.url {:?} must be an http:// or https:// URL",
                    crate::tls::redact_url(&agent.url)
                ));
            }
        }
        for (name, spec) in &self.workflows {
            self.workflow(name)?;
            if spec.max_failures == Some(0) {
                return invalid(format!("workflows.{name}.max_failures must be at least 1"));
            }
            if spec.retry_schedule.as_ref().is_some_and(Vec::is_empty) {
                return invalid(format!(
                    "workflows.{name}.retry_schedule needs at least one wait"
                ));
            }
            for step in &spec.steps {
                if step.retry.is_some_and(|r| r.max_attempts == Some(0)) {
                    return invalid(format!(
                        "workflows.{name} step {:?}: retry.max_attempts must be at least 1",
                        step.name
                    ));
                }
            }
        }
        self.compiled_schedules(chrono::Utc::now())?;
        self.validate_applications()?;
        self.dashboard.validate()?;
        self.retention.validate()?;
        self.validate_database()?;
        Ok(())
    }

    /// Refuses applications that cannot be told apart or used: a name or
    /// user that is no AMQP short string, a user two applications share, a
    /// reply-queue pattern inside sas's or the broker's own names.
    fn validate_applications(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        let names = crate::topology::QueueNames::new(&self.broker.prefix);
        let own = crate::broker::own_users(&self.broker);
        let mut users = std::collections::BTreeSet::new();
        for (name, app) in &self.applications {
            if !crate::messages::is_queue_name(name) {
                return invalid(
                    "applications: a name must be 1 to 255 bytes without control characters".into(),
                );
            }
            if let Some(user) = &app.user {
                if !crate::messages::is_queue_name(user) {
                    return invalid(format!(
                        "applications.{name}.user must be 1 to 255 bytes without control characters"
                    ));
                }
                if own.contains(user) {
                    // sas's copies say who sent their original: an application
                    // logged in as sas could say anything.
                    return invalid(format!(
                        "applications.{name}.user {user:?} is sas's own broker user; give the application a user of its own"
                    ));
                }
                if !users.insert(user.as_str()) {
                    return invalid(format!(
                        "applications.{name}.user {user:?} is another application's too"
                    ));
                }
            }
            for pattern in &app.reply_to {
                let literal = pattern.split('*').next().unwrap_or_default();
                if pattern.is_empty() || names.is_reserved(literal) && !literal.is_empty() {
                    return invalid(format!(
                        "applications.{name}.reply_to {pattern:?} names queues of sas or of the broker; name the application's own"
                    ));
                }
            }
            if let Some(bad) = app.tokens.iter().find(|t| !is_token_hash(t)) {
                return invalid(format!(
                    "applications.{name}.tokens: {:?} is not sha256:<64 hex digits> (tokens are kept hashed)",
                    crate::messages::truncate_bytes(bad, 16)
                ));
            }
        }
        Ok(())
    }

    /// Refuses database settings that cannot work: an `io_timeout` that
    /// would cut a statement the server still runs, or a host list sas
    /// cannot use ([`Hosts::parse`]).
    fn validate_database(&self) -> Result<(), ConfigError> {
        let d = &self.database;
        if d.io_timeout.is_zero() || d.io_timeout <= d.statement_timeout {
            return Err(ConfigError::Invalid(format!(
                "database.io_timeout ({:?}) must be above database.statement_timeout ({:?}), \
                 so that the server cancels a slow statement before the client drops its \
                 connection",
                d.io_timeout, d.statement_timeout
            )));
        }
        Hosts::parse(&d.url)
            .map(drop)
            .map_err(|e| ConfigError::Invalid(e.to_string()))
    }

    /// Refuses TLS settings that would let a connection fall back to
    /// plaintext, or that cannot be used (contract §1a: plaintext is never
    /// chosen silently when TLS was asked for).
    fn validate_tls(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        let mut schemes = Vec::new();
        for node in self.broker.nodes() {
            let scheme = node.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
            match scheme.as_deref() {
                Some("amqps") => schemes.push(true),
                Some("amqp") => schemes.push(false),
                _ => {
                    return invalid(format!(
                        "broker.url {:?} must be an amqp:// or amqps:// URL",
                        crate::tls::redact_url(node)
                    ));
                }
            }
        }
        let Some(&tls) = schemes.first() else {
            return invalid("broker.url is empty".into());
        };
        if schemes.iter().any(|s| *s != tls) {
            return invalid(
                "broker.url mixes amqp:// and amqps:// nodes; a cluster's nodes are reached \
                 the same way"
                    .into(),
            );
        }
        let b = &self.broker;
        if !tls && (b.ca_file.is_some() || b.client_cert.is_some() || b.client_key.is_some()) {
            return invalid(
                "broker.ca_file, broker.client_cert and broker.client_key need an amqps:// \
                 broker.url; amqp:// is plaintext"
                    .into(),
            );
        }
        if b.client_cert.is_some() != b.client_key.is_some() {
            return invalid("broker.client_cert and broker.client_key go together".into());
        }
        if self.database.ca_file.is_some()
            && let Some(mode) = query_param(&self.database.url, "sslmode")
            && !matches!(mode.as_str(), "verify-ca" | "verify-full")
        {
            return invalid(format!(
                "database.ca_file is set but database.url asks for sslmode={mode}, which \
                 does not verify the server: use verify-full (or leave sslmode out)"
            ));
        }
        Ok(())
    }

    /// `text` with every configured connection URL's password masked, and any
    /// other URL in it shown without its password ([`crate::tls::redact`]):
    /// what a process prints of an error that may quote its configuration.
    pub fn redact(&self, text: &str) -> String {
        let urls = [self.database.url.as_str(), self.broker.url.as_str()]
            .into_iter()
            .chain(self.agents.values().map(|a| a.url.as_str()));
        crate::tls::redact(text, urls)
    }

    /// `retry` of step `step` of `workflow`, if it sets one.
    pub fn step_retry(&self, workflow: &str, step: &str) -> Option<RetrySpec> {
        self.workflows.get(workflow)?.step_retry(step)
    }

    /// The compiled workflow of that name, if configured.
    pub fn workflow(&self, name: &str) -> Result<Workflow, WorkflowError> {
        let spec = self
            .workflows
            .get(name)
            .ok_or_else(|| WorkflowError::Unknown(name.to_owned()))?;
        Workflow::compile(name, spec)
    }

    /// Every agent name that a workflow step or compensation refers to, plus the configured agents.
    pub fn agent_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.agents.keys().cloned().collect();
        for wf in self.workflows.values() {
            for step in &wf.steps {
                names.extend(step.agent.clone());
                names.extend(step.compensate.clone());
            }
        }
        names.sort();
        names.dedup();
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_per_second_minute_or_hour() {
        assert_eq!(parse_rate("20/s"), Ok(20.0));
        assert_eq!(parse_rate("600/m"), Ok(10.0));
        assert_eq!(parse_rate(" 36 / h "), Ok(0.01));
        for bad in ["20", "x/s", "20/d", "0/s", "-1/s", "inf/s"] {
            assert!(parse_rate(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn defaults_are_valid() {
        Settings::default().validate().expect("defaults validate");
    }

    #[test]
    fn batch_and_admission_settings_refuse_zero() {
        for key in [
            "SAS__DATABASE__BATCH_SIZE",
            "SAS__DATABASE__BATCH_WORKERS",
            "SAS__SCHEDULER__MAX_IN_FLIGHT",
        ] {
            let env = [(key.to_owned(), "0".to_owned())].into_iter().collect();
            let err = Settings::load_with(None, Some(env)).expect_err(key);
            let name = key
                .trim_start_matches("SAS__")
                .replace("__", ".")
                .to_lowercase();
            assert!(err.to_string().contains(&name), "{key}: {err}");
        }
    }

    #[test]
    fn a_prefetch_below_twice_the_batch_is_advised_against_and_the_defaults_are_not() {
        assert!(Settings::default().advice().is_empty());
        let env = [("SAS__BROKER__PREFETCH".to_owned(), "300".to_owned())]
            .into_iter()
            .collect();
        let settings = Settings::load_with(None, Some(env)).expect("a working setting");
        let advice = settings.advice();
        assert_eq!(advice.len(), 1, "{advice:?}");
        assert!(advice[0].contains("broker.prefetch (300)"), "{advice:?}");
        assert!(
            advice[0].contains("database.batch_size (256)"),
            "{advice:?}"
        );
    }

    #[test]
    fn the_step_queues_are_quorum_or_classic() {
        assert_eq!(Settings::default().broker.step_queues, QueueType::Classic);
        let load = |v: &str| {
            let env = [("SAS__BROKER__STEP_QUEUES".to_owned(), v.to_owned())]
                .into_iter()
                .collect();
            Settings::load_with(None, Some(env))
        };
        let quorum = load("quorum").expect("quorum");
        assert_eq!(quorum.broker.step_queues, QueueType::Quorum);
        assert_eq!(quorum.broker.step_queues.as_str(), "quorum");
        let err = load("stream").expect_err("stream");
        assert!(err.to_string().contains("stream"), "{err}");
    }

    #[test]
    fn the_step_messages_are_transient_unless_told_persistent() {
        assert_eq!(
            Settings::default().broker.step_messages,
            Durability::Transient
        );
        let load = |v: &str| {
            let env = [("SAS__BROKER__STEP_MESSAGES".to_owned(), v.to_owned())]
                .into_iter()
                .collect();
            Settings::load_with(None, Some(env))
        };
        assert_eq!(
            load("persistent").expect("persistent").broker.step_messages,
            Durability::Persistent
        );
        let err = load("durable").expect_err("durable");
        assert!(err.to_string().contains("durable"), "{err}");
    }

    #[test]
    fn an_agent_follows_no_redirect_and_polls_at_most_once_a_second_unless_told() {
        let load = |pairs: &[(&str, &str)]| {
            let mut env: std::collections::HashMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (format!("SAS__AGENTS__X__{k}"), (*v).to_owned()))
                .collect();
            env.insert("SAS__AGENTS__X__URL".into(), "http://remote/x".into());
            Settings::load_with(None, Some(env))
        };
        let x = load(&[]).expect("defaults").agents["x"].clone();
        assert_eq!(x.follow_redirects, FollowRedirects::None);
        assert_eq!(x.min_poll, Duration::from_secs(1));
        let x = load(&[("FOLLOW_REDIRECTS", "same-origin"), ("MIN_POLL", "300ms")])
            .expect("set")
            .agents["x"]
            .clone();
        assert_eq!(x.follow_redirects, FollowRedirects::SameOrigin);
        assert_eq!(x.follow_redirects.as_str(), "same-origin");
        assert_eq!(x.min_poll, Duration::from_millis(300));
        for (pairs, says) in [
            (
                ("FOLLOW_REDIRECTS", "any"),
                "\"any\" is neither \"none\" nor \"same-origin\"",
            ),
            (("MIN_POLL", "0s"), "agents.x.min_poll"),
            (("MIN_POLL", "10ms"), "at least 100ms"),
        ] {
            let err = load(&[pairs]).expect_err(says).to_string();
            assert!(err.contains(says), "{err}");
            assert_eq!(err.lines().count(), 1, "{err}");
        }
    }

    #[test]
    fn database_settings_sas_cannot_use_are_refused_in_one_line() {
        let mut s = Settings::default();
        s.database.io_timeout = s.database.statement_timeout;
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("database.io_timeout"), "{e}");
        let mut s = Settings::default();
        s.database.url = "postgres://u:secret@a,b/x?target_session_attrs=standby".into();
        let e = s.validate().unwrap_err().to_string();
        assert!(
            e.contains("target_session_attrs=standby") && !e.contains("secret"),
            "{e}"
        );
        let mut s = Settings::default();
        s.database.url = "postgres://a:5432,b:5433/x?target_session_attrs=read-write".into();
        s.validate().expect("a host list validates");
    }

    #[test]
    fn tls_settings_that_would_fall_back_to_plaintext_are_refused() {
        let load = |pairs: &[(&str, &str)]| {
            let env = pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            Settings::load_with(None, Some(env))
        };
        let amqps = ("SAS__BROKER__URL", "amqps://u:secret@mq:5671/%2f");
        load(&[amqps, ("SAS__BROKER__CA_FILE", "/ca.pem")]).expect("amqps with a CA");
        load(&[
            amqps,
            ("SAS__BROKER__CLIENT_CERT", "/c.pem"),
            ("SAS__BROKER__CLIENT_KEY", "/c.key"),
        ])
        .expect("amqps with a client certificate");
        let refused = [
            (
                vec![("SAS__BROKER__CA_FILE", "/ca.pem")],
                "amqp:// is plaintext",
            ),
            (
                vec![amqps, ("SAS__BROKER__CLIENT_CERT", "/c.pem")],
                "go together",
            ),
            (
                vec![("SAS__BROKER__URL", "http://u:secret@mq/")],
                "amqp:// or amqps://",
            ),
            (
                vec![
                    (
                        "SAS__DATABASE__URL",
                        "postgres://u:secret@db/x?sslmode=require",
                    ),
                    ("SAS__DATABASE__CA_FILE", "/ca.pem"),
                ],
                "sslmode=require",
            ),
        ];
        for (pairs, expect) in refused {
            let err = load(&pairs).expect_err(expect).to_string();
            assert!(err.contains(expect), "{err}");
            assert!(!err.contains("secret"), "{err}");
        }
        load(&[
            ("SAS__DATABASE__URL", "postgres://db/x?sslmode=verify-ca"),
            ("SAS__DATABASE__CA_FILE", "/ca.pem"),
        ])
        .expect("verify-ca with a CA file");
        assert_eq!(
            query_param(
                "postgres://h/d?a=1&sslmode=prefer&sslmode=verify-full#x",
                "sslmode"
            )
            .as_deref(),
            Some("verify-full")
        );
    }

    #[test]
    fn redaction_covers_every_configured_url() {
        let mut s = Settings::default();
        s.database.url = "postgres://sas:db-pw@db/sas".into();
        s.broker.url = "amqps://sas:mq%2Fpw@mq/%2f".into();
        let text = "failed: db-pw, mq/pw, mq%2Fpw in amqps://sas:mq%2Fpw@mq/%2f";
        let shown = s.redact(text);
        for secret in ["db-pw", "mq/pw", "mq%2Fpw"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert!(shown.contains("amqps://sas:***@mq/%2f"), "{shown}");
    }

    #[test]
    fn the_deadline_ladder_must_be_ascending_fractions() {
        let mut s = Settings::default();
        assert_eq!(s.supervisor.warn_at, [0.5, 0.8]);
        assert!(s.validate().is_ok());
        for bad in [
            vec![0.8, 0.5],
            vec![0.5, 0.5],
            vec![0.0],
            vec![1.0],
            vec![f64::NAN],
        ] {
            s.supervisor.warn_at = bad;
            assert!(s.validate().is_err(), "{:?}", s.supervisor.warn_at);
        }
        s.supervisor.warn_at = Vec::new();
        assert!(s.validate().is_ok(), "no ladder");
    }

    #[test]
    fn retry_delay_repeats_the_last_entry() {
        let s = SupervisorSettings::default();
        assert_eq!(s.retry_delay(1), Duration::from_secs(60));
        assert_eq!(s.retry_delay(5), Duration::from_secs(3600));
        assert_eq!(s.retry_delay(9), Duration::from_secs(3600));
    }

    #[test]
    fn a_file_with_workflows_and_durations_loads() {
        let dir = std::env::temp_dir().join(format!("sas-config-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("sas.toml");
        std::fs::write(
            &path,
            r#"
[supervisor]
interval = "250ms"
max_failures = 3
retry_schedule = ["1s", "5s"]

[workflows.order]
steps = [
  { name = "reserve", agent = "inventory", timeout = "10s", compensate = "inventory-release" },
  { name = "ship", agent = "shipping" },
]

[agents.inventory]
url = "http://127.0.0.1:8081/inventory/reserve"
"#,
        )
        .unwrap();
        let s = Settings::load(Some(&path)).expect("loads");
        assert_eq!(s.supervisor.interval, Duration::from_millis(250));
        assert_eq!(s.supervisor.retry_schedule.len(), 2);
        let wf = s.workflow("order").unwrap();
        assert_eq!(wf.steps.len(), 2);
        assert_eq!(wf.steps[1].timeout, Duration::from_secs(30));
        assert_eq!(
            s.agent_names(),
            vec!["inventory", "inventory-release", "shipping"]
        );
        std::fs::remove_dir_all(dir).ok();
    }

    fn load_text(text: &str) -> Result<Settings, ConfigError> {
        let dir = std::env::temp_dir().join(format!("sas-config-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("sas.toml");
        std::fs::write(&path, text).unwrap();
        let s = Settings::load(Some(&path));
        std::fs::remove_dir_all(dir).ok();
        s
    }

    #[test]
    fn a_deployment_beyond_loopback_without_applications_is_told_so() {
        let with = |extra: &str| load_text(extra).expect("loads").unguarded_exposure();
        assert_eq!(with(""), None, "loopback by default");
        let open = with("[http]\nhost = \"0.0.0.0\"\n").expect("said");
        assert!(open.contains("HTTP port on 0.0.0.0"), "{open}");
        let broker = with("[broker]\nurl = \"amqp://sas:pw@mq.example:5672/%2f\"\n").expect("said");
        assert!(broker.contains("broker at mq.example"), "{broker}");
        assert!(!broker.contains("pw"), "{broker}");
        assert_eq!(with("[http]\nhost = \"::1\"\n"), None);
        assert_eq!(with("[http]\nhost = \"localhost\"\n"), None);
        let guarded = "[http]\nhost = \"0.0.0.0\"\n\n[applications.shop]\nuser = \"shop\"\nreply_to = [\"shop.*\"]\n";
        assert_eq!(with(guarded), None, "applications declared");
    }

    #[test]
    fn an_application_may_not_be_given_sas_own_broker_user() {
        let with = |user: &str| {
            load_text(&format!(
                "[broker]\nurl = \"amqp://sas:pw@mq.example:5672/%2f\"\n\n\
                 [applications.shop]\nuser = \"{user}\"\nreply_to = [\"shop.*\"]\n"
            ))
        };
        assert!(with("shop").is_ok());
        let refused = with("sas").expect_err("sas's own user");
        assert!(
            refused.to_string().contains("sas's own broker user"),
            "{refused}"
        );
    }

    #[test]
    fn conditions_and_inputs_load_as_written_and_a_bad_one_is_refused_in_one_line() {
        let s = load_text(
            r#"
[workflows.fulfil]
steps = [
  { name = "reserve", agent = "inventory" },
  { name = "charge", agent = "payments", when = "payload.total > 0",
    input = { orderTotal = "payload.total", Reservations = "results.reserve" } },
]
"#,
        )
        .expect("loads");
        let charge = &s.workflows["fulfil"].steps[1];
        assert_eq!(
            charge.when.as_ref().map(|w| w.source()),
            Some("payload.total > 0")
        );
        let keys: Vec<_> = charge
            .input
            .iter()
            .flatten()
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(keys, ["Reservations", "orderTotal"], "keys keep their case");
        let err = load_text(
            r#"
[workflows.fulfil]
steps = [{ name = "charge", agent = "payments", when = "payload.total >" }]
"#,
        )
        .expect_err("refused")
        .to_string();
        assert!(err.contains("does not compile"), "{err}");
        assert!(!err.contains('\n'), "one line: {err}");
    }

    #[test]
    fn environment_variables_override_with_lists_numbers_and_agent_urls() {
        let env: std::collections::HashMap<String, String> = [
            ("SAS__SUPERVISOR__RETRY_SCHEDULE", "1s, 5s,250ms"),
            ("SAS__BROKER__PREFIX", "123"),
            ("SAS__HTTP__PORT", "0"),
            ("SAS__DATABASE__URL", "postgres://u:p@db:5432/x"),
            ("SAS__AGENTS__PAYMENTS__URL", "http://pay:80/charge"),
            ("SAS__SUPERVISOR__MAX_FAILURES", "3"),
            ("SAS_CONFIG_UNRELATED", "ignored"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let s = Settings::load_with(None, Some(env)).expect("loads");
        assert_eq!(
            s.supervisor.retry_schedule,
            [
                Duration::from_secs(1),
                Duration::from_secs(5),
                Duration::from_millis(250)
            ]
        );
        assert_eq!(s.broker.prefix, "123");
        assert_eq!(s.http.port, Some(0));
        assert_eq!(s.database.url, "postgres://u:p@db:5432/x");
        assert_eq!(s.agents["payments"].url, "http://pay:80/charge");
        assert_eq!(s.supervisor.max_failures, 3);
    }

    #[test]
    fn a_bad_duration_is_a_clear_error() {
        let dir = std::env::temp_dir().join(format!("sas-config-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("sas.toml");
        std::fs::write(&path, "[supervisor]\ninterval = \"soon\"\n").unwrap();
        let err = Settings::load(Some(&path)).unwrap_err().to_string();
        assert!(err.contains("bad configuration"), "{err}");
        std::fs::remove_dir_all(dir).ok();
    }
}

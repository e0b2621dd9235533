//! The Agent: consumes `<prefix>.agent.<name>.requests` for each agent it
//! serves, calls the remote service, and answers on the request's reply queue,
//! acknowledging the request only once the answer is confirmed. It drops a
//! request whose complete-by has passed and stays silent when complete-by
//! passes mid-work: the supervisor takes over from there.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use sas::broker::{self, BrokerError, PublishError, Publisher, Received, SessionEnd};
use sas::config::{AgentSpec, FollowRedirects};
use sas::messages::{Direction, StepOutcome, StepReply, StepRequest};
use sas::metrics::labels;
use sas::service::Context;
use sas::trace::TraceContext;

use crate::deadline::Deadline;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::breaker::{Breaker, State};
use crate::remote::{self, CallEnd};
use crate::replies::Replies;
use crate::report;
use crate::shared::{self, Shared};
use sas::store_cell::StoreCell;

/// One served agent.
struct Agent {
    name: String,
    spec: AgentSpec,
    client: reqwest::Client,
    ctx: Arc<Context>,
    /// Cancelled when the shutdown grace period is over: in-flight calls stop and are handed back.
    hard_stop: CancellationToken,
    /// This instance's breaker; shared with the reporter that writes its state to Postgres.
    breaker: Arc<Breaker>,
    /// The breaker the agent's instances share.
    shared: Arc<Shared>,
}

/// Runs the agents named in `only` (every configured agent when empty) until shutdown.
pub async fn run(ctx: Arc<Context>, only: Vec<String>) -> anyhow::Result<()> {
    let names: Vec<String> = if only.is_empty() {
        ctx.settings.agents.keys().cloned().collect()
    } else {
        only
    };
    if names.is_empty() {
        bail!("no agents to serve: configure [agents.<name>] with a url");
    }
    // One client (one connection pool) per redirect policy the agents use:
    // the policy is the client's, and most deployments need only one.
    let mut clients: HashMap<FollowRedirects, reqwest::Client> = HashMap::new();
    let hard_stop = CancellationToken::new();
    let instance = report::instance_name();
    let store = ctx.connecting.clone();
    let mut agents = Vec::new();
    for name in &names {
        let spec = ctx.settings.agents.get(name).with_context(|| {
            format!("agent {name:?} is not configured (no [agents.{name}] url)")
        })?;
        let client = match clients.entry(spec.follow_redirects) {
            Entry::Occupied(built) => built.get().clone(),
            Entry::Vacant(slot) => slot
                .insert(http_client(&ctx.settings.agent, spec.follow_redirects)?)
                .clone(),
        };
        agents.push(Arc::new(Agent {
            name: name.clone(),
            spec: spec.clone(),
            client,
            ctx: ctx.clone(),
            hard_stop: hard_stop.clone(),
            breaker: Arc::new(Breaker::new(
                ctx.settings.agent.breaker_threshold,
                ctx.settings.agent.breaker_cooldown,
            )),
            shared: Arc::new(Shared::new(
                name,
                &instance,
                store.clone(),
                spec.breaker_policy(&ctx.settings.agent),
            )),
        }));
    }
    tracing::info!(agents = ?names, "serving");
    let reported = agents
        .iter()
        .map(|a| report::Reported {
            agent: a.name.clone(),
            // Shown on the dashboard: never with a password.
            endpoint: sas::tls::redact_url(&a.spec.url),
            breaker: a.breaker.clone(),
        })
        .collect();
    let shared = agents.iter().map(|a| a.shared.clone()).collect();
    let mut reporter = tokio::spawn(keep_breakers(
        instance,
        reported,
        shared,
        store,
        ctx.shutdown.clone(),
    ));
    let grace = ctx.settings.shutdown.grace;
    let grace_timer = {
        let (shutdown, hard_stop) = (ctx.shutdown.clone(), hard_stop.clone());
        tokio::spawn(async move {
            shutdown.cancelled().await;
            tokio::time::sleep(grace).await;
            hard_stop.cancel();
        })
    };
    // Owns what it uses (see `Context::run_sessions`).
    let owned = ctx.clone();
    let sessions = ctx
        .run_sessions(&names, async move |broker| {
            let (ctx, agents) = (&owned, &agents);
            let publisher = broker.publisher().await?;
            let replies = Replies::start(
                publisher.clone(),
                ctx.settings.broker.step_messages,
                ctx.metrics.clone(),
            );
            // One loop per agent, all on this session's connection; the first
            // to lose the broker stops the others.
            let lost = CancellationToken::new();
            let loops = agents.iter().map(|agent| async {
                let end = agent
                    .serve(broker, &publisher, &replies, &lost, grace)
                    .await;
                if end.is_err() {
                    lost.cancel();
                }
                end
            });
            let ends = futures_util::future::join_all(loops).await;
            ends.into_iter()
                .find(Result::is_err)
                .unwrap_or(Ok(SessionEnd::Shutdown))
        })
        .await;
    grace_timer.abort();
    if ctx.shutdown.is_cancelled() {
        // Let it delete this instance's rows; not long: Postgres may be gone.
        tokio::time::timeout(std::time::Duration::from_secs(2), &mut reporter)
            .await
            .ok();
    }
    reporter.abort();
    sessions.context("RabbitMQ")?;
    Ok(())
}

/// Once the service has reached Postgres (off the requests' path),
/// reports this instance's breakers and keeps the shared ones in sync
/// until `shutdown`.
async fn keep_breakers(
    instance: String,
    reported: Vec<report::Reported>,
    shared: Vec<Arc<Shared>>,
    cell: Arc<StoreCell>,
    shutdown: CancellationToken,
) {
    let store = tokio::select! {
        () = shutdown.cancelled() => return,
        store = cell.wait(Duration::MAX) => store,
    };
    let Some(store) = store else {
        return;
    };
    tokio::join!(
        report::run(&store, &instance, &reported, &shutdown),
        shared::run(&store, &shared, &shutdown),
    );
}

/// How long a request delivered again waits for this instance's first
/// connection to the state store, whose clock it is judged by.
const STORE_WAIT: Duration = Duration::from_secs(3);

impl Agent {
    /// The state store's clock, read for a request delivered again (whose
    /// wait since its dispatch is unknown: its `complete_by` must be
    /// compared with the store's clock, not this host's, which may be
    /// off by minutes, §6a); `None` when not needed or not readable.
    async fn store_now(&self, redelivered: bool) -> Option<chrono::DateTime<chrono::Utc>> {
        if !redelivered {
            return None;
        }
        // A request handed back by an agent that died comes again at once
        // to one just started, whose connection to Postgres may be on its
        // way: wait for it a little rather than judge by this host's clock.
        let store = self.shared.wait_for_store(STORE_WAIT).await?;
        // Boxed: see `Shared::lets_through`.
        match Box::pin(store.clock()).await {
            Ok(now) => Some(now),
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the state store's clock; using this host's");
                None
            }
        }
    }

    /// Consumes this agent's requests until shutdown, pausing the consumer
    /// while the breaker is open and probing with one request when it half-opens.
    async fn serve(
        self: &Arc<Self>,
        broker: &sas::broker::Broker,
        publisher: &Publisher,
        replies: &Replies,
        lost: &CancellationToken,
        grace: std::time::Duration,
    ) -> Result<SessionEnd, BrokerError> {
        let queue = self.ctx.queues.agent_requests(&self.name);
        loop {
            let state = tokio::select! {
                () = self.ctx.shutdown.cancelled() => return Ok(SessionEnd::Shutdown),
                () = lost.cancelled() => return Ok(SessionEnd::Shutdown),
                state = self.breaker.wait_until_usable() => state,
            };
            self.show_breaker(state);
            let prefetch = if state == State::HalfOpen {
                tracing::info!(agent = %self.name, "circuit half-open: probing with one request");
                1
            } else {
                self.ctx.settings.agent.concurrency
            };
            // Stop taking requests on shutdown, or when the breaker changes.
            let stop = self.ctx.shutdown.child_token();
            let change = self.breaker.change_token();
            let relay_stop = stop.clone();
            let watcher = tokio::spawn(async move {
                change.cancelled().await;
                relay_stop.cancel();
            });
            let tag = format!("agent-{}", self.name);
            let subscription = self
                .ctx
                .subscribe(broker, publisher, &queue, prefetch, &tag)
                .await?;
            // In-flight calls stop on their own at the hard stop, so the loop's grace can be longer.
            let end = broker::consume(subscription, &stop, lost, grace * 2, |delivery| {
                let (agent, replies) = (self.clone(), replies.clone());
                async move { agent.handle(&replies, delivery).await }
            })
            .await;
            watcher.abort();
            end?;
            if self.ctx.shutdown.is_cancelled() {
                return Ok(SessionEnd::Shutdown);
            }
            let state = self.breaker.state();
            if state == State::Open {
                tracing::warn!(agent = %self.name, "circuit open: stopped consuming");
            }
            self.show_breaker(state);
        }
    }

    /// Publishes the breaker state to `/metrics` and `/readyz`.
    fn show_breaker(&self, state: State) {
        self.ctx
            .metrics
            .agent_breaker_state
            .get_or_create(&labels(&[("agent", &self.name)]))
            .set(state.gauge());
        self.ctx.health.set_detail(
            &format!("breaker.{}", self.name),
            serde_json::Value::String(state.as_str().into()),
        );
    }

    /// Works on one request; an error means the broker is gone.
    async fn handle(&self, replies: &Replies, delivery: Received) -> Result<(), BrokerError> {
        // The step's time left counts from here (§6a).
        let arrived = tokio::time::Instant::now();
        sas::crash::panic_if_marked(delivery.body());
        let request: StepRequest = match serde_json::from_slice(delivery.body()) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(agent = %self.name, error = %e, "unreadable request; dead-lettered");
                self.count("malformed");
                let reason = format!(
                    "unreadable request: {}",
                    sas::messages::Quoted::new(&e.to_string())
                );
                return broker::dead_letter_with(&delivery, &reason).await;
            }
        };
        // Answers go to the schedulers' reply queue, or to a queue outside
        // sas's own names (a test's, an operator's): never into another of
        // sas's queues (contract §1b), and the remote is not called for a
        // request whose answer would go there.
        if let Some(queue) = delivery
            .reply_to()
            .filter(|q| self.ctx.queues.is_reserved(q) && *q != self.ctx.queues.replies())
        {
            tracing::warn!(agent = %self.name, reply_to = %sas::messages::Quoted::new(queue), "request answering into a queue of sas; dead-lettered");
            self.count("malformed");
            let reason = sas::messages::RejectReason::ReservedQueue {
                field: "the AMQP reply_to property",
                queue: sas::messages::Quoted::new(queue),
            };
            return broker::dead_letter_with(&delivery, &reason.to_string()).await;
        }
        let trace = delivery
            .header(sas::trace::HEADER)
            .and_then(|t| sas::trace::TraceContext::parse(&t));
        let span = tracing::info_span!(
            "step",
            order_id = %request.order_id,
            step = %request.step,
            attempt = request.attempt,
            agent = %self.name,
            trace_id = %trace.as_ref().map_or("", |t| t.trace_id.as_str()),
        );
        if let Some(parent) = &trace {
            sas::telemetry::continue_trace(&span, parent);
        }
        let started = std::time::Instant::now();
        let outcome = self
            .work(replies, &delivery, &request, arrived, trace.as_ref())
            .instrument(span)
            .await?;
        self.count(outcome);
        self.ctx
            .metrics
            .agent_step_duration_seconds
            .get_or_create(&labels(&[("agent", &self.name), ("outcome", outcome)]))
            .observe(started.elapsed().as_secs_f64());
        Ok(())
    }

    async fn work(
        &self,
        replies: &Replies,
        delivery: &Received,
        request: &StepRequest,
        arrived: tokio::time::Instant,
        trace: Option<&TraceContext>,
    ) -> Result<&'static str, BrokerError> {
        tracing::debug!(complete_by = %request.complete_by, "request taken");
        let deadline = Deadline::of(
            request,
            arrived,
            delivery.redelivered(),
            self.store_now(delivery.redelivered()).await,
        );
        if deadline.remaining().is_none() {
            tracing::info!("complete-by already passed; request dropped");
            broker::ack(delivery).await?;
            return Ok("expired");
        }
        // Each heartbeat of a long-running operation goes to the schedulers,
        // which store the step's new complete-by, while the call goes on.
        let (beats, mut beating) = tokio::sync::mpsc::unbounded_channel();
        let tell = async {
            while let Some((complete_by, location)) = beating.recv().await {
                let Some(reply_to) = delivery.reply_to() else {
                    continue;
                };
                let outcome = StepOutcome::Accepted {
                    complete_by,
                    location,
                };
                if let Err(e) = answer(replies, reply_to, request, trace, outcome).await {
                    tracing::warn!(error = %e, "heartbeat not delivered");
                }
            }
        };
        let end = if self.shared.lets_through(request.order_id).await {
            // The channel closes when the call ends, and so does `tell`.
            tokio::join!(self.call(request, deadline, trace, beats), tell).0
        } else {
            // Not sent now; but a request that comes again may have been
            // sent by the agent that had it before.
            CallEnd::Held {
                tried: delivery.redelivered(),
            }
        };
        let outcome = match end {
            CallEnd::Answer(outcome) => outcome,
            CallEnd::Held { tried } => {
                tracing::info!(tried, "shared breaker open: not sent; the order is held");
                StepOutcome::Held { tried }
            }
            CallEnd::Expired => {
                tracing::info!("complete-by passed; staying silent");
                broker::ack(delivery).await?;
                return Ok("expired");
            }
            CallEnd::Interrupted => {
                tracing::info!("shutting down or circuit open; request handed back");
                broker::requeue(delivery).await?;
                return Ok("handed_back");
            }
        };
        let Some(reply_to) = delivery.reply_to() else {
            tracing::warn!("request has no reply queue; nobody to answer");
            broker::ack(delivery).await?;
            return Ok("no_reply_to");
        };
        sas::crash::point("agent.after_call");
        let label = match outcome {
            StepOutcome::Succeeded { .. } => "succeeded",
            StepOutcome::Failed { .. } => "failed",
            StepOutcome::Held { .. } => "held",
            StepOutcome::Accepted { .. } => "accepted",
        };
        match answer(replies, reply_to, request, trace, outcome).await {
            Ok(()) => {}
            // No such reply queue (or no name it could have): nobody to
            // answer; the supervisor re-dispatches once complete-by passes.
            Err(e @ (PublishError::Unroutable(_) | PublishError::Invalid(_))) => {
                tracing::warn!(error = %e, "reply not delivered");
                broker::ack(delivery).await?;
                return Ok("no_reply_to");
            }
            Err(e) => return Err(e.into()),
        }
        tracing::debug!(outcome = label, "answered");
        broker::ack(delivery).await?;
        Ok(label)
    }

    /// Calls the remote for `request`, counting each attempt on both
    /// breakers; `heartbeat` tells of each `202` of a long-running operation.
    async fn call(
        &self,
        request: &StepRequest,
        deadline: Deadline,
        trace: Option<&TraceContext>,
        heartbeats: remote::Heartbeats,
    ) -> CallEnd {
        let endpoint = remote::Endpoint {
            client: &self.client,
            spec: &self.spec,
            stop: &self.hard_stop,
            breaker: &self.breaker,
            shared: &self.shared,
        };
        // The step's own retry (§4b), as the order's definition says
        // (§4d); its undo retries as the agent does.
        let own = match request.direction {
            Direction::Forward => request.retry.or_else(|| {
                self.ctx
                    .settings
                    .step_retry(&request.workflow, &request.step)
            }),
            Direction::Compensate => None,
        };
        let retry = remote::Retry::of(own, &self.ctx.settings.agent);
        remote::call(&endpoint, request, deadline, retry, trace, |outcome| {
            self.ctx
                .metrics
                .agent_calls
                .get_or_create(&labels(&[("agent", &self.name), ("outcome", outcome)]))
                .inc();
            // Counted here too: when only this instance cannot reach the
            // remote, its own breaker sends the requests to the others.
            let changed = match outcome {
                "transient" => self.breaker.failed(),
                _ => self.breaker.succeeded(),
            };
            if let Some(state) = changed {
                tracing::warn!(agent = %self.name, state = state.as_str(), "circuit breaker changed");
                self.show_breaker(state);
            }
        }, heartbeats)
        .await
    }

    fn count(&self, outcome: &str) {
        self.ctx
            .metrics
            .agent_requests
            .get_or_create(&labels(&[("agent", &self.name), ("outcome", outcome)]))
            .inc();
    }
}

/// Sends the scheduler `outcome` for `request` on `reply_to`, continuing
/// the request's trace.
async fn answer(
    replies: &Replies,
    reply_to: &str,
    request: &StepRequest,
    trace: Option<&TraceContext>,
    outcome: StepOutcome,
) -> Result<(), PublishError> {
    let mut reply = StepReply::to(request, outcome);
    // Sent from within the step's span: the reply continues it.
    reply.traceparent = trace
        .map(|t| sas::telemetry::hop(&tracing::Span::current(), Some(&t.trace_id)).to_string());
    replies.send(reply_to, reply).await
}

/// The agents' HTTP client: `https://` remotes verified against the system's
/// roots plus `agent.ca_file`; redirects followed as `follow` says (§1b).
fn http_client(
    settings: &sas::config::AgentSettings,
    follow: FollowRedirects,
) -> anyhow::Result<reqwest::Client> {
    sas::tls::install_crypto_provider();
    let mut builder = reqwest::Client::builder()
        .connect_timeout(settings.connect_timeout)
        .redirect(remote::redirect_policy(follow));
    if let Some(path) = &settings.ca_file {
        let pem = sas::tls::read_pem("agent.ca_file", path, "CERTIFICATE")?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .with_context(|| format!("agent.ca_file {}", path.display()))?;
        builder = builder.tls_certs_merge(certs);
    }
    builder.build().context("HTTP client")
}

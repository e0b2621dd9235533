//! The Agent: consumes `<prefix>.agent.<name>.requests` for each agent it
//! serves, calls the remote service, and answers on the request's reply queue,
//! acknowledging the request only once the answer is confirmed. It drops a
//! request whose complete-by has passed and stays silent when complete-by
//! passes mid-work: the supervisor takes over from there.

use std::sync::Arc;

use anyhow::{Context as _, bail};
use chrono::Utc;
use sas::broker::{self, BrokerError, Delivery, Outgoing, Publisher, SessionEnd};
use sas::config::AgentSpec;
use sas::messages::{StepReply, StepRequest};
use sas::metrics::labels;
use sas::service::Context;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::remote::{self, CallEnd};

/// One served agent.
struct Agent {
    name: String,
    spec: AgentSpec,
    client: reqwest::Client,
    ctx: Arc<Context>,
    /// Cancelled when the shutdown grace period is over: in-flight calls stop and are handed back.
    hard_stop: CancellationToken,
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
    let client = reqwest::Client::builder()
        .connect_timeout(ctx.settings.agent.connect_timeout)
        .build()
        .context("HTTP client")?;
    let hard_stop = CancellationToken::new();
    let mut agents = Vec::new();
    for name in &names {
        let spec = ctx.settings.agents.get(name).with_context(|| {
            format!("agent {name:?} is not configured (no [agents.{name}] url)")
        })?;
        agents.push(Arc::new(Agent {
            name: name.clone(),
            spec: spec.clone(),
            client: client.clone(),
            ctx: ctx.clone(),
            hard_stop: hard_stop.clone(),
        }));
    }
    tracing::info!(agents = ?names, "serving");
    let grace = ctx.settings.shutdown.grace;
    let grace_timer = {
        let (shutdown, hard_stop) = (ctx.shutdown.clone(), hard_stop.clone());
        tokio::spawn(async move {
            shutdown.cancelled().await;
            tokio::time::sleep(grace).await;
            hard_stop.cancel();
        })
    };
    broker::run_sessions(
        &ctx.settings.broker,
        ctx.name,
        &ctx.shutdown,
        &ctx.health,
        async |broker| {
            broker
                .declare_topology(&ctx.queues, &names, ctx.settings.broker.delivery_limit)
                .await?;
            let publisher = broker.publisher().await?;
            let lost = CancellationToken::new();
            let mut consumers = JoinSet::new();
            for agent in &agents {
                let consumer = broker
                    .consume(
                        &ctx.queues.agent_requests(&agent.name),
                        ctx.settings.agent.concurrency,
                        &format!("agent-{}", agent.name),
                    )
                    .await?;
                let (agent, publisher, shutdown, lost) = (
                    agent.clone(),
                    publisher.clone(),
                    ctx.shutdown.clone(),
                    lost.clone(),
                );
                consumers.spawn(async move {
                    // In-flight calls stop on their own at the hard stop, so the loop's grace can be longer.
                    let end = broker::consume(consumer, &shutdown, &lost, grace * 2, |delivery| {
                        let (agent, publisher) = (agent.clone(), publisher.clone());
                        async move { agent.handle(&publisher, delivery).await }
                    })
                    .await;
                    if end.is_err() {
                        lost.cancel();
                    }
                    end
                });
            }
            let mut outcome = Ok(SessionEnd::Shutdown);
            while let Some(done) = consumers.join_next().await {
                if let Ok(Err(e)) = done {
                    outcome = Err(e);
                }
            }
            outcome
        },
    )
    .await
    .context("RabbitMQ")?;
    grace_timer.abort();
    Ok(())
}

impl Agent {
    /// Works on one request; an error means the broker is gone.
    async fn handle(&self, publisher: &Publisher, delivery: Delivery) -> Result<(), BrokerError> {
        let request: StepRequest = match serde_json::from_slice(&delivery.data) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(agent = %self.name, error = %e, "unreadable request; dead-lettered");
                self.count("malformed");
                return broker::dead_letter(&delivery).await;
            }
        };
        let span = tracing::info_span!(
            "step",
            order_id = %request.order_id,
            step = %request.step,
            attempt = request.attempt,
            agent = %self.name,
        );
        self.work(publisher, &delivery, &request)
            .instrument(span)
            .await
    }

    async fn work(
        &self,
        publisher: &Publisher,
        delivery: &Delivery,
        request: &StepRequest,
    ) -> Result<(), BrokerError> {
        if request.complete_by <= Utc::now() {
            tracing::info!("complete-by already passed; request dropped");
            self.count("expired");
            return broker::ack(delivery).await;
        }
        let end = remote::call(
            &self.client,
            &self.spec,
            &self.ctx.settings.agent,
            request,
            &self.hard_stop,
            |outcome| {
                self.ctx
                    .metrics
                    .agent_calls
                    .get_or_create(&labels(&[("agent", &self.name), ("outcome", outcome)]))
                    .inc();
            },
        )
        .await;
        let outcome = match end {
            CallEnd::Answer(outcome) => outcome,
            CallEnd::Expired => {
                tracing::info!("complete-by passed; staying silent");
                self.count("expired");
                return broker::ack(delivery).await;
            }
            CallEnd::Interrupted => {
                tracing::info!("shutting down; request handed back");
                self.count("handed_back");
                return broker::requeue(delivery).await;
            }
        };
        let Some(reply_to) = broker::reply_to(delivery) else {
            tracing::warn!("request has no reply queue; nobody to answer");
            self.count("no_reply_to");
            return broker::ack(delivery).await;
        };
        let reply = StepReply::to(request, outcome);
        let label = match reply.outcome {
            sas::messages::StepOutcome::Succeeded { .. } => "succeeded",
            sas::messages::StepOutcome::Failed { .. } => "failed",
        };
        let body = serde_json::to_vec(&reply).unwrap_or_default();
        let correlation = request.dispatch_id.to_string();
        publisher
            .publish(&Outgoing {
                routing_key: reply_to,
                body: &body,
                correlation_id: Some(&correlation),
                mandatory: true,
                ..Outgoing::default()
            })
            .await?;
        self.count(label);
        broker::ack(delivery).await
    }

    fn count(&self, outcome: &str) {
        self.ctx
            .metrics
            .agent_requests
            .get_or_create(&labels(&[("agent", &self.name), ("outcome", outcome)]))
            .inc();
    }
}

//! The submission: `<prefix>.orders` → validate → one transaction (order,
//! steps, `received` event, outbox) → ack. Bad messages are copied to
//! `<prefix>.orders.dead` with the reason in `x-sas-reason`, answered with
//! `rejected` where a reply queue is known, and only then acknowledged.
//! The service's session ([`crate::session`]) serves it beside the other
//! queues.

use std::sync::Arc;

use chrono::Utc;
use sas::applications::Application;
use sas::broker::{self, BrokerError, Outgoing, Publisher, Received, Verdict};
use sas::engine::{Actor, Submitted};
use sas::messages::{
    Quoted, RejectReason, RejectedHints, Submission, decode_submission, rejected_event,
};
use sas::metrics::labels;
use sas::pipeline::Pipeline;
use sas::service::Context;
use sas::state_store::{NewOrder, StoreError};
use sas::trace::TraceContext;
use sas::workflow::Workflow;
use tracing::Instrument;
use uuid::Uuid;

/// An order to store, and what became of it.
type Batcher = sas::batch::Batcher<(NewOrder, Workflow), Result<Submitted, Arc<StoreError>>>;

/// Stores orders in batches: those that arrive while a transaction commits
/// share the next one (and its single wake-up of the schedulers).
/// With `starter` (an instance, the orders held deployment-wide below
/// which it starts new ones, and the step requests a batch's starts may
/// send at most), the orders whose first steps may go now start
/// in the same transaction ([`sas::engine::Transitions::submit_and_start`]).
fn store_in_batches(
    pipeline: Pipeline,
    db: &sas::config::DatabaseSettings,
    starter: Option<(Actor, u32, u32)>,
) -> Batcher {
    let pipeline = Arc::new(pipeline);
    let starter = Arc::new(starter);
    sas::batch::Batcher::start(db.batch_workers, db.batch_size, move |items| {
        let (pipeline, starter) = (pipeline.clone(), starter.clone());
        async move {
            let refs: Vec<(&NewOrder, &Workflow)> = items.iter().map(|(o, w)| (o, w)).collect();
            sas::batch::isolating(&refs, StoreError::is_refusal_of_input, |some| async {
                match starter.as_ref() {
                    Some((me, room, requests)) => {
                        pipeline.submit_and_start(me, *room, *requests, some).await
                    }
                    None => pipeline.submit_many(some).await,
                }
            })
            .await
        }
    })
}

/// Where accepted orders go, whichever way they came in (the orders queue
/// or `POST /v1/orders`): the same checks, the same id mapping of an
/// application (contract §1b), the same batched store transaction and the
/// same relay, so that an order sent both ways with one id is one order.
pub struct Intake {
    batcher: Batcher,
    pipeline: Pipeline,
    /// This instance: it heartbeats as the holder of the orders it starts.
    actor: Actor,
    /// The configured workflows, compiled.
    workflows: std::collections::HashMap<String, Workflow>,
    ctx: Arc<Context>,
}

/// An order that passed the checks, ready to be stored.
pub struct Accepted<'a> {
    /// The order as decoded.
    pub order: Submission,
    /// Its workflow, as configured now.
    pub workflow: Workflow,
    /// The id its sender gave it (or the one generated for it): the id its
    /// status events and the HTTP API say.
    pub given: Uuid,
    /// Its application, when applications are configured.
    pub sender: Option<&'a Application>,
    /// The sender's trace context (`traceparent`), if it sent one.
    pub sent: Option<TraceContext>,
}

impl Intake {
    /// The pipeline orders are stored through, whose relay publishes what
    /// the service's other transitions (signals, cancels, children's undo)
    /// commit too, at once.
    pub fn pipeline(&self) -> &Pipeline {
        &self.pipeline
    }

    /// The intake of the service of `ctx`; its relay starts with each broker
    /// session ([`crate::session::run`]).
    pub fn new(ctx: Arc<Context>) -> anyhow::Result<Arc<Self>> {
        let store = ctx.store()?.clone();
        // The holder of the orders it starts, beating as it runs
        // (`crate::session::run`): the requests it sends stay handed to it.
        let actor = Actor::new_instance("submission");
        let pipeline = Pipeline::new(&ctx, store).publishing_as(&actor.name);
        // Compiled once: each order takes its workflow (and the id of its
        // definition, a hash) from here.
        let workflows = ctx
            .settings
            .workflows
            .keys()
            .map(|name| Ok((name.clone(), ctx.settings.workflow(name)?)))
            .collect::<anyhow::Result<_>>()?;
        // While the orders held number fewer than one scheduler may hold:
        // past that the schedulers' claims, bounded and by priority, decide.
        // Bounded in step requests as a scheduler's claim is.
        let room = ctx.settings.scheduler.max_in_flight;
        let requests = ctx.settings.scheduler.claim_messages;
        let starter = ctx
            .settings
            .submission
            .start_orders
            .then(|| (actor.clone(), room, requests));
        Ok(Arc::new(Self {
            batcher: store_in_batches(pipeline.clone(), &ctx.settings.database, starter),
            pipeline,
            actor,
            workflows,
            ctx,
        }))
    }

    /// This instance, as the holder of the orders it starts.
    pub fn actor(&self) -> &Actor {
        &self.actor
    }

    /// The configured workflow `name`, compiled.
    pub fn workflow(&self, name: &str) -> Option<Workflow> {
        self.workflows.get(name).cloned()
    }

    /// Counts an order refused, whichever way it came in.
    pub fn count_rejected(&self, reason: &RejectReason) {
        self.ctx
            .metrics
            .orders_rejected
            .get_or_create(&labels(&[("reason", reason.label())]))
            .inc();
    }

    /// Decodes and checks a body (contract §1, §1b): `reply_to_property` is
    /// the AMQP `reply_to` (none over HTTP), `sender` the application that
    /// sent it. On refusal, why, and what can be told to the sender.
    pub fn accept(
        &self,
        body: &[u8],
        reply_to_property: Option<&str>,
        sender: Option<&Application>,
    ) -> Result<(Submission, Workflow), (RejectReason, RejectedHints)> {
        let settings = &self.ctx.settings;
        let s = decode_submission(
            body,
            reply_to_property,
            settings.submission.max_body_bytes,
            &self.ctx.queues,
        )?;
        let hints = || RejectedHints {
            order_id: s
                .order_id
                .map(|id| serde_json::Value::String(id.to_string())),
            reply_to: s.reply_to.clone(),
        };
        if let (Some(app), Some(queue)) = (sender, &s.reply_to)
            && !app.may_reply_to(queue)
        {
            let reason = RejectReason::NotTheApplicationsQueue {
                field: "reply_to",
                queue: Quoted::new(queue),
                application: Quoted::new(&app.name),
            };
            return Err((reason, hints()));
        }
        match self.workflows.get(&s.workflow) {
            Some(wf) => Ok((s, wf.clone())),
            None => {
                let reason = RejectReason::UnknownWorkflow(Quoted::new(&s.workflow));
                Err((reason, hints()))
            }
        }
    }

    /// Stores an accepted order, in its application's namespace (contract
    /// §1b), within a span that continues the sender's trace; what became
    /// of it, and the span, for the caller to go on in.
    pub async fn submit(
        &self,
        accepted: Accepted<'_>,
    ) -> (Result<Submitted, Arc<StoreError>>, tracing::Span) {
        let Accepted {
            order,
            workflow,
            given,
            sender,
            sent,
        } = accepted;
        // An application's ids are its own: stored in its namespace.
        let order_id = sender.map_or(given, |app| app.order_id(given));
        // Continue the application's trace when it sent one; this span is
        // the order's root in sas (its transitions' spans nest under it).
        let span = tracing::info_span!(
            "submit",
            %order_id,
            workflow = %workflow.name,
            trace_id = tracing::field::Empty,
        );
        if let Some(sent) = &sent {
            sas::telemetry::continue_trace(&span, sent);
        }
        let trace = sas::telemetry::hop(&span, sent.as_ref().map(|t| t.trace_id.as_str()));
        span.record("trace_id", trace.trace_id.as_str());
        let new = NewOrder {
            order_id,
            workflow: workflow.name.clone(),
            payload: serde_json::Value::Object(order.payload),
            reply_to: order.reply_to,
            priority: i16::from(order.priority.get()),
            not_before: order.not_before,
            trace_id: Some(trace.trace_id.clone()),
            trace_span: Some(trace.span_id.clone()),
            events: order.events,
            application: sender.map(|app| app.name.clone()),
            app_order_id: sender.map(|_| given),
        };
        let stored = self
            .batcher
            .call((new, workflow))
            .instrument(span.clone())
            .await
            .unwrap_or_else(|| Err(Arc::new(StoreError::NoOutcome)));
        span.in_scope(|| match &stored {
            Ok(Submitted::Created { started }) => {
                tracing::debug!(started, "order stored");
                self.ctx.metrics.orders_received.inc();
                if *started {
                    self.ctx.metrics.orders_claimed.inc();
                }
            }
            Ok(Submitted::Duplicate) => {
                tracing::info!("order already exists; nothing to do");
                self.ctx.metrics.orders_duplicate.inc();
            }
            Err(_) => {}
        });
        (stored, span)
    }
}

/// The submission's work, shared by its message handlers.
pub struct Submitter {
    pub intake: Arc<Intake>,
    pub ctx: Arc<Context>,
}

impl Submitter {
    /// Handles one delivery; an error means the broker is gone.
    pub async fn handle(
        &self,
        publisher: &Publisher,
        delivery: Received,
    ) -> Result<(), BrokerError> {
        sas::crash::panic_if_marked(delivery.body());
        // Who sent it (contract §1b): with applications configured, only
        // one of them, and its events only to its own queues.
        let sender = match self
            .ctx
            .applications
            .identify_sender(delivery.user_id(), delivery.carried_sender().as_deref())
        {
            Ok(sender) => sender,
            Err(unknown) => {
                let reason = RejectReason::UnknownApplication(unknown);
                return self
                    .reject(
                        publisher,
                        &delivery,
                        &reason,
                        &RejectedHints::default(),
                        None,
                    )
                    .await;
            }
        };
        let decoded = self
            .intake
            .accept(delivery.body(), delivery.reply_to(), sender);
        let (order, workflow) = match decoded {
            Ok(ok) => ok,
            Err((reason, hints)) => {
                return self
                    .reject(publisher, &delivery, &reason, &hints, sender)
                    .await;
            }
        };
        let given = given_id(order.order_id, delivery.message_id());
        let sent = delivery
            .header(sas::trace::HEADER)
            .and_then(|t| TraceContext::parse(&t));
        let new_reply_to = order.reply_to.clone();
        let accepted = Accepted {
            order,
            workflow,
            given,
            sender,
            sent,
        };
        let (stored, span) = self.intake.submit(accepted).await;
        async {
            match stored {
                Ok(Submitted::Created { .. }) => {
                    sas::crash::point("submission.after_commit");
                    // Its `received` event went to the relay with the commit.
                    broker::ack(&delivery).await?;
                }
                Ok(Submitted::Duplicate) => broker::ack(&delivery).await?,
                Err(e) if e.is_refusal_of_input() => {
                    // Postgres refused this order's values (it was tried
                    // alone): it will never be stored.
                    let reason = RejectReason::Internal(Quoted::new(&format!(
                        "the state store refused the order: {e}"
                    )));
                    let hints = RejectedHints {
                        order_id: Some(serde_json::Value::String(given.to_string())),
                        reply_to: new_reply_to,
                    };
                    self.reject(publisher, &delivery, &reason, &hints, sender)
                        .await?;
                }
                Err(e) => {
                    // Postgres away (a restart costs a delay, not an
                    // order), or a failure that may be this order's own.
                    tracing::warn!(error = %e, transient = e.is_transient(), "could not store the order");
                    Verdict::failed(e.is_transient(), || format!("could not store the order: {e}"))
                        .settle(&delivery)
                        .await?;
                }
            }
            Ok(())
        }
        .instrument(span)
        .await
    }

    /// Copies the message to the dead-letter queue with the reason, tells the
    /// sender (`sender`, with applications configured: only on one of its
    /// own queues), then acknowledges the original.
    async fn reject(
        &self,
        publisher: &Publisher,
        delivery: &Received,
        reason: &RejectReason,
        hints: &RejectedHints,
        sender: Option<&Application>,
    ) -> Result<(), BrokerError> {
        let text = reason.to_string();
        tracing::warn!(reason = %text, reply_to = ?hints.reply_to, "order rejected; dead-lettered");
        // A body over the limit goes to the dead-letter queue through the
        // broker (header x-death), not as a copy with the reason: a copy
        // would hold it twice (contract §1b). Its reason is in the log,
        // the counter and the `rejected` event.
        let copied = !matches!(reason, RejectReason::TooLarge { .. });
        if copied {
            let why = (broker::REASON_HEADER, broker::Header::Text(&text));
            publisher
                .republish(self.ctx.queues.orders_dead(), delivery, &[why])
                .await?;
        }
        let told = hints.reply_to.as_ref().filter(|q| {
            !self.ctx.applications.configured() || sender.is_some_and(|app| app.may_reply_to(q))
        });
        if let Some(queue) = told {
            let hints = self.unechoed(hints, sender).await;
            let event = rejected_event(&hints, reason, Utc::now());
            let body = serde_json::to_vec(&event).unwrap_or_default();
            // The hints hold only ids and queues of a routable size.
            let correlation = correlation_of(&event.order_id);
            let answered = publisher
                .publish(&Outgoing {
                    routing_key: queue,
                    body: &body,
                    correlation_id: correlation.as_deref(),
                    mandatory: true,
                    ..Outgoing::default()
                })
                .await;
            match answered {
                Ok(()) => {}
                Err(broker::PublishError::Unroutable(q)) => {
                    tracing::warn!(queue = %q, "reply queue does not exist; rejection not sent");
                }
                Err(e @ broker::PublishError::Invalid(_)) => {
                    tracing::warn!(error = %e, "rejection not sent");
                }
                Err(e) => return Err(e.into()),
            }
        }
        self.intake.count_rejected(reason);
        if copied {
            broker::ack(delivery).await
        } else {
            broker::dead_letter(delivery).await
        }
    }

    /// `hints` without an order id that names an existing order (contract
    /// §1b): a rejection of a stranger's message carrying a live order's id
    /// must not reach that order's application as if its order had been
    /// refused. When the store cannot say, the id is left out too.
    async fn unechoed(&self, hints: &RejectedHints, sender: Option<&Application>) -> RejectedHints {
        let mut hints = hints.clone();
        let id = hints
            .order_id
            .as_ref()
            .and_then(|v| v.as_str())
            .and_then(|s| Uuid::parse_str(s).ok())
            .map(|given| sender.map_or(given, |app| app.order_id(given)));
        if let Some(id) = id {
            let exists = match self.ctx.store() {
                // Boxed: inline, this statement's future (tens of KB) would
                // be held by every order's task, rejected or not.
                Ok(store) => Box::pin(store.order_exists(id)).await.unwrap_or(true),
                Err(_) => true,
            };
            if exists {
                hints.order_id = None;
            }
        }
        hints
    }
}

/// The id an order sent on the queue goes by: its `order_id`, else its AMQP
/// `message_id` when that is a UUID, else a new one.
fn given_id(order_id: Option<Uuid>, message_id: Option<&str>) -> Uuid {
    order_id
        .or_else(|| message_id.and_then(|m| Uuid::parse_str(m).ok()))
        .unwrap_or_else(Uuid::new_v4)
}

/// The `correlation_id` of a `rejected` event: the order id as sent, when
/// one was (a string as it is, any other JSON value as its text).
fn correlation_of(order_id: &serde_json::Value) -> Option<String> {
    match order_id {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Null => None,
        other => Some(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_order_goes_by_its_own_id_then_its_message_id_then_a_new_one() {
        let own = Uuid::now_v7();
        let message = Uuid::now_v7();
        let text = message.to_string();
        assert_eq!(given_id(Some(own), Some(&text)), own);
        assert_eq!(given_id(None, Some(&text)), message);
        // A message id that is no UUID is no order id.
        let fresh = given_id(None, Some("order-7"));
        assert_ne!(fresh, message);
        assert_ne!(given_id(None, None), fresh, "a new id each time");
    }

    #[test]
    fn a_rejection_correlates_with_the_id_as_sent() {
        assert_eq!(correlation_of(&json!("abc")), Some("abc".into()));
        assert_eq!(correlation_of(&json!(null)), None);
        assert_eq!(correlation_of(&json!(42)), Some("42".into()));
        assert_eq!(correlation_of(&json!({"a": 1})), Some(r#"{"a":1}"#.into()));
    }
}

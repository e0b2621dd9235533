//! Replay (contract §9): `<prefix>.replay` → read the stored status events
//! from the event log → publish them again, in `seq` order per order, to the
//! queue the request's AMQP `reply_to` names (else the order's own, or the
//! queue asked about) → ack. A request that cannot be served (malformed, an
//! unknown order, nowhere to send, a queue that does not exist) is copied to
//! `<prefix>.replay.dead` with the reason in `x-sas-reason`, counted, and
//! acknowledged, as a bad order is; the service goes on.
//!
//! A replay publishes at most `submission.max_replay_events` events: the
//! first of them; the application asks again from where it got to.

use std::sync::Arc;

use sas::applications::Application;
use sas::broker::{self, BrokerError, Outgoing, PublishError, Publisher, Received, Verdict};
use sas::messages::{Quoted, RejectReason, ReplayRequest, decode_replay, is_queue_name};
use sas::metrics::labels;
use sas::service::Context;
use sas::state_store::{StateStore, StoreError};
use tracing::Instrument;

/// Events published before their confirms are read, so that a replay of
/// thousands of events is a few round trips, not one per event.
const WINDOW: usize = 256;

/// Serves replay requests.
pub struct Replayer {
    pub store: StateStore,
    pub ctx: Arc<Context>,
}

impl Replayer {
    /// Handles one replay request; an error means the broker is gone (the
    /// request comes again, and its events are published again: the
    /// application dedupes on (`order_id`, `seq`) anyway).
    pub async fn handle(
        &self,
        publisher: &Publisher,
        delivery: Received,
    ) -> Result<(), BrokerError> {
        let settings = &self.ctx.settings.submission;
        // With applications configured (contract §1b), only an
        // application's, and only of its own orders, to its own queues.
        let sender = match self
            .ctx
            .applications
            .identify_sender(delivery.user_id(), delivery.carried_sender().as_deref())
        {
            Ok(sender) => sender,
            Err(unknown) => {
                return self
                    .reject(&delivery, &RejectReason::UnknownApplication(unknown))
                    .await;
            }
        };
        let request =
            match decode_replay(delivery.body(), settings.max_body_bytes, &self.ctx.queues) {
                Ok(request) => request,
                Err(reason) => return self.reject(&delivery, &reason).await,
            };
        let span = match &request {
            ReplayRequest::Order { order_id, from_seq } => {
                tracing::info_span!("replay", %order_id, from_seq)
            }
            ReplayRequest::Queue { reply_to, since } => {
                tracing::info_span!("replay", queue = %reply_to, %since)
            }
        };
        if let (Some(app), ReplayRequest::Queue { reply_to, .. }) = (sender, &request)
            && !app.may_reply_to(reply_to)
        {
            let reason = not_its_queue(app, "`reply_to`", reply_to.as_str());
            return self.reject(&delivery, &reason).await;
        }
        self.serve(publisher, &delivery, &request, sender)
            .instrument(span)
            .await
    }

    async fn serve(
        &self,
        publisher: &Publisher,
        delivery: &Received,
        request: &ReplayRequest,
        sender: Option<&Application>,
    ) -> Result<(), BrokerError> {
        let limit = self.ctx.settings.submission.max_replay_events;
        // An application names its orders by the ids it gave them.
        let stored = match (sender, request) {
            (Some(app), ReplayRequest::Order { order_id, from_seq }) => ReplayRequest::Order {
                order_id: app.order_id(*order_id),
                from_seq: *from_seq,
            },
            _ => request.clone(),
        };
        let application = sender.map(|app| app.name.as_str());
        let replay = match self.store.replay(&stored, application, limit).await {
            Ok(Some(replay)) => replay,
            Ok(None) => {
                let ReplayRequest::Order { order_id, .. } = request else {
                    // Only a request for one order can name an unknown one.
                    return self
                        .reject(
                            delivery,
                            &RejectReason::Internal(Quoted::new("the event log answered nothing")),
                        )
                        .await;
                };
                return self
                    .reject(delivery, &RejectReason::UnknownOrder(*order_id))
                    .await;
            }
            Err(e) => return self.store_failed(delivery, &e).await,
        };
        // An unusable property is ignored, as on an order.
        let to = delivery
            .reply_to()
            .filter(|q| is_queue_name(q))
            .map(|q| (q.to_owned(), "the AMQP reply_to property"))
            .or(replay.reply_to.map(|q| (q, "the order's reply_to")));
        let Some((to, named_by)) = to else {
            return self.reject(delivery, &RejectReason::NoReplyQueue).await;
        };
        // Never into sas's own queues (contract §1b), whoever named it: a
        // replay into the replay queue would feed itself for good.
        if self.ctx.queues.is_reserved(&to) {
            let reason = RejectReason::ReservedQueue {
                field: named_by,
                queue: Quoted::new(&to),
            };
            return self.reject(delivery, &reason).await;
        }
        if let Some(app) = sender
            && !app.may_reply_to(&to)
        {
            return self
                .reject(delivery, &not_its_queue(app, named_by, &to))
                .await;
        }
        if replay.truncated {
            tracing::warn!(
                limit,
                "replay larger than submission.max_replay_events; sending the first events only"
            );
        }
        match publish(publisher, &to, &replay.events).await {
            Ok(()) => {}
            Err(PublishError::Unroutable(q)) => {
                return self
                    .reject(delivery, &RejectReason::NoSuchQueue(Quoted::new(&q)))
                    .await;
            }
            Err(e @ PublishError::Invalid(_)) => {
                let reason = RejectReason::Internal(Quoted::new(&e.to_string()));
                return self.reject(delivery, &reason).await;
            }
            Err(e) => return Err(e.into()),
        }
        tracing::info!(events = replay.events.len(), queue = %to, truncated = replay.truncated, "replayed");
        self.count(if replay.truncated {
            "truncated"
        } else {
            "replayed"
        });
        broker::ack(delivery).await
    }

    /// Dead-letters the request with its reason, and counts it.
    async fn reject(&self, delivery: &Received, reason: &RejectReason) -> Result<(), BrokerError> {
        tracing::warn!(reason = %reason, "replay request rejected; dead-lettered");
        self.count(reason.label());
        crate::refusal::refuse(delivery, reason).await
    }

    /// The state store failed: a transient failure hands the request back
    /// after a pause; any other is retried a bounded number of times.
    async fn store_failed(&self, delivery: &Received, e: &StoreError) -> Result<(), BrokerError> {
        tracing::warn!(error = %e, transient = e.is_transient(), "could not read the event log for a replay");
        Verdict::failed(e.is_transient(), || {
            format!("could not read the event log: {e}")
        })
        .settle(delivery)
        .await
    }

    fn count(&self, outcome: &str) {
        self.ctx
            .metrics
            .replays
            .get_or_create(&labels(&[("outcome", outcome)]))
            .inc();
    }
}

/// Why a replay may not go to `queue`: not among `app`'s queues (§1b).
fn not_its_queue(app: &Application, field: &'static str, queue: &str) -> RejectReason {
    RejectReason::NotTheApplicationsQueue {
        field,
        queue: Quoted::new(queue),
        application: Quoted::new(&app.name),
    }
}

/// Publishes the events to `queue`, in order, persistent, with the
/// `correlation_id` of the original (the order id), a window of them at a
/// time; an error for the first that the broker did not take.
async fn publish(
    publisher: &Publisher,
    queue: &str,
    events: &[sas::messages::StatusEvent],
) -> Result<(), PublishError> {
    for window in events.chunks(WINDOW) {
        let mut pending = Vec::with_capacity(window.len());
        for event in window {
            // A status event always serializes.
            let body = serde_json::to_vec(event).unwrap_or_default();
            let correlation = event.order_id.as_str();
            pending.push(
                publisher
                    .send(&Outgoing {
                        routing_key: queue,
                        body: &body,
                        correlation_id: correlation,
                        mandatory: true,
                        ..Outgoing::default()
                    })
                    .await?,
            );
        }
        for confirm in pending {
            confirm.wait().await?;
        }
    }
    Ok(())
}

//! The agent's replies to the schedulers: each request's handler hands its
//! reply over and waits for the broker's confirm, while one sender task
//! publishes whatever replies are waiting as one message (a pack, read by
//! [`sas::messages::decode_replies`]).
//!
//! Nothing waits for a pack to fill, nor for an earlier message's confirm:
//! at low load a reply goes alone, as soon as it is ready; under load the
//! replies that became ready while the sender was busy go together, so the
//! broker routes, stores and delivers one message for many steps.

use std::sync::Arc;

use sas::broker::{Outgoing, PublishError, Publisher};
use sas::config::Durability;
use sas::messages::{StepReply, encode_replies};
use sas::metrics::Metrics;
use tokio::sync::{mpsc, oneshot};

/// Most replies the sender takes at once.
const MAX_TAKE: usize = 256;

/// A reply, the queue it goes to, and who waits for its confirm.
struct Reply {
    reply_to: String,
    reply: StepReply,
    confirmed: oneshot::Sender<Result<(), PublishError>>,
}

/// Sends replies, packing those ready together; cheap to clone. The sender
/// task ends when the last handle is dropped.
#[derive(Clone)]
pub struct Replies {
    queue: mpsc::UnboundedSender<Reply>,
}

impl Replies {
    /// A sender publishing over `publisher` as `durability` says (the
    /// step messages'), counting its messages in `sas_reply_messages_total`.
    pub fn start(publisher: Publisher, durability: Durability, metrics: Arc<Metrics>) -> Self {
        let (queue, waiting) = mpsc::unbounded_channel();
        tokio::spawn(run(publisher, durability, metrics, waiting));
        Self { queue }
    }

    /// Sends `reply` to `reply_to` and waits for the broker to take it.
    pub async fn send(&self, reply_to: &str, reply: StepReply) -> Result<(), PublishError> {
        let (confirmed, confirm) = oneshot::channel();
        let reply = Reply {
            reply_to: reply_to.to_owned(),
            reply,
            confirmed,
        };
        // Not `Invalid`, which the agent answers by acknowledging the
        // request: a reply not sent for want of a sender is handed back.
        let stopped = Err(PublishError::Stopped);
        if self.queue.send(reply).is_err() {
            return stopped;
        }
        confirm.await.unwrap_or(stopped)
    }
}

/// Takes what is waiting, publishes it, and leaves the confirms to tasks
/// of their own, until every handle is gone.
async fn run(
    publisher: Publisher,
    durability: Durability,
    metrics: Arc<Metrics>,
    mut waiting: mpsc::UnboundedReceiver<Reply>,
) {
    let sender = Sender {
        publisher,
        transient: durability.transient(),
    };
    let mut taken = Vec::with_capacity(MAX_TAKE);
    while waiting.recv_many(&mut taken, MAX_TAKE).await > 0 {
        send(&sender, &metrics, std::mem::take(&mut taken)).await;
    }
}

/// The confirm channel replies go over, and how.
struct Sender {
    publisher: Publisher,
    /// Sent non-persistent (`broker.step_messages = "transient"`).
    transient: bool,
}

/// Publishes `replies`, those for one queue packed together; each reply's
/// waiter learns its message's confirm.
async fn send(sender: &Sender, metrics: &Metrics, replies: Vec<Reply>) {
    // Almost always one queue (`<prefix>.scheduler.replies`); kept apart
    // when not, each in the order they came.
    let mut queues: Vec<(String, Vec<Reply>)> = Vec::new();
    for r in replies {
        match queues.iter_mut().find(|(q, _)| *q == r.reply_to) {
            Some((_, members)) => members.push(r),
            None => queues.push((r.reply_to.clone(), vec![r])),
        }
    }
    for (queue, members) in queues {
        let group: Vec<&StepReply> = members.iter().map(|r| &r.reply).collect();
        let bodies = encode_replies(&group);
        let mut members = members.into_iter();
        for (body, range) in bodies {
            let carried: Vec<Reply> = members.by_ref().take(range.len()).collect();
            let sent = publish(sender, &queue, &body, &carried).await;
            if sent.is_ok() {
                metrics.reply_messages.inc();
            }
            tokio::spawn(async move {
                let outcome = match sent {
                    Ok(confirm) => confirm.wait().await,
                    Err(e) => Err(e),
                };
                for r in carried {
                    // The handler may be gone (shutdown): nobody to tell.
                    let _ = r.confirmed.send(outcome.clone());
                }
            });
        }
    }
}

/// Publishes one message of replies. A reply alone keeps its correlation
/// id and trace in the properties, as every message of sas does; a pack's
/// replies carry theirs in the body.
async fn publish(
    sender: &Sender,
    queue: &str,
    body: &[u8],
    carried: &[Reply],
) -> Result<sas::broker::PendingConfirm, PublishError> {
    let alone = match carried {
        [one] => Some(&one.reply),
        _ => None,
    };
    let correlation = alone.map(|r| r.dispatch_id.to_string());
    let trace = alone.and_then(|r| r.traceparent.as_deref());
    let headers = trace.map(|t| [(sas::trace::HEADER, t)]);
    sender
        .publisher
        .send(&Outgoing {
            routing_key: queue,
            body,
            correlation_id: correlation.as_deref(),
            headers: headers.as_ref().map_or(&[], |h| h.as_slice()),
            mandatory: true,
            transient: sender.transient,
            ..Outgoing::default()
        })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use sas::messages::{Direction, StepOutcome};

    #[tokio::test]
    async fn a_reply_without_a_sender_is_stopped_not_invalid() {
        let (queue, waiting) = mpsc::unbounded_channel();
        drop(waiting);
        let replies = Replies { queue };
        let reply = StepReply {
            order_id: uuid::Uuid::new_v4(),
            step: "a".into(),
            step_index: 0,
            direction: Direction::Forward,
            attempt: 1,
            dispatch_id: uuid::Uuid::new_v4(),
            locked_by: "s1".into(),
            traceparent: None,
            outcome: StepOutcome::Held { tried: false },
        };
        let sent = replies.send("q", reply).await;
        assert!(matches!(sent, Err(PublishError::Stopped)), "{sent:?}");
    }
}

//! The dead-letter queues as an operator sees them: `<prefix>.orders.dead`
//! (orders the submission refused), each agent's
//! `<prefix>.agent.<name>.requests.dead` and
//! `<prefix>.scheduler.replies.dead` (step requests and replies that failed
//! on every try, or whose handler panicked). Each message carries its reason
//! in `x-sas-reason` when sas put it there.
//!
//! `sasctl dead-letters` and the dashboard share this: list without removing,
//! replay to the queue the message came from, purge. Invariants:
//! - listing leaves every message in its queue, in its order: each is held
//!   unacknowledged until all are read, then handed back;
//! - a replayed message is removed only once the broker confirmed its copy,
//!   so a failure loses nothing (at worst the copy is replayed twice, which
//!   the submission and the scheduler's fencing ignore);
//! - a replay takes only the messages there when it starts, so one that
//!   comes straight back (still bad) is not replayed again in the same run.

use serde::Serialize;

use crate::{
    Broker, BrokerError, Delivery, Header, PublishError, Publisher, REASON_HEADER, TRIES_HEADER,
    Taken,
};
use sas_core::topology::QueueNames;

/// Most messages one listing reads (each is held on a channel of its own).
pub const MAX_LIST: u32 = 1000;

/// Which work queue a dead-letter queue belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Source {
    /// `<prefix>.orders`: orders the submission could not accept.
    Orders,
    /// An agent's step requests.
    Requests { agent: String },
    /// The schedulers' replies.
    Replies,
}

/// A dead-letter queue and the queue its messages are replayed to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadLetterQueue {
    #[serde(flatten)]
    pub source: Source,
    /// The dead-letter queue.
    pub queue: String,
    /// Where a replay publishes: the queue the messages were dead-lettered from.
    pub origin: String,
}

impl DeadLetterQueue {
    /// `<prefix>.orders.dead`.
    pub fn orders(names: &QueueNames) -> Self {
        Self {
            source: Source::Orders,
            queue: names.orders_dead().to_owned(),
            origin: names.orders().to_owned(),
        }
    }

    /// `<prefix>.agent.<agent>.requests.dead`.
    pub fn requests(names: &QueueNames, agent: &str) -> Self {
        Self {
            source: Source::Requests {
                agent: agent.to_owned(),
            },
            queue: names.agent_requests_dead(agent),
            origin: names.agent_requests(agent),
        }
    }

    /// `<prefix>.scheduler.replies.dead`.
    pub fn replies(names: &QueueNames) -> Self {
        Self {
            source: Source::Replies,
            queue: names.replies_dead().to_owned(),
            origin: names.replies().to_owned(),
        }
    }

    /// Every dead-letter queue of a deployment with these agents: orders,
    /// then each agent's requests, then replies.
    pub fn all<'a>(names: &QueueNames, agents: impl IntoIterator<Item = &'a str>) -> Vec<Self> {
        let mut all = vec![Self::orders(names)];
        all.extend(agents.into_iter().map(|a| Self::requests(names, a)));
        all.push(Self::replies(names));
        all
    }

    /// The one of `all` named `queue`, if it is one (so a caller can only
    /// ever touch a deployment's own dead-letter queues).
    pub fn find<'a>(all: &'a [Self], queue: &str) -> Option<&'a Self> {
        all.iter().find(|q| q.queue == queue)
    }
}

/// A dead letter as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Letter {
    /// Why it was set aside ([`crate::dead_letter_reason`]): sas's
    /// `x-sas-reason`, or the broker's reason when the broker dead-lettered
    /// it by its own rules.
    pub reason: Option<String>,
    pub message_id: Option<String>,
    pub reply_to: Option<String>,
    /// Failed tries counted in `x-sas-tries`.
    pub tries: u32,
    /// The body as text (invalid UTF-8 replaced).
    pub body: String,
}

impl Letter {
    /// What a listing shows of a delivery.
    pub fn of(delivery: &Delivery) -> Self {
        Self {
            reason: crate::dead_letter_reason(delivery),
            message_id: delivery.message_id().map(str::to_owned),
            reply_to: delivery.reply_to().map(str::to_owned),
            tries: crate::tries(delivery),
            body: String::from_utf8_lossy(delivery.body()).into_owned(),
        }
    }
}

/// The first messages of a dead-letter queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Listing {
    /// Messages ready in the queue when the listing started.
    pub total: u32,
    /// The oldest ones, at most the limit asked.
    pub letters: Vec<Letter>,
}

/// What went wrong with a dead-letter queue.
#[derive(Debug, thiserror::Error)]
pub enum DeadLetterError {
    /// The queue is not there: the services declare it at start-up.
    #[error(
        "the queue {queue} does not exist (the sas services declare it at start-up; \
         is broker.prefix {prefix:?} right?)"
    )]
    NoQueue { queue: String, prefix: String },
    /// The broker failed while `doing` something with `queue`.
    #[error("{doing} {queue}")]
    Broker {
        doing: &'static str,
        queue: String,
        #[source]
        source: BrokerError,
    },
    /// The copy was not taken (the message stays in the dead-letter queue).
    #[error("publishing to {origin}")]
    Publish {
        origin: String,
        #[source]
        source: PublishError,
    },
    /// The copy was confirmed but the original could not be removed.
    #[error(
        "re-published to {origin}, but not removed from {queue}: it may be replayed again \
         (a copy is ignored by the submission and fenced by the scheduler)"
    )]
    NotRemoved {
        queue: String,
        origin: String,
        #[source]
        source: BrokerError,
    },
}

impl DeadLetterError {
    fn broker(doing: &'static str, queue: &str) -> impl FnOnce(BrokerError) -> Self + use<> {
        let queue = queue.to_owned();
        move |source| Self::Broker {
            doing,
            queue,
            source,
        }
    }
}

/// A replay that stopped: how many went through before `error`.
#[derive(Debug, thiserror::Error)]
#[error("{error} ({replayed} replayed before)")]
pub struct ReplayStopped {
    pub replayed: u32,
    #[source]
    pub error: DeadLetterError,
}

/// Messages ready in `q`; [`DeadLetterError::NoQueue`] when it does not exist.
pub async fn count(
    broker: &Broker,
    names: &QueueNames,
    q: &DeadLetterQueue,
) -> Result<u32, DeadLetterError> {
    match broker.message_count(&q.queue).await {
        Ok(n) => Ok(n),
        Err(e) if e.is_not_found() => Err(DeadLetterError::NoQueue {
            queue: q.queue.clone(),
            prefix: names.prefix().to_owned(),
        }),
        Err(e) => Err(DeadLetterError::broker("looking up", &q.queue)(e)),
    }
}

/// The oldest `limit` messages of `q` (at most [`MAX_LIST`]), left in the
/// queue in their order.
pub async fn list(
    broker: &Broker,
    names: &QueueNames,
    q: &DeadLetterQueue,
    limit: u32,
) -> Result<Listing, DeadLetterError> {
    let total = count(broker, names, q).await?;
    let limit = limit.min(MAX_LIST) as usize;
    // Hold each message until all are read, so none is read twice; then hand
    // them back in the order they came, which keeps the queue's order.
    let mut taken: Vec<Taken> = Vec::new();
    let mut failed = None;
    while taken.len() < limit {
        match broker.take(&q.queue).await {
            Ok(Some(t)) => taken.push(t),
            Ok(None) => break,
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    let letters = taken.iter().map(|t| Letter::of(&t.delivery)).collect();
    for t in taken {
        // Should this fail, closing the channel hands the message back all the same.
        if let Err(e) = t.release().await {
            tracing::debug!(error = %e, "releasing a dead letter");
        }
    }
    match failed {
        Some(e) => Err(DeadLetterError::broker("reading", &q.queue)(e)),
        None => Ok(Listing { total, letters }),
    }
}

/// Re-publishes the messages of `q` to its origin, oldest first, at most
/// `limit` of them (every message there when the replay starts without
/// one); how many.
pub async fn replay(
    broker: &Broker,
    publisher: &Publisher,
    names: &QueueNames,
    q: &DeadLetterQueue,
    limit: Option<u32>,
) -> Result<u32, ReplayStopped> {
    let stopped = |replayed, error| ReplayStopped { replayed, error };
    let total = count(broker, names, q).await.map_err(|e| stopped(0, e))?;
    let wanted = limit.map_or(total, |limit| limit.min(total));
    let mut replayed = 0u32;
    while replayed < wanted {
        let taken = broker
            .take(&q.queue)
            .await
            .map_err(|e| stopped(replayed, DeadLetterError::broker("reading", &q.queue)(e)))?;
        let Some(taken) = taken else {
            break;
        };
        replay_one(publisher, q, taken)
            .await
            .map_err(|e| stopped(replayed, e))?;
        replayed += 1;
    }
    Ok(replayed)
}

/// Publishes a copy of a dead letter to its origin (body and properties as
/// they were, without the reason and the count of tries: the operator
/// replays because the cause is fixed), waits for the confirm, then
/// acknowledges the original. Not confirmed, the original is handed back.
async fn replay_one(
    publisher: &Publisher,
    q: &DeadLetterQueue,
    taken: Taken,
) -> Result<(), DeadLetterError> {
    let fresh = [
        (REASON_HEADER, Header::Remove),
        (TRIES_HEADER, Header::Remove),
    ];
    match publisher
        .republish(&q.origin, &taken.delivery, &fresh)
        .await
    {
        Ok(()) => taken
            .ack()
            .await
            .map_err(|source| DeadLetterError::NotRemoved {
                queue: q.queue.clone(),
                origin: q.origin.clone(),
                source,
            }),
        Err(source) => {
            if let Err(e) = taken.release().await {
                tracing::debug!(error = %e, "handing back a dead letter");
            }
            Err(DeadLetterError::Publish {
                origin: q.origin.clone(),
                source,
            })
        }
    }
}

/// Deletes every message of `q`; how many.
pub async fn purge(
    broker: &Broker,
    names: &QueueNames,
    q: &DeadLetterQueue,
) -> Result<u32, DeadLetterError> {
    // A missing queue says so, rather than "purged 0".
    count(broker, names, q).await?;
    broker
        .purge(&q.queue)
        .await
        .map_err(DeadLetterError::broker("purging", &q.queue))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dead_letter_queue_replays_to_the_queue_it_belongs_to() {
        let names = QueueNames::new("t1");
        let all = DeadLetterQueue::all(&names, ["pay", "ship"]);
        let pairs: Vec<(&str, &str)> = all
            .iter()
            .map(|q| (q.queue.as_str(), q.origin.as_str()))
            .collect();
        assert_eq!(
            pairs,
            [
                ("t1.orders.dead", "t1.orders"),
                ("t1.agent.pay.requests.dead", "t1.agent.pay.requests"),
                ("t1.agent.ship.requests.dead", "t1.agent.ship.requests"),
                ("t1.scheduler.replies.dead", "t1.scheduler.replies"),
            ]
        );
        // Every one is a queue the deployment declares, dead-lettering from its origin.
        let declared = names.all(["pay", "ship"]);
        for q in &all {
            assert!(
                declared
                    .iter()
                    .any(|d| d.name == q.origin && d.dead_letters.as_deref() == Some(&q.queue)),
                "{q:?}"
            );
        }
        assert_eq!(
            DeadLetterQueue::find(&all, "t1.agent.pay.requests.dead").map(|q| &q.source),
            Some(&Source::Requests {
                agent: "pay".into()
            })
        );
        assert_eq!(DeadLetterQueue::find(&all, "t1.orders"), None);
        assert_eq!(DeadLetterQueue::find(&all, "other.orders.dead"), None);
    }

    #[test]
    fn a_queue_serialises_with_its_kind() {
        let names = QueueNames::new("p");
        let json = serde_json::to_value(DeadLetterQueue::requests(&names, "a")).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "kind": "requests", "agent": "a",
                "queue": "p.agent.a.requests.dead", "origin": "p.agent.a.requests",
            })
        );
    }
}

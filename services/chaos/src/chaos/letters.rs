//! The run's hostile messages in sas's dead-letter queues: found by their
//! `message_id` ([`super::hostile::message_number`]), counted and taken out,
//! so that the queues do not grow run after run. Every other message is
//! handed back unread in its place.
//!
//! Reading a queue delivers what it holds, so the queues are read as
//! little as can be: the run counts each queue's ready messages before it
//! sends anything, waits until they have grown by as many as it expects
//! (a passive declare each time, no delivery), then reads the queues that
//! grew; another pass comes only for messages still missing or for late
//! copies (a service killed between its dead-letter copy and its
//! acknowledgement copies the message again), at most [`MAX_PASSES`].

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::Context;
use sas::broker::Broker;
use sas::config::Settings;
use sas::topology::QueueNames;
use tokio_util::sync::CancellationToken;

use super::hostile::message_number;

/// Deliveries held unacknowledged while one queue is read: the messages of
/// others that are passed over until the queue is handed back.
const PREFETCH: u16 = 1000;

/// A queue's read stops when nothing arrived for this long.
const READ_IDLE: Duration = Duration::from_secs(1);

/// How often the queues are counted while waiting.
const POLL: Duration = Duration::from_millis(250);

/// Once every expected message is found, how long the queues are watched
/// for late copies.
const QUIET: Duration = Duration::from_secs(3);

/// Reads of the queues at most: each hands the messages of others back
/// once, so they are not read again and again.
const MAX_PASSES: usize = 5;

/// The dead-letter queues a hostile message may end up in.
pub fn dead_queues(queues: &QueueNames, agent: &str) -> Vec<String> {
    vec![
        queues.orders_dead().to_owned(),
        queues.replay_dead().to_owned(),
        queues.replies_dead().to_owned(),
        queues.agent_requests_dead(agent),
    ]
}

/// Ready messages in each of `queues` now; a queue that does not exist (yet) holds 0.
pub async fn ready(broker: &Broker, queues: &[String]) -> anyhow::Result<HashMap<String, u32>> {
    let mut counts = HashMap::new();
    for q in queues {
        let n = match broker.message_count(q).await {
            Ok(n) => n,
            Err(e) if e.is_not_found() => 0,
            Err(e) => return Err(e).with_context(|| format!("counting the messages of {q}")),
        };
        counts.insert(q.clone(), n);
    }
    Ok(counts)
}

/// Waits, at most until `deadline`, for `queue` to hold no ready message:
/// whether it did.
pub async fn emptied(
    settings: &Settings,
    queue: &str,
    deadline: Instant,
    shutdown: &CancellationToken,
) -> anyhow::Result<bool> {
    let broker = connect(settings).await?;
    let outcome = async {
        loop {
            let counts = ready(&broker, &[queue.to_owned()]).await?;
            if counts.get(queue).copied().unwrap_or(0) == 0 {
                return Ok(true);
            }
            if Instant::now() >= deadline || shutdown.is_cancelled() {
                return Ok(false);
            }
            tokio::time::sleep(POLL).await;
        }
    }
    .await;
    broker.close().await;
    outcome
}

/// What [`take_out`] found.
#[derive(Debug, Default)]
pub struct TakenOut {
    /// The queue each of the run's messages was found in, by number.
    pub found: HashMap<u32, String>,
    /// Messages taken out, copies of one message included: a service
    /// killed between its copy and its acknowledgement copies again.
    pub copies: u64,
}

/// Finds the run's hostile messages `expected` in `queues` (counted in
/// `baseline` before the run), waiting for them at most until `deadline`,
/// and takes out every one of the run's (`run_id`) found, expected or not.
/// Once all are found it goes on while the queues still grow (for at most
/// [`QUIET`] between messages): a late second copy is taken out too.
pub async fn take_out(
    settings: &Settings,
    run_id: &str,
    queues: &[String],
    baseline: &HashMap<String, u32>,
    expected: &HashSet<u32>,
    deadline: Instant,
    shutdown: &CancellationToken,
) -> anyhow::Result<TakenOut> {
    let broker = connect(settings).await?;
    let mut taken = TakenOut::default();
    let outcome = async {
        for _pass in 0..MAX_PASSES {
            let missing = expected
                .iter()
                .filter(|n| !taken.found.contains_key(*n))
                .count();
            // All found: wait a little for late copies only.
            let until = if missing == 0 {
                deadline.min(Instant::now() + QUIET)
            } else {
                deadline
            };
            let counts = loop {
                let counts = ready(&broker, queues).await?;
                let grown = grown(&counts, baseline);
                let enough = if missing == 0 {
                    grown > 0
                } else {
                    grown >= missing
                };
                if enough || Instant::now() >= until || shutdown.is_cancelled() {
                    break counts;
                }
                tokio::time::sleep(POLL).await;
            };
            if missing == 0 && grown(&counts, baseline) == 0 {
                break;
            }
            for q in queues {
                let n = counts.get(q).copied().unwrap_or(0);
                // A queue that holds no more than before the run has none of the run's.
                if n > baseline.get(q).copied().unwrap_or(0) {
                    read_once(&broker, q, n, run_id, &mut taken).await?;
                }
            }
            if Instant::now() >= deadline || shutdown.is_cancelled() {
                break;
            }
        }
        Ok(())
    }
    .await;
    broker.close().await;
    outcome.map(|()| taken)
}

/// Messages in `counts` beyond `baseline`, over all queues.
fn grown(counts: &HashMap<String, u32>, baseline: &HashMap<String, u32>) -> usize {
    counts
        .iter()
        .map(|(q, n)| n.saturating_sub(baseline.get(q).copied().unwrap_or(0)) as usize)
        .sum()
}

/// Reads the `count` messages `queue` held when counted: acknowledges (takes
/// out) the run's hostile ones, noting where each was, and leaves the others
/// unacknowledged, so that closing the channel hands them back.
async fn read_once(
    broker: &Broker,
    queue: &str,
    count: u32,
    run_id: &str,
    taken: &mut TakenOut,
) -> anyhow::Result<()> {
    if count == 0 {
        return Ok(());
    }
    let mut consumer = broker
        .consume(queue, PREFETCH, "sasctl-chaos-dead-letters")
        .await
        .with_context(|| format!("consuming {queue}"))?;
    // Held until the consumer closes: dropping one acknowledges nothing.
    let mut passed_over = Vec::new();
    let mut read = 0;
    let outcome = async {
        while read < count {
            let next = match tokio::time::timeout(READ_IDLE, consumer.next()).await {
                Err(_) | Ok(None) => break,
                Ok(Some(next)) => next.with_context(|| format!("reading {queue}"))?,
            };
            read += 1;
            match next.message_id().and_then(|m| message_number(run_id, m)) {
                Some(n) => {
                    next.ack()
                        .await
                        .with_context(|| format!("taking a message out of {queue}"))?;
                    taken.found.insert(n, queue.to_owned());
                    taken.copies += 1;
                }
                None => passed_over.push(next),
            }
        }
        Ok(())
    }
    .await;
    consumer.close("handing back what is not the run's").await;
    drop(passed_over);
    outcome
}

async fn connect(settings: &Settings) -> anyhow::Result<Broker> {
    Broker::connect(&settings.broker, "sasctl-chaos")
        .await
        .context("connecting to RabbitMQ")
}

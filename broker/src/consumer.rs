//! The consumer loop every service runs: take deliveries, work on each in its
//! own task, and on shutdown stop taking, give in-flight work a grace period,
//! then hand back (leave unacknowledged, so the broker redelivers) what is left.

use std::future::Future;
use std::time::Duration;

use std::panic::AssertUnwindSafe;

use futures_util::FutureExt as _;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::acks::{Received, Settle};
use super::poison;
use super::{BrokerError, SessionEnd, Subscription};

/// A handler's work on one delivery, boxed: for a service whose handlers
/// for several queues must be of one type.
pub type Handling = std::pin::Pin<Box<dyn Future<Output = Result<(), BrokerError>> + Send>>;

/// Consumes until `stop` (returning [`SessionEnd::Shutdown`]) or until the
/// consumer, a handler or a companion task (`lost`) fails on the broker
/// (returning the error, which ends the session). Concurrency is bounded by
/// the consumer's prefetch; handlers settle their deliveries with [`ack`],
/// [`requeue`] or [`dead_letter`], and acks go out several at a time
/// (the `acks` module). On the way out the acks still waiting are sent and the
/// subscription's channel is closed, so whatever was delivered but not
/// acknowledged is redelivered.
pub async fn consume<H, Fut>(
    subscription: Subscription,
    stop: &CancellationToken,
    lost: &CancellationToken,
    grace: Duration,
    handler: H,
) -> Result<SessionEnd, BrokerError>
where
    H: Fn(Received) -> Fut,
    Fut: Future<Output = Result<(), BrokerError>> + Send + 'static,
{
    let Subscription {
        mut consumer,
        acks,
        dead_letters,
    } = subscription;
    let queue = consumer.queue();
    let mut tasks: JoinSet<Result<(), BrokerError>> = JoinSet::new();
    let outcome = loop {
        tokio::select! {
            () = stop.cancelled() => break Ok(SessionEnd::Shutdown),
            () = lost.cancelled() => break Err(BrokerError::CompanionLost(queue.clone())),
            Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                if let Some(e) = task_error(done) {
                    break Err(e);
                }
            }
            next = consumer.next() => match next {
                Some(Ok(delivery)) => {
                    if let Some(e) = reap(&mut tasks) {
                        break Err(e);
                    }
                    let received = acks.received(delivery, dead_letters.clone());
                    // Headers the parser could not read whole (contract
                    // §1b): set aside before any handler sees the message.
                    if let Some(reason) = received.headers_refusal() {
                        tracing::warn!(%reason, %queue, "message refused unread; dead-lettered");
                        tasks.spawn(async move { poison::dead_letter_with(&received, &reason).await });
                        continue;
                    }
                    let kept = received.share();
                    // Boxed: a task that awaits a future it owns holds it
                    // twice over (the agent's was 65 KB for 32 KB of work).
                    let work = AssertUnwindSafe(Box::pin(handler(received))).catch_unwind();
                    // A panic settles its own delivery (dead-lettered with
                    // `internal_error`) and ends nothing else.
                    tasks.spawn(async move {
                        match work.await {
                            Ok(done) => done,
                            Err(panic) => poison::panicked(&kept, &poison::panic_text(panic.as_ref())).await,
                        }
                    });
                }
                Some(Err(e)) => break Err(e),
                None => break Err(BrokerError::ConsumerEnded(queue.clone())),
            },
        }
    };
    // Let in-flight work finish; what does not finish in time stays
    // unacknowledged and is redelivered once the channel closes.
    let drained = tokio::time::timeout(grace, async {
        while let Some(done) = tasks.join_next().await {
            if let Some(e) = task_error(done) {
                tracing::warn!(error = %e, %queue, "in-flight work failed while draining");
            }
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(%queue, left = tasks.len(), "grace period over; handing back unfinished deliveries");
        tasks.abort_all();
    }
    if let Err(e) = acks.send(true).await {
        tracing::warn!(error = %e, %queue, "could not send the last acks; those messages come again");
    }
    consumer.close("consumer stopped").await;
    outcome
}

/// Joins every handler that has finished, so that the set holds only the
/// ones still running: a finished task keeps its whole allocation until it
/// is joined, and under a long burst `select!`'s coin toss between joining
/// and taking the next delivery would let finished tasks pile up (hundreds,
/// growing with the burst). Returns the first broker error among them.
fn reap(tasks: &mut JoinSet<Result<(), BrokerError>>) -> Option<BrokerError> {
    let mut first = None;
    while let Some(done) = tasks.try_join_next() {
        if let Some(e) = task_error(done) {
            first.get_or_insert(e);
        }
    }
    first
}

fn task_error(
    done: Result<Result<(), BrokerError>, tokio::task::JoinError>,
) -> Option<BrokerError> {
    match done {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(e) if e.is_cancelled() => None,
        Err(e) => {
            tracing::error!(error = %e, "a message handler panicked");
            None
        }
    }
}

/// Acknowledges a delivery: the work is committed.
pub async fn ack(delivery: &Received) -> Result<(), BrokerError> {
    delivery.settle(Settle::Ack).await
}

/// Hands a delivery back for redelivery (a transient failure, or shutdown).
pub async fn requeue(delivery: &Received) -> Result<(), BrokerError> {
    delivery.settle(Settle::Requeue).await
}

/// Rejects a delivery that can never be processed: the queue dead-letters it.
pub async fn dead_letter(delivery: &Received) -> Result<(), BrokerError> {
    delivery.settle(Settle::DeadLetter).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn reaping_leaves_only_the_handlers_still_running_and_reports_an_error() {
        let mut tasks: JoinSet<Result<(), BrokerError>> = JoinSet::new();
        for _ in 0..500 {
            tasks.spawn(async { Ok(()) });
        }
        tasks.spawn(async { Err(BrokerError::NoSession) });
        let running = std::sync::Arc::new(tokio::sync::Notify::new());
        let waits = running.clone();
        tasks.spawn(async move {
            waits.notified().await;
            Ok(())
        });
        // Let every task that can finish do so.
        let bound = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut errors = 0;
        while tasks.len() > 1 && tokio::time::Instant::now() < bound {
            match reap(&mut tasks) {
                Some(BrokerError::NoSession) => errors += 1,
                Some(e) => panic!("unexpected error {e}"),
                None => tokio::task::yield_now().await,
            }
        }
        assert_eq!(tasks.len(), 1, "only the waiting handler is left");
        assert_eq!(errors, 1, "the failed handler's error, once");
        running.notify_one();
    }
}

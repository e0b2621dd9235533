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

/// Consumes until `stop` (returning [`SessionEnd::Shutdown`]) or until the
/// consumer, a handler or a companion task (`lost`) fails on the broker
/// (returning the error, which ends the session). Concurrency is bounded by
/// the consumer's prefetch; handlers settle their deliveries with [`ack`],
/// [`requeue`] or [`dead_letter`], and acks go out several at a time
/// ([`super::acks`]). On the way out the acks still waiting are sent and the
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
                    let received = acks.received(delivery, dead_letters.clone());
                    let kept = received.share();
                    let work = AssertUnwindSafe(handler(received)).catch_unwind();
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

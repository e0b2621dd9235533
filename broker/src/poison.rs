//! Deliveries that can never be handled (contract §1a): a handler that
//! panics, or a message that fails the same way on every try, must not sit
//! unacknowledged nor come back forever. Such a delivery is copied, body
//! and properties untouched, to its queue's `.dead` queue with the reason in
//! `x-sas-reason`, and the original is acknowledged once the copy is
//! confirmed.
//!
//! A failure that may mend (Postgres restarting) is retried without limit by
//! a plain hand-back; one that the handler judges specific to the message is
//! retried through [`retry_counted`], which counts tries in the message's
//! own `x-sas-tries` header. The count travels with the message, so it
//! holds across consumers, restarts and queue types (a classic queue counts
//! no deliveries; a quorum queue's `x-delivery-limit` cannot carry a reason).

use lapin::types::AMQPValue;

use super::acks::Received;
use super::delivery::Delivery;
use super::publisher::Header;
use super::{BrokerError, PublishError};

/// The header that carries why a message was dead-lettered.
pub const REASON_HEADER: &str = "x-sas-reason";

/// The header that counts a message's failed tries.
pub const TRIES_HEADER: &str = "x-sas-tries";

/// The reason given for a delivery whose handler panicked.
pub const INTERNAL_ERROR: &str = "internal_error";

/// Why a dead letter was set aside, as an operator's tools show it: sas's
/// `x-sas-reason`, or, for a message the broker dead-lettered by its own
/// rules (it expired, or was rejected), the broker's reason. A message the
/// broker dead-lettered keeps the headers its sender gave it, so an
/// `x-sas-reason` on it is the sender's, not sas's, and is not shown.
/// Bounded to [`sas_core::messages::MAX_REASON_BYTES`].
pub fn dead_letter_reason(delivery: &super::Delivery) -> Option<String> {
    let reason = match delivery.header("x-first-death-reason") {
        Some(broker) => format!("dead-lettered by the broker: {broker}"),
        None => delivery.header(REASON_HEADER)?,
    };
    Some(
        sas_core::messages::truncate_bytes(&reason, sas_core::messages::MAX_REASON_BYTES)
            .to_owned(),
    )
}

/// Copies the delivery to the dead-letter queue with `reason`, then
/// acknowledges it. Without a [`DeadLetters`](super::DeadLetters) (or if the copy cannot be
/// made), the delivery is rejected and the queue's own dead-letter route
/// takes it, without the reason.
pub async fn dead_letter_with(delivery: &Received, reason: &str) -> Result<(), BrokerError> {
    let Some(dead) = delivery.dead_letters() else {
        return super::dead_letter(delivery).await;
    };
    let reason_header = (REASON_HEADER, Header::Text(reason));
    match dead
        .publisher
        .republish(&dead.dead_queue, delivery, &[reason_header])
        .await
    {
        Ok(()) => super::ack(delivery).await,
        Err(PublishError::Amqp(e)) => Err(e.into()),
        Err(e) => {
            tracing::warn!(error = %e, queue = %dead.dead_queue, "could not copy to the dead-letter queue; rejecting instead");
            super::dead_letter(delivery).await
        }
    }
}

/// A failure specific to this message: puts a copy back on its queue with
/// one more try counted, or dead-letters it with `reason` once it has had
/// its tries. Without a [`DeadLetters`](super::DeadLetters), hands it back.
pub async fn retry_counted(delivery: &Received, reason: &str) -> Result<(), BrokerError> {
    let Some(dead) = delivery.dead_letters() else {
        return super::requeue(delivery).await;
    };
    // The header comes with the message: any value, even u32::MAX.
    let tries = tries(delivery).saturating_add(1);
    if tries >= dead.max_tries {
        tracing::warn!(tries, %reason, "message failed on every try; dead-lettered");
        return dead_letter_with(delivery, reason).await;
    }
    let count = (TRIES_HEADER, Header::Count(tries));
    match dead
        .publisher
        .republish(&dead.queue, delivery, &[count])
        .await
    {
        Ok(()) => super::ack(delivery).await,
        Err(PublishError::Amqp(e)) => Err(e.into()),
        Err(_) => super::requeue(delivery).await,
    }
}

/// What becomes of a delivery once its handler knows how its work went,
/// decided before anything is sent. A message that carries several items
/// (an agent's pack of replies) takes the greatest of theirs: a hand-back
/// over a counted retry over a dead letter over an acknowledgement, so that
/// no item's work is lost to another's verdict.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Verdict {
    /// Done (or nothing left to do): acknowledge.
    Ack,
    /// Can never be handled: dead-letter with this reason.
    DeadLetter(String),
    /// Failed for a reason that may be the message's own: retry, counted
    /// ([`retry_counted`]), with this reason once the tries run out.
    RetryCounted(String),
    /// Failed for a reason that may mend (the state store away): hand it
    /// back after a pause, without limit.
    Requeue,
}

/// How long a handed-back delivery waits first: a Postgres restart costs a
/// delay, not a hot loop of redeliveries.
const REQUEUE_PAUSE: std::time::Duration = std::time::Duration::from_millis(250);

impl Verdict {
    /// The work failed: handed back when the failure may mend
    /// (`transient`), otherwise retried a bounded number of times with `reason`.
    pub fn failed(transient: bool, reason: impl FnOnce() -> String) -> Self {
        if transient {
            Self::Requeue
        } else {
            Self::RetryCounted(reason())
        }
    }

    /// Settles `delivery` as this says; an error means the broker is gone.
    pub async fn settle(self, delivery: &Received) -> Result<(), BrokerError> {
        match self {
            Self::Ack => super::ack(delivery).await,
            Self::DeadLetter(reason) => dead_letter_with(delivery, &reason).await,
            Self::RetryCounted(reason) => retry_counted(delivery, &reason).await,
            Self::Requeue => {
                tokio::time::sleep(REQUEUE_PAUSE).await;
                super::requeue(delivery).await
            }
        }
    }
}

/// The handler of `delivery` panicked: counts it and, unless the handler
/// settled the delivery before, dead-letters it with reason `internal_error`.
pub(super) async fn panicked(delivery: &Received, what: &str) -> Result<(), BrokerError> {
    tracing::error!(panic = %what, delivery_tag = delivery.tag(), "a message handler panicked; the delivery is dead-lettered");
    if let Some(dead) = delivery.dead_letters() {
        dead.panics.inc();
    }
    if !delivery.is_unfinished() {
        return Ok(());
    }
    dead_letter_with(delivery, INTERNAL_ERROR).await
}

/// The tries counted in a delivery's `x-sas-tries` header (0 when absent).
pub fn tries(delivery: &Delivery) -> u32 {
    let Some(headers) = delivery.inner.properties.headers().as_ref() else {
        return 0;
    };
    match headers.inner().get(TRIES_HEADER) {
        Some(AMQPValue::LongUInt(n)) => *n,
        // A negative count is nonsense: none; a huge one: the most.
        Some(AMQPValue::LongLongInt(n)) => u32::try_from((*n).max(0)).unwrap_or(u32::MAX),
        Some(AMQPValue::LongInt(n)) => u32::try_from((*n).max(0)).unwrap_or(u32::MAX),
        Some(AMQPValue::ShortUInt(n)) => u32::from(*n),
        Some(AMQPValue::ShortShortUInt(n)) => u32::from(*n),
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes())
            .trim()
            .parse()
            .unwrap_or(0),
        _ => 0,
    }
}

/// The text of a panic's payload.
pub(super) fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use lapin::BasicProperties;
    use lapin::types::{FieldTable, LongString};

    use super::*;

    #[test]
    fn a_pack_takes_the_verdict_that_loses_no_items_work() {
        let verdicts = [
            Verdict::Ack,
            Verdict::DeadLetter("unreadable".into()),
            Verdict::RetryCounted("failed".into()),
            Verdict::Requeue,
        ];
        for (i, worst) in verdicts.iter().enumerate() {
            // Whatever the others, the hand-back of one item wins over
            // everything before it in the list.
            let mut pack = verdicts[..=i].to_vec();
            pack.reverse();
            assert_eq!(pack.into_iter().max().as_ref(), Some(worst));
        }
    }

    #[test]
    fn a_failure_that_may_mend_is_handed_back_and_any_other_is_counted() {
        assert_eq!(Verdict::failed(true, || unreachable!()), Verdict::Requeue);
        assert_eq!(
            Verdict::failed(false, || "why".into()),
            Verdict::RetryCounted("why".into())
        );
    }

    fn with_tries(value: Option<AMQPValue>) -> Delivery {
        let mut headers = FieldTable::default();
        if let Some(v) = value {
            headers.insert(TRIES_HEADER.into(), v);
        }
        let mut delivery =
            lapin::message::Delivery::mock(1, "".into(), "q".into(), false, Vec::new());
        delivery.properties = BasicProperties::default().with_headers(headers);
        Delivery::new(delivery)
    }

    #[test]
    fn tries_read_any_kind_of_count_and_never_fail_on_a_strange_one() {
        assert_eq!(tries(&with_tries(None)), 0);
        assert_eq!(tries(&with_tries(Some(AMQPValue::LongUInt(3)))), 3);
        assert_eq!(tries(&with_tries(Some(AMQPValue::LongLongInt(-5)))), 0);
        assert_eq!(
            tries(&with_tries(Some(AMQPValue::LongLongInt(i64::MAX)))),
            u32::MAX
        );
        assert_eq!(
            tries(&with_tries(Some(AMQPValue::LongString(LongString::from(
                "7"
            ))))),
            7
        );
        assert_eq!(
            tries(&with_tries(Some(AMQPValue::LongString(LongString::from(
                "many"
            ))))),
            0
        );
        assert_eq!(tries(&with_tries(Some(AMQPValue::Boolean(true)))), 0);
    }
}

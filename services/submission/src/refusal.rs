//! Refusing a message of an application's queue (a replay request, a
//! signal): copied to its queue's dead-letter queue with the reason in
//! `x-sas-reason`, then acknowledged; one too large to copy goes through
//! the broker's own dead-lettering, unread.

use sas::broker::{self, BrokerError, Received};
use sas::messages::RejectReason;

/// Dead-letters `delivery` with `reason` (after the caller counted it).
pub async fn refuse(delivery: &Received, reason: &RejectReason) -> Result<(), BrokerError> {
    if matches!(reason, RejectReason::TooLarge { .. }) {
        // Through the broker, not copied: a copy holds it twice.
        return broker::dead_letter(delivery).await;
    }
    broker::dead_letter_with(delivery, &reason.to_string()).await
}

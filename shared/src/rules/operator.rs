//! What an operator may do to an order: the refusals of `retry` and
//! `cancel`, which the state store enforces and the dashboard and `sasctl`
//! show ahead of time. Pure.

use crate::state::{ProcessState, StepState};

/// Why an operator may not retry an order in `state` (`undone`: some of its
/// steps were undone), or `None` when a retry is allowed. The one rule that
/// the state store's retry enforces and that tools show ahead of time.
pub fn retry_refusal(state: ProcessState, undone: bool) -> Option<&'static str> {
    if state != ProcessState::Error {
        Some("only error orders can be retried")
    } else if undone {
        Some("some of its steps were undone; cancel it to finish the undo")
    } else {
        None
    }
}

/// Why an operator may not cancel an order in `state`, or `None` when a
/// cancel is allowed (the state store's cancel enforces it).
pub fn cancel_refusal(state: ProcessState) -> Option<&'static str> {
    match state {
        ProcessState::Pending | ProcessState::Processing | ProcessState::Error => None,
        _ => Some("only pending, processing or error orders can be cancelled"),
    }
}

/// Whether any of these steps was undone or is being undone: their
/// idempotency keys are spent, so the order cannot go forward again.
pub fn any_undone(steps: impl IntoIterator<Item = StepState>) -> bool {
    steps
        .into_iter()
        .any(|s| matches!(s, StepState::Compensated | StepState::Compensating))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_error_orders_with_nothing_undone_can_be_retried() {
        assert_eq!(retry_refusal(ProcessState::Error, false), None);
        assert!(retry_refusal(ProcessState::Error, true).is_some_and(|w| w.contains("undone")));
        for state in [
            ProcessState::Pending,
            ProcessState::Processing,
            ProcessState::Processed,
            ProcessState::Compensating,
            ProcessState::Compensated,
        ] {
            assert!(retry_refusal(state, false).is_some(), "{state}");
        }
    }

    #[test]
    fn an_order_with_a_step_undone_or_being_undone_counts_as_undone() {
        assert!(!any_undone([StepState::Completed, StepState::NotStarted]));
        assert!(any_undone([StepState::Completed, StepState::Compensating]));
        assert!(any_undone([StepState::Compensated]));
    }

    #[test]
    fn pending_processing_and_error_orders_can_be_cancelled() {
        for state in [
            ProcessState::Pending,
            ProcessState::Processing,
            ProcessState::Error,
        ] {
            assert_eq!(cancel_refusal(state), None, "{state}");
        }
        for state in [
            ProcessState::Processed,
            ProcessState::Compensating,
            ProcessState::Compensated,
        ] {
            assert!(cancel_refusal(state).is_some(), "{state}");
        }
    }
}

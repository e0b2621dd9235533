//! What an operator may do to an order: [`retry`] one that failed,
//! [`cancel`] one that has not ended (or failed), and the refusals of both,
//! which the dashboard and `sasctl` show ahead of time. Pure.

use serde_json::json;

use super::order::{Context, Deciding, Decision, Event, Order};
use crate::messages::{EventKind, rfc3339};
use crate::state::{ProcessState, StepState};
use crate::workflow;

/// An operator's retry of an `error` order: back to `pending` with its
/// failure counts reset, to resume at its first incomplete step (the failed
/// one runs again, completed ones do not). Refused (why) for an order in
/// another state, or one some of whose steps were undone: their
/// idempotency keys are spent, so a remote that deduplicates would replay
/// the old answer instead of doing the step again; `cancel` finishes its
/// undo instead.
pub fn retry(order: &Order, ctx: Context<'_>) -> Result<Decision, &'static str> {
    let undone = any_undone(order.steps.iter().map(|s| s.state));
    if let Some(why) = retry_refusal(order.row.process_state, undone) {
        return Err(why);
    }
    let mut d = Deciding::new(order, ctx);
    for s in &mut d.order.steps {
        if matches!(
            s.state,
            StepState::Failed
                | StepState::Compensating
                | StepState::Compensated
                | StepState::Running
        ) {
            s.state = StepState::NotStarted;
            s.dispatch_id = None;
            s.complete_by = None;
            s.error = None;
        }
    }
    let o = &mut d.order.row;
    o.not_before = None;
    o.failure_count = 0;
    o.compensation_failures = 0;
    o.last_error = None;
    d.set_state(ProcessState::Pending, None, None);
    d.log(Event {
        kind: EventKind::RetryScheduled,
        from: Some(ProcessState::Error),
        to: ProcessState::Pending,
        step: None,
        attempt: 1,
        reason: Some("retried by an operator"),
        detail: json!({ "operator": true, "next_attempt_at": rfc3339::format(&ctx.now) }),
    });
    d.wake = true;
    Ok(d.done())
}

/// An operator's cancel of a `pending`, `processing` or `error` order: the
/// running step (if any) is withdrawn and the completed steps are undone,
/// newest first, by the schedulers. With nothing to undo the order ends
/// `compensated` at once. Refused (why) in any other state.
pub fn cancel(order: &Order, ctx: Context<'_>) -> Result<Decision, &'static str> {
    let from = order.row.process_state;
    if let Some(why) = cancel_refusal(from) {
        return Err(why);
    }
    let mut d = Deciding::new(order, ctx);
    d.withdraw_running();
    let undo = workflow::next_compensation(&d.order.views()) != workflow::Next::Finished;
    let (to, kind) = if undo {
        (ProcessState::Compensating, EventKind::Compensating)
    } else {
        (ProcessState::Compensated, EventKind::Compensated)
    };
    let attempt = d.row().attempt();
    d.set_state(to, None, None);
    let reason = "cancelled by an operator";
    d.order.row.last_error = Some(reason.into());
    d.log(Event {
        kind,
        from: Some(from),
        to,
        step: None,
        attempt,
        reason: Some(reason),
        detail: json!({ "cancelled": true }),
    });
    if undo {
        d.wake = true;
    } else {
        d.end(to);
    }
    Ok(d.done())
}

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

#[cfg(test)]
mod decisions {
    //! The operator's actions on whole orders.

    use super::*;
    use crate::rules::order::fixture::{ctx, pending};
    use crate::rules::scheduler::claim;

    fn failed(n: i32, done: usize) -> Order {
        let mut order = pending(n, |_| true);
        for s in &mut order.steps[..done] {
            s.state = StepState::Completed;
        }
        order.steps[done].state = StepState::Failed;
        order.row.process_state = ProcessState::Error;
        order.row.failure_count = 3;
        order.row.last_error = Some("boom".into());
        order
    }

    #[test]
    fn a_retry_resumes_at_the_failed_step_with_counts_reset() {
        let d = retry(&failed(3, 1), ctx("op")).expect("allowed");
        let row = &d.order.row;
        assert_eq!(row.process_state, ProcessState::Pending);
        assert_eq!((row.failure_count, row.last_error.as_ref()), (0, None));
        let states: Vec<_> = d.order.steps.iter().map(|s| s.state).collect();
        assert_eq!(
            states,
            [
                StepState::Completed,
                StepState::NotStarted,
                StepState::NotStarted
            ]
        );
        assert!(d.wake);
        let next = claim(&d.order, ctx("s1")).expect("claim");
        assert_eq!(next.requests().next().map(|(_, r)| r.step_index), Some(1));
    }

    #[test]
    fn a_retry_is_refused_once_a_step_was_undone() {
        let mut order = failed(2, 1);
        order.steps[0].state = StepState::Compensated;
        assert!(retry(&order, ctx("op")).is_err_and(|why| why.contains("undone")));
        order.row.process_state = ProcessState::Processed;
        assert!(retry(&order, ctx("op")).is_err());
    }

    #[test]
    fn a_cancel_withdraws_the_running_step_and_undoes_the_completed_ones() {
        let mut order = pending(3, |_| true);
        order.steps[0].state = StepState::Completed;
        let running = claim(&order, ctx("s1")).expect("claim").order;
        let d = cancel(&running, ctx("op")).expect("allowed");
        assert_eq!(d.order.row.process_state, ProcessState::Compensating);
        assert_eq!(d.order.row.locked_by, None);
        assert_eq!(d.order.steps[1].state, StepState::NotStarted);
        assert!(d.wake);
        assert_eq!(d.ended, None);
        let undo = claim(&d.order, ctx("s1")).expect("claim");
        assert_eq!(undo.requests().next().map(|(_, r)| r.step_index), Some(0));
    }

    #[test]
    fn a_cancel_with_nothing_to_undo_ends_the_order_at_once() {
        let d = cancel(&pending(2, |_| true), ctx("op")).expect("allowed");
        assert_eq!(d.ended, Some(ProcessState::Compensated));
        assert!(!d.wake);
        let mut done = pending(1, |_| true);
        done.row.process_state = ProcessState::Processed;
        assert!(cancel(&done, ctx("op")).is_err());
    }
}

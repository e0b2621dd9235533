//! What an operator may do to an order: [`retry`] one that failed,
//! [`cancel`] one that has not ended (or failed), [`redrive`] one that
//! ended without completing, maybe with a patched payload, and the
//! refusals of each, which the dashboard and `sasctl` show ahead of time.
//! Pure.

use serde_json::{Value, json};

use super::order::{Deciding, Decision, Event, Given, Order};
use crate::messages::{EventKind, RejectReason, payload_refusal, rfc3339};
use crate::model::StepRow;
use crate::state::{ProcessState, StepState};
use crate::workflow;

/// An operator's retry of an `error` order: back to `pending` with its
/// failure counts reset, to resume at its first incomplete step (the failed
/// one runs again, completed ones do not). Refused (why) for an order in
/// another state, or one some of whose steps were undone: their
/// idempotency keys are spent, so a remote that deduplicates would replay
/// the old answer instead of doing the step again; `cancel` finishes its
/// undo instead.
pub fn retry(order: &Order, ctx: Given<'_>) -> Result<Decision, &'static str> {
    let undone = any_undone(&order.steps);
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
    d.start_again(
        EventKind::RetryScheduled,
        ProcessState::Error,
        "retried by an operator",
        json!({ "operator": true, "next_attempt_at": rfc3339::format(&ctx.now) }),
    );
    Ok(d.done())
}

/// Why an order ended when an operator cancelled it.
pub const CANCELLED: &str = "cancelled by an operator";

/// An operator's cancel of a `pending`, `processing` or `error` order
/// (contract §4c): it is being undone from now on. Steps still running are
/// let finish or time out first (under the claim they were sent under, so
/// that a late success counts and is then undone); then every step that
/// completed or is in doubt is undone, newest first, by the schedulers.
/// With nothing to undo and nothing out, the order ends `compensated` at
/// once. Refused (why) in any other state.
pub fn cancel(order: &Order, ctx: Given<'_>) -> Result<Decision, &'static str> {
    if let Some(why) = cancel_refusal(order.row.process_state) {
        return Err(why);
    }
    Ok(cancelled(order, ctx))
}

/// The undo of a child order by its parent's step (contract §4d): a cancel
/// ([`cancel`]), which for a child that has been `processed` undoes its
/// completed steps too. Refused (why) when it is being undone or was.
pub fn undo_child(order: &Order, ctx: Given<'_>) -> Result<Decision, &'static str> {
    match order.row.process_state {
        ProcessState::Processed => Ok(cancelled(order, ctx)),
        state => cancel_refusal(state).map_or_else(|| Ok(cancelled(order, ctx)), Err),
    }
}

/// The cancel of `order`, allowed in its state.
fn cancelled(order: &Order, ctx: Given<'_>) -> Decision {
    let from = order.row.process_state;
    let mut d = Deciding::new(order, ctx);
    // Nothing is waited for once cancelled (§4d): no timer, no signal.
    d.withdraw_own_waits();
    // A step out whose undo does not exist needs no waiting for.
    let (undoable_out, other_out): (Vec<_>, Vec<_>) = d
        .order
        .steps
        .iter()
        .filter(|s| s.state == StepState::Running)
        .partition(|s| s.compensate.is_some());
    if undoable_out.is_empty() && !other_out.is_empty() {
        d.withdraw_running();
    }
    let running: Vec<String> = d
        .order
        .steps
        .iter()
        .filter(|s| s.state == StepState::Running)
        .map(|s| s.name.clone())
        .collect();
    let undo = workflow::anything_to_undo(&d.order.views());
    let (to, kind) = if undo {
        (ProcessState::Compensating, EventKind::Compensating)
    } else {
        (ProcessState::Compensated, EventKind::Compensated)
    };
    let attempt = d.row().attempt();
    // While steps are out, the claim they went under stays, so that their
    // answers count; the order's complete-by is theirs.
    let holder = d.row().locked_by.clone().filter(|_| d.any_out());
    let deadline = d.out_deadline();
    d.set_state(to, holder.as_deref(), deadline);
    d.order.row.last_error = Some(CANCELLED.into());
    let in_doubt = d.in_doubt_steps();
    d.log(Event {
        kind,
        from: Some(from),
        to,
        step: None,
        attempt,
        reason: Some(CANCELLED),
        detail: json!({
            "cancelled": true,
            "running": running,
            "in_doubt": !in_doubt.is_empty(),
            "in_doubt_steps": in_doubt,
        }),
    });
    if !undo {
        d.end(to);
    } else if !d.any_out() {
        d.wake = true;
    }
    d.done()
}

/// Why a redrive was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RedriveError {
    /// The order's state does not allow it ([`redrive_refusal`]).
    #[error("{0}")]
    NotAllowed(&'static str),
    /// The payload the patch gives is not one an order may carry: the
    /// submission's checks and limits ([`payload_refusal`]).
    #[error("the patched payload is refused: {0}")]
    Payload(RejectReason),
    /// The order was redriven as many times as its counter holds.
    #[error("the order was redriven {0} times, the most it can be")]
    TooMany(i32),
}

/// An operator's redrive of an ended order that did not complete
/// (`error`, or `compensated`) (contract §9): back to `pending` as redrive
/// N (the order's previous count plus one), its payload merged with `patch`
/// (RFC 7386) first when there is one. The steps completed and not undone
/// are kept; every other step (failed, undone, never run) is planned
/// afresh and runs again, with the idempotency key `<order_id>:<step>:rN`
/// ([`crate::messages::StepRequest::idempotency_key`]), so a remote that
/// remembers answers by key does it again instead of replaying an old
/// failure. Each step keeps its dispatch count, so the fencing token of
/// its next dispatch is greater than every one before (contract §8). The
/// `redriven` event records the payload before and after.
///
/// Refused (why) in another state, or when the patched payload is not one
/// a submission may carry (`max_payload_bytes`: its JSON text's limit).
pub fn redrive(
    order: &Order,
    patch: Option<&Value>,
    max_payload_bytes: usize,
    ctx: Given<'_>,
) -> Result<Decision, RedriveError> {
    let from = order.row.process_state;
    if let Some(why) = redrive_refusal(from, any_undo_in_doubt(&order.steps)) {
        return Err(RedriveError::NotAllowed(why));
    }
    let before = &order.row.payload;
    let mut after = before.clone();
    if let Some(patch) = patch {
        merge_patch(&mut after, patch);
    }
    if let Some(why) = payload_refusal(&after, max_payload_bytes) {
        return Err(RedriveError::Payload(why));
    }
    let n = order.row.redrives;
    let n = n.checked_add(1).ok_or(RedriveError::TooMany(n))?;
    let mut d = Deciding::new(order, ctx);
    for s in &mut d.order.steps {
        // Done and not undone: its effect stands, and its result is what
        // the later steps are given.
        if s.state == StepState::Completed {
            continue;
        }
        s.state = StepState::NotStarted;
        s.dispatch_id = None;
        s.complete_by = None;
        s.result = None;
        s.error = None;
        // Its `max_duration` counts from its first dispatch of this redrive.
        s.started_at = None;
        s.finished_at = None;
        s.warned = 0;
        // Its new key starts with nothing known of it.
        s.in_doubt = false;
        // `dispatches` stays: it is the fencing token, which only climbs.
    }
    let o = &mut d.order.row;
    o.payload = after.clone();
    o.redrives = n;
    d.start_again(
        EventKind::Redriven,
        from,
        "redriven by an operator",
        json!({
            "operator": true,
            "redrive": n,
            "before": before,
            "after": after,
        }),
    );
    Ok(d.done())
}

impl Deciding<'_> {
    /// Starts an ended order again from `from` (an operator's retry or
    /// redrive): `pending` now, its failures forgotten, attempt 1 again,
    /// and `kind` logged with `reason` and `detail`; the schedulers are woken.
    fn start_again(&mut self, kind: EventKind, from: ProcessState, reason: &str, detail: Value) {
        let o = &mut self.order.row;
        o.not_before = None;
        o.failure_count = 0;
        o.compensation_failures = 0;
        o.last_error = None;
        self.set_state(ProcessState::Pending, None, None);
        self.log(Event {
            kind,
            from: Some(from),
            to: ProcessState::Pending,
            step: None,
            attempt: 1,
            reason: Some(reason),
            detail,
        });
        self.wake = true;
    }
}

/// Why an operator may not redrive an order in `state`, or `None` when a
/// redrive is allowed: only an order that ended without completing
/// (`error`, whose terminal event is `failed`, or `compensated`), and none
/// of whose undos has an unknown outcome (`undo_in_doubt`; a redrive would
/// keep a step whose effect may be gone).
pub fn redrive_refusal(state: ProcessState, undo_in_doubt: bool) -> Option<&'static str> {
    match state {
        ProcessState::Error | ProcessState::Compensated if undo_in_doubt => {
            Some("an undo of one of its steps has an unknown outcome; cancel it to finish the undo")
        }
        ProcessState::Error | ProcessState::Compensated => None,
        _ => Some("only ended orders that did not complete (error or compensated) can be redriven"),
    }
}

/// Applies the JSON merge patch `patch` to `target` (RFC 7386, as amended
/// by RFC 7396): an object patch sets its members in `target` (merged
/// recursively; a `null` member removes it), and any other patch replaces
/// `target` whole. Recursion follows the patch, whose depth its parser
/// bounded (serde_json stops at 128 levels).
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(members) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(serde_json::Map::new());
    }
    if let Value::Object(fields) = target {
        for (key, value) in members {
            if value.is_null() {
                fields.remove(key);
            } else {
                merge_patch(fields.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
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

/// Whether any of these steps was undone, is being undone, or may have
/// been (its undo's outcome is unknown): their idempotency keys are spent,
/// so the order cannot go forward again.
pub fn any_undone<'a>(steps: impl IntoIterator<Item = &'a StepRow>) -> bool {
    steps.into_iter().any(|s| {
        matches!(s.state, StepState::Compensated | StepState::Compensating) || s.undo_in_doubt
    })
}

/// Whether an undo of any of these steps went out with no answer that
/// decided it.
pub fn any_undo_in_doubt<'a>(steps: impl IntoIterator<Item = &'a StepRow>) -> bool {
    steps.into_iter().any(|s| s.undo_in_doubt)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::order::fixture::pending;

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
    fn an_order_with_a_step_undone_being_undone_or_maybe_undone_counts_as_undone() {
        let with = |states: &[StepState]| {
            let mut order = pending(states.len() as i32, |_| true);
            for (s, state) in order.steps.iter_mut().zip(states) {
                s.state = *state;
            }
            order.steps
        };
        assert!(!any_undone(&with(&[
            StepState::Completed,
            StepState::NotStarted
        ])));
        assert!(any_undone(&with(&[
            StepState::Completed,
            StepState::Compensating
        ])));
        assert!(any_undone(&with(&[StepState::Compensated])));
        let mut maybe = with(&[StepState::Completed]);
        maybe[0].undo_in_doubt = true;
        assert!(any_undone(&maybe) && any_undo_in_doubt(&maybe));
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
    use crate::rules::scheduler::{Replied, apply_reply, claim};

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

    /// Undoes `d`'s order to the end, answering each undo with success:
    /// the steps undone, in order, and whether each was in doubt.
    fn undo_all(mut d: Decision) -> (Vec<(i32, bool)>, Decision) {
        let mut undone = Vec::new();
        loop {
            let next = d.requests().next().map(|(_, r)| r.clone());
            let Some(undo) = next else { break };
            assert_eq!(undo.direction, crate::messages::Direction::Compensate);
            undone.push((undo.step_index, undo.in_doubt));
            let ok = crate::messages::StepOutcome::Succeeded { result: json!({}) };
            let reply = crate::messages::StepReply::to(&undo, ok);
            d = match apply_reply(&d.order, &reply, ctx("s1")).expect("reply") {
                Replied::Applied(d) => *d,
                Replied::Stale(why) => panic!("stale: {why}"),
            };
        }
        (undone, d)
    }

    #[test]
    fn a_cancel_lets_the_running_step_finish_then_undoes_it_and_the_completed_ones() {
        let mut order = pending(3, |_| true);
        order.steps[0].state = StepState::Completed;
        let running = claim(&order, ctx("s1")).expect("claim");
        let call = running.requests().next().expect("step 1 out").1.clone();
        let d = cancel(&running.order, ctx("op")).expect("allowed");
        assert_eq!(d.order.row.process_state, ProcessState::Compensating);
        assert_eq!(
            d.order.row.locked_by.as_deref(),
            Some("s1"),
            "its answer still counts"
        );
        assert_eq!(d.order.steps[1].state, StepState::Running);
        assert_eq!(d.order.row.complete_by, Some(call.complete_by));
        assert!(!d.wake, "nothing to undo before it answers");
        assert_eq!(d.ended, None);
        // Its remote applied it and answers: accepted, then undone first.
        let ok = crate::messages::StepOutcome::Succeeded { result: json!({}) };
        let late = crate::messages::StepReply::to(&call, ok);
        let Replied::Applied(d) = apply_reply(&d.order, &late, ctx("s1")).expect("reply") else {
            panic!("the late success counts");
        };
        let (undone, d) = undo_all(*d);
        assert_eq!(undone, [(1, false), (0, false)]);
        assert_eq!(d.ended, Some(ProcessState::Compensated));
    }

    #[test]
    fn a_cancelled_step_that_never_answers_is_undone_in_doubt() {
        let mut order = pending(3, |_| true);
        order.steps[0].state = StepState::Completed;
        let running = claim(&order, ctx("s1")).expect("claim").order;
        let d = cancel(&running, ctx("op")).expect("allowed");
        let settings = crate::spec::SupervisorSettings::default();
        let (d, _) = crate::rules::supervisor::expire(&d.order, &settings, ctx("sup"));
        assert_eq!(
            (d.order.steps[1].state, d.order.steps[1].in_doubt),
            (StepState::NotStarted, true)
        );
        assert_eq!(d.order.row.failure_count, 0, "no failure of an undo");
        let d = claim(&d.order, ctx("s1")).expect("claim");
        let (undone, d) = undo_all(d);
        assert_eq!(undone, [(1, true), (0, false)]);
        let done = d.events().last().expect("compensated");
        assert_eq!(done.kind, EventKind::Compensated);
        assert_eq!(done.detail["in_doubt"], json!(true));
        assert_eq!(done.detail["in_doubt_steps"], json!(["s1"]));
    }

    #[test]
    fn a_cancel_with_only_steps_without_undo_out_ends_at_once() {
        let mut order = pending(2, |_| false);
        order.steps[0].state = StepState::Completed;
        let running = claim(&order, ctx("s1")).expect("claim").order;
        assert_eq!(running.steps[1].state, StepState::Running);
        let d = cancel(&running, ctx("op")).expect("allowed");
        assert_eq!(d.ended, Some(ProcessState::Compensated));
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

#[cfg(test)]
mod redrives {
    //! An operator's redrive (contract §9), with no database.

    use serde_json::json;

    use super::*;
    use crate::messages::Direction;
    use crate::rules::order::fixture::{ctx, pending};
    use crate::rules::scheduler::claim;

    /// Ended `state` after a run of three steps: the first completed, the
    /// second completed and undone, the third failed.
    fn ended(state: ProcessState) -> Order {
        let mut order = pending(3, |_| true);
        let s = &mut order.steps;
        s[0].state = StepState::Completed;
        s[0].dispatches = 1;
        s[0].result = Some(json!({ "kept": true }));
        s[1].state = StepState::Compensated;
        s[1].dispatches = 2;
        s[1].result = Some(json!({ "undone": true }));
        s[2].state = StepState::Failed;
        s[2].dispatches = 3;
        s[2].error = Some("HTTP 422".into());
        for step in s.iter_mut() {
            step.started_at = Some(crate::rules::order::fixture::now());
            step.finished_at = step.started_at;
        }
        order.row.process_state = state;
        order.row.failure_count = 1;
        order.row.compensation_failures = 1;
        order.row.last_error = Some("HTTP 422".into());
        order.row.payload = json!({ "sku": "A-1", "qty": 0, "note": "typo" });
        order.row.last_seq = 7;
        order
    }

    const LIMIT: usize = 1 << 20;

    #[test]
    fn a_redrive_keeps_the_steps_done_and_not_undone_and_plans_the_others_afresh() {
        let order = ended(ProcessState::Compensated);
        let patch = json!({ "qty": 2, "note": null });
        let d = redrive(&order, Some(&patch), LIMIT, ctx("operator:alice")).expect("allowed");
        let row = &d.order.row;
        assert_eq!(row.process_state, ProcessState::Pending);
        assert_eq!(row.redrives, 1);
        assert_eq!(row.payload, json!({ "sku": "A-1", "qty": 2 }));
        assert_eq!((row.failure_count, row.compensation_failures), (0, 0));
        assert_eq!(
            (row.last_error.as_ref(), row.locked_by.as_ref()),
            (None, None)
        );
        let states: Vec<_> = d.order.steps.iter().map(|s| s.state).collect();
        assert_eq!(
            states,
            [
                StepState::Completed,
                StepState::NotStarted,
                StepState::NotStarted
            ]
        );
        let [kept, undone, failed] = &d.order.steps[..] else {
            panic!("three steps");
        };
        assert_eq!(kept, &order.steps[0], "the step kept is untouched");
        assert_eq!(
            (undone.result.as_ref(), failed.error.as_ref()),
            (None, None)
        );
        assert_eq!((undone.started_at, failed.finished_at), (None, None));
        let dispatches: Vec<_> = d.order.steps.iter().map(|s| s.dispatches).collect();
        assert_eq!(dispatches, [1, 2, 3], "the fencing tokens only climb");
        assert!(d.wake);
        assert_eq!(d.ended, None);

        // One event, numbered next, with who, the payload before and after
        // and the redrive's number.
        let events: Vec<_> = d.events().collect();
        assert_eq!(events.len(), 1);
        let e = events[0];
        assert_eq!((e.seq, e.kind), (8, EventKind::Redriven));
        assert_eq!(
            (e.from, e.to),
            (Some(ProcessState::Compensated), ProcessState::Pending)
        );
        assert_eq!(e.actor, "operator:alice");
        assert_eq!(e.detail["redrive"], 1);
        assert_eq!(e.detail["before"], order.row.payload);
        assert_eq!(e.detail["after"], json!({ "sku": "A-1", "qty": 2 }));
        assert_eq!(d.order.row.last_seq, 8);
    }

    #[test]
    fn the_steps_run_again_under_the_redrives_key_with_a_greater_fencing_token() {
        let d = redrive(&ended(ProcessState::Error), None, LIMIT, ctx("op")).expect("allowed");
        assert_eq!(d.order.row.payload, ended(ProcessState::Error).row.payload);
        let next = claim(&d.order, ctx("s1")).expect("claim");
        let requests: Vec<_> = next.requests().map(|(_, r)| r.clone()).collect();
        assert_eq!(requests.len(), 1);
        let r = &requests[0];
        assert_eq!(
            (r.step_index, r.direction, r.redrive),
            (1, Direction::Forward, 1)
        );
        assert_eq!(r.idempotency_key(), format!("{}:s1:r1", r.order_id));
        assert_eq!(r.fencing_token, 3, "above its two dispatches before");
        assert_eq!(r.results.get("s0"), Some(&json!({ "kept": true })));
        assert!(
            !r.results.contains_key("s1"),
            "an undone step's result is gone"
        );
        assert_eq!(r.attempt, 1);
    }

    #[test]
    fn a_second_redrive_is_number_two_and_its_undo_keys_are_its_own() {
        let first = redrive(&ended(ProcessState::Error), None, LIMIT, ctx("op")).expect("first");
        let mut again = first.order;
        again.row.process_state = ProcessState::Compensated;
        let second = redrive(&again, None, LIMIT, ctx("op")).expect("second");
        assert_eq!(second.order.row.redrives, 2);
        let e = second.events().next().expect("event");
        assert_eq!((e.seq, e.detail["redrive"].as_i64()), (9, Some(2)));

        // A step kept since before any redrive is undone under the
        // redrive's undo key: its old undo key may hold an old failure.
        let mut undoing = second.order;
        undoing.row.process_state = ProcessState::Compensating;
        let undo = claim(&undoing, ctx("s1")).expect("claim");
        let (_, r) = undo.requests().next().expect("an undo");
        assert_eq!((r.step_index, r.direction), (0, Direction::Compensate));
        assert_eq!(
            r.idempotency_key(),
            format!("{}:s0:compensate:r2", r.order_id)
        );
        assert_eq!(r.fencing_token, 2);
    }

    #[test]
    fn only_orders_that_ended_without_completing_can_be_redriven() {
        for state in [ProcessState::Error, ProcessState::Compensated] {
            assert_eq!(redrive_refusal(state, false), None, "{state}");
            assert!(redrive_refusal(state, true).is_some_and(|why| why.contains("cancel")));
            assert!(
                redrive(&ended(state), None, LIMIT, ctx("op")).is_ok(),
                "{state}"
            );
        }
        for state in [
            ProcessState::Pending,
            ProcessState::Processing,
            ProcessState::Processed,
            ProcessState::Compensating,
        ] {
            assert!(redrive_refusal(state, false).is_some(), "{state}");
            let refused = redrive(&ended(state), None, LIMIT, ctx("op"));
            assert!(
                matches!(refused, Err(RedriveError::NotAllowed(why)) if why.contains("error or compensated")),
                "{state}: {refused:?}"
            );
        }
    }

    #[test]
    fn a_patched_payload_meets_the_limits_of_a_submitted_one() {
        let order = ended(ProcessState::Error);
        let refused =
            |patch: Value, limit: usize| match redrive(&order, Some(&patch), limit, ctx("op")) {
                Err(RedriveError::Payload(why)) => why.to_string(),
                other => panic!("{patch}: {other:?}"),
            };
        assert!(refused(json!([1]), LIMIT).contains("must be an object"));
        assert!(refused(json!({ "note": "a\u{0}b" }), LIMIT).contains("NUL"));
        assert!(refused(json!({ "m": 1.7e308 }), LIMIT).contains("1e300"));
        let mut deep = json!(1);
        for _ in 0..64 {
            deep = json!([deep]);
        }
        assert!(refused(json!({ "d": deep }), LIMIT).contains("64 levels"));
        assert!(refused(json!({ "big": "x".repeat(100) }), 64).contains("larger than the limit"));
        assert!(
            redrive(
                &order,
                Some(&json!({ "big": "x".repeat(100) })),
                200,
                ctx("op")
            )
            .is_ok()
        );
    }

    #[test]
    fn merge_patches_follow_rfc_7386() {
        // The examples of RFC 7396, appendix A.
        for (target, patch, result) in [
            (json!({"a":"b"}), json!({"a":"c"}), json!({"a":"c"})),
            (json!({"a":"b"}), json!({"b":"c"}), json!({"a":"b","b":"c"})),
            (json!({"a":"b"}), json!({"a":null}), json!({})),
            (
                json!({"a":"b","b":"c"}),
                json!({"a":null}),
                json!({"b":"c"}),
            ),
            (json!({"a":["b"]}), json!({"a":"c"}), json!({"a":"c"})),
            (json!({"a":"c"}), json!({"a":["b"]}), json!({"a":["b"]})),
            (
                json!({"a":{"b":"c"}}),
                json!({"a":{"b":"d","c":null}}),
                json!({"a":{"b":"d"}}),
            ),
            (json!({"a":[{"b":"c"}]}), json!({"a":[1]}), json!({"a":[1]})),
            (json!(["a", "b"]), json!(["c", "d"]), json!(["c", "d"])),
            (json!({"a":"b"}), json!(["c"]), json!(["c"])),
            (json!({"a":"foo"}), json!(null), json!(null)),
            (json!({"a":"foo"}), json!("bar"), json!("bar")),
            (json!({"e":null}), json!({"a":1}), json!({"e":null,"a":1})),
            (json!([1, 2]), json!({"a":"b","c":null}), json!({"a":"b"})),
            (
                json!({}),
                json!({"a":{"bb":{"ccc":null}}}),
                json!({"a":{"bb":{}}}),
            ),
        ] {
            let mut merged = target.clone();
            merge_patch(&mut merged, &patch);
            assert_eq!(merged, result, "{target} + {patch}");
        }
    }
}

//! The steps sas runs itself (contract §4d): a `wait` (for a duration, or
//! `until` a time) and a `signal` step. Neither goes to an agent: going
//! out marks the step `running` with its end as its complete-by, so the
//! state store holds the wait, not a sleeping process. A wait's end is
//! found by the supervisor's sweep of passed complete-bys ([`wake`]),
//! which completes it; a signal step completes when its signal comes
//! ([`signal`]), and at its timeout fails as a timed-out step does. Pure.

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use super::order::{Deciding, Decision, Event, Given, Order};
use crate::messages::{EventKind, rfc3339};
use crate::state::{ProcessState, StepState};
use crate::workflow::StepKind;

/// Why a signal is refused: it is never kept to be applied later.
pub const NOT_PROCESSING: &str = "the order is not running: nothing of it waits for a signal";
/// Why a signal is refused while the order runs.
pub const NOT_WAITING: &str = "no step of the order waits for this signal now";

impl Deciding<'_> {
    /// Marks the step at `pos`, a step sas runs itself, out: until
    /// `until`, or for its timeout (a wait's duration, a signal's timeout).
    pub(super) fn wait_out(&mut self, pos: usize, until: Option<DateTime<Utc>>) {
        let now = self.ctx.now;
        let dispatch_id = (self.ctx.new_id)();
        let step = &mut self.order.steps[pos];
        let end = until.unwrap_or_else(|| {
            now.checked_add_signed(chrono::Duration::milliseconds(step.timeout_ms))
                .unwrap_or(DateTime::<Utc>::MAX_UTC)
        });
        step.state = StepState::Running;
        step.dispatch_id = Some(dispatch_id);
        step.dispatches += 1;
        step.complete_by = Some(end);
        step.warned = 0;
        step.started_at.get_or_insert(now);
    }

    /// Completes the step at `pos`, out with sas itself, with `result`,
    /// told by `step_succeeded`.
    fn complete_own(&mut self, pos: usize, result: Value, detail: Value) {
        let now = self.ctx.now;
        let step = &mut self.order.steps[pos];
        step.state = StepState::Completed;
        step.result = Some(result);
        step.dispatch_id = None;
        step.complete_by = None;
        step.finished_at = Some(now);
        let name = step.name.clone();
        let (state, attempt) = (self.row().process_state, self.row().attempt());
        self.log(Event {
            kind: EventKind::StepSucceeded,
            from: Some(state),
            to: state,
            step: Some(&name),
            attempt,
            reason: None,
            detail,
        });
    }

    /// Takes back the steps sas runs itself that are out: an order given
    /// up has nothing to wait for, and they did nothing to undo.
    pub(super) fn withdraw_own_waits(&mut self) {
        for step in &mut self.order.steps {
            if step.state == StepState::Running && step.kind().held_by_sas() {
                step.state = StepState::NotStarted;
                step.dispatch_id = None;
                step.complete_by = None;
            }
        }
    }
}

/// The waits of `order` that have ended at `ctx.now` completed (result
/// `{"waited_until"}`), and the order driven on under its claim: `None`
/// when none has ended. Other steps past their complete-by are left to
/// [`super::supervisor::expire`] at the next sweep.
pub fn wake(order: &Order, ctx: Given<'_>) -> Option<Decision> {
    if order.row.process_state != ProcessState::Processing {
        return None;
    }
    let ended: Vec<(usize, DateTime<Utc>)> = order
        .steps
        .iter()
        .enumerate()
        .filter(|(_, s)| s.state == StepState::Running && matches!(s.kind(), StepKind::Wait { .. }))
        .filter_map(|(pos, s)| {
            s.complete_by
                .filter(|end| *end <= ctx.now)
                .map(|end| (pos, end))
        })
        .collect();
    if ended.is_empty() {
        return None;
    }
    let mut d = Deciding::new(order, ctx);
    for (pos, end) in ended {
        let result = json!({ "waited_until": rfc3339::format(&end) });
        d.complete_own(pos, result.clone(), json!({ "result": result }));
    }
    // A rule error here would be a corrupt order: leave it to expiry.
    d.drive().ok()?;
    Some(d.done())
}

/// The application's signal `name` with `data` for `order` (§4d): the
/// step waiting for it completes with `data` as its result and the order
/// goes on under its claim. Refused (why) when the order is not running or
/// no step of it waits for `name` now; a refused signal is not kept.
pub fn signal(
    order: &Order,
    name: &str,
    data: &Value,
    ctx: Given<'_>,
) -> Result<Decision, &'static str> {
    if order.row.process_state != ProcessState::Processing {
        return Err(NOT_PROCESSING);
    }
    let pos = order
        .steps
        .iter()
        .position(|s| s.state == StepState::Running && s.kind() == StepKind::Signal(name))
        .ok_or(NOT_WAITING)?;
    let mut d = Deciding::new(order, ctx);
    d.complete_own(pos, data.clone(), json!({ "result": data, "signal": name }));
    d.drive().map_err(|_| NOT_WAITING)?;
    Ok(d.done())
}

#[cfg(test)]
mod tests {
    use chrono::Duration;
    use serde_json::json;

    use super::super::order::fixture::{Known, ctx, now, order_of};
    use super::super::order::{Decision, Given, Order};
    use super::super::scheduler::{Replied, apply_reply, claim};
    use super::*;
    use crate::messages::{Direction, StepOutcome, StepReply, StepRequest};
    use crate::spec::SupervisorSettings;

    fn at(known: &Known, secs: i64) -> Given<'_> {
        Given {
            now: now() + Duration::seconds(secs),
            definitions: known,
            ..ctx("s1")
        }
    }

    fn requests(d: &Decision) -> Vec<StepRequest> {
        d.requests().map(|(_, r)| r.clone()).collect()
    }

    fn kinds(d: &Decision) -> Vec<&'static str> {
        d.events().map(|e| e.kind.as_str()).collect()
    }

    fn answered(d: &Decision, known: &Known, secs: i64, outcome: StepOutcome) -> Decision {
        let sent = requests(d).pop().expect("a request");
        match apply_reply(&d.order, &StepReply::to(&sent, outcome), at(known, secs)).expect("reply")
        {
            Replied::Applied(d) => *d,
            Replied::Stale(why) => panic!("stale: {why}"),
        }
    }

    fn ok() -> StepOutcome {
        StepOutcome::Succeeded { result: json!({}) }
    }

    #[test]
    fn a_wait_goes_out_to_no_agent_and_ends_by_the_supervisors_sweep() {
        let (order, known) = order_of(
            json!([{ "name": "cool-off", "wait": "10m" }, { "name": "ship", "agent": "ship" }]),
            json!({}),
        );
        let d = claim(&order, at(&known, 0)).expect("claim");
        assert!(requests(&d).is_empty(), "no agent runs a wait");
        let end = now() + Duration::minutes(10);
        assert_eq!(d.order.steps[0].state, StepState::Running);
        assert_eq!(d.order.steps[0].complete_by, Some(end));
        assert_eq!(
            d.order.row.complete_by,
            Some(end),
            "the store holds the wait"
        );
        // Before its end nothing wakes; a deadline warning does not count it late.
        assert!(wake(&d.order, at(&known, 599)).is_none());
        let settings = SupervisorSettings::default();
        assert!(super::super::supervisor::warn(&d.order, &settings, at(&known, 590)).is_none());
        let woke = wake(&d.order, at(&known, 601)).expect("ended");
        assert_eq!(woke.order.steps[0].state, StepState::Completed);
        assert_eq!(
            woke.order.steps[0].result,
            Some(json!({ "waited_until": rfc3339::format(&end) }))
        );
        assert_eq!(kinds(&woke), ["step_succeeded"]);
        let sent = requests(&woke);
        assert_eq!((sent.len(), sent[0].step.as_str()), (1, "ship"));
        assert_eq!(
            woke.order.row.locked_by, d.order.row.locked_by,
            "under the claim"
        );
        // The supervisor's rule wakes it rather than count it late.
        let (recovered, recovery) =
            super::super::supervisor::recover(&d.order, &settings, at(&known, 601));
        assert_eq!(recovery, super::super::supervisor::Recovery::Woke);
        assert_eq!(recovered.order.steps[0], woke.order.steps[0]);
        assert_eq!(kinds(&recovered), kinds(&woke));
        // A last wait ends the order.
        let (order, known) = order_of(json!([{ "name": "w", "wait": "1s" }]), json!({}));
        let d = claim(&order, at(&known, 0)).expect("claim");
        let woke = wake(&d.order, at(&known, 1)).expect("ended");
        assert_eq!(woke.order.row.process_state, ProcessState::Processed);
    }

    #[test]
    fn until_waits_for_the_time_its_expression_gives_and_a_bad_one_fails_the_step() {
        let at_time = now() + Duration::hours(2);
        let (order, known) = order_of(
            json!([{ "name": "w", "until": "payload.deliver_at" }, { "name": "x", "agent": "x" }]),
            json!({ "deliver_at": rfc3339::format(&at_time) }),
        );
        let d = claim(&order, at(&known, 0)).expect("claim");
        assert_eq!(d.order.steps[0].complete_by, Some(at_time));
        let (order, known) = order_of(
            json!([{ "name": "w", "until": "timestamp('2026-11-25T13:00:00Z') + duration('30m')" }]),
            json!({}),
        );
        let d = claim(&order, at(&known, 0)).expect("claim");
        assert_eq!(
            d.order.steps[0].complete_by,
            Some(now() + Duration::minutes(90))
        );
        for bad in ["payload.nothing", "'next tuesday'", "42"] {
            let (order, known) = order_of(json!([{ "name": "w", "until": bad }]), json!({}));
            let d = claim(&order, at(&known, 0)).expect("claim");
            assert_eq!(d.order.steps[0].state, StepState::Failed, "{bad}");
            assert!(
                d.order.steps[0]
                    .error
                    .as_deref()
                    .unwrap_or_default()
                    .starts_with("until: ")
            );
            assert_eq!(
                d.order.row.process_state,
                ProcessState::Error,
                "nothing to undo"
            );
        }
    }

    fn approval() -> (Order, Known) {
        order_of(
            json!([
                { "name": "reserve", "agent": "inv", "compensate": "inv-undo" },
                { "name": "approve", "signal": "approval", "timeout": "24h" },
                { "name": "charge", "agent": "pay", "input": { "by": "results.approve.by" } },
            ]),
            json!({}),
        )
    }

    #[test]
    fn a_signal_completes_its_step_with_its_data_and_the_order_goes_on() {
        let (order, known) = approval();
        let d = claim(&order, at(&known, 0)).expect("claim");
        let d = answered(&d, &known, 1, ok());
        assert!(requests(&d).is_empty(), "the signal step goes to no agent");
        assert_eq!(
            d.order.steps[1].complete_by,
            Some(now() + Duration::seconds(1) + Duration::hours(24))
        );
        let data = json!({ "by": "manager@example.com", "ok": true });
        assert_eq!(
            signal(&d.order, "refund", &data, at(&known, 2)).err(),
            Some(NOT_WAITING)
        );
        let signalled = signal(&d.order, "approval", &data, at(&known, 2)).expect("applied");
        assert_eq!(signalled.order.steps[1].state, StepState::Completed);
        assert_eq!(signalled.order.steps[1].result, Some(data.clone()));
        assert_eq!(kinds(&signalled), ["step_succeeded"]);
        let sent = requests(&signalled);
        assert_eq!(sent[0].step, "charge");
        assert_eq!(sent[0].payload, json!({ "by": "manager@example.com" }));
        // The same signal again: nothing waits for it any more.
        assert_eq!(
            signal(&signalled.order, "approval", &data, at(&known, 3)).err(),
            Some(NOT_WAITING)
        );
        let done = answered(&signalled, &known, 4, ok());
        assert_eq!(done.order.row.process_state, ProcessState::Processed);
        assert_eq!(
            signal(&done.order, "approval", &data, at(&known, 5)).err(),
            Some(NOT_PROCESSING)
        );
    }

    #[test]
    fn a_signal_before_its_step_waits_is_refused_not_kept() {
        let (order, known) = approval();
        assert_eq!(
            signal(&order, "approval", &json!({}), at(&known, 0)).err(),
            Some(NOT_PROCESSING)
        );
        let d = claim(&order, at(&known, 0)).expect("claim");
        // reserve is still out: approve does not wait yet.
        assert_eq!(
            signal(&d.order, "approval", &json!({}), at(&known, 0)).err(),
            Some(NOT_WAITING)
        );
        let d = answered(&d, &known, 1, ok());
        assert!(
            signal(&d.order, "approval", &json!({}), at(&known, 2)).is_ok(),
            "the refusal kept nothing"
        );
    }

    #[test]
    fn an_order_given_up_while_waiting_for_a_signal_is_undone_at_once() {
        let (order, known) = approval();
        let d = claim(&order, at(&known, 0)).expect("claim");
        let d = answered(&d, &known, 1, ok());
        let cancelled = super::super::operator::cancel(&d.order, at(&known, 2)).expect("cancel");
        assert_eq!(
            cancelled.order.steps[1].state,
            StepState::NotStarted,
            "withdrawn"
        );
        assert!(
            !cancelled.order.steps[1].in_doubt,
            "it did nothing anywhere"
        );
        assert_eq!(
            cancelled.order.row.process_state,
            ProcessState::Compensating
        );
        // Whoever drives it next undoes reserve: nothing waits for the signal.
        let views = cancelled.order.views();
        assert_eq!(
            super::super::scheduler::advance(ProcessState::Compensating, &views),
            Some(super::super::scheduler::Advance::Dispatch {
                steps: vec![0],
                direction: Direction::Compensate
            })
        );
    }

    #[test]
    fn a_signal_step_that_times_out_fails_as_a_timed_out_step_does() {
        let (order, known) = approval();
        let d = claim(&order, at(&known, 0)).expect("claim");
        let d = answered(&d, &known, 1, ok());
        let late = at(&known, 1 + 24 * 3600 + 1);
        assert!(wake(&d.order, late).is_none(), "a signal is no wait");
        let (expired, requeued) =
            super::super::supervisor::expire(&d.order, &SupervisorSettings::default(), late);
        assert!(requeued.is_some(), "counted as a failure and tried again");
        assert_eq!(expired.order.row.failure_count, 1);
    }
}

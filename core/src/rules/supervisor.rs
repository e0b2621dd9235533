//! What the supervisor decides when an order's complete-by has passed
//! (contract §4a): count the failure, then try again after the stored
//! retry schedule's wait, or give up once `supervisor.max_failures` is
//! reached. An order that was being undone counts its compensation's
//! failures instead and, out of tries, fails. Giving up (`Deciding::give_up`)
//! undoes the completed steps, newest first, or fails the order when there
//! is nothing to undo; the scheduler gives up the same way when a step
//! fails for good. Pure: no clock read, no I/O; the state store loads the
//! order, asks [`expire`] and writes the decision back.

use std::borrow::Cow;

use chrono::{DateTime, Utc};
use serde_json::json;

use super::breaker::Gate;
use super::order::{Deciding, Decision, Event, Given, Hold, Order};
use crate::messages::{EventKind, rfc3339};
use crate::spec::{SupervisorSettings, WorkflowSpec};
use crate::state::{ProcessState, StepState};
use crate::workflow;

/// Whether the supervisor's sweep loads `row`'s order at `now` (the pure
/// twin of the state store's `expired` query): driven by a scheduler and
/// past its step's complete-by, or held for an agent past its hold's end.
pub fn expired(row: &crate::model::OrderRow, now: DateTime<Utc>) -> bool {
    let driven = matches!(
        row.process_state,
        ProcessState::Processing | ProcessState::Compensating
    );
    let late = row.locked_by.is_some() && driven && row.complete_by.is_some_and(|by| by < now);
    let held_too_long = row.held_for.is_some() && row.hold_until.is_some_and(|until| until < now);
    late || held_too_long
}

/// What became of an expired order: the one form of the supervisor's
/// outcome, from the rule ([`recover`]) through the engine to the
/// service's log and its `supervisor_recoveries{action}` ([`Recovery::label`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// A wait of its had ended (§4d): completed, no failure counted, and
    /// the order went on.
    Woke,
    /// Put back for another attempt at `not_before`.
    Requeued { not_before: DateTime<Utc> },
    /// Held: its step's agent's breaker is open; no failure counted.
    Held,
    /// Given up: compensating, or ended when there was nothing (more) to undo.
    GaveUp,
}

impl Recovery {
    /// The `action` label of `supervisor_recoveries`.
    pub fn label(self) -> &'static str {
        match self {
            Recovery::Woke => "woke",
            Recovery::Requeued { .. } => "requeued",
            Recovery::Held => "held",
            Recovery::GaveUp => "gave_up",
        }
    }
}

/// The supervisor's policy for `order`: the workflow's own `max_failures`
/// and `retry_schedule` over `defaults` (contract §4b), as the order's
/// stored definition says (§4d), else as `configured` (the workflow's spec
/// in today's configuration) says.
pub fn policy<'s>(
    order: &Order,
    defaults: &'s SupervisorSettings,
    configured: Option<&WorkflowSpec>,
    ctx: Given<'_>,
) -> Cow<'s, SupervisorSettings> {
    match ctx.definition(&order.row).map(|d| &d.spec).or(configured) {
        Some(spec) => spec.failure_policy(defaults),
        None => Cow::Borrowed(defaults),
    }
}

/// The supervisor's rule for one order loaded as expired: a wait that has
/// ended is no failure, it wakes the order ([`super::waits::wake`]);
/// otherwise the order expires under `policy` ([`expire`]). With the
/// decision, what became of the order.
pub fn recover(order: &Order, policy: &SupervisorSettings, ctx: Given<'_>) -> (Decision, Recovery) {
    if let Some(decision) = super::waits::wake(order, ctx) {
        return (decision, Recovery::Woke);
    }
    let (decision, requeued) = expire(order, policy, ctx);
    let recovery = match requeued {
        Some(not_before) => Recovery::Requeued { not_before },
        None if decision.order.row.held_for.is_some() => Recovery::Held,
        None => Recovery::GaveUp,
    };
    (decision, recovery)
}

/// The supervisor's decision for `order`, whose complete-by had passed at
/// `ctx.now`: its running dispatch is withdrawn (a late reply to it is
/// stale), the failure is counted, and the order is put back for another
/// attempt after the retry schedule's wait, or given up. With the decision,
/// when the order was put back, the time it may start again.
pub fn expire(
    order: &Order,
    settings: &SupervisorSettings,
    ctx: Given<'_>,
) -> (Decision, Option<DateTime<Utc>>) {
    let mut d = Deciding::new(order, ctx);
    let held = order.row.held_for.is_some();
    if siblings_out_of_time(order) {
        // Given up (or cancelled), the order let its steps still running
        // finish, and one ran out of time: that is no failure of an undo,
        // nor a reason to wait for its agent's breaker. It is withdrawn, in
        // doubt (contract §4c), and the undoing goes on.
        d.withdraw_running();
        d.set_state(ProcessState::Compensating, None, None);
        d.wake = true;
        return (d.done(), None);
    }
    // A step whose agent's breaker is not closed ran late because the
    // agent cannot reach its remote: the order waits for it, no failure counted.
    if !held && let Some((step, gate)) = running_behind_a_breaker(order, ctx) {
        d.withdraw_running();
        d.hold(Hold::Breaker(gate), &step);
        return (d.done(), None);
    }
    d.withdraw_running();
    let before = d.row().clone();
    let expiry = Expiry {
        state: before.process_state,
        failure_count: before.failure_count,
        compensation_failures: before.compensation_failures,
        held,
    };
    let decision = at_deadline(expiry, ctx.now, settings);
    let failures = decision.failures;
    if decision.compensating {
        d.order.row.compensation_failures = failures;
    } else {
        d.order.row.failure_count = failures;
    }
    let (to, not_before, attempt) = match decision.next {
        Next::Fail => {
            d.fail(&decision.reason);
            return (d.done(), None);
        }
        Next::GiveUp => {
            d.wake = true;
            d.give_up(&decision.reason);
            return (d.done(), None);
        }
        Next::Retry {
            to,
            not_before,
            attempt,
            now,
        } => {
            d.wake |= now;
            (to, not_before, attempt)
        }
    };
    d.set_state(to, None, None);
    d.order.row.not_before = Some(not_before);
    let late = &decision.reason;
    d.log(Event {
        kind: EventKind::RetryScheduled,
        from: Some(before.process_state),
        to,
        step: None,
        attempt,
        reason: Some(late),
        detail: json!({
            "next_attempt_at": rfc3339::format(&not_before),
            "failure_count": if decision.compensating { before.failure_count } else { failures },
            "compensation": decision.compensating,
            "error": late,
        }),
    });
    (d.done(), Some(not_before))
}

/// The running step of `order` (its name) and the gate of its agent's
/// breaker, when that breaker is not closed (its probe included).
/// Whether `order` is being undone and waits only for forward steps (the
/// running siblings of the step that failed), none of its undos.
fn siblings_out_of_time(order: &Order) -> bool {
    order.row.process_state == ProcessState::Compensating
        && order.steps.iter().any(|s| s.state == StepState::Running)
        && !order
            .steps
            .iter()
            .any(|s| s.state == StepState::Compensating)
}

fn running_behind_a_breaker<'g>(order: &Order, ctx: Given<'g>) -> Option<(String, &'g Gate)> {
    let step = super::stuck::running_step(order)?;
    let agent = step.out_with()?;
    let gate = ctx.gates.iter().find(|g| g.agent == agent)?;
    Some((step.name.clone(), gate))
}

/// The deadline ladder (contract §8): the rungs of `settings.warn_at` that
/// `order`'s running step has passed at `ctx.now`, of which its dispatch
/// was not warned yet: a `deadline_warning` each, with the fraction and the
/// complete-by, and an alert at the last rung when `alert_at_warning` says
/// so. `None` when there is nothing to warn of.
pub fn warn(order: &Order, settings: &SupervisorSettings, ctx: Given<'_>) -> Option<Decision> {
    let state = order.row.process_state;
    let (pos, due) = ladder(state, &order.steps, &settings.warn_at, ctx.now)?;
    let step = &order.steps[pos];
    let complete_by = step.complete_by?;
    let &(last, _) = due.last()?;
    let mut d = Deciding::new(order, ctx);
    let name = step.name.clone();
    let attempt = d.row().attempt();
    for &(i, rung) in &due {
        let reason = format!("step {name} has used {:.0}% of its time", rung * 100.0);
        if settings.alert_at_warning && i + 1 == settings.warn_at.len() {
            d.alert(state, &reason);
        }
        d.log(Event {
            kind: EventKind::DeadlineWarning,
            from: Some(state),
            to: state,
            step: Some(&name),
            attempt,
            reason: Some(&reason),
            detail: json!({
                "step": name,
                "fraction": rung,
                "complete_by": rfc3339::format(&complete_by),
            }),
        });
    }
    d.order.steps[pos].warned = i16::try_from(last + 1).unwrap_or(i16::MAX);
    Some(d.done())
}

/// The step of an order in `state` that the deadline ladder watches (its
/// position), with the rungs of `warn_at` it has passed at `now` that its
/// dispatch was not warned of (index, fraction): the running step (the
/// compensating one, for an order being undone) with the soonest
/// complete-by, a wait excepted, since a wait's complete-by is its end, not
/// a deadline (§4d). `None` when there is nothing to warn of.
fn ladder(
    state: ProcessState,
    steps: &[crate::model::StepRow],
    warn_at: &[f64],
    now: DateTime<Utc>,
) -> Option<(usize, Vec<(usize, f64)>)> {
    let out = match state {
        ProcessState::Processing => StepState::Running,
        ProcessState::Compensating => StepState::Compensating,
        _ => return None,
    };
    let pos = steps
        .iter()
        .enumerate()
        .filter(|(_, s)| s.state == out && !matches!(s.kind(), workflow::StepKind::Wait { .. }))
        .min_by_key(|(_, s)| s.complete_by)
        .map(|(pos, _)| pos)?;
    let step = &steps[pos];
    let complete_by = step.complete_by?;
    if step.timeout_ms <= 0 {
        return None;
    }
    let budget = step.timeout_ms as f64;
    let left = (complete_by - now).num_milliseconds() as f64;
    let used = 1.0 - left / budget;
    let warned = usize::try_from(step.warned).unwrap_or(0);
    let due: Vec<(usize, f64)> = warn_at
        .iter()
        .copied()
        .enumerate()
        .skip(warned)
        .take_while(|&(_, rung)| used >= rung)
        .collect();
    (!due.is_empty()).then_some((pos, due))
}

/// Whether the supervisor's leader loads `row`'s order to warn of its
/// deadline at `now` (the pure twin of the state store's `warnable`
/// query): it is held by a scheduler, its complete-by has not passed (past
/// it, [`expire`] takes over), and [`warn`] has a rung to warn of.
pub fn warnable(
    row: &crate::model::OrderRow,
    steps: &[crate::model::StepRow],
    warn_at: &[f64],
    now: DateTime<Utc>,
) -> bool {
    row.locked_by.is_some()
        && row.complete_by.is_some_and(|by| by >= now)
        && ladder(row.process_state, steps, warn_at, now).is_some()
}

impl Deciding<'_> {
    /// Gives the order up (contract §4a, §4c): alerts, then compensates the
    /// completed steps and those in doubt, or fails it when there is
    /// nothing to undo. Any scheduler may claim it for the compensation;
    /// [`Deciding::give_up_and_drive`] dispatches it at once.
    pub(super) fn give_up(&mut self, reason: &str) {
        self.begin_giving_up(reason, false);
    }

    /// [`Deciding::give_up`], and the actor holds the order and dispatches
    /// the first compensation at once.
    pub(super) fn give_up_and_drive(&mut self, reason: &str) -> Result<(), super::RuleError> {
        if self.begin_giving_up(reason, true) {
            self.drive()?;
        }
        Ok(())
    }

    /// The order given up; whether it is compensating (not failed).
    fn begin_giving_up(&mut self, reason: &str, drive: bool) -> bool {
        self.withdraw_own_waits();
        if !workflow::anything_to_undo(&self.order.views()) {
            self.fail(reason);
            return false;
        }
        self.alert(ProcessState::Compensating, reason);
        let from = self.row().process_state;
        let attempt = self.row().attempt();
        self.order.row.last_error = Some(reason.into());
        // Steps still out keep the claim they were sent under, so that
        // their replies count (and are let finish before anything is undone).
        let holder = if drive {
            self.row().locked_by.clone()
        } else {
            None
        };
        let deadline = self.out_deadline();
        self.set_state(ProcessState::Compensating, holder.as_deref(), deadline);
        let in_doubt = self.in_doubt_steps();
        self.log(Event {
            kind: EventKind::Compensating,
            from: Some(from),
            to: ProcessState::Compensating,
            step: None,
            attempt,
            reason: Some(reason),
            detail: json!({
                "error": reason,
                "in_doubt": !in_doubt.is_empty(),
                "in_doubt_steps": in_doubt,
            }),
        });
        true
    }

    /// Ends the order in `error`, with an alert and a `failed` event.
    /// Steps still out (branches with nothing to undo) are withdrawn: their
    /// late answers are stale, and they no longer count against their
    /// agents' flow control.
    pub(super) fn fail(&mut self, reason: &str) {
        self.withdraw_running();
        self.alert(ProcessState::Error, reason);
        let o = self.row();
        let (from, attempt, failure_count) = (o.process_state, o.attempt(), o.failure_count);
        self.order.row.last_error = Some(reason.into());
        self.set_state(ProcessState::Error, None, None);
        self.log(Event {
            kind: EventKind::Failed,
            from: Some(from),
            to: ProcessState::Error,
            step: None,
            attempt,
            reason: Some(reason),
            detail: json!({ "error": reason, "failure_count": failure_count }),
        });
        self.end(ProcessState::Error);
    }
}

/// What an expired order looks like to the supervisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expiry {
    /// `processing` (a step ran late) or `compensating` (an undo ran late).
    pub state: ProcessState,
    /// Failures of the forward attempts so far.
    pub failure_count: i32,
    /// Failures of the compensation so far.
    pub compensation_failures: i32,
    /// It was held for a breaker longer than the agent's `max_hold`
    /// (rather than late with a step).
    pub held: bool,
}

/// The supervisor's decision for one expired order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AtDeadline {
    /// Whether the compensation (rather than the forward work) ran late:
    /// its failures are the ones counted.
    pub compensating: bool,
    /// The failure count after this one: the order's `failure_count`, or its
    /// `compensation_failures` when compensating.
    pub failures: i32,
    /// Why, for the event log and the status event.
    pub reason: String,
    /// What happens next.
    pub next: Next,
}

/// What happens to an expired order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Out of tries: give up and compensate the completed steps.
    GiveUp,
    /// Out of tries while compensating: the order fails.
    Fail,
    /// Try again from `to` (`pending`, or `compensating` to go on undoing)
    /// once `not_before` has come.
    Retry {
        to: ProcessState,
        not_before: DateTime<Utc>,
        /// The attempt the `retry_scheduled` event names.
        attempt: i32,
        /// Whether the retry may start at once (the schedulers are woken).
        now: bool,
    },
}

/// The decision for `order`, whose complete-by had passed at `now`.
pub fn at_deadline(order: Expiry, now: DateTime<Utc>, settings: &SupervisorSettings) -> AtDeadline {
    let compensating = order.state == ProcessState::Compensating;
    let failures = if compensating {
        order.compensation_failures
    } else {
        order.failure_count
    }
    .saturating_add(1);
    let cause = if order.held {
        "held longer than its agent's max_hold"
    } else {
        "complete-by passed"
    };
    let reason = format!("{cause} ({failures} of {} allowed)", settings.max_failures);
    let tries = u32::try_from(failures).unwrap_or(u32::MAX);
    if tries >= settings.max_failures {
        let (next, reason) = if compensating {
            (
                Next::Fail,
                format!("compensation could not complete: {reason}"),
            )
        } else {
            (Next::GiveUp, reason)
        };
        return AtDeadline {
            compensating,
            failures,
            reason,
            next,
        };
    }
    let delay =
        chrono::Duration::from_std(settings.retry_delay(tries)).unwrap_or(chrono::Duration::MAX);
    let not_before = now
        .checked_add_signed(delay)
        .unwrap_or(DateTime::<Utc>::MAX_UTC);
    let (to, attempt) = if compensating {
        (ProcessState::Compensating, order.failure_count + 1)
    } else {
        (ProcessState::Pending, failures + 1)
    };
    AtDeadline {
        compensating,
        failures,
        reason,
        next: Next::Retry {
            to,
            not_before,
            attempt,
            now: delay.is_zero(),
        },
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn settings(max_failures: u32, schedule: &[u64]) -> SupervisorSettings {
        SupervisorSettings {
            max_failures,
            retry_schedule: schedule.iter().map(|s| Duration::from_secs(*s)).collect(),
            ..SupervisorSettings::default()
        }
    }

    fn processing(failure_count: i32) -> Expiry {
        Expiry {
            state: ProcessState::Processing,
            failure_count,
            compensation_failures: 0,
            held: false,
        }
    }

    #[test]
    fn a_late_step_counts_a_failure_and_waits_as_the_schedule_says() {
        let now = Utc::now();
        let s = settings(3, &[60, 300]);
        let first = at_deadline(processing(0), now, &s);
        assert_eq!(first.failures, 1);
        assert_eq!(first.reason, "complete-by passed (1 of 3 allowed)");
        assert_eq!(
            first.next,
            Next::Retry {
                to: ProcessState::Pending,
                not_before: now + chrono::Duration::seconds(60),
                attempt: 2,
                now: false,
            }
        );
        let second = at_deadline(processing(1), now, &s);
        assert!(matches!(
            second.next,
            Next::Retry { not_before, attempt: 3, .. } if not_before == now + chrono::Duration::seconds(300)
        ));
    }

    #[test]
    fn the_last_entry_of_the_schedule_repeats_and_a_zero_wait_starts_at_once() {
        let now = Utc::now();
        let s = settings(10, &[0, 5]);
        assert!(matches!(
            at_deadline(processing(0), now, &s).next,
            Next::Retry { now: true, not_before, .. } if not_before == now
        ));
        assert!(matches!(
            at_deadline(processing(6), now, &s).next,
            Next::Retry { now: false, not_before, .. } if not_before == now + chrono::Duration::seconds(5)
        ));
    }

    #[test]
    fn reaching_max_failures_gives_up() {
        let decision = at_deadline(processing(2), Utc::now(), &settings(3, &[1]));
        assert_eq!(decision.next, Next::GiveUp);
        assert_eq!(decision.failures, 3);
        assert!(!decision.compensating);
        // Beyond the limit too (the limit was lowered meanwhile).
        assert_eq!(
            at_deadline(processing(9), Utc::now(), &settings(3, &[1])).next,
            Next::GiveUp
        );
    }

    #[test]
    fn a_late_compensation_counts_its_own_failures_and_fails_when_out_of_tries() {
        let now = Utc::now();
        let s = settings(2, &[7]);
        let undoing = Expiry {
            held: false,
            state: ProcessState::Compensating,
            failure_count: 4,
            compensation_failures: 0,
        };
        let again = at_deadline(undoing, now, &s);
        assert!(again.compensating);
        assert_eq!(
            again.failures, 1,
            "the compensation's failures, not the order's"
        );
        assert_eq!(
            again.next,
            Next::Retry {
                to: ProcessState::Compensating,
                not_before: now + chrono::Duration::seconds(7),
                attempt: 5,
                now: false,
            }
        );
        let out = at_deadline(
            Expiry {
                compensation_failures: 1,
                ..undoing
            },
            now,
            &s,
        );
        assert_eq!(out.next, Next::Fail);
        assert_eq!(
            out.reason,
            "compensation could not complete: complete-by passed (2 of 2 allowed)"
        );
    }

    #[test]
    fn an_endless_wait_does_not_overflow() {
        let decision = at_deadline(processing(0), DateTime::<Utc>::MAX_UTC, &settings(3, &[60]));
        assert!(matches!(
            decision.next,
            Next::Retry { not_before, .. } if not_before == DateTime::<Utc>::MAX_UTC
        ));
    }
}

#[cfg(test)]
mod decisions {
    //! The supervisor's decisions on whole orders.

    use std::time::Duration;

    use super::*;
    use crate::rules::Effect;
    use crate::rules::order::fixture::{ctx, now, pending};
    use crate::rules::scheduler::claim;
    use crate::state::StepState;

    fn settings(max_failures: u32) -> SupervisorSettings {
        SupervisorSettings {
            max_failures,
            retry_schedule: vec![Duration::from_secs(30)],
            ..SupervisorSettings::default()
        }
    }

    /// A claimed order of `n` steps, the first `done` of them completed.
    fn running(n: i32, done: usize) -> Order {
        let mut order = pending(n, |_| true);
        for s in &mut order.steps[..done] {
            s.state = StepState::Completed;
        }
        claim(&order, ctx("s1")).expect("claim").order
    }

    #[test]
    fn a_late_step_is_withdrawn_and_the_order_waits_for_its_next_attempt() {
        let order = running(2, 1);
        let (d, requeued) = expire(&order, &settings(3), ctx("sup"));
        let at = now() + chrono::Duration::seconds(30);
        assert_eq!(requeued, Some(at));
        let row = &d.order.row;
        assert_eq!(row.process_state, ProcessState::Pending);
        assert_eq!((row.locked_by.as_ref(), row.not_before), (None, Some(at)));
        assert_eq!(row.failure_count, 1);
        let late = &d.order.steps[1];
        assert_eq!(
            (late.state, late.dispatch_id),
            (StepState::NotStarted, None)
        );
        assert_eq!(d.order.steps[0].state, StepState::Completed);
        assert!(matches!(&d.effects[..], [Effect::Event(e)]
            if e.kind == EventKind::RetryScheduled && e.attempt == 2 && e.actor == "sup"));
        assert!(!d.wake, "nothing to run before the wait is over");
    }

    #[test]
    fn recover_names_what_became_of_each_expired_order_by_one_label_each() {
        let late = running(2, 1);
        let (d, recovery) = recover(&late, &settings(3), ctx("sup"));
        let at = now() + chrono::Duration::seconds(30);
        assert_eq!(recovery, Recovery::Requeued { not_before: at });
        assert_eq!(
            d,
            expire(&late, &settings(3), ctx("sup")).0,
            "the same decision"
        );
        let mut spent = running(2, 1);
        spent.row.failure_count = 2;
        assert_eq!(
            recover(&spent, &settings(3), ctx("sup")).1,
            Recovery::GaveUp
        );
        // Behind an open breaker: held, no failure counted.
        let gates = [crate::rules::breaker::Gate {
            agent: late.steps[1].agent.clone(),
            state: crate::rules::breaker::State::Open,
            since: Some(now()),
            probe_order: None,
            max_hold_ms: 60_000,
            forced: false,
        }];
        let behind = crate::rules::Given {
            gates: &gates,
            ..ctx("sup")
        };
        let (d, recovery) = recover(&late, &settings(3), behind);
        assert_eq!(recovery, Recovery::Held);
        assert_eq!(d.order.row.failure_count, 0);
        let labels = [
            Recovery::Woke,
            Recovery::Requeued { not_before: at },
            Recovery::Held,
            Recovery::GaveUp,
        ]
        .map(Recovery::label);
        assert_eq!(labels, ["woke", "requeued", "held", "gave_up"]);
    }

    #[test]
    fn the_policy_is_the_stored_definitions_else_the_configured_workflows_else_the_defaults() {
        let order = running(2, 1);
        let defaults = settings(3);
        assert_eq!(policy(&order, &defaults, None, ctx("sup")).max_failures, 3);
        let own: WorkflowSpec = serde_json::from_value(serde_json::json!({
            "steps": [{ "name": "a", "agent": "a" }],
            "max_failures": 7
        }))
        .expect("a spec");
        assert_eq!(
            policy(&order, &defaults, Some(&own), ctx("sup")).max_failures,
            7
        );
    }

    #[test]
    fn out_of_tries_the_order_is_given_up_for_any_scheduler_to_undo() {
        let mut order = running(2, 1);
        order.row.failure_count = 2;
        let (d, requeued) = expire(&order, &settings(3), ctx("sup"));
        assert_eq!(requeued, None);
        let row = &d.order.row;
        assert_eq!(row.process_state, ProcessState::Compensating);
        assert_eq!(row.locked_by, None, "left for any scheduler to claim");
        assert!(d.wake);
        assert!(
            matches!(&d.effects[..], [Effect::Alert(_), Effect::Event(e)] if e.kind == EventKind::Compensating)
        );
        assert_eq!(d.ended, None);
    }

    #[test]
    fn out_of_tries_with_nothing_to_undo_the_order_fails() {
        let mut order = pending(2, |_| false);
        order = claim(&order, ctx("s1")).expect("claim").order;
        order.row.failure_count = 2;
        let (d, _) = expire(&order, &settings(3), ctx("sup"));
        assert_eq!(d.ended, Some(ProcessState::Error));
        assert_eq!(d.order.row.failure_count, 3);
    }

    #[test]
    fn a_cancelled_orders_late_step_behind_an_open_breaker_is_undone_not_held() {
        let order = running(2, 1);
        let d = crate::rules::operator::cancel(&order, ctx("op")).expect("cancel");
        let gate = crate::rules::breaker::Gate {
            agent: d.order.steps[1].agent.clone(),
            state: crate::rules::breaker::State::Open,
            since: Some(now()),
            probe_order: None,
            max_hold_ms: 60_000,
            forced: false,
        };
        let gates = [gate];
        let late = crate::rules::Given {
            gates: &gates,
            ..ctx("sup")
        };
        let (d, _) = expire(&d.order, &settings(3), late);
        assert_eq!(d.order.row.held_for, None, "nothing to wait for");
        assert_eq!(d.order.row.process_state, ProcessState::Compensating);
        assert!(d.order.steps[1].in_doubt && d.wake);
        let undo = claim(&d.order, ctx("s2")).expect("claim");
        let (_, request) = undo.requests().next().expect("an undo");
        assert_eq!((request.step_index, request.in_doubt), (1, true));
    }

    #[test]
    fn out_of_tries_a_step_that_timed_out_is_in_doubt_and_undone() {
        // Its remote may have applied it and answered too late (contract §4c).
        let mut order = running(2, 0);
        order.row.failure_count = 2;
        let (d, _) = expire(&order, &settings(3), ctx("sup"));
        let step = &d.order.steps[0];
        assert_eq!((step.state, step.in_doubt), (StepState::NotStarted, true));
        assert_eq!(d.order.row.process_state, ProcessState::Compensating);
        let given_up = d.events().last().expect("compensating");
        assert_eq!(given_up.detail["in_doubt"], serde_json::json!(true));
        let undo = claim(&d.order, ctx("s2")).expect("claim");
        let (_, request) = undo.requests().next().expect("an undo");
        assert_eq!((request.step_index, request.in_doubt), (0, true));
        assert_eq!(request.outcome(), Some("unknown"));
        assert!(
            request.fencing_token > order.steps[0].dispatches.into(),
            "greater than every forward call's"
        );
    }

    /// The context at `ms` milliseconds after the fixture's clock.
    fn later(ms: i64) -> crate::rules::Given<'static> {
        crate::rules::Given {
            now: now() + chrono::Duration::milliseconds(ms),
            ..ctx("sup")
        }
    }

    #[test]
    fn each_rung_of_the_ladder_warns_once_per_dispatch() {
        let mut s = settings(3);
        s.warn_at = vec![0.5, 0.8];
        // The step's budget is 1 s, dispatched at the fixture's clock.
        let order = running(1, 0);
        assert_eq!(warn(&order, &s, later(400)), None, "below the first rung");
        let half = warn(&order, &s, later(500)).expect("the first rung");
        let events: Vec<_> = half.events().collect();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].kind, EventKind::DeadlineWarning);
        assert_eq!(events[0].detail["fraction"], 0.5);
        assert_eq!(events[0].detail["step"], "s0");
        assert_eq!(half.order.steps[0].warned, 1);
        assert_eq!(warn(&half.order, &s, later(700)), None, "warned already");
        let late = warn(&half.order, &s, later(850)).expect("the second rung");
        assert_eq!(late.order.steps[0].warned, 2);
        assert!(late.effects.iter().all(|e| !matches!(e, Effect::Alert(_))));
        assert_eq!(
            warn(&late.order, &s, later(990)),
            None,
            "the ladder is climbed"
        );
        // A new dispatch climbs it again.
        let (expired, _) = expire(&late.order, &s, later(1000));
        let again = claim(&expired.order, later(1000)).expect("claim").order;
        assert_eq!(again.steps[0].warned, 0);
        assert!(warn(&again, &s, later(1500)).is_some());
    }

    #[test]
    fn rungs_passed_together_warn_each_and_the_last_may_alert() {
        let mut s = settings(3);
        s.warn_at = vec![0.5, 0.8];
        s.alert_at_warning = true;
        let d = warn(&running(1, 0), &s, later(900)).expect("both rungs");
        let kinds: Vec<_> = d
            .effects
            .iter()
            .map(|e| match e {
                Effect::Event(e) => format!("{}:{}", e.kind.as_str(), e.detail["fraction"]),
                Effect::Alert(_) => "alert".into(),
                Effect::Request { .. } => "request".into(),
            })
            .collect();
        assert_eq!(
            kinds,
            ["deadline_warning:0.5", "alert", "deadline_warning:0.8"]
        );
        s.warn_at.clear();
        assert_eq!(warn(&running(1, 0), &s, later(900)), None, "no ladder");
        let mut done = running(1, 0);
        done.row.process_state = ProcessState::Processed;
        assert_eq!(warn(&done, &settings(3), later(900)), None);
    }

    #[test]
    fn a_late_undo_goes_back_to_completed_and_out_of_tries_fails() {
        let mut order = pending(2, |_| true);
        order.steps[0].state = StepState::Completed;
        order.row.process_state = ProcessState::Compensating;
        let undoing = claim(&order, ctx("s1")).expect("claim").order;
        assert_eq!(undoing.steps[0].state, StepState::Compensating);
        let (d, requeued) = expire(&undoing, &settings(2), ctx("sup"));
        assert!(requeued.is_some());
        assert_eq!(d.order.steps[0].state, StepState::Completed);
        assert_eq!(d.order.row.process_state, ProcessState::Compensating);
        assert_eq!(d.order.row.compensation_failures, 1);
        let again = claim(&d.order, ctx("s1")).expect("claim").order;
        let (d, _) = expire(&again, &settings(2), ctx("sup"));
        assert_eq!(d.ended, Some(ProcessState::Error));
    }
}

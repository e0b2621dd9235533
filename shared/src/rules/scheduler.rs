//! What the scheduler decides when an agent's reply comes: whether it still
//! counts (fencing), and what it does to its step. A reply counts only for
//! the order's state it was sent in, the claim that dispatched it, the
//! current attempt (forward steps) and the step's current dispatch; any
//! other reply is stale and changes nothing. Pure: the state store loads
//! the order and its steps, asks this rule and writes the change back.

use serde_json::Value;

use crate::messages::{Direction, EventKind, StepOutcome, StepReply};
use crate::state::{ProcessState, StepState};
use crate::state_store::{OrderRow, StepRow};
use crate::workflow::{self, StepView};

/// What the scheduler does next with an order it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advance {
    /// Send step `idx` to its agent, forward or to undo it.
    Dispatch { idx: i32, direction: Direction },
    /// Nothing left to run: the order ends in `state`, told by `event`.
    Finish {
        state: ProcessState,
        event: EventKind,
    },
}

/// The next move for an order in `state` with these steps: the first step
/// not completed (completed steps are never redone), or, while
/// compensating, the newest completed step that has an undo; `None` for an
/// order in a state the scheduler does not drive.
pub fn advance(state: ProcessState, steps: &[StepView<'_>]) -> Option<Advance> {
    let (next, direction, finished, event) = match state {
        ProcessState::Processing => (
            workflow::next_forward(steps),
            Direction::Forward,
            ProcessState::Processed,
            EventKind::Processed,
        ),
        ProcessState::Compensating => (
            workflow::next_compensation(steps),
            Direction::Compensate,
            ProcessState::Compensated,
            EventKind::Compensated,
        ),
        _ => return None,
    };
    Some(match next {
        workflow::Next::Run(idx) => Advance::Dispatch { idx, direction },
        workflow::Next::Finished => Advance::Finish {
            state: finished,
            event,
        },
    })
}

/// What an accepted reply does to its step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepChange<'r> {
    /// The step's position among the order's steps.
    pub pos: usize,
    /// The order's state the reply belongs to, which it stays in.
    pub order_state: ProcessState,
    /// The step's new state.
    pub to: StepState,
    /// The remote's result, for a forward step that succeeded.
    pub result: Option<&'r Value>,
    /// The remote's error, for a step or an undo that failed.
    pub error: Option<&'r str>,
}

/// Judges `reply` against the order and its steps: the change it makes, or
/// why it is stale.
pub fn judge_reply<'r>(
    order: &OrderRow,
    steps: &[StepRow],
    reply: &'r StepReply,
) -> Result<StepChange<'r>, String> {
    let (order_state, running, done) = match reply.direction {
        Direction::Forward => (
            ProcessState::Processing,
            StepState::Running,
            StepState::Completed,
        ),
        Direction::Compensate => (
            ProcessState::Compensating,
            StepState::Compensating,
            StepState::Compensated,
        ),
    };
    if order.process_state != order_state {
        return Err(format!("order is {}", order.process_state));
    }
    if order.locked_by.as_deref() != Some(reply.locked_by.as_str()) {
        return Err("order is held by another claim".into());
    }
    if reply.direction == Direction::Forward && order.attempt() != reply.attempt {
        return Err(format!(
            "attempt {} was superseded by attempt {}",
            reply.attempt,
            order.attempt()
        ));
    }
    let Some(pos) = steps
        .iter()
        .position(|s| s.idx == reply.step_index && s.name == reply.step)
    else {
        return Err("unknown step".into());
    };
    let step = &steps[pos];
    if step.state != running || step.dispatch_id != Some(reply.dispatch_id) {
        return Err("the dispatch was superseded".into());
    }
    let (to, result, error) = match (&reply.outcome, reply.direction) {
        (StepOutcome::Succeeded { result }, Direction::Forward) => (done, Some(result), None),
        (StepOutcome::Succeeded { .. }, Direction::Compensate) => (done, None, None),
        (StepOutcome::Failed { error }, Direction::Forward) => {
            (StepState::Failed, None, Some(error.as_str()))
        }
        // An undo that failed leaves the step done and not undone.
        (StepOutcome::Failed { error }, Direction::Compensate) => {
            (StepState::Completed, None, Some(error.as_str()))
        }
    };
    Ok(StepChange {
        pos,
        order_state,
        to,
        result,
        error,
    })
}

#[cfg(test)]
mod tests {
    use chrono::Utc;
    use serde_json::json;
    use uuid::Uuid;

    use super::*;

    fn order(state: ProcessState, failure_count: i32) -> OrderRow {
        let now = Utc::now();
        OrderRow {
            order_id: Uuid::new_v4(),
            workflow: "w".into(),
            payload: json!({}),
            reply_to: None,
            priority: 0,
            not_before: None,
            process_state: state,
            locked_by: Some("s1".into()),
            complete_by: Some(now),
            failure_count,
            compensation_failures: 0,
            last_seq: 3,
            last_error: None,
            created_at: now,
            updated_at: now,
            trace_id: None,
        }
    }

    fn step(order: &OrderRow, idx: i32, state: StepState, dispatch: Option<Uuid>) -> StepRow {
        StepRow {
            order_id: order.order_id,
            idx,
            name: format!("s{idx}"),
            agent: "a".into(),
            compensate: Some("a-undo".into()),
            timeout_ms: 1000,
            state,
            dispatches: 1,
            dispatch_id: dispatch,
            complete_by: None,
            result: None,
            error: None,
            started_at: None,
            finished_at: None,
        }
    }

    fn reply(order: &OrderRow, idx: i32, dispatch: Uuid, outcome: StepOutcome) -> StepReply {
        StepReply {
            order_id: order.order_id,
            step: format!("s{idx}"),
            step_index: idx,
            direction: Direction::Forward,
            attempt: order.attempt(),
            dispatch_id: dispatch,
            locked_by: "s1".into(),
            outcome,
        }
    }

    fn ok() -> StepOutcome {
        StepOutcome::Succeeded {
            result: json!({ "n": 1 }),
        }
    }

    #[test]
    fn an_order_runs_its_first_incomplete_step_and_undoes_newest_first() {
        let view = |idx, state, undo: Option<&'static str>| StepView {
            idx,
            state,
            compensate: undo,
        };
        let steps = [
            view(0, StepState::Completed, Some("u0")),
            view(1, StepState::Completed, None),
            view(2, StepState::NotStarted, Some("u2")),
        ];
        assert_eq!(
            advance(ProcessState::Processing, &steps),
            Some(Advance::Dispatch {
                idx: 2,
                direction: Direction::Forward
            })
        );
        assert_eq!(
            advance(ProcessState::Compensating, &steps),
            Some(Advance::Dispatch {
                idx: 0,
                direction: Direction::Compensate
            }),
            "step 1 has no undo, step 2 never ran"
        );
        let done = [view(0, StepState::Completed, None)];
        assert_eq!(
            advance(ProcessState::Processing, &done),
            Some(Advance::Finish {
                state: ProcessState::Processed,
                event: EventKind::Processed
            })
        );
        let undone = [view(0, StepState::Compensated, Some("u0"))];
        assert_eq!(
            advance(ProcessState::Compensating, &undone),
            Some(Advance::Finish {
                state: ProcessState::Compensated,
                event: EventKind::Compensated
            })
        );
        for state in [
            ProcessState::Pending,
            ProcessState::Error,
            ProcessState::Processed,
        ] {
            assert_eq!(advance(state, &steps), None, "{state}");
        }
    }

    #[test]
    fn a_current_reply_completes_or_fails_its_step() {
        let o = order(ProcessState::Processing, 0);
        let d = Uuid::new_v4();
        let steps = [
            step(&o, 0, StepState::Completed, Some(Uuid::new_v4())),
            step(&o, 1, StepState::Running, Some(d)),
        ];
        let r = reply(&o, 1, d, ok());
        let change = judge_reply(&o, &steps, &r).unwrap();
        assert_eq!(change.pos, 1);
        assert_eq!(change.to, StepState::Completed);
        assert_eq!(change.result, Some(&json!({ "n": 1 })));
        let failed = reply(
            &o,
            1,
            d,
            StepOutcome::Failed {
                error: "HTTP 422".into(),
            },
        );
        let change = judge_reply(&o, &steps, &failed).unwrap();
        assert_eq!(change.to, StepState::Failed);
        assert_eq!(change.error, Some("HTTP 422"));
    }

    #[test]
    fn an_undo_that_fails_leaves_its_step_completed() {
        let o = order(ProcessState::Compensating, 2);
        let d = Uuid::new_v4();
        let steps = [step(&o, 0, StepState::Compensating, Some(d))];
        let mut r = reply(&o, 0, d, StepOutcome::Failed { error: "no".into() });
        r.direction = Direction::Compensate;
        r.attempt = 1; // an undo is not fenced by the attempt
        assert_eq!(
            judge_reply(&o, &steps, &r).unwrap().to,
            StepState::Completed
        );
        r.outcome = ok();
        let change = judge_reply(&o, &steps, &r).unwrap();
        assert_eq!((change.to, change.result), (StepState::Compensated, None));
    }

    #[test]
    fn a_reply_counts_exactly_when_every_fence_matches() {
        use proptest::prelude::*;
        use proptest::test_runner::{Config, TestRunner};
        // Random orders and steps, and replies that keep or break each fence.
        let states = prop_oneof![
            Just(ProcessState::Pending),
            Just(ProcessState::Processing),
            Just(ProcessState::Compensating),
            Just(ProcessState::Error),
        ];
        let step_states = prop_oneof![
            Just(StepState::NotStarted),
            Just(StepState::Running),
            Just(StepState::Completed),
            Just(StepState::Compensating),
            Just(StepState::Compensated),
        ];
        let case = (
            states,
            0i32..3,
            proptest::collection::vec(step_states, 1..4),
            any::<bool>(),
            (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()),
            any::<prop::sample::Index>(),
        );
        let mut runner = TestRunner::new(Config {
            cases: 2000,
            failure_persistence: None,
            ..Config::default()
        });
        runner
            .run(
                &case,
                |(state, failures, states, compensate, breaks, which)| {
                    let o = order(state, failures);
                    let dispatches: Vec<Uuid> = states.iter().map(|_| Uuid::new_v4()).collect();
                    let steps: Vec<StepRow> = states
                        .iter()
                        .zip(&dispatches)
                        .enumerate()
                        .map(|(i, (s, d))| step(&o, i as i32, *s, Some(*d)))
                        .collect();
                    let pos = which.index(steps.len());
                    let mut r = reply(&o, pos as i32, dispatches[pos], ok());
                    if compensate {
                        r.direction = Direction::Compensate;
                    }
                    let (other_claim, old_attempt, other_dispatch, other_step) = breaks;
                    if other_claim {
                        r.locked_by = "s2".into();
                    }
                    if old_attempt {
                        r.attempt -= 1;
                    }
                    if other_dispatch {
                        r.dispatch_id = Uuid::new_v4();
                    }
                    if other_step {
                        r.step_index += 10;
                    }
                    let (order_state, running) = if compensate {
                        (ProcessState::Compensating, StepState::Compensating)
                    } else {
                        (ProcessState::Processing, StepState::Running)
                    };
                    let counts = state == order_state
                        && !other_claim
                        && (compensate || !old_attempt)
                        && !other_dispatch
                        && !other_step
                        && steps[pos].state == running;
                    let judged = judge_reply(&o, &steps, &r);
                    prop_assert_eq!(judged.is_ok(), counts, "{:?}", judged);
                    if let Ok(change) = judged {
                        prop_assert_eq!(change.pos, pos);
                        prop_assert_eq!(change.order_state, order_state);
                    }
                    Ok(())
                },
            )
            .unwrap();
    }

    #[test]
    fn a_reply_that_no_longer_counts_is_stale() {
        let o = order(ProcessState::Processing, 1);
        let d = Uuid::new_v4();
        let steps = [step(&o, 0, StepState::Running, Some(d))];
        let current = reply(&o, 0, d, ok());
        let stale = |r: &StepReply, o: &OrderRow, steps: &[StepRow]| {
            judge_reply(o, steps, r).expect_err("stale")
        };
        assert!(stale(&current, &order(ProcessState::Pending, 1), &steps).contains("order is"));
        let mut other_claim = current.clone();
        other_claim.locked_by = "s2".into();
        assert!(stale(&other_claim, &o, &steps).contains("another claim"));
        let mut old_attempt = current.clone();
        old_attempt.attempt = 1;
        assert!(stale(&old_attempt, &o, &steps).contains("superseded by attempt 2"));
        let mut unknown = current.clone();
        unknown.step = "nope".into();
        assert_eq!(stale(&unknown, &o, &steps), "unknown step");
        let mut old_dispatch = current.clone();
        old_dispatch.dispatch_id = Uuid::new_v4();
        assert!(stale(&old_dispatch, &o, &steps).contains("superseded"));
        // A duplicate of a reply already applied: the step is no longer running.
        let done = [step(&o, 0, StepState::Completed, Some(d))];
        assert!(stale(&current, &o, &done).contains("superseded"));
    }
}

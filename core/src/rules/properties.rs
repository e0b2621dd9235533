//! The pattern's invariants, checked over random histories of one order
//! (its steps in sequence, or in parallel branches of any shape): claims
//! by two schedulers, replies (current, duplicate and stale,
//! successes, failures and `held` answers), expiries, agents' breakers
//! opening, probing and closing, and operator retries and cancels, each
//! decided by the rules alone.

use std::collections::BTreeSet;
use std::time::Duration;

use proptest::prelude::*;
use serde_json::json;

use super::Given;
use super::breaker::{self, Admit, Gate, State};
use super::flow::{self, Flow};
use super::order::fixture::{Known, ctx, now, order_of, pending};
use super::scheduler::{Replied, apply_reply, claim};
use super::{Decision, Effect, Order, operator, submission, supervisor};
use crate::messages::{Direction, EventKind, StepOutcome, StepReply, StepRequest};
use crate::spec::SupervisorSettings;
use crate::state::{ProcessState, StepState};

/// What happens next to the order.
#[derive(Debug, Clone)]
enum Action {
    /// A scheduler (0 or 1) claims it, if it may be claimed.
    Claim(u8),
    /// A reply to one of the requests sent so far (any: a duplicate or a
    /// stale one too), succeeded or not, applied by scheduler 0 or 1.
    Reply(prop::sample::Index, bool, u8),
    /// Its deadline passes, if a step of it is running.
    Expire,
    /// An operator retries it.
    Retry,
    /// An operator cancels it.
    Cancel,
    /// The breaker of step `n`'s agent (or its undo's) opens, half-opens
    /// with this order as its probe, or closes.
    Breaker(u8, bool, u8),
    /// Step `n`'s agent has no room under flow control, or room again.
    Flow(u8, bool),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        3 => (0u8..2).prop_map(Action::Claim),
        6 => (any::<prop::sample::Index>(), prop::bool::weighted(0.8), 0u8..2)
            .prop_map(|(i, ok, s)| Action::Reply(i, ok, s)),
        2 => Just(Action::Expire),
        1 => Just(Action::Retry),
        1 => Just(Action::Cancel),
        2 => (0u8..4, any::<bool>(), 0u8..3).prop_map(|(n, undo, to)| Action::Breaker(n, undo, to)),
        2 => (0u8..4, any::<bool>()).prop_map(|(n, full)| Action::Flow(n, full)),
    ]
}

const SCHEDULERS: [&str; 2] = ["s1", "s2"];

/// The order, everything it sent and logged, and what the checks remember.
struct World {
    order: Order,
    sent: Vec<StepRequest>,
    seqs: Vec<i32>,
    /// Steps that completed at some point.
    completed: BTreeSet<i32>,
    /// Whether the order ended and no operator has reopened it since.
    ended: bool,
    /// The breakers that are not closed.
    gates: Vec<Gate>,
    /// `held` and `resumed` events logged.
    holds: (usize, usize),
    /// Whether a `held` was the order's last event of a hold.
    in_hold: bool,
    /// The agents with no room under flow control.
    full: Vec<Flow>,
}

impl World {
    /// Checks `decision`, taken on the world's order by `operator` or not,
    /// against every invariant, then takes it.
    fn take(&mut self, d: Decision, by_operator: bool) -> Result<(), TestCaseError> {
        let before = &self.order;
        // Exactly one terminal state: a decision that ends the order logs
        // one terminal event, last; only an operator acts on an ended order.
        let terminal: Vec<_> = d
            .events()
            .filter(|e| {
                matches!(
                    e.kind,
                    EventKind::Processed | EventKind::Compensated | EventKind::Failed
                )
            })
            .collect();
        prop_assert!(!self.ended || by_operator, "an ended order changed: {d:?}");
        match d.ended {
            Some(state) => {
                prop_assert_eq!(terminal.len(), 1);
                prop_assert_eq!(terminal[0].to, state);
                prop_assert_eq!(d.events().last().map(|e| e.seq), Some(terminal[0].seq));
                prop_assert_eq!(d.order.row.process_state, state);
                prop_assert!(d.order.row.locked_by.is_none());
            }
            None => {
                prop_assert!(terminal.is_empty(), "{:?}", terminal);
                prop_assert!(!d.order.row.process_state.is_terminal());
            }
        }
        let row = &d.order.row;
        if row.held_for.is_some() {
            // Held: nobody drives it, nothing runs, no deadline.
            prop_assert!(
                row.locked_by.is_none() && row.complete_by.is_none(),
                "{row:?}"
            );
            // A breaker's hold ends at max_hold; a wait for room does not.
            prop_assert_eq!(
                row.hold_until.is_some(),
                row.held_reason.as_deref() != Some("rate_limited"),
                "{:?}",
                row
            );
            prop_assert!(
                !d.order
                    .steps
                    .iter()
                    .any(|s| matches!(s.state, StepState::Running | StepState::Compensating)),
                "a held order has a step out: {:?}",
                d.order.steps
            );
        }
        // While steps are out, the order's deadline is the earliest of theirs.
        let out = d
            .order
            .steps
            .iter()
            .filter(|s| s.out_with().is_some())
            .filter_map(|s| s.complete_by)
            .min();
        if out.is_some() {
            prop_assert_eq!(row.complete_by, out, "{:?}", d.order.steps);
        }
        // Holding never counts a failure.
        if d.events().any(|e| e.kind == EventKind::Held) {
            prop_assert_eq!(row.failure_count, before.row.failure_count);
            prop_assert_eq!(row.compensation_failures, before.row.compensation_failures);
        }
        for (agent, _) in d.requests() {
            // Nothing goes to an agent with no room under flow control.
            prop_assert!(flow::room(&self.full, agent), "a request to full {agent}");
        }
        for (agent, r) in d.requests() {
            // Nothing goes to an agent whose breaker is open, but its probe.
            prop_assert!(
                !matches!(
                    breaker::admit(&self.gates, agent, r.order_id),
                    Admit::Hold(_)
                ),
                "a request to {agent} behind its open breaker: {:?}",
                self.gates
            );
            let step = &before.steps[r.step_index as usize];
            match r.direction {
                // A completed step is never dispatched again, and a step
                // only once every step it starts after has completed.
                Direction::Forward => {
                    prop_assert!(
                        !self.completed.contains(&r.step_index),
                        "redo of {}",
                        r.step_index
                    );
                    prop_assert_eq!(agent, step.agent.as_str());
                    prop_assert!(
                        step.after()
                            .iter()
                            .all(|a| d.order.steps[*a as usize].state.passed()),
                        "step {} before its after steps: {:?}",
                        r.step_index,
                        d.order.steps
                    );
                }
                // Undo only completed steps and steps in doubt (or one whose
                // undo was out and is sent again, after a `held` answer),
                // newest first; the call says which (contract §4c).
                Direction::Compensate => {
                    let now = &d.order.steps;
                    // (A branch let finish may complete in this very decision.)
                    let completes_now = d.events().any(|e| {
                        e.kind == EventKind::StepSucceeded && e.step.as_deref() == Some(&step.name)
                    });
                    let undoing = &now[r.step_index as usize];
                    // (A held answer puts a step in doubt in this very decision.)
                    prop_assert!(
                        matches!(step.state, StepState::Completed | StepState::Compensating)
                            || completes_now
                            || undoing.in_doubt,
                        "undo of a step neither completed nor in doubt: {:?}",
                        step
                    );
                    prop_assert_eq!(r.in_doubt, undoing.in_doubt);
                    prop_assert!(
                        r.fencing_token > i64::from(step.dispatches),
                        "an undo's token is not above the forward calls'"
                    );
                    prop_assert!(
                        now.iter()
                            .filter(|s| s.view().undoable())
                            .all(|s| (s.finished_at, s.idx) < (undoing.finished_at, undoing.idx)),
                        "a newer step is left undone: {:?}",
                        now
                    );
                    prop_assert_eq!(Some(agent), step.compensate.as_deref());
                    // Nothing is undone while a forward step still runs.
                    prop_assert!(
                        !now.iter().any(|s| s.state == StepState::Running),
                        "an undo beside a running step: {:?}",
                        now
                    );
                }
            }
            // The request is fenced by the step's current dispatch.
            prop_assert_eq!(
                d.order.steps[r.step_index as usize].dispatch_id,
                Some(r.dispatch_id)
            );
        }
        for e in &d.effects {
            if let Effect::Event(e) = e {
                self.seqs.push(e.seq);
                // A hold is announced once, whatever its probes, and ends
                // once (contract §4c): no `held` within a hold, no
                // `resumed` outside one; any other event ends it.
                match e.kind {
                    EventKind::Held => {
                        prop_assert!(!self.in_hold, "held again within a hold");
                        self.holds.0 += 1;
                        self.in_hold = true;
                    }
                    EventKind::Resumed => {
                        prop_assert!(self.in_hold, "resumed outside a hold");
                        self.holds.1 += 1;
                        self.in_hold = false;
                    }
                    // A step passed over by its condition (§4d) is no
                    // dispatch: the order may still be waiting to resume.
                    EventKind::StepSkipped => {}
                    _ => self.in_hold = false,
                }
            }
        }
        // `seq` has no gaps.
        prop_assert!(
            self.seqs.iter().copied().eq(1..=self.seqs.len() as i32),
            "{:?}",
            self.seqs
        );
        prop_assert_eq!(d.order.row.last_seq, self.seqs.len() as i32);
        self.completed.extend(
            d.order
                .steps
                .iter()
                .filter(|s| s.state == StepState::Completed)
                .map(|s| s.idx),
        );
        self.sent.extend(d.requests().map(|(_, r)| r.clone()));
        if d.ended.is_some() {
            self.ended = true;
        } else if by_operator {
            self.ended = false;
        }
        self.order = d.order;
        Ok(())
    }
}

/// Runs `actions` on an order of `steps` steps, step `i` undoable when bit
/// `i` of `undo` is set and started after the steps of the bits of
/// `after[i]` below `i` (acyclic by construction; all zero: every step at once).
fn run(
    steps: i32,
    undo: u8,
    after: Option<Vec<u8>>,
    actions: Vec<Action>,
    reached: &Reached,
) -> Result<(), TestCaseError> {
    let mut order = pending(steps, |i| undo & (1 << i) != 0);
    if let Some(after) = after {
        for (i, (step, bits)) in order.steps.iter_mut().zip(after).enumerate() {
            step.after_steps = Some((0..i as i32).filter(|b| bits & (1 << b) != 0).collect());
        }
    }
    run_order(order, Vec::new(), actions, reached)
}

/// Runs `actions` on `order`, which runs under the definition `known` has.
fn run_order(
    mut order: Order,
    known: Known,
    actions: Vec<Action>,
    reached: &Reached,
) -> Result<(), TestCaseError> {
    let settings = SupervisorSettings {
        max_failures: 3,
        retry_schedule: vec![Duration::ZERO],
        ..SupervisorSettings::default()
    };
    order.row.last_seq = 0;
    let received = submission::receive(&order, ctx("submission"));
    let mut world = World {
        order,
        sent: Vec::new(),
        seqs: Vec::new(),
        completed: BTreeSet::new(),
        ended: false,
        gates: Vec::new(),
        holds: (0, 0),
        in_hold: false,
        full: Vec::new(),
    };
    world.take(received, false)?;
    for action in actions {
        let gates = world.gates.clone();
        let full = world.full.clone();
        let with_gates = |actor| Given {
            gates: &gates,
            flows: &full,
            definitions: &known,
            ..ctx(actor)
        };
        let row = &world.order.row;
        match action {
            Action::Claim(s) => {
                // As `orders::claimable` selects: a held order once its
                // breaker closed or it is the probe.
                let waits = row.held_for.as_deref().is_some_and(|agent| {
                    matches!(breaker::admit(&gates, agent, row.order_id), Admit::Hold(_))
                });
                let claimable = row.process_state == ProcessState::Pending
                    || row.process_state == ProcessState::Compensating && row.locked_by.is_none();
                if claimable && !waits {
                    let d = claim(&world.order, with_gates(SCHEDULERS[s as usize]))
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    world.take(d, false)?;
                }
            }
            Action::Flow(n, no_room) => {
                let Some(step) = world.order.steps.get(usize::from(n)) else {
                    continue;
                };
                let agent = step.agent.clone();
                world.full.retain(|f| f.agent != agent);
                if no_room {
                    world.full.push(Flow {
                        agent,
                        max_in_flight: Some(1),
                        in_flight: 1,
                        rate_per_sec: None,
                        available: None,
                    });
                }
            }
            Action::Breaker(n, undo, to) => {
                let Some(step) = world.order.steps.get(usize::from(n)) else {
                    continue;
                };
                let agent = if undo {
                    step.compensate
                        .clone()
                        .unwrap_or_else(|| step.agent.clone())
                } else {
                    step.agent.clone()
                };
                world.gates.retain(|g| g.agent != agent);
                let state = match to {
                    0 => continue,
                    1 => State::Open,
                    _ => State::HalfOpen,
                };
                world.gates.push(Gate {
                    agent,
                    state,
                    since: Some(now()),
                    probe_order: (state == State::HalfOpen).then_some(row.order_id),
                    max_hold_ms: 60_000,
                    forced: false,
                });
            }
            Action::Reply(i, ok, s) => {
                if world.sent.is_empty() {
                    continue;
                }
                let pick = i.index(world.sent.len() * 5);
                let request = &world.sent[pick / 5];
                let outcome = if pick % 5 == 0 {
                    StepOutcome::Held { tried: false }
                } else if ok {
                    StepOutcome::Succeeded {
                        result: json!({ "step": request.step_index }),
                    }
                } else {
                    StepOutcome::Failed { error: "no".into() }
                };
                let reply = StepReply::to(request, outcome);
                let step = &world.order.steps[reply.step_index as usize];
                let current = step.dispatch_id == Some(reply.dispatch_id)
                    && row.locked_by.as_deref() == Some(reply.locked_by.as_str())
                    && matches!(step.state, StepState::Running | StepState::Compensating);
                match apply_reply(&world.order, &reply, with_gates(SCHEDULERS[s as usize]))
                    .map_err(|e| TestCaseError::fail(e.to_string()))?
                {
                    Replied::Applied(d) => {
                        if d.order
                            .steps
                            .iter()
                            .any(|s| s.state == StepState::Compensated)
                        {
                            reached
                                .undone
                                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        if let (Some(end), Ok(mut ended)) = (d.ended, reached.ended.lock()) {
                            ended.insert(end.as_str());
                        }
                        // Only the step's current dispatch counts.
                        prop_assert!(current, "a stale reply counted: {reply:?}");
                        world.take(*d, false)?;
                    }
                    // A stale reply changes nothing: there is no decision to take.
                    Replied::Stale(_) => {
                        reached
                            .stale
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let current_attempt = reply.direction == Direction::Compensate
                            || row.attempt() == reply.attempt;
                        prop_assert!(
                            !(current && current_attempt),
                            "a current reply was stale: {reply:?}"
                        );
                    }
                }
            }
            Action::Expire => {
                // A running step past its deadline, or a hold past max_hold.
                let running = matches!(
                    row.process_state,
                    ProcessState::Processing | ProcessState::Compensating
                ) && row.locked_by.is_some();
                if running || row.held_for.is_some() {
                    let (d, _) = supervisor::expire(&world.order, &settings, with_gates("sup"));
                    world.take(d, false)?;
                }
            }
            Action::Retry => {
                if let Ok(d) = operator::retry(&world.order, with_gates("op")) {
                    world.take(d, true)?;
                }
            }
            Action::Cancel => {
                if let Ok(d) = operator::cancel(&world.order, with_gates("op")) {
                    world.take(d, true)?;
                }
            }
        }
    }
    use std::sync::atomic::Ordering::Relaxed;
    reached.held.fetch_add(world.holds.0, Relaxed);
    reached.resumed.fetch_add(world.holds.1, Relaxed);
    Ok(())
}

/// What the histories reached, so that a test that explores nothing fails.
#[derive(Default)]
struct Reached {
    ended: std::sync::Mutex<BTreeSet<&'static str>>,
    stale: std::sync::atomic::AtomicUsize,
    undone: std::sync::atomic::AtomicUsize,
    held: std::sync::atomic::AtomicUsize,
    resumed: std::sync::atomic::AtomicUsize,
}

#[test]
fn every_history_keeps_the_invariants() {
    let mut runner = super::order::fixture::runner();
    let case = (
        1i32..5,
        any::<u8>(),
        proptest::option::of(proptest::collection::vec(any::<u8>(), 4)),
        proptest::collection::vec(action(), 1..80),
    );
    runner
        .run(&case, |(steps, undo, after, actions)| {
            run(steps, undo, after, actions, &REACHED)
        })
        .unwrap();
    let ended = REACHED.ended.lock().map(|e| e.clone()).unwrap_or_default();
    assert_eq!(
        ended,
        BTreeSet::from(["compensated", "error", "processed"]),
        "every end was reached"
    );
    assert!(REACHED.stale.load(std::sync::atomic::Ordering::Relaxed) > 100);
    let undone = REACHED.undone.load(std::sync::atomic::Ordering::Relaxed);
    assert!(undone > 20, "{undone} undos");
    let held = REACHED.held.load(std::sync::atomic::Ordering::Relaxed);
    let resumed = REACHED.resumed.load(std::sync::atomic::Ordering::Relaxed);
    // Resumes need a hold and a later close before a claim: rarer (18 to 40).
    assert!(held > 20 && resumed > 5, "{held} holds, {resumed} resumes");
}

static REACHED: std::sync::LazyLock<Reached> = std::sync::LazyLock::new(Reached::default);

#[test]
fn every_history_of_a_generated_workflow_keeps_the_invariants() {
    let mut runner = super::order::fixture::runner();
    let case = (
        super::net_effect::workflow(),
        proptest::collection::vec(action(), 1..80),
    );
    let reached = Reached::default();
    runner
        .run(&case, |((steps, payload), actions)| {
            let (order, known) = order_of(steps, payload);
            run_order(order, known, actions, &reached)
        })
        .unwrap();
    let ended = reached.ended.lock().map(|e| e.clone()).unwrap_or_default();
    assert_eq!(
        ended,
        BTreeSet::from(["compensated", "error", "processed"]),
        "every end was reached"
    );
    let undone = reached.undone.load(std::sync::atomic::Ordering::Relaxed);
    assert!(undone > 20, "{undone} undos");
}

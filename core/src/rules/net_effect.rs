//! The guarantee of contract §4c, checked over random histories of one
//! order against a model of its remotes: **an order that does not end
//! `processed` leaves no net effect at any remote, and a processed order
//! has each effect exactly once.**
//!
//! The remotes behave as the contract asks of them: a forward call applies
//! its effect at most once per idempotency key (a repeat replays the
//! answer), answers a permanent failure only when it did nothing, and may
//! apply an effect and then answer too late, or not at all; an undo of a
//! key never applied does nothing and succeeds; and a forward call whose
//! fencing token is older than the newest the key has seen (an undo's
//! included) is refused. Calls are made by agents in any order, repeated
//! (a redelivery after a crash), and late (a zombie); answers reach the
//! schedulers in any order, twice, or never. Deadlines pass, operators
//! cancel, retry and redrive, and steps run in parallel branches.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use proptest::prelude::*;
use serde_json::json;

use super::order::fixture::{Known, ctx, order_of, pending};
use super::scheduler::{Replied, apply_reply, claim};
use super::{Decision, Order, operator, submission, supervisor};
use crate::messages::{Direction, StepOutcome, StepReply, StepRequest};
use crate::spec::SupervisorSettings;
use crate::state::{ProcessState, StepState};

/// How a remote takes one call.
#[derive(Debug, Clone, Copy)]
enum Call {
    /// Applies it (or replays the answer) and answers.
    Apply,
    /// Applies it, and its answer comes too late: the agent says nothing.
    ApplyLate,
    /// Answers a permanent failure (only when it did nothing for the key).
    Refuse,
    /// Fails transiently until the deadline: nothing done, nothing said.
    Unreachable,
    /// The agent found its breaker open: no call, `held` answered.
    Held,
}

/// What happens next.
#[derive(Debug, Clone)]
enum Action {
    /// A scheduler claims the order, if it may be claimed.
    Claim,
    /// An agent calls the remote with one of the requests sent so far.
    Call(prop::sample::Index, Call),
    /// One of the answers given so far reaches a scheduler (again, maybe).
    Answer(prop::sample::Index),
    /// The order's deadline passes, if a step of it is out.
    Expire,
    Retry,
    Cancel,
    Redrive,
}

fn action() -> impl Strategy<Value = Action> {
    let call = prop_oneof![
        5 => Just(Call::Apply),
        2 => Just(Call::ApplyLate),
        1 => Just(Call::Refuse),
        2 => Just(Call::Unreachable),
        1 => Just(Call::Held),
    ];
    prop_oneof![
        3 => Just(Action::Claim),
        8 => (any::<prop::sample::Index>(), call).prop_map(|(i, c)| Action::Call(i, c)),
        6 => any::<prop::sample::Index>().prop_map(Action::Answer),
        2 => Just(Action::Expire),
        1 => Just(Action::Retry),
        1 => Just(Action::Cancel),
        1 => Just(Action::Redrive),
    ]
}

/// The remotes of every step, as one model: effects by forward key.
#[derive(Debug, Default)]
struct Remotes {
    /// Forward keys whose effect stands, with how often it was applied.
    applied: BTreeMap<String, u32>,
    /// Forward keys whose effect stands now.
    standing: BTreeSet<String>,
    /// The newest fencing token each forward key has seen (its undo's too).
    newest: BTreeMap<String, i64>,
    /// Forward keys answered with a permanent failure: a remote that
    /// deduplicates replays that answer for the key, and does nothing.
    refused: BTreeSet<String>,
    /// Requests whose agent answered `held`: it made no call and never will.
    dead: BTreeSet<usize>,
}

impl Remotes {
    /// The forward key a request's call is about (its undo's key names it).
    fn forward_key(r: &StepRequest) -> String {
        let forward = StepRequest {
            direction: Direction::Forward,
            ..r.clone()
        };
        forward.idempotency_key()
    }

    /// Request `i` (`r`) reaches its remote, which takes it as `how`:
    /// the agent's answer, if one reaches the scheduler.
    fn call(&mut self, i: usize, r: &StepRequest, how: Call) -> Option<StepOutcome> {
        if self.dead.contains(&i) {
            return None;
        }
        if let Call::Held = how {
            // This copy was not sent; another copy of the request (a
            // redelivery, or the outbox publishing it twice) may have been.
            self.dead.insert(i);
            return Some(StepOutcome::Held { tried: false });
        }
        let key = Self::forward_key(r);
        let newest = self.newest.entry(key.clone()).or_insert(r.fencing_token);
        let refused = r.fencing_token < *newest;
        *newest = (*newest).max(r.fencing_token);
        let ok = StepOutcome::Succeeded {
            result: json!({ "key": key }),
        };
        let failed = StepOutcome::Failed {
            error: "refused".into(),
        };
        if refused {
            return Some(failed);
        }
        if r.direction == Direction::Forward && self.refused.contains(&key) {
            return Some(failed);
        }
        match (r.direction, how) {
            (_, Call::Unreachable) => None,
            (Direction::Forward, Call::Refuse) if !self.applied.contains_key(&key) => {
                self.refused.insert(key);
                Some(failed)
            }
            (Direction::Forward, _) => {
                if !self.applied.contains_key(&key) {
                    self.applied.insert(key.clone(), 1);
                    self.standing.insert(key);
                }
                (!matches!(how, Call::ApplyLate)).then_some(ok)
            }
            // An undo is always possible, and harmless when nothing was done.
            (Direction::Compensate, _) => {
                self.standing.remove(&key);
                (!matches!(how, Call::ApplyLate)).then_some(ok)
            }
        }
    }

    /// How many effects of step `name` stand, over its redrives' keys.
    fn standing_of(&self, order: &Order, name: &str) -> usize {
        let prefix = format!("{}:{name}", order.row.order_id);
        self.standing
            .iter()
            .filter(|k| *k == &prefix || k.starts_with(&format!("{prefix}:r")))
            .count()
    }
}

/// The order, what it sent and what its remotes did.
struct World {
    order: Order,
    /// The definition the order runs under, if it has one.
    known: Known,
    sent: Vec<StepRequest>,
    /// The requests an agent called the remote with (or answered `held`).
    called: BTreeSet<usize>,
    answers: Vec<StepReply>,
    /// The answers before this one reached a scheduler (when catching up).
    delivered: usize,
    remotes: Remotes,
    /// An undo failed or ran out of time: the order may end `error` with
    /// effects left, which the operators were alerted to (contract §4a).
    undo_trouble: bool,
}

impl World {
    /// The rules' context for `actor`, with the order's definition.
    fn cx<'a>(&'a self, actor: &'a str) -> super::Given<'a> {
        super::Given {
            definitions: &self.known,
            ..ctx(actor)
        }
    }

    fn take(&mut self, d: Decision) {
        if self.order.row.process_state == ProcessState::Compensating
            && d.ended == Some(ProcessState::Error)
        {
            self.undo_trouble = true;
        }
        self.sent.extend(d.requests().map(|(_, r)| r.clone()));
        self.order = d.order;
    }

    /// An agent's answer reaches a scheduler.
    fn answer(&mut self, reply: &StepReply) -> Result<(), TestCaseError> {
        if let Replied::Applied(d) = apply_reply(&self.order, reply, self.cx("s1"))
            .map_err(|e| TestCaseError::fail(e.to_string()))?
        {
            self.take(*d);
        }
        Ok(())
    }

    fn act(&mut self, action: Action, settings: &SupervisorSettings) -> Result<(), TestCaseError> {
        let row = &self.order.row;
        match action {
            Action::Claim => {
                let claimable = row.process_state == ProcessState::Pending
                    || row.process_state == ProcessState::Compensating && row.locked_by.is_none();
                if claimable {
                    let d = claim(&self.order, self.cx("s1"))
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    self.take(d);
                }
            }
            Action::Call(i, how) => {
                if !self.sent.is_empty() {
                    let i = i.index(self.sent.len());
                    self.called.insert(i);
                    let request = self.sent[i].clone();
                    if let Some(outcome) = self.remotes.call(i, &request, how) {
                        self.answers.push(StepReply::to(&request, outcome));
                    }
                }
            }
            Action::Answer(i) => {
                if !self.answers.is_empty() {
                    let reply = self.answers[i.index(self.answers.len())].clone();
                    self.answer(&reply)?;
                }
            }
            Action::Expire => {
                let out = row.locked_by.is_some()
                    && matches!(
                        row.process_state,
                        ProcessState::Processing | ProcessState::Compensating
                    );
                if out {
                    let (d, _) = supervisor::expire(&self.order, settings, self.cx("sup"));
                    self.take(d);
                }
            }
            Action::Retry => {
                if let Ok(d) = operator::retry(&self.order, self.cx("op")) {
                    self.take(d);
                }
            }
            Action::Cancel => {
                if let Ok(d) = operator::cancel(&self.order, self.cx("op")) {
                    self.take(d);
                }
            }
            Action::Redrive => {
                if let Ok(d) = operator::redrive(&self.order, None, 1 << 20, self.cx("op")) {
                    self.take(d);
                }
            }
        }
        Ok(())
    }
}

/// Counts of what the histories reached, so that a test that explores
/// nothing fails.
#[derive(Debug, Default)]
struct Reached {
    processed: usize,
    /// Processed with a step skipped by its condition.
    skipped: usize,
    /// Processed with the items of a fan-out.
    items: usize,
    undone_clean: usize,
    undone_in_doubt: usize,
    late_effects_undone: usize,
}

/// A history of an order of `steps` steps (in sequence, or after the
/// earlier steps `after`'s bits name), each with an undo.
fn run(
    steps: i32,
    after: Option<Vec<u8>>,
    actions: Vec<Action>,
    reached: &mut Reached,
) -> Result<(), TestCaseError> {
    let mut order = pending(steps, |_| true);
    if let Some(after) = after {
        for (i, (step, bits)) in order.steps.iter_mut().zip(after).enumerate() {
            step.after_steps = Some((0..i as i32).filter(|b| bits & (1 << b) != 0).collect());
        }
    }
    run_order(order, Vec::new(), actions, reached)
}

/// A history of `order`, which runs under the definition `known` has.
fn run_order(
    order: Order,
    known: Known,
    actions: Vec<Action>,
    reached: &mut Reached,
) -> Result<(), TestCaseError> {
    let settings = SupervisorSettings {
        max_failures: 3,
        retry_schedule: vec![Duration::ZERO],
        ..SupervisorSettings::default()
    };
    let received = submission::receive(&order, ctx("submission"));
    let mut w = World {
        known,
        order: received.order,
        sent: Vec::new(),
        called: BTreeSet::new(),
        answers: Vec::new(),
        delivered: 0,
        remotes: Remotes::default(),
        undo_trouble: false,
    };
    for action in actions {
        w.act(action, &settings)?;
    }
    // Then the agents and the schedulers catch up, until the order ends:
    // every request not called yet is called and applied, every answer
    // reaches a scheduler, and a deadline passes only when nothing moves.
    for _ in 0..100 {
        if w.order.row.process_state.is_terminal() {
            break;
        }
        let before = (w.sent.len(), w.answers.len(), w.order.row.last_seq);
        w.act(Action::Claim, &settings)?;
        for i in 0..w.sent.len() {
            if w.called.insert(i) {
                let request = w.sent[i].clone();
                if let Some(outcome) = w.remotes.call(i, &request, Call::Apply) {
                    w.answers.push(StepReply::to(&request, outcome));
                }
            }
        }
        while w.delivered < w.answers.len() {
            let reply = w.answers[w.delivered].clone();
            w.delivered += 1;
            w.answer(&reply)?;
        }
        if before == (w.sent.len(), w.answers.len(), w.order.row.last_seq) {
            w.act(Action::Expire, &settings)?;
        }
    }
    // Zombies: every request ever sent is called once more, late.
    for i in 0..w.sent.len() {
        let request = w.sent[i].clone();
        w.remotes.call(i, &request, Call::ApplyLate);
    }
    let order = &w.order;
    match order.row.process_state {
        ProcessState::Processed => {
            reached.processed += 1;
            for s in &order.steps {
                // A skipped step (its condition false) never went out.
                let once = usize::from(s.state != StepState::Skipped);
                prop_assert_eq!(
                    w.remotes.standing_of(order, &s.name),
                    once,
                    "processed, but step {}'s effect is not there {} times: {:?}",
                    s.name,
                    once,
                    w.remotes
                );
            }
            prop_assert!(w.remotes.applied.values().all(|n| *n == 1));
            if order.steps.iter().any(|s| s.state == StepState::Skipped) {
                reached.skipped += 1;
            }
            if order
                .steps
                .iter()
                .any(|s| crate::workflow::item_of(&s.name).is_some())
            {
                reached.items += 1;
            }
        }
        ProcessState::Compensated | ProcessState::Error if !w.undo_trouble => {
            for s in &order.steps {
                prop_assert_eq!(
                    w.remotes.standing_of(order, &s.name),
                    0,
                    "ended {} with step {}'s effect left: {:?} {:?}",
                    order.row.process_state,
                    s.name,
                    w.remotes,
                    order.steps
                );
            }
            if order.row.process_state == ProcessState::Compensated {
                let in_doubt = order
                    .steps
                    .iter()
                    .any(|s| s.in_doubt && s.state == StepState::Compensated);
                if in_doubt {
                    reached.undone_in_doubt += 1;
                } else {
                    reached.undone_clean += 1;
                }
                // An effect applied with its answer lost, undone.
                let late = w
                    .sent
                    .iter()
                    .any(|r| r.direction == Direction::Compensate && r.in_doubt);
                if late && !w.remotes.applied.is_empty() {
                    reached.late_effects_undone += 1;
                }
            }
        }
        _ => {}
    }
    Ok(())
}

#[test]
fn an_order_that_does_not_end_processed_leaves_no_net_effect() {
    let mut runner = super::order::fixture::runner();
    let case = (
        1i32..5,
        proptest::option::of(proptest::collection::vec(any::<u8>(), 4)),
        proptest::collection::vec(action(), 1..60),
    );
    let reached = std::sync::Mutex::new(Reached::default());
    runner
        .run(&case, |(steps, after, actions)| {
            let mut r = Reached::default();
            run(steps, after, actions, &mut r)?;
            if let Ok(mut all) = reached.lock() {
                all.processed += r.processed;
                all.undone_clean += r.undone_clean;
                all.undone_in_doubt += r.undone_in_doubt;
                all.late_effects_undone += r.late_effects_undone;
            }
            Ok(())
        })
        .unwrap();
    let r = reached.lock().unwrap();
    assert!(r.processed > 50, "{r:?}");
    assert!(r.undone_clean > 20, "{r:?}");
    assert!(r.undone_in_doubt > 50, "{r:?}");
    assert!(r.late_effects_undone > 20, "{r:?}");
}

/// A generated workflow (§4d): each step after the earlier steps its bits
/// name, some with a condition (true, false, or over the payload or an
/// earlier result) and some running once per item of the payload's list,
/// a few at a time; every step with an undo.
pub(super) fn workflow() -> impl Strategy<Value = (serde_json::Value, serde_json::Value)> {
    let step = (any::<u8>(), 0u8..5, 0u8..3, 1u32..3);
    (proptest::collection::vec(step, 1..5), any::<bool>(), 0usize..4).prop_map(
        |(steps, flag, items)| {
            let steps: Vec<_> = steps
                .iter()
                .enumerate()
                .map(|(i, &(bits, when, each, max))| {
                    let mut s = json!({
                        "name": format!("s{i}"),
                        "agent": format!("a{i}"),
                        "compensate": format!("u{i}"),
                        "after": (0..i).filter(|b| bits & (1 << b) != 0).map(|b| format!("s{b}")).collect::<Vec<_>>(),
                    });
                    let earlier = i.checked_sub(1).map_or("true".to_owned(), |p| format!("has(results.s{p})"));
                    match when {
                        1 => s["when"] = json!("false"),
                        2 => s["when"] = json!("payload.flag"),
                        3 => s["when"] = json!(earlier),
                        _ => {}
                    }
                    if each == 1 {
                        s["for_each"] = json!("payload.items");
                        s["max_concurrency"] = json!(max);
                    }
                    s
                })
                .collect();
            let items: Vec<usize> = (0..items).collect();
            (json!(steps), json!({ "flag": flag, "items": items }))
        },
    )
}

#[test]
fn a_generated_workflow_with_conditions_and_fan_out_leaves_no_net_effect_unless_processed() {
    let mut runner = super::order::fixture::runner();
    let case = (workflow(), proptest::collection::vec(action(), 1..60));
    let reached = std::sync::Mutex::new((Reached::default(), 0usize, 0usize));
    runner
        .run(&case, |((steps, payload), actions)| {
            let (order, known) = order_of(steps, payload);
            let mut r = Reached::default();
            run_order(order, known, actions, &mut r)?;
            if let Ok(mut all) = reached.lock() {
                all.0.processed += r.processed;
                all.0.undone_clean += r.undone_clean + r.undone_in_doubt;
                all.1 += r.skipped;
                all.2 += r.items;
            }
            Ok(())
        })
        .unwrap();
    let (r, skipped, items) = &*reached.lock().unwrap();
    assert!(r.processed > 50, "{r:?}");
    assert!(r.undone_clean > 50, "{r:?}");
    assert!(
        *skipped > 50,
        "processed orders with a skipped step: {skipped}"
    );
    assert!(*items > 50, "processed orders with a fan-out: {items}");
}

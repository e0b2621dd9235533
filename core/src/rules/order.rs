//! What every rule works on and returns: an [`Order`] (its row and its
//! steps), the [`Given`] of a decision (who acts, the database's clock),
//! and the [`Decision`]: the order's new rows and, in the order they must
//! leave, the events to log and announce and the messages to send.
//!
//! A rule builds its decision on a [`Deciding`], whose small moves
//! (change state, log an event, send a request or an alert) the
//! scheduler's, the supervisor's and the operator's rules share.

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};
use uuid::Uuid;

use super::breaker::{self, Gate};
use crate::messages::{Alert, EventKind, StepRequest};
use crate::model::{OrderRow, StepRow};
use crate::state::{ProcessState, StepState};
use crate::workflow::StepView;

/// An order as the rules see it: its row and its steps, by index.
#[derive(Debug, Clone, PartialEq)]
pub struct Order {
    pub row: OrderRow,
    pub steps: Vec<StepRow>,
}

impl Order {
    /// What the step plan needs of the steps.
    pub fn views(&self) -> Vec<StepView<'_>> {
        self.steps.iter().map(StepRow::view).collect()
    }

    /// The results of the completed steps, by step name; a `for_each`
    /// step's is the list of its items' results in the items' order (null
    /// for an item with none yet).
    pub fn results(&self) -> Map<String, Value> {
        let mut results = Map::new();
        for s in &self.steps {
            match crate::workflow::item_of(&s.name) {
                None => {
                    if let Some(r) = &s.result {
                        results.insert(s.name.clone(), r.clone());
                    }
                }
                Some((base, index)) => {
                    let list = results
                        .entry(base.to_owned())
                        .or_insert_with(|| Value::Array(Vec::new()));
                    if let Value::Array(items) = list {
                        if items.len() <= index {
                            items.resize(index + 1, Value::Null);
                        }
                        items[index] = s.result.clone().unwrap_or(Value::Null);
                    }
                }
            }
        }
        results
    }
}

/// The facts a rule decides with besides the order.
#[derive(Debug, Clone, Copy)]
pub struct Given<'a> {
    /// The database's clock for this transaction: every time the decision writes.
    pub now: DateTime<Utc>,
    /// Who decides: written to the event log and, for schedulers, as the lock holder.
    pub actor: &'a str,
    /// Mints a dispatch id (`Uuid::now_v7` in the services).
    pub new_id: fn() -> Uuid,
    /// The agents' breakers that are not closed, as loaded with the orders.
    pub gates: &'a [Gate],
    /// The agents under flow control, with their room, as loaded with the
    /// orders and counted down by the unit's dispatches so far.
    pub flows: &'a [super::flow::Flow],
    /// The definitions the orders run under (contract §4d), by id.
    pub definitions: &'a [(Uuid, std::sync::Arc<crate::spec::Definition>)],
}

impl<'a> Given<'a> {
    /// The definition `row` runs under: the one it was submitted under,
    /// when it names one that is stored (`None`: it follows the
    /// configuration).
    pub fn definition(&self, row: &OrderRow) -> Option<&'a crate::spec::Definition> {
        let id = row.definition?;
        self.definitions
            .iter()
            .find(|(d, _)| *d == id)
            .map(|(_, d)| d.as_ref())
    }
}

/// An event a decision logs, with its number in the order's log; it is
/// also the order's status event when the order has a status queue.
#[derive(Debug, Clone, PartialEq)]
pub struct Logged {
    pub seq: i32,
    pub kind: EventKind,
    pub from: Option<ProcessState>,
    pub to: ProcessState,
    pub step: Option<String>,
    pub attempt: i32,
    pub actor: String,
    pub reason: Option<String>,
    pub detail: Value,
}

impl Logged {
    /// The status queue this event is announced on (contract §2, §2a), if
    /// any: the order's `reply_to`, when it asked for events of this kind
    /// and the queue is not one of sas's own (`reserved`, contract §1b: an
    /// order stored before such queues were refused may still name one).
    pub fn announced_to<'o>(
        &self,
        order: &'o OrderRow,
        reserved: impl Fn(&str) -> bool,
    ) -> Option<&'o str> {
        order
            .reply_to
            .as_deref()
            .filter(|q| order.events.publishes(self.kind) && !reserved(q))
    }
}

/// One thing a decision does besides changing rows, in the order they happen.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Log (and announce) an event.
    Event(Logged),
    /// Send a step (or its undo) to this agent.
    /// (Boxed: a request is several times the size of the other effects.)
    Request {
        agent: String,
        request: Box<StepRequest>,
    },
    /// Tell the operators.
    Alert(Alert),
}

/// What a rule decided for one order.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The order's rows as they are to be written back.
    pub order: Order,
    /// Events and messages, in order: an alert goes out before the events
    /// that follow it, a status event before the request it announces.
    pub effects: Vec<Effect>,
    /// Whether the schedulers should look for work when this commits.
    pub wake: bool,
    /// The terminal state the order reached, if it ended.
    pub ended: Option<ProcessState>,
    /// The flow-control room as the decision leaves it: the context's,
    /// counted down by its dispatches. The next decision of the same
    /// transition starts from it.
    pub flows: Vec<super::flow::Flow>,
    /// The agent under flow control of each dispatch that took room.
    pub took_room: Vec<String>,
}

impl Decision {
    /// The events logged, in order.
    pub fn events(&self) -> impl Iterator<Item = &Logged> {
        self.effects.iter().filter_map(|e| match e {
            Effect::Event(l) => Some(l),
            _ => None,
        })
    }

    /// The step requests sent, in order.
    pub fn requests(&self) -> impl Iterator<Item = (&str, &StepRequest)> {
        self.effects.iter().filter_map(|e| match e {
            Effect::Request { agent, request } => Some((agent.as_str(), &**request)),
            _ => None,
        })
    }
}

/// A rule and the stored order disagree: a bug, never a race (the order
/// is locked, or its write-back is guarded).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    /// The order is in a state the rule does not act on.
    #[error("order {order_id} is {found}, expected {expected}")]
    UnexpectedState {
        order_id: Uuid,
        found: ProcessState,
        expected: &'static str,
    },
    /// The order names a step its workflow does not have.
    #[error("order {order_id} has no step {idx}")]
    MissingStep { order_id: Uuid, idx: i32 },
    /// A step was to be undone but names no compensating agent.
    #[error("step {0} has no compensation")]
    NoCompensation(String),
}

/// A decision being built: the order as changed so far and what it does.
#[derive(Debug)]
pub struct Deciding<'c> {
    pub(super) order: Order,
    pub(super) effects: Vec<Effect>,
    pub(super) wake: bool,
    pub(super) ended: Option<ProcessState>,
    pub(super) ctx: Given<'c>,
    /// The flow-control room as loaded, counted down by this decision's
    /// own dispatches (steps in parallel may go to one agent).
    flows: Vec<super::flow::Flow>,
    /// The agent of each dispatch counted against its room.
    took_room: Vec<String>,
}

/// Why an order is held.
#[derive(Debug, Clone, Copy)]
pub(super) enum Hold<'g> {
    /// Its agent's breaker is open.
    Breaker(&'g Gate),
    /// Its agent has no room under its flow control.
    Flow(&'g str),
}

/// An event before it is numbered.
#[derive(Debug)]
pub(super) struct Event<'a> {
    pub kind: EventKind,
    pub from: Option<ProcessState>,
    pub to: ProcessState,
    pub step: Option<&'a str>,
    pub attempt: i32,
    pub reason: Option<&'a str>,
    pub detail: Value,
}

impl<'c> Deciding<'c> {
    /// Starts from the order as loaded.
    pub(super) fn new(order: &Order, ctx: Given<'c>) -> Self {
        Self {
            order: order.clone(),
            effects: Vec::new(),
            wake: false,
            ended: None,
            ctx,
            flows: ctx.flows.to_vec(),
            took_room: Vec::new(),
        }
    }

    /// The decision.
    pub(super) fn done(self) -> Decision {
        Decision {
            order: self.order,
            effects: self.effects,
            wake: self.wake,
            ended: self.ended,
            flows: self.flows,
            took_room: self.took_room,
        }
    }

    /// The order's row as changed so far.
    pub(super) fn row(&self) -> &OrderRow {
        &self.order.row
    }

    /// Moves the order to `to`, held by `locked_by`, with complete-by
    /// `deadline`; an order waiting for a breaker ([`Self::hold`]) is no
    /// longer held.
    pub(super) fn set_state(
        &mut self,
        to: ProcessState,
        locked_by: Option<&str>,
        deadline: Option<DateTime<Utc>>,
    ) {
        let o = &mut self.order.row;
        o.process_state = to;
        o.locked_by = locked_by.map(str::to_owned);
        o.complete_by = deadline;
        o.held_for = None;
        o.held_since = None;
        o.hold_until = None;
        o.held_reason = None;
    }

    /// Holds the order (contract §8, §4b): nobody drives it, no
    /// complete-by, no failure counted; pending (or compensating) again,
    /// its step (`step`) undispatched. Held for an open breaker, it is
    /// claimable once the breaker closes or picks it as its probe, and
    /// handled as a failure again after the agent's `max_hold`; held by flow
    /// control, it is claimable at once and dispatched when there is room.
    pub(super) fn hold(&mut self, why: Hold<'_>, step: &str) {
        let from = self.row().process_state;
        let to = match from {
            ProcessState::Compensating => ProcessState::Compensating,
            _ => ProcessState::Pending,
        };
        let now = self.ctx.now;
        let (agent, reason, since, until) = match why {
            Hold::Breaker(gate) => (
                gate.agent.as_str(),
                if gate.forced {
                    "forced_open"
                } else {
                    "breaker_open"
                },
                gate.since.unwrap_or(now),
                Some(breaker::after(now, gate.max_hold_ms)),
            ),
            Hold::Flow(agent) => (agent, "rate_limited", now, None),
        };
        // Its breaker's probe (this order's step) failed, or it was held
        // already (for another agent, or another reason): the hold it was
        // in goes on, from when it began, and was announced then
        // (contract §4c: a hold is announced once, whatever the probes).
        let ongoing = self.probing().or_else(|| {
            let o = self.row();
            o.held_for
                .as_ref()
                .and(o.held_since)
                .map(|since| (since, o.hold_until))
        });
        self.set_state(to, None, None);
        let o = &mut self.order.row;
        o.not_before = None;
        o.held_for = Some(agent.to_owned());
        o.held_reason = Some(reason.to_owned());
        if let Some((since, was_until)) = ongoing {
            o.held_since = Some(since);
            // A breaker's hold ends at max_hold from its start; a wait for
            // room has no end.
            o.hold_until = until.and(was_until.or(until));
            return;
        }
        o.held_since = Some(now);
        o.hold_until = until;
        let attempt = o.attempt();
        self.log(Event {
            kind: EventKind::Held,
            from: Some(from),
            to,
            step: Some(step),
            attempt,
            reason: Some(reason),
            detail: serde_json::json!({
                "agent": agent,
                "reason": reason,
                "since": crate::messages::rfc3339::format(&since),
            }),
        });
    }

    /// When the order is out as its breaker's probe, in the middle of a
    /// hold: when that hold began, and until when it may last. A probe keeps
    /// its hold's `held_since` and `hold_until` (not `held_for`: it is not
    /// held while out), so that a failed probe holds it again silently and
    /// an answered one announces `resumed` ([`Self::probe_answered`]).
    pub(super) fn probing(&self) -> Option<(DateTime<Utc>, Option<DateTime<Utc>>)> {
        let o = self.row();
        match (&o.held_for, o.held_since) {
            (None, Some(since)) => Some((since, o.hold_until)),
            _ => None,
        }
    }

    /// Keeps the hold going while the order is out as its breaker's probe
    /// (see [`Self::probing`]): after [`Self::set_state`], which ends it.
    pub(super) fn keep_hold(&mut self, since: DateTime<Utc>, until: Option<DateTime<Utc>>) {
        let o = &mut self.order.row;
        o.held_since = Some(since);
        o.hold_until = until;
    }

    /// The remote answered the order's probe: its hold is over, announced
    /// once with `resumed` (contract §4c).
    pub(super) fn probe_answered(&mut self, agent: &str, since: DateTime<Utc>) {
        let (state, attempt) = (self.row().process_state, self.row().attempt());
        let actor = self.ctx.actor.to_owned();
        self.log(Event {
            kind: EventKind::Resumed,
            from: Some(state),
            to: state,
            step: None,
            attempt,
            reason: None,
            detail: serde_json::json!({
                "agent": agent,
                "held_since": crate::messages::rfc3339::format(&since),
                "locked_by": actor,
            }),
        });
    }

    /// Logs `e` with the order's next event number (the numbers have no gaps).
    pub(super) fn log(&mut self, e: Event<'_>) {
        let o = &mut self.order.row;
        o.last_seq += 1;
        self.effects.push(Effect::Event(Logged {
            seq: o.last_seq,
            kind: e.kind,
            from: e.from,
            to: e.to,
            step: e.step.map(str::to_owned),
            attempt: e.attempt,
            actor: self.ctx.actor.to_owned(),
            reason: e.reason.map(str::to_owned),
            detail: e.detail,
        }));
    }

    /// Queues an operator alert, saying the order goes to `state` and why.
    pub(super) fn alert(&mut self, state: ProcessState, reason: &str) {
        let o = &self.order.row;
        self.effects.push(Effect::Alert(Alert {
            order_id: o.order_id,
            workflow: o.workflow.clone(),
            state: state.as_str().into(),
            reason: reason.into(),
            failure_count: o.failure_count,
            at: self.ctx.now,
        }));
    }

    /// The position of step `idx`.
    pub(super) fn step_pos(&self, idx: i32) -> Result<usize, RuleError> {
        self.order
            .steps
            .iter()
            .position(|s| s.idx == idx)
            .ok_or(RuleError::MissingStep {
                order_id: self.order.row.order_id,
                idx,
            })
    }

    /// Ends the order in `state`.
    pub(super) fn end(&mut self, state: ProcessState) {
        self.ended = Some(state);
    }

    /// Whether any step is out with an agent (forward or undo).
    pub(super) fn any_out(&self) -> bool {
        self.order.steps.iter().any(|s| s.out_with().is_some())
    }

    /// The earliest deadline of the steps out: the order's complete-by.
    pub(super) fn out_deadline(&self) -> Option<DateTime<Utc>> {
        self.order
            .steps
            .iter()
            .filter(|s| s.out_with().is_some())
            .filter_map(|s| s.complete_by)
            .min()
    }

    /// Who holds the order from here: while steps are out, the claim they
    /// were sent under (so that their replies still count); else the actor.
    pub(super) fn holder(&self) -> String {
        match &self.order.row.locked_by {
            Some(holder) if self.any_out() => holder.clone(),
            _ => self.ctx.actor.to_owned(),
        }
    }

    /// Whether one more step may go to `agent` under flow control.
    pub(super) fn has_room(&self, agent: &str) -> bool {
        super::flow::room(&self.flows, agent)
    }

    /// Counts a step dispatched to `agent` against its room.
    pub(super) fn took_room(&mut self, agent: &str) {
        if let Some(f) = self.flows.iter_mut().find(|f| f.agent == agent) {
            f.dispatched();
            self.took_room.push(agent.to_owned());
        }
    }

    /// Withdraws the order's running dispatches (a deadline passed, or the
    /// order ended while they ran): a late reply to them is stale. A
    /// forward step goes back to `not_started` **in doubt** (contract §4c):
    /// its remote may have applied it, so it is undone if the order gives
    /// up. An undo goes back to what it undid (`completed`, or in doubt),
    /// its own outcome in doubt: it is sent again before anything else.
    pub(super) fn withdraw_running(&mut self) {
        let now = self.ctx.now;
        for s in &mut self.order.steps {
            withdraw(s, now);
        }
    }

    /// Withdraws the steps sent before `before` ([`super::resend::sent_before`])
    /// as [`Self::withdraw_running`] does, and gives their room under flow
    /// control back to this decision, for their dispatches again.
    pub(super) fn withdraw_sent_before(&mut self, before: Uuid) {
        let now = self.ctx.now;
        for s in &mut self.order.steps {
            if !super::resend::sent_before(s, before) {
                continue;
            }
            if let Some(agent) = s.out_with()
                && let Some(f) = self.flows.iter_mut().find(|f| f.agent == agent)
            {
                f.in_flight -= 1;
            }
            withdraw(s, now);
        }
    }

    /// The names of the steps in doubt that are undone or to be undone.
    pub(super) fn in_doubt_steps(&self) -> Vec<String> {
        self.order
            .steps
            .iter()
            .filter(|s| s.in_doubt && s.compensate.is_some())
            .map(|s| s.name.clone())
            .collect()
    }
}

/// Withdraws `s` if it is out (running, or its undo compensating) at
/// `now`: its dispatch is forgotten, so a late reply to it is stale.
fn withdraw(s: &mut StepRow, now: DateTime<Utc>) {
    match s.state {
        StepState::Running => {
            s.state = StepState::NotStarted;
            // A step sas runs itself (§4d) did nothing anywhere.
            s.in_doubt |= !s.kind().held_by_sas();
            // When its outcome became unknown: its place in the undo order.
            s.finished_at = Some(now);
        }
        StepState::Compensating => {
            s.state = undo_withdrawn(s.in_doubt);
            s.undo_in_doubt = true;
        }
        _ => return,
    }
    s.dispatch_id = None;
    s.complete_by = None;
}

/// The state of a step whose undo was withdrawn or did not happen: back
/// to what the undo was for, `completed`, or (`in_doubt`) not started.
pub fn undo_withdrawn(in_doubt: bool) -> StepState {
    if in_doubt {
        StepState::NotStarted
    } else {
        StepState::Completed
    }
}

#[cfg(test)]
pub(crate) mod fixture {
    //! Orders to test the rules with.

    use chrono::{DateTime, TimeZone as _, Utc};
    use serde_json::json;
    use uuid::Uuid;

    use super::{Given, Order};
    use crate::model::NewOrder;
    use crate::model::{OrderRow, StepRow};
    use crate::workflow::Step;

    /// A fixed clock: the rules read no other.
    pub fn now() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 25, 12, 0, 0)
            .single()
            .unwrap_or_default()
    }

    /// A property test's runner: 1,000 generated cases, none kept on disk.
    pub fn runner() -> proptest::test_runner::TestRunner {
        proptest::test_runner::TestRunner::new(proptest::test_runner::Config {
            cases: 1000,
            failure_persistence: None,
            ..proptest::test_runner::Config::default()
        })
    }

    /// A context at [`now`] for `actor`.
    pub fn ctx(actor: &str) -> Given<'_> {
        Given {
            now: now(),
            actor,
            new_id: Uuid::new_v4,
            gates: &[],
            flows: &[],
            definitions: &[],
        }
    }

    /// The definitions a test's orders run under.
    pub type Known = Vec<(Uuid, std::sync::Arc<crate::spec::Definition>)>;

    /// A pending order of the workflow of `steps` (as configured), with
    /// `payload`, planned as the submission plans it, and its definition.
    pub fn order_of(steps: serde_json::Value, payload: serde_json::Value) -> (Order, Known) {
        let spec: crate::spec::WorkflowSpec =
            serde_json::from_value(json!({ "steps": steps })).expect("spec");
        let workflow = crate::workflow::Workflow::compile("w", &spec).expect("compiles");
        let mut order = pending(0, |_| false);
        order.steps = workflow
            .plan(&payload)
            .iter()
            .zip(0..)
            .map(|(s, idx)| StepRow::planned(order.row.order_id, idx, s))
            .collect();
        order.row.payload = payload;
        order.row.definition = Some(workflow.definition_id);
        (
            order,
            vec![(workflow.definition_id, workflow.definition.clone())],
        )
    }

    /// A pending order of `n` steps, each with an undo (`undo_agent`) when
    /// `undo` says so for its index.
    pub fn pending(n: i32, undo: impl Fn(i32) -> bool) -> Order {
        let order_id = Uuid::new_v4();
        let row = OrderRow {
            reply_to: Some("status".into()),
            last_seq: 1,
            ..OrderRow::pending(&NewOrder::new(order_id, "w", json!({ "n": n })), now())
        };
        let steps = (0..n)
            .map(|idx| {
                let step = Step {
                    name: format!("s{idx}"),
                    agent: format!("a{idx}"),
                    timeout: std::time::Duration::from_secs(1),
                    compensate: undo(idx).then(|| format!("u{idx}")),
                    after: crate::workflow::previous(idx).into_iter().collect(),
                    max_duration: std::time::Duration::from_secs(3600),
                    for_each: None,
                };
                StepRow::planned(order_id, idx, &step)
            })
            .collect();
        Order { row, steps }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use uuid::Uuid;

    use super::Logged;
    use crate::messages::{EventKind, Events};
    use crate::model::{NewOrder, OrderRow};
    use crate::state::ProcessState;

    fn logged(kind: EventKind) -> Logged {
        Logged {
            seq: 1,
            kind,
            from: None,
            to: ProcessState::Pending,
            step: None,
            attempt: 1,
            actor: "t".into(),
            reason: None,
            detail: json!({}),
        }
    }

    #[test]
    fn an_event_is_announced_on_the_orders_queue_when_it_asked_for_its_kind() {
        let reserved = |q: &str| q.starts_with("sas.");
        let mut order = OrderRow::pending(
            &NewOrder {
                reply_to: Some("shop.status".into()),
                ..NewOrder::new(Uuid::now_v7(), "w", json!({}))
            },
            chrono::Utc::now(),
        );
        let (step, end) = (
            logged(EventKind::StepSucceeded),
            logged(EventKind::Processed),
        );
        assert_eq!(step.announced_to(&order, reserved), Some("shop.status"));
        order.events = Events::Terminal;
        assert_eq!(step.announced_to(&order, reserved), None);
        assert_eq!(end.announced_to(&order, reserved), Some("shop.status"));
        order.reply_to = Some("sas.orders".into());
        assert_eq!(
            end.announced_to(&order, reserved),
            None,
            "never into sas's own"
        );
        order.reply_to = None;
        assert_eq!(end.announced_to(&order, reserved), None);
    }
}

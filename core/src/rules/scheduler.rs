//! What the scheduler decides: [`claim`] an order and dispatch its next
//! step, [`apply_reply`] of an agent (whether it still counts, by
//! [`judge_reply`]'s fences, and what it does to its step), and what comes
//! next ([`advance`]): the next step forward, the newest completed step to
//! undo, or the end. A reply counts only for the order's state it was sent
//! in, the claim that dispatched it, the current attempt (forward steps)
//! and the step's current dispatch; any other reply is stale and changes
//! nothing. Pure: the state store loads the order and its steps, asks
//! these rules and writes the decision back.

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use super::breaker::{self, Admit};
use super::conditions::{Launch, Prepared};
use super::flow;
use super::order::{
    Deciding, Decision, Effect, Event, Given, Hold, Order, RuleError, undo_withdrawn,
};
use crate::messages::{Direction, EventKind, StepOutcome, StepReply, StepRequest};
use crate::model::{OrderRow, StepRow};
use crate::state::{ProcessState, StepState};
use crate::workflow::{self, StepView};

/// The longest `Location` a heartbeat event quotes (contract §1b).
pub const MAX_LOCATION_BYTES: usize = 512;

/// Whether a scheduler may claim the order of `row` now, as the claim
/// query's `WHERE` has it (`state_store::orders::claimable`), stated once
/// more over the rules' own types so that it can be read and tested
/// without a database; a test compares the two over generated orders.
///
/// Claimable: `pending`, or `compensating` with no holder; not before its
/// `not_before`; if held for an agent's breaker, that breaker closed (not
/// among `gates`) or its probe this order's; if held by flow control, its
/// agent with room again (`flows`).
pub fn claimable(
    row: &OrderRow,
    now: DateTime<Utc>,
    gates: &[breaker::Gate],
    flows: &[flow::Flow],
) -> bool {
    let state = match row.process_state {
        ProcessState::Pending => true,
        ProcessState::Compensating => row.locked_by.is_none(),
        _ => false,
    };
    let due = row.not_before.is_none_or(|t| t <= now);
    let held_for = row.held_for.as_deref();
    let breaker_lets = held_for.is_none_or(|agent| {
        !gates.iter().any(|g| {
            g.agent == agent
                && g.state != breaker::State::Closed
                && g.probe_order != Some(row.order_id)
        })
    });
    let flow_lets = row.held_reason.as_deref() != Some("rate_limited")
        || !flows
            .iter()
            .any(|f| Some(f.agent.as_str()) == held_for && !f.has_room());
    state && due && breaker_lets && flow_lets
}

/// `ctx.actor` claims `order` (a `pending` one, which starts `processing`, or
/// a `compensating` one that nobody drives) and dispatches its next steps,
/// or finishes it when nothing is left to run.
pub fn claim(order: &Order, ctx: Given<'_>) -> Result<Decision, RuleError> {
    match claim_or_wait(order, ctx)? {
        Claim::Decided(decision) => Ok(*decision),
        Claim::Waits => Ok(Deciding::new(order, ctx).done()),
    }
}

/// What a claim comes to.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// The order's new rows and messages: claimed (its next steps
    /// dispatched, or finished when nothing was left), or held now for an
    /// agent with no room under flow control.
    Decided(Box<Decision>),
    /// No room under its agent's flow control, and held for that agent
    /// already: nothing changes, and the claim passes it by.
    Waits,
}

/// [`claim`], saying when nothing changes ([`Claim::Waits`]) rather than
/// returning the order as it was: what the store writes back, or skips.
pub fn claim_or_wait(order: &Order, ctx: Given<'_>) -> Result<Claim, RuleError> {
    let mut d = Deciding::new(order, ctx);
    let from = d.row().process_state;
    let to = match from {
        ProcessState::Pending => ProcessState::Processing,
        ProcessState::Compensating => ProcessState::Compensating,
        found => {
            return Err(RuleError::UnexpectedState {
                order_id: d.row().order_id,
                found,
                expected: "pending or compensating",
            });
        }
    };
    // None of its next steps' agents has room under flow control (§4b): it
    // waits, pending in Postgres and held for the first of them, so that
    // claims pass it by until there is room (and take the orders behind
    // it meanwhile).
    if let Some(Advance::Dispatch { steps, direction }) = advance(to, &order.views()) {
        let agents: Vec<&str> = steps
            .iter()
            .filter_map(|idx| order.steps.iter().find(|s| s.idx == *idx))
            .filter_map(|step| agent_for(step, direction))
            .collect();
        if let Some(&agent) = agents.first()
            && !agents.iter().any(|a| flow::room(ctx.flows, a))
        {
            if order.row.held_for.as_deref() == Some(agent) {
                return Ok(Claim::Waits);
            }
            let step = order
                .steps
                .iter()
                .find(|s| s.idx == steps[0])
                .map_or("", |s| s.name.as_str());
            d.hold(Hold::Flow(agent), step);
            return Ok(Claim::Decided(Box::new(d.done())));
        }
    }
    let held = d.row().held_for.clone().map(|a| (a, d.row().held_since));
    let hold_until = d.row().hold_until;
    d.set_state(to, Some(ctx.actor), None);
    d.order.row.not_before = None;
    let attempt = d.row().attempt();
    // Out as its breaker's probe, it is still in its hold: nothing is
    // announced until the remote answers (contract §4c).
    let probe = held.as_ref().and_then(|(agent, since)| {
        let probe = breaker::admit(ctx.gates, agent, d.row().order_id) == Admit::Probe;
        probe
            .then_some((*since)?)
            .map(|since| (since, agent.clone()))
    });
    if let Some((since, _)) = probe {
        d.keep_hold(since, hold_until);
    } else if let Some((agent, since)) = held {
        // Claimable again: its breaker closed, or it is the probe.
        d.log(Event {
            kind: EventKind::Resumed,
            from: Some(from),
            to,
            step: None,
            attempt,
            reason: None,
            detail: json!({
                "agent": agent,
                "held_since": since.map(|t| crate::messages::rfc3339::format(&t)),
                "locked_by": ctx.actor,
            }),
        });
    } else if from == ProcessState::Pending {
        d.log(Event {
            kind: EventKind::Processing,
            from: Some(from),
            to,
            step: None,
            attempt,
            reason: None,
            detail: json!({ "locked_by": ctx.actor }),
        });
    }
    d.drive()?;
    Ok(Claim::Decided(Box::new(d.done())))
}

/// What a reply did.
#[derive(Debug, Clone, PartialEq)]
pub enum Replied {
    /// It counted: the order moves on as decided.
    Applied(Box<Decision>),
    /// It answers a dispatch that no longer counts (why): nothing changes.
    Stale(String),
}

/// Applies an agent's `reply` to `order`: the step completes, fails, or is
/// undone, and the order is driven on: the steps it lets start are
/// dispatched, or, once no step is out any more, `ctx.actor` takes over
/// the order's claim. A forward step that failed for good gives the order
/// up (its steps still running are let finish, then every completed step
/// is undone, newest completion first); an undo that failed for good fails it.
pub fn apply_reply(order: &Order, reply: &StepReply, ctx: Given<'_>) -> Result<Replied, RuleError> {
    let change = match judge_reply(&order.row, &order.steps, reply) {
        Ok(change) => change,
        Err(why) => return Ok(Replied::Stale(why)),
    };
    let mut d = Deciding::new(order, ctx);
    if let StepOutcome::Accepted {
        complete_by,
        location,
    } = &reply.outcome
    {
        d.heartbeat(change.pos, *complete_by, location);
        return Ok(Replied::Applied(Box::new(d.done())));
    }
    let step = &mut d.order.steps[change.pos];
    step.state = change.to;
    step.complete_by = None;
    if let StepOutcome::Held { .. } = reply.outcome {
        // The agent found its breaker open and did not send this copy: the
        // step is dispatched again, which holds the order while the breaker
        // is open (as this load saw it). Its outcome is unknown all the
        // same (contract §4c): another copy of the request (the outbox
        // publishes at least once, a dead agent's delivery comes again) may
        // have reached the remote.
        step.dispatch_id = None;
        match reply.direction {
            Direction::Forward => {
                step.in_doubt = true;
                step.finished_at = Some(ctx.now);
            }
            Direction::Compensate => step.undo_in_doubt = true,
        }
    } else {
        if let Some(r) = change.result {
            step.result = Some(r.clone());
            // Its remote answered: it is done, no longer in doubt. (A
            // permanent failure after a dispatch in doubt leaves it in
            // doubt: the earlier call may have been applied.)
            step.in_doubt = false;
        }
        if reply.direction == Direction::Compensate {
            // Its remote answered the undo (done, or nothing done).
            step.undo_in_doubt = false;
        }
        step.error = change.error.map(str::to_owned);
        step.finished_at = Some(ctx.now);
    }
    let holder = d.holder();
    let probing = d.probing();
    d.set_state(change.order_state, Some(&holder), None);
    if let Some((since, until)) = probing {
        if matches!(reply.outcome, StepOutcome::Held { .. }) {
            // Its agent found the breaker open after all: still held.
            d.keep_hold(since, until);
        } else {
            let step = &d.order.steps[change.pos];
            let agent = match reply.direction {
                Direction::Forward => step.agent.clone(),
                Direction::Compensate => step.compensate.clone().unwrap_or_default(),
            };
            d.probe_answered(&agent, since);
        }
    }
    match (&reply.outcome, reply.direction) {
        (StepOutcome::Succeeded { result }, Direction::Forward) => {
            let attempt = d.row().attempt();
            d.log(Event {
                kind: EventKind::StepSucceeded,
                from: Some(change.order_state),
                to: change.order_state,
                step: Some(&reply.step),
                attempt,
                reason: None,
                detail: json!({ "result": result }),
            });
            d.drive()?;
        }
        (StepOutcome::Succeeded { .. }, Direction::Compensate) | (StepOutcome::Held { .. }, _) => {
            d.drive()?;
        }
        // A heartbeat returned above: nothing ends, nothing is driven.
        (StepOutcome::Accepted { .. }, _) => {}
        // A sibling of a step that failed, let finish: the undoing goes on.
        (StepOutcome::Failed { .. }, Direction::Forward)
            if change.order_state == ProcessState::Compensating =>
        {
            d.drive()?;
        }
        (StepOutcome::Failed { error }, Direction::Forward) => {
            let reason = format!("step {} failed permanently: {error}", reply.step);
            d.give_up_and_drive(&reason)?;
        }
        (StepOutcome::Failed { error }, Direction::Compensate) => {
            let reason = format!(
                "compensation of step {} failed permanently: {error}",
                reply.step
            );
            d.fail(&reason);
        }
    }
    Ok(Replied::Applied(Box::new(d.done())))
}

impl<'c> Deciding<'c> {
    /// Dispatches the order's next steps (forward, or the next undo), waits
    /// for the steps out, or finishes it. The order is held by the actor.
    pub(super) fn drive(&mut self) -> Result<(), RuleError> {
        let from = self.row().process_state;
        // Each round skips at least one step, so this ends.
        let (next, launches) = loop {
            let Some(next) = advance(from, &self.order.views()) else {
                return Err(RuleError::UnexpectedState {
                    order_id: self.row().order_id,
                    found: from,
                    expected: "processing or compensating",
                });
            };
            if let Advance::Dispatch {
                steps,
                direction: Direction::Forward,
            } = &next
            {
                match self.prepare_forward(steps)? {
                    Prepared::Go(launches) => break (next, launches),
                    Prepared::Skipped => continue,
                    Prepared::Broken(reason) => return self.give_up_and_drive(&reason),
                }
            }
            break (next, Vec::new());
        };
        match next {
            Advance::Dispatch { steps, direction } => {
                let mut gated = None;
                for idx in steps {
                    // Forward, only what the definition lets go now.
                    let launch = match launches.iter().find(|(i, _)| *i == idx) {
                        Some((_, launch)) => launch.clone(),
                        None if direction == Direction::Forward => continue,
                        None => Launch::default(),
                    };
                    if let Some(hold) = self.dispatch(idx, direction, launch)? {
                        gated.get_or_insert(hold);
                    }
                }
                // A step that may not go now waits in the order: for the
                // next reply while siblings are out, else held.
                if let Some((why, step)) = gated
                    && !self.any_out()
                {
                    match why {
                        Gated::Breaker(gate) => self.hold(Hold::Breaker(gate), &step),
                        Gated::Flow(agent) => self.hold(Hold::Flow(&agent), &step),
                    }
                    return Ok(());
                }
                self.order.row.complete_by = self.out_deadline();
            }
            Advance::Wait => self.order.row.complete_by = self.out_deadline(),
            // Cancelled, and its steps out answered with nothing to undo:
            // it ends as a cancel with nothing to undo does at once.
            Advance::Finish {
                state: ProcessState::Error,
                ..
            } if self.row().last_error.as_deref() == Some(super::operator::CANCELLED) => {
                self.finish(from, ProcessState::Compensated, EventKind::Compensated);
            }
            Advance::Finish {
                state: ProcessState::Error,
                ..
            } => {
                // Given up while steps ran, and nothing they did needs undoing.
                let reason = self
                    .row()
                    .last_error
                    .clone()
                    .unwrap_or_else(|| "given up with nothing to undo".into());
                self.fail(&reason);
            }
            Advance::Finish { state, event } => self.finish(from, state, event),
        }
        Ok(())
    }

    /// Ends the order in `state`, told by `event` with the results; an
    /// undone order's event also says which steps were undone in doubt.
    fn finish(&mut self, from: ProcessState, state: ProcessState, event: EventKind) {
        let attempt = self.row().attempt();
        let mut detail = json!({ "results": self.order.results() });
        if state == ProcessState::Compensated {
            let in_doubt = self.in_doubt_steps();
            detail["in_doubt"] = json!(!in_doubt.is_empty());
            detail["in_doubt_steps"] = json!(in_doubt);
        }
        self.set_state(state, None, None);
        self.log(Event {
            kind: event,
            from: Some(from),
            to: state,
            step: None,
            attempt,
            reason: None,
            detail,
        });
        self.end(state);
    }

    /// A long-running remote operation of the step at `pos` answered `202`
    /// again (§4b): its complete-by moves to what the agent asks (`asked`:
    /// the agent's now plus the step's timeout), never past now plus the
    /// timeout nor past its first dispatch plus its `max_duration`, and
    /// never back. The order's complete-by follows; the claim stays.
    fn heartbeat(&mut self, pos: usize, asked: DateTime<Utc>, location: &str) {
        let now = self.ctx.now;
        let step = &mut self.order.steps[pos];
        let mut moved = asked;
        if let Some(by_timeout) =
            now.checked_add_signed(chrono::Duration::milliseconds(step.timeout_ms))
        {
            moved = moved.min(by_timeout);
        }
        if let Some(max) = step.max_complete_by() {
            moved = moved.min(max);
        }
        let Some(was) = step.complete_by else { return };
        if moved <= was {
            return;
        }
        step.complete_by = Some(moved);
        let name = step.name.clone();
        self.order.row.complete_by = self.out_deadline();
        let (state, attempt) = (self.row().process_state, self.row().attempt());
        self.log(Event {
            kind: EventKind::Heartbeat,
            from: Some(state),
            to: state,
            step: Some(&name),
            attempt,
            reason: None,
            detail: json!({
                "step": name,
                "complete_by": crate::messages::rfc3339::format(&moved),
                // Bounded here too (contract §1b): the agent cuts it, but
                // the event log must not trust the reply for that.
                "location": crate::messages::truncate_bytes(location, MAX_LOCATION_BYTES),
            }),
        });
    }

    /// Sends step `idx` to its agent (or its compensating agent) with a
    /// fresh dispatch id and a complete-by of now plus the step's timeout,
    /// under the order's current claim, as `launch` says (its payload,
    /// built by the step's `input`, §4d). A step sas runs itself (a wait,
    /// a signal) is only marked out, with its end as its complete-by.
    ///
    /// While the agent's breaker is open, or the agent has no room under
    /// flow control, the step is not sent: why comes back (with the step's
    /// name), unless the order is the breaker's probe.
    fn dispatch(
        &mut self,
        idx: i32,
        direction: Direction,
        launch: Launch,
    ) -> Result<Option<(Gated<'c>, String)>, RuleError> {
        let now = self.ctx.now;
        let pos = self.step_pos(idx)?;
        let step = &self.order.steps[pos];
        if direction == Direction::Forward && step.kind().held_by_sas() {
            self.wait_out(pos, launch.until);
            return Ok(None);
        }
        let agent = agent_for(step, direction)
            .ok_or_else(|| RuleError::NoCompensation(step.name.clone()))?
            .to_owned();
        let state = match direction {
            Direction::Forward => StepState::Running,
            Direction::Compensate => StepState::Compensating,
        };
        let gates = self.ctx.gates;
        if let Admit::Hold(gate) = breaker::admit(gates, &agent, self.row().order_id) {
            return Ok(Some((Gated::Breaker(gate), step.name.clone())));
        }
        if !self.has_room(&agent) {
            return Ok(Some((Gated::Flow(agent), step.name.clone())));
        }
        let step = &mut self.order.steps[pos];
        let dispatch_id = (self.ctx.new_id)();
        let complete_by = now
            .checked_add_signed(chrono::Duration::milliseconds(step.timeout_ms))
            .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC);
        step.state = state;
        step.dispatch_id = Some(dispatch_id);
        step.dispatches += 1;
        step.complete_by = Some(complete_by);
        // Each dispatch climbs the deadline ladder afresh.
        step.warned = 0;
        step.started_at.get_or_insert(now);
        let name = step.name.clone();
        self.took_room(&agent);
        let o = self.row();
        // The step's own retry as its order's definition says (§4d), `{}`
        // when it sets none; an undo retries as its agent does.
        let retry = match direction {
            Direction::Forward => self
                .ctx
                .definition(o)
                .map(|d| d.spec.step_retry(&name).unwrap_or_default()),
            Direction::Compensate => None,
        };
        let request = StepRequest {
            order_id: o.order_id,
            workflow: o.workflow.clone(),
            step: name,
            step_index: idx,
            direction,
            attempt: o.attempt(),
            dispatch_id,
            locked_by: o
                .locked_by
                .clone()
                .unwrap_or_else(|| self.ctx.actor.to_owned()),
            complete_by,
            payload: launch.payload.unwrap_or_else(|| o.payload.clone()),
            results: self.order.results(),
            fencing_token: i64::from(self.order.steps[pos].dispatches),
            timeout_ms: Some(self.order.steps[pos].timeout_ms),
            max_complete_by: self.order.steps[pos].max_complete_by(),
            time_left_ms: Some(self.order.steps[pos].timeout_ms),
            redrive: o.redrives,
            in_doubt: direction == Direction::Compensate && self.order.steps[pos].in_doubt,
            retry,
            index: launch.item.as_ref().map(|(index, _)| *index),
            item: launch.item.map(|(_, item)| item),
        };
        self.effects.push(Effect::Request {
            agent,
            request: Box::new(request),
        });
        Ok(None)
    }
}

/// Why a step ready to go was not dispatched.
enum Gated<'g> {
    /// Its agent's breaker is open.
    Breaker(&'g breaker::Gate),
    /// Its agent has no room under flow control.
    Flow(String),
}

/// The agent a step's dispatch in `direction` goes to: its own, or its undo's.
fn agent_for(step: &StepRow, direction: Direction) -> Option<&str> {
    match direction {
        Direction::Forward => Some(step.agent.as_str()),
        Direction::Compensate => step.compensate.as_deref(),
    }
}

/// What the scheduler does next with an order it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Advance {
    /// Send these steps (by index) to their agents, forward or to undo them.
    Dispatch {
        steps: Vec<i32>,
        direction: Direction,
    },
    /// Steps are out with their agents; nothing else can go until they answer.
    Wait,
    /// Nothing left to run: the order ends in `state`, told by `event`.
    Finish {
        state: ProcessState,
        event: EventKind,
    },
}

/// The next move for an order in `state` with these steps: every step not
/// completed whose `after` steps have all completed (completed steps are
/// never redone), or, while compensating and once no step is out, the
/// newest completed step that has an undo; `None` for an order in a state
/// the scheduler does not drive. An order given up with nothing undone
/// once its running steps answered ends `error`.
pub fn advance(state: ProcessState, steps: &[StepView<'_>]) -> Option<Advance> {
    let (next, direction) = match state {
        ProcessState::Processing => (workflow::next_forward(steps), Direction::Forward),
        ProcessState::Compensating => (workflow::next_compensation(steps), Direction::Compensate),
        _ => return None,
    };
    Some(match next {
        workflow::Next::Run(steps) => Advance::Dispatch { steps, direction },
        workflow::Next::Wait => Advance::Wait,
        workflow::Next::Finished if state == ProcessState::Processing => Advance::Finish {
            state: ProcessState::Processed,
            event: EventKind::Processed,
        },
        workflow::Next::Finished if steps.iter().any(|s| s.state == StepState::Compensated) => {
            Advance::Finish {
                state: ProcessState::Compensated,
                event: EventKind::Compensated,
            }
        }
        workflow::Next::Finished => Advance::Finish {
            state: ProcessState::Error,
            event: EventKind::Failed,
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
    let order_state = order.process_state;
    // A forward step also answers while the order is being undone: a
    // sibling of the step that failed, let finish.
    let (state_fits, running, done) = match reply.direction {
        Direction::Forward => (
            matches!(
                order_state,
                ProcessState::Processing | ProcessState::Compensating
            ),
            StepState::Running,
            StepState::Completed,
        ),
        Direction::Compensate => (
            order_state == ProcessState::Compensating,
            StepState::Compensating,
            StepState::Compensated,
        ),
    };
    if !state_fits {
        return Err(format!("order is {order_state}"));
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
        // An undo that failed leaves the step done (or in doubt), not undone.
        (StepOutcome::Failed { error }, Direction::Compensate) => {
            (undo_withdrawn(step.in_doubt), None, Some(error.as_str()))
        }
        // Not sent: the step is as it was before its dispatch.
        (StepOutcome::Held { .. }, Direction::Forward) => (StepState::NotStarted, None, None),
        (StepOutcome::Held { .. }, Direction::Compensate) => {
            (undo_withdrawn(step.in_doubt), None, None)
        }
        // A heartbeat: still out.
        (StepOutcome::Accepted { .. }, _) => (running, None, None),
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

    use crate::model::NewOrder;

    use super::*;

    #[test]
    fn claimable_reads_state_holder_time_breaker_and_flow() {
        let now = Utc::now();
        let pending = OrderRow {
            locked_by: None,
            ..order(ProcessState::Pending, 0)
        };
        assert!(claimable(&pending, now, &[], &[]));
        assert!(!claimable(
            &order(ProcessState::Processing, 0),
            now,
            &[],
            &[]
        ));
        assert!(
            !claimable(&order(ProcessState::Compensating, 0), now, &[], &[]),
            "held by s1"
        );
        let later = OrderRow {
            not_before: Some(now + chrono::Duration::seconds(5)),
            ..pending.clone()
        };
        assert!(!claimable(&later, now, &[], &[]));

        let held = OrderRow {
            held_for: Some("a".into()),
            held_reason: Some("breaker_open".into()),
            ..pending.clone()
        };
        let gate = |state, probe| breaker::Gate {
            agent: "a".into(),
            state,
            since: Some(now),
            probe_order: probe,
            max_hold_ms: 1000,
            forced: false,
        };
        assert!(!claimable(
            &held,
            now,
            &[gate(breaker::State::Open, None)],
            &[]
        ));
        assert!(
            claimable(
                &held,
                now,
                &[gate(breaker::State::HalfOpen, Some(held.order_id))],
                &[]
            ),
            "the probe"
        );
        assert!(claimable(&held, now, &[], &[]), "closed");

        let limited = OrderRow {
            held_reason: Some("rate_limited".into()),
            ..held
        };
        let flow = |in_flight| flow::Flow {
            agent: "a".into(),
            max_in_flight: Some(2),
            in_flight,
            rate_per_sec: None,
            available: None,
        };
        assert!(!claimable(&limited, now, &[], &[flow(2)]));
        assert!(claimable(&limited, now, &[], &[flow(1)]));
    }

    fn order(state: ProcessState, failure_count: i32) -> OrderRow {
        let now = Utc::now();
        OrderRow {
            process_state: state,
            locked_by: Some("s1".into()),
            complete_by: Some(now),
            failure_count,
            last_seq: 3,
            ..OrderRow::pending(&NewOrder::new(Uuid::new_v4(), "w", json!({})), now)
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
            warned: 0,
            after_steps: None,
            max_duration_ms: None,
            in_doubt: false,
            undo_in_doubt: false,
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
            traceparent: None,
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
            after: None,
            finished_at: None,
            in_doubt: false,
        };
        let steps = [
            view(0, StepState::Completed, Some("u0")),
            view(1, StepState::Completed, None),
            view(2, StepState::NotStarted, Some("u2")),
        ];
        assert_eq!(
            advance(ProcessState::Processing, &steps),
            Some(Advance::Dispatch {
                steps: vec![2],
                direction: Direction::Forward
            })
        );
        assert_eq!(
            advance(ProcessState::Compensating, &steps),
            Some(Advance::Dispatch {
                steps: vec![0],
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
                    let (state_fits, running) = if compensate {
                        (state == ProcessState::Compensating, StepState::Compensating)
                    } else {
                        (
                            matches!(state, ProcessState::Processing | ProcessState::Compensating),
                            StepState::Running,
                        )
                    };
                    let counts = state_fits
                        && !other_claim
                        && (compensate || !old_attempt)
                        && !other_dispatch
                        && !other_step
                        && steps[pos].state == running;
                    let judged = judge_reply(&o, &steps, &r);
                    prop_assert_eq!(judged.is_ok(), counts, "{:?}", judged);
                    if let Ok(change) = judged {
                        prop_assert_eq!(change.pos, pos);
                        prop_assert_eq!(change.order_state, state);
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

#[cfg(test)]
mod decisions {
    //! The scheduler's decisions on whole orders.

    use serde_json::json;

    use super::*;
    use crate::rules::order::fixture::{ctx, now, pending};
    use crate::rules::{Effect, Order};

    fn claimed(order: &Order) -> Decision {
        claim(order, ctx("s1")).expect("claim")
    }

    /// The reply to the decision's request, with `outcome`.
    fn answer(d: &Decision, outcome: StepOutcome) -> StepReply {
        let (_, request) = d.requests().last().expect("a request");
        StepReply::to(request, outcome)
    }

    fn ok() -> StepOutcome {
        StepOutcome::Succeeded {
            result: json!({ "ok": true }),
        }
    }

    fn failed() -> StepOutcome {
        StepOutcome::Failed {
            error: "HTTP 422".into(),
        }
    }

    fn applied(order: &Order, reply: &StepReply, actor: &str) -> Decision {
        match apply_reply(order, reply, ctx(actor)).expect("reply") {
            Replied::Applied(d) => *d,
            Replied::Stale(why) => panic!("stale: {why}"),
        }
    }

    #[test]
    fn an_order_held_for_its_breaker_then_for_room_stays_in_the_one_hold_announced_then() {
        // Held for its breaker, then claimed (say as its probe) while its
        // next step's agent has no room: held for that agent now, in the
        // hold that began before (contract §4c), with no second `held`.
        let mut order = pending(1, |_| false);
        let began = now() - chrono::Duration::minutes(1);
        let row = &mut order.row;
        row.held_for = Some("elsewhere".into());
        row.held_reason = Some("breaker_open".into());
        row.held_since = Some(began);
        row.hold_until = Some(now() + chrono::Duration::minutes(1));
        let agent = order.steps[0].agent.clone();
        let full = [crate::rules::flow::Flow {
            agent: agent.clone(),
            max_in_flight: Some(1),
            in_flight: 1,
            rate_per_sec: None,
            available: None,
        }];
        let d = claim(
            &order,
            Given {
                flows: &full,
                ..ctx("s1")
            },
        )
        .expect("claim");
        assert_eq!(d.events().map(|e| e.kind).collect::<Vec<_>>(), []);
        let row = &d.order.row;
        assert_eq!(row.held_for.as_deref(), Some(agent.as_str()));
        assert_eq!(row.held_reason.as_deref(), Some("rate_limited"));
        assert_eq!(row.held_since, Some(began), "the hold goes on");
        assert_eq!(row.hold_until, None, "a wait for room has no end");
    }

    #[test]
    fn a_claim_starts_a_pending_order_and_dispatches_its_first_step() {
        let order = pending(2, |_| true);
        let d = claimed(&order);
        let row = &d.order.row;
        assert_eq!(row.process_state, ProcessState::Processing);
        assert_eq!(row.locked_by.as_deref(), Some("s1"));
        let deadline = now() + chrono::Duration::milliseconds(1000);
        assert_eq!(row.complete_by, Some(deadline));
        let step = &d.order.steps[0];
        assert_eq!(step.state, StepState::Running);
        assert_eq!((step.dispatches, step.started_at), (1, Some(now())));
        // The status event comes before the request it announces.
        assert!(
            matches!(&d.effects[..], [Effect::Event(e), Effect::Request { agent, request }]
            if e.kind == EventKind::Processing && e.seq == 2 && agent == "a0"
              && request.step_index == 0 && request.dispatch_id == step.dispatch_id.unwrap()
              && request.complete_by == deadline && request.locked_by == "s1")
        );
        assert_eq!(d.ended, None);
    }

    #[test]
    fn a_claim_of_an_order_being_undone_dispatches_its_newest_undo() {
        let mut order = pending(3, |i| i != 1);
        order.row.process_state = ProcessState::Compensating;
        for s in &mut order.steps[..2] {
            s.state = StepState::Completed;
        }
        let d = claimed(&order);
        assert_eq!(d.order.row.process_state, ProcessState::Compensating);
        assert_eq!(d.events().count(), 0, "it was compensating already");
        let (agent, request) = d.requests().next().expect("undo");
        assert_eq!((agent, request.step_index), ("u0", 0), "step 1 has no undo");
        assert_eq!(request.direction, Direction::Compensate);
    }

    #[test]
    fn only_pending_and_undriven_compensating_orders_are_claimed() {
        let mut order = pending(1, |_| false);
        order.row.process_state = ProcessState::Processed;
        assert!(matches!(
            claim(&order, ctx("s1")),
            Err(RuleError::UnexpectedState { .. })
        ));
    }

    #[test]
    fn each_success_dispatches_the_next_step_and_the_last_one_ends_the_order() {
        let order = pending(2, |_| true);
        let first = claimed(&order);
        // Another scheduler applies the reply and takes the order over.
        let second = applied(&first.order, &answer(&first, ok()), "s2");
        assert_eq!(second.order.steps[0].state, StepState::Completed);
        assert_eq!(second.order.steps[0].result, Some(json!({ "ok": true })));
        assert_eq!(second.order.row.locked_by.as_deref(), Some("s2"));
        let (_, request) = second.requests().next().expect("step 1");
        assert_eq!(request.step_index, 1);
        assert_eq!(request.results.get("s0"), Some(&json!({ "ok": true })));
        let done = applied(&second.order, &answer(&second, ok()), "s2");
        assert_eq!(done.ended, Some(ProcessState::Processed));
        let row = &done.order.row;
        assert_eq!((row.locked_by.as_ref(), row.complete_by), (None, None));
        let kinds: Vec<_> = done.events().map(|e| e.kind).collect();
        assert_eq!(kinds, [EventKind::StepSucceeded, EventKind::Processed]);
    }

    #[test]
    fn a_failed_step_undoes_the_completed_ones_newest_first() {
        let order = pending(3, |_| true);
        let d = claimed(&order);
        let d = applied(&d.order, &answer(&d, ok()), "s1");
        let d = applied(&d.order, &answer(&d, ok()), "s1");
        let d = applied(&d.order, &answer(&d, failed()), "s1");
        assert_eq!(d.order.row.process_state, ProcessState::Compensating);
        assert_eq!(d.order.steps[2].state, StepState::Failed);
        assert!(
            matches!(&d.effects[..], [Effect::Alert(a), Effect::Event(e), Effect::Request { request, .. }]
            if a.state == "compensating" && e.kind == EventKind::Compensating
              && request.step_index == 1 && request.direction == Direction::Compensate)
        );
        let d = applied(&d.order, &answer(&d, ok()), "s1");
        let (_, undo) = d.requests().next().expect("undo of step 0");
        assert_eq!(undo.step_index, 0);
        let d = applied(&d.order, &answer(&d, ok()), "s1");
        assert_eq!(d.ended, Some(ProcessState::Compensated));
    }

    #[test]
    fn a_failed_first_step_fails_the_order_and_a_failed_undo_too() {
        let order = pending(2, |_| true);
        let d = claimed(&order);
        let d = applied(&d.order, &answer(&d, failed()), "s1");
        assert_eq!(d.ended, Some(ProcessState::Error));
        assert!(
            matches!(&d.effects[..], [Effect::Alert(_), Effect::Event(e)] if e.kind == EventKind::Failed)
        );
        assert_eq!(
            d.order.row.last_error.as_deref(),
            Some("step s0 failed permanently: HTTP 422")
        );

        let d = claimed(&order);
        let d = applied(&d.order, &answer(&d, ok()), "s1");
        let d = applied(&d.order, &answer(&d, failed()), "s1");
        let d = applied(&d.order, &answer(&d, failed()), "s1");
        assert_eq!(d.ended, Some(ProcessState::Error));
        assert_eq!(d.order.steps[0].state, StepState::Completed, "not undone");
    }

    #[test]
    fn a_stale_reply_changes_nothing() {
        let order = pending(1, |_| true);
        let d = claimed(&order);
        let mut reply = answer(&d, ok());
        reply.dispatch_id = uuid::Uuid::new_v4();
        assert!(matches!(
            apply_reply(&d.order, &reply, ctx("s1")),
            Ok(Replied::Stale(_))
        ));
    }
}

#[cfg(test)]
mod parallel {
    //! Steps in parallel (§4b): a diamond `s0 → s1 ∥ s2 → s3`.

    use chrono::Duration;
    use serde_json::json;

    use super::*;
    use crate::rules::order::fixture::{ctx, now, pending};
    use crate::rules::supervisor;

    /// A pending diamond; every step has an undo.
    fn diamond() -> Order {
        let mut order = pending(4, |_| true);
        for (s, after) in order
            .steps
            .iter_mut()
            .zip([vec![], vec![0], vec![0], vec![1, 2]])
        {
            s.after_steps = Some(after);
        }
        order
    }

    fn at(actor: &str, secs: i64) -> Given<'_> {
        Given {
            now: now() + Duration::seconds(secs),
            ..ctx(actor)
        }
    }

    fn request(d: &Decision, idx: i32) -> &StepRequest {
        d.requests()
            .map(|(_, r)| r)
            .find(|r| r.step_index == idx)
            .unwrap_or_else(|| panic!("no request for step {idx}"))
    }

    fn ok(idx: i32) -> StepOutcome {
        StepOutcome::Succeeded {
            result: json!({ "step": idx }),
        }
    }

    fn applied(order: &Order, reply: &StepReply, ctx: Given<'_>) -> Decision {
        match apply_reply(order, reply, ctx).expect("reply") {
            Replied::Applied(d) => *d,
            Replied::Stale(why) => panic!("stale: {why}"),
        }
    }

    /// The diamond claimed and its first step answered: `s1` and `s2` out.
    fn branches_out() -> (Decision, StepRequest, StepRequest) {
        let d = claim(&diamond(), ctx("s1")).expect("claim");
        let first = request(&d, 0).clone();
        let d = applied(&d.order, &StepReply::to(&first, ok(0)), at("s1", 1));
        let (r1, r2) = (request(&d, 1).clone(), request(&d, 2).clone());
        (d, r1, r2)
    }

    #[test]
    fn a_dispatch_carries_its_steps_retry_as_the_orders_definition_says() {
        let mut order = diamond();
        let spec: crate::spec::WorkflowSpec = serde_json::from_value(json!({
            "steps": [
                { "name": "s0", "agent": "a0", "retry": { "max_attempts": 2 } },
                { "name": "s1", "agent": "a1" },
            ],
        }))
        .expect("spec");
        let definition = std::sync::Arc::new(crate::spec::Definition {
            workflow: "w".into(),
            spec,
        });
        let id = definition.id();
        let known = [(id, definition)];
        // No definition (an order from before they were kept): nothing said.
        let d = claim(&order, ctx("s1")).expect("claim");
        assert_eq!(request(&d, 0).retry, None);
        order.row.definition = Some(id);
        let d = claim(
            &order,
            Given {
                definitions: &known,
                ..ctx("s1")
            },
        )
        .expect("claim");
        let first = request(&d, 0).clone();
        assert_eq!(first.retry.and_then(|r| r.max_attempts), Some(2));
        // A step that sets none says so, so that no configuration of the
        // moment stands in for it.
        let d = applied(
            &d.order,
            &StepReply::to(&first, ok(0)),
            Given {
                definitions: &known,
                ..at("s1", 1)
            },
        );
        assert_eq!(
            request(&d, 1).retry,
            Some(crate::spec::RetrySpec::default())
        );
    }

    #[test]
    fn branches_to_one_agent_take_its_room_one_by_one_and_the_decision_says_so() {
        let mut order = diamond();
        for s in &mut order.steps[1..3] {
            s.agent = "x".into();
        }
        let room = [flow::Flow {
            agent: "x".into(),
            max_in_flight: Some(1),
            in_flight: 0,
            rate_per_sec: None,
            available: None,
        }];
        let claimed = claim(&order, ctx("s1")).expect("claim");
        assert!(claimed.took_room.is_empty(), "a0 is under no flow control");
        assert_eq!(claimed.flows, [], "the context had none");
        let first = request(&claimed, 0).clone();
        let with_room = Given {
            flows: &room,
            ..at("s1", 1)
        };
        let d = applied(&claimed.order, &StepReply::to(&first, ok(0)), with_room);
        assert_eq!(d.requests().count(), 1, "room for one of the two branches");
        assert_eq!(d.took_room, ["x"]);
        assert_eq!(d.flows[0].in_flight, 1, "the next decision sees it taken");
    }

    #[test]
    fn independent_steps_go_together_and_the_join_waits_for_both() {
        let (d, r1, r2) = branches_out();
        assert_eq!(d.requests().count(), 2);
        assert_eq!(r1.results.get("s0"), Some(&json!({ "step": 0 })));
        assert_eq!(
            d.order.row.complete_by,
            Some(r1.complete_by.min(r2.complete_by))
        );
        // Another scheduler applies s1's reply: s2 is still out under the
        // first claim, which the order keeps, so s2's reply still counts.
        let d = applied(&d.order, &StepReply::to(&r1, ok(1)), at("s2", 2));
        assert_eq!(d.requests().count(), 0, "s3 waits for s2");
        assert_eq!(d.order.row.locked_by.as_deref(), Some("s1"));
        assert_eq!(d.order.row.complete_by, Some(r2.complete_by));
        let d = applied(&d.order, &StepReply::to(&r2, ok(2)), at("s2", 3));
        let join = request(&d, 3);
        assert_eq!(join.results.len(), 3, "results hold every completed step");
        assert_eq!(
            d.order.row.locked_by.as_deref(),
            Some("s2"),
            "nothing was out: s2 took over"
        );
        let done = applied(&d.order, &StepReply::to(join, ok(3)), at("s2", 4));
        assert_eq!(done.ended, Some(ProcessState::Processed));
    }

    #[test]
    fn a_failed_branch_lets_its_sibling_finish_then_undoes_newest_completion_first() {
        let (d, r1, r2) = branches_out();
        let failed = StepOutcome::Failed {
            error: "HTTP 422".into(),
        };
        let d = applied(&d.order, &StepReply::to(&r1, failed), at("s1", 2));
        assert_eq!(d.order.row.process_state, ProcessState::Compensating);
        assert_eq!(d.requests().count(), 0, "s2 is let finish first");
        assert_eq!(d.order.row.complete_by, Some(r2.complete_by));
        let d = applied(&d.order, &StepReply::to(&r2, ok(2)), at("s1", 3));
        assert_eq!(d.order.steps[2].result, Some(json!({ "step": 2 })));
        let undo = request(&d, 2).clone();
        assert_eq!(undo.direction, Direction::Compensate);
        let d = applied(&d.order, &StepReply::to(&undo, ok(2)), at("s1", 4));
        let undo = request(&d, 0).clone();
        let d = applied(&d.order, &StepReply::to(&undo, ok(0)), at("s1", 5));
        assert_eq!(d.ended, Some(ProcessState::Compensated));
        assert_eq!(
            d.order.steps[1].state,
            StepState::Failed,
            "never completed, never undone"
        );
    }

    #[test]
    fn undo_follows_completion_time_not_the_order_of_the_list() {
        let (d, r1, r2) = branches_out();
        // s2 completes first, then s1, then the join fails.
        let d = applied(&d.order, &StepReply::to(&r2, ok(2)), at("s1", 2));
        let d = applied(&d.order, &StepReply::to(&r1, ok(1)), at("s1", 3));
        let join = request(&d, 3).clone();
        let failed = StepOutcome::Failed { error: "no".into() };
        let mut d = applied(&d.order, &StepReply::to(&join, failed), at("s1", 4));
        let mut undone = Vec::new();
        for t in 5..10 {
            let Some((_, undo)) = d.requests().next() else {
                break;
            };
            let undo = undo.clone();
            undone.push(undo.step_index);
            d = applied(&d.order, &StepReply::to(&undo, ok(0)), at("s1", t));
        }
        assert_eq!(undone, [1, 2, 0]);
        assert_eq!(d.ended, Some(ProcessState::Compensated));
    }

    #[test]
    fn a_sibling_that_runs_out_of_time_while_undoing_is_withdrawn_not_counted() {
        let (d, r1, _) = branches_out();
        let failed = StepOutcome::Failed { error: "no".into() };
        let d = applied(&d.order, &StepReply::to(&r1, failed), at("s1", 2));
        let late = at("sup", 60);
        let settings = crate::spec::SupervisorSettings::default();
        let (d, retry_at) = supervisor::expire(&d.order, &settings, late);
        assert_eq!(retry_at, None);
        assert_eq!(d.order.row.process_state, ProcessState::Compensating);
        assert_eq!(d.order.row.compensation_failures, 0);
        assert_eq!((d.order.row.locked_by.as_ref(), d.wake), (None, true));
        // The next claim undoes the sibling, in doubt and newest, then s0.
        let d = claim(&d.order, at("s2", 61)).expect("claim");
        let (_, undo) = d.requests().next().expect("undo");
        assert_eq!(
            (undo.step_index, undo.direction, undo.in_doubt),
            (2, Direction::Compensate, true)
        );
        let d = applied(&d.order, &StepReply::to(undo, ok(2)), at("s2", 62));
        let (_, undo) = d.requests().next().expect("undo");
        assert_eq!((undo.step_index, undo.in_doubt), (0, false));
    }

    #[test]
    fn a_reattempt_dispatches_only_what_is_not_completed_and_ready() {
        let (d, _, _) = branches_out();
        let late = at("sup", 60);
        let settings = crate::spec::SupervisorSettings {
            retry_schedule: vec![std::time::Duration::ZERO],
            ..Default::default()
        };
        // Both branches time out; s1 had completed meanwhile in another run.
        let mut order = d.order.clone();
        order.steps[1].state = StepState::Completed;
        order.steps[1].dispatch_id = None;
        let (d, _) = supervisor::expire(&order, &settings, late);
        assert_eq!(d.order.row.process_state, ProcessState::Pending);
        let d = claim(&d.order, at("s2", 61)).expect("claim");
        let sent: Vec<i32> = d.requests().map(|(_, r)| r.step_index).collect();
        assert_eq!(sent, [2]);
    }

    #[test]
    fn given_up_with_nothing_completed_to_undo_once_siblings_answer_it_fails() {
        let mut order = diamond();
        for s in &mut order.steps {
            s.compensate = None;
        }
        order.steps[2].compensate = Some("u2".into());
        order.steps[0].after_steps = Some(vec![]);
        let d = claim(&order, ctx("s1")).expect("claim");
        let first = request(&d, 0).clone();
        let d = applied(&d.order, &StepReply::to(&first, ok(0)), at("s1", 1));
        let (r1, r2) = (request(&d, 1).clone(), request(&d, 2).clone());
        let failed = StepOutcome::Failed { error: "no".into() };
        let d = applied(&d.order, &StepReply::to(&r1, failed.clone()), at("s1", 2));
        assert_eq!(
            d.order.row.process_state,
            ProcessState::Compensating,
            "s2 may need undoing"
        );
        let d = applied(&d.order, &StepReply::to(&r2, failed), at("s1", 3));
        assert_eq!(d.ended, Some(ProcessState::Error));
        assert!(d.events().any(|e| e.kind == EventKind::Failed));
    }

    #[test]
    fn a_heartbeat_moves_complete_by_forward_within_max_duration_and_keeps_the_claim() {
        let mut order = diamond();
        order.steps[0].max_duration_ms = Some(5_000);
        let d = claim(&order, ctx("s1")).expect("claim");
        let first = request(&d, 0).clone();
        assert_eq!(first.timeout_ms, Some(1000));
        assert_eq!(first.max_complete_by, Some(now() + Duration::seconds(5)));
        let beat = |complete_by| StepOutcome::Accepted {
            complete_by,
            location: "/jobs/1".into(),
        };
        // At 0.5 s the agent asks for now + 1 s.
        let asked = now() + Duration::milliseconds(1500);
        let late = Given {
            now: now() + Duration::milliseconds(500),
            ..ctx("s2")
        };
        let d = applied(&d.order, &StepReply::to(&first, beat(asked)), late);
        assert_eq!(d.order.steps[0].complete_by, Some(asked));
        assert_eq!(d.order.row.complete_by, Some(asked));
        assert_eq!(
            d.order.row.locked_by.as_deref(),
            Some("s1"),
            "the claim stays"
        );
        let e = d.events().next().expect("logged");
        assert_eq!(
            (e.kind, e.step.as_deref()),
            (EventKind::Heartbeat, Some("s0"))
        );
        assert_eq!(d.requests().count(), 0);
        // A Location of any length is logged at most 512 bytes long.
        let long = StepOutcome::Accepted {
            complete_by: now() + Duration::milliseconds(1600),
            location: "/".repeat(10_000),
        };
        let later = Given {
            now: now() + Duration::milliseconds(600),
            ..ctx("s2")
        };
        let logged = applied(&d.order, &StepReply::to(&first, long), later);
        let e = logged.events().next().expect("logged");
        assert_eq!(e.detail["location"].as_str().map(str::len), Some(512));
        // Asking past now + timeout or past max_duration gets the bound.
        let d = applied(
            &d.order,
            &StepReply::to(&first, beat(now() + Duration::hours(1))),
            at("s1", 3),
        );
        assert_eq!(
            d.order.steps[0].complete_by,
            Some(now() + Duration::seconds(4))
        );
        let d = applied(
            &d.order,
            &StepReply::to(&first, beat(now() + Duration::hours(1))),
            at("s1", 4),
        );
        assert_eq!(
            d.order.steps[0].complete_by,
            Some(now() + Duration::seconds(5))
        );
        // Never back, and then no event.
        let d = applied(&d.order, &StepReply::to(&first, beat(now())), at("s1", 4));
        assert_eq!(
            d.order.steps[0].complete_by,
            Some(now() + Duration::seconds(5))
        );
        assert_eq!(d.events().count(), 0);
        // The end of the operation is an ordinary answer.
        let d = applied(&d.order, &StepReply::to(&first, ok(0)), at("s1", 4));
        assert_eq!(d.order.steps[0].state, StepState::Completed);
    }
}

//! What happens to an order that is accepted: it is stored `pending` with
//! its steps, and its first event, `received`, is logged and announced;
//! where nothing else has a say, it also starts at once, in the same
//! write-back ([`receive_and_start`]). Pure.

use serde_json::json;

use super::order::{Deciding, Decision, Event, Given, Order, RuleError};
use super::scheduler::{Claim, claim_or_wait};
use crate::messages::EventKind;
use crate::state::ProcessState;

/// The decision for a new order (stored `pending`): its `received` event,
/// and a wake-up for the schedulers.
pub fn receive(order: &Order, ctx: Given<'_>) -> Decision {
    let mut d = Deciding::new(order, ctx);
    let o = d.row();
    let detail = json!({ "workflow": o.workflow, "priority": o.priority });
    d.log(Event {
        kind: EventKind::Received,
        from: None,
        to: ProcessState::Pending,
        step: None,
        attempt: 1,
        reason: None,
        detail,
    });
    d.wake = true;
    d.done()
}

/// The decision for a new order that may start at once, taken by
/// `ctx.actor` in the write-back that stores it: received ([`receive`]),
/// then claimed as a scheduler claims ([`super::scheduler::claim_or_wait`]),
/// its first steps dispatched, with no wake-up: no scheduler needs to read
/// back what was just written. It starts only when nothing else has a say:
/// it is due (`not_before`), its first steps go to agents that no breaker
/// holds (an open or probing breaker picks its probe in its own write) and
/// no flow control counts (their counts are checked where schedulers claim),
/// and the claim neither holds nor ends it. Otherwise it is only received,
/// and waits, pending, for the schedulers.
pub fn receive_and_start(order: &Order, ctx: Given<'_>) -> Result<Decision, RuleError> {
    let received = receive(order, ctx);
    if order.row.not_before.is_some_and(|t| t > ctx.now) {
        return Ok(received);
    }
    let Claim::Decided(claimed) = claim_or_wait(&received.order, ctx)? else {
        return Ok(received);
    };
    let unheld = |agent: &str| !ctx.gates.iter().any(|g| g.agent == agent);
    let starts = claimed.ended.is_none()
        && claimed.order.row.process_state == ProcessState::Processing
        && claimed.order.row.held_for.is_none()
        && claimed.took_room.is_empty()
        && claimed.requests().next().is_some()
        && claimed.requests().all(|(agent, _)| unheld(agent));
    if !starts {
        return Ok(received);
    }
    let mut effects = received.effects;
    effects.extend(claimed.effects);
    Ok(Decision {
        effects,
        ..*claimed
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::breaker::{Gate, State};
    use crate::rules::flow::Flow;
    use crate::rules::order::fixture::{ctx, now, order_of, pending};

    fn kinds(d: &Decision) -> Vec<EventKind> {
        d.events().map(|e| e.kind).collect()
    }

    #[test]
    fn a_new_order_whose_first_step_may_go_starts_in_its_own_write_back() {
        let order = pending(2, |_| true);
        let d = receive_and_start(&order, ctx("submission-1")).expect("rules");
        assert_eq!(kinds(&d), [EventKind::Received, EventKind::Processing]);
        let [(agent, request)] = d.requests().collect::<Vec<_>>()[..] else {
            panic!("one request: {:?}", d.effects)
        };
        assert_eq!((agent, request.step_index), ("a0", 0));
        assert_eq!(
            request.locked_by, "submission-1",
            "replies count under its claim"
        );
        let row = &d.order.row;
        assert_eq!(row.process_state, ProcessState::Processing);
        assert_eq!(row.locked_by.as_deref(), Some("submission-1"));
        assert!(!d.wake, "no scheduler needs waking");
    }

    #[test]
    fn a_new_order_waits_for_the_schedulers_when_anything_else_has_a_say() {
        let order = pending(2, |_| true);
        let received = |d: &Decision| {
            kinds(d) == [EventKind::Received]
                && d.wake
                && d.order.row.process_state == ProcessState::Pending
                && d.order.row.locked_by.is_none()
                && d.requests().next().is_none()
        };
        // Not due yet.
        let mut later = order.clone();
        later.row.not_before = Some(now() + chrono::Duration::minutes(5));
        assert!(received(
            &receive_and_start(&later, ctx("sub")).expect("rules")
        ));
        // Its agent's breaker is not closed.
        let gates = [Gate {
            agent: "a0".into(),
            state: State::Open,
            since: Some(now()),
            probe_order: None,
            max_hold_ms: 60_000,
            forced: false,
        }];
        let held = Given {
            gates: &gates,
            ..ctx("sub")
        };
        assert!(received(&receive_and_start(&order, held).expect("rules")));
        // Its agent is under flow control, with room or not.
        for in_flight in [0, 1] {
            let flows = [Flow {
                agent: "a0".into(),
                max_in_flight: Some(1),
                in_flight,
                rate_per_sec: None,
                available: None,
            }];
            let counted = Given {
                flows: &flows,
                ..ctx("sub")
            };
            assert!(received(
                &receive_and_start(&order, counted).expect("rules")
            ));
        }
        // Its first step is a wait: sas holds it, nothing to send.
        let (waits, known) = order_of(
            serde_json::json!([{ "name": "nap", "wait": "1h" }, { "name": "s", "agent": "a" }]),
            serde_json::json!({}),
        );
        let given = Given {
            definitions: &known,
            ..ctx("sub")
        };
        assert!(received(&receive_and_start(&waits, given).expect("rules")));
    }
}

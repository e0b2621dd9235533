//! Flow control per agent across the deployment (contract §4b): at most
//! `agents.<name>.max_in_flight` steps dispatched to an agent and not yet
//! answered. The rules dispatch a step only while its agent has room, as
//! loaded with the orders and counted down by the unit's own dispatches;
//! the write-back checks again, atomically, so that two schedulers
//! dispatching at once cannot pass the limit together.

use serde::{Deserialize, Serialize};

/// One limited agent, as loaded with the orders.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Flow {
    pub agent: String,
    pub max_in_flight: i32,
    /// Steps out with the agent now (this unit's dispatches included).
    pub in_flight: i32,
}

/// Whether one more step may go to `agent`: it has no limit, or room under it.
pub fn room(flows: &[Flow], agent: &str) -> bool {
    flows
        .iter()
        .find(|f| f.agent == agent)
        .is_none_or(|f| f.in_flight < f.max_in_flight)
}

#[cfg(test)]
mod tests {
    use super::super::Context;
    use super::super::order::fixture::{ctx, pending};
    use super::super::scheduler::{Replied, apply_reply, claim};
    use super::*;
    use crate::messages::{StepOutcome, StepReply};
    use crate::state::ProcessState;

    fn full(agent: &str) -> [Flow; 1] {
        [Flow {
            agent: agent.into(),
            max_in_flight: 1,
            in_flight: 1,
        }]
    }

    #[test]
    fn an_order_whose_next_agent_is_full_is_left_pending_and_one_mid_way_is_held() {
        let order = pending(2, |_| false);
        let a0 = full("a0");
        let left = claim(
            &order,
            Context {
                flows: &a0,
                ..ctx("s1")
            },
        )
        .unwrap();
        assert_eq!(left.order, order, "not claimed");
        assert!(left.effects.is_empty());
        // Step 0 done, step 1's agent full: the order waits, held, no failure.
        let claimed = claim(&order, ctx("s1")).unwrap();
        let (_, request) = claimed.requests().next().unwrap();
        let done = StepReply::to(
            request,
            StepOutcome::Succeeded {
                result: serde_json::json!({}),
            },
        );
        let a1 = full("a1");
        let Replied::Applied(d) = apply_reply(
            &claimed.order,
            &done,
            Context {
                flows: &a1,
                ..ctx("s1")
            },
        )
        .unwrap() else {
            panic!("counts");
        };
        let kinds: Vec<&str> = d.events().map(|e| e.kind.as_str()).collect();
        assert_eq!(kinds, ["step_succeeded", "held"]);
        let row = &d.order.row;
        assert_eq!(row.process_state, ProcessState::Pending);
        assert_eq!(row.held_reason.as_deref(), Some("rate_limited"));
        assert_eq!(row.hold_until, None, "no max_hold for a wait for room");
        assert_eq!(d.events().last().unwrap().detail["reason"], "rate_limited");
        // Room again: claimed, it resumes.
        let resumed = claim(&d.order, ctx("s2")).unwrap();
        assert_eq!(
            resumed.events().next().map(|e| e.kind.as_str()),
            Some("resumed")
        );
        assert_eq!(resumed.requests().count(), 1);
    }

    #[test]
    fn only_a_limited_agent_at_its_limit_has_no_room() {
        let flows = [Flow {
            agent: "pay".into(),
            max_in_flight: 2,
            in_flight: 2,
        }];
        assert!(!room(&flows, "pay"));
        assert!(room(&flows, "ship"));
        let below = [Flow {
            in_flight: 1,
            ..flows[0].clone()
        }];
        assert!(room(&below, "pay"));
    }
}

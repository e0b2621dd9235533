//! Flow control per agent across the deployment (contract §4b): at most
//! `agents.<name>.max_in_flight` steps dispatched to an agent and not yet
//! answered. The rules dispatch a step only while its agent has room, as
//! loaded with the orders and counted down by the unit's own dispatches;
//! the write-back checks again, atomically, so that two schedulers
//! dispatching at once cannot pass the limit together.

use serde::{Deserialize, Serialize};

use crate::model::StepRow;

/// One limited agent, as loaded with the orders.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Flow {
    pub agent: String,
    /// At most this many steps out with the agent (`None`: no bound).
    pub max_in_flight: Option<i32>,
    /// Steps out with the agent now (this unit's dispatches included).
    pub in_flight: i32,
    /// Dispatches per second (`None`: no rate limit).
    pub rate_per_sec: Option<f64>,
    /// Dispatches the rate allows now (its token bucket, this unit's
    /// dispatches taken).
    pub available: Option<f64>,
}

impl Flow {
    /// Whether one more step may go: under its in-flight limit and with a
    /// token in its bucket.
    pub fn has_room(&self) -> bool {
        self.max_in_flight.is_none_or(|max| self.in_flight < max)
            && self.available.is_none_or(|tokens| tokens >= 1.0)
    }

    /// Counts a step dispatched to the agent.
    pub fn dispatched(&mut self) {
        self.in_flight += 1;
        if let Some(tokens) = &mut self.available {
            *tokens -= 1.0;
        }
    }
}

/// Whether one more step may go to `agent`: it has no limit, or room under them.
pub fn room(flows: &[Flow], agent: &str) -> bool {
    flows
        .iter()
        .find(|f| f.agent == agent)
        .is_none_or(Flow::has_room)
}

/// How many more (or fewer) steps a write-back leaves out with an agent
/// under flow control, and how many it dispatches (each takes a token).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FlowDelta {
    pub agent: String,
    pub delta: i32,
    pub dispatched: i32,
}

/// The steps out with each agent of `flows` that a write-back adds or ends,
/// from each changed order's steps as read and as left (a step counts while
/// `running`, with its agent, or `compensating`, with its undo's:
/// [`StepRow::out_with`]), and the dispatches it makes (`dispatched`, an
/// agent per request). Agents without flow control are left out, and so
/// are agents with nothing to change.
pub fn deltas<'s>(
    flows: &[Flow],
    changed: impl IntoIterator<Item = (&'s [StepRow], &'s [StepRow])>,
    dispatched: &[String],
) -> Vec<FlowDelta> {
    if flows.is_empty() {
        return Vec::new();
    }
    let mut deltas: Vec<FlowDelta> = Vec::new();
    let mut add = |agent: Option<&str>, by: i32, sent: i32| {
        let Some(agent) = agent.filter(|a| flows.iter().any(|f| f.agent == *a)) else {
            return;
        };
        match deltas.iter_mut().find(|d| d.agent == agent) {
            Some(d) => {
                d.delta += by;
                d.dispatched += sent;
            }
            None => deltas.push(FlowDelta {
                agent: agent.to_owned(),
                delta: by,
                dispatched: sent,
            }),
        }
    };
    for (read, now) in changed {
        for (read, now) in read.iter().zip(now) {
            let (was, is) = (read.out_with(), now.out_with());
            if was != is {
                add(was, -1, 0);
                add(is, 1, 0);
            }
        }
    }
    for agent in dispatched {
        add(Some(agent), 0, 1);
    }
    deltas.retain(|d| d.delta != 0 || d.dispatched != 0);
    deltas
}

/// The burst a rate allows: a tenth of a second's worth, at least one
/// dispatch, so that no second sees much more than the rate.
pub fn burst(rate_per_sec: f64) -> f64 {
    (rate_per_sec / 10.0).max(1.0)
}

#[cfg(test)]
mod deltas_tests {
    use super::*;
    use crate::rules::order::fixture::pending;
    use crate::state::StepState;

    #[test]
    fn steps_going_out_or_coming_back_move_their_agents_count_and_dispatches_take_tokens() {
        let flows = [Flow {
            agent: "a0".into(),
            max_in_flight: Some(5),
            in_flight: 1,
            rate_per_sec: None,
            available: None,
        }];
        let read = pending(2, |_| false).steps;
        let mut now = read.clone();
        // Step 0 goes out to a0; step 1's agent has no flow control.
        now[0].state = StepState::Running;
        now[1].state = StepState::Running;
        let out = deltas(
            &flows,
            [(read.as_slice(), now.as_slice())],
            &["a0".into(), "a1".into()],
        );
        assert_eq!(
            out,
            [FlowDelta {
                agent: "a0".into(),
                delta: 1,
                dispatched: 1
            }]
        );
        // Back from a0: one fewer out, nothing dispatched.
        let back = deltas(&flows, [(now.as_slice(), read.as_slice())], &[]);
        assert_eq!(back[0].delta, -1);
        assert_eq!(back[0].dispatched, 0);
        assert!(deltas(&[], [(read.as_slice(), now.as_slice())], &["a0".into()]).is_empty());
        assert!(deltas(&flows, [(read.as_slice(), read.as_slice())], &[]).is_empty());
    }
}

#[cfg(test)]
mod tests {
    use super::super::Given;
    use super::super::order::fixture::{ctx, pending};
    use super::super::scheduler::{Claim, Replied, apply_reply, claim, claim_or_wait};
    use super::*;
    use crate::messages::{StepOutcome, StepReply};
    use crate::state::ProcessState;

    fn full(agent: &str) -> [Flow; 1] {
        [Flow {
            agent: agent.into(),
            max_in_flight: Some(1),
            in_flight: 1,
            rate_per_sec: None,
            available: None,
        }]
    }

    #[test]
    fn an_order_whose_next_agent_is_full_waits_held_for_it_whether_new_or_mid_way() {
        let order = pending(2, |_| false);
        let a0 = full("a0");
        let on_a0 = |actor| Given {
            flows: &a0,
            ..ctx(actor)
        };
        let waits = claim(&order, on_a0("s1")).unwrap();
        let kinds: Vec<&str> = waits.events().map(|e| e.kind.as_str()).collect();
        assert_eq!(kinds, ["held"], "not claimed: no processing");
        assert_eq!(waits.order.row.held_for.as_deref(), Some("a0"));
        assert_eq!(waits.order.row.locked_by, None);
        assert_eq!(waits.requests().count(), 0);
        // Still full at the next claim: nothing changes, nothing is logged again.
        let again = claim(&waits.order, on_a0("s2")).unwrap();
        assert_eq!(again.order, waits.order);
        assert!(again.effects.is_empty());
        // Said as such to the store, which then writes nothing.
        assert_eq!(
            claim_or_wait(&waits.order, on_a0("s2")).unwrap(),
            Claim::Waits
        );
        assert!(matches!(
            claim_or_wait(&order, on_a0("s1")).unwrap(),
            Claim::Decided(d) if *d == waits
        ));
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
            Given {
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
    fn only_a_limited_agent_at_its_limit_or_out_of_tokens_has_no_room() {
        let flows = [Flow {
            agent: "pay".into(),
            max_in_flight: Some(2),
            in_flight: 2,
            rate_per_sec: None,
            available: None,
        }];
        assert!(!room(&flows, "pay"));
        assert!(room(&flows, "ship"));
        let mut rated = Flow {
            max_in_flight: None,
            rate_per_sec: Some(20.0),
            available: Some(1.5),
            ..flows[0].clone()
        };
        assert!(rated.has_room());
        rated.dispatched();
        assert!(!rated.has_room(), "half a token left");
        assert_eq!(burst(20.0), 2.0);
        assert_eq!(burst(3.0), 1.0);
    }
}

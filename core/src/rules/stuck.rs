//! Why is it stuck (contract §8): for an order whose running step has
//! passed the first rung of its deadline ladder, the likeliest reason,
//! since when, and what shows it. Pure: the caller gathers the facts (the
//! holder's last heartbeat, the agent's request queue as the broker counts
//! it) and the clock.

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use super::Order;
use crate::model::StepRow;
use crate::state::ProcessState;

/// What the caller found out about the order's surroundings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Facts {
    /// When the scheduler holding the order last beat (`None`: never, or forgotten).
    pub holder_seen: Option<DateTime<Utc>>,
    /// The time between heartbeats; two missed say the holder is gone.
    pub heartbeat: std::time::Duration,
    /// The running step's request queue: messages ready and consumers
    /// (`None`: the broker could not be asked).
    pub queue: Option<(u32, u32)>,
    /// The database's clock.
    pub now: DateTime<Utc>,
}

/// Why an order is stuck.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The scheduler holding it has not beaten for two heartbeats.
    SchedulerGone,
    /// Nothing consumes its agent's requests.
    NoAgent,
    /// Its request waits behind others.
    Backlog,
    /// An agent has the request and has not answered.
    AgentBusy,
    /// Held: its agent's shared breaker is open.
    BreakerOpen,
    /// Held by flow control: its agent has no room under `max_in_flight`.
    RateLimited,
    /// None of the above could be told.
    Unknown,
}

impl Reason {
    /// Every reason, for a gauge that shows each.
    pub const ALL: [Self; 7] = [
        Self::SchedulerGone,
        Self::NoAgent,
        Self::Backlog,
        Self::AgentBusy,
        Self::BreakerOpen,
        Self::RateLimited,
        Self::Unknown,
    ];

    /// The name in `stuck.reason` and the `reason` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SchedulerGone => "scheduler_gone",
            Self::NoAgent => "no_agent",
            Self::Backlog => "backlog",
            Self::AgentBusy => "agent_busy",
            Self::BreakerOpen => "breaker_open",
            Self::RateLimited => "rate_limited",
            Self::Unknown => "unknown",
        }
    }
}

/// A stuck order's reason, since when, and what shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Stuck {
    pub reason: Reason,
    pub since: DateTime<Utc>,
    pub detail: Value,
}

impl Stuck {
    /// `stuck` as `sasctl orders show --json` and the dashboard give it.
    pub fn to_json(&self) -> Value {
        json!({
            "reason": self.reason.as_str(),
            "since": crate::messages::rfc3339::format(&self.since),
            "detail": self.detail,
        })
    }
}

/// The running step of `order` if the order may be stuck: the step has
/// passed the first rung of its deadline ladder. The caller gathers the
/// facts only then.
pub fn late_step(order: &Order) -> Option<&StepRow> {
    running_step(order).filter(|s| s.warned > 0)
}

/// The step `order` has out with an agent (forward or its undo), if any.
/// With steps in parallel, the one whose deadline comes first.
pub fn running_step(order: &Order) -> Option<&StepRow> {
    if !matches!(
        order.row.process_state,
        ProcessState::Processing | ProcessState::Compensating
    ) {
        return None;
    }
    order
        .steps
        .iter()
        .filter(|s| s.out_with().is_some())
        .min_by_key(|s| (s.complete_by, s.idx))
}

/// Why a held order is stuck: its agent's breaker is open, or its agent
/// has no room under flow control (since it was held). `None` for an order
/// that is not held.
pub fn held(order: &Order) -> Option<Stuck> {
    let agent = order.row.held_for.as_deref()?;
    let at = |t: Option<DateTime<Utc>>| t.map(|t| crate::messages::rfc3339::format(&t));
    let reason = match order.row.held_reason.as_deref() {
        Some("rate_limited") => Reason::RateLimited,
        _ => Reason::BreakerOpen,
    };
    Some(Stuck {
        reason,
        since: order.row.held_since.unwrap_or(order.row.updated_at),
        detail: json!({ "agent": agent, "hold_until": at(order.row.hold_until) }),
    })
}

/// Why `order` is stuck, if it is ([`late_step`]). The reasons are tried
/// in order: the holder gone, no agent, a backlog, else an agent busy
/// with it.
pub fn why(order: &Order, facts: &Facts) -> Option<Stuck> {
    if let Some(stuck) = held(order) {
        return Some(stuck);
    }
    let step = late_step(order)?;
    let dispatched = step
        .complete_by
        .map(|c| c - chrono::Duration::milliseconds(step.timeout_ms))
        .unwrap_or(facts.now);
    let agent = step.out_with();
    let gone_after =
        chrono::Duration::from_std(facts.heartbeat * 2).unwrap_or(chrono::Duration::MAX);
    let holder = order.row.locked_by.as_deref();
    let seen = facts.holder_seen;
    if seen.is_none_or(|seen| facts.now - seen > gone_after) {
        return Some(Stuck {
            reason: Reason::SchedulerGone,
            since: seen.map_or(dispatched, |s| s.max(dispatched)),
            detail: json!({ "locked_by": holder, "last_seen": seen.map(|s| crate::messages::rfc3339::format(&s)) }),
        });
    }
    let (reason, detail) = match facts.queue {
        None => (Reason::Unknown, json!({ "agent": agent })),
        Some((_, 0)) => (Reason::NoAgent, json!({ "agent": agent })),
        Some((ready, _)) if ready > 0 => {
            (Reason::Backlog, json!({ "agent": agent, "ahead": ready }))
        }
        Some(_) => (
            Reason::AgentBusy,
            json!({ "agent": agent, "step": step.name }),
        ),
    };
    Some(Stuck {
        reason,
        since: dispatched,
        detail,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::rules::order::fixture::{ctx, now, pending};
    use crate::rules::scheduler::claim;

    /// A claimed one-step order (budget 1 s from the fixture's clock),
    /// warned of its first rung.
    fn warned() -> Order {
        let mut order = claim(&pending(1, |_| true), ctx("s1"))
            .expect("claim")
            .order;
        order.steps[0].warned = 1;
        order
    }

    fn facts(seen_ago_ms: Option<i64>, queue: Option<(u32, u32)>) -> Facts {
        let at = now() + chrono::Duration::milliseconds(600);
        Facts {
            holder_seen: seen_ago_ms.map(|ms| at - chrono::Duration::milliseconds(ms)),
            heartbeat: Duration::from_secs(1),
            queue,
            now: at,
        }
    }

    fn reason(order: &Order, facts: &Facts) -> Option<&'static str> {
        why(order, facts).map(|s| s.reason.as_str())
    }

    #[test]
    fn each_reason_in_its_turn() {
        let o = warned();
        assert_eq!(
            reason(&o, &facts(None, Some((0, 1)))),
            Some("scheduler_gone")
        );
        assert_eq!(
            reason(&o, &facts(Some(2500), Some((0, 1)))),
            Some("scheduler_gone")
        );
        assert_eq!(reason(&o, &facts(Some(500), None)), Some("unknown"));
        assert_eq!(
            reason(&o, &facts(Some(500), Some((3, 0)))),
            Some("no_agent")
        );
        let backlog = why(&o, &facts(Some(500), Some((7, 2)))).expect("stuck");
        assert_eq!(backlog.reason, Reason::Backlog);
        assert_eq!(backlog.detail["ahead"], 7);
        assert_eq!(backlog.since, now(), "since the dispatch");
        assert_eq!(
            reason(&o, &facts(Some(500), Some((0, 1)))),
            Some("agent_busy")
        );
    }

    #[test]
    fn an_order_before_its_first_rung_or_not_running_is_not_stuck() {
        let mut o = warned();
        o.steps[0].warned = 0;
        assert_eq!(reason(&o, &facts(None, None)), None);
        let mut done = warned();
        done.row.process_state = ProcessState::Processed;
        assert_eq!(reason(&done, &facts(None, None)), None);
    }
}

//! The breaker shared by the deployment (contract §8): one per agent, in
//! the state store, written by every instance of that agent. Transient
//! failures are counted by all instances together ([`failed`]); at the
//! threshold the breaker opens and the orders that need the agent are held
//! ([`admit`]). After the cool-down one held order's step goes out as the
//! probe ([`probe`]): success closes the breaker ([`succeeded`]) and the
//! held orders resume; failure opens it for another cool-down. An
//! operator may force it open or closed ([`force`]).
//!
//! Pure: each rule takes the breaker as loaded and the database's clock
//! and returns the new breaker, or `None` when nothing changes. The state
//! store writes it back guarded by the version it loaded, so that two
//! instances deciding at once cannot both win: at most one of them starts
//! a probe.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A breaker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Steps for the agent are dispatched.
    Closed,
    /// Nothing is dispatched for the agent: orders that need it are held.
    Open,
    /// One held order's step is out as the probe; the others stay held.
    HalfOpen,
}

impl State {
    /// The name in the state store.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        }
    }

    /// The name's state (`None` for an unknown one).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "closed" => Some(Self::Closed),
            "open" => Some(Self::Open),
            "half_open" => Some(Self::HalfOpen),
            _ => None,
        }
    }
}

/// One agent's breaker as the rules see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Breaker {
    pub agent: String,
    pub state: State,
    /// Consecutive transient failures, all instances together.
    pub failures: i32,
    /// When it last opened (kept through half-open: the outage's start).
    pub opened_at: Option<DateTime<Utc>>,
    /// Open: the end of the cool-down. Half-open: when the probe is given up.
    pub open_until: Option<DateTime<Utc>>,
    /// Half-open: the held order whose step is the probe.
    pub probe_order: Option<Uuid>,
    /// An operator's override.
    pub forced: Option<State>,
    /// Failures that open it.
    pub threshold: i32,
    /// The cool-down, in milliseconds.
    pub cooldown_ms: i64,
    /// How long an order may be held, in milliseconds.
    pub max_hold_ms: i64,
}

impl Breaker {
    /// A closed breaker for `agent` with this policy.
    pub fn closed(agent: &str, threshold: i32, cooldown_ms: i64, max_hold_ms: i64) -> Self {
        Self {
            agent: agent.to_owned(),
            state: State::Closed,
            failures: 0,
            opened_at: None,
            open_until: None,
            probe_order: None,
            forced: None,
            threshold,
            cooldown_ms,
            max_hold_ms,
        }
    }

    /// Whether a step of `order_id` may call the remote: the breaker is
    /// closed, or the step is its probe.
    pub fn lets_through(&self, order_id: Uuid) -> bool {
        match self.state {
            State::Closed => true,
            State::HalfOpen => self.probe_order == Some(order_id),
            State::Open => false,
        }
    }

    fn cooldown_from(&self, now: DateTime<Utc>) -> DateTime<Utc> {
        after(now, self.cooldown_ms)
    }

    fn open(mut self, now: DateTime<Utc>) -> Self {
        if self.state == State::Closed {
            self.opened_at = Some(now);
        }
        self.state = State::Open;
        self.open_until = Some(self.cooldown_from(now));
        self.probe_order = None;
        self
    }
}

/// `now` plus `ms` milliseconds, saturating.
pub fn after(now: DateTime<Utc>, ms: i64) -> DateTime<Utc> {
    now.checked_add_signed(chrono::Duration::milliseconds(ms.max(0)))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// A transient failure of a call to the agent's remote: counted; the
/// breaker opens at the threshold, and a half-open one opens again (its
/// probe failed). Forced either way, only the count moves.
pub fn failed(b: &Breaker, now: DateTime<Utc>) -> Breaker {
    let mut next = b.clone();
    next.failures = b.failures.saturating_add(1);
    if b.forced.is_some() {
        return next;
    }
    let trip = match b.state {
        State::Closed => next.failures >= b.threshold.max(1),
        State::HalfOpen => true,
        State::Open => false,
    };
    if trip { next.open(now) } else { next }
}

/// An answer that shows the remote works (a success, or a permanent
/// error): the count starts again and the breaker closes, unless an
/// operator forced it open. `None` when nothing changes.
pub fn succeeded(b: &Breaker) -> Option<Breaker> {
    let closes = b.state != State::Closed && b.forced != Some(State::Open);
    if b.failures == 0 && !closes {
        return None;
    }
    let mut next = b.clone();
    next.failures = 0;
    if closes {
        next.state = State::Closed;
        next.open_until = None;
        next.probe_order = None;
    }
    Some(next)
}

/// After the cool-down, the probe: the breaker half-opens with `held`
/// (the oldest held order) as its probe, until another cool-down has
/// passed. Also when a half-open breaker's probe was given no verdict in
/// time. `None` before then, when forced, or with no held order to probe
/// with (the breaker waits, open, for one).
pub fn probe(b: &Breaker, held: Option<Uuid>, now: DateTime<Utc>) -> Option<Breaker> {
    let due = matches!(b.state, State::Open | State::HalfOpen)
        && b.forced.is_none()
        && b.open_until.is_none_or(|t| t <= now);
    let order = held.filter(|_| due)?;
    let mut next = b.clone();
    next.state = State::HalfOpen;
    next.probe_order = Some(order);
    next.open_until = Some(b.cooldown_from(now));
    Some(next)
}

/// An operator forces the breaker `to` (open or closed), or lets it decide
/// again (`None`: it stays as it is, an open one probing after a cool-down).
pub fn force(b: &Breaker, to: Option<State>, now: DateTime<Utc>) -> Breaker {
    let mut next = b.clone();
    next.forced = to;
    match to {
        Some(State::Open) => {
            next = next.open(now);
            next.forced = to;
        }
        Some(State::Closed) => {
            next.state = State::Closed;
            next.failures = 0;
            next.open_until = None;
            next.probe_order = None;
        }
        // Half-open is not an operator's to force.
        Some(State::HalfOpen) | None => {}
    }
    next
}

/// What dispatching steps need to know of a breaker that is not closed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gate {
    pub agent: String,
    pub state: State,
    /// When the breaker opened.
    pub since: Option<DateTime<Utc>>,
    /// The order whose step is the probe, when half-open.
    pub probe_order: Option<Uuid>,
    /// How long an order may be held for it, in milliseconds.
    pub max_hold_ms: i64,
    /// Whether an operator forced it open.
    pub forced: bool,
}

/// Whether a step of `order_id` may go to `agent` now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit<'g> {
    /// Its breaker is closed.
    Go,
    /// It is the probe of its half-open breaker.
    Probe,
    /// Its breaker is open (or half-open with another probe): hold the order.
    Hold(&'g Gate),
}

/// Whether a step of `order_id` may be dispatched to `agent`, given the
/// breakers that are not closed (`gates`).
pub fn admit<'g>(gates: &'g [Gate], agent: &str, order_id: Uuid) -> Admit<'g> {
    match gates.iter().find(|g| g.agent == agent) {
        None => Admit::Go,
        Some(g) if g.state == State::Closed => Admit::Go,
        Some(g) if g.state == State::HalfOpen && g.probe_order == Some(order_id) => Admit::Probe,
        Some(g) => Admit::Hold(g),
    }
}

#[cfg(test)]
mod tests {
    use super::super::Given;
    use super::super::order::fixture::now;
    use super::*;

    fn closed() -> Breaker {
        Breaker::closed("pay", 3, 5_000, 60_000)
    }

    #[test]
    fn consecutive_failures_open_it_and_a_success_starts_the_count_again() {
        let t = now();
        let once = failed(&closed(), t);
        let twice = failed(&once, t);
        assert_eq!((twice.state, twice.failures), (State::Closed, 2));
        let reset = succeeded(&twice).unwrap();
        assert_eq!((reset.state, reset.failures), (State::Closed, 0));
        assert_eq!(succeeded(&reset), None, "nothing to write");
        let open = failed(&failed(&twice, t), t);
        assert_eq!(open.state, State::Open);
        assert_eq!(open.opened_at, Some(t));
        assert_eq!(open.open_until, Some(after(t, 5_000)));
        // More failures while open move only the count.
        let later = failed(&open, after(t, 1_000));
        assert_eq!(later.open_until, open.open_until);
    }

    #[test]
    fn one_probe_per_cooldown_with_the_oldest_held_order() {
        let t = now();
        let open = failed(&failed(&failed(&closed(), t), t), t);
        let held = Uuid::new_v4();
        assert_eq!(
            probe(&open, Some(held), after(t, 4_999)),
            None,
            "cooling down"
        );
        assert_eq!(
            probe(&open, None, after(t, 5_000)),
            None,
            "nothing to probe with"
        );
        let half = probe(&open, Some(held), after(t, 5_000)).unwrap();
        assert_eq!(half.state, State::HalfOpen);
        assert_eq!(half.probe_order, Some(held));
        assert_eq!(half.opened_at, Some(t), "the outage's start is kept");
        // Another instance that loaded the half-open breaker finds no probe to start.
        assert_eq!(probe(&half, Some(Uuid::new_v4()), after(t, 9_999)), None);
        // The probe failed: open for another cool-down, no probe.
        let again = failed(&half, after(t, 6_000));
        assert_eq!(again.state, State::Open);
        assert_eq!(again.open_until, Some(after(t, 11_000)));
        assert_eq!(again.probe_order, None);
        // The probe succeeded: closed.
        let healed = succeeded(&half).unwrap();
        assert_eq!((healed.state, healed.probe_order), (State::Closed, None));
    }

    #[test]
    fn a_probe_without_a_verdict_in_time_is_given_up_for_another() {
        let t = now();
        let open = failed(&failed(&failed(&closed(), t), t), t);
        let half = probe(&open, Some(Uuid::new_v4()), after(t, 5_000)).unwrap();
        let next = Uuid::new_v4();
        let retried = probe(&half, Some(next), after(t, 10_000)).unwrap();
        assert_eq!(retried.probe_order, Some(next));
    }

    #[test]
    fn an_operator_forces_it_and_the_agents_only_count() {
        let t = now();
        let open = force(&closed(), Some(State::Open), t);
        assert_eq!((open.state, open.forced), (State::Open, Some(State::Open)));
        assert_eq!(succeeded(&open).map(|b| b.state), None);
        assert_eq!(probe(&open, Some(Uuid::new_v4()), after(t, 60_000)), None);
        let kept_closed = force(&open, Some(State::Closed), t);
        let failing = (0..10).fold(kept_closed, |b, _| failed(&b, t));
        assert_eq!((failing.state, failing.failures), (State::Closed, 10));
        let free = force(&failing, None, t);
        assert_eq!(free.forced, None);
        assert_eq!(
            failed(&free, t).state,
            State::Open,
            "counting opens it again"
        );
    }

    fn gate(agent: &str, state: State, probe_order: Option<Uuid>) -> Gate {
        Gate {
            agent: agent.into(),
            state,
            since: Some(now()),
            probe_order,
            max_hold_ms: 60_000,
            forced: false,
        }
    }

    fn kinds(d: &super::super::Decision) -> Vec<&'static str> {
        d.events().map(|e| e.kind.as_str()).collect()
    }

    #[test]
    fn an_order_whose_agent_is_behind_an_open_breaker_is_held_then_resumed() {
        use super::super::order::fixture::{ctx, pending};
        use super::super::scheduler::claim;
        use crate::state::{ProcessState, StepState};
        let order = pending(2, |_| true);
        let open = [gate("a0", State::Open, None)];
        let held = claim(
            &order,
            Given {
                gates: &open,
                ..ctx("s1")
            },
        )
        .unwrap();
        assert_eq!(kinds(&held), ["processing", "held"]);
        assert_eq!(held.requests().count(), 0, "nothing dispatched");
        let row = &held.order.row;
        assert_eq!(row.process_state, ProcessState::Pending);
        assert_eq!((row.locked_by.as_deref(), row.complete_by), (None, None));
        assert_eq!(row.held_for.as_deref(), Some("a0"));
        assert_eq!(row.hold_until, Some(after(now(), 60_000)));
        assert_eq!(row.failure_count, 0);
        let event = held.events().last().unwrap();
        assert_eq!(event.detail["agent"], "a0");
        assert_eq!(event.detail["reason"], "breaker_open");
        assert_eq!(held.order.steps[0].state, StepState::NotStarted);
        // Closed again: claimed, it resumes (no second `processing`) and dispatches.
        let resumed = claim(&held.order, ctx("s2")).unwrap();
        assert_eq!(kinds(&resumed), ["resumed"]);
        assert_eq!(resumed.requests().count(), 1);
        assert_eq!(resumed.order.row.held_for, None);
        assert_eq!(resumed.order.row.hold_until, None);
        // As the probe of a half-open breaker it goes too; another order does not.
        let id = held.order.row.order_id;
        let half = [gate("a0", State::HalfOpen, Some(id))];
        let probe = claim(
            &held.order,
            Given {
                gates: &half,
                ..ctx("s2")
            },
        )
        .unwrap();
        assert_eq!(probe.requests().count(), 1);
        let other = claim(
            &pending(1, |_| true),
            Given {
                gates: &half,
                ..ctx("s2")
            },
        )
        .unwrap();
        assert_eq!(kinds(&other), ["processing", "held"]);
    }

    #[test]
    fn a_hold_is_announced_once_whatever_its_failed_probes_and_ends_once_answered() {
        use super::super::order::fixture::{ctx, pending};
        use super::super::scheduler::{Replied, apply_reply, claim};
        use super::super::supervisor::expire;
        use crate::messages::{StepOutcome, StepReply};
        use crate::spec::SupervisorSettings;
        let open = [gate("a0", State::Open, None)];
        let with = |gates| Given { gates, ..ctx("s1") };
        let mut order = claim(&pending(1, |_| true), with(&open)).unwrap().order;
        let since = order.row.held_since;
        let until = order.row.hold_until;
        let id = order.row.order_id;
        let half = [gate("a0", State::HalfOpen, Some(id))];
        let settings = SupervisorSettings::default();
        for _ in 0..3 {
            // Out as the probe: no `resumed`, the hold goes on.
            let probe = claim(&order, with(&half)).unwrap();
            assert_eq!(kinds(&probe), Vec::<&str>::new());
            assert_eq!(probe.requests().count(), 1);
            // The probe fails (its step late behind the breaker, open
            // again): held again, silently, from when the hold began.
            let (late, _) = expire(&probe.order, &settings, with(&open));
            assert_eq!(kinds(&late), Vec::<&str>::new());
            assert_eq!(late.order.row.held_for.as_deref(), Some("a0"));
            assert_eq!(
                (late.order.row.held_since, late.order.row.hold_until),
                (since, until)
            );
            assert_eq!(late.order.row.failure_count, 0);
            order = late.order;
        }
        // A probe the agent answers `held` (the breaker open when it came):
        // still held, silently.
        let probe = claim(&order, with(&half)).unwrap();
        let (_, request) = probe.requests().next().unwrap();
        let Replied::Applied(held) = apply_reply(
            &probe.order,
            &StepReply::to(request, StepOutcome::Held { tried: false }),
            with(&open),
        )
        .unwrap() else {
            panic!("counts");
        };
        assert_eq!(kinds(&held), Vec::<&str>::new());
        assert_eq!(held.order.row.held_since, since);
        // A probe the remote answers: the hold ends, once.
        let probe = claim(&held.order, with(&half)).unwrap();
        let (_, request) = probe.requests().next().unwrap();
        let done = StepOutcome::Succeeded {
            result: serde_json::json!({}),
        };
        let Replied::Applied(answered) =
            apply_reply(&probe.order, &StepReply::to(request, done), with(&[])).unwrap()
        else {
            panic!("counts");
        };
        assert_eq!(kinds(&answered)[..2], ["resumed", "step_succeeded"]);
        assert_eq!(answered.order.row.held_since, None);
        assert_eq!(answered.order.row.hold_until, None);
    }

    #[test]
    fn an_agents_held_answer_holds_without_a_failure_and_a_late_step_behind_a_breaker_too() {
        use super::super::order::fixture::{ctx, pending};
        use super::super::scheduler::{Replied, apply_reply, claim};
        use super::super::supervisor::expire;
        use crate::messages::{StepOutcome, StepReply};
        use crate::spec::SupervisorSettings;
        use crate::state::{ProcessState, StepState};
        let claimed = claim(&pending(1, |_| true), ctx("s1")).unwrap();
        let (_, request) = claimed.requests().next().unwrap();
        let reply = StepReply::to(request, StepOutcome::Held { tried: false });
        let running = claimed.order.clone();
        let open = [gate("a0", State::Open, None)];
        let Replied::Applied(d) = apply_reply(
            &running,
            &reply,
            Given {
                gates: &open,
                ..ctx("s1")
            },
        )
        .unwrap() else {
            panic!("a current held answer counts");
        };
        assert_eq!(kinds(&d), ["held"]);
        assert_eq!(d.order.row.failure_count, 0);
        assert_eq!(d.order.steps[0].state, StepState::NotStarted);
        assert_eq!(d.order.steps[0].dispatch_id, None, "a late reply is stale");
        // Closed by the time the answer is applied: dispatched again at once.
        let Replied::Applied(again) = apply_reply(&running, &reply, ctx("s1")).unwrap() else {
            panic!("counts");
        };
        assert_eq!(kinds(&again), Vec::<&str>::new());
        assert_eq!(again.requests().count(), 1);
        // The supervisor finds the step late behind the open breaker: held.
        let settings = SupervisorSettings::default();
        let (late, requeued) = expire(
            &running,
            &settings,
            Given {
                gates: &open,
                ..ctx("sup")
            },
        );
        assert_eq!((kinds(&late), requeued), (vec!["held"], None));
        assert_eq!(late.order.row.failure_count, 0);
        // Held past max_hold: a failure, as a late step would be.
        let (over, requeued) = expire(&late.order, &settings, ctx("sup"));
        assert_eq!(kinds(&over), ["retry_scheduled"]);
        assert!(requeued.is_some());
        assert_eq!(over.order.row.failure_count, 1);
        assert_eq!(over.order.row.held_for, None);
        assert_eq!(over.order.row.process_state, ProcessState::Pending);
        let reason = over.events().last().unwrap().reason.clone().unwrap();
        assert!(
            reason.starts_with("held longer than its agent's max_hold"),
            "{reason}"
        );
    }

    #[test]
    fn only_the_probe_passes_a_half_open_gate() {
        let probe_order = Uuid::new_v4();
        let gates = [Gate {
            agent: "pay".into(),
            state: State::HalfOpen,
            since: Some(now()),
            probe_order: Some(probe_order),
            max_hold_ms: 1,
            forced: false,
        }];
        assert_eq!(admit(&gates, "ship", probe_order), Admit::Go);
        assert_eq!(admit(&gates, "pay", probe_order), Admit::Probe);
        assert_eq!(admit(&gates, "pay", Uuid::new_v4()), Admit::Hold(&gates[0]));
    }
}

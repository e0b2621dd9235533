//! What the supervisor decides when an order's complete-by has passed
//! (contract §4a): count the failure, then try again after the stored
//! retry schedule's wait, or give up once `supervisor.max_failures` is
//! reached. An order that was being undone counts its compensation's
//! failures instead and, out of tries, fails. Pure: no clock read, no I/O;
//! the state store loads the order, applies the decision and writes back.

use chrono::{DateTime, Utc};

use crate::config::SupervisorSettings;
use crate::state::ProcessState;

/// What an expired order looks like to the supervisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expiry {
    /// `processing` (a step ran late) or `compensating` (an undo ran late).
    pub state: ProcessState,
    /// Failures of the forward attempts so far.
    pub failure_count: i32,
    /// Failures of the compensation so far.
    pub compensation_failures: i32,
}

/// The supervisor's decision for one expired order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AtDeadline {
    /// Whether the compensation (rather than the forward work) ran late:
    /// its failures are the ones counted.
    pub compensating: bool,
    /// The failure count after this one: the order's `failure_count`, or its
    /// `compensation_failures` when compensating.
    pub failures: i32,
    /// Why, for the event log and the status event.
    pub reason: String,
    /// What happens next.
    pub next: Next,
}

/// What happens to an expired order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Out of tries: give up and compensate the completed steps.
    GiveUp,
    /// Out of tries while compensating: the order fails.
    Fail,
    /// Try again from `to` (`pending`, or `compensating` to go on undoing)
    /// once `not_before` has come.
    Retry {
        to: ProcessState,
        not_before: DateTime<Utc>,
        /// The attempt the `retry_scheduled` event names.
        attempt: i32,
        /// Whether the retry may start at once (the schedulers are woken).
        now: bool,
    },
}

/// The decision for `order`, whose complete-by had passed at `now`.
pub fn at_deadline(order: Expiry, now: DateTime<Utc>, settings: &SupervisorSettings) -> AtDeadline {
    let compensating = order.state == ProcessState::Compensating;
    let failures = if compensating {
        order.compensation_failures
    } else {
        order.failure_count
    }
    .saturating_add(1);
    let reason = format!(
        "complete-by passed ({failures} of {} allowed)",
        settings.max_failures
    );
    let tries = u32::try_from(failures).unwrap_or(u32::MAX);
    if tries >= settings.max_failures {
        let (next, reason) = if compensating {
            (
                Next::Fail,
                format!("compensation could not complete: {reason}"),
            )
        } else {
            (Next::GiveUp, reason)
        };
        return AtDeadline {
            compensating,
            failures,
            reason,
            next,
        };
    }
    let delay =
        chrono::Duration::from_std(settings.retry_delay(tries)).unwrap_or(chrono::Duration::MAX);
    let not_before = now
        .checked_add_signed(delay)
        .unwrap_or(DateTime::<Utc>::MAX_UTC);
    let (to, attempt) = if compensating {
        (ProcessState::Compensating, order.failure_count + 1)
    } else {
        (ProcessState::Pending, failures + 1)
    };
    AtDeadline {
        compensating,
        failures,
        reason,
        next: Next::Retry {
            to,
            not_before,
            attempt,
            now: delay.is_zero(),
        },
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn settings(max_failures: u32, schedule: &[u64]) -> SupervisorSettings {
        SupervisorSettings {
            max_failures,
            retry_schedule: schedule.iter().map(|s| Duration::from_secs(*s)).collect(),
            ..SupervisorSettings::default()
        }
    }

    fn processing(failure_count: i32) -> Expiry {
        Expiry {
            state: ProcessState::Processing,
            failure_count,
            compensation_failures: 0,
        }
    }

    #[test]
    fn a_late_step_counts_a_failure_and_waits_as_the_schedule_says() {
        let now = Utc::now();
        let s = settings(3, &[60, 300]);
        let first = at_deadline(processing(0), now, &s);
        assert_eq!(first.failures, 1);
        assert_eq!(first.reason, "complete-by passed (1 of 3 allowed)");
        assert_eq!(
            first.next,
            Next::Retry {
                to: ProcessState::Pending,
                not_before: now + chrono::Duration::seconds(60),
                attempt: 2,
                now: false,
            }
        );
        let second = at_deadline(processing(1), now, &s);
        assert!(matches!(
            second.next,
            Next::Retry { not_before, attempt: 3, .. } if not_before == now + chrono::Duration::seconds(300)
        ));
    }

    #[test]
    fn the_last_entry_of_the_schedule_repeats_and_a_zero_wait_starts_at_once() {
        let now = Utc::now();
        let s = settings(10, &[0, 5]);
        assert!(matches!(
            at_deadline(processing(0), now, &s).next,
            Next::Retry { now: true, not_before, .. } if not_before == now
        ));
        assert!(matches!(
            at_deadline(processing(6), now, &s).next,
            Next::Retry { now: false, not_before, .. } if not_before == now + chrono::Duration::seconds(5)
        ));
    }

    #[test]
    fn reaching_max_failures_gives_up() {
        let decision = at_deadline(processing(2), Utc::now(), &settings(3, &[1]));
        assert_eq!(decision.next, Next::GiveUp);
        assert_eq!(decision.failures, 3);
        assert!(!decision.compensating);
        // Beyond the limit too (the limit was lowered meanwhile).
        assert_eq!(
            at_deadline(processing(9), Utc::now(), &settings(3, &[1])).next,
            Next::GiveUp
        );
    }

    #[test]
    fn a_late_compensation_counts_its_own_failures_and_fails_when_out_of_tries() {
        let now = Utc::now();
        let s = settings(2, &[7]);
        let undoing = Expiry {
            state: ProcessState::Compensating,
            failure_count: 4,
            compensation_failures: 0,
        };
        let again = at_deadline(undoing, now, &s);
        assert!(again.compensating);
        assert_eq!(
            again.failures, 1,
            "the compensation's failures, not the order's"
        );
        assert_eq!(
            again.next,
            Next::Retry {
                to: ProcessState::Compensating,
                not_before: now + chrono::Duration::seconds(7),
                attempt: 5,
                now: false,
            }
        );
        let out = at_deadline(
            Expiry {
                compensation_failures: 1,
                ..undoing
            },
            now,
            &s,
        );
        assert_eq!(out.next, Next::Fail);
        assert_eq!(
            out.reason,
            "compensation could not complete: complete-by passed (2 of 2 allowed)"
        );
    }

    #[test]
    fn an_endless_wait_does_not_overflow() {
        let decision = at_deadline(processing(0), DateTime::<Utc>::MAX_UTC, &settings(3, &[60]));
        assert!(matches!(
            decision.next,
            Next::Retry { not_before, .. } if not_before == DateTime::<Utc>::MAX_UTC
        ));
    }
}

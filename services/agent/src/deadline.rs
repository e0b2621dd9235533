//! A step's complete-by as the agent keeps it (contract §6a): hosts' clocks
//! may disagree by minutes, so the agent does not compare the request's
//! absolute `complete_by` (the state store's clock) with its own wall
//! clock. It counts the time left at dispatch, which the request carries,
//! on its own monotonic clock from when the request arrived; the absolute
//! time still goes to the remote in `X-Complete-By`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sas::messages::StepRequest;
use tokio::time::Instant;

/// When a step's time is up, on this process's monotonic clock, and the
/// same moment on the state store's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    at: Instant,
    wall: DateTime<Utc>,
}

impl Deadline {
    /// The deadline of `request`, which arrived at `arrived`. A request
    /// delivered again (its first agent died, or gave it back) may have
    /// waited any time since its dispatch, and one from an older scheduler
    /// carries no time left: for those `complete_by` is compared with
    /// `now` on the state store's clock when the agent could read it (an
    /// agent whose own clock is off keeps such a request), else with this
    /// host's.
    pub fn of(
        request: &StepRequest,
        arrived: Instant,
        redelivered: bool,
        store_now: Option<DateTime<Utc>>,
    ) -> Self {
        let left = match request.time_left_ms {
            Some(ms) if !redelivered => Duration::from_millis(u64::try_from(ms).unwrap_or(0)),
            _ => (request.complete_by - store_now.unwrap_or_else(Utc::now))
                .to_std()
                .unwrap_or_default(),
        };
        Self {
            at: arrived + left,
            wall: request.complete_by,
        }
    }

    /// The time left, if any.
    pub fn remaining(&self) -> Option<Duration> {
        let left = self.at.saturating_duration_since(Instant::now());
        (!left.is_zero()).then_some(left)
    }

    /// The deadline on the state store's clock, for `X-Complete-By`.
    pub fn wall(&self) -> DateTime<Utc> {
        self.wall
    }

    /// The deadline a `202` heartbeat gives (§4b): `timeout` from now, never
    /// past `max` (on the state store's clock, as the request says it);
    /// `None` when that is no later than this one.
    pub fn extended(&self, timeout: Duration, max: DateTime<Utc>) -> Option<Self> {
        let mut at = Instant::now() + timeout;
        let room = max - self.wall;
        let max_at = match room.to_std() {
            Ok(ahead) => self.at + ahead,
            Err(_) => self.at,
        };
        at = at.min(max_at);
        let moved = at
            .checked_duration_since(self.at)
            .filter(|d| !d.is_zero())?;
        Some(Self {
            at,
            wall: self.wall + chrono::Duration::from_std(moved).ok()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Map, Value};
    use uuid::Uuid;

    use super::*;

    fn request(complete_by: DateTime<Utc>, time_left_ms: Option<i64>) -> StepRequest {
        StepRequest {
            order_id: Uuid::new_v4(),
            workflow: "w".into(),
            step: "a".into(),
            step_index: 0,
            direction: sas::messages::Direction::Forward,
            attempt: 1,
            dispatch_id: Uuid::new_v4(),
            locked_by: "s1".into(),
            complete_by,
            payload: Value::Null,
            results: Map::new(),
            fencing_token: 1,
            timeout_ms: Some(2000),
            max_complete_by: None,
            time_left_ms,
            redrive: 0,
            in_doubt: false,
            retry: None,
            item: None,
            index: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_time_left_counts_on_the_monotonic_clock_whatever_the_wall_clocks_say() {
        // The state store's clock is five minutes behind this host's: by
        // the wall clocks the step expired long ago, but it has 2 s left.
        let store_now = Utc::now() - chrono::Duration::minutes(5);
        let complete_by = store_now + chrono::Duration::seconds(2);
        let d = Deadline::of(
            &request(complete_by, Some(2000)),
            Instant::now(),
            false,
            None,
        );
        assert_eq!(d.remaining(), Some(Duration::from_secs(2)));
        assert_eq!(d.wall(), complete_by);
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(d.remaining(), Some(Duration::from_millis(500)));
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(d.remaining(), None);
        // Delivered again, it may have waited since its dispatch: by the
        // wall clock, long expired.
        let again = Deadline::of(
            &request(complete_by, Some(2000)),
            Instant::now(),
            true,
            None,
        );
        assert_eq!(again.remaining(), None);
        // By the state store's clock, read when it came again: 2 s left.
        let by_store = Deadline::of(
            &request(complete_by, Some(2000)),
            Instant::now(),
            true,
            Some(store_now),
        );
        assert_eq!(by_store.remaining(), Some(Duration::from_secs(2)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_heartbeat_moves_it_by_the_timeout_within_max_on_both_clocks() {
        let complete_by = Utc::now() + chrono::Duration::seconds(2);
        let d = Deadline::of(
            &request(complete_by, Some(2000)),
            Instant::now(),
            false,
            None,
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        let max = complete_by + chrono::Duration::seconds(2);
        let moved = d.extended(Duration::from_secs(2), max).expect("moved");
        assert_eq!(moved.remaining(), Some(Duration::from_secs(2)));
        assert_eq!(moved.wall(), complete_by + chrono::Duration::seconds(1));
        // Bounded by max, and never back.
        let capped = moved
            .extended(Duration::from_secs(60), max)
            .expect("moved to max");
        assert_eq!(capped.wall(), max);
        assert_eq!(capped.extended(Duration::from_secs(60), max), None);
        assert_eq!(d.extended(Duration::ZERO, max), None);
    }
}

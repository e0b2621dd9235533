//! The room new orders start in, kept between a submission's write-backs:
//! each write-back that starts orders reads the room as it leaves it, and
//! the next batch within [`FRESH_FOR`] starts in that instead of reading it
//! again, so that at a steady rate an order costs its submission one
//! statement.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use sas_store::Room;

/// How long a room read by a write-back stands for the room now, unless
/// set (`submission.room_fresh_for`). A breaker
/// that opened, or orders another process started, within it are seen by
/// the next read: as by a request already on its way when the breaker
/// opened, which the agent answers as its breaker says.
pub const FRESH_FOR: Duration = Duration::from_millis(100);

/// The room the last write-back read, and when.
#[derive(Debug)]
pub struct KeptRoom {
    kept: Mutex<Option<(Instant, Room)>>,
    /// How long a room kept stands for the room now ([`FRESH_FOR`] unless set).
    fresh_for: Duration,
}

impl Default for KeptRoom {
    fn default() -> Self {
        Self::fresh_for(FRESH_FOR)
    }
}

impl KeptRoom {
    /// Keeps a room for `fresh_for` (zero: never).
    pub fn fresh_for(fresh_for: Duration) -> Self {
        Self {
            kept: Mutex::new(None),
            fresh_for,
        }
    }

    /// The room kept, if it is younger than its freshness, its clock moved
    /// on by its age.
    pub fn fresh(&self) -> Option<Room> {
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let (at, room) = kept.as_ref()?;
        let age = at.elapsed();
        if age >= self.fresh_for {
            return None;
        }
        let mut room = room.clone();
        room.now += chrono::Duration::from_std(age).unwrap_or_default();
        Some(room)
    }

    /// Keeps `room`, read by a write-back that started `started` orders of
    /// its own (its count, read in the statement's snapshot, misses them).
    pub fn keep(&self, mut room: Room, started: usize) {
        room.held += i64::try_from(started).unwrap_or(i64::MAX);
        *self.kept.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), room));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn room(held: i64) -> Room {
        Room {
            now: chrono::Utc::now(),
            gates: Vec::new(),
            flows: Vec::new(),
            held,
        }
    }

    #[test]
    fn a_kept_room_counts_the_orders_its_write_back_started_and_goes_stale() {
        let kept = KeptRoom::default();
        assert_eq!(kept.fresh(), None, "nothing kept yet");
        let read = room(7);
        kept.keep(read.clone(), 3);
        let fresh = kept.fresh().expect("fresh");
        assert_eq!(fresh.held, 10);
        assert!(fresh.now >= read.now, "its clock moves on");
        // Aged past FRESH_FOR (set back rather than slept for).
        kept.kept.lock().expect("lock").as_mut().expect("kept").0 -= FRESH_FOR;
        assert_eq!(kept.fresh(), None);
        let never = KeptRoom::fresh_for(Duration::ZERO);
        never.keep(room(0), 0);
        assert_eq!(never.fresh(), None, "zero keeps nothing");
    }
}

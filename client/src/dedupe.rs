//! What "deduplicated on (`order_id`, `seq`)" remembers (contract §2:
//! delivery is at least once, so the same event may come twice). Pure.
//!
//! Invariant: an event whose key was seen among the last `capacity` keys is
//! a duplicate; memory stays bounded by `capacity` however long the stream
//! runs. A duplicate older than that is let through again: redeliveries come
//! soon after the original (a consumer that died before acking, an outbox
//! relay that republished), not hundreds of thousands of events later.

use std::collections::{HashSet, VecDeque};

use serde_json::Value;

/// The key of a status event: its order id as JSON text and its `seq`.
type Key = (String, i64);

/// The keys of the last `capacity` events seen.
#[derive(Debug)]
pub struct Seen {
    keys: HashSet<Key>,
    /// The same keys, oldest first, to forget the oldest.
    order: VecDeque<Key>,
    capacity: usize,
}

impl Seen {
    /// Remembers at most `capacity` keys (at least one).
    pub fn new(capacity: usize) -> Self {
        Self {
            keys: HashSet::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    /// Whether the event `(order_id, seq)` is seen for the first time; it
    /// is remembered. An event without an order id (a `rejected` event of a
    /// message that had none) has no identity: always the first time.
    pub fn first_time(&mut self, order_id: &Value, seq: i64) -> bool {
        let id = match order_id {
            Value::Null => return true,
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let key = (id, seq);
        if self.keys.contains(&key) {
            return false;
        }
        if self.order.len() >= self.capacity
            && let Some(oldest) = self.order.pop_front()
        {
            self.keys.remove(&oldest);
        }
        self.keys.insert(key.clone());
        self.order.push_back(key);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_same_order_and_seq_is_seen_once() {
        let mut seen = Seen::new(10);
        assert!(seen.first_time(&json!("a"), 1));
        assert!(seen.first_time(&json!("a"), 2));
        assert!(seen.first_time(&json!("b"), 1));
        assert!(!seen.first_time(&json!("a"), 1));
        assert!(!seen.first_time(&json!("b"), 1));
    }

    #[test]
    fn events_without_an_id_are_never_duplicates() {
        let mut seen = Seen::new(10);
        assert!(seen.first_time(&Value::Null, 0));
        assert!(seen.first_time(&Value::Null, 0));
        // A rejected message's id as given, whatever its type.
        assert!(seen.first_time(&json!(7), 0));
        assert!(!seen.first_time(&json!(7), 0));
    }

    #[test]
    fn memory_is_bounded_and_the_oldest_is_forgotten() {
        let mut seen = Seen::new(3);
        for seq in 1..=4 {
            assert!(seen.first_time(&json!("a"), seq));
        }
        assert_eq!(seen.keys.len(), 3);
        assert_eq!(seen.order.len(), 3);
        assert!(!seen.first_time(&json!("a"), 4));
        assert!(seen.first_time(&json!("a"), 1), "forgotten");
    }
}

//! The orders a scheduler keeps between their transitions: each write-back
//! returns the row version it left each order at, and the next reply to
//! the order is applied to the order as kept, guarded by that version,
//! instead of loading it again. A write-back the guard refuses (someone
//! else wrote the order since) runs again on the orders loaded.

use std::collections::HashMap;
use std::sync::Mutex;

use uuid::Uuid;

use super::room::KeptRoom;
use crate::rules::Order;
use sas_store::Room;

/// Most bytes of messages an order may have sent in its transition to be
/// kept: a big payload stays in Postgres, not in the scheduler's memory.
pub const MAX_BYTES: usize = 16 * 1024;

/// Orders kept, at the versions their last write-back left them, and the
/// room (clock, breakers, flow control) that write-back read.
#[derive(Debug)]
pub struct KeptOrders {
    orders: Mutex<HashMap<Uuid, (Order, i64)>>,
    /// Most orders kept; past it the oldest are forgotten all at once.
    max: usize,
    room: KeptRoom,
}

impl KeptOrders {
    /// Keeps up to `max` orders.
    pub fn new(max: usize) -> Self {
        Self {
            orders: Mutex::new(HashMap::new()),
            max,
            room: KeptRoom::default(),
        }
    }

    /// Takes out the kept orders that sent the requests `answered` answers
    /// (pairs of an order and a dispatch id; a transition that fails leaves
    /// them to be loaded): the orders kept, the ids to load, and the room
    /// to decide in when nothing is to be loaded (none: load them all). An
    /// order kept whose steps sent none of its answers' dispatches was
    /// moved on by another process since (another scheduler applied a
    /// reply): it is dropped and loaded, so that no judgement is made on
    /// it and no write-back refused.
    pub fn take(&self, answered: &[(Uuid, Uuid)]) -> (Vec<(Order, i64)>, Vec<Uuid>, Option<Room>) {
        let mut ids: Vec<Uuid> = answered.iter().map(|(order, _)| *order).collect();
        ids.sort_unstable();
        ids.dedup();
        let room = self.room.fresh();
        if room.is_none() {
            return (Vec::new(), ids, None);
        }
        let mut orders = self.orders.lock().unwrap_or_else(|p| p.into_inner());
        let (mut kept, mut load) = (Vec::new(), Vec::new());
        for id in ids {
            let sent = |(order, _): &(Order, i64)| {
                answered
                    .iter()
                    .filter(|(o, _)| *o == id)
                    .all(|(_, dispatch)| {
                        order.steps.iter().any(|s| s.dispatch_id == Some(*dispatch))
                    })
            };
            match orders.remove(&id) {
                Some(order) if sent(&order) => kept.push(order),
                _ => load.push(id),
            }
        }
        (kept, load, room)
    }

    /// After a write-back: keeps `orders` at the `versions` it returned
    /// (an order it did not update is not kept), and the `room` it read.
    pub fn keep(&self, orders: Vec<Order>, versions: &[(Uuid, i64)], room: Option<Room>) {
        if let Some(room) = room {
            self.room.keep(room, 0);
        }
        if orders.is_empty() {
            return;
        }
        let mut kept = self.orders.lock().unwrap_or_else(|p| p.into_inner());
        for order in orders {
            let id = order.row.order_id;
            let Some(&(_, version)) = versions.iter().find(|(v, _)| *v == id) else {
                continue;
            };
            if kept.len() >= self.max {
                // Replies that never came (their orders moved on elsewhere)
                // would fill it for good: start again.
                kept.clear();
            }
            kept.insert(id, (order, version));
        }
    }

    /// How many orders are kept.
    pub fn len(&self) -> usize {
        self.orders.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sas_core::model::{NewOrder, OrderRow, StepRow};

    /// An order with one step out under `dispatch`.
    fn order(dispatch: Uuid) -> Order {
        let id = Uuid::now_v7();
        let row = OrderRow::pending(
            &NewOrder::new(id, "one", serde_json::json!({})),
            chrono::Utc::now(),
        );
        let step: StepRow = serde_json::from_value(serde_json::json!({
            "order_id": id, "idx": 0, "name": "a", "agent": "a", "compensate": null,
            "timeout_ms": 1000, "state": "running", "dispatches": 1,
            "dispatch_id": dispatch, "complete_by": null, "result": null,
            "error": null, "started_at": null, "finished_at": null, "warned": 0,
        }))
        .expect("step");
        Order {
            row,
            steps: vec![step],
        }
    }

    fn room() -> Room {
        Room {
            now: chrono::Utc::now(),
            gates: Vec::new(),
            flows: Vec::new(),
            held: 0,
        }
    }

    #[test]
    fn a_kept_order_is_used_only_for_answers_to_what_it_sent_and_only_in_a_fresh_room() {
        let kept = KeptOrders::new(10);
        let (sent, other) = (Uuid::now_v7(), Uuid::now_v7());
        let (a, b) = (order(sent), order(sent));
        let (a_id, b_id) = (a.row.order_id, b.row.order_id);
        // No room read yet: everything is loaded.
        kept.keep(vec![a.clone()], &[(a_id, 7)], None);
        let (orders, load, room_now) = kept.take(&[(a_id, sent)]);
        assert!(orders.is_empty() && room_now.is_none());
        assert_eq!(load, [a_id]);
        // Kept at the version returned; not kept without one.
        kept.keep(vec![a, b], &[(a_id, 7)], Some(room()));
        assert_eq!(kept.len(), 1);
        let (orders, load, room_now) = kept.take(&[(a_id, sent), (b_id, sent)]);
        assert_eq!(orders.len(), 1);
        assert_eq!((orders[0].0.row.order_id, orders[0].1), (a_id, 7));
        assert_eq!(load, [b_id]);
        assert!(room_now.is_some());
        assert_eq!(kept.len(), 0, "taken out");
        // An answer to a dispatch the kept order did not send (another
        // scheduler moved it on): dropped and loaded.
        kept.keep(vec![orders[0].0.clone()], &[(a_id, 8)], Some(room()));
        let (orders, load, _) = kept.take(&[(a_id, other)]);
        assert!(orders.is_empty());
        assert_eq!(load, [a_id]);
        assert_eq!(kept.len(), 0, "dropped");
    }
}

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

    /// Takes the kept ones of `ids` out (a transition that fails leaves
    /// them to be loaded): the orders kept, the ids to load, and the room
    /// to decide in when nothing is to be loaded (none: load them all).
    pub fn take(&self, ids: &[Uuid]) -> (Vec<(Order, i64)>, Vec<Uuid>, Option<Room>) {
        let room = self.room.fresh();
        if room.is_none() {
            return (Vec::new(), ids.to_vec(), None);
        }
        let mut orders = self.orders.lock().unwrap_or_else(|p| p.into_inner());
        let (mut kept, mut load) = (Vec::new(), Vec::new());
        for id in ids {
            match orders.remove(id) {
                Some(order) => kept.push(order),
                None => load.push(*id),
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

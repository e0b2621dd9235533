//! Terminal events read by one wait for another order, kept for that
//! order's wait. Bounded: the oldest are forgotten.

use std::collections::{HashMap, VecDeque};

use crate::{OrderId, StatusEvent};

/// Terminal events kept for waits that have not come yet.
const TERMINALS_KEPT: usize = 10_000;

/// Terminal events by order, the oldest forgotten beyond [`TERMINALS_KEPT`].
#[derive(Debug, Default)]
pub(crate) struct Terminals {
    by_order: HashMap<OrderId, StatusEvent>,
    order: VecDeque<OrderId>,
}

impl Terminals {
    pub(crate) fn keep(&mut self, order_id: OrderId, event: StatusEvent) {
        if self.by_order.insert(order_id, event).is_none() {
            self.order.push_back(order_id);
        }
        while self.order.len() > TERMINALS_KEPT {
            if let Some(oldest) = self.order.pop_front() {
                self.by_order.remove(&oldest);
            }
        }
    }

    pub(crate) fn take(&mut self, order_id: OrderId) -> Option<StatusEvent> {
        let event = self.by_order.remove(&order_id)?;
        self.order.retain(|id| *id != order_id);
        Some(event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn terminal(id: OrderId) -> StatusEvent {
        serde_json::from_value(serde_json::json!({
            "order_id": id.to_string(), "seq": 5, "state": "processed",
            "at": "2026-11-27T10:00:00Z", "detail": {},
        }))
        .unwrap()
    }

    #[test]
    fn kept_terminals_are_taken_once_and_bounded() {
        let mut kept = Terminals::default();
        let a = Uuid::now_v7();
        kept.keep(a, terminal(a));
        assert!(kept.take(a).is_some());
        assert!(kept.take(a).is_none());
        for _ in 0..TERMINALS_KEPT + 5 {
            let id = Uuid::now_v7();
            kept.keep(id, terminal(id));
        }
        assert_eq!(kept.by_order.len(), TERMINALS_KEPT);
        assert_eq!(kept.order.len(), TERMINALS_KEPT);
    }
}

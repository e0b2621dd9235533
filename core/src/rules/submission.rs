//! What happens to an order that is accepted: it is stored `pending` with
//! its steps, and its first event, `received`, is logged and announced.
//! Pure.

use serde_json::json;

use super::order::{Deciding, Decision, Event, Given, Order};
use crate::messages::EventKind;
use crate::state::ProcessState;

/// The decision for a new order (stored `pending`): its `received` event,
/// and a wake-up for the schedulers.
pub fn receive(order: &Order, ctx: Given<'_>) -> Decision {
    let mut d = Deciding::new(order, ctx);
    let o = d.row();
    let detail = json!({ "workflow": o.workflow, "priority": o.priority });
    d.log(Event {
        kind: EventKind::Received,
        from: None,
        to: ProcessState::Pending,
        step: None,
        attempt: 1,
        reason: None,
        detail,
    });
    d.wake = true;
    d.done()
}

//! A decision taken into a transition's [`Unit`]: the order's rows as the
//! rule left them, its events logged (and announced where the rules say),
//! its requests and alerts queued in the outbox, in the order decided.

use sas_store::{NewEvent, NewMessage, StoreError, Unit};

use crate::messages::logged_event;
use crate::rules::{Decision, Effect, Logged};
use crate::state::ProcessState;
use crate::topology::QueueNames;

/// Takes `decision` for order `i` of `unit`.
pub(super) fn apply(
    unit: &mut Unit,
    i: usize,
    decision: Decision,
    queues: &QueueNames,
) -> Result<(), StoreError> {
    let row = &decision.order.row;
    let hop = crate::telemetry::transition(
        row.order_id,
        row.process_state.as_str(),
        row.trace_id.as_deref(),
        row.trace_span.as_deref(),
    );
    unit.set(i, decision.order, hop);
    if decision.wake {
        unit.wake();
    }
    // The rules counted the decision's dispatches against the room.
    unit.flows = decision.flows;
    unit.dispatched.extend(decision.took_room);
    for effect in decision.effects {
        match effect {
            Effect::Event(logged) => event(unit, i, logged, queues),
            Effect::Request { agent, request } => {
                let message = message(
                    unit,
                    i,
                    "request",
                    queues.requests_of(&agent),
                    serde_json::to_vec(&request)?,
                );
                unit.push_message(NewMessage {
                    correlation_id: Some(request.dispatch_id.to_string()),
                    reply_to: Some(queues.replies().to_owned()),
                    ..message
                });
            }
            Effect::Alert(alert) => {
                let message = message(
                    unit,
                    i,
                    "alert",
                    queues.alerts().to_owned(),
                    serde_json::to_vec(&alert)?,
                );
                unit.push_message(message);
            }
        }
    }
    Ok(())
}

/// Logs an event of order `i` and queues its status event where the
/// rules announce it ([`Logged::announced_to`]).
fn event(unit: &mut Unit, i: usize, e: Logged, queues: &QueueNames) {
    let now = unit.now;
    let o = &unit.get(i).order.row;
    // A child order's end goes to sas's agent of children (§4d): the
    // one queue of sas's own an order may name, which only sas sets
    // (an application's order naming it is refused as it comes in).
    let reserved = |q: &str| queues.is_reserved(q) && q != queues.children_ended();
    let status = e.announced_to(o, reserved).map(|queue| {
        // The same constructor as a replay's (contract §9), so a
        // replayed event is the event that was sent.
        let event = logged_event(
            o.public_id(),
            e.seq,
            e.kind,
            e.step.clone(),
            e.attempt,
            now,
            e.detail.clone(),
        );
        // A status event always serializes.
        let body = serde_json::to_vec(&event).unwrap_or_default();
        NewMessage {
            correlation_id: Some(o.public_id().to_string()),
            ..message(unit, i, "status", queue.to_owned(), body)
        }
    });
    let logged = NewEvent {
        order_id: o.order_id,
        seq: e.seq,
        event: e.kind.as_str(),
        from_state: e.from.map(ProcessState::as_str),
        to_state: e.to.as_str(),
        step: e.step,
        attempt: e.attempt,
        actor: e.actor,
        reason: e.reason,
        // JSON text: `jsonb` exactly as given, a JSON `null` included.
        detail: e.detail.to_string(),
    };
    if let Some(status) = status {
        unit.push_message(status);
    }
    unit.push_event(logged);
}

/// A message of order `i`, in its decision's span, or with a new span of
/// the order's trace.
fn message(unit: &Unit, i: usize, kind: &str, routing_key: String, body: Vec<u8>) -> NewMessage {
    let tracked = unit.get(i);
    let o = &tracked.order.row;
    NewMessage {
        order_id: o.order_id,
        kind: kind.to_owned(),
        routing_key,
        correlation_id: None,
        reply_to: None,
        traceparent: tracked.hop.clone().or_else(|| {
            o.trace_id
                .as_deref()
                .and_then(crate::trace::TraceContext::child_of)
                .map(|t| t.to_string())
        }),
        body,
    }
}

//! The `order_events` table: the event log of every transition, whose rows are
//! also the status events of contract §2 (queued in the outbox in the same statement).

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::messages::EventKind;
use crate::state::ProcessState;

/// One row of the event log.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct EventRow {
    pub seq: i32,
    pub event: String,
    pub from_state: Option<String>,
    pub to_state: String,
    pub step: Option<String>,
    pub attempt: i32,
    pub actor: String,
    pub reason: Option<String>,
    pub detail: Value,
    pub at: DateTime<Utc>,
}

/// A transition to log and announce.
#[derive(Debug, Clone)]
pub struct Event<'a> {
    pub kind: EventKind,
    pub from: Option<ProcessState>,
    pub to: ProcessState,
    pub step: Option<&'a str>,
    pub attempt: i32,
    pub actor: &'a str,
    pub reason: Option<&'a str>,
    pub detail: Value,
}

/// Appends the event with the order's next `seq` and, when the order has a
/// status queue, queues the status event in the outbox: one statement.
pub async fn append(
    conn: &mut PgConnection,
    order_id: Uuid,
    e: &Event<'_>,
) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar(
        "WITH s AS ( \
           UPDATE orders SET last_seq = last_seq + 1 WHERE order_id = $1 \
           RETURNING last_seq, reply_to, trace_id, now() AS at), \
         e AS ( \
           INSERT INTO order_events (order_id, seq, event, from_state, to_state, step, attempt, actor, reason, detail, at) \
           SELECT $1, s.last_seq, $2, $3, $4, $5, $6, $7, $8, $9, s.at FROM s), \
         o AS ( \
           INSERT INTO outbox (order_id, kind, routing_key, correlation_id, traceparent, body) \
           SELECT $1, 'status', s.reply_to, $1::text, '00-' || s.trace_id || '-' || $10 || '-01', \
             jsonb_strip_nulls(jsonb_build_object('order_id', $1::uuid, 'seq', s.last_seq, 'state', $2::text, \
               'step', $5::text, 'attempt', $6::int, \
               'at', to_char(s.at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'))) \
             || jsonb_build_object('detail', $9::jsonb) \
           FROM s WHERE s.reply_to IS NOT NULL) \
         SELECT last_seq FROM s",
    )
    .bind(order_id)
    .bind(e.kind.as_str())
    .bind(e.from.map(ProcessState::as_str))
    .bind(e.to.as_str())
    .bind(e.step)
    .bind(e.attempt)
    .bind(e.actor)
    .bind(e.reason)
    .bind(&e.detail)
    // The span id of this event's publish, in the order's trace.
    .bind(crate::trace::TraceContext::new_root().span_id)
    .fetch_one(conn)
    .await
}

/// The order's event log, oldest first.
pub async fn for_order(
    conn: &mut PgConnection,
    order_id: Uuid,
) -> Result<Vec<EventRow>, sqlx::Error> {
    sqlx::query_as::<_, EventRow>(
        "SELECT seq, event, from_state, to_state, step, attempt, actor, reason, detail, at \
         FROM order_events WHERE order_id = $1 ORDER BY seq",
    )
    .bind(order_id)
    .fetch_all(conn)
    .await
}

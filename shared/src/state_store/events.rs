//! The `order_events` table: the event log of every transition, whose rows are
//! also the status events of contract §2 (queued in the outbox in the same statement).

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

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

//! The `order_events` table: the event log of every transition, whose rows are
//! also the status events of contract §2 (queued in the outbox in the same
//! statement), and what a replay (§9) publishes again.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use sas_core::messages::{EventKind, ReplayRequest, StatusEvent, logged_event};

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

impl EventRow {
    /// The row as operators' tools show it (`sasctl orders show --json`,
    /// the dashboard's order page).
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "seq": self.seq,
            "at": sas_core::messages::rfc3339::format(&self.at),
            "event": self.event,
            "from_state": self.from_state,
            "to_state": self.to_state,
            "step": self.step,
            "attempt": self.attempt,
            "actor": self.actor,
            "reason": self.reason,
            "detail": self.detail,
        })
    }
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

/// A logged event as a replay reads it: the fields of its status event.
#[derive(Debug, sqlx::FromRow)]
struct Logged {
    order_id: Uuid,
    seq: i32,
    event: String,
    step: Option<String>,
    attempt: i32,
    detail: Value,
    at: DateTime<Utc>,
}

impl Logged {
    /// The status event it was sent as; `None` for a name no status event
    /// has (none is logged today).
    fn status_event(self) -> Option<StatusEvent> {
        let Ok(kind) = self.event.parse::<EventKind>() else {
            tracing::warn!(order_id = %self.order_id, seq = self.seq, event = %self.event, "logged event is no status event; not replayed");
            return None;
        };
        Some(logged_event(
            self.order_id,
            self.seq,
            kind,
            self.step,
            self.attempt,
            self.at,
            self.detail,
        ))
    }
}

/// What a replay (contract §9) found to publish again.
#[derive(Debug, Clone, PartialEq)]
pub struct Replay {
    /// The status events, in `seq` order per order.
    pub events: Vec<StatusEvent>,
    /// Where they go unless the request names a queue: the order's own
    /// status queue, or the queue whose orders were asked for.
    pub reply_to: Option<String>,
    /// There were more than the limit: `events` holds the first of them.
    pub truncated: bool,
}

/// The stored events a replay request of `application` (contract §1b:
/// `None` when none is configured) asks for, at most `limit`, of its own
/// orders only; `None` when it names an order that does not exist, or is
/// another application's. Each event says the id its application gave.
pub async fn replay(
    conn: &mut PgConnection,
    request: &ReplayRequest,
    application: Option<&str>,
    limit: u32,
) -> Result<Option<Replay>, sqlx::Error> {
    // One more than the limit, to know whether there were more.
    let fetch = i64::from(limit) + 1;
    let (rows, reply_to) = match request {
        ReplayRequest::Order { order_id, from_seq } => {
            let order: Option<(Option<String>, Option<Uuid>)> = sqlx::query_as(
                "SELECT reply_to, app_order_id FROM orders \
                 WHERE order_id = $1 AND application IS NOT DISTINCT FROM $2",
            )
            .bind(order_id)
            .bind(application)
            .fetch_optional(&mut *conn)
            .await?;
            let Some((reply_to, public)) = order else {
                return Ok(None);
            };
            let rows = sqlx::query_as::<_, Logged>(
                "SELECT coalesce($4, order_id) AS order_id, seq, event, step, attempt, detail, at \
                 FROM order_events WHERE order_id = $1 AND seq >= $2 ORDER BY seq LIMIT $3",
            )
            .bind(order_id)
            .bind(from_seq)
            .bind(fetch)
            .bind(public)
            .fetch_all(&mut *conn)
            .await?;
            (rows, reply_to)
        }
        ReplayRequest::Queue { reply_to, since } => {
            // Oldest first across orders, but each order's events in `seq`
            // order even were two transitions' clocks out of step: the
            // sort key is the latest `at` so far in the order's sequence.
            let rows = sqlx::query_as::<_, Logged>(
                "SELECT coalesce(o.app_order_id, e.order_id) AS order_id, e.seq, e.event, e.step, \
                   e.attempt, e.detail, e.at \
                 FROM order_events e JOIN orders o ON o.order_id = e.order_id \
                 WHERE o.reply_to = $1 AND e.at >= $2 \
                   AND o.application IS NOT DISTINCT FROM $4 \
                 ORDER BY max(e.at) OVER (PARTITION BY e.order_id ORDER BY e.seq), \
                   e.order_id, e.seq \
                 LIMIT $3",
            )
            .bind(reply_to)
            .bind(since)
            .bind(fetch)
            .bind(application)
            .fetch_all(&mut *conn)
            .await?;
            (rows, Some(reply_to.clone()))
        }
    };
    let truncated = rows.len() > limit as usize;
    let events = rows
        .into_iter()
        .take(limit as usize)
        .filter_map(Logged::status_event)
        .collect();
    Ok(Some(Replay {
        events,
        reply_to,
        truncated,
    }))
}

//! The `orders` table: one row per order with the pattern's fields.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::state::ProcessState;

/// An order row.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct OrderRow {
    pub order_id: Uuid,
    pub workflow: String,
    pub payload: Value,
    pub reply_to: Option<String>,
    pub priority: i16,
    pub not_before: Option<DateTime<Utc>>,
    #[sqlx(try_from = "String")]
    pub process_state: ProcessState,
    pub locked_by: Option<String>,
    pub complete_by: Option<DateTime<Utc>>,
    pub failure_count: i32,
    pub compensation_failures: i32,
    pub last_seq: i32,
    pub last_error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// The W3C trace id every hop of this order reports.
    pub trace_id: Option<String>,
}

impl OrderRow {
    /// The attempt now running or coming: 1 + failure count.
    pub fn attempt(&self) -> i32 {
        self.failure_count + 1
    }
}

/// An accepted order, ready to be stored.
#[derive(Debug, Clone)]
pub struct NewOrder {
    pub order_id: Uuid,
    pub workflow: String,
    pub payload: Value,
    pub reply_to: Option<String>,
    pub priority: i16,
    pub not_before: Option<DateTime<Utc>>,
    pub trace_id: Option<String>,
}

const COLUMNS: &str = "order_id, workflow, payload, reply_to, priority, not_before, process_state, \
     locked_by, complete_by, failure_count, compensation_failures, last_seq, last_error, created_at, updated_at, trace_id";

/// Inserts the order as `pending` unless it exists; whether it was created.
pub async fn insert(conn: &mut PgConnection, o: &NewOrder) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO orders (order_id, workflow, payload, reply_to, priority, not_before, trace_id) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (order_id) DO NOTHING",
    )
    .bind(o.order_id)
    .bind(&o.workflow)
    .bind(&o.payload)
    .bind(&o.reply_to)
    .bind(o.priority)
    .bind(o.not_before)
    .bind(&o.trace_id)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// The order, without locking it.
pub async fn get(conn: &mut PgConnection, order_id: Uuid) -> Result<Option<OrderRow>, sqlx::Error> {
    sqlx::query_as::<_, OrderRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM orders WHERE order_id = $1"
    )))
    .bind(order_id)
    .fetch_optional(conn)
    .await
}

/// The order, locked for this transaction.
pub async fn lock(
    conn: &mut PgConnection,
    order_id: Uuid,
) -> Result<Option<OrderRow>, sqlx::Error> {
    sqlx::query_as::<_, OrderRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM orders WHERE order_id = $1 FOR UPDATE"
    )))
    .bind(order_id)
    .fetch_optional(conn)
    .await
}

/// Claims up to `limit` claimable orders for `instance`, highest priority first:
/// pending orders whose `not_before` has come become `processing`; compensating
/// orders that nobody drives stay `compensating`. Rows other claimers hold are skipped.
pub async fn claim(
    conn: &mut PgConnection,
    instance: &str,
    limit: i64,
) -> Result<Vec<OrderRow>, sqlx::Error> {
    sqlx::query_as::<_, OrderRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE orders SET locked_by = $1, not_before = NULL, updated_at = now(), \
           process_state = CASE WHEN process_state = 'pending' THEN 'processing' ELSE process_state END \
         WHERE order_id IN ( \
           SELECT order_id FROM orders \
           WHERE (process_state = 'pending' OR (process_state = 'compensating' AND locked_by IS NULL)) \
             AND (not_before IS NULL OR not_before <= now()) \
           ORDER BY priority DESC, created_at \
           LIMIT $2 FOR UPDATE SKIP LOCKED) \
         RETURNING {COLUMNS}"
    )))
    .bind(instance)
    .bind(limit)
    .fetch_all(conn)
    .await
}

/// Moves the order from `from` (held by `holder`) to `to`, held by `locked_by`,
/// with `complete_by` set to `deadline`. Whether the guard held.
pub async fn transition(
    conn: &mut PgConnection,
    order_id: Uuid,
    from: ProcessState,
    holder: Option<&str>,
    to: ProcessState,
    locked_by: Option<&str>,
    deadline: Option<DateTime<Utc>>,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE orders SET process_state = $4, locked_by = $5, complete_by = $6, updated_at = now() \
         WHERE order_id = $1 AND process_state = $2 AND locked_by IS NOT DISTINCT FROM $3",
    )
    .bind(order_id)
    .bind(from.as_str())
    .bind(holder)
    .bind(to.as_str())
    .bind(locked_by)
    .bind(deadline)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Records why the order stopped, for operators.
pub async fn set_last_error(
    conn: &mut PgConnection,
    order_id: Uuid,
    error: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE orders SET last_error = $2 WHERE order_id = $1")
        .bind(order_id)
        .bind(error)
        .execute(conn)
        .await?;
    Ok(())
}

/// Orders whose step deadline has passed, locked for this transaction.
pub async fn expired(conn: &mut PgConnection, limit: i64) -> Result<Vec<OrderRow>, sqlx::Error> {
    sqlx::query_as::<_, OrderRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM orders \
         WHERE locked_by IS NOT NULL AND complete_by < now() \
           AND process_state IN ('processing', 'compensating') \
         ORDER BY complete_by LIMIT $1 FOR UPDATE SKIP LOCKED"
    )))
    .bind(limit)
    .fetch_all(conn)
    .await
}

/// Puts an expired order back for another attempt after `delay_ms`, counting
/// the failure. Guarded by the state, holder and failure count the sweep read.
pub async fn requeue_after_failure(
    conn: &mut PgConnection,
    o: &OrderRow,
    to: ProcessState,
    delay_ms: i64,
) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    let counter = if o.process_state == ProcessState::Compensating {
        "compensation_failures"
    } else {
        "failure_count"
    };
    sqlx::query_scalar::<_, DateTime<Utc>>(sqlx::AssertSqlSafe(format!(
        "UPDATE orders SET {counter} = {counter} + 1, process_state = $5, locked_by = NULL, \
           complete_by = NULL, not_before = now() + $6 * interval '1 millisecond', updated_at = now() \
         WHERE order_id = $1 AND process_state = $2 AND locked_by = $3 AND {counter} = $4 \
         RETURNING not_before"
    )))
    .bind(o.order_id)
    .bind(o.process_state.as_str())
    .bind(&o.locked_by)
    .bind(if counter == "failure_count" { o.failure_count } else { o.compensation_failures })
    .bind(to.as_str())
    .bind(delay_ms)
    .fetch_optional(conn)
    .await
}

/// Counts a failure of an expired order without re-queueing it (it is given up).
pub async fn count_failure(conn: &mut PgConnection, o: &OrderRow) -> Result<bool, sqlx::Error> {
    let counter = if o.process_state == ProcessState::Compensating {
        "compensation_failures"
    } else {
        "failure_count"
    };
    let done = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE orders SET {counter} = {counter} + 1, updated_at = now() \
         WHERE order_id = $1 AND process_state = $2 AND locked_by = $3"
    )))
    .bind(o.order_id)
    .bind(o.process_state.as_str())
    .bind(&o.locked_by)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Back to `pending` for an operator's retry, counts and error cleared.
pub async fn reset_for_retry(conn: &mut PgConnection, order_id: Uuid) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE orders SET process_state = 'pending', locked_by = NULL, complete_by = NULL, \
           not_before = NULL, failure_count = 0, compensation_failures = 0, last_error = NULL, updated_at = now() \
         WHERE order_id = $1 AND process_state = 'error'",
    )
    .bind(order_id)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Orders, newest first, optionally of one state and one workflow.
pub async fn list(
    conn: &mut PgConnection,
    state: Option<ProcessState>,
    workflow: Option<&str>,
    limit: i64,
) -> Result<Vec<OrderRow>, sqlx::Error> {
    sqlx::query_as::<_, OrderRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM orders \
         WHERE ($1::text IS NULL OR process_state = $1) AND ($2::text IS NULL OR workflow = $2) \
         ORDER BY created_at DESC LIMIT $3"
    )))
    .bind(state.map(ProcessState::as_str))
    .bind(workflow)
    .bind(limit)
    .fetch_all(conn)
    .await
}

/// Deletes ended orders (with their steps and events) last changed more than
/// `older_than_ms` ago; how many.
pub async fn prune(conn: &mut PgConnection, older_than_ms: i64) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "DELETE FROM orders WHERE process_state IN ('processed', 'compensated', 'error') \
           AND updated_at < now() - $1 * interval '1 millisecond'",
    )
    .bind(older_than_ms)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

//! The `orders` table: one row per order with the pattern's fields.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use super::literal::Args;
use crate::state::ProcessState;

/// An order row.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
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

/// An order locked by this transaction, with the transaction's clock
/// (`now()`, the same for every statement of it), read in the same round trip.
#[derive(Debug, sqlx::FromRow)]
pub struct Locked {
    #[sqlx(flatten)]
    pub order: OrderRow,
    pub tx_now: DateTime<Utc>,
    /// Whether this connection took the order's outbox lock with it (`None`:
    /// not asked to, or another publisher holds it).
    pub outbox_locked: Option<bool>,
    /// Its steps, read in the same round trip, unless the order changed
    /// while this statement waited for its lock (then read them afresh).
    pub steps: Option<sqlx::types::Json<Vec<super::steps::StepRow>>>,
}

/// Wraps a `SELECT … FOR UPDATE` of orders (`locked`, returning [`COLUMNS`],
/// `tx_now` and `row_xmin`) so that it also returns each order's steps and,
/// when parameter `$flag` is true, the connection tries to take each
/// returned order's outbox lock ([`super::outbox::Held`]). It does not wait
/// for a publisher that holds one (the previous transition's messages on
/// their way): the transaction goes on, and its messages for that order
/// follow once the lock comes free ([`super::outbox::Handoff::follow`]).
/// The rows come back in order id order.
///
/// The steps are read with the statement's snapshot, from before any wait
/// for a row lock: when the locked row is newer than that snapshot's (it
/// changed while we waited), they may be too, and come back `NULL` instead.
fn taking_outbox_locks(locked: &str, flag: u8) -> String {
    format!(
        "WITH l AS MATERIALIZED ({locked}) \
         SELECT l.*, k.outbox_locked, \
           CASE WHEN l.row_xmin = (SELECT o.xmin FROM orders o WHERE o.order_id = l.order_id) \
           THEN (SELECT coalesce(json_agg(s ORDER BY s.idx), '[]') FROM ( \
             SELECT {steps} FROM steps WHERE steps.order_id = l.order_id) s) END AS steps \
         FROM l LEFT JOIN LATERAL ( \
           SELECT pg_try_advisory_lock({key}) AS outbox_locked \
           WHERE ${flag}) k ON k.outbox_locked \
         ORDER BY l.order_id",
        steps = super::steps::COLUMNS,
        key = super::outbox::lock_key("l.order_id"),
    )
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

/// The order, without locking it.
pub async fn get(conn: &mut PgConnection, order_id: Uuid) -> Result<Option<OrderRow>, sqlx::Error> {
    sqlx::query_as::<_, OrderRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM orders WHERE order_id = $1"
    )))
    .bind(order_id)
    .fetch_optional(conn)
    .await
}

/// The statement of [`lock_many`]: `$1` the order ids, `$2` whether to take
/// their outbox locks.
pub(super) fn lock_many_sql() -> String {
    taking_outbox_locks(
        &format!(
            "SELECT {COLUMNS}, now() AS tx_now, xmin AS row_xmin FROM orders WHERE order_id = ANY($1) \
             ORDER BY order_id FOR UPDATE"
        ),
        2,
    )
}

/// These orders, locked for this transaction in id order (so that two
/// transactions locking overlapping sets cannot deadlock).
/// With `outbox_locks`, also takes their outbox locks.
pub async fn lock_many(
    conn: &mut PgConnection,
    order_ids: &[Uuid],
    outbox_locks: bool,
) -> Result<Vec<Locked>, sqlx::Error> {
    sqlx::query_as::<_, Locked>(sqlx::AssertSqlSafe(lock_many_sql()))
        .bind(order_ids)
        .bind(outbox_locks)
        .fetch_all(conn)
        .await
}

/// Opens a transaction on `conn` and locks these orders as [`lock_many`]
/// does, in one round trip instead of two ([`super::prepared::begin_with`]).
pub async fn begin_lock_many(
    conn: &mut PgConnection,
    order_ids: &[Uuid],
    outbox_locks: bool,
) -> Result<Vec<Locked>, sqlx::Error> {
    let execute = Args::default()
        .array(order_ids)
        .scalar(outbox_locks)
        .execute("sas_lock_many");
    super::prepared::begin_with(conn, &execute).await
}

/// Up to `limit` claimable orders, highest priority first, locked for a
/// transaction that this opens on `conn` in the same round trip
/// ([`super::prepared::begin_with`]): pending orders whose `not_before` has
/// come, and compensating orders that nobody drives. Rows other claimers
/// hold are skipped. Fewer when `holder` already holds nearly `max_held`
/// orders. With `outbox_locks`, also takes their outbox locks.
pub async fn begin_claimable(
    conn: &mut PgConnection,
    limit: i64,
    holder: &str,
    max_held: i64,
    outbox_locks: bool,
) -> Result<Vec<Locked>, sqlx::Error> {
    let execute = Args::default()
        .scalar(limit)
        .scalar(holder)
        .scalar(max_held)
        .scalar(outbox_locks)
        .execute("sas_claimable");
    super::prepared::begin_with(conn, &execute).await
}

/// The statement of [`begin_claimable`]: `$1` the limit, `$2` the holder, `$3`
/// the most it may hold, `$4` whether to take outbox locks.
pub(super) fn claimable_sql() -> String {
    taking_outbox_locks(
        &format!(
            "SELECT {COLUMNS}, now() AS tx_now, xmin AS row_xmin FROM orders \
             WHERE (process_state = 'pending' OR (process_state = 'compensating' AND locked_by IS NULL)) \
               AND (not_before IS NULL OR not_before <= now()) \
             ORDER BY priority DESC, created_at \
             LIMIT LEAST($1, GREATEST(0, $3 - (SELECT count(*) FROM orders WHERE locked_by = $2))) \
             FOR UPDATE SKIP LOCKED"
        ),
        4,
    )
}

/// Orders whose step deadline has passed, locked for this transaction.
/// With `outbox_locks`, also takes their outbox locks.
pub async fn expired(
    conn: &mut PgConnection,
    limit: i64,
    outbox_locks: bool,
) -> Result<Vec<Locked>, sqlx::Error> {
    sqlx::query_as::<_, Locked>(sqlx::AssertSqlSafe(taking_outbox_locks(
        &format!(
            "SELECT {COLUMNS}, now() AS tx_now, xmin AS row_xmin FROM orders \
             WHERE locked_by IS NOT NULL AND complete_by < now() \
               AND process_state IN ('processing', 'compensating') \
             ORDER BY complete_by LIMIT $1 FOR UPDATE SKIP LOCKED"
        ),
        2,
    )))
    .bind(limit)
    .bind(outbox_locks)
    .fetch_all(conn)
    .await
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

//! The `orders` table: one row per order with the pattern's fields.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use std::sync::LazyLock;

use crate::messages::Events;
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
    /// The span id of the order's root span (its submission), which the
    /// spans of its transitions are children of when spans are exported.
    pub trace_span: Option<String>,
    /// The agent whose breaker the order waits for (contract §8), if held.
    pub held_for: Option<String>,
    /// When it was held.
    pub held_since: Option<DateTime<Utc>>,
    /// When a hold that lasts is handled as a failure (the agent's `max_hold`).
    pub hold_until: Option<DateTime<Utc>>,
    /// Why it is held: `breaker_open`, `forced_open` or `rate_limited`.
    pub held_reason: Option<String>,
    /// How many times an operator redrove the order (contract §9): its
    /// steps' idempotency keys carry `:r<N>` from the first.
    pub redrives: i32,
    /// Which status events it is sent (contract §2a).
    #[sqlx(try_from = "String")]
    pub events: Events,
    /// The application that submitted it (contract §1b), if applications
    /// are configured.
    pub application: Option<String>,
    /// The id the application gave it, which its status events say; the
    /// stored id is in the application's namespace.
    pub app_order_id: Option<Uuid>,
}

impl OrderRow {
    /// `order` as it is first stored: `pending`, nothing run, at `now`.
    pub fn pending(order: &NewOrder, now: DateTime<Utc>) -> Self {
        Self {
            order_id: order.order_id,
            workflow: order.workflow.clone(),
            payload: order.payload.clone(),
            reply_to: order.reply_to.clone(),
            priority: order.priority,
            not_before: order.not_before,
            process_state: ProcessState::Pending,
            locked_by: None,
            complete_by: None,
            failure_count: 0,
            compensation_failures: 0,
            last_seq: 0,
            last_error: None,
            created_at: now,
            updated_at: now,
            trace_id: order.trace_id.clone(),
            held_for: None,
            held_since: None,
            hold_until: None,
            held_reason: None,
            trace_span: order.trace_span.clone(),
            redrives: 0,
            events: order.events,
            application: order.application.clone(),
            app_order_id: order.app_order_id,
        }
    }

    /// The id its status events carry: the application's own (contract §1b).
    pub fn public_id(&self) -> Uuid {
        self.app_order_id.unwrap_or(self.order_id)
    }

    /// The attempt now running or coming: 1 + failure count.
    pub fn attempt(&self) -> i32 {
        self.failure_count + 1
    }
}

/// An order loaded for a transition: its row, the row's version, the
/// database's clock and its steps, read by one statement.
#[derive(Debug, sqlx::FromRow)]
pub struct Loaded {
    #[sqlx(flatten)]
    pub order: OrderRow,
    /// The row version read (`xmin`): the write-back changes the row only
    /// if it is still this version, so a transition that raced another
    /// changes nothing.
    pub version: i64,
    /// The statement's clock (`now()`).
    pub tx_now: DateTime<Utc>,
    /// Whether this connection took the order's outbox lock with it (`None`:
    /// not asked to, or another publisher holds it).
    pub outbox_locked: Option<bool>,
    /// Its steps, by index.
    pub steps: sqlx::types::Json<Vec<super::steps::StepRow>>,
    /// The agents' breakers that are not closed (the same on every row).
    pub gates: sqlx::types::Json<Vec<crate::rules::breaker::Gate>>,
    /// The agents under flow control (the same on every row).
    pub flows: sqlx::types::Json<Vec<crate::rules::flow::Flow>>,
}

/// Wraps a query of orders (`picked`, returning [`COLUMNS`]) so that it
/// also returns each order's row version, the clock, its steps and, when
/// parameter `$flag` is true, takes each returned order's outbox lock for
/// this connection ([`super::outbox::Held`]). It does not wait for a
/// publisher that holds one (the previous transition's messages on their
/// way): the transition goes on, and its messages for that order follow
/// once the lock comes free ([`super::Committed::follow`]). With them, the
/// breakers that are not closed, read once ([`super::breakers::GATES`]).
/// The rows come back in order id order. Constant text: `flag` is a
/// parameter's number.
fn loading(picked: &str, flag: u8) -> String {
    format!(
        "WITH l AS MATERIALIZED ({picked}) \
         SELECT l.*, now() AS tx_now, k.outbox_locked, \
           (SELECT coalesce(json_agg(s ORDER BY s.idx), '[]') FROM ( \
             SELECT {steps} FROM steps WHERE steps.order_id = l.order_id) s) AS steps, \
           ({gates}) AS gates, ({flows}) AS flows \
         FROM l LEFT JOIN LATERAL ( \
           SELECT pg_try_advisory_lock({key}) AS outbox_locked \
           WHERE ${flag}) k ON k.outbox_locked \
         ORDER BY l.order_id",
        steps = super::steps::COLUMNS,
        gates = super::breakers::GATES,
        flows = *super::flows::FLOWS,
        key = super::outbox::lock_key("l.order_id"),
    )
}

/// The SQL of an order's claim lock key, for the order id in `column`: a
/// session-level advisory lock that a scheduler holds from reading an order
/// it claims to writing its claim back, so that another scheduler's claim
/// passes the order by meanwhile.
pub(super) fn claim_key(column: &str) -> String {
    format!("hashtextextended('sas.claim:' || {column}::text, 0)")
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
    /// The span id of its submission's span (see [`OrderRow::trace_span`]).
    pub trace_span: Option<String>,
    /// Which status events it is sent (contract §2a).
    pub events: Events,
    /// See [`OrderRow::application`].
    pub application: Option<String>,
    /// See [`OrderRow::app_order_id`].
    pub app_order_id: Option<Uuid>,
}

impl NewOrder {
    /// An order of `workflow` with `payload` under `order_id`; every other
    /// field at its default (no reply queue, priority 0, no trace, every
    /// event, no application).
    pub fn new(order_id: Uuid, workflow: impl Into<String>, payload: Value) -> Self {
        Self {
            order_id,
            workflow: workflow.into(),
            payload,
            reply_to: None,
            priority: 0,
            not_before: None,
            trace_id: None,
            trace_span: None,
            events: Events::All,
            application: None,
            app_order_id: None,
        }
    }
}

const COLUMNS: &str = "order_id, workflow, payload, reply_to, priority, not_before, process_state, \
     locked_by, complete_by, failure_count, compensation_failures, last_seq, last_error, created_at, updated_at, trace_id, trace_span, held_for, held_since, hold_until, held_reason, redrives, events, application, app_order_id";

/// The order, without locking it.
pub async fn get(conn: &mut PgConnection, order_id: Uuid) -> Result<Option<OrderRow>, sqlx::Error> {
    sqlx::query_as::<_, OrderRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM orders WHERE order_id = $1"
    )))
    .bind(order_id)
    .fetch_optional(conn)
    .await
}

/// These orders, as they are now (not locked: the write-back is guarded
/// by each row's version). With `outbox_locks`, also takes their outbox locks.
pub async fn load_many(
    conn: &mut PgConnection,
    order_ids: &[Uuid],
    outbox_locks: bool,
) -> Result<Vec<Loaded>, sqlx::Error> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        loading(
            &format!(
                "SELECT {COLUMNS}, xmin::text::bigint AS version FROM orders \
                 WHERE order_id = ANY($1)"
            ),
            2,
        )
    });
    sqlx::query_as::<_, Loaded>(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(order_ids)
        .bind(outbox_locks)
        .fetch_all(conn)
        .await
}

/// Up to `limit` claimable orders, highest priority first, for `holder` to
/// claim: pending orders whose `not_before` has come, and compensating orders
/// that nobody drives; one held for a breaker once the breaker closed or
/// picked it as its probe, one held for flow control once its agent has
/// room. Orders another scheduler is claiming (its row lock
/// or claim lock) are passed by; `holder` takes the claim lock of each order
/// returned, which the write-back lets go ([`claim_key`]). Fewer when
/// `holder` already holds nearly `max_held` orders. With `outbox_locks`,
/// also takes their outbox locks.
///
/// Its row locks make it a transaction that writes; it commits without
/// waiting for the disk, as it changes no data.
pub async fn claimable(
    conn: &mut PgConnection,
    limit: i64,
    holder: &str,
    max_held: i64,
    outbox_locks: bool,
) -> Result<Vec<Loaded>, sqlx::Error> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        loading(
            &format!(
                "WITH relaxed AS (SELECT set_config('synchronous_commit', 'off', true)), \
                 c AS MATERIALIZED ( \
                   SELECT {COLUMNS}, xmin::text::bigint AS version FROM orders, relaxed \
                   WHERE (process_state = 'pending' \
                          OR (process_state = 'compensating' AND locked_by IS NULL)) \
                     AND (not_before IS NULL OR not_before <= now()) \
                     AND (held_for IS NULL OR NOT EXISTS (SELECT 1 FROM breakers b \
                       WHERE b.agent = orders.held_for AND b.state <> 'closed' \
                         AND b.probe_order IS DISTINCT FROM orders.order_id)) \
                     AND (held_reason IS DISTINCT FROM 'rate_limited' \
                       OR NOT EXISTS (SELECT 1 FROM agent_flow f WHERE f.agent = orders.held_for \
                         AND ((f.max_in_flight IS NOT NULL AND f.in_flight >= f.max_in_flight) \
                           OR (f.rate_per_sec IS NOT NULL AND {bucket} < 1)))) \
                   ORDER BY priority DESC, created_at \
                   LIMIT LEAST($1, GREATEST(0, $3 - (SELECT count(*) FROM orders WHERE locked_by = $2))) \
                   FOR UPDATE OF orders SKIP LOCKED) \
                 SELECT * FROM c WHERE pg_try_advisory_lock({key})",
                key = claim_key("c.order_id"),
                bucket = super::flows::bucket("f"),
            ),
            4,
        )
    });
    sqlx::query_as::<_, Loaded>(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(limit)
        .bind(holder)
        .bind(max_held)
        .bind(outbox_locks)
        .fetch_all(conn)
        .await
}

/// Orders whose step deadline has passed, or held longer than their
/// agent's `max_hold` (held now: a breaker's probe out keeps its hold's
/// `hold_until` but is judged by its step's deadline, so that a probe whose
/// answer is on its way is not cut at `max_hold`), oldest deadline first, of the
/// `partitions` (out of `count`, [`super::partitions`]) the caller sweeps.
/// Orders another supervisor's sweep has locked are passed by. With
/// `outbox_locks`, also takes their outbox locks.
pub async fn expired(
    conn: &mut PgConnection,
    limit: i64,
    outbox_locks: bool,
    partitions: &[i32],
    count: i32,
) -> Result<Vec<Loaded>, sqlx::Error> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        loading(
            &format!(
                "WITH relaxed AS (SELECT set_config('synchronous_commit', 'off', true)) \
                 SELECT {COLUMNS}, xmin::text::bigint AS version FROM orders, relaxed \
                 WHERE ((locked_by IS NOT NULL AND complete_by < now() \
                         AND process_state IN ('processing', 'compensating')) \
                        OR (hold_until < now() AND held_for IS NOT NULL)) \
                   AND {partition} = ANY($3::int[]) \
                 ORDER BY coalesce(complete_by, hold_until) LIMIT $1 \
                 FOR UPDATE OF orders SKIP LOCKED",
                partition = super::partitions::partition_of("order_id", "$4::int"),
            ),
            2,
        )
    });
    sqlx::query_as::<_, Loaded>(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(limit)
        .bind(outbox_locks)
        .bind(partitions)
        .bind(count)
        .fetch_all(conn)
        .await
}

/// Orders whose running step has passed a rung of the deadline ladder
/// (`rungs`, ascending fractions of its time) that its dispatch was not
/// warned of, and whose complete-by has not passed; soonest deadline first.
/// With `outbox_locks`, also takes their outbox locks.
pub async fn warnable(
    conn: &mut PgConnection,
    rungs: &[f64],
    limit: i64,
    outbox_locks: bool,
) -> Result<Vec<Loaded>, sqlx::Error> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        loading(
            &format!(
                "SELECT {COLUMNS}, xmin::text::bigint AS version FROM orders o \
                 WHERE o.locked_by IS NOT NULL AND o.complete_by >= now() \
                   AND o.process_state IN ('processing', 'compensating') \
                   AND EXISTS (SELECT 1 FROM steps s WHERE s.order_id = o.order_id \
                     AND s.state IN ('running', 'compensating') \
                     AND s.warned < cardinality($1::float8[]) \
                     AND now() >= s.complete_by \
                       - (1 - ($1::float8[])[s.warned + 1]) * s.timeout_ms * interval '1 millisecond') \
                 ORDER BY o.complete_by LIMIT $3"
            ),
            2,
        )
    });
    sqlx::query_as::<_, Loaded>(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(rungs)
        .bind(outbox_locks)
        .bind(limit)
        .fetch_all(conn)
        .await
}

/// Orders whose running step is past the first rung of its deadline
/// ladder, and held orders (those that may be stuck), soonest deadline first.
pub async fn late(conn: &mut PgConnection, limit: i64) -> Result<Vec<Loaded>, sqlx::Error> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        loading(
            &format!(
                "SELECT {COLUMNS}, xmin::text::bigint AS version FROM orders o \
                 WHERE o.held_for IS NOT NULL OR (o.locked_by IS NOT NULL \
                   AND o.process_state IN ('processing', 'compensating') \
                   AND EXISTS (SELECT 1 FROM steps s WHERE s.order_id = o.order_id \
                     AND s.state IN ('running', 'compensating') AND s.warned > 0)) \
                 ORDER BY o.complete_by LIMIT $1"
            ),
            2,
        )
    });
    sqlx::query_as::<_, Loaded>(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(limit)
        .bind(false)
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

//! The `orders` table: one row per order with the pattern's fields.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row as _};
use uuid::Uuid;

use std::sync::LazyLock;

pub use sas_core::model::{NewOrder, OrderRow};
use sas_core::state::ProcessState;

/// An order loaded for a transition: its row, the row's version, the
/// database's clock and its steps, read by one statement.
#[derive(Debug)]
pub struct Loaded {
    pub order: OrderRow,
    /// The row version read (`xmin`): the write-back changes the row only
    /// if it is still this version, so a transition that raced another
    /// changes nothing.
    pub version: i64,
    /// The statement's clock (`now()`).
    pub tx_now: DateTime<Utc>,
    /// Its steps, by index.
    pub steps: sqlx::types::Json<Vec<super::steps::StepRow>>,
    /// The agents' breakers that are not closed (the same on every row).
    pub gates: sqlx::types::Json<Vec<sas_core::rules::breaker::Gate>>,
    /// The agents under flow control (the same on every row).
    pub flows: sqlx::types::Json<Vec<sas_core::rules::flow::Flow>>,
}

/// What a claim would take now, and what it judged by.
#[derive(Debug)]
pub struct ClaimableNow {
    /// The claim query's clock.
    pub now: DateTime<Utc>,
    /// The orders it would take, in order id order.
    pub orders: Vec<OrderRow>,
    /// The breakers that are not closed, as it read them (empty when it
    /// took no order).
    pub gates: Vec<sas_core::rules::breaker::Gate>,
    /// The agents under flow control, as it read them (empty when it took
    /// no order).
    pub flows: Vec<sas_core::rules::flow::Flow>,
}

impl super::StateStore {
    /// The orders a claim would take now (up to `limit`), read by the claim
    /// query itself in a transaction that is rolled back and with its claim
    /// locks let go after, so that nothing is taken; with the clock, the
    /// breakers and the flows it judged by. What tests hold the query to:
    /// [`sas_core::rules::scheduler::claimable`] over the same facts.
    pub async fn claimable_now(&self, limit: u32) -> Result<ClaimableNow, super::StoreError> {
        use sqlx::Connection as _;
        let mut conn = self.pool().acquire().await?;
        let limit = i64::from(limit);
        let loaded = {
            let mut tx = conn.begin().await?;
            let loaded = claimable(&mut tx, limit, "", limit).await;
            tx.rollback().await?;
            loaded?
        };
        sqlx::query("SELECT pg_advisory_unlock_all()")
            .execute(&mut *conn)
            .await?;
        let (now, gates, flows) = match loaded.first() {
            Some(first) => (first.tx_now, first.gates.0.clone(), first.flows.0.clone()),
            None => (
                sqlx::query_scalar("SELECT now()")
                    .fetch_one(&mut *conn)
                    .await?,
                Vec::new(),
                Vec::new(),
            ),
        };
        Ok(ClaimableNow {
            now,
            orders: loaded.into_iter().map(|l| l.order).collect(),
            gates,
            flows,
        })
    }
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
fn loading(picked: &str) -> String {
    format!(
        "WITH l AS MATERIALIZED ({picked}) \
         SELECT l.*, now() AS tx_now, \
           (SELECT coalesce(json_agg(s ORDER BY s.idx), '[]') FROM ( \
             SELECT {steps} FROM steps WHERE steps.order_id = l.order_id) s) AS steps, \
           ({gates}) AS gates, ({flows}) AS flows \
         FROM l ORDER BY l.order_id",
        steps = super::steps::COLUMNS,
        gates = super::breakers::GATES,
        flows = *super::flows::FLOWS,
    )
}

/// The SQL of an order's claim lock key, for the order id in `column`: a
/// session-level advisory lock that a scheduler holds from reading an order
/// it claims to writing its claim back, so that another scheduler's claim
/// passes the order by meanwhile.
pub(super) fn claim_key(column: &str) -> String {
    format!("hashtextextended('sas.claim:' || {column}::text, 0)")
}

/// The order's columns ([`COLUMNS`]) with what the loading queries add.
impl<'r> sqlx::FromRow<'r, PgRow> for Loaded {
    fn from_row(row: &'r PgRow) -> Result<Self, sqlx::Error> {
        Ok(Self {
            order: order_from_row(row)?,
            version: row.try_get("version")?,
            tx_now: row.try_get("tx_now")?,
            steps: row.try_get("steps")?,
            gates: row.try_get("gates")?,
            flows: row.try_get("flows")?,
        })
    }
}

/// Reads the columns of [`COLUMNS`] (by name): an order's row, as
/// `sas-core`'s model holds it.
pub(super) fn order_from_row(row: &PgRow) -> Result<OrderRow, sqlx::Error> {
    {
        Ok(OrderRow {
            order_id: row.try_get("order_id")?,
            workflow: row.try_get("workflow")?,
            payload: row.try_get("payload")?,
            reply_to: row.try_get("reply_to")?,
            priority: row.try_get("priority")?,
            not_before: row.try_get("not_before")?,
            process_state: super::rows::text_as(row, "process_state")?,
            locked_by: row.try_get("locked_by")?,
            complete_by: row.try_get("complete_by")?,
            failure_count: row.try_get("failure_count")?,
            compensation_failures: row.try_get("compensation_failures")?,
            last_seq: row.try_get("last_seq")?,
            last_error: row.try_get("last_error")?,
            created_at: row.try_get("created_at")?,
            updated_at: row.try_get("updated_at")?,
            trace_id: row.try_get("trace_id")?,
            trace_span: row.try_get("trace_span")?,
            held_for: row.try_get("held_for")?,
            held_since: row.try_get("held_since")?,
            hold_until: row.try_get("hold_until")?,
            held_reason: row.try_get("held_reason")?,
            redrives: row.try_get("redrives")?,
            events: super::rows::text_as(row, "events")?,
            application: row.try_get("application")?,
            app_order_id: row.try_get("app_order_id")?,
            definition: row.try_get("definition")?,
        })
    }
}

const COLUMNS: &str = "order_id, workflow, payload, reply_to, priority, not_before, process_state, \
     locked_by, complete_by, failure_count, compensation_failures, last_seq, last_error, created_at, updated_at, trace_id, trace_span, held_for, held_since, hold_until, held_reason, redrives, events, application, app_order_id, definition";

/// The order, without locking it.
pub async fn get(conn: &mut PgConnection, order_id: Uuid) -> Result<Option<OrderRow>, sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM orders WHERE order_id = $1"
    )))
    .bind(order_id)
    .try_map(|row: PgRow| order_from_row(&row))
    .fetch_optional(conn)
    .await
}

/// These orders, as they are now (not locked: the write-back is guarded
/// by each row's version).
pub async fn load_many(
    conn: &mut PgConnection,
    order_ids: &[Uuid],
) -> Result<Vec<Loaded>, sqlx::Error> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        loading(&format!(
            "SELECT {COLUMNS}, xmin::text::bigint AS version FROM orders \
                 WHERE order_id = ANY($1)"
        ))
    });
    sqlx::query_as::<_, Loaded>(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(order_ids)
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
/// `holder` already holds nearly `max_held` orders.
///
/// Its row locks make it a transaction that writes; it commits without
/// waiting for the disk, as it changes no data.
pub async fn claimable(
    conn: &mut PgConnection,
    limit: i64,
    holder: &str,
    max_held: i64,
) -> Result<Vec<Loaded>, sqlx::Error> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        loading(&format!(
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
        ))
    });
    sqlx::query_as::<_, Loaded>(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(limit)
        .bind(holder)
        .bind(max_held)
        .fetch_all(conn)
        .await
}

/// The orders `o` a scheduler drives whose complete-by has not passed (past
/// it, the supervisor's expiry takes them): those the deadline ladder warns
/// ([`warnable`]) and those whose steps may be sent again ([`unsent`]).
const DRIVEN_IN_TIME: &str = "o.locked_by IS NOT NULL AND o.complete_by >= now() \
     AND o.process_state IN ('processing', 'compensating')";

/// Orders whose step deadline has passed, or held longer than their
/// agent's `max_hold` (held now: a breaker's probe out keeps its hold's
/// `hold_until` but is judged by its step's deadline, so that a probe whose
/// answer is on its way is not cut at `max_hold`), oldest deadline first, of the
/// `partitions` (out of `count`, [`super::partitions`]) the caller sweeps.
/// Orders another supervisor's sweep has locked are passed by.
pub async fn expired(
    conn: &mut PgConnection,
    limit: i64,
    partitions: &[i32],
    count: i32,
) -> Result<Vec<Loaded>, sqlx::Error> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        loading(&format!(
            "WITH relaxed AS (SELECT set_config('synchronous_commit', 'off', true)) \
                 SELECT {COLUMNS}, xmin::text::bigint AS version FROM orders, relaxed \
                 WHERE ((locked_by IS NOT NULL AND complete_by < now() \
                         AND process_state IN ('processing', 'compensating')) \
                        OR (hold_until < now() AND held_for IS NOT NULL)) \
                   AND {partition} = ANY($2::int[]) \
                 ORDER BY coalesce(complete_by, hold_until) LIMIT $1 \
                 FOR UPDATE OF orders SKIP LOCKED",
            partition = super::partitions::partition_of("order_id", "$3::int"),
        ))
    });
    sqlx::query_as::<_, Loaded>(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(limit)
        .bind(partitions)
        .bind(count)
        .fetch_all(conn)
        .await
}

/// Orders whose watched step has passed a rung of the deadline ladder
/// (`rungs`, ascending fractions of its time) that its dispatch was not
/// warned of, and whose complete-by has not passed; soonest deadline first.
/// The watched step is the running one (compensating, for an order being
/// undone) with the soonest complete-by, a wait excepted: exactly the
/// orders [`sas_core::rules::supervisor::warnable`] names, which a test checks
/// over generated rows (a wait was picked here and never warned, so it was
/// loaded again at every tick).
pub async fn warnable(
    conn: &mut PgConnection,
    rungs: &[f64],
    limit: i64,
) -> Result<Vec<Loaded>, sqlx::Error> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        loading(&format!(
            "SELECT {COLUMNS}, xmin::text::bigint AS version FROM orders o \
                 WHERE {DRIVEN_IN_TIME} \
                   AND EXISTS (SELECT 1 FROM (SELECT s.complete_by, s.timeout_ms, s.warned \
                       FROM steps s WHERE s.order_id = o.order_id \
                         AND s.state = CASE o.process_state \
                           WHEN 'processing' THEN 'running' ELSE 'compensating' END \
                         AND s.agent NOT LIKE 'wait:%' \
                       ORDER BY s.complete_by NULLS FIRST, s.idx LIMIT 1) w \
                     WHERE w.timeout_ms > 0 \
                       AND w.warned < cardinality($1::float8[]) \
                       AND now() >= w.complete_by \
                         - (1 - ($1::float8[])[w.warned + 1]) * w.timeout_ms * interval '1 millisecond') \
                 ORDER BY o.complete_by LIMIT $2"
        ))
    });
    sqlx::query_as::<_, Loaded>(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(rungs)
        .bind(limit)
        .fetch_all(conn)
        .await
}

/// Orders driven by a scheduler, their complete-by not passed, with a step
/// out by a message sent under a dispatch id older than `before` (ids are
/// UUIDv7, ordered by time): a step out with an agent (a wait or a signal
/// sends nothing), or an undo out with its compensating agent. Exactly the
/// orders [`sas_core::rules::resend::unsent`] names, which a test checks
/// over generated rows. Soonest deadline first; orders another sweep has
/// locked are passed by.
pub async fn unsent(
    conn: &mut PgConnection,
    before: Uuid,
    limit: i64,
) -> Result<Vec<Loaded>, sqlx::Error> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        loading(&format!(
            "SELECT {COLUMNS}, xmin::text::bigint AS version FROM orders o \
                 WHERE {DRIVEN_IN_TIME} \
                   AND EXISTS (SELECT 1 FROM steps s WHERE s.order_id = o.order_id \
                     AND s.dispatch_id < $1 \
                     AND ((s.state = 'running' AND s.agent NOT LIKE 'wait:%' \
                           AND s.agent NOT LIKE 'signal:%') \
                       OR (s.state = 'compensating' AND s.compensate IS NOT NULL))) \
                 ORDER BY o.complete_by LIMIT $2 \
                 FOR UPDATE OF o SKIP LOCKED"
        ))
    });
    sqlx::query_as::<_, Loaded>(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(before)
        .bind(limit)
        .fetch_all(conn)
        .await
}

/// Orders whose running step is past the first rung of its deadline
/// ladder, and held orders (those that may be stuck), soonest deadline first.
pub async fn late(conn: &mut PgConnection, limit: i64) -> Result<Vec<Loaded>, sqlx::Error> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        loading(&format!(
            "SELECT {COLUMNS}, xmin::text::bigint AS version FROM orders o \
                 WHERE o.held_for IS NOT NULL OR (o.locked_by IS NOT NULL \
                   AND o.process_state IN ('processing', 'compensating') \
                   AND EXISTS (SELECT 1 FROM steps s WHERE s.order_id = o.order_id \
                     AND s.state IN ('running', 'compensating') AND s.warned > 0)) \
                 ORDER BY o.complete_by LIMIT $1"
        ))
    });
    sqlx::query_as::<_, Loaded>(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(limit)
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
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM orders \
         WHERE ($1::text IS NULL OR process_state = $1) AND ($2::text IS NULL OR workflow = $2) \
         ORDER BY created_at DESC LIMIT $3"
    )))
    .bind(state.map(ProcessState::as_str))
    .bind(workflow)
    .bind(limit)
    .try_map(|row: PgRow| order_from_row(&row))
    .fetch_all(conn)
    .await
}

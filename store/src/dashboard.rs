//! What the operator dashboard reads: orders per state, terminal orders and
//! their end-to-end latency in time buckets, orders waiting for a re-attempt,
//! failed orders, and the agents' breakers. Read-only; the dashboard's actions
//! go through [`super::Transitions`] like `sasctl`'s.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;
use uuid::Uuid;

use super::StoreError;
use super::breaker_reports::BreakerRow;
use sas_core::state::ProcessState;

/// The span of the dashboard's charts.
pub const CHART_WINDOW: Duration = Duration::from_secs(15 * 60);

/// The width of one bar of the charts.
pub const CHART_BUCKET: Duration = Duration::from_secs(10);

/// Everything the overview page shows, read in one snapshot.
#[derive(Debug, Clone, Serialize)]
pub struct Overview {
    /// The database clock when the snapshot was taken; the page shows times relative to it.
    pub now: DateTime<Utc>,
    /// Orders per `process_state`, every state present (0 when none).
    pub by_state: BTreeMap<String, i64>,
    /// Orders that ended in the chart window per [`CHART_BUCKET`], oldest first, gaps filled.
    pub buckets: Vec<Bucket>,
    /// Orders waiting for a re-attempt or their `not_before`, soonest first.
    pub waiting: Vec<WaitingOrder>,
    /// How many orders wait in all (`waiting` holds at most the list limit).
    pub waiting_total: i64,
    /// Orders in `error` or `compensated`, most recently changed first.
    pub failed: Vec<FailedOrder>,
    /// Orders whose alert still needs an operator: those in `error`.
    pub open_alerts: i64,
    /// Every agent instance's own breaker per endpoint.
    pub breakers: Vec<BreakerRow>,
    /// Each agent's breaker shared by its instances, with its held orders.
    pub shared_breakers: Vec<super::SharedBreaker>,
}

/// Orders that ended in one time bucket.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Bucket {
    pub start: DateTime<Utc>,
    pub processed: i64,
    pub compensated: i64,
    /// Ended in `error` (the `failed` event).
    pub failed: i64,
    /// Median time from submission to the end, in milliseconds; `None` when nothing ended.
    pub p50_ms: Option<f64>,
    /// 99th percentile of the same.
    pub p99_ms: Option<f64>,
}

/// An order waiting before it may be claimed again.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct WaitingOrder {
    pub order_id: Uuid,
    pub workflow: String,
    #[sqlx(try_from = "String")]
    pub process_state: ProcessState,
    /// `retry` (after a failure), `scheduled` (an application's
    /// `not_before`) or `held` (for its agent's open breaker).
    pub kind: String,
    /// The attempt that comes next (1 + failure count).
    pub attempt: i32,
    /// When it may be claimed; `None` or past means as soon as a scheduler polls.
    pub not_before: Option<DateTime<Utc>>,
    /// Why it waits: the reason of its last event.
    pub reason: Option<String>,
    pub created_at: DateTime<Utc>,
}

/// An order that ended badly.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct FailedOrder {
    pub order_id: Uuid,
    pub workflow: String,
    #[sqlx(try_from = "String")]
    pub process_state: ProcessState,
    pub failure_count: i32,
    /// Why it stopped (the alert's reason, or the operator's cancel).
    pub reason: Option<String>,
    /// Whether its alert is still open: it is in `error`, waiting for an operator.
    pub alert_open: bool,
    /// Whether some of its steps were undone (a retry is then refused).
    #[serde(skip)]
    pub undone: bool,
    /// Whether the engine's `Transitions::retry` would accept it now (shown as an
    /// enabled button; the transition checks again).
    #[sqlx(skip)]
    pub retryable: bool,
    /// Whether the engine's `Transitions::cancel` would accept it now.
    #[sqlx(skip)]
    pub cancellable: bool,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl crate::ReadModels {
    /// The overview, in one read-only snapshot so that counts and lists agree;
    /// lists hold at most `limit` orders each.
    pub async fn overview(&self, limit: i64) -> Result<Overview, StoreError> {
        let mut conn = self.store.conn().await?;
        let (now, by_state, buckets, (waiting, waiting_total), failed) = conn
            .run(|c| async move {
                let mut tx = sqlx::Connection::begin(c).await?;
                sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                    .execute(&mut *tx)
                    .await?;
                let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
                    .fetch_one(&mut *tx)
                    .await?;
                let by_state = by_state(&mut tx).await?;
                let buckets = buckets(&mut tx, now).await?;
                let waiting = waiting(&mut tx, limit).await?;
                let failed = failed(&mut tx, limit).await?;
                tx.commit().await?;
                Ok::<_, sqlx::Error>((now, by_state, buckets, waiting, failed))
            })
            .await?;
        drop(conn);
        let breakers = self.store.breakers().await?;
        let shared_breakers = self.store.shared_breakers().await?;
        Ok(Overview {
            now,
            open_alerts: by_state
                .get(ProcessState::Error.as_str())
                .copied()
                .unwrap_or(0),
            by_state,
            buckets,
            waiting,
            waiting_total,
            failed,
            breakers,
            shared_breakers,
        })
    }
}

async fn by_state(conn: &mut PgConnection) -> Result<BTreeMap<String, i64>, sqlx::Error> {
    let mut counts: BTreeMap<String, i64> = [
        ProcessState::Pending,
        ProcessState::Processing,
        ProcessState::Processed,
        ProcessState::Error,
        ProcessState::Compensating,
        ProcessState::Compensated,
    ]
    .iter()
    .map(|s| (s.as_str().to_owned(), 0))
    .collect();
    let rows =
        sqlx::query_as::<_, (String, i64)>("SELECT process_state, count(*) FROM orders GROUP BY 1")
            .fetch_all(conn)
            .await?;
    counts.extend(rows);
    Ok(counts)
}

/// One bucket as the query returns it: its number (start / width).
#[derive(sqlx::FromRow)]
struct BucketRow {
    bucket: i64,
    processed: i64,
    compensated: i64,
    failed: i64,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
}

/// The chart buckets ending with the one `now` falls in.
async fn buckets(conn: &mut PgConnection, now: DateTime<Utc>) -> Result<Vec<Bucket>, sqlx::Error> {
    let width = i64::try_from(CHART_BUCKET.as_secs()).unwrap_or(10).max(1);
    let count = i64::try_from(CHART_WINDOW.as_secs()).unwrap_or(900) / width;
    let last = now.timestamp().div_euclid(width);
    let first = last - count + 1;
    // One terminal event per run of an order: an order an operator retried
    // counts again when it ends again.
    let rows: Vec<BucketRow> = sqlx::query_as(
        "SELECT floor(extract(epoch FROM e.at) / $1)::bigint AS bucket, \
           count(*) FILTER (WHERE e.event = 'processed') AS processed, \
           count(*) FILTER (WHERE e.event = 'compensated') AS compensated, \
           count(*) FILTER (WHERE e.event = 'failed') AS failed, \
           percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM e.at - o.created_at)::float8 * 1000) AS p50_ms, \
           percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM e.at - o.created_at)::float8 * 1000) AS p99_ms \
         FROM order_events e JOIN orders o USING (order_id) \
         WHERE e.event IN ('processed', 'compensated', 'failed') AND e.at >= to_timestamp($2) \
         GROUP BY 1",
    )
    .bind(width)
    .bind(first * width)
    .fetch_all(conn)
    .await?;
    let mut by_bucket: BTreeMap<i64, BucketRow> = rows.into_iter().map(|r| (r.bucket, r)).collect();
    Ok((first..=last)
        .map(|b| {
            let start = DateTime::from_timestamp(b * width, 0).unwrap_or_default();
            match by_bucket.remove(&b) {
                Some(r) => Bucket {
                    start,
                    processed: r.processed,
                    compensated: r.compensated,
                    failed: r.failed,
                    p50_ms: r.p50_ms,
                    p99_ms: r.p99_ms,
                },
                None => Bucket {
                    start,
                    ..Bucket::default()
                },
            }
        })
        .collect())
}

/// Pending orders after a failure or before their `not_before`, and
/// compensating orders waiting to retry an undo.
async fn waiting(
    conn: &mut PgConnection,
    limit: i64,
) -> Result<(Vec<WaitingOrder>, i64), sqlx::Error> {
    const WAITING: &str = "o.locked_by IS NULL AND (o.held_for IS NOT NULL \
           OR (o.process_state = 'pending' AND (o.failure_count > 0 OR o.not_before > now())) \
           OR (o.process_state = 'compensating' AND o.not_before > now()))";
    let total: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM orders o WHERE {WAITING}"
    )))
    .fetch_one(&mut *conn)
    .await?;
    let rows = sqlx::query_as::<_, WaitingOrder>(sqlx::AssertSqlSafe(format!(
        "SELECT o.order_id, o.workflow, o.process_state, \
           CASE WHEN o.held_for IS NOT NULL THEN 'held' \
                WHEN o.failure_count > 0 OR o.process_state = 'compensating' \
                THEN 'retry' ELSE 'scheduled' END AS kind, \
           o.failure_count + 1 AS attempt, o.not_before, ev.reason, o.created_at \
         FROM orders o \
         LEFT JOIN LATERAL ( \
           SELECT reason FROM order_events e WHERE e.order_id = o.order_id \
           ORDER BY seq DESC LIMIT 1) ev ON true \
         WHERE {WAITING} \
         ORDER BY o.not_before NULLS FIRST, o.created_at LIMIT $1"
    )))
    .bind(limit)
    .fetch_all(conn)
    .await?;
    Ok((rows, total))
}

/// Orders in `error` or `compensated`, most recently changed first.
async fn failed(conn: &mut PgConnection, limit: i64) -> Result<Vec<FailedOrder>, sqlx::Error> {
    // `retryable` and `cancellable` are the rules' to say: the dashboard sets them.
    let rows = sqlx::query_as::<_, FailedOrder>(
        "SELECT o.order_id, o.workflow, o.process_state, o.failure_count, o.last_error AS reason, \
           o.process_state = 'error' AS alert_open, \
           EXISTS (SELECT 1 FROM steps s WHERE s.order_id = o.order_id \
             AND (s.state IN ('compensated', 'compensating') OR s.undo_in_doubt)) AS undone, \
           o.created_at, o.updated_at \
         FROM orders o WHERE o.process_state IN ('error', 'compensated') \
         ORDER BY o.process_state = 'error' DESC, o.updated_at DESC LIMIT $1",
    )
    .bind(limit)
    .fetch_all(conn)
    .await?;
    Ok(rows)
}

//! The `steps` table: one row per step of an order.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::state::StepState;
use crate::workflow::{Step, StepView};

/// A step row.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct StepRow {
    pub order_id: Uuid,
    pub idx: i32,
    pub name: String,
    pub agent: String,
    pub compensate: Option<String>,
    pub timeout_ms: i64,
    #[sqlx(try_from = "String")]
    pub state: StepState,
    pub dispatches: i32,
    pub dispatch_id: Option<Uuid>,
    pub complete_by: Option<DateTime<Utc>>,
    pub result: Option<Value>,
    pub error: Option<String>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
}

impl StepRow {
    /// What the step plan needs of this row.
    pub fn view(&self) -> StepView<'_> {
        StepView {
            idx: self.idx,
            state: self.state,
            compensate: self.compensate.as_deref(),
        }
    }
}

/// Inserts the steps of a new order, all `not_started`.
pub async fn insert_all(
    conn: &mut PgConnection,
    order_id: Uuid,
    steps: &[Step],
) -> Result<(), sqlx::Error> {
    let idx: Vec<i32> = (0..steps.len() as i32).collect();
    let names: Vec<&str> = steps.iter().map(|s| s.name.as_str()).collect();
    let agents: Vec<&str> = steps.iter().map(|s| s.agent.as_str()).collect();
    let comps: Vec<Option<&str>> = steps.iter().map(|s| s.compensate.as_deref()).collect();
    let timeouts: Vec<i64> = steps
        .iter()
        .map(|s| i64::try_from(s.timeout.as_millis()).unwrap_or(i64::MAX))
        .collect();
    sqlx::query(
        "INSERT INTO steps (order_id, idx, name, agent, compensate, timeout_ms) \
         SELECT $1, * FROM UNNEST($2::int[], $3::text[], $4::text[], $5::text[], $6::bigint[])",
    )
    .bind(order_id)
    .bind(idx)
    .bind(names)
    .bind(agents)
    .bind(comps)
    .bind(timeouts)
    .execute(conn)
    .await?;
    Ok(())
}

/// The steps of these orders, ordered by order and index.
pub async fn for_orders(
    conn: &mut PgConnection,
    order_ids: &[Uuid],
) -> Result<Vec<StepRow>, sqlx::Error> {
    sqlx::query_as::<_, StepRow>(
        "SELECT order_id, idx, name, agent, compensate, timeout_ms, state, dispatches, dispatch_id, \
           complete_by, result, error, started_at, finished_at \
         FROM steps WHERE order_id = ANY($1) ORDER BY order_id, idx",
    )
    .bind(order_ids)
    .fetch_all(conn)
    .await
}

/// Dispatches the step: moves it to `to` with a fresh dispatch id and a
/// complete-by from the database clock. Returns the complete-by.
pub async fn dispatch(
    conn: &mut PgConnection,
    order_id: Uuid,
    idx: i32,
    to: StepState,
    dispatch_id: Uuid,
) -> Result<DateTime<Utc>, sqlx::Error> {
    sqlx::query_scalar(
        "UPDATE steps SET state = $3, dispatch_id = $4, dispatches = dispatches + 1, \
           complete_by = now() + timeout_ms * interval '1 millisecond', \
           started_at = COALESCE(started_at, now()) \
         WHERE order_id = $1 AND idx = $2 RETURNING complete_by",
    )
    .bind(order_id)
    .bind(idx)
    .bind(to.as_str())
    .bind(dispatch_id)
    .fetch_one(conn)
    .await
}

/// How one dispatch of a step ended, and the guard it must pass.
#[derive(Debug, Clone, Copy)]
pub struct Finish<'a> {
    pub idx: i32,
    /// The state the step must still be in.
    pub expected: StepState,
    /// The dispatch the answer is for; any other is stale.
    pub dispatch_id: Uuid,
    pub to: StepState,
    pub result: Option<&'a Value>,
    pub error: Option<&'a str>,
}

/// Records how a dispatch ended, guarded by the state and the dispatch it answers.
/// Whether the guard held.
pub async fn finish(
    conn: &mut PgConnection,
    order_id: Uuid,
    f: &Finish<'_>,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE steps SET state = $5, result = COALESCE($6, result), error = $7, \
           finished_at = now(), complete_by = NULL \
         WHERE order_id = $1 AND idx = $2 AND state = $3 AND dispatch_id = $4",
    )
    .bind(order_id)
    .bind(f.idx)
    .bind(f.expected.as_str())
    .bind(f.dispatch_id)
    .bind(f.to.as_str())
    .bind(f.result)
    .bind(f.error)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Withdraws the running dispatch of an order (its deadline passed): a forward
/// step goes back to `not_started`, a compensation back to `completed`, and any
/// late reply to the old dispatch becomes stale.
pub async fn withdraw_running(conn: &mut PgConnection, order_id: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE steps SET dispatch_id = NULL, complete_by = NULL, \
           state = CASE state WHEN 'running' THEN 'not_started' ELSE 'completed' END \
         WHERE order_id = $1 AND state IN ('running', 'compensating')",
    )
    .bind(order_id)
    .execute(conn)
    .await?;
    Ok(())
}

/// Prepares an operator's retry: the failed step runs again; completed ones do not.
pub async fn reset_for_retry(conn: &mut PgConnection, order_id: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE steps SET state = 'not_started', dispatch_id = NULL, complete_by = NULL, error = NULL \
         WHERE order_id = $1 AND state IN ('failed', 'compensating', 'compensated', 'running')",
    )
    .bind(order_id)
    .execute(conn)
    .await?;
    Ok(())
}

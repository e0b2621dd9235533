//! The `steps` table: one row per step of an order.

use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row as _};
use uuid::Uuid;

pub use sas_core::model::{StepRow, stage_names};

/// Reads the columns of [`COLUMNS`] (by name): a step's row, as
/// `sas-core`'s model holds it.
fn step_from_row(row: &PgRow) -> Result<StepRow, sqlx::Error> {
    {
        Ok(StepRow {
            order_id: row.try_get("order_id")?,
            idx: row.try_get("idx")?,
            name: row.try_get("name")?,
            agent: row.try_get("agent")?,
            compensate: row.try_get("compensate")?,
            timeout_ms: row.try_get("timeout_ms")?,
            state: super::rows::text_as(row, "state")?,
            dispatches: row.try_get("dispatches")?,
            dispatch_id: row.try_get("dispatch_id")?,
            complete_by: row.try_get("complete_by")?,
            result: row.try_get("result")?,
            error: row.try_get("error")?,
            started_at: row.try_get("started_at")?,
            finished_at: row.try_get("finished_at")?,
            warned: row.try_get("warned")?,
            after_steps: row.try_get("after_steps")?,
            max_duration_ms: row.try_get("max_duration_ms")?,
            in_doubt: row.try_get("in_doubt")?,
            undo_in_doubt: row.try_get("undo_in_doubt")?,
        })
    }
}

/// The columns of a [`StepRow`].
pub(super) const COLUMNS: &str = "order_id, idx, name, agent, compensate, timeout_ms, state, \
     dispatches, dispatch_id, complete_by, result, error, started_at, finished_at, warned, after_steps, max_duration_ms, in_doubt, undo_in_doubt";

/// The steps of these orders, ordered by order and index.
pub async fn for_orders(
    conn: &mut PgConnection,
    order_ids: &[Uuid],
) -> Result<Vec<StepRow>, sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM steps WHERE order_id = ANY($1) ORDER BY order_id, idx"
    )))
    .bind(order_ids)
    .try_map(|row: PgRow| step_from_row(&row))
    .fetch_all(conn)
    .await
}

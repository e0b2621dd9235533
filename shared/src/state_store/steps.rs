//! The `steps` table: one row per step of an order.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::state::StepState;
use crate::workflow::StepView;

/// A step row.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Deserialize)]
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
    /// Rungs of the deadline ladder its current dispatch was warned of.
    pub warned: i16,
    /// The indices of the steps it starts after (§4b); `None` for steps
    /// stored before workflows had `after`: the step before it.
    #[serde(default)]
    pub after_steps: Option<Vec<i32>>,
    /// How far `202` heartbeats may move its complete-by from its first
    /// dispatch (§4b); `None` for steps stored before: [`DEFAULT_MAX_DURATION_MS`].
    #[serde(default)]
    pub max_duration_ms: Option<i64>,
    /// Dispatched, and no answer decided it (contract §4c): a remote may
    /// have applied it, so it is undone with the completed steps.
    #[serde(default)]
    pub in_doubt: bool,
    /// Its undo went out and no answer decided it: the remote may have
    /// undone it. It is undone again before a retry or redrive may go on.
    #[serde(default)]
    pub undo_in_doubt: bool,
}

/// A step's `max_duration` when its row has none: an hour.
pub const DEFAULT_MAX_DURATION_MS: i64 = 3_600_000;

impl StepRow {
    /// Step `idx` of a new order, as its workflow plans it: not started.
    pub fn planned(order_id: Uuid, idx: i32, step: &crate::workflow::Step) -> Self {
        Self {
            order_id,
            idx,
            name: step.name.clone(),
            agent: step.agent.clone(),
            compensate: step.compensate.clone(),
            timeout_ms: i64::try_from(step.timeout.as_millis()).unwrap_or(i64::MAX),
            state: StepState::NotStarted,
            dispatches: 0,
            dispatch_id: None,
            complete_by: None,
            result: None,
            error: None,
            started_at: None,
            finished_at: None,
            warned: 0,
            after_steps: Some(step.after.clone()),
            max_duration_ms: Some(i64::try_from(step.max_duration.as_millis()).unwrap_or(i64::MAX)),
            in_doubt: false,
            undo_in_doubt: false,
        }
    }

    /// The agent whose answer the step waits for while it is out: its own
    /// while `running`, its undo's while `compensating`; `None` otherwise.
    pub fn out_with(&self) -> Option<&str> {
        match self.state {
            StepState::Running => Some(self.agent.as_str()),
            StepState::Compensating => self.compensate.as_deref(),
            _ => None,
        }
    }

    /// The indices of the steps it starts after.
    pub fn after(&self) -> Vec<i32> {
        match &self.after_steps {
            Some(after) => after.clone(),
            None => crate::workflow::previous(self.idx).into_iter().collect(),
        }
    }

    /// The latest complete-by a `202` heartbeat may give it: its first
    /// dispatch plus its `max_duration` (none before its first dispatch).
    pub fn max_complete_by(&self) -> Option<DateTime<Utc>> {
        let max = self.max_duration_ms.unwrap_or(DEFAULT_MAX_DURATION_MS);
        self.started_at?
            .checked_add_signed(chrono::Duration::milliseconds(max))
    }

    /// The names of the steps it starts after, among `steps` (its order's).
    pub fn after_names(&self, steps: &[StepRow]) -> Vec<String> {
        self.after()
            .iter()
            .filter_map(|i| steps.iter().find(|s| s.idx == *i))
            .map(|s| s.name.clone())
            .collect()
    }

    /// What the step plan needs of this row.
    pub fn view(&self) -> StepView<'_> {
        StepView {
            idx: self.idx,
            state: self.state,
            compensate: self.compensate.as_deref(),
            after: self.after_steps.as_deref(),
            finished_at: self.finished_at,
            in_doubt: self.in_doubt,
        }
    }
}

/// An order's step names by stage ([`crate::workflow::stages`]): the
/// branches, as `sasctl` and the dashboard show them.
pub fn stage_names(steps: &[StepRow]) -> Vec<Vec<String>> {
    let views: Vec<_> = steps.iter().map(StepRow::view).collect();
    crate::workflow::stages(&views)
        .into_iter()
        .map(|stage| {
            stage
                .iter()
                .filter_map(|i| steps.iter().find(|s| s.idx == *i))
                .map(|s| s.name.clone())
                .collect()
        })
        .collect()
}

/// The columns of a [`StepRow`].
pub(super) const COLUMNS: &str = "order_id, idx, name, agent, compensate, timeout_ms, state, \
     dispatches, dispatch_id, complete_by, result, error, started_at, finished_at, warned, after_steps, max_duration_ms, in_doubt, undo_in_doubt";

/// The steps of these orders, ordered by order and index.
pub async fn for_orders(
    conn: &mut PgConnection,
    order_ids: &[Uuid],
) -> Result<Vec<StepRow>, sqlx::Error> {
    sqlx::query_as::<_, StepRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM steps WHERE order_id = ANY($1) ORDER BY order_id, idx"
    )))
    .bind(order_ids)
    .fetch_all(conn)
    .await
}

//! The `schedules` table: each recurring order's mark (contract §4b). A
//! pass loads the mark with the database's clock ([`StateStore::schedule_mark`]),
//! asks the rule ([`sas_core::rules::schedule::due`]), submits the ticks'
//! orders through the ordinary submission (the engine's `Transitions::submit`,
//! idempotent on their UUIDv5 ids) and only then moves the mark on,
//! guarded by the mark it loaded ([`StateStore::move_schedule_mark`]). A
//! pass that dies between the two submits the same ids again next time,
//! which changes nothing; two passes at once (a leader's hand-over) submit
//! the same ids, and one of them moves the mark.

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use super::{StateStore, StoreError};
use sas_core::rules::schedule::{self, Schedule, ScheduleKey};

/// A schedule's stored state as `sasctl schedules list` and the dashboard
/// show it, beside its configuration.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct ScheduleRow {
    pub name: String,
    /// Every tick at or before it is dealt with (ordered or passed over).
    pub last_tick: DateTime<Utc>,
    /// The latest order the schedule made.
    pub last_order_id: Option<Uuid>,
    /// That order's `process_state` (`None`: pruned, or none made yet).
    pub last_order_state: Option<String>,
    pub updated_at: DateTime<Utc>,
}

impl StateStore {
    /// The deployment's namespace of scheduled orders' ids (contract §1b),
    /// made at random by the migration that added it.
    pub async fn schedule_key(&self) -> Result<ScheduleKey, StoreError> {
        let key: Uuid = self
            .conn()
            .await?
            .run(|c| sqlx::query_scalar("SELECT key FROM schedule_key").fetch_one(c))
            .await?;
        Ok(ScheduleKey(key))
    }

    /// `name`'s mark (`None`: first seen) and the database's clock.
    pub async fn schedule_mark(
        &self,
        name: &str,
    ) -> Result<(Option<DateTime<Utc>>, DateTime<Utc>), StoreError> {
        self.conn()
            .await?
            .run(|c| {
                sqlx::query_as("SELECT (SELECT last_tick FROM schedules WHERE name = $1), now()")
                    .bind(name)
                    .fetch_one(c)
            })
            .await
    }

    /// Moves `name`'s mark from `expected` (`None`: no row yet) to `mark`,
    /// recording `last_order` when one was made. `false` when the mark was
    /// no longer `expected`: another pass moved it first.
    pub async fn move_schedule_mark(
        &self,
        name: &str,
        expected: Option<DateTime<Utc>>,
        mark: DateTime<Utc>,
        last_order: Option<Uuid>,
    ) -> Result<bool, StoreError> {
        let written = self
            .conn()
            .await?
            .run(|c| {
                sqlx::query(
            "INSERT INTO schedules AS s (name, last_tick, last_order_id) VALUES ($1, $3, $4) \
             ON CONFLICT (name) DO UPDATE \
               SET last_tick = $3, last_order_id = coalesce($4, s.last_order_id), \
                   updated_at = now() \
               WHERE s.last_tick IS NOT DISTINCT FROM $2",
        )
        .bind(name)
        .bind(expected)
        .bind(mark)
        .bind(last_order)
        .execute(c)
            })
            .await?
            .rows_affected();
        Ok(written == 1)
    }

    /// The stored state of these schedules (those with a row), by name,
    /// with the database's clock.
    pub async fn schedules(
        &self,
        names: &[String],
    ) -> Result<(Vec<ScheduleRow>, DateTime<Utc>), StoreError> {
        let rows = self
            .conn()
            .await?
            .run(|c| {
                sqlx::query_as::<_, ScheduleRow>(
                    "SELECT s.name, s.last_tick, s.last_order_id, \
               o.process_state AS last_order_state, s.updated_at \
             FROM schedules s LEFT JOIN orders o ON o.order_id = s.last_order_id \
             WHERE s.name = ANY($1) ORDER BY s.name",
                )
                .bind(names)
                .fetch_all(c)
            })
            .await?;
        let now = self
            .conn()
            .await?
            .run(|c| sqlx::query_scalar("SELECT now()").fetch_one(c))
            .await?;
        Ok((rows, now))
    }
}

/// A configured schedule with its stored state and next tick: one row of
/// `sasctl schedules list` and of the dashboard's panel.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScheduleView {
    pub name: String,
    pub workflow: String,
    pub cron: String,
    /// The IANA zone of `cron`'s wall clock (`UTC` by default).
    pub timezone: &'static str,
    pub catch_up: schedule::CatchUp,
    /// The first tick after the database's `now` (`None`: it never fires again).
    pub next_tick: Option<DateTime<Utc>>,
    /// Every tick at or before it is dealt with (`None`: no supervisor
    /// has seen the schedule yet).
    pub last_tick: Option<DateTime<Utc>>,
    /// The latest order the schedule made, and its state.
    pub last_order_id: Option<Uuid>,
    pub last_order_state: Option<String>,
}

impl StateStore {
    /// `schedules` as configured, each with its stored state and next
    /// tick, and the database's clock they were read at.
    pub async fn schedule_views(
        &self,
        schedules: &[Schedule],
    ) -> Result<(Vec<ScheduleView>, DateTime<Utc>), StoreError> {
        let names: Vec<String> = schedules.iter().map(|s| s.name.clone()).collect();
        let (rows, now) = self.schedules(&names).await?;
        let views = schedules
            .iter()
            .map(|s| {
                let row = rows.iter().find(|r| r.name == s.name);
                ScheduleView {
                    name: s.name.clone(),
                    workflow: s.workflow.clone(),
                    cron: s.cron_text.clone(),
                    timezone: s.zone_name(),
                    catch_up: s.catch_up,
                    next_tick: s.next_tick(now).ok(),
                    last_tick: row.map(|r| r.last_tick),
                    last_order_id: row.and_then(|r| r.last_order_id),
                    last_order_state: row.and_then(|r| r.last_order_state.clone()),
                }
            })
            .collect();
        Ok((views, now))
    }
}

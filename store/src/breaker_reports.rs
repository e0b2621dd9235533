//! The `agent_breakers` table: each agent instance's own circuit-breaker
//! state per endpoint (whether that instance reaches its remote), reported
//! by the agents for operators (the dashboard). Nothing in sas decides
//! anything from it: the breaker the deployment acts on is the shared one
//! ([`super::breakers`]).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::{StateStore, StoreError};

/// How often an agent reports its breakers when nothing changes.
pub const BREAKER_HEARTBEAT: Duration = Duration::from_secs(5);

/// A report older than this means the instance stopped reporting (it died,
/// or lost Postgres): the dashboard shows its row as not reporting.
pub const BREAKER_STALE_AFTER: Duration = Duration::from_secs(30);

/// Rows not reported for this long are deleted: their instances are gone.
pub const BREAKER_FORGET_AFTER: Duration = Duration::from_secs(24 * 3600);

/// What an agent instance reports of one endpoint's breaker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerReport<'a> {
    /// The agent's name.
    pub agent: &'a str,
    /// The reporting process, e.g. `<host>:<pid>`.
    pub instance: &'a str,
    /// The remote URL.
    pub endpoint: &'a str,
    /// `closed`, `half_open` or `open`.
    pub state: &'a str,
    pub consecutive_failures: u32,
}

/// One row of `agent_breakers`, as the dashboard shows it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct BreakerRow {
    pub agent: String,
    pub instance: String,
    pub endpoint: String,
    pub state: String,
    pub consecutive_failures: i32,
    pub changed_at: DateTime<Utc>,
    pub seen_at: DateTime<Utc>,
    /// Whether the last report is older than [`BREAKER_STALE_AFTER`] (database clock).
    pub stale: bool,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl StateStore {
    /// Records a breaker's state now; `changed_at` moves only when the state differs
    /// from the one last reported.
    pub async fn report_breaker(&self, r: &BreakerReport<'_>) -> Result<(), StoreError> {
        self.conn()
            .await?
            .run(|c| {
                sqlx::query(
            "INSERT INTO agent_breakers (agent, instance, endpoint, state, consecutive_failures) \
             VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (agent, instance, endpoint) DO UPDATE SET \
               changed_at = CASE WHEN agent_breakers.state IS DISTINCT FROM EXCLUDED.state \
                            THEN now() ELSE agent_breakers.changed_at END, \
               state = EXCLUDED.state, \
               consecutive_failures = EXCLUDED.consecutive_failures, \
               seen_at = now()",
        )
        .bind(r.agent)
        .bind(r.instance)
        .bind(r.endpoint)
        .bind(r.state)
        .bind(i32::try_from(r.consecutive_failures).unwrap_or(i32::MAX))
        .execute(c)
            })
            .await?;
        Ok(())
    }

    /// Deletes the rows of instances that have not reported for
    /// [`BREAKER_FORGET_AFTER`]; how many.
    pub async fn forget_old_breakers(&self) -> Result<u64, StoreError> {
        let done = self
            .conn()
            .await?
            .run(|c| {
                sqlx::query(
            "DELETE FROM agent_breakers WHERE seen_at < now() - $1 * interval '1 millisecond'",
        )
        .bind(millis(BREAKER_FORGET_AFTER))
        .execute(c)
            })
            .await?;
        Ok(done.rows_affected())
    }

    /// Deletes the rows of one instance (it stops cleanly); how many.
    pub async fn forget_breakers_of(&self, instance: &str) -> Result<u64, StoreError> {
        let done = self
            .conn()
            .await?
            .run(|c| {
                sqlx::query("DELETE FROM agent_breakers WHERE instance = $1")
                    .bind(instance)
                    .execute(c)
            })
            .await?;
        Ok(done.rows_affected())
    }

    /// Every reported breaker, by agent, instance and endpoint.
    pub async fn breakers(&self) -> Result<Vec<BreakerRow>, StoreError> {
        self.conn()
            .await?
            .run(|c| {
                sqlx::query_as::<_, BreakerRow>(
            "SELECT agent, instance, endpoint, state, consecutive_failures, changed_at, seen_at, \
               seen_at < now() - $1 * interval '1 millisecond' AS stale \
             FROM agent_breakers ORDER BY agent, instance, endpoint",
        )
        .bind(millis(BREAKER_STALE_AFTER))
        .fetch_all(c)
            })
            .await
    }
}

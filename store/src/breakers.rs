//! The `breakers` table: the breaker each agent's instances share (contract
//! §8), and `breaker_events`, the log of its changes. Each change loads the
//! row, asks the rule ([`sas_core::rules::breaker`]) and writes the new row
//! back guarded by the version it loaded; a write that finds the row
//! changed runs again on what is there now. So two instances that count a
//! failure at once both count, and two that would start a probe at once
//! start one.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;
use uuid::Uuid;

use super::{StateStore, StoreError, WAKE_CHANNEL};
use sas_core::rules::breaker::{Breaker, State};

/// The SQL of the breakers that are not closed, as the rules' gates (JSON):
/// read with every load of orders ([`super::orders`]).
pub(super) const GATES: &str = "SELECT coalesce(json_agg(json_build_object( \
     'agent', agent, 'state', state, 'since', opened_at, 'probe_order', probe_order, \
     'max_hold_ms', max_hold_ms, 'forced', coalesce(forced = 'open', false))), '[]') \
   FROM breakers WHERE state <> 'closed'";

/// How many times a change runs again when another instance changed the
/// breaker between its load and its write.
const RACES: u32 = 5;

/// The columns of a breaker's row the rules read.
const COLUMNS: &str = "agent, state, failures, opened_at, open_until, probe_order, forced, \
     threshold, cooldown_ms, max_hold_ms";

/// A breaker row as loaded.
#[derive(Debug, sqlx::FromRow)]
struct Loaded {
    agent: String,
    state: String,
    failures: i32,
    opened_at: Option<DateTime<Utc>>,
    open_until: Option<DateTime<Utc>>,
    probe_order: Option<Uuid>,
    forced: Option<String>,
    threshold: i32,
    cooldown_ms: i64,
    max_hold_ms: i64,
    version: i64,
    now: DateTime<Utc>,
    /// The order held longest for this agent.
    oldest_held: Option<Uuid>,
}

impl Loaded {
    fn breaker(&self) -> Breaker {
        Breaker {
            agent: self.agent.clone(),
            state: State::parse(&self.state).unwrap_or(State::Closed),
            failures: self.failures,
            opened_at: self.opened_at,
            open_until: self.open_until,
            probe_order: self.probe_order,
            forced: self.forced.as_deref().and_then(State::parse),
            threshold: self.threshold,
            cooldown_ms: self.cooldown_ms,
            max_hold_ms: self.max_hold_ms,
        }
    }
}

/// One agent's breaker as `sasctl agents` and the dashboard show it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct SharedBreaker {
    pub agent: String,
    /// `closed`, `open` or `half_open`.
    pub state: String,
    pub failures: i32,
    pub opened_at: Option<DateTime<Utc>>,
    pub open_until: Option<DateTime<Utc>>,
    pub probe_order: Option<Uuid>,
    /// `open` or `closed` when an operator forced it.
    pub forced: Option<String>,
    pub forced_by: Option<String>,
    pub changed_at: DateTime<Utc>,
    /// Orders held for it now (for its breaker or for room).
    pub held: i64,
    /// When the longest-held of them was held.
    pub oldest_held_since: Option<DateTime<Utc>>,
    /// Its flow control (contract §4b), if any: the bound on steps out
    /// with it, the steps out now, the dispatches per second.
    pub max_in_flight: Option<i32>,
    pub in_flight: Option<i32>,
    pub rate_per_sec: Option<f64>,
}

/// One change of a breaker's state.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct BreakerEvent {
    pub id: i64,
    pub agent: String,
    pub at: DateTime<Utc>,
    pub from_state: String,
    pub to_state: String,
    /// The agent instance, or `operator:<name>`.
    pub actor: String,
    pub reason: String,
}

async fn load(conn: &mut PgConnection, agent: &str) -> Result<Option<Loaded>, sqlx::Error> {
    sqlx::query_as::<_, Loaded>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS}, xmin::text::bigint AS version, now() AS now, \
           (SELECT order_id FROM orders WHERE held_for = b.agent \
            ORDER BY held_since, order_id LIMIT 1) AS oldest_held \
         FROM breakers b WHERE agent = $1"
    )))
    .bind(agent)
    .fetch_optional(conn)
    .await
}

/// Writes `next` over the row loaded as `version`, logging a change of
/// state (or of the override) by `actor` for `reason`, and waking the
/// schedulers when held orders may now be claimed. `false` when the row
/// was no longer that version.
async fn write(
    conn: &mut PgConnection,
    was: &Breaker,
    next: &Breaker,
    version: i64,
    actor: &str,
    reason: &str,
) -> Result<bool, sqlx::Error> {
    let logged = was.state != next.state || was.forced != next.forced;
    // Closing, or a new probe: orders become claimable.
    let wake = next.state == State::Closed && was.state != State::Closed
        || next.probe_order.is_some() && next.probe_order != was.probe_order;
    let written: i64 = sqlx::query_scalar(
        "WITH u AS ( \
           UPDATE breakers SET state = $2, failures = $3, opened_at = $4, open_until = $5, \
             probe_order = $6, forced = $7, \
             forced_by = CASE WHEN $7 IS NULL THEN NULL \
                              WHEN forced IS DISTINCT FROM $7 THEN $10 ELSE forced_by END, \
             changed_at = CASE WHEN state <> $2 THEN now() ELSE changed_at END \
           WHERE agent = $1 AND xmin::text::bigint = $8 RETURNING 1), \
         e AS (INSERT INTO breaker_events (agent, from_state, to_state, actor, reason) \
           SELECT $1, $9, $2, $10, $11 FROM u WHERE $12), \
         w AS (SELECT pg_notify($13, '') FROM u WHERE $14) \
         SELECT (SELECT count(*) FROM u) + 0 * (SELECT count(*) FROM w)",
    )
    .bind(&next.agent)
    .bind(next.state.as_str())
    .bind(next.failures)
    .bind(next.opened_at)
    .bind(next.open_until)
    .bind(next.probe_order)
    .bind(next.forced.map(State::as_str))
    .bind(version)
    .bind(was.state.as_str())
    .bind(actor)
    .bind(reason)
    .bind(logged)
    .bind(WAKE_CHANNEL)
    .bind(wake)
    .fetch_one(conn)
    .await?;
    Ok(written == 1)
}

impl StateStore {
    /// Creates `agent`'s breaker (closed) if it has none, and records its
    /// policy: the instances' configuration, which the rules read from the row.
    pub async fn declare_breaker(
        &self,
        agent: &str,
        threshold: u32,
        cooldown: std::time::Duration,
        max_hold: std::time::Duration,
    ) -> Result<(), StoreError> {
        self.conn()
            .await?
            .run(|c| {
                sqlx::query(
                    "INSERT INTO breakers AS b (agent, threshold, cooldown_ms, max_hold_ms) \
             VALUES ($1, $2, $3, $4) \
             ON CONFLICT (agent) DO UPDATE SET threshold = $2, cooldown_ms = $3, max_hold_ms = $4 \
             WHERE (b.threshold, b.cooldown_ms, b.max_hold_ms) IS DISTINCT FROM ($2, $3, $4)",
                )
                .bind(agent)
                .bind(i32::try_from(threshold).unwrap_or(i32::MAX))
                .bind(millis(cooldown))
                .bind(millis(max_hold))
                .execute(c)
            })
            .await?;
        Ok(())
    }

    /// Changes `agent`'s breaker by `rule` (`None`: no change) as `actor`,
    /// for `reason`; returns the breaker as it is afterwards (`None`: the
    /// agent has no breaker row).
    pub async fn change_breaker(
        &self,
        agent: &str,
        actor: &str,
        reason: &str,
        rule: impl Fn(&Breaker, Option<Uuid>, DateTime<Utc>) -> Option<Breaker>,
    ) -> Result<Option<Breaker>, StoreError> {
        let mut conn = self.conn().await?;
        for _ in 0..RACES {
            let Some(loaded) = conn.run(|c| load(c, agent)).await? else {
                return Ok(None);
            };
            let was = loaded.breaker();
            let Some(next) = rule(&was, loaded.oldest_held, loaded.now) else {
                return Ok(Some(was));
            };
            if next == was
                || conn
                    .run(|c| write(c, &was, &next, loaded.version, actor, reason))
                    .await?
            {
                return Ok(Some(next));
            }
        }
        Err(StoreError::WriteBackRefused(format!(
            "breaker {agent} changed {RACES} times while being written"
        )))
    }

    /// `agent`'s breaker as it is now (`None`: it has none).
    pub async fn breaker(&self, agent: &str) -> Result<Option<Breaker>, StoreError> {
        let mut conn = self.conn().await?;
        Ok(conn.run(|c| load(c, agent)).await?.map(|l| l.breaker()))
    }

    /// Makes `agent`'s breaker row (closed) unless it has one.
    pub async fn ensure_breaker(&self, agent: &str) -> Result<(), StoreError> {
        self.conn()
            .await?
            .run(|c| {
                sqlx::query(
                    "INSERT INTO breakers (agent) VALUES ($1) ON CONFLICT (agent) DO NOTHING",
                )
                .bind(agent)
                .execute(c)
            })
            .await?;
        Ok(())
    }

    /// Every agent's breaker, with the orders held for it and its flow control.
    pub async fn shared_breakers(&self) -> Result<Vec<SharedBreaker>, StoreError> {
        self.conn()
            .await?
            .run(|c| {
                sqlx::query_as::<_, SharedBreaker>(
            "SELECT b.agent, b.state, b.failures, b.opened_at, b.open_until, b.probe_order, \
               b.forced, b.forced_by, b.changed_at, count(o.order_id) AS held, \
               min(o.held_since) AS oldest_held_since, \
               f.max_in_flight, f.in_flight, f.rate_per_sec \
             FROM breakers b LEFT JOIN agent_flow f ON f.agent = b.agent \
               LEFT JOIN orders o ON o.held_for = b.agent \
             GROUP BY b.agent, f.agent ORDER BY b.agent",
        )
        .fetch_all(c)
            })
            .await
    }

    /// The latest `limit` changes of `agent`'s breaker (every agent's when
    /// `None`), newest first.
    pub async fn breaker_events(
        &self,
        agent: Option<&str>,
        limit: i64,
    ) -> Result<Vec<BreakerEvent>, StoreError> {
        self.conn()
            .await?
            .run(|c| {
                sqlx::query_as::<_, BreakerEvent>(
                    "SELECT id, agent, at, from_state, to_state, actor, reason FROM breaker_events \
             WHERE $1::text IS NULL OR agent = $1 ORDER BY id DESC LIMIT $2",
                )
                .bind(agent)
                .bind(limit)
                .fetch_all(c)
            })
            .await
    }
}

fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

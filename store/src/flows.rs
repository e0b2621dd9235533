//! The `agent_flow` table: flow control per agent across the deployment
//! (contract §4b). Each agent with `max_in_flight` or `rate_limit` has a
//! row with its limits, the steps out with it now and its token bucket;
//! every write-back moves the count by the steps it dispatches and ends,
//! takes a token per dispatch ([`super::unit`]) and refuses to pass either
//! limit, in the same statement, so schedulers dispatching at once cannot
//! pass them together.

use std::sync::LazyLock;

use super::{StateStore, StoreError};

/// The SQL of the agents under flow control, as the rules' flows (JSON):
/// read with every load of orders ([`super::orders`]).
pub(super) static FLOWS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT coalesce(json_agg(json_build_object( \
           'agent', agent, 'max_in_flight', max_in_flight, 'in_flight', in_flight, \
           'rate_per_sec', rate_per_sec, \
           'available', CASE WHEN rate_per_sec IS NOT NULL THEN {} END)), '[]') \
         FROM agent_flow",
        bucket("agent_flow")
    )
});

/// The SQL of the tokens in the bucket of `agent_flow` row `row` now: what
/// it held, refilled at its rate since, up to its burst.
pub(super) fn bucket(row: &str) -> String {
    format!(
        "least({row}.burst, {row}.tokens + {row}.rate_per_sec \
           * greatest(0, extract(epoch FROM now() - {row}.refilled_at))::float8)"
    )
}

/// The steps out with an agent now, counted from the steps: where a new
/// row's count starts.
const OUT_WITH: &str = "(SELECT count(*) FROM steps \
     WHERE (state = 'running' AND agent = $1) OR (state = 'compensating' AND compensate = $1))";

impl StateStore {
    /// How many steps are out with `agent` now, as a flow-control row's
    /// count starts ([`sas_core::model::StepRow::out_with`] is its pure twin).
    pub async fn steps_out_with(&self, agent: &str) -> Result<i64, StoreError> {
        static SQL: LazyLock<String> = LazyLock::new(|| format!("SELECT {OUT_WITH}"));
        self.conn()
            .await?
            .run(|c| {
                sqlx::query_scalar(sqlx::AssertSqlSafe(SQL.as_str()))
                    .bind(agent)
                    .fetch_one(c)
            })
            .await
    }

    /// Sets `agent`'s `max_in_flight` and `rate_limit` (dispatches per
    /// second); with neither, the agent has no flow control and its row
    /// goes. A new row starts from the steps out with the agent now and a
    /// full bucket of `burst` tokens (`sas_core::rules::flow::burst`).
    pub async fn declare_flow(
        &self,
        agent: &str,
        max_in_flight: Option<u32>,
        rate_per_sec: Option<f64>,
        burst: f64,
    ) -> Result<(), StoreError> {
        if max_in_flight.is_none() && rate_per_sec.is_none() {
            self.conn()
                .await?
                .run(|c| {
                    sqlx::query("DELETE FROM agent_flow WHERE agent = $1")
                        .bind(agent)
                        .execute(c)
                })
                .await?;
            return Ok(());
        }
        self.conn()
            .await?
            .run(|c| {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO agent_flow AS f (agent, max_in_flight, in_flight, rate_per_sec, \
               burst, tokens) \
             VALUES ($1, $2, {OUT_WITH}, $3, $4, $4) \
             ON CONFLICT (agent) DO UPDATE SET max_in_flight = $2, rate_per_sec = $3, \
               burst = $4, tokens = least(f.tokens, $4) \
             WHERE (f.max_in_flight, f.rate_per_sec, f.burst) IS DISTINCT FROM ($2, $3, $4)"
                )))
                .bind(agent)
                .bind(max_in_flight.map(|m| i32::try_from(m).unwrap_or(i32::MAX)))
                .bind(rate_per_sec)
                .bind(burst)
                .execute(c)
            })
            .await?;
        Ok(())
    }
}

//! The `agent_flow` table: flow control per agent across the deployment
//! (contract §4b). Each agent with `max_in_flight` has a row with its limit
//! and the steps out with it now; every write-back moves the count by the
//! steps it dispatches and ends ([`super::unit`]) and refuses to pass the
//! limit, in the same statement, so schedulers dispatching at once cannot
//! pass it together.

use super::{StateStore, StoreError};

/// The SQL of the agents under flow control, as the rules' flows (JSON):
/// read with every load of orders ([`super::orders`]).
pub(super) const FLOWS: &str = "SELECT coalesce(json_agg(json_build_object( \
     'agent', agent, 'max_in_flight', max_in_flight, 'in_flight', in_flight)), '[]') \
   FROM agent_flow";

/// The steps out with an agent now, counted from the steps: where a new
/// row's count starts.
const OUT_WITH: &str = "(SELECT count(*) FROM steps \
     WHERE (state = 'running' AND agent = $1) OR (state = 'compensating' AND compensate = $1))";

impl StateStore {
    /// Sets `agent`'s `max_in_flight` (`None`: no flow control, the row
    /// goes). A new row starts from the steps out with the agent now.
    pub async fn declare_flow(
        &self,
        agent: &str,
        max_in_flight: Option<u32>,
    ) -> Result<(), StoreError> {
        match max_in_flight {
            Some(max) => {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO agent_flow AS f (agent, max_in_flight, in_flight) \
                     VALUES ($1, $2, {OUT_WITH}) \
                     ON CONFLICT (agent) DO UPDATE SET max_in_flight = $2 \
                     WHERE f.max_in_flight <> $2"
                )))
                .bind(agent)
                .bind(i32::try_from(max).unwrap_or(i32::MAX))
                .execute(self.pool())
                .await?;
            }
            None => {
                sqlx::query("DELETE FROM agent_flow WHERE agent = $1")
                    .bind(agent)
                    .execute(self.pool())
                    .await?;
            }
        }
        Ok(())
    }
}

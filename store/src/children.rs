//! The `children` table (contract §4d): what sas's agent of child
//! workflows remembers of each child order, the newest request of the
//! parent's step for it, so that the child's end answers that request
//! (whatever dispatch of the step is current) and an older request, one a
//! newer dispatch or undo superseded, is refused.

use uuid::Uuid;

use super::{StateStore, StoreError};
use sas_core::messages::{Direction, StepRequest};
use sas_core::state::StepState;

impl StateStore {
    /// Remembers `request` as the newest of child `child_id`'s parent
    /// step, unless a request with a greater fencing token came first:
    /// whether it is the newest (`false`: superseded, to be refused).
    pub async fn remember_child_request(
        &self,
        child_id: Uuid,
        request: &StepRequest,
    ) -> Result<bool, StoreError> {
        let json = serde_json::to_value(request)?;
        let newest: Option<bool> = self
            .conn()
            .await?
            .run(|c| {
                sqlx::query_scalar(
                    "INSERT INTO children (child_id, request, newest_token) VALUES ($1, $2, $3) \
                     ON CONFLICT (child_id) DO UPDATE SET request = EXCLUDED.request, \
                       newest_token = EXCLUDED.newest_token, updated_at = now() \
                     WHERE children.newest_token <= EXCLUDED.newest_token \
                     RETURNING true",
                )
                .bind(child_id)
                .bind(json)
                .bind(request.fencing_token)
                .fetch_optional(c)
            })
            .await?;
        Ok(newest.unwrap_or(false))
    }

    /// The newest request of child `child_id`'s parent step, if any.
    pub async fn child_request(&self, child_id: Uuid) -> Result<Option<StepRequest>, StoreError> {
        let stored: Option<serde_json::Value> = self
            .conn()
            .await?
            .run(|c| {
                sqlx::query_scalar("SELECT request FROM children WHERE child_id = $1")
                    .bind(child_id)
                    .fetch_optional(c)
            })
            .await?;
        Ok(match stored {
            Some(json) => Some(serde_json::from_value(json)?),
            None => None,
        })
    }

    /// What runs the step `request` is for (its `agent` column), if the
    /// request is that step's current dispatch: the step of its order and
    /// index has its name, is running (forward) or compensating (undo)
    /// under its dispatch id, and has been dispatched as many times as its
    /// fencing token says. Anything else is stale or forged.
    pub async fn current_dispatch(
        &self,
        request: &StepRequest,
    ) -> Result<Option<String>, StoreError> {
        let state = match request.direction {
            Direction::Forward => StepState::Running,
            Direction::Compensate => StepState::Compensating,
        };
        self.conn()
            .await?
            .run(|c| {
                sqlx::query_scalar(
                    "SELECT agent FROM steps WHERE order_id = $1 AND idx = $2 AND name = $3 \
                     AND state = $4 AND dispatch_id = $5 AND dispatches::bigint = $6",
                )
                .bind(request.order_id)
                .bind(request.step_index)
                .bind(&request.step)
                .bind(state.as_str())
                .bind(request.dispatch_id)
                .bind(request.fencing_token)
                .fetch_optional(c)
            })
            .await
    }
}

//! Leadership among supervisors: a session-level advisory lock held on a
//! connection of its own. When the leader's process dies its connection
//! closes and Postgres releases the lock at once, so a stand-by takes over at
//! its next tick: the hand-over takes at most one `supervisor.interval`.

use sqlx::{Connection, PgConnection};

use super::bounded::{RELEASE_WITHIN, within};
use super::{StateStore, StoreError};

/// One contender for a named leadership.
pub struct Lease {
    name: &'static str,
    /// The connection that holds the lock, while we lead.
    held: Option<PgConnection>,
}

impl Lease {
    /// A contender for the leadership called `name`.
    pub fn new(name: &'static str) -> Self {
        Self { name, held: None }
    }

    /// Whether this contender leads now: keeps the lock if it holds it and
    /// its connection is alive, else tries to take it.
    pub async fn lead(&mut self, store: &StateStore) -> Result<bool, StoreError> {
        let bound = store.io_timeout();
        if let Some(conn) = self.held.as_mut() {
            let check = sqlx::query("SELECT 1").execute(&mut *conn);
            if within(bound, check).await.is_ok() {
                return Ok(true);
            }
            // The connection is gone, and with it the lock; or it is silent,
            // and dropping it closes its socket (the server lets the lock go
            // once its keepalive finds the session gone).
            self.held = None;
        }
        let mut conn = within(bound, store.pool().acquire()).await?.detach();
        let take = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtextextended($1, 0))")
            .bind(self.name)
            .fetch_one(&mut conn);
        let got: bool = within(bound, take).await?;
        if got {
            self.held = Some(conn);
        } else {
            tokio::time::timeout(RELEASE_WITHIN, conn.close())
                .await
                .ok();
        }
        Ok(got)
    }

    /// Gives the leadership up (on shutdown), so a stand-by takes over at once.
    pub async fn release(&mut self) {
        if let Some(conn) = self.held.take() {
            tokio::time::timeout(RELEASE_WITHIN, conn.close())
                .await
                .ok();
        }
    }
}

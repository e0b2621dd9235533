//! Partitioned supervisors (contract §8): the orders are split into
//! `supervisor.partitions` partitions by id, and each supervisor sweeps the
//! partitions whose lease it holds: a session-level advisory lock per
//! partition on a connection of its own, so that a supervisor that dies
//! lets its partitions go with its connection. Each holds a fair share of
//! the partitions: their count over the supervisors seen lately, rounded
//! up, so that the shares cover every partition once the supervisors agree
//! on who is alive.

use std::collections::BTreeSet;

use sqlx::{Connection, PgConnection};

use super::bounded::{RELEASE_WITHIN, within};
use super::{StateStore, StoreError};

/// The SQL of an order's partition, for the order id in `column`, out of
/// the partition count in `count` (both SQL expressions).
pub(super) fn partition_of(column: &str, count: &str) -> String {
    // Shifted into 0..2^32 first: `abs` of the smallest int overflows.
    format!("mod(hashtext({column}::text)::bigint + 2147483648, {count})")
}

/// The partition leases one supervisor holds.
pub struct Partitions {
    count: u32,
    held: BTreeSet<i32>,
    conn: Option<PgConnection>,
}

impl Partitions {
    /// A supervisor's leases over `count` partitions, none held yet.
    pub fn new(count: u32) -> Self {
        Self {
            count,
            held: BTreeSet::new(),
            conn: None,
        }
    }

    /// The partitions held, ascending.
    pub fn held(&self) -> Vec<i32> {
        self.held.iter().copied().collect()
    }

    /// How many partitions there are.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Holds a fair share of the partitions among `supervisors` (those seen
    /// lately, this one included): lets go of partitions beyond the share,
    /// or takes free ones up to it. Returns the partitions held.
    ///
    /// On an error the connection is closed and every lease with it: a
    /// failed statement may have taken locks this value does not know of.
    pub async fn rebalance(
        &mut self,
        store: &StateStore,
        supervisors: u32,
    ) -> Result<Vec<i32>, StoreError> {
        let held = self.try_rebalance(store, supervisors).await;
        if held.is_err() {
            self.release().await;
        }
        held
    }

    async fn try_rebalance(
        &mut self,
        store: &StateStore,
        supervisors: u32,
    ) -> Result<Vec<i32>, StoreError> {
        let bound = store.io_timeout();
        let alive = match self.conn.as_mut() {
            Some(conn) => within(bound, sqlx::query("SELECT 1").execute(&mut *conn))
                .await
                .is_ok(),
            None => false,
        };
        if !alive {
            // The connection is gone (or silent: dropped here, its socket
            // closes), and with it every lease.
            self.held.clear();
            self.conn = None;
            self.conn = Some(within(bound, store.pool().acquire()).await?.detach());
        }
        let Some(conn) = self.conn.as_mut() else {
            return Ok(Vec::new());
        };
        let count = i32::try_from(self.count).unwrap_or(i32::MAX);
        let share = usize::try_from(self.count.div_ceil(supervisors.max(1))).unwrap_or(usize::MAX);
        while self.held.len() > share {
            let Some(p) = self.held.pop_last() else { break };
            let unlock = sqlx::query(
                "SELECT pg_advisory_unlock(hashtextextended('sas.partition:' || $1, 0))",
            )
            .bind(p.to_string())
            .execute(&mut *conn);
            within(bound, unlock).await?;
        }
        let want = share.saturating_sub(self.held.len());
        if want > 0 {
            let free: Vec<i32> = (0..count).filter(|p| !self.held.contains(p)).collect();
            // The filter runs row by row as the limit pulls: once the share
            // is held, no further lock is tried.
            let take = sqlx::query_scalar(
                "SELECT p FROM unnest($1::int[]) AS f(p) \
                 WHERE pg_try_advisory_lock(hashtextextended('sas.partition:' || p::text, 0)) \
                 LIMIT $2",
            )
            .bind(&free)
            .bind(i64::try_from(want).unwrap_or(i64::MAX))
            .fetch_all(&mut *conn);
            let taken: Vec<i32> = within(bound, take).await?;
            self.held.extend(taken);
        }
        Ok(self.held())
    }

    /// Lets every lease go (on shutdown), so the others take over at once.
    pub async fn release(&mut self) {
        self.held.clear();
        if let Some(conn) = self.conn.take() {
            // Bounded: on a silent socket, dropping it is all there is to do.
            tokio::time::timeout(RELEASE_WITHIN, conn.close())
                .await
                .ok();
        }
    }
}

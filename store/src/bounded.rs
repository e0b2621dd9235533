//! A bound on every round trip to Postgres (contract §6a, `database.io_timeout`).
//!
//! A connection can go silent: the network or the server is gone, but
//! nothing closes or resets the socket, and a read on it waits forever.
//! sqlx has no bound of its own on a round trip, and a pooled connection
//! dropped in the middle of one is pinged when it goes back to the pool,
//! which on a silent socket also waits forever, holding its place in the
//! pool. So every store operation runs through [`Conn::run`]: past the
//! bound, its connection is closed (in the background, within five
//! seconds), never handed to anyone again, and the operation fails with
//! [`StoreError::Silent`], which callers treat as transient.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::PgConnection;
use sqlx::pool::PoolConnection;

use super::StoreError;

/// A pooled connection whose round trips are bounded. Dropped while an
/// operation is under way (its bound passed, or its task was cancelled),
/// it is closed instead of going back to the pool.
#[derive(Debug)]
pub(crate) struct Conn {
    /// Always there until [`into_pooled`](Self::into_pooled) takes it.
    inner: Option<PoolConnection<sqlx::Postgres>>,
    bound: Duration,
    /// Marked when the bound passes: the pool's other connections, opened
    /// before, likely went silent with this one.
    epoch: Epoch,
    /// An operation started and did not finish.
    busy: bool,
}

impl Conn {
    pub(super) fn new(
        inner: PoolConnection<sqlx::Postgres>,
        bound: Duration,
        epoch: Epoch,
    ) -> Self {
        Self {
            inner: Some(inner),
            bound,
            epoch,
            busy: false,
        }
    }

    /// Runs `op` on the connection within the bound. An error `op` returns
    /// leaves the connection usable (sqlx checks it when it goes back);
    /// passing the bound does not.
    pub(crate) async fn run<'c, T, E, F>(
        &'c mut self,
        op: impl FnOnce(&'c mut PgConnection) -> F,
    ) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, E>> + 'c,
        StoreError: From<E>,
    {
        let Self {
            inner,
            bound,
            epoch,
            busy,
        } = self;
        let Some(conn) = inner.as_deref_mut() else {
            return Err(StoreError::Silent(*bound));
        };
        let was = std::mem::replace(busy, true);
        match tokio::time::timeout(*bound, op(conn)).await {
            Ok(done) => {
                *busy = was;
                Ok(done?)
            }
            Err(_) => {
                epoch.mark();
                Err(StoreError::Silent(*bound))
            }
        }
    }

    /// Closes the connection when dropped, instead of handing it back (it
    /// may hold locks, or be in the middle of a transaction), until
    /// [`keep`](Self::keep).
    pub(super) fn discard(&mut self) {
        self.busy = true;
    }

    /// Hands the connection back to the pool when dropped again.
    pub(super) fn keep(&mut self) {
        self.busy = false;
    }

    /// The pooled connection, for a caller that keeps it past this
    /// operation (e.g. holding locks, [`super::Held`]); `None` when an
    /// operation did not finish, and it is closed.
    pub(super) fn into_pooled(mut self) -> Option<PoolConnection<sqlx::Postgres>> {
        if self.busy { None } else { self.inner.take() }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.busy
            && let Some(conn) = self.inner.as_mut()
        {
            conn.close_on_drop();
        }
    }
}

/// The pool's epoch: connections opened before it are retired as they come
/// out of the pool (a pool hook reads it: no round trip). It moves when a
/// round trip passes its bound (the idle connections, opened before, most
/// likely went silent too, and each would cost a bound of its own to find
/// out), and when the pool moves to another host after a failover.
#[derive(Debug, Clone)]
pub(super) struct Epoch {
    base: Instant,
    /// Milliseconds after `base`; 0 while it never moved.
    at_ms: Arc<AtomicU64>,
}

impl Epoch {
    pub(super) fn new() -> Self {
        Self {
            base: Instant::now(),
            at_ms: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Retires every connection open now.
    pub(super) fn mark(&self) {
        let ms = u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.at_ms.store(ms.max(1), Ordering::Relaxed);
    }

    /// Whether a connection `age` old was opened after the last mark.
    pub(super) fn current(&self, age: Duration) -> bool {
        let at = self.at_ms.load(Ordering::Relaxed);
        if at == 0 {
            return true;
        }
        let since = self
            .base
            .elapsed()
            .saturating_sub(Duration::from_millis(at));
        age < since
    }
}

/// How long closing a connection outside the pool may take: on a silent
/// socket, dropping it is all there is to do.
pub(super) const RELEASE_WITHIN: Duration = Duration::from_secs(2);

/// `op` within `bound`: for a connection outside the pool (a leader's, a
/// listener's), which the caller drops when this fails.
pub(super) async fn within<T, E>(
    bound: Duration,
    op: impl Future<Output = Result<T, E>>,
) -> Result<T, StoreError>
where
    StoreError: From<E>,
{
    match tokio::time::timeout(bound, op).await {
        Ok(done) => Ok(done?),
        Err(_) => Err(StoreError::Silent(bound)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_opened_before_the_epoch_are_retired() {
        let epoch = Epoch::new();
        assert!(epoch.current(Duration::from_secs(3600)));
        std::thread::sleep(Duration::from_millis(20));
        epoch.mark();
        assert!(!epoch.current(Duration::from_secs(1)), "opened before");
        std::thread::sleep(Duration::from_millis(20));
        assert!(epoch.current(Duration::from_millis(1)), "opened after");
    }
}

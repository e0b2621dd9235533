//! This instance's side of the breaker its agent's instances share
//! (contract §8; the rules are [`sas::rules::breaker`], the row is in the
//! state store). Each transient failure is counted there, and a success
//! starts the count again when this instance knows of failures. A request
//! goes to the remote only while the breaker is closed, or when its order
//! is the probe; otherwise the agent answers `held` without calling. Every
//! second the instance reads the breaker and, once its cool-down is over,
//! starts the probe (one instance wins; the write is guarded).
//!
//! Without Postgres the shared breaker is unknown: requests go through and
//! only the instance's own breaker ([`crate::breaker`]) guards the remote.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sas::engine::Breakers as _;
use sas::rules::breaker::{Breaker, State};
use sas::state_store::StateStore;

use sas::store_cell::StoreCell;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// How often an instance reads its breakers (and starts a due probe).
pub const SYNC: Duration = Duration::from_secs(1);

/// One agent's shared breaker, as this instance last saw it.
pub struct Shared {
    agent: String,
    instance: String,
    /// Set once Postgres is reached.
    store: Arc<StoreCell>,
    seen: Mutex<Option<Breaker>>,
    /// The agent's threshold, cool-down and max hold, declared on the row.
    policy: (u32, Duration, Duration),
}

impl Shared {
    /// The shared breaker of `agent`, seen by `instance`, with the agent's
    /// policy ([`sas::config::AgentSpec::breaker_policy`]).
    pub fn new(
        agent: &str,
        instance: &str,
        store: Arc<StoreCell>,
        policy: (u32, Duration, Duration),
    ) -> Self {
        Self {
            agent: agent.to_owned(),
            instance: instance.to_owned(),
            store,
            seen: Mutex::new(None),
            policy,
        }
    }

    fn seen(&self) -> Option<Breaker> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn see(&self, found: Option<Breaker>) -> Option<Breaker> {
        if let Some(b) = &found {
            *self.seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(b.clone());
        }
        found
    }

    /// The state last seen (closed when unknown).
    pub fn state(&self) -> State {
        self.seen().map_or(State::Closed, |b| b.state)
    }

    /// Whether a step of `order_id` may call the remote now. A breaker
    /// last seen closed lets it through; otherwise it is read again, as it
    /// may have closed, or this step be its probe.
    pub async fn lets_through(&self, order_id: Uuid) -> bool {
        let Some(seen) = self.seen() else {
            return true;
        };
        if seen.state == State::Closed {
            return true;
        }
        let Some(store) = self.store.get() else {
            return true;
        };
        // Boxed, here and below: a statement's future is tens of KB, which
        // every request's task would otherwise hold for its whole life.
        match Box::pin(store.breaker(&self.agent)).await {
            Ok(found) => self.see(found).is_none_or(|b| b.lets_through(order_id)),
            Err(e) => {
                tracing::warn!(agent = %self.agent, error = %e, "cannot read the shared breaker");
                seen.lets_through(order_id)
            }
        }
    }

    /// Counts a transient failure; whether the breaker is now open (or
    /// half-open with another probe): calls must stop.
    pub async fn failed(&self) -> bool {
        let Some(store) = self.store.get() else {
            return false;
        };
        match Box::pin(store.breaker_failed(&self.agent, &self.instance)).await {
            Ok(found) => {
                let was = self.state();
                let now = self.see(found).map_or(State::Closed, |b| b.state);
                if now != was && now == State::Open {
                    tracing::warn!(agent = %self.agent, "shared breaker opened: holding orders");
                }
                now != State::Closed
            }
            Err(e) => {
                tracing::warn!(agent = %self.agent, error = %e, "cannot count a failure on the shared breaker");
                false
            }
        }
    }

    /// An answer that shows the remote works: starts the count again and
    /// closes the breaker, when this instance knows of failures or an open
    /// breaker (a success is not written otherwise: most calls succeed).
    pub async fn succeeded(&self) {
        let known = self
            .seen()
            .is_some_and(|b| b.failures > 0 || b.state != State::Closed);
        let Some(store) = self.store.get().filter(|_| known) else {
            return;
        };
        match Box::pin(store.breaker_succeeded(&self.agent, &self.instance)).await {
            Ok(found) => {
                let was = self.state();
                if self.see(found).is_some_and(|b| b.state == State::Closed) && was != State::Closed
                {
                    tracing::info!(agent = %self.agent, "shared breaker closed: held orders resume");
                }
            }
            Err(e) => {
                tracing::warn!(agent = %self.agent, error = %e, "cannot reset the shared breaker");
            }
        }
    }

    /// The state store, waiting up to `within` for it to be connected.
    pub async fn wait_for_store(&self, within: Duration) -> Option<StateStore> {
        self.store.wait(within).await
    }

    /// Reads the breaker, starting its probe when one is due.
    async fn sync(&self, store: &StateStore) {
        match store.sync_breaker(&self.agent, &self.instance).await {
            Ok(found) => {
                let was = self.seen().and_then(|b| b.probe_order);
                if let Some(b) = self.see(found)
                    && b.state == State::HalfOpen
                    && b.probe_order != was
                {
                    tracing::info!(agent = %self.agent, probe = ?b.probe_order, "shared breaker half-open: probing");
                }
            }
            Err(e) => {
                tracing::debug!(agent = %self.agent, error = %e, "cannot read the shared breaker")
            }
        }
    }
}

/// Declares each breaker with its agent's policy, then reads them every
/// [`SYNC`] until `shutdown`.
pub async fn run(store: &StateStore, breakers: &[Arc<Shared>], shutdown: &CancellationToken) {
    for shared in breakers {
        let (threshold, cooldown, max_hold) = shared.policy;
        if let Err(e) = store
            .declare_breaker(&shared.agent, threshold, cooldown, max_hold)
            .await
        {
            tracing::warn!(agent = %shared.agent, error = %e, "cannot declare the shared breaker");
        }
    }
    loop {
        for shared in breakers {
            shared.sync(store).await;
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(SYNC) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn its_futures_keep_no_statement_inline() {
        // Every request's task awaits these: with a statement's future
        // inline (about 29 KB each), a request in flight held 65 KB.
        let shared = Shared::new(
            "a",
            "instance",
            Arc::new(StoreCell::default()),
            (5, Duration::from_secs(5), Duration::from_secs(60)),
        );
        let sizes = [
            size_of_val(&shared.lets_through(Uuid::nil())),
            size_of_val(&shared.failed()),
            size_of_val(&shared.succeeded()),
        ];
        assert!(sizes.iter().all(|&s| s < 1024), "{sizes:?}");
    }
}

//! The agent's connection to the state store, made off the requests' path
//! (an agent serves without Postgres, and its breakers and clock come from
//! it once it is reached): set once, read at once, or waited for with a
//! bound, woken when it is set rather than polled.

use std::sync::OnceLock;
use std::time::Duration;

use sas::state_store::StateStore;
use tokio::sync::Notify;

/// The state store (`T`), once connected.
pub struct StoreCell<T = StateStore> {
    store: OnceLock<T>,
    set: Notify,
}

impl<T> Default for StoreCell<T> {
    fn default() -> Self {
        Self {
            store: OnceLock::new(),
            set: Notify::new(),
        }
    }
}

impl<T> StoreCell<T> {
    /// The store, if connected.
    pub fn get(&self) -> Option<&T> {
        self.store.get()
    }

    /// Keeps `store` (the first one set) and wakes whoever waits for it.
    pub fn set(&self, store: T) -> &T {
        let kept = self.store.get_or_init(|| store);
        self.set.notify_waiters();
        kept
    }

    /// The store, waiting up to `within` for it to be connected.
    pub async fn wait(&self, within: Duration) -> Option<&T> {
        let notified = self.set.notified();
        tokio::pin!(notified);
        // Registered before looking, so that a set in between wakes it.
        notified.as_mut().enable();
        if let Some(store) = self.get() {
            return Some(store);
        }
        let _ = tokio::time::timeout(within, notified).await;
        self.get()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Instant;

    use super::*;

    #[tokio::test]
    async fn a_waiter_wakes_when_the_store_is_set_and_gives_up_at_its_bound() {
        let cell = Arc::new(StoreCell::<u32>::default());
        let started = Instant::now();
        assert_eq!(cell.wait(Duration::from_millis(50)).await, None);
        assert!(started.elapsed() >= Duration::from_millis(50));

        let setter = cell.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            setter.set(7);
        });
        // Woken by the set, long before the bound.
        let started = Instant::now();
        assert_eq!(cell.wait(Duration::from_secs(30)).await, Some(&7));
        assert!(started.elapsed() < Duration::from_secs(10));
        // Set: at once, and the first value stays.
        assert_eq!(cell.set(8), &7);
        assert_eq!(cell.wait(Duration::ZERO).await, Some(&7));
    }
}

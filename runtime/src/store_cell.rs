//! A service's state store connected off its start path (the agent's,
//! which serves without Postgres): empty until connected, then the store;
//! read at once, or waited for with a bound, woken when it is set rather
//! than polled.

use std::time::Duration;

use tokio::sync::watch;

use crate::state_store::StateStore;

/// The state store (`T`), once connected.
#[derive(Debug)]
pub struct StoreCell<T = StateStore> {
    store: watch::Sender<Option<T>>,
}

impl<T> Default for StoreCell<T> {
    fn default() -> Self {
        Self {
            store: watch::Sender::new(None),
        }
    }
}

impl<T: Clone> StoreCell<T> {
    /// The store, if connected.
    pub fn get(&self) -> Option<T> {
        self.store.borrow().clone()
    }

    /// Keeps `store` unless one was set before, and wakes whoever waits.
    pub fn set(&self, store: T) {
        let mut offered = Some(store);
        self.store.send_if_modified(|slot| {
            if slot.is_some() {
                return false;
            }
            *slot = offered.take();
            true
        });
    }

    /// The store, waiting up to `within` for it to be connected.
    pub async fn wait(&self, within: Duration) -> Option<T> {
        let mut set = self.store.subscribe();
        // Looks at the value first: one set before the call is had at once.
        let _ = tokio::time::timeout(within, set.wait_for(Option::is_some)).await;
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
        assert_eq!(cell.wait(Duration::from_secs(30)).await, Some(7));
        assert!(started.elapsed() < Duration::from_secs(10));
        // Set: at once, and the first value stays.
        cell.set(8);
        assert_eq!(cell.wait(Duration::ZERO).await, Some(7));
    }
}

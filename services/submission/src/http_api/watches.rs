//! One listener per submission instance for all its open event streams
//! (contract §9a): a stream stores a watch of its order
//! ([`StateStore::watch_events`]), the write-back that gives a watched
//! order events notifies `sas_order_events` with its id, and this instance's
//! one listener wakes the streams of that order, which then read the log.
//! A stream that waits costs the database nothing, however many are open.
//!
//! A notification lost while the listener was away (its connection lost,
//! the database restarted or failed over, which loses the unlogged
//! watches too) is made up for when it listens again: it stores every
//! watch anew and wakes every stream to read once. The listener asks the
//! database a question now and then, so that a connection gone silent is
//! noticed and replaced too.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sas::state_store::{Heard, StateStore, StoreError};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// How often the listener checks that its connection answers: one
/// statement per interval, whatever the number of streams.
const PING_EVERY: Duration = Duration::from_secs(30);

/// How long the check may take before the connection counts as lost.
const PING_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the listener waits before connecting again after a failure.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The open streams' watches of one instance.
pub struct Watches {
    store: StateStore,
    /// This instance's name in `event_watches`.
    watcher: String,
    /// A stored watch lasts this long past its stream's start: a stream
    /// ends sooner (its lifetime), and an instance that died leaves none
    /// for longer.
    lasts: Duration,
    orders: Mutex<HashMap<Uuid, Watched>>,
}

/// The streams of one order.
struct Watched {
    streams: usize,
    /// The `until` of the watch stored last: its deletion spares a later one.
    until: chrono::DateTime<chrono::Utc>,
    /// Counts the order's notifications; its streams wait for a change.
    news: watch::Sender<u64>,
}

/// A stream's watch of its order: it wakes when the order may have new
/// events; dropped with the stream, the last one of an order deletes the
/// stored watch.
pub struct Watch {
    watches: Arc<Watches>,
    order: Uuid,
    news: watch::Receiver<u64>,
}

impl Watch {
    /// Resolves when the order may have new events (at once when it may
    /// have had some since the last call); never when the listener is gone.
    pub async fn changed(&mut self) {
        if self.news.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.watches.release(self.order);
    }
}

impl Watches {
    /// The watches of this instance, with its listener running until
    /// `shutdown`; a stored watch lasts `lasts` (a stream's lifetime and
    /// a margin).
    pub fn start(store: StateStore, lasts: Duration, shutdown: CancellationToken) -> Arc<Self> {
        let watches = Arc::new(Self {
            store,
            watcher: format!("submission-{}", Uuid::new_v4()),
            lasts,
            orders: Mutex::new(HashMap::new()),
        });
        tokio::spawn(watches.clone().listen(shutdown));
        watches
    }

    /// Watches `order` for a new stream: stored before the stream first
    /// reads the log, so that no event written after that read goes
    /// unnoticed.
    pub async fn watch(self: &Arc<Self>, order: Uuid) -> Result<Watch, StoreError> {
        let until = self.until();
        let news = {
            let mut orders = self.lock();
            let watched = orders.entry(order).or_insert_with(|| Watched {
                streams: 0,
                until,
                news: watch::channel(0).0,
            });
            watched.streams += 1;
            watched.until = watched.until.max(until);
            watched.news.subscribe()
        };
        let watch = Watch {
            watches: self.clone(),
            order,
            news,
        };
        // Stored for every stream, not only the order's first: it moves
        // `until` on for the newest.
        self.store
            .watch_events(&self.watcher, &[order], until)
            .await?;
        Ok(watch)
    }

    fn until(&self) -> chrono::DateTime<chrono::Utc> {
        chrono::Utc::now() + chrono::Duration::from_std(self.lasts).unwrap_or(chrono::Duration::MAX)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Watched>> {
        self.orders.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A stream of `order` ended; the last one deletes the stored watch.
    fn release(self: &Arc<Self>, order: Uuid) {
        let last = {
            let mut orders = self.lock();
            match orders.get_mut(&order) {
                Some(watched) if watched.streams > 1 => {
                    watched.streams -= 1;
                    None
                }
                Some(_) => orders.remove(&order).map(|watched| watched.until),
                None => None,
            }
        };
        if let Some(stored) = last {
            // Best effort: a watch left behind only costs a notification
            // no one hears, until its `until`.
            let watches = self.clone();
            tokio::spawn(async move {
                let unwatched = watches
                    .store
                    .unwatch_events(&watches.watcher, order, stored)
                    .await;
                if let Err(e) = unwatched {
                    tracing::debug!(error = %e, %order, "event stream: could not delete a watch");
                }
            });
        }
    }

    /// Wakes the streams of `order`.
    fn wake(&self, order: Uuid) {
        if let Some(watched) = self.lock().get(&order) {
            watched.news.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Stores every watch again and wakes every stream: what the listener
    /// may have missed while it was away.
    async fn make_up(&self) {
        let until = self.until();
        let ids: Vec<Uuid> = {
            let mut orders = self.lock();
            for watched in orders.values_mut() {
                watched.until = watched.until.max(until);
            }
            orders.keys().copied().collect()
        };
        if ids.is_empty() {
            return;
        }
        if let Err(e) = self.store.watch_events(&self.watcher, &ids, until).await {
            tracing::warn!(error = %e, streams = ids.len(), "event streams: could not store their watches again");
        }
        for watched in self.lock().values() {
            watched.news.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// The listener: connects, makes up for what it missed, then wakes
    /// the streams of each order notified, until `shutdown`.
    async fn listen(self: Arc<Self>, shutdown: CancellationToken) {
        while !shutdown.is_cancelled() {
            let mut listener = match self.store.listen_for_events().await {
                Ok(listener) => listener,
                Err(e) => {
                    tracing::warn!(error = %e, "event streams: cannot listen for new events; trying again");
                    tokio::select! {
                        () = tokio::time::sleep(RETRY_AFTER) => continue,
                        () = shutdown.cancelled() => return,
                    }
                }
            };
            self.make_up().await;
            loop {
                let heard = tokio::select! {
                    heard = listener.next() => Some(heard),
                    () = tokio::time::sleep(PING_EVERY) => None,
                    () = shutdown.cancelled() => return,
                };
                match heard {
                    Some(Heard::Order(order)) => self.wake(order),
                    Some(Heard::Noise) => {}
                    Some(Heard::Lost) => break,
                    None if listener.answers(PING_TIMEOUT).await => {}
                    None => break,
                }
            }
            tracing::info!("event streams: the listener's connection was lost; listening again");
        }
    }
}

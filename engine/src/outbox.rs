//! The outbox relay: publishes the messages that transitions committed
//! (status events, step requests, alerts) with publisher confirms, then deletes
//! them. A process that dies between commit and publish loses nothing: its
//! rows stay, and any relay's sweep publishes them.
//!
//! Per order, messages go out in the order they were written: one relay at a
//! time takes an order (an advisory lock for its transaction) and publishes
//! all its rows in sequence; a relay that finds an order taken leaves it and
//! tries again a moment later, so relays never queue behind each other.
//!
//! While the relay is not busy, transitions skip its transaction: a
//! transition hands its committed messages over ([`Relay::hand_over`]) together with
//! the connection that still holds its orders' outbox locks, and they are
//! published at once, then deleted. Step requests alone need no lock: a
//! service's relay ([`Relay::publishing_as`]) leaves them in the outbox,
//! handed to its instance, and the reply's write-back deletes them; while
//! the instance beats, no other relay sends them again. Under load (a few hand-overs under way)
//! the relay's passes take everything, many orders at a time; they are also
//! the way back for what a hand-over could not do: messages of orders with
//! older ones still waiting, messages whose publish failed, and rows that a
//! dead process left behind. `outbox_published{kind, path}` counts both.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::broker::{BrokerError, Outgoing, PublishError, Publisher};
use crate::config::{Durability, OutboxSettings};
use crate::metrics::{Metrics, labels};
use crate::state_store::{Committed, DeletedBy, Held, OutboxRow, StateStore};

/// The relay of one process; transitions tell it which orders have new rows.
pub struct Relay {
    store: StateStore,
    settings: OutboxSettings,
    /// How step requests are sent (`broker.step_messages`).
    requests: Durability,
    metrics: Arc<Metrics>,
    /// Orders with rows this process committed and has not yet relayed.
    pending: Mutex<Pending>,
    wake: Notify,
    /// The confirm channel of the broker session, for handed-over messages.
    publisher: Mutex<Option<Publisher>>,
    /// Handed-over messages being published.
    handoffs: tokio_util::task::TaskTracker,
    /// Whether its passes also sweep for rows other processes left
    /// behind (a service's relay), or only publish what this process
    /// handed over (a tool's, [`Relay::for_handovers`]).
    sweeps: bool,
    /// The instance whose heartbeat covers the step requests it sent
    /// ([`Relay::publishing_as`]).
    instance: std::sync::OnceLock<String>,
    /// Status events and alerts handed over and confirmed, to delete: by
    /// the process's next write-back ([`Relay::take_published`]), or in a
    /// batch of their own ([`Relay::delete_published`]).
    published: Mutex<Vec<i64>>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("handoffs", &self.handoffs.len())
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// Takes what a transition committed: publishes its handed-over
    /// messages at once over the connection that holds their outbox locks,
    /// follows the orders whose locks another publisher held, and leaves the
    /// rest to the next pass.
    pub fn hand_over(self: &Arc<Self>, committed: Committed) {
        if !committed.later.is_empty() {
            self.push(committed.later);
        }
        if !committed.follow.is_empty() {
            self.clone().follow(committed.follow);
        }
        if !committed.publish.is_empty() || committed.held.is_some() {
            self.clone().publish(committed.held, committed.publish);
        }
    }

    /// Makes this relay a service's, whose instance beats as `instance`:
    /// the step requests it hands over stay in the outbox, handed to it,
    /// until their replies delete them (no delete, no lock for them).
    pub fn publishing_as(&self, instance: &str) {
        // Set once, as the service starts: a second name is ignored.
        let _ = self.instance.set(instance.to_owned());
    }

    /// The instance named by [`Relay::publishing_as`], if any.
    pub fn instance(&self) -> Option<&str> {
        self.instance.get().map(String::as_str)
    }

    /// The status events and alerts handed over and confirmed since the
    /// last call, for a write-back to delete. Give them back
    /// ([`Relay::keep_published`]) if it did not.
    pub fn take_published(&self) -> Vec<i64> {
        std::mem::take(&mut *self.published.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Keeps `ids` to delete later ([`Relay::take_published`]).
    pub fn keep_published(&self, ids: Vec<i64>) {
        if !ids.is_empty() {
            let mut published = self.published.lock().unwrap_or_else(|p| p.into_inner());
            published.extend(ids);
        }
    }

    /// Deletes the status events and alerts handed over and confirmed that
    /// no write-back took, in one statement; kept for the next try if it
    /// fails (until then, a relay takes none of their orders' later
    /// messages, which wait behind them).
    async fn delete_published(&self) {
        let ids = self.take_published();
        if ids.is_empty() {
            return;
        }
        if let Err(e) = self.store.delete_published(&ids).await {
            tracing::warn!(error = %e, "could not delete published messages; will retry");
            self.keep_published(ids);
        }
    }

    fn publish(self: Arc<Self>, held: Option<Held>, rows: Vec<OutboxRow>) {
        let publisher = self.publisher();
        let relay = self.clone();
        self.handoffs.spawn(async move {
            let orders: Vec<(i64, Uuid, bool)> =
                rows.iter().map(|r| (r.id, r.order_id, r.handed)).collect();
            let (done, outcome) = match publisher {
                Some(publisher) => relay.send(&publisher, "handoff", held, rows).await,
                // Between broker sessions: the relay's next pass sends them.
                None => (Vec::new(), Err(BrokerError::NoSession)),
            };
            if outcome.is_err() {
                // Unsent (a message the broker refused as unroutable stays
                // for the sweep, as in the relay's own pass). Requests
                // handed to this instance go back to the relays first:
                // while it beats, no relay takes them otherwise.
                let unsent = |&&(id, _, _): &&(i64, Uuid, bool)| !done.contains(&id);
                let handed: Vec<i64> = orders
                    .iter()
                    .filter(unsent)
                    .filter(|(_, _, handed)| *handed)
                    .map(|&(id, _, _)| id)
                    .collect();
                if !handed.is_empty()
                    && let Err(e) = relay.store.unhand_outbox(&handed).await
                {
                    tracing::warn!(error = %e, "could not hand unsent requests back to the relays");
                }
                let mut left: Vec<Uuid> = orders
                    .iter()
                    .filter(unsent)
                    .map(|&(_, order, _)| order)
                    .collect();
                left.dedup();
                relay.push(left);
            }
        });
    }

    fn follow(self: Arc<Self>, mut orders: Vec<Uuid>) {
        let Some(publisher) = self.publisher() else {
            return self.push(orders);
        };
        orders.sort_unstable();
        let relay = self.clone();
        // A take of its own, waiting for the locks: the relay's passes
        // never wait, so that one busy order cannot hold up the rest.
        self.handoffs.spawn(async move {
            let sent = match relay.store.take_outbox(&orders, true).await {
                Ok(taken) => {
                    // Behind messages handed over and not yet deleted:
                    // the relay's passes try them again.
                    relay.push(taken.busy);
                    relay
                        .send(&publisher, "follow", Some(taken.held), taken.rows)
                        .await
                        .1
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not take messages to follow");
                    Err(BrokerError::NoSession)
                }
            };
            if sent.is_err() {
                relay.push(orders);
            }
        });
    }

    /// The confirm channel of the current broker session, if any.
    fn publisher(&self) -> Option<Publisher> {
        self.publisher
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Publishes messages taken with their orders' outbox locks
    /// ([`publish_rows`]), then deletes the ones published, but for the
    /// handed requests (their replies do), and lets the locks go. Returns
    /// the ids published (or dropped as unpublishable) and whether the
    /// broker is still usable.
    async fn send(
        &self,
        publisher: &Publisher,
        path: &str,
        held: Option<Held>,
        rows: Vec<OutboxRow>,
    ) -> (Vec<i64>, Result<(), BrokerError>) {
        let deleted_by: std::collections::HashMap<i64, DeletedBy> =
            rows.iter().map(|r| (r.id, r.deleted_by())).collect();
        let (done, outcome) = if rows.is_empty() {
            (Vec::new(), Ok(()))
        } else {
            publish_rows(publisher, &self.metrics, self.requests, path, rows).await
        };
        crate::crash::point("outbox.after_publish");
        // Published (or dropped as unpublishable): each deleted by whoever
        // its row says.
        let by = |whom: DeletedBy| -> Vec<i64> {
            done.iter()
                .copied()
                .filter(|id| deleted_by.get(id).copied().unwrap_or(DeletedBy::Release) == whom)
                .collect()
        };
        self.keep_published(by(DeletedBy::WriteBack));
        if let Some(held) = held {
            let delete = by(DeletedBy::Release);
            if let Err(e) = held.release(&delete).await {
                // Published all the same: the sweep sends them again, later.
                tracing::warn!(error = %e, "could not delete published messages");
            }
        }
        (done, outcome)
    }

    /// Whether a hand-over now would go out at once: a broker session is
    /// up and few hand-overs are under way. Under load, when it says no,
    /// transitions take no outbox locks and leave their messages to the
    /// relay, whose passes publish many orders' messages together (and a
    /// transition never waits on a lock a busy publisher holds, nor holds a
    /// connection while its messages wait for their confirms).
    pub fn ready(&self) -> bool {
        self.handoffs.len() < MAX_HANDOFFS
            && self
                .publisher
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_some()
    }
}

/// Orders waiting for the relay, first pushed first taken, each once. Under
/// a backlog the relay takes them in the order they came: taking them in
/// any other order (by id, say) starves some orders' messages until their
/// complete-by passes.
#[derive(Debug, Default)]
struct Pending {
    queue: VecDeque<Uuid>,
    queued: HashSet<Uuid>,
}

impl Pending {
    /// Queues `order` unless it is queued already.
    fn push(&mut self, order: Uuid) {
        if self.queued.insert(order) {
            self.queue.push_back(order);
        }
    }

    /// The first `max` orders queued, taken off the queue.
    fn take(&mut self, max: usize) -> Vec<Uuid> {
        let n = max.min(self.queue.len());
        let taken: Vec<Uuid> = self.queue.drain(..n).collect();
        for order in &taken {
            self.queued.remove(order);
        }
        taken
    }
}

/// How often a relay deletes the status events handed over and confirmed
/// that no write-back of its process took ([`Relay::take_published`]):
/// until then they cost nothing, but a relay takes none of their orders'
/// later messages (an operator's retry of an order just ended waits as
/// long, at most).
const DELETE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(200);

/// Hand-overs under way beyond which transitions leave their messages to
/// the relay's passes: each holds a connection until its confirms arrive,
/// and under load one pass for many orders costs less than a hand-over each.
const MAX_HANDOFFS: usize = 4;

impl Relay {
    /// A relay over `store`, sending step requests as `requests` says.
    pub fn new(
        store: StateStore,
        settings: OutboxSettings,
        requests: Durability,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        Self::with_sweeps(store, settings, requests, metrics, true)
    }

    fn with_sweeps(
        store: StateStore,
        settings: OutboxSettings,
        requests: Durability,
        metrics: Arc<Metrics>,
        sweeps: bool,
    ) -> Arc<Self> {
        Arc::new(Self {
            store,
            settings,
            requests,
            metrics,
            pending: Mutex::new(Pending::default()),
            wake: Notify::new(),
            publisher: Mutex::new(None),
            handoffs: tokio_util::task::TaskTracker::new(),
            sweeps,
            instance: std::sync::OnceLock::new(),
            published: Mutex::new(Vec::new()),
        })
    }

    /// A relay for what one tool's transitions hand over (an operator's
    /// action): it never sweeps, since the services' relays publish what
    /// others left behind, and a tool's short session should not count the
    /// outbox nor take other orders' rows.
    pub fn for_handovers(
        store: StateStore,
        settings: OutboxSettings,
        requests: Durability,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        Self::with_sweeps(store, settings, requests, metrics, false)
    }

    /// Asks the relay to publish what these orders have queued.
    pub fn push(&self, orders: impl IntoIterator<Item = Uuid>) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        for order in orders {
            pending.push(order);
        }
        drop(pending);
        self.wake.notify_one();
    }

    fn take(&self, max: usize) -> Vec<Uuid> {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take(max)
    }

    /// Relays until `shutdown`, then flushes what this process queued and
    /// returns. Returns an error when the broker connection is lost.
    pub async fn run(
        &self,
        publisher: Publisher,
        shutdown: CancellationToken,
    ) -> Result<(), BrokerError> {
        let mut sweep = tokio::time::interval(self.settings.sweep_interval);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut deletes = tokio::time::interval(DELETE_INTERVAL);
        deletes.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let stop = tokio::select! {
                () = self.wake.notified() => false,
                _ = sweep.tick(), if self.sweeps => {
                    self.sweep(&publisher).await?;
                    false
                }
                _ = deletes.tick() => {
                    self.delete_published().await;
                    false
                }
                () = shutdown.cancelled() => true,
            };
            self.drain(&publisher).await?;
            if stop {
                return Ok(());
            }
        }
    }

    /// Relays every order pushed so far; orders another relay held are
    /// pushed again after a short pause.
    async fn drain(&self, publisher: &Publisher) -> Result<(), BrokerError> {
        let mut held = Vec::new();
        loop {
            let batch = self.take(self.settings.batch);
            if batch.is_empty() {
                break;
            }
            match self.relay(publisher, &batch).await {
                Ok(h) => held.extend(h),
                Err(e) => {
                    self.push(batch);
                    return Err(e);
                }
            }
        }
        if !held.is_empty() {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            self.push(held);
        }
        Ok(())
    }

    /// Relays rows that other (dead) processes left behind, and counts the backlog.
    async fn sweep(&self, publisher: &Publisher) -> Result<(), BrokerError> {
        if let Ok(n) = self.store.outbox_backlog().await {
            self.metrics.outbox_backlog.set(n);
        }
        let age = i64::try_from(self.settings.sweep_age.as_millis()).unwrap_or(i64::MAX);
        let limit = i64::try_from(self.settings.batch).unwrap_or(i64::MAX);
        // Requests answered or dispatched again elsewhere: nobody sends them.
        if let Err(e) = self.store.outbox_drop_superseded(age).await {
            tracing::warn!(error = %e, "could not drop superseded requests");
        }
        match self.store.outbox_stale_orders(age, limit).await {
            Ok(ids) if !ids.is_empty() => {
                tracing::info!(orders = ids.len(), "relaying messages left behind");
                // Orders another relay holds are being published already.
                self.relay(publisher, &ids).await.map(drop)
            }
            Ok(_) => Ok(()),
            Err(e) => {
                tracing::warn!(error = %e, "outbox sweep failed");
                Ok(())
            }
        }
    }

    /// Publishes and deletes the messages of these orders; returns the
    /// orders another relay held. A database error keeps the rows for
    /// later; a broker error ends the session.
    async fn relay(
        &self,
        publisher: &Publisher,
        orders: &[Uuid],
    ) -> Result<Vec<Uuid>, BrokerError> {
        let started = std::time::Instant::now();
        let taken = match self.store.take_outbox(orders, false).await {
            Ok(taken) => taken,
            Err(e) => {
                tracing::warn!(error = %e, "outbox relay failed; will retry");
                self.push(orders.iter().copied());
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                return Ok(Vec::new());
            }
        };
        let (done, outcome) = self
            .send(publisher, "relay", Some(taken.held), taken.rows)
            .await;
        outcome?;
        tracing::debug!(
            orders = orders.len(),
            held = taken.busy.len(),
            messages = done.len(),
            took_ms = started.elapsed().as_millis() as u64,
            "relayed"
        );
        Ok(taken.busy)
    }
}

/// Publishes rows pipelined: every message first, then every confirmation.
/// Returns the ids that may be deleted, and whether the broker is still usable.
/// `path` labels the count: `handoff` or `relay`; step requests go as
/// `requests` says, every other message persistent.
async fn publish_rows(
    publisher: &Publisher,
    metrics: &Metrics,
    requests: Durability,
    path: &str,
    rows: Vec<OutboxRow>,
) -> (Vec<i64>, Result<(), BrokerError>) {
    let mut sent = Vec::with_capacity(rows.len());
    let mut unpublishable = Vec::new();
    let mut failure = None;
    for row in &rows {
        let trace = row
            .traceparent
            .as_deref()
            .map(|t| [(crate::trace::HEADER, t)]);
        let msg = Outgoing {
            routing_key: &row.routing_key,
            body: &row.body,
            correlation_id: row.correlation_id.as_deref(),
            reply_to: row.reply_to.as_deref(),
            headers: trace.as_ref().map_or(&[], |h| h.as_slice()),
            mandatory: true,
            transient: row.kind == "request" && requests.transient(),
            ..Outgoing::default()
        };
        match publisher.send(&msg).await {
            Ok(pending) => sent.push((row, pending)),
            // No broker can take it (a name longer than AMQP allows): holding
            // it would block the relay for good.
            Err(e @ PublishError::Invalid(_)) => {
                tracing::error!(order_id = %row.order_id, kind = %row.kind, error = %e, "message can never be published; dropped");
                metrics.outbox_unroutable.inc();
                unpublishable.push(row.id);
            }
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    let mut done = unpublishable;
    for (row, pending) in sent {
        match pending.wait().await {
            Ok(()) => {
                metrics
                    .outbox_published
                    .get_or_create(&labels(&[("kind", &row.kind), ("path", path)]))
                    .inc();
                done.push(row.id);
            }
            // The application's status queue does not exist: nobody can ever
            // read the event, and holding it would block the order's later ones.
            Err(PublishError::Unroutable(queue)) if row.kind == "status" => {
                tracing::warn!(order_id = %row.order_id, %queue, "status queue does not exist; event dropped");
                metrics.outbox_unroutable.inc();
                done.push(row.id);
            }
            Err(PublishError::Unroutable(queue)) => {
                tracing::error!(order_id = %row.order_id, %queue, kind = %row.kind, "no such queue; will retry");
            }
            Err(e) => {
                failure.get_or_insert(e);
            }
        }
    }
    (done, failure.map_or(Ok(()), |e| Err(e.into())))
}

/// A relay running for one broker session.
pub struct RelayTask {
    relay: Arc<Relay>,
    stop: CancellationToken,
    /// Cancelled when the relay fails on the broker: the session must end.
    lost: CancellationToken,
    handle: tokio::task::JoinHandle<Result<(), BrokerError>>,
}

impl Relay {
    /// Starts relaying on its own confirm channel of `broker`.
    pub async fn start(
        self: &Arc<Self>,
        broker: &crate::broker::Broker,
    ) -> Result<RelayTask, BrokerError> {
        let publisher = broker.publisher().await?;
        *self.publisher.lock().unwrap_or_else(|p| p.into_inner()) = Some(publisher.clone());
        let stop = CancellationToken::new();
        let lost = CancellationToken::new();
        let relay = self.clone();
        let (token, lost_token) = (stop.clone(), lost.clone());
        let handle = tokio::spawn(async move {
            let outcome = relay.run(publisher, token).await;
            if outcome.is_err() {
                lost_token.cancel();
            }
            outcome
        });
        Ok(RelayTask {
            relay: self.clone(),
            stop,
            lost,
            handle,
        })
    }
}

impl RelayTask {
    /// Cancelled when the relay has failed on the broker.
    pub fn lost(&self) -> &CancellationToken {
        &self.lost
    }

    /// Flushes what this process queued and stops; combines with the session's
    /// own outcome so that the first error wins.
    pub async fn stop<T>(self, session: Result<T, BrokerError>) -> Result<T, BrokerError> {
        // Hand-overs from now on wait for the next session's relay; those
        // under way finish first (what they cannot send, the relay's pass
        // below sends).
        *self
            .relay
            .publisher
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
        self.relay.handoffs.close();
        self.relay.handoffs.wait().await;
        self.relay.handoffs.reopen();
        // Every message handed to this instance is sent now (an unsent one
        // was handed back): the confirmed status events are deleted, and
        // no relay must send its requests again once it stops beating.
        self.relay.delete_published().await;
        if let Some(instance) = self.relay.instance()
            && let Err(e) = self.relay.store.forget_handed(instance).await
        {
            tracing::warn!(error = %e, "could not forget the requests sent");
        }
        self.stop.cancel();
        let relayed = self
            .handle
            .await
            .unwrap_or_else(|e| Err(BrokerError::RelayTask(e)));
        let value = session?;
        relayed?;
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_relay_takes_orders_in_the_order_they_came_each_once() {
        let ids: Vec<Uuid> = (0..5u128).rev().map(Uuid::from_u128).collect();
        let mut pending = Pending::default();
        for &id in &ids {
            pending.push(id);
        }
        // Pushed again while queued: keeps its place.
        pending.push(ids[0]);
        assert_eq!(pending.take(2), ids[..2]);
        // Taken, then pushed again (another relay held it): goes to the back.
        pending.push(ids[0]);
        assert_eq!(pending.take(10), [ids[2], ids[3], ids[4], ids[0]]);
        assert!(pending.take(10).is_empty());
    }
}

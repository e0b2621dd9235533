//! # sas-client: a Rust application's side of sas
//!
//! An application talks to sas through RabbitMQ (contract §1, §2, §9). This
//! crate does it the way the contract asks, so that an application does not
//! write AMQP messages by hand:
//!
//! - [`Client::submit`]: publishes an [`Order`] through the submission
//!   exchange `<prefix>.submit` with publisher confirms, `mandatory` (no
//!   submission service means an error, not a silent loss) and a UUIDv7
//!   order id unless the order has one; the id is also the `message_id`, so
//!   resubmitting after an unclear failure is the same order. The body is
//!   checked first with the submission's own validation.
//! - [`Client::status`]: the status events of a queue as a [`Stream`] of
//!   typed [`StatusEvent`]s, deduplicated on (`order_id`, `seq`), each
//!   acknowledged once the application asks for the next.
//! - [`Client::wait`]: the terminal event of one order, read from the
//!   client's status queue ([`Client::with_status_queue`]).
//! - [`Client::replay`]: asks sas to publish an order's or a queue's stored
//!   status events again (contract §9), e.g. after losing a status queue.
//!
//! The wire types are sas's own ([`sas::messages`]): [`Order`] is the
//! submission's [`sas::messages::Submission`], so the client and the
//! service share one definition of the format.
//!
//! ```no_run
//! use std::time::Duration;
//! use sas_client::{Client, Order};
//!
//! # async fn run() -> Result<(), sas_client::Error> {
//! let client = Client::connect("amqp://guest:guest@127.0.0.1:5672/%2f", "sas")
//!     .await?
//!     .with_status_queue("shop.status")
//!     .await?;
//! let id = client.submit(Order::new("order", Default::default())).await?;
//! let terminal = client.wait(id, Duration::from_secs(60)).await?;
//! println!("{id} ended {}", terminal.state().as_str());
//! client.close().await;
//! # Ok(())
//! # }
//! ```
//!
//! Errors are typed ([`Error`]); nothing here panics on I/O or input.
//!
//! [`Stream`]: futures_util::Stream

mod dedupe;
mod status;

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use futures_util::StreamExt as _;
use sas::broker::{Broker, BrokerError, Outgoing, PendingConfirm, PublishError, Publisher};
use sas::config::BrokerSettings;
use sas::messages::{EventKind, RejectReason, is_queue_name};
use sas::topology::QueueNames;
use tokio::sync::Notify;
use tracing::Instrument as _;
use uuid::Uuid;

pub use sas::messages::{Events, Order, Priority, ReplayRequest, State, StatusEvent};
pub use status::StatusStream;

/// An order's identity (contract §1): a UUID, v7 when the client makes it.
pub type OrderId = Uuid;

/// Terminal events kept for [`Client::wait`] calls that have not come yet.
const TERMINALS_KEPT: usize = 10_000;

/// Unacknowledged status events a [`StatusStream`] holds at once.
const STATUS_PREFETCH: u16 = 256;

/// What went wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// RabbitMQ: unreachable, a bad URL, a lost connection.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// The broker did not take a message: nacked, or returned because no
    /// queue took it ([`PublishError::Unroutable`]: for an order, no
    /// submission service ever declared `<prefix>.orders`).
    #[error(transparent)]
    Publish(#[from] PublishError),
    /// The order would be rejected by the submission (contract §1): not
    /// sent.
    #[error("the order would be rejected: {0}")]
    InvalidOrder(RejectReason),
    /// Not a queue name (1 to 255 bytes, no control characters).
    #[error("not a queue name: {0:?}")]
    InvalidQueue(String),
    /// [`Client::wait`] needs the client's status queue.
    #[error("the client has no status queue: set one with Client::with_status_queue")]
    NoStatusQueue,
    /// No terminal event for the order within the time given.
    #[error("no terminal event for order {order_id} within {waited:?}")]
    Timeout { order_id: OrderId, waited: Duration },
    /// The consumer of a status queue stopped: its channel closed or the
    /// queue was deleted. Consume again (on a new client if the connection
    /// is gone).
    #[error("the consumer of {0} stopped: the channel or the queue is gone")]
    StreamEnded(String),
    /// A message on a status queue that is not a status event; it was
    /// acknowledged, and the stream goes on.
    #[error("a message on {queue} is not a status event: {reason}")]
    NotAStatusEvent { queue: String, reason: String },
}

/// How an order ended: its terminal status event (`processed`,
/// `compensated`, `failed` or `rejected`).
#[derive(Debug, Clone, PartialEq)]
pub struct Terminal {
    pub event: StatusEvent,
}

impl Terminal {
    /// `processed`, `compensated`, `failed` or `rejected`.
    pub fn state(&self) -> State {
        self.event.state.clone()
    }

    /// Whether the order was processed (every step succeeded).
    pub fn succeeded(&self) -> bool {
        self.event.state == EventKind::Processed
    }
}

/// A published message whose confirm has not been read yet, from
/// [`Client::send`]: publishing many before reading any confirm costs one
/// round trip, not one per message.
pub struct Pending {
    confirm: PendingConfirm,
}

impl Pending {
    /// Waits until the broker took the message.
    pub async fn confirmed(self) -> Result<(), Error> {
        Ok(self.confirm.wait().await?)
    }
}

/// A connection to one sas deployment's RabbitMQ.
pub struct Client {
    broker: Broker,
    publisher: Publisher,
    queues: QueueNames,
    /// Where the orders' events go unless an order names a queue, and what
    /// [`Client::wait`] reads.
    status_queue: Option<String>,
    /// Terminal events [`Client::wait`] read for orders other than its own,
    /// for the waits of those orders.
    terminals: Mutex<Terminals>,
    /// Wakes the waits when a terminal event is kept.
    kept: Notify,
}

impl Client {
    /// Connects to RabbitMQ at `url` (`amqp://` or `amqps://` with the
    /// system's roots), for the deployment whose `broker.prefix` is `prefix`,
    /// retrying for up to 30 s.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, Error> {
        let settings = BrokerSettings {
            url: url.to_owned(),
            prefix: prefix.to_owned(),
            ..BrokerSettings::default()
        };
        Self::connect_with(&settings, "sas-client").await
    }

    /// Connects with sas's broker settings (TLS files, connect timeout,
    /// several nodes), for `settings.prefix`; `name` is the connection's
    /// name in RabbitMQ's management.
    pub async fn connect_with(settings: &BrokerSettings, name: &str) -> Result<Self, Error> {
        let broker = Broker::connect(settings, name).await?;
        let publisher = broker.publisher().await?;
        Ok(Self {
            broker,
            publisher,
            queues: QueueNames::new(&settings.prefix),
            status_queue: None,
            terminals: Mutex::new(Terminals::default()),
            kept: Notify::new(),
        })
    }

    /// Declares `queue` (durable) and makes it the client's status queue:
    /// orders without a `reply_to` get it, and [`Client::wait`] reads it.
    pub async fn with_status_queue(mut self, queue: &str) -> Result<Self, Error> {
        self.declare_status_queue(queue).await?;
        self.status_queue = Some(queue.to_owned());
        Ok(self)
    }

    /// Whether the connection and its publishing channel are up; a client
    /// that is not is replaced by a new one.
    pub fn is_connected(&self) -> bool {
        self.broker.is_connected() && self.publisher.is_open()
    }

    /// The client's connection, for what the client does not wrap (sas's
    /// own tools and tests use it to count, take or purge messages).
    pub fn broker(&self) -> &Broker {
        &self.broker
    }

    /// The queue names of the deployment.
    pub fn queues(&self) -> &QueueNames {
        &self.queues
    }

    /// Declares an application's status queue (durable, classic), as it
    /// must exist before events are sent to it. A queue that exists with
    /// other arguments is used as it is.
    pub async fn declare_status_queue(&self, queue: &str) -> Result<(), Error> {
        if !is_queue_name(queue) {
            return Err(Error::InvalidQueue(queue.to_owned()));
        }
        match self.broker.declare_status_queue(queue).await {
            Ok(()) => Ok(()),
            Err(e) if e.is_precondition_failed() => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Submits an order and waits for the broker's confirm; its id (the
    /// order's own, else a new UUIDv7). The order goes to the client's
    /// status queue unless it names one.
    pub async fn submit(&self, order: Order) -> Result<OrderId, Error> {
        let (order_id, pending) = self.send(order).await?;
        let span = tracing::debug_span!("submit", %order_id);
        pending.confirmed().instrument(span).await?;
        Ok(order_id)
    }

    /// Publishes an order without waiting for its confirm (see
    /// [`Pending`]); its id.
    pub async fn send(&self, mut order: Order) -> Result<(OrderId, Pending), Error> {
        let order_id = *order.order_id.get_or_insert_with(Uuid::now_v7);
        if order.reply_to.is_none() {
            order.reply_to.clone_from(&self.status_queue);
        }
        let body = serde_json::to_vec(&order).map_err(|e| {
            Error::InvalidOrder(RejectReason::MalformedJson(sas::messages::Quoted::new(
                &e.to_string(),
            )))
        })?;
        // The submission's own validation, so that an order it would
        // reject is refused here, unsent (the workflow's existence aside).
        sas::messages::decode_submission(&body, None, usize::MAX, &self.queues)
            .map_err(|(reason, _)| Error::InvalidOrder(reason))?;
        let id = order_id.to_string();
        tracing::debug!(order_id = %id, workflow = %order.workflow, "submitting");
        let pending = self
            .send_raw(&body, order.reply_to.as_deref(), Some(&id))
            .await?;
        Ok((order_id, pending))
    }

    /// Publishes a body as-is as an order, without waiting for its confirm:
    /// for tools that forward what they are given (the submission validates
    /// it). `message_id`, when a UUID, is the order's id if the body has none.
    pub async fn send_raw(
        &self,
        body: &[u8],
        reply_to: Option<&str>,
        message_id: Option<&str>,
    ) -> Result<Pending, Error> {
        // Through the submission exchange, as an application with least
        // privilege must (it may not publish to the default exchange).
        let msg = Outgoing {
            exchange: self.queues.submit_exchange(),
            routing_key: self.queues.orders(),
            body,
            reply_to,
            message_id,
            // Who sends it, as RabbitMQ checks it: how sas tells
            // applications apart when identities are configured (§1b).
            user_id: self.broker.user(),
            // Returned when no queue takes it, so an absent submission
            // service is noticed.
            mandatory: true,
            ..Outgoing::default()
        };
        let confirm = self.publisher.send(&msg).await?;
        Ok(Pending { confirm })
    }

    /// The status events of `queue` (declared first), typed and
    /// deduplicated on (`order_id`, `seq`), each acknowledged once the next
    /// is asked for.
    pub async fn status(&self, queue: &str) -> Result<StatusStream, Error> {
        self.declare_status_queue(queue).await?;
        let consumer = self.broker.consume(queue, STATUS_PREFETCH, "").await?;
        Ok(StatusStream::new(queue, consumer))
    }

    /// Waits for the terminal event of `order_id` on the client's status
    /// queue, up to `timeout`.
    ///
    /// It reads the queue and acknowledges what it reads: the events of
    /// other orders are consumed too, their terminal events kept for their
    /// own `wait` (several may run at once). An application that needs
    /// every event reads [`Client::status`] instead.
    pub async fn wait(&self, order_id: OrderId, timeout: Duration) -> Result<Terminal, Error> {
        let queue = self.status_queue.as_deref().ok_or(Error::NoStatusQueue)?;
        let span = tracing::debug_span!("wait", %order_id);
        async {
            let deadline = tokio::time::Instant::now() + timeout;
            let mut events = self.status(queue).await?;
            let outcome = loop {
                // Registered before looking, so that a terminal kept by
                // another wait in between is not missed.
                let kept = self.kept.notified();
                if let Some(event) = self.take_terminal(order_id) {
                    break Ok(Terminal { event });
                }
                let next = tokio::select! {
                    next = tokio::time::timeout_at(deadline, events.next()) => next,
                    () = kept => continue,
                };
                match next {
                    Err(_) => {
                        break Err(Error::Timeout {
                            order_id,
                            waited: timeout,
                        });
                    }
                    Ok(None) => break Err(Error::StreamEnded(queue.to_owned())),
                    Ok(Some(Err(e @ Error::NotAStatusEvent { .. }))) => {
                        tracing::warn!(error = %e, "skipped");
                    }
                    Ok(Some(Err(e))) => break Err(e),
                    Ok(Some(Ok(event))) if !event.state.is_terminal() => {}
                    Ok(Some(Ok(event))) if is_of(&event, order_id) => break Ok(Terminal { event }),
                    Ok(Some(Ok(event))) => self.keep_terminal(event),
                }
            };
            // Acknowledges the last event read, the terminal one included.
            let closed = events.close().await;
            let terminal = outcome?;
            closed?;
            Ok(terminal)
        }
        .instrument(span)
        .await
    }

    /// Asks sas to publish stored status events again (contract §9), to
    /// `to` or, when `None`, to the order's own status queue
    /// ([`ReplayRequest::Order`]) or the queue asked about
    /// ([`ReplayRequest::Queue`]). Returns once the broker has the request;
    /// the events follow on that queue (dedupe them with the live ones:
    /// [`Client::status`] does).
    pub async fn replay(&self, request: &ReplayRequest, to: Option<&str>) -> Result<(), Error> {
        if let Some(q) = to
            && !is_queue_name(q)
        {
            return Err(Error::InvalidQueue(q.to_owned()));
        }
        let body = serde_json::to_string(request).unwrap_or_default();
        self.publisher
            .publish(&Outgoing {
                routing_key: self.queues.replay(),
                body: body.as_bytes(),
                reply_to: to,
                user_id: self.broker.user(),
                // No submission service has declared the queue: an error.
                mandatory: true,
                ..Outgoing::default()
            })
            .await?;
        Ok(())
    }

    /// Closes the connection.
    pub async fn close(self) {
        self.broker.close().await;
    }

    fn take_terminal(&self, order_id: OrderId) -> Option<StatusEvent> {
        self.terminals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take(order_id)
    }

    fn keep_terminal(&self, event: StatusEvent) {
        let Some(id) = event
            .order_id
            .as_str()
            .and_then(|s| Uuid::parse_str(s).ok())
        else {
            return;
        };
        self.terminals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keep(id, event);
        self.kept.notify_waiters();
    }
}

/// Whether `event` is about `order_id`.
fn is_of(event: &StatusEvent, order_id: OrderId) -> bool {
    event
        .order_id
        .as_str()
        .and_then(|s| Uuid::parse_str(s).ok())
        == Some(order_id)
}

/// Terminal events by order, the oldest forgotten beyond [`TERMINALS_KEPT`].
#[derive(Debug, Default)]
struct Terminals {
    by_order: HashMap<OrderId, StatusEvent>,
    order: VecDeque<OrderId>,
}

impl Terminals {
    fn keep(&mut self, order_id: OrderId, event: StatusEvent) {
        if self.by_order.insert(order_id, event).is_none() {
            self.order.push_back(order_id);
        }
        while self.order.len() > TERMINALS_KEPT {
            if let Some(oldest) = self.order.pop_front() {
                self.by_order.remove(&oldest);
            }
        }
    }

    fn take(&mut self, order_id: OrderId) -> Option<StatusEvent> {
        let event = self.by_order.remove(&order_id)?;
        self.order.retain(|id| *id != order_id);
        Some(event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;

    fn terminal(id: OrderId) -> StatusEvent {
        sas::messages::logged_event(
            id,
            5,
            EventKind::Processed,
            None,
            1,
            Utc::now(),
            serde_json::json!({}),
        )
    }

    #[test]
    fn kept_terminals_are_taken_once_and_bounded() {
        let mut kept = Terminals::default();
        let a = Uuid::now_v7();
        kept.keep(a, terminal(a));
        assert!(kept.take(a).is_some());
        assert!(kept.take(a).is_none());
        for _ in 0..TERMINALS_KEPT + 5 {
            let id = Uuid::now_v7();
            kept.keep(id, terminal(id));
        }
        assert_eq!(kept.by_order.len(), TERMINALS_KEPT);
        assert_eq!(kept.order.len(), TERMINALS_KEPT);
    }

    #[test]
    fn an_event_is_of_its_order_only() {
        let a = Uuid::now_v7();
        assert!(is_of(&terminal(a), a));
        assert!(!is_of(&terminal(a), Uuid::now_v7()));
        let rejected = StatusEvent {
            order_id: serde_json::Value::Null,
            ..terminal(a)
        };
        assert!(!is_of(&rejected, a));
    }
}

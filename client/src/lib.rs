//! # sas-client: a Rust application's side of sas
//!
//! An application talks to [sas] through RabbitMQ ([contract] §1, §2, §9)
//! and, for what the broker does not carry, the submission service's HTTP
//! API (§9a). This crate does both the way the contract asks, so that an
//! application writes no AMQP message by hand. It depends on nothing of
//! the server: the wire types are [`sas_protocol`]'s.
//!
//! - [`Client::submit`]: a typed payload in, a [`Handle`] out. The order
//!   goes through the submission exchange `<prefix>.submit` with publisher
//!   confirms and `mandatory` (no submission service means an error, not a
//!   silent loss), with a UUIDv7 id that is also its `message_id`: sending
//!   it again after an unclear failure is the same order, so the client
//!   sends it again by itself when the connection drops before the confirm.
//!   An order sas would refuse for its form is refused here, unsent.
//! - [`Handle::result`]: the order's results, typed, once it is processed;
//!   [`Error::OrderFailed`] when it ended otherwise.
//! - [`Client::status`]: the status events of a queue as a [`Stream`] of
//!   [`StatusEvent`]s, deduplicated on (`order_id`, `seq`), each
//!   acknowledged once the application asks for the next, and resumed on a
//!   new connection when the old one is lost. A state this version does not
//!   know is read as [`State::Other`], never dropped.
//! - [`Client::replay`]: asks sas to publish stored status events again.
//! - [`Handle::status`], [`Handle::cancel`], [`Handle::signal`]: over the
//!   HTTP API ([`Options::http`]).
//!
//! ```no_run
//! use std::collections::BTreeMap;
//! use sas_client::{Client, Options};
//!
//! #[derive(serde::Serialize)]
//! struct Checkout { sku: String, qty: u32 }
//!
//! # async fn run() -> Result<(), sas_client::Error> {
//! let options = Options::new("amqp://guest:guest@127.0.0.1:5672/%2f", "sas")
//!     .status_queue("shop.status");
//! let client = Client::connect_with(options).await?;
//! let order = client.submit("checkout", &Checkout { sku: "A-1".into(), qty: 2 }).await?;
//! // The results of the order's steps, by step name.
//! let results: BTreeMap<String, serde_json::Value> = order.result().await?;
//! println!("{} processed: {results:?}", order.id());
//! client.close().await;
//! # Ok(())
//! # }
//! ```
//!
//! Errors are typed ([`Error`]) and each says what the caller can do;
//! nothing here panics on I/O or input.
//!
//! # Known limitation: hostile headers on the status queue
//!
//! sas builds lapin's AMQP parser, `amq-protocol-types`, with two fixes
//! that no release carries yet (10.6.3 is the newest; see
//! [`third_party/README.md`]). This crate, built from crates.io, gets the
//! parser without them. So a message on the application's status queue
//! whose headers nest tables some 24,000 levels deep (120 KB, which
//! RabbitMQ forwards) overflows the stack of lapin's I/O thread and
//! aborts the process, and comes again after every restart; a header name
//! or property that is not UTF-8 closes the connection, and the
//! [`StatusStream`], consuming again, reads it again without end.
//!
//! Only whoever can publish to the status queue can do this; sas's
//! services never do. Protect the application in either way:
//! - let no one but sas's services write to its status queues: the broker
//!   permissions of [`docs/security.md`] (the application's own user
//!   writes to sas's `<prefix>.submit`, and `<prefix>.replay` or
//!   `<prefix>.signals` if it uses them, never to a queue);
//! - or build with sas's patched copy, in your workspace's `Cargo.toml`
//!   (`Cargo.lock` then pins the commit):
//!
//! ```toml
//! [patch.crates-io]
//! amq-protocol-types = { git = "https://github.com/sas-rs/sas" }
//! ```
//!
//! [sas]: https://github.com/sas-rs/sas
//! [contract]: https://github.com/sas-rs/sas/blob/main/docs/contract.md
//! [`third_party/README.md`]: https://github.com/sas-rs/sas/blob/main/third_party/README.md
//! [`docs/security.md`]: https://github.com/sas-rs/sas/blob/main/docs/security.md#broker-users-least-privilege-for-applications
//! [`Stream`]: futures_util::Stream
//!
//! Its modules: `connect` (nodes tried, retried, TLS), `handle` (one
//! order as its application follows it), `dedupe` (what "deduplicated on
//! (`order_id`, `seq`)" remembers) and `terminals` (terminal events kept for
//! another order's wait), beside `publish`, `status` and `http`.

pub mod connect;
mod dedupe;
mod handle;
mod http;
pub mod publish;
mod status;
mod terminals;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt as _;
use lapin::options::{BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use sas_protocol::limits::{is_queue_name, is_reserved_queue, payload_broken};
use serde::Serialize;
use tokio::sync::Notify;
use tracing::Instrument as _;
use uuid::Uuid;

pub use connect::{ConnectError, Tls};
pub use handle::Handle;
pub use http::HttpOptions;
pub use publish::{PendingConfirm, PublishError};
pub use sas_protocol::http::{Cancelled, OrderView, Problem, StepView};
pub use sas_protocol::{EventKind, Events, Order, Priority, ReplayRequest, State, StatusEvent};
pub use status::StatusStream;

use connect::{ConnectParams, Connected};
use publish::{Outgoing, Publisher};
use terminals::Terminals;

/// An order's identity (contract §1): a UUID, v7 when the client makes it.
pub type OrderId = Uuid;

/// Unacknowledged status events a [`StatusStream`] holds at once.
const STATUS_PREFETCH: u16 = 256;

/// What went wrong, and so what the caller can do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// RabbitMQ could not be reached, a URL is wrong, or TLS failed (see
    /// [`ConnectError`]).
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The broker failed a call (a channel or the connection closed):
    /// try again; a new connection is made when the old one is gone.
    #[error("RabbitMQ: {0}")]
    Amqp(#[from] lapin::Error),
    /// The broker did not take a message: nacked, or returned because no
    /// queue took it ([`PublishError::Unroutable`]: for an order, no
    /// submission service ever declared `<prefix>.orders`; check the prefix).
    #[error(transparent)]
    Publish(#[from] PublishError),
    /// The order would be refused by the submission (contract §1): not
    /// sent. Fix the field named.
    #[error("the order would be rejected: {0}")]
    InvalidOrder(String),
    /// Not a queue name an application may use (1 to 255 bytes, no
    /// control characters, not under the deployment's prefix nor `amq.`).
    #[error("not a queue name an application may use: {0:?}")]
    InvalidQueue(String),
    /// Waiting for an order needs the client's status queue:
    /// [`Options::status_queue`].
    #[error("the client has no status queue: set one with Options::status_queue")]
    NoStatusQueue,
    /// Reading, cancelling or signalling an order needs the HTTP API:
    /// [`Options::http`].
    #[error("the client has no HTTP API: set one with Options::http")]
    NoHttpApi,
    /// No terminal event for the order within the time given; it may still
    /// end later (wait again, or read it with [`Handle::status`]).
    #[error("no terminal event for order {order_id} within {waited:?}")]
    Timeout { order_id: OrderId, waited: Duration },
    /// The order ended without being processed (`compensated`, `failed`
    /// or `rejected`); `detail` says why (contract §2).
    #[error("order {order_id} ended {state}: {detail}")]
    OrderFailed {
        order_id: OrderId,
        state: String,
        detail: serde_json::Value,
    },
    /// An answer does not read as the type asked for (an order's results
    /// as `R`, an HTTP answer).
    #[error("unexpected answer: {0}")]
    Unexpected(String),
    /// The consumer of a status queue stopped while the connection stayed
    /// up: the queue was deleted or the channel closed by the broker.
    #[error("the consumer of {0} stopped: the queue or its channel is gone")]
    StreamEnded(String),
    /// A message on a status queue that is not a status event; it was
    /// acknowledged, and the stream goes on.
    #[error("a message on {queue} is not a status event: {reason}")]
    NotAStatusEvent { queue: String, reason: String },
    /// The HTTP API could not be reached or did not answer: try again.
    #[error("the HTTP API did not answer: {0}")]
    Http(reqwest::Error),
    /// The HTTP API refused the request; `problem.reason` says why
    /// (`401`: the token; `404`: no such order of this application;
    /// `409`: not allowed in the order's state).
    #[error("the HTTP API answered {status}: {} ({})", problem.reason, problem.error)]
    Refused { status: u16, problem: Problem },
}

/// How to reach a deployment of sas. Its `Debug` shows no password,
/// token or key, so that it may be logged.
#[derive(Clone)]
pub struct Options {
    /// The AMQP URL (`amqp://` or `amqps://`); several, separated by
    /// commas, name the nodes of one cluster.
    pub url: String,
    /// The deployment's `broker.prefix`.
    pub prefix: String,
    /// The connection's name in RabbitMQ's management.
    pub name: String,
    /// How long to keep trying to reach RabbitMQ, at start and after a
    /// lost connection.
    pub connect_timeout: Duration,
    /// The AMQP heartbeat, unless the URL names one.
    pub heartbeat: Duration,
    /// TLS beyond the system's roots, for `amqps://`.
    pub tls: Tls,
    /// The application's status queue: orders without a `reply_to` get
    /// it, and [`Handle::wait`] reads it. Declared at connect.
    pub status_queue: Option<String>,
    /// The submission service's HTTP API.
    pub http: Option<HttpOptions>,
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let url: Vec<String> = self.nodes().map(connect::without_password).collect();
        f.debug_struct("Options")
            .field("url", &url.join(","))
            .field("prefix", &self.prefix)
            .field("name", &self.name)
            .field("connect_timeout", &self.connect_timeout)
            .field("heartbeat", &self.heartbeat)
            .field("tls", &self.tls)
            .field("status_queue", &self.status_queue)
            .field("http", &self.http)
            .finish()
    }
}

impl Options {
    /// The deployment whose broker is at `url` with `broker.prefix` `prefix`.
    pub fn new(url: impl Into<String>, prefix: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            prefix: prefix.into(),
            name: "sas-client".into(),
            connect_timeout: Duration::from_secs(30),
            heartbeat: Duration::from_secs(10),
            tls: Tls::default(),
            status_queue: None,
            http: None,
        }
    }

    /// With the application's status queue ([`Options::status_queue`]).
    pub fn status_queue(mut self, queue: impl Into<String>) -> Self {
        self.status_queue = Some(queue.into());
        self
    }

    /// With the HTTP API at `base_url` (e.g. `http://sas:9101`) and the
    /// application's token, if sas has `[applications]`.
    pub fn http(mut self, base_url: impl Into<String>, token: Option<String>) -> Self {
        self.http = Some(HttpOptions {
            base_url: base_url.into(),
            token,
        });
        self
    }

    /// The nodes of [`Options::url`].
    fn nodes(&self) -> impl Iterator<Item = &str> {
        self.url.split(',').map(str::trim).filter(|n| !n.is_empty())
    }
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

    /// The results of a processed order's steps (`detail.results`, by step
    /// name) read as `R`; [`Error::OrderFailed`] when it was not processed.
    pub fn results<R: serde::de::DeserializeOwned>(&self) -> Result<R, Error> {
        if !self.succeeded() {
            return Err(Error::OrderFailed {
                order_id: self.order_id().unwrap_or_default(),
                state: self.event.state.as_str().to_owned(),
                detail: self.event.detail.clone(),
            });
        }
        let results = self
            .event
            .detail
            .get("results")
            .cloned()
            .unwrap_or(serde_json::Value::Object(Default::default()));
        serde_json::from_value(results).map_err(|e| Error::Unexpected(e.to_string()))
    }

    fn order_id(&self) -> Option<OrderId> {
        event_order_id(&self.event)
    }
}

/// The order id of `event`, when it has one that is a UUID.
fn event_order_id(event: &StatusEvent) -> Option<OrderId> {
    event
        .order_id
        .as_str()
        .and_then(|s| Uuid::parse_str(s).ok())
}

/// A published order whose confirm has not been read yet, from
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

/// A connection to one sas deployment. Cheap to clone: clones share the
/// connection, which is made again when it is lost.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    options: Options,
    nodes: Vec<lapin::uri::AMQPUri>,
    /// `<prefix>.submit`, `<prefix>.orders`, `<prefix>.replay`.
    submit_exchange: String,
    orders: String,
    replay: String,
    session: tokio::sync::Mutex<Option<Arc<Session>>>,
    /// Terminal events a wait read for orders other than its own, for the
    /// waits of those orders.
    terminals: Mutex<Terminals>,
    /// Wakes the waits when a terminal event is kept.
    kept: Notify,
    api: Option<http::Api>,
}

/// One connection and its publishing channel.
pub(crate) struct Session {
    connection: Arc<lapin::Connection>,
    publisher: Publisher,
    user: Option<String>,
}

impl Session {
    fn connected(&self) -> bool {
        self.connection.status().connected()
    }
}

impl Client {
    /// Connects to RabbitMQ at `url` for the deployment whose
    /// `broker.prefix` is `prefix`, retrying for up to 30 s.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, Error> {
        Self::connect_with(Options::new(url, prefix)).await
    }

    /// Connects with `options`, and declares its status queue.
    pub async fn connect_with(options: Options) -> Result<Self, Error> {
        let nodes = options
            .nodes()
            .map(|node| connect::parse_node(node, connect::without_password))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(queue) = &options.status_queue {
            check_queue(&options.prefix, queue)?;
        }
        let api = options.http.as_ref().map(http::Api::new).transpose()?;
        let prefix = &options.prefix;
        let client = Self {
            inner: Arc::new(Inner {
                nodes,
                submit_exchange: format!("{prefix}.submit"),
                orders: format!("{prefix}.orders"),
                replay: format!("{prefix}.replay"),
                session: tokio::sync::Mutex::new(None),
                terminals: Mutex::new(Terminals::default()),
                kept: Notify::new(),
                api,
                options,
            }),
        };
        client.session().await?;
        if let Some(queue) = client.inner.options.status_queue.clone() {
            client.declare_status_queue(&queue).await?;
        }
        Ok(client)
    }

    /// The options the client was made with.
    pub fn options(&self) -> &Options {
        &self.inner.options
    }

    /// The connection, made again when the last one is lost (bounded by
    /// [`Options::connect_timeout`]).
    pub(crate) async fn session(&self) -> Result<Arc<Session>, Error> {
        let mut slot = self.inner.session.lock().await;
        if let Some(session) = slot.as_ref()
            && session.connected()
        {
            if session.publisher.is_open() {
                return Ok(session.clone());
            }
            // The channel alone closed (the broker refused a message):
            // a new one on the same connection.
            let channel = session.connection.create_channel().await?;
            let fresh = Arc::new(Session {
                connection: session.connection.clone(),
                publisher: Publisher::new(channel).await?,
                user: session.user.clone(),
            });
            *slot = Some(fresh.clone());
            return Ok(fresh);
        }
        let options = &self.inner.options;
        let params = ConnectParams {
            name: options.name.clone(),
            timeout: options.connect_timeout,
            heartbeat: options.heartbeat,
            tls: options.tls.clone(),
        };
        let Connected {
            connection,
            user,
            node,
        } = connect::connect_nodes(self.inner.nodes.clone(), &params).await?;
        tracing::debug!(%node, "connected to RabbitMQ");
        let channel = connection.create_channel().await?;
        let session = Arc::new(Session {
            connection: Arc::new(connection),
            publisher: Publisher::new(channel).await?,
            user,
        });
        *slot = Some(session.clone());
        Ok(session)
    }

    /// Whether the connection is up now (it is made again when needed).
    pub fn is_connected(&self) -> bool {
        self.inner
            .session
            .try_lock()
            .map(|s| s.as_ref().is_some_and(|s| s.connected()))
            .unwrap_or(true)
    }

    /// Declares an application's status queue (durable, classic), as it
    /// must exist before events are sent to it. A queue that exists with
    /// other arguments is used as it is.
    pub async fn declare_status_queue(&self, queue: &str) -> Result<(), Error> {
        check_queue(&self.inner.options.prefix, queue)?;
        let session = self.session().await?;
        // A refused declaration closes the channel: one of its own.
        let channel = session.connection.create_channel().await?;
        let declared = channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await;
        match declared {
            Ok(_) => {
                channel.close(200, "declared".into()).await.ok();
                Ok(())
            }
            Err(e) if is_precondition_failed(&e) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Submits an order of `workflow` whose payload is `payload` (a value
    /// that serializes to a JSON object), and waits for the broker's
    /// confirm. The order goes to the client's status queue.
    pub async fn submit<T: Serialize + ?Sized>(
        &self,
        workflow: &str,
        payload: &T,
    ) -> Result<Handle, Error> {
        let order = Order::from_payload(workflow, payload).ok_or_else(|| {
            Error::InvalidOrder("payload: must serialize to a JSON object".into())
        })?;
        self.submit_order(order).await
    }

    /// Submits an order with every field of the contract's (its id,
    /// priority, `not_before`, which events) and waits for the broker's
    /// confirm; its id is the order's own, else a new UUIDv7. It goes to
    /// the client's status queue unless it names one. When the connection
    /// is lost before the confirm, the same order is sent again on a new
    /// one (the same id is the same order).
    pub async fn submit_order(&self, mut order: Order) -> Result<Handle, Error> {
        let order_id = *order.order_id.get_or_insert_with(Uuid::now_v7);
        let span = tracing::debug_span!("submit", %order_id);
        async {
            let started = tokio::time::Instant::now();
            loop {
                let sent = match self.send(order.clone()).await {
                    Ok((_, pending)) => pending.confirmed().await,
                    Err(e) => Err(e),
                };
                match sent {
                    // Lost at the publish or before its confirm: whether the
                    // broker has it is unknown, and the same id is the same
                    // order, so it goes again on a new connection.
                    Err(Error::Publish(PublishError::Amqp(e)) | Error::Amqp(e))
                        if !self.is_connected()
                            && started.elapsed() < self.inner.options.connect_timeout =>
                    {
                        tracing::warn!(error = %e, "connection lost before the confirm; sending again");
                    }
                    Err(e) => return Err(e),
                    Ok(()) => return Ok(Handle::new(self.clone(), order_id)),
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Publishes an order without waiting for its confirm (see
    /// [`Pending`]); its id.
    pub async fn send(&self, mut order: Order) -> Result<(OrderId, Pending), Error> {
        let order_id = *order.order_id.get_or_insert_with(Uuid::now_v7);
        if order.reply_to.is_none() {
            order.reply_to.clone_from(&self.inner.options.status_queue);
        }
        self.check(&order)?;
        let body = serde_json::to_vec(&order).map_err(|e| Error::InvalidOrder(e.to_string()))?;
        let id = order_id.to_string();
        tracing::debug!(order_id = %id, workflow = %order.workflow, "submitting");
        let pending = self
            .send_raw(&body, order.reply_to.as_deref(), Some(&id))
            .await?;
        Ok((order_id, pending))
    }

    /// What the submission would refuse of `order` for its form (contract
    /// §1), the workflow's existence aside.
    fn check(&self, order: &Order) -> Result<(), Error> {
        if !is_queue_name(&order.workflow) {
            return Err(Error::InvalidOrder(
                "workflow: a name of 1 to 255 bytes without control characters".into(),
            ));
        }
        if let Some(expected) = payload_broken(&order.payload) {
            return Err(Error::InvalidOrder(format!("payload: must be {expected}")));
        }
        if let Some(queue) = &order.reply_to {
            check_queue(&self.inner.options.prefix, queue).map_err(|_| {
                Error::InvalidOrder(format!(
                    "reply_to: {queue:?} is not a queue an application may use"
                ))
            })?;
        }
        Ok(())
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
        let session = self.session().await?;
        let msg = Outgoing {
            // Through the submission exchange, as an application with least
            // privilege must (it may not publish to the default exchange).
            exchange: &self.inner.submit_exchange,
            routing_key: &self.inner.orders,
            body,
            reply_to,
            message_id,
            // Who sends it, as RabbitMQ checks it: how sas tells
            // applications apart when identities are configured (§1b).
            user_id: session.user.as_deref(),
            // Returned when no queue takes it, so an absent submission
            // service is noticed.
            mandatory: true,
            ..Outgoing::default()
        };
        let confirm = session.publisher.send(&msg).await?;
        Ok(Pending { confirm })
    }

    /// The handle of an order submitted earlier (by this process or another).
    pub fn order(&self, order_id: OrderId) -> Handle {
        Handle::new(self.clone(), order_id)
    }

    /// The status events of `queue` (declared first), typed and
    /// deduplicated on (`order_id`, `seq`), each acknowledged once the next
    /// is asked for; consumed again on a new connection when the old one
    /// is lost.
    pub async fn status(&self, queue: &str) -> Result<StatusStream, Error> {
        self.declare_status_queue(queue).await?;
        let consumer = self.consume(queue).await?;
        Ok(StatusStream::new(self.clone(), queue, consumer))
    }

    /// A consumer of `queue` on a channel of its own.
    pub(crate) async fn consume(&self, queue: &str) -> Result<status::Consuming, Error> {
        let session = self.session().await?;
        let channel = session.connection.create_channel().await?;
        channel
            .basic_qos(STATUS_PREFETCH, BasicQosOptions::default())
            .await?;
        let consumer = channel
            .basic_consume(
                queue.into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(status::Consuming {
            session,
            channel,
            consumer,
        })
    }

    /// Waits for the terminal event of `order_id` on the client's status
    /// queue, up to `timeout`.
    ///
    /// It reads the queue and acknowledges what it reads: the events of
    /// other orders are consumed too, their terminal events kept for their
    /// own waits (several may run at once). An application that needs
    /// every event reads [`Client::status`] instead.
    pub async fn wait(&self, order_id: OrderId, timeout: Duration) -> Result<Terminal, Error> {
        self.wait_for(order_id, Some(timeout)).await
    }

    /// [`Client::wait`], up to `timeout` or (`None`) as long as it takes.
    pub(crate) async fn wait_for(
        &self,
        order_id: OrderId,
        timeout: Option<Duration>,
    ) -> Result<Terminal, Error> {
        let queue = self
            .inner
            .options
            .status_queue
            .as_deref()
            .ok_or(Error::NoStatusQueue)?;
        let span = tracing::debug_span!("wait", %order_id);
        async {
            let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
            let mut events = self.status(queue).await?;
            let outcome = loop {
                // Registered before looking, so that a terminal kept by
                // another wait in between is not missed.
                let kept = self.inner.kept.notified();
                if let Some(event) = self.lock_terminals().take(order_id) {
                    break Ok(Terminal { event });
                }
                let read = async {
                    match deadline {
                        Some(at) => tokio::time::timeout_at(at, events.next()).await.ok(),
                        None => Some(events.next().await),
                    }
                };
                let next = tokio::select! {
                    next = read => next,
                    () = kept => continue,
                };
                match next {
                    None => {
                        break Err(Error::Timeout {
                            order_id,
                            waited: timeout.unwrap_or_default(),
                        });
                    }
                    Some(None) => break Err(Error::StreamEnded(queue.to_owned())),
                    Some(Some(Err(e @ (Error::NotAStatusEvent { .. } | Error::Connect(_))))) => {
                        tracing::warn!(error = %e, "status stream: going on");
                    }
                    Some(Some(Err(e))) => break Err(e),
                    Some(Some(Ok(event))) if !event.state.is_terminal() => {}
                    Some(Some(Ok(event))) if event_order_id(&event) == Some(order_id) => {
                        break Ok(Terminal { event });
                    }
                    Some(Some(Ok(event))) => self.keep_terminal(event),
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
        if let Some(q) = to {
            check_queue(&self.inner.options.prefix, q)?;
        }
        let body = serde_json::to_vec(request).map_err(|e| Error::Unexpected(e.to_string()))?;
        let session = self.session().await?;
        session
            .publisher
            .publish(&Outgoing {
                routing_key: &self.inner.replay,
                body: &body,
                reply_to: to,
                user_id: session.user.as_deref(),
                // No submission service has declared the queue: an error.
                mandatory: true,
                ..Outgoing::default()
            })
            .await?;
        Ok(())
    }

    /// The HTTP API, if the options name one.
    pub(crate) fn api(&self) -> Result<&http::Api, Error> {
        self.inner.api.as_ref().ok_or(Error::NoHttpApi)
    }

    /// Closes the connection (of every clone).
    pub async fn close(&self) {
        if let Some(session) = self.inner.session.lock().await.take() {
            session.publisher.close().await;
            session.connection.close(200, "bye".into()).await.ok();
        }
    }

    fn lock_terminals(&self) -> std::sync::MutexGuard<'_, Terminals> {
        self.inner
            .terminals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    fn keep_terminal(&self, event: StatusEvent) {
        let Some(id) = event_order_id(&event) else {
            return;
        };
        self.lock_terminals().keep(id, event);
        self.inner.kept.notify_waiters();
    }
}

/// Whether `queue` is one an application may name.
fn check_queue(prefix: &str, queue: &str) -> Result<(), Error> {
    if is_queue_name(queue) && !is_reserved_queue(prefix, queue) {
        Ok(())
    } else {
        Err(Error::InvalidQueue(queue.to_owned()))
    }
}

/// Whether the broker refused with 406 PRECONDITION_FAILED (a queue
/// declared before with other arguments).
fn is_precondition_failed(e: &lapin::Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    matches!(
        e.kind(),
        lapin::ErrorKind::ProtocolError(amqp)
            if *amqp.kind() == AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn terminal(state: EventKind, detail: serde_json::Value) -> Terminal {
        let event: StatusEvent = serde_json::from_value(json!({
            "order_id": Uuid::now_v7().to_string(), "seq": 5, "state": state.as_str(),
            "at": "2026-11-27T10:00:00Z", "detail": detail,
        }))
        .unwrap();
        Terminal { event }
    }

    #[test]
    fn a_processed_orders_results_read_as_the_type_asked() {
        #[derive(serde::Deserialize, Debug, PartialEq)]
        struct Results {
            charge: serde_json::Value,
        }
        let t = terminal(
            EventKind::Processed,
            json!({"results": {"charge": {"id": 7}}}),
        );
        assert_eq!(
            t.results::<Results>().unwrap(),
            Results {
                charge: json!({"id": 7})
            }
        );
        assert!(matches!(t.results::<u32>(), Err(Error::Unexpected(_))));
    }

    #[test]
    fn an_order_that_was_not_processed_has_no_results() {
        let t = terminal(EventKind::Compensated, json!({"error": "card declined"}));
        match t.results::<serde_json::Value>() {
            Err(Error::OrderFailed { state, detail, .. }) => {
                assert_eq!(state, "compensated");
                assert_eq!(detail["error"], "card declined");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn options_show_no_secret_when_logged() {
        let options = Options {
            tls: Tls {
                ca_pem: Some("-----BEGIN CERTIFICATE-----".into()),
                identity: Some((b"cert".to_vec(), b"PRIVATE-KEY-BYTES".to_vec())),
            },
            ..Options::new("amqps://shop:hunter2@mq1,amqps://shop:hunter2@mq2", "sas")
                .http("http://sas:9101", Some("tok-s3cret".into()))
        };
        let shown = format!("{options:?}");
        for secret in ["hunter2", "tok-s3cret", "PRIVATE", "80, 82, 73"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("mq1") && shown.contains("mq2"), "{shown}");
    }

    #[test]
    fn an_application_may_not_name_sas_queues() {
        assert!(check_queue("sas", "shop.status").is_ok());
        assert!(check_queue("sas", "sas.orders").is_err());
        assert!(check_queue("sas", "amq.x").is_err());
        assert!(check_queue("sas", "").is_err());
    }
}

//! # sas-broker: RabbitMQ through lapin
//!
//! Connecting with bounded retries, declaring the topology, confirmed
//! publishing, consuming with manual acks, poison messages and dead
//! letters ([`dead_letters`]: listing, replaying and purging them for
//! operators). Only this crate touches lapin, and it knows no SQL.
//!
//! lapin does not reconnect by itself in a way we can rely on, so services run
//! their work as *sessions* over one connection (crate `sas`'s
//! `broker::run_sessions`): when the connection is lost the session ends and
//! a new one starts on a new connection, re-declaring the topology and
//! resuming the consumers.
//!
//! - [`headers`]: the AMQP headers sas reads and writes, and their bounds.
//! - `acks`, `consumer`, `delivery`: deliveries, their acks and consumers.
//! - `poison`: what a message that keeps failing becomes.
//! - `publisher`: confirmed publishing.
//! - `settings`: `[broker]` of the configuration.

mod acks;
mod consumer;
pub mod dead_letters;
mod delivery;
pub mod headers;
mod poison;
mod publisher;
mod settings;

use std::sync::Arc;
use std::time::Duration;

use lapin::options::{
    BasicConsumeOptions, BasicNackOptions, BasicQosOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};

pub use acks::{Acks, DeadLetters, Received};
pub use consumer::{Handling, ack, consume, dead_letter, requeue};
pub use delivery::{Consumer, Delivery};
pub use poison::{
    INTERNAL_ERROR, REASON_HEADER, TRIES_HEADER, Verdict, dead_letter_reason, dead_letter_with,
    retry_counted, tries,
};

pub use publisher::{Header, Outgoing, PendingConfirm, PublishError, Publisher};
pub use settings::{BrokerSettings, Durability, QueueType};

use sas_core::topology::QueueNames;

/// How a session ended, when it did not fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionEnd {
    /// Shutdown was asked for and the session drained its work.
    Shutdown,
}

/// What went wrong with the broker.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
    #[error("could not reach RabbitMQ within {waited:?}: {last}")]
    Unreachable {
        waited: Duration,
        last: lapin::Error,
    },
    /// `broker.url` does not parse; both fields are shown without the URL's
    /// password.
    #[error("broker.url {url} is not a valid AMQP URL: {reason}")]
    BadUrl { url: String, reason: String },
    /// A file named by `broker.ca_file`, `client_cert` or `client_key`.
    #[error(transparent)]
    TlsFile(#[from] sas_tls::TlsFileError),
    /// The TLS handshake with RabbitMQ failed: a configuration to fix, not a
    /// state to wait out, so start-up fails at once.
    #[error(
        "TLS to RabbitMQ failed (check broker.ca_file, the client certificate and the \
         server's certificate for the URL's host): {0}"
    )]
    Tls(lapin::Error),
    /// A consumer's stream ended: its channel or its queue is gone.
    #[error("consumer of {0} stopped: the channel or the queue is gone")]
    ConsumerEnded(String),
    /// A task working beside the consumer (the outbox relay) lost the broker.
    #[error("consumer of {0} stopped: a companion task lost the broker")]
    CompanionLost(String),
    /// The connection to RabbitMQ is no longer up.
    #[error("the connection to RabbitMQ is lost")]
    ConnectionLost,
    /// There is no broker session (between reconnections).
    #[error("no broker session")]
    NoSession,
    /// The outbox relay's task panicked or was cancelled.
    #[error("the outbox relay task failed: {0}")]
    RelayTask(#[source] tokio::task::JoinError),
    #[error(transparent)]
    Publish(#[from] PublishError),
}

impl BrokerError {
    /// Whether the broker refused with 406 PRECONDITION_FAILED, e.g. a queue
    /// declared before with other arguments.
    pub fn is_precondition_failed(&self) -> bool {
        self.is_soft(lapin::protocol::AMQPSoftError::PRECONDITIONFAILED)
    }

    /// Whether the broker answered 404 NOT_FOUND: no such queue or exchange.
    pub fn is_not_found(&self) -> bool {
        self.is_soft(lapin::protocol::AMQPSoftError::NOTFOUND)
    }

    /// Whether the broker refused with this channel-level error.
    fn is_soft(&self, soft: lapin::protocol::AMQPSoftError) -> bool {
        use lapin::protocol::AMQPErrorKind;
        matches!(
            self,
            Self::Amqp(e) if matches!(
                e.kind(),
                lapin::ErrorKind::ProtocolError(amqp)
                    if *amqp.kind() == AMQPErrorKind::Soft(soft)
            )
        )
    }
}

/// The TLS settings of `settings`: the CA file's certificates, added to
/// the system's roots, and the client certificate and key. Empty for
/// `amqp://` (validation refuses TLS files with a plaintext URL).
fn tls_config(settings: &BrokerSettings) -> Result<sas_client::Tls, BrokerError> {
    use sas_tls::read_pem;
    let ca_pem = match &settings.ca_file {
        Some(path) => {
            let pem = read_pem("broker.ca_file", path, "CERTIFICATE")?;
            Some(String::from_utf8_lossy(&pem).into_owned())
        }
        None => None,
    };
    let identity = match (&settings.client_cert, &settings.client_key) {
        (Some(cert), Some(key)) => Some((
            read_pem("broker.client_cert", cert, "CERTIFICATE")?,
            read_pem("broker.client_key", key, "PRIVATE KEY")?,
        )),
        _ => None,
    };
    Ok(sas_client::Tls { ca_pem, identity })
}

/// The options of a [`sas_client::Client`] for the deployment of
/// `settings` (its nodes, prefix, timeouts and TLS files), named `name` in
/// RabbitMQ: how sas's own tools submit, as applications do.
pub fn client_options(
    settings: &BrokerSettings,
    name: &str,
) -> Result<sas_client::Options, BrokerError> {
    Ok(sas_client::Options {
        name: name.to_owned(),
        connect_timeout: settings.connect_timeout,
        heartbeat: settings.heartbeat,
        tls: tls_config(settings)?,
        ..sas_client::Options::new(&settings.url, &settings.prefix)
    })
}

impl From<sas_client::ConnectError> for BrokerError {
    fn from(e: sas_client::ConnectError) -> Self {
        use sas_client::ConnectError as C;
        match e {
            C::BadUrl { url, reason } => Self::BadUrl { url, reason },
            C::Unreachable { waited, last } => Self::Unreachable { waited, last },
            C::Tls(e) => Self::Tls(e),
            C::Amqp(e) => Self::Amqp(e),
        }
    }
}

/// What a queue holds and who reads it, as the broker counts them now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueCounts {
    /// Messages ready (not delivered to a consumer yet).
    pub messages: u32,
    /// Consumers subscribed.
    pub consumers: u32,
}

/// One connection to RabbitMQ.
pub struct Broker {
    conn: Connection,
    /// Every channel opened on the connection, so that [`Broker::close`] can
    /// close them in order before the connection (a dropped lapin channel
    /// closes itself in the background, racing the connection's close).
    channels: std::sync::Mutex<Vec<Channel>>,
    /// The RabbitMQ user the connection logged in as, when the URL says
    /// (not with EXTERNAL or ANONYMOUS authentication, where the broker
    /// names it).
    user: Option<String>,
}

/// The RabbitMQ users sas's own connections log in as (the users of
/// `broker.url`'s nodes that name one): whose republished copies may say
/// who sent their original (contract §1b).
pub fn own_users(settings: &BrokerSettings) -> std::collections::BTreeSet<String> {
    settings
        .nodes()
        .into_iter()
        .filter_map(|node| sas_client::connect::parse_node(node, sas_tls::redact_url).ok())
        .filter_map(|uri| sas_client::connect::user_of(&uri))
        .collect()
}

/// The `frame_max` recommended for RabbitMQ (`rabbitmq.conf`): sas's
/// messages are a few hundred bytes, a larger one goes as several frames,
/// and it keeps lapin's buffers at 1 MiB per connection.
pub const RECOMMENDED_FRAME_MAX: u32 = 16 * 1024;

impl Broker {
    /// Connects, retrying with backoff until `connect_timeout`; over TLS
    /// when the URL is `amqps://`, trusting `ca_file` beside the system's
    /// roots and presenting `client_cert` when set. A failed handshake is
    /// not retried.
    pub async fn connect(settings: &BrokerSettings, app: &str) -> Result<Self, BrokerError> {
        // Parsed here rather than by lapin so that a bad URL's error never
        // quotes its password.
        let nodes = settings
            .nodes()
            .into_iter()
            .map(|node| sas_client::connect::parse_node(node, sas_tls::redact_url))
            .collect::<Result<Vec<_>, _>>()?;
        // Unless the URL names one, the server's frame_max is taken:
        // RabbitMQ forwards a publisher's content header as one frame,
        // however small the consumer's frame_max, and lapin closes a
        // connection that receives a frame over its own; with the server's
        // value no header that the broker accepted can (contract §1b).
        // lapin keeps two buffers of 32 frames per connection, so
        // RabbitMQ's default 128 KiB makes 8 MiB per connection:
        // `frame_max = 16384` in rabbitmq.conf (sas's deployment files set
        // it) bounds both.
        let explicit_frame_max = nodes.iter().any(|n| n.query.frame_max.is_some());
        let params = sas_client::connect::ConnectParams {
            name: app.to_owned(),
            timeout: settings.connect_timeout,
            heartbeat: settings.heartbeat,
            tls: tls_config(settings)?,
        };
        let connected = sas_client::connect::connect_nodes(nodes, &params).await?;
        let conn = connected.connection;
        let frame_max = conn.configuration().frame_max();
        if frame_max > RECOMMENDED_FRAME_MAX && !explicit_frame_max {
            tracing::info!(
                frame_max,
                "RabbitMQ's frame_max is above {RECOMMENDED_FRAME_MAX}: each connection keeps {} KiB of frame buffers; set frame_max = {RECOMMENDED_FRAME_MAX} in rabbitmq.conf to lower it",
                frame_max / 16
            );
        }
        Ok(Self {
            conn,
            channels: std::sync::Mutex::new(Vec::new()),
            user: connected.user,
        })
    }

    /// The RabbitMQ user the connection logged in as, when its URL names
    /// it: what an application's messages carry as `user_id` (contract
    /// §1b).
    pub fn user(&self) -> Option<&str> {
        self.user.as_deref()
    }

    /// The largest frame the connection's peers agreed on.
    pub fn frame_max(&self) -> u32 {
        self.conn.configuration().frame_max()
    }

    /// Whether the connection is up.
    pub fn is_connected(&self) -> bool {
        self.conn.status().connected()
    }

    /// Resolves when the connection is no longer up, however it went (a
    /// closed socket, a server-side close, a missed heartbeat).
    pub async fn lost(&self) -> BrokerError {
        while self.is_connected() {
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
        BrokerError::ConnectionLost
    }

    /// A plain channel.
    async fn channel(&self) -> Result<Channel, BrokerError> {
        let channel = self.conn.create_channel().await?;
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        channels.retain(|c| c.status().connected());
        channels.push(channel.clone());
        Ok(channel)
    }

    /// A channel in confirm mode for publishing.
    pub async fn publisher(&self) -> Result<Publisher, BrokerError> {
        Publisher::new(self.channel().await?, self.frame_max(), self.user.clone()).await
    }

    /// Declares every queue of the deployment (idempotent): durable queues,
    /// quorum but for the step queues (`broker.step_queues`), each work queue
    /// dead-lettering to its `.dead` queue after a reject or, when quorum,
    /// `broker.delivery_limit` deliveries.
    pub async fn declare_topology(
        &self,
        names: &QueueNames,
        agents: &[String],
        settings: &BrokerSettings,
    ) -> Result<(), BrokerError> {
        for q in names.all(agents.iter().map(String::as_str)) {
            let queue = &q.name;
            let kind = if q.step {
                settings.step_queues
            } else {
                QueueType::Quorum
            };
            let declared = self
                .declare_queue(
                    queue,
                    kind,
                    q.dead_letters.as_deref(),
                    settings.delivery_limit,
                )
                .await;
            match declared {
                Ok(()) => {}
                // Someone (an application, an older deployment) declared it with
                // other arguments: use it as it is rather than refuse to start.
                Err(e) if e.is_precondition_failed() => {
                    tracing::warn!(%queue, "queue exists with other arguments than sas declares; using it as it is");
                    self.message_count(queue).await?;
                }
                Err(e) => return Err(e),
            }
        }
        // Applications that may not use the default exchange submit here.
        let channel = self.channel().await?;
        channel
            .exchange_declare(
                names.submit_exchange().into(),
                lapin::ExchangeKind::Fanout,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_bind(
                names.orders().into(),
                names.submit_exchange().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        channel.close(200, "topology declared".into()).await.ok();
        Ok(())
    }

    /// Declares a durable queue of `kind` as sas declares its own: with a
    /// dead-letter route to the queue `dead_letter` when given and then,
    /// when quorum, a delivery limit. Fails with
    /// [`BrokerError::is_precondition_failed`] when the queue exists with
    /// other arguments.
    pub async fn declare_queue(
        &self,
        queue: &str,
        kind: QueueType,
        dead_letter: Option<&str>,
        delivery_limit: u32,
    ) -> Result<(), BrokerError> {
        // A refused declaration closes the channel: one of its own.
        let channel = self.channel().await?;
        channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::durable(),
                queue_arguments(kind, dead_letter, delivery_limit),
            )
            .await?;
        channel.close(200, "declared".into()).await.ok();
        Ok(())
    }

    /// Whether RabbitMQ has lost the transient messages it held (a restart
    /// drops them from classic queues) since this was last asked: `queue`,
    /// durable, of `kind` and never consumed, keeps one transient marker
    /// message, which goes with them. When the queue is there but the
    /// marker gone, a new marker is published and confirmed before this
    /// answers `true`, so that a message sent after the answer lasts as
    /// long as the marker. A queue not there yet is declared with its first
    /// marker, and nothing was lost: there was nothing to lose it with.
    pub async fn lost_transient(&self, queue: &str, kind: QueueType) -> Result<bool, BrokerError> {
        let ready = match self.message_count(queue).await {
            Ok(n) => Some(n),
            Err(e) if e.is_not_found() => None,
            Err(e) => return Err(e),
        };
        match ready {
            Some(n) if n > 0 => return Ok(false),
            Some(_) => {}
            None => self.declare_queue(queue, kind, None, 0).await?,
        }
        let publisher = self.publisher().await?;
        publisher
            .publish(&Outgoing {
                routing_key: queue,
                body: b"{}",
                mandatory: true,
                transient: true,
                ..Outgoing::default()
            })
            .await
            .map_err(BrokerError::from)?;
        publisher.close().await;
        Ok(ready.is_some())
    }

    /// Starts consuming `queue` on a channel of its own, with manual acks and
    /// at most `prefetch` unacknowledged deliveries.
    pub async fn consume(
        &self,
        queue: &str,
        prefetch: u16,
        tag: &str,
    ) -> Result<Consumer, BrokerError> {
        Ok(self.subscribe(queue, prefetch, tag).await?.consumer)
    }

    /// Like [`Broker::consume`], on a channel of its own that [`consume`] closes
    /// when it stops, so deliveries not yet worked on go back to the queue.
    pub async fn subscribe(
        &self,
        queue: &str,
        prefetch: u16,
        tag: &str,
    ) -> Result<Subscription, BrokerError> {
        let channel = self.channel().await?;
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await?;
        let consumer = channel
            .basic_consume(
                queue.into(),
                tag.into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(Subscription {
            consumer: Consumer::new(channel, consumer),
            acks: Acks::new(prefetch),
            dead_letters: None,
        })
    }

    /// Takes the next message of `queue`, if any, unacknowledged: the caller
    /// acks it (done with it) or drops it (the broker puts it back when the
    /// channel closes).
    pub async fn take(&self, queue: &str) -> Result<Option<Taken>, BrokerError> {
        let channel = self.channel().await?;
        let got = channel
            .basic_get(
                queue.into(),
                lapin::options::BasicGetOptions { no_ack: false },
            )
            .await?;
        Ok(got.map(|m| Taken {
            delivery: Delivery::new(m.delivery),
            channel,
        }))
    }

    /// Removes every ready message of `queue`; how many.
    pub async fn purge(&self, queue: &str) -> Result<u32, BrokerError> {
        let channel = self.channel().await?;
        let n = channel
            .queue_purge(queue.into(), lapin::options::QueuePurgeOptions::default())
            .await?;
        channel.close(200, "purged".into()).await.ok();
        Ok(n)
    }

    /// Messages ready in `queue` (a passive declare); an error that
    /// [`BrokerError::is_not_found`] when there is no such queue.
    pub async fn message_count(&self, queue: &str) -> Result<u32, BrokerError> {
        Ok(self.queue_counts(queue).await?.messages)
    }

    /// Messages ready in `queue` and its consumers (a passive declare); an
    /// error that [`BrokerError::is_not_found`] when there is no such queue.
    pub async fn queue_counts(&self, queue: &str) -> Result<QueueCounts, BrokerError> {
        let channel = self.channel().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let declared = channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await?;
        channel.close(200, "counted".into()).await.ok();
        Ok(QueueCounts {
            messages: declared.message_count(),
            consumers: declared.consumer_count(),
        })
    }

    /// Deletes a deployment's `queues` and its submission exchange (for
    /// tests and teardown); missing ones are fine.
    pub async fn delete_deployment(
        &self,
        names: &QueueNames,
        queues: &[String],
    ) -> Result<(), BrokerError> {
        self.delete_queues(queues).await?;
        self.delete_queues(&[names.marker().to_owned()]).await?;
        self.delete_exchanges(&[names.submit_exchange()]).await
    }

    /// Deletes exchanges; missing ones are skipped.
    pub async fn delete_exchanges(&self, exchanges: &[&str]) -> Result<(), BrokerError> {
        for exchange in exchanges {
            // A missing exchange closes the channel: one channel each.
            let channel = self.channel().await?;
            channel
                .exchange_delete((*exchange).into(), ExchangeDeleteOptions::default())
                .await
                .ok();
            channel.close(200, "deleted".into()).await.ok();
        }
        Ok(())
    }

    /// Deletes queues (and their messages); missing ones are skipped.
    pub async fn delete_queues(&self, queues: &[String]) -> Result<(), BrokerError> {
        for q in queues {
            // A channel error (e.g. the queue is gone) closes the channel, so one per queue.
            let channel = self.channel().await?;
            channel
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await
                .ok();
            channel.close(200, "deleted".into()).await.ok();
        }
        Ok(())
    }

    /// Declares an application's status queue (durable, classic), as an
    /// application would; used by `sasctl` and tests.
    pub async fn declare_status_queue(&self, queue: &str) -> Result<(), BrokerError> {
        let channel = self.channel().await?;
        channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await?;
        channel.close(200, "declared".into()).await.ok();
        Ok(())
    }

    /// Closes the open channels, then the connection.
    pub async fn close(&self) {
        let channels =
            std::mem::take(&mut *self.channels.lock().unwrap_or_else(|p| p.into_inner()));
        for channel in channels.iter().filter(|c| c.status().connected()) {
            channel.close(200, "bye".into()).await.ok();
        }
        self.conn.close(200, "bye".into()).await.ok();
    }
}

/// A message taken with [`Broker::take`], on a channel of its own.
pub struct Taken {
    pub delivery: Delivery,
    channel: Channel,
}

impl Taken {
    /// Done with it: the broker forgets it.
    pub async fn ack(self) -> Result<(), BrokerError> {
        self.delivery.ack().await?;
        self.channel.close(200, "taken".into()).await.ok();
        Ok(())
    }

    /// Puts it back on its queue.
    pub async fn release(self) -> Result<(), BrokerError> {
        self.delivery
            .inner
            .acker
            .nack(BasicNackOptions {
                requeue: true,
                ..BasicNackOptions::default()
            })
            .await?;
        self.channel.close(200, "released".into()).await.ok();
        Ok(())
    }
}

/// A consumer with its own channel, and that channel's acknowledgements.
pub struct Subscription {
    consumer: Consumer,
    acks: Arc<Acks>,
    /// Where hopeless deliveries go with their reason; without it they are
    /// rejected to the queue's own dead-letter route.
    dead_letters: Option<Arc<DeadLetters>>,
}

impl Subscription {
    /// Sends this subscription's hopeless deliveries (a panicked handler,
    /// [`retry_counted`] out of tries) to `dead_letters` with their reason.
    pub fn with_dead_letters(mut self, dead_letters: DeadLetters) -> Self {
        self.dead_letters = Some(Arc::new(dead_letters));
        self
    }

    /// The acknowledgements of this subscription's channel (to count them).
    pub fn acks(&self) -> Arc<Acks> {
        self.acks.clone()
    }
}

/// Arguments of a sas queue: its type, and for work queues a dead-letter
/// route and (quorum only) a delivery limit. A declaration with other
/// arguments than an existing queue's fails (`PRECONDITION_FAILED`).
fn queue_arguments(kind: QueueType, dead_letter: Option<&str>, delivery_limit: u32) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(kind.as_str().into()),
    );
    if let Some(dead) = dead_letter {
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("".into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(dead.into()),
        );
        if kind == QueueType::Quorum {
            args.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(i64::from(delivery_limit)),
            );
        }
    }
    args
}

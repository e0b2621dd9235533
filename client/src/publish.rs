//! Publishing with confirms: a channel in confirm mode whose publishes are
//! pipelined (send many, then read their confirms), and a confirm that
//! tells a nack and a return (`mandatory`: no queue took the message) from
//! an ack. The sas services publish through this too.

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, PublisherConfirm};
use sas_protocol::limits::truncate_bytes;

/// Why a message was not accepted by the broker.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PublishError {
    /// RabbitMQ refused the message (an internal error of the broker, or
    /// a queue over its length limit): send it again later.
    #[error("broker refused the message (nack)")]
    Nacked,
    /// No queue took the message: for an order, no submission service
    /// ever declared `<prefix>.orders` (check the prefix, and that sas
    /// runs).
    #[error("no queue named {0:?}: the message was returned")]
    Unroutable(String),
    /// The message cannot be put on the wire (a routing key or property
    /// longer than AMQP's short string): nothing was sent.
    #[error("cannot publish: {0}")]
    Invalid(&'static str),
    /// The task that publishes for the caller is gone (it panicked):
    /// nothing was sent, and the broker session should start again.
    #[error("the publishing task has stopped: nothing was sent")]
    Stopped,
    /// The channel or the connection failed: whether the broker has the
    /// message is unknown, so send it again (an order with the same id is
    /// the same order).
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
}

/// Longest value of a header written, in bytes: far below the broker's
/// frame size, so that no input can make RabbitMQ close the connection.
pub const MAX_HEADER_BYTES: usize = 1024;

/// Longest AMQP short string (routing keys, `reply_to`, ids).
pub const SHORT_STRING: usize = 255;

/// One message to publish, on the default exchange unless `exchange` names another.
#[derive(Debug, Clone, Default)]
pub struct Outgoing<'a> {
    /// The exchange; empty for the default exchange (straight to the queue
    /// named by the routing key).
    pub exchange: &'a str,
    pub routing_key: &'a str,
    pub body: &'a [u8],
    pub correlation_id: Option<&'a str>,
    pub reply_to: Option<&'a str>,
    pub message_id: Option<&'a str>,
    /// The AMQP `user_id`: the connection's own user, or the broker
    /// refuses the message (contract §1b: how an application is known).
    pub user_id: Option<&'a str>,
    /// Extra headers, as text (each cut to [`MAX_HEADER_BYTES`]).
    pub headers: &'a [(&'a str, &'a str)],
    /// Return the message (a failure) when no queue takes it.
    pub mandatory: bool,
    /// Sent non-persistent (delivery mode 1): a classic queue keeps it in
    /// memory only, and a broker restart loses it. Persistent by default.
    pub transient: bool,
}

/// A channel in confirm mode.
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
}

impl Publisher {
    /// Puts `channel` in confirm mode.
    pub async fn new(channel: Channel) -> Result<Self, lapin::Error> {
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Self { channel })
    }

    /// Sends a JSON message, persistent unless `transient`; the returned confirm resolves when
    /// the broker has it.
    pub async fn send(&self, msg: &Outgoing<'_>) -> Result<PendingConfirm, PublishError> {
        // lapin cannot encode a longer short string (it panics or breaks
        // the connection): refuse here, where the caller can settle the
        // one message.
        if msg.routing_key.len() > SHORT_STRING || msg.exchange.len() > SHORT_STRING {
            return Err(PublishError::Invalid("routing key longer than 255 bytes"));
        }
        let too_long = |v: Option<&str>| v.is_some_and(|v| v.len() > SHORT_STRING);
        if too_long(msg.correlation_id)
            || too_long(msg.reply_to)
            || too_long(msg.message_id)
            || too_long(msg.user_id)
        {
            return Err(PublishError::Invalid("a property longer than 255 bytes"));
        }
        let mut props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(if msg.transient { 1 } else { 2 });
        if let Some(c) = msg.correlation_id {
            props = props.with_correlation_id(c.into());
        }
        if let Some(r) = msg.reply_to {
            props = props.with_reply_to(r.into());
        }
        if let Some(m) = msg.message_id {
            props = props.with_message_id(m.into());
        }
        if let Some(u) = msg.user_id {
            props = props.with_user_id(u.into());
        }
        if !msg.headers.is_empty() {
            let mut table = FieldTable::default();
            for (k, v) in msg.headers {
                let v = truncate_bytes(v, MAX_HEADER_BYTES);
                table.insert((*k).into(), AMQPValue::LongString(v.into()));
            }
            props = props.with_headers(table);
        }
        self.publish_with(
            msg.exchange,
            msg.routing_key,
            msg.mandatory,
            msg.body,
            props,
        )
        .await
    }

    /// Publishes `body` with `props` as they are: for copies of deliveries,
    /// whose properties the caller builds.
    pub async fn publish_with(
        &self,
        exchange: &str,
        routing_key: &str,
        mandatory: bool,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<PendingConfirm, PublishError> {
        if routing_key.len() > SHORT_STRING || exchange.len() > SHORT_STRING {
            return Err(PublishError::Invalid("routing key longer than 255 bytes"));
        }
        let confirm = self
            .channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory,
                    ..BasicPublishOptions::default()
                },
                body,
                props,
            )
            .await?;
        Ok(PendingConfirm {
            confirm,
            routing_key: routing_key.to_owned(),
        })
    }

    /// Sends one message and waits for its confirm.
    pub async fn publish(&self, msg: &Outgoing<'_>) -> Result<(), PublishError> {
        self.send(msg).await?.wait().await
    }

    /// Whether the channel is still usable.
    pub fn is_open(&self) -> bool {
        self.channel.status().connected()
    }

    /// Closes the channel.
    pub async fn close(&self) {
        if self.is_open() {
            self.channel.close(200, "bye".into()).await.ok();
        }
    }
}

/// A published message whose confirmation has not been read yet.
pub struct PendingConfirm {
    confirm: PublisherConfirm,
    routing_key: String,
}

impl PendingConfirm {
    /// Waits for the broker: `Ok` only for an ack of a message a queue took.
    ///
    /// A `basic.return` names no delivery tag: lapin hands it to whichever
    /// confirm completes next, and when one ack covers several publishes
    /// (`multiple`), that may be another publish's of the channel. A return
    /// for another routing key is therefore not this message's: taking it
    /// as ours made a confirmed dead-letter copy look unroutable and ended
    /// the session, again and again (found by the attack suite). The
    /// return's own publish then sees a plain ack, which costs at most a
    /// warning about a queue that does not exist.
    pub async fn wait(self) -> Result<(), PublishError> {
        let confirmation = self.confirm.await?;
        if confirmation.is_nack() {
            return Err(PublishError::Nacked);
        }
        match confirmation.take_message() {
            Some(returned) if returned.delivery.routing_key.as_str() == self.routing_key => {
                Err(PublishError::Unroutable(self.routing_key))
            }
            Some(returned) => {
                tracing::debug!(
                    ours = %self.routing_key,
                    returned = %returned.delivery.routing_key,
                    "a return paired with another publish's confirm; not ours"
                );
                Ok(())
            }
            None => Ok(()),
        }
    }
}

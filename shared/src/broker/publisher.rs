//! A confirm-mode channel. Publishes are pipelined: send a batch, then wait
//! for its confirmations, rather than one round trip per message.

use lapin::PublisherConfirm;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};

use super::BrokerError;

/// Why a message was not accepted by the broker.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PublishError {
    #[error("broker refused the message (nack)")]
    Nacked,
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
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
}

/// Longest value of a header that sas writes, in bytes: far below the
/// broker's frame size, so no input can make RabbitMQ close the connection.
pub const MAX_HEADER_BYTES: usize = 1024;

/// A header value that sas writes on a copy of a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header<'a> {
    /// Text, cut to [`MAX_HEADER_BYTES`].
    Text(&'a str),
    /// A count.
    Count(u32),
    /// No such header: removed from the copy (a replayed dead letter loses
    /// its reason and its count of tries).
    Remove,
}

/// The properties of a copy of a message that sas publishes: the
/// original's but for `user_id`, which RabbitMQ refuses from a connection
/// of another user (a copy of an application's message would close sas's
/// channel, again at every redelivery), and `expiration`, which would let
/// a dead letter expire before an operator sees it. Headers are set by
/// the caller.
fn copied(original: &BasicProperties) -> BasicProperties {
    let mut props = BasicProperties::default();
    if let Some(v) = original.content_type() {
        props = props.with_content_type(v.clone());
    }
    if let Some(v) = original.content_encoding() {
        props = props.with_content_encoding(v.clone());
    }
    if let Some(v) = original.delivery_mode() {
        props = props.with_delivery_mode(*v);
    }
    if let Some(v) = original.priority() {
        props = props.with_priority(*v);
    }
    if let Some(v) = original.correlation_id() {
        props = props.with_correlation_id(v.clone());
    }
    if let Some(v) = original.reply_to() {
        props = props.with_reply_to(v.clone());
    }
    if let Some(v) = original.message_id() {
        props = props.with_message_id(v.clone());
    }
    if let Some(v) = original.timestamp() {
        props = props.with_timestamp(*v);
    }
    if let Some(v) = original.kind() {
        props = props.with_type(v.clone());
    }
    if let Some(v) = original.app_id() {
        props = props.with_app_id(v.clone());
    }
    if let Some(v) = original.cluster_id() {
        props = props.with_cluster_id(v.clone());
    }
    props
}

/// Longest AMQP short string (routing keys, `reply_to`, ids).
const SHORT_STRING: usize = 255;

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
    /// Extra headers, as text.
    pub headers: &'a [(&'a str, &'a str)],
    /// Return the message (a failure) when no queue takes it.
    pub mandatory: bool,
}

/// A channel in confirm mode.
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
    /// The connection's largest frame: a copy's content header must fit one.
    frame_max: u32,
}

impl Publisher {
    pub(super) async fn new(channel: Channel, frame_max: u32) -> Result<Self, BrokerError> {
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Self { channel, frame_max })
    }

    /// Sends a persistent JSON message; the returned future resolves on the broker's confirm.
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
            .with_delivery_mode(2);
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
                let v = crate::messages::truncate_bytes(v, MAX_HEADER_BYTES);
                table.insert((*k).into(), AMQPValue::LongString(v.into()));
            }
            props = props.with_headers(table);
        }
        let confirm = self
            .channel
            .basic_publish(
                msg.exchange.into(),
                msg.routing_key.into(),
                BasicPublishOptions {
                    mandatory: msg.mandatory,
                    ..BasicPublishOptions::default()
                },
                msg.body,
                props,
            )
            .await?;
        Ok(PendingConfirm {
            confirm,
            routing_key: msg.routing_key.to_owned(),
        })
    }

    /// Publishes a copy of `delivery` (body and properties untouched, but
    /// for `headers`, set or replaced) to the queue `routing_key`, and waits
    /// for the broker to take it. Original headers too large to leave room
    /// for sas's in one frame are left out ([`super::headers::carried_over`]).
    pub async fn republish(
        &self,
        routing_key: &str,
        delivery: &super::Delivery,
        headers: &[(&str, Header<'_>)],
    ) -> Result<(), PublishError> {
        if routing_key.len() > SHORT_STRING {
            return Err(PublishError::Invalid("routing key longer than 255 bytes"));
        }
        let mut table = super::headers::carried_over(
            delivery.inner.properties.headers().as_ref(),
            self.frame_max,
        )
        .inner()
        .clone();
        for (k, v) in headers {
            let v = match v {
                Header::Text(text) => AMQPValue::LongString(
                    crate::messages::truncate_bytes(text, MAX_HEADER_BYTES).into(),
                ),
                Header::Count(n) => AMQPValue::LongUInt(*n),
                Header::Remove => {
                    table.remove(*k);
                    continue;
                }
            };
            table.insert((*k).into(), v);
        }
        let original = &delivery.inner.properties;
        if let Some(user) = original.user_id() {
            // Kept for operators: who sent it (see [`copied`]).
            table.insert(
                super::headers::USER_ID_HEADER.into(),
                AMQPValue::LongString(user.as_str().into()),
            );
        }
        let props = copied(original).with_headers(FieldTable::from(table));
        let confirm = self
            .channel
            .basic_publish(
                "".into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                delivery.body(),
                props,
            )
            .await?;
        PendingConfirm {
            confirm,
            routing_key: routing_key.to_owned(),
        }
        .wait()
        .await
    }

    /// Sends one message and waits for its confirm.
    pub async fn publish(&self, msg: &Outgoing<'_>) -> Result<(), PublishError> {
        self.send(msg).await?.wait().await
    }

    /// Whether the channel is still usable.
    pub fn is_open(&self) -> bool {
        self.channel.status().connected()
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

//! What a consumer hands out: sas's own [`Delivery`] and [`Consumer`], so
//! that nothing outside this module names a lapin type. They expose what
//! sas reads of a message (body, `reply_to`, `message_id`, headers as text)
//! and the two ways a delivery taken outside [`super::consume`] is
//! acknowledged: on its own, or with every earlier one of its channel.

use futures_util::StreamExt as _;
use lapin::options::BasicAckOptions;
use lapin::types::AMQPValue;

use super::BrokerError;

/// One message as the broker delivered it, unacknowledged.
pub struct Delivery {
    pub(super) inner: lapin::message::Delivery,
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("tag", &self.inner.delivery_tag)
            .field("redelivered", &self.inner.redelivered)
            .field("message_id", &self.message_id())
            // Their size, not their content: a stranger's headers may fill
            // a frame (and nest deep).
            .field(
                "header_bytes",
                &self
                    .inner
                    .properties
                    .headers()
                    .as_ref()
                    .map(super::headers::encoded_len),
            )
            .finish_non_exhaustive()
    }
}

impl Delivery {
    pub(super) fn new(inner: lapin::message::Delivery) -> Self {
        Self { inner }
    }

    /// The message's body.
    pub fn body(&self) -> &[u8] {
        &self.inner.data
    }

    /// The delivery's tag: counts up per channel from 1.
    pub fn tag(&self) -> u64 {
        self.inner.delivery_tag
    }

    /// Whether the broker delivered this message before (to any consumer)
    /// without an acknowledgement.
    pub fn redelivered(&self) -> bool {
        self.inner.redelivered
    }

    /// Why the message's headers are refused unread, if they are
    /// ([`super::headers::refusal`]).
    pub fn headers_refusal(&self) -> Option<String> {
        super::headers::refusal(self.inner.properties.headers().as_ref())
    }

    /// A header as text, if present and text.
    pub fn header(&self, name: &str) -> Option<String> {
        let headers = self.inner.properties.headers().as_ref()?;
        match headers.inner().get(name)? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
            _ => None,
        }
    }

    /// The AMQP `reply_to`.
    pub fn reply_to(&self) -> Option<&str> {
        self.inner
            .properties
            .reply_to()
            .as_ref()
            .map(|s| s.as_str())
    }

    /// The AMQP `user_id`: the sender's RabbitMQ user, which RabbitMQ
    /// checks against the connection's (contract §1b).
    pub fn user_id(&self) -> Option<&str> {
        self.inner.properties.user_id().as_ref().map(|s| s.as_str())
    }

    /// The sender a copy says its original had (`x-sas-user-id`), believed
    /// only when sas's own user sent the copy
    /// ([`sas_core::applications::Applications::sender`]).
    pub fn carried_sender(&self) -> Option<String> {
        self.header(super::headers::USER_ID_HEADER)
    }

    /// Whether the message was sent persistent (AMQP `delivery-mode` 2):
    /// a durable queue keeps it across a broker restart.
    pub fn persistent(&self) -> bool {
        *self.inner.properties.delivery_mode() == Some(2)
    }

    /// The AMQP `message_id`.
    pub fn message_id(&self) -> Option<&str> {
        self.inner
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str())
    }

    /// Acknowledges this delivery alone (for deliveries taken outside
    /// [`super::consume`], which batches its own acks).
    pub async fn ack(&self) -> Result<(), BrokerError> {
        self.inner.acker.ack(BasicAckOptions::default()).await?;
        Ok(())
    }

    /// Acknowledges this delivery and every earlier unacknowledged one of
    /// its channel, in one frame (AMQP's `multiple`).
    pub async fn ack_up_to(&self) -> Result<(), BrokerError> {
        self.inner
            .acker
            .ack(BasicAckOptions { multiple: true })
            .await?;
        Ok(())
    }
}

/// Deliveries of one queue, from [`super::Broker::consume`], on a channel
/// of its own.
pub struct Consumer {
    /// Closed by [`Consumer::close`], which hands back what is unacknowledged.
    channel: lapin::Channel,
    inner: lapin::Consumer,
}

impl Consumer {
    pub(super) fn new(channel: lapin::Channel, inner: lapin::Consumer) -> Self {
        Self { channel, inner }
    }

    /// The queue consumed.
    pub fn queue(&self) -> String {
        self.inner.queue().to_string()
    }

    /// The next delivery; `None` once the broker cancelled the consumer
    /// (its channel closed or its queue was deleted). Cancel-safe: a
    /// delivery is never lost by dropping the future.
    pub async fn next(&mut self) -> Option<Result<Delivery, BrokerError>> {
        let next = self.inner.next().await?;
        Some(next.map(Delivery::new).map_err(BrokerError::from))
    }

    /// Stops consuming: closes the channel, so the broker hands what was
    /// delivered but not acknowledged to another consumer.
    pub async fn close(self, reason: &str) {
        self.channel.close(200, reason.into()).await.ok();
    }
}

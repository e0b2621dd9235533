//! A confirm-mode channel. Publishes are pipelined: send a batch, then wait
//! for its confirmations, rather than one round trip per message. The
//! publishing itself is the client's ([`sas_client::publish`]), so that
//! applications and services publish alike; sas adds copies of deliveries.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
pub use sas_client::publish::{MAX_HEADER_BYTES, Outgoing, PendingConfirm, PublishError};

use super::BrokerError;

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
/// channel, again at every redelivery): the copy's is sas's own, and the
/// original's sender goes in `x-sas-user-id`; and `expiration`, which
/// would let a dead letter expire before an operator sees it. Headers are
/// set by the caller.
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

/// A channel in confirm mode.
#[derive(Clone)]
pub struct Publisher {
    inner: sas_client::publish::Publisher,
    /// The connection's largest frame: a copy's content header must fit one.
    frame_max: u32,
    /// The user the connection logged in as, when its URL names it: the
    /// `user_id` of the copies it publishes, which RabbitMQ vouches for.
    user: Option<String>,
}

impl Publisher {
    pub(super) async fn new(
        channel: lapin::Channel,
        frame_max: u32,
        user: Option<String>,
    ) -> Result<Self, BrokerError> {
        let inner = sas_client::publish::Publisher::new(channel).await?;
        Ok(Self {
            inner,
            frame_max,
            user,
        })
    }

    /// Who sent `original`: the sender its copy carries when this
    /// publisher's user sent it (a copy of a copy), else its `user_id`.
    fn sender_of(&self, original: &BasicProperties) -> Option<String> {
        let user = original.user_id().as_ref()?.as_str();
        if self.user.as_deref() != Some(user) {
            return Some(user.to_owned());
        }
        let carried = original
            .headers()
            .as_ref()?
            .inner()
            .get(super::headers::USER_ID_HEADER)?;
        match carried {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            _ => None,
        }
    }

    /// Sends a persistent JSON message; the returned future resolves on the broker's confirm.
    pub async fn send(&self, msg: &Outgoing<'_>) -> Result<PendingConfirm, PublishError> {
        self.inner.send(msg).await
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
        let mut table = super::headers::carried_over(
            delivery.inner.properties.headers().as_ref(),
            self.frame_max,
        )
        .inner()
        .clone();
        for (k, v) in headers {
            let v = match v {
                Header::Text(text) => AMQPValue::LongString(
                    sas_core::messages::truncate_bytes(text, MAX_HEADER_BYTES).into(),
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
        // Who sent the original, kept on the copy (see [`copied`]): believed
        // by the services because the copy's `user_id` is sas's own; a
        // stranger's header of that name never passes on.
        match self.sender_of(original) {
            Some(sender) => {
                table.insert(
                    super::headers::USER_ID_HEADER.into(),
                    AMQPValue::LongString(sender.as_str().into()),
                );
            }
            None => {
                table.remove(super::headers::USER_ID_HEADER);
            }
        }
        let mut props = copied(original).with_headers(FieldTable::from(table));
        if let Some(user) = &self.user {
            props = props.with_user_id(user.as_str().into());
        }
        self.inner
            .publish_with("", routing_key, true, delivery.body(), props)
            .await?
            .wait()
            .await
    }

    /// Sends one message and waits for its confirm.
    pub async fn publish(&self, msg: &Outgoing<'_>) -> Result<(), PublishError> {
        self.send(msg).await?.wait().await
    }

    /// Whether the channel is still usable.
    pub fn is_open(&self) -> bool {
        self.inner.is_open()
    }

    /// Closes the channel (its confirms awaited already).
    pub async fn close(&self) {
        self.inner.close().await;
    }
}

//! [`StatusStream`]: the status events of one queue, typed, deduplicated on
//! (`order_id`, `seq`), each acknowledged once the caller asks for the next
//! (or closes the stream): an event the application has not finished with
//! when it crashes comes again. When the connection is lost the stream
//! consumes again on a new one; what was delivered and not acknowledged
//! comes again, and the deduplication drops what was yielded already.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::future::BoxFuture;
use futures_util::{Stream, StreamExt as _};
use lapin::options::BasicAckOptions;

use crate::dedupe::Seen;
use crate::{Client, Error, Session, StatusEvent};

/// Events remembered for deduplication; see [`crate::dedupe`].
const REMEMBERED: usize = 100_000;

/// A consumer on a channel of its own, and the connection it is on.
pub(crate) struct Consuming {
    pub(crate) session: Arc<Session>,
    pub(crate) channel: lapin::Channel,
    pub(crate) consumer: lapin::Consumer,
}

/// The status events of a queue, from [`Client::status`].
///
/// A [`Stream`] of `Result<StatusEvent, Error>`. An `Err` is one of:
/// - [`Error::NotAStatusEvent`]: a message that is not a status event,
///   acknowledged; the stream goes on;
/// - [`Error::Connect`]: the connection was lost and no new one could be
///   made within the connect timeout; the next poll tries again;
/// - [`Error::StreamEnded`] or another error: the queue or its channel is
///   gone while the connection is up; the stream ends.
///
/// Call [`StatusStream::close`] when done, so that the last event is
/// acknowledged; dropping the stream hands it back to the queue.
pub struct StatusStream {
    /// The consumer, between two events.
    idle: Option<Box<Reader>>,
    /// The next event being read, holding the consumer meanwhile: kept
    /// across polls, so a caller that gives up waiting loses nothing.
    reading: Option<BoxFuture<'static, Read>>,
}

/// A read finished: the reader back, and what it read (`None`: the end).
type Read = (Box<Reader>, Option<Result<StatusEvent, Error>>);

/// The consumer and what the stream remembers.
struct Reader {
    client: Client,
    queue: String,
    /// `None` between a lost connection and the next consumer.
    consuming: Option<Consuming>,
    /// The delivery of the last event yielded, acked when the next is asked for.
    unacked: Option<lapin::message::Delivery>,
    seen: Seen,
    /// The consumer stopped for good; nothing more comes.
    ended: bool,
}

impl StatusStream {
    pub(crate) fn new(client: Client, queue: &str, consuming: Consuming) -> Self {
        Self {
            idle: Some(Box::new(Reader {
                client,
                queue: queue.to_owned(),
                consuming: Some(consuming),
                unacked: None,
                seen: Seen::new(REMEMBERED),
                ended: false,
            })),
            reading: None,
        }
    }

    /// Acknowledges the last event yielded and stops consuming; what was
    /// delivered and not yielded goes back to the queue.
    pub async fn close(mut self) -> Result<(), Error> {
        // A read still in flight is dropped: its delivery, not yet
        // yielded, goes back to the queue with the channel.
        self.reading = None;
        let Some(mut reader) = self.idle.take() else {
            return Ok(());
        };
        let acked = match reader.unacked.take() {
            Some(d) => d.acker.ack(BasicAckOptions::default()).await.map(drop),
            None => Ok(()),
        };
        if let Some(consuming) = reader.consuming.take() {
            consuming
                .channel
                .close(200, "status stream closed".into())
                .await
                .ok();
        }
        // An ack on a lost connection is no failure: the event comes again
        // to whoever reads next, as an unacknowledged one does.
        match acked {
            Err(_) if !reader.client.is_connected() => Ok(()),
            other => other.map_err(Error::from),
        }
    }
}

impl Reader {
    /// The next event not seen before; acks the one yielded last.
    async fn next(&mut self) -> Option<Result<StatusEvent, Error>> {
        if self.ended {
            return None;
        }
        if let Some(done) = self.unacked.take()
            && let Err(e) = done.acker.ack(BasicAckOptions::default()).await
            && !self.lost()
        {
            self.ended = true;
            return Some(Err(e.into()));
        }
        loop {
            let Some(consuming) = self.consuming.as_mut() else {
                match self.client.consume(&self.queue).await {
                    Ok(c) => {
                        tracing::info!(queue = %self.queue, "status stream consuming again");
                        self.consuming = Some(c);
                        continue;
                    }
                    Err(e @ Error::Connect(_)) => return Some(Err(e)),
                    Err(e) => {
                        self.ended = true;
                        return Some(Err(e));
                    }
                }
            };
            let delivery = match consuming.consumer.next().await {
                Some(Ok(d)) => d,
                end => {
                    if self.lost() {
                        tracing::warn!(queue = %self.queue, "status stream: the connection is lost; consuming again on a new one");
                        self.consuming = None;
                        continue;
                    }
                    self.ended = true;
                    return Some(Err(match end {
                        Some(Err(e)) => e.into(),
                        _ => Error::StreamEnded(self.queue.clone()),
                    }));
                }
            };
            let event = match serde_json::from_slice::<StatusEvent>(&delivery.data) {
                Ok(event) => event,
                Err(e) => {
                    // Acked with the next call all the same: a stray message
                    // must not stop the stream.
                    self.unacked = Some(delivery);
                    return Some(Err(Error::NotAStatusEvent {
                        queue: self.queue.clone(),
                        reason: e.to_string(),
                    }));
                }
            };
            if self.seen.first_time(&event.order_id, event.seq) {
                self.unacked = Some(delivery);
                return Some(Ok(event));
            }
            tracing::debug!(order_id = %event.order_id, seq = event.seq, "duplicate status event dropped");
            if let Err(e) = delivery.acker.ack(BasicAckOptions::default()).await
                && !self.lost()
            {
                self.ended = true;
                return Some(Err(e.into()));
            }
        }
    }

    /// Whether the consumer's connection is gone (rather than its queue or
    /// channel): then a new consumer on a new connection takes over.
    fn lost(&self) -> bool {
        self.consuming
            .as_ref()
            .is_none_or(|c| !c.session.connected())
    }
}

impl Drop for Reader {
    /// A stream dropped without [`StatusStream::close`] closes its channel
    /// all the same, so that what it was delivered and did not acknowledge
    /// goes back to the queue now, not when the client's connection closes.
    fn drop(&mut self) {
        if let Some(consuming) = self.consuming.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(async move {
                consuming
                    .channel
                    .close(200, "status stream dropped".into())
                    .await
                    .ok();
            });
        }
    }
}

impl Stream for StatusStream {
    type Item = Result<StatusEvent, Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.reading.is_none() {
            let Some(mut reader) = this.idle.take() else {
                return Poll::Ready(None);
            };
            this.reading = Some(Box::pin(async move {
                let item = reader.next().await;
                (reader, item)
            }));
        }
        let Some(reading) = this.reading.as_mut() else {
            return Poll::Ready(None);
        };
        match reading.as_mut().poll(cx) {
            Poll::Ready((reader, item)) => {
                this.reading = None;
                this.idle = Some(reader);
                Poll::Ready(item)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

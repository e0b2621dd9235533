//! [`StatusStream`]: the status events of one queue, typed, deduplicated on
//! (`order_id`, `seq`), each acknowledged once the caller asks for the next
//! (or closes the stream): an event the application has not finished with
//! when it crashes comes again.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::Stream;
use futures_util::future::BoxFuture;
use sas::broker::{Consumer, Delivery};
use sas::messages::StatusEvent;

use crate::Error;
use crate::dedupe::Seen;

/// Events remembered for deduplication; see [`crate::dedupe`].
const REMEMBERED: usize = 100_000;

/// The status events of a queue, from [`crate::Client::status`].
///
/// A [`Stream`] of `Result<StatusEvent, Error>`: an `Err` is either a
/// message that is not a status event ([`Error::NotAStatusEvent`], acked,
/// and the stream goes on) or the end of the consumer
/// ([`Error::StreamEnded`] or a broker error, after which the stream ends).
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
    queue: String,
    /// `None` once closed.
    consumer: Option<Consumer>,
    /// The delivery of the last event yielded, acked when the next is asked for.
    unacked: Option<Delivery>,
    seen: Seen,
    /// The consumer stopped; nothing more comes.
    ended: bool,
}

impl StatusStream {
    pub(crate) fn new(queue: &str, consumer: Consumer) -> Self {
        Self {
            idle: Some(Box::new(Reader {
                queue: queue.to_owned(),
                consumer: Some(consumer),
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
            Some(d) => d.ack().await.map_err(Error::from),
            None => Ok(()),
        };
        if let Some(consumer) = reader.consumer.take() {
            consumer.close("status stream closed").await;
        }
        acked
    }
}

impl Reader {
    /// The next event not seen before; acks the one yielded last.
    async fn next(&mut self) -> Option<Result<StatusEvent, Error>> {
        if self.ended {
            return None;
        }
        if let Some(done) = self.unacked.take()
            && let Err(e) = done.ack().await
        {
            self.ended = true;
            return Some(Err(e.into()));
        }
        loop {
            let Some(consumer) = self.consumer.as_mut() else {
                self.ended = true;
                return None;
            };
            let delivery = match consumer.next().await {
                Some(Ok(d)) => d,
                Some(Err(e)) => {
                    self.ended = true;
                    return Some(Err(e.into()));
                }
                None => {
                    self.ended = true;
                    return Some(Err(Error::StreamEnded(self.queue.clone())));
                }
            };
            let event = match serde_json::from_slice::<StatusEvent>(delivery.body()) {
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
            if let Err(e) = delivery.ack().await {
                self.ended = true;
                return Some(Err(e.into()));
            }
        }
    }
}

impl Drop for Reader {
    /// A stream dropped without [`StatusStream::close`] closes its channel
    /// all the same, so that what it was delivered and did not acknowledge
    /// goes back to the queue now, not when the client's connection closes.
    fn drop(&mut self) {
        if let Some(consumer) = self.consumer.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(consumer.close("status stream dropped"));
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

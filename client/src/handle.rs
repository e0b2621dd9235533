//! [`Handle`]: one order, as its application follows it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{Cancelled, Client, Error, OrderId, OrderView, Terminal};

/// An order submitted (or named by its id with [`Client::order`]): wait
/// for its end, read its results, its state, cancel it, signal it.
#[derive(Clone)]
pub struct Handle {
    client: Client,
    order_id: OrderId,
    /// The terminal event once read: a queue delivers it once, and every
    /// later wait or result of this handle (and its clones) answers from it.
    ended: Arc<Mutex<Option<Terminal>>>,
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle")
            .field("order_id", &self.order_id)
            .finish()
    }
}

impl Handle {
    pub(crate) fn new(client: Client, order_id: OrderId) -> Self {
        Self {
            client,
            order_id,
            ended: Arc::default(),
        }
    }

    /// The order's id.
    pub fn id(&self) -> OrderId {
        self.order_id
    }

    /// The order's terminal event, read from the client's status queue,
    /// within `timeout`.
    pub async fn wait(&self, timeout: Duration) -> Result<Terminal, Error> {
        self.ended(Some(timeout)).await
    }

    /// The terminal event: the one read before, or the next on the queue.
    async fn ended(&self, timeout: Option<Duration>) -> Result<Terminal, Error> {
        if let Some(terminal) = self.lock().clone() {
            return Ok(terminal);
        }
        let terminal = self.client.wait_for(self.order_id, timeout).await?;
        *self.lock() = Some(terminal.clone());
        Ok(terminal)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Terminal>> {
        self.ended.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The results of the order's steps (`detail.results` of `processed`,
    /// by step name) read as `R`, once it ends, however long that takes;
    /// [`Error::OrderFailed`] when it ends otherwise.
    pub async fn result<R: DeserializeOwned>(&self) -> Result<R, Error> {
        self.ended(None).await?.results()
    }

    /// [`Handle::result`] within `timeout` ([`Error::Timeout`] after).
    pub async fn result_within<R: DeserializeOwned>(&self, timeout: Duration) -> Result<R, Error> {
        self.wait(timeout).await?.results()
    }

    /// The order as sas holds it now: state, steps, events (HTTP API).
    pub async fn status(&self) -> Result<OrderView, Error> {
        self.client.api()?.order(self.order_id).await
    }

    /// Cancels the order (HTTP API): steps running finish or time out,
    /// then whatever was done is undone (contract §4c). A `409`
    /// ([`Error::Refused`]) when it has ended already.
    pub async fn cancel(&self) -> Result<Cancelled, Error> {
        self.client.api()?.cancel(self.order_id).await
    }

    /// Sends the signal `name` with `data` to the order (HTTP API), for a
    /// step waiting for it (contract §4d); refused (`409`) when nothing
    /// waits for it.
    pub async fn signal<T: Serialize + ?Sized>(
        &self,
        name: &str,
        data: &T,
    ) -> Result<serde_json::Value, Error> {
        self.client.api()?.signal(self.order_id, name, data).await
    }
}

//! An operator's action on one order from a tool (`sasctl orders …`, the
//! dashboard's buttons) rather than from a service's broker session. The
//! transition runs with a relay of the action's own, on a connection of its
//! own, so what it commits (the next step's request, a status event) is
//! published at once, as what the services commit is, not at the next sweep
//! of the services' relays. When the broker cannot be reached within
//! [`CONNECT_WITHIN`], the action still runs, and what it commits waits in
//! the outbox for those sweeps.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use uuid::Uuid;

use crate::broker::Broker;
use crate::config::Settings;
use crate::engine::{Actor, Operated, Transitions};
use crate::metrics::Metrics;
use crate::outbox::{Relay, RelayTask};
use crate::state_store::{StateStore, StoreError};
use crate::topology::QueueNames;

/// How long a tool waits for the broker before it leaves its action's
/// messages to the services' relays: an operator waits for the answer.
pub const CONNECT_WITHIN: Duration = Duration::from_secs(2);

/// What an operator asks of one order (contract §4c, §4d).
#[derive(Debug, Clone, Copy)]
pub enum Operation<'a> {
    /// Run an order in `error` again.
    Retry,
    /// Stop an order and undo what it did.
    Cancel,
    /// Run an ended order again, its payload changed by a JSON merge
    /// `patch`, the result no larger than `max_bytes`.
    Redrive {
        patch: Option<&'a Value>,
        max_bytes: usize,
    },
    /// The signal `name`, with `data`, for the step waiting for it.
    Signal { name: &'a str, data: &'a Value },
}

/// Runs `operation` on order `order_id` as `operator`, from the tool `app`
/// (its name on the broker connection and in the relay's metrics), and
/// publishes what it commits before it returns.
pub async fn operate(
    store: &StateStore,
    settings: &Settings,
    app: &str,
    operator: &Actor,
    order_id: Uuid,
    operation: Operation<'_>,
) -> Result<Operated, StoreError> {
    let relay = Relay::for_handovers(
        store.clone(),
        settings.outbox.clone(),
        settings.broker.step_messages,
        Arc::new(Metrics::new(app)),
    );
    let publishing = start(settings, app, &relay).await;
    let queues = QueueNames::new(&settings.broker.prefix);
    let transitions = Transitions::with_outlet(store.clone(), queues, Arc::new(relay));
    let operated = match operation {
        Operation::Retry => transitions.retry(operator, order_id).await,
        Operation::Cancel => transitions.cancel(operator, order_id).await,
        Operation::Redrive { patch, max_bytes } => {
            let redriven = transitions.redrive(operator, order_id, patch, max_bytes);
            redriven.await
        }
        Operation::Signal { name, data } => {
            transitions.signal(operator, order_id, name, data).await
        }
    };
    if let Some((broker, task)) = publishing {
        // Waits for what the action handed over to be confirmed.
        if let Err(e) = task.stop(Ok(())).await {
            tracing::warn!(%order_id, error = %e, "the action's messages wait for the services' relays");
        }
        broker.close().await;
    }
    operated
}

/// The action's relay started on a connection of its own, or `None` (the
/// relay never ready: its messages wait for the services' relays).
async fn start(settings: &Settings, app: &str, relay: &Arc<Relay>) -> Option<(Broker, RelayTask)> {
    let mut quick = settings.broker.clone();
    quick.connect_timeout = quick.connect_timeout.min(CONNECT_WITHIN);
    let started = async {
        let broker = Broker::connect(&quick, app).await?;
        match relay.start(&broker).await {
            Ok(task) => Ok((broker, task)),
            Err(e) => {
                broker.close().await;
                Err(e)
            }
        }
    };
    match started.await {
        Ok(started) => Some(started),
        Err(e) => {
            tracing::warn!(error = %e, "cannot reach RabbitMQ: the action's messages wait for the services' relays");
            None
        }
    }
}

//! One service's way of changing orders: its [`Transitions`], whose outlet
//! is its outbox [`Relay`], as one value. What a transition commits is
//! published once it has, never inside a transaction; the relay starts
//! with each broker session ([`Pipeline::start`]).

use std::sync::Arc;

use crate::broker::{Broker, BrokerError};
use crate::engine::Transitions;
use crate::outbox::{Relay, RelayTask};
use crate::service::Context;
use crate::state_store::StateStore;

/// A service's transitions with its relay. Its transitions are
/// [`Transitions`]' own (it derefs to them).
#[derive(Debug, Clone)]
pub struct Pipeline {
    transitions: Transitions,
    relay: Arc<Relay>,
}

impl Pipeline {
    /// The pipeline of the service of `ctx`, over `store`.
    pub fn new(ctx: &Context, store: StateStore) -> Self {
        let relay = Relay::new(
            store.clone(),
            ctx.settings.outbox.clone(),
            ctx.settings.broker.step_messages,
            ctx.metrics.clone(),
        );
        Self {
            transitions: Transitions::with_outlet(
                store,
                ctx.queues.clone(),
                Arc::new(relay.clone()),
            )
            .keeping_room_for(ctx.settings.submission.room_fresh_for),
            relay,
        }
    }

    /// The same pipeline, its transitions keeping up to `max` orders that
    /// wait for a reply ([`Transitions::keeping_orders`]).
    #[must_use]
    pub fn keeping_orders(mut self, max: usize) -> Self {
        self.transitions = self.transitions.keeping_orders(max);
        self
    }

    /// The same pipeline, its relay a service instance's that beats as
    /// `instance` ([`Relay::publishing_as`]): the step requests it hands
    /// over stay in the outbox until their replies delete them.
    #[must_use]
    pub fn publishing_as(self, instance: &str) -> Self {
        self.relay.publishing_as(instance);
        self
    }

    /// Starts the relay for a broker session; stop it when the session ends.
    pub async fn start(&self, broker: &Broker) -> Result<RelayTask, BrokerError> {
        self.relay.start(broker).await
    }
}

// The pipeline is its transitions, with a relay to start: every verb of
// `Transitions` is the pipeline's, with no forwarding written twice.
impl std::ops::Deref for Pipeline {
    type Target = Transitions;

    fn deref(&self) -> &Transitions {
        &self.transitions
    }
}

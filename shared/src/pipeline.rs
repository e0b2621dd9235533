//! One service's way of changing orders: its [`Transitions`] and its outbox
//! [`Relay`] as one value. Each transition asks the relay whether it would
//! publish at once, runs, and hands what it committed over; the service sees
//! only the outcome. Messages are published after their transition's commit,
//! never inside a transaction ([`crate::state_store::Committed`]).

use std::sync::Arc;

use crate::broker::{Broker, BrokerError};
use crate::config::{Settings, SupervisorSettings};
use crate::messages::StepReply;
use crate::outbox::{Relay, RelayTask};
use crate::service::Context;
use crate::state_store::{
    Actor, ClaimBounds, Claimed, Done, Expired, NewOrder, Operated, ReplyOutcome, StateStore,
    StoreError, Submitted, Transitions,
};
use crate::workflow::Workflow;
use uuid::Uuid;

/// A service's transitions with its relay.
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
            transitions: Transitions::new(store, ctx.queues.clone()),
            relay,
        }
    }

    /// The state store underneath.
    pub fn store(&self) -> &StateStore {
        self.transitions.store()
    }

    /// Starts the relay for a broker session; stop it when the session ends.
    pub async fn start(&self, broker: &Broker) -> Result<RelayTask, BrokerError> {
        self.relay.start(broker).await
    }

    /// Hands what a transition committed to the relay; returns its outcome.
    fn settle<T>(&self, done: Done<T>) -> T {
        self.relay.hand_over(done.committed);
        done.value
    }

    /// [`Transitions::submit`].
    pub async fn submit(
        &self,
        order: &NewOrder,
        workflow: &Workflow,
    ) -> Result<Submitted, StoreError> {
        let hand_over = self.relay.ready();
        let done = self.transitions.submit(order, workflow, hand_over).await?;
        Ok(self.settle(done))
    }

    /// [`Transitions::submit_many`].
    pub async fn submit_many(
        &self,
        batch: &[(&NewOrder, &Workflow)],
    ) -> Result<Vec<Submitted>, StoreError> {
        let hand_over = self.relay.ready();
        let done = self.transitions.submit_many(batch, hand_over).await?;
        Ok(self.settle(done))
    }

    /// [`Transitions::claim`].
    pub async fn claim(&self, me: &Actor, bounds: ClaimBounds) -> Result<Claimed, StoreError> {
        let hand_over = self.relay.ready();
        let done = self.transitions.claim(me, bounds, hand_over).await?;
        Ok(self.settle(done))
    }

    /// [`Transitions::apply_replies`].
    pub async fn apply_replies(
        &self,
        me: &Actor,
        replies: &[StepReply],
    ) -> Result<Vec<ReplyOutcome>, StoreError> {
        let hand_over = self.relay.ready();
        let done = self
            .transitions
            .apply_replies(me, replies, hand_over)
            .await?;
        Ok(self.settle(done))
    }

    /// [`Transitions::recover_expired`].
    pub async fn recover_expired(
        &self,
        me: &Actor,
        settings: &Settings,
        partitions: &[i32],
    ) -> Result<Vec<Expired>, StoreError> {
        let hand_over = self.relay.ready();
        let done = self
            .transitions
            .recover_expired(me, settings, partitions, hand_over)
            .await?;
        Ok(self.settle(done))
    }

    /// [`Transitions::warn_late`].
    pub async fn warn_late(
        &self,
        me: &Actor,
        settings: &SupervisorSettings,
    ) -> Result<usize, StoreError> {
        let hand_over = self.relay.ready();
        let done = self.transitions.warn_late(me, settings, hand_over).await?;
        Ok(self.settle(done))
    }

    /// [`Transitions::signal`]: the step waiting for it completes, and what
    /// the order does next is published at once.
    pub async fn signal(
        &self,
        actor: &Actor,
        order_id: Uuid,
        name: &str,
        data: &serde_json::Value,
    ) -> Result<Operated, StoreError> {
        let hand_over = self.relay.ready();
        let done = self
            .transitions
            .signal(actor, order_id, name, data, hand_over)
            .await?;
        Ok(self.settle(done))
    }

    /// [`Transitions::cancel`], its undoing published at once.
    pub async fn cancel(&self, actor: &Actor, order_id: Uuid) -> Result<Operated, StoreError> {
        let hand_over = self.relay.ready();
        let done = self.transitions.cancel(actor, order_id, hand_over).await?;
        Ok(self.settle(done))
    }

    /// [`Transitions::undo_child`], its undoing published at once.
    pub async fn undo_child(&self, actor: &Actor, order_id: Uuid) -> Result<Operated, StoreError> {
        let hand_over = self.relay.ready();
        let done = self
            .transitions
            .undo_child(actor, order_id, hand_over)
            .await?;
        Ok(self.settle(done))
    }
}

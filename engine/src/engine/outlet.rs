//! The engine's port to whoever publishes what transitions commit: the
//! service's outbox relay ([`crate::outbox::Relay`]), or nobody (the
//! messages wait for the relays' sweeps). The store never learns which.

use std::sync::Arc;

use sas_store::Committed;

/// Where a transition's committed messages go.
pub trait Outlet: Send + Sync + std::fmt::Debug {
    /// Whether messages handed over now would be published at once: then
    /// a transition takes its orders' outbox locks and hands the messages
    /// over with the connection that holds them.
    fn ready(&self) -> bool;

    /// Takes what a transition committed.
    fn hand_over(&self, committed: Committed);

    /// The instance, beating while it runs, whose hand-overs leave the
    /// step requests they send in the outbox until their replies delete
    /// them; `None`: every message is deleted once published.
    fn publisher(&self) -> Option<String> {
        None
    }

    /// Messages handed over and confirmed that are left to delete, for a
    /// write-back to take; give back what it did not delete.
    fn take_published(&self) -> Vec<i64> {
        Vec::new()
    }

    /// Gives back messages taken with [`Outlet::take_published`] and not
    /// deleted.
    fn keep_published(&self, ids: Vec<i64>) {
        drop(ids);
    }
}

/// No publisher of its own: the messages wait in the outbox for the
/// services' relays (an operator's tool, a test). Dropped, a [`Committed`]
/// lets its locks go with its connection.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sweep;

impl Outlet for Sweep {
    fn ready(&self) -> bool {
        false
    }

    fn hand_over(&self, _committed: Committed) {}
}

impl Outlet for Arc<crate::outbox::Relay> {
    fn ready(&self) -> bool {
        crate::outbox::Relay::ready(self)
    }

    fn hand_over(&self, committed: Committed) {
        crate::outbox::Relay::hand_over(self, committed);
    }

    fn publisher(&self) -> Option<String> {
        self.instance().map(str::to_owned)
    }

    fn take_published(&self) -> Vec<i64> {
        crate::outbox::Relay::take_published(self)
    }

    fn keep_published(&self, ids: Vec<i64>) {
        crate::outbox::Relay::keep_published(self, ids);
    }
}

//! The read models operators look at: the dashboard's overview
//! ([`crate::Overview`]), the order search ([`crate::OrderSearch`]) and
//! the stats snapshot ([`crate::Stats`]). They change nothing, and stand
//! apart from the verbs that transitions use.

use super::StateStore;

/// The read models, over a state store's connections.
#[derive(Debug, Clone)]
pub struct ReadModels {
    pub(crate) store: StateStore,
}

impl ReadModels {
    /// The read models of `store`.
    pub fn new(store: StateStore) -> Self {
        Self { store }
    }
}

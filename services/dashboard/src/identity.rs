//! Who is looking: an authenticated caller of the dashboard, as the login
//! ([`crate::auth`]) names it and a session ([`crate::sessions`]) keeps it.

use sas::config::Role;
use sas::engine::Actor;

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// A plain word (see [`sas::config::valid_name`]).
    pub name: String,
    pub role: Role,
}

impl Identity {
    /// The event log's actor for this caller's actions: `operator:<name>`.
    pub fn actor(&self) -> Actor {
        Actor {
            name: format!("operator:{}", self.name),
        }
    }
}

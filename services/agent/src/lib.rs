//! `agent`: serves step requests for the configured agents, calling each
//! one's remote service with retries until the step's complete-by.
//!
//! Modules: `agent` (the consumers and the request's way through),
//! `remote` (one call to the remote service), `deadline` (a step's
//! complete-by as the agent keeps it), `breaker` (this instance's breaker
//! per endpoint), `shared` (its side of the breaker all instances share),
//! `report` (breaker states for the dashboard) and `replies` (replies
//! sent and confirmed).

mod agent;
mod breaker;
mod deadline;
mod remote;
mod replies;
mod report;
mod shared;

use sas::config::Settings;
use sas::service::{App, Spec, StoreUse};

/// How an agent starts.
pub const SPEC: Spec = Spec {
    name: "agent",
    default_port: 9103,
    // Reports and breaker reads are small and few: a handful of
    // connections, reached off the requests' path.
    store: StoreUse::Background { max_connections: 4 },
};

/// Starts an agent with `settings` serving the agents named in `only`
/// (every configured agent when empty): the binary with the
/// configuration's; tests in-process, on `http.port = 0`.
pub async fn build(settings: Settings, only: Vec<String>) -> anyhow::Result<App> {
    App::start(SPEC, settings, move |ctx| agent::run(ctx, only)).await
}

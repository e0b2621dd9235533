//! `scheduler`: claims pending orders, runs their steps through the agents
//! and records each reply with a guarded transition.

mod scheduler;

use sas::config::Settings;
use sas::service::{App, Spec, StoreUse};
use sas::state_store::Plans;

/// How a scheduler starts.
pub const SPEC: Spec = Spec {
    name: "scheduler",
    default_port: 9102,
    store: StoreUse::Required(Plans::Generic),
};

/// Starts a scheduler with `settings` (the binary with the configuration's;
/// tests in-process, on `http.port = 0`).
pub async fn build(settings: Settings) -> anyhow::Result<App> {
    App::start(SPEC, settings, scheduler::run).await
}

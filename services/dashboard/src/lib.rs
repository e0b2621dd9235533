//! `dashboard`: the operator's web page. Shows orders per state, throughput
//! and latency, orders waiting for a re-attempt, failed orders with retry and
//! cancel, breakers per agent endpoint and each order's timeline, refreshing
//! itself; finds orders (by id, state, workflow, time and payload field) and
//! shows the dead-letter queues (replay and purge). Reads Postgres, and
//! RabbitMQ for the dead letters only; retry and cancel are `sasctl`'s
//! transitions, replay and purge `sasctl dead-letters`' code.
//! Who may see and who may act is `[dashboard]`'s business (see `auth`).
//!
//! Modules: `api` (the routes), `assets` (the pages), `search` (the
//! order search), `dead_letters` (the dead-letter queues), `auth` (who
//! calls and may they act), `identity` (who is looking), `login` and
//! `sessions` (`token` mode's login and its sessions), `throttle`
//! (wrong secrets, counted), `hosts` (the Host and Origin allow-list) and
//! `forwarded` (what a trusted proxy says of the client).

mod api;
mod assets;
mod auth;
mod dead_letters;
mod forwarded;
mod hosts;
mod identity;
mod login;
mod search;
mod sessions;
mod throttle;

use sas::config::Settings;
use sas::service::{App, Spec, StoreUse};
use sas::state_store::Plans;

/// How a dashboard starts.
pub const SPEC: Spec = Spec {
    name: "dashboard",
    default_port: 9105,
    store: StoreUse::Required(Plans::PerExecution),
};

/// Starts a dashboard with `settings` (the binary with the configuration's;
/// tests in-process, on `http.port = 0`).
pub async fn build(settings: Settings) -> anyhow::Result<App> {
    App::start_with_routes(SPEC, settings, |ctx| {
        let routes = api::routes(ctx.clone());
        // The pages are all there is: serve them until stopped.
        (routes, async move {
            ctx.shutdown.cancelled().await;
            Ok(())
        })
    })
    .await
}

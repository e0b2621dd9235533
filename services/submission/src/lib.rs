//! `submission`: consumes `<prefix>.orders`, stores each valid order with its
//! state record and `received` event in one transaction, dead-letters the rest;
//! serves replay requests (`<prefix>.replay`, contract §9) from the event log,
//! and the HTTP API of orders on its port (`/v1`, contract §9a), which stores
//! orders through the same intake as the queue; applies the signals of
//! `<prefix>.signals` to the orders' steps waiting for them (contract §4d).
//!
//! Modules: `session` (the broker sessions and their consumers),
//! `submission` (the orders queue's intake), `http_api` (the HTTP API),
//! `replay`, `signals`, `children` (sas's own agent of child
//! workflows) and `refusal` (dead-lettering an application's message with
//! why).

mod children;
mod http_api;
mod refusal;
mod replay;
mod session;
mod signals;
mod submission;

use sas::config::Settings;
use sas::service::{App, Spec, StoreUse};
use sas::state_store::Plans;

/// How a submission starts.
pub const SPEC: Spec = Spec {
    name: "submission",
    default_port: 9101,
    store: StoreUse::Required(Plans::Generic),
};

/// Starts a submission with `settings` (the binary with the configuration's;
/// tests in-process, on `http.port = 0`).
pub async fn build(settings: Settings) -> anyhow::Result<App> {
    App::start_with_routes(SPEC, settings, |ctx| {
        // One intake: the HTTP API and the orders queue store through it.
        let intake = submission::Intake::new(ctx.clone());
        let routes = match &intake {
            Ok(intake) => http_api::routes(ctx.clone(), intake.clone()),
            Err(_) => axum::Router::new(),
        };
        (routes, async move { session::run(ctx, intake?).await })
    })
    .await
}

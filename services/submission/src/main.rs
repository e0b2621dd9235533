//! `submission`: consumes `<prefix>.orders`, stores each valid order with its
//! state record and `received` event in one transaction, dead-letters the rest;
//! serves replay requests (`<prefix>.replay`, contract §9) from the event log,
//! and the HTTP API of orders on its port (`/v1`, contract §9a), which stores
//! orders through the same intake as the queue; applies the signals of
//! `<prefix>.signals` to the orders' steps waiting for them (contract §4d).

mod children;
mod http_api;
mod refusal;
mod replay;
mod session;
mod signals;
mod submission;

use clap::Parser;
use sas::service::{CommonArgs, Spec, StoreUse};
use sas::state_store::Plans;
use std::process::ExitCode;

/// sas submission service.
#[derive(Parser)]
#[command(version, about)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
}

// One thread: the service mostly waits on Postgres, RabbitMQ and HTTP, and
// a second worker thread only added cross-thread wake-ups (docs/performance.md:
// more orders/s and less CPU per order on one thread).
#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    let spec = Spec {
        name: "submission",
        default_port: 9101,
        store: StoreUse::Required(Plans::Generic),
    };
    sas::service::main_with_routes(spec, args.common, |ctx| {
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

//! `submission`: consumes `<prefix>.orders`, stores each valid order with its
//! state record and `received` event in one transaction, dead-letters the rest;
//! serves replay requests (`<prefix>.replay`, contract §9) from the event log.

mod replay;
mod submission;

use std::process::ExitCode;

use clap::Parser;
use sas::service::{CommonArgs, Spec};
use sas::state_store::Plans;

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
        store: Some(Plans::Generic),
    };
    sas::service::main(spec, args.common, submission::run).await
}

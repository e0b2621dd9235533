//! `scheduler`: claims pending orders, runs their steps through the agents
//! and records each reply with a guarded transition.

mod scheduler;

use std::process::ExitCode;

use clap::Parser;
use sas::service::{CommonArgs, Spec, StoreUse};
use sas::state_store::Plans;

/// sas scheduler.
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
        name: "scheduler",
        default_port: 9102,
        store: StoreUse::Required(Plans::Generic),
    };
    sas::service::main(spec, args.common, scheduler::run).await
}

//! The `scheduler` binary: see the library for what it does.

use std::process::ExitCode;

use clap::Parser;
use sas::service::CommonArgs;

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
    sas::service::main(scheduler::SPEC.name, args.common, scheduler::build).await
}

//! The `agent` binary: see the library for what it does.

use std::process::ExitCode;

use clap::Parser;
use sas::service::CommonArgs;

/// sas agent.
#[derive(Parser)]
#[command(version, about)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// Serve only this agent (repeatable); default: every configured agent.
    #[arg(long = "agent", value_name = "NAME")]
    agents: Vec<String>,
}

// One thread: the service mostly waits on Postgres, RabbitMQ and HTTP, and
// a second worker thread only added cross-thread wake-ups (docs/performance.md:
// more orders/s and less CPU per order on one thread).
#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    let only = args.agents;
    sas::service::main(agent::SPEC.name, args.common, |settings| {
        agent::build(settings, only)
    })
    .await
}

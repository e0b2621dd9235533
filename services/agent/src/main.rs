//! `agent`: serves step requests for the configured agents, calling each
//! one's remote service with retries until the step's complete-by.

mod agent;
mod breaker;
mod deadline;
mod remote;
mod replies;
mod report;
mod shared;

use std::process::ExitCode;

use clap::Parser;
use sas::service::{CommonArgs, Spec, StoreUse};

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
    let spec = Spec {
        name: "agent",
        default_port: 9103,
        // Reports and breaker reads are small and few: a handful of
        // connections, reached off the requests' path.
        store: StoreUse::Background { max_connections: 4 },
    };
    let only = args.agents;
    sas::service::main(spec, args.common, move |ctx| agent::run(ctx, only)).await
}

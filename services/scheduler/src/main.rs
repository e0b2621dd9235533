//! `scheduler`: claims pending orders, runs their steps through the agents
//! and records each reply with a guarded transition.

mod scheduler;

use std::process::ExitCode;

use clap::Parser;
use sas::service::{CommonArgs, Spec};

/// sas scheduler.
#[derive(Parser)]
#[command(version, about)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let spec = Spec {
        name: "scheduler",
        default_port: 9102,
        uses_store: true,
    };
    sas::service::main(spec, args.common, |_| {}, scheduler::run).await
}

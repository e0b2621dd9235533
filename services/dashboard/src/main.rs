//! The `dashboard` binary: see the library for what it does.

use std::process::ExitCode;

use clap::Parser;
use sas::service::CommonArgs;

/// sas operator dashboard.
#[derive(Parser)]
#[command(version, about)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    sas::service::main(dashboard::SPEC.name, args.common, dashboard::build).await
}

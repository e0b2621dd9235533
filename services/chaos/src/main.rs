//! `sas-chaos`: the soak run (see [`chaos`]). It submits and reads with
//! sasctl's code (`sasctl::submit`, `sasctl::watch`) and reports on one
//! line per verdict; a binary of its own, since operators' day-to-day
//! tooling (`sasctl`) has no need of its fault injection and process kills.

mod chaos;

use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use sas::service::CommonArgs;

/// Soak run for a sas deployment: submit orders under remote faults and
/// service kills, then report orders per terminal state, lost orders and
/// duplicate effects. Configuration keys are the services' own
/// (`SAS__BROKER__PREFIX`, `SAS__DATABASE__URL`, ...).
#[derive(Debug, Parser)]
#[command(name = "sas-chaos", version, about)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    args: chaos::Args,
}

#[tokio::main]
async fn main() -> ExitCode {
    let Cli { common, args } = Cli::parse();
    if let Err(message) = args.check() {
        Cli::command()
            .error(clap::error::ErrorKind::ArgumentConflict, message)
            .exit();
    }
    let config = common.config;
    sasctl::run_command("sas-chaos", config.as_deref(), async |settings| {
        chaos::run(args, &settings, config.as_deref()).await
    })
    .await
}

//! `submission`: consumes `<prefix>.orders`, stores each valid order with its
//! state record and `received` event in one transaction, dead-letters the rest.

mod submission;

use std::process::ExitCode;

use clap::Parser;
use sas::service::{CommonArgs, Spec};

/// sas submission service.
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
        name: "submission",
        default_port: 9101,
        uses_store: true,
    };
    sas::service::main(spec, args.common, |_| {}, submission::run).await
}

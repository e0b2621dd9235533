//! `supervisor`: sweeps the state store for expired complete-by times and
//! asks for a re-attempt or gives the order up; the leader also submits
//! the orders of the recurring schedules and deletes old ended orders.

mod retention;
mod schedules;
mod stuck_gauge;
mod supervisor;

use std::process::ExitCode;

use clap::Parser;
use sas::service::{CommonArgs, Spec, StoreUse};
use sas::state_store::Plans;

/// sas supervisor.
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
        name: "supervisor",
        default_port: 9104,
        store: StoreUse::Required(Plans::Generic),
    };
    sas::service::main(spec, args.common, supervisor::run).await
}

//! `sasctl migrate`: connects to the state store, which applies the migrations.

use anyhow::Context;
use sas::config::Settings;
use sas::state_store::StateStore;

/// Options of `sasctl migrate`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print `{"migrated": true}` instead of a sentence.
    #[arg(long)]
    json: bool,
}

/// Runs `sasctl migrate`.
pub async fn run(args: Args, settings: &Settings) -> anyhow::Result<()> {
    let store = StateStore::connect(&settings.database, "sasctl")
        .await
        .context("connecting to Postgres and applying the migrations")?;
    store.close().await;
    if args.json {
        println!("{}", serde_json::json!({ "migrated": true }));
    } else {
        println!("migrations applied");
    }
    Ok(())
}

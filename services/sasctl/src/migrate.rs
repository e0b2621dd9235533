//! `sasctl migrate`: connects to the state store, which applies the migrations.

use anyhow::Context;
use sas::config::Settings;
use sas::state_store::StateStore;

/// Runs `sasctl migrate`.
pub async fn run(settings: &Settings) -> anyhow::Result<()> {
    let store = StateStore::connect(&settings.database, "sasctl")
        .await
        .context("connecting to Postgres and applying the migrations")?;
    store.close().await;
    println!("migrations applied");
    Ok(())
}

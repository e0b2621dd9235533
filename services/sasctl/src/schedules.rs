//! `sasctl schedules`: the recurring orders (contract §4b) as configured,
//! each with its next tick, the last tick dealt with and the last order
//! made, with that order's state.

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use sas::config::Settings;
use sas::messages::rfc3339;
use sas::state_store::{ScheduleView, StateStore};

use crate::orders::table;

/// `sasctl schedules …`.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// List each configured schedule: its cron expression and time zone,
    /// its next tick, the last tick dealt with, and the last order it made
    /// (id and state).
    List(ListArgs),
}

/// Options of `sasctl schedules list`.
#[derive(Debug, clap::Args)]
pub struct ListArgs {
    /// Print a JSON array instead of a table.
    #[arg(long)]
    json: bool,
}

/// Runs `sasctl schedules …`.
pub async fn run(command: Command, settings: &Settings) -> anyhow::Result<()> {
    let Command::List(args) = command;
    let schedules = settings.compiled_schedules(Utc::now())?;
    let store = StateStore::connect(&settings.database, "sasctl")
        .await
        .context("connecting to Postgres")?;
    let views = store.schedule_views(&schedules).await;
    store.close().await;
    let (views, _) = views.context("reading the schedules")?;
    if args.json {
        println!("{}", serde_json::to_value(&views)?);
    } else {
        print!("{}", to_text(&views));
    }
    Ok(())
}

fn time(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "-".into(), |t| rfc3339::format(&t))
}

fn to_text(views: &[ScheduleView]) -> String {
    let rows = views
        .iter()
        .map(|v| {
            vec![
                v.name.clone(),
                v.workflow.clone(),
                v.cron.clone(),
                v.timezone.to_owned(),
                v.catch_up.as_str().to_owned(),
                time(v.next_tick),
                time(v.last_tick),
                v.last_order_id
                    .map_or_else(|| "-".into(), |id| id.to_string()),
                v.last_order_state.clone().unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    table(
        &[
            "SCHEDULE",
            "WORKFLOW",
            "CRON",
            "TIME ZONE",
            "CATCH UP",
            "NEXT TICK",
            "LAST TICK",
            "LAST ORDER",
            "STATE",
        ],
        rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use sas::rules::schedule::CatchUp;
    use serde_json::Value;

    #[test]
    fn the_list_shows_zone_ticks_and_the_last_order() {
        let id = uuid::Uuid::new_v4();
        let view = ScheduleView {
            name: "nightly".into(),
            workflow: "report".into(),
            cron: "0 2 * * *".into(),
            timezone: "Europe/Paris",
            catch_up: CatchUp::Last,
            next_tick: Some(Utc::now()),
            last_tick: None,
            last_order_id: Some(id),
            last_order_state: Some("processed".into()),
        };
        let text = to_text(std::slice::from_ref(&view));
        for shown in ["nightly", "0 2 * * *", "Europe/Paris", "last", "processed"] {
            assert!(text.contains(shown), "{text}");
        }
        assert!(text.contains(&id.to_string()), "{text}");
        let json = serde_json::to_value(&view).unwrap();
        assert_eq!(json["catch_up"], "last");
        assert_eq!(json["last_tick"], Value::Null);
        assert_eq!(json["last_order_id"], id.to_string());
    }
}

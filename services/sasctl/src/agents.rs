//! `sasctl agents`: the breakers the agents' instances share (contract
//! §8), with the orders held for each, and an operator's override: force
//! one open (hold every order that needs the agent, e.g. while its remote
//! is in maintenance) or closed (keep sending whatever fails), or release
//! it to decide again. Every override is logged in `breaker_events` under
//! the operator's name.

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use sas::config::Settings;
use sas::engine::Breakers as _;
use sas::messages::rfc3339;
use sas::rules::breaker::State;
use sas::state_store::{BreakerEvent, SharedBreaker, StateStore};
use serde_json::{Value, json};

use crate::orders::{operator, table};

/// `sasctl agents …`.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// List each agent's shared breaker: state, failures counted, since
    /// when, the probe, an operator's override, the orders held and its
    /// flow control (steps in flight over `max_in_flight`, `rate_limit`).
    List(ListArgs),
    /// Force an agent's breaker open: its orders are held until it is
    /// released or forced closed. Logged under the operator's name.
    ForceOpen(ForceArgs),
    /// Force an agent's breaker closed: steps are sent whatever the remote
    /// answers. Logged under the operator's name.
    ForceClosed(ForceArgs),
    /// Let an agent's breaker decide by its failures again (an open one
    /// probes after its cool-down). Logged under the operator's name.
    Release(ForceArgs),
    /// The latest changes of the breakers (or one agent's), newest first:
    /// who changed what, when and why.
    History(HistoryArgs),
}

/// Options of `sasctl agents list`.
#[derive(Debug, clap::Args)]
pub struct ListArgs {
    /// Print a JSON array instead of a table.
    #[arg(long)]
    json: bool,
}

/// Options of the overrides.
#[derive(Debug, clap::Args)]
pub struct ForceArgs {
    /// The agent (its name in `[agents.<name>]`).
    agent: String,
    /// Print the breaker afterwards as JSON.
    #[arg(long)]
    json: bool,
}

/// Options of `sasctl agents history`.
#[derive(Debug, clap::Args)]
pub struct HistoryArgs {
    /// Only this agent's breaker.
    agent: Option<String>,
    /// How many changes.
    #[arg(long, default_value_t = 20)]
    limit: i64,
    /// Print JSON lines instead of a table.
    #[arg(long)]
    json: bool,
}

/// Runs `sasctl agents …`.
pub async fn run(command: Command, settings: &Settings) -> anyhow::Result<()> {
    let store = StateStore::connect(&settings.database, "sasctl")
        .await
        .context("connecting to Postgres")?;
    let done = match command {
        Command::List(args) => list(&store, args.json).await,
        Command::ForceOpen(args) => force(&store, args, Some(State::Open), settings).await,
        Command::ForceClosed(args) => force(&store, args, Some(State::Closed), settings).await,
        Command::Release(args) => force(&store, args, None, settings).await,
        Command::History(args) => history(&store, args).await,
    };
    store.close().await;
    done
}

async fn list(store: &StateStore, as_json: bool) -> anyhow::Result<()> {
    let breakers = store
        .shared_breakers()
        .await
        .context("reading the breakers")?;
    if as_json {
        let rows: Vec<Value> = breakers.iter().map(to_json).collect();
        println!("{}", Value::Array(rows));
    } else {
        print!("{}", to_text(&breakers));
    }
    Ok(())
}

async fn force(
    store: &StateStore,
    args: ForceArgs,
    to: Option<State>,
    settings: &Settings,
) -> anyhow::Result<()> {
    if !settings.agents.contains_key(&args.agent) {
        // A typo would otherwise create a breaker nothing reads.
        return Err(crate::Exit {
            code: crate::Exit::USAGE,
            message: format!(
                "agent {:?} is not configured (no [agents.{}])",
                args.agent, args.agent
            ),
        }
        .into());
    }
    let me = operator();
    let b = store
        .force_breaker(&args.agent, to, &me.name)
        .await
        .context("changing the breaker")?;
    tracing::info!(agent = %args.agent, operator = %me.name, state = b.state.as_str(), "breaker overridden");
    if args.json {
        let shown = store
            .shared_breakers()
            .await
            .context("reading the breakers")?;
        if let Some(row) = shown.iter().find(|r| r.agent == args.agent) {
            println!("{}", to_json(row));
        }
    } else {
        let how = match to {
            Some(State::Open) => "forced open",
            Some(_) => "forced closed",
            None => "released",
        };
        println!("breaker of {} {how} by {}", args.agent, me.name);
    }
    Ok(())
}

async fn history(store: &StateStore, args: HistoryArgs) -> anyhow::Result<()> {
    let events = store
        .breaker_events(args.agent.as_deref(), args.limit.max(1))
        .await
        .context("reading the breakers' changes")?;
    if args.json {
        for e in &events {
            println!("{}", event_json(e));
        }
    } else {
        let rows = events
            .iter()
            .map(|e| {
                vec![
                    rfc3339::format(&e.at),
                    e.agent.clone(),
                    format!("{} → {}", e.from_state, e.to_state),
                    e.actor.clone(),
                    e.reason.clone(),
                ]
            })
            .collect();
        print!("{}", table(&["AT", "AGENT", "CHANGE", "BY", "WHY"], rows));
    }
    Ok(())
}

fn time(t: Option<DateTime<Utc>>) -> Value {
    t.map_or(Value::Null, |t| Value::String(rfc3339::format(&t)))
}

/// One breaker as `agents list --json` gives it.
fn to_json(b: &SharedBreaker) -> Value {
    json!({
        "agent": b.agent,
        "state": b.state,
        "failures": b.failures,
        "opened_at": time(b.opened_at),
        "open_until": time(b.open_until),
        "probe_order": b.probe_order,
        "forced": b.forced,
        "forced_by": b.forced_by,
        "changed_at": rfc3339::format(&b.changed_at),
        "held": b.held,
        "oldest_held_since": time(b.oldest_held_since),
        "max_in_flight": b.max_in_flight,
        "in_flight": b.in_flight,
        "rate_per_sec": b.rate_per_sec,
    })
}

/// Its flow control as the table shows it, e.g. `2/3 in flight, 20/s`.
fn flow_text(b: &SharedBreaker) -> String {
    let bound = b
        .max_in_flight
        .map(|max| format!("{}/{max} in flight", b.in_flight.unwrap_or(0)));
    let rate = b.rate_per_sec.map(|r| format!("{r}/s"));
    let parts: Vec<String> = bound.into_iter().chain(rate).collect();
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(", ")
    }
}

fn event_json(e: &BreakerEvent) -> Value {
    json!({
        "agent": e.agent,
        "at": rfc3339::format(&e.at),
        "from": e.from_state,
        "to": e.to_state,
        "actor": e.actor,
        "reason": e.reason,
    })
}

fn to_text(breakers: &[SharedBreaker]) -> String {
    let rows = breakers
        .iter()
        .map(|b| {
            let state = match &b.forced {
                Some(f) => format!("{} (forced {f})", b.state),
                None => b.state.clone(),
            };
            vec![
                b.agent.clone(),
                state,
                b.failures.to_string(),
                b.opened_at
                    .filter(|_| b.state != "closed")
                    .map_or_else(|| "-".into(), |t| rfc3339::format(&t)),
                b.held.to_string(),
                b.forced_by.clone().unwrap_or_else(|| "-".into()),
                flow_text(b),
            ]
        })
        .collect();
    table(
        &[
            "AGENT",
            "BREAKER",
            "FAILURES",
            "OPEN SINCE",
            "HELD",
            "FORCED BY",
            "FLOW CONTROL",
        ],
        rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker(state: &str, forced: Option<&str>) -> SharedBreaker {
        SharedBreaker {
            agent: "pay".into(),
            state: state.into(),
            failures: 4,
            opened_at: Some(Utc::now()),
            open_until: None,
            probe_order: None,
            forced: forced.map(str::to_owned),
            forced_by: forced.map(|_| "operator:ann".to_owned()),
            changed_at: Utc::now(),
            held: 12,
            oldest_held_since: None,
            max_in_flight: Some(3),
            in_flight: Some(2),
            rate_per_sec: None,
        }
    }

    #[test]
    fn the_list_shows_state_override_and_held_orders() {
        let text = to_text(&[breaker("open", Some("open")), breaker("closed", None)]);
        assert!(text.contains("open (forced open)"), "{text}");
        assert!(text.contains("operator:ann"), "{text}");
        assert!(text.lines().nth(1).unwrap().contains("12"), "{text}");
        assert!(text.contains("2/3 in flight"), "{text}");
        let json = to_json(&breaker("half_open", None));
        assert_eq!(json["state"], "half_open");
        assert_eq!(json["held"], 12);
        assert_eq!(json["forced"], Value::Null);
    }
}

//! `sasctl orders`: list orders, show one with its steps and event log, retry,
//! cancel or redrive one, and prune ended ones, all in the state store.
//!
//! Retry, cancel and redrive are transitions like the services' own: one transaction
//! that also queues the order's status event in the outbox, which the running
//! services' relays publish (within `outbox.sweep_age`). They need Postgres
//! only, not RabbitMQ.

use std::fmt::Write as _;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use clap::{Subcommand, value_parser};
use sas::config::Settings;
use sas::engine::{Actor, Operated};
use sas::messages::rfc3339;
use sas::operate::Operation;
use sas::rules::retention::more_after;
use sas::state::ProcessState;
use sas::state_store::{Archive, EventRow, OrderRow, Policy, StateStore, StepRow, Totals};
use sas::topology::QueueNames;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::Exit;

/// Every order state, in the order of an order's life.
pub(crate) const STATES: [ProcessState; 6] = ProcessState::ALL;

/// `sasctl orders …`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List orders, newest first: id, state, workflow, failure count, lock holder, complete-by, last change.
    List(ListArgs),
    /// Show an order: its state, its steps and its event log (who, when, from → to, step, attempt, why).
    Show(ShowArgs),
    /// Retry an `error` order: back to `pending` with its failure counts reset;
    /// it resumes at its first incomplete step (completed steps do not run again).
    Retry(ActionArgs),
    /// Cancel a `pending`, `processing` or `error` order: the running step is
    /// withdrawn and the completed steps are undone, newest first.
    Cancel(ActionArgs),
    /// Redrive an `error` or `compensated` order (contract §9): run it again,
    /// its payload first merged with the JSON merge patch (RFC 7386) of
    /// --patch. Steps completed and not undone are kept; every other step
    /// runs again with the idempotency key `<order_id>:<step>:r<N>`.
    Redrive(RedriveArgs),
    /// Send a `processing` order the signal its `signal` step waits for
    /// (contract §4d): the step completes with --data as its result and the
    /// order goes on. Refused when no step of the order waits for this
    /// signal now; a refused signal is not kept.
    Signal(SignalArgs),
    /// Delete ended orders (`processed`, `compensated`; not `error`) last
    /// changed longer ago than --older-than, in batches, archived first with --archive.
    ///
    /// Each order goes with its steps, event log and unsent messages, a
    /// batch per transaction, as the leading supervisor does every
    /// `retention.interval` (contract §10). Orders in `error` are kept: their
    /// alert is open until an operator retries, cancels or redrives them.
    /// With an archive, each order is first appended as one JSON line
    /// `{"order", "steps", "events"}` to `orders-<date>.jsonl` there,
    /// flushed to disk before its batch is committed.
    Prune(PruneArgs),
}

/// Options of `sasctl orders list`.
#[derive(Debug, clap::Args)]
pub struct ListArgs {
    /// Only orders in this state: pending, processing, processed, error, compensating or compensated.
    #[arg(long, value_name = "STATE", value_parser = parse_state)]
    state: Option<ProcessState>,
    /// Only orders of this workflow.
    #[arg(long, value_name = "NAME")]
    workflow: Option<String>,
    /// At most this many orders.
    #[arg(long, value_name = "N", default_value_t = 50, value_parser = value_parser!(i64).range(1..))]
    limit: i64,
    /// Print a JSON array of `{"order_id", "state", "workflow", "failure_count",
    /// "locked_by", "complete_by", "created_at", "updated_at"}` instead of a table.
    #[arg(long)]
    json: bool,
}

/// Options of `sasctl orders show`.
#[derive(Debug, clap::Args)]
pub struct ShowArgs {
    /// The order's id.
    #[arg(value_name = "ID")]
    id: Uuid,
    /// Print one JSON object `{"order", "steps", "events"}` instead of tables.
    #[arg(long)]
    json: bool,
}

/// Options of `sasctl orders retry` and `sasctl orders cancel`.
#[derive(Debug, clap::Args)]
pub struct ActionArgs {
    /// The order's id.
    #[arg(value_name = "ID")]
    id: Uuid,
    /// Print `{"order_id", "state"}` (the state the order is now in) instead of a sentence.
    #[arg(long)]
    json: bool,
}

/// Options of `sasctl orders redrive`.
#[derive(Debug, clap::Args)]
pub struct RedriveArgs {
    #[command(flatten)]
    action: ActionArgs,
    /// A JSON merge patch (RFC 7386) for the order's payload, e.g.
    /// `{"address": {"zip": "12345"}, "coupon": null}` (null removes a
    /// field); `-` reads it from stdin. The patched payload must pass the
    /// checks and limits of a submitted order's payload.
    #[arg(long, value_name = "FILE")]
    patch: Option<PathBuf>,
}

/// Options of `sasctl orders signal`.
#[derive(Debug, clap::Args)]
pub struct SignalArgs {
    #[command(flatten)]
    action: ActionArgs,
    /// The signal's name, as the workflow's `signal` step names it.
    #[arg(value_name = "SIGNAL")]
    name: String,
    /// The signal's data, JSON (the step's result) [default: {}].
    #[arg(long, value_name = "JSON")]
    data: Option<String>,
}

/// Options of `sasctl orders prune`.
#[derive(Debug, clap::Args)]
pub struct PruneArgs {
    /// Delete only ended orders last changed longer ago than this (e.g.
    /// "30days", "12h") [default: retention.ended_after; required when that is "off"].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    older_than: Option<Duration>,
    /// Orders deleted per transaction [default: retention.batch].
    #[arg(long, value_name = "N", value_parser = value_parser!(u32).range(1..=i64::from(sas::config::MAX_RETENTION_BATCH)))]
    batch: Option<u32>,
    /// Append each order to `orders-<date>.jsonl` in this existing directory
    /// before deleting it [default: retention.archive, if set].
    #[arg(long, value_name = "DIR")]
    archive: Option<PathBuf>,
    /// Print `{"deleted", "steps", "events", "outbox", "batches", "archived": [files]}`
    /// instead of a sentence.
    #[arg(long)]
    json: bool,
}

/// `--state`: a state name; the error lists the valid ones.
fn parse_state(text: &str) -> Result<ProcessState, String> {
    text.parse().map_err(|_| {
        let names: Vec<&str> = STATES.iter().map(|s| s.as_str()).collect();
        format!("unknown state; valid states: {}", names.join(", "))
    })
}

/// An operator's action on one order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Action {
    Retry,
    Cancel,
    /// With the payload's merge patch, if any.
    Redrive(Option<Value>),
    /// The signal's name and data.
    Signal(String, Value),
}

impl Action {
    fn verb(&self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::Cancel => "cancel",
            Self::Redrive(_) => "redrive",
            Self::Signal(..) => "signal",
        }
    }

    fn done(&self) -> &'static str {
        match self {
            Self::Retry => "retried",
            Self::Cancel => "cancelled",
            Self::Redrive(_) => "redriven",
            Self::Signal(..) => "signalled",
        }
    }

    fn doing(&self) -> &'static str {
        match self {
            Self::Retry => "retrying",
            Self::Cancel => "cancelling",
            Self::Redrive(_) => "redriving",
            Self::Signal(..) => "signalling",
        }
    }
}

/// Runs `sasctl orders …`.
pub async fn run(command: Command, settings: &Settings) -> anyhow::Result<()> {
    match command {
        Command::List(args) => list(args, settings).await,
        Command::Show(args) => show(args, settings).await,
        Command::Retry(args) => operate(Action::Retry, args, settings).await,
        Command::Cancel(args) => operate(Action::Cancel, args, settings).await,
        Command::Redrive(args) => {
            let patch = match &args.patch {
                Some(path) => Some(read_patch(path, settings.submission.max_body_bytes)?),
                None => None,
            };
            operate(Action::Redrive(patch), args.action, settings).await
        }
        Command::Signal(args) => {
            let data = match &args.data {
                None => json!({}),
                Some(text) => serde_json::from_str(text).map_err(|e| Exit {
                    code: Exit::USAGE,
                    message: format!("--data is not JSON: {e}"),
                })?,
            };
            operate(Action::Signal(args.name, data), args.action, settings).await
        }
        Command::Prune(args) => prune(args, settings).await,
    }
}

async fn connect(settings: &Settings) -> anyhow::Result<StateStore> {
    StateStore::connect(&settings.database, "sasctl")
        .await
        .context("connecting to Postgres")
}

fn not_found(id: Uuid) -> anyhow::Error {
    Exit {
        code: Exit::NOT_FOUND,
        message: format!("no order {id}"),
    }
    .into()
}

async fn list(args: ListArgs, settings: &Settings) -> anyhow::Result<()> {
    let store = connect(settings).await?;
    let orders = store
        .list_orders(args.state, args.workflow.as_deref(), args.limit)
        .await;
    store.close().await;
    let orders = orders.context("listing orders")?;
    let text = if args.json {
        Value::Array(orders.iter().map(list_json).collect()).to_string()
    } else {
        list_text(&orders)
    };
    println!("{}", crate::terminal::printable(text.trim_end()));
    Ok(())
}

/// One order of `orders list --json`.
fn list_json(order: &OrderRow) -> Value {
    json!({
        "order_id": order.order_id,
        "state": order.process_state.as_str(),
        "workflow": order.workflow,
        "failure_count": order.failure_count,
        "locked_by": order.locked_by,
        "complete_by": order.complete_by.as_ref().map(rfc3339::format),
        "created_at": rfc3339::format(&order.created_at),
        "updated_at": rfc3339::format(&order.updated_at),
    })
}

/// The orders of `orders list` as a table.
fn list_text(orders: &[OrderRow]) -> String {
    let rows = orders
        .iter()
        .map(|o| {
            vec![
                o.order_id.to_string(),
                o.process_state.to_string(),
                o.workflow.clone(),
                o.failure_count.to_string(),
                opt(o.locked_by.as_deref()),
                opt_time(o.complete_by),
                time(o.updated_at),
            ]
        })
        .collect();
    table(
        &[
            "ORDER_ID",
            "STATE",
            "WORKFLOW",
            "FAILURE_COUNT",
            "LOCKED_BY",
            "COMPLETE_BY",
            "UPDATED_AT",
        ],
        rows,
    )
}

/// The operator an action is recorded under: `operator:<$USER>`, or
/// `operator:sasctl` when `USER` is unset.
pub(crate) fn operator() -> Actor {
    let user = std::env::var("USER").unwrap_or_default();
    let user = user.trim();
    Actor {
        name: format!("operator:{}", if user.is_empty() { "sasctl" } else { user }),
    }
}

/// A bad `--patch`: exit code 2, like a `--file` that cannot be opened.
fn bad_patch(message: String) -> anyhow::Error {
    Exit {
        code: Exit::USAGE,
        message,
    }
    .into()
}

/// The JSON merge patch of `--patch FILE` (`-`: stdin), read up to
/// `max_bytes` (a patch larger than a whole order could not give a payload
/// that passes).
fn read_patch(path: &Path, max_bytes: usize) -> anyhow::Result<Value> {
    let name = path.display();
    let mut source: Box<dyn std::io::Read> = if path == Path::new("-") {
        Box::new(std::io::stdin())
    } else {
        let file = std::fs::File::open(path)
            .map_err(|e| bad_patch(format!("cannot open the patch {name}: {e}")))?;
        Box::new(file)
    };
    let mut text = Vec::new();
    let limit = u64::try_from(max_bytes)
        .unwrap_or(u64::MAX)
        .saturating_add(1);
    source
        .by_ref()
        .take(limit)
        .read_to_end(&mut text)
        .map_err(|e| bad_patch(format!("cannot read the patch {name}: {e}")))?;
    if text.len() > max_bytes {
        return Err(bad_patch(format!(
            "the patch {name} is larger than submission.max_body_bytes ({max_bytes} bytes)"
        )));
    }
    serde_json::from_slice(&text)
        .map_err(|e| bad_patch(format!("the patch {name} is not JSON: {e}")))
}

async fn operate(action: Action, args: ActionArgs, settings: &Settings) -> anyhow::Result<()> {
    let store = connect(settings).await?;
    let me = operator();
    let operation = match &action {
        Action::Retry => Operation::Retry,
        Action::Cancel => Operation::Cancel,
        Action::Redrive(patch) => Operation::Redrive {
            patch: patch.as_ref(),
            max_bytes: settings.submission.max_body_bytes,
        },
        Action::Signal(name, data) => Operation::Signal { name, data },
    };
    // Published before it returns, through a relay of its own.
    let outcome = sas::operate::operate(&store, settings, "sasctl", &me, args.id, operation).await;
    store.close().await;
    let outcome = outcome.with_context(|| format!("{} order {}", action.doing(), args.id))?;
    let state = match outcome {
        Operated::Done(state) => state,
        Operated::NotFound => return Err(not_found(args.id)),
        Operated::NotAllowed(state, why) => {
            return Err(Exit {
                code: Exit::NOT_ALLOWED,
                message: format!(
                    "cannot {} order {}: it is {state} ({why})",
                    action.verb(),
                    args.id
                ),
            }
            .into());
        }
        Operated::PayloadRefused(why) => {
            let what = match action {
                Action::Signal(..) => "the signal",
                _ => "the patched payload",
            };
            return Err(bad_patch(format!(
                "cannot {} order {}: {what} is refused: {why}",
                action.verb(),
                args.id
            )));
        }
    };
    if args.json {
        println!(
            "{}",
            json!({ "order_id": args.id, "state": state.as_str() })
        );
    } else {
        println!("order {} {}: {state}", args.id, action.done());
    }
    Ok(())
}

async fn prune(args: PruneArgs, settings: &Settings) -> anyhow::Result<()> {
    let retention = &settings.retention;
    let Some(ended_after) = args.older_than.or(retention.ended_after) else {
        return Err(Exit {
            code: Exit::USAGE,
            message: "retention.ended_after is \"off\": say how old with --older-than".into(),
        }
        .into());
    };
    let policy = Policy {
        ended_after,
        batch: args.batch.unwrap_or(retention.batch),
        states: sas::rules::retention::PRUNABLE,
    };
    let archive = args.archive.or_else(|| retention.archive.clone());
    if let Some(dir) = archive.as_ref().filter(|d| !d.is_dir()) {
        return Err(Exit {
            code: Exit::USAGE,
            message: format!("the archive directory {} does not exist", dir.display()),
        }
        .into());
    }
    let archive = archive.map(Archive::new);
    let store = connect(settings).await?;
    let mut totals = Totals::default();
    let outcome = loop {
        match store.prune(policy, archive.as_ref()).await {
            Ok(pruned) => {
                totals.add(&pruned);
                if !more_after(pruned.orders.len(), policy.batch) {
                    break Ok(());
                }
            }
            Err(e) => break Err(e),
        }
    };
    store.close().await;
    outcome.with_context(|| {
        format!(
            "pruning ended orders ({} deleted before this failure)",
            totals.orders
        )
    })?;
    let archived: Vec<String> = totals
        .archived
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    if args.json {
        println!(
            "{}",
            json!({
                "deleted": totals.orders,
                "steps": totals.steps,
                "events": totals.events,
                "outbox": totals.outbox,
                "batches": totals.batches,
                "archived": archived,
            })
        );
    } else {
        let deleted = totals.orders;
        let plural = if deleted == 1 { "" } else { "s" };
        let mut text = format!(
            "deleted {deleted} ended order{plural} last changed more than {} ago",
            humantime::format_duration(ended_after)
        );
        if !archived.is_empty() {
            let _ = write!(text, ", archived to {}", archived.join(", "));
        }
        if totals.outbox > 0 {
            let _ = write!(
                text,
                " ({} of their messages had never been published)",
                totals.outbox
            );
        }
        println!("{}", crate::terminal::printable(&text));
    }
    Ok(())
}

async fn show(args: ShowArgs, settings: &Settings) -> anyhow::Result<()> {
    let store = connect(settings).await?;
    let details = store.order_details(args.id).await;
    let Some((order, steps, events)) =
        details.with_context(|| format!("reading order {}", args.id))?
    else {
        store.close().await;
        return Err(not_found(args.id));
    };
    let stuck = stuck_of(&order, &steps, &store, settings).await;
    let version = store.version_of(&order).await;
    store.close().await;
    let text = if args.json {
        let mut json = to_json(&order, &steps, &events);
        json["order"]["version"] = json!(version);
        json["stuck"] = stuck.map_or(Value::Null, |s| s.to_json());
        json.to_string()
    } else {
        let mut text = to_text(&order, &steps, &events, version.as_deref());
        if let Some(s) = &stuck {
            let json = s.to_json();
            text.push_str(&format!(
                "\nstuck: {} since {} {}",
                s.reason.as_str(),
                json["since"].as_str().unwrap_or_default(),
                s.detail
            ));
        }
        text
    };
    println!("{}", crate::terminal::printable(text.trim_end()));
    Ok(())
}

/// The order, its steps and its events as one JSON object.
fn to_json(order: &OrderRow, steps: &[StepRow], events: &[EventRow]) -> Value {
    json!({
        "order": order.to_json(),
        "stages": sas::state_store::stage_names(steps),
        "steps": steps.iter().map(|s| s.to_json(steps)).collect::<Vec<_>>(),
        "events": events.iter().map(EventRow::to_json).collect::<Vec<_>>(),
    })
}

/// The order, its steps and its events as readable text; `version`, the
/// definition it runs under (contract §4d).
fn to_text(
    order: &OrderRow,
    steps: &[StepRow],
    events: &[EventRow],
    version: Option<&str>,
) -> String {
    let mut out = String::new();
    let fields = [
        ("order", order.order_id.to_string()),
        ("state", order.process_state.to_string()),
        ("workflow", order.workflow.clone()),
        ("version", opt(version)),
        ("locked_by", opt(order.locked_by.as_deref())),
        ("complete_by", opt_time(order.complete_by)),
        (
            "failure_count",
            format!(
                "{} (attempt {}, compensation failures {})",
                order.failure_count,
                order.attempt(),
                order.compensation_failures
            ),
        ),
        ("priority", order.priority.to_string()),
        ("redrives", order.redrives.to_string()),
        ("not_before", opt_time(order.not_before)),
        ("reply_to", opt(order.reply_to.as_deref())),
        ("events", order.events.as_str().to_owned()),
        ("last_error", opt(order.last_error.as_deref())),
        ("created", time(order.created_at)),
        ("updated", time(order.updated_at)),
        ("payload", order.payload.to_string()),
    ];
    let width = fields.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (key, value) in fields {
        let _ = writeln!(out, "{key:<width$}  {}", cell(&value));
    }

    // The branches: the steps of one stage may run at the same time.
    let flow = sas::state_store::stage_names(steps)
        .iter()
        .map(|stage| stage.join(" ∥ "))
        .collect::<Vec<_>>()
        .join(" → ");
    let _ = writeln!(out, "\nsteps  {flow}");
    let rows = steps
        .iter()
        .map(|s| {
            let after = s.after_names(steps);
            vec![
                s.idx.to_string(),
                s.name.clone(),
                if after.is_empty() {
                    "-".into()
                } else {
                    after.join(",")
                },
                s.agent.clone(),
                s.state.to_string(),
                s.dispatches.to_string(),
                opt_time(s.started_at),
                opt_time(s.finished_at),
                opt_time(s.complete_by),
                opt(s.error.as_deref()),
                s.result
                    .as_ref()
                    .map_or_else(|| "-".into(), Value::to_string),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "IDX",
            "NAME",
            "AFTER",
            "AGENT",
            "STATE",
            "DISPATCHES",
            "STARTED",
            "FINISHED",
            "COMPLETE_BY",
            "ERROR",
            "RESULT",
        ],
        rows,
    ));

    // The timeline: who did what when, from which state to which, and why.
    let _ = writeln!(out, "\nevent log");
    let rows = events
        .iter()
        .map(|e| {
            vec![
                e.seq.to_string(),
                time(e.at),
                e.actor.clone(),
                e.event.clone(),
                format!(
                    "{} → {}",
                    e.from_state.as_deref().unwrap_or("-"),
                    e.to_state
                ),
                opt(e.step.as_deref()),
                e.attempt.to_string(),
                opt(e.reason.as_deref()),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "SEQ",
            "AT",
            "ACTOR",
            "EVENT",
            "FROM → TO",
            "STEP",
            "ATTEMPT",
            "REASON",
        ],
        rows,
    ));

    // What each redrive changed (contract §9): the payload before and after.
    let redrives: Vec<&EventRow> = events.iter().filter(|e| e.event == "redriven").collect();
    if !redrives.is_empty() {
        let _ = writeln!(out, "\nredrives");
        for e in redrives {
            let d = &e.detail;
            let _ = writeln!(
                out,
                "{}  {}  {}  payload {} → {}",
                d["redrive"],
                time(e.at),
                e.actor,
                cell(&d["before"].to_string()),
                cell(&d["after"].to_string()),
            );
        }
    }
    out
}

/// Left-aligned columns two spaces apart; `(none)` for no rows.
pub(crate) fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
    if rows.is_empty() {
        return "(none)\n".into();
    }
    let rows: Vec<Vec<String>> = rows
        .into_iter()
        .map(|r| r.iter().map(|c| cell(c)).collect())
        .collect();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = headers.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(&header).chain(&rows) {
        let mut line = String::new();
        for (i, (c, w)) in row.iter().zip(&widths).enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            line.push_str(c);
            line.extend(std::iter::repeat_n(' ', w - c.chars().count()));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// A value on one line.
pub(crate) use crate::terminal::{cell, time};

fn opt(text: Option<&str>) -> String {
    text.unwrap_or("-").to_owned()
}

fn opt_time(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "-".into(), time)
}

/// Why the order is stuck, if it is held for a breaker or its running step
/// is past the first rung of its deadline ladder ([`sas::diagnosis::explain`]);
/// RabbitMQ is asked only for the latter.
async fn stuck_of(
    order: &OrderRow,
    steps: &[StepRow],
    store: &StateStore,
    settings: &Settings,
) -> Option<sas::rules::stuck::Stuck> {
    let order = sas::rules::Order {
        row: order.clone(),
        steps: steps.to_vec(),
    };
    if let Some(held) = sas::rules::stuck::held(&order) {
        return Some(held);
    }
    sas::rules::stuck::late_step(&order)?;
    let broker = sas::broker::Broker::connect(&settings.broker, "sasctl")
        .await
        .ok();
    let queues = QueueNames::new(&settings.broker.prefix);
    let mut why = sas::diagnosis::explain(
        std::slice::from_ref(&order),
        store,
        broker.as_ref(),
        &queues,
    )
    .await;
    if let Some(broker) = broker {
        broker.close().await;
    }
    why.pop().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sas::state::StepState;
    use sas::state_store::NewOrder;

    fn sample() -> (OrderRow, Vec<StepRow>, Vec<EventRow>) {
        let at = DateTime::parse_from_rfc3339("2030-01-02T03:04:05.678Z")
            .unwrap()
            .with_timezone(&Utc);
        let id = Uuid::parse_str("67e55044-10b1-426f-9247-bb680e5fe0c8").unwrap();
        let order = OrderRow {
            reply_to: Some("app".into()),
            priority: 3,
            process_state: ProcessState::Processing,
            locked_by: Some("scheduler-1".into()),
            complete_by: Some(at),
            failure_count: 1,
            last_seq: 2,
            last_error: Some("timed out\nat step charge".into()),
            ..OrderRow::pending(&NewOrder::new(id, "order", json!({"sku": "A-1"})), at)
        };
        let step = |idx: i32, name: &str, state, result: Option<Value>| StepRow {
            order_id: id,
            idx,
            name: name.into(),
            agent: format!("{name}-agent"),
            compensate: None,
            timeout_ms: 10_000,
            state,
            dispatches: 1,
            dispatch_id: None,
            complete_by: None,
            result,
            error: None,
            started_at: Some(at),
            finished_at: None,
            warned: 0,
            after_steps: None,
            max_duration_ms: None,
            in_doubt: false,
            undo_in_doubt: false,
        };
        let steps = vec![
            step(
                0,
                "reserve",
                StepState::Completed,
                Some(json!({"ok": true})),
            ),
            step(1, "charge", StepState::Running, None),
        ];
        let events = vec![EventRow {
            seq: 1,
            event: "received".into(),
            from_state: None,
            to_state: "pending".into(),
            step: None,
            attempt: 1,
            actor: "submission".into(),
            reason: None,
            detail: json!({}),
            at,
        }];
        (order, steps, events)
    }

    #[test]
    fn json_has_the_order_its_steps_and_events() {
        let (order, steps, events) = sample();
        let v = to_json(&order, &steps, &events);
        assert_eq!(v["order"]["state"], "processing");
        assert_eq!(v["order"]["order_id"], order.order_id.to_string());
        assert_eq!(v["order"]["complete_by"], "2030-01-02T03:04:05.678000Z");
        assert_eq!(v["order"]["not_before"], Value::Null);
        assert_eq!(v["order"]["attempt"], 2);
        assert_eq!(v["steps"][0]["result"]["ok"], true);
        assert_eq!(v["steps"][1]["state"], "running");
        assert_eq!(v["steps"][1]["after"], json!(["reserve"]));
        assert_eq!(v["stages"], json!([["reserve"], ["charge"]]));
        assert_eq!(v["events"][0]["event"], "received");
        assert_eq!(v["events"][0]["from_state"], Value::Null);
    }

    #[test]
    fn text_shows_aligned_tables() {
        let (order, steps, events) = sample();
        let text = to_text(&order, &steps, &events, Some("2026-11-27"));
        assert!(text.contains("version        2026-11-27\n"), "{text}");
        assert!(text.contains("state          processing\n"), "{text}");
        assert!(
            text.contains("last_error     timed out at step charge\n"),
            "{text}"
        );
        assert!(
            text.contains("IDX  NAME     AFTER    AGENT          STATE"),
            "{text}"
        );
        assert!(
            text.contains("0    reserve  -        reserve-agent  completed"),
            "{text}"
        );
        assert!(
            text.contains("1    charge   reserve  charge-agent   running"),
            "{text}"
        );
        assert!(text.contains("steps  reserve → charge\n"), "{text}");
        assert!(text.contains("- → pending"), "{text}");
        let (order, _, _) = sample();
        assert!(to_text(&order, &[], &[], None).contains("steps  \n(none)\n"));
    }

    #[test]
    fn the_event_log_reads_as_a_timeline() {
        let (order, steps, mut events) = sample();
        events[0].reason = Some("accepted\nfrom app".into());
        let text = to_text(&order, &steps, &events, Some("2026-11-27"));
        assert!(text.contains("version        2026-11-27\n"), "{text}");
        assert!(text.contains("\nevent log\n"), "{text}");
        assert!(
            text.contains("SEQ  AT                        ACTOR       EVENT     FROM → TO    STEP  ATTEMPT  REASON\n"),
            "{text}"
        );
        assert!(
            text.contains("1    2030-01-02 03:04:05.678Z  submission  received  - → pending  -     1        accepted from app\n"),
            "{text}"
        );
    }

    #[test]
    fn a_redrive_shows_the_payload_before_and_after() {
        let (order, steps, mut events) = sample();
        let mut redriven = events[0].clone();
        redriven.seq = 2;
        redriven.event = "redriven".into();
        redriven.actor = "operator:alice".into();
        redriven.detail = json!({"redrive": 1, "before": {"n": 1}, "after": {"n": 2}});
        events.push(redriven);
        let text = to_text(&order, &steps, &events, Some("2026-11-27"));
        assert!(text.contains("version        2026-11-27\n"), "{text}");
        assert!(
            text.contains(
                "\nredrives\n1  2030-01-02 03:04:05.678Z  operator:alice  payload {\"n\":1} → {\"n\":2}\n"
            ),
            "{text}"
        );
        assert!(!to_text(&order, &steps, &events[..1], None).contains("redrives\n"));
    }

    #[test]
    fn the_list_has_one_row_per_order() {
        let (order, _, _) = sample();
        let text = list_text(std::slice::from_ref(&order));
        assert!(
            text.starts_with("ORDER_ID                              STATE       WORKFLOW  FAILURE_COUNT  LOCKED_BY    COMPLETE_BY               UPDATED_AT\n"),
            "{text}"
        );
        assert!(
            text.contains("67e55044-10b1-426f-9247-bb680e5fe0c8  processing  order     1              scheduler-1  2030-01-02 03:04:05.678Z"),
            "{text}"
        );
        assert_eq!(list_text(&[]), "(none)\n");
        let v = list_json(&order);
        assert_eq!(v["state"], "processing");
        assert_eq!(v["failure_count"], 1);
        assert_eq!(v["locked_by"], "scheduler-1");
        assert_eq!(v["complete_by"], "2030-01-02T03:04:05.678000Z");
    }

    #[test]
    fn states_are_checked_and_the_error_lists_the_valid_ones() {
        assert_eq!(parse_state("error").unwrap(), ProcessState::Error);
        let e = parse_state("broken").unwrap_err();
        assert!(
            e.contains("pending, processing, processed, error, compensating, compensated"),
            "{e}"
        );
        for s in STATES {
            assert_eq!(parse_state(s.as_str()).unwrap(), s);
        }
    }

    #[test]
    fn actions_name_themselves_and_the_operator() {
        assert_eq!(Action::Retry.verb(), "retry");
        assert_eq!(Action::Cancel.done(), "cancelled");
        assert!(operator().name.starts_with("operator:"));
    }

    #[test]
    fn a_patch_file_is_read_as_json_up_to_the_limit_and_its_faults_are_usage_errors() {
        let dir = std::env::temp_dir().join(format!("sasctl-patch-{}", Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let ok = file("ok.json", r#"{"a": {"b": null}}"#);
        assert_eq!(read_patch(&ok, 64).unwrap(), json!({"a": {"b": null}}));
        let usage = |path: &Path, limit: usize| {
            let e = read_patch(path, limit).unwrap_err();
            let exit = e.downcast_ref::<Exit>().expect("an exit code");
            assert_eq!(exit.code, Exit::USAGE, "{}", exit.message);
            exit.message.clone()
        };
        assert!(usage(&ok, 8).contains("larger than submission.max_body_bytes (8 bytes)"));
        assert!(usage(&file("bad.json", "{nope"), 64).contains("is not JSON"));
        assert!(usage(&dir.join("missing.json"), 64).contains("cannot open the patch"));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn tables_pad_by_characters() {
        let t = table(&["A", "B"], vec![vec!["→x".into(), "1".into()]]);
        assert_eq!(t, "A   B\n→x  1\n");
    }
}

//! `sasctl orders`: an order with its steps and event log, from the state store.

use std::fmt::Write as _;

use anyhow::Context;
use chrono::{DateTime, Utc};
use clap::Subcommand;
use sas::config::Settings;
use sas::messages::rfc3339;
use sas::state_store::{EventRow, OrderRow, StateStore, StepRow};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::Exit;

/// `sasctl orders …`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show an order: its state, its steps and its event log.
    Show(ShowArgs),
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

/// Runs `sasctl orders …`.
pub async fn run(command: Command, settings: &Settings) -> anyhow::Result<()> {
    match command {
        Command::Show(args) => show(args, settings).await,
    }
}

async fn show(args: ShowArgs, settings: &Settings) -> anyhow::Result<()> {
    let store = StateStore::connect(&settings.database, "sasctl")
        .await
        .context("connecting to Postgres")?;
    let details = store.order_details(args.id).await;
    store.close().await;
    let Some((order, steps, events)) =
        details.with_context(|| format!("reading order {}", args.id))?
    else {
        return Err(Exit {
            code: Exit::NOT_FOUND,
            message: format!("no order {}", args.id),
        }
        .into());
    };
    let text = if args.json {
        to_json(&order, &steps, &events).to_string()
    } else {
        to_text(&order, &steps, &events)
    };
    println!("{}", text.trim_end());
    Ok(())
}

/// The order, its steps and its events as one JSON object.
fn to_json(order: &OrderRow, steps: &[StepRow], events: &[EventRow]) -> Value {
    let time = |t: &Option<DateTime<Utc>>| t.as_ref().map(rfc3339::format);
    json!({
        "order": {
            "order_id": order.order_id,
            "workflow": order.workflow,
            "state": order.process_state.as_str(),
            "payload": order.payload,
            "reply_to": order.reply_to,
            "priority": order.priority,
            "not_before": time(&order.not_before),
            "locked_by": order.locked_by,
            "complete_by": time(&order.complete_by),
            "failure_count": order.failure_count,
            "compensation_failures": order.compensation_failures,
            "attempt": order.attempt(),
            "last_seq": order.last_seq,
            "last_error": order.last_error,
            "created_at": rfc3339::format(&order.created_at),
            "updated_at": rfc3339::format(&order.updated_at),
        },
        "steps": steps.iter().map(|s| json!({
            "idx": s.idx,
            "name": s.name,
            "agent": s.agent,
            "compensate": s.compensate,
            "timeout_ms": s.timeout_ms,
            "state": s.state.as_str(),
            "dispatches": s.dispatches,
            "dispatch_id": s.dispatch_id,
            "complete_by": time(&s.complete_by),
            "result": s.result,
            "error": s.error,
            "started_at": time(&s.started_at),
            "finished_at": time(&s.finished_at),
        })).collect::<Vec<_>>(),
        "events": events.iter().map(|e| json!({
            "seq": e.seq,
            "at": rfc3339::format(&e.at),
            "event": e.event,
            "from_state": e.from_state,
            "to_state": e.to_state,
            "step": e.step,
            "attempt": e.attempt,
            "actor": e.actor,
            "reason": e.reason,
            "detail": e.detail,
        })).collect::<Vec<_>>(),
    })
}

/// The order, its steps and its events as readable text.
fn to_text(order: &OrderRow, steps: &[StepRow], events: &[EventRow]) -> String {
    let mut out = String::new();
    let fields = [
        ("order", order.order_id.to_string()),
        ("state", order.process_state.to_string()),
        ("workflow", order.workflow.clone()),
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
        ("not_before", opt_time(order.not_before)),
        ("reply_to", opt(order.reply_to.as_deref())),
        ("last_error", opt(order.last_error.as_deref())),
        ("created", time(order.created_at)),
        ("updated", time(order.updated_at)),
        ("payload", order.payload.to_string()),
    ];
    let width = fields.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (key, value) in fields {
        let _ = writeln!(out, "{key:<width$}  {}", cell(&value));
    }

    let _ = writeln!(out, "\nsteps");
    let rows = steps
        .iter()
        .map(|s| {
            vec![
                s.idx.to_string(),
                s.name.clone(),
                s.agent.clone(),
                s.state.to_string(),
                s.dispatches.to_string(),
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
            "AGENT",
            "STATE",
            "DISPATCHES",
            "COMPLETE_BY",
            "ERROR",
            "RESULT",
        ],
        rows,
    ));

    let _ = writeln!(out, "\nevents");
    let rows = events
        .iter()
        .map(|e| {
            vec![
                e.seq.to_string(),
                time(e.at),
                e.event.clone(),
                format!(
                    "{} → {}",
                    e.from_state.as_deref().unwrap_or("-"),
                    e.to_state
                ),
                opt(e.step.as_deref()),
                e.attempt.to_string(),
                e.actor.clone(),
                opt(e.reason.as_deref()),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "SEQ",
            "AT",
            "EVENT",
            "FROM → TO",
            "STEP",
            "ATTEMPT",
            "ACTOR",
            "REASON",
        ],
        rows,
    ));
    out
}

/// Left-aligned columns two spaces apart; `(none)` for no rows.
fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
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
fn cell(text: &str) -> String {
    text.replace(['\n', '\r', '\t'], " ")
}

fn opt(text: Option<&str>) -> String {
    text.unwrap_or("-").to_owned()
}

fn time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S%.3fZ").to_string()
}

fn opt_time(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "-".into(), time)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sas::state::{ProcessState, StepState};

    fn sample() -> (OrderRow, Vec<StepRow>, Vec<EventRow>) {
        let at = DateTime::parse_from_rfc3339("2030-01-02T03:04:05.678Z")
            .unwrap()
            .with_timezone(&Utc);
        let id = Uuid::parse_str("67e55044-10b1-426f-9247-bb680e5fe0c8").unwrap();
        let order = OrderRow {
            order_id: id,
            workflow: "order".into(),
            payload: json!({"sku": "A-1"}),
            reply_to: Some("app".into()),
            priority: 3,
            not_before: None,
            process_state: ProcessState::Processing,
            locked_by: Some("scheduler-1".into()),
            complete_by: Some(at),
            failure_count: 1,
            compensation_failures: 0,
            last_seq: 2,
            last_error: Some("timed out\nat step charge".into()),
            created_at: at,
            updated_at: at,
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
        assert_eq!(v["events"][0]["event"], "received");
        assert_eq!(v["events"][0]["from_state"], Value::Null);
    }

    #[test]
    fn text_shows_aligned_tables() {
        let (order, steps, events) = sample();
        let text = to_text(&order, &steps, &events);
        assert!(text.contains("state          processing\n"), "{text}");
        assert!(
            text.contains("last_error     timed out at step charge\n"),
            "{text}"
        );
        assert!(
            text.contains("IDX  NAME     AGENT          STATE"),
            "{text}"
        );
        assert!(
            text.contains("0    reserve  reserve-agent  completed"),
            "{text}"
        );
        assert!(text.contains("- → pending"), "{text}");
        let (order, _, _) = sample();
        assert!(to_text(&order, &[], &[]).contains("steps\n(none)\n"));
    }

    #[test]
    fn tables_pad_by_characters() {
        let t = table(&["A", "B"], vec![vec!["→x".into(), "1".into()]]);
        assert_eq!(t, "A   B\n→x  1\n");
    }
}

//! `sasctl stats`: figures from the state store for an operator: orders per
//! state, orders received and ended per second over a window, the oldest
//! pending order's age, orders waiting for a re-attempt, the outbox backlog.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use sas::config::Settings;
use sas::messages::rfc3339;
use sas::state::ProcessState;
use sas::state_store::{StateStore, Stats};
use serde_json::{Value, json};

use crate::orders::STATES;

/// The states an order ends in, as `Stats::ended_recently` counts them.
const ENDED: [ProcessState; 3] = [
    ProcessState::Processed,
    ProcessState::Compensated,
    ProcessState::Error,
];

/// Options of `sasctl stats`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The window of the rates: orders received and ended within it, per
    /// second (whole seconds, at least 1s; e.g. "1m", "1h").
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_window)]
    window: Duration,
    /// Print one JSON object instead of text: `by_state` (every state, 0 when
    /// none), `total`, `received_recently`, `ended_recently` (per end state),
    /// `window_secs`, `received_per_sec`, `ended_per_sec`, `oldest_pending`
    /// (RFC 3339 or null), `oldest_pending_age_secs`, `waiting`, `outbox_backlog`.
    #[arg(long)]
    json: bool,
}

/// `--window`: a duration of at least one second.
fn parse_window(text: &str) -> Result<Duration, String> {
    let window = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if window < Duration::from_secs(1) {
        return Err("the window is at least 1s".into());
    }
    Ok(window)
}

/// Runs `sasctl stats`.
pub async fn run(args: Args, settings: &Settings) -> anyhow::Result<()> {
    let store = StateStore::connect(&settings.database, "sasctl")
        .await
        .context("connecting to Postgres")?;
    let stats = sas::state_store::ReadModels::new(store.clone())
        .stats(args.window)
        .await;
    store.close().await;
    let stats = stats.context("reading the statistics")?;
    let figures = Figures::new(stats, Utc::now());
    if args.json {
        println!("{}", figures.json());
    } else {
        print!("{}", figures.text());
    }
    Ok(())
}

/// The snapshot with every state present and the derived figures.
#[derive(Debug)]
struct Figures {
    stats: Stats,
    now: DateTime<Utc>,
}

impl Figures {
    fn new(mut stats: Stats, now: DateTime<Utc>) -> Self {
        for state in STATES {
            stats.by_state.entry(state.as_str().to_owned()).or_insert(0);
        }
        for state in ENDED {
            stats
                .ended_recently
                .entry(state.as_str().to_owned())
                .or_insert(0);
        }
        Self { stats, now }
    }

    fn total(&self) -> i64 {
        self.stats.by_state.values().sum()
    }

    fn ended(&self) -> i64 {
        self.stats.ended_recently.values().sum()
    }

    /// Per second over the window.
    fn rate(&self, n: i64) -> f64 {
        // Counts and windows of orders are far below f64's exact range.
        #[allow(clippy::cast_precision_loss)]
        let (n, secs) = (n as f64, self.stats.window_secs.max(1) as f64);
        n / secs
    }

    /// How long ago the oldest pending order was submitted.
    fn oldest_pending_age(&self) -> Option<Duration> {
        let oldest = self.stats.oldest_pending?;
        Some((self.now - oldest).to_std().unwrap_or_default())
    }

    fn json(&self) -> Value {
        let round = |x: f64| (x * 1000.0).round() / 1000.0;
        json!({
            "by_state": self.stats.by_state,
            "total": self.total(),
            "received_recently": self.stats.received_recently,
            "ended_recently": self.stats.ended_recently,
            "window_secs": self.stats.window_secs,
            "received_per_sec": round(self.rate(self.stats.received_recently)),
            "ended_per_sec": round(self.rate(self.ended())),
            "oldest_pending": self.stats.oldest_pending.as_ref().map(rfc3339::format),
            "oldest_pending_age_secs": self.oldest_pending_age().map(|d| d.as_secs()),
            "waiting": self.stats.waiting,
            "outbox_backlog": self.stats.outbox_backlog,
        })
    }

    fn text(&self) -> String {
        let window = humantime::format_duration(Duration::from_secs(
            u64::try_from(self.stats.window_secs).unwrap_or_default(),
        ));
        let mut out = String::new();
        let _ = writeln!(out, "orders          {}", self.total());
        let width = STATES.iter().map(|s| s.as_str().len()).max().unwrap_or(0);
        for state in STATES {
            let n = self
                .stats
                .by_state
                .get(state.as_str())
                .copied()
                .unwrap_or(0);
            let _ = writeln!(out, "  {:<width$}  {n}", state.as_str());
        }
        let ended: Vec<String> = ENDED
            .iter()
            .map(|s| {
                let n = self
                    .stats
                    .ended_recently
                    .get(s.as_str())
                    .copied()
                    .unwrap_or(0);
                format!("{s} {n}")
            })
            .collect();
        let _ = writeln!(
            out,
            "last {window}: received {} ({:.2}/s), ended {} ({:.2}/s: {})",
            self.stats.received_recently,
            self.rate(self.stats.received_recently),
            self.ended(),
            self.rate(self.ended()),
            ended.join(", ")
        );
        let oldest = match (self.stats.oldest_pending, self.oldest_pending_age()) {
            (Some(at), Some(age)) => format!(
                "{} ago ({})",
                humantime::format_duration(Duration::from_secs(age.as_secs())),
                crate::terminal::time(at)
            ),
            _ => "-".into(),
        };
        let _ = writeln!(out, "oldest pending  {oldest}");
        let _ = writeln!(
            out,
            "waiting         {} (pending until their not_before: re-attempts, delayed orders)",
            self.stats.waiting
        );
        let _ = writeln!(out, "outbox backlog  {}", self.stats.outbox_backlog);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Figures {
        let now = DateTime::parse_from_rfc3339("2030-01-02T03:04:05Z")
            .unwrap()
            .with_timezone(&Utc);
        let stats = Stats {
            by_state: [("processed".to_owned(), 9), ("pending".to_owned(), 2)].into(),
            oldest_pending: Some(now - chrono::Duration::seconds(125)),
            waiting: 1,
            ended_recently: [("processed".to_owned(), 6)].into(),
            received_recently: 30,
            window_secs: 300,
            outbox_backlog: 4,
        };
        Figures::new(stats, now)
    }

    #[test]
    fn json_has_every_state_and_the_rates() {
        let v = sample().json();
        assert_eq!(v["by_state"]["processed"], 9);
        assert_eq!(v["by_state"]["compensating"], 0);
        assert_eq!(v["total"], 11);
        assert_eq!(v["ended_recently"]["error"], 0);
        assert_eq!(v["received_per_sec"], 0.1);
        assert_eq!(v["ended_per_sec"], 0.02);
        assert_eq!(v["oldest_pending_age_secs"], 125);
        assert_eq!(v["oldest_pending"], "2030-01-02T03:02:00.000000Z");
        assert_eq!(v["waiting"], 1);
        assert_eq!(v["outbox_backlog"], 4);
        assert_eq!(v["window_secs"], 300);
    }

    #[test]
    fn text_shows_counts_rates_and_ages() {
        let text = sample().text();
        assert!(text.starts_with("orders          11\n"), "{text}");
        assert!(text.contains("  processed     9\n"), "{text}");
        assert!(text.contains("  compensating  0\n"), "{text}");
        assert!(
            text.contains(
                "last 5m: received 30 (0.10/s), ended 6 (0.02/s: processed 6, compensated 0, error 0)"
            ),
            "{text}"
        );
        assert!(
            text.contains("oldest pending  2m 5s ago (2030-01-02 03:02:00.000Z)"),
            "{text}"
        );
        assert!(text.contains("outbox backlog  4\n"), "{text}");
        let empty = Figures::new(Stats::default(), Utc::now());
        assert!(empty.text().contains("oldest pending  -\n"));
        assert_eq!(empty.json()["oldest_pending"], Value::Null);
    }

    #[test]
    fn the_window_is_at_least_a_second() {
        assert_eq!(parse_window("5m").unwrap(), Duration::from_secs(300));
        assert!(parse_window("500ms").is_err());
        assert!(parse_window("soon").is_err());
    }
}

//! `sasctl submit`: publishes orders to `<prefix>.orders` exactly as an
//! application would (contract §1), with publisher confirms, pipelined in
//! chunks: generated orders (`--workflow … --count N`), a raw body (`--raw`),
//! or the lines of a JSON-lines file (`--file`), each published as-is.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use clap::value_parser;
use indicatif::{ProgressBar, ProgressStyle};
use sas::broker::PublishError;
use sas::config::Settings;
use sas::messages::{Events, Priority};
use sas::topology::QueueNames;
use sas_client::{Client, Order};
use serde_json::{Map, Value, json};
use tokio::io::{AsyncBufRead, AsyncBufReadExt};
use uuid::Uuid;

use crate::Exit;

/// Messages sent before their confirms are awaited.
pub const CHUNK: u32 = 256;

/// How many bad line numbers the final error names before "…".
const BAD_LINES_NAMED: usize = 10;

/// Options of `sasctl submit`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Workflow of the orders (a workflow configured in the services).
    #[arg(long, required_unless_present_any = ["raw", "file"])]
    workflow: Option<String>,
    /// Business data handed to every step: a JSON object [default: {}].
    #[arg(long, value_name = "JSON", value_parser = parse_payload)]
    payload: Option<Map<String, Value>>,
    /// The order's id (only with `--count 1`); generated when absent.
    #[arg(long, value_name = "UUID")]
    order_id: Option<Uuid>,
    /// Private status queue for the orders' events (the AMQP reply_to of every
    /// message, also with --file and --raw); declared (durable) first.
    #[arg(long, value_name = "QUEUE", value_parser = parse_queue)]
    reply_to: Option<String>,
    /// Priority from 0 to 9; higher is claimed first.
    #[arg(long, value_name = "N", value_parser = value_parser!(u8).range(0..=9))]
    priority: Option<u8>,
    /// Do not start the orders before this time (RFC 3339).
    #[arg(long, value_name = "RFC3339", value_parser = parse_time)]
    not_before: Option<DateTime<Utc>>,
    /// Which status events the orders are sent (contract §2a): `all`, or
    /// `terminal` for their end only (the rest stays for a replay).
    #[arg(long, value_name = "all|terminal", value_parser = parse_events, default_value = "all")]
    events: Events,
    /// How many orders to publish.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = value_parser!(u32).range(1..))]
    count: u32,
    /// Publish this body as-is instead of an order (e.g. to demonstrate dead-lettering).
    #[arg(
        long,
        value_name = "BODY",
        conflicts_with_all = ["workflow", "payload", "order_id", "priority", "not_before", "events", "file"]
    )]
    raw: Option<String>,
    /// Publish the orders of a JSON-lines file ("-": standard input), one
    /// order per line, each as-is: the submission service validates them.
    /// sasctl checks only that each line is JSON; it reports a bad line with
    /// its number, skips it and exits 1 at the end. Empty lines are ignored.
    #[arg(
        long,
        value_name = "PATH",
        conflicts_with_all = ["workflow", "payload", "order_id", "priority", "not_before", "events", "count"]
    )]
    file: Option<PathBuf>,
    /// Print the summary as one JSON object on stdout instead of the order
    /// ids: `{"queue", "published", "order_ids", "bad_lines": [{"line",
    /// "error"}], "elapsed_secs", "per_sec"}`.
    #[arg(long)]
    json: bool,
}

impl Args {
    /// Checks between arguments that clap cannot express.
    pub fn check(&self) -> Result<(), String> {
        if self.order_id.is_some() && self.count != 1 {
            return Err("--order-id can only be used with --count 1".into());
        }
        Ok(())
    }

    /// The next message: its order id (none for a raw body) and its body.
    fn message(&self) -> (Option<Uuid>, Vec<u8>) {
        if let Some(raw) = &self.raw {
            return (None, raw.as_bytes().to_vec());
        }
        let order_id = self.order_id.unwrap_or_else(Uuid::new_v4);
        let body = order_body(
            order_id,
            self.workflow.as_deref().unwrap_or_default(),
            self.payload.clone().unwrap_or_default(),
            &Options {
                priority: self.priority,
                not_before: self.not_before,
                events: self.events,
            },
        );
        (Some(order_id), body.to_string().into_bytes())
    }
}

/// An order's optional fields; the default leaves each out of the body.
#[derive(Debug, Clone, Default)]
pub struct Options {
    pub priority: Option<u8>,
    pub not_before: Option<DateTime<Utc>>,
    pub events: Events,
}

/// The body of an order (contract §1), as the client encodes it.
pub fn order_body(
    order_id: Uuid,
    workflow: &str,
    payload: Map<String, Value>,
    options: &Options,
) -> Value {
    let mut order = Order::new(workflow, payload);
    order.order_id = Some(order_id);
    order.priority = options
        .priority
        .and_then(|p| Priority::new(p.into()))
        .unwrap_or_default();
    order.not_before = options.not_before;
    order.events = options.events;
    serde_json::to_value(order).unwrap_or_default()
}

/// `--events`: `all` or `terminal`.
fn parse_events(text: &str) -> Result<Events, String> {
    Events::try_from(text.to_owned()).map_err(|_| "`all` or `terminal`".to_owned())
}

/// `--payload`: a JSON object.
pub fn parse_payload(text: &str) -> Result<Map<String, Value>, String> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err("the payload must be a JSON object".into()),
        Err(e) => Err(format!("not valid JSON: {e}")),
    }
}

/// `--reply-to`: a queue name, 1 to 255 bytes.
fn parse_queue(text: &str) -> Result<String, String> {
    if text.is_empty() || text.len() > 255 {
        return Err("a queue name is 1 to 255 bytes".into());
    }
    Ok(text.to_owned())
}

/// `--not-before`: an RFC 3339 time.
fn parse_time(text: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| format!("not an RFC 3339 time (e.g. 2030-01-01T12:00:00Z): {e}"))
}

/// Where the lines of `--file` come from.
struct Input {
    reader: Box<dyn AsyncBufRead + Unpin + Send>,
    /// The file's size, for the progress bar; `None` for standard input.
    len: Option<u64>,
    /// The file's name, for errors.
    name: String,
}

/// Opens `--file`; `-` is standard input. A file that cannot be opened is a
/// usage error (exit 2).
async fn open(path: &Path) -> anyhow::Result<Input> {
    const BUFFER: usize = 64 * 1024;
    if path == Path::new("-") {
        return Ok(Input {
            reader: Box::new(tokio::io::BufReader::with_capacity(
                BUFFER,
                tokio::io::stdin(),
            )),
            len: None,
            name: "standard input".into(),
        });
    }
    let name = path.display().to_string();
    let file = tokio::fs::File::open(path).await.map_err(|e| Exit {
        code: Exit::USAGE,
        message: format!("cannot open {name}: {e}"),
    })?;
    let len = file
        .metadata()
        .await
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.len());
    Ok(Input {
        reader: Box::new(tokio::io::BufReader::with_capacity(BUFFER, file)),
        len,
        name,
    })
}

/// One line of a JSON-lines file.
#[derive(Debug, PartialEq, Eq)]
enum Line {
    /// Nothing but white space: ignored.
    Empty,
    /// JSON: published as-is; its `order_id`, when it is a string.
    Json { order_id: Option<String> },
    /// Not JSON: why, reported and skipped.
    Bad(String),
}

/// Checks a line (without its line ending); only that it is JSON.
fn check_line(line: &[u8]) -> Line {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Line::Empty;
    }
    match serde_json::from_slice::<Value>(line) {
        Ok(value) => Line::Json {
            order_id: value
                .get("order_id")
                .and_then(Value::as_str)
                .map(str::to_owned),
        },
        Err(e) => Line::Bad(format!("not JSON ({e})")),
    }
}

/// A line without its `\n` or `\r\n`.
fn trim_line_ending(mut line: &[u8]) -> &[u8] {
    if let Some(rest) = line.strip_suffix(b"\n") {
        line = rest;
    }
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// A line of the input that was not JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BadLine {
    /// Its number, from 1.
    line: u64,
    error: String,
}

/// What a submission did: the summary line on stderr, or `--json` on stdout.
#[derive(Debug, Default)]
struct Summary {
    /// Messages the broker confirmed.
    published: u64,
    /// The ids of the confirmed orders (generated, or a line's `order_id`);
    /// collected for `--json` only, printed as they come otherwise.
    order_ids: Vec<String>,
    bad_lines: Vec<BadLine>,
    /// From the first publish to the last confirm.
    elapsed: Duration,
}

impl Summary {
    /// Confirmed messages per second.
    fn per_sec(&self) -> f64 {
        // A u64 count is exact in an f64 far beyond any real run.
        #[allow(clippy::cast_precision_loss)]
        let published = self.published as f64;
        published / self.elapsed.as_secs_f64().max(0.001)
    }

    fn json(&self, queue: &str) -> Value {
        json!({
            "queue": queue,
            "published": self.published,
            "order_ids": self.order_ids,
            "bad_lines": self
                .bad_lines
                .iter()
                .map(|b| json!({ "line": b.line, "error": b.error }))
                .collect::<Vec<_>>(),
            "elapsed_secs": (self.elapsed.as_secs_f64() * 1000.0).round() / 1000.0,
            "per_sec": (self.per_sec() * 10.0).round() / 10.0,
        })
    }

    /// The summary line: published, to where, elapsed, rate, bad lines.
    fn text(&self, queue: &str, noun: (&str, &str), reply_to: Option<&str>) -> String {
        let noun = if self.published == 1 { noun.0 } else { noun.1 };
        let mut line = format!("submitted {} {noun} to {queue}", self.published);
        if let Some(q) = reply_to {
            line.push_str(&format!(" (events to {q})"));
        }
        line.push_str(&format!(
            " in {:.2}s ({:.1}/s)",
            self.elapsed.as_secs_f64(),
            self.per_sec()
        ));
        match self.bad_lines.len() {
            0 => {}
            1 => line.push_str("; 1 bad line skipped"),
            n => line.push_str(&format!("; {n} bad lines skipped")),
        }
        line
    }

    /// The failure to report when lines were skipped.
    fn bad_lines_error(&self) -> Option<anyhow::Error> {
        let (first, n) = (self.bad_lines.first()?, self.bad_lines.len());
        let mut numbers: Vec<String> = self
            .bad_lines
            .iter()
            .take(BAD_LINES_NAMED)
            .map(|b| b.line.to_string())
            .collect();
        if n > BAD_LINES_NAMED {
            numbers.push("…".into());
        }
        Some(if n == 1 {
            anyhow::anyhow!("line {} skipped: {}", first.line, first.error)
        } else {
            anyhow::anyhow!("{n} lines skipped, not JSON: lines {}", numbers.join(", "))
        })
    }
}

/// A progress bar on stderr; hidden when stderr is not a terminal.
fn progress_bar(len: Option<u64>, template: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = match len {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::new_spinner(),
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// Runs `sasctl submit`.
pub async fn run(args: Args, settings: &Settings) -> anyhow::Result<()> {
    let queues = QueueNames::new(&settings.broker.prefix);
    let input = match &args.file {
        Some(path) => Some(open(path).await?),
        None => None,
    };
    let client = Client::connect_with(sas::broker::client_options(&settings.broker, "sasctl")?)
        .await
        .context("connecting to RabbitMQ")?;
    let outcome = submit(&client, &queues, &args, input).await;
    client.close().await;
    let summary = outcome?;
    let noun = match (args.raw.is_some(), args.file.is_some()) {
        (true, _) => ("raw message", "raw messages"),
        (false, true) => ("line", "lines"),
        (false, false) => ("order", "orders"),
    };
    if args.json {
        println!("{}", summary.json(queues.orders()));
    } else {
        eprintln!(
            "{}",
            summary.text(queues.orders(), noun, args.reply_to.as_deref())
        );
    }
    match summary.bad_lines_error() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Declares the status queue and publishes everything.
async fn submit(
    client: &Client,
    queues: &QueueNames,
    args: &Args,
    input: Option<Input>,
) -> anyhow::Result<Summary> {
    if let Some(q) = &args.reply_to {
        client
            .declare_status_queue(q)
            .await
            .with_context(|| format!("declaring the status queue {q}"))?;
    }
    let bar = match (&input, args.count > CHUNK) {
        (Some(Input { len: Some(len), .. }), _) => progress_bar(
            Some(*len),
            "{spinner} {elapsed_precise} [{wide_bar}] {bytes}/{total_bytes} {msg}",
        ),
        (Some(Input { len: None, .. }), _) => {
            progress_bar(None, "{spinner} {elapsed_precise} {bytes} read, {msg}")
        }
        (None, true) => progress_bar(
            Some(u64::from(args.count)),
            "{spinner} {elapsed_precise} [{wide_bar}] {pos}/{len} orders ({per_sec})",
        ),
        (None, false) => ProgressBar::hidden(),
    };
    let mut submitting = Submitting {
        client,
        queues,
        reply_to: args.reply_to.as_deref(),
        json: args.json,
        bar,
        summary: Summary::default(),
    };
    let started = Instant::now();
    let outcome = match input {
        Some(input) => submitting.lines(input).await,
        None => submitting.generated(args).await,
    };
    submitting.bar.finish_and_clear();
    outcome?;
    submitting.summary.elapsed = started.elapsed();
    Ok(submitting.summary)
}

/// A submission under way.
struct Submitting<'a> {
    client: &'a Client,
    queues: &'a QueueNames,
    reply_to: Option<&'a str>,
    json: bool,
    bar: ProgressBar,
    summary: Summary,
}

impl Submitting<'_> {
    /// `--count` generated orders, or `--raw` bodies.
    async fn generated(&mut self, args: &Args) -> anyhow::Result<()> {
        let mut remaining = args.count;
        while remaining > 0 {
            let n = remaining.min(CHUNK);
            let batch: Vec<(Option<Uuid>, Vec<u8>)> = (0..n).map(|_| args.message()).collect();
            let ids: Vec<Option<String>> = batch
                .iter()
                .map(|(id, _)| id.map(|id| id.to_string()))
                .collect();
            self.chunk(&batch, &ids).await?;
            self.bar.set_position(self.summary.published);
            remaining -= n;
        }
        Ok(())
    }

    /// The lines of `--file`, chunk by chunk.
    async fn lines(&mut self, mut input: Input) -> anyhow::Result<()> {
        let chunk = CHUNK as usize;
        let mut batch: Vec<(Option<Uuid>, Vec<u8>)> = Vec::with_capacity(chunk);
        let mut ids: Vec<Option<String>> = Vec::with_capacity(chunk);
        let mut buf = Vec::new();
        let (mut number, mut read) = (0u64, 0u64);
        loop {
            buf.clear();
            let n = input
                .reader
                .read_until(b'\n', &mut buf)
                .await
                .with_context(|| format!("reading {} after line {number}", input.name))?;
            if n == 0 {
                break;
            }
            number += 1;
            read += n as u64;
            let line = trim_line_ending(&buf);
            match check_line(line) {
                Line::Empty => {}
                Line::Json { order_id } => {
                    batch.push((None, line.to_vec()));
                    ids.push(order_id);
                }
                Line::Bad(error) => {
                    self.bar
                        .suspend(|| eprintln!("sasctl: line {number}: {error}; skipped"));
                    self.summary.bad_lines.push(BadLine {
                        line: number,
                        error,
                    });
                    self.show_counts();
                }
            }
            if batch.len() >= chunk {
                self.chunk(&batch, &ids).await?;
                batch.clear();
                ids.clear();
                self.show_counts();
            }
            self.bar.set_position(read);
        }
        if !batch.is_empty() {
            self.chunk(&batch, &ids).await?;
        }
        Ok(())
    }

    /// The counts beside the progress bar.
    fn show_counts(&self) {
        if !self.bar.is_hidden() {
            self.bar.set_message(format!(
                "{} published, {} bad",
                self.summary.published,
                self.summary.bad_lines.len()
            ));
        }
    }

    /// Publishes a chunk, then reads its confirms; the ids of the confirmed
    /// messages are printed (or kept for `--json`). An error when any message
    /// was not accepted.
    async fn chunk(
        &mut self,
        batch: &[(Option<Uuid>, Vec<u8>)],
        ids: &[Option<String>],
    ) -> anyhow::Result<()> {
        let queue = self.queues.orders();
        let confirmed_before = self.summary.published;
        let outcomes = publish_batch(self.client, self.reply_to, batch)
            .await
            .with_context(|| {
                format!("publishing to {queue} ({confirmed_before} confirmed before)")
            })?;
        let mut confirmed = Vec::new();
        let mut failed: Option<(u32, sas_client::Error)> = None;
        for (id, outcome) in ids.iter().zip(outcomes) {
            match outcome {
                Ok(()) => {
                    self.summary.published += 1;
                    if let Some(id) = id {
                        confirmed.push(id.clone());
                    }
                }
                Err(e) => match &mut failed {
                    Some((count, _)) => *count += 1,
                    None => failed = Some((1, e)),
                },
            }
        }
        if self.json {
            self.summary.order_ids.extend(confirmed);
        } else if !confirmed.is_empty() {
            self.bar
                .suspend(|| {
                    let mut out = std::io::stdout().lock();
                    for id in &confirmed {
                        writeln!(out, "{id}")?;
                    }
                    out.flush()
                })
                .context("writing to stdout")?;
        }
        if let Some((count, e)) = failed {
            let summary = format!(
                "{count} of {} messages not accepted, {} confirmed",
                batch.len(),
                self.summary.published
            );
            return Err(match e {
                sas_client::Error::Publish(PublishError::Unroutable(_)) => {
                    anyhow::anyhow!("{summary}: {e} ({})", no_orders_queue_hint(self.queues))
                }
                e => anyhow::Error::new(e).context(summary),
            });
        }
        Ok(())
    }
}

/// Why `<prefix>.orders` may not exist, for an unroutable order.
pub fn no_orders_queue_hint(queues: &QueueNames) -> String {
    format!(
        "start a submission service with broker.prefix {:?}: it declares the queue",
        queues.prefix()
    )
}

/// Publishes a batch of messages (order id, body) to `<prefix>.orders`
/// through the client, as-is, then reads their confirms: for each message,
/// in order, whether the broker took it. Sending everything before reading
/// any confirm pipelines the batch (one round trip, not one per message).
/// An error means a send failed: the messages sent before it may or may not
/// have arrived.
pub async fn publish_batch(
    client: &Client,
    reply_to: Option<&str>,
    batch: &[(Option<Uuid>, Vec<u8>)],
) -> Result<Vec<Result<(), sas_client::Error>>, sas_client::Error> {
    let mut pending = Vec::with_capacity(batch.len());
    for (order_id, body) in batch {
        let message_id = order_id.map(|id| id.to_string());
        pending.push(
            client
                .send_raw(body, reply_to, message_id.as_deref())
                .await?,
        );
    }
    let mut outcomes = Vec::with_capacity(pending.len());
    for confirm in pending {
        outcomes.push(confirm.confirmed().await);
    }
    Ok(outcomes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_must_be_json_objects() {
        assert_eq!(parse_payload("{}").unwrap(), Map::new());
        assert_eq!(parse_payload(r#"{"a":[1,2]}"#).unwrap()["a"][1], 2);
        assert!(parse_payload("{").unwrap_err().contains("not valid JSON"));
        assert!(parse_payload("[1]").unwrap_err().contains("object"));
        assert!(parse_payload("\"x\"").is_err());
    }

    #[test]
    fn times_and_queues_are_checked() {
        assert_eq!(
            parse_time("2030-01-01T01:00:00+01:00")
                .unwrap()
                .to_rfc3339(),
            "2030-01-01T00:00:00+00:00"
        );
        assert!(parse_time("tomorrow").is_err());
        assert!(parse_queue("").is_err());
        assert!(parse_queue(&"q".repeat(256)).is_err());
        assert_eq!(parse_queue("app.events").unwrap(), "app.events");
    }

    #[test]
    fn the_body_is_what_the_submission_accepts() {
        let id = Uuid::new_v4();
        let t = parse_time("2030-01-01T00:00:00Z").unwrap();
        let payload = parse_payload(r#"{"sku":"A-1"}"#).unwrap();
        let body = order_body(
            id,
            "order",
            payload,
            &Options {
                priority: Some(7),
                not_before: Some(t),
                events: Events::Terminal,
            },
        );
        let decoded = sas::messages::decode_submission(
            body.to_string().as_bytes(),
            Some("app"),
            1 << 20,
            &sas::topology::QueueNames::new("sas"),
        )
        .unwrap();
        assert_eq!(decoded.order_id, Some(id));
        assert_eq!(decoded.workflow, "order");
        assert_eq!(decoded.payload["sku"], "A-1");
        assert_eq!(decoded.priority.get(), 7);
        assert_eq!(decoded.not_before, Some(t));
        assert_eq!(decoded.events, Events::Terminal);
        assert_eq!(decoded.reply_to.as_deref(), Some("app"));
        assert_eq!(parse_events("terminal"), Ok(Events::Terminal));
        assert!(parse_events("some").is_err());

        let minimal = order_body(id, "w", Map::new(), &Options::default());
        assert_eq!(
            minimal,
            serde_json::json!({"order_id": id.to_string(), "workflow": "w", "payload": {}})
        );
    }

    #[test]
    fn lines_need_only_be_json() {
        assert_eq!(check_line(b""), Line::Empty);
        assert_eq!(check_line(b"  \t"), Line::Empty);
        assert_eq!(
            check_line(br#"{"order_id":"x","workflow":"w"}"#),
            Line::Json {
                order_id: Some("x".into())
            }
        );
        // The submission validates: any JSON passes here.
        assert_eq!(check_line(b"[1,2]"), Line::Json { order_id: None });
        assert_eq!(
            check_line(br#"{"order_id":7}"#),
            Line::Json { order_id: None }
        );
        match check_line(b"{\"workflow\":") {
            Line::Bad(why) => assert!(why.starts_with("not JSON ("), "{why}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(check_line(&[0xff, b'{']), Line::Bad(_)));
        assert_eq!(trim_line_ending(b"{}\r\n"), b"{}");
        assert_eq!(trim_line_ending(b"{}\n"), b"{}");
        assert_eq!(trim_line_ending(b"{}"), b"{}");
    }

    #[test]
    fn the_summary_gives_counts_time_rate_and_bad_lines() {
        let mut summary = Summary {
            published: 8,
            order_ids: vec!["a".into()],
            bad_lines: vec![
                BadLine {
                    line: 3,
                    error: "not JSON (x)".into(),
                },
                BadLine {
                    line: 7,
                    error: "not JSON (y)".into(),
                },
            ],
            elapsed: Duration::from_millis(500),
        };
        assert_eq!(
            summary.text("p.orders", ("line", "lines"), Some("app")),
            "submitted 8 lines to p.orders (events to app) in 0.50s (16.0/s); 2 bad lines skipped"
        );
        let v = summary.json("p.orders");
        assert_eq!(v["published"], 8);
        assert_eq!(v["per_sec"], 16.0);
        assert_eq!(v["elapsed_secs"], 0.5);
        assert_eq!(v["order_ids"], json!(["a"]));
        assert_eq!(
            v["bad_lines"][1],
            json!({"line": 7, "error": "not JSON (y)"})
        );
        assert_eq!(
            summary.bad_lines_error().unwrap().to_string(),
            "2 lines skipped, not JSON: lines 3, 7"
        );
        summary.bad_lines.truncate(1);
        assert_eq!(
            summary.bad_lines_error().unwrap().to_string(),
            "line 3 skipped: not JSON (x)"
        );
        summary.bad_lines = (1..=12)
            .map(|line| BadLine {
                line,
                error: String::new(),
            })
            .collect();
        assert!(
            summary
                .bad_lines_error()
                .unwrap()
                .to_string()
                .ends_with("lines 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, …")
        );
        summary.bad_lines.clear();
        assert!(summary.bad_lines_error().is_none());
        assert!(!summary.text("q", ("order", "orders"), None).contains("bad"));
    }

    #[test]
    fn the_progress_bar_is_hidden_without_a_terminal() {
        // Tests run with stderr captured or redirected.
        if !std::io::stderr().is_terminal() {
            assert!(progress_bar(Some(10), "{bar}").is_hidden());
        }
    }

    #[test]
    fn messages_get_fresh_ids_unless_given() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let args = Cli::try_parse_from(["t", "--workflow", "w", "--count", "2"])
            .unwrap()
            .args;
        let (a, _) = args.message();
        let (b, body) = args.message();
        assert_ne!(a, b);
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["payload"], serde_json::json!({}));

        let raw = Cli::try_parse_from(["t", "--raw", "not json"])
            .unwrap()
            .args;
        assert_eq!(raw.message(), (None, b"not json".to_vec()));
        assert!(Cli::try_parse_from(["t", "--raw", "x", "--workflow", "w"]).is_err());
        assert!(Cli::try_parse_from(["t"]).is_err());
        assert!(Cli::try_parse_from(["t", "--workflow", "w", "--count", "0"]).is_err());
        assert!(Cli::try_parse_from(["t", "--workflow", "w", "--priority", "10"]).is_err());
        let file = Cli::try_parse_from(["t", "--file", "-", "--reply-to", "q", "--json"])
            .unwrap()
            .args;
        assert_eq!(file.file.as_deref(), Some(Path::new("-")));
        assert!(file.json);
        assert!(Cli::try_parse_from(["t", "--file", "f", "--priority", "1"]).is_err());
    }
}

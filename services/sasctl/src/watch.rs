//! `sasctl watch`: prints the messages of a queue as JSON lines on stdout,
//! acknowledging each once printed; with filters (`--order-id`, `--state`)
//! only the matching ones are printed, the others are consumed all the same.
//! [`print_queue`] is the machinery, shared with `sasctl alerts`;
//! [`read_queue`], its reading loop, is shared with `sas-chaos`.

use std::collections::BTreeSet;
use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use clap::value_parser;
use sas::broker::{Broker, Consumer};
use sas::config::Settings;
use sas::messages::EventKind;
use serde_json::Value;

/// Every status event state, in the order of an order's life.
const EVENT_STATES: [EventKind; 9] = [
    EventKind::Received,
    EventKind::Rejected,
    EventKind::Processing,
    EventKind::StepSucceeded,
    EventKind::RetryScheduled,
    EventKind::Processed,
    EventKind::Compensating,
    EventKind::Compensated,
    EventKind::Failed,
];

/// Options of `sasctl watch`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The queue to read; declared (durable) when it does not exist yet.
    #[arg(value_name = "QUEUE")]
    queue: String,
    /// Stop after this many messages.
    #[arg(long, value_name = "N", value_parser = value_parser!(u64).range(1..))]
    count: Option<u64>,
    /// Stop when no message arrived for this long (e.g. "30s", "500ms").
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    timeout: Option<Duration>,
    /// Print only messages about this order (their `order_id`); repeatable.
    /// The others are consumed (acknowledged) all the same.
    #[arg(long = "order-id", value_name = "ID")]
    order_ids: Vec<String>,
    /// Print only status events in this state: received, rejected,
    /// processing, step_succeeded, retry_scheduled, processed, compensating,
    /// compensated or failed; repeatable. The others are consumed
    /// (acknowledged) all the same.
    #[arg(long = "state", value_name = "STATE", value_parser = parse_event_state)]
    states: Vec<EventKind>,
    /// Stop once every --order-id has had a terminal event (processed,
    /// compensated, failed or rejected), printed or not. Reading that stops
    /// before (--count, --timeout, Ctrl-C) exits 1, naming the orders that
    /// did not end.
    #[arg(long, requires = "order_ids")]
    until_terminal: bool,
    /// Accepted for scripts that pass --json everywhere: the output is always JSON lines.
    #[arg(long)]
    json: bool,
}

/// `--state`: a status event state; the error lists the valid ones.
fn parse_event_state(text: &str) -> Result<EventKind, String> {
    text.parse().map_err(|_| {
        let names: Vec<&str> = EVENT_STATES.iter().map(|s| s.as_str()).collect();
        format!("unknown state; valid states: {}", names.join(", "))
    })
}

/// Which messages to print: all when empty. A message matches when it
/// matches each filter given.
#[derive(Debug, Default)]
pub struct Filter {
    /// Messages whose `order_id` is one of these.
    pub order_ids: BTreeSet<String>,
    /// Status events whose `state` is one of these.
    pub states: Vec<EventKind>,
}

impl Filter {
    fn is_empty(&self) -> bool {
        self.order_ids.is_empty() && self.states.is_empty()
    }

    /// Whether a message (`None`: not JSON) is to be printed.
    fn matches(&self, message: Option<&Value>) -> bool {
        if self.is_empty() {
            return true;
        }
        let Some(message) = message else {
            return false;
        };
        let id_ok = self.order_ids.is_empty()
            || order_id_of(message).is_some_and(|id| self.order_ids.contains(&id));
        let state_ok =
            self.states.is_empty() || state_of(message).is_some_and(|s| self.states.contains(&s));
        id_ok && state_ok
    }
}

/// A message's `order_id` as text (a `rejected` event gives the id as the
/// message had it, whatever its type).
fn order_id_of(message: &Value) -> Option<String> {
    match message.get("order_id")? {
        Value::String(s) => Some(s.clone()),
        Value::Null => None,
        other => Some(other.to_string()),
    }
}

/// A status event's `state`.
fn state_of(message: &Value) -> Option<EventKind> {
    message.get("state")?.as_str()?.parse().ok()
}

/// The orders `--until-terminal` still waits for.
#[derive(Debug)]
struct Waiting(BTreeSet<String>);

impl Waiting {
    /// Notes a message; whether every order has now ended.
    fn see(&mut self, message: Option<&Value>) -> bool {
        if let Some(message) = message
            && state_of(message).is_some_and(EventKind::is_terminal)
            && let Some(id) = order_id_of(message)
        {
            self.0.remove(&id);
        }
        self.0.is_empty()
    }
}

/// A queue to print and when to stop.
#[derive(Debug)]
pub struct Reading<'a> {
    pub queue: &'a str,
    /// What to do when the queue does not exist.
    pub missing: Missing,
    /// Stop after this many messages.
    pub count: Option<u64>,
    /// Stop when no message arrived for this long.
    pub idle: Option<Duration>,
    /// Which messages to print; the others are acknowledged unprinted.
    pub filter: Filter,
    /// Stop once every order of `filter.order_ids` had a terminal event.
    pub until_terminal: bool,
    /// What the messages are called in the summary on stderr, singular and plural.
    pub noun: (&'a str, &'a str),
}

/// What [`print_queue`] does about the queue's existence.
#[derive(Debug)]
pub enum Missing {
    /// Declare it as an application's status queue (durable, classic) when
    /// missing; read it as it is when it exists with other arguments.
    Declare,
    /// Do not declare it: a sas queue (e.g. the quorum queue `<prefix>.alerts`)
    /// that the services declare. Missing, it is an error with this hint.
    Fail { hint: String },
}

/// Why reading stopped.
#[derive(Debug, PartialEq, Eq)]
enum Stop {
    Count,
    /// Every order `--until-terminal` waited for ended.
    Ended,
    Idle,
    Signal,
    /// Whoever reads stdout went away; the last message was not acknowledged.
    ClosedOutput,
}

/// Runs `sasctl watch`.
pub async fn run(args: Args, settings: &Settings) -> anyhow::Result<()> {
    print_queue(
        settings,
        &Reading {
            queue: &args.queue,
            missing: Missing::Declare,
            count: args.count,
            idle: args.timeout,
            filter: Filter {
                order_ids: args.order_ids.iter().cloned().collect(),
                states: args.states.clone(),
            },
            until_terminal: args.until_terminal,
            noun: ("message", "messages"),
        },
    )
    .await
}

/// Prints the messages of a queue as JSON lines on stdout, acknowledging each
/// once printed, until a stop condition or SIGINT/SIGTERM; then a summary on stderr.
pub async fn print_queue(settings: &Settings, reading: &Reading<'_>) -> anyhow::Result<()> {
    let queue = reading.queue;
    let shutdown = sas::shutdown::on_signal().context("installing the signal handlers")?;
    let setup = async {
        let broker = Broker::connect(&settings.broker, "sasctl")
            .await
            .context("connecting to RabbitMQ")?;
        if let Missing::Declare = reading.missing {
            match broker.declare_status_queue(queue).await {
                Ok(()) => {}
                // It exists with other arguments (a sas quorum queue such as
                // `<prefix>.alerts` or a dead-letter queue): read it as it is.
                Err(e) if e.is_precondition_failed() => {
                    tracing::debug!(%queue, "the queue exists with other arguments");
                }
                Err(e) => {
                    return Err(e).with_context(|| format!("declaring the queue {queue}"));
                }
            }
        }
        let prefetch = reading.count.map_or(settings.broker.prefetch, |n| {
            u16::try_from(n)
                .unwrap_or(u16::MAX)
                .min(settings.broker.prefetch)
        });
        let consumer = match broker.consume(queue, prefetch, "sasctl-watch").await {
            Ok(consumer) => consumer,
            Err(e) if e.is_not_found() => {
                broker.close().await;
                return Err(match &reading.missing {
                    Missing::Fail { hint } => {
                        anyhow::anyhow!("the queue {queue} does not exist ({hint})")
                    }
                    Missing::Declare => anyhow::anyhow!("the queue {queue} does not exist"),
                });
            }
            Err(e) => {
                broker.close().await;
                return Err(e).with_context(|| format!("consuming {queue}"));
            }
        };
        anyhow::Ok((broker, consumer))
    };
    let (broker, mut consumer) = tokio::select! {
        ready = setup => ready?,
        () = shutdown.cancelled() => return Ok(()),
    };
    let outcome = consume(&mut consumer, reading, shutdown.cancelled()).await;
    // Closing the connection hands back what was delivered but not printed;
    // the consumer is dropped after it, so its cancel does not race the close.
    broker.close().await;
    drop(consumer);
    let (seen, stop) = outcome?;
    let why = match stop {
        Stop::Count => "count reached".to_owned(),
        Stop::Ended => "every watched order ended".to_owned(),
        Stop::Idle => format!(
            "nothing for {}",
            humantime::format_duration(reading.idle.unwrap_or_default())
        ),
        Stop::Signal => "interrupted".to_owned(),
        Stop::ClosedOutput => "output closed".to_owned(),
    };
    let noun = if seen.printed == 1 {
        reading.noun.0
    } else {
        reading.noun.1
    };
    let others = if seen.others > 0 {
        format!(", {} other{} consumed", seen.others, plural(seen.others))
    } else {
        String::new()
    };
    eprintln!("{} {noun} from {queue} ({why}){others}", seen.printed);
    if reading.until_terminal && stop != Stop::Ended {
        let open: Vec<&str> = seen.waiting.iter().map(String::as_str).collect();
        anyhow::bail!(
            "{} of {} watched orders had no terminal event: {}",
            open.len(),
            reading.filter.order_ids.len(),
            open.join(", ")
        );
    }
    Ok(())
}

fn plural(n: u64) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// What a reading saw.
#[derive(Debug, Default)]
struct Seen {
    /// Messages printed.
    printed: u64,
    /// Messages consumed without being printed (filtered out).
    others: u64,
    /// Watched orders without a terminal event yet.
    waiting: BTreeSet<String>,
}

/// Prints and acknowledges deliveries until a stop condition; what was seen.
async fn consume(
    consumer: &mut Consumer,
    reading: &Reading<'_>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<(Seen, Stop)> {
    let mut waiting = reading
        .until_terminal
        .then(|| Waiting(reading.filter.order_ids.clone()));
    let mut seen = Seen::default();
    if reading.count == Some(0) {
        return Ok((seen, Stop::Count));
    }
    let mut out = std::io::stdout();
    let mut closed = false;
    let mut ended = false;
    let end = read_queue(consumer, reading.queue, reading.idle, shutdown, |body| {
        let message = serde_json::from_slice::<Value>(body).ok();
        let all_ended = waiting.as_mut().is_some_and(|w| w.see(message.as_ref()));
        if !reading.filter.matches(message.as_ref()) {
            seen.others += 1;
            ended = all_ended;
            return Ok(if all_ended {
                Handled::Last
            } else {
                Handled::Next
            });
        }
        let line = match &message {
            Some(value) => value.to_string(),
            None => json_line(body),
        };
        match writeln!(out, "{line}").and_then(|()| out.flush()) {
            Ok(()) => {}
            // Unacknowledged, the message goes back to the queue.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                closed = true;
                return Ok(Handled::Refused);
            }
            Err(e) => return Err(e).context("writing to stdout"),
        }
        seen.printed += 1;
        ended = all_ended;
        Ok(
            if all_ended || reading.count.is_some_and(|n| seen.printed >= n) {
                Handled::Last
            } else {
                Handled::Next
            },
        )
    })
    .await?;
    if let Some(w) = waiting {
        seen.waiting = w.0;
    }
    let stop = match end {
        ReadEnd::Handler if closed => Stop::ClosedOutput,
        ReadEnd::Handler if ended => Stop::Ended,
        ReadEnd::Handler => Stop::Count,
        ReadEnd::Idle => Stop::Idle,
        ReadEnd::Stopped => Stop::Signal,
    };
    Ok((seen, stop))
}

/// What a [`read_queue`] handler wants done with the message it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// Acknowledge it and read on.
    Next,
    /// Acknowledge it and stop reading.
    Last,
    /// Leave it unacknowledged, so the broker hands it out again, and stop.
    Refused,
}

/// Why [`read_queue`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadEnd {
    /// The handler said [`Handled::Last`] or [`Handled::Refused`].
    Handler,
    /// Nothing arrived for the idle time.
    Idle,
    /// The `stop` future completed.
    Stopped,
}

/// Hands each delivery's body to `handle` and acknowledges it as told, until
/// the handler stops, nothing arrives for `idle`, or `stop` completes. The
/// reading loop of `sasctl watch`, `sasctl alerts` and `sas-chaos`. An
/// error is the consumer's (the channel, the connection or the queue went
/// away), an acknowledgement's, or the handler's.
pub async fn read_queue<F>(
    consumer: &mut Consumer,
    queue: &str,
    idle: Option<Duration>,
    stop: impl Future<Output = ()>,
    mut handle: F,
) -> anyhow::Result<ReadEnd>
where
    F: FnMut(&[u8]) -> anyhow::Result<Handled>,
{
    let mut stop = std::pin::pin!(stop);
    loop {
        let next = tokio::select! {
            () = &mut stop => return Ok(ReadEnd::Stopped),
            () = idle_for(idle) => return Ok(ReadEnd::Idle),
            next = consumer.next() => next,
        };
        let delivery = match next {
            Some(Ok(delivery)) => delivery,
            Some(Err(e)) => {
                return Err(e).with_context(|| format!("consuming {queue}"));
            }
            None => anyhow::bail!(
                "the broker cancelled the consumer of {queue} (was the queue deleted?)"
            ),
        };
        let handled = handle(delivery.body())?;
        if handled == Handled::Refused {
            return Ok(ReadEnd::Handler);
        }
        delivery
            .ack()
            .await
            .with_context(|| format!("acknowledging a message of {queue}"))?;
        if handled == Handled::Last {
            return Ok(ReadEnd::Handler);
        }
    }
}

/// Resolves after `timeout`, or never.
async fn idle_for(timeout: Option<Duration>) {
    match timeout {
        Some(t) => tokio::time::sleep(t).await,
        None => std::future::pending().await,
    }
}

/// A body as one line of JSON: compacted when it is JSON, else as a JSON string.
fn json_line(body: &[u8]) -> String {
    match serde_json::from_slice::<Value>(body) {
        Ok(value) => value.to_string(),
        Err(_) => Value::String(String::from_utf8_lossy(body).into_owned()).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_become_single_json_lines() {
        assert_eq!(
            json_line(b"{\n  \"seq\": 1,\n  \"state\": \"received\"\n}"),
            r#"{"seq":1,"state":"received"}"#
        );
        assert_eq!(json_line(b"not json\n"), r#""not json\n""#);
        assert_eq!(json_line(&[0xff, b'a']), "\"\u{fffd}a\"");
    }

    #[test]
    fn filters_match_order_ids_and_states() {
        let event =
            |id: Value, state: &str| serde_json::json!({"order_id": id, "seq": 1, "state": state});
        let all = Filter::default();
        assert!(all.matches(None));
        assert!(all.matches(Some(&event("a".into(), "received"))));

        let by_id = Filter {
            order_ids: ["a".to_owned(), "7".to_owned()].into(),
            states: vec![],
        };
        assert!(by_id.matches(Some(&event("a".into(), "received"))));
        assert!(by_id.matches(Some(&event(7.into(), "rejected"))));
        assert!(!by_id.matches(Some(&event("b".into(), "received"))));
        assert!(!by_id.matches(Some(&event(Value::Null, "rejected"))));
        assert!(!by_id.matches(None));

        let both = Filter {
            order_ids: ["a".to_owned()].into(),
            states: vec![EventKind::Processed, EventKind::Failed],
        };
        assert!(both.matches(Some(&event("a".into(), "processed"))));
        assert!(!both.matches(Some(&event("a".into(), "received"))));
        assert!(!both.matches(Some(&event("b".into(), "failed"))));
        let by_state = Filter {
            order_ids: BTreeSet::new(),
            states: vec![EventKind::StepSucceeded],
        };
        assert!(by_state.matches(Some(&event("z".into(), "step_succeeded"))));
        assert!(!by_state.matches(Some(&serde_json::json!({"order_id": "z"}))));
    }

    #[test]
    fn until_terminal_waits_for_every_order_to_end() {
        let event =
            |id: &str, state: &str| Some(serde_json::json!({"order_id": id, "state": state}));
        let mut waiting = Waiting(["a".to_owned(), "b".to_owned()].into());
        assert!(!waiting.see(event("a", "processing").as_ref()));
        assert!(!waiting.see(event("c", "processed").as_ref()));
        assert!(!waiting.see(None));
        assert!(!waiting.see(event("a", "compensated").as_ref()));
        assert!(waiting.see(event("b", "rejected").as_ref()));
        assert!(parse_event_state("step_succeeded").is_ok());
        assert!(
            parse_event_state("done")
                .unwrap_err()
                .contains("received, rejected, processing, step_succeeded")
        );
    }

    #[test]
    fn options_parse() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let args = Cli::try_parse_from(["t", "q", "--count", "3", "--timeout", "1m 30s"])
            .unwrap()
            .args;
        assert_eq!(args.queue, "q");
        assert_eq!(args.count, Some(3));
        assert_eq!(args.timeout, Some(Duration::from_secs(90)));
        assert!(Cli::try_parse_from(["t", "q", "--timeout", "soon"]).is_err());
        assert!(Cli::try_parse_from(["t", "q", "--count", "0"]).is_err());
        assert!(Cli::try_parse_from(["t"]).is_err());
    }
}

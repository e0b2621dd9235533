//! `sasctl watch`: prints the messages of a queue as JSON lines on stdout,
//! acknowledging each once printed. [`print_queue`] is the machinery, shared
//! with `sasctl alerts`; [`read_queue`], its reading loop, is shared with
//! `sasctl chaos`.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use clap::value_parser;
use futures_util::StreamExt;
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use sas::broker::{Broker, BrokerError, Consumer};
use sas::config::Settings;
use serde_json::Value;

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
                Err(BrokerError::Amqp(e))
                    if is_soft_error(&e, AMQPSoftError::PRECONDITIONFAILED) =>
                {
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
            Err(BrokerError::Amqp(e)) if is_soft_error(&e, AMQPSoftError::NOTFOUND) => {
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
        Stop::Idle => format!(
            "nothing for {}",
            humantime::format_duration(reading.idle.unwrap_or_default())
        ),
        Stop::Signal => "interrupted".to_owned(),
        Stop::ClosedOutput => "output closed".to_owned(),
    };
    let noun = if seen == 1 {
        reading.noun.0
    } else {
        reading.noun.1
    };
    eprintln!("{seen} {noun} from {queue} ({why})");
    Ok(())
}

/// Prints and acknowledges deliveries until a stop condition; how many were printed.
async fn consume(
    consumer: &mut Consumer,
    reading: &Reading<'_>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<(u64, Stop)> {
    if reading.count == Some(0) {
        return Ok((0, Stop::Count));
    }
    let mut out = std::io::stdout();
    let mut seen = 0u64;
    let mut closed = false;
    let end = read_queue(consumer, reading.queue, reading.idle, shutdown, |body| {
        let line = json_line(body);
        match writeln!(out, "{line}").and_then(|()| out.flush()) {
            Ok(()) => {}
            // Unacknowledged, the message goes back to the queue.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                closed = true;
                return Ok(Handled::Refused);
            }
            Err(e) => return Err(e).context("writing to stdout"),
        }
        seen += 1;
        Ok(if reading.count.is_some_and(|n| seen >= n) {
            Handled::Last
        } else {
            Handled::Next
        })
    })
    .await?;
    let stop = match end {
        ReadEnd::Handler if closed => Stop::ClosedOutput,
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
/// reading loop of `sasctl watch`, `sasctl alerts` and `sasctl chaos`. An
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
        let handled = handle(&delivery.data)?;
        if handled == Handled::Refused {
            return Ok(ReadEnd::Handler);
        }
        sas::broker::ack(&delivery)
            .await
            .with_context(|| format!("acknowledging a message of {queue}"))?;
        if handled == Handled::Last {
            return Ok(ReadEnd::Handler);
        }
    }
}

/// Whether the broker refused with this soft error, e.g. 406
/// PRECONDITION_FAILED (a queue declared with other arguments) or 404 NOT_FOUND.
fn is_soft_error(e: &lapin::Error, soft: AMQPSoftError) -> bool {
    matches!(
        e.kind(),
        lapin::ErrorKind::ProtocolError(amqp)
            if *amqp.kind() == AMQPErrorKind::Soft(soft)
    )
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

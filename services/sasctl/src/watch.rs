//! `sasctl watch`: prints the messages of a queue as JSON lines on stdout,
//! acknowledging each once printed.

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

/// Why watching stopped.
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
    let shutdown = sas::shutdown::on_signal().context("installing the signal handlers")?;
    let setup = async {
        let broker = Broker::connect(&settings.broker, "sasctl")
            .await
            .context("connecting to RabbitMQ")?;
        match broker.declare_status_queue(&args.queue).await {
            Ok(()) => {}
            // It exists with other arguments (a sas quorum queue such as
            // `<prefix>.alerts` or a dead-letter queue): read it as it is.
            Err(BrokerError::Amqp(e)) if is_precondition_failed(&e) => {
                tracing::debug!(queue = %args.queue, "the queue exists with other arguments");
            }
            Err(e) => {
                return Err(e).with_context(|| format!("declaring the queue {}", args.queue));
            }
        }
        let prefetch = args.count.map_or(settings.broker.prefetch, |n| {
            u16::try_from(n)
                .unwrap_or(u16::MAX)
                .min(settings.broker.prefetch)
        });
        let consumer = broker
            .consume(&args.queue, prefetch, "sasctl-watch")
            .await
            .with_context(|| format!("consuming {}", args.queue))?;
        anyhow::Ok((broker, consumer))
    };
    let (broker, mut consumer) = tokio::select! {
        ready = setup => ready?,
        () = shutdown.cancelled() => return Ok(()),
    };
    let outcome = watch(&mut consumer, &args, shutdown.cancelled()).await;
    // Closing the connection hands back what was delivered but not printed;
    // the consumer is dropped after it, so its cancel does not race the close.
    broker.close().await;
    drop(consumer);
    let (seen, stop) = outcome?;
    let why = match stop {
        Stop::Count => "count reached".to_owned(),
        Stop::Idle => format!(
            "nothing for {}",
            humantime::format_duration(args.timeout.unwrap_or_default())
        ),
        Stop::Signal => "interrupted".to_owned(),
        Stop::ClosedOutput => "output closed".to_owned(),
    };
    let plural = if seen == 1 { "" } else { "s" };
    eprintln!("{seen} message{plural} from {} ({why})", args.queue);
    Ok(())
}

/// Prints and acknowledges deliveries until a stop condition; how many were printed.
async fn watch(
    consumer: &mut Consumer,
    args: &Args,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<(u64, Stop)> {
    let mut shutdown = std::pin::pin!(shutdown);
    let mut out = std::io::stdout();
    let mut seen = 0u64;
    loop {
        if args.count.is_some_and(|n| seen >= n) {
            return Ok((seen, Stop::Count));
        }
        let next = tokio::select! {
            () = &mut shutdown => return Ok((seen, Stop::Signal)),
            () = idle(args.timeout) => return Ok((seen, Stop::Idle)),
            next = consumer.next() => next,
        };
        let delivery = match next {
            Some(Ok(delivery)) => delivery,
            Some(Err(e)) => {
                return Err(e).with_context(|| format!("consuming {}", args.queue));
            }
            None => anyhow::bail!(
                "the broker cancelled the consumer of {} (was the queue deleted?)",
                args.queue
            ),
        };
        let line = json_line(&delivery.data);
        match writeln!(out, "{line}").and_then(|()| out.flush()) {
            Ok(()) => {}
            // Unacknowledged, the message goes back to the queue.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                return Ok((seen, Stop::ClosedOutput));
            }
            Err(e) => return Err(e).context("writing to stdout"),
        }
        sas::broker::ack(&delivery)
            .await
            .with_context(|| format!("acknowledging a message of {}", args.queue))?;
        seen += 1;
    }
}

/// Whether the broker refused a declaration because the queue exists with
/// other arguments (406 PRECONDITION_FAILED).
fn is_precondition_failed(e: &lapin::Error) -> bool {
    matches!(
        e.kind(),
        lapin::ErrorKind::ProtocolError(amqp)
            if *amqp.kind() == AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
    )
}

/// Resolves after `timeout`, or never.
async fn idle(timeout: Option<Duration>) {
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

//! A long-lived consumer of a status queue: prints every event once (the
//! stream drops redelivered duplicates), acknowledging each after it is
//! printed, until Ctrl-C. A consumer whose stream ends (the connection or
//! the queue is gone) exits non-zero, for its supervisor to restart it;
//! `--replay-since <RFC 3339>` first asks sas to send the queue's events
//! since then again (after losing the queue, say). A lost connection is
//! not an end: the stream consumes again on a new one.
//!
//! ```sh
//! cargo run -p sas-client --example consumer -- app.status
//! ```

use anyhow::Context as _;
use futures_util::StreamExt as _;
use sas_client::{Client, ReplayRequest};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt::init();
    let env =
        |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
    let url = env("SAS_URL", "amqp://guest:guest@127.0.0.1:55673/%2f");
    let prefix = env("SAS_PREFIX", "sas");
    let args: Vec<String> = std::env::args().skip(1).collect();
    let queue = args
        .first()
        .context("usage: consumer QUEUE [--replay-since RFC3339]")?;

    let client = Client::connect(&url, &prefix).await?;
    let mut events = client.status(queue).await?;
    if let [_, flag, since] = args.as_slice()
        && flag == "--replay-since"
    {
        let since = chrono::DateTime::parse_from_rfc3339(since)
            .context("--replay-since takes an RFC 3339 time")?
            .with_timezone(&chrono::Utc);
        let request = ReplayRequest::Queue {
            reply_to: queue.clone(),
            since,
        };
        client.replay(&request, None).await?;
    }
    // One Ctrl-C future for the whole loop: a new one per round would miss
    // an interrupt that came while the round before was printing.
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    loop {
        tokio::select! {
            _ = &mut interrupted => break,
            next = events.next() => match next {
                Some(Ok(event)) => println!("{}", serde_json::to_string(&event)?),
                Some(Err(e @ sas_client::Error::NotAStatusEvent { .. })) => eprintln!("skipped: {e}"),
                // RabbitMQ unreachable for a while: the next read tries again.
                Some(Err(e @ sas_client::Error::Connect(_))) => eprintln!("waiting: {e}"),
                Some(Err(e)) => return Err(e.into()),
                None => anyhow::bail!("the status stream of {queue} ended"),
            },
        }
    }
    // Acknowledges the last event printed.
    events.close().await?;
    client.close().await;
    Ok(())
}

//! `sasctl events replay`: asks sas to publish stored status events again
//! (contract §9), through the client, as an application would: one order's
//! events from a `seq` on, or the events since a time of every order whose
//! status queue is a given one. The events go to `--to`, else to the
//! order's own status queue, or the queue asked about.

use anyhow::Context;
use chrono::{DateTime, Utc};
use clap::value_parser;
use sas::config::Settings;
use sas_client::{Client, ReplayRequest};
use uuid::Uuid;

/// `sasctl events …`.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Ask the submission service to publish stored status events again
    /// (same fields, same seq), in seq order per order: one order's
    /// (--order-id, --from-seq) or every order's of a status queue since a
    /// time (--reply-to, --since). Replays are bounded by
    /// submission.max_replay_events.
    Replay(ReplayArgs),
}

/// Options of `sasctl events replay`.
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// The order whose events to publish again.
    #[arg(
        long,
        value_name = "UUID",
        required_unless_present = "reply_to",
        conflicts_with_all = ["reply_to", "since"]
    )]
    order_id: Option<Uuid>,
    /// The first seq to publish [default: 1, every event].
    #[arg(long, value_name = "N", conflicts_with_all = ["reply_to", "since"], value_parser = value_parser!(i32).range(0..))]
    from_seq: Option<i32>,
    /// Publish again the events of every order whose status queue is this one…
    #[arg(long, value_name = "QUEUE", requires = "since")]
    reply_to: Option<String>,
    /// …logged at or after this time (RFC 3339).
    #[arg(long, value_name = "RFC3339", value_parser = parse_time, requires = "reply_to")]
    since: Option<DateTime<Utc>>,
    /// Where the events go (declared, durable, first) [default: the
    /// order's own status queue, or --reply-to].
    #[arg(long, value_name = "QUEUE")]
    to: Option<String>,
}

impl ReplayArgs {
    /// The request the options describe.
    fn request(&self) -> anyhow::Result<ReplayRequest> {
        match (&self.order_id, &self.reply_to, &self.since) {
            (Some(order_id), _, _) => Ok(ReplayRequest::Order {
                order_id: *order_id,
                from_seq: self.from_seq.unwrap_or(1),
            }),
            (None, Some(reply_to), Some(since)) => Ok(ReplayRequest::Queue {
                reply_to: reply_to.clone(),
                since: *since,
            }),
            // clap requires one form or the other.
            _ => anyhow::bail!("give --order-id, or --reply-to with --since"),
        }
    }
}

/// `--since`: an RFC 3339 time.
fn parse_time(text: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| format!("not an RFC 3339 time (e.g. 2030-01-01T12:00:00Z): {e}"))
}

/// Runs `sasctl events …`.
pub async fn run(command: Command, settings: &Settings) -> anyhow::Result<()> {
    match command {
        Command::Replay(args) => replay(&args, settings).await,
    }
}

async fn replay(args: &ReplayArgs, settings: &Settings) -> anyhow::Result<()> {
    let request = args.request()?;
    let client = Client::connect_with(sas::broker::client_options(&settings.broker, "sasctl")?)
        .await
        .context("connecting to RabbitMQ")?;
    let outcome = async {
        if let Some(to) = &args.to {
            client
                .declare_status_queue(to)
                .await
                .with_context(|| format!("declaring the queue {to}"))?;
        }
        client
            .replay(&request, args.to.as_deref())
            .await
            .with_context(|| format!("publishing to {}.replay", settings.broker.prefix))
    }
    .await;
    client.close().await;
    outcome?;
    let what = match &request {
        ReplayRequest::Order { order_id, from_seq } => {
            format!("the events of order {order_id} from seq {from_seq}")
        }
        ReplayRequest::Queue { reply_to, since } => format!(
            "the events of {reply_to}'s orders since {}",
            sas::messages::rfc3339::format(since)
        ),
    };
    let to = match (&args.to, &request) {
        (Some(to), _) => to.clone(),
        (None, ReplayRequest::Order { .. }) => "the order's status queue".into(),
        (None, ReplayRequest::Queue { reply_to, .. }) => reply_to.clone(),
    };
    eprintln!("asked for a replay of {what}, to {to}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Command,
    }

    fn parse(args: &[&str]) -> Result<ReplayArgs, clap::Error> {
        let mut all = vec!["t", "replay"];
        all.extend_from_slice(args);
        Cli::try_parse_from(all).map(|c| match c.command {
            Command::Replay(args) => args,
        })
    }

    #[test]
    fn either_form_of_request_is_built() {
        let id = Uuid::new_v4();
        let by_order = parse(&["--order-id", &id.to_string(), "--from-seq", "3"]).unwrap();
        assert_eq!(
            by_order.request().unwrap(),
            ReplayRequest::Order {
                order_id: id,
                from_seq: 3
            }
        );
        let by_queue = parse(&[
            "--reply-to",
            "app",
            "--since",
            "2030-01-01T00:00:00Z",
            "--to",
            "q2",
        ])
        .unwrap();
        assert_eq!(by_queue.to.as_deref(), Some("q2"));
        assert!(matches!(
            by_queue.request().unwrap(),
            ReplayRequest::Queue { reply_to, .. } if reply_to == "app"
        ));
    }

    #[test]
    fn the_forms_do_not_mix() {
        let id = Uuid::new_v4().to_string();
        assert!(parse(&[]).is_err());
        assert!(
            parse(&["--reply-to", "app"]).is_err(),
            "--since is required"
        );
        assert!(parse(&["--order-id", &id, "--reply-to", "app"]).is_err());
        assert!(
            parse(&[
                "--from-seq",
                "2",
                "--reply-to",
                "a",
                "--since",
                "2030-01-01T00:00:00Z"
            ])
            .is_err()
        );
        assert!(parse(&["--order-id", &id, "--from-seq", "-1"]).is_err());
        assert!(parse(&["--reply-to", "a", "--since", "yesterday"]).is_err());
    }
}

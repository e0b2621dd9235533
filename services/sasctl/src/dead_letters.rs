//! `sasctl dead-letters`: the orders' dead-letter queue `<prefix>.orders.dead`,
//! where the submission service puts the messages it cannot accept, each with
//! its reason in the `x-sas-reason` header. List them without removing them,
//! replay them to `<prefix>.orders` once the cause is fixed, or purge them.

use anyhow::Context;
use clap::{Subcommand, value_parser};
use sas::broker::{self, Broker, Outgoing, PublishError, Publisher, Taken};
use sas::config::Settings;
use sas::topology::QueueNames;
use serde_json::{Value, json};

use crate::Exit;
use crate::orders::{cell, table};
use crate::submit::no_orders_queue_hint;

/// The header in which the submission service gives its reason.
const REASON: &str = "x-sas-reason";

/// How many characters of a body the table shows.
const BODY_SHOWN: usize = 60;

/// `sasctl dead-letters …`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show the dead letters, oldest first: reason (`x-sas-reason`),
    /// message_id, reply_to and body. They stay in the queue, in order.
    List(ListArgs),
    /// Re-publish dead letters to `<prefix>.orders` (body, reply_to and
    /// message_id as they were), each with a confirm, then remove them. Use it
    /// after fixing the cause (e.g. configuring the missing workflow); a
    /// message that is still bad comes back with a fresh reason.
    Replay(ReplayArgs),
    /// Delete every dead letter. Refuses (exit 2) without --yes, saying how many there are.
    Purge(PurgeArgs),
}

/// Options of `sasctl dead-letters list`.
#[derive(Debug, clap::Args)]
pub struct ListArgs {
    /// At most this many messages, from the oldest (each is held on a channel
    /// of its own while listing).
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = value_parser!(u32).range(1..=1000))]
    limit: u32,
    /// Print a JSON array of `{"reason", "message_id", "reply_to", "body"}`
    /// (the whole body, as text) instead of a table.
    #[arg(long)]
    json: bool,
}

/// Options of `sasctl dead-letters replay`.
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// At most this many messages, from the oldest [default: every message in
    /// the queue when the replay starts].
    #[arg(long, value_name = "N", value_parser = value_parser!(u32).range(1..))]
    limit: Option<u32>,
    /// Print `{"replayed": n}` instead of a sentence.
    #[arg(long)]
    json: bool,
}

/// Options of `sasctl dead-letters purge`.
#[derive(Debug, clap::Args)]
pub struct PurgeArgs {
    /// Really delete them.
    #[arg(long)]
    yes: bool,
    /// Print `{"purged": n}` instead of a sentence.
    #[arg(long)]
    json: bool,
}

/// A dead letter as `list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Letter {
    reason: Option<String>,
    message_id: Option<String>,
    reply_to: Option<String>,
    body: String,
}

impl Letter {
    fn of(delivery: &broker::Delivery) -> Self {
        Self {
            reason: delivery.header(REASON),
            message_id: delivery.message_id().map(str::to_owned),
            reply_to: delivery.reply_to().map(str::to_owned),
            body: String::from_utf8_lossy(delivery.body()).into_owned(),
        }
    }

    fn json(&self) -> Value {
        json!({
            "reason": self.reason,
            "message_id": self.message_id,
            "reply_to": self.reply_to,
            "body": self.body,
        })
    }
}

/// The letters as a table, bodies cut to [`BODY_SHOWN`] characters.
fn letters_text(letters: &[Letter]) -> String {
    let opt = |s: &Option<String>| s.clone().unwrap_or_else(|| "-".into());
    let rows = letters
        .iter()
        .map(|l| {
            vec![
                opt(&l.reason),
                opt(&l.message_id),
                opt(&l.reply_to),
                shorten(&cell(&l.body), BODY_SHOWN),
            ]
        })
        .collect();
    table(&["REASON", "MESSAGE_ID", "REPLY_TO", "BODY"], rows)
}

/// At most `max` characters, the last one `…` when cut.
fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut out: String = text.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// Runs `sasctl dead-letters …`.
pub async fn run(command: Command, settings: &Settings) -> anyhow::Result<()> {
    let queues = QueueNames::new(&settings.broker.prefix);
    let broker = Broker::connect(&settings.broker, "sasctl")
        .await
        .context("connecting to RabbitMQ")?;
    // The publisher's channel outlives the connection's close (see submit).
    let mut publisher = None;
    let outcome = match command {
        Command::List(args) => list(&broker, &queues, &args).await,
        Command::Replay(args) => replay(&broker, &mut publisher, &queues, &args).await,
        Command::Purge(args) => purge(&broker, &queues, &args).await,
    };
    broker.close().await;
    drop(publisher);
    outcome
}

/// Messages ready in the dead-letter queue; an error when it does not exist.
async fn ready(broker: &Broker, queues: &QueueNames) -> anyhow::Result<u32> {
    let queue = queues.orders_dead();
    match broker.message_count(queue).await {
        Ok(n) => Ok(n),
        Err(e) if e.is_not_found() => Err(anyhow::anyhow!(
            "the queue {queue} does not exist (the sas services declare it at start-up; \
             is broker.prefix {:?} right?)",
            queues.prefix()
        )),
        Err(e) => Err(e).with_context(|| format!("looking up the queue {queue}")),
    }
}

async fn list(broker: &Broker, queues: &QueueNames, args: &ListArgs) -> anyhow::Result<()> {
    let queue = queues.orders_dead();
    let total = ready(broker, queues).await?;
    // Hold each message until all are read, so none is read twice; then hand
    // them back in the order they came, which keeps the queue's order.
    let mut taken: Vec<Taken> = Vec::new();
    let mut failed = None;
    while taken.len() < args.limit as usize {
        match broker.take(queue).await {
            Ok(Some(t)) => taken.push(t),
            Ok(None) => break,
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    let letters: Vec<Letter> = taken.iter().map(|t| Letter::of(&t.delivery)).collect();
    for t in taken {
        // Should this fail, closing the connection hands the message back all the same.
        if let Err(e) = t.release().await {
            tracing::debug!(error = %e, "releasing a dead letter");
        }
    }
    if let Some(e) = failed {
        return Err(e).with_context(|| format!("reading {queue}"));
    }
    if args.json {
        let all: Vec<Value> = letters.iter().map(Letter::json).collect();
        println!("{}", Value::Array(all));
    } else {
        print!("{}", crate::terminal::printable(&letters_text(&letters)));
    }
    let noun = if total == 1 {
        "dead letter"
    } else {
        "dead letters"
    };
    eprintln!(
        "{} of {total} {noun} in {queue} shown (left in the queue)",
        letters.len()
    );
    Ok(())
}

async fn replay(
    broker: &Broker,
    publisher: &mut Option<Publisher>,
    queues: &QueueNames,
    args: &ReplayArgs,
) -> anyhow::Result<()> {
    let queue = queues.orders_dead();
    // Only the messages there now: one that is still bad comes back to the
    // end of the queue, and is not replayed again in this run.
    let total = ready(broker, queues).await?;
    let wanted = args.limit.map_or(total, |limit| limit.min(total));
    let publisher = publisher.insert(
        broker
            .publisher()
            .await
            .context("opening a channel in confirm mode")?,
    );
    let mut replayed = 0u32;
    while replayed < wanted {
        let taken = broker
            .take(queue)
            .await
            .with_context(|| format!("reading {queue} ({replayed} replayed before)"))?;
        let Some(taken) = taken else {
            break;
        };
        replay_one(publisher, queues, taken)
            .await
            .with_context(|| format!("replaying ({replayed} replayed before)"))?;
        replayed += 1;
    }
    if args.json {
        println!("{}", json!({ "replayed": replayed }));
    } else {
        let noun = if replayed == 1 {
            "dead letter"
        } else {
            "dead letters"
        };
        println!(
            "replayed {replayed} {noun} from {queue} to {}",
            queues.orders()
        );
    }
    Ok(())
}

/// Publishes a dead letter to `<prefix>.orders` as it came (body, reply_to,
/// message_id, traceparent), waits for the confirm, then acknowledges it. Not
/// confirmed, it is handed back to the dead-letter queue.
async fn replay_one(
    publisher: &Publisher,
    queues: &QueueNames,
    taken: Taken,
) -> anyhow::Result<()> {
    let delivery = &taken.delivery;
    let trace = delivery.header(sas::trace::HEADER);
    let headers: Vec<(&str, &str)> = trace
        .as_deref()
        .map(|t| (sas::trace::HEADER, t))
        .into_iter()
        .collect();
    let message_id = delivery.message_id().map(str::to_owned);
    let published = publisher
        .publish(&Outgoing {
            routing_key: queues.orders(),
            body: delivery.body(),
            reply_to: delivery.reply_to(),
            message_id: message_id.as_deref(),
            headers: &headers,
            mandatory: true,
            ..Outgoing::default()
        })
        .await;
    match published {
        Ok(()) => taken.ack().await.context(
            "re-published, but not removed from the dead-letter queue: it may be replayed again \
             (the submission ignores an order it already has)",
        ),
        Err(e) => {
            if let Err(release) = taken.release().await {
                tracing::debug!(error = %release, "handing back a dead letter");
            }
            Err(match e {
                PublishError::Unroutable(_) => {
                    anyhow::anyhow!("{e} ({})", no_orders_queue_hint(queues))
                }
                e => anyhow::Error::new(e).context(format!("publishing to {}", queues.orders())),
            })
        }
    }
}

async fn purge(broker: &Broker, queues: &QueueNames, args: &PurgeArgs) -> anyhow::Result<()> {
    let queue = queues.orders_dead();
    let total = ready(broker, queues).await?;
    if !args.yes {
        let noun = if total == 1 {
            "dead letter"
        } else {
            "dead letters"
        };
        return Err(Exit {
            code: Exit::USAGE,
            message: format!(
                "{queue} holds {total} {noun}; nothing deleted: run again with --yes to delete them"
            ),
        }
        .into());
    }
    let purged = broker
        .purge(queue)
        .await
        .with_context(|| format!("purging {queue}"))?;
    if args.json {
        println!("{}", json!({ "purged": purged }));
    } else {
        let noun = if purged == 1 {
            "dead letter"
        } else {
            "dead letters"
        };
        println!("purged {purged} {noun} from {queue}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter(body: &str) -> Letter {
        Letter {
            reason: Some("unknown workflow \"nope\"".into()),
            message_id: None,
            reply_to: Some("app".into()),
            body: body.into(),
        }
    }

    #[test]
    fn the_table_cuts_long_bodies_and_json_keeps_them_whole() {
        let long = format!(
            "{{\"workflow\":\"nope\",\"payload\":\"{}\"}}",
            "x".repeat(100)
        );
        let text = letters_text(&[letter(&long)]);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("REASON"), "{text}");
        assert!(lines[0].contains("MESSAGE_ID  REPLY_TO  BODY"), "{text}");
        assert!(lines[1].contains("unknown workflow \"nope\"  -"), "{text}");
        assert!(lines[1].ends_with('…'), "{text}");
        assert!(!lines[1].contains(&long), "{text}");
        assert_eq!(letter(&long).json()["body"], long);
        assert_eq!(letter(&long).json()["message_id"], Value::Null);
        assert_eq!(letters_text(&[]), "(none)\n");
    }

    #[test]
    fn shortening_counts_characters() {
        assert_eq!(shorten("abc", 3), "abc");
        assert_eq!(shorten("abcd", 3), "ab…");
        assert_eq!(shorten("→→→→", 2), "→…");
    }

    #[test]
    fn options_parse() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(subcommand)]
            command: Command,
        }
        let parse = |args: &[&str]| {
            Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied())).map(|c| c.command)
        };
        match parse(&["list"]).unwrap() {
            Command::List(a) => assert_eq!((a.limit, a.json), (100, false)),
            other => panic!("{other:?}"),
        }
        match parse(&["replay", "--limit", "3", "--json"]).unwrap() {
            Command::Replay(a) => assert_eq!((a.limit, a.json), (Some(3), true)),
            other => panic!("{other:?}"),
        }
        match parse(&["purge"]).unwrap() {
            Command::Purge(a) => assert!(!a.yes),
            other => panic!("{other:?}"),
        }
        assert!(parse(&["list", "--limit", "0"]).is_err());
        assert!(parse(&["list", "--limit", "1001"]).is_err());
        assert!(parse(&["replay", "--limit", "0"]).is_err());
        assert!(parse(&["drop"]).is_err());
    }
}

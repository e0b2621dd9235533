//! `sasctl dead-letters`: the orders' dead-letter queue `<prefix>.orders.dead`,
//! where the submission service puts the messages it cannot accept, each with
//! its reason in the `x-sas-reason` header. List them without removing them,
//! replay them to `<prefix>.orders` once the cause is fixed, or purge them.
//! The work is [`sas::dead_letters`]'s, which the dashboard shares.

use anyhow::Context;
use clap::{Subcommand, value_parser};
use sas::broker::{Broker, PublishError, Publisher};
use sas::config::Settings;
use sas::dead_letters::{self, DeadLetterError, DeadLetterQueue, Letter};
use sas::topology::QueueNames;
use serde_json::{Value, json};

use crate::Exit;
use crate::orders::{cell, table};
use crate::submit::no_orders_queue_hint;

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

/// A dead letter as `list --json` prints it.
fn letter_json(letter: &Letter) -> Value {
    json!({
        "reason": letter.reason,
        "message_id": letter.message_id,
        "reply_to": letter.reply_to,
        "body": letter.body,
    })
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
    let dead = DeadLetterQueue::orders(&queues);
    // The publisher's channel outlives the connection's close (see submit).
    let mut publisher = None;
    let outcome = match command {
        Command::List(args) => list(&broker, &queues, &dead, &args).await,
        Command::Replay(args) => replay(&broker, &mut publisher, &queues, &dead, &args).await,
        Command::Purge(args) => purge(&broker, &queues, &dead, &args).await,
    };
    broker.close().await;
    drop(publisher);
    outcome
}

async fn list(
    broker: &Broker,
    queues: &QueueNames,
    dead: &DeadLetterQueue,
    args: &ListArgs,
) -> anyhow::Result<()> {
    let listing = dead_letters::list(broker, queues, dead, args.limit).await?;
    let letters = &listing.letters;
    if args.json {
        let all: Vec<Value> = letters.iter().map(letter_json).collect();
        println!("{}", Value::Array(all));
    } else {
        print!("{}", crate::terminal::printable(&letters_text(letters)));
    }
    let total = listing.total;
    let noun = if total == 1 {
        "dead letter"
    } else {
        "dead letters"
    };
    eprintln!(
        "{} of {total} {noun} in {} shown (left in the queue)",
        letters.len(),
        dead.queue
    );
    Ok(())
}

async fn replay(
    broker: &Broker,
    publisher: &mut Option<Publisher>,
    queues: &QueueNames,
    dead: &DeadLetterQueue,
    args: &ReplayArgs,
) -> anyhow::Result<()> {
    let publisher = publisher.insert(
        broker
            .publisher()
            .await
            .context("opening a channel in confirm mode")?,
    );
    let replayed = dead_letters::replay(broker, publisher, queues, dead, args.limit)
        .await
        .map_err(|stopped| match &stopped.error {
            DeadLetterError::Publish {
                source: source @ PublishError::Unroutable(_),
                ..
            } => anyhow::anyhow!("{stopped}: {source} ({})", no_orders_queue_hint(queues)),
            _ => anyhow::Error::new(stopped),
        })?;
    if args.json {
        println!("{}", json!({ "replayed": replayed }));
    } else {
        let noun = if replayed == 1 {
            "dead letter"
        } else {
            "dead letters"
        };
        println!(
            "replayed {replayed} {noun} from {} to {}",
            dead.queue, dead.origin
        );
    }
    Ok(())
}

async fn purge(
    broker: &Broker,
    queues: &QueueNames,
    dead: &DeadLetterQueue,
    args: &PurgeArgs,
) -> anyhow::Result<()> {
    let queue = &dead.queue;
    if !args.yes {
        let total = dead_letters::count(broker, queues, dead).await?;
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
    let purged = dead_letters::purge(broker, queues, dead).await?;
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
            tries: 0,
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
        assert_eq!(letter_json(&letter(&long))["body"], long);
        assert_eq!(letter_json(&letter(&long))["message_id"], Value::Null);
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

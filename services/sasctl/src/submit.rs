//! `sasctl submit`: publishes orders to `<prefix>.orders` exactly as an
//! application would (contract §1), with publisher confirms, pipelined in chunks.

use std::io::Write;

use anyhow::Context;
use chrono::{DateTime, Utc};
use clap::value_parser;
use sas::broker::{Broker, Outgoing, PublishError, Publisher};
use sas::config::Settings;
use sas::topology::QueueNames;
use serde_json::{Map, Value};
use uuid::Uuid;

/// Messages sent before their confirms are awaited.
pub const CHUNK: u32 = 256;

/// Options of `sasctl submit`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Workflow of the orders (a workflow configured in the services).
    #[arg(long, required_unless_present = "raw")]
    workflow: Option<String>,
    /// Business data handed to every step: a JSON object [default: {}].
    #[arg(long, value_name = "JSON", value_parser = parse_payload)]
    payload: Option<Map<String, Value>>,
    /// The order's id (only with `--count 1`); generated when absent.
    #[arg(long, value_name = "UUID")]
    order_id: Option<Uuid>,
    /// Private status queue for the orders' events; declared (durable) first.
    #[arg(long, value_name = "QUEUE", value_parser = parse_queue)]
    reply_to: Option<String>,
    /// Priority from 0 to 9; higher is claimed first.
    #[arg(long, value_name = "N", value_parser = value_parser!(u8).range(0..=9))]
    priority: Option<u8>,
    /// Do not start the orders before this time (RFC 3339).
    #[arg(long, value_name = "RFC3339", value_parser = parse_time)]
    not_before: Option<DateTime<Utc>>,
    /// How many orders to publish.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = value_parser!(u32).range(1..))]
    count: u32,
    /// Publish this body as-is instead of an order (e.g. to demonstrate dead-lettering).
    #[arg(
        long,
        value_name = "BODY",
        conflicts_with_all = ["workflow", "payload", "order_id", "priority", "not_before"]
    )]
    raw: Option<String>,
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
            self.priority,
            self.not_before,
        );
        (Some(order_id), body.to_string().into_bytes())
    }
}

/// The body of an order (contract §1).
pub fn order_body(
    order_id: Uuid,
    workflow: &str,
    payload: Map<String, Value>,
    priority: Option<u8>,
    not_before: Option<DateTime<Utc>>,
) -> Value {
    let mut body = Map::new();
    body.insert("order_id".into(), order_id.to_string().into());
    body.insert("workflow".into(), workflow.into());
    body.insert("payload".into(), Value::Object(payload));
    if let Some(p) = priority {
        body.insert("priority".into(), p.into());
    }
    if let Some(t) = not_before {
        body.insert(
            "not_before".into(),
            sas::messages::rfc3339::format(&t).into(),
        );
    }
    Value::Object(body)
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

/// Runs `sasctl submit`.
pub async fn run(args: Args, settings: &Settings) -> anyhow::Result<()> {
    let queues = QueueNames::new(&settings.broker.prefix);
    let broker = Broker::connect(&settings.broker, "sasctl")
        .await
        .context("connecting to RabbitMQ")?;
    // The publisher's channel outlives the connection's close: a channel
    // dropped first would race its own close against the connection's.
    let mut publisher = None;
    let outcome = submit(&broker, &mut publisher, &queues, &args).await;
    broker.close().await;
    drop(publisher);
    let published = outcome?;
    let what = match (args.raw.is_some(), published) {
        (true, 1) => "raw message",
        (true, _) => "raw messages",
        (false, 1) => "order",
        (false, _) => "orders",
    };
    match &args.reply_to {
        Some(q) => eprintln!(
            "submitted {published} {what} to {} (events to {q})",
            queues.orders()
        ),
        None => eprintln!("submitted {published} {what} to {}", queues.orders()),
    }
    Ok(())
}

/// Publishes the messages chunk by chunk: send a chunk, then read its
/// confirms, printing each confirmed order id. Returns how many were confirmed.
async fn submit(
    broker: &Broker,
    publisher: &mut Option<Publisher>,
    queues: &QueueNames,
    args: &Args,
) -> anyhow::Result<u32> {
    if let Some(q) = &args.reply_to {
        broker
            .declare_status_queue(q)
            .await
            .with_context(|| format!("declaring the status queue {q}"))?;
    }
    let publisher = publisher.insert(
        broker
            .publisher()
            .await
            .context("opening a channel in confirm mode")?,
    );
    let mut confirmed = 0u32;
    let mut remaining = args.count;
    let mut out = std::io::stdout();
    while remaining > 0 {
        let n = remaining.min(CHUNK);
        let batch: Vec<(Option<Uuid>, Vec<u8>)> = (0..n).map(|_| args.message()).collect();
        let outcomes = publish_batch(publisher, queues, args.reply_to.as_deref(), &batch)
            .await
            .with_context(|| {
                format!(
                    "publishing to {} ({confirmed} confirmed before)",
                    queues.orders()
                )
            })?;
        let mut failed: Option<(u32, PublishError)> = None;
        for ((order_id, _), outcome) in batch.iter().zip(outcomes) {
            match outcome {
                Ok(()) => {
                    confirmed += 1;
                    if let Some(id) = order_id {
                        writeln!(out, "{id}").context("writing to stdout")?;
                    }
                }
                Err(e) => match &mut failed {
                    Some((count, _)) => *count += 1,
                    None => failed = Some((1, e)),
                },
            }
        }
        out.flush().context("writing to stdout")?;
        if let Some((count, e)) = failed {
            let summary = format!(
                "{count} of {} messages not accepted, {confirmed} confirmed",
                args.count
            );
            return Err(match e {
                PublishError::Unroutable(_) => {
                    anyhow::anyhow!("{summary}: {e} ({})", no_orders_queue_hint(queues))
                }
                e => anyhow::Error::new(e).context(summary),
            });
        }
        remaining -= n;
    }
    Ok(confirmed)
}

/// Why `<prefix>.orders` may not exist, for an unroutable order.
pub fn no_orders_queue_hint(queues: &QueueNames) -> String {
    format!(
        "start a submission service with broker.prefix {:?}: it declares the queue",
        queues.prefix()
    )
}

/// Publishes a batch of messages (order id, body) to `<prefix>.orders`
/// as an application would, then reads their confirms: for each message, in
/// order, whether the broker took it. Sending everything before reading any
/// confirm pipelines the batch (one round trip, not one per message). An
/// error means a send failed: the messages sent before it may or may not
/// have arrived.
pub async fn publish_batch(
    publisher: &Publisher,
    queues: &QueueNames,
    reply_to: Option<&str>,
    batch: &[(Option<Uuid>, Vec<u8>)],
) -> Result<Vec<Result<(), PublishError>>, PublishError> {
    let mut pending = Vec::with_capacity(batch.len());
    for (order_id, body) in batch {
        let message_id = order_id.map(|id| id.to_string());
        let msg = Outgoing {
            routing_key: queues.orders(),
            body,
            reply_to,
            message_id: message_id.as_deref(),
            // Returned when no queue takes it, so an absent submission service is noticed.
            mandatory: true,
            ..Outgoing::default()
        };
        pending.push(publisher.send(&msg).await?);
    }
    let mut outcomes = Vec::with_capacity(pending.len());
    for confirm in pending {
        outcomes.push(confirm.wait().await);
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
        let body = order_body(id, "order", payload, Some(7), Some(t));
        let decoded =
            sas::messages::Submission::decode(body.to_string().as_bytes(), Some("app"), 1 << 20)
                .unwrap();
        assert_eq!(decoded.order_id, Some(id));
        assert_eq!(decoded.workflow, "order");
        assert_eq!(decoded.payload["sku"], "A-1");
        assert_eq!(decoded.priority.get(), 7);
        assert_eq!(decoded.not_before, Some(t));
        assert_eq!(decoded.reply_to.as_deref(), Some("app"));

        let minimal = order_body(id, "w", Map::new(), None, None);
        assert_eq!(
            minimal,
            serde_json::json!({"order_id": id.to_string(), "workflow": "w", "payload": {}})
        );
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
    }
}

//! Submits one order and waits for how it ended.
//!
//! ```sh
//! cargo run -p sas-client --example submit_and_wait -- order '{"sku":"A-1"}'
//! ```
//!
//! `SAS_URL` (default: the local RabbitMQ) and `SAS_PREFIX` (default `sas`)
//! name the deployment.

use std::time::Duration;

use anyhow::Context as _;
use sas_client::{Client, Order};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt::init();
    let url = std::env::var("SAS_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let prefix = std::env::var("SAS_PREFIX").unwrap_or_else(|_| "sas".to_owned());
    let mut args = std::env::args().skip(1);
    let workflow = args.next().unwrap_or_else(|| "order".to_owned());
    let payload = match args.next() {
        Some(json) => serde_json::from_str(&json).context("the payload must be a JSON object")?,
        None => serde_json::Map::new(),
    };

    // A status queue of this application's own: events go there, and
    // `wait` reads it.
    let client = Client::connect(&url, &prefix)
        .await?
        .with_status_queue("example.status")
        .await?;
    let order_id = client.submit(Order::new(workflow, payload)).await?;
    println!("submitted {order_id}");
    let terminal = client.wait(order_id, Duration::from_secs(120)).await?;
    println!(
        "{order_id} ended {} (seq {}): {}",
        terminal.state().as_str(),
        terminal.event.seq,
        terminal.event.detail
    );
    client.close().await;
    Ok(())
}

//! Submits one order with a typed payload and waits for its results.
//!
//! ```sh
//! cargo run -p sas-client --example submit_and_wait -- order '{"sku":"A-1"}'
//! ```
//!
//! `SAS_URL` (default: the RabbitMQ of `scripts/run-local.sh`), `SAS_PREFIX` (default `sas`)
//! and `SAS_STATUS_QUEUE` (default `example.status`) name the deployment
//! and the application's status queue.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use sas_client::{Client, Error, Options};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt::init();
    let env =
        |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
    let url = env("SAS_URL", "amqp://guest:guest@127.0.0.1:55673/%2f");
    let options = Options::new(url, env("SAS_PREFIX", "sas"))
        .status_queue(env("SAS_STATUS_QUEUE", "example.status"));
    let mut args = std::env::args().skip(1);
    let workflow = args.next().unwrap_or_else(|| "order".to_owned());
    let payload: serde_json::Value = match args.next() {
        Some(json) => serde_json::from_str(&json).context("the payload must be JSON")?,
        None => serde_json::json!({}),
    };

    // Events go to the application's own status queue, which `result` reads.
    let client = Client::connect_with(options).await?;
    let order = client.submit(&workflow, &payload).await?;
    println!("submitted {}", order.id());
    // Each step's result, by step name.
    let outcome = order
        .result_within::<BTreeMap<String, serde_json::Value>>(Duration::from_secs(120))
        .await;
    client.close().await;
    match outcome {
        Ok(results) => {
            println!(
                "{} ended processed: {}",
                order.id(),
                serde_json::to_string(&results)?
            );
            Ok(())
        }
        Err(Error::OrderFailed { state, detail, .. }) => {
            println!("{} ended {state}: {detail}", order.id());
            std::process::exit(1)
        }
        Err(e) => Err(e.into()),
    }
}

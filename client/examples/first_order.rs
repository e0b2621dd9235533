//! The README's first order in Rust, against `scripts/run-local.sh`'s suite:
//! `cargo run -p sas-client --example first_order`. The README shows this
//! file from `use` on, and a test keeps the two the same.

use std::collections::BTreeMap;

use sas_client::{Client, Options};

#[derive(serde::Serialize)]
struct Checkout {
    sku: String,
}

#[tokio::main]
async fn main() -> Result<(), sas_client::Error> {
    // scripts/run-local.sh's RabbitMQ; the status queue is declared, and
    // is where the orders' events go.
    let url = "amqp://guest:guest@127.0.0.1:55673/%2f";
    let options = Options::new(url, "sas").status_queue("shop.status");
    let client = Client::connect_with(options).await?;
    // Any Serialize that is a JSON object; sent with confirms, a UUIDv7 id.
    let checkout = Checkout { sku: "A-1".into() };
    let order = client.submit("order", &checkout).await?;
    // Each step's result by step name; Error::OrderFailed if it was undone.
    let results: BTreeMap<String, serde_json::Value> = order.result().await?;
    println!("{} processed: {results:?}", order.id());
    client.close().await;
    Ok(())
}

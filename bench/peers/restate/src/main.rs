//! Restate doing sas's work, for sas-bench: a service `OrderService` whose
//! handler `order` runs each step as a journaled `ctx.run` that POSTs to
//! remote-sim with `Idempotency-Key: <order>:<step>`, one step after another.
//! The caller (sas-bench) invokes it through Restate's ingress with the order
//! id as the invocation's idempotency key.
//!
//! Configuration from the environment (set by sas-bench): `BENCH_SIM`
//! (remote-sim's base URL), `BENCH_PATH` (the URL path prefix of the
//! endpoints), `BENCH_LISTEN` (default `127.0.0.1:0`). Once it accepts
//! connections it prints `listening on <addr>` on stdout and writes `<addr>`
//! to `BENCH_READY_FILE` when that is set.
//!
//! The SDK's own `HttpServer` leaves Nagle's algorithm on, which costs about
//! 40 ms per round trip with Restate's delayed ACKs: this accept loop serves
//! the same `HyperEndpoint` over HTTP/2 with `TCP_NODELAY` set on every
//! accepted connection.

use std::collections::BTreeMap;
use std::io::Write as _;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use restate_sdk::hyper::HyperEndpoint;
use restate_sdk::prelude::*;
use serde::{Deserialize, Serialize};

const STEPS: [&str; 3] = ["a", "b", "c"];

/// What the ingress caller sends.
#[derive(Debug, Serialize, Deserialize)]
struct Order {
    id: String,
    steps: usize,
}

/// What the caller gets back: each step's reply from remote-sim.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Done {
    results: BTreeMap<String, serde_json::Value>,
}

struct OrderService {
    http: Client<HttpConnector, Full<Bytes>>,
    /// `<BENCH_SIM>/<BENCH_PATH>`.
    base: String,
}

impl OrderService {
    /// One step: the POST the sas agent sends (same body shape, same key).
    async fn post(
        &self,
        order: &str,
        step: &str,
        results: &BTreeMap<String, serde_json::Value>,
    ) -> Result<serde_json::Value, HandlerError> {
        let body = serde_json::to_vec(&serde_json::json!({
            "order_id": order,
            "step": step,
            "attempt": 1,
            "payload": {},
            "results": results,
        }))?;
        let req = hyper::Request::post(format!("{}/{step}", self.base))
            .header("content-type", "application/json")
            .header("idempotency-key", format!("{order}:{step}"))
            .body(Full::new(Bytes::from(body)))?;
        let res = self.http.request(req).await?;
        let status = res.status();
        let bytes = res.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            return Err(format!("remote-sim answered {status}").into());
        }
        Ok(serde_json::from_slice(&bytes)?)
    }
}

#[service]
impl OrderService {
    #[handler]
    async fn order(&self, ctx: Context<'_>, order: Json<Order>) -> HandlerResult<Json<Done>> {
        let order = order.into_inner();
        let mut done = Done::default();
        for step in STEPS.iter().take(order.steps.clamp(1, STEPS.len())) {
            let results = &done.results;
            let id = order.id.as_str();
            let reply = ctx
                .run(|| async move { Ok(Json(self.post(id, step, results).await?)) })
                .name(*step)
                .await?
                .into_inner();
            done.results.insert((*step).to_owned(), reply);
        }
        Ok(Json(done))
    }
}

#[tokio::main]
async fn main() {
    let sim = std::env::var("BENCH_SIM").unwrap_or_else(|_| "http://127.0.0.1:8081".into());
    let path = std::env::var("BENCH_PATH").unwrap_or_else(|_| "restate".into());
    let listen = std::env::var("BENCH_LISTEN").unwrap_or_else(|_| "127.0.0.1:0".into());
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let http = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build(connector);
    let service = OrderService {
        http,
        base: format!("{}/{}", sim.trim_end_matches('/'), path.trim_matches('/')),
    };
    let endpoint = HyperEndpoint::new(Endpoint::builder().bind(service).build());
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .unwrap_or_else(|e| panic!("binding {listen}: {e}"));
    let addr = listener.local_addr().expect("local address");
    println!("listening on {addr}");
    std::io::stdout().flush().ok();
    if let Ok(ready) = std::env::var("BENCH_READY_FILE") {
        std::fs::write(&ready, addr.to_string()).unwrap_or_else(|e| panic!("writing {ready}: {e}"));
    }
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                stream.set_nodelay(true).ok();
                let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), endpoint.clone());
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        eprintln!("connection: {e}");
                    }
                });
            }
            _ = tokio::signal::ctrl_c() => break,
        }
    }
}

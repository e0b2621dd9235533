//! A small OTLP/HTTP (protobuf) receiver: services export their spans to it
//! (`OTEL_EXPORTER_OTLP_ENDPOINT`), and a test or the benchmark reads them
//! back.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use axum::body::Bytes;
use axum::extract::State;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::AnyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message as _;

/// One exported span.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// The exporting process's `service.name`.
    pub service: String,
    pub name: String,
    /// Hex, as in `traceparent`.
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent: String,
    /// String attributes (the `tracing` span's fields).
    pub attributes: Vec<(String, String)>,
    /// Start and end, µs since the Unix epoch.
    pub start_us: f64,
    pub end_us: f64,
}

impl Span {
    /// The attribute `key`, if the span has it.
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

type Store = Arc<Mutex<Vec<Span>>>;

/// A running receiver, on a free loopback port until dropped.
pub struct Otlp {
    /// The base URL to give `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub endpoint: String,
    spans: Store,
    server: tokio::task::JoinHandle<()>,
}

impl Otlp {
    /// Starts listening.
    pub async fn start() -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the OTLP receiver")?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let spans = Store::default();
        let app = axum::Router::new()
            .route("/v1/traces", axum::routing::post(receive))
            .with_state(spans.clone());
        let server = tokio::spawn(async move {
            // Stops only with the runtime or when dropped.
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self {
            endpoint,
            spans,
            server,
        })
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// How many spans have come so far.
    pub fn len(&self) -> usize {
        self.spans.lock().map_or(0, |s| s.len())
    }

    /// Whether no span has come yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes every span received so far.
    pub fn take(&self) -> Vec<Span> {
        self.spans
            .lock()
            .map(|mut s| std::mem::take(&mut *s))
            .unwrap_or_default()
    }

    /// Waits until no span has come for `quiet` (the exporters send in
    /// batches), at most `bound`.
    pub async fn settle(&self, quiet: Duration, bound: Duration) {
        let deadline = tokio::time::Instant::now() + bound;
        let mut seen = self.len();
        while tokio::time::Instant::now() < deadline {
            tokio::time::sleep(quiet).await;
            let now = self.len();
            if now == seen {
                return;
            }
            seen = now;
        }
    }
}

impl Drop for Otlp {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn receive(State(spans): State<Store>, body: Bytes) -> Vec<u8> {
    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
        return Vec::new();
    };
    let text = |v: &Option<AnyValue>| match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        _ => String::new(),
    };
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let mut got = Vec::new();
    for resource in request.resource_spans {
        let service = resource
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|a| a.key == "service.name")
            .map(|a| text(&a.value))
            .unwrap_or_default();
        for s in resource.scope_spans.into_iter().flat_map(|s| s.spans) {
            got.push(Span {
                service: service.clone(),
                trace_id: hex(&s.trace_id),
                span_id: hex(&s.span_id),
                parent: hex(&s.parent_span_id),
                attributes: s
                    .attributes
                    .iter()
                    .map(|a| (a.key.clone(), text(&a.value)))
                    .collect(),
                start_us: s.start_time_unix_nano as f64 / 1000.0,
                end_us: s.end_time_unix_nano as f64 / 1000.0,
                name: s.name,
            });
        }
    }
    if let Ok(mut all) = spans.lock() {
        all.extend(got);
    }
    // An empty ExportTraceServiceResponse.
    Vec::new()
}

//! `/healthz`, `/readyz` and `/metrics`, served by every service, beside
//! whatever routes a service adds (the dashboard's pages).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::config::HttpSettings;
use crate::metrics::Metrics;
use crate::state_store::StateStore;

/// What `/readyz` reports: the service's connections.
#[derive(Default)]
pub struct Health {
    broker: AtomicBool,
    /// Set by services that use no broker (the dashboard): readiness is then
    /// Postgres alone and `/readyz` reports `rabbitmq: null`.
    no_broker: AtomicBool,
    store: Option<StateStore>,
    /// Service-specific detail shown in `/readyz` (e.g. breaker states).
    detail: std::sync::Mutex<serde_json::Map<String, serde_json::Value>>,
}

impl Health {
    /// Health of a service that uses this state store (or none).
    pub fn new(store: Option<StateStore>) -> Self {
        Self {
            broker: AtomicBool::new(false),
            no_broker: AtomicBool::new(false),
            store,
            detail: Default::default(),
        }
    }

    /// Sets one entry of the detail shown in `/readyz`.
    pub fn set_detail(&self, key: &str, value: serde_json::Value) {
        let mut detail = self.detail.lock().unwrap_or_else(|p| p.into_inner());
        detail.insert(key.to_owned(), value);
    }

    /// Marks the service as one that never connects to RabbitMQ.
    pub fn without_broker(&self) {
        self.no_broker.store(true, Ordering::Relaxed);
    }

    /// Records whether the broker connection is up.
    pub fn set_broker(&self, up: bool) {
        self.broker.store(up, Ordering::Relaxed);
    }

    async fn report(&self) -> (bool, serde_json::Value) {
        let rabbitmq =
            (!self.no_broker.load(Ordering::Relaxed)).then(|| self.broker.load(Ordering::Relaxed));
        let postgres = match &self.store {
            // A health check answers at once; the pool would wait for a connection.
            Some(store) => Some(
                tokio::time::timeout(std::time::Duration::from_secs(1), store.ping())
                    .await
                    .unwrap_or(false),
            ),
            None => None,
        };
        let ready = rabbitmq.unwrap_or(true) && postgres.unwrap_or(true);
        let detail = self
            .detail
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        (
            ready,
            json!({ "ready": ready, "rabbitmq": rabbitmq, "postgres": postgres, "detail": detail }),
        )
    }
}

#[derive(Clone)]
struct AppState {
    health: Arc<Health>,
    metrics: Arc<Metrics>,
}

/// Binds the HTTP port (`http.port`, else `default_port`) and serves the
/// health and metrics endpoints plus `extra` until `shutdown`. Returns the
/// bound address and the server task. Requests carry their peer's address as
/// [`axum::extract::ConnectInfo`]`<SocketAddr>`. The health and metrics
/// endpoints need no credentials; `extra` brings its own guards.
pub async fn serve(
    settings: &HttpSettings,
    default_port: u16,
    health: Arc<Health>,
    metrics: Arc<Metrics>,
    extra: Router,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)> {
    let port = settings.port.unwrap_or(default_port);
    let listener = tokio::net::TcpListener::bind((settings.host.as_str(), port))
        .await
        .map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot listen on {}:{port}: {e}", settings.host),
            )
        })?;
    let addr = listener.local_addr()?;
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(AppState { health, metrics })
        .merge(extra);
    // Handlers may ask for the TCP peer (`ConnectInfo<SocketAddr>`, set by
    // the server): the dashboard believes a proxy's identity header only
    // from a trusted peer.
    let task = tokio::spawn(async move {
        let stop = async move { shutdown.cancelled().await };
        let listener = crate::server::no_delay(listener);
        crate::server::serve(listener, app, crate::server::Limits::default(), stop).await
    });
    Ok((addr, task))
}

async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    let (ready, body) = state.health.report().await;
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(body))
}

async fn metrics_text(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        state.metrics.render(),
    )
}

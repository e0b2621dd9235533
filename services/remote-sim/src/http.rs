//! HTTP layer: the axum router with the control API and the catch-all
//! handler for simulated endpoints.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::header::{ALLOW, LOCATION, RETRY_AFTER};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get;
use serde_json::json;

use crate::knobs::{Knobs, is_control_path};
use crate::sim::{RemoteSim, Reply};

/// Largest accepted request body (1 MiB); larger bodies answer 413.
pub const BODY_LIMIT: usize = 1024 * 1024;

/// Header carrying the idempotency key of a call.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// The fencing token an agent sends with each call (contract §8).
pub const FENCING_TOKEN: HeaderName = HeaderName::from_static("x-sas-fencing-token");
/// What sas knew of the forward step a compensating call undoes: `unknown`
/// (it may or may not have been applied) or `completed`.
pub const SAS_OUTCOME: HeaderName = HeaderName::from_static("x-sas-outcome");

/// Longest `X-Sas-Outcome` value recorded, in bytes; longer ones are cut
/// (on a character boundary), so a hostile header cannot bloat the stats.
pub const OUTCOME_LIMIT: usize = 32;

/// Header set to `true` on answers replayed from the deduplication store.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Builds the router: control API plus every other path as a simulated endpoint (POST).
pub fn router(sim: Arc<RemoteSim>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/stats", get(get_stats).delete(reset_stats))
        .route("/_sim/knobs", get(list_knobs).delete(reset_knobs))
        .route(
            "/_sim/knobs/{*path}",
            get(get_knobs).put(put_knobs).delete(delete_knobs),
        )
        .fallback(simulated_endpoint)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(sim)
}

impl IntoResponse for Reply {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body)).into_response();
        let headers = response.headers_mut();
        if let Some(seconds) = self.retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        if self.replayed {
            headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        }
        if let Some(location) = self.location.and_then(|l| HeaderValue::from_str(&l).ok()) {
            headers.insert(LOCATION, location);
        }
        response
    }
}

/// A JSON error answer for the control API and malformed requests.
fn error(status: StatusCode, message: impl std::fmt::Display) -> Response {
    let body = json!({ "ok": false, "error": message.to_string() });
    (status, Json(body)).into_response()
}

async fn healthz() -> &'static str {
    "ok"
}

async fn get_stats(State(sim): State<Arc<RemoteSim>>) -> Response {
    Json(sim.stats()).into_response()
}

async fn reset_stats(State(sim): State<Arc<RemoteSim>>) -> StatusCode {
    sim.reset_stats();
    tracing::info!("stats and deduplication store reset");
    StatusCode::NO_CONTENT
}

async fn list_knobs(State(sim): State<Arc<RemoteSim>>) -> Response {
    Json(sim.all_knobs()).into_response()
}

async fn reset_knobs(State(sim): State<Arc<RemoteSim>>) -> StatusCode {
    sim.reset_knobs();
    tracing::info!("all knobs reset to defaults");
    StatusCode::NO_CONTENT
}

async fn get_knobs(State(sim): State<Arc<RemoteSim>>, Path(path): Path<String>) -> Response {
    Json(sim.knobs(&format!("/{path}"))).into_response()
}

async fn put_knobs(
    State(sim): State<Arc<RemoteSim>>,
    Path(path): Path<String>,
    body: Bytes,
) -> Response {
    let path = format!("/{path}");
    let knobs = match serde_json::from_slice::<Knobs>(&body) {
        Ok(knobs) => knobs,
        Err(err) => return error(StatusCode::BAD_REQUEST, format!("invalid knobs: {err}")),
    };
    if let Err(err) = sim.set_knobs(&path, knobs.clone()) {
        return error(StatusCode::BAD_REQUEST, format!("{err:#}"));
    }
    tracing::info!(endpoint = %path, ?knobs, "knobs set");
    StatusCode::NO_CONTENT.into_response()
}

async fn delete_knobs(State(sim): State<Arc<RemoteSim>>, Path(path): Path<String>) -> StatusCode {
    let path = format!("/{path}");
    sim.remove_knobs(&path);
    tracing::info!(endpoint = %path, "knobs reset to defaults");
    StatusCode::NO_CONTENT
}

/// Every path that is not part of the control API is a simulated endpoint.
async fn simulated_endpoint(
    State(sim): State<Arc<RemoteSim>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let endpoint = uri.path();
    if is_control_path(endpoint) {
        return error(StatusCode::NOT_FOUND, format!("no control path {endpoint}"));
    }
    // A long-running operation's `Location` (knob `long_ms`) is polled with GET.
    if method == Method::GET
        && let Some((_, job)) = endpoint.rsplit_once("/jobs/")
        && !job.is_empty()
        && !job.contains('/')
    {
        let reply = sim.poll(job).await;
        tracing::info!(endpoint, status = reply.status.as_u16(), "poll");
        return reply.into_response();
    }
    if method != Method::POST {
        let mut response = error(
            StatusCode::METHOD_NOT_ALLOWED,
            "simulated endpoints accept POST (and GET of a job's Location) only",
        );
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("POST"));
        return response;
    }
    let key = headers
        .get(&IDEMPOTENCY_KEY)
        .and_then(|value| value.to_str().ok())
        .map(str::trim)
        .filter(|key| !key.is_empty());
    let token = headers
        .get(&FENCING_TOKEN)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse::<i64>().ok());
    let outcome = headers
        .get(&SAS_OUTCOME)
        .map(|value| outcome(value.as_bytes()));
    let reply = sim
        .call(endpoint, key, token, outcome.as_deref(), &body)
        .await;
    tracing::info!(
        endpoint,
        key = key.unwrap_or("-"),
        status = reply.status.as_u16(),
        replayed = reply.replayed,
        "call"
    );
    reply.into_response()
}

/// An `X-Sas-Outcome` value as recorded: trimmed, at most [`OUTCOME_LIMIT`]
/// bytes, bytes that are not UTF-8 replaced (header values may be any bytes).
fn outcome(value: &[u8]) -> String {
    let value = String::from_utf8_lossy(value);
    let value = value.trim();
    let mut end = value.len().min(OUTCOME_LIMIT);
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    value[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_values_are_recorded_as_given_but_bounded() {
        assert_eq!(outcome(b"unknown"), "unknown");
        assert_eq!(outcome(b" completed "), "completed");
        assert_eq!(outcome(b"Maybe"), "Maybe");
        assert_eq!(outcome(b""), "");
        assert_eq!(outcome(&[b'x'; 100]).len(), OUTCOME_LIMIT);
        assert_eq!(outcome(b"a\xff"), "a\u{fffd}");
        // 31 ASCII bytes then a 3-byte replacement character: cut before it.
        let mut odd = vec![b'y'; 31];
        odd.push(0xff);
        assert_eq!(outcome(&odd), "y".repeat(31));
    }
}

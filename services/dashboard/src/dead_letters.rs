//! The dead-letter queues on the dashboard, through [`sas::dead_letters`]
//! (what `sasctl dead-letters` uses too):
//!
//! - `GET  /api/dead-letters`: `{"queues": [{"kind", "agent", "queue",
//!   "origin", "total"}]}`: the orders', each agent's requests' and the
//!   replies' dead-letter queues with the messages each holds (`total` null
//!   and `error` set for a queue that cannot be counted).
//! - `GET  /api/dead-letters/{queue}?limit=N`: `{"queue", "total",
//!   "letters": [{"reason", "message_id", "reply_to", "tries", "body"}]}`,
//!   the oldest N (20 by default, at most 1000), left in the queue.
//! - `POST /api/dead-letters/{queue}/replay?limit=N`: re-publishes the oldest
//!   N (every one by default) to the queue they came from: `{"replayed"}`.
//! - `POST /api/dead-letters/{queue}/purge`: deletes them all: `{"purged"}`.
//!
//! Only a deployment's own dead-letter queues are named (404 otherwise).
//! Replay and purge are an operator's (a viewer gets 403) and need a JSON
//! request (415 otherwise), like retry and cancel. The dashboard connects to
//! RabbitMQ only for these, on first use, and keeps the connection; when
//! RabbitMQ cannot be reached they answer 503 and the rest of the dashboard
//! works on.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sas::broker::{Broker, BrokerError, Publisher};
use sas::dead_letters::{self, DeadLetterError, DeadLetterQueue};
use sas::service::Context;
use serde_json::{Value, json};
use tokio::sync::Mutex;

use crate::auth::{Identity, Operator};

/// Letters listed unless `limit` says otherwise.
const DEFAULT_LIST: u32 = 20;

/// How long a request waits for RabbitMQ before answering 503: a page
/// should not hang for `broker.connect_timeout`.
const CONNECT_WITHIN: Duration = Duration::from_secs(3);

/// The dashboard's one connection to RabbitMQ, made on first use and made
/// again once lost; with its publisher for replays.
#[derive(Default)]
pub struct Rabbit {
    live: Mutex<Option<Arc<Live>>>,
}

struct Live {
    broker: Broker,
    publisher: Publisher,
}

impl Rabbit {
    async fn get(&self, ctx: &Context) -> Result<Arc<Live>, Failure> {
        let mut live = self.live.lock().await;
        if let Some(l) = live.as_ref()
            && l.broker.is_connected()
            && l.publisher.is_open()
        {
            return Ok(l.clone());
        }
        if let Some(old) = live.take() {
            old.broker.close().await;
        }
        let mut settings = ctx.settings.broker.clone();
        settings.connect_timeout = settings.connect_timeout.min(CONNECT_WITHIN);
        let unreachable = |e: BrokerError| Failure::Unavailable(format!("RabbitMQ: {e}"));
        let broker = Broker::connect(&settings, "dashboard")
            .await
            .map_err(unreachable)?;
        let publisher = match broker.publisher().await {
            Ok(p) => p,
            Err(e) => {
                broker.close().await;
                return Err(unreachable(e));
            }
        };
        let fresh = Arc::new(Live { broker, publisher });
        *live = Some(fresh.clone());
        Ok(fresh)
    }
}

/// Why a dead-letter request failed, answered as `{"error"}`.
#[derive(Debug)]
enum Failure {
    NotFound(String),
    BadRequest(String),
    UnsupportedMediaType,
    Unavailable(String),
}

impl Failure {
    fn message(&self) -> &str {
        match self {
            Self::NotFound(m) | Self::BadRequest(m) | Self::Unavailable(m) => m,
            Self::UnsupportedMediaType => "not a JSON request",
        }
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let (status, message) = match self {
            Self::NotFound(m) => (StatusCode::NOT_FOUND, m),
            Self::BadRequest(m) => (StatusCode::BAD_REQUEST, m),
            Self::UnsupportedMediaType => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "send the action as a JSON request (Content-Type: application/json)".to_owned(),
            ),
            Self::Unavailable(m) => {
                tracing::warn!(error = %m, "dashboard: a dead-letter request failed");
                (StatusCode::SERVICE_UNAVAILABLE, m)
            }
        };
        (status, axum::Json(json!({ "error": message }))).into_response()
    }
}

impl From<DeadLetterError> for Failure {
    fn from(e: DeadLetterError) -> Self {
        // A queue that is not there is the deployment's state (no service
        // declared it yet); anything else is RabbitMQ failing.
        let not_found = matches!(e, DeadLetterError::NoQueue { .. });
        let message = format!("{:#}", anyhow::Error::new(e));
        if not_found {
            Self::NotFound(message)
        } else {
            Self::Unavailable(message)
        }
    }
}

/// The deployment's dead-letter queues: for the configured agents.
fn queues(ctx: &Context) -> Vec<DeadLetterQueue> {
    let agents = ctx.settings.agent_names();
    DeadLetterQueue::all(&ctx.queues, agents.iter().map(String::as_str))
}

/// The queue named in the path, if it is one of the deployment's.
fn named(ctx: &Context, queue: &str) -> Result<DeadLetterQueue, Failure> {
    DeadLetterQueue::find(&queues(ctx), queue)
        .cloned()
        .ok_or_else(|| {
            Failure::NotFound(format!(
                "{:?} is not a dead-letter queue of this deployment",
                sas::messages::truncate_bytes(queue, 300)
            ))
        })
}

/// `limit=N` from the query string, within `1..=max`.
fn limit(query: Option<&str>, max: u32) -> Result<Option<u32>, Failure> {
    let Some(query) = query else {
        return Ok(None);
    };
    let mut found = None;
    for (key, value) in form_urlencoded::parse(query.as_bytes()) {
        match key.as_ref() {
            "limit" if value.is_empty() => {}
            "limit" => {
                let n = value
                    .parse::<u32>()
                    .ok()
                    .filter(|n| (1..=max).contains(n))
                    .ok_or_else(|| {
                        Failure::BadRequest(format!("limit: give a number from 1 to {max}"))
                    })?;
                found = Some(n);
            }
            _ => return Err(Failure::BadRequest("the only parameter is limit".into())),
        }
    }
    Ok(found)
}

/// An action must come as JSON: a plain HTML form from another site cannot
/// send one, so a page elsewhere cannot make a visitor's browser act here.
fn require_json(headers: &HeaderMap) -> Result<(), Failure> {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("application/json"));
    if json {
        Ok(())
    } else {
        Err(Failure::UnsupportedMediaType)
    }
}

/// `GET /api/dead-letters`.
pub async fn overview(
    State(ctx): State<Arc<Context>>,
    axum::Extension(rabbit): axum::Extension<Arc<Rabbit>>,
) -> Result<axum::Json<Value>, Response> {
    let live = rabbit
        .get(&ctx)
        .await
        .map_err(IntoResponse::into_response)?;
    let mut all = Vec::new();
    for q in queues(&ctx) {
        let mut entry = serde_json::to_value(&q).unwrap_or(Value::Null);
        match dead_letters::count(&live.broker, &ctx.queues, &q).await {
            Ok(n) => entry["total"] = json!(n),
            Err(e) => {
                entry["total"] = Value::Null;
                entry["error"] = json!(format!("{:#}", anyhow::Error::new(e)));
            }
        }
        all.push(entry);
    }
    Ok(axum::Json(json!({ "queues": all })))
}

/// `GET /api/dead-letters/{queue}`.
pub async fn list(
    State(ctx): State<Arc<Context>>,
    axum::Extension(rabbit): axum::Extension<Arc<Rabbit>>,
    Path(queue): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<axum::Json<Value>, Response> {
    let run = async {
        let q = named(&ctx, &queue)?;
        let limit = limit(query.as_deref(), dead_letters::MAX_LIST)?.unwrap_or(DEFAULT_LIST);
        let live = rabbit.get(&ctx).await?;
        let listing = dead_letters::list(&live.broker, &ctx.queues, &q, limit).await?;
        Ok::<_, Failure>(json!({
            "queue": q.queue,
            "total": listing.total,
            "letters": listing.letters,
        }))
    };
    run.await
        .map(axum::Json)
        .map_err(IntoResponse::into_response)
}

/// `POST /api/dead-letters/{queue}/replay` and `…/purge`.
pub async fn act_on(
    State(ctx): State<Arc<Context>>,
    axum::Extension(rabbit): axum::Extension<Arc<Rabbit>>,
    Operator(who): Operator,
    Path((queue, action)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Result<axum::Json<Value>, Response> {
    let chosen = match action.as_str() {
        "replay" => Act::Replay,
        "purge" => Act::Purge,
        _ => {
            let what = format!(
                "{:?} is not an action on a dead-letter queue (replay or purge)",
                sas::messages::truncate_bytes(&action, 100)
            );
            return Err(Failure::NotFound(what).into_response());
        }
    };
    act(
        &ctx,
        &rabbit,
        &who,
        &queue,
        query.as_deref(),
        &headers,
        chosen,
    )
    .await
    .map(axum::Json)
    .map_err(IntoResponse::into_response)
}

/// An operator's action on a dead-letter queue.
#[derive(Debug, Clone, Copy)]
enum Act {
    Replay,
    Purge,
}

async fn act(
    ctx: &Context,
    rabbit: &Rabbit,
    who: &Identity,
    queue: &str,
    query: Option<&str>,
    headers: &HeaderMap,
    action: Act,
) -> Result<Value, Failure> {
    require_json(headers)?;
    let q = named(ctx, queue)?;
    let live = rabbit.get(ctx).await?;
    match action {
        Act::Replay => {
            let limit = limit(query, u32::MAX)?;
            let replayed =
                dead_letters::replay(&live.broker, &live.publisher, &ctx.queues, &q, limit)
                    .await
                    .map_err(|stopped| {
                        let replayed = stopped.replayed;
                        match Failure::from(stopped.error) {
                            Failure::NotFound(m) => Failure::NotFound(m),
                            other => Failure::Unavailable(format!(
                                "{} ({replayed} replayed before)",
                                other.message()
                            )),
                        }
                    })?;
            tracing::info!(queue = %q.queue, origin = %q.origin, replayed, operator = %who.name, "dead letters replayed by an operator");
            Ok(json!({ "queue": q.queue, "replayed": replayed }))
        }
        Act::Purge => {
            if query.is_some_and(|q| !q.is_empty()) {
                return Err(Failure::BadRequest("purge takes no parameter".into()));
            }
            let purged = dead_letters::purge(&live.broker, &ctx.queues, &q).await?;
            tracing::info!(queue = %q.queue, purged, operator = %who.name, "dead letters purged by an operator");
            Ok(json!({ "queue": q.queue, "purged": purged }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_is_the_only_parameter_and_is_bounded() {
        assert!(matches!(limit(None, 10), Ok(None)));
        assert!(matches!(limit(Some("limit=3"), 10), Ok(Some(3))));
        assert!(matches!(limit(Some("limit="), 10), Ok(None)));
        for bad in ["limit=0", "limit=11", "limit=x", "queue=a"] {
            assert!(
                matches!(limit(Some(bad), 10), Err(Failure::BadRequest(_))),
                "{bad}"
            );
        }
    }
}

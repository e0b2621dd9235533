//! The dashboard's routes: the pages (see [`crate::assets`]), the login
//! (see [`crate::login`]) and the JSON API the pages poll. Every one of them,
//! and every unknown path, is behind the Host/Origin allow-list
//! ([`crate::hosts`]); the pages and the API also need an identity
//! ([`crate::auth`]).
//!
//! - `GET  /api/me`: `{"name", "role", "auth"}`: who the caller is, so the page
//!   shows a viewer no action buttons.
//! - `GET  /api/overview`: [`Overview`]: counts, chart buckets, waiting and
//!   failed orders, breakers.
//! - `GET  /api/schedules`: `{"now", "schedules"}`: each recurring order's
//!   schedule ([`ScheduleView`]): cron, time zone, next tick, last tick and
//!   last order with its state.
//! - `GET  /api/orders?state=&workflow=&…`: the order search ([`crate::search`]).
//! - `GET  /api/dead-letters…`, `POST /api/dead-letters/{queue}/replay|purge`:
//!   the dead-letter queues ([`crate::dead_letters`]).
//! - `GET  /api/orders/{id}`: one order, its steps and its event log with durations.
//! - `POST /api/orders/{id}/retry`, `POST /api/orders/{id}/cancel`: the
//!   operator's actions, through the same [`sas::operate`] as `sasctl orders
//!   retry|cancel` (published at once), so guards and status events are
//!   identical; the event log
//!   names the caller (`operator:<name>`), and a viewer gets 403. They answer
//!   `{"order_id", "state"}`, or `{"error"}` with 404 (no such order), 409 (not
//!   allowed in the order's state, with `state`), 400 (not an order id) or
//!   415 (not a JSON request: a plain HTML form from another site cannot send
//!   one, so a page elsewhere cannot make a visitor's browser act here).
//! - `POST /api/orders/{id}/signals/{name}`, body `{}` or `{"data": …}`:
//!   the signal a `signal` step of the order waits for (contract §4d), as
//!   `sasctl orders signal`, answered like retry and cancel (`409` with
//!   the reason when no step waits for it now).
//! - `POST /api/orders/{id}/redrive`, body `{}` or `{"patch": <JSON merge
//!   patch>}`: the operator's redrive of an `error` or `compensated` order
//!   (contract §9), as `sasctl orders redrive`, answered like retry and
//!   cancel; a body that is not such an object is a 400, a patch that gives
//!   a payload no order may carry a 422.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router, middleware};
use chrono::{DateTime, Utc};
use sas::engine::{Operated, any_undone};
use sas::operate::Operation;
use sas::rules::Order;
use sas::rules::operator::any_undo_in_doubt;
use sas::rules::operator::cancel_refusal;
use sas::rules::operator::redrive_refusal;
use sas::rules::operator::retry_refusal;
use sas::service::Context;
use sas::state::ProcessState;
use sas::state_store::{EventRow, OrderRow, Overview, ScheduleView, StepRow};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::auth::{self, Auth, Identity, Operator};
use crate::hosts::{self, AllowedHosts};

/// Orders listed at most per table of the overview.
const LIST_LIMIT: i64 = 50;

/// The pages, the login and the API, over the service's context.
pub fn routes(ctx: Arc<Context>) -> Router {
    // The dashboard never connects to RabbitMQ: ready means Postgres answers.
    ctx.health.without_broker();
    let settings = &ctx.settings;
    let auth = Arc::new(Auth::new(&settings.dashboard));
    auth.log_start(&settings.http.host);
    let hosts = Arc::new(AllowedHosts::new(
        &settings.http.host,
        &settings.dashboard.allowed_hosts,
    ));
    crate::assets::pages()
        .route("/api/me", get(me))
        .route("/api/overview", get(overview))
        .route("/api/schedules", get(schedules))
        .route("/api/orders", get(crate::search::search))
        .route("/api/orders/{id}", get(order))
        .route("/api/orders/{id}/retry", post(retry))
        .route("/api/orders/{id}/cancel", post(cancel))
        .route("/api/orders/{id}/redrive", post(redrive))
        .route("/api/orders/{id}/signals/{name}", post(signal))
        .route("/api/dead-letters", get(crate::dead_letters::overview))
        .route("/api/dead-letters/{queue}", get(crate::dead_letters::list))
        .route(
            "/api/dead-letters/{queue}/{action}",
            post(crate::dead_letters::act_on),
        )
        .layer(Extension(Arc::new(crate::dead_letters::Rabbit::default())))
        .with_state(ctx)
        .route_layer(middleware::from_fn_with_state(auth.clone(), auth::require))
        .merge(crate::assets::files())
        .merge(crate::login::routes(auth))
        // Unknown paths too: the host guard answers every request that is
        // not a health or metrics probe.
        .fallback(|| async { StatusCode::NOT_FOUND })
        .layer(middleware::from_fn_with_state(hosts, hosts::guard))
}

/// An API failure, answered as `{"error": …}` with its status.
#[derive(Debug)]
enum ApiError {
    BadRequest(String),
    NotFound(String),
    NotAllowed {
        message: String,
        state: ProcessState,
    },
    UnsupportedMediaType,
    /// A redrive's patch gives a payload no order may carry.
    Unprocessable(String),
    Internal(anyhow::Error),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, body) = match self {
            Self::BadRequest(message) => (StatusCode::BAD_REQUEST, json!({ "error": message })),
            Self::NotFound(message) => (StatusCode::NOT_FOUND, json!({ "error": message })),
            Self::NotAllowed { message, state } => (
                StatusCode::CONFLICT,
                json!({ "error": message, "state": state.as_str() }),
            ),
            Self::Unprocessable(message) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                json!({ "error": message }),
            ),
            Self::UnsupportedMediaType => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                json!({ "error": "send the action as a JSON request (Content-Type: application/json)" }),
            ),
            Self::Internal(e) => {
                tracing::error!(error = format!("{e:#}"), "dashboard request failed");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    json!({ "error": format!("{e:#}") }),
                )
            }
        };
        (status, axum::Json(body)).into_response()
    }
}

impl<E: Into<anyhow::Error>> From<E> for ApiError {
    fn from(e: E) -> Self {
        Self::Internal(e.into())
    }
}

fn parse_id(text: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(text).map_err(|_| ApiError::BadRequest(format!("{text:?} is not an order id")))
}

async fn me(
    State(ctx): State<Arc<Context>>,
    Extension(who): Extension<Identity>,
) -> axum::Json<Value> {
    let mut me = json!({
        "name": who.name,
        "role": who.role.as_str(),
        "auth": ctx.settings.dashboard.auth.as_str(),
    });
    // Shown on every page while the deployment is open to anyone.
    if let Some(warning) = ctx.settings.unguarded_exposure() {
        me["warnings"] = json!([warning]);
    }
    axum::Json(me)
}

async fn overview(State(ctx): State<Arc<Context>>) -> Result<axum::Json<Overview>, ApiError> {
    let reads = sas::state_store::ReadModels::new(ctx.store()?.clone());
    let mut overview = reads.overview(LIST_LIMIT).await?;
    // The page greys out a button the transition would refuse, by the
    // transitions' own rules; the transition still decides.
    for o in &mut overview.failed {
        o.retryable = retry_refusal(o.process_state, o.undone).is_none();
        o.cancellable = cancel_refusal(o.process_state).is_none();
    }
    Ok(axum::Json(overview))
}

/// The schedules' answer: the views with the database clock they were read at.
#[derive(Debug, serde::Serialize)]
struct Schedules {
    now: DateTime<Utc>,
    schedules: Vec<ScheduleView>,
}

async fn schedules(State(ctx): State<Arc<Context>>) -> Result<axum::Json<Schedules>, ApiError> {
    let compiled = ctx.settings.compiled_schedules(Utc::now())?;
    let (schedules, now) = ctx.store()?.schedule_views(&compiled).await?;
    Ok(axum::Json(Schedules { now, schedules }))
}

async fn order(
    State(ctx): State<Arc<Context>>,
    Path(id): Path<String>,
) -> Result<axum::Json<Value>, ApiError> {
    let id = parse_id(&id)?;
    let store = ctx.store()?;
    let Some((order, steps, events)) = store.order_details(id).await? else {
        return Err(ApiError::NotFound(format!("no order {id}")));
    };
    let mut json = order_json(&order, &steps, &events, Utc::now());
    // The definition it runs under (contract §4d).
    json["order"]["version"] = json!(store.version_of(&order).await);
    // Why it is stuck, from the state store alone (the dashboard does not
    // ask RabbitMQ: a late step's queue facts read `unknown`).
    let loaded = [Order { row: order, steps }];
    let stuck = sas::diagnosis::explain(&loaded, store, None, &ctx.queues)
        .await
        .pop()
        .flatten();
    json["stuck"] = stuck.map_or(Value::Null, |s| s.to_json());
    Ok(axum::Json(json))
}

/// An operator's action.
#[derive(Debug, Clone)]
enum Action {
    Retry,
    Cancel,
    /// With the body as sent, read once the request is known to be JSON.
    Redrive(axum::body::Bytes),
    /// The signal's name, and the body as sent (`{"data": …}` or `{}`).
    Signal(String, axum::body::Bytes),
}

async fn retry(
    State(ctx): State<Arc<Context>>,
    Operator(who): Operator,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<axum::Json<Value>, ApiError> {
    operate(&ctx, &who, Action::Retry, &id, &headers).await
}

async fn cancel(
    State(ctx): State<Arc<Context>>,
    Operator(who): Operator,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<axum::Json<Value>, ApiError> {
    operate(&ctx, &who, Action::Cancel, &id, &headers).await
}

async fn redrive(
    State(ctx): State<Arc<Context>>,
    Operator(who): Operator,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<axum::Json<Value>, ApiError> {
    operate(&ctx, &who, Action::Redrive(body), &id, &headers).await
}

/// `POST /api/orders/{id}/signals/{name}`, body `{}` or `{"data": …}`:
/// the signal a step of the order waits for (contract §4d), as `sasctl
/// orders signal`.
async fn signal(
    State(ctx): State<Arc<Context>>,
    Operator(who): Operator,
    Path((id, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<axum::Json<Value>, ApiError> {
    operate(&ctx, &who, Action::Signal(name, body), &id, &headers).await
}

/// The data of a signal's body: `{}` (none: `{}`) or `{"data": …}`.
fn signal_data(body: &[u8]) -> Result<Value, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(mut fields)) => Ok(fields
            .remove("data")
            .filter(|d| !d.is_null())
            .unwrap_or_else(|| json!({}))),
        _ => Err(ApiError::BadRequest("send {} or {\"data\": <JSON>}".into())),
    }
}

/// The patch of a redrive's body: `{}` (none) or `{"patch": …}` (a JSON
/// `null` patch is none too: as a merge patch it would leave no payload).
fn redrive_patch(body: &[u8]) -> Result<Option<Value>, ApiError> {
    let refused = || ApiError::BadRequest("send {} or {\"patch\": <JSON merge patch>}".into());
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(mut fields)) => Ok(fields.remove("patch").filter(|p| !p.is_null())),
        _ => Err(refused()),
    }
}

async fn operate(
    ctx: &Context,
    who: &Identity,
    action: Action,
    id: &str,
    headers: &HeaderMap,
) -> Result<axum::Json<Value>, ApiError> {
    let json_request = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("application/json"));
    if !json_request {
        return Err(ApiError::UnsupportedMediaType);
    }
    let id = parse_id(id)?;
    let me = who.actor();
    let (patch, data);
    let (operation, verb) = match &action {
        Action::Retry => (Operation::Retry, "retry"),
        Action::Cancel => (Operation::Cancel, "cancel"),
        Action::Redrive(body) => {
            patch = redrive_patch(body)?;
            let max_bytes = ctx.settings.submission.max_body_bytes;
            let patch = patch.as_ref();
            (Operation::Redrive { patch, max_bytes }, "redrive")
        }
        Action::Signal(name, body) => {
            data = signal_data(body)?;
            (Operation::Signal { name, data: &data }, "signal")
        }
    };
    // Published before it answers, through a relay of the action's own.
    let store = ctx.store()?;
    let outcome = sas::operate::operate(store, &ctx.settings, "dashboard", &me, id, operation);
    let outcome = outcome.await?;
    match outcome {
        Operated::Done(state) => {
            tracing::info!(order_id = %id, operator = %me.name, state = %state, "order {verb} by an operator");
            Ok(axum::Json(
                json!({ "order_id": id, "state": state.as_str() }),
            ))
        }
        Operated::NotFound => Err(ApiError::NotFound(format!("no order {id}"))),
        Operated::NotAllowed(state, why) => Err(ApiError::NotAllowed {
            message: format!("cannot {verb} order {id}: it is {state} ({why})"),
            state,
        }),
        Operated::PayloadRefused(why) => {
            let what = if verb == "signal" {
                "the signal"
            } else {
                "the patched payload"
            };
            Err(ApiError::Unprocessable(format!(
                "cannot {verb} order {id}: {what} is refused: {why}"
            )))
        }
    }
}

/// Milliseconds from `from` to `to`, when both are known.
fn millis(from: Option<DateTime<Utc>>, to: Option<DateTime<Utc>>) -> Option<i64> {
    Some((to? - from?).num_milliseconds())
}

/// The order page's data: the order, its steps with their durations, its
/// event log with the time since the previous event, and which actions the
/// transitions would accept now (to grey out the others; they check again).
fn order_json(
    order: &OrderRow,
    steps: &[StepRow],
    events: &[EventRow],
    now: DateTime<Utc>,
) -> Value {
    // The rules `Transitions::retry` and `Transitions::cancel` enforce.
    let retryable = retry_refusal(order.process_state, any_undone(steps)).is_none();
    let cancellable = cancel_refusal(order.process_state).is_none();
    let redrivable = redrive_refusal(order.process_state, any_undo_in_doubt(steps)).is_none();
    let mut previous = Some(order.created_at);
    let events: Vec<Value> = events
        .iter()
        .map(|e| {
            let since_previous_ms = millis(previous, Some(e.at));
            previous = Some(e.at);
            let mut event = e.to_json();
            event["since_previous_ms"] = json!(since_previous_ms);
            event["since_created_ms"] = json!(millis(Some(order.created_at), Some(e.at)));
            event
        })
        .collect();
    let steps_json: Vec<Value> = steps
        .iter()
        .map(|s| {
            let mut step = s.to_json(steps);
            step["duration_ms"] = json!(millis(s.started_at, s.finished_at));
            step
        })
        .collect();
    json!({
        "now": now,
        "order": order.to_json(),
        "actions": { "retry": retryable, "cancel": cancellable, "redrive": redrivable },
        "stages": sas::state_store::stage_names(steps),
        "steps": steps_json,
        "events": events,
    })
}

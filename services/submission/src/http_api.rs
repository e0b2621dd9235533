//! The HTTP API of orders (contract §9a), on the submission's port beside
//! `/healthz`, `/readyz` and `/metrics`:
//!
//! - `POST /v1/orders`: an order, body as on the queue (§1), stored through
//!   the same [`Intake`] as the queue's, so an id sent both ways is one
//!   order. `Idempotency-Key: <uuid>` is its `order_id`. `202` with
//!   `{"order_id"}` and `Location` once stored; the same id again: `200`.
//! - `GET /v1/orders/{id}`: the order, its steps and its status events.
//! - `GET /v1/orders/{id}/events?from_seq=N`: its status events as
//!   `text/event-stream` ([`stream`]), ending after the terminal event;
//!   `Last-Event-ID` resumes.
//! - `POST /v1/orders/{id}/cancel`: the operator's cancel (the same
//!   transition as `sasctl orders cancel`), `202` or `409` with the reason.
//! - `POST /v1/orders/{id}/signals/{name}`: the application's signal to
//!   the order's step that waits for it (§4d), `202`, or `409` with the
//!   reason when none waits for it now.
//! - `GET /v1/openapi.json`: the OpenAPI document ([`openapi`]), generated
//!   from [`Endpoint::ALL`], which also builds the router.
//!
//! Who may call is [`auth`]'s business; an application sees only its own
//! orders, and another's is `404` as if it did not exist. Every refusal is
//! `{"error", "reason"}` with a 4xx status; no input panics the service.

mod auth;
mod openapi;
mod stream;
mod watches;

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, MethodRouter, on};
use sas::engine::{Operated, Submitted};
use sas::messages::{EventKind, RejectReason, logged_event, signal_refusal, truncate_bytes};
use sas::service::Context;
use sas::state_store::{EventRow, OrderRow, StepRow, StoreError};
use sas_protocol::http::{Cancelled, OrderAccepted, OrderView, Signalled, StepView};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::submission::{Accepted, Intake};
use auth::{Caller, Gate};

/// What the handlers share.
pub struct Api {
    ctx: Arc<Context>,
    intake: Arc<Intake>,
    /// Who may call.
    gate: Gate,
    /// The open event streams: their places and watches.
    streams: stream::Streams,
    /// The OpenAPI document, generated once.
    openapi: Bytes,
}

/// The API's routes over the service's context, storing orders through
/// `intake` (the one the orders queue shares).
pub fn routes(ctx: Arc<Context>, made: Arc<Intake>) -> Router {
    let gate = Gate::new(&ctx.settings);
    gate.log_start(&ctx.settings.http.host);
    let body_limit = ctx.settings.submission.max_body_bytes;
    let Ok(store) = ctx.store().cloned() else {
        tracing::error!("no state store; the HTTP API is not served");
        return Router::new();
    };
    let streams = stream::Streams::new(&ctx.settings.submission, store, ctx.shutdown.clone());
    let api = Arc::new(Api {
        gate,
        intake: made,
        streams,
        openapi: Bytes::from(openapi::document().to_string()),
        ctx,
    });
    router()
        // Bodies up to the submission's limit (the server's default is
        // smaller); a longer one is refused before it is read.
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(api)
        // Unknown paths and methods of this port: JSON like the rest.
        .fallback(|| async { ApiError::no_route() })
}

/// The router of [`Endpoint::ALL`], without its state.
fn router() -> Router<Arc<Api>> {
    Endpoint::ALL
        .into_iter()
        .fold(Router::new(), |r, e| r.route(e.path(), e.method_router()))
}

/// One operation of the API: the router and the OpenAPI document are both
/// built from these, so neither has a route the other lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Submit,
    Order,
    Events,
    Cancel,
    Signal,
    OpenApi,
}

impl Endpoint {
    /// Every operation.
    pub const ALL: [Self; 6] = [
        Self::Submit,
        Self::Order,
        Self::Events,
        Self::Cancel,
        Self::Signal,
        Self::OpenApi,
    ];

    /// Its path, as axum and OpenAPI both write it.
    pub fn path(self) -> &'static str {
        match self {
            Self::Submit => "/v1/orders",
            Self::Order => "/v1/orders/{id}",
            Self::Events => "/v1/orders/{id}/events",
            Self::Cancel => "/v1/orders/{id}/cancel",
            Self::Signal => "/v1/orders/{id}/signals/{name}",
            Self::OpenApi => "/v1/openapi.json",
        }
    }

    /// Its method.
    pub fn method(self) -> Method {
        match self {
            Self::Order | Self::Events | Self::OpenApi => Method::GET,
            Self::Submit | Self::Cancel | Self::Signal => Method::POST,
        }
    }

    /// Its handler, on its method only.
    fn method_router(self) -> MethodRouter<Arc<Api>> {
        let only = MethodFilter::try_from(self.method()).unwrap_or(MethodFilter::GET);
        match self {
            Self::Submit => on(only, submit),
            Self::Order => on(only, order),
            Self::Events => on(only, stream::events),
            Self::Cancel => on(only, cancel),
            Self::Signal => on(only, signal),
            Self::OpenApi => on(only, openapi_json),
        }
    }
}

/// A refusal: `{"error", "reason"}` (and more fields where said) with its
/// status.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    /// A short code, stable across versions.
    error: &'static str,
    /// What was wrong, for a person.
    reason: String,
    /// Further fields of the body (a `409`'s `state`).
    extra: Option<(&'static str, Value)>,
    /// `Retry-After` seconds, for a `503`.
    retry_after: Option<u32>,
}

impl ApiError {
    fn new(status: StatusCode, error: &'static str, reason: impl Into<String>) -> Self {
        Self {
            status,
            error,
            reason: reason.into(),
            extra: None,
            retry_after: None,
        }
    }

    fn bad_request(error: &'static str, reason: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, error, reason)
    }

    /// No such order, or not the caller's: the same answer, so that an
    /// application cannot learn which ids another uses.
    fn not_found(given: Uuid) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no order {given}"),
        )
    }

    fn no_route() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "no_route",
            "no such path in this API (see /v1/openapi.json)",
        )
    }

    fn unavailable(reason: impl Into<String>) -> Self {
        Self {
            retry_after: Some(1),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", reason)
        }
    }

    /// An unexpected failure: logged in full, answered without detail.
    fn internal(e: &dyn std::fmt::Display) -> Self {
        tracing::error!(error = %e, "HTTP API request failed");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "internal error",
        )
    }

    /// What the request carries refused ([`RejectReason`]): `413` when too
    /// large, else `400`, with the reason's label as `error`.
    fn refused(reason: &RejectReason) -> Self {
        let status = match reason {
            RejectReason::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            _ => StatusCode::BAD_REQUEST,
        };
        Self::new(status, reason.label(), reason.to_string())
    }

    /// A failure of the state store: `503` when it should pass, `400` when
    /// it refused a value the request carried (never a `500`).
    fn store(e: &StoreError) -> Self {
        if e.is_refusal_of_input() {
            tracing::warn!(error = %e, "HTTP API request: the state store refused a value");
            Self::bad_request(
                "refused_by_store",
                format!("the state store refused the request: {e}"),
            )
        } else if e.is_transient() {
            tracing::warn!(error = %e, "HTTP API request: the state store is unavailable");
            Self::unavailable("the state store is unavailable; try again")
        } else {
            Self::internal(e)
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = json!({ "error": self.error, "reason": self.reason });
        if let Some((key, value)) = self.extra {
            body[key] = value;
        }
        let mut response = (self.status, axum::Json(body)).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"sas\""),
            );
        }
        response
    }
}

/// An order id of a path: the caller's own id (a UUID).
fn parse_id(text: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(text).map_err(|_| {
        ApiError::bad_request(
            "bad_order_id",
            format!("{:?} is not an order id (a UUID)", truncate_bytes(text, 64)),
        )
    })
}

/// The body of a request, read up to the limit.
fn read_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        let status = r.status();
        let error = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "too_large"
        } else {
            "unreadable_body"
        };
        ApiError::new(status, error, r.body_text())
    })
}

/// Whether the request says its body is JSON (`application/json`, with
/// any parameters).
fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
}

/// The `Idempotency-Key` header, if given: a UUID, given once.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<Uuid>, ApiError> {
    let mut keys = headers.get_all("idempotency-key").iter();
    let Some(key) = keys.next() else {
        return Ok(None);
    };
    let refused = |why: &str| Err(ApiError::bad_request("bad_idempotency_key", why.to_owned()));
    if keys.next().is_some() {
        return refused("give Idempotency-Key once");
    }
    match key.to_str().ok().map(|k| Uuid::parse_str(k.trim())) {
        Some(Ok(id)) => Ok(Some(id)),
        _ => refused("Idempotency-Key must be a UUID: it is the order's order_id"),
    }
}

/// `POST /v1/orders`.
async fn submit(
    State(api): State<Arc<Api>>,
    caller: Caller,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    if !is_json(&headers) {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "send the order as Content-Type: application/json",
        ));
    }
    let key = idempotency_key(&headers)?;
    let body = read_body(body)?;
    let sender = caller.application();
    let (order, workflow) = api
        .intake
        .accept(&body, None, sender)
        .map_err(|(reason, _)| {
            api.intake.count_rejected(&reason);
            ApiError::refused(&reason)
        })?;
    let given = match (key, order.order_id) {
        (Some(key), Some(id)) if key != id => {
            return Err(ApiError::bad_request(
                "conflicting_order_id",
                format!("Idempotency-Key {key} and the body's order_id {id} differ"),
            ));
        }
        (key, id) => key.or(id).unwrap_or_else(Uuid::new_v4),
    };
    let sent = headers
        .get(sas::trace::HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(sas::trace::TraceContext::parse);
    let accepted = Accepted {
        order,
        workflow,
        given,
        sender,
        sent,
    };
    let (stored, _span) = api.intake.submit(accepted).await;
    let status = match stored {
        Ok(Submitted::Created { .. }) => StatusCode::ACCEPTED,
        Ok(Submitted::Duplicate) => StatusCode::OK,
        Err(e) if e.is_refusal_of_input() => {
            let text = format!("the state store refused the order: {e}");
            api.intake
                .count_rejected(&RejectReason::Internal(sas::messages::Quoted::new(&text)));
            return Err(ApiError::bad_request("refused_by_store", text));
        }
        Err(e) => return Err(ApiError::store(&e)),
    };
    let location = format!("/v1/orders/{given}");
    let mut response = (status, axum::Json(OrderAccepted { order_id: given })).into_response();
    if let Ok(value) = HeaderValue::from_str(&location) {
        response.headers_mut().insert(header::LOCATION, value);
    }
    Ok(response)
}

/// An order as `GET /v1/orders/{id}` shows it.
fn order_view(order: &OrderRow, steps: &[StepRow], events: &[EventRow]) -> OrderView {
    let public = order.public_id();
    OrderView {
        order_id: public,
        workflow: order.workflow.clone(),
        state: order.process_state.as_str().to_owned(),
        attempt: order.attempt(),
        steps: steps
            .iter()
            .map(|s| StepView {
                name: s.name.clone(),
                state: s.state.as_str().to_owned(),
                result: s.result.clone(),
            })
            .collect(),
        events: events
            .iter()
            .filter_map(|e| {
                let kind = e.event.parse::<EventKind>().ok()?;
                Some(logged_event(
                    public,
                    e.seq,
                    kind,
                    e.step.clone(),
                    e.attempt,
                    e.at,
                    e.detail.clone(),
                ))
            })
            .collect(),
    }
}

/// `GET /v1/orders/{id}`.
async fn order(
    State(api): State<Arc<Api>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<axum::Json<OrderView>, ApiError> {
    let given = parse_id(&id)?;
    let store = api.ctx.store().map_err(|e| ApiError::internal(&e))?;
    let details = store
        .order_details(caller.stored_id(given))
        .await
        .map_err(|e| ApiError::store(&e))?;
    match details {
        Some((order, steps, events)) if caller.owns(&order) => {
            Ok(axum::Json(order_view(&order, &steps, &events)))
        }
        _ => Err(ApiError::not_found(given)),
    }
}

/// The caller's order `given`, if it exists and is the caller's.
async fn owned(api: &Api, caller: &Caller, given: Uuid) -> Result<OrderRow, ApiError> {
    let store = api.ctx.store().map_err(|e| ApiError::internal(&e))?;
    match store.order(caller.stored_id(given)).await {
        Ok(Some(row)) if caller.owns(&row) => Ok(row),
        Ok(_) => Err(ApiError::not_found(given)),
        Err(e) => Err(ApiError::store(&e)),
    }
}

/// `POST /v1/orders/{id}/cancel`: the operator's cancel, recorded under
/// the caller ([`Caller::actor`]).
async fn cancel(
    State(api): State<Arc<Api>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let given = parse_id(&id)?;
    let row = owned(&api, &caller, given).await?;
    let actor = caller.actor();
    let outcome = api
        .intake
        .pipeline()
        .cancel(&actor, row.order_id)
        .await
        .map_err(|e| ApiError::store(&e))?;
    let state = operated(outcome, given, "not_allowed", "cancel")?;
    tracing::info!(order_id = %row.order_id, actor = %actor.name, state = %state, "order cancelled over HTTP");
    let body = Cancelled {
        order_id: given,
        state: state.as_str().to_owned(),
    };
    Ok((StatusCode::ACCEPTED, axum::Json(body)).into_response())
}

/// The state an action (`doing`, as in "cannot <doing> order …") left the
/// order `given` in, or its refusal: `409` with `error`, the reason and
/// the order's `state`; `404` for an order that is gone.
fn operated(
    outcome: Operated,
    given: Uuid,
    error: &'static str,
    doing: &str,
) -> Result<sas::state::ProcessState, ApiError> {
    match outcome {
        Operated::Done(state) => Ok(state),
        Operated::NotAllowed(state, why) => Err(ApiError {
            extra: Some(("state", Value::from(state.as_str()))),
            ..ApiError::new(
                StatusCode::CONFLICT,
                error,
                format!("cannot {doing} order {given}: it is {state} ({why})"),
            )
        }),
        Operated::NotFound => Err(ApiError::not_found(given)),
        Operated::PayloadRefused(why) => Err(ApiError::refused(&why)),
    }
}

/// `POST /v1/orders/{id}/signals/{name}`: the application's signal
/// (contract §4d, the same transition as `sasctl orders signal`), its data
/// the body (none: `{}`); `202`, or `409` with the reason when no step of
/// the order waits for it now (it is not kept).
async fn signal(
    State(api): State<Arc<Api>>,
    caller: Caller,
    Path((id, name)): Path<(String, String)>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let given = parse_id(&id)?;
    let body = read_body(body)?;
    let data: Value = if body.is_empty() {
        json!({})
    } else {
        serde_json::from_slice(&body).map_err(|_| {
            ApiError::bad_request("malformed_json", "the signal's data must be JSON")
        })?
    };
    // The one check of every way a signal comes in, before anything is read.
    if let Some(why) = signal_refusal(&name, &data) {
        return Err(ApiError::refused(&why));
    }
    let row = owned(&api, &caller, given).await?;
    let actor = caller.actor();
    let outcome = api
        .intake
        .pipeline()
        .signal(&actor, row.order_id, &name, &data)
        .await
        .map_err(|e| ApiError::store(&e))?;
    let shown = truncate_bytes(&name, 64);
    let state = operated(outcome, given, "not_waiting", &format!("signal {shown} to"))?;
    tracing::info!(order_id = %row.order_id, actor = %actor.name, signal = %shown, "signal applied over HTTP");
    let body = Signalled {
        order_id: given,
        signal: name,
        state: state.as_str().to_owned(),
    };
    Ok((StatusCode::ACCEPTED, axum::Json(body)).into_response())
}

/// `GET /v1/openapi.json`: needs no credentials.
async fn openapi_json(State(api): State<Arc<Api>>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        api.openapi.clone(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_endpoint_is_routed_on_its_method_and_path_once() {
        let mut seen = std::collections::BTreeSet::new();
        for e in Endpoint::ALL {
            assert!(seen.insert((e.path(), e.method().to_string())), "{e:?}");
            assert!(MethodFilter::try_from(e.method()).is_ok(), "{e:?}");
        }
        // Building the router panics on a malformed or doubled path.
        let _ = router();
    }

    #[test]
    fn content_types_and_idempotency_keys_are_read_strictly() {
        let with = |name: &'static str, value: &str| {
            let mut h = HeaderMap::new();
            h.insert(name, HeaderValue::from_str(value).unwrap());
            h
        };
        assert!(is_json(&with("content-type", "application/json")));
        assert!(is_json(&with(
            "content-type",
            "Application/JSON; charset=utf-8"
        )));
        assert!(!is_json(&with("content-type", "text/plain")));
        assert!(!is_json(&with("content-type", "application/jsonx")));
        assert!(!is_json(&HeaderMap::new()));

        let id = Uuid::new_v4();
        assert_eq!(idempotency_key(&HeaderMap::new()).unwrap(), None);
        assert_eq!(
            idempotency_key(&with("idempotency-key", &id.to_string())).unwrap(),
            Some(id)
        );
        assert!(idempotency_key(&with("idempotency-key", "abc")).is_err());
        let mut twice = with("idempotency-key", &id.to_string());
        twice.append("idempotency-key", HeaderValue::from_static("x"));
        assert!(idempotency_key(&twice).is_err());
    }

    #[test]
    fn a_bad_path_id_is_a_400_quoting_a_bounded_prefix() {
        let long = "x".repeat(10_000);
        let e = parse_id(&long).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.reason.len() < 200, "{}", e.reason);
        assert!(parse_id("../etc/passwd").is_err());
    }
}

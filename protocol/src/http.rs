//! The bodies of the HTTP API (contract §9a) beside [`crate::Order`] and
//! [`crate::StatusEvent`]: what the submission service answers, and what a
//! client reads.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::StatusEvent;

/// `{"order_id"}`: the answer to `POST /v1/orders`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schemars", schemars(title = "OrderAccepted"))]
pub struct OrderAccepted {
    /// The order's id (the one given, or the one generated).
    pub order_id: Uuid,
}

/// An order as `GET /v1/orders/{id}` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schemars", schemars(title = "OrderView"))]
pub struct OrderView {
    /// The order's id, as its application gave it.
    pub order_id: Uuid,
    /// Its workflow.
    pub workflow: String,
    /// Its state: `pending`, `processing`, `processed`, `error`,
    /// `compensating` or `compensated` (contract §3).
    pub state: String,
    /// The attempt running or coming: 1 + its failures.
    pub attempt: i32,
    /// Its steps, in the workflow's order.
    pub steps: Vec<StepView>,
    /// Its status events so far, in `seq` order (contract §2).
    pub events: Vec<StatusEvent>,
}

/// One step of an [`OrderView`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
pub struct StepView {
    /// The step's name.
    pub name: String,
    /// `not_started`, `running`, `completed`, `failed`, `compensating` or
    /// `compensated`.
    pub state: String,
    /// Its result once completed (the remote's answer), else null.
    pub result: Option<Value>,
}

/// `{"order_id", "state"}`: the answer to `POST /v1/orders/{id}/cancel`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schemars", schemars(title = "Cancelled"))]
pub struct Cancelled {
    /// The order's id.
    pub order_id: Uuid,
    /// Its state after the cancel (`compensating`, or `compensated` when
    /// nothing was left to undo).
    pub state: String,
}

/// `{"order_id", "signal", "state"}`: the answer to `POST
/// /v1/orders/{id}/signals/{name}` (contract §4d).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schemars", schemars(title = "Signalled"))]
pub struct Signalled {
    /// The order's id.
    pub order_id: Uuid,
    /// The signal's name.
    pub signal: String,
    /// The order's state after the signal (`processing`, or `processed`
    /// when the signal's step was its last).
    pub state: String,
}

/// The body of every refusal: `{"error", "reason"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schemars", schemars(rename = "Error", title = "Error"))]
pub struct Problem {
    /// A short code, stable across versions (`malformed_json`,
    /// `unknown_workflow`, `not_found`, `not_allowed`, `unauthenticated`, …).
    pub error: String,
    /// What was wrong, for a person.
    pub reason: String,
    /// With `409` of a cancel: the order's state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
}

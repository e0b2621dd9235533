//! Operator alerts (contract §5).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::rfc3339;

/// An alert on `<prefix>.alerts`: an order that needs an operator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schemars", schemars(title = "Alert"))]
pub struct Alert {
    /// The order.
    pub order_id: Uuid,
    /// Its workflow.
    pub workflow: String,
    /// The order's state when the alert was raised (e.g. `error`).
    pub state: String,
    /// Why an operator is needed.
    pub reason: String,
    /// The order's failures so far.
    pub failure_count: i32,
    /// When, in UTC.
    #[serde(with = "rfc3339")]
    #[cfg_attr(feature = "schemars", schemars(with = "DateTime<Utc>"))]
    pub at: DateTime<Utc>,
}

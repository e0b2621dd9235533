//! Status events on an application's private queue (contract §2).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;
use uuid::Uuid;

use crate::rfc3339;

/// The states this version of sas knows (contract §2, §2a, §4b, §8, §9).
/// Later versions add states: match with a wildcard arm, and read events
/// through [`State`], which keeps a state it does not know.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    Received,
    Rejected,
    Processing,
    StepSucceeded,
    /// A step's `when` was false: the order went on without it (contract §4d).
    StepSkipped,
    RetryScheduled,
    Processed,
    Compensating,
    Compensated,
    Failed,
    /// A running step has used a rung's fraction of its time (contract §8).
    DeadlineWarning,
    /// The order waits for its agent's breaker to close (contract §8).
    Held,
    /// A held order's step is dispatched again.
    Resumed,
    /// A long-running remote operation answered `202 Accepted` again: the
    /// step's complete-by moved forward (contract §4b).
    Heartbeat,
    /// An operator started an ended order again, maybe with a patched
    /// payload (contract §9).
    Redriven,
}

impl EventKind {
    /// Every state this version knows, in the order an order meets them.
    pub const ALL: [Self; 15] = [
        Self::Received,
        Self::Rejected,
        Self::Processing,
        Self::StepSucceeded,
        Self::StepSkipped,
        Self::RetryScheduled,
        Self::DeadlineWarning,
        Self::Heartbeat,
        Self::Held,
        Self::Resumed,
        Self::Compensating,
        Self::Processed,
        Self::Compensated,
        Self::Failed,
        Self::Redriven,
    ];

    /// The name on the wire and in the event log.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Received => "received",
            Self::Rejected => "rejected",
            Self::Processing => "processing",
            Self::StepSucceeded => "step_succeeded",
            Self::StepSkipped => "step_skipped",
            Self::RetryScheduled => "retry_scheduled",
            Self::Processed => "processed",
            Self::Compensating => "compensating",
            Self::Compensated => "compensated",
            Self::Failed => "failed",
            Self::DeadlineWarning => "deadline_warning",
            Self::Held => "held",
            Self::Resumed => "resumed",
            Self::Heartbeat => "heartbeat",
            Self::Redriven => "redriven",
        }
    }

    /// The state named `name`, if this version knows it.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == name)
    }

    /// Whether the event ends the order: every order ends with exactly one
    /// of these (an operator's retry or redrive starts it again).
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Processed | Self::Compensated | Self::Failed | Self::Rejected
        )
    }
}

impl std::fmt::Display for EventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is not one of [`EventKind::ALL`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownState(pub String);

impl std::fmt::Display for UnknownState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "unknown event state {:?}", self.0)
    }
}

impl std::error::Error for UnknownState {}

impl std::str::FromStr for EventKind {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s).ok_or_else(|| UnknownState(s.to_owned()))
    }
}

impl Serialize for EventKind {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for EventKind {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Self::parse(&name).ok_or_else(|| serde::de::Error::custom(UnknownState(name)))
    }
}

/// The `state` of a status event as read: a known [`EventKind`], or a state
/// of a later version, kept by name so no event is ever dropped for it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum State {
    /// A state this version knows.
    Known(EventKind),
    /// A state of a later version of sas; never terminal for this reader.
    Other(String),
}

impl State {
    /// The known state, if it is one.
    pub fn kind(&self) -> Option<EventKind> {
        match self {
            Self::Known(k) => Some(*k),
            Self::Other(_) => None,
        }
    }

    /// The name on the wire.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Known(k) => k.as_str(),
            Self::Other(name) => name,
        }
    }

    /// Whether the event ends the order. A state this version does not know
    /// is not terminal: every order still ends with one it knows.
    pub fn is_terminal(&self) -> bool {
        self.kind().is_some_and(EventKind::is_terminal)
    }
}

impl From<EventKind> for State {
    fn from(kind: EventKind) -> Self {
        Self::Known(kind)
    }
}

impl From<&str> for State {
    fn from(name: &str) -> Self {
        EventKind::parse(name).map_or_else(|| Self::Other(name.to_owned()), Self::Known)
    }
}

impl PartialEq<EventKind> for State {
    fn eq(&self, other: &EventKind) -> bool {
        self.kind() == Some(*other)
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for State {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for State {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Ok(Self::from(name.as_str()))
    }
}

#[cfg(feature = "schemars")]
impl schemars::JsonSchema for State {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "State".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let known: Vec<&str> = EventKind::ALL.iter().map(|k| k.as_str()).collect();
        schemars::json_schema!({
            "description": "The event's state: one of the known states, or a state of a later version (read it as unknown, never drop the event). Terminal: processed, compensated, failed, rejected.",
            "anyOf": [
                { "enum": known },
                { "type": "string" }
            ]
        })
    }
}

/// A status event on the application's private queue (contract §2).
/// Delivery is at least once, in `seq` order per order: dedupe on
/// (`order_id`, `seq`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schemars", schemars(title = "StatusEvent"))]
pub struct StatusEvent {
    /// The order's id; in a `rejected` event, the id as the message gave it
    /// (whatever its type), or null.
    pub order_id: Value,
    /// 1, 2, 3 … per order, in the order the transitions happened; 0 in a
    /// `rejected` event.
    pub seq: i64,
    /// What happened.
    pub state: State,
    /// The step, where the event is about one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
    /// The order's attempt (1 + its failures); in `retry_scheduled`, the coming one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<i32>,
    /// When, in UTC.
    #[serde(with = "rfc3339")]
    #[cfg_attr(feature = "schemars", schemars(with = "DateTime<Utc>"))]
    pub at: DateTime<Utc>,
    /// Error text, next attempt time, step or final result.
    #[serde(default)]
    pub detail: Value,
}

impl StatusEvent {
    /// The order's id, if the event carries one as a UUID (a `rejected`
    /// event may echo anything, or nothing).
    pub fn order_id(&self) -> Option<Uuid> {
        self.order_id.as_str().and_then(|s| Uuid::parse_str(s).ok())
    }

    /// Whether this event ends its order.
    pub fn is_terminal(&self) -> bool {
        self.state.is_terminal()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_known_state_is_named_once_and_reads_back() {
        let names: std::collections::HashSet<&str> =
            EventKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), EventKind::ALL.len());
        for kind in EventKind::ALL {
            let state: State = serde_json::from_value(json!(kind.as_str())).unwrap();
            assert_eq!(state, kind);
            assert_eq!(serde_json::to_value(kind).unwrap(), json!(kind.as_str()));
        }
    }

    #[test]
    fn a_state_of_a_later_version_is_kept_by_name_and_is_not_terminal() {
        let event: StatusEvent = serde_json::from_value(json!({
            "order_id": "0192a0c0-0000-7000-8000-000000000001", "seq": 4,
            "state": "step_paused", "step": "ship", "at": "2026-11-27T10:00:00Z",
            "detail": {"why": "when was false"}, "later_field": true
        }))
        .unwrap();
        assert_eq!(event.state, State::Other("step_paused".into()));
        assert!(!event.is_terminal());
        let again = serde_json::to_value(&event).unwrap();
        assert_eq!(again["state"], "step_paused");
        assert_eq!(
            event.order_id(),
            Some(Uuid::from_u128(0x0192a0c0_0000_7000_8000_000000000001))
        );
    }

    #[test]
    fn a_rejected_event_may_carry_any_id_or_none() {
        let event: StatusEvent = serde_json::from_value(json!({
            "order_id": 42, "seq": 0, "state": "rejected", "at": "2026-11-27T10:00:00+02:00"
        }))
        .unwrap();
        assert_eq!(event.order_id(), None);
        assert!(event.is_terminal());
        assert_eq!(event.detail, Value::Null);
    }
}

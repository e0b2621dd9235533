//! An order as an application submits it (contract §1).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};
use uuid::Uuid;

use crate::rfc3339;

/// The body published to `<prefix>.orders`, or posted to `POST /v1/orders`
/// (contract §1). Fields at their default are left out when written; fields
/// this version does not know are ignored when read, as the server does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schemars", schemars(title = "Order"))]
pub struct Order {
    /// The order's identity and idempotency key. Absent: the AMQP
    /// `message_id` when it is a UUID, else one is generated and reported
    /// in the `received` event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order_id: Option<Uuid>,
    /// The name of a configured workflow.
    pub workflow: String,
    /// Business data handed to every step (may be `{}`).
    pub payload: Map<String, Value>,
    /// The application's private status queue; overrides the AMQP
    /// `reply_to` property. Never a queue under `<prefix>.` or `amq.`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schemars", schemars(length(min = 1, max = 255)))]
    pub reply_to: Option<String>,
    /// 0 (default) to 9; higher is claimed first.
    #[serde(
        default,
        skip_serializing_if = "Priority::is_default",
        deserialize_with = "null_is_default"
    )]
    #[cfg_attr(feature = "schemars", schemars(with = "Option<Priority>"))]
    pub priority: Priority,
    /// Do not start before this time.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "rfc3339::option"
    )]
    #[cfg_attr(feature = "schemars", schemars(with = "Option<DateTime<Utc>>"))]
    pub not_before: Option<DateTime<Utc>>,
    /// Which status events are published (contract §2a).
    #[serde(
        default,
        skip_serializing_if = "Events::is_all",
        deserialize_with = "null_is_default"
    )]
    #[cfg_attr(feature = "schemars", schemars(with = "Option<Events>"))]
    pub events: Events,
}

/// A field given as null reads as its default, as the server reads it.
fn null_is_default<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(
    d: D,
) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

impl Order {
    /// An order of `workflow` with `payload`; every optional field unset.
    pub fn new(workflow: impl Into<String>, payload: Map<String, Value>) -> Self {
        Self {
            order_id: None,
            workflow: workflow.into(),
            payload,
            reply_to: None,
            priority: Priority::default(),
            not_before: None,
            events: Events::All,
        }
    }

    /// An order whose payload is `payload` serialized; `None` unless that
    /// is a JSON object (a payload is always one).
    pub fn from_payload<T: Serialize + ?Sized>(
        workflow: impl Into<String>,
        payload: &T,
    ) -> Option<Self> {
        match serde_json::to_value(payload).ok()? {
            Value::Object(map) => Some(Self::new(workflow, map)),
            _ => None,
        }
    }
}

/// An order's priority, 0 (default) to 9; higher is claimed first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Priority(u8);

impl Priority {
    /// The highest priority.
    pub const MAX: u8 = 9;

    /// The priority, if `n` is in 0..=9.
    pub fn new(n: i64) -> Option<Self> {
        u8::try_from(n).ok().filter(|n| *n <= Self::MAX).map(Self)
    }

    /// The value, 0 to 9.
    pub fn get(self) -> u8 {
        self.0
    }

    fn is_default(&self) -> bool {
        self.0 == 0
    }
}

impl Serialize for Priority {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(self.0)
    }
}

impl<'de> Deserialize<'de> for Priority {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = i64::deserialize(d)?;
        Self::new(n).ok_or_else(|| serde::de::Error::custom("a priority is an integer from 0 to 9"))
    }
}

#[cfg(feature = "schemars")]
impl schemars::JsonSchema for Priority {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Priority".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "0 (default) to 9; higher is claimed first.",
            "type": "integer",
            "minimum": 0,
            "maximum": Self::MAX,
        })
    }
}

/// Which of an order's status events are published (contract §2a); the
/// event log keeps them all, for a replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Events {
    /// Every transition (contract §2).
    #[default]
    All,
    /// Only the terminal event, with its `seq` in the full history.
    Terminal,
}

impl Events {
    /// The name in an order's body.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::All => "all",
            Self::Terminal => "terminal",
        }
    }

    /// Whether an event of `kind` is published.
    pub fn publishes(self, kind: crate::EventKind) -> bool {
        self == Self::All || kind.is_terminal()
    }

    fn is_all(&self) -> bool {
        *self == Self::All
    }
}

impl TryFrom<String> for Events {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        match s.as_str() {
            "all" => Ok(Self::All),
            "terminal" => Ok(Self::Terminal),
            _ => Err(format!("unknown events setting {s:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fields_at_their_default_are_left_out() {
        let order = Order::new("w", Map::new());
        assert_eq!(
            serde_json::to_value(&order).unwrap(),
            json!({"workflow": "w", "payload": {}})
        );
    }

    #[test]
    fn every_field_round_trips() {
        let at = rfc3339::parse("2030-01-01T00:00:00.000001Z").unwrap();
        let order = Order {
            order_id: Some(Uuid::from_u128(7)),
            reply_to: Some("shop.status".into()),
            priority: Priority::new(9).unwrap(),
            not_before: Some(at),
            events: Events::Terminal,
            ..Order::from_payload("w", &json!({"a": [1, 2]})).unwrap()
        };
        let text = serde_json::to_string(&order).unwrap();
        assert_eq!(serde_json::from_str::<Order>(&text).unwrap(), order);
        assert!(
            text.contains(r#""not_before":"2030-01-01T00:00:00.000001Z""#),
            "{text}"
        );
    }

    #[test]
    fn a_priority_out_of_range_or_a_payload_not_an_object_is_refused() {
        for bad in [
            json!({"workflow": "w", "payload": {}, "priority": 10}),
            json!({"workflow": "w", "payload": {}, "priority": -1}),
            json!({"workflow": "w", "payload": []}),
        ] {
            assert!(
                serde_json::from_value::<Order>(bad.clone()).is_err(),
                "{bad}"
            );
        }
        assert!(Order::from_payload("w", &[1, 2]).is_none());
    }

    #[test]
    fn unknown_fields_are_ignored_as_the_server_ignores_them() {
        let o: Order =
            serde_json::from_value(json!({"workflow": "w", "payload": {}, "extra": 1})).unwrap();
        assert_eq!(o, Order::new("w", Map::new()));
    }
}

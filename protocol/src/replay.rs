//! A request to publish stored status events again (contract §9).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::rfc3339;

/// The body published to `<prefix>.replay`, with the AMQP `reply_to` naming
/// where the events go (by default the order's own status queue). The
/// server reads it strictly: a field of neither form is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schemars", schemars(title = "ReplayRequest"))]
#[serde(untagged, deny_unknown_fields)]
pub enum ReplayRequest {
    /// One order's events from `from_seq` on.
    Order {
        /// The order.
        order_id: Uuid,
        /// The first `seq` to publish again (default 1).
        #[serde(default = "first_seq")]
        #[cfg_attr(feature = "schemars", schemars(range(min = 0)))]
        from_seq: i32,
    },
    /// The events at or after `since` of every order whose status queue is
    /// `reply_to`.
    Queue {
        /// The status queue whose orders' events are wanted.
        #[cfg_attr(feature = "schemars", schemars(length(min = 1, max = 255)))]
        reply_to: String,
        /// The earliest event time wanted.
        #[serde(with = "rfc3339")]
        #[cfg_attr(feature = "schemars", schemars(with = "DateTime<Utc>"))]
        since: DateTime<Utc>,
    },
}

fn first_seq() -> i32 {
    1
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn both_forms_round_trip_and_a_stranger_field_is_refused() {
        let one = ReplayRequest::Order {
            order_id: Uuid::from_u128(1),
            from_seq: 3,
        };
        let v = serde_json::to_value(&one).unwrap();
        assert_eq!(
            v,
            json!({"order_id": Uuid::from_u128(1).to_string(), "from_seq": 3})
        );
        assert_eq!(serde_json::from_value::<ReplayRequest>(v).unwrap(), one);
        let since = rfc3339::parse("2026-01-01T00:00:00Z").unwrap();
        let queue = ReplayRequest::Queue {
            reply_to: "shop.status".into(),
            since,
        };
        let v = serde_json::to_value(&queue).unwrap();
        assert_eq!(
            v,
            json!({"reply_to": "shop.status", "since": "2026-01-01T00:00:00.000000Z"})
        );
        assert_eq!(serde_json::from_value::<ReplayRequest>(v).unwrap(), queue);
        let stranger = json!({"order_id": Uuid::from_u128(1).to_string(), "seq": 2});
        assert!(serde_json::from_value::<ReplayRequest>(stranger).is_err());
    }
}

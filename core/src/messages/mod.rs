//! Wire types, one per queue, with their encoding (contract §1, §2, §4,
//! §5); what sas accepts of them is [`validation`]'s, re-exported here.
//! No I/O.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use uuid::Uuid;

pub use sas_protocol::limits::{
    MAX_JSON_DEPTH, MAX_JSON_NUMBER, MAX_NAME_BYTES, is_queue_name, json_limit_broken,
    truncate_bytes,
};
pub use sas_protocol::{
    Alert, EventKind, Events, Order, Priority, ReplayRequest, State, StatusEvent, rfc3339,
};

pub mod validation;
use validation::replace_nul_in;
pub use validation::*;

/// The `rejected` event for a message that was not accepted (`seq` 0).
pub fn rejected_event(
    hints: &RejectedHints,
    reason: &RejectReason,
    at: DateTime<Utc>,
) -> StatusEvent {
    StatusEvent {
        order_id: hints.order_id.clone().unwrap_or(Value::Null),
        seq: 0,
        state: EventKind::Rejected.into(),
        step: None,
        attempt: None,
        at,
        detail: serde_json::json!({ "error": reason.to_string() }),
    }
}

/// The status event of a logged transition of `order_id` (contract §2):
/// what the outbox publishes when the transition commits, and what a
/// replay (§9) publishes again from the event log, field for field.
pub fn logged_event(
    order_id: Uuid,
    seq: i32,
    state: EventKind,
    step: Option<String>,
    attempt: i32,
    at: DateTime<Utc>,
    detail: Value,
) -> StatusEvent {
    StatusEvent {
        order_id: Value::String(order_id.to_string()),
        seq: i64::from(seq),
        state: state.into(),
        step,
        attempt: Some(attempt),
        at,
        detail,
    }
}

/// A signal for an order's `signal` step (contract §4d), as applications
/// send it to `<prefix>.signals`.
#[derive(Debug, Clone, PartialEq)]
pub struct SignalMessage {
    /// The order, by the id its sender gave it.
    pub order_id: Uuid,
    /// The signal's name.
    pub signal: String,
    /// The step's result to be (`{}` when absent).
    pub data: Value,
}

/// Whether a step request runs the step or undoes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    Forward,
    Compensate,
}

/// A request from a scheduler to an agent, on `<prefix>.agent.<agent>.requests`.
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schemars", schemars(title = "StepRequest"))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRequest {
    pub order_id: Uuid,
    pub workflow: String,
    pub step: String,
    pub step_index: i32,
    pub direction: Direction,
    /// The order's attempt (1 + failure count).
    pub attempt: i32,
    /// Fences the reply: only the step's current dispatch may change it.
    pub dispatch_id: Uuid,
    /// The scheduler instance holding the order when this was dispatched.
    pub locked_by: String,
    /// After this the agent stops and sends nothing back.
    #[serde(with = "rfc3339")]
    #[cfg_attr(feature = "schemars", schemars(with = "DateTime<Utc>"))]
    pub complete_by: DateTime<Utc>,
    pub payload: Value,
    /// Earlier steps' results, by step name.
    pub results: Map<String, Value>,
    /// The `X-Sas-Fencing-Token` of this dispatch's calls (contract §8): the
    /// step's dispatch count, the same on every retry within this dispatch
    /// and greater on every later dispatch of the step (re-attempts,
    /// operator retries and its undo included), so a remote can refuse a
    /// call older than the newest it has seen. 0 in a request that carries
    /// none (from an older scheduler).
    #[serde(default)]
    pub fencing_token: i64,
    /// The step's timeout (contract §4b): each `202 Accepted` of a
    /// long-running operation moves complete-by to now plus this. Absent
    /// (an older scheduler): a `202` moves nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<i64>,
    /// How far a `202` may move complete-by: the step's first dispatch plus
    /// its `max_duration`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_complete_by: Option<DateTime<Utc>>,
    /// The time left at dispatch, in milliseconds (§6a): the agent counts it
    /// on its own monotonic clock from the request's arrival, since its
    /// wall clock may disagree with the state store's, whose time
    /// `complete_by` is. Absent (an older scheduler): the agent compares
    /// `complete_by` with its wall clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_left_ms: Option<i64>,
    /// The order's redrive (contract §9): N after an operator's N-th
    /// redrive, which the idempotency key carries; 0 (and absent, from an
    /// older scheduler) before any.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub redrive: i32,
    /// An undo of a step in doubt (contract §4c): dispatched, and no answer
    /// decided whether its remote applied it. The agent says so in
    /// [`OUTCOME_HEADER`]: `unknown` (else `completed`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_doubt: bool,
    /// The step's own `retry` (contract §4b) as the order's definition
    /// says (§4d), which the agent follows over its own settings (`{}`:
    /// the step sets none). Absent in an undo, and for an order stored
    /// before definitions were kept (or from an older scheduler): the agent
    /// reads the step's `retry` from its configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schemars", schemars(with = "Option<Value>"))]
    pub retry: Option<crate::spec::RetrySpec>,
    /// For an item of a `for_each` step (§4d): the item, sent to the
    /// remote as `item`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub item: Option<Value>,
    /// For an item of a `for_each` step: its index in the list, sent to
    /// the remote as `index`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
}

fn is_zero(n: &i32) -> bool {
    *n == 0
}

/// The header that carries [`StepRequest::fencing_token`] to the remote.
pub const FENCING_TOKEN_HEADER: &str = "X-Sas-Fencing-Token";

/// The header of a compensating call that says what sas knows of the
/// forward step it undoes (contract §4c): [`StepRequest::outcome`].
pub const OUTCOME_HEADER: &str = "X-Sas-Outcome";

impl StepRequest {
    /// The `Idempotency-Key` of this call: the same on every retry and
    /// re-attempt; after an operator's N-th redrive (contract §9) it ends
    /// in `:r<N>`, so a remote that remembers answers by key does the step
    /// (or its undo) again instead of replaying an old failure.
    pub fn idempotency_key(&self) -> String {
        let (id, step, n) = (self.order_id, &self.step, self.redrive);
        match (self.direction, n) {
            (Direction::Forward, 0) => format!("{id}:{step}"),
            (Direction::Forward, _) => format!("{id}:{step}:r{n}"),
            (Direction::Compensate, 0) => format!("{id}:{step}:compensate"),
            (Direction::Compensate, _) => format!("{id}:{step}:compensate:r{n}"),
        }
    }

    /// The [`OUTCOME_HEADER`] of this call: `unknown` or `completed` for an
    /// undo, `None` for a forward call.
    pub fn outcome(&self) -> Option<&'static str> {
        match (self.direction, self.in_doubt) {
            (Direction::Forward, _) => None,
            (Direction::Compensate, true) => Some("unknown"),
            (Direction::Compensate, false) => Some("completed"),
        }
    }

    /// The HTTP body sent to the remote service (contract §4).
    pub fn remote_body(&self) -> Value {
        let mut body = serde_json::json!({
            "order_id": self.order_id,
            "step": self.step,
            "attempt": self.attempt,
            "payload": self.payload,
            "results": self.results,
        });
        // An item of a `for_each` step (§4d) says which.
        if let (Some(item), Some(index)) = (&self.item, self.index) {
            body["item"] = item.clone();
            body["index"] = Value::from(index);
        }
        body
    }
}

/// How a step ended at the agent.
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum StepOutcome {
    /// The remote answered 2xx; its JSON body (or null).
    Succeeded { result: Value },
    /// The remote answered a permanent error: no retry will help.
    Failed { error: String },
    /// Not sent: the agent's breaker is open (contract §8). The order is
    /// held, and no failure counts. The step is in doubt all the same
    /// (contract §4c): another copy of the request may have been sent.
    /// `tried`, for the logs: this very request may have reached the remote
    /// (the breaker opened on its own transient failures, or it came again
    /// after an agent died with it). Absent (an older agent): false.
    Held {
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        tried: bool,
    },
    /// Not an end: the remote answered `202 Accepted` with `location` to
    /// poll, and the agent polls on until `complete_by`, the step's new
    /// deadline (contract §4b), which this heartbeat asks to store.
    Accepted {
        #[serde(with = "rfc3339")]
        #[cfg_attr(feature = "schemars", schemars(with = "DateTime<Utc>"))]
        complete_by: DateTime<Utc>,
        location: String,
    },
}

impl StepOutcome {
    /// Replaces every NUL character (`\u0000`, which Postgres cannot store)
    /// in the result's keys and strings, or in the error, with U+FFFD.
    /// Returns whether there was any: a remote's answer is stored as it came
    /// but for those.
    pub fn replace_nul(&mut self) -> bool {
        match self {
            Self::Succeeded { result } => replace_nul(result),
            Self::Failed { error } => replace_nul_in(error),
            Self::Held { .. } => false,
            Self::Accepted { location, .. } => replace_nul_in(location),
        }
    }
}

/// An agent's answer to a [`StepRequest`], on the scheduler's reply queue:
/// alone, or in a pack with others ([`decode_replies`]).
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schemars", schemars(title = "StepReply"))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepReply {
    pub order_id: Uuid,
    pub step: String,
    pub step_index: i32,
    pub direction: Direction,
    pub attempt: i32,
    pub dispatch_id: Uuid,
    pub locked_by: String,
    /// The W3C trace context this reply continues. In the body because a
    /// pack's replies each continue their own request's trace; a reply sent
    /// alone carries it in the AMQP header too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    #[serde(flatten)]
    pub outcome: StepOutcome,
}

/// Most bytes of JSON an agent puts in one message of replies; a reply
/// larger than this alone goes alone.
pub const MAX_PACK_BYTES: usize = 128 * 1024;

/// Most replies in one pack: an agent's packs hold at most
/// [`MAX_PACK_BYTES`], and a reply takes more than 200 bytes, so a pack of
/// more was not sent by an agent (contract §1b: a pack's count is bounded).
pub const MAX_PACK_REPLIES: usize = 1024;

/// The largest message of replies an agent sends when its remotes' answers
/// are at most `max_response_bytes`: the answer as JSON text, each byte
/// escaped at worst (`\u00XX`), and room for the rest of the reply. A
/// larger one is a stranger's, refused before it is read.
pub fn max_reply_message_bytes(max_response_bytes: usize) -> usize {
    max_response_bytes
        .saturating_mul(6)
        .saturating_add(64 * 1024)
        .max(MAX_PACK_BYTES)
}

/// A reply of a message of the reply queue, or why it could not be read.
pub type ReadReply = Result<StepReply, serde_json::Error>;

/// Reads a message of the reply queue: one reply (a JSON object), or a
/// pack of replies an agent had ready together (a JSON array, never
/// empty). Each reply of a pack is read on its own, so that one that
/// cannot be read does not keep the others from their orders; the message
/// is unreadable as a whole only when it is not one of these two shapes,
/// or is a pack larger than an agent makes ([`MAX_PACK_BYTES`],
/// [`MAX_PACK_REPLIES`]): a stranger's pack of 100,000 replies must not
/// hold the scheduler's memory.
pub fn decode_replies(body: &[u8]) -> Result<Vec<ReadReply>, serde_json::Error> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first == Some(&b'[') {
        if body.len() > MAX_PACK_BYTES {
            return Err(serde::de::Error::custom(format!(
                "a pack of {} bytes: agents pack at most {MAX_PACK_BYTES}",
                body.len()
            )));
        }
        let pack: Vec<&serde_json::value::RawValue> = serde_json::from_slice(body)?;
        if pack.is_empty() {
            return Err(serde::de::Error::invalid_length(0, &"at least one reply"));
        }
        if pack.len() > MAX_PACK_REPLIES {
            return Err(serde::de::Error::invalid_length(
                pack.len(),
                &"at most 1024 replies in a pack",
            ));
        }
        Ok(pack
            .into_iter()
            .map(|one| serde_json::from_str(one.get()))
            .collect())
    } else {
        serde_json::from_slice(body).map(|one| vec![Ok(one)])
    }
}

/// Encodes replies into message bodies for [`decode_replies`]: each body
/// with the range of `replies` it carries. One reply goes as an object;
/// several as arrays of at most [`MAX_PACK_BYTES`] (a larger reply alone).
pub fn encode_replies<R: std::borrow::Borrow<StepReply>>(
    replies: &[R],
) -> Vec<(Vec<u8>, std::ops::Range<usize>)> {
    let encoded: Vec<Vec<u8>> = replies
        .iter()
        .map(|r| serde_json::to_vec(r.borrow()).unwrap_or_default())
        .collect();
    let mut bodies = Vec::new();
    let mut start = 0;
    while start < encoded.len() {
        let mut end = start + 1;
        let mut bytes = encoded[start].len() + 2;
        while end < encoded.len() && bytes + encoded[end].len() < MAX_PACK_BYTES {
            bytes += encoded[end].len() + 1;
            end += 1;
        }
        let body = if end - start == 1 {
            encoded[start].clone()
        } else {
            let mut body = Vec::with_capacity(bytes);
            body.push(b'[');
            for (i, one) in encoded[start..end].iter().enumerate() {
                if i > 0 {
                    body.push(b',');
                }
                body.extend_from_slice(one);
            }
            body.push(b']');
            body
        };
        bodies.push((body, start..end));
        start = end;
    }
    bodies
}

impl StepReply {
    /// The reply to `request` with that outcome.
    pub fn to(request: &StepRequest, outcome: StepOutcome) -> Self {
        Self {
            order_id: request.order_id,
            step: request.step.clone(),
            step_index: request.step_index,
            direction: request.direction,
            attempt: request.attempt,
            dispatch_id: request.dispatch_id,
            locked_by: request.locked_by.clone(),
            traceparent: None,
            outcome,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::QueueNames;

    /// The queues of the deployment the tests' messages come to.
    fn names() -> QueueNames {
        QueueNames::new("sas")
    }

    fn decode(body: &str) -> Result<Submission, RejectReason> {
        decode_submission(body.as_bytes(), None, 1024, &names()).map_err(|(r, _)| r)
    }

    #[test]
    fn a_signal_decodes_strictly_and_any_other_body_says_why() {
        let id = Uuid::new_v4();
        let ok = decode_signal(
            format!(r#"{{"order_id":"{id}","signal":"approval","data":{{"by":"ann"}}}}"#)
                .as_bytes(),
            1024,
        )
        .expect("a signal");
        assert_eq!((ok.order_id, ok.signal.as_str()), (id, "approval"));
        assert_eq!(ok.data, serde_json::json!({ "by": "ann" }));
        let bare = decode_signal(
            format!(r#"{{"order_id":"{id}","signal":"s"}}"#).as_bytes(),
            1024,
        );
        assert_eq!(bare.expect("no data").data, serde_json::json!({}));
        let long = "s".repeat(MAX_SIGNAL_NAME_BYTES + 1);
        for (body, label) in [
            (String::new(), "malformed_json"),
            ("[]".into(), "not_an_object"),
            (r#"{"signal":"s"}"#.into(), "missing_field"),
            (format!(r#"{{"order_id":"{id}"}}"#), "missing_field"),
            (format!(r#"{{"order_id":"{id}","signal":1}}"#), "wrong_type"),
            (
                format!(r#"{{"order_id":"{id}","signal":""}}"#),
                "wrong_type",
            ),
            (
                format!(r#"{{"order_id":"{id}","signal":"{long}"}}"#),
                "wrong_type",
            ),
            (r#"{"order_id":"x","signal":"s"}"#.into(), "wrong_type"),
            (
                format!(r#"{{"order_id":"{id}","signal":"s","x":1}}"#),
                "unknown_field",
            ),
            // A name that would forge a log line; data Postgres cannot store.
            (
                format!(r#"{{"order_id":"{id}","signal":"s\nINFO forged"}}"#),
                "wrong_type",
            ),
            (
                format!(r#"{{"order_id":"{id}","signal":"s","data":{{"a":"x\u0000"}}}}"#),
                "wrong_type",
            ),
            (
                format!(r#"{{"order_id":"{id}","signal":"s","data":"\u0000"}}"#),
                "wrong_type",
            ),
            (
                format!(r#"{{"order_id":"{id}","signal":"s","data":[1e308]}}"#),
                "wrong_type",
            ),
            ("x".repeat(2000), "too_large"),
        ] {
            let got = decode_signal(body.as_bytes(), 1024).expect_err("refused");
            assert_eq!(got.label(), label, "{body:.60}: {got}");
        }
        assert_eq!(
            decode_signal(b"\xff", 1024).unwrap_err().label(),
            "not_utf8"
        );
    }

    #[test]
    fn a_minimal_order_decodes() {
        let s = decode(r#"{"workflow":"order","payload":{}}"#).unwrap();
        assert_eq!(s.workflow, "order");
        assert_eq!(s.priority.get(), 0);
        assert!(s.order_id.is_none());
    }

    #[test]
    fn every_field_decodes() {
        let id = Uuid::new_v4();
        let s = decode(&format!(
            r#"{{"order_id":"{id}","workflow":"w","payload":{{"a":1}},"reply_to":"q","priority":7,"not_before":"2030-01-01T00:00:00+01:00","extra":true}}"#
        ))
        .unwrap();
        assert_eq!(s.order_id, Some(id));
        assert_eq!(s.reply_to.as_deref(), Some("q"));
        assert_eq!(s.priority.get(), 7);
        assert_eq!(
            s.not_before.unwrap().to_rfc3339(),
            "2029-12-31T23:00:00+00:00"
        );
    }

    #[test]
    fn events_is_all_by_default_terminal_when_asked_and_nothing_else() {
        assert_eq!(
            decode(r#"{"workflow":"w","payload":{}}"#).unwrap().events,
            Events::All
        );
        for (body, events) in [
            (
                r#"{"workflow":"w","payload":{},"events":null}"#,
                Events::All,
            ),
            (
                r#"{"workflow":"w","payload":{},"events":"all"}"#,
                Events::All,
            ),
            (
                r#"{"workflow":"w","payload":{},"events":"terminal"}"#,
                Events::Terminal,
            ),
        ] {
            let s = decode(body).unwrap();
            assert_eq!(s.events, events, "{body}");
            // What an application would publish reads back the same.
            let again = serde_json::to_vec(&s).unwrap();
            assert_eq!(decode_submission(&again, None, 1024, &names()).unwrap(), s);
        }
        for body in [
            r#"{"workflow":"w","payload":{},"events":"some"}"#,
            r#"{"workflow":"w","payload":{},"events":"TERMINAL"}"#,
            r#"{"workflow":"w","payload":{},"events":true}"#,
        ] {
            let reason = decode(body).unwrap_err();
            assert_eq!(reason.label(), "wrong_type", "{body}");
            assert!(reason.to_string().contains("events"), "{reason}");
        }
    }

    #[test]
    fn terminal_events_publish_only_the_end() {
        for kind in [
            EventKind::Processed,
            EventKind::Compensated,
            EventKind::Failed,
            EventKind::Rejected,
        ] {
            assert!(Events::Terminal.publishes(kind));
            assert!(Events::All.publishes(kind));
        }
        for kind in [
            EventKind::Received,
            EventKind::Processing,
            EventKind::StepSucceeded,
            EventKind::Compensating,
            EventKind::Redriven,
        ] {
            assert!(!Events::Terminal.publishes(kind));
            assert!(Events::All.publishes(kind));
        }
    }

    #[test]
    fn nul_characters_in_an_outcome_are_replaced() {
        let mut ok = StepOutcome::Succeeded {
            result: serde_json::json!({ "a\u{0}": ["x\u{0}y", 1, { "b": "\u{0}" }], "c": "clean" }),
        };
        assert!(ok.replace_nul());
        assert_eq!(
            ok,
            StepOutcome::Succeeded {
                result: serde_json::json!({ "a\u{FFFD}": ["x\u{FFFD}y", 1, { "b": "\u{FFFD}" }], "c": "clean" }),
            }
        );
        assert!(!ok.replace_nul(), "nothing left");
        let mut failed = StepOutcome::Failed {
            error: "HTTP 400: \u{0}".into(),
        };
        assert!(failed.replace_nul());
        assert_eq!(
            failed,
            StepOutcome::Failed {
                error: "HTTP 400: \u{FFFD}".into()
            }
        );
    }

    #[test]
    fn nul_characters_which_postgres_cannot_store_are_refused() {
        for body in [
            r#"{"workflow":"w","payload":{"a":"x\u0000"}}"#,
            r#"{"workflow":"w","payload":{"a\u0000":1}}"#,
            r#"{"workflow":"w","payload":{"a":[{"b":["\u0000"]}]}}"#,
        ] {
            let reason = decode(body).unwrap_err();
            assert_eq!(reason.label(), "wrong_type", "{body}");
            assert!(reason.to_string().contains("NUL"), "{reason}");
        }
        assert_eq!(
            decode(r#"{"workflow":"w","payload":{},"reply_to":"q\u0000"}"#)
                .unwrap_err()
                .label(),
            "wrong_type"
        );
        let property = decode_submission(
            br#"{"workflow":"w","payload":{}}"#,
            Some("q\0"),
            1024,
            &names(),
        )
        .unwrap();
        assert_eq!(
            property.reply_to, None,
            "a reply_to property with NUL is ignored"
        );
    }

    #[test]
    fn bad_bodies_get_precise_reasons() {
        assert!(matches!(
            decode("{nope"),
            Err(RejectReason::MalformedJson(_))
        ));
        assert_eq!(decode("[1]"), Err(RejectReason::NotAnObject));
        assert_eq!(
            decode(r#"{"payload":{}}"#),
            Err(RejectReason::MissingField("workflow"))
        );
        assert_eq!(
            decode(r#"{"workflow":"w"}"#),
            Err(RejectReason::MissingField("payload"))
        );
        assert_eq!(
            decode(r#"{"workflow":"w","payload":{},"priority":"high"}"#)
                .unwrap_err()
                .label(),
            "wrong_type"
        );
        assert_eq!(
            decode(r#"{"workflow":"w","payload":{},"priority":10}"#)
                .unwrap_err()
                .label(),
            "wrong_type"
        );
        assert_eq!(
            decode(r#"{"order_id":"x","workflow":"w","payload":{}}"#)
                .unwrap_err()
                .label(),
            "wrong_type"
        );
        assert_eq!(
            decode(r#"{"workflow":5,"payload":{}}"#)
                .unwrap_err()
                .label(),
            "wrong_type"
        );
        assert_eq!(
            decode_submission(&[0xff, 0xfe], None, 10, &names())
                .unwrap_err()
                .0,
            RejectReason::NotUtf8
        );
        assert!(matches!(
            decode_submission(&[b' '; 11], None, 10, &names())
                .unwrap_err()
                .0,
            RejectReason::TooLarge {
                size: 11,
                limit: 10
            }
        ));
    }

    #[test]
    fn names_and_times_beyond_what_can_be_stored_or_routed_are_refused() {
        let long = "q".repeat(256);
        for body in [
            format!(r#"{{"workflow":"w","payload":{{}},"reply_to":"{long}"}}"#),
            format!(r#"{{"workflow":"{long}","payload":{{}}}}"#),
            r#"{"workflow":"w\u0007","payload":{}}"#.to_owned(),
            r#"{"workflow":"w","payload":{},"reply_to":"a\nb"}"#.to_owned(),
            r#"{"workflow":"w","payload":{},"not_before":"9999-12-31T23:59:59-01:00"}"#.to_owned(),
            r#"{"workflow":"w","payload":{},"not_before":"0000-12-31T23:59:59Z"}"#.to_owned(),
            r#"{"workflow":"w","payload":{},"not_before":"2030-02-30T00:00:00Z"}"#.to_owned(),
        ] {
            let (reason, hints) =
                decode_submission(body.as_bytes(), None, 4096, &names()).unwrap_err();
            assert_eq!(reason.label(), "wrong_type", "{body}");
            assert!(
                hints.reply_to.as_ref().is_none_or(|q| is_queue_name(q)),
                "{body}"
            );
        }
        let edge = format!(
            r#"{{"workflow":"w","payload":{{}},"reply_to":"{}"}}"#,
            "q".repeat(255)
        );
        assert!(
            decode_submission(edge.as_bytes(), None, 4096, &names()).is_ok(),
            "255 bytes is a name"
        );
        // An unusable reply queue or order id in a rejected body is not echoed.
        let (_, hints) = decode_submission(
            format!(r#"{{"order_id":{{"deep":[1,2]}},"payload":1,"reply_to":"{long}"}}"#)
                .as_bytes(),
            Some("prop"),
            4096,
            &names(),
        )
        .unwrap_err();
        assert_eq!(hints.reply_to.as_deref(), Some("prop"));
        assert_eq!(hints.order_id, None);
    }

    #[test]
    fn payloads_too_deep_or_with_numbers_postgres_cannot_give_back_are_refused() {
        let deep = |n: usize| {
            format!(
                r#"{{"workflow":"w","payload":{{"d":{}1{}}}}}"#,
                "[".repeat(n),
                "]".repeat(n)
            )
        };
        assert!(decode(&deep(63)).is_ok());
        assert!(
            decode(&deep(64))
                .unwrap_err()
                .to_string()
                .contains("64 levels")
        );
        let big = r#"{"workflow":"w","payload":{"m":1.7976931348623157e308}}"#;
        assert!(decode(big).unwrap_err().to_string().contains("1e300"));
        assert!(
            decode(
                r#"{"workflow":"w","payload":{"m":-1e300,"i":-9223372036854775808,"t":5e-324}}"#
            )
            .is_ok()
        );
        assert_eq!(json_limit_broken(&serde_json::json!([[1]])), None);
    }

    #[test]
    fn reasons_quote_only_a_short_prefix() {
        let name = "x".repeat(200_000);
        let reason = RejectReason::UnknownWorkflow(Quoted::new(&name));
        let text = reason.to_string();
        assert!(text.len() < MAX_REASON_BYTES, "{} bytes", text.len());
        assert!(text.contains("first 64 of 200000 characters"), "{text}");
        let controls = Quoted::new("a\u{1b}[31m\0b").to_string();
        assert!(!controls.chars().any(char::is_control), "{controls}");
        assert_eq!(truncate_bytes("héllo", 2), "h");
    }

    #[test]
    fn whatever_decodes_can_be_stored_and_routed() {
        use proptest::prelude::*;
        use proptest::test_runner::{Config, TestRunner};
        // Bodies built from hostile pieces: long and empty names, control
        // characters and NUL, lone surrogates, deep nesting, odd numbers
        // and times.
        let text = prop_oneof![
            Just(String::new()),
            Just("ok".to_owned()),
            Just("\\u0000".to_owned()),
            Just("\\ud800".to_owned()),
            Just("\\u001b[2J".to_owned()),
            Just("é".repeat(200)),
            (0usize..600).prop_map(|n| "q".repeat(n)),
        ];
        let value = prop_oneof![
            text.clone().prop_map(|t| format!("\"{t}\"")),
            Just("null".to_owned()),
            Just("-1".to_owned()),
            Just("1e400".to_owned()),
            Just("18446744073709551616".to_owned()),
            Just("9".to_owned()),
            Just(
                "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]"
                    .to_owned()
            ),
            Just(format!("{}{}", "[".repeat(200), "]".repeat(200))),
            Just("{}".to_owned()),
            Just("\"2030-01-01T00:00:00Z\"".to_owned()),
            Just("\"+10000-01-01T00:00:00Z\"".to_owned()),
            Just("\"9999-12-31T23:59:60Z\"".to_owned()),
        ];
        let field = prop_oneof![
            Just("order_id"),
            Just("workflow"),
            Just("payload"),
            Just("reply_to"),
            Just("priority"),
            Just("not_before"),
            Just("events"),
            Just("workflow"),
        ];
        let body = proptest::collection::vec((field, value), 0..8).prop_map(|fields| {
            let inner: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
            let unique = fields
                .iter()
                .map(|(k, _)| k)
                .collect::<std::collections::HashSet<_>>();
            (
                format!("{{{}}}", inner.join(",")),
                unique.len() == fields.len(),
            )
        });
        let mut runner = TestRunner::new(Config {
            cases: 4000,
            failure_persistence: None,
            ..Config::default()
        });
        runner
            .run(
                &(body, proptest::option::of(text)),
                |((body, unique), property)| {
                    match decode_submission(body.as_bytes(), property.as_deref(), 1 << 20, &names())
                    {
                        Ok(s) => {
                            // The published wire type reads what the server
                            // accepts as the same order (the server alone
                            // takes a repeated field, the last one, replaces
                            // NUL, and falls back to the AMQP reply_to).
                            if unique && !body.contains("\\u0000") && property.is_none() {
                                let wire: Order = serde_json::from_str(&body)
                                    .map_err(|e| TestCaseError::fail(format!("{e}: {body}")))?;
                                prop_assert_eq!(&wire, &s, "{}", body);
                            }
                            prop_assert!(is_queue_name(&s.workflow));
                            prop_assert!(s.reply_to.as_deref().is_none_or(is_queue_name));
                            let (earliest, latest) = rfc3339::bounds();
                            prop_assert!(s.not_before.is_none_or(|t| earliest <= t && t <= latest));
                            let stored = serde_json::to_string(&s.payload).unwrap_or_default();
                            prop_assert!(!stored.contains("\\u0000"));
                        }
                        Err((reason, hints)) => {
                            prop_assert!(reason.to_string().len() <= MAX_REASON_BYTES);
                            prop_assert!(hints.reply_to.as_deref().is_none_or(is_queue_name));
                            let id = hints.order_id.map(|v| v.to_string()).unwrap_or_default();
                            prop_assert!(id.len() <= 2 + MAX_NAME_BYTES * 6);
                        }
                    }
                    Ok(())
                },
            )
            .unwrap();
    }

    #[test]
    fn the_published_wire_type_and_the_server_read_every_order_alike() {
        use proptest::prelude::*;
        use proptest::test_runner::{Config, TestRunner};
        let pick = |options: &[&'static str]| proptest::sample::select(options.to_vec());
        let fields = (
            pick(&[r#""w""#, r#""shop.checkout""#, r#""é""#, r#""""#, "7"]),
            pick(&["{}", r#"{"a":1}"#, r#"{"n":[1,{"b":null}],"s":"t"}"#, "[]"]),
            pick(&[
                "",
                r#""0192a0c0-0000-7000-8000-000000000001""#,
                "null",
                r#""x""#,
            ]),
            pick(&["", r#""app.status""#, "null", r#""sas.orders""#, r#""""#]),
            pick(&["", "0", "9", "null", "10", "-1", "3.5"]),
            pick(&[
                "",
                r#""2030-01-01T00:00:00+02:00""#,
                "null",
                r#""2030-02-30T00:00:00Z""#,
            ]),
            pick(&["", r#""all""#, r#""terminal""#, "null", r#""some""#]),
            pick(&["", "1", r#"{"deep":[[]]}"#]),
        );
        let body = fields.prop_flat_map(|(w, p, id, q, prio, nb, ev, extra)| {
            let named = [
                ("workflow", w),
                ("payload", p),
                ("order_id", id),
                ("reply_to", q),
                ("priority", prio),
                ("not_before", nb),
                ("events", ev),
                ("extra", extra),
            ];
            let present: Vec<String> = named
                .iter()
                .filter(|(_, v)| !v.is_empty())
                .map(|(k, v)| format!("\"{k}\":{v}"))
                .collect();
            Just(present)
                .prop_shuffle()
                .prop_map(|f| format!("{{{}}}", f.join(",")))
        });
        let mut runner = TestRunner::new(Config {
            cases: 2000,
            failure_persistence: None,
            ..Config::default()
        });
        runner
            .run(&body, |body| {
                if let Ok(s) = decode_submission(body.as_bytes(), None, 1 << 20, &names()) {
                    let wire: Order = serde_json::from_str(&body)
                        .map_err(|e| TestCaseError::fail(format!("{e}: {body}")))?;
                    prop_assert_eq!(&wire, &s, "{}", body);
                    // And what the wire type writes, the server reads back.
                    let again = serde_json::to_vec(&wire).unwrap();
                    prop_assert_eq!(
                        decode_submission(&again, None, 1 << 20, &names()).ok(),
                        Some(s)
                    );
                }
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn a_redriven_request_carries_its_redrive_in_its_keys_and_older_requests_still_parse() {
        let id = Uuid::new_v4();
        // As a scheduler of an earlier version wrote it: no `redrive`.
        let mut req: StepRequest = serde_json::from_value(serde_json::json!({
            "order_id": id, "workflow": "w", "step": "charge", "step_index": 1,
            "direction": "forward", "attempt": 1, "dispatch_id": Uuid::new_v4(),
            "locked_by": "s1", "complete_by": "2030-01-01T00:00:00Z", "payload": {},
            "results": {}, "fencing_token": 3,
        }))
        .expect("an older request parses");
        assert_eq!(req.redrive, 0);
        assert_eq!(req.idempotency_key(), format!("{id}:charge"));
        assert!(serde_json::to_value(&req).unwrap().get("redrive").is_none());
        req.redrive = 2;
        assert_eq!(req.idempotency_key(), format!("{id}:charge:r2"));
        assert_eq!(serde_json::to_value(&req).unwrap()["redrive"], 2);
        req.direction = Direction::Compensate;
        assert_eq!(req.idempotency_key(), format!("{id}:charge:compensate:r2"));
        req.redrive = 0;
        assert_eq!(req.idempotency_key(), format!("{id}:charge:compensate"));
    }

    #[test]
    fn a_payload_that_did_not_come_in_a_submission_gets_a_submissions_checks() {
        use serde_json::json;
        assert_eq!(
            payload_refusal(&json!({ "a": [1, { "b": null }] }), 1024),
            None
        );
        let label = |v: Value, max: usize| payload_refusal(&v, max).map(|r| r.to_string());
        assert!(label(json!("text"), 1024).is_some_and(|r| r.contains("an object")));
        assert!(label(json!({ "a\u{0}": 1 }), 1024).is_some_and(|r| r.contains("NUL")));
        assert!(label(json!({ "a": ["\u{0}"] }), 1024).is_some_and(|r| r.contains("NUL")));
        assert!(label(json!({ "m": 1.7e308 }), 1024).is_some_and(|r| r.contains("1e300")));
        assert!(
            label(json!({ "s": "x".repeat(20) }), 16).is_some_and(|r| r.contains("limit of 16"))
        );
    }

    #[test]
    fn an_order_encodes_to_what_the_submission_decodes() {
        let mut order = Order::new("w", Map::new());
        assert_eq!(
            serde_json::to_value(&order).unwrap(),
            serde_json::json!({"workflow": "w", "payload": {}})
        );
        order.order_id = Some(Uuid::new_v4());
        order.payload.insert("sku".into(), "A-1".into());
        order.reply_to = Some("app.status".into());
        order.priority = Priority::new(7).unwrap();
        order.not_before = rfc3339::parse("2030-01-01T00:00:00Z");
        let body = serde_json::to_string(&order).unwrap();
        assert_eq!(
            decode_submission(body.as_bytes(), None, 1024, &names()).unwrap(),
            order
        );
    }

    #[test]
    fn replay_requests_decode_in_either_form_and_round_trip() {
        let id = Uuid::new_v4();
        let one = decode_replay(
            format!(r#"{{"order_id":"{id}","from_seq":3}}"#).as_bytes(),
            1024,
            &names(),
        )
        .unwrap();
        assert_eq!(
            one,
            ReplayRequest::Order {
                order_id: id,
                from_seq: 3
            }
        );
        assert_eq!(
            decode_replay(
                format!(r#"{{"order_id":"{id}"}}"#).as_bytes(),
                1024,
                &names()
            )
            .unwrap(),
            ReplayRequest::Order {
                order_id: id,
                from_seq: 1
            },
            "from_seq defaults to the first event"
        );
        let queue = decode_replay(
            br#"{"reply_to":"app","since":"2030-01-01T01:00:00+01:00"}"#,
            1024,
            &names(),
        )
        .unwrap();
        assert_eq!(
            queue,
            ReplayRequest::Queue {
                reply_to: "app".into(),
                since: rfc3339::parse("2030-01-01T00:00:00Z").unwrap()
            }
        );
        for request in [one, queue] {
            let body = serde_json::to_string(&request).unwrap();
            assert_eq!(
                decode_replay(body.as_bytes(), 1024, &names()).unwrap(),
                request
            );
        }
    }

    #[test]
    fn malformed_replay_requests_get_precise_reasons() {
        let label = |body: &str| {
            decode_replay(body.as_bytes(), 256, &names())
                .unwrap_err()
                .label()
        };
        assert_eq!(label("{nope"), "malformed_json");
        assert_eq!(label("[1]"), "not_an_object");
        assert_eq!(label("{}"), "missing_field");
        assert_eq!(label(r#"{"reply_to":"q"}"#), "missing_field");
        assert_eq!(label(r#"{"order_id":"x"}"#), "wrong_type");
        assert_eq!(label(r#"{"order_id":7}"#), "wrong_type");
        let id = Uuid::new_v4();
        for bad in [
            format!(r#"{{"order_id":"{id}","from_seq":-1}}"#),
            format!(r#"{{"order_id":"{id}","from_seq":2147483648}}"#),
            format!(r#"{{"order_id":"{id}","from_seq":"1"}}"#),
            format!(r#"{{"order_id":"{id}","reply_to":"q"}}"#),
            r#"{"reply_to":"q","since":"yesterday"}"#.to_owned(),
            r#"{"reply_to":"","since":"2030-01-01T00:00:00Z"}"#.to_owned(),
            r#"{"reply_to":"a\nb","since":"2030-01-01T00:00:00Z"}"#.to_owned(),
        ] {
            assert_eq!(label(&bad), "wrong_type", "{bad}");
        }
        assert_eq!(label(&" ".repeat(257)), "too_large");
        assert!(
            decode_replay(b"{}", 10, &names())
                .unwrap_err()
                .to_string()
                .contains("`order_id` or `reply_to`")
        );
    }

    #[test]
    fn a_logged_event_is_the_status_event_the_outbox_sends() {
        let id = Uuid::new_v4();
        let at = rfc3339::parse("2026-11-21T10:00:00.123456Z").unwrap();
        let e = logged_event(
            id,
            3,
            EventKind::StepSucceeded,
            Some("charge".into()),
            1,
            at,
            serde_json::json!({"result": {"b": 1, "a": 2}}),
        );
        assert_eq!(
            serde_json::to_string(&e).unwrap(),
            format!(
                r#"{{"order_id":"{id}","seq":3,"state":"step_succeeded","step":"charge","attempt":1,"at":"2026-11-21T10:00:00.123456Z","detail":{{"result":{{"a":2,"b":1}}}}}}"#
            )
        );
    }

    #[test]
    fn a_rejected_body_still_yields_its_reply_queue() {
        let (_, hints) = decode_submission(
            br#"{"order_id":"nope","workflow":"w","payload":{},"reply_to":"mine"}"#,
            Some("prop"),
            1024,
            &names(),
        )
        .unwrap_err();
        assert_eq!(hints.reply_to.as_deref(), Some("mine"));
        let ev = rejected_event(&hints, &RejectReason::NotAnObject, Utc::now());
        assert_eq!(ev.seq, 0);
        assert_eq!(ev.order_id, "nope", "the id as given");
    }

    #[test]
    fn a_reply_queue_of_sas_or_the_broker_is_refused_in_the_body_or_the_property() {
        let id = Uuid::new_v4();
        for queue in [
            "sas.replay",
            "sas.alerts",
            "sas.orders.dead",
            "sas.agent.a.requests",
            "sas",
            "amq.gen-x",
        ] {
            let body = format!(
                r#"{{"order_id":"{id}","workflow":"w","payload":{{}},"reply_to":"{queue}"}}"#
            );
            let (reason, hints) =
                decode_submission(body.as_bytes(), None, 1024, &names()).unwrap_err();
            assert_eq!(reason.label(), "reserved_queue", "{queue}");
            assert_eq!(hints.reply_to, None, "no event goes to {queue}");
            // A usable property is where the sender is told.
            let (_, hints) =
                decode_submission(body.as_bytes(), Some("mine"), 1024, &names()).unwrap_err();
            assert_eq!(hints.reply_to.as_deref(), Some("mine"));

            let body = r#"{"workflow":"w","payload":{},"reply_to":"mine"}"#;
            let (reason, hints) =
                decode_submission(body.as_bytes(), Some(queue), 1024, &names()).unwrap_err();
            assert_eq!(reason.label(), "reserved_queue", "property {queue}");
            assert_eq!(hints.reply_to.as_deref(), Some("mine"));
            let text = reason.to_string();
            assert!(
                text.contains("reply_to") && text.len() <= MAX_REASON_BYTES,
                "{text}"
            );
        }
        // Another deployment's prefix, or a name that merely starts alike, is the application's.
        let ok = decode_submission(
            br#"{"workflow":"w","payload":{},"reply_to":"sasx.status"}"#,
            Some("other.status"),
            1024,
            &names(),
        )
        .unwrap();
        assert_eq!(ok.reply_to.as_deref(), Some("sasx.status"));
    }

    #[test]
    fn a_replay_request_is_read_strictly_and_never_into_sas_queues() {
        let id = Uuid::new_v4();
        // A status event, an order, a request with one stray field: none is a replay request.
        let event = serde_json::to_vec(&logged_event(
            id,
            1,
            EventKind::Received,
            None,
            1,
            Utc::now(),
            serde_json::json!({}),
        ))
        .unwrap();
        let stray = format!(r#"{{"order_id":"{id}","from_seq":1,"x":1}}"#);
        let order = format!(r#"{{"order_id":"{id}","workflow":"w","payload":{{}}}}"#);
        for body in [event, stray.into_bytes(), order.into_bytes()] {
            let reason = decode_replay(&body, 1024, &names()).unwrap_err();
            assert_eq!(
                reason.label(),
                "unknown_field",
                "{}",
                String::from_utf8_lossy(&body)
            );
        }
        let body = br#"{"reply_to":"sas.replay","since":"2030-01-01T00:00:00Z"}"#;
        assert_eq!(
            decode_replay(body, 1024, &names()).unwrap_err().label(),
            "reserved_queue"
        );
        assert_eq!(
            decode_replay(br#"{"from_seq":2}"#, 1024, &names()).unwrap_err(),
            RejectReason::MissingField("order_id")
        );
    }

    #[test]
    fn replies_round_trip_with_a_flat_outcome() {
        let req = StepRequest {
            order_id: Uuid::new_v4(),
            workflow: "w".into(),
            step: "charge".into(),
            step_index: 1,
            direction: Direction::Compensate,
            attempt: 2,
            dispatch_id: Uuid::new_v4(),
            locked_by: "s1".into(),
            complete_by: Utc::now(),
            payload: Value::Null,
            results: Map::new(),
            fencing_token: 1,
            timeout_ms: Some(2000),
            max_complete_by: None,
            time_left_ms: None,
            redrive: 0,
            in_doubt: false,
            retry: None,
            item: None,
            index: None,
        };
        assert!(req.idempotency_key().ends_with(":charge:compensate"));
        let reply = StepReply::to(&req, StepOutcome::Failed { error: "no".into() });
        let json = serde_json::to_value(&reply).unwrap();
        assert_eq!(json["outcome"], "failed");
        assert_eq!(serde_json::from_value::<StepReply>(json).unwrap(), reply);
        let at = Utc::now();
        let heartbeat = StepReply::to(
            &req,
            StepOutcome::Accepted {
                complete_by: at,
                location: "/jobs/1".into(),
            },
        );
        let json = serde_json::to_value(&heartbeat).unwrap();
        assert_eq!(json["outcome"], "accepted");
        assert_eq!(json["location"], "/jobs/1");
        assert_eq!(json["complete_by"], rfc3339::format(&at));
    }

    fn reply_of(bytes: usize) -> StepReply {
        StepReply {
            order_id: Uuid::new_v4(),
            step: "a".into(),
            step_index: 0,
            direction: Direction::Forward,
            attempt: 1,
            dispatch_id: Uuid::new_v4(),
            locked_by: "s1".into(),
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
            outcome: StepOutcome::Succeeded {
                result: serde_json::json!({ "pad": "x".repeat(bytes) }),
            },
        }
    }

    #[test]
    fn one_reply_goes_as_an_object_and_several_as_packs_within_the_size() {
        let one = reply_of(10);
        let bodies = encode_replies(std::slice::from_ref(&one));
        assert_eq!(bodies.len(), 1);
        assert_eq!(bodies[0].0[0], b'{', "alone, as before packs");
        assert_eq!(read_all(&bodies[0].0), vec![one]);

        // Three of a third of the limit fit two to a pack; one over the limit goes alone.
        let mut replies: Vec<StepReply> = (0..3).map(|_| reply_of(MAX_PACK_BYTES / 3)).collect();
        replies.push(reply_of(MAX_PACK_BYTES));
        replies.push(reply_of(10));
        let bodies = encode_replies(&replies);
        let ranges: Vec<_> = bodies.iter().map(|(_, r)| r.clone()).collect();
        assert_eq!(ranges, vec![0..2, 2..3, 3..4, 4..5]);
        let mut decoded = Vec::new();
        for (body, range) in &bodies {
            assert!(body.len() <= MAX_PACK_BYTES || range.len() == 1);
            let got = read_all(body);
            assert_eq!(got.len(), range.len());
            decoded.extend(got);
        }
        assert_eq!(decoded, replies, "every reply once, in order, trace kept");
        let small: Vec<StepReply> = (0..50).map(|_| reply_of(10)).collect();
        assert_eq!(
            encode_replies(&small).len(),
            1,
            "small replies share one message"
        );
    }

    /// Every reply of a message that must read whole.
    fn read_all(body: &[u8]) -> Vec<StepReply> {
        decode_replies(body)
            .unwrap()
            .into_iter()
            .map(Result::unwrap)
            .collect()
    }

    #[test]
    fn a_message_of_neither_shape_is_unreadable_and_a_packs_bad_reply_is_its_own() {
        assert!(decode_replies(b"[]").is_err());
        // Packs no agent makes: too large, or too many (small) replies.
        let many = format!("[{}]", vec!["{}"; MAX_PACK_REPLIES + 1].join(","));
        let e = decode_replies(many.as_bytes()).unwrap_err().to_string();
        assert!(e.contains("at most 1024 replies"), "{e}");
        let large = format!("[{}]", vec!["{}"; MAX_PACK_BYTES].join(","));
        let e = decode_replies(large.as_bytes()).unwrap_err().to_string();
        assert!(e.contains("agents pack at most"), "{e}");
        let fine = format!("[{}]", vec!["{}"; MAX_PACK_REPLIES].join(","));
        assert_eq!(
            decode_replies(fine.as_bytes()).unwrap().len(),
            MAX_PACK_REPLIES
        );
        assert!(decode_replies(b"  [ ]").is_err());
        assert!(decode_replies(b"[1,2").is_err());
        assert!(decode_replies(b"").is_err());
        assert!(decode_replies(br#"{"not":"a reply"}"#).is_err());
        let got = decode_replies(br#"[{"not":"a reply"}, 2]"#).unwrap();
        assert!(got.len() == 2 && got.iter().all(Result::is_err));
        let good = reply_of(1);
        let mut mixed = b"[".to_vec();
        mixed.extend_from_slice(&serde_json::to_vec(&good).unwrap());
        mixed.extend_from_slice(b",{}]");
        let got = decode_replies(&mixed).unwrap();
        assert_eq!(
            got[0].as_ref().ok(),
            Some(&good),
            "read despite its neighbour"
        );
        assert!(got[1].is_err());
        // A reply without a trace (an older agent's) reads as before.
        let mut old = serde_json::to_value(reply_of(1)).unwrap();
        old.as_object_mut().unwrap().remove("traceparent");
        assert_eq!(read_all(old.to_string().as_bytes())[0].traceparent, None);
    }
}

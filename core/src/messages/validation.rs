//! What sas accepts of a message, and why it refuses the rest (contract
//! §1a, §4d, §9): the submission's checks, a signal's, a replay
//! request's, and the bounded reasons of a refusal. No I/O.

use serde_json::Value;
use uuid::Uuid;

use super::{Events, Priority, ReplayRequest, SignalMessage, is_queue_name, rfc3339};
use crate::topology::QueueNames;
use sas_protocol::limits::{is_step_name, payload_broken, value_broken};

/// Longest text a reason quotes from what it rejects, in characters: a
/// header value must stay far below the broker's frame size whatever the
/// input (contract §1a).
pub const MAX_QUOTE_CHARS: usize = 64;

/// Longest reason text, in bytes (an `x-sas-reason` header, a `rejected`
/// event's error).
pub const MAX_REASON_BYTES: usize = 512;

/// Why a submitted message was not accepted; the text goes into `x-sas-reason`.
///
/// Every variant's text is bounded: it quotes at most [`MAX_QUOTE_CHARS`]
/// characters of the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RejectReason {
    #[error("body of {size} bytes is larger than the limit of {limit} bytes")]
    TooLarge { size: usize, limit: usize },
    #[error("body is not valid UTF-8")]
    NotUtf8,
    #[error("body is not valid JSON: {0}")]
    MalformedJson(Quoted),
    #[error("body must be a JSON object")]
    NotAnObject,
    #[error("missing required field `{0}`")]
    MissingField(&'static str),
    #[error("field `{field}` must be {expected}")]
    WrongType {
        field: &'static str,
        expected: &'static str,
    },
    #[error("unknown workflow {0}")]
    UnknownWorkflow(Quoted),
    /// A handler failed on the message in a way no retry will mend (a
    /// panic, or a store refusal of this one message).
    #[error("internal error: {0}")]
    Internal(Quoted),
    /// A replay request (contract §9) names an order the state store does not hold.
    #[error("unknown order {0}")]
    UnknownOrder(Uuid),
    /// A replay request has no `reply_to` property and its order no status
    /// queue: there is nowhere to send the events.
    #[error("no queue to send the events to: no reply_to property, and the order has none")]
    NoReplyQueue,
    /// The queue a replay's events were to go to does not exist.
    #[error("no queue {0}: the events could not be delivered")]
    NoSuchQueue(Quoted),
    /// A `reply_to` names one of sas's own queues or the broker's
    /// (contract §1b): applications name queues of their own.
    #[error(
        "{field} names {queue}, a queue of sas (under its prefix) or of the broker (amq.): name a queue of your own"
    )]
    ReservedQueue { field: &'static str, queue: Quoted },
    /// With applications configured (contract §1b), the message is no
    /// known application's.
    #[error("{0}")]
    UnknownApplication(crate::applications::Unknown),
    /// A `reply_to` outside the sending application's queues (§1b).
    #[error("{field} names {queue}, which is not among application {application}'s queues")]
    NotTheApplicationsQueue {
        field: &'static str,
        queue: Quoted,
        application: Quoted,
    },
    /// A field the message may not carry (a replay request is read
    /// strictly, so that no other message is taken for one).
    #[error("unknown field {0}")]
    UnknownField(Quoted),
    /// A signal that nothing waits for (contract §4d): the order's state
    /// and why. It is not kept.
    #[error("order {order_id} is {state}: {why}")]
    NotWaiting {
        order_id: Uuid,
        state: &'static str,
        why: &'static str,
    },
}

impl RejectReason {
    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Self::TooLarge { .. } => "too_large",
            Self::NotUtf8 => "not_utf8",
            Self::MalformedJson(_) => "malformed_json",
            Self::NotAnObject => "not_an_object",
            Self::MissingField(_) => "missing_field",
            Self::WrongType { .. } => "wrong_type",
            Self::UnknownWorkflow(_) => "unknown_workflow",
            Self::Internal(_) => "internal_error",
            Self::UnknownOrder(_) => "unknown_order",
            Self::NoReplyQueue => "no_reply_queue",
            Self::NoSuchQueue(_) => "no_such_queue",
            Self::ReservedQueue { .. } => "reserved_queue",
            Self::UnknownApplication(_) => "unknown_application",
            Self::NotTheApplicationsQueue { .. } => "not_the_applications_queue",
            Self::UnknownField(_) => "unknown_field",
            Self::NotWaiting { .. } => "not_waiting",
        }
    }
}

/// A bounded quote of untrusted text for a reason: at most
/// [`MAX_QUOTE_CHARS`] characters, control characters escaped, and a note
/// of how much was left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quoted(String);

impl Quoted {
    /// Quotes (a prefix of) `text`.
    pub fn new(text: &str) -> Self {
        let total = text.chars().count();
        let prefix: String = text.chars().take(MAX_QUOTE_CHARS).collect();
        let mut quoted = format!("{prefix:?}");
        if total > MAX_QUOTE_CHARS {
            quoted.push_str(&format!(" (first {MAX_QUOTE_CHARS} of {total} characters)"));
        }
        Self(quoted)
    }
}

impl std::fmt::Display for Quoted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// An order as the submission decoded and validated it (contract §1): the
/// wire's [`Order`](sas_protocol::Order), whose fields it has.
pub type Submission = sas_protocol::Order;
/// What is known of a rejected message, to answer its sender.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RejectedHints {
    pub order_id: Option<Value>,
    pub reply_to: Option<String>,
}

/// Decodes and validates a body. `reply_to_property` is the AMQP
/// `reply_to`; a queue of `names` (sas's own, contract §1b) in either
/// the property or the body is refused.
///
/// On rejection also returns what could be read of the order id and the
/// reply queue, so the sender can be told: a reply queue only where
/// sas may publish (never one of its own).
pub fn decode_submission(
    body: &[u8],
    reply_to_property: Option<&str>,
    max_bytes: usize,
    names: &QueueNames,
) -> Result<Submission, (RejectReason, RejectedHints)> {
    let reply_to_property = reply_to_property.filter(|q| is_queue_name(q));
    let usable = |q: &&str| !names.is_reserved(q);
    let mut hints = RejectedHints {
        order_id: None,
        reply_to: reply_to_property.filter(usable).map(str::to_owned),
    };
    if body.len() > max_bytes {
        return Err((
            RejectReason::TooLarge {
                size: body.len(),
                limit: max_bytes,
            },
            hints,
        ));
    }
    let text = std::str::from_utf8(body).map_err(|_| (RejectReason::NotUtf8, hints.clone()))?;
    let value: Value = serde_json::from_str(text).map_err(|e| {
        (
            RejectReason::MalformedJson(Quoted::new(&e.to_string())),
            hints.clone(),
        )
    })?;
    let Value::Object(mut obj) = value else {
        return Err((RejectReason::NotAnObject, hints));
    };
    // Read the reply queue and the id first, so even a wrong body can be answered.
    // Only what can be routed and echoed: a queue name, an id of a
    // sensible size.
    match obj.get("reply_to") {
        Some(Value::String(q)) if is_queue_name(q) && !names.is_reserved(q) => {
            hints.reply_to = Some(q.clone());
        }
        _ => {}
    }
    hints.order_id = match obj.get("order_id") {
        Some(Value::String(id)) if is_queue_name(id) => Some(Value::String(id.clone())),
        Some(n @ Value::Number(_)) => Some(n.clone()),
        _ => None,
    };
    let fail = |r: RejectReason| Err((r, hints.clone()));
    if let Some(q) = reply_to_property.filter(|q| names.is_reserved(q)) {
        return fail(reserved("the AMQP reply_to property", q));
    }

    let order_id = match obj.remove("order_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => match Uuid::parse_str(&s) {
            Ok(id) => Some(id),
            Err(_) => return fail(wrong("order_id", "a UUID string")),
        },
        Some(_) => return fail(wrong("order_id", "a UUID string")),
    };
    let workflow = match obj.remove("workflow") {
        None | Some(Value::Null) => return fail(RejectReason::MissingField("workflow")),
        Some(Value::String(s)) if is_queue_name(&s) => s,
        Some(_) => {
            return fail(wrong(
                "workflow",
                "a name of 1 to 255 bytes without control characters",
            ));
        }
    };
    let payload = match obj.remove("payload") {
        None | Some(Value::Null) => return fail(RejectReason::MissingField("payload")),
        Some(Value::Object(m)) => {
            if let Some(expected) = payload_broken(&m) {
                return fail(wrong("payload", expected));
            }
            m
        }
        Some(_) => return fail(wrong("payload", "an object")),
    };
    let reply_to = match obj.remove("reply_to") {
        None | Some(Value::Null) => reply_to_property.map(str::to_owned),
        Some(Value::String(s)) if names.is_reserved(&s) => {
            return fail(reserved("`reply_to`", &s));
        }
        Some(Value::String(s)) if is_queue_name(&s) => Some(s),
        Some(_) => {
            return fail(wrong(
                "reply_to",
                "a queue name (1 to 255 bytes, no control characters)",
            ));
        }
    };
    let priority = match obj.remove("priority") {
        None | Some(Value::Null) => Priority::default(),
        Some(Value::Number(n)) => match n.as_i64().and_then(Priority::new) {
            Some(p) => p,
            None => return fail(wrong("priority", "an integer from 0 to 9")),
        },
        Some(_) => return fail(wrong("priority", "an integer from 0 to 9")),
    };
    let not_before = match obj.remove("not_before") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => match rfc3339::parse(&s) {
            Some(t) => Some(t),
            None => return fail(wrong("not_before", rfc3339::EXPECTED)),
        },
        Some(_) => return fail(wrong("not_before", rfc3339::EXPECTED)),
    };
    let events = match obj.remove("events") {
        None | Some(Value::Null) => Events::All,
        Some(Value::String(s)) => match Events::try_from(s) {
            Ok(e) => e,
            Err(_) => return fail(wrong("events", EVENTS)),
        },
        Some(_) => return fail(wrong("events", EVENTS)),
    };
    Ok(Submission {
        order_id,
        workflow,
        payload,
        reply_to,
        priority,
        not_before,
        events,
    })
}

/// Why `payload` cannot be an order's payload, if it cannot: the same
/// checks and limits as a submitted order's `payload` (contract §1, §1a),
/// for a payload that did not come in a submission (an operator's redrive
/// with a patch, contract §9). `max_bytes` bounds its JSON text, as
/// `submission.max_body_bytes` bounds a submission's whole body.
pub fn payload_refusal(payload: &Value, max_bytes: usize) -> Option<RejectReason> {
    let Value::Object(m) = payload else {
        return Some(wrong("payload", "an object"));
    };
    if let Some(expected) = payload_broken(m) {
        return Some(wrong("payload", expected));
    }
    let size = payload.to_string().len();
    (size > max_bytes).then_some(RejectReason::TooLarge {
        size,
        limit: max_bytes,
    })
}

/// Replaces every NUL character (`\u0000`, which Postgres cannot store)
/// in the keys and strings of `v` with U+FFFD; returns whether there was any.
pub(super) fn replace_nul(v: &mut Value) -> bool {
    match v {
        Value::String(s) => replace_nul_in(s),
        Value::Array(items) => items.iter_mut().fold(false, |f, i| replace_nul(i) | f),
        Value::Object(o) => replace_nul_map(o),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

fn replace_nul_map(o: &mut serde_json::Map<String, Value>) -> bool {
    let keys = o.keys().any(|k| k.contains('\0'));
    if keys {
        *o = std::mem::take(o)
            .into_iter()
            .map(|(k, v)| (k.replace('\0', "\u{FFFD}"), v))
            .collect();
    }
    o.values_mut().fold(keys, |f, v| replace_nul(v) | f)
}

pub(super) fn replace_nul_in(s: &mut String) -> bool {
    let found = s.contains('\0');
    if found {
        *s = s.replace('\0', "\u{FFFD}");
    }
    found
}

/// What an order's `events` may be.
const EVENTS: &str = "\"all\" or \"terminal\"";

fn wrong(field: &'static str, expected: &'static str) -> RejectReason {
    RejectReason::WrongType { field, expected }
}

fn reserved(field: &'static str, queue: &str) -> RejectReason {
    RejectReason::ReservedQueue {
        field,
        queue: Quoted::new(queue),
    }
}

/// The fields a replay request may carry, of either form.
const REPLAY_FIELDS: [&str; 4] = ["order_id", "from_seq", "reply_to", "since"];

/// What `from_seq` must be.
const FROM_SEQ: &str = "an integer from 0 to 2147483647";

/// The fields a signal may have.
const SIGNAL_FIELDS: [&str; 3] = ["order_id", "signal", "data"];

/// The longest signal name: as long as a step's name may be.
pub const MAX_SIGNAL_NAME_BYTES: usize = 100;

/// Decodes and checks a signal (contract §4d): a JSON object of at most
/// `max_bytes` with `order_id` (a UUID string), `signal` (a name of 1 to
/// [`MAX_SIGNAL_NAME_BYTES`] bytes) and optionally `data`, and nothing else.
pub fn decode_signal(body: &[u8], max_bytes: usize) -> Result<SignalMessage, RejectReason> {
    if body.len() > max_bytes {
        return Err(RejectReason::TooLarge {
            size: body.len(),
            limit: max_bytes,
        });
    }
    let text = std::str::from_utf8(body).map_err(|_| RejectReason::NotUtf8)?;
    let value: Value = serde_json::from_str(text)
        .map_err(|e| RejectReason::MalformedJson(Quoted::new(&e.to_string())))?;
    let Value::Object(mut obj) = value else {
        return Err(RejectReason::NotAnObject);
    };
    if let Some(unknown) = obj.keys().find(|k| !SIGNAL_FIELDS.contains(&k.as_str())) {
        return Err(RejectReason::UnknownField(Quoted::new(unknown)));
    }
    let order_id = match obj.get("order_id") {
        None | Some(Value::Null) => return Err(RejectReason::MissingField("order_id")),
        Some(Value::String(s)) => {
            Uuid::parse_str(s).map_err(|_| wrong("order_id", "a UUID string"))?
        }
        Some(_) => return Err(wrong("order_id", "a UUID string")),
    };
    let signal = match obj.remove("signal") {
        None | Some(Value::Null) => return Err(RejectReason::MissingField("signal")),
        Some(Value::String(s)) => s,
        Some(_) => return Err(wrong("signal", SIGNAL_NAME)),
    };
    let data = match obj.remove("data") {
        None | Some(Value::Null) => Value::Object(serde_json::Map::new()),
        Some(data) => data,
    };
    if let Some(why) = signal_refusal(&signal, &data) {
        return Err(why);
    }
    Ok(SignalMessage {
        order_id,
        signal,
        data,
    })
}

/// What a signal's name must be.
const SIGNAL_NAME: &str = "a name of 1 to 100 bytes without control characters";

/// Why a signal named `name` with `data` cannot be applied, if it cannot:
/// the one check of a signal's name and data, however it came (the
/// signals queue, the HTTP API, sasctl), so that the same signal gets the
/// same answer on every way in. The data, a step's result to be, takes the
/// checks of an order's payload (no NUL, numbers and nesting within sas's
/// limits); its size is bounded by the body that carried it.
pub fn signal_refusal(name: &str, data: &Value) -> Option<RejectReason> {
    if !is_step_name(name, MAX_SIGNAL_NAME_BYTES) {
        return Some(wrong("signal", SIGNAL_NAME));
    }
    value_broken(data).map(|expected| wrong("data", expected))
}

/// Decodes and validates a replay request's body, strictly (contract
/// §1b): a field other than the two forms' is refused, so no other
/// message (a status event, an order) is ever read as a request, and
/// a `reply_to` naming a queue of `names` is refused.
pub fn decode_replay(
    body: &[u8],
    max_bytes: usize,
    names: &QueueNames,
) -> Result<ReplayRequest, RejectReason> {
    if body.len() > max_bytes {
        return Err(RejectReason::TooLarge {
            size: body.len(),
            limit: max_bytes,
        });
    }
    let text = std::str::from_utf8(body).map_err(|_| RejectReason::NotUtf8)?;
    let value: Value = serde_json::from_str(text)
        .map_err(|e| RejectReason::MalformedJson(Quoted::new(&e.to_string())))?;
    let Value::Object(obj) = value else {
        return Err(RejectReason::NotAnObject);
    };
    if let Some(unknown) = obj.keys().find(|k| !REPLAY_FIELDS.contains(&k.as_str())) {
        return Err(RejectReason::UnknownField(Quoted::new(unknown)));
    }
    let present = |k: &str| obj.get(k).is_some_and(|v| !v.is_null());
    if present("order_id") {
        if present("reply_to") || present("since") {
            return Err(wrong(
                "reply_to",
                "absent beside order_id (the AMQP reply_to property names where events go)",
            ));
        }
        let order_id = match obj.get("order_id") {
            Some(Value::String(s)) => {
                Uuid::parse_str(s).map_err(|_| wrong("order_id", "a UUID string"))?
            }
            _ => return Err(wrong("order_id", "a UUID string")),
        };
        let from_seq = match obj.get("from_seq") {
            None | Some(Value::Null) => 1,
            Some(Value::Number(n)) => n
                .as_i64()
                .and_then(|n| i32::try_from(n).ok())
                .filter(|n| *n >= 0)
                .ok_or_else(|| wrong("from_seq", FROM_SEQ))?,
            Some(_) => return Err(wrong("from_seq", FROM_SEQ)),
        };
        return Ok(ReplayRequest::Order { order_id, from_seq });
    }
    if present("from_seq") {
        return Err(RejectReason::MissingField("order_id"));
    }
    let reply_to = match obj.get("reply_to") {
        None | Some(Value::Null) => {
            return Err(RejectReason::MissingField("order_id` or `reply_to"));
        }
        Some(Value::String(q)) if names.is_reserved(q) => {
            return Err(reserved("`reply_to`", q));
        }
        Some(Value::String(q)) if is_queue_name(q) => q.clone(),
        Some(_) => return Err(wrong("reply_to", "a queue name of 1 to 255 bytes")),
    };
    let since = match obj.get("since") {
        None | Some(Value::Null) => return Err(RejectReason::MissingField("since")),
        Some(Value::String(s)) => {
            rfc3339::parse(s).ok_or_else(|| wrong("since", rfc3339::EXPECTED))?
        }
        Some(_) => return Err(wrong("since", rfc3339::EXPECTED)),
    };
    Ok(ReplayRequest::Queue { reply_to, since })
}

//! What sas accepts in an order (contract §1, §1a), as pure checks: the
//! submission applies them to every order it reads, and a client applies
//! them before sending, so that an order sas would refuse is refused at
//! once, unsent.

use serde_json::{Map, Value};

/// Longest queue or workflow name sas accepts: AMQP's short string.
pub const MAX_NAME_BYTES: usize = 255;

/// Deepest nesting of arrays and objects sas accepts in a payload or a
/// remote's answer: it is carried inside step requests and replies, each
/// adding a level or two, and every JSON reader on the way stops at 128.
pub const MAX_JSON_DEPTH: usize = 64;

/// Largest magnitude of a fractional number sas accepts in a payload or an
/// answer: Postgres keeps a JSON number as an exact decimal, and the
/// decimal of a double near its maximum reads back as out of range.
pub const MAX_JSON_NUMBER: f64 = 1e300;

/// Whether `name` can be a queue or workflow name: 1 to
/// [`MAX_NAME_BYTES`] bytes, no control characters (a NUL cannot be
/// stored, and the others are surely a mistake).
pub fn is_queue_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME_BYTES && !name.chars().any(char::is_control)
}

/// Whether `queue` is not for applications to name (contract §1b): one of
/// the deployment's own (its `prefix`, or under `<prefix>.`) or the
/// broker's (`amq.`).
pub fn is_reserved_queue(prefix: &str, queue: &str) -> bool {
    queue.starts_with("amq.")
        || queue
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

/// Why a JSON value cannot travel through sas, if it cannot: what it
/// should be instead.
pub fn json_limit_broken(value: &Value) -> Option<&'static str> {
    limit_broken_at(value, 0)
}

fn limit_broken_at(v: &Value, depth: usize) -> Option<&'static str> {
    match v {
        Value::Array(_) | Value::Object(_) if depth >= MAX_JSON_DEPTH => {
            Some("nested at most 64 levels deep")
        }
        Value::Array(items) => items.iter().find_map(|i| limit_broken_at(i, depth + 1)),
        Value::Object(fields) => fields.values().find_map(|f| limit_broken_at(f, depth + 1)),
        Value::Number(n) if n.as_f64().is_none_or(|x| x.abs() > MAX_JSON_NUMBER) => {
            Some("free of numbers beyond 1e300 in magnitude")
        }
        _ => None,
    }
}

/// What an order's payload must be free of: Postgres stores no NUL
/// character in text or jsonb.
const NUL_FREE: &str = "free of NUL characters (\\u0000), which cannot be stored";

/// What a payload breaks of what sas can store and carry, if anything
/// (what it should be instead): the checks of an order's `payload` beyond
/// its being an object.
pub fn payload_broken(payload: &Map<String, Value>) -> Option<&'static str> {
    if payload.iter().any(|(k, v)| k.contains('\0') || has_nul(v)) {
        return Some(NUL_FREE);
    }
    payload.values().find_map(|v| limit_broken_at(v, 1))
}

/// What any other value an application sends for sas to store (a
/// signal's data, which becomes a step's result) breaks, if anything: the
/// same checks as a payload's, on a value of any type.
pub fn value_broken(value: &Value) -> Option<&'static str> {
    if has_nul(value) {
        return Some(NUL_FREE);
    }
    json_limit_broken(value)
}

/// Whether `name` can name a step or a signal: 1 to `max` bytes, no
/// control characters (a NUL cannot be stored; a newline would forge log
/// lines, and no step is named so).
pub fn is_step_name(name: &str, max: usize) -> bool {
    !name.is_empty() && name.len() <= max && !name.chars().any(char::is_control)
}

/// `text` cut to at most `max` bytes, on a character boundary.
pub fn truncate_bytes(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Whether a key or string anywhere in `v` holds a NUL character.
pub fn has_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(has_nul),
        Value::Object(o) => o.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn queue_names_are_short_and_printable() {
        assert!(is_queue_name("shop.status"));
        assert!(!is_queue_name(""));
        assert!(!is_queue_name(&"q".repeat(256)));
        assert!(!is_queue_name("a\nb"));
    }

    #[test]
    fn the_deployments_and_the_brokers_queues_are_reserved() {
        assert!(is_reserved_queue("sas", "sas"));
        assert!(is_reserved_queue("sas", "sas.orders"));
        assert!(is_reserved_queue("sas", "amq.gen-1"));
        assert!(!is_reserved_queue("sas", "sas-app.status"));
        assert!(!is_reserved_queue("sas", "shop.status"));
    }

    #[test]
    fn payloads_too_deep_with_nul_or_huge_numbers_are_named() {
        let deep = (0..70).fold(json!(1), |v, _| json!([v]));
        let map = |v: Value| json!({ "x": v }).as_object().cloned().unwrap_or_default();
        assert!(payload_broken(&map(deep.clone())).is_some());
        assert!(payload_broken(&map(json!("a\u{0}b"))).is_some());
        assert!(payload_broken(&map(json!(1e308))).is_some());
        assert!(payload_broken(&map(json!({"a": [1, "b", null]}))).is_none());
        assert!(
            value_broken(&json!("a\u{0}b")).is_some(),
            "a NUL in any value"
        );
        assert!(
            value_broken(&json!({"k\u{0}": 1})).is_some(),
            "and in a key"
        );
        assert!(value_broken(&json!([1e308])).is_some());
        assert!(value_broken(&deep).is_some());
        assert!(value_broken(&json!({"ok": ["a", 1, null]})).is_none());
        assert!(is_step_name("approve", 100));
        assert!(!is_step_name("", 100));
        assert!(!is_step_name("a\nINFO forged", 100));
        assert!(!is_step_name(&"x".repeat(101), 100));
    }
}

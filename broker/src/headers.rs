//! What a stranger's AMQP headers may do to sas (contract §1b), pure.
//!
//! - Header tables and arrays nested [`MAX_NESTING`] levels or deeper:
//!   the AMQP parser (patched, `third_party/amq-protocol-types`) keeps
//!   what lies deeper as raw bytes rather than recursing into it, so such a
//!   message arrives altered; it is refused with a reason.
//! - Headers of any size the broker accepts: a copy that sas publishes
//!   (a dead letter, a counted retry) adds its own headers, so the copy of
//!   a message whose headers nearly fill a frame would not fit one, and
//!   RabbitMQ would close the publishing connection. The copy leaves the
//!   original headers out when they would not leave room, and says so.

use lapin::types::{AMQPValue, FieldTable};

/// How deep header tables and arrays nest in a message sas accepts: the
/// bound the patched parser stops at (its `parsing::MAX_NESTING`).
pub const MAX_NESTING: usize = 64;

/// Room kept in a frame beside a copy's headers: the content header's
/// fixed part, every other property at its longest (short strings of 255
/// bytes), and the headers sas adds (each value at most
/// [`super::MAX_HEADER_BYTES`]).
const FRAME_ROOM: usize = 8 * 1024;

/// The header of a copy that says which RabbitMQ user sent the original
/// (its `user_id`, which a copy cannot carry).
pub const USER_ID_HEADER: &str = "x-sas-user-id";

/// The header that says a copy left the original headers out.
pub const DROPPED_HEADER: &str = "x-sas-headers-dropped";

/// Why a message's headers are refused, if they are.
pub fn refusal(headers: Option<&FieldTable>) -> Option<String> {
    let depth = headers.map_or(0, nesting);
    (depth >= MAX_NESTING)
        .then(|| format!("AMQP headers nested {MAX_NESTING} levels deep or deeper: refused unread"))
}

/// How deep the tables and arrays of `table` nest: 1 for a flat table.
pub fn nesting(table: &FieldTable) -> usize {
    // A stack, not recursion: the depth is the input's.
    let mut deepest = 1;
    let mut stack: Vec<(&AMQPValue, usize)> = table.inner().values().map(|v| (v, 2)).collect();
    while let Some((value, depth)) = stack.pop() {
        match value {
            AMQPValue::FieldTable(t) => {
                deepest = deepest.max(depth);
                stack.extend(t.inner().values().map(|v| (v, depth + 1)));
            }
            AMQPValue::FieldArray(a) => {
                deepest = deepest.max(depth);
                stack.extend(a.as_slice().iter().map(|v| (v, depth + 1)));
            }
            _ => {}
        }
    }
    deepest
}

/// The bytes `table` takes on the wire (its length prefix included).
pub fn encoded_len(table: &FieldTable) -> usize {
    let mut len = 4;
    let mut stack: Vec<&AMQPValue> = Vec::new();
    for (key, value) in table.inner() {
        len += 1 + key.as_str().len();
        stack.push(value);
    }
    while let Some(value) = stack.pop() {
        // The type tag, then the value.
        len += 1 + match value {
            AMQPValue::Boolean(_) | AMQPValue::ShortShortInt(_) | AMQPValue::ShortShortUInt(_) => 1,
            AMQPValue::ShortInt(_) | AMQPValue::ShortUInt(_) => 2,
            AMQPValue::LongInt(_) | AMQPValue::LongUInt(_) | AMQPValue::Float(_) => 4,
            AMQPValue::LongLongInt(_) | AMQPValue::Double(_) | AMQPValue::Timestamp(_) => 8,
            AMQPValue::DecimalValue(_) => 5,
            AMQPValue::ShortString(s) => 1 + s.as_str().len(),
            AMQPValue::LongString(s) => 4 + s.as_bytes().len(),
            AMQPValue::ByteArray(b) => 4 + b.as_slice().len(),
            AMQPValue::Void => 0,
            AMQPValue::FieldArray(a) => {
                stack.extend(a.as_slice());
                4
            }
            AMQPValue::FieldTable(t) => {
                for (key, value) in t.inner() {
                    len += 1 + key.as_str().len();
                    stack.push(value);
                }
                4
            }
        };
    }
    len
}

/// The headers a copy of a message carries over, for a connection whose
/// frames are at most `frame_max` bytes: the original ones when they leave
/// room for the rest of the content header, else none but
/// [`DROPPED_HEADER`] saying how many bytes were left out.
pub fn carried_over(original: Option<&FieldTable>, frame_max: u32) -> FieldTable {
    let Some(original) = original else {
        return FieldTable::default();
    };
    let size = encoded_len(original);
    let room = (frame_max as usize).saturating_sub(FRAME_ROOM);
    if size <= room {
        return original.clone();
    }
    let mut table = FieldTable::default();
    table.insert(
        DROPPED_HEADER.into(),
        AMQPValue::LongString(
            format!("{size} bytes of the original headers did not fit a frame beside sas's own")
                .into(),
        ),
    );
    table
}

#[cfg(test)]
mod tests {
    use lapin::types::{FieldArray, LongString};

    use super::*;

    fn nested(levels: usize) -> FieldTable {
        let mut value = AMQPValue::Boolean(true);
        for _ in 0..levels {
            value = AMQPValue::FieldArray(FieldArray::from(vec![value]));
        }
        let mut table = FieldTable::default();
        table.insert("h".into(), value);
        table
    }

    #[test]
    fn nesting_counts_tables_and_arrays_and_refuses_at_the_parsers_bound() {
        assert_eq!(nesting(&FieldTable::default()), 1);
        assert_eq!(nesting(&nested(1)), 2);
        assert_eq!(nesting(&nested(10)), 11);
        assert_eq!(refusal(None), None);
        assert_eq!(refusal(Some(&nested(MAX_NESTING - 2))), None);
        let refused = refusal(Some(&nested(MAX_NESTING - 1))).expect("refused");
        assert!(refused.contains("nested 64 levels"), "{refused}");
        // Deep enough to overflow a recursive walk's stack.
        let deep = nested(200_000);
        assert_eq!(nesting(&deep), 200_001);
        // Dropping so deep a value recurses in lapin's own types: leak it.
        std::mem::forget(deep);
    }

    #[test]
    fn the_encoded_length_is_what_goes_on_the_wire() {
        let mut table = FieldTable::default();
        table.insert("a".into(), AMQPValue::LongString(LongString::from("xyz")));
        table.insert("b".into(), AMQPValue::LongUInt(7));
        table.insert("c".into(), nested(2).inner()["h"].clone());
        let (wire, _) = cookie_factory::r#gen(
            lapin::types::generation::gen_field_table(&table),
            Vec::new(),
        )
        .expect("encodes");
        assert_eq!(encoded_len(&table), wire.len());
    }

    #[test]
    fn a_copy_carries_the_headers_over_only_when_they_leave_room() {
        let mut small = FieldTable::default();
        small.insert("x-app".into(), AMQPValue::LongString("v".into()));
        assert_eq!(carried_over(Some(&small), 16 * 1024), small);
        assert_eq!(carried_over(None, 16 * 1024), FieldTable::default());
        let mut large = FieldTable::default();
        large.insert(
            "x-pad".into(),
            AMQPValue::LongString(LongString::from(vec![b'p'; 12 * 1024])),
        );
        let copied = carried_over(Some(&large), 16 * 1024);
        assert!(copied.inner().get("x-pad").is_none());
        assert!(copied.inner().contains_key(DROPPED_HEADER));
        // A larger frame takes them.
        assert_eq!(carried_over(Some(&large), 128 * 1024), large);
    }
}

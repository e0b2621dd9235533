//! W3C trace context (`traceparent: 00-<trace id>-<parent id>-<flags>`), so
//! that one order's path through submission, scheduler, agents and remote
//! services is one trace: the trace id is kept with the order, and every hop
//! sends a `traceparent` with a span id of its own. Pure: no I/O.

use std::fmt;

/// A trace id and the id of the span that sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    /// 32 lowercase hex digits, not all zero.
    pub trace_id: String,
    /// 16 lowercase hex digits, not all zero.
    pub span_id: String,
}

/// The header name, in AMQP headers and HTTP.
pub const HEADER: &str = "traceparent";

fn hex_id(s: &str, len: usize) -> bool {
    s.len() == len
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        && s.bytes().any(|b| b != b'0')
}

fn random_hex(bytes: usize) -> String {
    let mut out = String::with_capacity(bytes * 2);
    while out.len() < bytes * 2 {
        out.push_str(&format!("{:016x}", fastrand::u64(1..)));
    }
    out.truncate(bytes * 2);
    out
}

impl TraceContext {
    /// A new trace.
    pub fn new_root() -> Self {
        Self {
            trace_id: random_hex(16),
            span_id: random_hex(8),
        }
    }

    /// Reads a `traceparent` value; `None` when it is not a valid version-00 one.
    ///
    /// Not OpenTelemetry's `TraceContextPropagator`: its 0.33 reads
    /// `00-abc-def-01` as a valid context (the ids left-padded with zeros),
    /// which W3C Trace Context forbids: a stranger's malformed header would
    /// be followed as a trace.
    pub fn parse(value: &str) -> Option<Self> {
        let mut parts = value.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version != "00" || parts.next().is_some() || flags.len() != 2 {
            return None;
        }
        (hex_id(trace, 32) && hex_id(span, 16)).then(|| Self {
            trace_id: trace.to_owned(),
            span_id: span.to_owned(),
        })
    }

    /// The context of a new span in the same trace (the next hop).
    pub fn child_of(trace_id: &str) -> Option<Self> {
        hex_id(trace_id, 32).then(|| Self {
            trace_id: trace_id.to_owned(),
            span_id: random_hex(8),
        })
    }
}

impl fmt::Display for TraceContext {
    /// The `traceparent` header value (sampled).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "00-{}-{}-01", self.trace_id, self.span_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_malformed_values() {
        let root = TraceContext::new_root();
        let header = root.to_string();
        assert_eq!(TraceContext::parse(&header), Some(root.clone()));
        let child = TraceContext::child_of(&root.trace_id).unwrap();
        assert_eq!(child.trace_id, root.trace_id);
        assert_ne!(child.span_id, root.span_id);
        for bad in [
            "",
            "00-abc-def-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad:?}");
        }
        assert!(
            TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
                .is_some()
        );
    }
}

//! Times on the wire: RFC 3339 in UTC with microseconds and a `Z` when sas
//! writes them; any offset when it reads them, within [`bounds`].

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Deserializer, Serializer};

/// What a time must be, as a reason quotes it.
pub const EXPECTED: &str = "an RFC 3339 timestamp from year 0001 to 9999 (UTC)";

/// The earliest and latest time sas accepts in a message: what every
/// reader of an RFC 3339 timestamp (four-digit years) and Postgres hold.
pub fn bounds() -> (DateTime<Utc>, DateTime<Utc>) {
    let earliest = DateTime::parse_from_rfc3339("0001-01-01T00:00:00Z");
    let latest = DateTime::parse_from_rfc3339("9999-12-31T23:59:59.999999Z");
    match (earliest, latest) {
        (Ok(a), Ok(b)) => (a.with_timezone(&Utc), b.with_timezone(&Utc)),
        // Constants that parse: unreachable, but never panic on it.
        _ => (DateTime::<Utc>::MIN_UTC, DateTime::<Utc>::MAX_UTC),
    }
}

/// An RFC 3339 timestamp within [`bounds`], in UTC.
pub fn parse(s: &str) -> Option<DateTime<Utc>> {
    let t = DateTime::parse_from_rfc3339(s).ok()?.with_timezone(&Utc);
    let (earliest, latest) = bounds();
    (earliest..=latest).contains(&t).then_some(t)
}

/// Formats a time the way sas writes it.
pub fn format(t: &DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// `#[serde(with = "rfc3339")]`: writes [`format()`].
pub fn serialize<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format(t))
}

/// `#[serde(with = "rfc3339")]`: reads what [`parse`] accepts.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
    let s = String::deserialize(d)?;
    parse(&s).ok_or_else(|| serde::de::Error::custom(EXPECTED))
}

/// The same for an optional time (absent or null is `None`).
pub mod option {
    use super::*;

    /// Writes [`super::format()`], or null.
    pub fn serialize<S: Serializer>(t: &Option<DateTime<Utc>>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => super::serialize(t, s),
            None => s.serialize_none(),
        }
    }

    /// Reads what [`super::parse`] accepts, or null.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<DateTime<Utc>>, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(None),
            Some(s) => super::parse(&s)
                .map(Some)
                .ok_or_else(|| serde::de::Error::custom(EXPECTED)),
        }
    }
}

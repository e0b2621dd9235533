//! SQL literals for the arguments of an `EXECUTE` sent as a simple query
//! ([`super::prepared`]): the one way to send a statement prepared by name
//! together with `BEGIN` or `COMMIT` in one round trip, which sqlx's bound
//! queries cannot.
//!
//! Strings are quoted with their quotes doubled, which is all a literal
//! needs while `standard_conforming_strings` is on (pinned in the
//! connection's start-up options, [`super::Plans`]): backslashes stay as
//! they are. An array is one string literal in the array syntax (`{"a",NULL}`),
//! its elements double-quoted with `"` and `\` escaped.

use chrono::{DateTime, Utc};
use uuid::Uuid;

/// A value that can stand in an SQL statement as a literal, on its own or
/// as an element of an array literal.
pub(super) trait Literal {
    /// Writes the bare literal (`NULL` for none).
    fn write(&self, out: &mut String);

    /// Writes the value as an element of an array literal's text (`NULL`
    /// for none), before that text is quoted as a string literal.
    fn write_element(&self, out: &mut String);
}

/// Writes `text` as a string literal.
fn quoted(text: &str, out: &mut String) {
    out.reserve(text.len() + 2);
    out.push('\'');
    for c in text.chars() {
        if c == '\'' {
            out.push('\'');
        }
        out.push(c);
    }
    out.push('\'');
}

/// Writes `text` as an array element: double-quoted, with `"` and `\`
/// escaped by a backslash.
fn element(text: &str, out: &mut String) {
    out.reserve(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
}

impl Literal for str {
    fn write(&self, out: &mut String) {
        quoted(self, out);
    }
    fn write_element(&self, out: &mut String) {
        element(self, out);
    }
}

impl Literal for String {
    fn write(&self, out: &mut String) {
        quoted(self, out);
    }
    fn write_element(&self, out: &mut String) {
        element(self, out);
    }
}

impl<T: Literal + ?Sized> Literal for &T {
    fn write(&self, out: &mut String) {
        (**self).write(out);
    }
    fn write_element(&self, out: &mut String) {
        (**self).write_element(out);
    }
}

/// Text that needs no escaping, quoted `q`.
fn plain_quoted(text: &str, q: char, out: &mut String) {
    out.push(q);
    out.push_str(text);
    out.push(q);
}

impl Literal for Uuid {
    fn write(&self, out: &mut String) {
        plain_quoted(
            self.hyphenated().encode_lower(&mut Uuid::encode_buffer()),
            '\'',
            out,
        );
    }
    fn write_element(&self, out: &mut String) {
        plain_quoted(
            self.hyphenated().encode_lower(&mut Uuid::encode_buffer()),
            '"',
            out,
        );
    }
}

/// Microseconds, truncated, as a bound parameter would be.
fn timestamp(at: &DateTime<Utc>) -> String {
    at.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
}

impl Literal for DateTime<Utc> {
    fn write(&self, out: &mut String) {
        plain_quoted(&timestamp(self), '\'', out);
    }
    fn write_element(&self, out: &mut String) {
        plain_quoted(&timestamp(self), '"', out);
    }
}

/// `bytea`, in hex.
impl Literal for Vec<u8> {
    fn write(&self, out: &mut String) {
        out.push('\'');
        hex(self, out);
        out.push('\'');
    }
    fn write_element(&self, out: &mut String) {
        // The element's backslash, escaped for the array's parser.
        out.push('"');
        out.push('\\');
        hex(self, out);
        out.push('"');
    }
}

/// `\x` and the bytes in hex.
fn hex(bytes: &[u8], out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.reserve(bytes.len() * 2 + 2);
    out.push_str("\\x");
    for b in bytes {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 0xf)]));
    }
}

macro_rules! plain {
    ($($t:ty),*) => {$(
        impl Literal for $t {
            fn write(&self, out: &mut String) {
                out.push_str(&self.to_string());
            }
            fn write_element(&self, out: &mut String) {
                out.push_str(&self.to_string());
            }
        }
    )*};
}

plain!(bool, i16, i32, i64);

impl<T: Literal> Literal for Option<T> {
    fn write(&self, out: &mut String) {
        match self {
            Some(v) => v.write(out),
            None => out.push_str("NULL"),
        }
    }
    fn write_element(&self, out: &mut String) {
        match self {
            Some(v) => v.write_element(out),
            None => out.push_str("NULL"),
        }
    }
}

/// The arguments of an `EXECUTE`, in order: `(a, b, …)`. They are untyped
/// literals: the prepared statement's parameter types read them, once per
/// argument (an array is one literal, read by the array's input function),
/// which costs the server far less than an `ARRAY[…]` expression would.
#[derive(Debug, Default)]
pub(super) struct Args {
    sql: String,
    /// An array's text, before it is quoted.
    scratch: String,
}

impl Args {
    /// Adds one value.
    pub fn scalar<T: Literal>(mut self, value: T) -> Self {
        self.next();
        value.write(&mut self.sql);
        self
    }

    /// Adds an array of values.
    pub fn array<T: Literal>(mut self, values: &[T]) -> Self {
        self.next();
        self.scratch.clear();
        self.scratch.push('{');
        for (i, v) in values.iter().enumerate() {
            if i > 0 {
                self.scratch.push(',');
            }
            v.write_element(&mut self.scratch);
        }
        self.scratch.push('}');
        quoted(&self.scratch, &mut self.sql);
        self
    }

    fn next(&mut self) {
        self.sql.push(if self.sql.is_empty() { '(' } else { ',' });
    }

    /// `EXECUTE name(args)`.
    pub fn execute(self, name: &str) -> String {
        let args = if self.sql.is_empty() {
            String::new()
        } else {
            self.sql + ")"
        };
        format!("EXECUTE {name}{args}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_are_doubled_and_array_elements_escaped() {
        let sql = Args::default()
            .scalar("it's a \\ test")
            .array(&[Some("a'b\"c\\".to_owned()), None])
            .execute("s");
        assert_eq!(sql, r#"EXECUTE s('it''s a \ test','{"a''b\"c\\",NULL}')"#);
    }

    #[test]
    fn empty_arrays_bytes_and_numbers() {
        let sql = Args::default()
            .array::<Uuid>(&[])
            .array(&[vec![0u8, 255, 16]])
            .array(&[1i16, -2])
            .scalar(true)
            .scalar(vec![1u8])
            .execute("s");
        assert_eq!(
            sql,
            r#"EXECUTE s('{}','{"\\x00ff10"}','{1,-2}',true,'\x01')"#
        );
        assert_eq!(Args::default().execute("s"), "EXECUTE s");
    }
}

//! Log lines that outside input cannot shape: every field of the pretty
//! format is written with its control characters (newlines, carriage
//! returns, ANSI escapes, C1 codes) and the invisible characters that
//! reorder or break lines (bidirectional overrides, line and paragraph
//! separators) escaped, as the JSON format escapes them. A signal name, a
//! header or a remote's answer that holds a newline so cannot forge a line.

use std::fmt;

use tracing::field::Field;
use tracing_subscriber::field::MakeExt as _;
use tracing_subscriber::field::delimited::Delimited;
use tracing_subscriber::fmt::format::{FieldFn, Writer, debug_fn};

/// How one field is written.
type WriteField = for<'w> fn(&mut Writer<'w>, &Field, &dyn fmt::Debug) -> fmt::Result;

/// The field formatter of the pretty format: `message` as its text, every
/// other field as `name=value`, separated by spaces, each escaped.
pub fn fields() -> Delimited<&'static str, FieldFn<WriteField>> {
    debug_fn(write_field as WriteField).delimited(" ")
}

fn write_field(writer: &mut Writer<'_>, field: &Field, value: &dyn fmt::Debug) -> fmt::Result {
    let text = format!("{value:?}");
    if field.name() != "message" {
        write!(writer, "{}=", field.name())?;
    }
    write_escaped(writer, &text)
}

/// Writes `text` with the characters that could shape a log line escaped.
pub fn write_escaped(out: &mut impl fmt::Write, text: &str) -> fmt::Result {
    for c in text.chars() {
        if shapes_lines(c) {
            write!(out, "{}", c.escape_default())?;
        } else {
            out.write_char(c)?;
        }
    }
    Ok(())
}

/// Whether `c` can end, start or reorder a line on a terminal or in a file.
fn shapes_lines(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{2028}' | '\u{2029}'                 // line and paragraph separators
            | '\u{200e}' | '\u{200f}'               // left-to-right and right-to-left marks
            | '\u{202a}'..='\u{202e}'               // bidirectional embeddings and overrides
            | '\u{2066}'..='\u{2069}') // bidirectional isolates
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex};

    use super::*;

    /// Everything written, shared with the subscriber.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().expect("not poisoned").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn logged(log: impl FnOnce()) -> String {
        let out = Captured::default();
        let sink = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || sink.clone())
            .with_ansi(false)
            .compact()
            .fmt_fields(fields())
            .finish();
        tracing::subscriber::with_default(subscriber, log);
        let bytes = out.0.lock().expect("not poisoned").clone();
        String::from_utf8(bytes).expect("UTF-8")
    }

    #[test]
    fn a_field_from_outside_cannot_forge_a_line_or_colour_the_terminal() {
        let forged =
            "pay\n2026-11-28T00:00:00Z  INFO order processed\r\u{1b}[31mred\u{202e}rtl\u{2028}";
        let text = logged(|| {
            let span = tracing::info_span!("signal", signal = %forged);
            let _in = span.enter();
            tracing::warn!(reason = %forged, name = forged, "refused {forged}");
        });
        assert_eq!(text.lines().count(), 1, "one line: {text:?}");
        for raw in ['\n', '\r', '\u{1b}', '\u{202e}', '\u{2028}'] {
            assert!(!text.trim_end().contains(raw), "{raw:?} escaped: {text:?}");
        }
        assert!(text.contains("\\n2026-11-28T00:00:00Z"), "{text}");
        assert!(text.contains("reason=pay\\n"), "{text}");
        assert!(
            text.contains("signal=pay\\n"),
            "the span's field too: {text}"
        );
    }

    #[test]
    fn ordinary_text_is_written_as_it_is() {
        let text = logged(|| tracing::info!(order_id = %"0192-ab", n = 3, "order é processed"));
        assert!(
            text.contains("order é processed order_id=0192-ab n=3"),
            "{text}"
        );
    }
}

//! Text for a terminal: what sasctl prints comes partly from strangers (a
//! remote's error text, a rejected body, a reason), and a control character
//! in it could move the cursor, rewrite earlier lines or retitle the window.
//! JSON output escapes them already; text output goes through here.

use std::borrow::Cow;

/// `text` with every control character but line feeds and tabs shown as an
/// escape (`\u{1b}`), so it prints as it is and does nothing.
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text
        .chars()
        .any(|c| c.is_control() && c != '\n' && c != '\t')
    {
        return Cow::Borrowed(text);
    }
    Cow::Owned(
        text.chars()
            .map(|c| match c {
                '\n' | '\t' => c.to_string(),
                c if c.is_control() => c.escape_unicode().to_string(),
                c => c.to_string(),
            })
            .collect(),
    )
}

/// `text` for one cell of a table: on one line, control characters escaped.
pub fn cell(text: &str) -> String {
    printable(&text.replace(['\n', '\r', '\t'], " ")).into_owned()
}

/// A time as sasctl's tables show it: UTC to the millisecond (machine
/// output, `--json`, uses the messages' RFC 3339 instead).
pub fn time(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S%.3fZ").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_shown_not_obeyed() {
        assert_eq!(printable("plain\ttext\n"), "plain\ttext\n");
        assert_eq!(printable("a\u{1b}[2Jb\u{7}"), "a\\u{1b}[2Jb\\u{7}");
        assert_eq!(printable("\u{9b}31m"), "\\u{9b}31m", "C1 controls too");
        assert_eq!(
            cell("two\nlines\r\u{1b}]0;title\u{7}"),
            "two lines \\u{1b}]0;title\\u{7}"
        );
    }
}

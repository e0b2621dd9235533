//! TLS and secrets around every connection sas makes: the one rustls crypto
//! provider of the process, the PEM files named in the configuration, and
//! the redaction of passwords from connection URLs.
//!
//! Every TLS connection goes through rustls with the `ring` provider (no
//! OpenSSL, and no aws-lc-sys C build): sqlx to Postgres, lapin to RabbitMQ
//! (`amqps://`) and reqwest to HTTPS remotes. Each trusts the system's root
//! certificates plus the CA file its section names (`database.ca_file`,
//! `broker.ca_file`, `agent.ca_file`).
//!
//! A connection URL may carry a password (`postgres://user:secret@host/db`,
//! `amqps://user:secret@host`). [`redact_url`] and [`redact`] are the one way
//! such a URL or a text that may quote it is shown: logs, errors and
//! operator tools print what they return, never the configured string.

use std::path::{Path, PathBuf};
use std::sync::Once;

/// What is wrong with a TLS file named in the configuration.
#[derive(Debug, thiserror::Error)]
pub enum TlsFileError {
    /// The file cannot be read.
    #[error("{key} {}: {source}", path.display())]
    Read {
        key: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file holds no PEM block of the kind wanted.
    #[error("{key} {}: no PEM {wanted} in the file", path.display())]
    NoPem {
        key: &'static str,
        path: PathBuf,
        wanted: &'static str,
    },
}

/// Installs rustls's `ring` provider as the process's default, once.
///
/// reqwest is built without a provider of its own (`rustls-no-provider`,
/// which keeps aws-lc-sys out of the build) and panics when it builds a
/// client before one is installed: call this before any `reqwest::Client`
/// is built. sqlx and lapin pick `ring` themselves; installing it as the
/// default keeps all three on the same one.
pub fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Err means another provider is installed already: keep it.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// Reads a PEM file named by configuration key `key`, checking that it
/// holds at least one block whose label contains `wanted` (`CERTIFICATE`,
/// `PRIVATE KEY`), so a wrong path or a wrong file fails at start-up with a
/// line naming the key, not at the first handshake.
pub fn read_pem(
    key: &'static str,
    path: &Path,
    wanted: &'static str,
) -> Result<Vec<u8>, TlsFileError> {
    let bytes = std::fs::read(path).map_err(|source| TlsFileError::Read {
        key,
        path: path.to_path_buf(),
        source,
    })?;
    let text = String::from_utf8_lossy(&bytes);
    let has_block = text.lines().any(|line| {
        line.trim()
            .strip_prefix("-----BEGIN ")
            .is_some_and(|label| label.contains(wanted))
    });
    if !has_block {
        return Err(TlsFileError::NoPem {
            key,
            path: path.to_path_buf(),
            wanted,
        });
    }
    Ok(bytes)
}

/// What replaces a password wherever it would be shown.
pub const MASK: &str = "***";

/// The URL (or list of URLs) with everything that may be a secret replaced
/// by [`MASK`]: the userinfo's password and any parameter whose name says
/// it is one (see `secret_spans`). The rest is kept, so an operator still
/// sees the user, hosts, ports, database and other parameters. A text
/// that holds no such piece is returned unchanged.
///
/// This must hold for any text a setting may hold, not only well-formed
/// URLs: where it cannot tell a secret from the rest, it masks more.
pub fn redact_url(url: &str) -> String {
    let mut out = String::with_capacity(url.len());
    let mut at = 0;
    for span in secret_spans(url) {
        out.push_str(&url[at..span.start]);
        out.push_str(MASK);
        at = span.end;
    }
    out.push_str(&url[at..]);
    out
}

/// The byte ranges of `text` that may be secrets, sorted and disjoint:
///
/// - The password of each URL's userinfo. `text` may be a list of URLs
///   (`amqp://u:p@h1,amqps://u:p@h2`): a URL starts at a `scheme://` that
///   begins the text or follows a comma or white space. Its userinfo runs
///   to the URL's last `@` (a password may hold `@`, `/`, `?`, `#` or `,`
///   unescaped), and the password is what follows its first `:`.
/// - Text before the first such URL that holds an `@` is a URL without
///   `//` (`amqp:user:secret@host`), whose scheme, user and password
///   cannot be told apart: everything between its first `:` and its last
///   `@` is masked.
/// - The value of every `key=value` whose key names a secret (`password`,
///   `sslpassword`, `pass`, `secret`, `token`…: see [`is_secret_key`]),
///   in a query string or a libpq keyword/value string: up to the next `&`
///   or white space, or the closing quote of a quoted value.
fn secret_spans(text: &str) -> Vec<std::ops::Range<usize>> {
    let mut spans = Vec::new();
    let starts = url_starts(text);
    let first = starts.first().map_or(text.len(), |&(start, _)| start);
    // Text before the first `scheme://`: a URL without `//`, or no URL.
    if let Some(last_at) = text[..first].rfind('@')
        && let Some(colon) = text[..last_at].find(':')
    {
        spans.push(colon + 1..last_at);
    }
    for (i, &(_, authority)) in starts.iter().enumerate() {
        let end = starts.get(i + 1).map_or(text.len(), |&(next, _)| next);
        let url = &text[authority..end];
        if let Some(last_at) = url.rfind('@')
            && let Some(colon) = url[..last_at].find(':')
        {
            spans.push(authority + colon + 1..authority + last_at);
        }
    }
    spans.extend(secret_values(text));
    spans.retain(|s| !s.is_empty());
    spans.sort_by_key(|s| (s.start, std::cmp::Reverse(s.end)));
    // Overlapping spans (a `password=` inside a masked userinfo) merge.
    let mut merged: Vec<std::ops::Range<usize>> = Vec::with_capacity(spans.len());
    for span in spans {
        match merged.last_mut() {
            Some(last) if span.start <= last.end => last.end = last.end.max(span.end),
            _ => merged.push(span),
        }
    }
    merged
}

/// Where each URL of a list begins: `(scheme's start, authority's start)`
/// for every `scheme://` at the start of `text` or after a separator (a
/// comma, white space, `;`, `=`, an opening bracket or quote). A `://`
/// elsewhere (after the `:` of a password) starts nothing.
fn url_starts(text: &str) -> Vec<(usize, usize)> {
    let is_scheme = |c: char| c.is_ascii_alphanumeric() || "+-.".contains(c);
    let mut starts = Vec::new();
    let mut from = 0;
    while let Some(found) = text[from..].find("://") {
        let at = from + found;
        let start = text[..at]
            .char_indices()
            .rev()
            .find(|&(_, c)| !is_scheme(c))
            .map_or(0, |(i, c)| i + c.len_utf8());
        // After a separator, not after a `:`, `/` or `@` of a password.
        let separated = text[..start]
            .chars()
            .next_back()
            .is_none_or(|c| c.is_whitespace() || ",;=([{<\"'`".contains(c));
        if start < at && separated {
            starts.push((start, at + 3));
        }
        from = at + 3;
    }
    starts
}

/// Whether a parameter named `key` holds a secret. Unsure means yes: a
/// masked `passfile` costs an operator a look at the configuration, a
/// shown password costs the password.
fn is_secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    ["pass", "pwd", "secret", "token"]
        .iter()
        .any(|word| key.contains(word))
}

/// The values of the `key=value` pairs of `text` whose key names a
/// secret ([`is_secret_key`]).
fn secret_values(text: &str) -> Vec<std::ops::Range<usize>> {
    let is_key = |c: char| c.is_ascii_alphanumeric() || "_-.".contains(c);
    let mut spans = Vec::new();
    let mut from = 0;
    while let Some(found) = text[from..].find('=') {
        let eq = from + found;
        from = eq + 1;
        let key_start = text[..eq]
            .char_indices()
            .rev()
            .find(|&(_, c)| !is_key(c))
            .map_or(0, |(i, c)| i + c.len_utf8());
        if !is_secret_key(&text[key_start..eq]) {
            continue;
        }
        let value = &text[eq + 1..];
        let len = match value.chars().next() {
            Some(quote @ ('\'' | '"')) => value[1..].find(quote).map_or(value.len(), |i| i + 2),
            _ => value
                .find(|c: char| c == '&' || c.is_whitespace())
                .unwrap_or(value.len()),
        };
        spans.push(eq + 1..eq + 1 + len);
        from = eq + 1 + len;
    }
    spans
}

/// The secrets a configured URL (or list of URLs) carries, as written
/// and percent-decoded, with their pieces at each `:`, `@`, `#`, `/`, `?` and `,` (so that a
/// password quoted alone is found even when the span masked with it the
/// user name of a URL without `//`): what [`redact`] must never let
/// through.
fn passwords(url: &str) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    for span in secret_spans(url) {
        let secret = &url[span];
        found.push(secret.to_owned());
        for (i, _) in secret.match_indices(':') {
            found.push(secret[i + 1..].to_owned());
        }
        // Garbage (`::::secret@@@`) is cut where a secret may end too.
        found.extend(
            secret
                .split([':', '@', '#', '/', '?', ','])
                .map(str::to_owned),
        );
        // A quoted keyword value (`password='a b'`) is also quoted bare.
        found.push(secret.trim_matches(['\'', '"']).to_owned());
    }
    let decoded: Vec<String> = found.iter().map(|p| percent_decode(p)).collect();
    found.extend(decoded);
    found.retain(|p| !p.is_empty());
    // Longest first, so a password that contains another is masked whole.
    found.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
    found.dedup();
    found
}

/// `text` (an error message, a log line) with every word of it that may
/// hold a secret shown as [`redact_url`] shows it, and every secret that
/// the URLs of `urls` carry (`passwords`) masked wherever it appears:
/// for messages from libraries that may quote what they were given, whole
/// or in pieces.
pub fn redact<'a>(text: &str, urls: impl IntoIterator<Item = &'a str>) -> String {
    let urls: Vec<&str> = urls.into_iter().filter(|u| !u.is_empty()).collect();
    let mut out = text.to_owned();
    for url in &urls {
        if out.contains(url) {
            out = out.replace(url, &redact_url(url));
        }
    }
    out = mask_words(&out);
    for url in urls {
        for password in passwords(url) {
            out = mask_password(&out, &password);
        }
    }
    out
}

/// Passwords at least this long are masked wherever they appear; shorter
/// ones only where they stand alone, so that a password such as `sas`
/// does not turn every `sas` of a message into [`MASK`].
const MASK_ANYWHERE: usize = 6;

/// `text` with `password` masked: anywhere when it is long, as a whole word
/// (no letter, digit or `_` on either side) when it is short.
fn mask_password(text: &str, password: &str) -> String {
    if password.len() >= MASK_ANYWHERE {
        return text.replace(password, MASK);
    }
    let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(password) {
        let end = at + password.len();
        let alone = !word(rest[..at].chars().next_back()) && !word(rest[end..].chars().next());
        out.push_str(&rest[..at]);
        out.push_str(if alone { MASK } else { password });
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// Every word of `text` (a run without white space or quotes) passed
/// through [`redact_url`], which leaves a word holding no secret as it is.
fn mask_words(text: &str) -> String {
    let delimiter = |c: char| c.is_whitespace() || "\"'`<>".contains(c);
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(end) = rest.find(delimiter) {
        out.push_str(&redact_url(&rest[..end]));
        let d = rest[end..].chars().next().map_or(1, char::len_utf8);
        out.push_str(&rest[end..end + d]);
        rest = &rest[end + d..];
    }
    out.push_str(&redact_url(rest));
    out
}

/// `%XX` escapes decoded; anything malformed is kept as written.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(hex) = text.get(i + 1..i + 3)
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_passwords_and_keep_the_rest() {
        let cases = [
            (
                "postgres://sas:s3cret@db.example:5432/sas?sslmode=verify-full",
                "postgres://sas:***@db.example:5432/sas?sslmode=verify-full",
            ),
            (
                "amqps://guest:guest@127.0.0.1:5671/%2f",
                "amqps://guest:***@127.0.0.1:5671/%2f",
            ),
            ("amqp://user@host", "amqp://user@host"),
            ("postgres://host/db", "postgres://host/db"),
            (
                "postgres://u:p%40ss@h/db?password=other&sslmode=require",
                "postgres://u:***@h/db?password=***&sslmode=require",
            ),
            ("https://a:b@c@remote/x#f", "https://a:***@remote/x#f"),
            ("not a url", "not a url"),
        ];
        for (url, shown) in cases {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }

    #[test]
    fn texts_that_quote_a_url_or_its_password_are_masked() {
        let url = "postgres://sas:p%40ss%20word@db/sas";
        let text = format!("connecting to {url} failed: bad password 'p@ss word' or p%40ss%20word");
        let shown = redact(&text, [url]);
        assert!(!shown.contains("p@ss word"), "{shown}");
        assert!(!shown.contains("p%40ss%20word"), "{shown}");
        assert!(shown.contains("postgres://sas:***@db/sas"), "{shown}");
        assert_eq!(redact("nothing secret", [url, ""]), "nothing secret");
        assert_eq!(redact("no password", ["amqp://guest@h"]), "no password");
        // A short password is masked where it stands alone, not inside words.
        assert_eq!(
            redact(
                "user sas of sasctl: password 'sas' refused",
                ["amqp://sas:sas@h/"]
            ),
            "user *** of sasctl: password '***' refused"
        );
        // A URL the caller did not name is masked all the same.
        assert_eq!(
            redact("bad: 'amqp://u:pw@h:1/%2f' (x) and https://a:b@c/d)", []),
            "bad: 'amqp://u:***@h:1/%2f' (x) and https://a:***@c/d)"
        );
    }

    /// Every shape a setting may hold, and the secret it must never show.
    const SHAPES: &[(&str, &str)] = &[
        ("amqp:user:s3cr3t@127.0.0.1:1", "s3cr3t"),
        ("amqp:s3cr3t@127.0.0.1:1", "s3cr3t"),
        ("user:s3cr3t@host", "s3cr3t"),
        ("amqp:/user:s3cr3t@host/%2f", "s3cr3t"),
        ("amqp://user:s3/cr3t@127.0.0.1:1", "s3/cr3t"),
        ("amqp://user:s3#cr3t@127.0.0.1:1", "s3#cr3t"),
        ("amqp://user:s3?cr3t@127.0.0.1:1/v?x=1", "s3?cr3t"),
        ("amqp://user:s3@cr@3t@127.0.0.1:1", "s3@cr@3t"),
        ("amqp://user:s3,cr3t@h1,amqp://user:s3,cr3t@h2", "s3,cr3t"),
        ("amqp://user:pa://ss@host", "pa://ss"),
        ("amqps://u:p%40ss%2Fword@h:5671/%2f", "p%40ss%2Fword"),
        ("amqp://u:s3cr3t@h1:1,amqp:u:s3cr3t@h2:2", "s3cr3t"),
        ("amqp://u@h1:1, amqps://v:s3cr3t@h2:2", "s3cr3t"),
        (
            "postgres://u:s3cr3t@h1:5432,h2:5433/db?target_session_attrs=read-write",
            "s3cr3t",
        ),
        ("postgresql://u:s3/cr3t@127.0.0.1:5432/db", "s3/cr3t"),
        ("postgres:u:s3cr3t@127.0.0.1/db", "s3cr3t"),
        (
            "postgres://h/db?user=u&password=s3cr3t&sslmode=require",
            "s3cr3t",
        ),
        ("postgres://h/db?PASSWORD=s3cr3t", "s3cr3t"),
        ("postgres://h/db?sslpassword=s3cr3t#frag", "s3cr3t"),
        ("host=h1,h2 user=u password=s3cr3t dbname=sas", "s3cr3t"),
        ("host=h user=u password='s3 cr3t' dbname=sas", "s3 cr3t"),
        ("amqp://h?auth_token=s3cr3t", "s3cr3t"),
        ("::::s3cr3t@@@", "s3cr3t"),
        (":s3cr3t@", "s3cr3t"),
        ("пароль:s3cr3t@хост", "s3cr3t"),
        ("amqp://ü:s3cr3tü@ö/", "s3cr3tü"),
    ];

    #[test]
    fn no_shape_of_url_shows_its_secret() {
        for (url, secret) in SHAPES {
            let shown = redact_url(url);
            assert!(!shown.contains(secret), "{url} shown as {shown}");
            assert!(shown.contains(MASK), "{url} shown as {shown}");
            // Quoted by a library, whole, alone or decoded: masked.
            let decoded = percent_decode(secret);
            for text in [
                format!("cannot connect to {url}: refused"),
                format!("bad URL {url:?}"),
                format!("password {secret} is wrong"),
                format!("password '{decoded}' is wrong"),
            ] {
                let shown = redact(&text, [*url]);
                assert!(!shown.contains(secret), "{url}: {text} shown as {shown}");
                assert!(!shown.contains(&decoded), "{text} shown as {shown}");
            }
        }
    }

    #[test]
    fn texts_with_no_configured_url_lose_what_looks_like_a_secret() {
        for (url, secret) in SHAPES {
            // Quoted as a word (a TOML error quotes the line it stopped at).
            let text = format!("bad configuration: url = \"{url}\" at line 3");
            let shown = redact(&text, []);
            if url.contains(' ') {
                continue; // A quoted value with a space spans words.
            }
            assert!(!shown.contains(secret), "{text} shown as {shown}");
        }
        assert_eq!(
            redact("order 7 of alice@example.com: state failed at 12:00", []),
            "order 7 of alice@example.com: state failed at 12:00",
            "a text without a secret is unchanged"
        );
    }

    #[test]
    fn lists_keep_their_hosts_and_users() {
        assert_eq!(
            redact_url("amqp://u:a@h1:5672/%2f,amqps://v:b@h2,amqp://w@h3"),
            "amqp://u:***@h1:5672/%2f,amqps://v:***@h2,amqp://w@h3"
        );
        assert_eq!(
            redact_url("postgres://u:p@h1:5432,h2:5433/sas?sslmode=verify-full"),
            "postgres://u:***@h1:5432,h2:5433/sas?sslmode=verify-full"
        );
        assert_eq!(redact_url("amqp:user:s3cr3t@host:1"), "amqp:***@host:1");
        assert_eq!(
            redact_url("host=h port=5432 password=x dbname=d"),
            "host=h port=5432 password=*** dbname=d"
        );
        assert_eq!(redact_url(""), "");
        assert_eq!(redact_url("@"), "@");
        assert_eq!(redact_url("://"), "://");
    }

    #[test]
    fn a_pem_file_must_exist_and_hold_the_wanted_block() {
        let dir = std::env::temp_dir().join(format!("sas-tls-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("dir");
        let missing = dir.join("missing.pem");
        let err = read_pem("broker.ca_file", &missing, "CERTIFICATE").expect_err("missing");
        assert!(err.to_string().starts_with("broker.ca_file "), "{err}");
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "hello").expect("write");
        let err = read_pem("broker.ca_file", &junk, "CERTIFICATE").expect_err("junk");
        assert!(err.to_string().contains("no PEM CERTIFICATE"), "{err}");
        let pem = dir.join("ca.pem");
        std::fs::write(
            &pem,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .expect("write");
        read_pem("broker.ca_file", &pem, "CERTIFICATE").expect("a certificate block");
        std::fs::remove_dir_all(dir).ok();
    }
}

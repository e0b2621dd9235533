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

/// The URL with its password (the userinfo's, and a `password=` query
/// parameter's) replaced by [`MASK`]; anything else is kept, so an operator
/// still sees the user, host, port, database and parameters. A text that is
/// not a URL is returned unchanged.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_owned();
    };
    let rest_start = scheme_end + 3;
    let rest = &url[rest_start..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let mut out = String::with_capacity(url.len());
    out.push_str(&url[..rest_start]);
    // The userinfo ends at the authority's last '@' (a password may hold '@'
    // unescaped, a host never does).
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            match userinfo.split_once(':') {
                Some((user, _password)) => {
                    out.push_str(user);
                    out.push(':');
                    out.push_str(MASK);
                }
                None => out.push_str(userinfo),
            }
            out.push('@');
            out.push_str(host);
        }
        None => out.push_str(authority),
    }
    let tail = &rest[authority_end..];
    match tail.split_once('?') {
        Some((path, query)) => {
            out.push_str(path);
            out.push('?');
            let (query, fragment) = match query.split_once('#') {
                Some((q, f)) => (q, Some(f)),
                None => (query, None),
            };
            let params: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}={MASK}"),
                    _ => pair.to_owned(),
                })
                .collect();
            out.push_str(&params.join("&"));
            if let Some(f) = fragment {
                out.push('#');
                out.push_str(f);
            }
        }
        None => out.push_str(tail),
    }
    out
}

/// The passwords a URL carries, as written and percent-decoded: what
/// [`redact`] must never let through.
fn passwords(url: &str) -> Vec<String> {
    let Some(scheme_end) = url.find("://") else {
        return Vec::new();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let mut found = Vec::new();
    if let Some((userinfo, _)) = rest[..authority_end].rsplit_once('@')
        && let Some((_, password)) = userinfo.split_once(':')
    {
        found.push(password.to_owned());
    }
    if let Some((_, query)) = rest[authority_end..].split_once('?') {
        let query = query.split('#').next().unwrap_or_default();
        for pair in query.split('&') {
            if let Some((k, v)) = pair.split_once('=')
                && k.eq_ignore_ascii_case("password")
            {
                found.push(v.to_owned());
            }
        }
    }
    let decoded: Vec<String> = found.iter().map(|p| percent_decode(p)).collect();
    found.extend(decoded);
    found.retain(|p| !p.is_empty());
    // Longest first, so a password that contains another is masked whole.
    found.sort_by_key(|p| std::cmp::Reverse(p.len()));
    found.dedup();
    found
}

/// `text` (an error message, a log line) with any URL in it shown as
/// [`redact_url`] shows it, and every password that the URLs of `urls`
/// carry masked wherever it appears: for messages from libraries that may
/// quote what they were given, whole or in pieces.
pub fn redact<'a>(text: &str, urls: impl IntoIterator<Item = &'a str>) -> String {
    let mut out = mask_embedded_urls(text);
    for url in urls {
        if url.is_empty() {
            continue;
        }
        if out.contains(url) {
            out = out.replace(url, &redact_url(url));
        }
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

/// Every `scheme://…` in `text` passed through [`redact_url`]; a URL ends
/// at white space or a quote.
fn mask_embedded_urls(text: &str) -> String {
    let is_scheme = |c: char| c.is_ascii_alphanumeric() || "+-.".contains(c);
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let start = rest[..at]
            .char_indices()
            .rev()
            .find(|&(_, c)| !is_scheme(c))
            .map_or(0, |(i, c)| i + c.len_utf8());
        let end = rest[at..]
            .find(|c: char| c.is_whitespace() || "\"'`<>".contains(c))
            .map_or(rest.len(), |i| at + i);
        out.push_str(&rest[..start]);
        out.push_str(&redact_url(&rest[start..end]));
        rest = &rest[end..];
    }
    out.push_str(rest);
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

//! The Host and Origin allow-list, against DNS rebinding and cross-site
//! requests: a page on another site whose name is made to resolve to the
//! dashboard's address still sends its own name as `Host`, and a cross-site
//! request carries its own `Origin`.
//!
//! - Every request to the dashboard must carry exactly one `Host` header, a
//!   host name or address with an optional port, and a request target in
//!   absolute form (`GET http://host/ …`) must name that same host: anything
//!   else is answered 400, as RFC 9112 §3.2 asks, before any handler runs
//!   (two `Host`s are how a request is made to mean one host to a proxy
//!   and another to us).
//! - It must name an allowed host (any port): `localhost`, `127.0.0.1`,
//!   `[::1]`, `http.host` and `dashboard.allowed_hosts`. Anything else is
//!   answered 421.
//! - A request that may change something (any method but GET, HEAD and
//!   OPTIONS) whose `Origin` is present must come from the origin it is sent
//!   to: the `Origin`'s host and port equal `Host`. Anything else, `null`
//!   included, is answered 403. (A proxy in front must pass `Host` through.)

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// The host names requests may address.
#[derive(Debug, Clone)]
pub struct AllowedHosts {
    /// Lower-case names, IPv6 addresses in brackets.
    names: Vec<String>,
}

impl AllowedHosts {
    /// The loopback names, the bind host (unless it is a wildcard address)
    /// and `extra`.
    pub fn new(bind_host: &str, extra: &[String]) -> Self {
        let mut names: Vec<String> = ["localhost", "127.0.0.1", "[::1]"]
            .into_iter()
            .map(str::to_owned)
            .collect();
        let bind = bind_host.trim().to_ascii_lowercase();
        if !matches!(bind.as_str(), "" | "0.0.0.0" | "::" | "[::]") {
            names.push(if bind.contains(':') && !bind.starts_with('[') {
                format!("[{bind}]")
            } else {
                bind
            });
        }
        names.extend(extra.iter().map(|h| normalize(h)));
        names.sort();
        names.dedup();
        Self { names }
    }

    /// Whether a `Host` header value (`name[:port]`) names an allowed host.
    pub fn allows(&self, host: &str) -> bool {
        host_name(host).is_some_and(|name| self.names.contains(&name))
    }
}

/// Lower case without a trailing dot (`Example.COM.` is `example.com`).
fn normalize(name: &str) -> String {
    name.trim().trim_end_matches('.').to_ascii_lowercase()
}

/// The name part of `name[:port]` or `[v6][:port]`, normalized; `None` when
/// the value is not of that shape (a name is letters, digits, `.`, `-` and
/// `_`; a bracketed address must be an IPv6 address). Stricter than
/// `http::uri::Authority`, which also takes a user (`a@host`) and any port
/// text: a `Host` is only ever a name and a port.
fn host_name(authority: &str) -> Option<String> {
    let authority = authority.trim();
    let (name, port) = match authority.strip_prefix('[') {
        Some(rest) => {
            let (v6, after) = rest.split_once(']')?;
            let port = match after {
                "" => None,
                after => Some(after.strip_prefix(':')?),
            };
            (format!("[{v6}]"), port)
        }
        None => match authority.split_once(':') {
            Some((name, port)) => (name.to_owned(), Some(port)),
            None => (authority.to_owned(), None),
        },
    };
    if port.is_some_and(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit())) {
        return None;
    }
    let name = normalize(&name);
    let well_formed = match name.strip_prefix('[').and_then(|n| n.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => {
            !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
        }
    };
    well_formed.then_some(name)
}

/// Whether `origin` (`scheme://host[:port]`) is the origin of a request to `host`.
fn same_origin(origin: &str, host: &str) -> bool {
    let Some((scheme, authority)) = origin.trim().split_once("://") else {
        return false;
    };
    let default_port = match scheme.to_ascii_lowercase().as_str() {
        "http" => ":80",
        "https" => ":443",
        _ => return false,
    };
    let strip = |a: &str| {
        let a = a.to_ascii_lowercase();
        a.strip_suffix(default_port).map(str::to_owned).unwrap_or(a)
    };
    !authority.contains('/') && strip(authority) == strip(host.trim())
}

/// The request's one `Host` header, if it has exactly one and it parses;
/// a request target in absolute form must name the same host.
fn single_host<'h>(uri: &Uri, headers: &'h HeaderMap) -> Option<&'h str> {
    let mut sent = headers.get_all(header::HOST).iter();
    let (Some(host), None) = (sent.next(), sent.next()) else {
        return None;
    };
    let host = host.to_str().ok()?;
    host_name(host)?;
    match uri.authority() {
        Some(target) if !target.as_str().eq_ignore_ascii_case(host.trim()) => None,
        _ => Some(host),
    }
}

/// Why a request is refused, if it is: the status and the reason.
fn check(
    hosts: &AllowedHosts,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<(), (StatusCode, &'static str)> {
    let Some(host) = single_host(uri, headers) else {
        return Err((
            StatusCode::BAD_REQUEST,
            "a request must carry exactly one Host header: a host name with an optional port",
        ));
    };
    if !hosts.allows(host) {
        return Err((
            StatusCode::MISDIRECTED_REQUEST,
            "this host name is not one the dashboard answers to (dashboard.allowed_hosts)",
        ));
    }
    let safe = matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS);
    if !safe {
        // Every `Origin` sent (a browser sends one) must be this origin.
        let foreign = headers
            .get_all(header::ORIGIN)
            .iter()
            .any(|origin| !same_origin(origin.to_str().unwrap_or_default(), host));
        if foreign {
            return Err((
                StatusCode::FORBIDDEN,
                "a request from another site cannot act on the dashboard",
            ));
        }
    }
    Ok(())
}

/// The middleware in front of every dashboard route (not the health and
/// metrics endpoints, which carry no credentials and change nothing).
pub async fn guard(
    State(hosts): State<Arc<AllowedHosts>>,
    request: Request,
    next: Next,
) -> Response {
    match check(&hosts, request.method(), request.uri(), request.headers()) {
        Ok(()) => next.run(request).await,
        Err((status, message)) => {
            tracing::warn!(
                %status,
                host = ?request.headers().get_all(header::HOST).iter().collect::<Vec<_>>(),
                origin = ?request.headers().get(header::ORIGIN),
                path = request.uri().path(),
                "dashboard: request without one allowed host, or from another site, refused"
            );
            (status, axum::Json(json!({ "error": message }))).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn a_request_must_carry_one_host_that_parses() {
        let uri = Uri::from_static("/login");
        let refused = |headers: &HeaderMap, uri: &Uri| {
            check(&hosts(), &Method::GET, uri, headers).map_err(|(status, _)| status)
        };
        let mut two = HeaderMap::new();
        two.append(header::HOST, HeaderValue::from_static("127.0.0.1:9105"));
        two.append(header::HOST, HeaderValue::from_static("127.0.0.1:9105"));
        assert_eq!(refused(&two, &uri), Err(StatusCode::BAD_REQUEST), "twice");
        for bad in [
            "",
            "localhost, evil.example",
            "localhost:9105/x",
            "user@localhost",
            "[not-v6]:9105",
            "localhost:99x",
            "local host",
        ] {
            let mut one = HeaderMap::new();
            one.insert(header::HOST, HeaderValue::from_static(bad));
            assert_eq!(refused(&one, &uri), Err(StatusCode::BAD_REQUEST), "{bad:?}");
        }
        let mut one = HeaderMap::new();
        one.insert(header::HOST, HeaderValue::from_static("127.0.0.1:9105"));
        assert_eq!(refused(&one, &uri), Ok(()));
        // An absolute-form target must name the same host as `Host`.
        let same = Uri::from_static("http://127.0.0.1:9105/login");
        assert_eq!(refused(&one, &same), Ok(()));
        let other = Uri::from_static("http://evil.example/login");
        assert_eq!(refused(&one, &other), Err(StatusCode::BAD_REQUEST));
    }

    fn hosts() -> AllowedHosts {
        AllowedHosts::new("10.0.0.7", &["Sas.Example.com".to_owned()])
    }

    #[test]
    fn loopback_the_bind_host_and_the_listed_names_are_allowed_on_any_port() {
        let hosts = hosts();
        for ok in [
            "localhost",
            "localhost:9105",
            "127.0.0.1:1",
            "[::1]:9105",
            "[::1]",
            "10.0.0.7:9105",
            "sas.example.com",
            "SAS.example.com.:443",
        ] {
            assert!(hosts.allows(ok), "{ok}");
        }
        for bad in [
            "",
            "evil.example",
            "localhost.evil.example",
            "127.0.0.2",
            "localhost:x",
            "localhost:",
            "[::1]x",
            "[::2]:9105",
            "sas.example.com:80:80",
        ] {
            assert!(!hosts.allows(bad), "{bad}");
        }
        let v6 = AllowedHosts::new("fd00::7", &[]);
        assert!(v6.allows("[fd00::7]:9105"));
        let any = AllowedHosts::new("0.0.0.0", &[]);
        assert!(!any.allows("0.0.0.0:9105"));
    }

    fn request(method: Method, pairs: &[(&'static str, &'static str)]) -> Result<(), StatusCode> {
        let mut headers = HeaderMap::new();
        for (k, v) in pairs {
            headers.insert(*k, HeaderValue::from_static(v));
        }
        check(&hosts(), &method, &Uri::from_static("/"), &headers).map_err(|(status, _)| status)
    }

    #[test]
    fn actions_must_come_from_the_origin_they_are_sent_to() {
        let host = ("host", "127.0.0.1:9105");
        assert_eq!(
            request(Method::POST, &[host]),
            Ok(()),
            "no Origin: not a browser"
        );
        assert_eq!(
            request(Method::POST, &[host, ("origin", "http://127.0.0.1:9105")]),
            Ok(())
        );
        for origin in [
            "http://evil.example",
            "http://127.0.0.1:8000",
            "null",
            "http://127.0.0.1:9105/x",
            "file://127.0.0.1:9105",
        ] {
            let headers = HeaderValue::from_str(origin).unwrap();
            let mut map = HeaderMap::new();
            map.insert(header::HOST, HeaderValue::from_static("127.0.0.1:9105"));
            map.insert(header::ORIGIN, headers);
            assert_eq!(
                check(&hosts(), &Method::POST, &Uri::from_static("/"), &map)
                    .map_err(|(status, _)| status),
                Err(StatusCode::FORBIDDEN),
                "{origin}"
            );
        }
        let mut two = HeaderMap::new();
        two.insert(header::HOST, HeaderValue::from_static("127.0.0.1:9105"));
        two.append(
            header::ORIGIN,
            HeaderValue::from_static("http://127.0.0.1:9105"),
        );
        two.append(
            header::ORIGIN,
            HeaderValue::from_static("http://evil.example"),
        );
        assert_eq!(
            check(&hosts(), &Method::POST, &Uri::from_static("/"), &two)
                .map_err(|(status, _)| status),
            Err(StatusCode::FORBIDDEN),
            "a second, foreign Origin"
        );
        // Reading is not acting: a GET may carry any Origin.
        assert_eq!(
            request(Method::GET, &[host, ("origin", "http://evil.example")]),
            Ok(())
        );
        assert_eq!(
            request(Method::GET, &[("host", "evil.example:9105")]),
            Err(StatusCode::MISDIRECTED_REQUEST)
        );
        assert_eq!(
            request(Method::GET, &[]),
            Err(StatusCode::BAD_REQUEST),
            "no Host at all"
        );
        assert_eq!(
            request(
                Method::POST,
                &[
                    ("host", "sas.example.com"),
                    ("origin", "https://sas.example.com:443")
                ]
            ),
            Ok(())
        );
    }
}

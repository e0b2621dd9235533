//! What a request says about its client, believed only as far as the
//! TCP peer is trusted (`dashboard.trusted_proxies`): the client's address
//! (the login throttle's key) and whether the client reached us over HTTPS
//! (the session cookie's `Secure`).
//!
//! A client may send any `X-Forwarded-For` it likes; a proxy appends the
//! address it saw. So the list is read from the right, past the hops that
//! are trusted proxies, and the first address that is not one is the
//! client: whatever a client wrote to the left of it is never used. From
//! a peer that is not a trusted proxy, the headers are ignored.

use std::net::{IpAddr, SocketAddr};

use axum::http::{HeaderMap, HeaderName, header};
use sas::config::Cidr;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// The client's address: `peer`, or, when `peer` is a trusted proxy, the
/// nearest address in `X-Forwarded-For` that is not a trusted proxy.
pub fn client_address(peer: Option<IpAddr>, headers: &HeaderMap, trusted: &[Cidr]) -> IpAddr {
    let is_trusted = |ip: IpAddr| trusted.iter().any(|net| net.contains(ip));
    let Some(mut client) = peer else {
        // The server always sets the peer; without one, all share a key.
        return IpAddr::from([0, 0, 0, 0]);
    };
    let hops: Vec<&str> = headers
        .get_all(X_FORWARDED_FOR)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .collect();
    for hop in hops.iter().rev() {
        if !is_trusted(client) {
            break;
        }
        // A hop a trusted proxy wrote that does not parse: stop at the
        // proxy rather than guess.
        let Some(ip) = parse_hop(hop) else {
            break;
        };
        client = ip;
    }
    client
}

/// An `X-Forwarded-For` entry: an address, possibly with a port
/// (`192.0.2.1:4711`, `[2001:db8::1]:4711`).
fn parse_hop(hop: &str) -> Option<IpAddr> {
    let hop = hop.trim();
    hop.parse::<IpAddr>()
        .ok()
        .or_else(|| hop.parse::<SocketAddr>().ok().map(|s| s.ip()))
}

/// Whether the client reached the dashboard over HTTPS: the browser's
/// `Origin` says `https://` (the host guard has checked that it names this
/// host), or a trusted proxy says `X-Forwarded-Proto: https`.
pub fn over_https(peer: Option<IpAddr>, headers: &HeaderMap, trusted: &[Cidr]) -> bool {
    let origin = headers
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|o| o.trim().to_ascii_lowercase().starts_with("https://"));
    let trusted_peer = peer.is_some_and(|ip| trusted.iter().any(|net| net.contains(ip)));
    // The first value is the scheme the client used (a proxy chain appends).
    let forwarded = trusted_peer
        && headers
            .get(X_FORWARDED_PROTO)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(',').next())
            .is_some_and(|proto| proto.trim().eq_ignore_ascii_case("https"));
    origin || forwarded
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(*k, HeaderValue::from_static(v));
        }
        map
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("address")
    }

    fn trusted() -> Vec<Cidr> {
        vec![
            "10.0.0.0/8".parse().expect("range"),
            "fd00::/8".parse().expect("range"),
        ]
    }

    #[test]
    fn a_client_cannot_choose_its_own_address() {
        let t = trusted();
        let stranger = Some(ip("198.51.100.7"));
        let forged = headers(&[("x-forwarded-for", "192.0.2.99")]);
        assert_eq!(
            client_address(stranger, &forged, &t),
            ip("198.51.100.7"),
            "from an untrusted peer the header is ignored"
        );
        let proxy = Some(ip("10.0.0.2"));
        // The client wrote 192.0.2.99; the proxy appended what it saw.
        let appended = headers(&[("x-forwarded-for", "192.0.2.99, 203.0.113.5")]);
        assert_eq!(client_address(proxy, &appended, &t), ip("203.0.113.5"));
        // Two proxies, and the client's forgery in a header of its own.
        let chain = headers(&[
            ("x-forwarded-for", "192.0.2.99"),
            ("x-forwarded-for", "203.0.113.5:4711, 10.1.1.1"),
        ]);
        assert_eq!(client_address(proxy, &chain, &t), ip("203.0.113.5"));
        // A client that claims to be a proxy is still stopped at the last
        // address a trusted hop wrote.
        let claims = headers(&[("x-forwarded-for", "192.0.2.99, 10.9.9.9, 203.0.113.5")]);
        assert_eq!(client_address(proxy, &claims, &t), ip("203.0.113.5"));
        assert_eq!(
            client_address(proxy, &headers(&[]), &t),
            ip("10.0.0.2"),
            "no header: the proxy itself"
        );
        let garbage = headers(&[("x-forwarded-for", "192.0.2.99, not-an-ip")]);
        assert_eq!(client_address(proxy, &garbage, &t), ip("10.0.0.2"));
        let v6 = headers(&[("x-forwarded-for", "[2001:db8::1]:443")]);
        assert_eq!(
            client_address(Some(ip("fd00::1")), &v6, &t),
            ip("2001:db8::1")
        );
        assert_eq!(client_address(proxy, &forged, &[]), ip("10.0.0.2"));
    }

    #[test]
    fn https_is_what_the_browser_or_a_trusted_proxy_says() {
        let t = trusted();
        let peer = Some(ip("127.0.0.1"));
        let proxy = Some(ip("10.0.0.2"));
        assert!(over_https(
            peer,
            &headers(&[("origin", "https://sas.example.com")]),
            &t
        ));
        assert!(!over_https(
            peer,
            &headers(&[("origin", "http://127.0.0.1:9105")]),
            &t
        ));
        assert!(!over_https(peer, &headers(&[]), &t));
        let proto = headers(&[("x-forwarded-proto", "https")]);
        assert!(over_https(proxy, &proto, &t));
        assert!(!over_https(peer, &proto, &t), "only from a trusted proxy");
        assert!(!over_https(
            proxy,
            &headers(&[("x-forwarded-proto", "http, https")]),
            &t
        ));
    }
}

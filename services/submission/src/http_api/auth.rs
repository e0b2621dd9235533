//! Who may call the HTTP API (contract §9a, §1b).
//!
//! - A request with `Authorization: Bearer <token>` is the application
//!   whose `applications.<name>.tokens` holds `sha256:<hex>` of the token;
//!   any other token is a `401`. The SHA-256 of the token is compared with
//!   every configured hash in constant time.
//! - A request without one is anonymous, allowed only when no
//!   `[applications]` are configured, `http.api_loopback_open` is on (the
//!   default), the peer is a loopback address, the `Host` it names is a
//!   loopback one and it carries no `Origin`. The last two keep a web page
//!   that the operator's browser opens (directly, or through a DNS name
//!   rebound to 127.0.0.1) from using the operator's loopback. Else `401`.
//!
//! An application's ids are its own ([`Application::order_id`], the same
//! mapping as on the queue), and it sees only its own orders.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{ConnectInfo, FromRequestParts};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use sas::applications::Application;
use sas::config::Settings;
use sas::engine::Actor;
use sas::state_store::OrderRow;
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;
use uuid::Uuid;

use super::{Api, ApiError};

/// Longest bearer token read: longer ones are no configured token's.
const MAX_TOKEN_BYTES: usize = 4096;

/// The API's gatekeeper.
#[derive(Debug)]
pub struct Gate {
    /// Each configured token's SHA-256 and its application.
    tokens: Vec<([u8; 32], Application)>,
    /// Whether `[applications]` is configured: then every request needs a
    /// token.
    applications: bool,
    /// `http.api_loopback_open`.
    loopback_open: bool,
}

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// A local tool, with no `[applications]` configured: every order
    /// submitted without an application is its.
    Anonymous,
    /// An application, by its token.
    Application(Application),
}

impl Gate {
    /// The gate of `settings`: `[applications]` and `http.api_loopback_open`.
    /// Tokens that are not `sha256:<64 hex>` were refused at start-up.
    pub fn new(settings: &Settings) -> Self {
        let tokens = settings
            .applications
            .iter()
            .flat_map(|(name, spec)| {
                let app = Application::new(name, &spec.reply_to);
                spec.tokens
                    .iter()
                    .filter_map(|t| hash_of_config(t))
                    .map(move |hash| (hash, app.clone()))
            })
            .collect();
        Self {
            tokens,
            applications: !settings.applications.is_empty(),
            loopback_open: settings.http.api_loopback_open,
        }
    }

    /// Says at start-up who may use the API.
    pub fn log_start(&self, host: &str) {
        if self.applications {
            tracing::info!(
                tokens = self.tokens.len(),
                "HTTP API: applications' bearer tokens only"
            );
        } else if self.loopback_open {
            tracing::info!(
                %host,
                "HTTP API: open to loopback callers without a token (http.api_loopback_open); no [applications], so nothing else gets in"
            );
        } else {
            tracing::info!(
                "HTTP API: closed (no [applications] and http.api_loopback_open = false)"
            );
        }
    }

    /// The caller of a request from `peer` with `headers`, or why not.
    pub fn admit(
        &self,
        peer: Option<SocketAddr>,
        headers: &HeaderMap,
    ) -> Result<Caller, &'static str> {
        if let Some(value) = headers.get(header::AUTHORIZATION) {
            let token = value
                .to_str()
                .ok()
                .and_then(bearer)
                .ok_or("send Authorization: Bearer <token>")?;
            return self
                .application_of(token)
                .map(|app| Caller::Application(app.clone()))
                .ok_or("unknown token");
        }
        if self.applications {
            return Err("a bearer token of an application is required");
        }
        let local = self.loopback_open
            && peer.is_some_and(|p| p.ip().to_canonical().is_loopback())
            && headers
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .is_some_and(is_loopback_host)
            && !headers.contains_key(header::ORIGIN);
        if local {
            Ok(Caller::Anonymous)
        } else {
            Err("a bearer token is required")
        }
    }

    /// The application whose token this is. Every configured hash is
    /// compared, each in constant time.
    fn application_of(&self, token: &str) -> Option<&Application> {
        if token.len() > MAX_TOKEN_BYTES {
            return None;
        }
        let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut found = None;
        for (known, app) in &self.tokens {
            if bool::from(known.ct_eq(&hash)) {
                found = Some(app);
            }
        }
        found
    }
}

/// The token of an `Authorization: Bearer <token>` value.
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The 32 bytes of a configured `sha256:<64 hex>`.
fn hash_of_config(text: &str) -> Option<[u8; 32]> {
    let hex = text.strip_prefix("sha256:")?.as_bytes();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (byte, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
        let text = std::str::from_utf8(pair).ok()?;
        *byte = u8::from_str_radix(text, 16).ok()?;
    }
    Some(out)
}

/// Whether a `Host` header names this host by a loopback name:
/// `localhost`, `127.x.x.x` or `[::1]`, with any port.
fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost")
        || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

impl Caller {
    /// Its application, if it is one.
    pub fn application(&self) -> Option<&Application> {
        match self {
            Self::Anonymous => None,
            Self::Application(app) => Some(app),
        }
    }

    /// The stored id of its order `given` (contract §1b).
    pub fn stored_id(&self, given: Uuid) -> Uuid {
        self.application().map_or(given, |app| app.order_id(given))
    }

    /// Whether the order is its own.
    pub fn owns(&self, order: &OrderRow) -> bool {
        order.application.as_deref() == self.application().map(|app| app.name.as_str())
    }

    /// Whom the event log names for what it does.
    pub fn actor(&self) -> Actor {
        Actor {
            name: match self {
                Self::Anonymous => "http".to_owned(),
                Self::Application(app) => format!("application:{}", app.name),
            },
        }
    }
}

impl FromRequestParts<Arc<Api>> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, api: &Arc<Api>) -> Result<Self, ApiError> {
        let peer = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0);
        api.gate
            .admit(peer, &parts.headers)
            .map_err(|why| ApiError::new(StatusCode::UNAUTHORIZED, "unauthenticated", why))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use sas::config::ApplicationSpec;

    fn sha(token: &str) -> String {
        let hash = Sha256::digest(token.as_bytes());
        let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
        format!("sha256:{hex}")
    }

    fn gate(apps: &[(&str, &str)], loopback_open: bool) -> Gate {
        let mut settings = Settings::default();
        settings.http.api_loopback_open = loopback_open;
        for (name, token) in apps {
            settings.applications.insert(
                (*name).to_owned(),
                ApplicationSpec {
                    user: None,
                    reply_to: vec![format!("{name}.*")],
                    tokens: vec![sha(token)],
                },
            );
        }
        Gate::new(&settings)
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    const LOCAL: Option<SocketAddr> = Some(SocketAddr::new(
        IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        40000,
    ));
    const REMOTE: Option<SocketAddr> = Some(SocketAddr::new(
        IpAddr::V4(std::net::Ipv4Addr::new(10, 1, 2, 3)),
        40000,
    ));

    #[test]
    fn without_applications_only_a_local_tool_gets_in() {
        let g = gate(&[], true);
        let host = [("host", "127.0.0.1:9101")];
        assert_eq!(g.admit(LOCAL, &headers(&host)), Ok(Caller::Anonymous));
        assert_eq!(
            g.admit(LOCAL, &headers(&[("host", "localhost")])),
            Ok(Caller::Anonymous)
        );
        assert_eq!(
            g.admit(LOCAL, &headers(&[("host", "[::1]:9101")])),
            Ok(Caller::Anonymous)
        );
        // Another host, a rebound name, a web page, no Host: refused.
        assert!(g.admit(REMOTE, &headers(&host)).is_err());
        assert!(
            g.admit(LOCAL, &headers(&[("host", "evil.example:9101")]))
                .is_err()
        );
        let page = [
            ("host", "127.0.0.1:9101"),
            ("origin", "http://evil.example"),
        ];
        assert!(g.admit(LOCAL, &headers(&page)).is_err());
        assert!(g.admit(LOCAL, &HeaderMap::new()).is_err());
        assert!(g.admit(None, &headers(&host)).is_err());
        // A token that is no application's is refused, even locally.
        let bad = [("host", "127.0.0.1:9101"), ("authorization", "Bearer x")];
        assert!(g.admit(LOCAL, &headers(&bad)).is_err());
        // Closed by configuration.
        assert!(gate(&[], false).admit(LOCAL, &headers(&host)).is_err());
    }

    #[test]
    fn with_applications_a_token_is_always_needed_and_names_its_application() {
        let g = gate(&[("shop", "s3cret"), ("billing", "other")], true);
        let host = ("host", "127.0.0.1:9101");
        assert!(g.admit(LOCAL, &headers(&[host])).is_err());
        let shop = g
            .admit(REMOTE, &headers(&[("authorization", "Bearer s3cret")]))
            .unwrap();
        assert_eq!(shop.application().unwrap().name, "shop");
        let billing = g
            .admit(
                LOCAL,
                &headers(&[host, ("authorization", "bearer  other ")]),
            )
            .unwrap();
        assert_eq!(billing.application().unwrap().name, "billing");
        for wrong in [
            "Bearer s3cre",
            "Bearer S3CRET",
            "Basic s3cret",
            "Bearer",
            "s3cret",
        ] {
            assert!(
                g.admit(LOCAL, &headers(&[("authorization", wrong)]))
                    .is_err(),
                "{wrong}"
            );
        }
        let huge = format!("Bearer {}", "a".repeat(100_000));
        assert!(
            g.admit(LOCAL, &headers(&[("authorization", &huge)]))
                .is_err()
        );
        // The same mapping of ids as on the queue.
        let given = Uuid::new_v4();
        let app = Application::new("shop", &["shop.*".to_owned()]);
        assert_eq!(shop.stored_id(given), app.order_id(given));
        assert_ne!(shop.stored_id(given), billing.stored_id(given));
        assert_eq!(Caller::Anonymous.stored_id(given), given);
        assert_eq!(shop.actor().name, "application:shop");
    }

    #[test]
    fn configured_hashes_are_read_as_32_bytes() {
        let h = hash_of_config(&sha("t")).unwrap();
        let want: [u8; 32] = Sha256::digest(b"t").into();
        assert_eq!(h, want);
        assert!(hash_of_config("sha256:zz").is_none());
        assert!(hash_of_config(&format!("sha256:{}", "g".repeat(64))).is_none());
        assert!(hash_of_config("md5:00").is_none());
    }
}

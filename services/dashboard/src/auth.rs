//! Who is calling, and may they act: [`Auth`] turns a request's credentials
//! into an [`Identity`] as `dashboard.auth` says (see
//! [`sas::config::DashboardSettings`]), [`require`] refuses the pages and the
//! API to anyone it cannot identify, and [`Operator`] admits only operators
//! to the actions.
//!
//! What is believed: a bearer token or a Basic password that matches the
//! configuration (compared in constant time), a session cookie that the login
//! page set, and, in `proxy` mode only, the identity header of a request whose
//! TCP peer is a trusted proxy. Nothing else: a `X-Forwarded-User` from
//! anyone else names nobody. Secrets are never logged.
//!
//! Every check of a secret (a bearer token, a Basic password, the login
//! form's token) goes through the login throttle ([`crate::throttle`]):
//! a client that failed too often, or all clients together, are answered
//! 429 with `Retry-After` before their secret is looked at. A session
//! cookie is not a secret anyone can guess (256 random bits) and is not
//! throttled, so an attack does not log out those already logged in.

use std::net::IpAddr;

use axum::extract::{ConnectInfo, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use base64::Engine;
use sas::config::{Cidr, DashboardAuth, DashboardSettings, Role, Secret, valid_name};
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;

pub use crate::identity::Identity;
use crate::sessions::Sessions;
use crate::throttle::{self, Attempt, Limits, Throttle};

/// The session cookie's name.
pub const SESSION_COOKIE: &str = "sas_session";

/// Longest credential read from a request: anything longer matches nothing.
const MAX_CREDENTIAL_BYTES: usize = 4096;

/// A configured secret and whom it identifies.
struct Credential {
    /// The user name (Basic) or the token's owner.
    name: String,
    secret: Secret,
    role: Role,
}

/// Why a request was not identified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No credentials at all (or an expired session).
    Missing,
    /// Credentials that match nobody.
    Wrong,
    /// An identity header from a peer that is not a trusted proxy.
    UntrustedPeer,
    /// A trusted proxy sent an unusable name or role.
    BadIdentity,
}

/// The dashboard's authentication, built once from the settings.
pub struct Auth {
    mode: DashboardAuth,
    /// `token` mode's tokens.
    tokens: Vec<Credential>,
    /// `basic` mode's users.
    users: Vec<Credential>,
    trusted_proxies: Vec<Cidr>,
    user_header: HeaderName,
    role_header: Option<HeaderName>,
    proxy_role: Role,
    /// `dashboard.secure_cookie`: `Secure` even when the request does not
    /// say it came over HTTPS.
    secure_cookie: bool,
    /// `token` mode's logins.
    pub sessions: Sessions,
    /// Failed secrets per client and in all.
    throttle: Throttle,
}

impl Auth {
    /// The authentication `settings` ask for (validated when loaded).
    pub fn new(settings: &DashboardSettings) -> Self {
        let header = |name: &str| {
            HeaderName::from_bytes(name.as_bytes())
                .unwrap_or_else(|_| HeaderName::from_static("x-forwarded-user"))
        };
        let tokens = settings
            .tokens
            .iter()
            .map(|t| Credential {
                name: t.name.clone(),
                secret: t.token.clone(),
                role: t.role,
            })
            .chain(settings.single_token().map(|t| Credential {
                name: settings.token_name.clone(),
                secret: t.clone(),
                role: Role::Operator,
            }))
            .collect();
        let users = settings
            .users
            .iter()
            .map(|u| Credential {
                name: u.name.clone(),
                secret: u.password.clone(),
                role: u.role,
            })
            .collect();
        Self {
            mode: settings.auth,
            tokens,
            users,
            trusted_proxies: settings.trusted_proxies.clone(),
            user_header: header(&settings.user_header),
            role_header: settings.role_header.as_deref().map(header),
            proxy_role: settings.proxy_role,
            secure_cookie: settings.secure_cookie,
            sessions: Sessions::new(settings.session_ttl),
            throttle: Throttle::new(Limits {
                per_client: settings.login_failures_per_client,
                total: settings.login_failures_total,
                window: settings.login_failure_window,
            }),
        }
    }

    /// The configured mode.
    pub fn mode(&self) -> DashboardAuth {
        self.mode
    }

    /// Logs how the dashboard authenticates (never a secret), with a warning
    /// when anyone who can reach a non-loopback address may act.
    pub fn log_start(&self, bind_host: &str) {
        tracing::info!(
            auth = self.mode.as_str(),
            tokens = self.tokens.len(),
            users = self.users.len(),
            trusted_proxies = self.trusted_proxies.len(),
            "dashboard authentication"
        );
        if self.mode == DashboardAuth::None && !is_loopback(bind_host) {
            tracing::warn!(
                host = bind_host,
                "dashboard.auth is \"none\" on a non-loopback address: anyone who can reach it \
                 can retry and cancel orders; set dashboard.auth to token, basic or proxy"
            );
        }
    }

    /// Who sent a request from `peer` with these headers.
    pub fn identify(&self, peer: Option<IpAddr>, headers: &HeaderMap) -> Result<Identity, Refusal> {
        match self.mode {
            DashboardAuth::None => Ok(Identity {
                name: "dashboard".into(),
                role: Role::Operator,
            }),
            DashboardAuth::Token => match authorization(headers, "Bearer") {
                Some(token) => self.token_identity(token).ok_or(Refusal::Wrong),
                None => session_id(headers)
                    .and_then(|id| self.sessions.get(id))
                    .ok_or(Refusal::Missing),
            },
            DashboardAuth::Basic => {
                let encoded = authorization(headers, "Basic").ok_or(Refusal::Missing)?;
                let decoded = base64::engine::general_purpose::STANDARD
                    .decode(encoded)
                    .map_err(|_| Refusal::Wrong)?;
                let text = String::from_utf8(decoded).map_err(|_| Refusal::Wrong)?;
                let (name, password) = text.split_once(':').ok_or(Refusal::Wrong)?;
                find(&self.users, password, Some(name)).ok_or(Refusal::Wrong)
            }
            DashboardAuth::Proxy => self.proxy_identity(peer, headers),
        }
    }

    /// The holder of `token` (`token` mode), if any.
    pub fn token_identity(&self, token: &str) -> Option<Identity> {
        find(&self.tokens, token, None)
    }

    /// [`Auth::identify`] through the login throttle when the request
    /// carries a secret to check (an `Authorization` header in `token` or
    /// `basic` mode): a wrong one counts against the client.
    pub fn identify_throttled(
        &self,
        peer: Option<IpAddr>,
        headers: &HeaderMap,
    ) -> Attempt<Result<Identity, Refusal>> {
        let checks_secret = matches!(self.mode, DashboardAuth::Token | DashboardAuth::Basic)
            && headers.contains_key(header::AUTHORIZATION);
        if !checks_secret {
            return Attempt::Checked(self.identify(peer, headers));
        }
        self.throttle.attempt(
            self.client(peer, headers),
            || self.identify(peer, headers),
            |result| *result == Err(Refusal::Wrong),
        )
    }

    /// [`Auth::token_identity`] through the login throttle (the login form).
    pub fn login(
        &self,
        peer: Option<IpAddr>,
        headers: &HeaderMap,
        token: &str,
    ) -> Attempt<Option<Identity>> {
        self.throttle.attempt(
            self.client(peer, headers),
            || self.token_identity(token),
            Option::is_none,
        )
    }

    /// Whom the throttle counts a request against (see [`crate::forwarded`]).
    pub fn client(&self, peer: Option<IpAddr>, headers: &HeaderMap) -> IpAddr {
        crate::forwarded::client_address(peer, headers, &self.trusted_proxies)
    }

    /// Whether the session cookie of this request's answer is `Secure`:
    /// always with `dashboard.secure_cookie`, else when the request came
    /// over HTTPS (see [`crate::forwarded::over_https`]).
    pub fn secure(&self, peer: Option<IpAddr>, headers: &HeaderMap) -> bool {
        self.secure_cookie || crate::forwarded::over_https(peer, headers, &self.trusted_proxies)
    }

    fn proxy_identity(
        &self,
        peer: Option<IpAddr>,
        headers: &HeaderMap,
    ) -> Result<Identity, Refusal> {
        let trusted = peer.is_some_and(|ip| self.trusted_proxies.iter().any(|n| n.contains(ip)));
        if !trusted {
            return Err(Refusal::UntrustedPeer);
        }
        let name = single(headers, &self.user_header)?.ok_or(Refusal::Missing)?;
        if !valid_name(name) {
            return Err(Refusal::BadIdentity);
        }
        let role = match &self.role_header {
            Some(h) => match single(headers, h)? {
                Some(role) => role.parse().map_err(|()| Refusal::BadIdentity)?,
                None => self.proxy_role,
            },
            None => self.proxy_role,
        };
        Ok(Identity {
            name: name.to_owned(),
            role,
        })
    }

    /// The `Set-Cookie` value that carries a new session, `Secure` when
    /// `secure` (see [`Auth::secure`]).
    pub fn session_cookie(&self, id: &str, secure: bool) -> String {
        format!(
            "{SESSION_COOKIE}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}{}",
            self.sessions.ttl().as_secs(),
            if secure { "; Secure" } else { "" }
        )
    }

    /// The `Set-Cookie` value that removes the session cookie.
    pub fn expired_cookie(&self, secure: bool) -> String {
        format!(
            "{SESSION_COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0{}",
            if secure { "; Secure" } else { "" }
        )
    }

    /// The answer to a refused request: the login page for a page in `token`
    /// mode, else 401 (with the challenge of the mode) or 403 for a peer that
    /// is not a trusted proxy.
    fn refuse(&self, refusal: Refusal, method: &Method, path: &str) -> Response {
        let page = method == Method::GET && !path.starts_with("/api/");
        if self.mode == DashboardAuth::Token && page {
            return Redirect::to("/login").into_response();
        }
        let (status, message) = match refusal {
            Refusal::Missing => (StatusCode::UNAUTHORIZED, "log in first"),
            Refusal::Wrong => (StatusCode::UNAUTHORIZED, "those credentials are not valid"),
            Refusal::BadIdentity => (
                StatusCode::UNAUTHORIZED,
                "the proxy sent no usable user name or role",
            ),
            Refusal::UntrustedPeer => (
                StatusCode::FORBIDDEN,
                "only a trusted proxy may reach the dashboard",
            ),
        };
        let mut response = (status, axum::Json(json!({ "error": message }))).into_response();
        let challenge = match self.mode {
            DashboardAuth::Basic => Some("Basic realm=\"sas dashboard\", charset=\"UTF-8\""),
            DashboardAuth::Token => Some("Bearer realm=\"sas dashboard\""),
            _ => None,
        };
        if let (StatusCode::UNAUTHORIZED, Some(challenge)) = (status, challenge) {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(challenge),
            );
        }
        response
    }
}

/// The middleware in front of the pages and the API: identifies the caller
/// and hands its [`Identity`] to the handler, or refuses the request.
pub async fn require(State(auth): State<Arc<Auth>>, mut request: Request, next: Next) -> Response {
    let peer = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    let identified = match auth.identify_throttled(peer, request.headers()) {
        Attempt::Checked(identified) => identified,
        Attempt::Throttled(wait) => {
            tracing::warn!(
                ?peer,
                path = request.uri().path(),
                "dashboard: too many failed logins; refused unread"
            );
            return too_many(wait);
        }
    };
    match identified {
        Ok(identity) => {
            request.extensions_mut().insert(identity);
            next.run(request).await
        }
        Err(refusal) => {
            let path = request.uri().path();
            match refusal {
                Refusal::Missing => tracing::debug!(?peer, path, "dashboard: no credentials"),
                _ => tracing::warn!(?peer, path, ?refusal, "dashboard: request refused"),
            }
            auth.refuse(refusal, request.method(), path)
        }
    }
}

/// The answer to a throttled request: 429 with `Retry-After`.
pub fn too_many(wait: std::time::Duration) -> Response {
    let secs = throttle::retry_after_secs(wait);
    let mut response = (
        StatusCode::TOO_MANY_REQUESTS,
        axum::Json(json!({ "error": format!("too many failed logins: try again in {secs} s") })),
    )
        .into_response();
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    response
}

/// An operator's request: extracting it refuses a viewer with 403.
pub struct Operator(pub Identity);

impl<S: Send + Sync> FromRequestParts<S> for Operator {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        match parts.extensions.get::<Identity>() {
            Some(who) if who.role == Role::Operator => Ok(Self(who.clone())),
            Some(who) => {
                tracing::warn!(user = %who.name, path = parts.uri.path(), "dashboard: a viewer tried to act");
                Err((
                    StatusCode::FORBIDDEN,
                    axum::Json(json!({ "error": format!("{} is a viewer: only operators can act on orders", who.name) })),
                )
                    .into_response())
            }
            None => Err((
                StatusCode::UNAUTHORIZED,
                axum::Json(json!({ "error": "log in first" })),
            )
                .into_response()),
        }
    }
}

/// The credential after `Authorization: <scheme> `, when that is the scheme.
fn authorization<'h>(headers: &'h HeaderMap, scheme: &str) -> Option<&'h str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (given, credential) = value.split_once(' ')?;
    given
        .eq_ignore_ascii_case(scheme)
        .then(|| credential.trim())
        .filter(|c| !c.is_empty() && c.len() <= MAX_CREDENTIAL_BYTES)
}

/// The session id in the request's cookies, if any.
pub fn session_id(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == SESSION_COOKIE)
        .map(|(_, value)| value.trim())
        .filter(|v| !v.is_empty() && v.len() <= MAX_CREDENTIAL_BYTES)
}

/// The one value of header `name`: `None` when absent, refused when sent
/// twice (a client's header beside the proxy's) or not text.
fn single<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Result<Option<&'h str>, Refusal> {
    let mut values = headers.get_all(name).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(Refusal::BadIdentity);
    }
    let text = first.to_str().map_err(|_| Refusal::BadIdentity)?.trim();
    Ok((!text.is_empty()).then_some(text))
}

/// The credential whose secret is `secret` (and whose name is `name`, when
/// given). Every credential is compared, each in constant time, so the time
/// taken says nothing about which one matched or how much of it.
fn find(credentials: &[Credential], secret: &str, name: Option<&str>) -> Option<Identity> {
    if secret.len() > MAX_CREDENTIAL_BYTES {
        return None;
    }
    let mut found = None;
    for c in credentials {
        let name_ok = name.is_none_or(|n| constant_time_eq(n.as_bytes(), c.name.as_bytes()));
        let secret_ok = constant_time_eq(secret.as_bytes(), c.secret.expose().as_bytes());
        if name_ok & secret_ok && found.is_none() {
            found = Some(Identity {
                name: c.name.clone(),
                role: c.role,
            });
        }
    }
    found
}

/// Whether `a == b`, in a time that depends on their lengths only.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= usize::from(x ^ y);
    }
    std::hint::black_box(diff) == 0
}

/// Whether the bind host only takes connections from this machine.
fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sas::config::{DashboardToken, DashboardUser};

    fn settings(mode: DashboardAuth) -> DashboardSettings {
        DashboardSettings {
            auth: mode,
            tokens: vec![
                DashboardToken {
                    name: "vera".into(),
                    token: "viewer-token-0123456789".into(),
                    role: Role::Viewer,
                },
                DashboardToken {
                    name: "alice".into(),
                    token: "operator-token-0123456789".into(),
                    role: Role::Operator,
                },
            ],
            users: vec![DashboardUser {
                name: "bob".into(),
                password: "hunter2".into(),
                role: Role::Operator,
            }],
            trusted_proxies: vec!["10.0.0.0/8".parse().unwrap()],
            role_header: Some("X-Forwarded-Role".into()),
            ..DashboardSettings::default()
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        map
    }

    fn who(name: &str, role: Role) -> Result<Identity, Refusal> {
        Ok(Identity {
            name: name.into(),
            role,
        })
    }

    #[test]
    fn bearer_tokens_and_sessions_identify_their_holders() {
        let auth = Auth::new(&settings(DashboardAuth::Token));
        let bearer = |t: &str| headers(&[("authorization", &format!("Bearer {t}"))]);
        assert_eq!(
            auth.identify(None, &bearer("operator-token-0123456789")),
            who("alice", Role::Operator)
        );
        assert_eq!(
            auth.identify(None, &bearer("viewer-token-0123456789")),
            who("vera", Role::Viewer)
        );
        assert_eq!(
            auth.identify(None, &bearer("operator-token-012345678")),
            Err(Refusal::Wrong)
        );
        assert_eq!(auth.identify(None, &headers(&[])), Err(Refusal::Missing));
        // A forged proxy header names nobody outside proxy mode.
        assert_eq!(
            auth.identify(None, &headers(&[("x-forwarded-user", "root")])),
            Err(Refusal::Missing)
        );
        let id = auth.sessions.open(Identity {
            name: "alice".into(),
            role: Role::Operator,
        });
        let cookie = format!("theme=dark; {SESSION_COOKIE}={id}");
        assert_eq!(
            auth.identify(None, &headers(&[("cookie", &cookie)])),
            who("alice", Role::Operator)
        );
        assert_eq!(
            auth.identify(None, &headers(&[("cookie", "sas_session=forged")])),
            Err(Refusal::Missing)
        );
        assert!(
            auth.session_cookie(&id, false)
                .contains("HttpOnly; SameSite=Strict")
        );
    }

    #[test]
    fn basic_checks_name_and_password() {
        let auth = Auth::new(&settings(DashboardAuth::Basic));
        let basic = |user: &str| {
            let encoded = base64::engine::general_purpose::STANDARD.encode(user);
            headers(&[("authorization", &format!("Basic {encoded}"))])
        };
        assert_eq!(
            auth.identify(None, &basic("bob:hunter2")),
            who("bob", Role::Operator)
        );
        assert_eq!(
            auth.identify(None, &basic("bob:hunter3")),
            Err(Refusal::Wrong)
        );
        assert_eq!(
            auth.identify(None, &basic("eve:hunter2")),
            Err(Refusal::Wrong)
        );
        assert_eq!(auth.identify(None, &basic("bob")), Err(Refusal::Wrong));
        assert_eq!(
            auth.identify(
                None,
                &headers(&[("authorization", "Bearer operator-token-0123456789")])
            ),
            Err(Refusal::Missing)
        );
    }

    #[test]
    fn proxy_headers_count_only_from_trusted_peers() {
        let auth = Auth::new(&settings(DashboardAuth::Proxy));
        let proxy = Some("10.1.2.3".parse().unwrap());
        let user = headers(&[("x-forwarded-user", "carol")]);
        assert_eq!(auth.identify(proxy, &user), who("carol", Role::Viewer));
        assert_eq!(
            auth.identify(Some("192.168.1.1".parse().unwrap()), &user),
            Err(Refusal::UntrustedPeer)
        );
        assert_eq!(auth.identify(None, &user), Err(Refusal::UntrustedPeer));
        let operator = headers(&[
            ("x-forwarded-user", "carol"),
            ("x-forwarded-role", "operator"),
        ]);
        assert_eq!(
            auth.identify(proxy, &operator),
            who("carol", Role::Operator)
        );
        for bad in [
            headers(&[("x-forwarded-user", "carol"), ("x-forwarded-role", "root")]),
            headers(&[("x-forwarded-user", "car ol")]),
            headers(&[("x-forwarded-user", "carol"), ("x-forwarded-user", "root")]),
        ] {
            assert_eq!(
                auth.identify(proxy, &bad),
                Err(Refusal::BadIdentity),
                "{bad:?}"
            );
        }
        assert_eq!(auth.identify(proxy, &headers(&[])), Err(Refusal::Missing));
    }

    #[test]
    fn no_authentication_makes_everyone_the_dashboard_operator() {
        let auth = Auth::new(&DashboardSettings::default());
        let forged = headers(&[("x-forwarded-user", "root")]);
        assert_eq!(
            auth.identify(None, &forged),
            who("dashboard", Role::Operator)
        );
        assert_eq!(
            auth.identify(None, &forged).map(|i| i.actor().name),
            Ok("operator:dashboard".to_owned())
        );
    }

    #[test]
    fn the_cookie_is_secure_over_https_and_keeps_its_other_attributes() {
        let auth = Auth::new(&settings(DashboardAuth::Token));
        let local = Some("127.0.0.1".parse().unwrap());
        let plain = headers(&[("origin", "http://127.0.0.1:9105")]);
        let tls = headers(&[("origin", "https://sas.example.com")]);
        assert!(!auth.secure(local, &plain));
        assert!(auth.secure(local, &tls));
        let proxied = headers(&[("x-forwarded-proto", "https")]);
        assert!(auth.secure(Some("10.0.0.9".parse().unwrap()), &proxied));
        assert!(!auth.secure(local, &proxied), "an untrusted peer's word");
        for secure in [false, true] {
            for cookie in [
                auth.session_cookie("id", secure),
                auth.expired_cookie(secure),
            ] {
                assert!(cookie.contains("; HttpOnly; SameSite=Strict;"), "{cookie}");
                assert_eq!(cookie.ends_with("; Secure"), secure, "{cookie}");
            }
        }
        let always = Auth::new(&DashboardSettings {
            secure_cookie: true,
            ..settings(DashboardAuth::Token)
        });
        assert!(always.secure(local, &plain));
    }

    #[test]
    fn wrong_secrets_are_throttled_and_a_throttled_right_one_is_refused_unread() {
        let auth = Auth::new(&DashboardSettings {
            login_failures_per_client: 2,
            ..settings(DashboardAuth::Token)
        });
        let eve = Some("192.0.2.1".parse().unwrap());
        let alice = Some("198.51.100.7".parse().unwrap());
        let bearer = |t: &str| headers(&[("authorization", &format!("Bearer {t}"))]);
        let wrong = bearer("not-the-token-not-the-token");
        let right = bearer("operator-token-0123456789");
        for _ in 0..2 {
            assert_eq!(
                auth.identify_throttled(eve, &wrong),
                Attempt::Checked(Err(Refusal::Wrong))
            );
        }
        assert!(matches!(
            auth.identify_throttled(eve, &right),
            Attempt::Throttled(_)
        ));
        assert!(matches!(
            auth.login(eve, &HeaderMap::new(), "operator-token-0123456789"),
            Attempt::Throttled(_)
        ));
        assert_eq!(
            auth.identify_throttled(alice, &right),
            Attempt::Checked(who("alice", Role::Operator))
        );
        // A session cookie is not a guessable secret: never throttled.
        let id = auth.sessions.open(Identity {
            name: "alice".into(),
            role: Role::Operator,
        });
        let cookie = headers(&[("cookie", &format!("{SESSION_COOKIE}={id}"))]);
        assert_eq!(
            auth.identify_throttled(eve, &cookie),
            Attempt::Checked(who("alice", Role::Operator))
        );
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(constant_time_eq(b"", b""));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"abc\0", b"abc"));
        assert!(!constant_time_eq(b"", b"a"));
    }

    #[test]
    fn loopback_hosts() {
        for host in ["127.0.0.1", "localhost", "::1", "[::1]", "127.9.9.9"] {
            assert!(is_loopback(host), "{host}");
        }
        for host in ["0.0.0.0", "::", "10.0.0.1", "sas.example.com"] {
            assert!(!is_loopback(host), "{host}");
        }
    }
}

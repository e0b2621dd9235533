//! `[dashboard]`: who may use the operator dashboard, and from where.
//!
//! `auth` picks how a caller proves who they are:
//! - `token`: a bearer token (`Authorization: Bearer …`, or the login page,
//!   which trades it for a session cookie), from `tokens` and/or `token`;
//! - `basic`: HTTP Basic with `users`;
//! - `proxy`: an identity header set by an authenticating proxy, believed
//!   only from a peer address in `trusted_proxies`;
//! - `none` (the default): everyone is the operator `dashboard`, which is only
//!   safe on a loopback address (the default `http.host`).
//!
//! Every identity has a [`Role`]: a `viewer` reads, an `operator` also acts.
//! Secrets are [`Secret`]s, which never print. Guessing them is bounded by
//! the `login_failures_*` limits, per client and over all clients.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;

use super::ConfigError;

/// Shortest bearer token accepted, in bytes: a token is a password that is
/// typed rarely, so it can be long and random.
pub const MIN_TOKEN_BYTES: usize = 16;

/// Longest identity name: the event log's actor is `operator:<name>`.
pub const MAX_NAME_BYTES: usize = 64;

/// Shortest `login_failure_window`: shorter would make the limits no limit.
pub const MIN_LOGIN_FAILURE_WINDOW: Duration = Duration::from_millis(100);

/// `[dashboard]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct DashboardSettings {
    /// How callers authenticate.
    pub auth: DashboardAuth,
    /// `token` mode: named bearer tokens with their roles.
    pub tokens: Vec<DashboardToken>,
    /// `token` mode: one more token, an operator named `token_name`; meant
    /// for `SAS__DASHBOARD__TOKEN` (a secret in the environment).
    pub token: Option<Secret>,
    /// The name of the operator who holds `token`.
    pub token_name: String,
    /// `basic` mode: users with their passwords and roles.
    pub users: Vec<DashboardUser>,
    /// `proxy` mode: the peers (IP addresses or CIDR ranges) whose identity
    /// header is believed. Anyone else is refused. In every mode, what these
    /// peers append to `X-Forwarded-For` and say in `X-Forwarded-Proto` is
    /// believed (the login limits' client, the cookie's `Secure`); what
    /// anyone else sends there is ignored.
    pub trusted_proxies: Vec<Cidr>,
    /// `proxy` mode: the header that names the user.
    pub user_header: String,
    /// `proxy` mode: the header that gives the user's role (`viewer` or
    /// `operator`); when unset or not sent, the role is `proxy_role`.
    pub role_header: Option<String>,
    /// `proxy` mode: the role of a user the proxy gives no role.
    pub proxy_role: Role,
    /// Host names (without port) that requests may address besides
    /// `localhost`, `127.0.0.1`, `[::1]` and `http.host`: a guard against
    /// DNS rebinding. Any port is allowed.
    pub allowed_hosts: Vec<String>,
    /// How long a login (the session cookie) lasts.
    #[serde(with = "humantime_serde")]
    pub session_ttl: Duration,
    /// Marks the session cookie `Secure` (sent over HTTPS only) always. Without
    /// it the cookie is still `Secure` whenever the request came over HTTPS:
    /// the login form's `Origin` is `https://…`, or a peer in
    /// `trusted_proxies` sent `X-Forwarded-Proto: https`. Set it when the
    /// dashboard is reached through an HTTPS proxy that sends neither.
    pub secure_cookie: bool,
    /// Failed logins (the login form, a wrong bearer token or Basic
    /// password) one client may make per `login_failure_window`; past it,
    /// its logins, right or wrong, are answered 429 with `Retry-After` until
    /// the window has let one more through. A client is its IP address (an
    /// IPv6 client its /64), or, from a peer in `trusted_proxies`, the
    /// address that peer appended to `X-Forwarded-For`.
    pub login_failures_per_client: u32,
    /// Failed logins of all clients together per `login_failure_window`:
    /// the bound on guessing from many addresses at once. Past it, every
    /// login is answered 429 (sessions already open and proxy mode are not
    /// affected).
    pub login_failures_total: u32,
    /// The window the two limits above count in: failures are forgotten
    /// evenly over it (a token bucket), so after a burst one more attempt
    /// is allowed every `login_failure_window / limit`.
    #[serde(with = "humantime_serde")]
    pub login_failure_window: Duration,
}

impl Default for DashboardSettings {
    fn default() -> Self {
        Self {
            auth: DashboardAuth::None,
            tokens: Vec::new(),
            token: None,
            token_name: "admin".into(),
            users: Vec::new(),
            trusted_proxies: Vec::new(),
            user_header: "X-Forwarded-User".into(),
            role_header: None,
            proxy_role: Role::Viewer,
            allowed_hosts: Vec::new(),
            session_ttl: Duration::from_secs(12 * 3600),
            secure_cookie: false,
            login_failures_per_client: 10,
            login_failures_total: 100,
            login_failure_window: Duration::from_secs(60),
        }
    }
}

/// How dashboard callers authenticate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DashboardAuth {
    /// Bearer tokens, and a login page that trades one for a session cookie.
    Token,
    /// HTTP Basic.
    Basic,
    /// An identity header from a trusted proxy.
    Proxy,
    /// No authentication: everyone is the operator `dashboard`.
    None,
}

impl DashboardAuth {
    /// The setting's value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Token => "token",
            Self::Basic => "basic",
            Self::Proxy => "proxy",
            Self::None => "none",
        }
    }
}

/// What an identity may do on the dashboard.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Reads the pages and the GET API.
    #[default]
    Viewer,
    /// Also retries and cancels orders.
    Operator,
}

impl Role {
    /// The role's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Viewer => "viewer",
            Self::Operator => "operator",
        }
    }
}

impl FromStr for Role {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        match s.trim().to_ascii_lowercase().as_str() {
            "viewer" => Ok(Self::Viewer),
            "operator" => Ok(Self::Operator),
            _ => Err(()),
        }
    }
}

/// `dashboard.tokens[]`: a named bearer token.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DashboardToken {
    pub name: String,
    pub token: Secret,
    /// `viewer` unless said otherwise.
    #[serde(default)]
    pub role: Role,
}

/// `dashboard.users[]`: an HTTP Basic user.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DashboardUser {
    pub name: String,
    pub password: Secret,
    /// `viewer` unless said otherwise.
    #[serde(default)]
    pub role: Role,
}

/// A secret string (a token, a password): its `Debug` shows no content, so
/// printing the settings never leaks it.
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// The secret itself, for comparing it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(…)")
    }
}

/// An IP address or a CIDR range (`10.0.0.5`, `10.0.0.0/8`, `fd00::/8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct Cidr(ipnet::IpNet);

/// Why a [`Cidr`] did not parse.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not an IP address or a CIDR range such as 10.0.0.0/8")]
pub struct CidrError(String);

impl Cidr {
    /// Whether `ip` is in the range (an IPv4-mapped IPv6 address counts as
    /// its IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.contains(&ip.to_canonical())
    }
}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(text: &str) -> Result<Self, CidrError> {
        let trimmed = text.trim();
        let net = match trimmed.parse::<IpAddr>() {
            // One address: the range of just it, as the peer's canonical
            // form (an IPv4-mapped address is its IPv4 address).
            Ok(addr) => ipnet::IpNet::from(addr.to_canonical()),
            Err(_) => trimmed.parse().map_err(|_| CidrError(text.to_owned()))?,
        };
        Ok(Self(net))
    }
}

impl TryFrom<String> for Cidr {
    type Error = CidrError;

    fn try_from(text: String) -> Result<Self, CidrError> {
        text.parse()
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Whether `name` can be an identity's name: 1 to 64 ASCII letters, digits,
/// `.`, `_`, `@` or `-`, so `operator:<name>` is a plain word in the event log.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._@-".contains(c))
}

/// Whether `host` can be an allowed host: a name or address without scheme,
/// path or port (an IPv6 address in brackets).
fn valid_host(host: &str) -> bool {
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']'));
    match bare {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => {
            !host.is_empty()
                && host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || ".-_".contains(c))
        }
    }
}

impl DashboardSettings {
    /// `token`, unless it is unset or empty (an empty `SAS__DASHBOARD__TOKEN`
    /// counts as unset).
    pub fn single_token(&self) -> Option<&Secret> {
        self.token.as_ref().filter(|t| !t.expose().is_empty())
    }

    /// Checks names, secrets and what the chosen mode needs.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        let bad_name = |key: &str, name: &str| {
            ConfigError::Invalid(format!(
                "{key} {name:?} must be 1 to {MAX_NAME_BYTES} ASCII letters, digits, '.', '_', '@' or '-'"
            ))
        };
        for t in &self.tokens {
            if !valid_name(&t.name) {
                return Err(bad_name("dashboard.tokens[].name", &t.name));
            }
        }
        if !valid_name(&self.token_name) {
            return Err(bad_name("dashboard.token_name", &self.token_name));
        }
        for u in &self.users {
            if !valid_name(&u.name) {
                return Err(bad_name("dashboard.users[].name", &u.name));
            }
        }
        let tokens: Vec<(&str, &Secret)> = self
            .tokens
            .iter()
            .map(|t| (t.name.as_str(), &t.token))
            .chain(self.single_token().map(|t| (self.token_name.as_str(), t)))
            .collect();
        for (i, (name, token)) in tokens.iter().enumerate() {
            if token.expose().len() < MIN_TOKEN_BYTES {
                return invalid(format!(
                    "dashboard token of {name:?} must be at least {MIN_TOKEN_BYTES} bytes"
                ));
            }
            if tokens[..i].iter().any(|(_, t)| t == token) {
                return invalid(format!(
                    "dashboard token of {name:?} is also another identity's token"
                ));
            }
        }
        for (i, u) in self.users.iter().enumerate() {
            if u.password.expose().is_empty() {
                return invalid(format!(
                    "dashboard.users: the password of {:?} is empty",
                    u.name
                ));
            }
            if self.users[..i].iter().any(|o| o.name == u.name) {
                return invalid(format!("dashboard.users: {:?} is listed twice", u.name));
            }
        }
        for header in std::iter::once(&self.user_header).chain(self.role_header.iter()) {
            if axum::http::HeaderName::from_bytes(header.as_bytes()).is_err() {
                return invalid(format!(
                    "dashboard header name {header:?} is not a valid HTTP header name"
                ));
            }
        }
        for host in &self.allowed_hosts {
            if !valid_host(host) {
                return invalid(format!(
                    "dashboard.allowed_hosts entry {host:?} must be a host name or address \
                     without scheme, port or path (IPv6 in brackets)"
                ));
            }
        }
        if self.session_ttl.is_zero() {
            return invalid("dashboard.session_ttl must be more than 0".into());
        }
        if self.login_failures_per_client == 0 || self.login_failures_total == 0 {
            return invalid(
                "dashboard.login_failures_per_client and dashboard.login_failures_total must \
                 be more than 0 (a client that may never fail could never log in)"
                    .into(),
            );
        }
        if self.login_failure_window < MIN_LOGIN_FAILURE_WINDOW {
            return invalid(format!(
                "dashboard.login_failure_window must be at least {MIN_LOGIN_FAILURE_WINDOW:?}"
            ));
        }
        match self.auth {
            DashboardAuth::Token if tokens.is_empty() => invalid(
                "dashboard.auth = \"token\" needs dashboard.tokens or dashboard.token \
                 (SAS__DASHBOARD__TOKEN)"
                    .into(),
            ),
            DashboardAuth::Basic if self.users.is_empty() => {
                invalid("dashboard.auth = \"basic\" needs dashboard.users".into())
            }
            DashboardAuth::Proxy if self.trusted_proxies.is_empty() => invalid(
                "dashboard.auth = \"proxy\" needs dashboard.trusted_proxies (the proxy's addresses)"
                    .into(),
            ),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    fn load(env: &[(&str, &str)]) -> Result<Settings, ConfigError> {
        let env = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Settings::load_with(None, Some(env))
    }

    #[test]
    fn the_default_is_no_authentication() {
        let s = Settings::default();
        assert_eq!(s.dashboard.auth, DashboardAuth::None);
        assert_eq!(s.dashboard.user_header, "X-Forwarded-User");
        assert_eq!(s.dashboard.proxy_role, Role::Viewer);
    }

    #[test]
    fn a_token_from_the_environment_is_enough_for_token_mode_and_never_prints() {
        let secret = "s3cret-s3cret-s3cret";
        let s = load(&[
            ("SAS__DASHBOARD__AUTH", "token"),
            ("SAS__DASHBOARD__TOKEN", secret),
        ])
        .expect("loads");
        assert_eq!(s.dashboard.auth, DashboardAuth::Token);
        assert_eq!(s.dashboard.token.as_ref().map(Secret::expose), Some(secret));
        assert!(!format!("{s:?}").contains(secret), "a secret in Debug");
    }

    #[test]
    fn each_mode_needs_its_credentials() {
        for (mode, key) in [
            ("token", "dashboard.token"),
            ("basic", "dashboard.users"),
            ("proxy", "dashboard.trusted_proxies"),
        ] {
            let err = load(&[("SAS__DASHBOARD__AUTH", mode)]).expect_err(mode);
            assert!(err.to_string().contains(key), "{mode}: {err}");
        }
        let err = load(&[("SAS__DASHBOARD__AUTH", "kerberos")]).expect_err("unknown mode");
        assert!(err.to_string().contains("kerberos"), "{err}");
    }

    #[test]
    fn an_empty_token_variable_counts_as_unset() {
        let s = load(&[("SAS__DASHBOARD__TOKEN", "")]).expect("loads with auth none");
        assert!(s.dashboard.single_token().is_none());
        let err = load(&[
            ("SAS__DASHBOARD__AUTH", "token"),
            ("SAS__DASHBOARD__TOKEN", ""),
        ])
        .expect_err("token mode without a token");
        assert!(err.to_string().contains("SAS__DASHBOARD__TOKEN"), "{err}");
    }

    #[test]
    fn a_short_token_and_a_bad_name_are_refused() {
        let err = load(&[
            ("SAS__DASHBOARD__AUTH", "token"),
            ("SAS__DASHBOARD__TOKEN", "short"),
        ])
        .expect_err("short");
        assert!(err.to_string().contains("at least 16 bytes"), "{err}");
        let err = load(&[
            ("SAS__DASHBOARD__TOKEN", "long-enough-long-enough"),
            ("SAS__DASHBOARD__TOKEN_NAME", "eve\nadmin"),
        ])
        .expect_err("bad name");
        assert!(err.to_string().contains("token_name"), "{err}");
    }

    #[test]
    fn trusted_proxies_and_allowed_hosts_are_lists_in_the_environment() {
        let s = load(&[
            ("SAS__DASHBOARD__AUTH", "proxy"),
            (
                "SAS__DASHBOARD__TRUSTED_PROXIES",
                "10.0.0.5, 192.168.0.0/16,fd00::/8",
            ),
            ("SAS__DASHBOARD__ALLOWED_HOSTS", "sas.example.com,[fd00::1]"),
            ("SAS__DASHBOARD__ROLE_HEADER", "X-Forwarded-Role"),
        ])
        .expect("loads");
        let d = &s.dashboard;
        assert_eq!(d.trusted_proxies.len(), 3);
        assert_eq!(d.allowed_hosts, ["sas.example.com", "[fd00::1]"]);
        assert_eq!(d.role_header.as_deref(), Some("X-Forwarded-Role"));
        let err = load(&[("SAS__DASHBOARD__ALLOWED_HOSTS", "https://x.example")])
            .expect_err("a URL is not a host");
        assert!(err.to_string().contains("allowed_hosts"), "{err}");
        let err =
            load(&[("SAS__DASHBOARD__TRUSTED_PROXIES", "10.0.0.0/33")]).expect_err("bad range");
        assert!(err.to_string().contains("10.0.0.0/33"), "{err}");
    }

    #[test]
    fn a_cidr_contains_its_addresses_only() {
        let net: Cidr = "10.1.0.0/16".parse().expect("range");
        assert!(net.contains("10.1.200.3".parse().unwrap()));
        assert!(!net.contains("10.2.0.1".parse().unwrap()));
        assert!(
            net.contains("::ffff:10.1.0.9".parse().unwrap()),
            "IPv4-mapped"
        );
        let one: Cidr = "127.0.0.1".parse().expect("address");
        assert!(one.contains("127.0.0.1".parse().unwrap()));
        assert!(!one.contains("127.0.0.2".parse().unwrap()));
        let odd: Cidr = "192.168.0.0/23".parse().expect("range");
        assert!(odd.contains("192.168.1.255".parse().unwrap()));
        assert!(!odd.contains("192.168.2.0".parse().unwrap()));
        let v6: Cidr = "fd00::/8".parse().expect("range");
        assert!(v6.contains("fd12::1".parse().unwrap()));
        assert!(!v6.contains("10.0.0.1".parse().unwrap()));
        let all: Cidr = "0.0.0.0/0".parse().expect("range");
        assert!(all.contains("8.8.8.8".parse().unwrap()));
        for bad in ["10.0.0.0/33", "nope", "10.0.0.0/x", "::/129"] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn login_limits_have_defaults_and_must_let_someone_in() {
        let d = Settings::default().dashboard;
        assert_eq!(
            (
                d.login_failures_per_client,
                d.login_failures_total,
                d.login_failure_window
            ),
            (10, 100, Duration::from_secs(60))
        );
        let s = load(&[
            ("SAS__DASHBOARD__LOGIN_FAILURES_PER_CLIENT", "3"),
            ("SAS__DASHBOARD__LOGIN_FAILURE_WINDOW", "2s"),
        ])
        .expect("loads");
        assert_eq!(s.dashboard.login_failures_per_client, 3);
        assert_eq!(s.dashboard.login_failure_window, Duration::from_secs(2));
        let err = load(&[("SAS__DASHBOARD__LOGIN_FAILURES_TOTAL", "0")]).expect_err("zero");
        assert!(err.to_string().contains("login_failures_total"), "{err}");
        let err = load(&[("SAS__DASHBOARD__LOGIN_FAILURE_WINDOW", "1ms")]).expect_err("short");
        assert!(err.to_string().contains("login_failure_window"), "{err}");
    }

    #[test]
    fn names_are_plain_words() {
        assert!(valid_name("alice.smith@example.com"));
        for bad in ["", "a b", "eve\n", "ünï", &"x".repeat(65)] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }
}

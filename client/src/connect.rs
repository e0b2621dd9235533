//! Connecting to RabbitMQ: a list of nodes tried in a shuffled order,
//! retried with backoff until a deadline, over TLS for `amqps://`. The sas
//! services connect through [`connect_nodes`] too, so there is one way to
//! reach the broker.

use std::time::{Duration, Instant};

use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::uri::{AMQPUri, SASLMechanism};
use lapin::{Connection, ConnectionProperties, DefaultConnectionBuilder};

/// Why no connection was made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// A URL does not parse. The URL is shown without its password.
    #[error("{url} is not a valid AMQP URL: {reason}")]
    BadUrl { url: String, reason: String },
    /// No node answered before the deadline: RabbitMQ is down or the
    /// address is wrong. Try again later, or check the URL.
    #[error("could not reach RabbitMQ within {waited:?}: {last}")]
    Unreachable {
        waited: Duration,
        last: lapin::Error,
    },
    /// The TLS handshake failed: a configuration to fix (the CA
    /// certificates, the client certificate, the server's certificate for
    /// the URL's host), not a state to wait out, so it is not retried.
    #[error(
        "TLS to RabbitMQ failed (check the CA certificates, the client certificate and the \
         server's certificate for the URL's host): {0}"
    )]
    Tls(lapin::Error),
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
}

/// TLS beyond the system's root certificates, for `amqps://` URLs. Its
/// `Debug` leaves the client key out.
#[derive(Clone, Default)]
pub struct Tls {
    /// PEM certificates trusted beside the system's roots (a private CA).
    pub ca_pem: Option<String>,
    /// A client certificate chain and its PKCS #8 key, both PEM, for
    /// RabbitMQ's `EXTERNAL` authentication or mutual TLS.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("ca_pem", &self.ca_pem.as_ref().map(|_| "<PEM>"))
            .field(
                "identity",
                &self.identity.as_ref().map(|_| "<certificate and key>"),
            )
            .finish()
    }
}

impl Tls {
    fn lapin(&self) -> OwnedTLSConfig {
        OwnedTLSConfig {
            identity: self
                .identity
                .clone()
                .map(|(pem, key)| OwnedIdentity::PKCS8 { pem, key }),
            cert_chain: self.ca_pem.clone(),
        }
    }
}

/// How to connect, beside the nodes.
#[derive(Debug, Clone)]
pub struct ConnectParams {
    /// The connection's name in RabbitMQ's management.
    pub name: String,
    /// How long to keep trying before [`ConnectError::Unreachable`].
    pub timeout: Duration,
    /// The AMQP heartbeat, unless a URL names one: a silent connection is
    /// given up after about two.
    pub heartbeat: Duration,
    pub tls: Tls,
}

/// A connection made, and who it logged in as.
pub struct Connected {
    pub connection: Connection,
    /// The user of the URL that connected (none with `EXTERNAL` or
    /// `ANONYMOUS` authentication, where the broker names it): what
    /// messages carry as `user_id` (contract §1b).
    pub user: Option<String>,
    /// The node, as `host:port`.
    pub node: String,
}

/// The user a node's URL logs in as: none with `EXTERNAL` or `ANONYMOUS`
/// authentication, where the broker names it.
pub fn user_of(uri: &AMQPUri) -> Option<String> {
    match uri.query.auth_mechanism.unwrap_or_default() {
        SASLMechanism::External | SASLMechanism::Anonymous => None,
        _ => Some(uri.authority.userinfo.username.clone()),
    }
}

/// Parses a node's URL, with `redact` to show it in an error without its
/// password.
pub fn parse_node(url: &str, redact: impl Fn(&str) -> String) -> Result<AMQPUri, ConnectError> {
    let uri: AMQPUri = url.parse().map_err(|reason: String| ConnectError::BadUrl {
        url: redact(url),
        reason: reason.replace(url, &redact(url)),
    })?;
    if let Some(n) = uri.query.frame_max
        && n < lapin::protocol::constants::FRAME_MIN_SIZE
    {
        return Err(ConnectError::BadUrl {
            url: redact(url),
            reason: format!(
                "frame_max={n} is below AMQP's smallest frame ({})",
                lapin::protocol::constants::FRAME_MIN_SIZE
            ),
        });
    }
    Ok(uri)
}

/// `url` without the password of its userinfo.
pub fn without_password(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    // The userinfo runs to the last `@` (a password may hold one).
    let Some(at) = url.rfind('@').filter(|&at| at > scheme_end) else {
        return url.to_owned();
    };
    match url[scheme_end..at].find(':') {
        Some(colon) => format!("{}:***{}", &url[..scheme_end + colon], &url[at..]),
        None => url.to_owned(),
    }
}

/// Connects to one of `nodes`, each in a shuffled order (so that instances
/// spread over a cluster and a reconnection after a node's loss tries the
/// others), retrying with backoff until `params.timeout`. A failed TLS
/// handshake is not retried.
pub async fn connect_nodes(
    mut nodes: Vec<AMQPUri>,
    params: &ConnectParams,
) -> Result<Connected, ConnectError> {
    if nodes.is_empty() {
        return Err(ConnectError::BadUrl {
            url: String::new(),
            reason: "no node".into(),
        });
    }
    for uri in &mut nodes {
        if uri.query.heartbeat.is_none() {
            let secs = params.heartbeat.as_secs().clamp(1, u64::from(u16::MAX));
            uri.query.heartbeat = Some(u16::try_from(secs).unwrap_or(u16::MAX));
        }
    }
    fastrand::shuffle(&mut nodes);
    let tls = params.tls.lapin();
    let properties =
        ConnectionProperties::default().with_connection_name(params.name.clone().into());
    let started = Instant::now();
    let mut wait = Duration::from_millis(100);
    loop {
        let mut last = None;
        for uri in &nodes {
            let node = format!("{}:{}", uri.authority.host, uri.authority.port);
            // Bound each attempt: an address that swallows packets would
            // otherwise hold one for the kernel's TCP timeout (minutes).
            let left = params
                .timeout
                .saturating_sub(started.elapsed())
                .clamp(Duration::from_millis(500), Duration::from_secs(10));
            let builder = DefaultConnectionBuilder::new()?
                .with_uri(uri.clone())
                .with_properties(properties.clone())
                .with_tls_config(tls.clone());
            let attempt = tokio::time::timeout(left, builder.connect())
                .await
                .unwrap_or_else(|_| {
                    Err(lapin::Error::from(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no answer within {left:?}"),
                    )))
                });
            match attempt {
                Ok(connection) => {
                    let user = user_of(uri);
                    return Ok(Connected {
                        connection,
                        user,
                        node,
                    });
                }
                Err(e) if is_tls_failure(&e) => return Err(ConnectError::Tls(e)),
                Err(e) => {
                    tracing::warn!(error = %e, %node, "RabbitMQ node not reachable");
                    last = Some(e);
                }
            }
        }
        if started.elapsed() >= params.timeout
            && let Some(last) = last
        {
            return Err(ConnectError::Unreachable {
                waited: started.elapsed(),
                last,
            });
        }
        tracing::warn!("no RabbitMQ node reachable yet; retrying");
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(2));
    }
}

/// Whether a connection attempt failed in the TLS handshake (an unknown
/// issuer, a name mismatch, a refused client certificate, a plaintext
/// server): rustls's error inside the I/O error lapin reports.
fn is_tls_failure(e: &lapin::Error) -> bool {
    match e.kind() {
        lapin::ErrorKind::IOError(io) => io
            .get_ref()
            .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some()),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_is_never_shown() {
        assert_eq!(
            without_password("amqps://shop:s3cr@t@mq.example:5671/%2f"),
            "amqps://shop:***@mq.example:5671/%2f"
        );
        assert_eq!(without_password("amqp://mq:5672"), "amqp://mq:5672");
        assert_eq!(without_password("amqp://guest@mq"), "amqp://guest@mq");
    }

    #[test]
    fn a_bad_url_is_refused_without_its_password() {
        let Err(ConnectError::BadUrl { url, reason }) =
            parse_node("amqp://u:hunter2@host:notaport", without_password)
        else {
            panic!("a bad port parses");
        };
        assert!(
            !url.contains("hunter2") && !reason.contains("hunter2"),
            "{url} {reason}"
        );
    }

    #[test]
    fn a_frame_max_below_amqps_smallest_is_refused() {
        assert!(parse_node("amqp://h?frame_max=100", without_password).is_err());
        assert!(parse_node("amqp://h?frame_max=16384", without_password).is_ok());
    }
}

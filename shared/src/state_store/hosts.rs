//! Several database hosts (contract §6a), named as libpq names them:
//! `postgres://u@h1:5432,h2:5432/sas?target_session_attrs=read-write`.
//!
//! What sqlx does and does not do here: its `PgConnectOptions` names one
//! host and port (a list does not parse), ignores `target_session_attrs`
//! and `load_balance_hosts`, and a pool opens every connection with the
//! options it was given, which [`sqlx::Pool::set_connect_options`] may
//! change while it runs. It does not notice that a server went read-only,
//! and it keeps idle connections to a server that is gone until they fail.
//! So sas does the rest: [`Hosts`] splits the list into one URL per host,
//! [`find`] asks each host in turn, as libpq does, for the first that
//! answers (and accepts writes, with `read-write` or `primary`), and
//! [`follow`] watches the pool's host and, when it stops answering or
//! accepting writes, points the pool at the host that does and retires the
//! connections opened before (see [`Switched`]).

use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};

/// A `database.url` that sas cannot use.
#[derive(Debug, thiserror::Error)]
pub enum HostsError {
    /// A list entry is empty (`h1,,h2`, a trailing comma).
    #[error("database.url names an empty host in its host list: {0}")]
    EmptyHost(String),
    /// `target_session_attrs` asks for a server sas cannot write to.
    #[error(
        "database.url asks for target_session_attrs={0}: sas writes to the database, so it \
         must be any, read-write or primary"
    )]
    SessionAttrs(String),
    /// `load_balance_hosts` is neither `disable` nor `random`.
    #[error("database.url asks for load_balance_hosts={0}: it must be disable or random")]
    LoadBalance(String),
    /// One host's URL does not parse.
    #[error("database.url {url} does not parse: {error}")]
    Url { url: String, error: String },
}

/// The hosts a `database.url` names, in its order, with what sas asks of
/// the one it uses.
#[derive(Debug, Clone)]
pub struct Hosts {
    /// One URL per host, without the parameters that only this module reads.
    urls: Vec<String>,
    /// `target_session_attrs=read-write` (or `primary`): only a server that
    /// accepts writes will do.
    writable: bool,
    /// `load_balance_hosts=random`: hosts are tried in a random order.
    random: bool,
}

impl Hosts {
    /// Splits `url` into its hosts; a URL naming one host without the
    /// parameters is kept as it is.
    pub fn parse(url: &str) -> Result<Self, HostsError> {
        let attrs = crate::config::query_param(url, "target_session_attrs");
        let writable = match attrs.as_deref() {
            None | Some("any") => false,
            Some("read-write" | "primary") => true,
            Some(other) => return Err(HostsError::SessionAttrs(other.to_owned())),
        };
        let random = match crate::config::query_param(url, "load_balance_hosts").as_deref() {
            None | Some("disable") => false,
            Some("random") => true,
            Some(other) => return Err(HostsError::LoadBalance(other.to_owned())),
        };
        let urls = split(url)?;
        for one in &urls {
            if let Err(e) = one.parse::<PgConnectOptions>() {
                return Err(HostsError::Url {
                    url: crate::tls::redact_url(one),
                    error: crate::tls::redact(&e.to_string(), [one.as_str(), url]),
                });
            }
        }
        Ok(Self {
            urls,
            writable,
            random,
        })
    }

    /// One URL per host, in the configured order.
    pub fn urls(&self) -> &[String] {
        &self.urls
    }

    /// Whether only a server that accepts writes will do.
    pub fn writable(&self) -> bool {
        self.writable
    }

    /// Whether the pool must be watched: more than one host, or a host
    /// that must accept writes (a lone server may be demoted).
    pub fn watched(&self) -> bool {
        self.urls.len() > 1 || self.writable
    }

    /// The order to try the hosts in: as configured, or shuffled with
    /// `load_balance_hosts=random`.
    fn order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.urls.len()).collect();
        if self.random {
            fastrand::shuffle(&mut order);
        }
        order
    }
}

/// `url` with its host list split, one URL per host, the parameters that
/// only [`Hosts`] reads taken out of the query.
fn split(url: &str) -> Result<Vec<String>, HostsError> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Ok(vec![url.to_owned()]);
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (Some(userinfo), hosts),
        None => (None, authority),
    };
    let (path, query) = match tail.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (tail, None),
    };
    let ours = |pair: &&str| {
        let key = pair.split('=').next().unwrap_or_default();
        key == "target_session_attrs" || key == "load_balance_hosts"
    };
    let kept: Option<Vec<&str>> = query.map(|q| q.split('&').filter(|p| !ours(p)).collect());
    if !hosts.contains(',') && kept.as_ref().map(Vec::len) == query.map(|q| q.split('&').count()) {
        return Ok(vec![url.to_owned()]);
    }
    let query = match kept {
        Some(kept) if !kept.is_empty() => format!("?{}", kept.join("&")),
        _ => String::new(),
    };
    hosts
        .split(',')
        .map(|host| {
            if host.is_empty() {
                return Err(HostsError::EmptyHost(crate::tls::redact_url(url)));
            }
            let user = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
            Ok(format!("{scheme}://{user}{host}{path}{query}"))
        })
        .collect()
}

/// Whether this connection's server accepts writes (what libpq's
/// `read-write` asks: `transaction_read_only` is off, so neither a standby
/// in recovery nor a server set read-only).
pub(super) async fn accepts_writes(conn: &mut sqlx::PgConnection) -> Result<bool, sqlx::Error> {
    let read_only: String = sqlx::query_scalar("SHOW transaction_read_only")
        .fetch_one(&mut *conn)
        .await?;
    Ok(read_only == "off")
}

/// The first host, in [`Hosts`]'s order, that answers within `bound` (and
/// accepts writes, when asked): its index in `options`. The error is the
/// last host's.
pub(super) async fn find(
    hosts: &Hosts,
    options: &[PgConnectOptions],
    bound: Duration,
) -> Result<usize, sqlx::Error> {
    let mut last = sqlx::Error::Configuration("database.url names no host".into());
    for i in hosts.order() {
        let Some(one) = options.get(i) else { continue };
        let tried = tokio::time::timeout(bound, async {
            let mut conn = one.connect().await?;
            let writes = !hosts.writable || accepts_writes(&mut conn).await?;
            conn.close().await.ok();
            Ok::<_, sqlx::Error>(writes)
        })
        .await;
        match tried {
            Ok(Ok(true)) => return Ok(i),
            Ok(Ok(false)) => {
                last = sqlx::Error::Protocol(format!(
                    "host {} of database.url does not accept writes (a standby, or read-only)",
                    i + 1
                ));
            }
            Ok(Err(e)) => last = e,
            Err(_) => {
                last = sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "host {} of database.url did not answer within {bound:?}",
                        i + 1
                    ),
                ));
            }
        }
    }
    Err(last)
}

/// How often [`follow`] asks the pool's host whether it still serves.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// Keeps `store`'s pool on the host that serves, until the pool closes:
/// every second, asks its host (through the pool, within a second);
/// when that fails or the host no longer accepts writes, finds the one
/// that does ([`find`]) and points the pool's new connections at it,
/// retiring the old ones ([`super::bounded::Epoch`]).
pub(super) async fn follow(
    store: super::StateStore,
    hosts: Hosts,
    options: Vec<PgConnectOptions>,
    mut current: usize,
) {
    // A short bound on asking the pool's host: a false alarm (a pool busy
    // under load) costs one probe of the hosts, and a dead host is found
    // soon (sqlx's acquire retries a refused connection until its timeout).
    let check = store.io_timeout().min(CHECK_EVERY);
    let probe = store.io_timeout().min(Duration::from_secs(5));
    loop {
        tokio::time::sleep(CHECK_EVERY).await;
        if store.pool.is_closed() {
            return;
        }
        let serves = async {
            let mut conn = store.conn().await?;
            let serves = !hosts.writable || conn.run(accepts_writes).await?;
            if !serves {
                conn.discard();
            }
            Ok::<_, super::StoreError>(serves)
        };
        if matches!(tokio::time::timeout(check, serves).await, Ok(Ok(true))) {
            continue;
        }
        match find(&hosts, &options, probe).await {
            Ok(i) if i != current => {
                tracing::warn!(
                    from = current + 1,
                    to = i + 1,
                    "Postgres host {} of database.url no longer serves; following host {}",
                    current + 1,
                    i + 1
                );
                if let Some(one) = options.get(i) {
                    store.pool.set_connect_options(one.clone());
                    store.epoch.mark();
                    current = i;
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "no host of database.url serves yet");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_host_is_kept_as_it_is() {
        let url = "postgres://u:p@db:5432/sas?sslmode=disable";
        let hosts = Hosts::parse(url).unwrap();
        assert_eq!(hosts.urls(), [url]);
        assert!(!hosts.watched());
    }

    #[test]
    fn a_host_list_becomes_one_url_per_host_without_libpqs_own_parameters() {
        let hosts = Hosts::parse(
            "postgres://u:p@h1:5433,h2,[::1]:5434/sas?target_session_attrs=read-write&sslmode=prefer",
        )
        .unwrap();
        assert_eq!(
            hosts.urls(),
            [
                "postgres://u:p@h1:5433/sas?sslmode=prefer",
                "postgres://u:p@h2/sas?sslmode=prefer",
                "postgres://u:p@[::1]:5434/sas?sslmode=prefer",
            ]
        );
        assert!(hosts.writable() && hosts.watched());
        let one = Hosts::parse("postgres://h1/sas?target_session_attrs=primary").unwrap();
        assert_eq!(one.urls(), ["postgres://h1/sas"]);
        assert!(
            one.watched(),
            "a lone host that must accept writes is watched"
        );
    }

    #[test]
    fn hosts_are_tried_in_order_unless_asked_to_shuffle() {
        let hosts = Hosts::parse("postgres://a,b,c,d/x").unwrap();
        assert_eq!(hosts.order(), [0, 1, 2, 3]);
        assert!(!hosts.writable());
        let random = Hosts::parse("postgres://a,b,c,d/x?load_balance_hosts=random").unwrap();
        let mut seen = random.order();
        seen.sort_unstable();
        assert_eq!(seen, [0, 1, 2, 3]);
    }

    #[test]
    fn what_sas_cannot_use_is_refused_with_the_reason() {
        for (url, says) in [
            (
                "postgres://a,b/x?target_session_attrs=read-only",
                "must be any, read-write",
            ),
            (
                "postgres://a,b/x?target_session_attrs=standby",
                "must be any, read-write",
            ),
            ("postgres://a,,b/x", "empty host"),
            (
                "postgres://a,b/x?load_balance_hosts=often",
                "disable or random",
            ),
            ("postgres://u:secret@a:99999,b/x", "does not parse"),
        ] {
            let e = Hosts::parse(url).unwrap_err().to_string();
            assert!(e.contains(says), "{url}: {e}");
            assert!(!e.contains("secret"), "{url}: the password shows: {e}");
        }
    }
}

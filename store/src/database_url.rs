//! A `database.url` as libpq reads it: several hosts
//! (`postgres://u@h1:5432,h2:5432/sas?target_session_attrs=read-write`),
//! split into one URL per host, and its query parameters. Parsing only:
//! the state store connects ([`crate::state_store`]'s host following).

use sqlx::postgres::PgConnectOptions;

/// The value of query parameter `name` in a URL, if present (the last one
/// wins, as in libpq and sqlx), percent-decoded as libpq decodes it (a `+`
/// stays a `+`).
pub fn query_param(url: &str, name: &str) -> Option<String> {
    let query = url.split_once('?')?.1;
    let query = query.split('#').next().unwrap_or_default();
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .rfind(|(k, _)| *k == name)
        .map(|(_, v)| {
            percent_encoding::percent_decode_str(v)
                .decode_utf8_lossy()
                .into_owned()
        })
}

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
        let attrs = query_param(url, "target_session_attrs");
        let writable = match attrs.as_deref() {
            None | Some("any") => false,
            Some("read-write" | "primary") => true,
            Some(other) => return Err(HostsError::SessionAttrs(other.to_owned())),
        };
        let random = match query_param(url, "load_balance_hosts").as_deref() {
            None | Some("disable") => false,
            Some("random") => true,
            Some(other) => return Err(HostsError::LoadBalance(other.to_owned())),
        };
        let urls = split(url)?;
        for one in &urls {
            if let Err(e) = one.parse::<PgConnectOptions>() {
                return Err(HostsError::Url {
                    url: sas_tls::redact_url(one),
                    error: sas_tls::redact(&e.to_string(), [one.as_str(), url]),
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
    pub(crate) fn order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.urls.len()).collect();
        if self.random {
            fastrand::shuffle(&mut order);
        }
        order
    }
}

/// `url` with its host list split, one URL per host, the parameters that
/// only [`Hosts`] reads taken out of the query. By hand: a libpq host list
/// (`h1:5432,h2:5432`) is no URL authority, so the `url` crate refuses it;
/// each URL this returns is then parsed by sqlx.
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
                return Err(HostsError::EmptyHost(sas_tls::redact_url(url)));
            }
            let user = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
            Ok(format!("{scheme}://{user}{host}{path}{query}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_parameter_is_the_last_of_its_name_percent_decoded() {
        let url = "postgres://u@h1,h2/sas?sslrootcert=%2Fetc%2Fca+1.pem&a=1&a=2#x";
        assert_eq!(query_param(url, "a").as_deref(), Some("2"));
        assert_eq!(
            query_param(url, "sslrootcert").as_deref(),
            Some("/etc/ca+1.pem")
        );
        assert_eq!(query_param(url, "b"), None);
        assert_eq!(query_param("postgres://h/sas", "a"), None);
    }

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

//! `[database]` of the configuration: how the state store reaches Postgres.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

/// `[database]`: the state store.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct DatabaseSettings {
    /// Postgres URL; the database is created when it does not exist. It
    /// may name several hosts as libpq does (contract §6a),
    /// `postgres://u@h1:5432,h2:5432/sas?target_session_attrs=read-write`:
    /// sas then uses the one that accepts writes and follows it after a
    /// failover ([`crate::Hosts`]).
    pub url: String,
    /// Pool size per process.
    pub max_connections: u32,
    /// How long start-up keeps trying to reach Postgres before giving up.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Server-side bound on any one statement.
    #[serde(with = "humantime_serde")]
    pub statement_timeout: Duration,
    /// Client-side bound on each store operation's round trips to Postgres
    /// (contract §6a): one that passes it drops its connection, which is
    /// never used again, so a connection gone silent (a partition, a
    /// failover that moved an address) is replaced within this bound. Above
    /// `statement_timeout`, so a slow statement is cancelled by the server
    /// with a clear error before the client gives up on its connection.
    #[serde(with = "humantime_serde")]
    pub io_timeout: Duration,
    /// Most orders (submissions) or replies stored in one transaction. The
    /// ones that arrive while a transaction commits share the next one, up
    /// to this many: a batch costs about the same round trips and fixed
    /// work whatever its size, so under load larger batches do more per
    /// commit (docs/performance.md). A batch can be no larger than
    /// `broker.prefetch` allows: keep that at least twice this, so that the
    /// next batch can gather while one commits.
    pub batch_size: usize,
    /// Such transactions in flight at once per process. One by default:
    /// the replies that arrive while it commits make a larger next batch,
    /// which costs less per order than several small ones side by side
    /// (docs/performance.md).
    pub batch_workers: usize,
    /// A PEM file of CA certificates that Postgres's certificate may chain
    /// to, trusted beside the system's roots. Setting it asks for verified
    /// TLS: `sslmode` becomes `verify-full` unless the URL says `verify-ca`
    /// or `verify-full`, and a URL asking for less is refused. The URL's own
    /// `sslmode=verify-full&sslrootcert=<file>` works as well; when both
    /// are set, this file replaces the URL's `sslrootcert`.
    pub ca_file: Option<PathBuf>,
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        Self {
            url: "postgres://postgres@127.0.0.1:5432/sas".into(),
            max_connections: 10,
            connect_timeout: Duration::from_secs(30),
            statement_timeout: Duration::from_secs(20),
            io_timeout: Duration::from_secs(25),
            batch_size: 256,
            batch_workers: 1,
            ca_file: None,
        }
    }
}

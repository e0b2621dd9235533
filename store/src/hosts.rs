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

use crate::Hosts;
use sqlx::{ConnectOptions, Connection};

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
            let writes = !hosts.writable() || accepts_writes(&mut conn).await?;
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
            let serves = !hosts.writable() || conn.run(accepts_writes).await?;
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

//! # sas-store: the state store
//!
//! Every SQL statement sas issues, grouped by table, as verbs: a
//! transition's [`Session`] loads orders into a [`Unit`] and writes the
//! unit back in one guarded statement. The store holds no rule and chooses
//! no outcome: the engine (crate `sas`) asks the rules between the load and
//! the write-back. It knows nothing of the broker. Every value reaches SQL
//! as a bound parameter.
//!
//! A transition's write-back names, in its `WHERE`, the row version it
//! loaded and the step state and dispatch it expects, so a stale actor
//! changes nothing: the row count says so, and the statement fails whole.
//!
//! Its modules (private ones in code style):
//!
//! - Transitions: `session` (load verbs, write-back), `unit` (the one
//!   write-back statement), `orders`, `steps`, `rows` (row mapping),
//!   `events`, `outbox` (messages and their locks), `definitions`,
//!   `children`, `flows`, `breakers`, `breaker_reports`.
//! - Operations: `leases` and `partitions` (which supervisor sweeps what),
//!   `instances` (heartbeats), `schedules`, `retention` (the batched
//!   prune and its archive), `watches` (HTTP event streams).
//! - Read models ([`ReadModels`], in `reads`): `dashboard`, `search`, `stats`.
//! - Connections: `settings` (`[database]`), `database_url` (libpq host
//!   lists), `hosts` (following a failover), `bounded` (a bound on every
//!   round trip).

mod bounded;
mod breaker_reports;
mod breakers;
mod children;
mod dashboard;
mod database_url;
mod definitions;
mod events;
mod flows;
mod hosts;
mod instances;
mod leases;
mod orders;
mod outbox;
mod partitions;
mod reads;
mod retention;
mod rows;
mod schedules;
mod search;
mod session;
mod settings;
mod stats;
mod steps;
mod unit;
mod watches;

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};

pub use breaker_reports::{
    BREAKER_FORGET_AFTER, BREAKER_HEARTBEAT, BREAKER_STALE_AFTER, BreakerReport, BreakerRow,
};
pub use breakers::{BreakerEvent, SharedBreaker};
pub use dashboard::{Bucket, CHART_BUCKET, CHART_WINDOW, FailedOrder, Overview, WaitingOrder};
pub use database_url::{Hosts, HostsError, query_param};
pub use events::{EventRow, Replay};
pub use leases::Lease;
pub use orders::{ClaimableNow, NewOrder, OrderRow};
pub use outbox::{Committed, DeletedBy, Held, OutboxLocks, OutboxRow, Taken};
pub use partitions::Partitions;
pub use reads::ReadModels;
pub use retention::{Archive, Policy, PruneBatch, PruneError, Pruned, Totals, archive_file_name};
pub use schedules::{ScheduleRow, ScheduleView};
pub use search::{
    Cursor, FoundOrder, MAX_PAGE as MAX_SEARCH_PAGE, OrderSearch, PayloadField, SearchError,
    SearchFailed, SearchPage,
};
pub use session::{Room, Session, Written};
pub use settings::DatabaseSettings;
pub use stats::Stats;
pub use steps::{StepRow, stage_names};
pub use unit::{NewEvent, NewMessage, Tracked, Unit};
pub use watches::{EVENTS_CHANNEL, EventListener, Heard};

/// The Postgres channel a transaction notifies when it makes work claimable now.
pub const WAKE_CHANNEL: &str = "sas_work";

/// What went wrong in the state store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error(transparent)]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("could not reach Postgres within {waited:?}: {last}")]
    Unreachable { waited: Duration, last: sqlx::Error },
    /// A file named by `database.ca_file` or the URL's `sslrootcert`.
    #[error(transparent)]
    TlsFile(#[from] sas_tls::TlsFileError),
    /// The TLS handshake failed or the server refused TLS that the URL asks
    /// for: a configuration to fix, not a state to wait out, so start-up
    /// fails at once.
    #[error(
        "TLS to Postgres failed (check database.ca_file or sslrootcert, sslmode and the \
         server's certificate): {0}"
    )]
    Tls(sqlx::Error),
    /// A rule and the stored order disagree (a bug, never a race: rows
    /// are locked).
    #[error(transparent)]
    Rule(#[from] sas_core::rules::RuleError),
    /// The write-back's guard refused it (an expected state had changed),
    /// or it returned nothing.
    #[error("the write-back was refused: {0}")]
    WriteBackRefused(String),
    /// A message could not be encoded for the outbox.
    #[error("could not encode a message: {0}")]
    Encode(#[from] serde_json::Error),
    /// A batch ended without an outcome for an item (its workers stopped).
    #[error("no outcome for this item: the batch workers stopped")]
    NoOutcome,
    /// A round trip to Postgres passed `database.io_timeout` (the
    /// connection may have gone silent): the connection is dropped.
    #[error(
        "Postgres did not answer within {0:?} (database.io_timeout); the connection is dropped"
    )]
    Silent(Duration),
    /// `database.url` names hosts sas cannot use.
    #[error(transparent)]
    Hosts(#[from] HostsError),
}

impl StoreError {
    /// Whether Postgres refused the data itself (SQLSTATE class 22, a data
    /// exception such as a value out of range or an untranslatable
    /// character; 23, a constraint; 54, a program limit such as a value too
    /// large): the same input fails again every time, so the input that
    /// caused it must be set aside, not retried.
    pub fn is_refusal_of_input(&self) -> bool {
        match self {
            Self::Db(sqlx::Error::Database(e)) => e
                .code()
                .is_some_and(|c| ["22", "23", "54"].iter().any(|class| c.starts_with(class))),
            // sqlx could not encode a value for Postgres.
            Self::Db(sqlx::Error::Encode(_)) => true,
            _ => false,
        }
    }

    /// Whether running the same transaction again may succeed (a lost
    /// connection, a serialization failure, a deadlock, a restart, a full pool).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Db(sqlx::Error::Database(e)) => e.code().is_some_and(|c| {
                // 25006: read_only_sql_transaction, a server that stopped
                // accepting writes (a primary demoted): the pool moves on.
                matches!(
                    c.as_ref(),
                    "40001" | "40P01" | "57P01" | "57P02" | "57P03" | "55P03" | "25006"
                ) || c.starts_with("08")
            }),
            Self::Db(sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed) => {
                true
            }
            Self::Db(sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed) => true,
            Self::Unreachable { .. } | Self::Silent(_) => true,
            // The batch workers stopped (shutting down): hand the item back.
            Self::NoOutcome => true,
            _ => false,
        }
    }
}

/// Handle on the state store; cheap to clone.
#[derive(Clone, Debug)]
pub struct StateStore {
    pool: PgPool,
    /// `database.io_timeout`: the bound on each operation's round trips.
    io_timeout: Duration,
    /// Connections opened before it are retired ([`bounded::Epoch`]).
    epoch: bounded::Epoch,
    /// The definitions read so far ([`definitions`]): they never change.
    definitions: definitions::Cache,
}

/// How Postgres plans the prepared statements of a store's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plans {
    /// Postgres's own choice: while a plan made for the values at hand looks
    /// cheaper than a generic one, it plans every execution. Right for
    /// operator queries with optional filters (`$1 IS NULL OR …`).
    PerExecution,
    /// One generic plan per statement and connection, made at its first
    /// execution, and no sequential scan where an index serves. The
    /// services' statements lock and write orders by key from arrays; for
    /// the one or two orders of a quiet moment Postgres would otherwise
    /// re-plan each (0.5 to 1 ms per statement here, more than running it),
    /// on every transition of every order. A plan made while a table was
    /// small (a new deployment, statistics older than its growth) would scan
    /// it whole on every execution until the next `ANALYZE`.
    Generic,
}

impl Plans {
    /// The planner settings, sent with the connection's start-up.
    ///
    /// No JIT compilation either way: sas's statements run in well under a
    /// millisecond, and compiling one costs a hundred or more. A statement
    /// whose estimate passes `jit_above_cost` (a sequential scan priced as
    /// disabled does) would burn that CPU at every execution.
    pub fn settings(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Self::PerExecution => &[("plan_cache_mode", "auto"), ("jit", "off")],
            Self::Generic => &[
                ("plan_cache_mode", "force_generic_plan"),
                ("enable_seqscan", "off"),
                ("jit", "off"),
            ],
        }
    }
}

impl StateStore {
    /// Connects (creating the database when missing), retrying until
    /// `connect_timeout`, and applies the migrations; statements planned as
    /// Postgres sees fit ([`Plans::PerExecution`]).
    pub async fn connect(settings: &DatabaseSettings, app: &str) -> Result<Self, StoreError> {
        Self::connect_with(settings, app, Plans::PerExecution).await
    }

    /// [`connect`](Self::connect), with statements planned as `plans` says.
    pub async fn connect_with(
        settings: &DatabaseSettings,
        app: &str,
        plans: Plans,
    ) -> Result<Self, StoreError> {
        let hosts = Hosts::parse(&settings.url)?;
        let options = hosts
            .urls()
            .iter()
            .map(|url| {
                let options = tls_options(settings, url.parse::<PgConnectOptions>()?)?
                    .application_name(app)
                    // Sent with the start-up packet: no round trip.
                    .options(session_settings(settings))
                    .options(plans.settings().iter().copied())
                    .log_statements(tracing::log::LevelFilter::Trace);
                Ok(options)
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        let started = std::time::Instant::now();
        let mut wait = Duration::from_millis(100);
        loop {
            match Self::try_connect(&hosts, &options, settings).await {
                Ok(store) => {
                    store.migrate().await?;
                    return Ok(store);
                }
                // No retry: a certificate does not become valid by waiting.
                Err(e) if is_tls_failure(&e) => return Err(StoreError::Tls(e)),
                Err(e) if started.elapsed() < settings.connect_timeout => {
                    let error = sas_tls::redact(&e.to_string(), [settings.url.as_str()]);
                    tracing::warn!(%error, "Postgres not reachable yet; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
                Err(last) => {
                    return Err(StoreError::Unreachable {
                        waited: started.elapsed(),
                        last,
                    });
                }
            }
        }
    }

    /// One attempt: the host to use (the first that serves, when the URL
    /// names several or asks for writes), its database created if missing,
    /// a pool on it, and the task that follows a failover ([`hosts::follow`]).
    async fn try_connect(
        hosts: &Hosts,
        options: &[PgConnectOptions],
        settings: &DatabaseSettings,
    ) -> Result<Self, sqlx::Error> {
        let current = if hosts.watched() {
            hosts::find(hosts, options, settings.io_timeout).await?
        } else {
            0
        };
        let Some(chosen) = options.get(current) else {
            return Err(sqlx::Error::Configuration(
                "database.url names no host".into(),
            ));
        };
        ensure_database(chosen).await?;
        let mut pool = PgPoolOptions::new()
            .max_connections(settings.max_connections)
            .min_connections(1)
            .acquire_timeout(Duration::from_secs(10).min(settings.io_timeout))
            // No ping before each use: it is a round trip per transaction.
            // A connection that died fails its next statement instead, which
            // every caller treats as transient and retries.
            .test_before_acquire(false);
        // Connections opened before the epoch (a round trip that passed its
        // bound, a move to another host) are retired as they come out of
        // the pool: an atomic read, no round trip.
        let epoch = bounded::Epoch::new();
        let retire = epoch.clone();
        pool = pool.before_acquire(move |_, meta| {
            let current = retire.current(meta.age);
            Box::pin(async move { Ok(current) })
        });
        // A connection's buffers grow to the largest statement it sent and
        // the largest answer it read (a write-back of 256 fan-out orders:
        // megabytes), and would keep that size in the pool: each of its
        // connections would hold a peak's worth. Back in the pool they go
        // back to their default size (nothing is done when they are at it).
        pool = pool.after_release(|conn, _| {
            conn.shrink_buffers();
            Box::pin(async { Ok(true) })
        });
        if hosts.watched() {
            let writable = hosts.writable();
            // A new connection to a server that stopped accepting writes is
            // refused (one round trip per connection, not per use).
            pool = pool.after_connect(move |conn, _| {
                Box::pin(async move {
                    if writable && !hosts::accepts_writes(conn).await? {
                        return Err(sqlx::Error::Protocol(
                            "this Postgres host no longer accepts writes".into(),
                        ));
                    }
                    Ok(())
                })
            });
        }
        let pool = pool.connect_with(chosen.clone()).await?;
        let store = Self {
            pool,
            io_timeout: settings.io_timeout,
            epoch,
            definitions: definitions::Cache::default(),
        };
        if hosts.watched() {
            tokio::spawn(hosts::follow(
                store.clone(),
                hosts.clone(),
                options.to_vec(),
                current,
            ));
        }
        Ok(store)
    }

    /// A store over a pool the caller built, without migrating: for tools and
    /// tests that control the connections themselves.
    pub fn from_pool(pool: PgPool) -> Self {
        Self {
            pool,
            io_timeout: DatabaseSettings::default().io_timeout,
            epoch: bounded::Epoch::new(),
            definitions: definitions::Cache::default(),
        }
    }

    /// A pooled connection whose round trips are bounded by
    /// `database.io_timeout` ([`bounded::Conn`]); the wait for it too.
    pub(crate) async fn conn(&self) -> Result<bounded::Conn, StoreError> {
        let conn = bounded::within(self.io_timeout, self.pool.acquire()).await?;
        Ok(bounded::Conn::new(
            conn,
            self.io_timeout,
            self.epoch.clone(),
        ))
    }

    /// `database.io_timeout`.
    pub(crate) fn io_timeout(&self) -> Duration {
        self.io_timeout
    }

    /// Applies the embedded migrations; safe when several services start at once
    /// (sqlx takes an advisory lock).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        sqlx::migrate!("../migrations").run(&self.pool).await?;
        Ok(())
    }

    /// The connection pool, for callers in this crate's modules.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Whether Postgres answers now.
    pub async fn ping(&self) -> bool {
        match self.conn().await {
            Ok(mut conn) => conn
                .run(|c| sqlx::query("SELECT 1").execute(c))
                .await
                .is_ok(),
            Err(_) => false,
        }
    }

    /// A listener for wake-up notifications on [`WAKE_CHANNEL`]. Nothing
    /// tells a listener that its connection went silent: whoever waits on
    /// it also polls, and listens again after a store operation failed.
    pub async fn listen(&self) -> Result<sqlx::postgres::PgListener, StoreError> {
        bounded::within(self.io_timeout, async {
            let mut listener = sqlx::postgres::PgListener::connect_with(&self.pool).await?;
            listener.listen(WAKE_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        })
        .await
    }

    /// A listener for [`EVENTS_CHANNEL`]: the ids of watched orders with
    /// new status events ([`StateStore::watch_events`]).
    pub async fn listen_for_events(&self) -> Result<EventListener, StoreError> {
        bounded::within(self.io_timeout, async {
            let mut listener = sqlx::postgres::PgListener::connect_with(&self.pool).await?;
            listener.listen(EVENTS_CHANNEL).await?;
            Ok::<_, sqlx::Error>(EventListener(listener))
        })
        .await
    }

    /// Stores that `watcher` (a submission instance) waits for the status
    /// events of `orders` until `until`, so that the write-back notifies
    /// [`EVENTS_CHANNEL`] of theirs; deletes watches past their `until`.
    pub async fn watch_events(
        &self,
        watcher: &str,
        orders: &[uuid::Uuid],
        until: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), StoreError> {
        self.conn()
            .await?
            .run(|c| watches::watch(c, watcher, orders, until))
            .await
    }

    /// Stores that `watcher` no longer waits for `order`'s events, the
    /// watch it stored last being the one until `stored`: a later one (a
    /// stream opened meanwhile) stays.
    pub async fn unwatch_events(
        &self,
        watcher: &str,
        order: uuid::Uuid,
        stored: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), StoreError> {
        self.conn()
            .await?
            .run(|c| watches::unwatch(c, watcher, order, stored))
            .await
    }

    /// The orders the supervisor's leader would load now to warn of their
    /// deadlines (at most `limit`, taking nothing), and the state store's
    /// clock as the query read it: for checking the query against its
    /// rule, [`sas_core::rules::supervisor::warnable`].
    pub async fn warnable_now(
        &self,
        rungs: &[f64],
        limit: i64,
    ) -> Result<(Vec<uuid::Uuid>, chrono::DateTime<chrono::Utc>), StoreError> {
        self.conn()
            .await?
            .run(|c| async move {
                let loaded = orders::warnable(&mut *c, rungs, limit).await?;
                let now = match loaded.first() {
                    Some(l) => l.tx_now,
                    None => sqlx::query_scalar("SELECT now()").fetch_one(c).await?,
                };
                Ok::<_, sqlx::Error>((loaded.iter().map(|l| l.order.order_id).collect(), now))
            })
            .await
    }

    /// The orders the supervisor's sweep would load now as expired (at most
    /// `limit`, of every partition, taking nothing: the row locks the query
    /// takes are let go at once), and the state store's clock as the query
    /// read it: for checking the query against its rule,
    /// [`sas_core::rules::supervisor::expired`].
    pub async fn expired_now(
        &self,
        limit: i64,
    ) -> Result<(Vec<uuid::Uuid>, chrono::DateTime<chrono::Utc>), StoreError> {
        self.locking_load_now(limit, None).await
    }

    /// The orders the supervisor would load now to send their steps sent
    /// before `before` again (at most `limit`, taking nothing), and the
    /// state store's clock as the query read it: for checking the query
    /// against its rule, [`sas_core::rules::resend::unsent`].
    pub async fn unsent_now(
        &self,
        before: uuid::Uuid,
        limit: i64,
    ) -> Result<(Vec<uuid::Uuid>, chrono::DateTime<chrono::Utc>), StoreError> {
        self.locking_load_now(limit, Some(before)).await
    }

    /// The expired query (`unsent`: the unsent one, with its bound) run in a
    /// transaction rolled back at once, so that its row locks go with it;
    /// the ids it loaded and its clock.
    async fn locking_load_now(
        &self,
        limit: i64,
        unsent: Option<uuid::Uuid>,
    ) -> Result<(Vec<uuid::Uuid>, chrono::DateTime<chrono::Utc>), StoreError> {
        self.conn()
            .await?
            .run(|c| async move {
                let mut tx = sqlx::Connection::begin(c).await?;
                let loaded = match unsent {
                    None => orders::expired(&mut tx, limit, &[0], 1).await?,
                    Some(before) => orders::unsent(&mut tx, before, limit).await?,
                };
                let now = sqlx::query_scalar("SELECT now()")
                    .fetch_one(&mut *tx)
                    .await?;
                tx.rollback().await?;
                Ok::<_, sqlx::Error>((loaded.iter().map(|l| l.order.order_id).collect(), now))
            })
            .await
    }

    /// The state store's clock now: deadlines are on it (contract §6a),
    /// whatever the clock of the host asking.
    pub async fn clock(&self) -> Result<chrono::DateTime<chrono::Utc>, StoreError> {
        self.conn()
            .await?
            .run(|c| sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(c))
            .await
    }

    /// Whether an order of this id exists (any state): a rejection must not
    /// echo it (contract §1b).
    pub async fn order_exists(&self, order_id: uuid::Uuid) -> Result<bool, StoreError> {
        self.conn()
            .await?
            .run(|c| {
                sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM orders WHERE order_id = $1)")
                    .bind(order_id)
                    .fetch_one(c)
            })
            .await
    }

    /// One order's row, without its steps or events (a cheap read by id).
    pub async fn order(&self, order_id: uuid::Uuid) -> Result<Option<OrderRow>, StoreError> {
        let mut conn = self.conn().await?;
        conn.run(|c| orders::get(c, order_id)).await
    }

    /// One order with its steps and event log, for operators.
    pub async fn order_details(
        &self,
        order_id: uuid::Uuid,
    ) -> Result<Option<(OrderRow, Vec<StepRow>, Vec<EventRow>)>, StoreError> {
        let mut conn = self.conn().await?;
        conn.run(|c| async move {
            let Some(order) = orders::get(&mut *c, order_id).await? else {
                return Ok(None);
            };
            let steps = steps::for_orders(&mut *c, &[order_id]).await?;
            let events = events::for_order(c, order_id).await?;
            Ok::<_, sqlx::Error>(Some((order, steps, events)))
        })
        .await
    }

    /// The stored status events a replay request (contract §9) of
    /// `application` (§1b) asks for, of its own orders, at most `limit`;
    /// `None` when it names an unknown order (or another application's).
    pub async fn replay(
        &self,
        request: &sas_core::messages::ReplayRequest,
        application: Option<&str>,
        limit: u32,
    ) -> Result<Option<Replay>, StoreError> {
        let mut conn = self.conn().await?;
        conn.run(|c| events::replay(c, request, application, limit))
            .await
    }

    /// Orders, newest first, optionally of one state and one workflow.
    pub async fn list_orders(
        &self,
        state: Option<sas_core::state::ProcessState>,
        workflow: Option<&str>,
        limit: i64,
    ) -> Result<Vec<OrderRow>, StoreError> {
        let mut conn = self.conn().await?;
        conn.run(|c| orders::list(c, state, workflow, limit)).await
    }

    /// Records that `instance` (of `role`) is alive now; instances not seen
    /// for an hour are forgotten.
    pub async fn heartbeat(&self, instance: &str, role: &str) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        conn.run(|c| instances::beat(c, instance, role, 3_600_000))
            .await
    }

    /// How many instances of `role` recorded a heartbeat within `within`.
    pub async fn alive(&self, role: &str, within: Duration) -> Result<u32, StoreError> {
        let mut conn = self.conn().await?;
        let ms = i64::try_from(within.as_millis()).unwrap_or(i64::MAX);
        let n: i64 = conn
            .run(|c| {
                sqlx::query_scalar(
                    "SELECT count(*) FROM instances \
                     WHERE role = $1 AND last_seen > now() - $2 * interval '1 millisecond'",
                )
                .bind(role)
                .bind(ms)
                .fetch_one(c)
            })
            .await?;
        Ok(u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// When `instance` last recorded a heartbeat (`None`: never, or
    /// forgotten), with the database's clock now.
    pub async fn last_seen(
        &self,
        instance: &str,
    ) -> Result<
        (
            Option<chrono::DateTime<chrono::Utc>>,
            chrono::DateTime<chrono::Utc>,
        ),
        StoreError,
    > {
        let mut conn = self.conn().await?;
        conn.run(|c| instances::last_seen(c, instance)).await
    }

    /// Up to `limit` orders whose running step is past the first rung of
    /// its deadline ladder (those that may be stuck), with their steps.
    pub async fn late_orders(&self, limit: i64) -> Result<Vec<sas_core::rules::Order>, StoreError> {
        let mut conn = self.conn().await?;
        let loaded = conn.run(|c| orders::late(c, limit)).await?;
        Ok(loaded
            .into_iter()
            .map(|l| sas_core::rules::Order {
                row: l.order,
                steps: l.steps.0,
            })
            .collect())
    }

    /// Closes the pool, waiting for connections in use to come back.
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// What each session asks of the server, sent with the start-up packet.
///
/// Server-side TCP keepalive (sqlx sets none on its own socket): a client
/// gone silently is found by the server within about 25 s, which ends its
/// session and lets its locks go (a leader's advisory lock, an order's row
/// locks). And no transaction may sit idle past `io_timeout`: its client
/// has given up on it by then.
fn session_settings(settings: &DatabaseSettings) -> [(&'static str, String); 5] {
    [
        (
            "statement_timeout",
            settings.statement_timeout.as_millis().to_string(),
        ),
        (
            "idle_in_transaction_session_timeout",
            settings.io_timeout.as_millis().to_string(),
        ),
        ("tcp_keepalives_idle", "10".into()),
        ("tcp_keepalives_interval", "5".into()),
        ("tcp_keepalives_count", "3".into()),
    ]
}

/// Whether connecting failed in TLS: the server refused the TLS that
/// `sslmode` requires, or the handshake failed (sqlx reports rustls's
/// verdict, e.g. an unknown issuer, as an I/O error).
fn is_tls_failure(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Tls(_) => true,
        sqlx::Error::Io(io) => io
            .get_ref()
            .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some()),
        _ => false,
    }
}

/// `options` with the TLS that `settings` ask for: `database.ca_file`
/// trusted (and `sslmode` raised to `verify-full` unless the URL asks for
/// `verify-ca`; `Settings::validate` (crate `sas`)
/// refuses a URL that asks for less), and the URL's own `sslrootcert`
/// checked now, so that a wrong path fails start-up with the key's name.
fn tls_options(
    settings: &DatabaseSettings,
    mut options: PgConnectOptions,
) -> Result<PgConnectOptions, StoreError> {
    use sqlx::postgres::PgSslMode;
    if let Some(root) = crate::query_param(&settings.url, "sslrootcert") {
        sas_tls::read_pem(
            "database.url's sslrootcert",
            std::path::Path::new(&root),
            "CERTIFICATE",
        )?;
    }
    if let Some(ca) = &settings.ca_file {
        let pem = sas_tls::read_pem("database.ca_file", ca, "CERTIFICATE")?;
        options = options.ssl_root_cert_from_pem(pem);
        if !matches!(
            options.get_ssl_mode(),
            PgSslMode::VerifyCa | PgSslMode::VerifyFull
        ) {
            options = options.ssl_mode(PgSslMode::VerifyFull);
        }
    }
    Ok(options)
}

/// Creates the database named in `options` when it does not exist, so a
/// service starts against a bare Postgres. Races between services are fine.
async fn ensure_database(options: &PgConnectOptions) -> Result<(), sqlx::Error> {
    let Some(name) = options.get_database().map(str::to_owned) else {
        return Ok(());
    };
    match options.connect().await {
        Ok(conn) => {
            conn.close().await.ok();
            return Ok(());
        }
        // 3D000: invalid_catalog_name, the database does not exist.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("3D000") => {}
        Err(e) => return Err(e),
    }
    let mut admin = options.clone().database("postgres").connect().await?;
    // A name cannot be a bound parameter: Postgres quotes it (`%I`), from one.
    let create: Result<String, sqlx::Error> =
        sqlx::query_scalar("SELECT format('CREATE DATABASE %I', $1::text)")
            .bind(&name)
            .fetch_one(&mut admin)
            .await;
    let result = match create {
        Ok(create) => {
            sqlx::raw_sql(sqlx::AssertSqlSafe(create))
                .execute(&mut admin)
                .await
        }
        Err(e) => Err(e),
    };
    admin.close().await.ok();
    match result {
        Ok(_) => Ok(()),
        // Another service created it first (duplicate_database, or the unique index).
        Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("42P04" | "23505")) => {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

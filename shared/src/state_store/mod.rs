//! The state store: every SQL statement sas issues, grouped by table, and the
//! transitions built from them, which load orders, ask the pattern's rules
//! ([`crate::rules`]) and write the decisions back. Every value reaches SQL
//! as a bound parameter.
//!
//! A transition's write-back names, in its `WHERE`, the row version it
//! loaded and the step state and dispatch it expects, so a stale actor
//! changes nothing: the row count says so, and the statement fails whole.

mod breaker_reports;
mod breakers;
mod dashboard;
mod events;
mod flows;
mod instances;
mod leases;
mod orders;
mod outbox;
mod partitions;
mod schedules;
mod search;
mod stats;
mod steps;
mod transitions;
mod unit;

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};

pub use crate::rules::operator::{cancel_refusal, redrive_refusal, retry_refusal};
pub use breaker_reports::{
    BREAKER_FORGET_AFTER, BREAKER_HEARTBEAT, BREAKER_STALE_AFTER, BreakerReport, BreakerRow,
};
pub use breakers::{BreakerEvent, SharedBreaker};
pub use dashboard::{Bucket, CHART_BUCKET, CHART_WINDOW, FailedOrder, Overview, WaitingOrder};
pub use events::{EventRow, Replay};
pub use leases::Lease;
pub use orders::{NewOrder, OrderRow};
pub use outbox::{Committed, Held, OutboxRow};
pub use partitions::Partitions;
pub use schedules::{ScheduleRow, ScheduleView};
pub use search::{
    Cursor, FoundOrder, MAX_PAGE as MAX_SEARCH_PAGE, OrderSearch, PayloadField, SearchError,
    SearchFailed, SearchPage,
};
pub use stats::Stats;
pub use steps::{StepRow, stage_names};
pub use transitions::{
    Actor, Done, Expired, Operated, ReplyOutcome, Submitted, Transitions, any_undone,
};

use crate::config::DatabaseSettings;

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
    TlsFile(#[from] crate::tls::TlsFileError),
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
    Rule(#[from] crate::rules::RuleError),
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
                matches!(
                    c.as_ref(),
                    "40001" | "40P01" | "57P01" | "57P02" | "57P03" | "55P03"
                ) || c.starts_with("08")
            }),
            Self::Db(sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed) => {
                true
            }
            Self::Db(sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed) => true,
            Self::Unreachable { .. } => true,
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
    fn settings(self) -> &'static [(&'static str, &'static str)] {
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
        let options = tls_options(settings, settings.url.parse::<PgConnectOptions>()?)?
            .application_name(app)
            // Sent with the start-up packet: no round trip.
            .options([(
                "statement_timeout",
                settings.statement_timeout.as_millis().to_string(),
            )])
            .options(plans.settings().iter().copied())
            .log_statements(tracing::log::LevelFilter::Trace);
        let started = std::time::Instant::now();
        let mut wait = Duration::from_millis(100);
        loop {
            match Self::try_connect(&options, settings.max_connections).await {
                Ok(pool) => {
                    let store = Self { pool };
                    store.migrate().await?;
                    return Ok(store);
                }
                // No retry: a certificate does not become valid by waiting.
                Err(e) if is_tls_failure(&e) => return Err(StoreError::Tls(e)),
                Err(e) if started.elapsed() < settings.connect_timeout => {
                    let error = crate::tls::redact(&e.to_string(), [settings.url.as_str()]);
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

    async fn try_connect(options: &PgConnectOptions, max: u32) -> Result<PgPool, sqlx::Error> {
        ensure_database(options).await?;
        PgPoolOptions::new()
            .max_connections(max)
            .min_connections(1)
            .acquire_timeout(Duration::from_secs(10))
            // No ping before each use: it is a round trip per transaction.
            // A connection that died fails its next statement instead, which
            // every caller treats as transient and retries.
            .test_before_acquire(false)
            .connect_with(options.clone())
            .await
    }

    /// A store over a pool the caller built, without migrating: for tools and
    /// tests that control the connections themselves.
    pub fn from_pool(pool: PgPool) -> Self {
        Self { pool }
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
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }

    /// A listener for wake-up notifications on [`WAKE_CHANNEL`].
    pub async fn listen(&self) -> Result<sqlx::postgres::PgListener, StoreError> {
        let mut listener = sqlx::postgres::PgListener::connect_with(&self.pool).await?;
        listener.listen(WAKE_CHANNEL).await?;
        Ok(listener)
    }

    /// One order with its steps and event log, for operators.
    pub async fn order_details(
        &self,
        order_id: uuid::Uuid,
    ) -> Result<Option<(OrderRow, Vec<StepRow>, Vec<EventRow>)>, StoreError> {
        let mut conn = self.pool.acquire().await?;
        let Some(order) = orders::get(&mut conn, order_id).await? else {
            return Ok(None);
        };
        let steps = steps::for_orders(&mut conn, &[order_id]).await?;
        let events = events::for_order(&mut conn, order_id).await?;
        Ok(Some((order, steps, events)))
    }

    /// The stored status events a replay request (contract §9) asks for, at
    /// most `limit`; `None` when it names an unknown order.
    pub async fn replay(
        &self,
        request: &crate::messages::ReplayRequest,
        limit: u32,
    ) -> Result<Option<Replay>, StoreError> {
        let mut conn = self.pool.acquire().await?;
        Ok(events::replay(&mut conn, request, limit).await?)
    }

    /// Orders, newest first, optionally of one state and one workflow.
    pub async fn list_orders(
        &self,
        state: Option<crate::state::ProcessState>,
        workflow: Option<&str>,
        limit: i64,
    ) -> Result<Vec<OrderRow>, StoreError> {
        let mut conn = self.pool.acquire().await?;
        Ok(orders::list(&mut conn, state, workflow, limit).await?)
    }

    /// A snapshot for operators; "recently" means the last `window`.
    pub async fn stats(&self, window: Duration) -> Result<Stats, StoreError> {
        let mut conn = self.pool.acquire().await?;
        let secs = i64::try_from(window.as_secs()).unwrap_or(i64::MAX);
        Ok(stats::read(&mut conn, secs).await?)
    }

    /// Deletes ended orders last changed longer ago than `older_than`; how many.
    pub async fn prune(&self, older_than: Duration) -> Result<u64, StoreError> {
        let mut conn = self.pool.acquire().await?;
        let ms = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        Ok(orders::prune(&mut conn, ms).await?)
    }

    /// Records that `instance` (of `role`) is alive now; instances not seen
    /// for an hour are forgotten.
    pub async fn heartbeat(&self, instance: &str, role: &str) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await?;
        Ok(instances::beat(&mut conn, instance, role, 3_600_000).await?)
    }

    /// How many instances of `role` recorded a heartbeat within `within`.
    pub async fn alive(&self, role: &str, within: Duration) -> Result<u32, StoreError> {
        let mut conn = self.pool.acquire().await?;
        let ms = i64::try_from(within.as_millis()).unwrap_or(i64::MAX);
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM instances \
             WHERE role = $1 AND last_seen > now() - $2 * interval '1 millisecond'",
        )
        .bind(role)
        .bind(ms)
        .fetch_one(&mut *conn)
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
        let mut conn = self.pool.acquire().await?;
        Ok(instances::last_seen(&mut conn, instance).await?)
    }

    /// Up to `limit` orders whose running step is past the first rung of
    /// its deadline ladder (those that may be stuck), with their steps.
    pub async fn late_orders(&self, limit: i64) -> Result<Vec<crate::rules::Order>, StoreError> {
        let mut conn = self.pool.acquire().await?;
        let loaded = orders::late(&mut conn, limit).await?;
        Ok(loaded
            .into_iter()
            .map(|l| crate::rules::Order {
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
/// `verify-ca`; [`Settings::validate`](crate::config::Settings::validate)
/// refuses a URL that asks for less), and the URL's own `sslrootcert`
/// checked now, so that a wrong path fails start-up with the key's name.
fn tls_options(
    settings: &DatabaseSettings,
    mut options: PgConnectOptions,
) -> Result<PgConnectOptions, StoreError> {
    use sqlx::postgres::PgSslMode;
    if let Some(root) = crate::config::query_param(&settings.url, "sslrootcert") {
        crate::tls::read_pem(
            "database.url's sslrootcert",
            std::path::Path::new(&root),
            "CERTIFICATE",
        )?;
    }
    if let Some(ca) = &settings.ca_file {
        let pem = crate::tls::read_pem("database.ca_file", ca, "CERTIFICATE")?;
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

//! Statements prepared by name, run as simple queries with their arguments
//! as literals ([`super::literal`]), so that one round trip carries more
//! than one statement: `BEGIN` and a transition's first statement, and a
//! transition's write-back and `COMMIT`. sqlx sends each bound query on its
//! own and waits for its answer; at low load each round trip wakes two
//! processes.

use std::sync::Arc;

use sqlx::PgConnection;
use sqlx::postgres::PgRow;

/// The statements run by name, prepared when a connection is made ([`prepare`])
/// or on first use. Server-side: each keeps its generic plan, as every
/// statement of the services does. The write-back comes first: a
/// connection that holds any of them holds it too (a failed `PREPARE` ends
/// the query), so a transaction opened with one can end with it.
fn prepare_sql() -> String {
    format!(
        "PREPARE sas_flush AS {}; \
         PREPARE sas_lock_many(uuid[], boolean) AS {}; \
         PREPARE sas_claimable(bigint, text, bigint, boolean) AS {}; \
         PREPARE sas_take(uuid[], boolean) AS {}",
        super::unit::FLUSH,
        super::orders::lock_many_sql(),
        super::orders::claimable_sql(),
        super::outbox::take_sql(),
    )
}

/// Prepares the statements on a new connection, when what they name exists
/// (a connection made before the migrations prepares them on its first use
/// instead, see [`begin_with`]). A failure is only logged: the first use
/// tries again.
pub(super) async fn prepare(conn: &mut PgConnection) {
    let migrated: Result<bool, sqlx::Error> = sqlx::query_scalar(
        "SELECT to_regclass('orders') IS NOT NULL AND to_regclass('steps') IS NOT NULL \
           AND to_regclass('outbox') IS NOT NULL AND to_regprocedure('sas_fail(text)') IS NOT NULL",
    )
    .fetch_one(&mut *conn)
    .await;
    if let Ok(true) = migrated
        && let Err(e) = sqlx::raw_sql(sqlx::AssertSqlSafe(prepare_sql()))
            .execute(&mut *conn)
            .await
    {
        tracing::warn!(error = %e, "could not prepare the transitions' statements; will on first use");
    }
}

/// Prepares the statements unless this connection has them: for a
/// transaction that sqlx opened, where a first use could not prepare them
/// (the failed `EXECUTE` would abort it). One round trip more.
pub(super) async fn ensure(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    let have: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_prepared_statements WHERE name = 'sas_flush')",
    )
    .fetch_one(&mut *conn)
    .await?;
    if !have {
        sqlx::raw_sql(sqlx::AssertSqlSafe(prepare_sql()))
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// `invalid_sql_statement_name`: no prepared statement of that name.
const UNKNOWN_STATEMENT: &str = "26000";

/// Runs `BEGIN` and `execute` (an `EXECUTE` of a statement of
/// [`prepare_sql`], its arguments literals) in one round trip and returns
/// the statement's rows (in text format). On a connection that has not
/// prepared the statements yet, prepares them and tries again. The
/// transaction stays open, unknown to sqlx: the caller ends it and must not
/// let the connection go back to the pool with it open (see
/// `transitions::Begun`).
pub(super) async fn begin_with<T>(
    conn: &mut PgConnection,
    execute: &str,
) -> Result<Vec<T>, sqlx::Error>
where
    T: for<'r> sqlx::FromRow<'r, PgRow>,
{
    // The failed `EXECUTE` aborted the transaction `BEGIN` opened.
    retrying(conn, format!("BEGIN; {execute}"), Some("ROLLBACK; ")).await
}

/// Runs `sql` (an `EXECUTE` of a statement of [`prepare_sql`], maybe
/// followed by more statements) and returns its rows. Outside a
/// transaction, a connection that has not prepared the statements prepares
/// them and tries again; inside one, they must be there (the transaction
/// was opened with [`begin_with`], or [`ensure`] ran).
pub(super) async fn run<T>(
    conn: &mut PgConnection,
    sql: String,
    in_transaction: bool,
) -> Result<Vec<T>, sqlx::Error>
where
    T: for<'r> sqlx::FromRow<'r, PgRow>,
{
    retrying(conn, sql, (!in_transaction).then_some("")).await
}

/// Runs `sql`; when the connection has not prepared the statements, and
/// `retry` says what must go first (`None`: it cannot be retried), sends
/// that, the statements' `PREPARE` and `sql` again in one round trip.
async fn retrying<T>(
    conn: &mut PgConnection,
    sql: String,
    retry: Option<&str>,
) -> Result<Vec<T>, sqlx::Error>
where
    T: for<'r> sqlx::FromRow<'r, PgRow>,
{
    let sql: Arc<str> = sql.into();
    match (rows(conn, sql.clone()).await, retry) {
        (Err(sqlx::Error::Database(e)), Some(first))
            if e.code().as_deref() == Some(UNKNOWN_STATEMENT) =>
        {
            rows(conn, format!("{first}{}; {sql}", prepare_sql()).into()).await
        }
        (other, _) => other,
    }
}

async fn rows<T>(conn: &mut PgConnection, sql: Arc<str>) -> Result<Vec<T>, sqlx::Error>
where
    T: for<'r> sqlx::FromRow<'r, PgRow>,
{
    let found = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .fetch_all(conn)
        .await?;
    found.iter().map(T::from_row).collect()
}

//! Opening a transaction with its first statement: `BEGIN` and an `EXECUTE`
//! of a statement prepared by name, sent as one simple query. sqlx's
//! `begin()` and a query cost two round trips, and at low load each round
//! trip wakes two processes; the claims, the replies and the relay open
//! their transactions this way.

use sqlx::PgConnection;
use sqlx::postgres::PgRow;

/// The statements [`begin_with`] runs by name, prepared on a connection's
/// first use or when it is made ([`prepare`]; server-side: each keeps its
/// generic plan, as every statement of the services does).
fn prepare_sql() -> String {
    format!(
        "PREPARE sas_lock_many(uuid[], boolean) AS {}; \
         PREPARE sas_claimable(bigint, text, bigint, boolean) AS {}; \
         PREPARE sas_take(uuid[], boolean) AS {}",
        super::orders::lock_many_sql(),
        super::orders::claimable_sql(),
        super::outbox::take_sql(),
    )
}

/// Prepares the statements on a new connection, when the tables they name
/// exist (a connection made before the migrations prepares them on its
/// first use instead, see [`begin_with`]). A failure is only logged: the
/// first use tries again.
pub(super) async fn prepare(conn: &mut PgConnection) {
    let migrated: Result<bool, sqlx::Error> = sqlx::query_scalar(
        "SELECT to_regclass('orders') IS NOT NULL AND to_regclass('steps') IS NOT NULL \
           AND to_regclass('outbox') IS NOT NULL",
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
    let first = rows(conn, format!("BEGIN; {execute}")).await;
    match first {
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(UNKNOWN_STATEMENT) => {
            rows(
                conn,
                format!("ROLLBACK; {}; BEGIN; {execute}", prepare_sql()),
            )
            .await
        }
        other => other,
    }
}

async fn rows<T>(conn: &mut PgConnection, sql: String) -> Result<Vec<T>, sqlx::Error>
where
    T: for<'r> sqlx::FromRow<'r, PgRow>,
{
    let found = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .fetch_all(conn)
        .await?;
    found.iter().map(T::from_row).collect()
}

/// `text` as an SQL string literal (quotes doubled; Postgres keeps
/// backslashes as they are, `standard_conforming_strings` being on).
pub(super) fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// Uuids as an SQL `uuid[]` literal.
pub(super) fn uuid_array(ids: &[uuid::Uuid]) -> String {
    let ids: Vec<String> = ids.iter().map(uuid::Uuid::to_string).collect();
    format!("'{{{}}}'", ids.join(","))
}

//! The `outbox` table: messages committed with a transition, published by the
//! engine's relay and deleted once the broker confirmed them.

use sqlx::PgConnection;
use uuid::Uuid;

use super::{StateStore, StoreError};

/// A message waiting to be published.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct OutboxRow {
    pub id: i64,
    pub order_id: Uuid,
    /// `status`, `request` or `alert`.
    pub kind: String,
    pub routing_key: String,
    pub correlation_id: Option<String>,
    pub reply_to: Option<String>,
    /// The W3C `traceparent` to publish with.
    pub traceparent: Option<String>,
    /// The JSON body, as published: encoded once, when the transition wrote it.
    pub body: Vec<u8>,
    /// A step request handed to this process to publish (`handed_to`): it
    /// stays in the outbox until its reply's write-back deletes it, so the
    /// publisher does not delete it.
    #[sqlx(default)]
    pub handed: bool,
}

/// Who deletes an outbox row once its publish is confirmed
/// ([`OutboxRow::deleted_by`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeletedBy {
    /// The publisher, as it lets the orders' outbox locks go
    /// ([`Held::release`]).
    Release,
    /// The write-back of the step's reply ([`Unit::answered`](super::Unit::answered)):
    /// a request handed to its publisher.
    Reply,
    /// The publishing process's next write-back, or its batch of deletes
    /// ([`Unit::delete_published`](super::Unit::delete_published)): a
    /// status event or alert handed to its publisher.
    WriteBack,
}

impl OutboxRow {
    /// Who deletes this row once published: what a relay and anything
    /// standing in for one must do alike.
    pub fn deleted_by(&self) -> DeletedBy {
        match (self.handed, self.kind == "request") {
            (false, _) => DeletedBy::Release,
            (true, true) => DeletedBy::Reply,
            (true, false) => DeletedBy::WriteBack,
        }
    }
}

/// Whether a transition's connection takes the outbox locks of the orders
/// it loads and writes messages for, keeping them past its write-back so
/// that whoever holds the connection publishes those messages at once and
/// in order ([`Committed::publish`]); or leaves them to the outbox's sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboxLocks {
    /// Take them: the messages come back with the connection that holds them.
    Take,
    /// Take none: the messages wait in the outbox for a sweep.
    Leave,
}

/// The SQL of an order's outbox lock key, for the order id in `column`: one
/// advisory lock per order, held by whoever is publishing its messages (a
/// connection handed over with [`Held`], by a transition or a [`take`]).
pub(super) fn lock_key(column: &str) -> String {
    format!("hashtextextended('sas.outbox:' || {column}::text, 0)")
}

/// What a transition committed for publishing, handed back to its caller,
/// which passes it to whoever publishes (the engine's relay).
/// Dropped unread, the connection it holds is closed (letting its outbox
/// locks go) and the messages wait for a relay's sweep (a handed request:
/// until its publisher stops beating, `PUBLISHABLE`).
#[derive(Debug, Default)]
pub struct Committed {
    /// Messages to publish at once, in order (several orders' messages);
    /// then [`Held::release`] deletes them, but for the handed requests
    /// ([`OutboxRow::handed`]), and lets the locks go.
    pub publish: Vec<OutboxRow>,
    /// The connection holding the outbox locks of the orders among them
    /// with messages that applications see (status events, alerts), and of
    /// any whose older messages still wait; none when only handed requests
    /// go out.
    pub held: Option<Held>,
    /// Orders whose new messages are left to the relay's next pass.
    pub later: Vec<Uuid>,
    /// Orders whose outbox locks another publisher held when the transition
    /// tried to take them (their previous messages were on their way):
    /// their messages go once the locks come free.
    pub follow: Vec<Uuid>,
}

/// [`Held::release`]'s statement: the delete is read (and so run) before
/// the session's locks go, and each order's transaction-level lock is taken
/// before them (the same session's, so at once).
static RELEASE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "WITH relaxed AS (SELECT set_config('synchronous_commit', 'off', true)), \
         gone AS (DELETE FROM outbox WHERE id = ANY($1) RETURNING order_id), \
         fenced AS (SELECT count(*) AS n FROM (SELECT DISTINCT order_id FROM gone) g \
           WHERE pg_advisory_xact_lock({key})::text IS NOT NULL) \
         SELECT pg_advisory_unlock_all() FROM relaxed, fenced",
        key = lock_key("order_id")
    )
});

/// A pooled connection holding orders' outbox locks (session-level advisory
/// locks, taken by the transition that wrote their messages and kept past
/// its commit), so that nobody else publishes those orders' messages until
/// they are published and deleted. Dropped without [`release`](Self::release)
/// (an error, a cancelled task), it closes the connection instead of
/// returning it to the pool, and the server lets the locks go with the session.
#[derive(Debug)]
pub struct Held {
    conn: Option<sqlx::pool::PoolConnection<sqlx::Postgres>>,
    /// `database.io_timeout`, the bound on [`release`](Self::release).
    bound: std::time::Duration,
}

impl Held {
    /// Wraps a connection that has taken outbox locks.
    pub(crate) fn new(
        conn: sqlx::pool::PoolConnection<sqlx::Postgres>,
        bound: std::time::Duration,
    ) -> Self {
        Self {
            conn: Some(conn),
            bound,
        }
    }

    /// Deletes the published messages and lets every lock go, in one
    /// statement that does not wait for the disk (a lost delete republishes);
    /// then the connection goes back to the pool.
    pub async fn release(mut self, published: &[i64]) -> Result<(), sqlx::Error> {
        let Some(mut conn) = self.conn.take() else {
            return Ok(());
        };
        // The session's locks go in this statement, but a lock of the
        // transaction's own, taken first on each order whose rows it deletes,
        // keeps those orders until the delete commits: a relay that gets the
        // lock then never finds the published rows ([`take`]).
        let release = sqlx::query(sqlx::AssertSqlSafe(RELEASE.as_str()))
            .bind(published)
            .execute(&mut *conn);
        // Past the bound the connection may be silent: it is closed below.
        let done = match tokio::time::timeout(self.bound, release).await {
            Ok(done) => done,
            Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "Postgres did not answer within {:?} (database.io_timeout)",
                    self.bound
                ),
            ))),
        };
        if done.is_err() {
            // The locks may still be held: never hand this session to anyone.
            conn.close_on_drop();
        }
        done.map(drop)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.as_mut() {
            conn.close_on_drop();
        }
    }
}

/// A row of [`take`]: an order taken, and one of its messages if it has any.
#[derive(Debug, sqlx::FromRow)]
struct TakenRow {
    taken: Uuid,
    id: Option<i64>,
    kind: Option<String>,
    routing_key: Option<String>,
    correlation_id: Option<String>,
    reply_to: Option<String>,
    traceparent: Option<String>,
    body: Option<Vec<u8>>,
}

/// Orders taken for publishing ([`StateStore::take_outbox`](super::StateStore::take_outbox)):
/// their messages, and the connection that holds their outbox locks until
/// [`Held::release`] deletes the published ones.
#[derive(Debug)]
pub struct Taken {
    /// Holds the taken orders' outbox locks.
    pub held: Held,
    /// The taken orders' messages, in the order they were written.
    pub rows: Vec<OutboxRow>,
    /// The orders another publisher held: not taken.
    pub busy: Vec<Uuid>,
}

/// Takes these orders for publishing, on `conn`, in one statement that
/// commits at once (`sas_outbox_take`, migration 20261206000001): the orders
/// no other publisher holds right now (a session-level advisory lock per
/// order, [`lock_key`], kept past the statement), so each order's messages
/// are published by one publisher at a time, in sequence, and relays never
/// wait on each other; with `wait`, every order, once its publisher lets it
/// go (give `order_ids` sorted, so that two waiters cannot deadlock; a lock
/// not had within 30 s fails the statement). Returns the orders taken and
/// their messages, in the order they were written. No transaction stays
/// open while they are published: [`Held::release`] deletes them afterwards.
///
/// The messages are read after the locks are had, by a statement of their
/// own: a publisher lets an order's lock go only once its delete of the
/// published rows has committed, so they are never read again. The take
/// locks no row and writes nothing. On an error the locks taken so far stay
/// with the session: the caller closes the connection.
pub(super) async fn take(
    conn: &mut PgConnection,
    order_ids: &[Uuid],
    wait: bool,
) -> Result<(Vec<Uuid>, Vec<OutboxRow>), sqlx::Error> {
    const SQL: &str = "SELECT taken, id, kind, routing_key, correlation_id, reply_to, \
        traceparent, body FROM sas_outbox_take($1, $2)";
    let found: Vec<TakenRow> = sqlx::query_as(SQL)
        .bind(order_ids)
        .bind(wait)
        .fetch_all(&mut *conn)
        .await?;
    let mut taken = Vec::new();
    let mut rows = Vec::new();
    for r in found {
        if !taken.contains(&r.taken) {
            taken.push(r.taken);
        }
        if let (Some(id), Some(kind), Some(routing_key), Some(body)) =
            (r.id, r.kind, r.routing_key, r.body)
        {
            rows.push(OutboxRow {
                id,
                order_id: r.taken,
                kind,
                routing_key,
                correlation_id: r.correlation_id,
                reply_to: r.reply_to,
                traceparent: r.traceparent,
                body,
                handed: false,
            });
        }
    }
    Ok((taken, rows))
}

/// Whether the relays may publish an outbox row now (the SQL function of
/// migration 20261208000001, over the row's columns): not while it is
/// handed to a publisher that still beats (a status event or alert for 30
/// seconds at most), nor ever a step request whose step no longer waits
/// for its dispatch.
pub(super) const PUBLISHABLE: &str =
    "sas_outbox_publishable(kind, order_id, correlation_id, handed_to, created_at)";

/// Orders with messages older than `age_ms` that a relay may publish: left
/// behind by a process that died.
pub async fn stale_orders(
    conn: &mut PgConnection,
    age_ms: i64,
    limit: i64,
) -> Result<Vec<Uuid>, sqlx::Error> {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "SELECT order_id FROM outbox WHERE created_at < now() - $1 * interval '1 millisecond' \
             AND {PUBLISHABLE} GROUP BY order_id ORDER BY min(id) LIMIT $2"
        )
    });
    sqlx::query_scalar(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(age_ms)
        .bind(limit)
        .fetch_all(conn)
        .await
}

/// Deletes the step requests older than `age_ms` whose step no longer
/// waits for their dispatch (answered elsewhere, or dispatched again):
/// nobody may send them again. Returns how many.
pub async fn drop_superseded(conn: &mut PgConnection, age_ms: i64) -> Result<u64, sqlx::Error> {
    sqlx::query(
        "DELETE FROM outbox o WHERE o.kind = 'request' \
           AND o.created_at < now() - $1 * interval '1 millisecond' \
           AND NOT EXISTS (SELECT 1 FROM steps s WHERE s.order_id = o.order_id \
             AND s.dispatch_id::text = o.correlation_id \
             AND s.state IN ('running', 'compensating'))",
    )
    .bind(age_ms)
    .execute(conn)
    .await
    .map(|done| done.rows_affected())
}

/// Messages waiting in the outbox for a relay: not those handed over (a
/// step request waits for its reply, a status event sent for its delete).
pub async fn backlog(conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM outbox WHERE handed_to IS NULL")
        .fetch_one(conn)
        .await
}

impl StateStore {
    /// Takes the queued messages of these orders for publishing
    /// (`take`): the orders no other publisher holds, or with
    /// `wait` every order once its publisher lets it go. Publish the rows,
    /// then [`Held::release`] the ones published: nothing stays open in
    /// between but the outbox locks.
    pub async fn take_outbox(&self, order_ids: &[Uuid], wait: bool) -> Result<Taken, StoreError> {
        let mut conn = self.conn().await?;
        // The locks stay with the session: failing, it is closed, not pooled.
        conn.discard();
        let (taken, rows) = conn.run(|c| take(c, order_ids, wait)).await?;
        conn.keep();
        let held = conn
            .into_pooled()
            .map(|c| Held::new(c, self.io_timeout()))
            .ok_or(StoreError::Silent(self.io_timeout()))?;
        let busy = order_ids
            .iter()
            .filter(|id| !taken.contains(id))
            .copied()
            .collect();
        Ok(Taken { held, rows, busy })
    }

    /// Hands these step requests back to the relays: their hand-over could
    /// not send them, so any relay may now (`PUBLISHABLE`).
    pub async fn unhand_outbox(&self, ids: &[i64]) -> Result<(), StoreError> {
        self.outbox_rows("UPDATE outbox SET handed_to = NULL WHERE id = ANY($1)", ids)
            .await
    }

    /// Runs `sql`, a write to the outbox rows `ids` (`$1`).
    async fn outbox_rows(&self, sql: &'static str, ids: &[i64]) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        conn.run(|c| sqlx::query(sql).bind(ids).execute(c))
            .await
            .map(drop)
    }

    /// Deletes messages handed to this process that the broker confirmed
    /// (status events and alerts: a step request waits for its reply), in
    /// one statement for many.
    pub async fn delete_published(&self, ids: &[i64]) -> Result<(), StoreError> {
        self.outbox_rows("DELETE FROM outbox WHERE id = ANY($1)", ids)
            .await
    }

    /// Deletes the step requests handed to `instance`, all sent: called as
    /// it stops, so that no relay sends them again once it no longer beats.
    pub async fn forget_handed(&self, instance: &str) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        conn.run(|c| {
            sqlx::query("DELETE FROM outbox WHERE handed_to = $1 AND kind = 'request'")
                .bind(instance)
                .execute(c)
        })
        .await
        .map(drop)
    }

    /// Deletes step requests superseded for longer than `age_ms`
    /// (`drop_superseded`).
    pub async fn outbox_drop_superseded(&self, age_ms: i64) -> Result<u64, StoreError> {
        let mut conn = self.conn().await?;
        conn.run(|c| drop_superseded(c, age_ms)).await
    }

    /// Messages waiting in the outbox.
    pub async fn outbox_backlog(&self) -> Result<i64, StoreError> {
        let mut conn = self.conn().await?;
        conn.run(backlog).await
    }

    /// Orders with messages left behind by a process that died.
    pub async fn outbox_stale_orders(
        &self,
        age_ms: i64,
        limit: i64,
    ) -> Result<Vec<Uuid>, StoreError> {
        let mut conn = self.conn().await?;
        conn.run(|c| stale_orders(c, age_ms, limit)).await
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_take_function_locks_the_keys_every_other_publisher_locks() {
        let take = include_str!("../../migrations/20261206000001_outbox_take.sql");
        assert_eq!(
            take.matches(&super::lock_key("t.id")).count(),
            2,
            "both ways of taking"
        );
        assert!(super::RELEASE.contains(&super::lock_key("order_id")));
    }

    #[test]
    fn a_row_handed_over_is_deleted_by_its_reply_or_the_next_write_back_and_any_other_by_its_publisher()
     {
        use super::{DeletedBy, OutboxRow};
        let row = |kind: &str, handed: bool| OutboxRow {
            id: 1,
            order_id: uuid::Uuid::nil(),
            kind: kind.into(),
            routing_key: "q".into(),
            correlation_id: None,
            reply_to: None,
            traceparent: None,
            body: Vec::new(),
            handed,
        };
        for kind in ["request", "status", "alert"] {
            assert_eq!(row(kind, false).deleted_by(), DeletedBy::Release, "{kind}");
        }
        assert_eq!(row("request", true).deleted_by(), DeletedBy::Reply);
        assert_eq!(row("status", true).deleted_by(), DeletedBy::WriteBack);
        assert_eq!(row("alert", true).deleted_by(), DeletedBy::WriteBack);
    }
}

//! Figures for operators: orders per state, what waits, what ended lately.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

/// A snapshot of the state store.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Stats {
    /// Orders per `process_state`.
    pub by_state: BTreeMap<String, i64>,
    /// When the oldest pending order was submitted.
    pub oldest_pending: Option<DateTime<Utc>>,
    /// Pending orders waiting for their `not_before` (re-attempts and delays).
    pub waiting: i64,
    /// Orders that ended in the last `window_secs`, per state.
    pub ended_recently: BTreeMap<String, i64>,
    /// Orders submitted in the last `window_secs`.
    pub received_recently: i64,
    /// The window of the two figures above, in seconds.
    pub window_secs: i64,
    /// Messages waiting in the outbox.
    pub outbox_backlog: i64,
}

/// Reads the snapshot; "recently" means the last `window_secs`.
pub async fn read(conn: &mut PgConnection, window_secs: i64) -> Result<Stats, sqlx::Error> {
    let by_state: BTreeMap<String, i64> =
        sqlx::query_as::<_, (String, i64)>("SELECT process_state, count(*) FROM orders GROUP BY 1")
            .fetch_all(&mut *conn)
            .await?
            .into_iter()
            .collect();
    let (oldest_pending, waiting): (Option<DateTime<Utc>>, i64) = sqlx::query_as(
        "SELECT min(created_at), count(*) FILTER (WHERE not_before > now()) \
         FROM orders WHERE process_state = 'pending'",
    )
    .fetch_one(&mut *conn)
    .await?;
    let ended_recently: BTreeMap<String, i64> = sqlx::query_as::<_, (String, i64)>(
        "SELECT process_state, count(*) FROM orders \
         WHERE process_state IN ('processed', 'compensated', 'error') \
           AND updated_at > now() - $1 * interval '1 second' GROUP BY 1",
    )
    .bind(window_secs)
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .collect();
    let received_recently: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM orders WHERE created_at > now() - $1 * interval '1 second'",
    )
    .bind(window_secs)
    .fetch_one(&mut *conn)
    .await?;
    let outbox_backlog = super::outbox::backlog(&mut *conn).await?;
    Ok(Stats {
        by_state,
        oldest_pending,
        waiting,
        ended_recently,
        received_recently,
        window_secs,
        outbox_backlog,
    })
}

impl crate::ReadModels {
    /// A snapshot for operators; "recently" means the last `window`.
    pub async fn stats(&self, window: std::time::Duration) -> Result<Stats, crate::StoreError> {
        let mut conn = self.store.conn().await?;
        let secs = i64::try_from(window.as_secs()).unwrap_or(i64::MAX);
        conn.run(|c| read(c, secs)).await
    }
}

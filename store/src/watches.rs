//! The `event_watches` table: the orders whose status events an open HTTP
//! event stream waits for (contract §9a). The write-back
//! ([`super::unit`]) notifies [`EVENTS_CHANNEL`] with the id of each such
//! order it adds events to; nothing is sent for an order no stream watches.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

/// Where the write-back says that a watched order has new events; the
/// payload is the order's id.
pub const EVENTS_CHANNEL: &str = "sas_order_events";

/// Stores that `watcher` waits for the events of `orders` until `until`
/// (again: moves `until` on), and deletes every watch past its `until`.
pub async fn watch(
    conn: &mut PgConnection,
    watcher: &str,
    orders: &[Uuid],
    until: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    // A watch lost in a crash is stored again on the next listen: no wait
    // for the disk.
    sqlx::query(
        "WITH relaxed AS (SELECT set_config('synchronous_commit', 'off', true)), \
         stale AS (DELETE FROM event_watches WHERE until < now()) \
         INSERT INTO event_watches (order_id, watcher, until) \
         SELECT o, $1, $3 FROM unnest($2::uuid[]) AS o, relaxed \
         ON CONFLICT (order_id, watcher) DO UPDATE SET until = EXCLUDED.until",
    )
    .bind(watcher)
    .bind(orders)
    .bind(until)
    .execute(conn)
    .await?;
    Ok(())
}

/// Stores that `watcher` no longer waits for `order`'s events, unless it
/// stored a later watch of it since (`until` past `stored`): a stream that
/// opens while the last one's deletion is on its way keeps its watch.
pub async fn unwatch(
    conn: &mut PgConnection,
    watcher: &str,
    order: Uuid,
    stored: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "WITH relaxed AS (SELECT set_config('synchronous_commit', 'off', true)) \
         DELETE FROM event_watches USING relaxed \
         WHERE order_id = $1 AND watcher = $2 AND until <= $3",
    )
    .bind(order)
    .bind(watcher)
    .bind(stored)
    .execute(conn)
    .await?;
    Ok(())
}

/// A connection listening on [`EVENTS_CHANNEL`].
pub struct EventListener(pub(super) sqlx::postgres::PgListener);

/// What an [`EventListener`] heard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heard {
    /// This watched order has new events.
    Order(Uuid),
    /// A notification that names no order: ignored.
    Noise,
    /// The connection was lost, and the notifications sent meanwhile with
    /// it: listen anew and make up for them.
    Lost,
}

impl EventListener {
    /// The next notification, or that the connection was lost. Safe to
    /// drop while waiting: nothing it has not returned is taken.
    pub async fn next(&mut self) -> Heard {
        match self.0.try_recv().await {
            Ok(Some(note)) => note.payload().parse().map_or(Heard::Noise, Heard::Order),
            Ok(None) | Err(_) => Heard::Lost,
        }
    }

    /// Whether the connection answers a question within `within`: a
    /// connection gone silent (a partition) tells nothing by itself.
    pub async fn answers(&mut self, within: std::time::Duration) -> bool {
        let ping = sqlx::query("SELECT 1").execute(&mut self.0);
        matches!(tokio::time::timeout(within, ping).await, Ok(Ok(_)))
    }
}

//! The `instances` table: one heartbeat row per running service instance.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

/// Records that `instance` (of `role`) is alive now, and forgets instances
/// not seen for `forget_after_ms`.
pub async fn beat(
    conn: &mut PgConnection,
    instance: &str,
    role: &str,
    forget_after_ms: i64,
) -> Result<(), sqlx::Error> {
    // A heartbeat lost in a crash is worth nothing: no wait for the disk.
    sqlx::query(
        "WITH relaxed AS (SELECT set_config('synchronous_commit', 'off', true)), \
         gone AS (DELETE FROM instances \
           WHERE last_seen < now() - $3 * interval '1 millisecond' AND instance_id <> $1) \
         INSERT INTO instances (instance_id, role) SELECT $1, $2 FROM relaxed \
         ON CONFLICT (instance_id) DO UPDATE SET last_seen = now()",
    )
    .bind(instance)
    .bind(role)
    .bind(forget_after_ms)
    .execute(conn)
    .await?;
    Ok(())
}

/// When `instance` was last seen, and the database's clock now.
pub async fn last_seen(
    conn: &mut PgConnection,
    instance: &str,
) -> Result<(Option<DateTime<Utc>>, DateTime<Utc>), sqlx::Error> {
    sqlx::query_as("SELECT (SELECT last_seen FROM instances WHERE instance_id = $1), now()")
        .bind(instance)
        .fetch_one(conn)
        .await
}

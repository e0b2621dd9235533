//! Retention (contract §10): ended orders older than `retention.ended_after`
//! are deleted with their steps, events and outbox rows, a batch per
//! transaction, optionally archived first as one JSON line each.
//!
//! Invariants:
//!
//! - **Which orders.** Only `processed` and `compensated` orders
//!   (`sas_core::rules::retention::prunable`, given in [`Policy::states`]). An order in `error` has an open alert: it waits for an
//!   operator (retry, cancel or redrive), however old it is. The state
//!   store keeps no other per-order alert state: the alert of contract §5
//!   is a message, and the order's `error` state is what says it is open
//!   (as the dashboard's `open_alerts` counts). Its age is that of its last
//!   change (`updated_at`): an order redriven yesterday is young again.
//! - **Never a live order's lock.** A batch locks the orders it deletes
//!   with `FOR UPDATE SKIP LOCKED`, after its `WHERE` has kept only old
//!   ended ones: it neither waits for nor takes the lock of any other row,
//!   and an ended order that someone holds (a retry or redrive being
//!   written) is passed by, for the next run. The delete names the states
//!   and the age again, so an order that changed is not deleted; a
//!   transition that loaded an order before it was deleted finds its row
//!   gone and its guarded write-back fails whole.
//! - **Nothing dangles.** An order's `steps`, `order_events` and `outbox`
//!   rows go with it, in the same statement. Other tables name orders only
//!   while they are live (`breakers.probe_order`, a held order's) or
//!   already expect them gone (`schedules.last_order_id`).
//! - **Archive first.** With an archive, the batch's orders are read as
//!   they are deleted (`{"order", "steps", "events"}`, every column), and
//!   the lines are appended to `orders-<date>.jsonl` and flushed to disk
//!   (`fsync`) before the transaction commits; if that fails the batch is
//!   rolled back and nothing is deleted. A commit that fails after the
//!   write leaves lines for orders still there, which a later run archives
//!   again: a reader keeps the last line per `order.order_id`.
//!
//! The scan: ended orders are found through the `orders_created` index
//! (`created_at` never changes, and is never after `updated_at`), oldest
//! first, so no index on `updated_at` is needed (one would make every
//! step's update of an order write index entries, see migration
//! `20261129000001`). What it reads beyond the orders it deletes are the
//! old orders it keeps: those in `error`, and live ones created long ago.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{self, Write as _};
use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};
use uuid::Uuid;

use super::bounded::Conn;
use super::{StateStore, StoreError};
use sas_core::state::ProcessState;

/// The archive file of the orders deleted on `day` (the state store's date).
pub fn archive_file_name(day: NaiveDate) -> String {
    format!("orders-{}.jsonl", day.format("%Y-%m-%d"))
}

/// What one run deletes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Orders last changed longer ago than this (on the state store's clock).
    pub ended_after: Duration,
    /// Orders per batch (one transaction each).
    pub batch: u32,
    /// The states an order may be deleted in
    /// (`sas_core::rules::retention::PRUNABLE`).
    pub states: &'static [ProcessState],
}

/// What one batch deleted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pruned {
    /// The orders, oldest first.
    pub orders: Vec<Uuid>,
    /// Their steps, events and outbox rows (messages never published: an
    /// order ended long ago whose status event or alert could not be sent).
    pub steps: u64,
    pub events: u64,
    pub outbox: u64,
    /// The file their lines were appended to, if archived.
    pub archived: Option<PathBuf>,
}

/// What a run of batches deleted, summed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Totals {
    pub batches: u64,
    pub orders: u64,
    pub steps: u64,
    pub events: u64,
    pub outbox: u64,
    /// Every archive file written to.
    pub archived: BTreeSet<PathBuf>,
}

impl Totals {
    /// Counts one batch (an empty one is no batch).
    pub fn add(&mut self, pruned: &Pruned) {
        if pruned.orders.is_empty() {
            return;
        }
        self.batches += 1;
        self.orders += pruned.orders.len() as u64;
        self.steps += pruned.steps;
        self.events += pruned.events;
        self.outbox += pruned.outbox;
        self.archived.extend(pruned.archived.iter().cloned());
    }
}

/// Why a batch deleted nothing.
#[derive(Debug, thiserror::Error)]
pub enum PruneError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The archive could not be written: the batch was rolled back.
    #[error("could not archive to {}: {source}; nothing was deleted", path.display())]
    Archive {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// A batch deleted and not yet committed: its transaction holds the
/// deleted orders' row locks (and no other). [`commit`](Self::commit)
/// makes it so; dropped or [rolled back](Self::rollback), nothing is deleted.
#[derive(Debug)]
pub struct PruneBatch {
    /// In the transaction; `None` once it ended (or never began: nothing found).
    conn: Option<Conn>,
    pruned: Pruned,
    /// One JSON line per order, in `pruned.orders`' order, when asked for.
    lines: Vec<String>,
    /// The transaction's time on the state store's clock.
    at: Option<DateTime<Utc>>,
}

impl PruneBatch {
    /// The orders it deletes, oldest first.
    pub fn orders(&self) -> &[Uuid] {
        &self.pruned.orders
    }

    /// Their archive lines, `{"order", "steps", "events"}` (none unless asked for).
    pub fn lines(&self) -> &[String] {
        &self.lines
    }

    /// The state store's date of the deletion: which archive file it goes to.
    pub fn day(&self) -> Option<NaiveDate> {
        self.at.map(|t| t.date_naive())
    }

    /// Commits the deletion; what it deleted.
    pub async fn commit(mut self) -> Result<Pruned, StoreError> {
        if let Some(mut conn) = self.conn.take() {
            conn.run(|c| sqlx::raw_sql("COMMIT").execute(c)).await?;
            conn.keep();
        }
        Ok(std::mem::take(&mut self.pruned))
    }

    /// Deletes nothing after all.
    pub async fn rollback(mut self) {
        if let Some(mut conn) = self.conn.take()
            && conn
                .run(|c| sqlx::raw_sql("ROLLBACK").execute(c))
                .await
                .is_ok()
        {
            conn.keep();
        }
    }

    fn archived_to(&mut self, path: PathBuf) {
        self.pruned.archived = Some(path);
    }
}

/// Picks the batch: old ended orders, oldest first, locked, passing by any
/// that another transaction holds. `$1` the prunable states, `$2` the age
/// in milliseconds, `$3` the batch.
///
/// The state is compared as an expression (`|| ''`) so that no plan reads
/// this through `orders_state`, which holds every ended order, young ones
/// too (all would be read and sorted for each batch): the scan is by
/// `orders_created`, oldest first, stopping at the batch, whatever the
/// statistics said when a connection made its generic plan (the services'
/// connections keep one per statement).
const PICK: &str = "\
SELECT order_id FROM orders \
WHERE (process_state || '') = ANY($1::text[]) \
  AND created_at < now() - $2 * interval '1 millisecond' \
  AND updated_at < now() - $2 * interval '1 millisecond' \
ORDER BY created_at, order_id LIMIT $3 \
FOR UPDATE SKIP LOCKED";

/// Deletes the picked orders (`$1`) that are still ended (`$2`) and old
/// (`$3`), with their steps, events and outbox rows (and, for a child
/// order, what its parent's step asked of it); returns each deleted
/// order, the time, the rows deleted with them, and with `$4` its archive
/// line, read from what was deleted (the statement's snapshot still shows
/// the steps and events it deletes).
const DELETE: &str = "\
WITH gone AS ( \
  DELETE FROM orders WHERE order_id = ANY($1::uuid[]) AND process_state = ANY($2::text[]) \
    AND updated_at < now() - $3 * interval '1 millisecond' \
  RETURNING *), \
ids AS MATERIALIZED (SELECT coalesce(array_agg(order_id), '{}') AS ids FROM gone), \
s AS (DELETE FROM steps WHERE order_id = ANY((SELECT ids FROM ids)::uuid[]) RETURNING 1), \
e AS (DELETE FROM order_events WHERE order_id = ANY((SELECT ids FROM ids)::uuid[]) RETURNING 1), \
m AS (DELETE FROM outbox WHERE order_id = ANY((SELECT ids FROM ids)::uuid[]) RETURNING 1), \
c AS (DELETE FROM children WHERE child_id = ANY((SELECT ids FROM ids)::uuid[])) \
SELECT g.order_id, now() AS at, \
  CASE WHEN $4 THEN jsonb_build_object( \
    'order', to_jsonb(g), \
    'steps', (SELECT coalesce(jsonb_agg(to_jsonb(st) ORDER BY st.idx), '[]'::jsonb) \
              FROM steps st WHERE st.order_id = g.order_id), \
    'events', (SELECT coalesce(jsonb_agg(to_jsonb(ev) ORDER BY ev.seq), '[]'::jsonb) \
               FROM order_events ev WHERE ev.order_id = g.order_id))::text END AS line, \
  (SELECT count(*) FROM s) AS steps, (SELECT count(*) FROM e) AS events, \
  (SELECT count(*) FROM m) AS outbox \
FROM gone g ORDER BY g.created_at, g.order_id";

/// A row of [`DELETE`].
#[derive(Debug, sqlx::FromRow)]
struct Gone {
    order_id: Uuid,
    at: DateTime<Utc>,
    line: Option<String>,
    steps: i64,
    events: i64,
    outbox: i64,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl StateStore {
    /// Deletes one batch of old ended orders in a transaction left open:
    /// the caller archives [`PruneBatch::lines`] (asked for with
    /// `lines`), then commits. Nothing found: an empty batch, no
    /// transaction left open.
    pub async fn prune_begin(&self, policy: Policy, lines: bool) -> Result<PruneBatch, StoreError> {
        let states: Vec<&str> = policy.states.iter().map(|s| s.as_str()).collect();
        let age = millis(policy.ended_after);
        let limit = i64::from(policy.batch);
        let mut conn = self.conn().await?;
        // Until the transaction ends, leaving early closes the connection
        // (and the server rolls back).
        conn.discard();
        let picked: Vec<Uuid> = conn
            .run(|c| async move {
                sqlx::raw_sql("BEGIN").execute(&mut *c).await?;
                sqlx::query_scalar(PICK)
                    .bind(&states)
                    .bind(age)
                    .bind(limit)
                    .fetch_all(c)
                    .await
            })
            .await?;
        if picked.is_empty() {
            conn.run(|c| sqlx::raw_sql("COMMIT").execute(c)).await?;
            conn.keep();
            return Ok(PruneBatch {
                conn: None,
                pruned: Pruned::default(),
                lines: Vec::new(),
                at: None,
            });
        }
        let states: Vec<&str> = policy.states.iter().map(|s| s.as_str()).collect();
        let gone: Vec<Gone> = conn
            .run(|c| {
                sqlx::query_as(DELETE)
                    .bind(&picked)
                    .bind(&states)
                    .bind(age)
                    .bind(lines)
                    .fetch_all(c)
            })
            .await?;
        let first = gone.first();
        let pruned = Pruned {
            orders: gone.iter().map(|g| g.order_id).collect(),
            steps: first.map_or(0, |g| u64::try_from(g.steps).unwrap_or(0)),
            events: first.map_or(0, |g| u64::try_from(g.events).unwrap_or(0)),
            outbox: first.map_or(0, |g| u64::try_from(g.outbox).unwrap_or(0)),
            archived: None,
        };
        Ok(PruneBatch {
            at: first.map(|g| g.at),
            lines: gone.into_iter().filter_map(|g| g.line).collect(),
            pruned,
            conn: Some(conn),
        })
    }

    /// Deletes one batch of old ended orders (contract §10), archived first
    /// when `archive` is given; what it deleted (no orders: nothing was left).
    pub async fn prune(
        &self,
        policy: Policy,
        archive: Option<&Archive>,
    ) -> Result<Pruned, PruneError> {
        let mut batch = self.prune_begin(policy, archive.is_some()).await?;
        if let (Some(archive), Some(day)) = (archive, batch.day()) {
            match archive.append(day, batch.lines()).await {
                Ok(path) => batch.archived_to(path),
                Err(source) => {
                    batch.rollback().await;
                    return Err(PruneError::Archive {
                        path: archive.path_for(day),
                        source,
                    });
                }
            }
        }
        Ok(batch.commit().await?)
    }
}

/// The archive directory (`retention.archive`): one file per day of
/// deletion, `orders-<YYYY-MM-DD>.jsonl`, one JSON line per deleted order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Archive {
    dir: PathBuf,
}

impl Archive {
    /// The archive in `dir`, which must exist when it is written to.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of the orders deleted on `day`.
    pub fn path_for(&self, day: NaiveDate) -> PathBuf {
        self.dir.join(archive_file_name(day))
    }

    /// Appends `lines` to the file of `day` and flushes it to disk; the
    /// file's path. On failure the file is cut back to what it held.
    pub async fn append(&self, day: NaiveDate, lines: &[String]) -> io::Result<PathBuf> {
        let path = self.path_for(day);
        let mut data = Vec::with_capacity(lines.iter().map(|l| l.len() + 1).sum());
        for line in lines {
            // jsonb's text has no raw line break; a line must stay one line.
            if line.contains('\n') {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "an archive line holds a line break",
                ));
            }
            data.extend_from_slice(line.as_bytes());
            data.push(b'\n');
        }
        let target = path.clone();
        tokio::task::spawn_blocking(move || append_durably(&target, &data))
            .await
            .map_err(io::Error::other)??;
        Ok(path)
    }
}

/// Appends `data` to `path` (created, readable by its owner only) under an
/// exclusive lock of the file, then `fsync`s it (and its directory, for a
/// new file). A last line left unfinished by a writer that failed is cut
/// first: that writer's batch was not committed. On failure the file is
/// cut back to the length it had.
fn append_durably(path: &Path, data: &[u8]) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    if !dir.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("the archive directory {} does not exist", dir.display()),
        ));
    }
    let file = OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path)?;
    // Another sas process archiving at the same time waits its turn.
    file.lock()?;
    let was = file.metadata()?.len();
    let len = complete_len(&file, was)?;
    if len != was {
        file.set_len(len)?;
    }
    let written = (&file).write_all(data).and_then(|()| file.sync_data());
    if let Err(e) = written {
        file.set_len(len).and_then(|()| file.sync_data()).ok();
        return Err(e);
    }
    if len == 0 {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// The length of `file`'s complete lines: `len`, or less when its last
/// line has no line break.
fn complete_len(file: &File, len: u64) -> io::Result<u64> {
    const CHUNK: u64 = 64 * 1024;
    let mut end = len;
    let mut buf = vec![0u8; CHUNK as usize];
    while end > 0 {
        // The last byte alone first: nearly always a line break.
        let start = if end == len {
            end - 1
        } else {
            end.saturating_sub(CHUNK)
        };
        let n = usize::try_from(end - start).unwrap_or(0);
        file.read_exact_at(&mut buf[..n], start)?;
        if let Some(i) = buf[..n].iter().rposition(|&b| b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_count_batches_that_deleted_something() {
        let mut t = Totals::default();
        t.add(&Pruned {
            orders: vec![Uuid::nil(), Uuid::max()],
            steps: 3,
            events: 8,
            outbox: 1,
            archived: Some("/a/orders-2026-12-03.jsonl".into()),
        });
        t.add(&Pruned::default());
        t.add(&Pruned {
            orders: vec![Uuid::nil()],
            steps: 1,
            events: 4,
            outbox: 0,
            archived: Some("/a/orders-2026-12-03.jsonl".into()),
        });
        assert_eq!(
            (t.batches, t.orders, t.steps, t.events, t.outbox),
            (2, 3, 4, 12, 1)
        );
        assert_eq!(t.archived.len(), 1);
    }

    #[test]
    fn an_archive_file_is_named_by_its_day() {
        let day = NaiveDate::from_ymd_opt(2026, 1, 9).unwrap();
        assert_eq!(archive_file_name(day), "orders-2026-01-09.jsonl");
        assert_eq!(
            Archive::new("/srv/a").path_for(day),
            Path::new("/srv/a/orders-2026-01-09.jsonl")
        );
    }

    fn temp_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("sas-archive-{}", Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[tokio::test]
    async fn archive_lines_are_appended_one_per_line_and_a_torn_last_line_is_cut() {
        let dir = temp_dir();
        let archive = Archive::new(&dir);
        let day = NaiveDate::from_ymd_opt(2026, 12, 3).unwrap();
        let path = archive
            .append(day, &[r#"{"a":1}"#.into(), r#"{"b":2}"#.into()])
            .await
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"a\":1}\n{\"b\":2}\n"
        );
        // A writer that died in the middle of a line (its batch was not committed).
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(br#"{"c":"#)
            .unwrap();
        archive.append(day, &[r#"{"d":4}"#.into()]).await.unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"a\":1}\n{\"b\":2}\n{\"d\":4}\n"
        );
        // Only a torn line: nothing complete is left of it.
        let other = archive.path_for(day.succ_opt().unwrap());
        std::fs::write(&other, vec![b'x'; 200_000]).unwrap();
        archive
            .append(day.succ_opt().unwrap(), &["{}".into()])
            .await
            .unwrap();
        assert_eq!(std::fs::read_to_string(&other).unwrap(), "{}\n");
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test]
    async fn an_archive_that_cannot_be_written_says_why() {
        let dir = temp_dir();
        let day = NaiveDate::from_ymd_opt(2026, 12, 3).unwrap();
        let missing = Archive::new(dir.join("missing"));
        let e = missing.append(day, &["{}".into()]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(e.to_string().contains("does not exist"), "{e}");
        // A directory where the file should be.
        let archive = Archive::new(&dir);
        std::fs::create_dir(archive.path_for(day)).unwrap();
        assert!(archive.append(day, &["{}".into()]).await.is_err());
        let e = archive
            .append(day.succ_opt().unwrap(), &["{\n}".into()])
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        std::fs::remove_dir_all(dir).ok();
    }
}

//! A sampling profiler for Postgres without `pg_stat_statements`: every few
//! milliseconds, what each backend of the deployment's database is doing
//! (`pg_stat_activity`): which statement it runs and what it waits on, or
//! that it sits idle inside a transaction (waiting for its client). Counted
//! over a run, the shares say where Postgres time goes.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::Serialize;
use sqlx::PgPool;

/// One kind of activity and its share of the samples.
#[derive(Debug, Clone, Serialize)]
pub struct Activity {
    /// The statement's start (whitespace collapsed), or `idle in transaction`.
    pub what: String,
    /// `CPU` or the wait event, e.g. `IO:WALSync`, `Lock:transactionid`.
    pub waiting_on: String,
    /// Backends seen in it, per sample (summed over samples / samples).
    pub mean_backends: f64,
    /// Share of all non-idle backend samples.
    pub share: f64,
}

/// What the sampler found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Profile {
    pub samples: usize,
    /// Non-idle backends per sample, on average.
    pub mean_busy_backends: f64,
    pub top: Vec<Activity>,
}

/// Samples taken, and how often each (statement, wait) was seen.
type Counts = (usize, HashMap<(String, String), usize>);

/// A running sampler.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    handle: tokio::task::JoinHandle<Counts>,
}

/// Starts sampling the backends of `db`'s database every `every`.
pub fn start(db: PgPool, every: Duration) -> Sampler {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let handle = tokio::spawn(async move {
        let mut counts: HashMap<(String, String), usize> = HashMap::new();
        let mut samples = 0;
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        while !flag.load(Ordering::Relaxed) {
            tick.tick().await;
            let rows: Vec<(String, Option<String>, Option<String>, String)> = match sqlx::query_as(
                "SELECT state, wait_event_type, wait_event, left(query, 400) FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid() \
                   AND backend_type = 'client backend' AND state IS NOT NULL AND state <> 'idle'",
            )
            .fetch_all(&db)
            .await
            {
                Ok(r) => r,
                Err(_) => continue,
            };
            samples += 1;
            for (state, wait_type, wait, query) in rows {
                let key = if state == "active" {
                    let waiting = match (wait_type, wait) {
                        (Some(t), Some(w)) => format!("{t}:{w}"),
                        _ => "CPU".into(),
                    };
                    (normalize(&query), waiting)
                } else {
                    (
                        "(idle in transaction: waiting for the client)".into(),
                        state,
                    )
                };
                *counts.entry(key).or_default() += 1;
            }
        }
        (samples, counts)
    });
    Sampler { stop, handle }
}

impl Sampler {
    /// Stops and summarizes, keeping the `top` largest activities.
    pub async fn finish(self, top: usize) -> Profile {
        self.stop.store(true, Ordering::Relaxed);
        let Ok((samples, counts)) = self.handle.await else {
            return Profile::default();
        };
        let total: usize = counts.values().sum();
        let mut v: Vec<((String, String), usize)> = counts.into_iter().collect();
        v.sort_by_key(|e| std::cmp::Reverse(e.1));
        Profile {
            samples,
            mean_busy_backends: total as f64 / samples.max(1) as f64,
            top: v
                .into_iter()
                .take(top)
                .map(|((what, waiting_on), n)| Activity {
                    what,
                    waiting_on,
                    mean_backends: n as f64 / samples.max(1) as f64,
                    share: n as f64 / total.max(1) as f64,
                })
                .collect(),
        }
    }
}

/// The first words of a statement, enough to tell sas's statements apart.
fn normalize(query: &str) -> String {
    let flat: String = query.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut cut: String = flat.chars().take(90).collect();
    if flat.chars().count() > 90 {
        cut.push('…');
    }
    cut
}

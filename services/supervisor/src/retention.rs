//! Retention (contract §10), the leader's: every `retention.interval`
//! (the first time as soon as it leads), a run deletes old ended orders
//! batch after batch ([`StateStore::prune`]) until a batch comes back
//! short, yielding between batches. A run is a task of its own, so that a
//! long one (a backlog of millions) never delays the sweeps; it stops
//! after its batch when the supervisor stops leading or shuts down.
//! `retention.ended_after = "off"` runs nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use sas::config::RetentionSettings;
use sas::rules::retention::more_after;
use sas::service::Context;
use sas::state_store::{Archive, Policy, StateStore, Totals};
use tokio::task::JoinHandle;

/// The leader's retention runs.
pub struct Retention {
    /// `None`: retention is off.
    policy: Option<Policy>,
    archive: Option<Archive>,
    interval: std::time::Duration,
    /// When the next run may start (`None`: as soon as this supervisor leads).
    next: Option<Instant>,
    /// The run under way, and the flag that stops it after its batch.
    running: Option<(JoinHandle<()>, Arc<AtomicBool>)>,
}

impl Retention {
    /// From `[retention]`.
    pub fn new(settings: &RetentionSettings) -> Self {
        let policy = settings.ended_after.map(|ended_after| Policy {
            ended_after,
            batch: settings.batch,
            states: sas::rules::retention::PRUNABLE,
        });
        if policy.is_none() {
            tracing::info!("retention.ended_after is off: ended orders are kept");
        }
        Self {
            policy,
            archive: settings.archive.clone().map(Archive::new),
            interval: settings.interval,
            next: None,
            running: None,
        }
    }

    /// The archive directory, checked at start-up: a configured directory
    /// that does not exist is a configuration to fix, not a run to fail
    /// every hour.
    pub fn check(&self) -> anyhow::Result<()> {
        match &self.archive {
            Some(a) if self.policy.is_some() && !a.dir().is_dir() => {
                anyhow::bail!("retention.archive {} is not a directory", a.dir().display())
            }
            _ => Ok(()),
        }
    }

    /// At each of the leader's passes: starts a run when one is due and
    /// none is under way.
    pub fn lead(&mut self, ctx: &Arc<Context>, store: &StateStore) {
        let Some(policy) = self.policy else { return };
        if self
            .running
            .as_ref()
            .is_some_and(|(task, _)| !task.is_finished())
        {
            return;
        }
        self.running = None;
        let now = Instant::now();
        if self.next.is_some_and(|next| now < next) {
            return;
        }
        self.next = Some(now + self.interval);
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(run(
            ctx.clone(),
            store.clone(),
            policy,
            self.archive.clone(),
            stop.clone(),
        ));
        self.running = Some((task, stop));
    }

    /// When this supervisor does not lead (any more): a run under way stops
    /// after its batch, and the next leadership starts one at once.
    pub fn stand_by(&mut self) {
        if let Some((_, stop)) = &self.running {
            stop.store(true, Ordering::Relaxed);
        }
        self.next = None;
    }

    /// On shutdown: lets a run under way finish its batch.
    pub async fn stop(mut self) {
        self.stand_by();
        if let Some((task, _)) = self.running.take() {
            task.await.ok();
        }
    }
}

/// One run: batch after batch until one comes back short, or `stop`.
async fn run(
    ctx: Arc<Context>,
    store: StateStore,
    policy: Policy,
    archive: Option<Archive>,
    stop: Arc<AtomicBool>,
) {
    let started = Instant::now();
    let mut totals = Totals::default();
    let failed = loop {
        if stop.load(Ordering::Relaxed) || ctx.shutdown.is_cancelled() {
            break None;
        }
        match store.prune(policy, archive.as_ref()).await {
            Ok(pruned) => {
                totals.add(&pruned);
                let deleted = u64::try_from(pruned.orders.len()).unwrap_or(u64::MAX);
                ctx.metrics.orders_pruned.inc_by(deleted);
                if pruned.outbox > 0 {
                    tracing::warn!(
                        orders = pruned.orders.len(),
                        messages = pruned.outbox,
                        "deleted ended orders whose messages were never published"
                    );
                }
                if !more_after(pruned.orders.len(), policy.batch) {
                    break None;
                }
                tracing::debug!(orders = pruned.orders.len(), "retention batch deleted");
            }
            Err(e) => break Some(e),
        }
        // Let the sweeps and the relay have the runtime between batches.
        tokio::task::yield_now().await;
    };
    if totals.orders > 0 {
        let archived: Vec<String> = totals
            .archived
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        tracing::info!(
            orders = totals.orders,
            steps = totals.steps,
            events = totals.events,
            outbox = totals.outbox,
            batches = totals.batches,
            archived = archived.join(","),
            took_ms = started.elapsed().as_millis() as u64,
            "deleted ended orders older than retention.ended_after"
        );
    }
    if let Some(e) = failed {
        tracing::warn!(
            error = %e,
            deleted = totals.orders,
            "retention run failed; the next one tries again"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(
        ended_after: Option<std::time::Duration>,
        archive: Option<&str>,
    ) -> RetentionSettings {
        RetentionSettings {
            ended_after,
            archive: archive.map(Into::into),
            ..RetentionSettings::default()
        }
    }

    #[test]
    fn an_archive_directory_that_does_not_exist_is_refused_at_start_up() {
        let day = Some(std::time::Duration::from_secs(86_400));
        let missing = Retention::new(&settings(day, Some("/nonexistent/sas-archive")));
        let err = missing.check().expect_err("refused").to_string();
        assert!(err.contains("/nonexistent/sas-archive"), "{err}");
        let dir = std::env::temp_dir();
        assert!(Retention::new(&settings(day, dir.to_str())).check().is_ok());
        // Off: the archive is never written, so it need not exist.
        let off = Retention::new(&settings(None, Some("/nonexistent/sas-archive")));
        assert!(off.check().is_ok());
    }

    #[test]
    fn standing_by_makes_the_next_leadership_run_at_once() {
        let mut retention =
            Retention::new(&settings(Some(std::time::Duration::from_secs(60)), None));
        retention.next = Some(Instant::now() + std::time::Duration::from_secs(3600));
        retention.stand_by();
        assert_eq!(retention.next, None);
    }
}

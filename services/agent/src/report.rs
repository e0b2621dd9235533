//! Reports each served endpoint's circuit-breaker state to Postgres
//! (`agent_breakers`) for the operator dashboard: at every change and as a
//! heartbeat every few seconds.
//!
//! Best effort and off the calls' path: the agent serves requests without
//! Postgres, a report that fails is logged and the next heartbeat tries again.
//! A clean shutdown deletes this instance's rows; a crashed instance's rows
//! go stale and the dashboard shows them as not reporting.

use std::sync::Arc;

use sas::state_store::{BREAKER_HEARTBEAT, BreakerReport, StateStore};
use tokio_util::sync::CancellationToken;

use crate::breaker::Breaker;

/// One endpoint whose breaker is reported.
pub struct Reported {
    pub agent: String,
    /// The remote URL the agent calls.
    pub endpoint: String,
    pub breaker: Arc<Breaker>,
}

/// The name this process reports under: `<host>:<pid>`, so operators can tell
/// instances (containers, machines) apart.
pub fn instance_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into());
    format!("{host}:{}", std::process::id())
}

/// Reports until `shutdown`, then deletes this instance's rows.
pub async fn run(
    store: &StateStore,
    instance: &str,
    endpoints: &[Reported],
    shutdown: &CancellationToken,
) {
    if let Err(e) = store.forget_old_breakers().await {
        tracing::warn!(error = %e, "could not delete old breaker reports");
    }
    let loops = endpoints
        .iter()
        .map(|e| report_loop(store, instance, e, shutdown));
    futures_util::future::join_all(loops).await;
    if let Err(e) = store.forget_breakers_of(instance).await {
        tracing::warn!(error = %e, "could not delete this instance's breaker reports");
    }
}

async fn report_loop(
    store: &StateStore,
    instance: &str,
    endpoint: &Reported,
    shutdown: &CancellationToken,
) {
    // Warn once per run of failures, not at every heartbeat.
    let mut failing = false;
    loop {
        let (state, consecutive_failures) = endpoint.breaker.snapshot();
        let report = BreakerReport {
            agent: &endpoint.agent,
            instance,
            endpoint: &endpoint.endpoint,
            state: state.as_str(),
            consecutive_failures,
        };
        match store.report_breaker(&report).await {
            Ok(()) => failing = false,
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(agent = %endpoint.agent, error = %e, "could not report the breaker state");
            }
            Err(e) => {
                tracing::debug!(agent = %endpoint.agent, error = %e, "could not report the breaker state");
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = endpoint.breaker.state_changed() => {}
            () = tokio::time::sleep(BREAKER_HEARTBEAT) => {}
        }
    }
}

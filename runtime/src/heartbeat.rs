//! Heartbeats: every service instance with a state store records, every
//! [`INTERVAL`], that it is alive (`instances`), so that the deployment
//! knows who is: an order held by a scheduler that has not beaten for two
//! intervals says `scheduler_gone` (contract §8).

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::state_store::StateStore;

/// Time between an instance's heartbeats.
pub const INTERVAL: Duration = Duration::from_secs(1);

/// Records `instance`'s heartbeats (as `role`) until `stop`, in a task of
/// its own. A beat that fails is logged and tried again at the next one.
pub fn spawn(store: StateStore, instance: String, role: &'static str, stop: CancellationToken) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Err(e) = store.heartbeat(&instance, role).await {
                tracing::warn!(error = %e, "could not record a heartbeat");
            }
        }
    });
}

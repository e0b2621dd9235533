//! The Supervisor: every `supervisor.interval`, finds orders whose
//! `complete_by` has passed, counts the failure (`failure_count`) and either
//! re-queues the order after the retry schedule's wait or, at
//! `supervisor.max_failures`, gives it up (alert, then compensate or fail).
//! It knows nothing of the steps' business: only deadlines and counts.
//!
//! Several supervisors may run: each expired order is locked by one sweep
//! (`FOR UPDATE SKIP LOCKED`) and changed once, guarded by its state and holder.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use sas::broker::{self, SessionEnd};
use sas::metrics::labels;
use sas::outbox::Relay;
use sas::service::Context;
use sas::state_store::{Actor, Expired, Transitions};

/// Runs a supervisor until shutdown.
pub async fn run(ctx: Arc<Context>) -> anyhow::Result<()> {
    let store = ctx.store()?.clone();
    let me = Actor::new_instance("supervisor");
    let transitions = Transitions::new(store.clone(), ctx.queues.clone());
    let relay = Relay::new(store, ctx.settings.outbox.clone(), ctx.metrics.clone());
    let agents = ctx.settings.agent_names();
    broker::run_sessions(
        &ctx.settings.broker,
        ctx.name,
        &ctx.shutdown,
        &ctx.health,
        async |broker| {
            broker
                .declare_topology(&ctx.queues, &agents, ctx.settings.broker.delivery_limit)
                .await?;
            let relay_task = relay.start(broker).await?;
            let mut tick = tokio::time::interval(ctx.settings.supervisor.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = ctx.shutdown.cancelled() => break,
                    () = relay_task.lost().cancelled() => break,
                    _ = tick.tick() => {}
                }
                let started = Instant::now();
                match transitions
                    .recover_expired(&me, &ctx.settings.supervisor)
                    .await
                {
                    Ok(recovered) => {
                        ctx.metrics.supervisor_sweeps.inc();
                        if !recovered.is_empty() {
                            tracing::info!(
                                recovered = recovered.len(),
                                took_ms = started.elapsed().as_millis() as u64,
                                "recovered expired orders"
                            );
                        }
                        report(&ctx, &recovered);
                        relay.push(recovered.iter().map(|r| match r {
                            Expired::Requeued { order_id, .. } | Expired::GaveUp { order_id } => {
                                *order_id
                            }
                        }));
                    }
                    Err(e) => tracing::warn!(error = %e, "sweep failed; will retry"),
                }
            }
            relay_task.stop(Ok(SessionEnd::Shutdown)).await
        },
    )
    .await
    .context("RabbitMQ")?;
    Ok(())
}

fn report(ctx: &Context, recovered: &[Expired]) {
    for r in recovered {
        let action = match r {
            Expired::Requeued {
                order_id,
                not_before,
            } => {
                tracing::info!(%order_id, %not_before, "complete-by passed; re-attempt scheduled");
                "requeued"
            }
            Expired::GaveUp { order_id } => {
                tracing::warn!(%order_id, "complete-by passed too often; order given up");
                "gave_up"
            }
        };
        ctx.metrics
            .supervisor_recoveries
            .get_or_create(&labels(&[("action", action)]))
            .inc();
    }
}

//! The Supervisor: every `supervisor.interval`, finds orders whose
//! `complete_by` has passed, counts the failure (`failure_count`) and either
//! re-queues the order after the retry schedule's wait or, at
//! `supervisor.max_failures`, gives it up (alert, then compensate or fail).
//! It knows nothing of the steps' business: only deadlines and counts.
//!
//! The leader also submits the orders of the recurring schedules
//! ([`crate::schedules`]) and deletes ended orders past their retention
//! ([`crate::retention`]).
//!
//! Several supervisors may run and all sweep: the orders are split into
//! `supervisor.partitions` partitions, shared out among the supervisors seen
//! within two intervals (each partition held by one, under a Postgres
//! advisory lock), so a supervisor that dies has its partitions taken over
//! within an interval. One leads (a Postgres lease) for the schedules and
//! retention. Even two sweeps of one partition would be safe: each expired
//! order is locked by one sweep (`FOR UPDATE SKIP LOCKED`) and changed once,
//! guarded by its state and holder.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use sas::broker::{Broker, SessionEnd};
use sas::engine::{Actor, Recovered};
use sas::metrics::labels;
use sas::pipeline::Pipeline;
use sas::rules::supervisor::Recovery;
use sas::service::Context;
use sas::state_store::{Lease, Partitions, StateStore};
use uuid::Uuid;

/// What a supervisor keeps from one broker session to the next and lets go
/// of when it stops.
struct Kept {
    lease: Lease,
    leading: bool,
    partitions: Partitions,
    retention: crate::retention::Retention,
    /// While the leader sends again the steps sent before a loss of
    /// RabbitMQ's transient messages: the bound of their dispatch ids.
    resend: Option<Uuid>,
}

/// Runs a supervisor until shutdown.
pub async fn run(ctx: Arc<Context>) -> anyhow::Result<()> {
    let store = ctx.store()?.clone();
    let me = Actor::new_instance("supervisor");
    let pipeline = Pipeline::new(&ctx, store.clone());
    let agents = ctx.settings.agent_names();
    let schedules = crate::schedules::Schedules::compile(&ctx.settings)?;
    let retention = crate::retention::Retention::new(&ctx.settings.retention);
    retention.check()?;
    let kept = Arc::new(tokio::sync::Mutex::new(Kept {
        lease: Lease::new("sas.supervisor"),
        leading: false,
        partitions: Partitions::new(ctx.settings.supervisor.partitions),
        retention,
        resend: None,
    }));
    // Owns what it uses (see `Context::run_sessions`).
    let (owned, session_kept) = (ctx.clone(), kept.clone());
    let sessions = ctx
        .run_sessions(&agents, async move |broker| {
            let ctx = &owned;
            let kept = &mut *session_kept.lock().await;
            let relay_task = pipeline.start(broker).await?;
            let mut tick = tokio::time::interval(ctx.settings.supervisor.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = ctx.shutdown.cancelled() => break,
                    () = relay_task.lost().cancelled() => break,
                    _ = tick.tick() => {}
                }
                let mine = share(ctx, &me, &store, &mut kept.partitions).await;
                let started = Instant::now();
                match pipeline.recover_expired(&me, &ctx.settings, &mine).await {
                    Ok(recovered) => {
                        ctx.metrics.supervisor_sweeps.inc();
                        ctx.metrics
                            .supervisor_sweep_duration_seconds
                            .observe(started.elapsed().as_secs_f64());
                        if !recovered.is_empty() {
                            tracing::info!(
                                recovered = recovered.len(),
                                took_ms = started.elapsed().as_millis() as u64,
                                "recovered expired orders"
                            );
                        }
                        report(ctx, &recovered);
                    }
                    Err(e) => tracing::warn!(error = %e, "sweep failed; will retry"),
                }
                // The rest is the leader's alone.
                if !lead(ctx, &me, &store, &mut kept.lease, &mut kept.leading).await {
                    kept.retention.stand_by();
                    continue;
                }
                kept.retention.lead(ctx, &store);
                resend_lost(ctx, &me, &pipeline, broker, &mut kept.resend).await;
                match pipeline.warn_late(&me, &ctx.settings.supervisor).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(orders = n, "warned of approaching deadlines"),
                    Err(e) => tracing::warn!(error = %e, "deadline warnings failed; will retry"),
                }
                schedules.pass(&pipeline).await;
                crate::stuck_gauge::count(ctx, &store, broker).await;
            }
            relay_task.stop(Ok(SessionEnd::Shutdown)).await
        })
        .await
        .context("RabbitMQ");
    // The sessions are over, and the closure that held `kept` with them.
    let Kept {
        mut lease,
        mut partitions,
        retention,
        ..
    } = Arc::into_inner(kept)
        .context("the broker sessions still hold the supervisor's state")?
        .into_inner();
    retention.stop().await;
    sessions?;
    lease.release().await;
    partitions.release().await;
    Ok(())
}

/// Records this supervisor's heartbeat, then holds its fair share of the
/// partitions among the supervisors seen within two intervals;
/// returns the partitions it sweeps (none while Postgres cannot say).
async fn share(
    ctx: &Context,
    me: &Actor,
    store: &StateStore,
    partitions: &mut Partitions,
) -> Vec<i32> {
    let interval = ctx.settings.supervisor.interval;
    let held = async {
        store.heartbeat(&me.name, "supervisor").await?;
        let alive = store.alive("supervisor", interval * 2).await?;
        partitions.rebalance(store, alive).await
    };
    match held.await {
        Ok(held) => {
            ctx.metrics
                .supervisor_partitions
                .set(i64::try_from(held.len()).unwrap_or(i64::MAX));
            held
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot hold partitions; sweeping none");
            ctx.metrics.supervisor_partitions.set(0);
            Vec::new()
        }
    }
}

/// Whether this supervisor leads now; reports changes.
async fn lead(
    ctx: &Context,
    me: &Actor,
    store: &StateStore,
    lease: &mut Lease,
    leading: &mut bool,
) -> bool {
    let now = match lease.lead(store).await {
        Ok(now) => now,
        Err(e) => {
            tracing::warn!(error = %e, "cannot reach the lease; standing by");
            false
        }
    };
    if now != *leading {
        *leading = now;
        ctx.metrics.supervisor_leader.set(i64::from(now));
        if now {
            tracing::info!(instance = %me.name, "leading: deadline warnings, schedules, retention and stuck counts");
        } else {
            tracing::warn!(instance = %me.name, "standing by: another supervisor leads");
            crate::stuck_gauge::clear(ctx);
        }
    }
    now
}

/// With transient step messages, the leader's watch on RabbitMQ's: when
/// the broker has lost them ([`Broker::lost_transient`]), every step sent
/// before is sent again at once ([`sas::engine::Transitions::resend`]), a
/// batch per tick until a pass finds none, rather than left to its
/// complete-by. `resend` holds the bound of the dispatches still to send
/// again.
async fn resend_lost(
    ctx: &Context,
    me: &Actor,
    pipeline: &Pipeline,
    broker: &Broker,
    resend: &mut Option<Uuid>,
) {
    let broker_settings = &ctx.settings.broker;
    if !broker_settings.step_messages.transient() {
        return;
    }
    match broker
        .lost_transient(ctx.queues.marker(), broker_settings.step_queues)
        .await
    {
        Ok(true) => {
            tracing::info!(
                "RabbitMQ holds no transient messages from before: sending the steps out again"
            );
            *resend = Some(sas::rules::resend::sent_before_time(chrono::Utc::now()));
        }
        Ok(false) => {}
        // Its node away, say: the steps' complete-by still stands.
        Err(e) => tracing::warn!(error = %e, "cannot check RabbitMQ's transient messages"),
    }
    let Some(before) = *resend else { return };
    match pipeline.resend(me, before, &ctx.settings.supervisor).await {
        Ok(resent) => {
            if !resent.is_empty() {
                tracing::info!(orders = resent.len(), "steps lost with RabbitMQ sent again");
                ctx.metrics
                    .supervisor_recoveries
                    .get_or_create(&labels(&[("action", "resent")]))
                    .inc_by(resent.len() as u64);
            }
            // Until a pass finds none: one may have passed by orders that
            // another transition had locked.
            if resent.is_empty() {
                *resend = None;
            }
        }
        Err(e) => tracing::warn!(error = %e, "sending lost steps again failed; will retry"),
    }
}

/// Logs and counts what a sweep did.
fn report(ctx: &Context, recovered: &[Recovered]) {
    for r in recovered {
        let order_id = r.order_id;
        match r.recovery {
            Recovery::Requeued { not_before } => {
                tracing::info!(%order_id, %not_before, "complete-by passed; re-attempt scheduled");
            }
            Recovery::Held => {
                tracing::info!(%order_id, "complete-by passed behind an open breaker; order held");
            }
            Recovery::GaveUp => {
                tracing::warn!(%order_id, "complete-by passed too often; order given up");
            }
            Recovery::Woke => tracing::info!(%order_id, "a wait ended; order goes on"),
        }
        if let Some(end) = &r.ended {
            ctx.metrics.finished(&end.workflow, end.state, None);
        }
        ctx.metrics
            .supervisor_recoveries
            .get_or_create(&labels(&[("action", r.recovery.label())]))
            .inc();
    }
}

//! The submission service's broker sessions: `<prefix>.orders`
//! ([`crate::submission`]), `<prefix>.replay` ([`crate::replay`]),
//! `<prefix>.signals` ([`crate::signals`]) and the requests and ends of
//! child workflows ([`crate::children`]), each on a consumer of its own, all
//! ending together, with the intake's relay started and stopped around
//! them.

use std::sync::Arc;

use anyhow::Context as _;
use sas::broker::{self, BrokerError, Handling, Received};
use sas::service::Context;

use crate::children::Children;
use crate::replay::Replayer;
use crate::signals::Signaller;
use crate::submission::{Intake, Submitter};

/// Runs the submission until shutdown, storing orders through `intake`
/// (shared with the HTTP API, [`crate::http_api`]).
pub async fn run(ctx: Arc<Context>, intake: Arc<Intake>) -> anyhow::Result<()> {
    let store = ctx.store()?.clone();
    // The holder of the orders it starts: alive while it beats.
    sas::heartbeat::spawn(
        store.clone(),
        intake.actor().name.clone(),
        "submission",
        ctx.shutdown.clone(),
    );
    let replayer = Arc::new(Replayer {
        store,
        ctx: ctx.clone(),
    });
    let children = Arc::new(Children {
        intake: intake.clone(),
        store: ctx.store()?.clone(),
        ctx: ctx.clone(),
        actor: sas::engine::Actor::new_instance("submission"),
    });
    let signaller = Arc::new(Signaller {
        pipeline: intake.pipeline().clone(),
        ctx: ctx.clone(),
        actor: sas::engine::Actor::new_instance("submission"),
    });
    let submission = Arc::new(Submitter {
        intake,
        ctx: ctx.clone(),
    });
    // Owns what it uses (see `Context::run_sessions`).
    let owned = ctx.clone();
    ctx.run_sessions(&ctx.settings.agent_names(), async move |broker| {
        let ctx = &owned;
        let publisher = broker.publisher().await?;
        let relay = submission.intake.pipeline().start(broker).await?;
        let (orders, replay) = (ctx.queues.orders(), ctx.queues.replay());
        let prefetch = ctx.settings.broker.prefetch;
        let consumer = ctx
            .subscribe(broker, &publisher, orders, prefetch, "submission")
            .await?;
        let replays = ctx
            .subscribe(
                broker,
                &publisher,
                replay,
                REPLAY_PREFETCH,
                "submission-replay",
            )
            .await?;
        let signals = ctx
            .subscribe(
                broker,
                &publisher,
                ctx.queues.signals(),
                SIGNAL_PREFETCH,
                "submission-signals",
            )
            .await?;
        let child_requests = ctx
            .subscribe(
                broker,
                &publisher,
                ctx.queues.children(),
                SIGNAL_PREFETCH,
                "submission-children",
            )
            .await?;
        let child_ends = ctx
            .subscribe(
                broker,
                &publisher,
                ctx.queues.children_ended(),
                SIGNAL_PREFETCH,
                "submission-children-ended",
            )
            .await?;
        // The consumers end together: whichever stops first (the broker
        // lost, or shutdown) stops the others.
        let stop = ctx.shutdown.child_token();
        let grace = ctx.settings.shutdown.grace;
        let lost = relay.lost();
        let submitting = serve(consumer, &stop, lost, grace, |delivery| -> Handling {
            let (submission, publisher) = (submission.clone(), publisher.clone());
            Box::pin(async move { submission.handle(&publisher, delivery).await })
        });
        let replaying = serve(replays, &stop, lost, grace, |delivery| -> Handling {
            let (replayer, publisher) = (replayer.clone(), publisher.clone());
            Box::pin(async move { replayer.handle(&publisher, delivery).await })
        });
        let signalling = serve(signals, &stop, lost, grace, |delivery| -> Handling {
            let signaller = signaller.clone();
            Box::pin(async move { signaller.handle(delivery).await })
        });
        let starting = serve(child_requests, &stop, lost, grace, |delivery| -> Handling {
            let (children, publisher) = (children.clone(), publisher.clone());
            Box::pin(async move { children.request(&publisher, delivery).await })
        });
        let ending = serve(child_ends, &stop, lost, grace, |delivery| -> Handling {
            let (children, publisher) = (children.clone(), publisher.clone());
            Box::pin(async move { children.event(&publisher, delivery).await })
        });
        let (orders, replays, signals, starts, ends) =
            tokio::join!(submitting, replaying, signalling, starting, ending);
        // The first error wins; else the orders' consumer says how it ended.
        let end = orders.and_then(|end| {
            [replays, signals, starts, ends]
                .into_iter()
                .find_map(Result::err)
                .map_or(Ok(end), Err)
        });
        relay.stop(end).await
    })
    .await
    .context("RabbitMQ")?;
    Ok(())
}

/// Consumes `subscription` with `handler` until shutdown or the broker is
/// lost; ending, it stops the session's other consumers (`stop`).
async fn serve(
    subscription: broker::Subscription,
    stop: &tokio_util::sync::CancellationToken,
    lost: &tokio_util::sync::CancellationToken,
    grace: std::time::Duration,
    handler: impl Fn(Received) -> Handling,
) -> Result<broker::SessionEnd, BrokerError> {
    let end = broker::consume(subscription, stop, lost, grace, handler).await;
    stop.cancel();
    end
}

/// Replay requests worked on at once: each may publish thousands of events.
const REPLAY_PREFETCH: u16 = 4;

/// Signals worked on at once: each is one transition.
const SIGNAL_PREFETCH: u16 = 16;

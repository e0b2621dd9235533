//! The Scheduler: claims orders atomically (`locked_by`, `complete_by`,
//! `processing`), dispatches each step to its agent through the outbox, and
//! applies the agents' replies from the shared reply queue, each in one
//! transaction guarded by the order's state, lock holder, attempt and the
//! step's dispatch id.
//!
//! New work is noticed at once through Postgres `LISTEN`; a slow poll beside
//! it picks up orders whose `not_before` has come.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use sas::broker::{self, BrokerError, Received, Verdict};
use sas::engine::{Actor, ClaimBounds, ReplyOutcome};
use sas::messages::{Quoted, StepReply, decode_replies};
use sas::metrics::labels;
use sas::pipeline::Pipeline;
use sas::service::Context;
use sas::state_store::StoreError;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// A reply to apply, and what became of it.
type Batcher = sas::batch::Batcher<StepReply, Result<ReplyOutcome, Arc<StoreError>>>;

/// The scheduler's work, shared by its tasks.
struct Scheduler {
    me: Actor,
    /// Its transitions, and the relay that publishes what they commit.
    pipeline: Pipeline,
    /// Applies replies in batches: those that arrive while a transaction
    /// commits share the next one.
    replies: Batcher,
    /// An order ended while this instance held about as many as it may
    /// (`scheduler.max_in_flight`): room to claim another.
    room: tokio::sync::Notify,
    /// About how many orders this instance holds: claimed, not yet ended.
    /// Only a hint for when to wake the claimer (orders also leave through
    /// the supervisor, or another scheduler); the limit itself is counted
    /// in the state store.
    held: std::sync::atomic::AtomicUsize,
    ctx: Arc<Context>,
}

/// Runs a scheduler until shutdown.
pub async fn run(ctx: Arc<Context>) -> anyhow::Result<()> {
    let store = ctx.store()?.clone();
    let me = match &ctx.settings.scheduler.instance_id {
        Some(id) => Actor { name: id.clone() },
        None => Actor::new_instance("scheduler"),
    };
    tracing::info!(instance = %me.name, "scheduler instance");
    // Flow control (§4b) as this configuration sets it; the schedulers enforce it.
    for (agent, spec) in &ctx.settings.agents {
        store
            .declare_flow(
                agent,
                spec.max_in_flight,
                spec.rate_per_sec(),
                spec.rate_per_sec().map_or(1.0, sas::rules::flow::burst),
            )
            .await
            .with_context(|| format!("declaring the flow control of agent {agent}"))?;
    }
    sas::heartbeat::spawn(
        store.clone(),
        me.name.clone(),
        "scheduler",
        ctx.shutdown.clone(),
    );
    let mut pipeline = Pipeline::new(&ctx, store).publishing_as(&me.name);
    let keep = ctx.settings.scheduler.keep_orders as usize;
    if keep > 0 {
        pipeline = pipeline.keeping_orders(keep);
    }
    let replies = apply_in_batches(pipeline.clone(), me.clone(), &ctx.settings.database);
    let scheduler = Arc::new(Scheduler {
        me,
        pipeline,
        replies,
        room: tokio::sync::Notify::new(),
        held: std::sync::atomic::AtomicUsize::new(0),
        ctx: ctx.clone(),
    });
    // Owns what it uses (see `Context::run_sessions`).
    let owned = ctx.clone();
    ctx.run_sessions(&ctx.settings.agent_names(), async move |broker| {
        let ctx = &owned;
        let relay = scheduler.pipeline.start(broker).await?;
        let session = ctx.shutdown.child_token();
        let claimer = tokio::spawn(scheduler.clone().claim_loop(session.clone()));
        let publisher = broker.publisher().await?;
        let consumer = ctx
            .subscribe(
                broker,
                &publisher,
                ctx.queues.replies(),
                ctx.settings.broker.prefetch,
                &scheduler.me.name,
            )
            .await?;
        let end = broker::consume(
            consumer,
            &ctx.shutdown,
            relay.lost(),
            ctx.settings.shutdown.grace,
            |delivery| {
                let scheduler = scheduler.clone();
                async move { scheduler.on_reply(delivery).await }
            },
        )
        .await;
        session.cancel();
        claimer.await.ok();
        relay.stop(end).await
    })
    .await
    .context("RabbitMQ")?;
    Ok(())
}

/// Starts the workers that apply replies in batches.
fn apply_in_batches(pipeline: Pipeline, me: Actor, db: &sas::config::DatabaseSettings) -> Batcher {
    let shared = Arc::new((pipeline, me));
    sas::batch::Batcher::start(db.batch_workers, db.batch_size, move |replies| {
        let shared = shared.clone();
        async move {
            let (pipeline, me) = &*shared;
            sas::batch::isolating(&replies, StoreError::is_refusal_of_input, |some| {
                pipeline.apply_replies(me, some)
            })
            .await
        }
    })
}

impl Scheduler {
    /// Claims work whenever woken (a notification or the poll) until `stop`.
    async fn claim_loop(self: Arc<Self>, stop: CancellationToken) {
        let settings = &self.ctx.settings;
        let rates = settings.agents.values().filter_map(|a| a.rate_per_sec());
        let poll = poll_interval(settings.scheduler.poll_interval, rates);
        let mut listener = None;
        loop {
            if listener.is_none() {
                listener = match self.pipeline.store().listen().await {
                    Ok(l) => Some(l),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot LISTEN for new work; polling");
                        None
                    }
                };
            }
            if !self.claim_all(&stop).await {
                // Postgres failed us: the listener's connection may have
                // failed too, silently (nothing tells a listener). Listen
                // again on a fresh one.
                listener = None;
            }
            let woken = async {
                match listener.as_mut() {
                    // A notification, or the poll interval, whichever comes first.
                    Some(l) => {
                        if let Ok(Err(e)) = tokio::time::timeout(poll, l.recv()).await {
                            tracing::warn!(error = %e, "wake-up listener failed; polling");
                            tokio::time::sleep(poll).await;
                        }
                    }
                    None => tokio::time::sleep(poll).await,
                }
            };
            tokio::select! {
                () = stop.cancelled() => return,
                () = woken => {}
                () = self.room.notified() => {}
            }
        }
    }

    /// Claims batches until there is nothing left to claim; false when a
    /// claim failed.
    async fn claim_all(&self, stop: &CancellationToken) -> bool {
        let settings = &self.ctx.settings.scheduler;
        let bounds = ClaimBounds {
            orders: settings.claim_batch,
            max_held: settings.max_in_flight,
            requests: settings.claim_messages,
        };
        while !stop.is_cancelled() {
            match self.pipeline.claim(&self.me, bounds).await {
                Ok(claimed) => {
                    let n = claimed.ids.len();
                    if n > 0 {
                        sas::crash::point("scheduler.after_dispatch");
                        tracing::debug!(claimed = n, "claimed orders");
                        self.ctx.metrics.orders_claimed.inc_by(n as u64);
                        self.held.fetch_add(n, Ordering::Relaxed);
                    }
                    // Fewer than a batch, and not stopped by its requests:
                    // caught up, others hold the rest, or this instance holds
                    // all it may.
                    if n < bounds.orders as usize && !claimed.more {
                        return true;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "claim failed; will retry");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    return false;
                }
            }
        }
        true
    }

    /// Applies a message of replies (one, or an agent's pack); an error
    /// means the broker is gone. The message is settled by its worst
    /// reply: handed back if any could not be applied for now (those
    /// applied are stale when it comes again), retried a bounded number of
    /// times if any failed otherwise, dead-lettered if one cannot be read
    /// (after the others are applied).
    async fn on_reply(&self, delivery: Received) -> Result<(), BrokerError> {
        let limit = self.max_reply_bytes();
        if delivery.body().len() > limit {
            // Dead-lettered by the broker, not copied: a copy would hold
            // the body twice (contract §1b: bounded memory per message).
            tracing::warn!(
                bytes = delivery.body().len(),
                limit,
                "a reply larger than any agent sends; dead-lettered by the broker"
            );
            self.count_reply("malformed");
            return broker::dead_letter(&delivery).await;
        }
        let replies = match decode_replies(delivery.body()) {
            Ok(r) => r,
            Err(e) => {
                let reason = self.unreadable(&e);
                return broker::dead_letter_with(&delivery, &reason).await;
            }
        };
        let header = delivery.header(sas::trace::HEADER);
        let applied = futures_util::future::join_all(replies.into_iter().map(|read| async {
            match read {
                Ok(reply) => self.apply(reply, header.as_deref()).await,
                Err(e) => Verdict::DeadLetter(self.unreadable(&e)),
            }
        }))
        .await;
        // The applied replies' messages went to the relay with the commit.
        let verdict = applied.into_iter().max().unwrap_or(Verdict::Ack);
        verdict.settle(&delivery).await
    }

    /// The largest message of replies the configured agents send
    /// ([`sas::messages::max_reply_message_bytes`]).
    fn max_reply_bytes(&self) -> usize {
        let settings = &self.ctx.settings;
        let largest = settings
            .agents
            .values()
            .map(|a| a.max_response_bytes)
            .max()
            .unwrap_or(1 << 20);
        sas::messages::max_reply_message_bytes(largest)
    }

    /// Logs and counts a reply that cannot be read; the reason to
    /// dead-letter its message with.
    fn unreadable(&self, e: &serde_json::Error) -> String {
        tracing::warn!(error = %e, "unreadable reply; dead-lettered");
        self.count_reply("malformed");
        format!("unreadable reply: {}", Quoted::new(&e.to_string()))
    }

    /// Applies one reply, in its order's span.
    async fn apply(&self, mut reply: StepReply, header: Option<&str>) -> Verdict {
        let sent = reply
            .traceparent
            .take()
            .as_deref()
            .or(header)
            .and_then(sas::trace::TraceContext::parse);
        let span = tracing::info_span!(
            "reply",
            order_id = %reply.order_id,
            step = %reply.step,
            attempt = reply.attempt,
            trace_id = %sent.as_ref().map_or("", |t| t.trace_id.as_str()),
        );
        if let Some(sent) = &sent {
            sas::telemetry::continue_trace(&span, sent);
        }
        async {
            if reply.outcome.replace_nul() {
                tracing::warn!("the remote's answer held NUL characters; stored as U+FFFD");
            }
            let applied = self
                .replies
                .call(reply)
                .await
                .unwrap_or_else(|| Err(Arc::new(StoreError::NoOutcome)));
            match &applied {
                Ok(ReplyOutcome::Applied { ended, age }) => {
                    tracing::debug!(?ended, "reply applied");
                    if let Some(end) = ended {
                        self.ctx
                            .metrics
                            .finished(&end.workflow, end.state, Some(*age));
                        self.ended_one();
                    }
                    self.count_reply("applied");
                }
                Ok(ReplyOutcome::Stale(why)) => {
                    tracing::info!(%why, "stale reply ignored");
                    self.count_reply("stale");
                }
                Err(e) if e.is_transient() => {
                    tracing::warn!(error = %e, "could not apply the reply; handing it back");
                }
                Err(e) => {
                    // Not the store being away: this reply may be what
                    // fails. Retried a bounded number of times.
                    tracing::warn!(error = %e, "could not apply the reply");
                    self.count_reply("failed");
                }
            }
            verdict(&applied)
        }
        .instrument(span)
        .await
    }

    /// Counts an order of ours as ended, and wakes the claimer if it may
    /// have stopped at the limit.
    fn ended_one(&self) {
        let before = self
            .held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |h| {
                Some(h.saturating_sub(1))
            })
            .unwrap_or(0);
        if room_again(before, &self.ctx.settings.scheduler) {
            self.room.notify_one();
        }
    }

    fn count_reply(&self, outcome: &str) {
        self.ctx
            .metrics
            .replies
            .get_or_create(&labels(&[("outcome", outcome)]))
            .inc();
    }
}

/// What a reply's outcome makes of its message: applied or stale, done;
/// the store away, handed back; any other failure, which may be the
/// reply's own, retried a bounded number of times.
fn verdict(applied: &Result<ReplyOutcome, Arc<StoreError>>) -> Verdict {
    match applied {
        Ok(_) => Verdict::Ack,
        Err(e) => Verdict::failed(e.is_transient(), || {
            format!("could not apply the reply: {}", Quoted::new(&e.to_string()))
        }),
    }
}

/// Whether an order ending, with `before` held until then, may have made
/// room for a claimer that stopped at `scheduler.max_in_flight`: a claim
/// takes up to `claim_batch` at once, so it stops within a batch of the limit.
fn room_again(before: usize, settings: &sas::config::SchedulerSettings) -> bool {
    before >= settings.max_in_flight.saturating_sub(settings.claim_batch) as usize
}

/// How often the claimer looks without being woken: `configured`, or,
/// under the agents' rate limits (dispatches per second), as often as a
/// dispatch comes due (nothing notifies a token's coming, §4b), but no more
/// than every 10 ms.
fn poll_interval(configured: Duration, rates: impl Iterator<Item = f64>) -> Duration {
    rates
        .map(|rate| Duration::from_secs_f64((1.0 / rate).max(0.01)))
        .fold(configured, Duration::min)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sas::config::SchedulerSettings;

    #[test]
    fn a_reply_applied_or_stale_is_acknowledged() {
        let applied = Ok(ReplyOutcome::Applied {
            ended: None,
            age: Duration::ZERO,
        });
        assert_eq!(verdict(&applied), Verdict::Ack);
        let stale = Ok(ReplyOutcome::Stale("answered already".into()));
        assert_eq!(verdict(&stale), Verdict::Ack);
    }

    #[test]
    fn a_reply_the_store_could_not_take_now_is_handed_back_and_one_it_refused_is_counted() {
        let away = Err(Arc::new(StoreError::Silent(Duration::from_secs(5))));
        assert_eq!(verdict(&away), Verdict::Requeue);
        let refused = Err(Arc::new(StoreError::WriteBackRefused("guard".into())));
        match verdict(&refused) {
            Verdict::RetryCounted(reason) => {
                assert!(
                    reason.starts_with("could not apply the reply: "),
                    "{reason}"
                );
                assert!(reason.contains("guard"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_pack_with_one_reply_handed_back_is_handed_back_whole() {
        let pack = [
            Verdict::Ack,
            verdict(&Err(Arc::new(StoreError::NoOutcome))),
            Verdict::DeadLetter("unreadable reply".into()),
        ];
        assert_eq!(pack.into_iter().max(), Some(Verdict::Requeue));
    }

    #[test]
    fn an_ending_wakes_the_claimer_only_within_a_batch_of_the_limit() {
        let settings = SchedulerSettings {
            max_in_flight: 1000,
            claim_batch: 256,
            ..SchedulerSettings::default()
        };
        assert!(!room_again(0, &settings));
        assert!(!room_again(743, &settings));
        assert!(room_again(744, &settings));
        assert!(room_again(5000, &settings));
        // A batch larger than the limit: every ending may make room.
        let small = SchedulerSettings {
            max_in_flight: 10,
            claim_batch: 256,
            ..SchedulerSettings::default()
        };
        assert!(room_again(0, &small));
    }

    #[test]
    fn the_claimer_polls_as_often_as_the_fastest_rate_limit_allows_a_dispatch() {
        let poll = Duration::from_millis(500);
        assert_eq!(poll_interval(poll, std::iter::empty()), poll);
        assert_eq!(poll_interval(poll, [1.0].into_iter()), poll);
        assert_eq!(
            poll_interval(poll, [1.0, 20.0].into_iter()),
            Duration::from_millis(50)
        );
        // Never a busy loop, however high the rate.
        assert_eq!(
            poll_interval(poll, [1e6].into_iter()),
            Duration::from_millis(10)
        );
    }
}

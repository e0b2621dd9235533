//! Acknowledgements, several at a time. Each delivery a consumer takes is
//! handled in its own task, and handlers finish in any order; one
//! `basic.ack` with `multiple` settles every finished delivery below the
//! oldest unfinished one, so a batch of orders committed together costs the
//! broker one frame instead of one per order (RabbitMQ spends about half as
//! much CPU per consumed message with acks 32 at a time as with one each).
//!
//! Nothing waits for company: a delivery whose handler finishes while no
//! frame is on its way is settled at once, so latency does not change.
//! Frames go out one batch at a time, in delivery order, and what finishes
//! meanwhile shares the next batch. Hand-backs and rejections take their
//! place in that order (a multiple ack that reached the broker before the
//! rejection of a delivery it covers would leave the rejection's tag
//! unknown, or worse, acknowledge a message meant to come back). A
//! hand-back or rejection behind an unfinished delivery goes out at once,
//! on its own, so that another consumer can take a handed-back message; an
//! ack behind an unfinished delivery waits (it still counts against the
//! prefetch) until the unfinished one ends or half the prefetch is waiting,
//! then they go out one by one, so a slow handler cannot stall the consumer.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lapin::Acker;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};

use super::BrokerError;
use super::delivery::Delivery;
use prometheus_client::metrics::counter::Counter;

use super::publisher::Publisher;

/// A delivery taken by [`super::consume`]: a [`Delivery`] (it derefs to
/// it), settled through its channel's [`Acks`].
pub struct Received {
    /// Shared with the consumer loop, which settles it if the handler panics.
    delivery: Arc<Delivery>,
    acks: Arc<Acks>,
    /// Where the delivery goes when it can never be handled.
    dead_letters: Option<Arc<DeadLetters>>,
}

impl Deref for Received {
    type Target = Delivery;

    fn deref(&self) -> &Delivery {
        &self.delivery
    }
}

impl std::fmt::Debug for Received {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Received")
            .field("delivery_tag", &self.delivery.tag())
            .finish_non_exhaustive()
    }
}

impl Received {
    /// Settles the delivery through its channel's [`Acks`]: what
    /// [`super::ack`], [`super::requeue`] and [`super::dead_letter`] do.
    pub(super) async fn settle(&self, how: Settle) -> Result<(), BrokerError> {
        let (tag, acker) = (self.delivery.tag(), self.delivery.inner.acker.clone());
        self.acks.finished(tag, acker, how);
        self.acks.send(false).await
    }

    /// Whether no handler has settled the delivery yet.
    pub(super) fn is_unfinished(&self) -> bool {
        self.acks.lock().unfinished.contains(&self.delivery.tag())
    }

    /// The consumer's dead-letter route, when it has one.
    pub(super) fn dead_letters(&self) -> Option<&DeadLetters> {
        self.dead_letters.as_deref()
    }

    /// A second handle on the same delivery, for the consumer loop.
    pub(super) fn share(&self) -> Self {
        Self {
            delivery: self.delivery.clone(),
            acks: self.acks.clone(),
            dead_letters: self.dead_letters.clone(),
        }
    }
}

/// How a handler settled its delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Settle {
    /// Done: the broker may forget it.
    Ack,
    /// Back to its queue, for redelivery.
    Requeue,
    /// Rejected without requeue: the queue dead-letters it.
    DeadLetter,
}

/// The acknowledgements of one consumer's channel (delivery tags count up
/// per channel).
#[derive(Debug)]
pub struct Acks {
    state: Mutex<State<Acker>>,
    /// Held while a batch of frames goes out, so that batches leave in order.
    sending: tokio::sync::Mutex<()>,
    /// Finished deliveries that may wait behind an unfinished one.
    max_waiting: usize,
    /// Deliveries acknowledged, and ack frames sent for them.
    acked: AtomicU64,
    ack_frames: AtomicU64,
}

/// The deliveries of a channel by tag; `A` settles one (lapin's [`Acker`];
/// a stand-in in tests).
#[derive(Debug)]
struct State<A> {
    /// Delivered, and not yet settled by the handler.
    unfinished: BTreeSet<u64>,
    /// Settled by their handler, not yet sent.
    finished: BTreeMap<u64, (A, Settle)>,
}

impl<A> Default for State<A> {
    fn default() -> Self {
        Self {
            unfinished: BTreeSet::new(),
            finished: BTreeMap::new(),
        }
    }
}

/// A frame to send: how, and for an ack whether it covers every earlier
/// delivery too (`multiple`).
type Frame<A> = (A, Settle, bool);

impl<A> State<A> {
    /// The frames that may go out now, in order. With `all`, every finished
    /// delivery, whatever still runs.
    fn due(&mut self, max_waiting: usize, all: bool) -> Vec<Frame<A>> {
        let oldest = self.unfinished.first().copied().unwrap_or(u64::MAX);
        let mut frames = Vec::new();
        // Behind the oldest unfinished delivery: hand-backs and rejections
        // go at once (each settles only its own delivery, and a multiple ack
        // sent after it cannot cover it); acks wait.
        let mut behind = Vec::new();
        let mut waiting = BTreeMap::new();
        // Before it, each run of acks goes as one multiple ack of its last
        // delivery, after the hand-backs and rejections before it.
        let mut run = None;
        for (tag, (acker, how)) in std::mem::take(&mut self.finished) {
            if tag > oldest {
                if how == Settle::Ack {
                    waiting.insert(tag, (acker, how));
                } else {
                    behind.push((acker, how, false));
                }
                continue;
            }
            if how == Settle::Ack {
                run = Some(acker);
                continue;
            }
            if let Some(last) = run.take() {
                frames.push((last, Settle::Ack, true));
            }
            frames.push((acker, how, false));
        }
        if let Some(last) = run {
            frames.push((last, Settle::Ack, true));
        }
        frames.extend(behind);
        if all || waiting.len() >= max_waiting {
            frames.extend(
                std::mem::take(&mut waiting)
                    .into_values()
                    .map(|(acker, how)| (acker, how, false)),
            );
        }
        self.finished = waiting;
        frames
    }
}

impl Acks {
    /// Acknowledgements for a channel with this prefetch.
    pub fn new(prefetch: u16) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State::default()),
            sending: tokio::sync::Mutex::new(()),
            max_waiting: usize::from(prefetch / 2).max(1),
            acked: AtomicU64::new(0),
            ack_frames: AtomicU64::new(0),
        })
    }

    /// Wraps a delivery just taken from the channel; it counts as
    /// unfinished until its handler settles it.
    pub(super) fn received(
        self: &Arc<Self>,
        delivery: Delivery,
        dead_letters: Option<Arc<DeadLetters>>,
    ) -> Received {
        self.lock().unfinished.insert(delivery.tag());
        Received {
            delivery: Arc::new(delivery),
            acks: self.clone(),
            dead_letters,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<Acker>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn finished(&self, tag: u64, acker: Acker, how: Settle) {
        let mut state = self.lock();
        state.unfinished.remove(&tag);
        state.finished.insert(tag, (acker, how));
        if how == Settle::Ack {
            self.acked.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Sends what is due; with `all`, every finished delivery (on the way
    /// out: what did not finish is redelivered once the channel closes).
    pub async fn send(&self, all: bool) -> Result<(), BrokerError> {
        let _sending = self.sending.lock().await;
        let frames = self.lock().due(self.max_waiting, all);
        for (acker, how, multiple) in frames {
            match how {
                Settle::Ack => {
                    acker.ack(BasicAckOptions { multiple }).await?;
                    self.ack_frames.fetch_add(1, Ordering::Relaxed);
                }
                Settle::Requeue => {
                    let requeue = BasicNackOptions {
                        requeue: true,
                        ..BasicNackOptions::default()
                    };
                    acker.nack(requeue).await?;
                }
                Settle::DeadLetter => {
                    acker.reject(BasicRejectOptions { requeue: false }).await?;
                }
            }
        }
        Ok(())
    }

    /// Deliveries acknowledged so far (sent or waiting).
    pub fn acked(&self) -> u64 {
        self.acked.load(Ordering::Relaxed)
    }

    /// Ack frames sent so far.
    pub fn ack_frames(&self) -> u64 {
        self.ack_frames.load(Ordering::Relaxed)
    }
}

/// Where a consumer's hopeless deliveries go.
#[derive(Clone)]
pub struct DeadLetters {
    pub(super) publisher: Publisher,
    /// The consumed queue (a retry goes back to it).
    pub(super) queue: String,
    /// The consumed queue's dead-letter queue.
    pub(super) dead_queue: String,
    /// Tries of one message before [`super::retry_counted`] dead-letters it.
    pub(super) max_tries: u32,
    /// Handler panics, for `sas_handler_panics_total`.
    pub(super) panics: Counter,
}

impl DeadLetters {
    /// Dead letters of `queue` go to `<queue>.dead` through `publisher`.
    pub fn new(publisher: Publisher, queue: &str, max_tries: u32, panics: Counter) -> Self {
        Self {
            publisher,
            queue: queue.to_owned(),
            dead_queue: format!("{queue}.dead"),
            max_tries: max_tries.max(1),
            panics,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use Settle::{Ack, DeadLetter, Requeue};

    /// A state whose ackers are their own tags.
    fn state(unfinished: &[u64], finished: &[(u64, Settle)]) -> State<u64> {
        State {
            unfinished: unfinished.iter().copied().collect(),
            finished: finished.iter().map(|&(t, how)| (t, (t, how))).collect(),
        }
    }

    fn waiting(s: &State<u64>) -> Vec<u64> {
        s.finished.keys().copied().collect()
    }

    #[test]
    fn finished_deliveries_below_the_oldest_unfinished_one_go_as_one_multiple_ack() {
        let mut s = state(&[7], &[(1, Ack), (2, Ack), (3, Ack), (5, Ack), (8, Ack)]);
        assert_eq!(s.due(32, false), vec![(5, Ack, true)]);
        assert_eq!(waiting(&s), vec![8]);
    }

    #[test]
    fn with_nothing_unfinished_everything_goes_as_one_multiple_ack() {
        let mut s = state(&[], &[(4, Ack), (5, Ack), (6, Ack)]);
        assert_eq!(s.due(32, false), vec![(6, Ack, true)]);
        assert!(waiting(&s).is_empty());
    }

    #[test]
    fn hand_backs_and_rejections_go_in_their_place_between_runs_of_acks() {
        let mut s = state(
            &[],
            &[(1, Ack), (2, DeadLetter), (3, Ack), (4, Ack), (5, Requeue)],
        );
        assert_eq!(
            s.due(32, false),
            vec![
                (1, Ack, true),
                (2, DeadLetter, false),
                (4, Ack, true),
                (5, Requeue, false)
            ]
        );
    }

    #[test]
    fn acks_behind_a_slow_delivery_go_one_by_one_once_too_many_wait() {
        let mut s = state(&[1], &[(2, Ack), (3, Ack)]);
        assert_eq!(s.due(3, false), vec![]);
        s.finished.insert(4, (4, Ack));
        assert_eq!(
            s.due(3, false),
            vec![(2, Ack, false), (3, Ack, false), (4, Ack, false)]
        );
        assert!(waiting(&s).is_empty());
        assert_eq!(s.unfinished.iter().copied().collect::<Vec<_>>(), vec![1]);
    }

    #[test]
    fn hand_backs_and_rejections_behind_a_slow_delivery_go_at_once() {
        let mut s = state(&[2], &[(1, Ack), (3, Ack), (4, Requeue), (5, DeadLetter)]);
        assert_eq!(
            s.due(32, false),
            vec![(1, Ack, true), (4, Requeue, false), (5, DeadLetter, false)]
        );
        assert_eq!(waiting(&s), vec![3]);
    }

    #[test]
    fn on_the_way_out_every_finished_delivery_goes() {
        let mut s = state(&[3], &[(1, Ack), (2, Ack), (5, Ack)]);
        assert_eq!(s.due(32, true), vec![(2, Ack, true), (5, Ack, false)]);
        assert!(waiting(&s).is_empty());
    }
}

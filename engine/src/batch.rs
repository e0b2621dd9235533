//! Group commit for message handlers: each delivery's handler hands its item
//! to a [`Batcher`] and awaits its own outcome, while a few worker tasks take
//! whatever items are waiting and run them as one batch (one transaction).
//!
//! Nothing waits for a batch to fill: a worker takes what is there when it
//! becomes free. At low load a batch is one item and costs what it did
//! alone; under load the items that arrive while a batch commits form the
//! next one, so the cost of a commit is shared by many.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{Mutex, mpsc, oneshot};

/// An item and where its outcome goes.
type Job<I, O> = (I, oneshot::Sender<O>);

/// Hands items to the batch workers; cheap to clone.
#[derive(Debug)]
pub struct Batcher<I, O> {
    jobs: mpsc::UnboundedSender<Job<I, O>>,
}

impl<I, O> Clone for Batcher<I, O> {
    fn clone(&self) -> Self {
        Self {
            jobs: self.jobs.clone(),
        }
    }
}

impl<I: Send + 'static, O: Send + 'static> Batcher<I, O> {
    /// Starts `workers` tasks, each running batches of at most `max` items
    /// through `run`, which returns one outcome per item, in order. The
    /// tasks end when the last `Batcher` handle is dropped.
    pub fn start<F, Fut>(workers: usize, max: usize, run: F) -> Self
    where
        F: Fn(Vec<I>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<O>> + Send,
    {
        let (jobs, rx) = mpsc::unbounded_channel::<Job<I, O>>();
        let rx = Arc::new(Mutex::new(rx));
        let run = Arc::new(run);
        for _ in 0..workers.max(1) {
            let (rx, run) = (rx.clone(), run.clone());
            tokio::spawn(async move {
                while let Some(batch) = next_batch(&rx, max.max(1)).await {
                    let (items, replies): (Vec<I>, Vec<oneshot::Sender<O>>) =
                        batch.into_iter().unzip();
                    let outcomes = run(items).await;
                    for (reply, outcome) in replies.into_iter().zip(outcomes) {
                        // The handler may have been cancelled (shutdown): nobody to tell.
                        let _ = reply.send(outcome);
                    }
                }
            });
        }
        Self { jobs }
    }

    /// Runs `item` in the next batch and returns its outcome; `None` if the
    /// workers are gone or the batch function gave no outcome for it.
    pub async fn call(&self, item: I) -> Option<O> {
        let (tx, rx) = oneshot::channel();
        self.jobs.send((item, tx)).ok()?;
        rx.await.ok()
    }
}

/// One outcome per item from a batch that succeeded or failed as a whole:
/// on failure every item gets the same error.
pub fn each<T, E>(outcome: Result<Vec<T>, E>, items: usize) -> Vec<Result<T, Arc<E>>> {
    match outcome {
        Ok(outcomes) => outcomes.into_iter().map(Ok).collect(),
        Err(e) => {
            let e = Arc::new(e);
            (0..items).map(|_| Err(e.clone())).collect()
        }
    }
}

/// Runs `items` as one batch through `run`; when the batch fails with an
/// error that `culprit` says one item may have caused (Postgres refused a
/// value), runs the items again one at a time, so that only the culprit
/// gets the error and the others are stored (contract §1a: one bad order
/// never fails another). Any other error is every item's.
pub async fn isolating<'t, T, O, E, F, Fut>(
    items: &'t [T],
    culprit: impl Fn(&E) -> bool,
    run: F,
) -> Vec<Result<O, Arc<E>>>
where
    F: Fn(&'t [T]) -> Fut,
    Fut: Future<Output = Result<Vec<O>, E>>,
{
    match run(items).await {
        Err(e) if items.len() > 1 && culprit(&e) => {
            tracing::warn!(
                items = items.len(),
                "a batch was refused; trying its items one by one"
            );
            let mut outcomes = Vec::with_capacity(items.len());
            for one in items.chunks(1) {
                outcomes.extend(each(run(one).await, 1));
            }
            outcomes
        }
        outcome => each(outcome, items.len()),
    }
}

/// Waits for one job, then takes the others already waiting, up to `max`.
async fn next_batch<I, O>(
    rx: &Mutex<mpsc::UnboundedReceiver<Job<I, O>>>,
    max: usize,
) -> Option<Vec<Job<I, O>>> {
    let mut rx = rx.lock().await;
    let first = rx.recv().await?;
    let mut batch = Vec::with_capacity(max.min(64));
    batch.push(first);
    while batch.len() < max {
        match rx.try_recv() {
            Ok(job) => batch.push(job),
            Err(_) => break,
        }
    }
    Some(batch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_item_gets_its_own_outcome() {
        let batcher = Batcher::start(2, 8, |items: Vec<u32>| async move {
            items.into_iter().map(|i| i * 10).collect::<Vec<_>>()
        });
        let calls: Vec<_> = (0..100)
            .map(|i| {
                let b = batcher.clone();
                tokio::spawn(async move { (i, b.call(i).await) })
            })
            .collect();
        for call in calls {
            let (i, out) = call.await.unwrap();
            assert_eq!(out, Some(i * 10));
        }
    }

    #[tokio::test]
    async fn a_refused_batch_is_retried_one_by_one_and_only_the_culprit_fails() {
        let runs = std::sync::Mutex::new(Vec::new());
        // A batch fails when it holds -1.
        let run = |items: &[i32]| {
            runs.lock().unwrap().push(items.len());
            let out = if items.contains(&-1) {
                Err("refused")
            } else {
                Ok(items.to_vec())
            };
            async move { out }
        };
        let outcomes = isolating(&[1, -1, 3], |e| *e == "refused", run).await;
        assert_eq!(outcomes[0].as_ref().ok(), Some(&1));
        assert!(outcomes[1].is_err());
        assert_eq!(outcomes[2].as_ref().ok(), Some(&3));
        assert_eq!(*runs.lock().unwrap(), vec![3, 1, 1, 1]);
        // An error no item caused (the database is down) is everyone's, at once.
        runs.lock().unwrap().clear();
        let outcomes = isolating(&[1, -1], |_| false, run).await;
        assert!(outcomes.iter().all(Result::is_err));
        assert_eq!(*runs.lock().unwrap(), vec![2]);
    }

    #[tokio::test]
    async fn items_waiting_together_share_a_batch() {
        let sizes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = sizes.clone();
        let batcher = Batcher::start(1, 64, move |items: Vec<u32>| {
            seen.lock().unwrap().push(items.len());
            async move {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                items
            }
        });
        let calls: Vec<_> = (0..50)
            .map(|i| {
                let b = batcher.clone();
                tokio::spawn(async move { b.call(i).await })
            })
            .collect();
        for call in calls {
            call.await.unwrap();
        }
        let sizes = sizes.lock().unwrap();
        assert_eq!(sizes.iter().sum::<usize>(), 50);
        assert!(sizes.len() < 50, "no batching happened: {sizes:?}");
    }
}

//! The floor of sas's own chain (#44): what one order cannot be faster than
//! on this machine. An order's path to its terminal event is a chain of
//! waits that each depend on the one before: commits that wait for the disk
//! (the order stored, the claim that sends the first request, each reply
//! applied), deliveries through RabbitMQ (the order; each step's request and
//! reply; the terminal status event), and the remote calls. Each kind of hop
//! is timed here on its own, one after another with nothing else running,
//! and the floor of a workflow is the sum of its hops. A low-load p50 near
//! its floor leaves nothing to win but fewer hops.

use std::time::{Duration, Instant};

use anyhow::Context;
use sas::broker::{Broker, Outgoing};
use sas::config::QueueType;
use serde::Serialize;
use sqlx::Connection;
use uuid::Uuid;

use crate::suite::{Env, Sim};

/// Each hop's median time, milliseconds, over [`SAMPLES`] serial samples.
#[derive(Debug, Clone, Serialize)]
pub struct Hops {
    /// An `INSERT` of an order-sized row committed with `synchronous_commit`
    /// on (it waits for the disk, as a transition does).
    pub commit_ms: f64,
    /// A confirmed publish to the orders' queue (quorum) until its delivery
    /// to a consumer.
    pub order_delivery_ms: f64,
    /// The same on a step queue (`broker.step_queues`).
    pub step_delivery_ms: f64,
    /// The same on a classic queue (an application's status queue).
    pub status_delivery_ms: f64,
    /// The agent's POST to remote-sim, answered.
    pub call_ms: f64,
    /// Samples per hop.
    pub samples: usize,
}

/// One workflow's chain (terminal events only: the other events are not
/// on the way to the terminal one), and its floor.
#[derive(Debug, Clone, Serialize)]
pub struct Chain {
    pub workflow: String,
    pub steps: usize,
    /// Stored, claimed (the first request), each reply applied.
    pub commits: usize,
    /// The order, then each step's request and reply, then the status event.
    pub deliveries: usize,
    pub calls: usize,
    /// The sum of the chain's hops, milliseconds.
    pub ms: f64,
}

/// The floor: the hops, timed, and the chains of the workflows measured.
#[derive(Debug, Clone, Serialize)]
pub struct Floor {
    /// The hops the chains add up: the mean of every timing in `timed`.
    pub hops: Hops,
    pub chains: Vec<Chain>,
    /// Each timing of the hops (before sas's runs, and after them when
    /// sas ran): the machine drifts within a run.
    pub timed: Vec<Hops>,
}

impl Floor {
    /// The floor of `timed` (at least one timing): each hop's mean.
    fn of_timings(timed: Vec<Hops>) -> Self {
        let n = timed.len().max(1) as f64;
        let mean = |hop: fn(&Hops) -> f64| timed.iter().map(hop).sum::<f64>() / n;
        let hops = Hops {
            commit_ms: mean(|h| h.commit_ms),
            order_delivery_ms: mean(|h| h.order_delivery_ms),
            step_delivery_ms: mean(|h| h.step_delivery_ms),
            status_delivery_ms: mean(|h| h.status_delivery_ms),
            call_ms: mean(|h| h.call_ms),
            samples: timed.iter().map(|h| h.samples).sum(),
        };
        let chains = [("one", 1), ("three", 3)]
            .into_iter()
            .map(|(workflow, steps)| chain(&hops, workflow, steps))
            .collect();
        Self {
            hops,
            chains,
            timed,
        }
    }

    /// Times the hops once more (after sas's runs) and takes it into the
    /// means.
    pub async fn again(self, env: &Env) -> anyhow::Result<Self> {
        let mut timed = self.timed;
        timed.push(hops(env).await?);
        Ok(Self::of_timings(timed))
    }

    /// The floor of `workflow`'s chain, milliseconds.
    pub fn of(&self, workflow: &str) -> Option<f64> {
        self.chains
            .iter()
            .find(|c| c.workflow == workflow)
            .map(|c| c.ms)
    }
}

/// Samples per hop, after a few not counted (connections and plans warm).
const SAMPLES: usize = 200;
const WARM_UP: usize = 20;

/// A message the size of an order or a request (about what sas sends).
const BODY_BYTES: usize = 300;

/// Times each hop and adds up the chains of the one- and three-step
/// workflows.
pub async fn measure(env: &Env) -> anyhow::Result<Floor> {
    Ok(Floor::of_timings(vec![hops(env).await?]))
}

/// Each hop, timed once.
async fn hops(env: &Env) -> anyhow::Result<Hops> {
    let commit_ms = commits(env).await.context("timing commits")?;
    let settings = env.broker_settings(&format!("sasbench{}floor", env.run_id));
    let order_delivery_ms = deliveries(env, QueueType::Quorum, "orders").await?;
    let step_delivery_ms = deliveries(env, settings.step_queues, "steps").await?;
    let status_delivery_ms = deliveries(env, QueueType::Classic, "status").await?;
    let call_ms = calls(env).await.context("timing remote calls")?;
    Ok(Hops {
        commit_ms,
        order_delivery_ms,
        step_delivery_ms,
        status_delivery_ms,
        call_ms,
        samples: SAMPLES,
    })
}

/// The chain of an order of `steps` sequential steps.
fn chain(h: &Hops, workflow: &str, steps: usize) -> Chain {
    let commits = steps + 2;
    let n = steps as f64;
    Chain {
        workflow: workflow.into(),
        steps,
        commits,
        deliveries: 2 + 2 * steps,
        calls: steps,
        ms: commits as f64 * h.commit_ms
            + h.order_delivery_ms
            + 2.0 * n * h.step_delivery_ms
            + h.status_delivery_ms
            + n * h.call_ms,
    }
}

/// The median of `samples`, milliseconds.
fn median_ms(mut samples: Vec<Duration>) -> f64 {
    samples.sort();
    samples
        .get(samples.len() / 2)
        .map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0)
}

/// Serial commits on a database of its own, dropped after.
async fn commits(env: &Env) -> anyhow::Result<f64> {
    let name = format!("sasbench_{}_floor", env.run_id);
    let url = env.postgres.create(&name).await?;
    let timed = async {
        let mut conn = sqlx::PgConnection::connect(&url).await?;
        sqlx::raw_sql(
            "SET synchronous_commit = on; \
             CREATE TABLE hop (id bigserial PRIMARY KEY, body bytea NOT NULL)",
        )
        .execute(&mut conn)
        .await?;
        let body = vec![b'x'; BODY_BYTES];
        let mut samples = Vec::with_capacity(SAMPLES);
        for i in 0..WARM_UP + SAMPLES {
            let started = Instant::now();
            sqlx::query("INSERT INTO hop (body) VALUES ($1)")
                .bind(&body)
                .execute(&mut conn)
                .await?;
            if i >= WARM_UP {
                samples.push(started.elapsed());
            }
        }
        conn.close().await.ok();
        Ok::<_, anyhow::Error>(median_ms(samples))
    }
    .await;
    env.drop_db(&name).await;
    timed
}

/// Serial confirmed publishes to a queue of `kind`, each timed until a
/// consumer has it.
async fn deliveries(env: &Env, kind: QueueType, what: &str) -> anyhow::Result<f64> {
    let prefix = format!("sasbench{}floor", env.run_id);
    let queue = format!("{prefix}.{what}");
    let broker = Broker::connect(&env.broker_settings(&prefix), "sas-bench-floor").await?;
    let timed = async {
        broker.declare_queue(&queue, kind, None, 0).await?;
        let mut consumer = broker.consume(&queue, 1, "sas-bench-floor").await?;
        let publisher = broker.publisher().await?;
        let body = vec![b'x'; BODY_BYTES];
        let mut samples = Vec::with_capacity(SAMPLES);
        for i in 0..WARM_UP + SAMPLES {
            let started = Instant::now();
            let confirm = publisher
                .send(&Outgoing {
                    routing_key: &queue,
                    body: &body,
                    mandatory: true,
                    ..Outgoing::default()
                })
                .await?;
            let delivered =
                match tokio::time::timeout(Duration::from_secs(10), consumer.next()).await {
                    Ok(Some(Ok(d))) => d,
                    _ => anyhow::bail!("{queue}: no delivery within 10 s"),
                };
            if i >= WARM_UP {
                samples.push(started.elapsed());
            }
            confirm.wait().await?;
            delivered.ack().await?;
        }
        Ok::<_, anyhow::Error>(median_ms(samples))
    }
    .await;
    broker.delete_queues(&[queue]).await.ok();
    broker.close().await;
    timed.with_context(|| format!("timing deliveries on a {} queue", kind.as_str()))
}

/// Serial POSTs like the agent's to a remote-sim of its own.
async fn calls(env: &Env) -> anyhow::Result<f64> {
    let sim = Sim::start(env, "remote-sim-floor").await?;
    let timed = async {
        let client = crate::suite::http();
        let url = format!("{}/bench/floor", sim.url());
        let mut samples = Vec::with_capacity(SAMPLES);
        for i in 0..WARM_UP + SAMPLES {
            let started = Instant::now();
            crate::limits::call_as_the_agent(&client, &url, Uuid::new_v4()).await?;
            if i >= WARM_UP {
                samples.push(started.elapsed());
            }
        }
        Ok::<_, anyhow::Error>(median_ms(samples))
    }
    .await;
    sim.stop().await;
    timed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_adds_up_its_hops() {
        let h = Hops {
            commit_ms: 1.0,
            order_delivery_ms: 10.0,
            step_delivery_ms: 100.0,
            status_delivery_ms: 1000.0,
            call_ms: 10_000.0,
            samples: 1,
        };
        let one = chain(&h, "one", 1);
        assert_eq!((one.commits, one.deliveries, one.calls), (3, 4, 1));
        assert_eq!(one.ms, 3.0 + 10.0 + 200.0 + 1000.0 + 10_000.0);
        let three = chain(&h, "three", 3);
        assert_eq!((three.commits, three.deliveries, three.calls), (5, 8, 3));
        assert_eq!(three.ms, 5.0 + 10.0 + 600.0 + 1000.0 + 30_000.0);
    }

    #[test]
    fn two_timings_of_the_hops_give_their_means() {
        let hops = |ms: f64| Hops {
            commit_ms: ms,
            order_delivery_ms: ms,
            step_delivery_ms: ms,
            status_delivery_ms: ms,
            call_ms: ms,
            samples: 200,
        };
        let floor = Floor::of_timings(vec![hops(1.0), hops(3.0)]);
        assert_eq!(floor.hops.commit_ms, 2.0);
        assert_eq!(floor.hops.samples, 400);
        assert_eq!(floor.timed.len(), 2);
        // One step: 3 commits, 4 deliveries, 1 call, each 2 ms.
        assert_eq!(floor.of("one"), Some(16.0));
    }

    #[test]
    fn the_median_of_samples_is_their_middle_one() {
        let ms = |n: u64| Duration::from_millis(n);
        assert_eq!(median_ms(vec![ms(9), ms(1), ms(5)]), 5.0);
        assert!(median_ms(Vec::new()).is_nan());
    }
}

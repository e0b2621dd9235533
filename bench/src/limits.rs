//! The machine's limit for sas's work, measured in the same run:
//!
//! - Postgres: the statements sas issues per order, through the library
//!   itself (`Transitions::submit_many`, `claim`, `apply_replies`, each
//!   handing its messages over to be deleted as the services' relay does
//!   once the broker confirmed them), in the services' batch sizes, each
//!   kind in a loop on several concurrent tasks, with no broker and no
//!   services;
//! - RabbitMQ: confirmed publishes (as many in flight as `broker.prefetch`,
//!   128) and manual-ack consumes (32 deliveries per ack frame) of
//!   messages of the sizes sas sends, on a quorum queue (orders, step
//!   requests, replies) and a classic one (status events);
//! - the remote calls: the agent's HTTP POST to remote-sim, 64 concurrent.
//!
//! Each is measured with the machine to itself, and costed in machine time:
//! the busy CPU time of every process (the servers, the client, the
//! kernel's networking) divided by the cores, so time spent waiting (an
//! fsync, a round trip) costs nothing that other work could not use. Added
//! up they give the most orders/s any design doing sas's transactions and
//! messages could reach here.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use sas::broker::{Broker, Outgoing};
use sas::config::{DatabaseSettings, QueueType, StepSpec, WorkflowSpec};
use sas::engine::{Actor, ClaimBounds, ReplyOutcome, Submitted, Transitions};
use sas::messages::{StepOutcome, StepReply, StepRequest};
use sas::state_store::{Committed, Held, NewOrder, OutboxRow, StateStore, StoreError};
use sas::topology::QueueNames;
use sas::workflow::Workflow;
use serde::Serialize;
use serde_json::json;
use uuid::Uuid;

use crate::suite::{Env, Sim};

/// One kind of transaction, timed.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    pub name: String,
    /// Transactions run.
    pub transactions: usize,
    /// Orders they moved.
    pub orders: usize,
    pub seconds: f64,
    pub tx_per_s: f64,
}

/// Postgres doing sas's transactions for one workflow.
#[derive(Debug, Clone, Serialize)]
pub struct PgLimit {
    pub workflow: String,
    pub orders: usize,
    pub concurrency: usize,
    /// Submissions or replies per transaction.
    pub store_batch: usize,
    pub claim_batch: u32,
    pub phases: Vec<Phase>,
    /// Transactions per order (relay and claim transactions shared by their batch).
    pub tx_per_order: f64,
    /// All transactions / all time.
    pub tx_per_s: f64,
    /// Machine time per order for the transactions (busy CPU ÷ cores), ms.
    pub ms_per_order: f64,
    /// Sizes of the messages sas sent in those transactions, by kind: mean bytes.
    pub message_bytes: Vec<(String, f64)>,
}

/// Queues a RabbitMQ limit run drives at once.
pub const LANES: usize = 4;

/// RabbitMQ moving messages of one size mix through one kind of queue.
#[derive(Debug, Clone, Serialize)]
pub struct MqLimit {
    pub queue_type: String,
    pub messages: usize,
    pub mean_bytes: f64,
    pub in_flight: usize,
    pub seconds: f64,
    pub msg_per_s: f64,
    /// Messages per second of machine time (busy CPU ÷ cores).
    pub machine_msg_per_s: f64,
}

/// remote-sim answering the agent's POSTs.
#[derive(Debug, Clone, Serialize)]
pub struct HttpLimit {
    pub calls: usize,
    pub concurrency: usize,
    pub seconds: f64,
    pub calls_per_s: f64,
}

/// The limit for one workflow.
#[derive(Debug, Clone, Serialize)]
pub struct WorkflowLimit {
    pub workflow: String,
    pub steps: usize,
    pub pg: PgLimit,
    /// Messages per order: `(quorum, classic)`.
    pub messages_per_order: (usize, usize),
    pub mq_quorum: MqLimit,
    pub mq_classic: MqLimit,
    /// Machine time per order, ms: Postgres, RabbitMQ, HTTP.
    pub pg_ms: f64,
    pub mq_ms: f64,
    pub http_ms: f64,
    /// The most orders/s: 1 / (Postgres + RabbitMQ time per order).
    pub orders_per_s: f64,
    /// The same with the remote calls' time added.
    pub orders_per_s_with_http: f64,
    /// Each repetition: Postgres ms per order; RabbitMQ msgs/s (quorum, classic).
    /// The median of each is used.
    pub pg_runs_ms: Vec<f64>,
    pub mq_runs: Vec<(f64, f64)>,
    /// Share of the CPU that processes other than ours used meanwhile
    /// (the harness's own work counts as ours).
    pub other_share: f64,
}

/// Each measurement of the limit is repeated this often; the median counts.
const REPEATS: usize = 3;

/// The median element by `key`.
fn median_by<T>(mut v: Vec<T>, key: impl Fn(&T) -> f64) -> T {
    v.sort_by(|a, b| key(a).total_cmp(&key(b)));
    let mid = v.len() / 2;
    v.swap_remove(mid)
}

/// Options of the limit measurement.
#[derive(Debug, Clone)]
pub struct LimitOptions {
    pub orders: usize,
    pub messages: usize,
    pub http_calls: usize,
    pub concurrency: usize,
}

/// Measures the limit for `one` and `three`.
pub async fn measure(
    env: &Env,
    o: &LimitOptions,
) -> anyhow::Result<(Vec<WorkflowLimit>, HttpLimit)> {
    // The remote calls go to a remote-sim of their own, stopped after, as
    // every measured system's do (`Suite::sim`).
    let sim = Sim::start(env, "remote-sim-limit").await?;
    let http = http_limit(&sim, o.http_calls, 64).await;
    sim.stop().await;
    let http = http?;
    let mut out = Vec::new();
    for (workflow, steps) in [("one", 1usize), ("three", 3)] {
        let ours = [crate::procs::Group {
            name: "bench".into(),
            roots: vec![std::process::id()],
        }];
        let before = crate::procs::snapshot(&ours);
        eprintln!(
            "  limits: Postgres, {workflow} ({} orders, {REPEATS} times)",
            o.orders
        );
        let mut pgs = Vec::new();
        for _ in 0..REPEATS {
            pgs.push(pg_limit(env, workflow, steps, o.orders, o.concurrency).await?);
        }
        let pg_runs_ms: Vec<f64> = pgs.iter().map(|p| p.ms_per_order).collect();
        let pg = median_by(pgs, |p| p.ms_per_order);
        let size = |kind: &str| {
            pg.message_bytes
                .iter()
                .find(|(k, _)| k == kind)
                .map_or(300.0, |(_, b)| *b)
        };
        // Quorum queues carry the order, each step's request and its reply;
        // the classic status queue every event: received, processing, one
        // per step, processed.
        let order_bytes = size("order");
        let quorum_sizes: Vec<usize> = std::iter::once(order_bytes)
            .chain((0..steps).flat_map(|_| [size("request"), size("reply")]))
            .map(|b| b as usize)
            .collect();
        let classic_sizes: Vec<usize> = vec![size("status") as usize; steps + 3];
        eprintln!("  limits: RabbitMQ, {workflow} message sizes ({REPEATS} times)");
        let mut quorum = Vec::new();
        let mut classic = Vec::new();
        for _ in 0..REPEATS {
            for (kind, sizes, runs) in [
                (QueueType::Quorum, &quorum_sizes, &mut quorum),
                (QueueType::Classic, &classic_sizes, &mut classic),
            ] {
                runs.push(mq_limit(env, kind, sizes, o.messages).await?);
            }
        }
        let mq_runs: Vec<(f64, f64)> = quorum
            .iter()
            .zip(&classic)
            .map(|(q, c)| (q.machine_msg_per_s, c.machine_msg_per_s))
            .collect();
        let mq_quorum = median_by(quorum, |m| m.machine_msg_per_s);
        let mq_classic = median_by(classic, |m| m.machine_msg_per_s);
        let other_share = crate::procs::snapshot(&ours).since(&before).other_share();
        let messages_per_order = (quorum_sizes.len(), classic_sizes.len());
        let pg_ms = pg.ms_per_order;
        let mq_ms = 1000.0
            * (messages_per_order.0 as f64 / mq_quorum.machine_msg_per_s
                + messages_per_order.1 as f64 / mq_classic.machine_msg_per_s);
        let http_ms = 1000.0 * steps as f64 / http.calls_per_s;
        out.push(WorkflowLimit {
            workflow: workflow.into(),
            steps,
            pg,
            messages_per_order,
            mq_quorum,
            mq_classic,
            pg_ms,
            mq_ms,
            http_ms,
            orders_per_s: 1000.0 / (pg_ms + mq_ms),
            orders_per_s_with_http: 1000.0 / (pg_ms + mq_ms + http_ms),
            pg_runs_ms,
            mq_runs,
            other_share,
        });
    }
    Ok((out, http))
}

fn workflow(name: &str, steps: usize) -> anyhow::Result<Workflow> {
    let spec = WorkflowSpec {
        steps: ["a", "b", "c"]
            .iter()
            .take(steps)
            .enumerate()
            .map(|(i, s)| StepSpec {
                name: (*s).into(),
                agent: Some((*s).into()),
                wait: None,
                until: None,
                signal: None,
                workflow: None,
                for_each: None,
                max_concurrency: None,
                timeout: Duration::from_secs(5),
                compensate: (steps > 1 && i + 1 < steps).then(|| format!("{s}-undo")),
                retry: None,
                after: None,
                max_duration: Duration::from_secs(3600),
                when: None,
                input: None,
            })
            .collect(),
        ..WorkflowSpec::default()
    };
    Ok(Workflow::compile(name, &spec)?)
}

/// Runs `f` over `items` on `concurrency` tasks; returns the seconds taken.
async fn on_tasks<T, F, Fut>(items: Vec<T>, concurrency: usize, f: F) -> anyhow::Result<f64>
where
    T: Send + Sync + 'static,
    F: Fn(usize, &T) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send,
{
    let items = Arc::new(items);
    let next = Arc::new(AtomicUsize::new(0));
    let f = Arc::new(f);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..concurrency {
        let (items, next, f) = (items.clone(), next.clone(), f.clone());
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else {
                    return Ok::<(), anyhow::Error>(());
                };
                f(worker, item).await?;
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// Postgres running sas's transactions for `orders` orders of a workflow.
async fn pg_limit(
    env: &Env,
    name: &str,
    steps: usize,
    orders: usize,
    concurrency: usize,
) -> anyhow::Result<PgLimit> {
    const CLAIMERS: usize = 4;
    // What the services' batches hold at full load: their largest.
    let store_batch = DatabaseSettings::default().batch_size;
    let claim_batch = sas::config::SchedulerSettings::default().claim_batch;
    let db_name = format!("sasbench_{}_limits", env.run_id);
    let db_url = env.postgres.create(&db_name).await?;
    let result = async {
        let store = StateStore::connect(
            &DatabaseSettings {
                url: db_url,
                max_connections: concurrency as u32,
                ..Default::default()
            },
            "sas-bench-limits",
        )
        .await?;
        let prefix = format!("sasbench{}limits", env.run_id);
        let outlet = Arc::new(Outlet::default());
        // As the services at full load, where batches fill up: the limit
        // costs the statements of the hand-over, one delete per transition.
        let transitions = Arc::new(Handing {
            t: Transitions::with_outlet(store.clone(), QueueNames::new(&prefix), outlet.clone()),
        });
        let wf = Arc::new(workflow(name, steps)?);
        let status = format!("{prefix}-app.status");
        let new_orders = sas_testkit::fixtures::new_orders(name, orders, &status);
        let ids: Vec<Uuid> = new_orders.iter().map(|o| o.order_id).collect();
        let order_body = format!(
            r#"{{"order_id":"{}","workflow":"{name}","payload":{{}}}}"#,
            ids[0]
        );
        let actors: Arc<Vec<Actor>> = Arc::new(
            (0..concurrency)
                .map(|_| Actor::new_instance("scheduler"))
                .collect(),
        );
        // Requests handed over, to answer in the next round; sizes by kind.
        let requests = outlet.requests.clone();
        let sizes = outlet.sizes.clone();
        sizes
            .lock()
            .unwrap()
            .push(("order".into(), order_body.len()));
        let mut phases = Vec::new();
        // Machine time of the timed phases.
        let mut machine_s = 0.0;

        let t = transitions.clone();
        let w = wf.clone();
        // In batches, as the submission stores what arrives together.
        let chunks: Vec<Vec<NewOrder>> = new_orders
            .chunks(store_batch)
            .map(<[NewOrder]>::to_vec)
            .collect();
        let n = chunks.len();
        let started = Instant::now();
        let cpu = crate::procs::snapshot(&[]);
        on_tasks(chunks, concurrency, move |_, chunk| {
            let (t, w) = (t.clone(), w.clone());
            let chunk = chunk.clone();
            async move {
                let batch: Vec<(&NewOrder, &Workflow)> = chunk.iter().map(|o| (o, &*w)).collect();
                t.submit_many(&batch).await?;
                Ok(())
            }
        })
        .await?;
        let released = outlet.settle().await;
        let secs = started.elapsed().as_secs_f64();
        machine_s += machine_since(&cpu);
        phases.push(phase("submit (+ delete)", n + released, orders, secs));
        vacuum(&store).await?;

        // Claim until every order is claimed; a claim may come back empty under concurrency.
        let claimed = Arc::new(AtomicUsize::new(0));
        let claims = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let cpu = crate::procs::snapshot(&[]);
        let mut tasks = tokio::task::JoinSet::new();
        // A few claimers, as a few schedulers would; more only skip each other's rows.
        for worker in 0..concurrency.min(CLAIMERS) {
            let (t, actors, claimed, claims) = (
                transitions.clone(),
                actors.clone(),
                claimed.clone(),
                claims.clone(),
            );
            tasks.spawn(async move {
                let mut empty = 0;
                while claimed.load(Ordering::Relaxed) < orders && empty < 200 {
                    let got = t.claim(&actors[worker], claim_batch, u32::MAX).await?;
                    claims.fetch_add(1, Ordering::Relaxed);
                    if got.is_empty() {
                        empty += 1;
                        tokio::task::yield_now().await;
                    } else {
                        claimed.fetch_add(got.len(), Ordering::Relaxed);
                    }
                }
                Ok::<(), anyhow::Error>(())
            });
        }
        while let Some(r) = tasks.join_next().await {
            r??;
        }
        let released = outlet.settle().await;
        machine_s += machine_since(&cpu);
        phases.push(phase(
            "claim (+ delete)",
            claims.load(Ordering::Relaxed) + released,
            claimed.load(Ordering::Relaxed),
            started.elapsed().as_secs_f64(),
        ));
        vacuum(&store).await?;

        for s in 0..steps {
            let batch: Vec<StepRequest> = std::mem::take(&mut *requests.lock().unwrap());
            anyhow::ensure!(
                batch.len() == orders,
                "step {s}: {} requests for {orders} orders",
                batch.len()
            );
            let (t, actors) = (transitions.clone(), actors.clone());
            let replies: Vec<StepReply> = batch
                .iter()
                .map(|r| {
                    let result = json!({
                        "ok": true,
                        "endpoint": format!("/bench/{}", r.step),
                        "idempotency_key": r.idempotency_key(),
                        "effect_id": Uuid::new_v4(),
                        "order_id": r.order_id,
                        "step": r.step,
                    });
                    StepReply::to(r, StepOutcome::Succeeded { result })
                })
                .collect();
            for reply in replies.iter().take(1) {
                sizes.lock().unwrap().push((
                    "reply".into(),
                    serde_json::to_vec(reply).unwrap_or_default().len(),
                ));
            }
            // In batches, as a scheduler applies what arrives together.
            let chunks: Vec<Vec<StepReply>> = replies
                .chunks(store_batch)
                .map(<[StepReply]>::to_vec)
                .collect();
            let n = chunks.len();
            let started = Instant::now();
            let cpu = crate::procs::snapshot(&[]);
            on_tasks(chunks, concurrency, move |worker, chunk| {
                let (t, actors) = (t.clone(), actors.clone());
                let chunk = chunk.clone();
                async move {
                    t.apply_replies(&actors[worker], &chunk).await?;
                    Ok(())
                }
            })
            .await?;
            let released = outlet.settle().await;
            let secs = started.elapsed().as_secs_f64();
            machine_s += machine_since(&cpu);
            phases.push(phase(
                &format!("apply replies {} (+ delete)", s + 1),
                n + released,
                orders,
                secs,
            ));
            vacuum(&store).await?;
        }
        let unfinished: i64 =
            sqlx::query_scalar("SELECT count(*) FROM orders WHERE process_state <> 'processed'")
                .fetch_one(store.pool())
                .await?;
        anyhow::ensure!(
            unfinished == 0,
            "{unfinished} orders not processed in the limit run"
        );
        store.close().await;

        let total_tx: usize = phases.iter().map(|p| p.transactions).sum();
        let total_s: f64 = phases.iter().map(|p| p.seconds).sum();
        let sizes = sizes.lock().unwrap().clone();
        let mut by_kind: std::collections::BTreeMap<String, (f64, usize)> = Default::default();
        for (k, b) in sizes {
            let e = by_kind.entry(k).or_default();
            e.0 += b as f64;
            e.1 += 1;
        }
        Ok(PgLimit {
            workflow: name.into(),
            orders,
            concurrency,
            store_batch,
            claim_batch,
            phases,
            tx_per_order: total_tx as f64 / orders as f64,
            tx_per_s: total_tx as f64 / total_s,
            ms_per_order: machine_s * 1000.0 / orders as f64,
            message_bytes: by_kind
                .into_iter()
                .map(|(k, (sum, n))| (k, sum / n as f64))
                .collect(),
        })
    }
    .await;
    env.drop_db(&db_name).await;
    result
}

/// Machine time since `before`: busy CPU seconds of the whole machine over the cores.
fn machine_since(before: &crate::procs::CpuSnapshot) -> f64 {
    let used = crate::procs::snapshot(&[]).since(before);
    used.machine_busy_share * used.wall_s
}

/// Takes the messages the transitions hand over, as the services' relay
/// does, but instead of publishing them (the broker is measured on its
/// own) notes the requests and sizes, then deletes them at once.
#[derive(Debug, Default)]
struct Outlet {
    requests: Arc<Mutex<Vec<StepRequest>>>,
    sizes: Arc<Mutex<Vec<(String, usize)>>>,
    releases: tokio_util::task::TaskTracker,
    released: Arc<AtomicUsize>,
}

/// Transitions whose committed messages go to the outlet (the engine's
/// port), as the services' go to their relay.
struct Handing {
    t: Transitions,
}

impl Handing {
    async fn submit_many(
        &self,
        batch: &[(&NewOrder, &Workflow)],
    ) -> Result<Vec<Submitted>, StoreError> {
        self.t.submit_many(batch).await
    }

    async fn claim(&self, me: &Actor, limit: u32, max: u32) -> Result<Vec<Uuid>, StoreError> {
        let bounds = ClaimBounds::orders(limit, max);
        Ok(self.t.claim(me, bounds).await?.ids)
    }

    async fn apply_replies(
        &self,
        me: &Actor,
        replies: &[StepReply],
    ) -> Result<Vec<ReplyOutcome>, StoreError> {
        self.t.apply_replies(me, replies).await
    }
}

impl sas::engine::Outlet for Outlet {
    /// Always: the limit measures transitions that hand over.
    fn ready(&self) -> bool {
        true
    }

    /// Takes what a transition committed: the messages handed over.
    fn hand_over(&self, committed: Committed) {
        if let Some(held) = committed.held {
            self.publish(held, committed.publish);
        }
    }
}

impl Outlet {
    fn publish(&self, held: Held, rows: Vec<OutboxRow>) {
        let mut ids = Vec::with_capacity(rows.len());
        for row in rows {
            self.sizes
                .lock()
                .unwrap()
                .push((row.kind.clone(), row.body.len()));
            if row.kind == "request"
                && let Ok(r) = serde_json::from_slice(&row.body)
            {
                self.requests.lock().unwrap().push(r);
            }
            ids.push(row.id);
        }
        let released = self.released.clone();
        self.releases.spawn(async move {
            if held.release(&ids).await.is_ok() {
                released.fetch_add(1, Ordering::Relaxed);
            }
        });
    }

    /// Waits for the deletes under way; how many statements ran since last time.
    async fn settle(&self) -> usize {
        self.releases.close();
        self.releases.wait().await;
        self.releases.reopen();
        self.released.swap(0, Ordering::Relaxed)
    }
}

/// Between phases, untimed: what autovacuum would do, so every phase runs
/// with fresh planner statistics (and re-planned prepared statements) and
/// without the previous phase's dead rows.
async fn vacuum(store: &StateStore) -> anyhow::Result<()> {
    sqlx::raw_sql("VACUUM (ANALYZE) orders, steps, outbox, order_events")
        .execute(store.pool())
        .await?;
    Ok(())
}

fn phase(name: &str, transactions: usize, orders: usize, seconds: f64) -> Phase {
    Phase {
        name: name.into(),
        transactions,
        orders,
        seconds,
        tx_per_s: transactions as f64 / seconds.max(1e-9),
    }
}

/// Deliveries the limit's consumers acknowledge with one `multiple` ack.
const ACKS_PER_FRAME: usize = 32;

/// RabbitMQ moving `messages` messages of the given sizes through queues of
/// one type: published with confirms, as many in flight as the services
/// allow, and consumed with manual acks, [`ACKS_PER_FRAME`] per frame (sas
/// too acknowledges deliveries finished together with one frame), on
/// [`LANES`] queues at once (sas
/// too runs several flows at once: orders, requests, replies, events), each
/// with its own publisher and consumer channel.
async fn mq_limit(
    env: &Env,
    queue_type: QueueType,
    sizes: &[usize],
    messages: usize,
) -> anyhow::Result<MqLimit> {
    // As many unconfirmed publishes and unacknowledged deliveries as the
    // services allow themselves (`broker.prefetch`).
    let in_flight = usize::from(sas::config::BrokerSettings::default().prefetch);
    let prefix = format!("sasbench{}limits", env.run_id);
    let queues: Vec<String> = (0..LANES)
        .map(|lane| format!("{prefix}.mq.{}.{lane}", queue_type.as_str()))
        .collect();
    let publisher_conn = Broker::connect(&env.broker_settings(&prefix), "sas-bench-mq-pub").await?;
    let consumer_conn = Broker::connect(&env.broker_settings(&prefix), "sas-bench-mq-sub").await?;
    let result = async {
        let bodies: Arc<Vec<Vec<u8>>> = Arc::new(sizes.iter().map(|s| body_of(*s)).collect());
        let mean_bytes = (0..messages)
            .map(|i| bodies[i % bodies.len()].len() as f64)
            .sum::<f64>()
            / messages as f64;
        let per_lane = messages.div_ceil(LANES);
        let mut lanes = Vec::new();
        for queue in &queues {
            // No dead-letter route, so no delivery limit either: a bare queue.
            publisher_conn
                .declare_queue(queue, queue_type, None, 0)
                .await
                .with_context(|| format!("declaring {queue}"))?;
            // Its own channel, `in_flight` deliveries unacknowledged at most.
            let consumer = consumer_conn
                .consume(queue, in_flight as u16, "sas-bench-mq")
                .await?;
            lanes.push((queue.clone(), publisher_conn.publisher().await?, consumer));
        }
        let started = Instant::now();
        let cpu = crate::procs::snapshot(&[]);
        let mut tasks = tokio::task::JoinSet::new();
        for (queue, publisher, mut consumer) in lanes {
            tasks.spawn(async move {
                let mut got = 0;
                while got < per_lane {
                    match tokio::time::timeout(Duration::from_secs(30), consumer.next()).await {
                        Ok(Some(Ok(d))) => {
                            got += 1;
                            // Several deliveries per ack frame, as sas acknowledges.
                            if got % ACKS_PER_FRAME == 0 || got == per_lane {
                                d.ack_up_to().await?;
                            }
                        }
                        _ => anyhow::bail!("consumer stopped after {got} of {per_lane} messages"),
                    }
                }
                Ok(())
            });
            let bodies = bodies.clone();
            tasks.spawn(async move {
                let mut pending = std::collections::VecDeque::with_capacity(in_flight);
                for i in 0..per_lane {
                    if pending.len() >= in_flight {
                        let p: sas::broker::PendingConfirm = pending.pop_front().expect("pending");
                        p.wait().await?;
                    }
                    let p = publisher
                        .send(&Outgoing {
                            routing_key: &queue,
                            body: &bodies[i % bodies.len()],
                            mandatory: true,
                            ..Outgoing::default()
                        })
                        .await?;
                    pending.push_back(p);
                }
                for p in pending {
                    p.wait().await?;
                }
                Ok(())
            });
        }
        while let Some(done) = tasks.join_next().await {
            done??;
        }
        let machine_s = machine_since(&cpu);
        let seconds = started.elapsed().as_secs_f64();
        let moved = per_lane * LANES;
        Ok::<MqLimit, anyhow::Error>(MqLimit {
            queue_type: queue_type.as_str().into(),
            messages: moved,
            mean_bytes,
            in_flight,
            seconds,
            msg_per_s: moved as f64 / seconds,
            machine_msg_per_s: moved as f64 / machine_s.max(1e-9),
        })
    }
    .await;
    consumer_conn.close().await;
    publisher_conn.delete_queues(&queues).await.ok();
    publisher_conn.close().await;
    result
}

/// A JSON body of `size` bytes.
fn body_of(size: usize) -> Vec<u8> {
    let head = br#"{"pad":""#;
    let tail = br#""}"#;
    let fill = size.saturating_sub(head.len() + tail.len());
    let mut b = Vec::with_capacity(size);
    b.extend_from_slice(head);
    b.extend(std::iter::repeat_n(b'x', fill));
    b.extend_from_slice(tail);
    b
}

/// remote-sim answering `calls` POSTs like the agent's, `concurrency` at a time.
async fn http_limit(sim: &Sim, calls: usize, concurrency: usize) -> anyhow::Result<HttpLimit> {
    sas::tls::install_crypto_provider();
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(2))
        .build()?;
    let url = format!("{}/bench/limit", sim.url());
    let items: Vec<Uuid> = (0..calls).map(|_| Uuid::new_v4()).collect();
    let seconds = on_tasks(items, concurrency, move |_, id| {
        let (client, url) = (client.clone(), url.clone());
        let id = *id;
        async move { call_as_the_agent(&client, &url, id).await }
    })
    .await?;
    sim.reset().await;
    Ok(HttpLimit {
        calls,
        concurrency,
        seconds,
        calls_per_s: calls as f64 / seconds,
    })
}

/// One POST to remote-sim at `url`, as the agent makes it for step `a` of
/// order `id`, answered in full.
pub async fn call_as_the_agent(
    client: &reqwest::Client,
    url: &str,
    id: Uuid,
) -> anyhow::Result<()> {
    let body = json!({
        "order_id": id, "step": "a", "attempt": 1, "payload": {}, "results": {}
    });
    let r = client
        .post(url)
        .header("Idempotency-Key", format!("{id}:a"))
        .json(&body)
        .send()
        .await?;
    anyhow::ensure!(
        r.status().is_success(),
        "remote-sim answered {}",
        r.status()
    );
    r.bytes().await?;
    Ok(())
}

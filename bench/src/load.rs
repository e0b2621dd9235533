//! One load run against a deployment: publish orders (as fast as the broker
//! confirms them, or paced at a fixed rate), read the status events from the
//! application's queue, and measure throughput (first submit → last terminal
//! event received), latency (submit → `processed` received) and where the
//! time went between the events.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use sas::broker::{Outgoing, PendingConfirm};
use sas::messages::Events;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::procs::{self, CpuUse};
use crate::suite::{PgCounters, Suite};

/// What to run.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// `one`, `three`, `diamond` or `fanout` (see [`sas_testkit::config`]).
    pub workflow: &'static str,
    /// Its steps (the diamond's four, though its longest path is three;
    /// the fan-out's eleven calls, two deep).
    pub steps: usize,
    /// Which status events the orders ask for (contract §2a).
    pub events: Events,
    pub orders: usize,
    /// Orders per second; `None` is full load (as fast as confirms come back).
    pub rate: Option<f64>,
    /// Give up waiting for terminal events after this long.
    pub timeout: Duration,
    /// SIGKILL this process once this many orders have been submitted.
    pub kill: Option<(String, usize)>,
    /// How the orders come in.
    pub via: Via,
}

/// How the bench submits its orders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Via {
    /// Published to `<prefix>.orders`, a window of confirms outstanding.
    #[default]
    Queue,
    /// `POST /v1/orders` to the submission (contract §9a), [`HTTP_IN_FLIGHT`]
    /// requests at once; a `202` is the confirm.
    Http,
}

/// Requests in flight when submitting over HTTP: about the queue's window
/// of outstanding confirms, so both ways in are asked for the same.
const HTTP_IN_FLIGHT: usize = 64;

impl LoadSpec {
    /// Whether to sample Postgres activity: at full load, where it tells where the time goes.
    fn profile(&self) -> bool {
        self.rate.is_none()
    }
}

/// Percentiles in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    pub mean: f64,
}

impl Percentiles {
    /// From samples in milliseconds.
    pub fn of(mut v: Vec<f64>) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
            v[i]
        };
        Self {
            p50: at(0.50),
            p99: at(0.99),
            p999: at(0.999),
            max: v[v.len() - 1],
            mean: v.iter().sum::<f64>() / v.len() as f64,
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct LoadResult {
    pub workflow: String,
    /// The orders' `events`: `all` or `terminal` (contract §2a).
    pub status_events: &'static str,
    pub orders: usize,
    /// The asked rate (orders/s), or null for full load.
    pub offered_rate: Option<f64>,
    /// Orders ended `processed`.
    pub processed: usize,
    /// Orders ended otherwise (`compensated`, `failed`, `rejected`).
    pub other_terminal: usize,
    /// Orders with no terminal event before the timeout.
    pub missing: usize,
    /// First submit → last terminal event received, seconds.
    pub elapsed_s: f64,
    /// Time to publish every order (confirmed), seconds.
    pub submit_s: f64,
    pub throughput: f64,
    /// Submit → `processed` received.
    pub latency_ms: Percentiles,
    /// Median milliseconds between consecutive events, from each event's
    /// `at` (Postgres `now()`, the start of the transition's transaction):
    /// `submit→received` (queue + submission), `received→processing` (claim),
    /// `processing→step a` … (dispatch, relay, agent, HTTP call, reply, apply),
    /// `processed→delivered` (commit, relay, broker, our consumer).
    pub stages_ms: Vec<(String, Percentiles)>,
    /// The remote calls of one processed order (a fan-out's items each).
    pub calls_per_order: usize,
    /// CPU used during the run, per process group.
    pub cpu: CpuUse,
    /// CPU milliseconds per order, per process group.
    pub cpu_ms_per_order: std::collections::BTreeMap<String, f64>,
    /// Status events received, and duplicates among them.
    pub events: usize,
    /// Distinct status events by `state` (e.g. how many `retry_scheduled`).
    pub event_states: std::collections::BTreeMap<String, usize>,
    pub duplicate_events: usize,
    /// With a kill: seconds from the kill until every order submitted before
    /// it was terminal, and until every order was.
    pub recovery: Option<Recovery>,
    /// Postgres work per order: commits, rows written, WAL bytes (full-load runs only; see [`PgCounters`]).
    pub pg_per_order: Option<PgCounters>,
    /// What the deployment's Postgres backends were doing, sampled.
    pub pg_profile: crate::pgsample::Profile,
    /// Effects remote-sim applied in this run (one per step per order, if
    /// idempotency held and nothing was lost).
    pub remote_applied: Option<u64>,
    /// Outbox messages per order by the path that published them
    /// (`handoff`, `follow`, `relay`), and the agents' messages of replies
    /// (`agent replies`); see [`Suite::published`].
    pub outbox_paths: std::collections::BTreeMap<String, f64>,
    /// Each order's publish and receipt times, for [`crate::hops`].
    #[serde(skip)]
    pub timeline: Vec<Timeline>,
}

/// One order's times in a run, µs since the Unix epoch.
#[derive(Debug, Clone)]
pub struct Timeline {
    pub order_id: Uuid,
    pub submitted_us: f64,
    /// When its `processed` event came, if it did.
    pub delivered_us: Option<f64>,
}

impl LoadResult {
    /// The outbox messages per order by path, as `follow 0.12, handoff 1.88`.
    pub fn outbox_paths_text(&self) -> String {
        let paths: Vec<String> = self
            .outbox_paths
            .iter()
            .map(|(path, n)| format!("{path} {n:.2}"))
            .collect();
        paths.join(", ")
    }
}

/// The recovery after a kill.
#[derive(Debug, Clone, Serialize)]
pub struct Recovery {
    pub killed: String,
    /// Orders submitted before the kill.
    pub before_kill: usize,
    /// Kill → every order submitted before it terminal, seconds.
    pub in_flight_recovered_s: f64,
    /// Kill → every order terminal, seconds.
    pub all_terminal_s: f64,
    /// The longest latency of an order submitted before the kill, ms.
    pub worst_latency_ms: f64,
}

#[derive(Deserialize)]
struct Event<'a> {
    #[serde(borrow)]
    order_id: Option<&'a str>,
    seq: i64,
    state: &'a str,
    step: Option<&'a str>,
    at: Option<&'a str>,
}

/// One order's events as received.
#[derive(Default, Clone)]
struct Seen {
    /// `(seq, state, step, at as µs since the run's wall-clock start)`.
    events: Vec<(i64, String, Option<String>, f64)>,
    /// When the terminal event arrived (µs since start) and its state.
    terminal: Option<(f64, String)>,
}

/// Runs one load against `suite`.
pub async fn run(suite: &mut Suite, spec: &LoadSpec) -> anyhow::Result<LoadResult> {
    let n = spec.orders;
    let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    let index: Arc<HashMap<Uuid, usize>> =
        Arc::new(ids.iter().enumerate().map(|(i, id)| (*id, i)).collect());
    let submitted: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());

    suite.sim.reset().await;
    let mut groups = suite.groups();
    if let Some(pid) = suite.sim.pid() {
        groups.push(procs::Group {
            name: "remote-sim".into(),
            roots: vec![pid],
        });
    }
    groups.push(procs::Group {
        name: "bench".into(),
        roots: vec![std::process::id()],
    });
    let published_before = suite.published().await;
    let cpu_before = procs::snapshot(&groups);
    let pg_before = suite.pg_counters().await;
    let sampler = spec
        .profile()
        .then(|| crate::pgsample::start(suite.db.clone(), Duration::from_millis(20)));

    // The collector: its own connection and consumer on the status queue.
    // Not `sas_client::Client::status`: the bench counts the duplicates that
    // the client's stream drops, and acks 200 events in one frame where the
    // client acks each after it is yielded; both would change what is
    // measured (duplicate_events, and the broker's work per order).
    let consumer_broker = sas::broker::Broker::connect(
        &suite.env.broker_settings(&suite.prefix),
        "sas-bench-collector",
    )
    .await?;
    let mut consumer = consumer_broker
        .consume(&suite.status_queue, 2000, "sas-bench")
        .await?;
    let start = Instant::now();
    let wall_start = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs_f64() * 1e6;
    let us = move || start.elapsed().as_secs_f64() * 1e6;
    let deadline = start + spec.timeout;

    let collector = {
        let index = index.clone();
        tokio::spawn(async move {
            let mut seen: Vec<Seen> = vec![Seen::default(); n];
            let mut terminal = 0usize;
            let mut events = 0usize;
            let mut dupes = 0usize;
            let mut states: std::collections::BTreeMap<String, usize> = Default::default();
            let mut unacked = 0usize;
            let mut last = None;
            while terminal < n {
                let next = tokio::time::timeout_at(deadline.into(), consumer.next()).await;
                let delivery = match next {
                    Ok(Some(Ok(d))) => d,
                    Ok(Some(Err(e))) => {
                        eprintln!("status consumer failed: {e}");
                        break;
                    }
                    Ok(None) | Err(_) => break,
                };
                let now = us();
                events += 1;
                if let Ok(e) = serde_json::from_slice::<Event>(delivery.body())
                    && let Some(i) = e
                        .order_id
                        .and_then(|s| Uuid::parse_str(s).ok())
                        .and_then(|id| index.get(&id).copied())
                {
                    let s = &mut seen[i];
                    if s.events.iter().any(|(seq, ..)| *seq == e.seq) {
                        dupes += 1;
                    } else {
                        *states.entry(e.state.to_owned()).or_insert(0) += 1;
                        let at =
                            e.at.and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
                                .map_or(f64::NAN, |t| t.timestamp_micros() as f64 - wall_start);
                        s.events
                            .push((e.seq, e.state.to_owned(), e.step.map(str::to_owned), at));
                        let is_terminal =
                            matches!(e.state, "processed" | "compensated" | "failed" | "rejected");
                        if is_terminal && s.terminal.is_none() {
                            s.terminal = Some((now, e.state.to_owned()));
                            terminal += 1;
                        }
                    }
                }
                unacked += 1;
                if unacked >= 200 {
                    delivery.ack_up_to().await.ok();
                    unacked = 0;
                    last = None;
                } else {
                    last = Some(delivery);
                }
            }
            if let Some(delivery) = last {
                delivery.ack_up_to().await.ok();
            }
            (seen, events, dupes, states)
        })
    };

    // The confirm waiter: a window of outstanding publishes. The orders are
    // published here rather than through `sas_client::Client::send`, which
    // would build each body as a JSON value and decode it again to validate
    // it: CPU in the bench's own process, which the report counts.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<PendingConfirm>(256);
    let confirms = tokio::spawn(async move {
        let mut failed = 0usize;
        while let Some(p) = rx.recv().await {
            if p.wait().await.is_err() {
                failed += 1;
            }
        }
        (failed, Instant::now())
    });

    // Over HTTP: one keep-alive client, a bounded number of requests at once.
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(HTTP_IN_FLIGHT)
        .build()
        .context("an HTTP client")?;
    let orders_url = match spec.via {
        Via::Http => format!("http://127.0.0.1:{}/v1/orders", suite.port("submission")?),
        Via::Queue => String::new(),
    };
    let http_slots = Arc::new(tokio::sync::Semaphore::new(HTTP_IN_FLIGHT));
    let http_done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut http_posts = tokio::task::JoinSet::new();

    let events = match spec.events {
        Events::All => String::new(),
        other => format!(r#","events":"{}""#, other.as_str()),
    };
    let mut kill_at: Option<f64> = None;
    for (i, id) in ids.iter().enumerate() {
        if let Some(rate) = spec.rate {
            let due = start + Duration::from_secs_f64(i as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
        if let Some((name, after)) = &spec.kill
            && i == *after
            && kill_at.is_none()
        {
            suite.kill(name).await;
            kill_at = Some(us());
        }
        let body = format!(
            r#"{{"order_id":"{id}","workflow":"{}","payload":{{}}{events}}}"#,
            spec.workflow
        );
        submitted[i].store(us().max(1.0) as u64, Ordering::Relaxed);
        match spec.via {
            Via::Queue => {
                let pending = suite
                    .publisher
                    .send(&Outgoing {
                        routing_key: suite.queues.orders(),
                        body: body.as_bytes(),
                        reply_to: Some(&suite.status_queue),
                        mandatory: true,
                        ..Outgoing::default()
                    })
                    .await
                    .context("publishing an order")?;
                tx.send(pending).await.ok();
            }
            Via::Http => {
                // The reply queue goes in the body: HTTP has no AMQP property.
                let body = format!(
                    r#"{},"reply_to":"{}"}}"#,
                    &body[..body.len() - 1],
                    suite.status_queue
                );
                let slot = http_slots
                    .clone()
                    .acquire_owned()
                    .await
                    .context("the HTTP submitters' semaphore")?;
                let (client, url, done) = (http.clone(), orders_url.clone(), http_done.clone());
                http_posts.spawn(async move {
                    let answer = client
                        .post(url)
                        .header("content-type", "application/json")
                        .body(body)
                        .send()
                        .await;
                    let ok = answer.is_ok_and(|r| r.status().as_u16() == 202);
                    drop(slot);
                    if !ok {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        }
    }
    drop(tx);
    while http_posts.join_next().await.is_some() {}
    let (failed_publishes, confirmed_at) = confirms.await?;
    let failed_publishes = failed_publishes + http_done.load(Ordering::Relaxed);
    if failed_publishes > 0 {
        eprintln!("warning: {failed_publishes} orders were not confirmed by the broker");
    }
    let submit_s = confirmed_at.duration_since(start).as_secs_f64();
    // Memory while the services are still warm.
    suite.sample_memory();
    let (seen, events, duplicate_events, event_states) = collector.await?;
    let cpu_after = procs::snapshot(&groups);
    let published_after = suite.published().await;
    let pg_profile = match sampler {
        Some(s) => s.finish(12).await,
        None => Default::default(),
    };
    // Other backends report their statistics up to ~10 s after they go idle
    // (PGSTAT_IDLE_INTERVAL): wait for that before reading the counters, at
    // full load, where they say what an order costs.
    let pg_after = if spec.profile() {
        tokio::time::sleep(Duration::from_secs(11)).await;
        suite.pg_counters().await
    } else {
        None
    };
    consumer_broker.close().await;
    let cpu = cpu_after.since(&cpu_before);

    let sub = |i: usize| submitted[i].load(Ordering::Relaxed) as f64;
    let first = (0..n).map(sub).fold(f64::INFINITY, f64::min);
    let mut last_terminal: f64 = 0.0;
    let mut processed = 0;
    let mut other_terminal = 0;
    let mut latencies = Vec::with_capacity(n);
    for (i, s) in seen.iter().enumerate() {
        if let Some((t, state)) = &s.terminal {
            last_terminal = last_terminal.max(*t);
            if state == "processed" {
                processed += 1;
                latencies.push((t - sub(i)) / 1000.0);
            } else {
                other_terminal += 1;
            }
        }
    }
    let missing = n - processed - other_terminal;
    let elapsed_s = ((last_terminal - first) / 1e6).max(1e-9);
    let recovery = kill_at.map(|k| {
        let before: Vec<usize> = (0..n).filter(|i| sub(*i) < k && sub(*i) > 0.0).collect();
        let end_of = |i: usize| seen[i].terminal.as_ref().map_or(f64::NAN, |(t, _)| *t);
        let in_flight = before
            .iter()
            .map(|i| end_of(*i))
            .fold(k, |a, b| if b.is_nan() { f64::INFINITY } else { a.max(b) });
        let worst = before
            .iter()
            .map(|i| end_of(*i) - sub(*i))
            .fold(0.0, f64::max);
        Recovery {
            killed: spec
                .kill
                .as_ref()
                .map(|(n, _)| n.clone())
                .unwrap_or_default(),
            before_kill: before.len(),
            in_flight_recovered_s: (in_flight - k) / 1e6,
            all_terminal_s: if missing > 0 {
                f64::INFINITY
            } else {
                (last_terminal - k) / 1e6
            },
            worst_latency_ms: worst / 1000.0,
        }
    });
    let stages_ms = stages(&seen, &sub, spec.steps);
    let timeline = ids
        .iter()
        .zip(&seen)
        .enumerate()
        .map(|(i, (id, s))| Timeline {
            order_id: *id,
            submitted_us: wall_start + sub(i),
            delivered_us: s
                .terminal
                .as_ref()
                .filter(|(_, state)| state == "processed")
                .map(|(t, _)| wall_start + t),
        })
        .collect();
    let orders_done = processed + other_terminal;
    let cpu_ms_per_order = cpu.per_order_ms(orders_done);
    let outbox_paths = published_after
        .into_iter()
        .map(|(path, n)| {
            let before = published_before.get(&path).copied().unwrap_or(0.0);
            (path, (n - before) / orders_done.max(1) as f64)
        })
        .collect();
    Ok(LoadResult {
        workflow: spec.workflow.to_owned(),
        status_events: spec.events.as_str(),
        orders: n,
        offered_rate: spec.rate,
        processed,
        other_terminal,
        missing,
        elapsed_s,
        submit_s,
        throughput: orders_done as f64 / elapsed_s,
        latency_ms: Percentiles::of(latencies),
        stages_ms,
        calls_per_order: spec.steps,
        cpu,
        cpu_ms_per_order,
        events,
        event_states,
        duplicate_events,
        recovery,
        pg_per_order: pg_before
            .zip(pg_after)
            .map(|(b, a)| a.per_order(&b, orders_done)),
        pg_profile,
        remote_applied: suite.sim.applied().await,
        outbox_paths,
        timeline,
    })
}

/// The time between consecutive events of processed orders, per stage.
fn stages(seen: &[Seen], sub: &dyn Fn(usize) -> f64, steps: usize) -> Vec<(String, Percentiles)> {
    let mut names: Vec<String> = vec!["submit→received".into(), "received→processing".into()];
    let step_names = ["a", "b", "c", "d"];
    let mut prev = "processing".to_owned();
    for s in step_names.iter().take(steps) {
        names.push(format!("{prev}→step {s} done"));
        prev = format!("step {s} done");
    }
    names.push("processed→delivered".into());
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    for (i, s) in seen.iter().enumerate() {
        let Some((recv, state)) = &s.terminal else {
            continue;
        };
        if state != "processed" {
            continue;
        }
        let mut ev = s.events.clone();
        ev.sort_by_key(|e| e.0);
        let at = |state: &str, step: Option<&str>| {
            ev.iter()
                .find(|(_, st, sp, _)| st == state && (step.is_none() || sp.as_deref() == step))
                .map(|e| e.3)
        };
        let mut points = vec![Some(sub(i)), at("received", None), at("processing", None)];
        for st in step_names.iter().take(steps) {
            points.push(at("step_succeeded", Some(st)));
        }
        let processed_at = at("processed", None);
        for (k, w) in points.windows(2).enumerate() {
            if let (Some(a), Some(b)) = (w[0], w[1])
                && a.is_finite()
                && b.is_finite()
            {
                samples[k].push((b - a) / 1000.0);
            }
        }
        if let Some(p) = processed_at.filter(|p| p.is_finite()) {
            samples[names.len() - 1].push((recv - p) / 1000.0);
        }
    }
    names
        .into_iter()
        .zip(samples)
        .map(|(n, s)| (n, Percentiles::of(s)))
        .collect()
}

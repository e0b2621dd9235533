//! The sequence of one bench run: the machine's limit, the floor of sas's
//! chain, sas with one scheduler and one agent (full load and low load, 1
//! and 3 steps, a diamond and a fan-out), with two
//! of each, an agent SIGKILLed mid-run, then the peers (Celery,
//! procrastinate, Restate, DBOS); then the report.
//! Everything it creates (databases, queues, processes) is removed at the
//! end, also after an error or Ctrl-C.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use chrono::Utc;
use sas::messages::Events;
use sqlx::Connection as _;
use uuid::Uuid;

use crate::Args;
use crate::limits::{self, LimitOptions};
use crate::load::{self, LoadSpec, Via};
use crate::peers::{self, CeleryBackend, PeerOptions, PeerRun};
use crate::procs;
use crate::report::{self, HTTP_FULL, Limits, Report, SasRun};
use crate::restate::{self, RestateOptions};
use crate::suite::{AGENTS, Env, Sim, Suite, SuiteOptions};

/// Run sizes.
#[derive(Debug, Clone)]
struct Sizes {
    warmup: usize,
    one: usize,
    three: usize,
    low: usize,
    low_max_secs: f64,
    scaled: usize,
    recovery: usize,
    limit_orders: usize,
    limit_messages: usize,
    limit_http: usize,
    peer_one: usize,
    peer_three: usize,
    peer_low: usize,
}

impl Sizes {
    fn from(a: &Args) -> Self {
        let base = if a.quick {
            Self {
                warmup: 300,
                one: 2000,
                three: 1000,
                low: 300,
                low_max_secs: 8.0,
                scaled: 1000,
                recovery: 600,
                limit_orders: 1000,
                limit_messages: 5000,
                limit_http: 5000,
                peer_one: 1000,
                peer_three: 300,
                peer_low: 150,
            }
        } else {
            Self {
                warmup: 1000,
                one: 20_000,
                three: 10_000,
                low: 2000,
                low_max_secs: 30.0,
                scaled: 10_000,
                recovery: 2000,
                limit_orders: 4000,
                limit_messages: 20_000,
                limit_http: 20_000,
                peer_one: 10_000,
                peer_three: 3000,
                peer_low: 1000,
            }
        };
        Self {
            one: a.orders_one.unwrap_or(base.one),
            three: a.orders_three.unwrap_or(base.three),
            low: a.low_orders.unwrap_or(base.low),
            low_max_secs: a.low_max_secs.unwrap_or(base.low_max_secs),
            scaled: a.scaled_orders.unwrap_or(base.scaled),
            recovery: a.recovery_orders.unwrap_or(base.recovery),
            limit_orders: a.limit_orders.unwrap_or(base.limit_orders),
            peer_one: a.peer_orders.unwrap_or(base.peer_one),
            peer_three: a.peer_orders.map_or(base.peer_three, |n| (n / 3).max(1)),
            ..base
        }
    }
}

/// How long to wait for a run of `orders` before giving up on it.
fn timeout_for(orders: usize) -> Duration {
    Duration::from_secs(120 + orders as u64 / 20)
}

/// Runs everything and writes the report.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let run_id = Uuid::new_v4().simple().to_string()[..6].to_owned();
    std::fs::create_dir_all(&args.work_dir)?;
    let work_dir = std::fs::canonicalize(&args.work_dir)?.join(format!("run-{run_id}"));
    std::fs::create_dir_all(&work_dir)?;
    let sas_env = args
        .sas_env
        .iter()
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .with_context(|| format!("--sas-env {kv:?}: expected KEY=VALUE"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let env = Env {
        postgres: sas_testkit::database::Postgres::new(&args.pg),
        amqp: args.amqp.clone(),
        bin_dir: std::fs::canonicalize(&args.bin_dir).with_context(|| {
            format!(
                "{} (build with `cargo build --release`)",
                args.bin_dir.display()
            )
        })?,
        work_dir: work_dir.clone(),
        run_id,
        sas_env,
        vacuum_every: None,
        skip_fanout: args.skip_fanout,
    };
    let mut env = env;
    let autovacuum = server_setting(&env, "autovacuum").await;
    env.vacuum_every = match args.vacuum_every {
        Some(s) if s > 0.0 => Some(Duration::from_secs_f64(s)),
        Some(_) => None,
        None if autovacuum.as_deref() == Some("off") => Some(Duration::from_secs(5)),
        None => None,
    };
    if let Some(every) = env.vacuum_every {
        eprintln!(
            "Postgres autovacuum is {}: the harness runs VACUUM (ANALYZE) on sas's tables every {every:?}",
            autovacuum.as_deref().unwrap_or("unknown")
        );
    }
    let env = env;
    eprintln!(
        "sas-bench run {} (scratch: {})",
        env.run_id,
        work_dir.display()
    );
    let outcome = tokio::select! {
        r = measure(&args, &env, autovacuum) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    // Whatever happened: no database, queue or process of this run stays.
    cleanup(&env).await;
    if !args.keep_logs && outcome.is_ok() {
        std::fs::remove_dir_all(&work_dir).ok();
    }
    let report = outcome?;
    let json = serde_json::to_string_pretty(&report)?;
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, json)?;
    let md_path = args.out.with_extension("md");
    std::fs::write(&md_path, report.markdown())?;
    println!("\n{}", report.table());
    println!(
        "Targets (ratios of figures measured in this run):\n\n{}",
        report.targets_table()
    );
    println!(
        "Full report: {} and {}",
        args.out.display(),
        md_path.display()
    );
    Ok(())
}

async fn wait_idle(threshold: f64) {
    if threshold <= 0.0 {
        return;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(600);
    loop {
        let load = procs::load_average();
        if load < threshold {
            eprintln!("load average {load:.2} < {threshold}: measuring");
            return;
        }
        if std::time::Instant::now() > deadline {
            eprintln!("warning: load average still {load:.2} after 10 minutes; measuring anyway");
            return;
        }
        eprintln!("load average {load:.2} ≥ {threshold}: waiting 30 s for an idle machine");
        tokio::time::sleep(Duration::from_secs(30)).await;
    }
}

/// Before each part of the run (with `--wait-idle`): waits, up to 5 minutes,
/// until the machine is quiet, i.e. less than 15% of its CPU was busy over 2 s
/// while nothing of ours ran. The load average reacts too slowly for this.
pub async fn wait_quiet(threshold: f64) {
    if threshold <= 0.0 {
        return;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    loop {
        let before = procs::snapshot(&[]);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let busy = procs::snapshot(&[]).since(&before).machine_busy_share;
        if busy < 0.15 {
            return;
        }
        if std::time::Instant::now() > deadline {
            eprintln!(
                "warning: the machine is still {:.0}% busy; measuring anyway",
                busy * 100.0
            );
            return;
        }
        eprintln!(
            "   machine {:.0}% busy with other work: waiting 10 s",
            busy * 100.0
        );
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
}

async fn measure(args: &Args, env: &Env, autovacuum: Option<String>) -> anyhow::Result<Report> {
    let sizes = Sizes::from(args);
    let started_at = Utc::now().to_rfc3339();
    wait_idle(args.wait_idle).await;
    let load_before = procs::load_average();
    let outcome = measure_with(args, env, &sizes).await;
    let (sas, memory_mib, limits, floor, hops, peers, peer_errors, peer_versions) = outcome?;
    let mut report = Report {
        started_at,
        finished_at: Utc::now().to_rfc3339(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        git: git_describe(),
        machine: procs::machine(),
        load_before,
        load_after: procs::load_average(),
        postgres: postgres_version(env).await,
        autovacuum: autovacuum.unwrap_or_else(|| "unknown".into()),
        vacuum_every_s: env.vacuum_every.map(|d| d.as_secs_f64()),
        rabbitmq: rabbitmq_version().await,
        peer_versions,
        sas,
        memory_mib,
        limits,
        floor,
        hops,
        peers,
        peer_errors,
        targets: Vec::new(),
    };
    let options = SuiteOptions::default();
    let bound =
        humantime(options.step_timeout) + 2.0 * humantime(options.supervisor_interval) + 1.0;
    report.targets = report::targets(&report, bound);
    Ok(report)
}

type Measured = (
    Vec<SasRun>,
    std::collections::BTreeMap<String, f64>,
    Option<Limits>,
    Option<crate::floor::Floor>,
    Vec<crate::hops::Hops>,
    Vec<peers::PeerResult>,
    Vec<String>,
    Option<String>,
);

/// Measures the limit, sas and the peers. Each measured system (the limit,
/// each sas deployment, each peer run) calls a remote-sim of its own,
/// started for it and stopped after ([`Suite::sim`]).
async fn measure_with(args: &Args, env: &Env, sizes: &Sizes) -> anyhow::Result<Measured> {
    // 1. The machine's limit, with nothing else running.
    env.checkpoint().await;
    let limits = if args.skip_limits {
        None
    } else {
        eprintln!("== machine limit");
        let (workflows, http) = limits::measure(
            env,
            &LimitOptions {
                orders: sizes.limit_orders,
                messages: sizes.limit_messages,
                http_calls: sizes.limit_http,
                concurrency: 16,
            },
        )
        .await?;
        Some(Limits { workflows, http })
    };
    // 1b. The floor of sas's own chain, with nothing else running.
    let mut floor = if args.skip_floor {
        None
    } else {
        eprintln!("== floor of the chain");
        let floor = crate::floor::measure(env).await?;
        for c in &floor.chains {
            eprintln!("   {}: {:.1} ms", c.workflow, c.ms);
        }
        Some(floor)
    };

    let mut runs = Vec::new();
    let mut memory: std::collections::BTreeMap<String, f64> = Default::default();

    // 2. sas: one scheduler and one agent; right after it Restate, the
    // peer it is held against, so that the machine drifts little between.
    if !args.skip_sas {
        sas_single(args, env, sizes, &mut runs, &mut memory).await?;
        // The floor once more, right after sas's runs: the machine drifts.
        if let Some(f) = floor.take() {
            eprintln!("== floor of the chain, again");
            floor = Some(match f.clone().again(env).await {
                Ok(both) => both,
                Err(e) => {
                    eprintln!("warning: the floor's second timing failed: {e:#}");
                    f
                }
            });
        }
    }
    // 2b. Where an order's milliseconds go, from the spans (apart: exporting
    // costs CPU).
    let hops = if args.skip_sas || args.skip_hops {
        Vec::new()
    } else {
        sas_hops(args, env, sizes).await?
    };
    let (restate, others): (Vec<Peer>, Vec<Peer>) = if args.skip_peers {
        (Vec::new(), Vec::new())
    } else {
        wanted_peers(args)
            .into_iter()
            .partition(|p| *p == Peer::Restate)
    };
    let mut peers = Peers::default();
    peers.run(args, env, sizes, restate).await?;

    // 3–4. sas with two of each, and recovery.
    if !args.skip_sas {
        sas_scaled_and_recovery(args, env, sizes, &mut runs, &mut memory).await?;
    }

    // 4b. The same deployment on a three-node RabbitMQ cluster and on one node.
    if args.cluster {
        cluster_runs(args, env, sizes, &mut runs).await?;
    }

    // 5. The other peers.
    peers.run(args, env, sizes, others).await?;
    let Peers {
        results: peer_results,
        errors: peer_errors,
        versions,
    } = peers;
    let peer_versions = (!versions.is_empty()).then(|| versions.join("; "));
    Ok((
        runs,
        memory,
        limits,
        floor,
        hops,
        peer_results,
        peer_errors,
        peer_versions,
    ))
}

/// What the peers' runs gave: results, set-up or run errors, versions.
#[derive(Default)]
struct Peers {
    results: Vec<peers::PeerResult>,
    errors: Vec<String>,
    versions: Vec<String>,
}

impl Peers {
    /// Runs `wanted` (see [`peer_runs`]) and keeps what they gave.
    async fn run(
        &mut self,
        args: &Args,
        env: &Env,
        sizes: &Sizes,
        wanted: Vec<Peer>,
    ) -> anyhow::Result<()> {
        if wanted.is_empty() {
            return Ok(());
        }
        peer_runs(args, env, sizes, wanted, self).await
    }
}

/// The peers the arguments ask for.
fn wanted_peers(args: &Args) -> Vec<Peer> {
    let mut wanted = Vec::new();
    if !args.skip_celery {
        wanted.push(Peer::Celery(CeleryBackend::Postgres));
        wanted.push(Peer::Celery(CeleryBackend::Rpc));
    }
    if !args.skip_procrastinate {
        wanted.push(Peer::Procrastinate);
    }
    if !args.skip_restate {
        wanted.push(Peer::Restate);
    }
    if !args.skip_dbos {
        wanted.push(Peer::Dbos);
    }
    wanted
}

/// Section 5: each of `wanted`, one-step then three-step, at full load and
/// at low load, at the rate sas is offered ([`low_rate`]). A peer that cannot be set up is
/// reported and left out; the others run.
async fn peer_runs(
    args: &Args,
    env: &Env,
    sizes: &Sizes,
    mut wanted: Vec<Peer>,
    out: &mut Peers,
) -> anyhow::Result<()> {
    let Peers {
        results: peer_results,
        errors: peer_errors,
        versions,
    } = out;
    let work_dir = std::fs::canonicalize(&args.work_dir)?;
    let peers_dir = std::fs::canonicalize(&args.peers_dir)
        .with_context(|| format!("{}", args.peers_dir.display()))?;
    let o = PeerOptions {
        python: args.python.clone(),
        venv: work_dir.join("venv"),
        dir: peers_dir.clone(),
        celery_concurrency: args.celery_concurrency,
        procrastinate_workers: args.procrastinate_workers,
        procrastinate_concurrency: args.procrastinate_concurrency,
        dbos_workers: args.dbos_workers,
        dbos_concurrency: args.dbos_concurrency,
    };
    if wanted.iter().any(|p| p.is_python()) {
        match peers::ensure_venv(&o).await {
            Err(e) => {
                peer_errors.push(format!("could not set up the peers' virtualenv: {e:#}"));
                wanted.retain(|p| !p.is_python());
            }
            Ok(()) => versions.push(peers::versions(&o).await),
        }
    }
    let ro = RestateOptions {
        install_dir: work_dir.join("restate"),
        project: peers_dir.join("restate"),
        target_dir: work_dir.join("restate-target"),
        data_dir: work_dir.join("restate-data"),
        npm: args.npm.clone(),
        in_flight: args.restate_in_flight,
    };
    let mut installed = None;
    if wanted.contains(&Peer::Restate) {
        match restate::ensure(&ro).await {
            Err(e) => {
                peer_errors.push(format!("could not set up Restate: {e:#}"));
                wanted.retain(|p| *p != Peer::Restate);
            }
            Ok(i) => {
                versions.push(i.versions.clone());
                installed = Some(i);
            }
        }
    }
    let setup = PeerSetup {
        o,
        restate: installed.map(|i| (ro, i)),
    };
    for (workflow, steps, n) in [("one", 1, sizes.peer_one), ("three", 3, sizes.peer_three)] {
        let mut systems = wanted.clone();
        let mut i = 0;
        while i < systems.len() {
            let peer = systems[i];
            i += 1;
            let full = PeerRun {
                workflow,
                steps,
                orders: n,
                rate: None,
                timeout: timeout_for(n),
            };
            wait_quiet(args.wait_idle).await;
            eprintln!("== {}: {workflow}, {n} orders", peer.name());
            let throughput = match run_peer(env, &setup, peer, &full).await {
                Ok(r) => {
                    print_peer(&r);
                    // Waiting for each result failed (a chain on rpc:// does, with
                    // BacklogLimitExceeded): measure the other way of collecting too.
                    if peer == Peer::Celery(CeleryBackend::Rpc) && r.error.is_some() {
                        systems.insert(i, Peer::Celery(CeleryBackend::RpcJoin));
                    }
                    let t = r.throughput.filter(|_| r.error.is_none());
                    peer_results.push(r);
                    t
                }
                Err(e) => {
                    peer_errors.push(format!("{} {workflow}: {e:#}", peer.name()));
                    None
                }
            };
            if throughput.is_none() || args.skip_peer_low {
                continue;
            }
            let rate = low_rate(args, workflow, steps);
            let low_n = sizes
                .peer_low
                .min((rate * sizes.low_max_secs / 2.0) as usize)
                .max(50);
            let low = PeerRun {
                workflow,
                steps,
                orders: low_n,
                rate: Some(rate),
                timeout: timeout_for(low_n) + Duration::from_secs_f64(low_n as f64 / rate),
            };
            wait_quiet(args.wait_idle).await;
            eprintln!(
                "== {}: {workflow}, low load, {low_n} orders at {rate:.1}/s",
                peer.name()
            );
            match run_peer(env, &setup, peer, &low).await {
                Ok(r) => {
                    print_peer(&r);
                    peer_results.push(r);
                }
                Err(e) => peer_errors.push(format!("{} {workflow} low load: {e:#}", peer.name())),
            }
        }
    }
    Ok(())
}

/// Section 2: sas with 1 scheduler and 1 agent, each workflow with every
/// status event and with the terminal one only, at full and at low load
/// ([`low_rate`]).
async fn sas_single(
    args: &Args,
    env: &Env,
    sizes: &Sizes,
    runs: &mut Vec<SasRun>,
    memory: &mut std::collections::BTreeMap<String, f64>,
) -> anyhow::Result<()> {
    wait_quiet(args.wait_idle).await;
    eprintln!("== sas: 1 scheduler, 1 agent");
    let mut suite = Suite::create(env, "s1", SuiteOptions::default()).await?;
    let result = async {
        suite.start_services(1, 1).await?;
        suite.start_maintenance();
        warm_up(&mut suite, sizes.warmup).await?;
        for (workflow, steps, n, events) in [
            ("one", 1, sizes.one, Events::All),
            ("one", 1, sizes.one, Events::Terminal),
            ("three", 3, sizes.three, Events::All),
            ("three", 3, sizes.three, Events::Terminal),
            ("diamond", 4, sizes.three, Events::All),
            // Ten items at once, then one step (§4d): eleven calls, two deep.
            ("fanout", 11, sizes.three / 3, Events::Terminal),
        ]
        .into_iter()
        .filter(|(workflow, ..)| *workflow != "fanout" || !args.skip_fanout)
        {
            let full = full_load(&mut suite, workflow, steps, n, events).await?;
            let rate = low_rate(args, workflow, steps);
            let low_n = sizes.low.min((rate * sizes.low_max_secs) as usize).max(50);
            let deployment = "1 scheduler, 1 agent".to_owned();
            runs.push(SasRun {
                deployment: deployment.clone(),
                load: "full".into(),
                result: full,
                compared: None,
            });
            if (workflow, events) == ("one", Events::All) && !args.skip_http {
                // The same orders over HTTP (contract §9a) right after, so
                // that the ratio of the two ways in is read back to back.
                let http = full_load_via(&mut suite, workflow, steps, n, events, Via::Http).await?;
                runs.push(SasRun {
                    deployment: deployment.clone(),
                    load: HTTP_FULL.into(),
                    result: http,
                    compared: None,
                });
            }
            eprintln!(
                "   {workflow} (events {}): low load, {low_n} orders at {rate:.1}/s",
                events.as_str()
            );
            let low = load::run(
                &mut suite,
                &LoadSpec {
                    workflow,
                    steps,
                    events,
                    orders: low_n,
                    rate: Some(rate),
                    timeout: timeout_for(low_n) + Duration::from_secs_f64(low_n as f64 / rate),
                    kill: None,
                    via: Via::Queue,
                },
            )
            .await?;
            print_line(&low);
            suite.reset_store().await?;
            runs.push(SasRun {
                deployment,
                load: "low".into(),
                result: low,
                compared: None,
            });
        }
        Ok::<(), anyhow::Error>(())
    }
    .await;
    merge_memory(memory, suite.peak_memory());
    finish(suite, result, args.keep_logs).await
}

/// Section 2b: sas with 1 scheduler and 1 agent exporting their spans to
/// the harness, each workflow at its low-load rate with terminal events:
/// the time between each hop of an order ([`crate::hops`]).
async fn sas_hops(args: &Args, env: &Env, sizes: &Sizes) -> anyhow::Result<Vec<crate::hops::Hops>> {
    wait_quiet(args.wait_idle).await;
    eprintln!("== sas: 1 scheduler, 1 agent, spans exported (the hops)");
    let receiver = sas_testkit::otlp::Otlp::start().await?;
    let mut env = env.clone();
    env.sas_env.extend([
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(),
            receiver.endpoint.clone(),
        ),
        // Sent in small batches, so that the queue never drops a span.
        ("OTEL_BSP_SCHEDULE_DELAY".to_owned(), "200".to_owned()),
    ]);
    let mut suite = Suite::create(&env, "hops", SuiteOptions::default()).await?;
    let mut all = Vec::new();
    let result = async {
        suite.start_services(1, 1).await?;
        suite.start_maintenance();
        warm_up(&mut suite, sizes.warmup).await?;
        for (workflow, steps) in [("one", 1), ("three", 3)] {
            let rate = low_rate(args, workflow, steps);
            let n = sizes.low.min((rate * sizes.low_max_secs) as usize).max(50);
            receiver
                .settle(Duration::from_millis(500), Duration::from_secs(10))
                .await;
            receiver.take();
            eprintln!("   {workflow}: {n} orders at {rate:.1}/s");
            let low = load::run(
                &mut suite,
                &LoadSpec {
                    workflow,
                    steps,
                    events: Events::Terminal,
                    orders: n,
                    rate: Some(rate),
                    timeout: timeout_for(n) + Duration::from_secs_f64(n as f64 / rate),
                    kill: None,
                    via: Via::Queue,
                },
            )
            .await?;
            receiver
                .settle(Duration::from_millis(1000), Duration::from_secs(15))
                .await;
            let (orders, hops) = crate::hops::breakdown(&receiver.take(), &low.timeline, steps);
            eprintln!(
                "   → p50 {:.1} ms; {orders} of {} processed orders with every span",
                low.latency_ms.p50, low.processed
            );
            for (hop, p) in &hops {
                eprintln!("     {:6.2} ms  {hop}", p.p50);
            }
            all.push(crate::hops::Hops {
                workflow: workflow.to_owned(),
                status_events: Events::Terminal.as_str(),
                offered_rate: Some(rate),
                orders,
                latency_p50_ms: low.latency_ms.p50,
                hops,
            });
            suite.reset_store().await?;
        }
        Ok::<(), anyhow::Error>(())
    }
    .await;
    finish(suite, result, args.keep_logs).await?;
    Ok(all)
}

/// The rate of a workflow's low-load runs, the same for sas and the peers
/// (#44: what a steady deployment sees): 50 one-step and 20 three-step
/// orders/s; other workflows 50 calls' worth; with `--low-rate r`, r
/// one-step orders/s and r divided by the steps for the others (a
/// three-step order is about three one-step orders' work).
pub fn low_rate(args: &Args, workflow: &str, steps: usize) -> f64 {
    match (args.low_rate, workflow) {
        (Some(r), _) => r / steps as f64,
        (None, "one") => 50.0,
        (None, "three" | "diamond") => 20.0,
        (None, _) => 50.0 / steps as f64,
    }
}

/// Sections 3–4: sas with 2 schedulers and 2 agents, and the recovery run.
async fn sas_scaled_and_recovery(
    args: &Args,
    env: &Env,
    sizes: &Sizes,
    runs: &mut Vec<SasRun>,
    memory: &mut std::collections::BTreeMap<String, f64>,
) -> anyhow::Result<()> {
    // 3. Two schedulers, two agents.
    if !args.skip_scaled {
        wait_quiet(args.wait_idle).await;
        eprintln!("== sas: 2 schedulers, 2 agents");
        let mut suite = Suite::create(env, "s2", SuiteOptions::default()).await?;
        let result = async {
            suite.start_services(2, 2).await?;
            suite.start_maintenance();
            warm_up(&mut suite, sizes.warmup).await?;
            for (workflow, steps, n, events) in [
                ("one", 1, sizes.scaled, Events::All),
                ("one", 1, sizes.scaled, Events::Terminal),
                ("three", 3, sizes.scaled / 2, Events::All),
                ("three", 3, sizes.scaled / 2, Events::Terminal),
            ] {
                let full = full_load(&mut suite, workflow, steps, n, events).await?;
                runs.push(SasRun {
                    deployment: "2 schedulers, 2 agents".into(),
                    load: "full".into(),
                    result: full,
                    compared: None,
                });
            }
            Ok::<(), anyhow::Error>(())
        }
        .await;
        merge_memory(memory, suite.peak_memory());
        finish(suite, result, args.keep_logs).await?;
    }

    // 4. Recovery: 3-step orders at half the full-load rate, two agents, one SIGKILLed.
    if !args.skip_recovery {
        wait_quiet(args.wait_idle).await;
        eprintln!("== sas: recovery (agent SIGKILL)");
        let three_full = runs
            .iter()
            .find(|r| r.load == "full" && r.result.workflow == "three")
            .map_or(100.0, |r| r.result.throughput);
        let rate = (three_full * 0.5).max(10.0);
        let n = sizes.recovery;
        let mut suite = Suite::create(env, "rec", SuiteOptions::default()).await?;
        let result = async {
            suite.start_services(1, 2).await?;
            suite.start_maintenance();
            warm_up(&mut suite, sizes.warmup / 2).await?;
            eprintln!(
                "   three: {n} orders at {rate:.0}/s, agent-1 killed after {}",
                n / 3
            );
            let r = load::run(
                &mut suite,
                &LoadSpec {
                    workflow: "three",
                    steps: 3,
                    events: Events::All,
                    orders: n,
                    rate: Some(rate),
                    timeout: timeout_for(n) + Duration::from_secs_f64(n as f64 / rate),
                    kill: Some(("agent-1".into(), n / 3)),
                    via: Via::Queue,
                },
            )
            .await?;
            print_line(&r);
            runs.push(SasRun {
                deployment: "1 scheduler, 2 agents".into(),
                load: "recovery".into(),
                result: r,
                compared: None,
            });
            Ok::<(), anyhow::Error>(())
        }
        .await;
        finish(suite, result, args.keep_logs).await?;
    }

    Ok(())
}

/// The nodes of `scripts/cluster.sh`, taken down (and their directory
/// removed) when dropped: after the runs, an error or Ctrl-C alike.
struct Cluster {
    script: std::path::PathBuf,
    /// `broker.url` for the cluster: its nodes' URLs, comma-separated.
    urls: String,
}

impl Cluster {
    async fn up() -> anyhow::Result<Self> {
        let script = std::env::current_dir()?.join("scripts/cluster.sh");
        anyhow::ensure!(
            script.is_file(),
            "{} not found: run from the repository's root (scripts/bench.sh does)",
            script.display()
        );
        // From here on, dropping the guard takes down whatever came up.
        let mut cluster = Self {
            script,
            urls: String::new(),
        };
        cluster.run("up").await?;
        cluster.urls = cluster.run("urls").await?;
        Ok(cluster)
    }

    /// `scripts/cluster.sh <command>`'s output; its own one-line error
    /// when it fails.
    async fn run(&self, command: &str) -> anyhow::Result<String> {
        let out = tokio::process::Command::new(&self.script)
            .arg(command)
            .output()
            .await
            .with_context(|| format!("running {}", self.script.display()))?;
        anyhow::ensure!(
            out.status.success(),
            "scripts/cluster.sh {command} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let down = std::process::Command::new(&self.script)
            .arg("down")
            .status();
        if !down.is_ok_and(|s| s.success()) {
            eprintln!("warning: scripts/cluster.sh down failed: run it by hand");
        }
    }
}

/// Section 4b (`--cluster`): one scheduler and one agent, the 1-step
/// workflow at full load, quorum step queues, on the machine's node and on
/// a three-node cluster, in this run; the cluster's row says its ratio to
/// the node's. The orders queue is a quorum queue in both.
async fn cluster_runs(
    args: &Args,
    env: &Env,
    sizes: &Sizes,
    runs: &mut Vec<SasRun>,
) -> anyhow::Result<()> {
    eprintln!("== sas on a three-node RabbitMQ cluster (scripts/cluster.sh up)");
    let cluster = Cluster::up().await?;
    let n = args.cluster_orders.unwrap_or(sizes.one);
    let quorum = ("SAS__BROKER__STEP_QUEUES".to_owned(), "quorum".to_owned());
    let mut single = env.clone();
    single.sas_env.push(quorum.clone());
    let mut clustered = env.clone();
    clustered.amqp = cluster.urls.clone();
    clustered.sas_env.push(quorum);
    clustered
        .sas_env
        .push(("SAS__BROKER__URL".to_owned(), cluster.urls.clone()));
    let mut node_rate = None;
    for (name, where_, env) in [
        ("q1", "1 node", &single),
        ("qc", "3-node cluster", &clustered),
    ] {
        wait_quiet(args.wait_idle).await;
        let deployment = format!("1 scheduler, 1 agent; {where_}, quorum step queues");
        eprintln!("== sas: {deployment}");
        let mut suite = Suite::create(env, name, SuiteOptions::default()).await?;
        let result = async {
            suite.start_services(1, 1).await?;
            suite.start_maintenance();
            warm_up(&mut suite, sizes.warmup).await?;
            let full = full_load(&mut suite, "one", 1, n, Events::All).await?;
            let compared = node_rate.map(|node: f64| {
                format!(
                    "{:.2}× the 1-node run's throughput ({:.0}/s)",
                    full.throughput / node,
                    node
                )
            });
            if let Some(c) = &compared {
                eprintln!("   cluster: {c}");
            }
            node_rate.get_or_insert(full.throughput);
            runs.push(SasRun {
                deployment,
                load: "full".into(),
                result: full,
                compared,
            });
            Ok::<(), anyhow::Error>(())
        }
        .await;
        finish(suite, result, args.keep_logs).await?;
    }
    drop(cluster);
    Ok(())
}

/// A peer system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Peer {
    Celery(CeleryBackend),
    Procrastinate,
    Restate,
    Dbos,
}

impl Peer {
    fn name(self) -> String {
        match self {
            Self::Celery(b) => b.system().to_owned(),
            Self::Procrastinate => "procrastinate".into(),
            Self::Restate => "restate".into(),
            Self::Dbos => "dbos".into(),
        }
    }

    /// Runs in the peers' Python virtualenv.
    fn is_python(self) -> bool {
        !matches!(self, Self::Restate)
    }
}

/// What the peer runs need: the Python side, and Restate once installed.
struct PeerSetup {
    o: PeerOptions,
    restate: Option<(RestateOptions, restate::Installed)>,
}

/// One run of a peer, against a remote-sim of its own.
async fn run_peer(
    env: &Env,
    setup: &PeerSetup,
    peer: Peer,
    run: &PeerRun<'_>,
) -> anyhow::Result<peers::PeerResult> {
    let sim = Sim::start(env, "remote-sim-peer").await?;
    let o = &setup.o;
    let result = match peer {
        Peer::Celery(b) => peers::celery(env, &sim, o, b, run).await,
        Peer::Procrastinate => peers::procrastinate(env, &sim, o, run).await,
        Peer::Dbos => peers::dbos(env, &sim, o, run).await,
        Peer::Restate => match &setup.restate {
            Some((ro, installed)) => restate::run(env, &sim, ro, installed, run).await,
            None => Err(anyhow::anyhow!("Restate is not installed")),
        },
    };
    sim.stop().await;
    result
}

async fn warm_up(suite: &mut Suite, n: usize) -> anyhow::Result<()> {
    if n == 0 {
        return Ok(());
    }
    eprintln!("   warm-up: {n} orders");
    let r = load::run(
        suite,
        &LoadSpec {
            workflow: "one",
            steps: 1,
            events: Events::All,
            orders: n,
            rate: None,
            timeout: timeout_for(n),
            kill: None,
            via: Via::Queue,
        },
    )
    .await?;
    anyhow::ensure!(r.missing == 0, "warm-up: {} orders never ended", r.missing);
    suite.reset_store().await
}

async fn full_load(
    suite: &mut Suite,
    workflow: &'static str,
    steps: usize,
    n: usize,
    events: Events,
) -> anyhow::Result<load::LoadResult> {
    full_load_via(suite, workflow, steps, n, events, Via::Queue).await
}

/// [`full_load`], the orders coming in `via`.
async fn full_load_via(
    suite: &mut Suite,
    workflow: &'static str,
    steps: usize,
    n: usize,
    events: Events,
    via: Via,
) -> anyhow::Result<load::LoadResult> {
    eprintln!(
        "   {workflow} (events {}): full load, {n} orders{}",
        events.as_str(),
        if via == Via::Http { ", over HTTP" } else { "" }
    );
    let r = load::run(
        suite,
        &LoadSpec {
            workflow,
            steps,
            events,
            orders: n,
            rate: None,
            timeout: timeout_for(n),
            kill: None,
            via,
        },
    )
    .await?;
    print_line(&r);
    suite.reset_store().await?;
    Ok(r)
}

fn print_line(r: &load::LoadResult) {
    eprintln!(
        "   → {:.0} orders/s, p50 {:.1} ms, p99 {:.1} ms, p99.9 {:.1} ms ({} processed, {} other, {} missing; CPU busy {:.0}%)",
        r.throughput,
        r.latency_ms.p50,
        r.latency_ms.p99,
        r.latency_ms.p999,
        r.processed,
        r.other_terminal,
        r.missing,
        r.cpu.machine_busy_share * 100.0
    );
    if !r.outbox_paths.is_empty() {
        eprintln!("     messages per order by path: {}", r.outbox_paths_text());
    }
}

fn print_peer(r: &peers::PeerResult) {
    eprintln!(
        "   → {} orders/s, p50 {:.1} ms, p99 {:.1} ms ({} of {} completed{})",
        r.throughput.map_or("—".into(), |t| format!("{t:.0}")),
        r.latency_ms.p50,
        r.latency_ms.p99,
        r.completed,
        r.orders,
        r.error.as_ref().map_or(String::new(), |e| format!("; {e}"))
    );
}

fn merge_memory(
    into: &mut std::collections::BTreeMap<String, f64>,
    from: std::collections::BTreeMap<String, f64>,
) {
    for (k, v) in from {
        let e = into.entry(k).or_default();
        *e = e.max(v);
    }
}

/// Tears a suite down after its runs; an error of the runs says where the logs are.
async fn finish(suite: Suite, result: anyhow::Result<()>, keep_logs: bool) -> anyhow::Result<()> {
    let dir = suite.dir().to_owned();
    suite.teardown(keep_logs).await;
    result.map_err(|e| with_logs(e, &dir, keep_logs))
}

fn with_logs(e: anyhow::Error, dir: &Path, kept: bool) -> anyhow::Error {
    if kept {
        e.context(format!("logs in {}", dir.display()))
    } else {
        e.context("run again with --keep-logs to keep the services' logs")
    }
}

fn humantime(s: &str) -> f64 {
    if let Some(ms) = s.strip_suffix("ms") {
        ms.parse::<f64>().unwrap_or(0.0) / 1000.0
    } else if let Some(secs) = s.strip_suffix('s') {
        secs.parse().unwrap_or(0.0)
    } else {
        0.0
    }
}

/// Removes every database, queue and exchange this run may have created.
async fn cleanup(env: &Env) {
    peers::kill_all().await;
    if let Some(work_dir) = env.work_dir.parent() {
        restate::cleanup(&work_dir.join("restate-data"));
    }
    let mut queues = Vec::new();
    // `qc` lived on the cluster, which `down` removed with its queues.
    for name in ["s1", "s2", "rec", "q1"] {
        let prefix = format!("sasbench{}{name}", env.run_id);
        queues.extend(
            sas::topology::QueueNames::new(&prefix)
                .all(AGENTS)
                .into_iter()
                .map(|q| q.name),
        );
        queues.push(format!("{prefix}-app.status"));
    }
    for t in ["quorum", "classic"] {
        for lane in 0..crate::limits::LANES {
            queues.push(format!("sasbench{}limits.mq.{t}.{lane}", env.run_id));
        }
    }
    let celery: Vec<String> = ["postgres", "rpc"]
        .iter()
        .flat_map(|b| ["one", "three"].map(|w| format!("sasbench{}.celery-{b}-{w}", env.run_id)))
        .collect();
    queues.extend(celery.iter().cloned());
    env.delete_queues(&queues).await;
    peers::delete_exchanges(env, &celery).await;
    if let Ok(mut admin) = sqlx::PgConnection::connect(&env.postgres.admin_url).await {
        let names: Vec<String> =
            sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE $1")
                .bind(format!("sasbench\\_{}\\_%", env.run_id))
                .fetch_all(&mut admin)
                .await
                .unwrap_or_default();
        sqlx::Connection::close(admin).await.ok();
        for n in names {
            env.drop_db(&n).await;
        }
    }
}

fn git_describe() -> String {
    let run = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let head = run(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty =
        run(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    if dirty {
        format!("{head} (with uncommitted changes)")
    } else {
        head
    }
}

async fn server_setting(env: &Env, name: &str) -> Option<String> {
    let mut c = sqlx::PgConnection::connect(&env.postgres.admin_url)
        .await
        .ok()?;
    let v: Option<String> = sqlx::query_scalar("SELECT current_setting($1)")
        .bind(name)
        .fetch_one(&mut c)
        .await
        .ok();
    c.close().await.ok();
    v
}

async fn postgres_version(env: &Env) -> String {
    let Ok(mut c) = sqlx::PgConnection::connect(&env.postgres.admin_url).await else {
        return "Postgres".into();
    };
    let v: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&mut c)
        .await
        .unwrap_or_default();
    sqlx::Connection::close(c).await.ok();
    format!("Postgres {}", v.split_whitespace().next().unwrap_or(""))
}

async fn rabbitmq_version() -> String {
    let out = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::process::Command::new("rabbitmqctl")
            .args(["version"])
            .output(),
    )
    .await;
    match out {
        Ok(Ok(o)) if o.status.success() => {
            format!("RabbitMQ {}", String::from_utf8_lossy(&o.stdout).trim())
        }
        _ => "RabbitMQ".into(),
    }
}

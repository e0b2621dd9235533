//! `sasctl chaos`: a soak run. Submits N orders with a mix of transient and
//! permanent remote faults (set on a remote-sim) while services are killed at
//! random, reads every order's status events, and prints one verdict: orders
//! per terminal state, orders lost, sequence gaps, orders with more than one
//! terminal event, effects applied twice. Exit code 0 only when none was lost
//! or doubled.
//!
//! It runs against the configured deployment like every sasctl command, or
//! starts the services itself (`--spawn`). Three things run side by side:
//! the submitter, the reader of the run's status queue and the killer. They
//! share one task, so they share state through `Cell`s without locks.

mod faults;
mod processes;
mod report;

use std::cell::{Cell, RefCell};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::value_parser;
use sas::broker::{Broker, PublishError};
use sas::config::Settings;
use sas::topology::QueueNames;
use serde_json::Map;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::Exit;
use crate::submit::{CHUNK, no_orders_queue_hint, order_body, publish_batch};
use crate::watch::{Handled, ReadEnd, read_queue};
use faults::Sim;
use processes::{Fleet, SERVICES, run_kill_command};
use report::{RunFacts, Tally};

/// Unacknowledged status events the reader holds: it only counts them.
const EVENT_PREFETCH: u16 = 500;

/// The reader checks whether the run is complete when nothing arrived for this long.
const READ_IDLE: Duration = Duration::from_millis(500);

/// After every order has ended, the reader goes on until nothing arrives
/// for this long (at most [`SETTLE_MAX`]), to catch a late second terminal event.
const SETTLE_IDLE: Duration = Duration::from_secs(2);
const SETTLE_MAX: Duration = Duration::from_secs(10);

/// How often progress goes to stderr.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// Options of `sasctl chaos`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Examples:
  # The whole suite started by sasctl, against a remote-sim whose URLs the configuration uses:
  sasctl chaos --spawn target/release --sim http://127.0.0.1:8081 --workflow order \\
      --orders 10000 --transient 0.05 --permanent 0.01 --kill-every 3s
  # Your own deployment (docker compose), killing a random service every 10 s:
  sasctl chaos --workflow order --orders 1000 --sim http://127.0.0.1:8081 --kill-every 10s \\
      --kill-cmd 'docker compose kill -s KILL {service} && docker compose up -d {service}'

Exit code 0 when no order was lost, none has a gap in its seq or two terminal
events, and no effect was applied twice; 1 otherwise.")]
pub struct Args {
    /// How many orders to submit.
    #[arg(long, value_name = "N", value_parser = value_parser!(u32).range(1..))]
    orders: u32,
    /// Workflow of the orders.
    #[arg(long)]
    workflow: String,
    /// Probability (0 to 1) that a call of a forward step answers 503 (needs --sim).
    #[arg(long, value_name = "RATE", value_parser = parse_probability, requires = "sim")]
    transient: Option<f64>,
    /// Probability (0 to 1) that a call of a forward step answers 422 (needs --sim).
    #[arg(long, value_name = "RATE", value_parser = parse_probability, requires = "sim")]
    permanent: Option<f64>,
    /// Base URL of the remote-sim the workflow's agents call (e.g.
    /// http://127.0.0.1:8081): sets the fault rates on their endpoints, and
    /// counts the effects applied twice.
    #[arg(long, value_name = "URL", value_parser = parse_url)]
    sim: Option<String>,
    /// Kill a random service this often (e.g. "3s"); with --spawn or --kill-cmd.
    #[arg(long, value_name = "DURATION", value_parser = parse_positive_duration)]
    kill_every: Option<Duration>,
    /// Start submission, scheduler, agent and supervisor from this directory,
    /// SIGKILL and restart them, and stop them (SIGTERM) at the end.
    #[arg(long, value_name = "BIN_DIR", conflicts_with = "kill_cmd")]
    spawn: Option<PathBuf>,
    /// Kill a service of your own deployment: run `sh -c CMD` with {service}
    /// replaced by a random name of --services.
    #[arg(long, value_name = "CMD")]
    kill_cmd: Option<String>,
    /// The services to kill (with --spawn: among submission, scheduler, agent, supervisor).
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "submission,scheduler,agent,supervisor"
    )]
    services: Vec<String>,
    /// How long to wait for the orders to end, after the last one is submitted.
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = parse_positive_duration)]
    timeout: Duration,
    /// Submit at most this many orders per second (e.g. "200" or "200/s").
    #[arg(long, value_name = "N/s", value_parser = parse_rate)]
    rate: Option<f64>,
    /// Print the report as one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

impl Args {
    /// Checks between arguments that clap cannot express.
    pub fn check(&self) -> Result<(), String> {
        if self.kill_every.is_some() && self.spawn.is_none() && self.kill_cmd.is_none() {
            return Err("--kill-every needs --spawn or --kill-cmd".into());
        }
        if self.kill_cmd.is_some() && self.kill_every.is_none() {
            return Err("--kill-cmd needs --kill-every".into());
        }
        if self.services.iter().any(|s| s.trim().is_empty()) {
            return Err("--services: a name is empty".into());
        }
        if self.spawn.is_some()
            && let Some(other) = self
                .services
                .iter()
                .find(|s| !SERVICES.contains(&s.as_str()))
        {
            return Err(format!(
                "--services: with --spawn the services are {}; {other:?} is not one",
                SERVICES.join(", ")
            ));
        }
        Ok(())
    }
}

/// `--transient`, `--permanent`: a probability.
fn parse_probability(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err("a probability from 0 to 1 (e.g. 0.05)".into()),
    }
}

/// `--rate`: orders per second, "200" or "200/s".
fn parse_rate(text: &str) -> Result<f64, String> {
    let number = text.strip_suffix("/s").unwrap_or(text);
    match number.trim().parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err("orders per second, more than 0 (e.g. 200 or 200/s)".into()),
    }
}

/// `--sim`: an http:// URL.
fn parse_url(text: &str) -> Result<String, String> {
    if text.starts_with("http://") || text.starts_with("https://") {
        Ok(text.trim_end_matches('/').to_owned())
    } else {
        Err("an http:// URL, e.g. http://127.0.0.1:8081".into())
    }
}

/// `--kill-every`, `--timeout`: a human duration above zero.
fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    match humantime::parse_duration(text) {
        Ok(d) if !d.is_zero() => Ok(d),
        Ok(_) => Err("must be more than 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// Counters the killer keeps.
#[derive(Debug, Default)]
struct Kills {
    done: Cell<u64>,
    failed: Cell<u64>,
    unexpected_exits: Cell<u64>,
}

fn bump(counter: &Cell<u64>) {
    counter.set(counter.get() + 1);
}

/// Runs `sasctl chaos`. `config` is the configuration file sasctl read, handed
/// to the services it spawns.
pub async fn run(args: Args, settings: &Settings, config: Option<&Path>) -> anyhow::Result<()> {
    if let Err(e) = settings.workflow(&args.workflow) {
        return Err(Exit {
            code: 2,
            message: format!("--workflow: {e}"),
        }
        .into());
    }
    let shutdown = sas::shutdown::on_signal().context("installing the signal handlers")?;
    let run_id = Uuid::new_v4().simple().to_string()[..8].to_owned();
    let status_queue = format!("{}.chaos.{run_id}", settings.broker.prefix);
    let faults = (args.transient.unwrap_or(0.0), args.permanent.unwrap_or(0.0));

    let mut sim = None;
    if let Some(base) = &args.sim {
        let (endpoints, skipped) = faults::plan(settings, &args.workflow, base)?;
        if !skipped.is_empty() {
            eprintln!(
                "chaos: agents not on {base} get no faults and are not counted: {}",
                skipped.join(", ")
            );
        }
        if !endpoints.iter().any(|e| e.forward) {
            return Err(Exit {
                code: 2,
                message: format!(
                    "--sim {base}: no step agent of workflow {:?} has its URL there",
                    args.workflow
                ),
            }
            .into());
        }
        let mut client = Sim::new(base)?;
        let prepared = client.prepare(&endpoints, faults.0, faults.1).await;
        if let Err(e) = prepared {
            client.restore().await;
            return Err(e);
        }
        for e in &endpoints {
            let what = if e.forward {
                format!(
                    "{}% transient, {}% permanent",
                    report::round(faults.0 * 100.0, 3),
                    report::round(faults.1 * 100.0, 3)
                )
            } else {
                "healthy (compensation)".into()
            };
            eprintln!("chaos: {}{} ({}): {what}", base, e.path, e.agent);
        }
        sim = Some(client);
    }

    let mut fleet = None;
    let soaked = async {
        if let Some(dir) = &args.spawn {
            eprintln!("chaos: starting the services from {}", dir.display());
            let started = Fleet::start(dir, config, settings, &run_id).await?;
            eprintln!(
                "chaos: services ready; logs in {}",
                started.log_dir().display()
            );
            fleet = Some(started);
        }
        soak(&args, settings, &status_queue, fleet.as_mut(), &shutdown).await
    }
    .await;

    // Stop the services first: an effect applied twice would be applied by them.
    if let Some(fleet) = &mut fleet {
        eprintln!("chaos: stopping the services");
        fleet.stop().await;
    }
    let mut duplicates = None;
    let mut sim_error = None;
    if let (Some(sim), Ok(soak)) = (&sim, &soaked) {
        match sim.duplicates(soak.tally.confirmed_ids()).await {
            Ok(n) => duplicates = Some(n),
            Err(e) => sim_error = Some(e),
        }
    }
    if let Some(sim) = &sim {
        sim.restore().await;
    }
    delete_queue(settings, &status_queue).await;
    let soak = soaked?;
    if let Some(e) = sim_error {
        return Err(e.context("the run ended, but effects applied twice cannot be counted"));
    }

    let report = soak.tally.report(RunFacts {
        workflow: args.workflow.clone(),
        orders: u64::from(args.orders),
        duplicates,
        kills: soak.kills.done.get(),
        kill_failures: soak.kills.failed.get(),
        unexpected_exits: soak.kills.unexpected_exits.get(),
        faults: sim.as_ref().map(|_| faults),
        kill_every: args.kill_every,
        started: soak.started,
        elapsed: soak.elapsed,
        interrupted: soak.interrupted,
        logs: fleet.as_ref().map(|f| f.log_dir().display().to_string()),
        queue: status_queue,
    });
    if args.json {
        println!("{}", report.json());
    } else {
        print!("{}", report.table());
    }
    let failures = report.failures();
    if failures.is_empty() {
        Ok(())
    } else {
        Err(Exit {
            code: 1,
            message: format!("chaos run failed: {}", failures.join("; ")),
        }
        .into())
    }
}

/// What the submitter, reader and killer leave behind.
struct Soak {
    tally: Tally,
    kills: Kills,
    started: Instant,
    elapsed: Duration,
    interrupted: bool,
}

/// Submits the orders, reads their events and kills services, side by side,
/// until every order has ended, the timeout passes or a signal comes.
async fn soak(
    args: &Args,
    settings: &Settings,
    status_queue: &str,
    fleet: Option<&mut Fleet>,
    shutdown: &CancellationToken,
) -> anyhow::Result<Soak> {
    // The status queue first: events for a queue that does not exist are dropped.
    let broker = Broker::connect(&settings.broker, "sasctl-chaos")
        .await
        .context("connecting to RabbitMQ")?;
    let declared = broker.declare_status_queue(status_queue).await;
    broker.close().await;
    declared.with_context(|| format!("declaring the status queue {status_queue}"))?;

    let ids: Vec<Uuid> = (0..args.orders).map(|_| Uuid::new_v4()).collect();
    let tally = RefCell::new(Tally::new(&ids));
    let kills = Kills::default();
    // When the submitter is done: the timeout counts from there.
    let (submitted_tx, submitted_rx) = watch::channel(None::<Instant>);
    let (finished_tx, finished_rx) = watch::channel(false);
    let started = Instant::now();
    eprintln!(
        "chaos: submitting {} orders of workflow {:?}; events to {status_queue}",
        args.orders, args.workflow
    );

    let submitter = async {
        let outcome = submit_orders(args, settings, status_queue, &ids, &tally, shutdown).await;
        if let Err(e) = &outcome {
            eprintln!("chaos: submitting stopped: {}", crate::chain(e));
        }
        tally.borrow_mut().submission_done();
        submitted_tx.send_replace(Some(Instant::now()));
    };
    let reader = async {
        let outcome = read_events(
            settings,
            status_queue,
            &tally,
            submitted_rx,
            args.timeout,
            shutdown,
        )
        .await;
        finished_tx.send_replace(true);
        outcome
    };
    let killer = kill_services(args, fleet, &kills, finished_rx.clone(), shutdown);
    let progress = report_progress(args.orders, &tally, &kills, started, finished_rx);
    let ((), read, (), ()) = tokio::join!(submitter, reader, killer, progress);
    let elapsed = started.elapsed();
    let end = read?;
    match end {
        ReadStop::Complete => eprintln!("chaos: every order ended"),
        ReadStop::Deadline => eprintln!(
            "chaos: {} passed after the last order was submitted; the orders not ended are lost",
            humantime::format_duration(args.timeout)
        ),
        ReadStop::Interrupted => eprintln!("chaos: interrupted"),
    }
    Ok(Soak {
        tally: tally.into_inner(),
        kills,
        started,
        elapsed,
        interrupted: end == ReadStop::Interrupted,
    })
}

/// Publishes the orders with confirms, in chunks (paced by `--rate`). A
/// chunk whose messages were not all confirmed is published again, on a new
/// connection if need be, until it is or `--timeout` passes without progress:
/// each order has its own `order_id`, so a repeat is the same order.
async fn submit_orders(
    args: &Args,
    settings: &Settings,
    status_queue: &str,
    ids: &[Uuid],
    tally: &RefCell<Tally>,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let queues = QueueNames::new(&settings.broker.prefix);
    let chunk = match args.rate {
        // About ten chunks a second, so the pace is even.
        Some(rate) => ((rate / 10.0).ceil() as usize).clamp(1, CHUNK as usize),
        None => CHUNK as usize,
    };
    let started = tokio::time::Instant::now();
    let mut conn: Option<sas_client::Client> = None;
    let outcome = async {
        for (n, chunk_ids) in ids.chunks(chunk).enumerate() {
            if let Some(rate) = args.rate {
                let due = started + Duration::from_secs_f64((n * chunk) as f64 / rate);
                tokio::select! {
                    () = tokio::time::sleep_until(due) => {}
                    () = shutdown.cancelled() => anyhow::bail!("interrupted"),
                }
            }
            let mut pending: Vec<Uuid> = chunk_ids.to_vec();
            let mut backoff = Duration::from_millis(250);
            let mut stuck_since: Option<Instant> = None;
            while !pending.is_empty() {
                if shutdown.is_cancelled() {
                    anyhow::bail!("interrupted");
                }
                let error = match publish_orders(
                    &mut conn,
                    settings,
                    &queues,
                    args,
                    status_queue,
                    &pending,
                )
                .await
                {
                    Ok(outcomes) => {
                        let mut again = Vec::new();
                        let mut error = None;
                        for (id, outcome) in pending.iter().zip(outcomes) {
                            match outcome {
                                Ok(()) => tally.borrow_mut().confirmed(*id),
                                Err(e) => {
                                    again.push(*id);
                                    error = Some(e);
                                }
                            }
                        }
                        pending = again;
                        match error {
                            Some(sas_client::Error::Publish(PublishError::Unroutable(q))) => {
                                Some(anyhow::anyhow!(
                                    "no queue named {q:?} ({})",
                                    no_orders_queue_hint(&queues)
                                ))
                            }
                            Some(e) => Some(anyhow::Error::new(e)),
                            None => None,
                        }
                    }
                    Err(e) => {
                        // The connection may be gone: start over on a new one.
                        if let Some(client) = conn.take() {
                            client.close().await;
                        }
                        Some(e)
                    }
                };
                let Some(error) = error else { break };
                let since = *stuck_since.get_or_insert_with(Instant::now);
                if since.elapsed() > args.timeout {
                    return Err(error.context(format!(
                        "{} orders not confirmed for {}",
                        pending.len(),
                        humantime::format_duration(args.timeout)
                    )));
                }
                eprintln!(
                    "chaos: {} orders not confirmed, publishing them again in {}ms: {}",
                    pending.len(),
                    backoff.as_millis(),
                    crate::chain(&error)
                );
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = shutdown.cancelled() => anyhow::bail!("interrupted"),
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
        Ok(())
    }
    .await;
    if let Some(client) = conn {
        client.close().await;
    }
    outcome
}

/// Publishes `ids` as orders on the open connection, opening one first when
/// there is none; the confirm of each.
async fn publish_orders(
    conn: &mut Option<sas_client::Client>,
    settings: &Settings,
    queues: &QueueNames,
    args: &Args,
    status_queue: &str,
    ids: &[Uuid],
) -> anyhow::Result<Vec<Result<(), sas_client::Error>>> {
    let client = match conn {
        Some(open) if open.is_connected() => open,
        _ => {
            if let Some(client) = conn.take() {
                client.close().await;
            }
            let client = sas_client::Client::connect_with(&settings.broker, "sasctl-chaos")
                .await
                .context("connecting to RabbitMQ")?;
            conn.insert(client)
        }
    };
    let batch: Vec<(Option<Uuid>, Vec<u8>)> = ids
        .iter()
        .map(|id| {
            let body = order_body(*id, &args.workflow, Map::new(), &Default::default());
            (Some(*id), body.to_string().into_bytes())
        })
        .collect();
    publish_batch(client, Some(status_queue), &batch)
        .await
        .with_context(|| format!("publishing to {}", queues.orders()))
}

/// Why reading stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReadStop {
    Complete,
    Deadline,
    Interrupted,
}

/// Reads the status queue into the tally until every confirmed order has
/// ended (then a little longer, see [`SETTLE_IDLE`]), `timeout` after the
/// submitter is done, or a signal. A lost connection is opened again: the
/// queue is durable, and what was delivered but not acknowledged comes again
/// (the tally deduplicates).
async fn read_events(
    settings: &Settings,
    queue: &str,
    tally: &RefCell<Tally>,
    submitted: watch::Receiver<Option<Instant>>,
    timeout: Duration,
    shutdown: &CancellationToken,
) -> anyhow::Result<ReadStop> {
    let stop = || {
        let mut submitted = submitted.clone();
        async move {
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = async {
                    let done = submitted.wait_for(Option::is_some).await.ok().and_then(|t| *t);
                    match done {
                        Some(at) => tokio::time::sleep_until((at + timeout).into()).await,
                        // The submitter is gone without a word: nothing more will come.
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
    };
    let stopped = || {
        if shutdown.is_cancelled() {
            ReadStop::Interrupted
        } else {
            ReadStop::Deadline
        }
    };
    'connect: loop {
        let connected = tokio::select! {
            connected = subscribe(settings, queue) => connected,
            () = stop() => return Ok(stopped()),
        };
        let (broker, mut consumer) = match connected {
            Ok(open) => open,
            Err(e) => {
                eprintln!("chaos: reading {queue}: {}; trying again", crate::chain(&e));
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => continue 'connect,
                    () = stop() => return Ok(stopped()),
                }
            }
        };
        loop {
            let end = read_queue(&mut consumer, queue, Some(READ_IDLE), stop(), |body| {
                let mut tally = tally.borrow_mut();
                tally.record(body);
                Ok(if tally.complete() {
                    Handled::Last
                } else {
                    Handled::Next
                })
            })
            .await;
            match end {
                Ok(ReadEnd::Handler) => break,
                Ok(ReadEnd::Idle) if tally.borrow().complete() => break,
                Ok(ReadEnd::Idle) => {}
                Ok(ReadEnd::Stopped) => {
                    broker.close().await;
                    drop(consumer);
                    return Ok(stopped());
                }
                Err(e) => {
                    eprintln!(
                        "chaos: reading {queue}: {}; connecting again",
                        crate::chain(&e)
                    );
                    broker.close().await;
                    drop(consumer);
                    continue 'connect;
                }
            }
        }
        // Every order ended: read on briefly for events that should not come.
        let settle = read_queue(
            &mut consumer,
            queue,
            Some(SETTLE_IDLE),
            async {
                tokio::select! {
                    () = tokio::time::sleep(SETTLE_MAX) => {}
                    () = shutdown.cancelled() => {}
                }
            },
            |body| {
                tally.borrow_mut().record(body);
                Ok(Handled::Next)
            },
        )
        .await;
        if let Err(e) = settle {
            eprintln!(
                "chaos: reading {queue} after the last order ended: {}",
                crate::chain(&e)
            );
        }
        // Closing the connection before dropping the consumer, as `watch` does.
        broker.close().await;
        drop(consumer);
        return Ok(ReadStop::Complete);
    }
}

/// A connection consuming `queue`.
async fn subscribe(
    settings: &Settings,
    queue: &str,
) -> anyhow::Result<(Broker, sas::broker::Consumer)> {
    let broker = Broker::connect(&settings.broker, "sasctl-chaos")
        .await
        .context("connecting to RabbitMQ")?;
    match broker.consume(queue, EVENT_PREFETCH, "sasctl-chaos").await {
        Ok(consumer) => Ok((broker, consumer)),
        Err(e) => {
            broker.close().await;
            Err(e).with_context(|| format!("consuming {queue}"))
        }
    }
}

/// Every `--kill-every`, kills a random service of `--services`: with
/// `--spawn` by SIGKILL, starting it again after a random pause of up to a
/// second (a crash, then a supervisor such as systemd bringing it back);
/// with `--kill-cmd` by running the command. With `--spawn` it also starts
/// again any service that exited by itself, and counts it.
async fn kill_services(
    args: &Args,
    mut fleet: Option<&mut Fleet>,
    kills: &Kills,
    mut finished: watch::Receiver<bool>,
    shutdown: &CancellationToken,
) {
    if fleet.is_none() && args.kill_every.is_none() {
        return;
    }
    let every = args.kill_every;
    let mut next_kill = every.map(|d| tokio::time::Instant::now() + d);
    let over = |finished: &watch::Receiver<bool>| *finished.borrow() || shutdown.is_cancelled();
    loop {
        if over(&finished) {
            return;
        }
        let kill_due = async {
            match next_kill {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = finished.changed() => continue,
            () = shutdown.cancelled() => return,
            () = kill_due => {}
            () = tokio::time::sleep(Duration::from_millis(250)) => {
                if let Some(fleet) = fleet.as_deref_mut() {
                    for (name, status) in fleet.exited() {
                        eprintln!("chaos: {name} exited by itself ({status}); starting it again");
                        bump(&kills.unexpected_exits);
                    }
                    if let Err(e) = fleet.restart_missing() {
                        eprintln!("chaos: {}", crate::chain(&e));
                    }
                }
                continue;
            }
        }
        next_kill = next_kill.zip(every).map(|(at, d)| at + d);
        let victim = &args.services[fastrand::usize(..args.services.len())];
        if let Some(fleet) = fleet.as_deref_mut() {
            match fleet.kill(victim).await {
                Ok(()) => {
                    bump(&kills.done);
                    let pause = Duration::from_millis(fastrand::u64(0..1000));
                    eprintln!(
                        "chaos: killed {victim} (SIGKILL); starting it again in {}ms",
                        pause.as_millis()
                    );
                    tokio::select! {
                        () = tokio::time::sleep(pause) => {}
                        () = shutdown.cancelled() => return,
                    }
                    if over(&finished) {
                        return;
                    }
                    if let Err(e) = fleet.restart_missing() {
                        eprintln!("chaos: {}", crate::chain(&e));
                    }
                }
                Err(e) => {
                    bump(&kills.failed);
                    eprintln!("chaos: {}", crate::chain(&e));
                }
            }
        } else if let Some(template) = &args.kill_cmd {
            eprintln!("chaos: killing {victim}");
            if run_kill_command(template, victim).await {
                bump(&kills.done);
            } else {
                bump(&kills.failed);
            }
        }
    }
}

/// A line on stderr every [`PROGRESS_EVERY`] until the reader is done.
async fn report_progress(
    orders: u32,
    tally: &RefCell<Tally>,
    kills: &Kills,
    started: Instant,
    mut finished: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = finished.wait_for(|done| *done) => return,
            () = tokio::time::sleep(PROGRESS_EVERY) => {}
        }
        let (confirmed, ended) = {
            let tally = tally.borrow();
            (tally.confirmed_count(), tally.ended_count())
        };
        eprintln!(
            "chaos: {:>4}s  submitted {confirmed}/{orders}  ended {ended}  kills {}",
            started.elapsed().as_secs(),
            kills.done.get()
        );
    }
}

/// Deletes the run's status queue; a failure is reported, not fatal.
async fn delete_queue(settings: &Settings, queue: &str) {
    let deleted = async {
        let broker = Broker::connect(&settings.broker, "sasctl-chaos").await?;
        let outcome = broker.delete_queues(&[queue.to_owned()]).await;
        broker.close().await;
        outcome
    }
    .await;
    if let Err(e) = deleted {
        eprintln!("chaos: could not delete the status queue {queue}: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn the_documented_soak_parses() {
        let args = parse(&[
            "--orders",
            "10000",
            "--workflow",
            "order",
            "--transient",
            "0.05",
            "--permanent",
            "0.01",
            "--sim",
            "http://127.0.0.1:8081/",
            "--kill-every",
            "3s",
            "--spawn",
            "target/release",
            "--timeout",
            "120s",
            "--rate",
            "500/s",
            "--json",
        ])
        .unwrap();
        assert!(args.check().is_ok());
        assert_eq!(args.orders, 10_000);
        assert_eq!(args.transient, Some(0.05));
        assert_eq!(args.sim.as_deref(), Some("http://127.0.0.1:8081"));
        assert_eq!(args.kill_every, Some(Duration::from_secs(3)));
        assert_eq!(args.rate, Some(500.0));
        assert_eq!(args.services, SERVICES);
        assert!(args.json);
        let args = parse(&["--orders", "1", "--workflow", "w"]).unwrap();
        assert_eq!(args.timeout, Duration::from_secs(600));
        assert!(args.check().is_ok());
    }

    #[test]
    fn bad_combinations_are_refused() {
        for bad in [
            &["--orders", "0", "--workflow", "w"][..],
            &["--orders", "1"],
            &["--orders", "1", "--workflow", "w", "--transient", "0.1"],
            &[
                "--orders",
                "1",
                "--workflow",
                "w",
                "--sim",
                "http://s",
                "--permanent",
                "1.5",
            ],
            &["--orders", "1", "--workflow", "w", "--sim", "s:8081"],
            &["--orders", "1", "--workflow", "w", "--kill-every", "0s"],
            &["--orders", "1", "--workflow", "w", "--rate", "0"],
            &[
                "--orders",
                "1",
                "--workflow",
                "w",
                "--spawn",
                "bin",
                "--kill-cmd",
                "x",
            ],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        for unchecked in [
            &["--orders", "1", "--workflow", "w", "--kill-every", "1s"][..],
            &["--orders", "1", "--workflow", "w", "--kill-cmd", "x"],
            &[
                "--orders",
                "1",
                "--workflow",
                "w",
                "--spawn",
                "bin",
                "--services",
                "agent,rabbitmq",
            ],
        ] {
            let args = parse(unchecked).unwrap();
            assert!(args.check().is_err(), "{unchecked:?}");
        }
        // A deployment of the user's own may name any service.
        let args = parse(&[
            "--orders",
            "1",
            "--workflow",
            "w",
            "--kill-cmd",
            "docker compose restart {service}",
            "--kill-every",
            "10s",
            "--services",
            "agent,rabbitmq",
        ])
        .unwrap();
        assert!(args.check().is_ok());
        assert_eq!(args.services, ["agent", "rabbitmq"]);
    }
}

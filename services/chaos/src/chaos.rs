//! `sas-chaos`: a soak run. Submits N orders with a mix of transient and
//! permanent remote faults (set on a remote-sim) while services are killed at
//! random, reads every order's status events, and prints one verdict: orders
//! per terminal state, orders lost, sequence gaps, orders with more than one
//! terminal event, effects applied twice. Exit code 0 only when none was lost
//! or doubled.
//!
//! With `--hostile SHARE`, that share of the messages sent are hostile
//! ([`hostile`]: bodies sas must refuse, its own queue names as reply
//! queues, good orders' ids with other payloads, garbage on its internal
//! queues, large headers), sent among the good orders. The verdict then
//! also says what became of each hostile message (dead-lettered, rejected,
//! ignored as a duplicate: [`letters`] takes the run's own out of the
//! dead-letter queues) and how many good orders were harmed, which must be
//! none.
//!
//! It runs against the configured deployment as sasctl does, or
//! starts the services itself (`--spawn`). Three things run side by side:
//! the submitter, the reader of the run's status queue and the killer. They
//! share one task, so they share state through `Cell`s without locks.

mod faults;
mod hostile;
mod letters;
mod processes;
mod report;

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::value_parser;
use sas::broker::{Broker, Outgoing, PublishError, Publisher};
use sas::config::Settings;
use sas::state_store::StateStore;
use sas::topology::QueueNames;
use serde_json::Map;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use faults::Sim;
use hostile::{Aim, Fate, Planned, Sent};
use processes::{Fleet, SERVICES, run_kill_command};
use report::{HostileFacts, RunFacts, Tally};
use sasctl::Exit;
use sasctl::submit::{CHUNK, no_orders_queue_hint, order_body, publish_batch};
use sasctl::watch::{Handled, ReadEnd, read_queue};

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

/// How long, after every good order ended, the run waits for its hostile
/// messages to reach the dead-letter queues.
const HOSTILE_SETTLE_MAX: Duration = Duration::from_secs(60);

/// What a sas service logs when it lost its RabbitMQ connection
/// (`sas::broker::run_sessions`); a killed service logs nothing of the kind.
const CONNECTION_LOST: &str = "lost RabbitMQ; reconnecting";

/// Options of `sas-chaos`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Examples:
  # The whole suite started by sas-chaos, against a remote-sim whose URLs the configuration uses:
  sas-chaos --spawn target/release --sim http://127.0.0.1:8081 --workflow order \\
      --orders 10000 --transient 0.05 --permanent 0.01 --kill-every 3s
  # Your own deployment (docker compose), killing a random service every 10 s:
  sas-chaos --workflow order --orders 1000 --sim http://127.0.0.1:8081 --kill-every 10s \\
      --kill-cmd 'docker compose kill -s KILL {service} && docker compose up -d {service}'
  # One message in five hostile, repeatably:
  sas-chaos --spawn target/release --workflow order --orders 1000 --hostile 0.2 --seed 7

Exit code 0 when no order was lost, none has a gap in its seq or two terminal
events, and no effect was applied twice; with --hostile, also when no good
order was harmed, every hostile message is accounted for, and no spawned
service exited or lost its connection; 1 otherwise.")]
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
    /// Share of all the messages sent that are hostile, from 0 (none, the
    /// default) up to but not including 1: 0.2 sends one hostile message
    /// for every four good orders. They are dead-lettered, rejected or
    /// ignored by sas, and taken out of the dead-letter queues at the end.
    #[arg(long, value_name = "SHARE", default_value_t = 0.0, value_parser = parse_share)]
    hostile: f64,
    /// Seed of the hostile messages: the same seed sends the same messages
    /// (the good orders they aim at are picked as the run goes). Printed
    /// when drawn.
    #[arg(long, value_name = "N", requires = "hostile")]
    seed: Option<u64>,
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

/// `--hostile`: a share of the messages, at least 0 and below 1 (at 1
/// there would be no good order to harm).
fn parse_share(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if (0.0..1.0).contains(&s) => Ok(s),
        _ => Err(
            "a share of the messages sent, at least 0 and below 1 (e.g. 0.2: one in five)".into(),
        ),
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

/// Runs `sas-chaos`. `config` is the configuration file it read, handed
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
    // Beside the prefix, not under it: names under `<prefix>.` are sas's own
    // and refused as a reply queue (contract §1b).
    let status_queue = format!("{}-chaos.{run_id}", settings.broker.prefix);
    let faults = (args.transient.unwrap_or(0.0), args.permanent.unwrap_or(0.0));
    let hostile = if args.hostile > 0.0 {
        Some(Hostile::new(
            &args,
            settings,
            args.hostile,
            &run_id,
            &status_queue,
        )?)
    } else {
        None
    };

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
        soak(
            &args,
            settings,
            &status_queue,
            fleet.as_mut(),
            hostile.as_ref(),
            &shutdown,
        )
        .await
    }
    .await;

    // While the services still run: the hostile messages still on their way
    // reach the dead-letter queues.
    let mut hostile_facts = None;
    if let (Some(h), Ok(soak)) = (&hostile, &soaked) {
        // A service killed last may still be down (the killer stops with
        // the reader): its messages would wait for it.
        if let Some(fleet) = &mut fleet
            && let Err(e) = fleet.restart_missing()
        {
            eprintln!("chaos: {}", sasctl::chain(&e));
        }
        hostile_facts = Some(settle_hostile(settings, h, soak, fleet.as_ref(), &shutdown).await);
        if let Some(fleet) = &mut fleet {
            for (name, status) in fleet.exited() {
                eprintln!("chaos: {name} exited by itself ({status})");
                bump(&soak.kills.unexpected_exits);
            }
        }
    }

    // Stop the services first: an effect applied twice would be applied by them.
    if let Some(fleet) = &mut fleet {
        eprintln!("chaos: stopping the services");
        fleet.stop().await;
    }
    let mut effects = None;
    let mut sim_error = None;
    if let (Some(sim), Ok(soak)) = (&sim, &soaked) {
        let undoable: Vec<String> = settings
            .workflows
            .get(&args.workflow)
            .map(|w| {
                w.steps
                    .iter()
                    .filter(|s| s.compensate.is_some())
                    .map(|s| s.name.clone())
                    .collect()
            })
            .unwrap_or_default();
        match sim.effects(soak.tally.confirmed_ids(), &undoable).await {
            Ok(found) => effects = Some(found),
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
        effects,
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
        hostile: hostile_facts,
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
    /// The hostile messages the broker took.
    sent: Vec<Sent>,
    /// Hostile messages that could not be published.
    unsent: u64,
    /// Ready messages in each dead-letter queue before the run sent anything.
    dead_baseline: HashMap<String, u32>,
}

/// The hostile traffic of a run (`--hostile`).
struct Hostile {
    share: f64,
    seed: u64,
    aim: Aim,
    /// The messages, in sending order.
    plan: Vec<Planned>,
    /// Where they may be dead-lettered.
    dead_queues: Vec<String>,
}

impl Hostile {
    /// The plan for `share` of hostile messages among the run's orders,
    /// from `--seed` or a drawn one (printed, so the run can be repeated).
    fn new(
        args: &Args,
        settings: &Settings,
        share: f64,
        run_id: &str,
        status_queue: &str,
    ) -> anyhow::Result<Self> {
        let agent = settings
            .workflows
            .get(&args.workflow)
            .and_then(|w| {
                w.steps
                    .iter()
                    .find_map(|s| s.agent.clone().filter(|a| !a.is_empty()))
            })
            .ok_or_else(|| Exit {
                code: 2,
                message: format!(
                    "--hostile: workflow {:?} has no step with an agent to send garbage to",
                    args.workflow
                ),
            })?;
        let seed = args.seed.unwrap_or_else(|| fastrand::u64(..));
        let queues = QueueNames::new(&settings.broker.prefix);
        let aim = Aim {
            queues: queues.clone(),
            workflow: args.workflow.clone(),
            agent: agent.clone(),
            status_queue: status_queue.to_owned(),
            max_body_bytes: settings.submission.max_body_bytes,
            run_id: run_id.to_owned(),
        };
        let plan = hostile::plan(seed, args.orders, share);
        eprintln!(
            "chaos: {} hostile messages among the {} orders ({}%), seed {seed} (--seed {seed} sends them again)",
            plan.len(),
            args.orders,
            report::round(share * 100.0, 3)
        );
        Ok(Self {
            share,
            seed,
            dead_queues: letters::dead_queues(&queues, &agent),
            aim,
            plan,
        })
    }
}

/// Submits the orders, reads their events and kills services, side by side,
/// until every order has ended, the timeout passes or a signal comes.
async fn soak(
    args: &Args,
    settings: &Settings,
    status_queue: &str,
    fleet: Option<&mut Fleet>,
    hostile: Option<&Hostile>,
    shutdown: &CancellationToken,
) -> anyhow::Result<Soak> {
    // The status queue first: events for a queue that does not exist are dropped.
    let broker = Broker::connect(&settings.broker, "sasctl-chaos")
        .await
        .context("connecting to RabbitMQ")?;
    let declared = broker.declare_status_queue(status_queue).await;
    // What the dead-letter queues hold before the run adds to them.
    let dead_baseline = match (&declared, hostile) {
        (Ok(()), Some(h)) => letters::ready(&broker, &h.dead_queues).await,
        _ => Ok(HashMap::new()),
    };
    broker.close().await;
    declared.with_context(|| format!("declaring the status queue {status_queue}"))?;
    let dead_baseline = dead_baseline?;

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

    let mut sender = hostile.map(HostileSender::new);
    let submitter = async {
        let outcome = submit_orders(
            args,
            settings,
            status_queue,
            &ids,
            &tally,
            sender.as_mut(),
            shutdown,
        )
        .await;
        if let Err(e) = &outcome {
            eprintln!("chaos: submitting stopped: {}", sasctl::chain(e));
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
    let (sent, unsent) = sender.map_or((Vec::new(), 0), |s| (s.sent, s.unsent));
    Ok(Soak {
        tally: tally.into_inner(),
        kills,
        started,
        elapsed,
        interrupted: end == ReadStop::Interrupted,
        sent,
        unsent,
        dead_baseline,
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
    mut hostile: Option<&mut HostileSender<'_>>,
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
            let before = u32::try_from(n * chunk).unwrap_or(u32::MAX);
            send_hostile(hostile.as_deref_mut(), settings, before, tally).await;
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
                    sasctl::chain(&error)
                );
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = shutdown.cancelled() => anyhow::bail!("interrupted"),
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
        if let Some(sender) = hostile {
            sender
                .finish(settings, tally, args.timeout, shutdown)
                .await?;
        }
        Ok(())
    }
    .await;
    if let Some(client) = conn {
        client.close().await;
    }
    outcome
}

/// The open connection, or a new one when there is none or it is down.
async fn connected<'c>(
    conn: &'c mut Option<sas_client::Client>,
    settings: &Settings,
) -> anyhow::Result<&'c sas_client::Client> {
    if !conn.as_ref().is_some_and(sas_client::Client::is_connected) {
        if let Some(client) = conn.take() {
            client.close().await;
        }
        let options = sas::broker::client_options(&settings.broker, "sasctl-chaos")?;
        let client = sas_client::Client::connect_with(options)
            .await
            .context("connecting to RabbitMQ")?;
        *conn = Some(client);
    }
    // Set just above when it was not.
    conn.as_ref().context("no connection to RabbitMQ")
}

/// Sends the hostile messages due once `confirmed` good orders are in; a
/// failure is told, and what was not sent goes with the next chunk.
async fn send_hostile(
    sender: Option<&mut HostileSender<'_>>,
    settings: &Settings,
    confirmed: u32,
    tally: &RefCell<Tally>,
) {
    let Some(sender) = sender else { return };
    let sent = sender.send_due(settings, confirmed, tally).await;
    if let Err(e) = sent {
        eprintln!(
            "chaos: sending hostile messages: {}; trying again later",
            sasctl::chain(&e)
        );
    }
}

/// Sends a run's hostile messages as their turn comes, between the chunks
/// of good orders, through sas's own publisher.
struct HostileSender<'h> {
    hostile: &'h Hostile,
    /// The first planned message not yet due.
    next: usize,
    /// Due messages not sent yet: waiting for a good order to aim at, or
    /// for a connection.
    waiting: VecDeque<&'h Planned>,
    /// Picks the good orders aimed at; seeded, though which orders run at
    /// a given moment is up to timing.
    rng: fastrand::Rng,
    /// A connection of its own (sas's broker code, which writes any
    /// message whole) and a confirm channel on it.
    broker: Option<(Broker, Publisher)>,
    sent: Vec<Sent>,
    unsent: u64,
}

impl<'h> HostileSender<'h> {
    fn new(hostile: &'h Hostile) -> Self {
        Self {
            hostile,
            next: 0,
            waiting: VecDeque::new(),
            rng: fastrand::Rng::with_seed(hostile.seed.wrapping_add(1)),
            broker: None,
            sent: Vec::new(),
            unsent: 0,
        }
    }

    /// Whether every planned message was sent or given up.
    fn done(&self) -> bool {
        self.next == self.hostile.plan.len() && self.waiting.is_empty()
    }

    /// Publishes, with confirms, the messages due once `confirmed` good
    /// orders are in, except those that need a good order to aim at while
    /// none has started. A message the broker did not take waits for the
    /// next call, but for one it can never take (counted unsent).
    async fn send_due(
        &mut self,
        settings: &Settings,
        confirmed: u32,
        tally: &RefCell<Tally>,
    ) -> anyhow::Result<()> {
        while let Some(p) = self.hostile.plan.get(self.next)
            && p.after <= confirmed
        {
            self.waiting.push_back(p);
            self.next += 1;
        }
        if self.waiting.is_empty() {
            return Ok(());
        }
        let (broker, publisher) = match self.broker.take() {
            Some((broker, open)) if broker.is_connected() && open.is_open() => (broker, open),
            stale => {
                if let Some((broker, _)) = stale {
                    broker.close().await;
                }
                let broker = Broker::connect(&settings.broker, "sasctl-chaos-hostile")
                    .await
                    .context("connecting to RabbitMQ")?;
                let publisher = broker.publisher().await.context("opening a channel")?;
                (broker, publisher)
            }
        };
        let frame_max = broker.frame_max();
        self.broker = Some((broker, publisher.clone()));
        let mut batch = Vec::new();
        for _ in 0..self.waiting.len() {
            let Some(p) = self.waiting.pop_front() else {
                break;
            };
            let target = if p.class.needs_target() {
                let picked = tally.borrow().pick_started(&mut self.rng);
                let Some(target) = picked else {
                    self.waiting.push_back(p);
                    continue;
                };
                Some(target)
            } else {
                None
            };
            let message = p.make(&self.hostile.aim, target, frame_max);
            // Known to the reader before any answer can come.
            let mut tally = tally.borrow_mut();
            if let Some(id) = message.hostile_id {
                tally.hostile(id);
            }
            if let Some(id) = target {
                tally.targeted(id);
            }
            batch.push((p, message));
        }
        // All sent, then all confirms read: one round trip, not one each.
        let mut pending = Vec::with_capacity(batch.len());
        for (_, m) in &batch {
            let headers: Vec<(&str, &str)> = m
                .headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let outgoing = Outgoing {
                exchange: &m.exchange,
                routing_key: &m.routing_key,
                body: &m.body,
                reply_to: m.reply_to.as_deref(),
                message_id: Some(&m.message_id),
                headers: &headers,
                mandatory: true,
                ..Outgoing::default()
            };
            pending.push(publisher.send(&outgoing).await);
        }
        let mut failure = None;
        for ((p, m), sent) in batch.into_iter().zip(pending) {
            let confirmed = match sent {
                Ok(confirm) => confirm.wait().await,
                Err(e) => Err(e),
            };
            match confirmed {
                Ok(()) => self.sent.push(m.sent()),
                Err(e @ (PublishError::Unroutable(_) | PublishError::Invalid(_))) => {
                    eprintln!(
                        "chaos: hostile message {} ({}) not sent: {e}",
                        m.n,
                        m.class.as_str()
                    );
                    self.unsent += 1;
                }
                Err(e) => {
                    // Maybe taken, maybe not: sent again, and found once.
                    self.waiting.push_back(p);
                    failure = Some(e);
                }
            }
        }
        match failure {
            Some(e) => {
                if let Some((broker, _)) = self.broker.take() {
                    broker.close().await;
                }
                Err(anyhow::Error::new(e).context("publishing hostile messages"))
            }
            None => Ok(()),
        }
    }

    /// Sends what is left once the good orders are all in, waiting (up to
    /// `timeout`) for a good order to aim at; what is still not sent then
    /// is counted unsent.
    async fn finish(
        &mut self,
        settings: &Settings,
        tally: &RefCell<Tally>,
        timeout: Duration,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            send_hostile(Some(self), settings, u32::MAX, tally).await;
            if self.done() {
                return Ok(());
            }
            if Instant::now() > deadline {
                let left = self.waiting.len() + self.hostile.plan.len() - self.next;
                eprintln!(
                    "chaos: {left} hostile messages not sent within {}",
                    humantime::format_duration(timeout)
                );
                self.unsent += left as u64;
                return Ok(());
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
                () = shutdown.cancelled() => anyhow::bail!("interrupted"),
            }
        }
    }
}

/// What became of the hostile messages: waits (a bounded time) for the
/// orders queue to empty and for the messages to reach the dead-letter
/// queues, takes the run's out of them, reads the targeted good orders'
/// payloads from the state store, and counts the spawned services' lost
/// connections. A failure is told and leaves its part unknown.
async fn settle_hostile(
    settings: &Settings,
    hostile: &Hostile,
    soak: &Soak,
    fleet: Option<&Fleet>,
    shutdown: &CancellationToken,
) -> HostileFacts {
    let deadline = Instant::now() + HOSTILE_SETTLE_MAX;
    let mut seen = hostile::Seen::default();
    eprintln!("chaos: accounting for the hostile messages");
    match letters::emptied(settings, hostile.aim.queues.orders(), deadline, shutdown).await {
        Ok(emptied) => seen.orders_drained = emptied,
        Err(e) => eprintln!("chaos: watching the orders queue: {}", sasctl::chain(&e)),
    }
    let expected: HashSet<u32> = soak
        .sent
        .iter()
        .filter(|s| matches!(s.fate, Fate::DeadLetter(_)))
        .map(|s| s.n)
        .collect();
    let found = letters::take_out(
        settings,
        &hostile.aim.run_id,
        &hostile.dead_queues,
        &soak.dead_baseline,
        &expected,
        deadline,
        shutdown,
    )
    .await;
    match found {
        Ok(taken) => {
            eprintln!(
                "chaos: took {} hostile messages ({} copies) out of the dead-letter queues",
                taken.found.len(),
                taken.copies
            );
            seen.dead_lettered = taken.found;
        }
        Err(e) => eprintln!(
            "chaos: taking the hostile messages out of the dead-letter queues: {}",
            sasctl::chain(&e)
        ),
    }
    let mut payload_check_error = None;
    match foreign_payloads(settings, soak.tally.targeted_ids()).await {
        Ok(foreign) => {
            seen.foreign_payload = foreign;
            seen.payloads_checked = true;
        }
        Err(e) => payload_check_error = Some(sasctl::chain(&e)),
    }
    HostileFacts {
        share: hostile.share,
        seed: hostile.seed,
        sent: soak.sent.clone(),
        unsent: soak.unsent,
        seen,
        payload_check_error,
        connections_lost: fleet.map(|f| f.count_in_logs(CONNECTION_LOST)),
    }
}

/// The good orders among `targets` whose stored payload is not their own:
/// a hostile copy's (it carries [`hostile::MARKER`]), or none at all.
async fn foreign_payloads(
    settings: &Settings,
    targets: &HashSet<Uuid>,
) -> anyhow::Result<HashSet<Uuid>> {
    if targets.is_empty() {
        return Ok(HashSet::new());
    }
    let store = StateStore::connect(&settings.database, "sasctl-chaos")
        .await
        .context("connecting to Postgres")?;
    let mut foreign = HashSet::new();
    let checked = async {
        for id in targets {
            let details = store
                .order_details(*id)
                .await
                .with_context(|| format!("reading order {id}"))?;
            let own =
                details.is_some_and(|(order, _, _)| order.payload.get(hostile::MARKER).is_none());
            if !own {
                foreign.insert(*id);
            }
        }
        anyhow::Ok(())
    }
    .await;
    store.close().await;
    checked.map(|()| foreign)
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
    let client = connected(conn, settings).await?;
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
                eprintln!(
                    "chaos: reading {queue}: {}; trying again",
                    sasctl::chain(&e)
                );
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
                        sasctl::chain(&e)
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
                sasctl::chain(&e)
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
                        eprintln!("chaos: {}", sasctl::chain(&e));
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
                        eprintln!("chaos: {}", sasctl::chain(&e));
                    }
                }
                Err(e) => {
                    bump(&kills.failed);
                    eprintln!("chaos: {}", sasctl::chain(&e));
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
    fn hostile_traffic_is_a_share_below_one_with_an_optional_seed() {
        let base = ["--orders", "4", "--workflow", "w"];
        let with = |extra: &[&str]| parse(&[&base[..], extra].concat());
        let args = with(&[]).unwrap();
        assert_eq!(args.hostile, 0.0);
        assert_eq!(args.seed, None);
        let args = with(&["--hostile", "0.2", "--seed", "7"]).unwrap();
        assert_eq!(args.hostile, 0.2);
        assert_eq!(args.seed, Some(7));
        assert_eq!(with(&["--hostile", "0"]).unwrap().hostile, 0.0);
        for bad in ["1", "1.5", "-0.1", "NaN", "a fifth"] {
            let e = with(&[&format!("--hostile={bad}")])
                .unwrap_err()
                .to_string();
            assert!(e.contains("at least 0 and below 1"), "{bad}: {e}");
        }
        // A seed says which hostile messages: none without --hostile.
        assert!(with(&["--seed", "7"]).is_err());
        assert!(with(&["--hostile", "0.1", "--seed", "x"]).is_err());
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

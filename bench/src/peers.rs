//! The peers, doing the same work in the same run: Celery (RabbitMQ broker,
//! `acks_late`, results in Postgres or over `rpc://`), procrastinate
//! (Postgres only) and DBOS Transact (Postgres only; Restate is in
//! [`crate::restate`]). Each step is one HTTP POST to the same remote-sim with
//! an `Idempotency-Key`; three steps are a Celery chain, a procrastinate job
//! deferring the next, or three `@DBOS.step` calls of one DBOS workflow. The
//! Python side is in `bench/peers/`; it runs in a virtualenv this module
//! creates (git-ignored, `.bench/venv`).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use tokio::process::{Child, Command};

use crate::load::Percentiles;
use crate::procs::{self, CpuUse, Group};
use crate::suite::{Env, Sim};

/// How the peers run.
#[derive(Debug, Clone)]
pub struct PeerOptions {
    /// The Python that creates the virtualenv.
    pub python: String,
    pub venv: PathBuf,
    /// `bench/peers`.
    pub dir: PathBuf,
    /// Celery prefork processes.
    pub celery_concurrency: usize,
    /// procrastinate worker processes, and jobs each runs at once.
    pub procrastinate_workers: usize,
    pub procrastinate_concurrency: usize,
    /// DBOS worker processes, and workflows each runs at once.
    pub dbos_workers: usize,
    pub dbos_concurrency: usize,
}

/// What one peer run measured.
#[derive(Debug, Clone, Serialize)]
pub struct PeerResult {
    /// E.g. `celery (postgres results)`.
    pub system: String,
    pub workflow: String,
    pub orders: usize,
    /// The asked rate (orders/s), or null for full load.
    pub offered_rate: Option<f64>,
    pub completed: usize,
    pub failed: usize,
    /// What went wrong, as it happened (e.g. `BacklogLimitExceeded`).
    pub error: Option<String>,
    pub submit_s: f64,
    pub elapsed_s: Option<f64>,
    pub throughput: Option<f64>,
    pub latency_ms: Percentiles,
    pub cpu: Option<CpuUse>,
    pub cpu_ms_per_order: std::collections::BTreeMap<String, f64>,
    /// Peak memory of the worker processes (summed over each worker's tree), MiB.
    pub worker_peak_mib: f64,
    /// The same, per process group where there are several (Restate's server
    /// and service), MiB.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub peak_mib: std::collections::BTreeMap<String, f64>,
    /// How it was run.
    pub setup: String,
}

#[derive(Deserialize)]
pub(crate) struct DriverResult {
    pub completed: usize,
    pub failed: usize,
    pub error: Option<String>,
    pub submit_s: f64,
    pub elapsed_s: Option<f64>,
    pub latencies_ms: Vec<f64>,
    /// CPU seconds the driver itself used while submitting and waiting (a
    /// process of its own; 0 for a driver inside sas-bench).
    #[serde(default)]
    pub cpu_s: f64,
}

/// Creates the virtualenv and installs `requirements.txt` unless already done.
pub async fn ensure_venv(o: &PeerOptions) -> anyhow::Result<()> {
    let requirements = o.dir.join("requirements.txt");
    let wanted = std::fs::read_to_string(&requirements)
        .with_context(|| format!("reading {}", requirements.display()))?;
    let stamp = o.venv.join(".sas-bench-requirements");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) {
        return Ok(());
    }
    if !o.venv.join("bin/python").exists() {
        eprintln!("peers: creating {}", o.venv.display());
        let ok = Command::new(&o.python)
            .args(["-m", "venv"])
            .arg(&o.venv)
            .status()
            .await?;
        if !ok.success() {
            bail!("`{} -m venv` failed", o.python);
        }
    }
    eprintln!("peers: installing {}", requirements.display());
    let ok = Command::new(o.venv.join("bin/pip"))
        .args(["install", "--quiet", "--disable-pip-version-check", "-r"])
        .arg(&requirements)
        .status()
        .await?;
    if !ok.success() {
        bail!("pip install -r {} failed", requirements.display());
    }
    std::fs::write(&stamp, wanted)?;
    Ok(())
}

/// Versions of the installed peers, for the report.
pub async fn versions(o: &PeerOptions) -> String {
    let out = Command::new(o.venv.join("bin/python"))
        .args([
            "-c",
            "import sys; from importlib.metadata import version as v; \
             print(f'Python {sys.version.split()[0]}, Celery {v(\"celery\")}, kombu {v(\"kombu\")}, \
             SQLAlchemy {v(\"SQLAlchemy\")}, procrastinate {v(\"procrastinate\")}, DBOS {v(\"dbos\")}')",
        ])
        .output()
        .await;
    match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_owned(),
        _ => "unknown".into(),
    }
}

/// The process groups of the workers started and not yet stopped, for
/// [`kill_all`] after an error or Ctrl-C.
static GROUPS: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

/// SIGKILLs every worker process group still registered.
pub async fn kill_all() {
    let groups = std::mem::take(&mut *GROUPS.lock().unwrap_or_else(|p| p.into_inner()));
    for g in groups {
        signal_group(g, "KILL").await;
    }
}

/// A worker process group we started.
pub(crate) struct Worker {
    pub child: Child,
    pub pid: u32,
}

impl Worker {
    pub fn spawn(mut cmd: Command, log: &Path) -> anyhow::Result<Self> {
        let log = std::fs::File::create(log)?;
        let child = cmd
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0)
            .kill_on_drop(true)
            .spawn()?;
        let pid = child.id().context("worker pid")?;
        GROUPS.lock().unwrap_or_else(|p| p.into_inner()).push(pid);
        Ok(Self { child, pid })
    }

    /// SIGTERM to the worker's process group, then SIGKILL after `grace`.
    pub async fn stop(mut self, grace: Duration) {
        signal_group(self.pid, "TERM").await;
        if tokio::time::timeout(grace, self.child.wait())
            .await
            .is_err()
        {
            signal_group(self.pid, "KILL").await;
            self.child.wait().await.ok();
        }
        // Pool processes that outlived their parent.
        signal_group(self.pid, "KILL").await;
        GROUPS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|g| *g != self.pid);
    }
}

async fn signal_group(pgid: u32, sig: &str) {
    Command::new("kill")
        .arg(format!("-{sig}"))
        .arg("--")
        .arg(format!("-{pgid}"))
        .stderr(Stdio::null())
        .status()
        .await
        .ok();
}

pub(crate) async fn wait_for_file(
    path: &Path,
    workers: &mut [Worker],
    what: &str,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if path.exists() {
            return Ok(());
        }
        for w in workers.iter_mut() {
            if let Some(status) = w.child.try_wait()? {
                bail!("{what} exited with {status} before it was ready");
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("{what} not ready within 60 s")
}

/// One peer run: the work and the load.
#[derive(Debug, Clone, Copy)]
pub struct PeerRun<'a> {
    pub workflow: &'a str,
    pub steps: usize,
    pub orders: usize,
    /// Orders per second; `None` is full load.
    pub rate: Option<f64>,
    pub timeout: Duration,
}

impl PeerRun<'_> {
    pub fn tag(&self) -> String {
        match self.rate {
            Some(_) => format!("{}-low", self.workflow),
            None => self.workflow.to_owned(),
        }
    }
}

/// A peer's process groups, with the harness itself and remote-sim beside
/// them, as every run counts them.
pub fn with_bench_and_sim(sim: &Sim, mut groups: Vec<Group>) -> Vec<Group> {
    groups.push(Group {
        name: "bench".into(),
        roots: vec![std::process::id()],
    });
    groups.push(Group {
        name: "remote-sim".into(),
        roots: sim.pid().into_iter().collect(),
    });
    groups
}

/// Runs the driver to completion and reads its result.
async fn drive(
    o: &PeerOptions,
    script: &str,
    envs: &[(String, String)],
    extra: &[&str],
    run: &PeerRun<'_>,
    dir: &Path,
) -> anyhow::Result<DriverResult> {
    let (steps, orders, timeout) = (run.steps, run.orders, run.timeout);
    let (out, log) = (dir.join("result.json"), dir.join("driver.log"));
    let mut cmd = Command::new(o.venv.join("bin/python"));
    cmd.current_dir(&o.dir)
        .arg(script)
        .args(["drive", "--steps", &steps.to_string()])
        .args(["--orders", &orders.to_string()])
        .args(["--timeout", &timeout.as_secs().to_string()])
        .args(["--rate", &run.rate.unwrap_or(0.0).to_string()])
        .args(extra)
        .arg("--out")
        .arg(&out)
        .envs(envs.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .kill_on_drop(true);
    let mut child = cmd.spawn().context("starting the peer driver")?;
    let status = tokio::time::timeout(timeout + Duration::from_secs(120), child.wait())
        .await
        .context("the peer driver did not finish")??;
    if !status.success() {
        bail!("the peer driver failed ({status}); see {}", log.display());
    }
    let text = std::fs::read_to_string(&out).context("reading the driver's result")?;
    Ok(serde_json::from_str(&text)?)
}

/// Which result backend Celery uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CeleryBackend {
    /// `db+postgresql://`; the driver polls the result table.
    Postgres,
    /// `rpc://`; the driver waits for each order's result with `AsyncResult.get()`.
    Rpc,
    /// `rpc://`; the driver collects all results with `ResultSet.join_native()`.
    RpcJoin,
}

impl CeleryBackend {
    fn label(self) -> &'static str {
        match self {
            Self::Postgres => "postgres",
            Self::Rpc => "rpc",
            Self::RpcJoin => "rpc-join",
        }
    }

    /// How the report names the system.
    pub fn system(self) -> &'static str {
        match self {
            Self::Postgres => "celery (postgres results)",
            Self::Rpc => "celery (rpc results)",
            Self::RpcJoin => "celery (rpc results, join_native)",
        }
    }
}

pub(crate) fn result_of(
    system: String,
    run: &PeerRun<'_>,
    r: DriverResult,
    cpu: Option<CpuUse>,
    worker_peak_mib: f64,
    setup: String,
) -> PeerResult {
    let cpu = cpu.map(|mut c| {
        // The driver is the application: count it apart from `other`.
        if let Some(other) = c.cpu_s.get_mut("other") {
            *other = (*other - r.cpu_s).max(0.0);
        }
        c.cpu_s.insert("driver".into(), r.cpu_s);
        c
    });
    let throughput = r
        .elapsed_s
        .filter(|e| *e > 0.0)
        .map(|e| r.completed as f64 / e);
    let cpu_ms_per_order = cpu
        .as_ref()
        .map(|c| c.per_order_ms(r.completed))
        .unwrap_or_default();
    PeerResult {
        system,
        workflow: run.workflow.into(),
        orders: run.orders,
        offered_rate: run.rate,
        completed: r.completed,
        failed: r.failed,
        error: r.error,
        submit_s: r.submit_s,
        elapsed_s: r.elapsed_s,
        throughput,
        latency_ms: Percentiles::of(r.latencies_ms),
        cpu,
        cpu_ms_per_order,
        worker_peak_mib,
        peak_mib: Default::default(),
        setup,
    }
}

/// Celery: one worker (prefork) and a driver that submits the orders and waits.
pub async fn celery(
    env: &Env,
    sim: &Sim,
    o: &PeerOptions,
    backend: CeleryBackend,
    run: &PeerRun<'_>,
) -> anyhow::Result<PeerResult> {
    let tag = format!("celery-{}-{}", backend.label(), run.tag());
    let dir = env.work_dir.join(&tag);
    std::fs::create_dir_all(&dir)?;
    let queue = format!("sasbench{}.{tag}", env.run_id);
    let db_name = format!("sasbench_{}_celery", env.run_id);
    let backend_url = match backend {
        CeleryBackend::Rpc | CeleryBackend::RpcJoin => "rpc://".to_owned(),
        CeleryBackend::Postgres => {
            let url = env.postgres.create(&db_name).await?;
            format!("db+{}", url.replacen("postgres://", "postgresql://", 1))
        }
    };
    let ready = dir.join("ready");
    let collect: &[&str] = match backend {
        CeleryBackend::RpcJoin => &["--collect", "join"],
        _ => &["--collect", "get"],
    };
    let envs: Vec<(String, String)> = vec![
        ("BENCH_AMQP".into(), env.amqp.clone()),
        ("BENCH_BACKEND".into(), backend_url),
        ("BENCH_QUEUE".into(), queue.clone()),
        ("BENCH_SIM".into(), sim.url()),
        ("BENCH_PATH".into(), tag.clone()),
        ("BENCH_READY_FILE".into(), ready.display().to_string()),
    ];
    let outcome = async {
        let mut cmd = Command::new(o.venv.join("bin/celery"));
        cmd.current_dir(&o.dir)
            .args(["-A", "celery_bench", "worker", "--pool", "prefork"])
            .args(["--concurrency", &o.celery_concurrency.to_string()])
            .args(["--queues", &queue])
            .args([
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ])
            .args(["--loglevel", "WARNING"])
            .envs(envs.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let mut workers = vec![Worker::spawn(cmd, &dir.join("worker.log"))?];
        let result = async {
            wait_for_file(&ready, &mut workers, "celery worker").await?;
            let groups = with_bench_and_sim(
                sim,
                vec![Group {
                    name: "celery-worker".into(),
                    roots: vec![workers[0].pid],
                }],
            );
            let before = procs::snapshot(&groups);
            let r = drive(o, "celery_bench.py", &envs, collect, run, &dir).await?;
            let after = procs::snapshot(&groups);
            let peak = procs::tree_peak_mib(workers[0].pid);
            Ok::<_, anyhow::Error>((r, after.since(&before), peak))
        }
        .await;
        for w in workers {
            w.stop(Duration::from_secs(20)).await;
        }
        result
    }
    .await;
    env.delete_queues(std::slice::from_ref(&queue)).await;
    delete_exchanges(env, std::slice::from_ref(&queue)).await;
    if backend == CeleryBackend::Postgres {
        env.drop_db(&db_name).await;
    }
    let (r, cpu, peak) = outcome?;
    let setup = format!(
        "prefork {} processes, acks_late, prefetch multiplier 4",
        o.celery_concurrency
    );
    Ok(result_of(
        backend.system().to_owned(),
        run,
        r,
        Some(cpu),
        peak,
        setup,
    ))
}

/// procrastinate: workers and a driver against a fresh database.
pub async fn procrastinate(
    env: &Env,
    sim: &Sim,
    o: &PeerOptions,
    run: &PeerRun<'_>,
) -> anyhow::Result<PeerResult> {
    let tag = format!("procrastinate-{}", run.tag());
    let dir = env.work_dir.join(&tag);
    std::fs::create_dir_all(&dir)?;
    let db_name = format!("sasbench_{}_procrastinate", env.run_id);
    let dsn = env
        .postgres
        .create(&db_name)
        .await?
        .replacen("postgres://", "postgresql://", 1);
    let base: Vec<(String, String)> = vec![
        ("BENCH_DSN".into(), dsn),
        ("BENCH_SIM".into(), sim.url()),
        ("BENCH_PATH".into(), tag.clone()),
    ];
    let outcome = async {
        let ok = Command::new(o.venv.join("bin/python"))
            .current_dir(&o.dir)
            .args(["procrastinate_bench.py", "schema"])
            .envs(base.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("schema.log"))?)
            .status()
            .await?;
        if !ok.success() {
            bail!("procrastinate schema failed");
        }
        let mut workers = Vec::new();
        for i in 0..o.procrastinate_workers {
            let ready = dir.join(format!("ready-{i}"));
            let mut cmd = Command::new(o.venv.join("bin/python"));
            cmd.current_dir(&o.dir)
                .args(["procrastinate_bench.py", "worker", "--concurrency"])
                .arg(o.procrastinate_concurrency.to_string())
                .envs(base.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .env("BENCH_READY_FILE", &ready);
            workers.push(Worker::spawn(cmd, &dir.join(format!("worker-{i}.log")))?);
        }
        let result = async {
            for i in 0..workers.len() {
                wait_for_file(
                    &dir.join(format!("ready-{i}")),
                    &mut workers,
                    "procrastinate worker",
                )
                .await?;
            }
            let groups = with_bench_and_sim(
                sim,
                vec![Group {
                    name: "procrastinate-workers".into(),
                    roots: workers.iter().map(|w| w.pid).collect(),
                }],
            );
            let before = procs::snapshot(&groups);
            let r = drive(o, "procrastinate_bench.py", &base, &[], run, &dir).await?;
            let after = procs::snapshot(&groups);
            let peak: f64 = workers.iter().map(|w| procs::tree_peak_mib(w.pid)).sum();
            Ok::<_, anyhow::Error>((r, after.since(&before), peak))
        }
        .await;
        for w in workers {
            w.stop(Duration::from_secs(20)).await;
        }
        result
    }
    .await;
    env.drop_db(&db_name).await;
    let (r, cpu, peak) = outcome?;
    let setup = format!(
        "{} worker processes × {} concurrent async jobs, httpx",
        o.procrastinate_workers, o.procrastinate_concurrency
    );
    Ok(result_of(
        "procrastinate".into(),
        run,
        r,
        Some(cpu),
        peak,
        setup,
    ))
}

/// DBOS Transact: worker processes (each a DBOS executor listening to one
/// queue) and a driver that enqueues with `DBOSClient`, on a database of its
/// own (DBOS's system database).
pub async fn dbos(
    env: &Env,
    sim: &Sim,
    o: &PeerOptions,
    run: &PeerRun<'_>,
) -> anyhow::Result<PeerResult> {
    let tag = format!("dbos-{}", run.tag());
    let dir = env.work_dir.join(&tag);
    std::fs::create_dir_all(&dir)?;
    let db_name = format!("sasbench_{}_dbos", env.run_id);
    let dsn = env
        .postgres
        .create(&db_name)
        .await?
        .replacen("postgres://", "postgresql://", 1);
    let concurrency = o.dbos_concurrency.to_string();
    let base: Vec<(String, String)> = vec![
        ("BENCH_DSN".into(), dsn),
        ("BENCH_SIM".into(), sim.url()),
        ("BENCH_PATH".into(), tag.clone()),
        // The queue's polling interval, as #27 asks (DBOS's default is 1 s).
        ("BENCH_POLL".into(), "0.01".into()),
    ];
    let outcome = async {
        let ok = Command::new(o.venv.join("bin/python"))
            .current_dir(&o.dir)
            .args(["dbos_bench.py", "schema", "--concurrency", &concurrency])
            .envs(base.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("schema.log"))?)
            .status()
            .await?;
        if !ok.success() {
            bail!(
                "dbos schema failed; see {}",
                dir.join("schema.log").display()
            );
        }
        let mut workers = Vec::new();
        for i in 0..o.dbos_workers {
            let ready = dir.join(format!("ready-{i}"));
            let mut cmd = Command::new(o.venv.join("bin/python"));
            cmd.current_dir(&o.dir)
                .args(["dbos_bench.py", "worker", "--index", &i.to_string()])
                .args(["--concurrency", &concurrency])
                .envs(base.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .env("BENCH_READY_FILE", &ready);
            workers.push(Worker::spawn(cmd, &dir.join(format!("worker-{i}.log")))?);
        }
        let result = async {
            for i in 0..workers.len() {
                wait_for_file(&dir.join(format!("ready-{i}")), &mut workers, "dbos worker").await?;
            }
            let groups = with_bench_and_sim(
                sim,
                vec![Group {
                    name: "dbos-workers".into(),
                    roots: workers.iter().map(|w| w.pid).collect(),
                }],
            );
            let before = procs::snapshot(&groups);
            let r = drive(o, "dbos_bench.py", &base, &[], run, &dir).await?;
            let after = procs::snapshot(&groups);
            let peak: f64 = workers.iter().map(|w| procs::tree_peak_mib(w.pid)).sum();
            Ok::<_, anyhow::Error>((r, after.since(&before), peak))
        }
        .await;
        for w in workers {
            w.stop(Duration::from_secs(20)).await;
        }
        result
    }
    .await;
    env.drop_db(&db_name).await;
    let (r, cpu, peak) = outcome?;
    let setup = format!(
        "{} worker processes (DBOS executors) × ≤ {} workflows each (threads), one queue polled every 10 ms, \
         DBOSClient enqueues (workflow id = order id), requests; system database on the local Postgres",
        o.dbos_workers, o.dbos_concurrency
    );
    Ok(result_of("dbos".into(), run, r, Some(cpu), peak, setup))
}

/// Deletes the exchanges Celery declared (named like its queues).
pub async fn delete_exchanges(env: &Env, names: &[String]) {
    if let Ok(b) = sas::broker::Broker::connect(&env.broker_settings("cleanup"), "sas-bench").await
    {
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        b.delete_exchanges(&names).await.ok();
        b.close().await;
    }
}

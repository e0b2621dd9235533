//! Starting things: remote-sim, and a sas deployment (its own database and
//! broker prefix, a configuration file, the release binaries of the services),
//! and taking it all down again.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sas::broker::{Broker, Publisher};
use sas::config::BrokerSettings;
use sas::topology::QueueNames;
use sas_testkit::config::{ConfigFile, WORKFLOW_AGENTS};
use sas_testkit::database::Postgres;
use sqlx::{Connection, PgPool};
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};

use crate::procs::{self, Group, Memory};

/// Where everything is: shared by every deployment of one bench run.
#[derive(Debug, Clone)]
pub struct Env {
    /// The server, where each deployment's database is created and dropped.
    pub postgres: Postgres,
    pub amqp: String,
    /// The directory of the release binaries.
    pub bin_dir: PathBuf,
    /// Scratch space of this run (configuration, logs).
    pub work_dir: PathBuf,
    /// A short id naming this run's databases and prefixes.
    pub run_id: String,
    /// Extra `SAS__…` variables for every service.
    pub sas_env: Vec<(String, String)>,
    /// Run `VACUUM (ANALYZE)` on each deployment's tables this often, as
    /// autovacuum would (for a server that runs with `autovacuum = off`).
    pub vacuum_every: Option<Duration>,
    /// Leave the `fanout` workflow out of the configuration (`--skip-fanout`).
    pub skip_fanout: bool,
}

/// The broker URL sas's services get: `amqp` asking for the `frame_max`
/// that sas's deployment files give RabbitMQ
/// ([`sas::broker::RECOMMENDED_FRAME_MAX`], `deploy/rabbitmq/rabbitmq.conf`),
/// unless it names one. The machine's RabbitMQ keeps its default (128 KiB),
/// and with it each connection of sas keeps 8 MiB of frame buffers (1 MiB
/// at 16 KiB), which cost the one-step runs a tenth of their throughput
/// (docs/performance.md): the bench measures sas as it is deployed.
fn as_deployed(amqp: &str) -> String {
    if amqp.contains("frame_max=") {
        return amqp.to_owned();
    }
    let joint = if amqp.contains('?') { '&' } else { '?' };
    format!(
        "{amqp}{joint}frame_max={}",
        sas::broker::RECOMMENDED_FRAME_MAX
    )
}

/// `toml` without the section headed `header` (up to the next header).
fn without_section(toml: &str, header: &str) -> String {
    let mut out = String::with_capacity(toml.len());
    let mut inside = false;
    for line in toml.lines() {
        if line.starts_with('[') {
            inside = line.trim() == header;
        }
        if !inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

impl Env {
    /// Broker settings for `prefix`.
    pub fn broker_settings(&self, prefix: &str) -> BrokerSettings {
        // The harness declares the queues before the services start: as
        // they will, when --sas-env chooses the step queues' type.
        let step_queues = self
            .sas_env
            .iter()
            .find(|(k, _)| k == "SAS__BROKER__STEP_QUEUES")
            .and_then(|(_, v)| serde_json::from_value(serde_json::Value::String(v.clone())).ok());
        let defaults = sas_testkit::broker::settings(&self.amqp, prefix);
        BrokerSettings {
            step_queues: step_queues.unwrap_or(defaults.step_queues),
            ..defaults
        }
    }

    /// Drops a database, disconnecting whoever is still on it; a failure
    /// is only reported: clean-up must not end a bench run.
    pub async fn drop_db(&self, name: &str) {
        if let Err(e) = self.postgres.drop(name).await {
            eprintln!("warning: could not drop database {name}: {e:#}");
        }
    }

    /// Writes out the dirty buffers the previous run left (as pgbench does
    /// between runs), so a run does not pay for its predecessor's checkpoint.
    pub async fn checkpoint(&self) {
        if let Ok(mut admin) = sqlx::PgConnection::connect(&self.postgres.admin_url).await {
            sqlx::raw_sql("CHECKPOINT").execute(&mut admin).await.ok();
            admin.close().await.ok();
        }
    }

    /// Deletes queues (missing ones are fine).
    pub async fn delete_queues(&self, queues: &[String]) {
        match Broker::connect(&self.broker_settings("cleanup"), "sas-bench-cleanup").await {
            Ok(b) => {
                b.delete_queues(queues).await.ok();
                b.close().await;
            }
            Err(e) => eprintln!("warning: could not delete queues: {e}"),
        }
    }

    /// The path of a release binary.
    pub fn bin(&self, name: &str) -> PathBuf {
        self.bin_dir.join(name)
    }
}

/// A tiny HTTP client for readiness and remote-sim's control API.
pub fn http() -> reqwest::Client {
    sas::tls::install_crypto_provider();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("HTTP client")
}

/// remote-sim, started from its release binary.
pub struct Sim {
    child: Child,
    pub addr: SocketAddr,
}

impl Sim {
    /// Starts `remote-sim --port 0`, logging to `<name>.log` in the work
    /// directory, and reads the address it announces.
    pub async fn start(env: &Env, name: &str) -> anyhow::Result<Self> {
        let log = std::fs::File::create(env.work_dir.join(format!("{name}.log")))?;
        let mut child = Command::new(env.bin("remote-sim"))
            .args(["--port", "0"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", env.bin("remote-sim").display()))?;
        let stdout = child.stdout.take().context("remote-sim stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .context("remote-sim did not announce its address")??
            .context("remote-sim exited")?;
        let addr = line
            .strip_prefix("remote-sim listening on ")
            .context("unexpected first line from remote-sim")?
            .trim()
            .parse()?;
        // Keep reading (and discarding) stdout so the pipe never fills.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Self { child, addr })
    }

    /// The base URL, e.g. `http://127.0.0.1:41234`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Forgets every idempotency key and counter (keeps memory flat between runs).
    pub async fn reset(&self) {
        http()
            .delete(format!("{}/stats", self.url()))
            .send()
            .await
            .ok();
    }

    /// Calls applied so far (effects), from `GET /stats`.
    pub async fn applied(&self) -> Option<u64> {
        let v: serde_json::Value = http()
            .get(format!("{}/stats", self.url()))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        let endpoints = v.get("endpoints")?.as_object()?;
        Some(
            endpoints
                .values()
                .filter_map(|e| e.get("applied").and_then(serde_json::Value::as_u64))
                .sum(),
        )
    }

    /// Stops remote-sim.
    pub async fn stop(mut self) {
        self.child.kill().await.ok();
    }
}

/// How a deployment is configured.
#[derive(Debug, Clone)]
pub struct SuiteOptions {
    pub step_timeout: &'static str,
    pub supervisor_interval: &'static str,
}

impl Default for SuiteOptions {
    fn default() -> Self {
        Self {
            step_timeout: "5s",
            supervisor_interval: "500ms",
        }
    }
}

/// The agents of the bench workflows (the undos are idle in these runs).
pub const AGENTS: [&str; 5] = WORKFLOW_AGENTS;

struct Proc {
    child: Child,
    /// The peak memory seen before the process was stopped.
    last_memory: Option<Memory>,
    /// Its HTTP port (`/metrics`).
    port: u16,
}

/// One sas deployment.
pub struct Suite {
    pub env: Env,
    pub prefix: String,
    pub queues: QueueNames,
    pub db_name: String,
    pub db: PgPool,
    pub status_queue: String,
    config: PathBuf,
    dir: PathBuf,
    pub broker: Broker,
    pub publisher: Publisher,
    procs: BTreeMap<String, Proc>,
    /// Peak memory per process name, kept when a process stops.
    memory: BTreeMap<String, Memory>,
    /// The autovacuum stand-in, and how many times it ran (and for how long in all).
    maintenance: Option<tokio::task::JoinHandle<()>>,
    pub vacuums: std::sync::Arc<std::sync::Mutex<(usize, Duration)>>,
    /// The deployment's own remote-sim, stopped at teardown: one that has
    /// served another system's calls was seen to cost the next run about a
    /// third more CPU per order in every process (docs/performance.md).
    pub sim: Sim,
}

impl Suite {
    /// Starts the deployment's remote-sim and creates the database, the
    /// configuration and the status queue; starts no service.
    pub async fn create(env: &Env, name: &str, options: SuiteOptions) -> anyhow::Result<Self> {
        let sim = Sim::start(env, &format!("remote-sim-{name}")).await?;
        let prefix = format!("sasbench{}{name}", env.run_id);
        let db_name = format!("sasbench_{}_{name}", env.run_id);
        // Not migrated here: the first service (submission, started alone)
        // migrates it with the schema of the build under test, which may be
        // older than the harness's (scripts/bench-compare.sh).
        let db_url = env.postgres.create(&db_name).await?;
        let dir = env.work_dir.join(name);
        std::fs::create_dir_all(&dir)?;
        let config = dir.join("sas.toml");
        let agents_url = format!("{}/bench", sim.url());
        let broker_url = as_deployed(&env.amqp);
        let text = ConfigFile {
            database_url: &db_url,
            max_connections: None,
            broker_url: &broker_url,
            step_queues: env.broker_settings(&prefix).step_queues.as_str(),
            prefix: &prefix,
            agents_url: &agents_url,
            agents: &AGENTS,
            step_timeout: options.step_timeout,
            supervisor_interval: options.supervisor_interval,
            max_failures: 5,
            retry_schedule: r#"["200ms"]"#,
            // The default ladder, as a deployment has it.
            warn_at: "[0.5, 0.8]",
            extra: "",
        }
        .to_toml();
        let text = if env.skip_fanout {
            without_section(&text, "[workflows.fanout]")
        } else {
            text
        };
        std::fs::write(&config, text).with_context(|| format!("writing {}", config.display()))?;
        let db = PgPool::connect(&db_url).await?;
        let broker_settings = env.broker_settings(&prefix);
        let broker = Broker::connect(&broker_settings, "sas-bench").await?;
        let publisher = broker.publisher().await?;
        let queues = sas_testkit::broker::declare(&broker, &broker_settings, &AGENTS).await?;
        let status_queue = format!("{prefix}-app.status");
        broker.declare_status_queue(&status_queue).await?;
        Ok(Self {
            env: env.clone(),
            prefix,
            queues,
            db_name,
            db,
            status_queue,
            config,
            dir,
            broker,
            publisher,
            procs: BTreeMap::new(),
            memory: BTreeMap::new(),
            maintenance: None,
            vacuums: Default::default(),
            sim,
        })
    }

    /// Starts `schedulers` schedulers and `agents` agents plus one submission
    /// and one supervisor, each ready before it returns.
    pub async fn start_services(&mut self, schedulers: usize, agents: usize) -> anyhow::Result<()> {
        self.start("submission", "submission").await?;
        for i in 1..=schedulers {
            self.start(&format!("scheduler-{i}"), "scheduler").await?;
        }
        for i in 1..=agents {
            self.start(&format!("agent-{i}"), "agent").await?;
        }
        self.start("supervisor", "supervisor").await?;
        Ok(())
    }

    /// The HTTP port of process `name`.
    pub fn port(&self, name: &str) -> anyhow::Result<u16> {
        self.procs
            .get(name)
            .map(|p| p.port)
            .with_context(|| format!("no process {name}"))
    }

    /// Starts `binary` as process `name` and waits for its `/readyz`.
    pub async fn start(&mut self, name: &str, binary: &str) -> anyhow::Result<()> {
        let port = sas_testkit::free_port()?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{name}.log")))?;
        let mut cmd = Command::new(self.env.bin(binary));
        cmd.env("SAS_CONFIG", &self.config)
            .env("SAS__HTTP__PORT", port.to_string())
            .env(
                "RUST_LOG",
                std::env::var("SAS_BENCH_LOG").unwrap_or("info".into()),
            )
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        for (k, v) in &self.env.sas_env {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", self.env.bin(binary).display()))?;
        self.procs.insert(
            name.to_owned(),
            Proc {
                child,
                last_memory: None,
                port,
            },
        );
        self.wait_ready(name, port).await
    }

    async fn wait_ready(&mut self, name: &str, port: u16) -> anyhow::Result<()> {
        let url = format!("http://127.0.0.1:{port}/readyz");
        let client = http();
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(r) = client.get(&url).send().await
                && r.status().is_success()
            {
                return Ok(());
            }
            let p = self.procs.get_mut(name).context("process")?;
            if let Some(status) = p.child.try_wait()? {
                bail!(
                    "{name} exited with {status} before it was ready; see {}",
                    self.dir.join(format!("{name}.log")).display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!("{name} not ready within 60 s")
    }

    /// Kills a process with SIGKILL; returns when it is gone.
    pub async fn kill(&mut self, name: &str) {
        self.sample_memory();
        if let Some(mut p) = self.procs.remove(name) {
            if let Some(m) = p.last_memory {
                self.memory.insert(name.to_owned(), m);
            }
            p.child.kill().await.ok();
        }
    }

    /// Outbox messages the running services have published so far, by
    /// path (`handoff`: by the transition that wrote them, at once;
    /// `follow`: once the previous publisher of the order let go; `relay`:
    /// by a pass of the relay), summed over the running processes, from
    /// their `sas_outbox_published_total`; and the agents' messages of
    /// replies (`agent replies`, a pack counting once). A process killed between two
    /// readings takes its counts with it: only the agents are killed (the
    /// recovery run), which publish nothing through an outbox, but whose
    /// `agent replies` count is then short by the killed agent's.
    pub async fn published(&self) -> BTreeMap<String, f64> {
        let mut by_path = BTreeMap::new();
        for p in self.procs.values() {
            let url = format!("http://127.0.0.1:{}/metrics", p.port);
            let Ok(r) = http().get(&url).send().await else {
                continue;
            };
            let Ok(text) = r.text().await else { continue };
            for (path, n) in published_by_path(&text) {
                *by_path.entry(path).or_insert(0.0) += n;
            }
        }
        by_path
    }

    /// Records each running process's memory (the peak so far is kept when it stops).
    pub fn sample_memory(&mut self) {
        for (name, p) in &mut self.procs {
            if let Some(m) = p.child.id().and_then(procs::memory) {
                p.last_memory = Some(m);
                self.memory.insert(name.clone(), m);
            }
        }
    }

    /// Peak memory per process (binary name → largest `VmHWM` of its instances).
    pub fn peak_memory(&mut self) -> BTreeMap<String, f64> {
        self.sample_memory();
        let mut by_binary: BTreeMap<String, f64> = BTreeMap::new();
        for (name, m) in &self.memory {
            let binary = name.split('-').next().unwrap_or(name).to_owned();
            let e = by_binary.entry(binary).or_default();
            *e = e.max(m.peak_mib);
        }
        by_binary
    }

    /// The process groups to account CPU to: each service process by name.
    pub fn groups(&self) -> Vec<Group> {
        self.procs
            .iter()
            .filter_map(|(name, p)| {
                Some(Group {
                    name: name.clone(),
                    roots: vec![p.child.id()?],
                })
            })
            .collect()
    }

    /// Empties the state store between runs, so every run starts from the same tables.
    pub async fn reset_store(&self) -> anyhow::Result<()> {
        sqlx::raw_sql("TRUNCATE orders, steps, order_events, outbox")
            .execute(&self.db)
            .await?;
        self.env.checkpoint().await;
        Ok(())
    }

    /// Starts the autovacuum stand-in, if the run asks for one: `VACUUM
    /// (ANALYZE)` of sas's tables every `Env::vacuum_every`. Besides removing
    /// dead rows, each run refreshes the planner's statistics, which makes the
    /// services re-plan their prepared statements as the tables grow.
    pub fn start_maintenance(&mut self) {
        let Some(every) = self.env.vacuum_every else {
            return;
        };
        let (db, vacuums) = (self.db.clone(), self.vacuums.clone());
        self.maintenance = Some(tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let started = Instant::now();
                let done = sqlx::raw_sql("VACUUM (ANALYZE) orders, steps, outbox, order_events")
                    .execute(&db)
                    .await;
                if done.is_ok() {
                    let mut v = vacuums.lock().unwrap_or_else(|p| p.into_inner());
                    v.0 += 1;
                    v.1 += started.elapsed();
                }
            }
        }));
    }

    /// Cumulative counters of this deployment's database (and the server's WAL position).
    pub async fn pg_counters(&self) -> Option<PgCounters> {
        let row: (i64, i64, i64, i64, i64, f64) = sqlx::query_as(
            "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted, \
               (pg_current_wal_lsn() - '0/0'::pg_lsn)::float8 \
             FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(&self.db)
        .await
        .ok()?;
        Some(PgCounters {
            commits: row.0 as f64,
            rollbacks: row.1 as f64,
            inserted: row.2 as f64,
            updated: row.3 as f64,
            deleted: row.4 as f64,
            wal_bytes: row.5,
        })
    }

    /// Stops every process, deletes the queues and the database and, unless
    /// `keep`, the scratch directory.
    pub async fn teardown(mut self, keep: bool) {
        if let Some(m) = self.maintenance.take() {
            m.abort();
        }
        self.sample_memory();
        for (_, mut p) in std::mem::take(&mut self.procs) {
            p.child.kill().await.ok();
        }
        let mut queues: Vec<String> = self
            .queues
            .all(AGENTS)
            .into_iter()
            .map(|q| q.name)
            .collect();
        queues.push(self.status_queue.clone());
        self.broker
            .delete_deployment(&self.queues, &queues)
            .await
            .ok();
        self.broker.close().await;
        self.db.close().await;
        self.env.drop_db(&self.db_name).await;
        self.sim.stop().await;
        if !keep {
            std::fs::remove_dir_all(&self.dir).ok();
        }
    }

    /// The scratch directory (logs, configuration).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Postgres counters, cumulative or per order. The statistics of other
/// backends reach `pg_stat_database` up to a second or so late, so per-run
/// differences are approximate; the WAL position is exact (and server-wide).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct PgCounters {
    pub commits: f64,
    pub rollbacks: f64,
    pub inserted: f64,
    pub updated: f64,
    pub deleted: f64,
    pub wal_bytes: f64,
}

impl PgCounters {
    /// `(self − earlier) / orders`.
    pub fn per_order(&self, earlier: &PgCounters, orders: usize) -> PgCounters {
        let n = orders.max(1) as f64;
        PgCounters {
            commits: (self.commits - earlier.commits) / n,
            rollbacks: (self.rollbacks - earlier.rollbacks) / n,
            inserted: (self.inserted - earlier.inserted) / n,
            updated: (self.updated - earlier.updated) / n,
            deleted: (self.deleted - earlier.deleted) / n,
            wal_bytes: (self.wal_bytes - earlier.wal_bytes) / n,
        }
    }
}

/// `sas_outbox_published_total{kind="…",path="…"} N` lines of a metrics
/// text, as (path, N), and an agent's `sas_reply_messages_total N` as
/// (`agent replies`, N).
fn published_by_path(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter_map(|l| {
            if let Some(n) = l.strip_prefix("sas_reply_messages_total ") {
                return Some(("agent replies".to_owned(), n.trim().parse().ok()?));
            }
            let rest = l.strip_prefix("sas_outbox_published_total{")?;
            let (labels, value) = rest.split_once("} ")?;
            let path = labels.split(',').find_map(|kv| kv.strip_prefix("path="))?;
            Some((
                path.trim_matches('"').to_owned(),
                value.trim().parse().ok()?,
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn sas_connects_with_the_deployed_frame_max_unless_the_url_names_one() {
        let url = "amqp://guest:guest@127.0.0.1:5672/%2f";
        assert_eq!(super::as_deployed(url), format!("{url}?frame_max=16384"));
        assert_eq!(
            super::as_deployed(&format!("{url}?heartbeat=10")),
            format!("{url}?heartbeat=10&frame_max=16384")
        );
        let named = format!("{url}?frame_max=131072");
        assert_eq!(super::as_deployed(&named), named);
    }

    #[test]
    fn published_counts_are_read_by_path() {
        let text = "# TYPE sas_outbox_published counter\n\
            sas_outbox_published_total{kind=\"request\",path=\"handoff\"} 7\n\
            sas_outbox_published_total{kind=\"status\",path=\"follow\"} 2\n\
            sas_outbox_unroutable_total 0\n\
            sas_reply_messages_total 5\n";
        assert_eq!(
            super::published_by_path(text),
            vec![
                ("handoff".to_owned(), 7.0),
                ("follow".to_owned(), 2.0),
                ("agent replies".to_owned(), 5.0)
            ]
        );
    }

    #[test]
    fn a_section_is_left_out_up_to_the_next_header() {
        let toml = "[a]\nx = 1\n\n[workflows.fanout]\nsteps = []\n\n[b]\ny = 2\n";
        assert_eq!(
            super::without_section(toml, "[workflows.fanout]"),
            "[a]\nx = 1\n\n[b]\ny = 2\n"
        );
    }
}

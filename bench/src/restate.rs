//! Restate, the durable-execution server, doing the same work in the same
//! run: one `restate-server` (the npm package `@restatedev/restate-server`,
//! pinned, installed into `.bench/restate`) with its default durability (one
//! node; the log on the node's own log-server, its RocksDB WAL fsynced, writes
//! committed in batches), and a Rust service (`bench/peers/restate/`, the
//! `restate-sdk` crate, built into `.bench/restate-target`) whose handler runs
//! each step as a journaled `ctx.run` doing the POST to remote-sim.
//!
//! The driver is here, in sas-bench: each order is one request-response call
//! to the ingress (`POST /OrderService/order`) with the order id as its
//! `idempotency-key`; the answer comes when the invocation has ended, so the
//! latency is submit → the caller knows it is done. At full load every order
//! is handed over at the start and at most `in_flight` calls are open at once
//! (HTTP/1.1 keep-alive connections); at 10% load the calls start at the
//! given rate.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::process::Command;

use crate::peers::{
    DriverResult, PeerResult, PeerRun, Worker, result_of, wait_for_file, with_bench_and_sim,
};
use crate::procs::{self, Group};
use crate::suite::{Env, Sim};

/// The server version sas-bench installs (the one #27 measured).
pub const SERVER_VERSION: &str = "1.7.12";
/// Restate's own ports (its defaults): ingress, admin, node-to-node.
const INGRESS: &str = "127.0.0.1:8080";
const ADMIN: &str = "127.0.0.1:9070";
const NODE: &str = "127.0.0.1:5122";

/// How Restate runs.
#[derive(Debug, Clone)]
pub struct RestateOptions {
    /// Where npm installs the server (`.bench/restate`).
    pub install_dir: PathBuf,
    /// The service's Cargo project (`bench/peers/restate`).
    pub project: PathBuf,
    /// Its target directory (`.bench/restate-target`).
    pub target_dir: PathBuf,
    /// The server's data, wiped before and after each run (`.bench/restate-data`).
    pub data_dir: PathBuf,
    pub npm: String,
    /// Calls open at once at full load.
    pub in_flight: usize,
}

/// The installed server and the built service.
#[derive(Debug, Clone)]
pub struct Installed {
    pub server: PathBuf,
    pub service: PathBuf,
    /// E.g. `Restate 1.7.12 (restate-sdk 0.13.0)`.
    pub versions: String,
}

/// Installs the server (npm) and builds the service (cargo) unless done.
pub async fn ensure(o: &RestateOptions) -> anyhow::Result<Installed> {
    let server = match server_binary(&o.install_dir) {
        Some(b) if version_of(&b).await.as_deref() == Some(SERVER_VERSION) => b,
        _ => {
            eprintln!(
                "restate: installing @restatedev/restate-server@{SERVER_VERSION} into {}",
                o.install_dir.display()
            );
            std::fs::create_dir_all(&o.install_dir)?;
            let manifest = o.install_dir.join("package.json");
            if !manifest.exists() {
                std::fs::write(
                    &manifest,
                    "{\"name\": \"sas-bench-restate\", \"private\": true}\n",
                )?;
            }
            // --ignore-scripts: the package's only install script is a
            // download-analytics ping (@scarf/scarf); the binary is in the
            // platform package itself.
            let ok = Command::new(&o.npm)
                .current_dir(&o.install_dir)
                .args(["install", "--no-audit", "--no-fund", "--ignore-scripts"])
                .args(["--save-exact", "--loglevel", "error"])
                .arg(format!("@restatedev/restate-server@{SERVER_VERSION}"))
                .status()
                .await
                .with_context(|| format!("running {}", o.npm))?;
            if !ok.success() {
                bail!("npm install @restatedev/restate-server@{SERVER_VERSION} failed");
            }
            server_binary(&o.install_dir).context("restate-server not found after npm install")?
        }
    };
    // cargo decides whether anything changed; a no-op after the first build.
    let manifest = o.project.join("Cargo.toml");
    eprintln!("restate: building {}", manifest.display());
    let ok = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "build",
            "--release",
            "--locked",
            "--quiet",
            "--manifest-path",
        ])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&o.target_dir)
        .status()
        .await
        .context("running cargo")?;
    if !ok.success() {
        bail!("cargo build of {} failed", manifest.display());
    }
    let service = o.target_dir.join("release/sas-bench-restate");
    let sdk = sdk_version(&o.project.join("Cargo.lock")).unwrap_or_else(|| "?".into());
    let server_version = version_of(&server)
        .await
        .unwrap_or_else(|| "unknown".into());
    Ok(Installed {
        server,
        service,
        versions: format!("Restate {server_version} (restate-sdk {sdk})"),
    })
}

/// `node_modules/@restatedev/restate-server-<platform>/bin/restate-server`.
fn server_binary(install_dir: &Path) -> Option<PathBuf> {
    let scope = install_dir.join("node_modules/@restatedev");
    std::fs::read_dir(scope)
        .ok()?
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with("restate-server-"))
        })
        .map(|e| e.path().join("bin/restate-server"))
        .find(|p| p.exists())
}

/// `restate-server --version` prints `restate-server 1.7.12`.
async fn version_of(server: &Path) -> Option<String> {
    let out = Command::new(server).arg("--version").output().await.ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace().nth(1).map(str::to_owned)
}

/// The `restate-sdk` version locked in the service's `Cargo.lock`.
fn sdk_version(lock: &Path) -> Option<String> {
    let text = std::fs::read_to_string(lock).ok()?;
    let mut lines = text.lines();
    while let Some(l) = lines.next() {
        if l.trim() == "name = \"restate-sdk\"" {
            let v = lines.next()?.trim();
            return Some(v.strip_prefix("version = ")?.trim_matches('"').to_owned());
        }
    }
    None
}

fn http() -> reqwest::Client {
    sas::tls::install_crypto_provider();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("HTTP client")
}

/// Waits until `url` answers 2xx.
async fn wait_healthy(url: &str, server: &mut Worker) -> anyhow::Result<()> {
    let client = http();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Some(status) = server.child.try_wait()? {
            bail!("restate-server exited with {status} before it was ready");
        }
        if client
            .get(url)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("restate-server: {url} not healthy within 60 s")
}

/// The ports Restate uses must be free: another Restate (or anything else)
/// there would be measured instead.
async fn ports_free() -> anyhow::Result<()> {
    for addr in [INGRESS, ADMIN, NODE] {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            bail!("{addr} is taken: Restate needs its ports 8080, 9070 and 5122 free");
        }
    }
    Ok(())
}

/// One Restate run: a fresh server and service, the deployment registered,
/// the orders driven through the ingress, everything stopped and wiped.
pub async fn run(
    env: &Env,
    sim: &Sim,
    o: &RestateOptions,
    inst: &Installed,
    run: &PeerRun<'_>,
) -> anyhow::Result<PeerResult> {
    let tag = format!("restate-{}", run.tag());
    let dir = env.work_dir.join(&tag);
    std::fs::create_dir_all(&dir)?;
    ports_free().await?;
    std::fs::remove_dir_all(&o.data_dir).ok();
    std::fs::create_dir_all(&o.data_dir)?;
    // Restate's defaults but for telemetry (this machine's network is closed)
    // and quieter logs.
    let config = dir.join("restate.toml");
    std::fs::write(
        &config,
        "disable-telemetry = true\nlog-filter = \"warn\"\nlog-disable-ansi-codes = true\n",
    )?;
    let outcome = async {
        let mut cmd = Command::new(&inst.server);
        cmd.arg("--config-file")
            .arg(&config)
            .arg("--base-dir")
            .arg(&o.data_dir)
            .args([
                "--node-name",
                "sasbench",
                "--listen-mode",
                "tcp",
                "--no-logo",
            ]);
        let mut server = Worker::spawn(cmd, &dir.join("server.log"))?;
        let ready = dir.join("service-ready");
        let mut cmd = Command::new(&inst.service);
        cmd.env("BENCH_SIM", sim.url())
            .env("BENCH_PATH", &tag)
            .env("BENCH_READY_FILE", &ready);
        let mut service = Worker::spawn(cmd, &dir.join("service.log"))?;
        let result = async {
            wait_for_file(
                &ready,
                std::slice::from_mut(&mut service),
                "restate service",
            )
            .await?;
            let addr = std::fs::read_to_string(&ready)?.trim().to_owned();
            wait_healthy(&format!("http://{ADMIN}/health"), &mut server).await?;
            wait_healthy(&format!("http://{INGRESS}/restate/health"), &mut server).await?;
            register(&addr).await?;
            warm_up().await?;
            let groups = with_bench_and_sim(
                sim,
                vec![
                    Group {
                        name: "restate-server".into(),
                        roots: vec![server.pid],
                    },
                    Group {
                        name: "restate-service".into(),
                        roots: vec![service.pid],
                    },
                ],
            );
            let before = procs::snapshot(&groups);
            let r = drive(run, o.in_flight).await;
            let after = procs::snapshot(&groups);
            let peaks = [
                (
                    "restate-server".to_owned(),
                    procs::tree_peak_mib(server.pid),
                ),
                (
                    "restate-service".to_owned(),
                    procs::tree_peak_mib(service.pid),
                ),
            ];
            Ok::<_, anyhow::Error>((r, after.since(&before), peaks))
        }
        .await;
        service.stop(Duration::from_secs(5)).await;
        server.stop(Duration::from_secs(20)).await;
        result
    }
    .await;
    std::fs::remove_dir_all(&o.data_dir).ok();
    let (r, cpu, peaks) = outcome?;
    let setup = format!(
        "{}: one restate-server, its defaults (24 partitions; the log on its own log-server, RocksDB WAL fsynced, \
         appends committed in batches); Rust service over HTTP/2 with TCP_NODELAY, one journaled ctx.run per step (hyper client); \
         request-response calls to the ingress, idempotency-key = order id, ≤ {} open at full load (HTTP/1.1 keep-alive)",
        inst.versions, o.in_flight
    );
    let peak = peaks.iter().map(|(_, m)| m).sum();
    let mut result = result_of("restate".into(), run, r, Some(cpu), peak, setup);
    result.peak_mib = peaks.into_iter().collect();
    Ok(result)
}

/// `POST /deployments` on the admin API: Restate discovers the service.
async fn register(addr: &str) -> anyhow::Result<()> {
    let r = http()
        .post(format!("http://{ADMIN}/deployments"))
        .json(&serde_json::json!({ "uri": format!("http://{addr}") }))
        .send()
        .await
        .context("registering the deployment")?;
    let status = r.status();
    if !status.is_success() {
        let body = r.text().await.unwrap_or_default();
        bail!("registering the deployment: {status}: {body}");
    }
    Ok(())
}

/// One order through the ingress, tried until the new deployment is visible
/// there (it answers 404 until then).
async fn warm_up() -> anyhow::Result<()> {
    let client = http();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = String::new();
    while Instant::now() < deadline {
        match order(&client, &format!("warm-up-{}", uuid::Uuid::new_v4()), 1).await {
            Ok(()) => return Ok(()),
            Err(e) => last = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("no order went through Restate's ingress within 30 s: {last}")
}

async fn order(client: &reqwest::Client, id: &str, steps: usize) -> anyhow::Result<()> {
    let r = client
        .post(format!("http://{INGRESS}/OrderService/order"))
        .header("idempotency-key", id)
        .json(&serde_json::json!({ "id": id, "steps": steps }))
        .send()
        .await?;
    let status = r.status();
    let body = r.bytes().await?;
    if !status.is_success() {
        bail!("{status}: {}", String::from_utf8_lossy(&body));
    }
    Ok(())
}

/// Submits the run's orders and waits for each answer.
async fn drive(run: &PeerRun<'_>, in_flight: usize) -> DriverResult {
    let client = reqwest::Client::builder()
        .timeout(run.timeout)
        .pool_max_idle_per_host(in_flight)
        .build()
        .expect("HTTP client");
    // At 10% load the calls start on schedule; the bound only matters at full load.
    let permits = Arc::new(tokio::sync::Semaphore::new(if run.rate.is_some() {
        in_flight.max(4096)
    } else {
        in_flight
    }));
    let first = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..run.orders {
        let t0 = match run.rate {
            Some(rate) => {
                let at = first + Duration::from_secs_f64(i as f64 / rate);
                tokio::time::sleep_until(at.into()).await;
                at
            }
            // Every order is handed over at the start, as sas's and the
            // other peers' are: its latency counts its wait for a free call.
            None => first,
        };
        let permit = permits.clone().acquire_owned().await.expect("semaphore");
        let (client, steps) = (client.clone(), run.steps);
        tasks.spawn(async move {
            let id = uuid::Uuid::new_v4().to_string();
            let r = order(&client, &id, steps).await;
            drop(permit);
            (r, t0, Instant::now())
        });
    }
    let submit_s = first.elapsed().as_secs_f64();
    let (mut latencies, mut ends, mut failed, mut error) = (Vec::new(), Vec::new(), 0, None);
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((Ok(()), t0, end)) => {
                latencies.push((end - t0).as_secs_f64() * 1000.0);
                ends.push(end);
            }
            Ok((Err(e), ..)) => {
                failed += 1;
                error.get_or_insert_with(|| format!("{e:#}"));
            }
            Err(e) => {
                failed += 1;
                error.get_or_insert_with(|| format!("{e}"));
            }
        }
    }
    DriverResult {
        completed: ends.len(),
        failed,
        error: error.map(|e| format!("{failed} orders failed; first: {e}")),
        submit_s,
        elapsed_s: ends.iter().max().map(|end| (*end - first).as_secs_f64()),
        latencies_ms: latencies,
        cpu_s: 0.0,
    }
}

/// Wipes the data directory after an error or Ctrl-C (the processes are
/// stopped with the other peers' by [`crate::peers::kill_all`]).
pub fn cleanup(data_dir: &Path) {
    std::fs::remove_dir_all(data_dir).ok();
}

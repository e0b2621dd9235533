//! The services a chaos run starts itself (`--spawn BIN_DIR`), kills and
//! starts again, and the kill command it runs against a deployment of the
//! user's own (`--kill-cmd`).

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use sas::config::Settings;
use tokio::process::{Child, Command};

/// The services `--spawn` starts, in start order.
pub const SERVICES: [&str; 4] = ["submission", "scheduler", "agent", "supervisor"];

/// How long a spawned service gets to become ready at the start.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a spawned service gets to stop after SIGTERM before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// How long one `--kill-cmd` may run before it is killed and counted as failed.
const KILL_CMD_TIMEOUT: Duration = Duration::from_secs(120);

/// The services a run started, each restarted when killed.
pub struct Fleet {
    bin_dir: PathBuf,
    /// Handed to every service as `SAS_CONFIG`.
    config: Option<PathBuf>,
    /// Where the services listen (`http.host`), and where readiness is asked.
    host: String,
    log_dir: PathBuf,
    /// The running processes; a service missing here is down and is started
    /// again by [`Fleet::restart_missing`].
    running: BTreeMap<&'static str, Child>,
}

impl Fleet {
    /// Starts the four services from `bin_dir` with the configuration of
    /// sas-chaos, each on a free HTTP port, logging to a fresh directory, and
    /// waits until each answers `/readyz`. On failure, stops what it started.
    pub async fn start(
        bin_dir: &Path,
        config: Option<&Path>,
        settings: &Settings,
        run_id: &str,
    ) -> anyhow::Result<Self> {
        for name in SERVICES {
            let bin = bin_dir.join(name);
            if !bin.is_file() {
                return Err(sasctl::Exit {
                    code: 2,
                    message: format!("--spawn: {} does not exist (build first)", bin.display()),
                }
                .into());
            }
        }
        let config = config
            .map(std::path::absolute)
            .transpose()
            .context("resolving the configuration file's path")?;
        let log_dir =
            std::env::temp_dir().join(format!("sas-chaos-{}-{run_id}", settings.broker.prefix));
        std::fs::create_dir_all(&log_dir)
            .with_context(|| format!("creating the log directory {}", log_dir.display()))?;
        let mut fleet = Self {
            bin_dir: bin_dir.to_owned(),
            config,
            host: settings.http.host.clone(),
            log_dir,
            running: BTreeMap::new(),
        };
        match fleet.start_all().await {
            Ok(()) => Ok(fleet),
            Err(e) => {
                fleet.stop().await;
                Err(e)
            }
        }
    }

    async fn start_all(&mut self) -> anyhow::Result<()> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .context("building the HTTP client")?;
        let mut ports = Vec::new();
        for name in SERVICES {
            ports.push((name, self.spawn(name)?));
        }
        let deadline = Instant::now() + READY_TIMEOUT;
        for (name, port) in ports {
            let url = format!("http://{}:{port}/readyz", self.reachable_host());
            loop {
                let ready = client
                    .get(&url)
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                if ready {
                    break;
                }
                if let Some(status) = self.reap(name) {
                    anyhow::bail!(
                        "{name} exited with {status} before it was ready; the end of its log:\n{}",
                        self.log_tail(name)
                    );
                }
                if Instant::now() > deadline {
                    anyhow::bail!(
                        "{name} was not ready at {url} within {}s; the end of its log:\n{}",
                        READY_TIMEOUT.as_secs(),
                        self.log_tail(name)
                    );
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        Ok(())
    }

    /// Where the services log, one file per service (a restart appends).
    pub fn log_dir(&self) -> &Path {
        &self.log_dir
    }

    /// Starts `name` on a free HTTP port; returns the port.
    ///
    /// The port is picked here rather than with `SAS__HTTP__PORT=0` so that
    /// readiness can be asked at the start; two processes never share one.
    fn spawn(&mut self, name: &'static str) -> anyhow::Result<u16> {
        let port = free_port(&self.host)?;
        let path = self.log_dir.join(format!("{name}.log"));
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let err = log
            .try_clone()
            .with_context(|| format!("opening {}", path.display()))?;
        let mut command = Command::new(self.bin_dir.join(name));
        command
            .env("SAS__HTTP__PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            // Should sas-chaos fail on its way, no service outlives it.
            .kill_on_drop(true);
        if let Some(config) = &self.config {
            command.env("SAS_CONFIG", config);
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting {}", self.bin_dir.join(name).display()))?;
        self.running.insert(name, child);
        Ok(port)
    }

    /// SIGKILLs `name` and waits for it; it is then down until restarted.
    pub async fn kill(&mut self, name: &str) -> anyhow::Result<()> {
        let Some(mut child) = self.running.remove(name) else {
            return Ok(());
        };
        child
            .kill()
            .await
            .with_context(|| format!("killing {name}"))
    }

    /// Starts again every service that is down (killed, or exited).
    pub fn restart_missing(&mut self) -> anyhow::Result<()> {
        for name in SERVICES {
            if !self.running.contains_key(name) {
                self.spawn(name)?;
            }
        }
        Ok(())
    }

    /// The services that exited by themselves since the last call, with
    /// their exit status; they are down until restarted.
    pub fn exited(&mut self) -> Vec<(&'static str, ExitStatus)> {
        let mut exited = Vec::new();
        for name in SERVICES {
            if let Some(status) = self.reap(name) {
                exited.push((name, status));
            }
        }
        exited
    }

    /// The exit status of `name` if it has exited, forgetting the process.
    fn reap(&mut self, name: &str) -> Option<ExitStatus> {
        let child = self.running.get_mut(name)?;
        match child.try_wait() {
            Ok(Some(status)) => {
                self.running.remove(name);
                Some(status)
            }
            Ok(None) | Err(_) => None,
        }
    }

    /// Stops every service: SIGTERM, then SIGKILL for those still running
    /// after [`STOP_TIMEOUT`], so in-flight work is handed back as in any
    /// orderly shutdown.
    pub async fn stop(&mut self) {
        for (name, child) in &self.running {
            if let Some(pid) = child.id() {
                // `kill` rather than an unsafe libc call.
                let sent = Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status()
                    .await;
                if !sent.is_ok_and(|s| s.success()) {
                    eprintln!("chaos: could not send SIGTERM to {name} (pid {pid})");
                }
            }
        }
        let deadline = tokio::time::Instant::now() + STOP_TIMEOUT;
        for (name, mut child) in std::mem::take(&mut self.running) {
            match tokio::time::timeout_at(deadline, child.wait()).await {
                Ok(Ok(status)) if status.success() => {}
                Ok(Ok(status)) => eprintln!("chaos: {name} stopped with {status}"),
                Ok(Err(e)) => eprintln!("chaos: waiting for {name}: {e}"),
                Err(_) => {
                    eprintln!(
                        "chaos: {name} still running {}s after SIGTERM; killing it",
                        STOP_TIMEOUT.as_secs()
                    );
                    child.kill().await.ok();
                }
            }
        }
    }

    /// The host to ask for readiness: the listening one, or loopback for a wildcard.
    fn reachable_host(&self) -> String {
        match self.host.parse::<IpAddr>() {
            Ok(ip) if ip.is_unspecified() && ip.is_ipv4() => "127.0.0.1".into(),
            Ok(ip) if ip.is_unspecified() => "[::1]".into(),
            Ok(IpAddr::V6(ip)) => format!("[{ip}]"),
            _ => self.host.clone(),
        }
    }

    /// How many lines of the services' logs (every start of each) hold
    /// `needle`.
    pub fn count_in_logs(&self, needle: &str) -> u64 {
        SERVICES
            .iter()
            .map(|name| {
                let text = std::fs::read_to_string(self.log_dir.join(format!("{name}.log")))
                    .unwrap_or_default();
                text.lines().filter(|l| l.contains(needle)).count() as u64
            })
            .sum()
    }

    /// The last lines of a service's log.
    fn log_tail(&self, name: &str) -> String {
        let text =
            std::fs::read_to_string(self.log_dir.join(format!("{name}.log"))).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

/// A port nothing listens on now.
fn free_port(host: &str) -> anyhow::Result<u16> {
    std::net::TcpListener::bind((host, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .with_context(|| format!("finding a free port on {host}"))
}

/// Runs `--kill-cmd` for `service`: `sh -c` with `{service}` replaced.
/// Its output goes to stderr, so that stdout stays the report's. Whether it
/// succeeded within [`KILL_CMD_TIMEOUT`].
pub async fn run_kill_command(template: &str, service: &str) -> bool {
    let command = template.replace("{service}", service);
    let child = Command::new("sh")
        .args(["-c", &command])
        .stdin(Stdio::null())
        .stdout(Stdio::from(std::io::stderr()))
        .kill_on_drop(true)
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) => {
            eprintln!("chaos: cannot run `sh -c {command:?}`: {e}");
            return false;
        }
    };
    match tokio::time::timeout(KILL_CMD_TIMEOUT, child.wait()).await {
        Ok(Ok(status)) if status.success() => true,
        Ok(Ok(status)) => {
            eprintln!("chaos: `{command}` exited with {status}");
            false
        }
        Ok(Err(e)) => {
            eprintln!("chaos: `{command}`: {e}");
            false
        }
        Err(_) => {
            eprintln!(
                "chaos: `{command}` still running after {}s; killed",
                KILL_CMD_TIMEOUT.as_secs()
            );
            child.kill().await.ok();
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_kill_command_names_the_service_and_reports_failure() {
        let dir = std::env::temp_dir().join(format!("sasctl-kill-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let marker = dir.join("killed");
        let template = format!("echo {{service}} > {}", marker.display());
        assert!(run_kill_command(&template, "agent").await);
        assert_eq!(std::fs::read_to_string(&marker).unwrap(), "agent\n");
        assert!(!run_kill_command("exit 3", "agent").await);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn free_ports_are_found() {
        assert_ne!(free_port("127.0.0.1").unwrap(), 0);
    }
}

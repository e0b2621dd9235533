//! Server restarts under load (issue 4): RabbitMQ (`stop_app`/`start_app`, and
//! a full stop and start) and Postgres. These restart the servers every test
//! uses, so `scripts/test.sh` runs this binary alone, after every other test.
//! A guard brings each server back even when a test fails.
//!
//! Which servers: the private ones of `scripts/servers.sh` when
//! `SAS_SERVERS_DIR` names them (`scripts/servers.sh env` sets it), through
//! that script's `pg-stop`, `pg-start`, `rabbit-stop-app`, `rabbit-stop` and
//! `rabbit-start`; else the machine's own (127.0.0.1:5432 and :5672), with
//! `pg_ctlcluster` and `rabbitmqctl`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use remote_sim::Knobs;
use sas_tests::{TestApp, amqp_address, http_get, pg_address};

const ALL: [&str; 4] = ["submission", "scheduler", "agent", "supervisor"];

fn run(cmd: &str, args: &[&str]) -> bool {
    Command::new(cmd)
        .args(args)
        .status()
        .is_ok_and(|s| s.success())
}

/// The directory of `scripts/servers.sh`'s private servers, when the tests
/// use them. Otherwise the tests must use the machine's own servers, the
/// only others these tests know how to restart.
fn private_servers() -> Option<PathBuf> {
    let dir = std::env::var_os("SAS_SERVERS_DIR").filter(|d| !d.is_empty());
    if dir.is_none() {
        assert!(
            pg_address() == "127.0.0.1:5432" && amqp_address() == "127.0.0.1:5672",
            "the restart tests restart the servers of scripts/servers.sh (SAS_SERVERS_DIR) \
             or the machine's own (127.0.0.1:5432, 127.0.0.1:5672), not {} and {} \
             (SAS_TEST_DATABASE_URL, SAS_TEST_BROKER_URL)",
            pg_address(),
            amqp_address()
        );
    }
    dir.map(PathBuf::from)
}

/// Runs `scripts/servers.sh command` on the private servers in `dir`; panics
/// with what it said when it fails (it waits, within its own bound, for what
/// it starts to accept connections).
fn servers_sh(dir: &Path, command: &str) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/servers.sh");
    let out = Command::new(script)
        .arg(command)
        .env("SAS_SERVERS_DIR", dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run scripts/servers.sh: {e}"));
    assert!(
        out.status.success(),
        "scripts/servers.sh {command} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Whether the machine's node runs.
fn rabbitmq_up() -> bool {
    run("rabbitmq-diagnostics", &["-q", "check_running"])
}

fn wait_until(what: &str, timeout: Duration, check: impl Fn() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check() {
        assert!(Instant::now() < deadline, "{what} not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Brings RabbitMQ back when dropped, whatever the test did.
struct RabbitGuard {
    private: Option<PathBuf>,
}

impl RabbitGuard {
    fn stop_app() -> Self {
        let private = private_servers();
        match &private {
            Some(dir) => servers_sh(dir, "rabbit-stop-app"),
            None => assert!(run("rabbitmqctl", &["-q", "stop_app"])),
        }
        Self { private }
    }

    fn stop_node() -> Self {
        let private = private_servers();
        match &private {
            Some(dir) => servers_sh(dir, "rabbit-stop"),
            None => assert!(run("rabbitmqctl", &["-q", "stop"])),
        }
        Self { private }
    }

    fn start(&self) {
        if let Some(dir) = &self.private {
            // The application or the node, whichever is down.
            servers_sh(dir, "rabbit-start");
            return;
        }
        if !rabbitmq_up() {
            // After stop_app the node is up and start_app suffices; after a
            // full stop the node must be started.
            if !run("rabbitmqctl", &["-q", "start_app"]) {
                run("rabbitmq-server", &["-detached"]);
            }
        }
        wait_until("RabbitMQ running", Duration::from_secs(90), || {
            rabbitmq_up() || {
                run("rabbitmqctl", &["-q", "start_app"]);
                false
            }
        });
    }
}

impl Drop for RabbitGuard {
    fn drop(&mut self) {
        self.start();
    }
}

fn postgres_cluster() -> String {
    std::fs::read_dir("/etc/postgresql")
        .ok()
        .and_then(|mut d| d.next())
        .and_then(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .unwrap_or_else(|| "15".into())
}

/// Whether the machine's Postgres answers.
fn postgres_up() -> bool {
    run("pg_isready", &["-q", "-h", "127.0.0.1", "-p", "5432"])
}

/// Brings Postgres back when dropped.
struct PostgresGuard {
    private: Option<PathBuf>,
}

impl PostgresGuard {
    fn stop() -> Self {
        let private = private_servers();
        match &private {
            Some(dir) => servers_sh(dir, "pg-stop"),
            None => {
                let version = postgres_cluster();
                assert!(run(
                    "pg_ctlcluster",
                    &[
                        "--skip-systemctl-redirect",
                        &version,
                        "main",
                        "stop",
                        "-m",
                        "fast"
                    ]
                ));
            }
        }
        Self { private }
    }

    fn start(&self) {
        if let Some(dir) = &self.private {
            servers_sh(dir, "pg-start");
            return;
        }
        if !postgres_up() {
            let version = postgres_cluster();
            run(
                "pg_ctlcluster",
                &["--skip-systemctl-redirect", &version, "main", "start"],
            );
        }
        wait_until(
            "Postgres accepting connections",
            Duration::from_secs(60),
            postgres_up,
        );
    }
}

impl Drop for PostgresGuard {
    fn drop(&mut self) {
        self.start();
    }
}

async fn ready(app: &TestApp, name: &str) -> u16 {
    http_get(&format!("http://127.0.0.1:{}/readyz", app.port(name)))
        .await
        .map_or(0, |(code, _)| code)
}

/// How the step messages go in [`rabbitmq_restart`].
#[derive(Debug, Clone, Copy, PartialEq)]
enum Steps {
    /// `broker.step_messages = "persistent"`.
    Persistent,
    /// Transient (the default), and the restart comes while requests wait
    /// in a step queue: the broker drops them. Steps have 300 s to answer,
    /// so that only their being sent again at once (not their complete-by)
    /// ends the orders within the test's bound.
    Transient,
}

/// Restarts RabbitMQ (the node when `full`, else its application) while
/// orders run.
async fn rabbitmq_restart(full: bool, steps: Steps) {
    let app = match steps {
        Steps::Persistent => TestApp::builder().build().await,
        Steps::Transient => TestApp::builder().step_timeout("300s").build().await,
    };
    let env: &[(&str, &str)] = match steps {
        Steps::Persistent => &[("SAS__BROKER__STEP_MESSAGES", "persistent")],
        // Four requests at a time per agent: with the slow step below, its
        // requests wait in the queue however fast or slow the machine is.
        Steps::Transient => &[("SAS__AGENT__CONCURRENCY", "4")],
    };
    for name in ALL {
        app.start_with_env(name, name, &[], env).await;
    }
    let status = app.status_queue("status").await;
    if steps == Steps::Transient {
        // A slow second step: its requests queue up behind the agent's.
        app.knobs(
            "b",
            Knobs {
                latency_ms: 100,
                ..Knobs::default()
            },
        );
    }
    let mut ids = app.submit_many("three", 150, Some(&status)).await;
    if steps == Steps::Transient {
        let queue = app.queues.agent_requests("b");
        app.eventually("requests waiting", Duration::from_secs(20), || async {
            app.ready(&queue).await > 0
        })
        .await;
    }
    let guard = tokio::task::block_in_place(|| {
        if full {
            RabbitGuard::stop_node()
        } else {
            RabbitGuard::stop_app()
        }
    });
    // While RabbitMQ is down every service says it is not ready, and keeps running.
    app.eventually(
        "services report not ready",
        Duration::from_secs(20),
        || async {
            for name in ALL {
                if ready(&app, name).await != 503 {
                    return false;
                }
            }
            true
        },
    )
    .await;
    // Blocking (the server's own tools): off the runtime's workers.
    tokio::task::block_in_place(|| {
        guard.start();
        drop(guard);
    });
    app.eventually("services reconnected", Duration::from_secs(60), || async {
        for name in ALL {
            if ready(&app, name).await != 200 {
                return false;
            }
        }
        true
    })
    .await;
    app.reconnect().await;
    ids.extend(app.submit_many("three", 50, Some(&status)).await);
    let stories = app
        .assert_invariants(&status, &ids, &[], Duration::from_secs(120))
        .await;
    assert!(
        stories
            .values()
            .all(|s| s.last().unwrap()["state"] == "processed")
    );
    if steps == Steps::Transient {
        // Sent again at once, not retried at a deadline: no failure counted.
        let retried = stories
            .values()
            .filter(|s| s.iter().any(|e| e["state"] == "retry_scheduled"))
            .count();
        assert_eq!(retried, 0, "orders that counted a failure");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_stop_app_and_start_app_with_persistent_step_messages_loses_and_repeats_nothing() {
    rabbitmq_restart(false, Steps::Persistent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_restart_with_transient_step_messages_loses_no_order_and_repeats_nothing() {
    // The restart drops the step messages in flight; the supervisor sends
    // each of their steps again at once, with its key.
    rabbitmq_restart(false, Steps::Transient).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_full_stop_and_start_with_transient_step_messages_loses_and_repeats_nothing() {
    rabbitmq_restart(true, Steps::Transient).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_under_load_loses_and_repeats_nothing() {
    let app = TestApp::spawn().await;
    let status = app.status_queue("status").await;
    let mut ids = app.submit_many("three", 150, Some(&status)).await;
    let guard = tokio::task::block_in_place(PostgresGuard::stop);
    app.eventually(
        "services report Postgres down",
        Duration::from_secs(20),
        || async {
            for name in ["submission", "scheduler", "supervisor"] {
                if ready(&app, name).await != 503 {
                    return false;
                }
            }
            true
        },
    )
    .await;
    // Orders keep arriving while the state store is down; none is lost.
    ids.extend(app.submit_many("three", 30, Some(&status)).await);
    // The outage lasts two seconds more while they arrive: part of the
    // scenario, not a wait for something to happen.
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Blocking (the server's own tools): off the runtime's workers.
    tokio::task::block_in_place(|| {
        guard.start();
        drop(guard);
    });
    let stories = app
        .assert_invariants(&status, &ids, &[], Duration::from_secs(120))
        .await;
    assert!(
        stories
            .values()
            .all(|s| s.last().unwrap()["state"] == "processed")
    );
}

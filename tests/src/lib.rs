//! The test harness: [`TestApp::spawn`] gives each test its own database, its
//! own broker prefix, an in-process remote-sim whose knobs the test turns, and
//! the real service binaries, started and killed for real. Dropping the app
//! kills the processes, deletes the queues and drops the database.
//!
//! The binaries come from the same target directory as the test binary, so
//! run `cargo build --workspace` before the tests (`scripts/test.sh` does).
//! [`browser`] drives a headless Chromium for the dashboard's test; [`tls`]
//! starts the servers of the TLS tests (stunnel, and a Postgres of their
//! own from [`postgres`], which also serves the tests that count for a
//! whole server).
//!
//! The Postgres and RabbitMQ the tests use are [`pg_admin`] and [`amqp`]:
//! `SAS_TEST_DATABASE_URL` and `SAS_TEST_BROKER_URL`, which `scripts/test.sh`
//! points at the private servers of `scripts/servers.sh`, else the machine's
//! own on 127.0.0.1:5432 and :5672.
//!
//! Its helpers beside [`TestApp`]: [`broker_users`] (an application's
//! RabbitMQ user), [`cli`] (sasctl as a process), [`hostile`] (seeded
//! generated attacks), [`proxy`] (a silently partitioning TCP proxy),
//! [`raw_amqp`] (hand-written AMQP frames), [`app_tokens`] (the
//! applications' test tokens), [`dashboard`], [`browser`] and [`tls`].

pub mod broker_users;
pub mod browser;
pub mod cli;
pub mod dashboard;
pub mod hostile;
pub use sas_testkit::otlp;
pub mod postgres;
pub mod proxy;
pub mod raw_amqp;
pub mod tls;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use remote_sim::{Knobs, RemoteSim, Stats};
use sas::broker::{Broker, Consumer, Delivery, Outgoing, Publisher, Subscription};
use sas::config::{BrokerSettings, QueueType};
use sas::topology::QueueNames;
use sas_client::{Client, Order};
use sas_testkit::config::ConfigFile;
use sas_testkit::database::Postgres;
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

/// Postgres as every test sees it: an admin URL (its `postgres` database,
/// where each test's database is created and dropped). `SAS_TEST_DATABASE_URL`
/// when set (`scripts/test.sh` sets it to the private server of
/// `scripts/servers.sh`), else the machine's own server on 127.0.0.1:5432.
pub fn pg_admin() -> &'static str {
    static URL: LazyLock<String> = LazyLock::new(|| {
        env_or(
            "SAS_TEST_DATABASE_URL",
            "postgres://postgres@127.0.0.1:5432/postgres",
        )
    });
    &URL
}

/// RabbitMQ as every test sees it: `SAS_TEST_BROKER_URL` when set (the
/// private node of `scripts/servers.sh`, through `scripts/test.sh`), else
/// the machine's own node on 127.0.0.1:5672.
pub fn amqp() -> &'static str {
    static URL: LazyLock<String> = LazyLock::new(|| {
        env_or(
            "SAS_TEST_BROKER_URL",
            "amqp://guest:guest@127.0.0.1:5672/%2f",
        )
    });
    &URL
}

/// Committed transactions of the database `db_name`, read from the admin
/// database so that reading does not count. A backend reports its counts
/// when it goes idle (at most once a second) or exits: a reader that needs
/// them settled polls until they hold still.
pub async fn pg_commits(db_name: &str) -> i64 {
    use sqlx::Connection as _;
    let mut admin = sqlx::PgConnection::connect(pg_admin())
        .await
        .expect("connect");
    let n = sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = $1")
        .bind(db_name)
        .fetch_one(&mut admin)
        .await
        .expect("pg_stat_database");
    admin.close().await.ok();
    n
}

/// The crates `package` depends on to build (normal dependencies, each
/// once), as `cargo tree` gives them: what a layering test checks.
pub fn dependencies(package: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root");
    let out = Command::new(cargo)
        .args(["tree", "--offline", "-p", package, "-e", "normal"])
        .args(["--prefix", "none", "--no-dedupe"])
        .current_dir(root)
        .output()
        .expect("cargo tree");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut crates: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect();
    crates.sort();
    crates.dedup();
    crates
}

/// Asserts that `package` depends (normally, at any depth) on every crate
/// of `with` and on none of `without`: a layer's line, held by the compiler
/// and checked here.
pub fn assert_layer(package: &str, with: &[&str], without: &[&str]) {
    let crates = dependencies(package);
    for needed in with {
        assert!(
            crates.iter().any(|c| c == needed),
            "{package} no longer depends on {needed}: {crates:?}"
        );
    }
    for barred in without {
        assert!(
            !crates.iter().any(|c| c == barred),
            "{package} depends on {barred}: {crates:?}"
        );
    }
}

/// Bearer tokens of two applications, `shop` and `billing`, and the
/// `sha256:` hashes their configuration holds.
pub mod app_tokens {
    pub const SHOP_TOKEN: &str = "shop-token-1";
    pub const SHOP_HASH: &str =
        "sha256:c4e212531303fd8cec100fa4330eccd120edc935bc20d239174363c92cbd1511";
    pub const BILLING_TOKEN: &str = "billing-token-1";
    pub const BILLING_HASH: &str =
        "sha256:b1762227a5c55b2728c31d64ba22051d54823cfde637e353822df2869fb2d4dc";
}

/// `host:port` of [`pg_admin`], for what connects by address (proxies).
pub fn pg_address() -> &'static str {
    static ADDRESS: LazyLock<String> = LazyLock::new(|| address_of(pg_admin(), 5432));
    &ADDRESS
}

/// `host:port` of [`amqp`], for what connects by address (raw AMQP,
/// stunnel, proxies).
pub fn amqp_address() -> &'static str {
    static ADDRESS: LazyLock<String> = LazyLock::new(|| address_of(amqp(), 5672));
    &ADDRESS
}

/// The user and password of [`amqp`] (guest's when it names none).
pub fn amqp_login() -> (&'static str, &'static str) {
    static LOGIN: LazyLock<(String, String)> = LazyLock::new(|| {
        let url = parse_url(amqp());
        match url.username() {
            "" => ("guest".to_owned(), "guest".to_owned()),
            user => (
                percent_decoded(user),
                percent_decoded(url.password().unwrap_or_default()),
            ),
        }
    });
    (&LOGIN.0, &LOGIN.1)
}

/// A RabbitMQ command line tool (`rabbitmqctl`, `rabbitmq-diagnostics`)
/// aimed at the node of [`amqp`]. When `SAS_TEST_RABBITMQ_NODE` names a
/// node (`scripts/servers.sh env` does), RabbitMQ's own tool from
/// `SAS_TEST_RABBITMQ_BIN` with `-n <node>` and `HOME` at
/// `SAS_TEST_RABBITMQ_HOME`, where the node's Erlang cookie is (Debian's
/// wrapper on the PATH would run as the `rabbitmq` user, with the machine
/// node's cookie); else the tool on the PATH, for the machine's node.
pub fn rabbitmq_cli(tool: &str) -> Command {
    let node = std::env::var("SAS_TEST_RABBITMQ_NODE").unwrap_or_default();
    if node.is_empty() {
        return Command::new(tool);
    }
    let bin = env_or("SAS_TEST_RABBITMQ_BIN", "/usr/lib/rabbitmq/bin");
    let mut cmd = Command::new(Path::new(&bin).join(tool));
    if let Ok(home) = std::env::var("SAS_TEST_RABBITMQ_HOME") {
        cmd.env("HOME", home);
    }
    cmd.args(["-n", &node]);
    cmd
}

/// Environment variable `name`, or `default` when it is unset or empty.
fn env_or(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_owned())
}

fn parse_url(url: &str) -> reqwest::Url {
    reqwest::Url::parse(url).unwrap_or_else(|e| panic!("{url} is not a URL: {e}"))
}

/// `host:port` of a one-host URL, `default_port` when it names none.
fn address_of(url: &str, default_port: u16) -> String {
    let parsed = parse_url(url);
    let host = parsed
        .host_str()
        .unwrap_or_else(|| panic!("{url} names no host"));
    format!("{host}:{}", parsed.port().unwrap_or(default_port))
}

/// A URL's percent-encoded user or password, decoded.
fn percent_decoded(text: &str) -> String {
    let mut bytes = Vec::with_capacity(text.len());
    let mut rest = text.as_bytes();
    while let Some((&b, tail)) = rest.split_first() {
        let hex = tail
            .get(..2)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (b, hex) {
            (b'%', Some(decoded)) => {
                bytes.push(decoded);
                rest = &tail[2..];
            }
            _ => {
                bytes.push(b);
                rest = tail;
            }
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The agents of the test workflows
/// ([`sas_testkit::config::WORKFLOW_AGENTS`]), `c-undo`, which no
/// configured workflow calls (the agent serves and reports it all the
/// same), and `d`, for the workflows a test adds (a diamond's fourth step).
pub const AGENTS: [&str; 7] = ["a", "b", "c", "a-undo", "b-undo", "c-undo", "d"];

/// How a test wants its deployment configured: what the [`Builder`] sets.
#[derive(Debug, Clone)]
struct Options {
    /// Complete-by of each step.
    pub step_timeout: &'static str,
    pub max_failures: u32,
    pub retry_schedule: &'static str,
    pub supervisor_interval: &'static str,
    /// The scheduler's slow poll beside its wake-ups.
    pub scheduler_poll: &'static str,
    /// `supervisor.warn_at`: none by default, so that the events of a
    /// slow step do not depend on when the sweeps happen to fall.
    pub warn_at: &'static str,
    /// `agent.breaker_threshold` and `agent.breaker_cooldown`.
    pub breaker: (u32, &'static str),
    /// Where the test's database is created and dropped, and the URL the
    /// services (and the test's own checks) reach it by, `{db}` standing
    /// for its name: [`pg_admin()`]'s server by default.
    pub postgres: Option<(String, String)>,
    /// Extra TOML appended to the configuration.
    pub extra: String,
    /// `broker.url` (default [`amqp()`]): the harness's
    /// own connection uses it too.
    pub broker_url: String,
    /// `broker.step_queues` (default classic): the harness declares the
    /// queues before the services, so both must agree.
    pub step_queues: QueueType,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            step_timeout: "5s",
            max_failures: 3,
            retry_schedule: r#"["100ms"]"#,
            supervisor_interval: "200ms",
            scheduler_poll: "200ms",
            warn_at: "[]",
            // Many tests hang or fail endpoints on purpose; only the
            // breakers' own tests trip them.
            breaker: (100_000, "5s"),
            postgres: None,
            extra: String::new(),
            broker_url: amqp().to_owned(),
            step_queues: QueueType::Classic,
        }
    }
}

/// Arranges a [`TestApp`]: each method changes one setting of the
/// deployment's configuration from the tests' quick defaults.
#[derive(Debug, Clone, Default)]
pub struct Builder {
    options: Options,
}

impl Builder {
    /// The complete-by of every step (default 5s).
    pub fn step_timeout(mut self, timeout: &'static str) -> Self {
        self.options.step_timeout = timeout;
        self
    }

    /// `supervisor.max_failures` (default 3).
    pub fn max_failures(mut self, n: u32) -> Self {
        self.options.max_failures = n;
        self
    }

    /// `supervisor.retry_schedule` as a TOML array (default `["100ms"]`).
    pub fn retry_schedule(mut self, schedule: &'static str) -> Self {
        self.options.retry_schedule = schedule;
        self
    }

    /// `supervisor.interval` (default 200ms).
    pub fn supervisor_interval(mut self, interval: &'static str) -> Self {
        self.options.supervisor_interval = interval;
        self
    }

    /// The deadline ladder, `supervisor.warn_at` as a TOML array (default
    /// `[]`, none).
    pub fn warn_at(mut self, rungs: &'static str) -> Self {
        self.options.warn_at = rungs;
        self
    }

    /// The scheduler's slow poll beside its wake-ups (default 200ms).
    pub fn scheduler_poll(mut self, poll: &'static str) -> Self {
        self.options.scheduler_poll = poll;
        self
    }

    /// The breakers: `agent.breaker_threshold` failures open one, for
    /// `agent.breaker_cooldown` (default: they never open).
    pub fn breaker(mut self, threshold: u32, cooldown: &'static str) -> Self {
        self.options.breaker = (threshold, cooldown);
        self
    }

    /// The test's database on another Postgres: created and dropped through
    /// `admin_url`, reached by the services and the test's own checks at
    /// `url`, where `{db}` stands for its name (e.g. a host list).
    pub fn postgres(mut self, admin_url: impl Into<String>, url: impl Into<String>) -> Self {
        self.options.postgres = Some((admin_url.into(), url.into()));
        self
    }

    /// `broker.url`: another broker than [`amqp()`]'s node, e.g. the
    /// nodes of `scripts/cluster.sh` (comma-separated).
    pub fn broker_url(mut self, url: impl Into<String>) -> Self {
        self.options.broker_url = url.into();
        self
    }

    /// `broker.step_queues` (default classic).
    pub fn step_queues(mut self, kind: QueueType) -> Self {
        self.options.step_queues = kind;
        self
    }

    /// Further TOML sections appended to the configuration.
    pub fn extra_config(mut self, toml: impl Into<String>) -> Self {
        self.options.extra = toml.into();
        self
    }

    /// The deployment (database, prefix, remote-sim, configuration), with
    /// no service running yet.
    pub async fn build(self) -> TestApp {
        TestApp::with(self.options).await
    }

    /// The deployment with submission, scheduler, agent and supervisor
    /// running and ready.
    pub async fn spawn(self) -> TestApp {
        let app = self.build().await;
        app.start_all().await;
        app
    }
}

/// One test's deployment.
pub struct TestApp {
    pub prefix: String,
    pub queues: QueueNames,
    pub db_name: String,
    pub db_url: String,
    /// Where the test's database is created and dropped.
    admin_url: String,
    /// The configuration file every process reads.
    pub config: PathBuf,
    /// Where the processes' logs go.
    pub dir: PathBuf,
    pub sim: Arc<RemoteSim>,
    pub sim_addr: std::net::SocketAddr,
    pub db: PgPool,
    /// How the harness reaches the deployment's broker (its URL, prefix and
    /// step queue type, as the services have them).
    broker: BrokerSettings,
    /// The test's own broker connection, replaced by [`TestApp::reconnect`].
    conn: std::sync::RwLock<Arc<Conn>>,
    processes: Mutex<BTreeMap<String, Proc>>,
    extra_queues: Mutex<Vec<String>>,
    /// Stops the in-process remote-sim.
    sim_stop: Option<tokio::sync::oneshot::Sender<()>>,
}

/// The test's connections: the application's client (orders go through
/// it, as an application's would), and sas's own broker code with a raw
/// publisher for what an application never sends (step replies, malformed
/// bodies) and for looking into queues.
struct Conn {
    client: Client,
    broker: Broker,
    publisher: Publisher,
}

impl Conn {
    async fn open(settings: &BrokerSettings) -> Self {
        let options = sas::broker::client_options(settings, "test").expect("client options");
        let client = Client::connect_with(options).await.expect("RabbitMQ is up");
        let broker = Broker::connect(settings, "test")
            .await
            .expect("RabbitMQ is up");
        let publisher = broker.publisher().await.expect("publisher");
        Self {
            client,
            broker,
            publisher,
        }
    }

    fn broker(&self) -> &Broker {
        &self.broker
    }
}

struct Proc {
    child: Child,
    port: u16,
}

impl TestApp {
    /// How a test arranges its deployment: quick default timings, changed
    /// one at a time, e.g.
    /// `TestApp::builder().step_timeout("700ms").spawn().await`.
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// A fresh deployment with the default configuration, without processes
    /// yet: `TestApp::builder().build()`.
    pub async fn new() -> Self {
        Self::builder().build().await
    }

    /// A fresh deployment: database, prefix, remote-sim and configuration.
    async fn with(options: Options) -> Self {
        let id = Uuid::new_v4().simple().to_string();
        let prefix = format!("t{}", &id[..12]);
        let db_name = format!("sas_test_{}", &id[..12]);
        let admin_url = options
            .postgres
            .as_ref()
            .map_or(pg_admin().to_owned(), |(admin, _)| admin.clone());
        let mut db_url = Postgres::new(admin_url.as_str())
            .create_migrated(&db_name)
            .await
            .expect("Postgres is up");
        let db = match &options.postgres {
            None => PgPool::connect(&db_url)
                .await
                .expect("connect test database"),
            Some((_, url)) => {
                // Through sas's own store, which follows a host list.
                db_url = url.replace("{db}", &db_name);
                let settings = sas::config::DatabaseSettings {
                    url: db_url.clone(),
                    max_connections: 4,
                    ..Default::default()
                };
                sas::state_store::StateStore::connect(&settings, "test")
                    .await
                    .expect("connect test database")
                    .pool()
                    .clone()
            }
        };

        let sim = Arc::new(RemoteSim::new(Default::default()).expect("remote-sim"));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind remote-sim");
        let sim_addr = listener.local_addr().expect("remote-sim address");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(remote_sim::serve_with(listener, sim.clone(), async move {
            let _ = rx.await;
        }));

        let dir = std::env::temp_dir().join(format!("sas-test-{prefix}"));
        std::fs::create_dir_all(&dir).expect("test dir");
        let config = dir.join("sas.toml");
        let agents_url = format!("http://{sim_addr}/svc");
        let extra = format!(
            r#"[scheduler]
poll_interval = "{poll}"

[outbox]
sweep_interval = "300ms"
sweep_age = "1s"

[shutdown]
grace = "5s"

[agent]
backoff_initial = "20ms"
backoff_max = "200ms"
breaker_threshold = {threshold}
breaker_cooldown = "{cooldown}"

{extra}"#,
            poll = options.scheduler_poll,
            threshold = options.breaker.0,
            cooldown = options.breaker.1,
            extra = options.extra,
        );
        config_file(&options, &db_url, &prefix, &agents_url, &extra)
            .write(&config)
            .expect("write config");

        let settings = broker_settings(&options, &prefix);
        let conn = Conn::open(&settings).await;
        let queues = sas_testkit::broker::declare(conn.broker(), &settings, &AGENTS)
            .await
            .expect("topology");
        Self {
            prefix,
            queues,
            db_name,
            db_url,
            admin_url,
            config,
            dir,
            sim,
            sim_addr,
            db,
            broker: settings,
            conn: std::sync::RwLock::new(Arc::new(conn)),
            processes: Mutex::new(BTreeMap::new()),
            extra_queues: Mutex::new(Vec::new()),
            sim_stop: Some(tx),
        }
    }

    /// A deployment with one of each service running and ready:
    /// `TestApp::builder().spawn()`.
    pub async fn spawn() -> Self {
        Self::builder().spawn().await
    }

    /// The settings the services read from the deployment's configuration,
    /// with the HTTP port any free one (`http.port = 0`): for a service
    /// started in the test's own process (`scheduler::build(settings)`).
    pub fn settings(&self) -> sas::config::Settings {
        let mut settings =
            sas::config::Settings::load(Some(&self.config)).expect("the test's configuration");
        settings.http.port = Some(0);
        settings
    }

    /// Starts submission, scheduler, agent and supervisor and waits until each is ready.
    pub async fn start_all(&self) {
        for name in ["submission", "scheduler", "agent", "supervisor"] {
            self.start(name, name, &[]).await;
        }
    }

    /// Starts the four services, `service` with `env` (a setting of its
    /// own, e.g. `SAS__SCHEDULER__CLAIM_BATCH`), and waits for each.
    /// `SAS__SUBMISSION__START_ORDERS=false`: every new order waits,
    /// pending, for a scheduler's claim (for tests of the claims).
    pub const CLAIM_EVERY_ORDER: [(&str, &str); 1] = [("SAS__SUBMISSION__START_ORDERS", "false")];

    /// Starts the submission so that it stores new orders pending, for the
    /// schedulers to claim ([`Self::CLAIM_EVERY_ORDER`]).
    pub async fn start_submission_claiming_every_order(&self) {
        self.start_with_env("submission", "submission", &[], &Self::CLAIM_EVERY_ORDER)
            .await;
    }

    pub async fn start_all_with_env(&self, service: &str, env: &[(&str, &str)]) {
        for name in ["submission", "scheduler", "agent", "supervisor"] {
            let env = if name == service { env } else { &[] };
            self.start_with_env(name, name, &[], env).await;
        }
    }

    /// Starts `binary` as process `name` with `args` and waits for `/readyz`.
    pub async fn start(&self, name: &str, binary: &str, args: &[&str]) {
        self.start_with_env(name, binary, args, &[]).await;
    }

    /// Like [`TestApp::start`], with extra environment variables (e.g. `SAS__…` overrides).
    pub async fn start_with_env(
        &self,
        name: &str,
        binary: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) {
        // The port is free when picked, but another test may bind it before
        // the process does: then it exits at once, and gets another port.
        for attempt in 1..=3 {
            let port = free_port();
            let logged = self.log(name).len();
            // Append: a restarted process keeps its predecessor's lines.
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.dir.join(format!("{name}.log")))
                .expect("log file");
            let child = Command::new(bin(binary))
                .args(args)
                .env("SAS_CONFIG", &self.config)
                .env("SAS__HTTP__PORT", port.to_string())
                .env(
                    "RUST_LOG",
                    std::env::var("SAS_TEST_LOG").unwrap_or_else(|_| "info".into()),
                )
                .envs(env.iter().copied())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| {
                    panic!("cannot start {binary} (run `cargo build --workspace` first): {e}")
                });
            self.processes
                .lock()
                .unwrap()
                .insert(name.to_owned(), Proc { child, port });
            let Err(status) = self.wait_ready(name, port, logged).await else {
                return;
            };
            let log = self.log(name);
            let taken = log
                .get(logged..)
                .is_some_and(|new| new.contains("Address already in use"));
            assert!(
                taken && attempt < 3,
                "{name} exited with {status} before it was ready; log:\n{log}"
            );
        }
    }

    /// Waits for `/readyz`; the process's exit status if it exits first.
    /// A ready answer counts once the process's log (from `logged` bytes
    /// on) says it listens on `port`: another test's process that took the
    /// port first answers `/readyz` too, while this one fails to bind. A
    /// log kept quiet (`SAS_TEST_LOG`) says nothing: then two seconds of
    /// ready answers with the process alive will do.
    async fn wait_ready(&self, name: &str, port: u16, logged: usize) -> Result<(), ExitStatus> {
        let url = format!("http://127.0.0.1:{port}/readyz");
        let listening = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut ready_since = None;
        while Instant::now() < deadline {
            if let Some(status) = self.try_status(name) {
                return Err(status);
            }
            if http_get(&url).await.is_some_and(|(code, _)| code == 200) {
                let ours = self
                    .log(name)
                    .get(logged..)
                    .is_some_and(|new| new.contains(&listening));
                let since = *ready_since.get_or_insert_with(Instant::now);
                if ours || since.elapsed() > Duration::from_secs(2) {
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{name} not ready within 30s; log:\n{}", self.log(name));
    }

    /// Asserts that none of the processes `names` has exited.
    pub fn assert_running(&self, names: &[&str]) {
        for name in names {
            assert!(
                self.try_status(name).is_none(),
                "{name} exited; log:\n{}",
                self.log(name)
            );
        }
    }

    /// A process's exit status if it has exited (a crash, a refusal),
    /// `None` while it runs.
    pub fn try_status(&self, name: &str) -> Option<ExitStatus> {
        let mut procs = self.processes.lock().unwrap();
        procs.get_mut(name)?.child.try_wait().ok().flatten()
    }

    /// A process's log so far.
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default()
    }

    /// The HTTP port of a running process.
    pub fn port(&self, name: &str) -> u16 {
        self.processes.lock().unwrap()[name].port
    }

    /// Kills a process with SIGKILL.
    /// The process id of a running process.
    pub fn pid(&self, name: &str) -> u32 {
        self.processes.lock().unwrap()[name].child.id()
    }

    /// Whether a running process is stopped (SIGSTOP), by `/proc`.
    pub fn is_stopped(&self, name: &str) -> bool {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.pid(name))).unwrap_or_default();
        // The state follows the command name, which is in parentheses.
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('T'))
    }

    pub fn kill(&self, name: &str) {
        if let Some(mut p) = self.processes.lock().unwrap().remove(name) {
            p.child.kill().ok();
            p.child.wait().ok();
        }
    }

    /// Waits (up to `timeout`) for a process to exit by itself, e.g. at a crash point.
    pub async fn wait_exit(&self, name: &str, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_status(name) {
                self.processes.lock().unwrap().remove(name);
                return status;
            }
            if Instant::now() > deadline {
                panic!(
                    "{name} still running after {timeout:?}; log:\n{}",
                    self.log(name)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends SIGTERM and waits (up to 30 s) for the exit status.
    pub async fn terminate(&self, name: &str) -> ExitStatus {
        let mut p = self
            .processes
            .lock()
            .unwrap()
            .remove(name)
            .expect("process is running");
        signal(&p.child, "TERM");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = p.child.try_wait().expect("wait") {
                return status;
            }
            if Instant::now() > deadline {
                p.child.kill().ok();
                panic!(
                    "{name} did not stop within 30s of SIGTERM; log:\n{}",
                    self.log(name)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Declares an application status queue under this test's prefix.
    pub async fn status_queue(&self, name: &str) -> String {
        let queue = format!("{}-app.{name}", self.prefix);
        self.conn()
            .broker()
            .declare_status_queue(&queue)
            .await
            .expect("declare status queue");
        self.extra_queues.lock().unwrap().push(queue.clone());
        queue
    }

    /// Declares a quorum queue of the test's own (deleted with the app),
    /// dead-lettering to `dead` when given, as sas declares its work queues.
    pub async fn declare_queue(&self, queue: &str, dead: Option<&str>) {
        self.conn()
            .broker()
            .declare_queue(queue, sas::config::QueueType::Quorum, dead, 20)
            .await
            .expect("declare queue");
        self.extra_queues.lock().unwrap().push(queue.to_owned());
    }

    /// Publishes a body to the orders queue as an application would.
    pub async fn publish_raw(&self, body: &[u8], reply_to: Option<&str>, message_id: Option<&str>) {
        self.conn()
            .publisher
            .publish(&Outgoing {
                routing_key: self.queues.orders(),
                body,
                reply_to,
                message_id,
                mandatory: true,
                ..Outgoing::default()
            })
            .await
            .expect("publish order");
    }

    /// Submits an order of `workflow` through the client; returns its id.
    pub async fn submit(&self, workflow: &str, reply_to: Option<&str>) -> Uuid {
        self.submit_payload(workflow, json!({ "n": 1 }), reply_to)
            .await
    }

    /// Submits an order of `workflow` with `payload` (an object) through
    /// the client; returns its id.
    pub async fn submit_payload(
        &self,
        workflow: &str,
        payload: Value,
        reply_to: Option<&str>,
    ) -> Uuid {
        let Value::Object(payload) = payload else {
            panic!("a payload is an object: {payload}")
        };
        let mut order = Order::new(workflow, payload);
        order.reply_to = reply_to.map(str::to_owned);
        self.client()
            .submit_order(order)
            .await
            .expect("submit order")
            .id()
    }

    /// Submits many orders through the client, pipelining the confirms.
    /// Submits `n` orders of `workflow`, one every `every`: a steady load
    /// while a fault happens (the pacing is the load's shape, not a wait
    /// for something).
    pub async fn submit_steadily(
        &self,
        workflow: &str,
        n: usize,
        every: Duration,
        reply_to: Option<&str>,
    ) -> Vec<Uuid> {
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            ids.push(self.submit(workflow, reply_to).await);
            tokio::time::sleep(every).await;
        }
        ids
    }

    pub async fn submit_many(&self, workflow: &str, n: usize, reply_to: Option<&str>) -> Vec<Uuid> {
        let conn = self.conn();
        let mut ids = Vec::with_capacity(n);
        let mut left = n;
        while left > 0 {
            let mut pending = Vec::new();
            for _ in 0..left.min(100) {
                let mut order = Order::new(workflow, serde_json::Map::new());
                order.reply_to = reply_to.map(str::to_owned);
                let (id, confirm) = conn.client.send(order).await.expect("publish");
                ids.push(id);
                pending.push(confirm);
            }
            left -= pending.len();
            for p in pending {
                p.confirmed().await.expect("confirm");
            }
        }
        ids
    }

    /// The test's client, as an application holds one (on the test's
    /// connection: replaced by [`TestApp::reconnect`]).
    pub fn client(&self) -> ClientRef {
        ClientRef(self.conn())
    }

    /// Reads messages from `queue` (acking them) until `done` says so; panics after `timeout`.
    pub async fn collect(
        &self,
        queue: &str,
        timeout: Duration,
        done: impl Fn(&[Value]) -> bool,
    ) -> Vec<Value> {
        let read = |d: &Delivery| {
            vec![serde_json::from_slice(d.body()).unwrap_or_else(|_| {
                json!({ "raw": String::from_utf8_lossy(d.body()), "delivery": format!("{d:?}") })
            })]
        };
        self.collect_with(queue, timeout, done, read).await.0
    }

    /// Reads an agents' reply queue (acking) until `done` says so, each
    /// reply apart: a message may carry several (a pack, a JSON array).
    /// Returns the replies and how many messages carried them; panics
    /// after `timeout`.
    pub async fn collect_replies(
        &self,
        queue: &str,
        timeout: Duration,
        done: impl Fn(&[Value]) -> bool,
    ) -> (Vec<Value>, usize) {
        let read = |d: &Delivery| {
            let replies = sas::messages::decode_replies(d.body())
                .unwrap_or_else(|e| panic!("unreadable reply ({e}): {d:?}"));
            replies
                .into_iter()
                .map(|r| {
                    let r = r.unwrap_or_else(|e| panic!("unreadable reply ({e}): {d:?}"));
                    serde_json::to_value(r).expect("a reply as JSON")
                })
                .collect()
        };
        self.collect_with(queue, timeout, done, read).await
    }

    /// Reads messages from `queue` (acking them), each into values by
    /// `read`, until `done` says so: the values and how many messages
    /// carried them. Panics after `timeout`.
    async fn collect_with(
        &self,
        queue: &str,
        timeout: Duration,
        done: impl Fn(&[Value]) -> bool,
        read: impl Fn(&Delivery) -> Vec<Value>,
    ) -> (Vec<Value>, usize) {
        let mut consumer = self.consumer(queue).await;
        let (mut got, mut messages) = (Vec::new(), 0);
        let deadline = tokio::time::Instant::now() + timeout;
        while !done(&got) {
            match tokio::time::timeout_at(deadline, consumer.next()).await {
                Ok(Some(Ok(d))) => {
                    messages += 1;
                    got.extend(read(&d));
                    d.ack().await.expect("ack");
                }
                Ok(_) => panic!("consumer of {queue} ended"),
                Err(_) => panic!(
                    "timed out on {queue} after {} values in {messages} messages; last: {:?}",
                    got.len(),
                    got.iter().rev().take(3).collect::<Vec<_>>()
                ),
            }
        }
        consumer.close("done").await;
        (got, messages)
    }

    /// Takes one message from `queue`, if any, unsettled: ack it or put it back.
    pub async fn take(&self, queue: &str) -> Option<sas::broker::Taken> {
        self.conn().broker().take(queue).await.expect("basic.get")
    }

    /// Takes one message from `queue`, if any: `(body, x-sas-reason)`.
    pub async fn get(&self, queue: &str) -> Option<(Vec<u8>, Option<String>)> {
        let taken = self.conn().broker().take(queue).await.expect("basic.get")?;
        let got = (taken.delivery.body().to_vec(), reason_of(&taken.delivery));
        taken.ack().await.expect("ack");
        Some(got)
    }

    /// A consumer of `queue` (up to 500 unacknowledged) on a channel of its own.
    async fn consumer(&self, queue: &str) -> Consumer {
        self.conn()
            .broker()
            .consume(queue, 500, "")
            .await
            .expect("consume")
    }

    /// Takes every message now ready in `queue` (acking them): `(body,
    /// x-sas-reason)` each, in queue order.
    pub async fn drain(&self, queue: &str) -> Vec<(Vec<u8>, Option<String>)> {
        let count = self.ready(queue).await as usize;
        let mut consumer = self.consumer(queue).await;
        let mut got = Vec::with_capacity(count);
        while got.len() < count {
            match tokio::time::timeout(Duration::from_secs(10), consumer.next()).await {
                Ok(Some(Ok(d))) => {
                    got.push((d.body().to_vec(), reason_of(&d)));
                    d.ack().await.expect("ack");
                }
                _ => panic!("{queue}: {} of {count} messages taken", got.len()),
            }
        }
        consumer.close("done").await;
        got
    }

    /// Waits until `check` holds, polling; panics with `what` after `timeout`.
    pub async fn eventually<F, Fut>(&self, what: &str, timeout: Duration, check: F)
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + timeout;
        while !check().await {
            if Instant::now() > deadline {
                panic!("not within {timeout:?}: {what}\n{}", self.logs_tail());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The last lines of every process's log, for failure messages.
    pub fn logs_tail(&self) -> String {
        let mut out = String::new();
        for entry in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "log") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                out.push_str(&format!("--- {}\n", path.display()));
                for l in &lines[lines.len().saturating_sub(15)..] {
                    out.push_str(l);
                    out.push('\n');
                }
            }
        }
        out
    }

    /// Counts orders per `process_state`.
    pub async fn states(&self) -> BTreeMap<String, i64> {
        sqlx::query_as::<_, (String, i64)>("SELECT process_state, count(*) FROM orders GROUP BY 1")
            .fetch_all(&self.db)
            .await
            .expect("count states")
            .into_iter()
            .collect()
    }

    /// How many orders are in `state`.
    pub async fn count_in(&self, state: &str) -> i64 {
        self.states().await.get(state).copied().unwrap_or(0)
    }

    /// An order's `(process_state, failure_count)`.
    pub async fn order(&self, id: Uuid) -> Option<(String, i32)> {
        sqlx::query_as("SELECT process_state, failure_count FROM orders WHERE order_id = $1")
            .bind(id)
            .fetch_optional(&self.db)
            .await
            .expect("read order")
    }

    /// Waits until `n` orders are in `state`.
    pub async fn wait_for_state(&self, state: &str, n: i64, timeout: Duration) {
        self.eventually(&format!("{n} orders {state}"), timeout, || async {
            self.count_in(state).await >= n
        })
        .await;
    }

    /// Waits (up to 10 s) until `n` sessions of the test's database wait on
    /// a lock (a row lock or an advisory lock): a statement the test blocked
    /// on purpose has reached the lock, rather than maybe being on its way.
    pub async fn wait_for_lock_waiters(&self, n: i64) {
        self.eventually(
            &format!("{n} sessions waiting on a lock"),
            Duration::from_secs(10),
            || async {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .fetch_one(&self.db)
                .await
                .expect("pg_stat_activity");
                waiting >= n
            },
        )
        .await;
    }

    /// Kills the agent (named `agent`) and keeps it down until the
    /// supervisor has re-attempted order `id` (its complete-by passed),
    /// then starts a new one.
    pub async fn crash_agent_until_reattempt(&self, id: Uuid, timeout: Duration) {
        self.kill("agent");
        self.eventually("the re-attempt", timeout, || async {
            self.order(id)
                .await
                .is_some_and(|(_, failures)| failures >= 1)
        })
        .await;
        self.start("agent", "agent", &[]).await;
    }

    /// Sets the remote-sim knobs of `/svc/<agent>`.
    pub fn knobs(&self, agent: &str, knobs: Knobs) {
        self.sim
            .set_knobs(&format!("/svc/{agent}"), knobs)
            .expect("knobs");
    }

    /// What remote-sim has seen.
    pub fn stats(&self) -> Stats {
        self.sim.stats()
    }

    /// The test's own confirm-mode publisher.
    pub fn publisher(&self) -> Publisher {
        self.conn().publisher.clone()
    }

    fn conn(&self) -> Arc<Conn> {
        self.conn.read().unwrap().clone()
    }

    /// Opens a new connection for the test itself (after a broker restart).
    pub async fn reconnect(&self) {
        let conn = Conn::open(&self.broker).await;
        *self.conn.write().unwrap() = Arc::new(conn);
    }

    /// A consumer of `queue` on a channel of its own, as the services subscribe.
    pub async fn subscribe(&self, queue: &str, prefetch: u16) -> Subscription {
        self.conn()
            .broker()
            .subscribe(queue, prefetch, "test")
            .await
            .expect("subscribe")
    }

    /// Messages ready in a queue (a passive declare).
    pub async fn ready(&self, queue: &str) -> u32 {
        self.conn()
            .broker()
            .message_count(queue)
            .await
            .expect("queue exists")
    }

    /// Publishes a step reply to the schedulers' reply queue, as an agent would.
    pub async fn publish_reply(&self, reply: &sas::messages::StepReply) {
        let body = serde_json::to_vec(reply).expect("encode reply");
        let correlation = reply.dispatch_id.to_string();
        self.conn()
            .publisher
            .publish(&Outgoing {
                routing_key: self.queues.replies(),
                body: &body,
                correlation_id: Some(&correlation),
                mandatory: true,
                ..Outgoing::default()
            })
            .await
            .expect("publish reply");
    }

    /// Sends `request` to agent `agent`'s queue as a scheduler would, its
    /// replies to go to `reply_to`; the broker's confirm is left to the
    /// caller, so that several can be on their way at once.
    pub async fn send_request(
        &self,
        agent: &str,
        request: &sas::messages::StepRequest,
        reply_to: &str,
    ) -> sas::broker::PendingConfirm {
        let body = serde_json::to_vec(request).expect("encode request");
        self.conn()
            .publisher
            .send(&Outgoing {
                routing_key: &self.queues.agent_requests(agent),
                body: &body,
                reply_to: Some(reply_to),
                mandatory: true,
                ..Outgoing::default()
            })
            .await
            .expect("send request")
    }

    /// Publishes step replies to the schedulers' reply queue as one message
    /// (a pack, as an agent sends the replies it has ready together),
    /// followed in the pack by `unreadable` items as they are written.
    pub async fn publish_pack(&self, replies: &[sas::messages::StepReply], unreadable: &[&str]) {
        let bodies = sas::messages::encode_replies(replies);
        assert_eq!(bodies.len(), 1, "the replies fit one message");
        let mut body = bodies[0].0.clone();
        if !unreadable.is_empty() {
            assert_eq!(body.pop(), Some(b']'), "a pack of two replies or more");
            for item in unreadable {
                body.push(b',');
                body.extend_from_slice(item.as_bytes());
            }
            body.push(b']');
        }
        self.conn()
            .publisher
            .publish(&Outgoing {
                routing_key: self.queues.replies(),
                body: &body,
                mandatory: true,
                ..Outgoing::default()
            })
            .await
            .expect("publish replies");
    }

    /// Submits one order of `workflow` with a fresh status queue and reads its
    /// events until the terminal one: `(order id, events)`.
    pub async fn run_one(&self, workflow: &str) -> (Uuid, Vec<Value>) {
        self.run_with(workflow, json!({ "n": 1 })).await
    }

    /// [`Self::run_one`] with `payload`.
    pub async fn run_with(&self, workflow: &str, payload: Value) -> (Uuid, Vec<Value>) {
        let status = self
            .status_queue(&format!("status-{}", Uuid::new_v4().simple()))
            .await;
        let id = self.submit_payload(workflow, payload, Some(&status)).await;
        let events = self
            .collect(&status, Duration::from_secs(30), |got| {
                got.iter().any(is_terminal)
            })
            .await;
        (id, events)
    }

    /// Reads status events from `queue` until every order of `ids` has had a
    /// terminal event; returns each order's events, deduplicated on
    /// (`order_id`, `seq`) as the contract tells consumers to, in `seq` order.
    pub async fn stories(
        &self,
        queue: &str,
        ids: &[Uuid],
        timeout: Duration,
    ) -> BTreeMap<Uuid, Vec<Value>> {
        let wanted: std::collections::BTreeSet<String> = ids.iter().map(Uuid::to_string).collect();
        let events = self
            .collect(queue, timeout, |got| {
                let ended: std::collections::BTreeSet<&str> = got
                    .iter()
                    .filter(|e| is_terminal(e))
                    .filter_map(|e| e["order_id"].as_str())
                    .filter(|id| wanted.contains(*id))
                    .collect();
                ended.len() == wanted.len()
            })
            .await;
        let mut stories: BTreeMap<Uuid, BTreeMap<i64, Value>> = BTreeMap::new();
        for e in events {
            let (Some(id), Some(seq)) = (
                e["order_id"].as_str().and_then(|s| Uuid::parse_str(s).ok()),
                e["seq"].as_i64(),
            ) else {
                continue;
            };
            let previous = stories.entry(id).or_default().insert(seq, e.clone());
            if let Some(p) = previous {
                assert_eq!(
                    p["state"], e["state"],
                    "order {id}: two different events with seq {seq}"
                );
            }
        }
        stories
            .into_iter()
            .map(|(id, by_seq)| (id, by_seq.into_values().collect()))
            .collect()
    }

    /// The invariants every fault scenario must keep:
    /// - every order ends in exactly one terminal state, in the state store
    ///   and on its status queue (events numbered 1, 2, 3 … without a gap);
    /// - no order is left `processing` past its complete-by;
    /// - remote-sim applied each idempotency key at most once;
    /// - the dead-letter queues hold nothing but the `expected_dead` messages;
    /// - the work queues are drained (nothing left unacknowledged or unread).
    ///
    /// Returns each order's events.
    pub async fn assert_invariants(
        &self,
        status: &str,
        ids: &[Uuid],
        expected_dead: &[(&str, u32)],
        timeout: Duration,
    ) -> BTreeMap<Uuid, Vec<Value>> {
        let stories = self.stories(status, ids, timeout).await;
        for id in ids {
            let story = &stories[id];
            let seqs: Vec<i64> = story.iter().filter_map(|e| e["seq"].as_i64()).collect();
            let expected: Vec<i64> = (1..=story.len() as i64).collect();
            assert_eq!(seqs, expected, "order {id}: events not numbered 1..n");
            let terminals: Vec<&Value> = story.iter().filter(|e| is_terminal(e)).collect();
            assert_eq!(
                terminals.len(),
                1,
                "order {id}: {} terminal events",
                terminals.len()
            );
            let last = story.last().expect("events")["state"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let (state, _) = self.order(*id).await.expect("order stored");
            let matches = matches!(
                (last.as_str(), state.as_str()),
                ("processed", "processed") | ("compensated", "compensated") | ("failed", "error")
            );
            assert!(matches, "order {id}: last event {last} but state {state}");
        }
        let stuck: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM orders WHERE process_state IN ('processing', 'compensating') \
             AND complete_by < now() - interval '5 seconds'",
        )
        .fetch_one(&self.db)
        .await
        .expect("count stuck orders");
        assert_eq!(stuck, 0, "orders left past their complete-by");
        let stats = self.stats();
        for (key, k) in &stats.keys {
            assert!(k.applied <= 1, "{key} applied {} times", k.applied);
        }
        let agents: Vec<&str> = AGENTS.to_vec();
        for q in self.queues.all(agents.iter().copied()) {
            let queue = q.name;
            if let Some(dead) = q.dead_letters {
                let want = expected_dead
                    .iter()
                    .find(|(q, _)| *q == dead)
                    .map_or(0, |(_, n)| *n);
                assert_eq!(self.ready(&dead).await, want, "dead letters in {dead}");
                // Late duplicates (stale replies, re-sent requests) may still be on their way.
                let drained = async {
                    while self.ready(&queue).await > 0 {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                };
                tokio::time::timeout(Duration::from_secs(15), drained)
                    .await
                    .unwrap_or_else(|_| panic!("messages left in {queue}"));
            }
        }
        stories
    }

    /// Fetches `/metrics` of a process.
    pub async fn metrics(&self, name: &str) -> String {
        let url = format!("http://127.0.0.1:{}/metrics", self.port(name));
        http_get(&url)
            .await
            .map(|(_, body)| body)
            .unwrap_or_default()
    }

    /// Removes every ready message of `queue` (as a broker restart drops
    /// transient ones); how many.
    pub async fn purge(&self, queue: &str) -> u32 {
        self.conn().broker().purge(queue).await.expect("purge")
    }

    /// Messages ready in `queue`, or `None` while nobody has declared it.
    pub async fn ready_if_declared(&self, queue: &str) -> Option<u32> {
        self.conn().broker().message_count(queue).await.ok()
    }
}

/// The value of the sample `name` (with its labels, as printed) in a
/// Prometheus text page; 0 when absent.
pub fn sample(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

impl Drop for TestApp {
    fn drop(&mut self) {
        for (_, mut p) in std::mem::take(&mut *self.processes.lock().unwrap()) {
            p.child.kill().ok();
            p.child.wait().ok();
        }
        if let Some(tx) = self.sim_stop.take() {
            tx.send(()).ok();
        }
        let extra_queues: Vec<String> = self.extra_queues.lock().unwrap().drain(..).collect();
        let (db_name, broker, dir) = (self.db_name.clone(), self.broker.clone(), self.dir.clone());
        let admin_url = self.admin_url.clone();
        let keep_logs = std::thread::panicking() || std::env::var_os("SAS_TEST_KEEP").is_some();
        // Async cleanup from Drop: a thread with its own runtime.
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                // Best effort: a failed clean-up must not fail the test.
                sas_testkit::broker::delete(&broker, &AGENTS, &extra_queues)
                    .await
                    .ok();
                Postgres::new(admin_url).drop(&db_name).await.ok();
            });
            if keep_logs {
                eprintln!("logs kept in {}", dir.display());
            } else {
                std::fs::remove_dir_all(&dir).ok();
            }
        })
        .join()
        .ok();
    }
}

fn broker_settings(options: &Options, prefix: &str) -> BrokerSettings {
    BrokerSettings {
        step_queues: options.step_queues,
        ..sas_testkit::broker::settings(&options.broker_url, prefix)
    }
}

/// The configuration of a test deployment: the shared workflows, with
/// the tests' quick timings (a slow poll, sweep and back-off would make
/// every test wait) and the test's `extra` sections.
fn config_file<'a>(
    o: &'a Options,
    db_url: &'a str,
    prefix: &'a str,
    agents_url: &'a str,
    extra: &'a str,
) -> ConfigFile<'a> {
    ConfigFile {
        database_url: db_url,
        max_connections: Some(8),
        broker_url: &o.broker_url,
        step_queues: o.step_queues.as_str(),
        prefix,
        agents_url,
        agents: &AGENTS,
        step_timeout: o.step_timeout,
        supervisor_interval: o.supervisor_interval,
        max_failures: o.max_failures,
        retry_schedule: o.retry_schedule,
        warn_at: o.warn_at,
        extra,
    }
}

/// The test's [`Client`], borrowed from its current connection.
pub struct ClientRef(Arc<Conn>);

impl std::ops::Deref for ClientRef {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.0.client
    }
}

/// Why a dead letter was set aside ([`sas::broker::dead_letter_reason`]).
fn reason_of(delivery: &Delivery) -> Option<String> {
    sas::broker::dead_letter_reason(delivery)
}

/// A workflow `parent` whose step `ship` runs the child workflow
/// `shipping` (one step, `pack`, on agent `b`, undone by `b-undo`).
pub const CHILD_WORKFLOWS: &str = r#"[workflows.shipping]
steps = [ { name = "pack", agent = "b", compensate = "b-undo" } ]

[workflows.parent]
steps = [
  { name = "reserve", agent = "a", compensate = "a-undo" },
  { name = "ship", workflow = "shipping", timeout = "20s" },
  { name = "bill", agent = "c" },
]
"#;

/// The child order of step `step` of order `parent`: `UUIDv5(parent, step)`.
pub fn child_of(parent: Uuid, step: &str) -> Uuid {
    Uuid::new_v5(&parent, step.as_bytes())
}

/// Whether a status event ends its order.
pub fn is_terminal(e: &Value) -> bool {
    matches!(
        e["state"].as_str(),
        Some("processed" | "compensated" | "failed" | "rejected")
    )
}

/// Whether every order's last event is `state`.
pub fn all_end_in(stories: &BTreeMap<Uuid, Vec<Value>>, state: &str) -> bool {
    stories
        .values()
        .all(|s| s.last().is_some_and(|e| e["state"] == state))
}

/// The `state` of each status event, in order.
pub fn states(events: &[Value]) -> Vec<&str> {
    events.iter().filter_map(|e| e["state"].as_str()).collect()
}

/// Starts `binary` with the configuration `toml` and checks that it
/// refuses to start: exit code 2 and one line on stderr that says `says`.
pub fn assert_refused_at_start_up(binary: &str, toml: &str, says: &str) {
    let dir = tls::temp_dir("refused");
    let file = dir.join("sas.toml");
    std::fs::write(&file, toml).expect("write the configuration");
    let out = Command::new(bin(binary))
        .env("SAS_CONFIG", &file)
        .output()
        .expect("run");
    std::fs::remove_dir_all(&dir).ok();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(says), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// The path of a workspace binary next to the test binary.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target directory");
    dir.join(name)
}

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> u16 {
    sas_testkit::free_port().expect("free port")
}

fn signal(child: &Child, sig: &str) {
    Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(child.id().to_string())
        .status()
        .expect("kill");
}

/// A tiny HTTP GET over a plain TCP stream: `(status, body)`.
pub async fn http_get(url: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_string()), |(h, p)| (h, format!("/{p}")));
    let mut stream =
        tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(host))
            .await
            .ok()?
            .ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    stream.write_all(req.as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut buf))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((code, body))
}

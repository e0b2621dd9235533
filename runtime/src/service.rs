//! What every service does around its own work. [`App`] is a service as a
//! value: built from its settings, it connects the state store, serves
//! `/healthz`, `/readyz` and `/metrics` on its port, runs its work and stops
//! when asked. [`main`] is a binary around one: it loads the configuration,
//! starts telemetry, stops the app on SIGTERM/SIGINT, and reports a failure
//! in one line with a non-zero exit.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::http::{self, Health};
use crate::metrics::Metrics;
use crate::state_store::{Plans, StateStore};
use crate::store_cell::StoreCell;
use crate::telemetry;
use crate::topology::QueueNames;

/// Options every service takes.
#[derive(Debug, Clone, clap::Args)]
pub struct CommonArgs {
    /// TOML configuration file (layered over the defaults, under `SAS__*` variables).
    #[arg(long, env = "SAS_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// What a service's work gets: settings, clients, metrics and the shutdown token.
pub struct Context {
    pub name: &'static str,
    pub settings: Settings,
    pub queues: QueueNames,
    /// Who may submit and where their events may go (contract §1b).
    pub applications: crate::applications::Applications,
    /// The state store of a service that needs one to start
    /// ([`StoreUse::Required`]).
    pub store: Option<StateStore>,
    /// The state store of a service that connects it in the background
    /// ([`StoreUse::Background`]): empty until connected.
    pub connecting: Arc<StoreCell>,
    pub metrics: Arc<Metrics>,
    pub health: Arc<Health>,
    pub shutdown: CancellationToken,
}

impl Context {
    /// The state store; services that need it were started with one.
    pub fn store(&self) -> anyhow::Result<&StateStore> {
        self.store
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("{} runs without a state store", self.name))
    }

    /// Runs this service's broker sessions until shutdown
    /// ([`crate::broker::run_sessions`]), declaring the queues of `agents`.
    /// Make `session` an `async move` closure that owns what it uses (an
    /// `Arc` of the context, say): one that borrows the caller's locals
    /// keeps the service's future from being `Send`, since rustc cannot
    /// prove it for every lifetime of the session's call, and
    /// [`App::start`] runs the work as a task of its own.
    pub async fn run_sessions<F>(
        &self,
        agents: &[String],
        session: F,
    ) -> Result<(), crate::broker::BrokerError>
    where
        F: AsyncFnMut(
            &crate::broker::Broker,
        ) -> Result<crate::broker::SessionEnd, crate::broker::BrokerError>,
    {
        crate::broker::run_sessions(
            &self.settings.broker,
            agents,
            self.name,
            &self.shutdown,
            &self.health,
            session,
        )
        .await
    }

    /// Consumes `queue` on `broker` (`prefetch` unacknowledged at most,
    /// consumer tag `tag`), its hopeless deliveries going to its `.dead`
    /// queue with their reason through `publisher`, after
    /// `broker.delivery_limit` tries of one that fails the same way each
    /// time; handler panics are counted.
    pub async fn subscribe(
        &self,
        broker: &crate::broker::Broker,
        publisher: &crate::broker::Publisher,
        queue: &str,
        prefetch: u16,
        tag: &str,
    ) -> Result<crate::broker::Subscription, crate::broker::BrokerError> {
        let dead_letters = crate::broker::DeadLetters::new(
            publisher.clone(),
            queue,
            self.settings.broker.delivery_limit,
            self.metrics.handler_panics.clone(),
        );
        Ok(broker
            .subscribe(queue, prefetch, tag)
            .await?
            .with_dead_letters(dead_letters))
    }
}

/// How a service starts.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    pub name: &'static str,
    /// Its HTTP port unless `http.port` says otherwise.
    pub default_port: u16,
    /// How it uses the state store.
    pub store: StoreUse,
}

/// How a service uses the state store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreUse {
    /// Not at all.
    None,
    /// Connected (and migrated) before the service starts, its statements
    /// planned as given: it cannot work without it ([`Context::store`]).
    Required(Plans),
    /// Connected off the start path with at most `max_connections`, trying
    /// again every ten seconds until shutdown: the service serves without it
    /// meanwhile (the agent, whose calls go on while Postgres is away), and
    /// finds it in [`Context::connecting`] once it is reached.
    Background { max_connections: u32 },
}

/// How long a background connection waits before trying again.
const RECONNECT: Duration = Duration::from_secs(10);

/// Connects `cell`'s store in the background, trying again until `shutdown`.
async fn connect_in_background(
    mut database: crate::config::DatabaseSettings,
    max_connections: u32,
    name: &'static str,
    cell: Arc<StoreCell>,
    shutdown: CancellationToken,
) {
    database.max_connections = max_connections;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            connected = StateStore::connect(&database, name) => match connected {
                Ok(store) => return cell.set(store),
                Err(e) => tracing::warn!(error = %e, "cannot reach Postgres; trying again"),
            },
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(RECONNECT) => {}
        }
    }
}

/// A service built from its settings: its HTTP port bound, its state store
/// connected as its [`Spec`] says, its work running. The binaries start one
/// and stop it on SIGTERM ([`main`]); tests start several in one process,
/// each on a port of its own (`http.port = 0`), and stop them.
pub struct App {
    name: &'static str,
    addr: SocketAddr,
    shutdown: CancellationToken,
    running: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl App {
    /// Starts the service `spec` describes with `settings`: connects its
    /// state store, makes its routes and its work with `build` (together,
    /// so that what they share is handed from one to the other as a value),
    /// serves the routes beside `/healthz`, `/readyz` and `/metrics`, then
    /// starts the work. Returns once the port is bound; an `Err` is a
    /// service that could not start (its store unreachable, its port taken).
    pub async fn start_with_routes<B, Fut>(
        spec: Spec,
        settings: Settings,
        build: B,
    ) -> anyhow::Result<App>
    where
        B: FnOnce(Arc<Context>) -> (axum::Router, Fut),
        Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let Spec {
            name,
            default_port,
            store,
        } = spec;
        // Before anything builds a TLS client (reqwest needs it); once per process.
        crate::tls::install_crypto_provider();
        let shutdown = CancellationToken::new();
        let connecting = Arc::new(StoreCell::default());
        let store = match store {
            StoreUse::Required(plans) => {
                Some(StateStore::connect_with(&settings.database, name, plans).await?)
            }
            StoreUse::Background { max_connections } => {
                tokio::spawn(connect_in_background(
                    settings.database.clone(),
                    max_connections,
                    name,
                    connecting.clone(),
                    shutdown.clone(),
                ));
                None
            }
            StoreUse::None => None,
        };
        let metrics = Arc::new(Metrics::new(name));
        let health = Arc::new(Health::new(store.clone()));
        let ctx = Arc::new(Context {
            name,
            queues: QueueNames::new(&settings.broker.prefix),
            applications: crate::applications::Applications::new(
                &settings.applications,
                crate::broker::own_users(&settings.broker),
            ),
            settings,
            store: store.clone(),
            connecting: connecting.clone(),
            metrics: metrics.clone(),
            health: health.clone(),
            shutdown: shutdown.clone(),
        });
        let http_stop = CancellationToken::new();
        // A future does nothing until awaited: the work starts below.
        let (routes, work) = build(ctx.clone());
        let served = http::serve(
            &ctx.settings.http,
            default_port,
            health,
            metrics,
            routes,
            http_stop.clone(),
        )
        .await;
        let (addr, server) = match served {
            Ok(served) => served,
            Err(e) => {
                // Nothing runs: stop what the store's connection started.
                shutdown.cancel();
                close(store, &connecting).await;
                return Err(e.into());
            }
        };
        tracing::info!(%addr, prefix = %ctx.settings.broker.prefix, "{name} started");
        for advice in ctx.settings.advice() {
            tracing::warn!("{advice}");
        }
        drop(ctx);
        let running = tokio::spawn(async move {
            let outcome = work.await;
            http_stop.cancel();
            server.await.ok();
            close(store, &connecting).await;
            outcome
        });
        Ok(App {
            name,
            addr,
            shutdown,
            running,
        })
    }

    /// Like [`App::start_with_routes`], for a service that serves no routes
    /// of its own: only its `work`.
    pub async fn start<F, Fut>(spec: Spec, settings: Settings, work: F) -> anyhow::Result<App>
    where
        F: FnOnce(Arc<Context>) -> Fut,
        Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        Self::start_with_routes(spec, settings, |ctx| (axum::Router::new(), work(ctx))).await
    }

    /// The service's name (`scheduler`, …).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Where its HTTP port is bound.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Asks the service to stop: it stops taking work and drains what it
    /// has, within `shutdown.grace`. [`App::stopped`] tells when it has.
    pub fn stop(&self) {
        self.shutdown.cancel();
    }

    /// Waits until the service has stopped (asked by [`App::stop`], or its
    /// work ended by itself): the work's outcome.
    pub async fn stopped(self) -> anyhow::Result<()> {
        match self.running.await {
            Ok(outcome) => outcome,
            Err(e) => Err(anyhow::anyhow!("{} panicked: {e}", self.name)),
        }
    }
}

async fn close(store: Option<StateStore>, connecting: &StoreCell) {
    for store in store.into_iter().chain(connecting.get()) {
        store.close().await;
    }
}

/// Runs the service that `build` makes from the configuration to
/// completion, stopping it on SIGTERM or SIGINT, and turns the outcome into
/// an exit code: 0 after a clean shutdown, 2 for bad configuration, 1 for
/// anything else, each failure reported in one line on stderr.
pub async fn main<F, Fut>(name: &'static str, args: CommonArgs, build: F) -> ExitCode
where
    F: FnOnce(Settings) -> Fut,
    Fut: Future<Output = anyhow::Result<App>>,
{
    // Before the service starts threads (lapin's, blocking ones).
    crate::memory::limit_arenas();
    // Before anything builds a TLS client (reqwest needs it).
    crate::tls::install_crypto_provider();
    let settings = match Settings::load(args.config.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            // No settings to know the secrets by: mask any URL's password.
            eprintln!("{name}: {}", crate::tls::redact(&e.to_string(), []));
            return ExitCode::from(2);
        }
    };
    if let Err(e) = settings.validate() {
        eprintln!("{name}: {}", settings.redact(&e.to_string()));
        return ExitCode::from(2);
    }
    let exporter = telemetry::init_with_export(&settings.log, &settings.telemetry, name);
    // What is printed of a failure must not show a password the
    // configuration holds, whichever library quoted it.
    let redactor = settings.clone();
    match run(settings, build).await {
        Ok(()) => {
            tracing::info!("{name} stopped");
            exporter.shutdown();
            ExitCode::SUCCESS
        }
        Err(e) => {
            let error = redactor.redact(&format!("{e:#}"));
            tracing::error!(%error, "{name} failed");
            eprintln!("{name}: {error}");
            exporter.shutdown();
            ExitCode::FAILURE
        }
    }
}

async fn run<F, Fut>(settings: Settings, build: F) -> anyhow::Result<()>
where
    F: FnOnce(Settings) -> Fut,
    Fut: Future<Output = anyhow::Result<App>>,
{
    // Before the service starts: a signal while it connects stops it as
    // soon as it has started.
    let signal = crate::shutdown::on_signal()?;
    let app = build(settings).await?;
    let stop = app.shutdown.clone();
    tokio::spawn(async move {
        signal.cancelled().await;
        stop.cancel();
    });
    app.stopped().await
}

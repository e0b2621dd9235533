//! `sas-bench`: measures the sas suite against the machine's limit and its
//! peers, in one run. `scripts/bench.sh` builds the release binaries and runs
//! it; see docs/performance.md.

mod floor;
mod hops;
mod limits;
mod load;
mod peers;
mod pgsample;
mod plan;
mod procs;
mod report;
mod restate;
mod suite;

use std::path::PathBuf;

use clap::Parser;

/// Benchmarks sas (release binaries) against the local Postgres and RabbitMQ,
/// with the machine's limit and Celery, procrastinate, Restate and DBOS in
/// the same run.
#[derive(Debug, Clone, Parser)]
#[command(name = "sas-bench", version, about)]
pub struct Args {
    /// A ~2-minute smoke run: small sizes everywhere.
    #[arg(long)]
    pub quick: bool,
    /// Orders of the 1-step workflow at full load.
    #[arg(long)]
    pub orders_one: Option<usize>,
    /// Orders of the 3-step workflow at full load.
    #[arg(long)]
    pub orders_three: Option<usize>,
    /// Orders of each low-load run (fewer when the run would exceed --low-max-secs).
    #[arg(long)]
    pub low_orders: Option<usize>,
    /// Offer the low-load runs (sas's and the peers') this many 1-step
    /// orders/s (3-step: a third) instead of 50 one-step and 20 three-step
    /// orders/s.
    #[arg(long, value_name = "ORDERS_PER_SEC")]
    pub low_rate: Option<f64>,
    /// Longest low-load run, seconds.
    #[arg(long)]
    pub low_max_secs: Option<f64>,
    /// Orders of each run with 2 schedulers and 2 agents (1-step; half as many 3-step).
    #[arg(long)]
    pub scaled_orders: Option<usize>,
    /// Orders of the recovery run (3-step, one agent SIGKILLed a third of the way in).
    #[arg(long)]
    pub recovery_orders: Option<usize>,
    /// Orders per workflow for the Postgres limit.
    #[arg(long)]
    pub limit_orders: Option<usize>,
    /// Orders of each peer run, 1-step (3-step: a third of it).
    #[arg(long)]
    pub peer_orders: Option<usize>,
    /// Skip every sas run (the limit and the peers only).
    #[arg(long)]
    pub skip_sas: bool,
    /// Skip the 2-scheduler, 2-agent runs.
    #[arg(long)]
    pub skip_scaled: bool,
    /// Skip the run that submits over HTTP (for a build without the HTTP
    /// API, e.g. an older revision in `scripts/bench-compare.sh`).
    #[arg(long)]
    pub skip_http: bool,
    /// Skip the fan-out workflow, its run and its configuration (for a
    /// revision before #43, which knows no `for_each`).
    #[arg(long)]
    pub skip_fanout: bool,
    /// Skip the recovery run.
    #[arg(long)]
    pub skip_recovery: bool,
    /// Skip measuring the machine's limit.
    #[arg(long)]
    pub skip_limits: bool,
    /// Skip timing the floor of sas's chain (its hops, one at a time).
    #[arg(long)]
    pub skip_floor: bool,
    /// Skip the low-load runs with spans exported that time each hop of an
    /// order (`hops` in the report).
    #[arg(long)]
    pub skip_hops: bool,
    /// Skip every peer (Celery, procrastinate, Restate, DBOS).
    #[arg(long)]
    pub skip_peers: bool,
    /// Skip Celery (both result backends).
    #[arg(long)]
    pub skip_celery: bool,
    /// Skip the peers' low-load runs.
    #[arg(long)]
    pub skip_peer_low: bool,
    /// Skip procrastinate only.
    #[arg(long)]
    pub skip_procrastinate: bool,
    /// Skip Restate only.
    #[arg(long)]
    pub skip_restate: bool,
    /// Skip DBOS only.
    #[arg(long)]
    pub skip_dbos: bool,
    /// Before measuring, wait (up to 10 minutes) until the 1-minute load
    /// average is below this; 0 does not wait.
    #[arg(long, default_value_t = 0.0)]
    pub wait_idle: f64,
    /// Run `VACUUM (ANALYZE)` on sas's tables every this many seconds while
    /// sas runs, standing in for autovacuum; by default every 5 s when the
    /// server runs with `autovacuum = off`, else never. 0: never.
    #[arg(long, value_name = "SECONDS")]
    pub vacuum_every: Option<f64>,
    /// Where the JSON report goes (a Markdown copy goes beside it).
    #[arg(long, default_value = "bench/out/latest.json")]
    pub out: PathBuf,
    /// The release binaries.
    #[arg(long, default_value = "target/release")]
    pub bin_dir: PathBuf,
    /// Scratch space (configuration, logs, the peers' virtualenv).
    #[arg(long, default_value = ".bench")]
    pub work_dir: PathBuf,
    /// The peers' Python files and requirements.
    #[arg(long, default_value = "bench/peers")]
    pub peers_dir: PathBuf,
    /// Python that creates the peers' virtualenv.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Celery prefork processes.
    #[arg(long, default_value_t = 2)]
    pub celery_concurrency: usize,
    /// procrastinate worker processes.
    #[arg(long, default_value_t = 2)]
    pub procrastinate_workers: usize,
    /// Jobs each procrastinate worker runs at once.
    #[arg(long, default_value_t = 16)]
    pub procrastinate_concurrency: usize,
    /// DBOS worker processes (2 was its best in #27).
    #[arg(long, default_value_t = 2)]
    pub dbos_workers: usize,
    /// Workflows each DBOS worker process runs at once (the queue's `worker_concurrency`).
    #[arg(long, default_value_t = 16)]
    pub dbos_concurrency: usize,
    /// Calls to Restate's ingress open at once at full load.
    #[arg(long, default_value_t = 256)]
    pub restate_in_flight: usize,
    /// npm, which installs Restate's server into the work directory.
    #[arg(long, default_value = "npm")]
    pub npm: String,
    /// Postgres server (a database there is created and dropped per deployment).
    #[arg(
        long,
        env = "SAS_BENCH_PG",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub pg: String,
    /// RabbitMQ (queues are named under a prefix of their own and deleted).
    #[arg(
        long,
        env = "SAS_BENCH_AMQP",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp: String,
    /// Extra configuration for every sas service, e.g. `SAS__SCHEDULER__CLAIM_BATCH=64`.
    #[arg(long = "sas-env", value_name = "KEY=VALUE")]
    pub sas_env: Vec<String>,
    /// Also measure the 1-step workflow at full load with quorum step queues
    /// on a three-node RabbitMQ cluster (`scripts/cluster.sh`, brought up
    /// and taken down by the run) and on the single node, same settings:
    /// two rows and their ratio. Runs even with --skip-sas.
    #[arg(long)]
    pub cluster: bool,
    /// Orders of each --cluster run (default: as the 1-step full-load run).
    #[arg(long)]
    pub cluster_orders: Option<usize>,
    /// Keep each deployment's configuration and logs in the work directory.
    #[arg(long)]
    pub keep_logs: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    plan::run(args).await
}

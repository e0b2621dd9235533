//! `remote-sim` binary: serves the simulated remote services over HTTP.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use tracing_subscriber::EnvFilter;

/// Simulated remote services (inventory, payments, shipping, ...) with fault knobs.
#[derive(Debug, Parser)]
#[command(name = "remote-sim", version, about)]
struct Args {
    /// Address to listen on (docker uses 0.0.0.0).
    #[arg(long, env = "REMOTE_SIM_HOST", default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on; 0 picks a free port.
    #[arg(long, env = "REMOTE_SIM_PORT", default_value_t = 8081)]
    port: u16,
    /// JSON file mapping endpoint path (e.g. "/payments/charge") to knobs.
    #[arg(long, env = "REMOTE_SIM_KNOBS")]
    knobs: Option<PathBuf>,
    /// Serve HTTPS with this PEM certificate chain (needs --tls-key).
    #[arg(
        long,
        env = "REMOTE_SIM_TLS_CERT",
        requires = "tls_key",
        value_name = "FILE"
    )]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(
        long,
        env = "REMOTE_SIM_TLS_KEY",
        requires = "tls_cert",
        value_name = "FILE"
    )]
    tls_key: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();

    let initial = match &args.knobs {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading knobs file {}", path.display()))?;
            remote_sim::parse_knobs_map(&text)
                .with_context(|| format!("parsing knobs file {}", path.display()))?
        }
        None => HashMap::new(),
    };
    // Read before binding, so a wrong file fails before the port is announced.
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(remote_sim::tls_config(cert, key)?),
        _ => None,
    };
    // Install the signal handlers before announcing the port, so a signal sent
    // right after the announcement already means "graceful shutdown".
    let shutdown = shutdown_signal()?;

    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "remote-sim listening on {addr}")?;
    stdout.flush()?;
    drop(stdout);
    tracing::info!(
        %addr,
        https = tls.is_some(),
        endpoints_with_knobs = initial.len(),
        "remote-sim started"
    );

    match tls {
        Some(tls) => {
            let sim = std::sync::Arc::new(remote_sim::RemoteSim::new(initial)?);
            remote_sim::serve_tls_with(listener, tls, sim, shutdown).await
        }
        None => remote_sim::serve(listener, initial, shutdown).await,
    }
}

/// Completes on SIGTERM or SIGINT (Ctrl-C elsewhere).
#[cfg(unix)]
fn shutdown_signal() -> anyhow::Result<impl Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
        }
    })
}

/// Completes on Ctrl-C.
#[cfg(not(unix))]
fn shutdown_signal() -> anyhow::Result<impl Future<Output = ()> + Send + 'static> {
    Ok(async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    })
}

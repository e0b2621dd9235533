//! Shutdown as a value: a token cancelled on SIGTERM or SIGINT, passed to
//! every task, which then stops taking work and drains what it has.

use tokio_util::sync::CancellationToken;

/// A token that is cancelled on the first SIGTERM or SIGINT.
pub fn on_signal() -> std::io::Result<CancellationToken> {
    let token = CancellationToken::new();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let cancel = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        cancel.cancel();
    });
    Ok(token)
}

//! Sessions over a connection, started again on a new connection whenever
//! the old one is lost, until shutdown.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::broker::{Broker, BrokerError, SessionEnd};
use crate::config::BrokerSettings;
use crate::http::Health;
use crate::topology::QueueNames;

/// Runs `session` on a fresh connection, again and again while the broker
/// keeps dropping, until a session returns after shutdown. Each connection
/// first declares the deployment's queues (for `agents`).
///
/// The first connection must come up within `connect_timeout`, so a wrong
/// URL fails start-up clearly; later, reconnection retries with backoff for
/// as long as it takes. `/readyz` reports ready only once the queues are
/// declared, and not ready while disconnected.
pub async fn run_sessions<F>(
    settings: &BrokerSettings,
    agents: &[String],
    app: &str,
    shutdown: &CancellationToken,
    health: &Health,
    mut session: F,
) -> Result<(), BrokerError>
where
    F: AsyncFnMut(&Broker) -> Result<SessionEnd, BrokerError>,
{
    let mut first = true;
    let mut wait = Duration::from_millis(200);
    loop {
        let broker = match Broker::connect(settings, app).await {
            Ok(b) => b,
            Err(e) if first => return Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "still cannot reach RabbitMQ");
                if sleep_or_shutdown(shutdown, wait).await {
                    return Ok(());
                }
                wait = (wait * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        if !first {
            tracing::info!("reconnected to RabbitMQ");
        }
        let names = QueueNames::new(&settings.prefix);
        let outcome = match broker.declare_topology(&names, agents, settings).await {
            Ok(()) => {
                first = false;
                health.set_broker(true);
                // A session that does not touch the broker for a while (the
                // supervisor between sweeps) would not notice it is gone.
                tokio::select! {
                    outcome = session(&broker) => outcome,
                    lost = broker.lost() => Err(lost),
                }
            }
            Err(e) if first => return Err(e),
            Err(e) => Err(e),
        };
        health.set_broker(false);
        match outcome {
            Ok(SessionEnd::Shutdown) => {
                broker.close().await;
                return Ok(());
            }
            Err(e) => {
                tracing::warn!(error = %e, "lost RabbitMQ; reconnecting");
                broker.close().await;
                if sleep_or_shutdown(shutdown, wait).await {
                    return Ok(());
                }
                wait = Duration::from_millis(200);
            }
        }
    }
}

/// Sleeps, or returns `true` at once if shutdown is asked for.
async fn sleep_or_shutdown(shutdown: &CancellationToken, wait: Duration) -> bool {
    tokio::select! {
        () = shutdown.cancelled() => true,
        () = tokio::time::sleep(wait) => false,
    }
}

//! A deployment's queues under a broker prefix of its own, so that
//! deployments never consume each other's messages.

use anyhow::Context as _;
use sas::broker::Broker;
use sas::config::BrokerSettings;
use sas::topology::QueueNames;

/// The broker settings of the deployment under `prefix`.
pub fn settings(url: &str, prefix: &str) -> BrokerSettings {
    BrokerSettings {
        url: url.into(),
        prefix: prefix.into(),
        ..BrokerSettings::default()
    }
}

/// Declares every queue of the deployment, as its services will: the
/// harness publishes before they start.
pub async fn declare(
    broker: &Broker,
    settings: &BrokerSettings,
    agents: &[&str],
) -> anyhow::Result<QueueNames> {
    let queues = QueueNames::new(&settings.prefix);
    let agents: Vec<String> = agents.iter().map(|s| s.to_string()).collect();
    broker
        .declare_topology(&queues, &agents, settings)
        .await
        .context("declaring the sas queues")?;
    Ok(queues)
}

/// Deletes the deployment's queues, `extra` queues (an application's
/// status queues) and its submission exchange, on a connection of its own.
pub async fn delete(
    settings: &BrokerSettings,
    agents: &[&str],
    extra: &[String],
) -> anyhow::Result<()> {
    let names = QueueNames::new(&settings.prefix);
    let mut queues: Vec<String> = names
        .all(agents.iter().copied())
        .into_iter()
        .map(|q| q.name)
        .collect();
    queues.extend_from_slice(extra);
    let broker = Broker::connect(settings, "sas-testkit-cleanup")
        .await
        .context("connecting to RabbitMQ")?;
    let deleted = broker.delete_deployment(&names, &queues).await;
    broker.close().await;
    deleted.context("deleting the deployment's queues")
}

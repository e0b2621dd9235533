//! Why an order is stuck, for `sasctl orders show` (contract §8).

use sas::broker::Broker;
use sas::config::Settings;
use sas::rules::Order;
use sas::rules::stuck::Stuck;
use sas::state_store::{OrderRow, StateStore, StepRow};
use sas::topology::QueueNames;

/// Why the order is stuck, if it is held for a breaker or its running step
/// is past the first rung of its deadline ladder ([`sas::stuck::explain`]);
/// RabbitMQ is asked only for the latter.
pub async fn of(
    order: &OrderRow,
    steps: &[StepRow],
    store: &StateStore,
    settings: &Settings,
) -> Option<Stuck> {
    let order = Order {
        row: order.clone(),
        steps: steps.to_vec(),
    };
    if let Some(held) = sas::rules::stuck::held(&order) {
        return Some(held);
    }
    sas::rules::stuck::late_step(&order)?;
    let broker = Broker::connect(&settings.broker, "sasctl").await.ok();
    let queues = QueueNames::new(&settings.broker.prefix);
    let mut why = sas::stuck::explain(
        std::slice::from_ref(&order),
        store,
        broker.as_ref(),
        &queues,
    )
    .await;
    if let Some(broker) = broker {
        broker.close().await;
    }
    why.pop().flatten()
}

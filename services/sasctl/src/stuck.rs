//! Why an order is stuck, for `sasctl orders show` (contract §8): gathers
//! the facts the rule needs ([`sas::rules::stuck::why`]) from Postgres (the
//! holder's last heartbeat) and RabbitMQ (the agent's request queue).

use sas::broker::Broker;
use sas::config::Settings;
use sas::rules::Order;
use sas::rules::stuck::{self, Facts, Stuck};
use sas::state_store::{OrderRow, StateStore, StepRow};
use sas::topology::QueueNames;
use serde_json::{Value, json};

/// Why the order is stuck, if its running step is past the first rung of
/// its deadline ladder; the facts that cannot be had count as unknown.
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
    let agent = stuck::agent_of(stuck::late_step(&order)?)?.to_owned();
    let holder = order.row.locked_by.as_deref().unwrap_or_default();
    let (holder_seen, now) = store
        .last_seen(holder)
        .await
        .unwrap_or((None, chrono::Utc::now()));
    let facts = Facts {
        holder_seen,
        heartbeat: sas::heartbeat::INTERVAL,
        queue: queue_counts(settings, &agent).await,
        now,
    };
    stuck::why(&order, &facts)
}

/// The agent's request queue: messages ready and consumers, if the broker answers.
async fn queue_counts(settings: &Settings, agent: &str) -> Option<(u32, u32)> {
    let queue = QueueNames::new(&settings.broker.prefix).agent_requests(agent);
    let broker = Broker::connect(&settings.broker, "sasctl").await.ok()?;
    let counts = broker.queue_counts(&queue).await;
    broker.close().await;
    counts.ok().map(|c| (c.messages, c.consumers))
}

/// `stuck` as `orders show --json` gives it.
pub fn to_json(s: &Stuck) -> Value {
    json!({
        "reason": s.reason.as_str(),
        "since": sas::messages::rfc3339::format(&s.since),
        "detail": s.detail,
    })
}

//! Gathers the facts that say why orders are stuck (contract §8) and asks
//! the rule ([`crate::rules::stuck::why`]): each holder's last heartbeat
//! from Postgres, each agent's request queue from RabbitMQ, each asked
//! once however many orders share it. Used by `sasctl orders show` for one
//! order and by the leading supervisor for the `sas_orders_stuck` gauge.

use std::collections::HashMap;

use crate::broker::Broker;
use crate::rules::Order;
use crate::rules::stuck::{self, Facts, Stuck};
use crate::state_store::{StateStore, StepRow};
use crate::topology::QueueNames;

/// Why each of `orders` is stuck (`None`: it is not), in order. With no
/// broker, or one that does not answer, the queue facts are unknown.
pub async fn explain(
    orders: &[Order],
    store: &StateStore,
    broker: Option<&Broker>,
    queues: &QueueNames,
) -> Vec<Option<Stuck>> {
    let mut seen = HashMap::new();
    let mut counts = HashMap::new();
    let mut out = Vec::with_capacity(orders.len());
    for order in orders {
        let Some(agent) = stuck::late_step(order).and_then(StepRow::out_with) else {
            // Held, or not stuck: no facts needed.
            out.push(stuck::held(order));
            continue;
        };
        let holder = order.row.locked_by.clone().unwrap_or_default();
        if !seen.contains_key(&holder) {
            let found = store.last_seen(&holder).await.ok();
            seen.insert(holder.clone(), found);
        }
        if !counts.contains_key(agent) {
            let found = match broker {
                Some(b) => b.queue_counts(&queues.agent_requests(agent)).await.ok(),
                None => None,
            };
            counts.insert(agent.to_owned(), found.map(|c| (c.messages, c.consumers)));
        }
        let (holder_seen, now) = seen[&holder].unwrap_or((None, chrono::Utc::now()));
        let facts = Facts {
            holder_seen,
            heartbeat: crate::heartbeat::INTERVAL,
            queue: counts[agent],
            now,
        };
        out.push(stuck::why(order, &facts));
    }
    out
}

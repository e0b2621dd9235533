//! The `sas_orders_stuck{reason}` gauge (contract §8), counted by the
//! leading supervisor: the orders past the first rung of their deadline
//! ladder, by why they are stuck ([`sas::diagnosis::explain`]).

use sas::broker::Broker;
use sas::rules::stuck::Reason;
use sas::service::Context;
use sas::state_store::StateStore;

/// Orders counted at most, per count.
const LIMIT: i64 = 1000;

/// Sets the gauge to 0 for every reason: a supervisor that no longer leads
/// counts nothing, so that the deployment's sum is the leader's count.
pub fn clear(ctx: &Context) {
    for reason in Reason::ALL {
        set(ctx, reason, 0);
    }
}

fn set(ctx: &Context, reason: Reason, n: usize) {
    ctx.metrics
        .orders_stuck
        .get_or_create(&sas::metrics::labels(&[("reason", reason.as_str())]))
        .set(i64::try_from(n).unwrap_or(i64::MAX));
}

/// Counts the stuck orders by reason and sets the gauge (0 for a reason no
/// order has). A count that fails leaves the gauge as it was.
pub async fn count(ctx: &Context, store: &StateStore, broker: &Broker) {
    let orders = match store.late_orders(LIMIT).await {
        Ok(orders) => orders,
        Err(e) => {
            tracing::warn!(error = %e, "could not count stuck orders");
            return;
        }
    };
    let why = sas::diagnosis::explain(&orders, store, Some(broker), &ctx.queues).await;
    for reason in Reason::ALL {
        let n = why.iter().flatten().filter(|s| s.reason == reason).count();
        set(ctx, reason, n);
    }
}

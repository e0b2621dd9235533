//! Orders as the library's transitions take them.

use sas::state_store::NewOrder;
use uuid::Uuid;

/// `n` orders of `workflow` with an empty payload, each with a trace of its
/// own, reporting to `reply_to`.
pub fn new_orders(workflow: &str, n: usize, reply_to: &str) -> Vec<NewOrder> {
    (0..n)
        .map(|_| NewOrder {
            order_id: Uuid::new_v4(),
            workflow: workflow.into(),
            payload: serde_json::json!({}),
            reply_to: Some(reply_to.to_owned()),
            priority: 0,
            not_before: None,
            trace_id: Some(sas::trace::TraceContext::new_root().trace_id),
            trace_span: None,
            events: sas::messages::Events::All,
            application: None,
            app_order_id: None,
        })
        .collect()
}

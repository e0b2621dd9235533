//! Steps whose message the broker may have lost (contract §3): with
//! `broker.step_messages = "transient"`, a RabbitMQ restart drops the step
//! requests and replies it held. Postgres still has every step; the
//! supervisor, told of the loss, sends each step that was out before it
//! again at once ([`resend`]), under its order's current claim and with the
//! same idempotency key, rather than waiting for its complete-by and
//! counting a failure. No event is logged: nothing happened to the order.

use uuid::Uuid;

use super::order::{Deciding, Decision, Given, Order, RuleError};
use crate::model::{OrderRow, StepRow};
use crate::state::{ProcessState, StepState};

/// The bound of [`sent_before`] for the messages sent before `at`: the
/// least UUIDv7 of `at`'s millisecond, so that every dispatch id made
/// earlier is smaller and none made at `at` or later is.
pub fn sent_before_time(at: chrono::DateTime<chrono::Utc>) -> Uuid {
    let ms = u128::try_from(at.timestamp_millis()).unwrap_or(0) & ((1 << 48) - 1);
    Uuid::from_u128(ms << 80)
}

/// Whether `step` is out with an agent by a message sent under a dispatch
/// id older than `before` (ids are UUIDv7: they order by time). A step sas
/// holds itself (a wait, a signal) sent nothing.
pub fn sent_before(step: &StepRow, before: Uuid) -> bool {
    let sent = match step.state {
        StepState::Running => !step.kind().held_by_sas(),
        StepState::Compensating => step.compensate.is_some(),
        _ => false,
    };
    sent && step.dispatch_id.is_some_and(|id| id < before)
}

/// Whether the supervisor loads `row`'s order to send its steps again
/// (the pure twin of the state store's `unsent` query): driven by a
/// scheduler, its complete-by not passed (past it, the expiry takes over),
/// with a step out by a message sent before `before`.
pub fn unsent(
    row: &OrderRow,
    steps: &[StepRow],
    before: Uuid,
    now: chrono::DateTime<chrono::Utc>,
) -> bool {
    matches!(
        row.process_state,
        ProcessState::Processing | ProcessState::Compensating
    ) && row.locked_by.is_some()
        && row.complete_by.is_some_and(|by| by >= now)
        && steps.iter().any(|s| sent_before(s, before))
}

/// The supervisor's rule for an order whose steps sent before `before` may
/// have been lost: each is withdrawn (a late reply to its old dispatch is
/// stale; a forward step's outcome is unknown, so it is in doubt until it
/// answers, contract §4c) and dispatched again at once, with a new dispatch
/// id and complete-by, by the order's holder. Its room under flow control
/// is given back first, so that the new dispatch takes the old one's
/// place. `None` when the order has no such step.
pub fn resend(order: &Order, before: Uuid, ctx: Given<'_>) -> Result<Option<Decision>, RuleError> {
    if order.row.locked_by.is_none() || !order.steps.iter().any(|s| sent_before(s, before)) {
        return Ok(None);
    }
    let mut d = Deciding::new(order, ctx);
    d.withdraw_sent_before(before);
    d.drive()?;
    Ok(Some(d.done()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::flow::Flow;
    use crate::rules::order::fixture::{ctx, now, order_of, pending};
    use crate::rules::scheduler::claim;

    /// A claimed order of `n` steps in a row, its first step out.
    fn out(n: i32) -> Order {
        claim(&pending(n, |_| true), ctx("s1"))
            .expect("claim")
            .order
    }

    fn requests(d: &Decision) -> Vec<&crate::messages::StepRequest> {
        d.requests().map(|(_, r)| r).collect()
    }

    #[test]
    fn a_step_sent_before_the_loss_goes_again_under_the_same_claim_and_key() {
        let claimed = claim(&pending(2, |_| true), ctx("s1")).expect("claim");
        let (_, original) = claimed.requests().next().expect("a request");
        let order = claimed.order.clone();
        let d = resend(&order, Uuid::max(), ctx("sup"))
            .expect("rules")
            .expect("resent");
        let [request] = requests(&d)[..] else {
            panic!("one request: {:?}", d.effects)
        };
        assert_eq!(request.step_index, 0);
        assert_ne!(
            request.dispatch_id, original.dispatch_id,
            "a late reply to the old one is stale"
        );
        assert_eq!(request.locked_by, "s1", "its reply counts under the claim");
        assert_eq!(
            request.idempotency_key(),
            original.idempotency_key(),
            "the same key: the remote applies it at most once"
        );
        let row = &d.order.row;
        assert_eq!(
            (
                row.process_state,
                row.locked_by.as_deref(),
                row.failure_count
            ),
            (ProcessState::Processing, Some("s1"), 0),
            "no failure counted, nothing else changed"
        );
        assert_eq!(d.order.steps[0].state, StepState::Running);
        assert!(d.order.steps[0].in_doubt, "until it answers");
        assert_eq!(d.events().count(), 0);
        assert!(!d.wake);
    }

    #[test]
    fn steps_sent_after_the_loss_and_orders_nobody_drives_are_left_alone() {
        let order = out(2);
        assert_eq!(
            resend(&order, Uuid::nil(), ctx("sup")).expect("rules"),
            None
        );
        let idle = pending(2, |_| true);
        assert_eq!(resend(&idle, Uuid::max(), ctx("sup")).expect("rules"), None);
    }

    #[test]
    fn a_wait_sent_nothing_and_is_not_restarted() {
        let (order, known) = order_of(
            serde_json::json!([{ "name": "nap", "wait": "1h" }]),
            serde_json::json!({}),
        );
        let given = crate::rules::Given {
            definitions: &known,
            ..ctx("s1")
        };
        let order = claim(&order, given).expect("claim").order;
        assert_eq!(order.steps[0].state, StepState::Running);
        assert!(!sent_before(&order.steps[0], Uuid::max()));
        assert_eq!(
            resend(&order, Uuid::max(), ctx("sup")).expect("rules"),
            None
        );
    }

    #[test]
    fn an_undo_sent_before_the_loss_goes_again() {
        // Out of tries at its deadline: given up, and its undo sent.
        let order = out(2);
        let once = crate::spec::SupervisorSettings {
            max_failures: 1,
            ..crate::spec::SupervisorSettings::default()
        };
        let (given_up, _) = crate::rules::supervisor::expire(&order, &once, ctx("sup"));
        let undoing = claim(&given_up.order, ctx("s2")).expect("claim").order;
        let step = &undoing.steps[0];
        assert_eq!(step.state, StepState::Compensating);
        assert!(sent_before(step, Uuid::max()));
        let d = resend(&undoing, Uuid::max(), ctx("sup"))
            .expect("rules")
            .expect("resent");
        let [request] = requests(&d)[..] else {
            panic!("one undo: {:?}", d.effects)
        };
        assert_eq!(
            (
                request.step_index,
                request.direction,
                request.locked_by.as_str()
            ),
            (0, crate::messages::Direction::Compensate, "s2")
        );
        assert_eq!(d.order.row.process_state, ProcessState::Compensating);
    }

    #[test]
    fn the_room_of_the_lost_dispatch_is_given_back_for_the_new_one() {
        let order = out(1);
        let agent = order.steps[0].agent.clone();
        // The agent is full: the one step out is this order's.
        let flows = [Flow {
            agent,
            max_in_flight: Some(1),
            in_flight: 1,
            rate_per_sec: None,
            available: None,
        }];
        let given = crate::rules::Given {
            flows: &flows,
            ..ctx("sup")
        };
        let d = resend(&order, Uuid::max(), given)
            .expect("rules")
            .expect("resent");
        assert_eq!(requests(&d).len(), 1, "not held for room it had");
        assert_eq!(d.order.row.held_for, None);
        assert_eq!(d.flows[0].in_flight, 1);
    }

    #[test]
    fn the_bound_of_a_time_orders_the_dispatch_ids_made_before_it_first() {
        let at = chrono::Utc::now();
        let bound = sent_before_time(at);
        let before = at - chrono::Duration::milliseconds(1);
        let ts = |t: chrono::DateTime<chrono::Utc>| {
            uuid::Timestamp::from_unix(
                uuid::NoContext,
                u64::try_from(t.timestamp()).expect("after 1970"),
                t.timestamp_subsec_nanos(),
            )
        };
        for _ in 0..100 {
            assert!(Uuid::new_v7(ts(before)) < bound);
            assert!(Uuid::new_v7(ts(at)) > bound);
        }
    }

    #[test]
    fn the_twin_names_the_orders_resend_acts_on() {
        let order = out(2);
        assert!(unsent(&order.row, &order.steps, Uuid::max(), now()));
        assert!(!unsent(&order.row, &order.steps, Uuid::nil(), now()));
        let late = now() + chrono::Duration::hours(1);
        assert!(
            !unsent(&order.row, &order.steps, Uuid::max(), late),
            "past its complete-by the expiry takes it"
        );
    }
}

//! The state store's predicates against their pure twins: over generated
//! orders and steps, the orders a loading query takes (warnable, expired,
//! unsent) are exactly those its rule names, judged by the query's own
//! clock, and the steps the flow-control count takes as out with an agent are those
//! `StepRow::out_with` names (as `claims.rs` does for claimability).

use std::collections::BTreeSet;

use sas::rules;
use sas::state::ProcessState;
use sas::state_store::StateStore;
use sas_tests::TestApp;
use uuid::Uuid;

/// The deadline ladder's rungs, as `supervisor.warn_at` gives them.
const RUNGS: [f64; 2] = [0.5, 0.8];

/// Fractions of a step's time used, each far from a rung, so that the
/// moments between the query's clock and the rule's do not matter.
const USED: [f64; 6] = [0.1, 0.3, 0.65, 0.9, 0.95, 1.2];

/// A step's `agent` column: an agent, a wait (for, until), a signal, a child.
const KINDS: [&str; 5] = ["a", "wait:for", "wait:until", "signal:go", "workflow:one"];

/// Steps out (running, compensating) most often: the ones the ladder watches.
const STEP_STATES: [&str; 7] = [
    "running",
    "running",
    "compensating",
    "compensating",
    "not_started",
    "completed",
    "failed",
];

/// Orders being driven most often, and some that are not.
const ORDER_STATES: [ProcessState; 6] = [
    ProcessState::Processing,
    ProcessState::Processing,
    ProcessState::Compensating,
    ProcessState::Compensating,
    ProcessState::Pending,
    ProcessState::Processed,
];

/// Empties the tables a round's generated rows go into.
async fn empty(app: &TestApp) {
    sqlx::query("TRUNCATE orders, steps, order_events, outbox CASCADE")
        .execute(&app.db)
        .await
        .expect("truncate");
}

/// Stores a generated order, most often driven (held by a scheduler, in
/// a state it drives), with a complete-by passed, to come, or none; its id.
async fn driven_order(app: &TestApp, rng: &mut fastrand::Rng) -> Uuid {
    let id = Uuid::now_v7();
    let state = ORDER_STATES[rng.usize(..ORDER_STATES.len())].as_str();
    let locked = (rng.u8(..4) > 0).then_some("scheduler-x");
    let complete_by = [None, Some(-30.0), Some(300.0), Some(300.0)][rng.usize(..4)];
    sqlx::query(
        "INSERT INTO orders (order_id, workflow, payload, process_state, locked_by, complete_by) \
         VALUES ($1, 'one', '{}', $2, $3, now() + make_interval(secs => $4))",
    )
    .bind(id)
    .bind(state)
    .bind(locked)
    .bind(complete_by)
    .execute(&app.db)
    .await
    .expect("insert order");
    id
}

/// One round's verdict: the orders the query loaded are exactly those of
/// `ids` that `rule` names, and the round had some.
async fn agree(round: usize, ids: &[Uuid], loaded: Vec<Uuid>, rule: impl AsyncFn(Uuid) -> bool) {
    let by_query: BTreeSet<Uuid> = loaded.into_iter().collect();
    let mut by_rule = BTreeSet::new();
    for id in ids {
        if rule(*id).await {
            by_rule.insert(*id);
        }
    }
    assert!(
        !by_rule.is_empty(),
        "round {round}: the rule names some orders (the query loaded {})",
        by_query.len()
    );
    assert_eq!(
        by_query,
        by_rule,
        "round {round}: the query and the rule disagree on {:?}",
        by_query.symmetric_difference(&by_rule).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_warnable_query_loads_exactly_the_orders_the_ladder_would_warn() {
    let app = TestApp::new().await;
    let store = StateStore::from_pool(app.db.clone());
    let mut rng = fastrand::Rng::with_seed(0x3a7);
    for round in 0..4 {
        empty(&app).await;
        let mut ids = Vec::new();
        for _ in 0..150 {
            let id = driven_order(&app, &mut rng).await;
            ids.push(id);
            for idx in 0..rng.i32(1..4) {
                let timeout_ms: i64 = [0, 100_000, 200_000][rng.usize(..3)];
                let used = USED[rng.usize(..USED.len())];
                // Seconds until its complete-by: none, or where `used` puts it.
                let left = (rng.u8(..5) > 0)
                    .then(|| (1.0 - used) * timeout_ms.max(100_000) as f64 / 1000.0);
                sqlx::query(
                    "INSERT INTO steps (order_id, idx, name, agent, timeout_ms, state, complete_by, warned) \
                     VALUES ($1, $2, $3, $4, $5, $6, now() + make_interval(secs => $7), $8)",
                )
                .bind(id)
                .bind(idx)
                .bind(format!("s{idx}"))
                .bind(KINDS[rng.usize(..KINDS.len())])
                .bind(timeout_ms)
                .bind(STEP_STATES[rng.usize(..STEP_STATES.len())])
                .bind(left)
                .bind(rng.i16(0..3))
                .execute(&app.db)
                .await
                .expect("insert step");
            }
        }

        let (loaded, now) = store.warnable_now(&RUNGS, 10_000).await.expect("warnable");
        agree(round, &ids, loaded, async |id| {
            let (row, steps, _) = store
                .order_details(id)
                .await
                .expect("read")
                .expect("the order");
            rules::supervisor::warnable(&row, &steps, &RUNGS, now)
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_expired_query_loads_exactly_the_orders_the_supervisor_would_expire() {
    let app = TestApp::new().await;
    let store = StateStore::from_pool(app.db.clone());
    let mut rng = fastrand::Rng::with_seed(0xe81);
    for round in 0..4 {
        empty(&app).await;
        let mut ids = Vec::new();
        for _ in 0..150 {
            let id = Uuid::now_v7();
            ids.push(id);
            let state = ProcessState::ALL[rng.usize(..ProcessState::ALL.len())].as_str();
            let locked = rng.bool().then_some("scheduler-x");
            // Seconds from now: passed, to come, or none.
            let when = |rng: &mut fastrand::Rng| [None, Some(-30.0), Some(30.0)][rng.usize(..3)];
            let complete_by = when(&mut rng);
            let held_for = rng.bool().then_some("a");
            let hold_until = when(&mut rng);
            sqlx::query(
                "INSERT INTO orders (order_id, workflow, payload, process_state, locked_by, \
                   complete_by, held_for, held_since, hold_until) \
                 VALUES ($1, 'one', '{}', $2, $3, now() + make_interval(secs => $4), $5, \
                   CASE WHEN $5 IS NOT NULL THEN now() END, now() + make_interval(secs => $6))",
            )
            .bind(id)
            .bind(state)
            .bind(locked)
            .bind(complete_by)
            .bind(held_for)
            .bind(hold_until)
            .execute(&app.db)
            .await
            .expect("insert order");
        }
        let (loaded, now) = store.expired_now(10_000).await.expect("expired");
        agree(round, &ids, loaded, async |id| {
            let row = store.order(id).await.expect("read").expect("the order");
            rules::supervisor::expired(&row, now)
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_steps_out_with_an_agent_are_counted_as_the_rule_says() {
    const AGENTS: [&str; 3] = ["a", "b", "a-undo"];
    let app = TestApp::new().await;
    let store = StateStore::from_pool(app.db.clone());
    let mut rng = fastrand::Rng::with_seed(0x0a7);
    let mut ids = Vec::new();
    for _ in 0..100 {
        let id = Uuid::now_v7();
        ids.push(id);
        sqlx::query(
            "INSERT INTO orders (order_id, workflow, payload, process_state) \
             VALUES ($1, 'one', '{}', 'processing')",
        )
        .bind(id)
        .execute(&app.db)
        .await
        .expect("insert order");
        for idx in 0..rng.i32(1..4) {
            // An agent's step or one sas runs; an undo or none.
            let agent = ["a", "b", "a-undo", "wait:for", "signal:a"][rng.usize(..5)];
            let compensate = [None, Some("a-undo"), Some("b"), Some("a")][rng.usize(..4)];
            sqlx::query(
                "INSERT INTO steps (order_id, idx, name, agent, compensate, timeout_ms, state) \
                 VALUES ($1, $2, $3, $4, $5, 1000, $6)",
            )
            .bind(id)
            .bind(idx)
            .bind(format!("s{idx}"))
            .bind(agent)
            .bind(compensate)
            .bind(STEP_STATES[rng.usize(..STEP_STATES.len())])
            .execute(&app.db)
            .await
            .expect("insert step");
        }
    }
    let mut steps = Vec::new();
    for id in &ids {
        let (_, of_order, _) = store
            .order_details(*id)
            .await
            .expect("read")
            .expect("the order");
        steps.extend(of_order);
    }
    for agent in AGENTS {
        let by_rule = steps.iter().filter(|s| s.out_with() == Some(agent)).count();
        let by_query = store.steps_out_with(agent).await.expect("count");
        assert!(by_rule > 0, "{agent}: some steps out with it");
        assert_eq!(
            usize::try_from(by_query).ok(),
            Some(by_rule),
            "{agent}: the query and the rule disagree"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unsent_query_loads_exactly_the_orders_whose_steps_would_be_sent_again() {
    let app = TestApp::new().await;
    let store = StateStore::from_pool(app.db.clone());
    let mut rng = fastrand::Rng::with_seed(0x5e7);
    // The loss: dispatches made a minute either side of it, or none.
    let lost_at = chrono::Utc::now();
    let before = rules::resend::sent_before_time(lost_at);
    let dispatched = |rng: &mut fastrand::Rng| {
        let at = lost_at + chrono::Duration::milliseconds(rng.i64(-60_000..60_000));
        let ts = uuid::Timestamp::from_unix(
            uuid::NoContext,
            u64::try_from(at.timestamp()).unwrap_or(0),
            at.timestamp_subsec_nanos(),
        );
        (rng.u8(..4) > 0).then(|| Uuid::new_v7(ts))
    };
    for round in 0..4 {
        empty(&app).await;
        let mut ids = Vec::new();
        for _ in 0..150 {
            let id = driven_order(&app, &mut rng).await;
            ids.push(id);
            for idx in 0..rng.i32(1..4) {
                let compensate = [None, Some("a-undo")][rng.usize(..2)];
                sqlx::query(
                    "INSERT INTO steps (order_id, idx, name, agent, compensate, timeout_ms, state, dispatch_id) \
                     VALUES ($1, $2, $3, $4, $5, 1000, $6, $7)",
                )
                .bind(id)
                .bind(idx)
                .bind(format!("s{idx}"))
                .bind(KINDS[rng.usize(..KINDS.len())])
                .bind(compensate)
                .bind(STEP_STATES[rng.usize(..STEP_STATES.len())])
                .bind(dispatched(&mut rng))
                .execute(&app.db)
                .await
                .expect("insert step");
            }
        }
        let (loaded, now) = store.unsent_now(before, 10_000).await.expect("unsent");
        agree(round, &ids, loaded, async |id| {
            let (row, steps, _) = store
                .order_details(id)
                .await
                .expect("read")
                .expect("the order");
            rules::resend::unsent(&row, &steps, before, now)
        })
        .await;
    }
}

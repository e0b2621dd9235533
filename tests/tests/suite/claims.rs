//! The claim query against its statement in Rust: over generated orders
//! (every state, with and without a holder, due and not yet, held for an
//! agent's breaker or by its flow control, probe or not) and generated
//! breakers and flows, the orders the store's claim query would take are
//! exactly those [`rules::scheduler::claimable`] says, judged by the same
//! clock, breakers and flows.

use std::collections::BTreeSet;

use sas::rules;
use sas::state::ProcessState;
use sas::state_store::StateStore;
use sas_tests::TestApp;
use uuid::Uuid;

const AGENTS: [&str; 4] = ["a", "b", "c", "d"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_query_takes_exactly_the_orders_the_rule_says_are_claimable() {
    let app = TestApp::new().await;
    let store = StateStore::from_pool(app.db.clone());
    let mut rng = fastrand::Rng::with_seed(0x5a5);
    for round in 0..4 {
        sqlx::query("TRUNCATE orders, steps, order_events, outbox, breakers, agent_flow CASCADE")
            .execute(&app.db)
            .await
            .expect("truncate");
        let mut ids = Vec::new();
        for _ in 0..150 {
            let id = Uuid::now_v7();
            ids.push(id);
            let state = ProcessState::ALL[rng.usize(..ProcessState::ALL.len())].as_str();
            let locked = rng.bool().then_some("scheduler-x");
            // Seconds from now: past, future, or none.
            let not_before = [None, Some(-30), Some(30)][rng.usize(..3)];
            let held_for = rng.bool().then(|| AGENTS[rng.usize(..AGENTS.len())]);
            let reason =
                held_for.map(|_| ["breaker_open", "rate_limited", "forced_open"][rng.usize(..3)]);
            sqlx::query(
                "INSERT INTO orders (order_id, workflow, payload, process_state, locked_by, \
                   not_before, held_for, held_since, held_reason, priority) \
                 VALUES ($1, 'one', '{}', $2, $3, now() + make_interval(secs => $4), $5, \
                   CASE WHEN $5 IS NOT NULL THEN now() END, $6, $7)",
            )
            .bind(id)
            .bind(state)
            .bind(locked)
            .bind(not_before.map(f64::from))
            .bind(held_for)
            .bind(reason)
            .bind(rng.i16(0..10))
            .execute(&app.db)
            .await
            .expect("insert order");
        }
        for agent in AGENTS {
            // A breaker: none, closed, open, or half open with a probe.
            match rng.usize(..4) {
                0 => {}
                kind => {
                    let state = ["closed", "open", "half_open"][kind - 1];
                    let probe = (state == "half_open").then(|| ids[rng.usize(..ids.len())]);
                    sqlx::query(
                        "INSERT INTO breakers (agent, state, opened_at, probe_order) \
                         VALUES ($1, $2, now(), $3)",
                    )
                    .bind(agent)
                    .bind(state)
                    .bind(probe)
                    .execute(&app.db)
                    .await
                    .expect("insert breaker");
                }
            }
            // Flow control: none, room, or full.
            if rng.bool() {
                let max = rng.i32(1..4);
                let in_flight = if rng.bool() { max } else { max - 1 };
                sqlx::query(
                    "INSERT INTO agent_flow (agent, max_in_flight, in_flight) VALUES ($1, $2, $3)",
                )
                .bind(agent)
                .bind(max)
                .bind(in_flight)
                .execute(&app.db)
                .await
                .expect("insert flow");
            }
        }

        let taken = store.claimable_now(10_000).await.expect("claimable");
        let by_query: BTreeSet<Uuid> = taken.orders.iter().map(|o| o.order_id).collect();
        // A hundred and fifty random orders always hold claimable ones, and
        // the rule judges with the facts the query read with them.
        assert!(!by_query.is_empty(), "round {round}: some orders claimable");
        let mut by_rule = BTreeSet::new();
        for id in &ids {
            let row = store.order(*id).await.expect("read").expect("the order");
            if rules::scheduler::claimable(&row, taken.now, &taken.gates, &taken.flows) {
                by_rule.insert(*id);
            }
        }
        assert_eq!(
            by_query,
            by_rule,
            "round {round}: the query and the rule disagree on {:?}",
            by_query.symmetric_difference(&by_rule).collect::<Vec<_>>()
        );
        // Nothing was taken: the same orders are still there to claim.
        let again = store.claimable_now(10_000).await.expect("claimable");
        assert_eq!(
            again.orders.len(),
            by_query.len(),
            "round {round}: nothing taken"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_stopped_by_its_bound_of_requests_is_followed_at_once_by_the_next() {
    // Slow polls: had the scheduler waited for a wake-up after a claim that
    // stopped at its bound, the orders stored before it started (whose
    // wake-ups it missed) would wait a minute.
    let app = TestApp::builder().scheduler_poll("60s").build().await;
    for name in ["submission", "agent", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    let status = app.status_queue("bound").await;
    let ids = app.submit_many("three", 20, Some(&status)).await;
    app.eventually(
        "orders stored",
        std::time::Duration::from_secs(20),
        || async {
            let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
                .fetch_one(&app.db)
                .await
                .expect("count");
            stored == 20
        },
    )
    .await;
    // One request per claim: every claim of more than one order stops at it.
    app.start_with_env(
        "scheduler",
        "scheduler",
        &[],
        &[("SAS__SCHEDULER__CLAIM_MESSAGES", "1")],
    )
    .await;
    let stories = app
        .assert_invariants(&status, &ids, &[], std::time::Duration::from_secs(30))
        .await;
    assert!(
        stories
            .values()
            .all(|s| s.last().expect("events")["state"] == "processed")
    );
}

//! The fault suite (issue 4): each process crashed at its worst moment, remote
//! services that stay down, hang or answer near the deadline, duplicated and
//! stray messages, and poison input. After each scenario the invariants of
//! [`TestApp::assert_invariants`] must hold.

use std::time::Duration;

use chrono::Utc;
use remote_sim::Knobs;
use sas::broker::Outgoing;
use sas::messages::{Direction, StepOutcome, StepReply, StepRequest};
use sas_tests::TestApp;
use serde_json::{Map, json};
use uuid::Uuid;

const ALL: [&str; 4] = ["submission", "scheduler", "agent", "supervisor"];
const WAIT: Duration = Duration::from_secs(90);

/// Starts every service, `crashing` with `SAS_CRASH_AT=point`, submits
/// orders, waits for the crash, restarts the service normally and checks the
/// invariants.
async fn crash_and_recover(app: &TestApp, crashing: &str, point: &str, workflow: &str, n: usize) {
    crash_and_recover_with(app, crashing, point, workflow, n, &[]).await;
}

/// [`crash_and_recover`], every service given `env` too.
async fn crash_and_recover_with(
    app: &TestApp,
    crashing: &str,
    point: &str,
    workflow: &str,
    n: usize,
    env: &[(&str, &str)],
) {
    for name in ALL {
        if name == crashing {
            let mut crash = vec![("SAS_CRASH_AT", point)];
            crash.extend_from_slice(env);
            app.start_with_env(name, name, &[], &crash).await;
        } else {
            app.start_with_env(name, name, &[], env).await;
        }
    }
    let status = app.status_queue("status").await;
    let ids = app.submit_many(workflow, n, Some(&status)).await;
    let exit = app.wait_exit(crashing, Duration::from_secs(30)).await;
    assert!(!exit.success(), "{crashing} should have crashed at {point}");
    app.start(crashing, crashing, &[]).await;
    let stories = app.assert_invariants(&status, &ids, &[], WAIT).await;
    for (id, story) in &stories {
        assert_eq!(story.last().unwrap()["state"], "processed", "order {id}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submission_killed_after_its_commit_and_before_its_ack_loses_and_repeats_nothing() {
    let app = TestApp::new().await;
    crash_and_recover(&app, "submission", "submission.after_commit:5", "three", 30).await;
    // The redelivered order was recognised, not stored twice.
    assert!(
        app.metrics("submission")
            .await
            .contains("sas_orders_duplicate_total")
    );
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(n, 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduler_killed_after_dispatching_a_step_loses_and_repeats_nothing() {
    let app = TestApp::new().await;
    // At the first claim: a burst of orders may well be claimed in one batch,
    // so a later claim is not sure to come. The orders wait for a claim
    // (the submission starts none of them).
    let claimed = [("SAS__SUBMISSION__START_ORDERS", "false")];
    crash_and_recover_with(
        &app,
        "scheduler",
        "scheduler.after_dispatch:1",
        "three",
        30,
        &claimed,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_mid_call_applies_the_effect_once() {
    let app = TestApp::new().await;
    crash_and_recover(&app, "agent", "agent.after_call:7", "three", 30).await;
    // The call whose answer was lost was made again with the same key and replayed.
    let replayed: u64 = app.stats().endpoints.values().map(|e| e.replayed).sum();
    assert!(replayed >= 1, "the remote saw the repeated call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn supervisor_killed_mid_sweep_recovers_each_expiry_once() {
    let app = TestApp::builder().step_timeout("700ms").build().await;
    app.knobs(
        "a",
        Knobs {
            hang_first: 1,
            ..Knobs::default()
        },
    );
    crash_and_recover(&app, "supervisor", "supervisor.mid_sweep:1", "one", 10).await;
    for (state, failures) in
        sqlx::query_as::<_, (String, i32)>("SELECT process_state, failure_count FROM orders")
            .fetch_all(&app.db)
            .await
            .unwrap()
    {
        assert_eq!(
            (state.as_str(), failures),
            ("processed", 1),
            "one recovery per expiry"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_killed_between_publish_and_bookkeeping_delivers_every_event() {
    let app = TestApp::new().await;
    // The scheduler's relay publishes, then dies before deleting its rows:
    // another relay publishes them again; consumers see duplicates, never gaps.
    crash_and_recover(&app, "scheduler", "outbox.after_publish:3", "three", 30).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_down_longer_than_complete_by_then_back_ends_processed() {
    let app = TestApp::builder()
        .step_timeout("500ms")
        .max_failures(10)
        .build()
        .await;
    app.knobs(
        "b",
        Knobs {
            status: Some(503),
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let status = app.status_queue("status").await;
    let ids = app.submit_many("three", 10, Some(&status)).await;
    app.eventually(
        "orders re-attempted while b is down",
        Duration::from_secs(30),
        || async {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE failure_count >= 2")
                .fetch_one(&app.db)
                .await
                .unwrap();
            n == 10
        },
    )
    .await;
    app.knobs("b", Knobs::default());
    let stories = app.assert_invariants(&status, &ids, &[], WAIT).await;
    assert!(
        stories
            .values()
            .all(|s| s.last().unwrap()["state"] == "processed")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_that_answers_near_the_deadline_keeps_every_invariant() {
    let app = TestApp::builder()
        .step_timeout("400ms")
        .max_failures(10)
        .build()
        .await;
    // Some answers land just before complete-by, some just after.
    app.knobs(
        "b",
        Knobs {
            latency_ms: 380,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let status = app.status_queue("status").await;
    let ids = app.submit_many("three", 20, Some(&status)).await;
    app.eventually(
        "some orders re-attempted",
        Duration::from_secs(30),
        || async {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM order_events WHERE event = 'retry_scheduled'",
            )
            .fetch_one(&app.db)
            .await
            .unwrap();
            n > 0 || app.count_in("processed").await == 20
        },
    )
    .await;
    app.knobs("b", Knobs::default());
    app.assert_invariants(&status, &ids, &[], WAIT).await;
}

fn request(order_id: Uuid, complete_in_ms: i64) -> StepRequest {
    StepRequest {
        order_id,
        workflow: "one".into(),
        step: "a".into(),
        step_index: 0,
        direction: Direction::Forward,
        attempt: 1,
        dispatch_id: Uuid::new_v4(),
        locked_by: "nobody".into(),
        complete_by: Utc::now() + chrono::Duration::milliseconds(complete_in_ms),
        payload: json!({}),
        results: Map::new(),
        fencing_token: 1,
        timeout_ms: None,
        max_complete_by: None,
        time_left_ms: None,
        redrive: 0,
        in_doubt: false,
        retry: None,
        item: None,
        index: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicated_and_stray_requests_and_replies_change_nothing() {
    let app = TestApp::new().await;
    app.knobs(
        "b",
        Knobs {
            hang: true,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let status = app.status_queue("status").await;
    let id = app.submit("three", Some(&status)).await;
    app.eventually("step b is running", Duration::from_secs(20), || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM steps WHERE order_id = $1 AND idx = 1 AND state = 'running'",
        )
        .bind(id)
        .fetch_one(&app.db)
        .await
        .unwrap();
        n == 1
    })
    .await;
    // A's reply again (a duplicate), a reply for an order that does not exist,
    // and a reply for step c, which was never dispatched (out of order).
    let (a_dispatch, locked_by): (Uuid, String) = sqlx::query_as(
        "SELECT s.dispatch_id, o.locked_by FROM steps s JOIN orders o USING (order_id) WHERE s.order_id = $1 AND s.idx = 0",
    )
    .bind(id)
    .fetch_one(&app.db)
    .await
    .unwrap_or((Uuid::new_v4(), String::new()));
    let reply = |order_id, step: &str, idx, dispatch_id| StepReply {
        order_id,
        step: step.into(),
        step_index: idx,
        direction: Direction::Forward,
        attempt: 1,
        dispatch_id,
        locked_by: locked_by.clone(),
        traceparent: None,
        outcome: StepOutcome::Succeeded { result: json!({}) },
    };
    app.publish_reply(&reply(id, "a", 0, a_dispatch)).await;
    app.publish_reply(&reply(Uuid::new_v4(), "a", 0, Uuid::new_v4()))
        .await;
    app.publish_reply(&reply(id, "c", 2, Uuid::new_v4())).await;
    app.eventually("three stale replies", Duration::from_secs(10), || async {
        app.metrics("scheduler")
            .await
            .contains(r#"sas_replies_total{outcome="stale"} 3"#)
    })
    .await;
    // The same request twice: the remote sees one key, applies once.
    let dup = request(Uuid::new_v4(), 5000);
    let replies = app.status_queue("replies").await;
    for _ in 0..2 {
        let sent = app.send_request("a", &dup, &replies).await;
        sent.wait().await.unwrap();
    }
    app.collect_replies(&replies, Duration::from_secs(10), |got| got.len() == 2)
        .await;
    assert_eq!(app.stats().keys[&format!("{}:a", dup.order_id)].applied, 1);
    app.knobs("b", Knobs::default());
    app.sim.set_knobs("/svc/b", Knobs::default()).unwrap();
    // The running dispatch of b hangs for good: the supervisor re-attempts it.
    app.assert_invariants(&status, &[id], &[], WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_input_is_dead_lettered_and_never_stops_a_service() {
    let app = TestApp::spawn().await;
    let status = app.status_queue("status").await;
    // Orders: a 10 MB body, no reply queue at all, a reply queue that does not exist.
    let huge = vec![b'x'; 10 * 1024 * 1024];
    app.publish_raw(&huge, Some(&status), None).await;
    app.publish_raw(b"[]", None, None).await;
    let missing = format!("{}-app.no-such-queue", app.prefix);
    app.publish_raw(br#"{"workflow":"nope","payload":{}}"#, Some(&missing), None)
        .await;
    let accepted_unknown_fields = Uuid::new_v4();
    let body = json!({ "order_id": accepted_unknown_fields, "workflow": "one", "payload": {}, "colour": "blue" });
    app.publish_raw(body.to_string().as_bytes(), Some(&status), None)
        .await;
    let no_status_queue = Uuid::new_v4();
    let body = json!({ "order_id": no_status_queue, "workflow": "one", "payload": {} });
    app.publish_raw(body.to_string().as_bytes(), Some(&missing), None)
        .await;
    // An agent request and a reply that cannot be read.
    app.publisher()
        .publish(&Outgoing {
            routing_key: &app.queues.agent_requests("a"),
            body: b"\xff\xfe garbage",
            mandatory: true,
            ..Outgoing::default()
        })
        .await
        .unwrap();
    app.publisher()
        .publish(&Outgoing {
            routing_key: app.queues.replies(),
            body: b"{\"not\":\"a reply\"}",
            mandatory: true,
            ..Outgoing::default()
        })
        .await
        .unwrap();
    // Everything after still flows.
    let ids = app.submit_many("three", 10, Some(&status)).await;
    let mut all = ids.clone();
    all.push(accepted_unknown_fields);
    let dead = [
        (app.queues.orders_dead(), 3u32),
        (&app.queues.agent_requests_dead("a") as &str, 1),
        (app.queues.replies_dead(), 1),
    ];
    let dead: Vec<(&str, u32)> = dead.iter().map(|(q, n)| (*q, *n)).collect();
    app.assert_invariants(&status, &all, &dead, WAIT).await;
    app.eventually(
        "the order without a status queue ended too",
        Duration::from_secs(20),
        || async {
            app.order(no_status_queue)
                .await
                .is_some_and(|(s, _)| s == "processed")
        },
    )
    .await;
    assert!(
        app.metrics("scheduler")
            .await
            .contains("sas_outbox_unroutable_total")
    );
    for name in ["submission", "scheduler", "agent", "supervisor"] {
        let (code, _) =
            sas_tests::http_get(&format!("http://127.0.0.1:{}/healthz", app.port(name)))
                .await
                .unwrap();
        assert_eq!(code, 200, "{name} still serves");
    }
}

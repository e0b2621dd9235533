//! Succeed or fail as a whole, and heal (issue 3): resume without redoing,
//! circuit breakers, supervisor leadership, priorities and delays, and a
//! mixed load with transient faults.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use remote_sim::Knobs;
use sas_tests::TestApp;
use serde_json::json;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_step_that_times_out_twice_then_succeeds_applies_every_effect_once() {
    let app = TestApp::builder()
        .step_timeout("600ms")
        .max_failures(5)
        .build()
        .await;
    app.knobs(
        "b",
        Knobs {
            hang_first: 2,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let id = app.submit("three", None).await;
    app.eventually(
        "the order is processed",
        Duration::from_secs(30),
        || async { app.order(id).await.is_some_and(|(s, _)| s == "processed") },
    )
    .await;
    assert_eq!(app.order(id).await, Some(("processed".into(), 2)));
    let stats = app.stats();
    let key = |s: &str| stats.keys[&format!("{id}:{s}")].clone();
    assert_eq!((key("a").calls, key("a").applied), (1, 1), "a ran once");
    assert_eq!(
        (key("b").calls, key("b").applied),
        (3, 1),
        "b three times, one effect"
    );
    assert_eq!((key("c").calls, key("c").applied), (1, 1), "c once");
    // Results of earlier steps reach later ones.
    let result: serde_json::Value =
        sqlx::query_scalar("SELECT result FROM steps WHERE order_id = $1 AND idx = 0")
            .bind(id)
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert_eq!(result["idempotency_key"], format!("{id}:a"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_breaker_sends_requests_to_a_healthy_agent_and_closes_after_recovery() {
    let app = TestApp::new().await;
    for name in ["submission", "scheduler", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    // One instance cannot reach the endpoint: nothing listens on its port yet.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let unreachable = format!("http://127.0.0.1:{port}/svc/a");
    let breaker = [
        ("SAS__AGENT__BREAKER_THRESHOLD", "3"),
        ("SAS__AGENT__BREAKER_COOLDOWN", "1s"),
    ];
    let mut env = breaker.to_vec();
    env.push(("SAS__AGENTS__A__URL", &unreachable));
    app.start_with_env("agent-cut-off", "agent", &["--agent", "a"], &env)
        .await;
    app.start_with_env("agent-healthy", "agent", &["--agent", "a"], &breaker)
        .await;
    let ids = app.submit_many("one", 40, None).await;
    app.wait_for_state("processed", 40, Duration::from_secs(60))
        .await;
    // The breaker tripped. Its one-second cool-down may have run out by now:
    // then it is half-open, waiting for a request to probe with, and stays
    // so while the healthy instance takes every request. Never closed: no
    // call of the cut-off instance has succeeded.
    let open = app.metrics("agent-cut-off").await;
    assert!(
        open.contains(r#"sas_agent_breaker_state{agent="a"} 2"#)
            || open.contains(r#"sas_agent_breaker_state{agent="a"} 1"#),
        "{open}"
    );
    let readyz = sas_tests::http_get(&format!(
        "http://127.0.0.1:{}/readyz",
        app.port("agent-cut-off")
    ))
    .await
    .unwrap()
    .1;
    assert!(
        readyz.contains(r#""breaker.a":"open""#) || readyz.contains(r#""breaker.a":"half_open""#),
        "{readyz}"
    );
    let stats = app.stats();
    for id in &ids {
        assert_eq!(stats.keys[&format!("{id}:a")].applied, 1);
    }
    // The endpoint becomes reachable: a probe closes the breaker and the
    // instance does the work alone.
    let sim = std::sync::Arc::new(remote_sim::RemoteSim::new(Default::default()).unwrap());
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    tokio::spawn(remote_sim::serve_with(
        listener,
        sim.clone(),
        std::future::pending(),
    ));
    app.kill("agent-healthy");
    let more = app.submit_many("one", 10, None).await;
    app.wait_for_state("processed", 50, Duration::from_secs(60))
        .await;
    let closed = app.metrics("agent-cut-off").await;
    assert!(
        closed.contains(r#"sas_agent_breaker_state{agent="a"} 0"#),
        "{closed}"
    );
    let reached = sim.stats();
    for id in &more {
        assert_eq!(reached.keys[&format!("{id}:a")].applied, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_supervisors_share_sixteen_partitions_recover_each_expiry_once_and_take_over_a_dead_ones()
 {
    // Ticks of 0.5 s: a supervisor counts the others alive over two of
    // them, which a loaded machine keeps to.
    let app = TestApp::builder()
        .step_timeout("1500ms")
        .supervisor_interval("500ms")
        .build()
        .await;
    app.knobs(
        "a",
        Knobs {
            hang_first: 1,
            ..Knobs::default()
        },
    );
    for name in ["submission", "scheduler", "agent"] {
        app.start(name, name, &[]).await;
    }
    let sups = ["supervisor-1", "supervisor-2", "supervisor-3"];
    for s in sups {
        app.start(s, "supervisor", &[]).await;
    }
    // Each holds at most its share (16 over 3, rounded up: 6), and
    // together all 16.
    app.eventually(
        "the three hold the 16 partitions between them",
        Duration::from_secs(10),
        || async {
            let held = held(&app, &sups).await;
            held.iter().all(|n| (1..=6).contains(n)) && held.iter().sum::<i64>() == 16
        },
    )
    .await;
    let first = app.submit_many("one", 20, None).await;
    app.wait_for_state("processed", 20, Duration::from_secs(60))
        .await;
    assert_one_recovery_each(&app, &first).await;
    let leading = leaders(&app, &sups).await;
    assert_eq!(leading.len(), 1, "exactly one leader: {leading:?}");
    let leader = leading[0];
    // The leader dies: the others take its partitions within three
    // intervals (1.5 s; the bound allows a second more for a loaded machine), and one
    // of them leads.
    app.kill(leader);
    let rest: Vec<&str> = sups.iter().copied().filter(|s| *s != leader).collect();
    let killed = std::time::Instant::now();
    app.eventually(
        "the two left hold the 16 partitions",
        Duration::from_secs(10),
        || async { held(&app, &rest).await.iter().sum::<i64>() == 16 },
    )
    .await;
    assert!(
        killed.elapsed() < Duration::from_millis(2500),
        "taken over in {:?}",
        killed.elapsed()
    );
    let second = app.submit_many("one", 20, None).await;
    app.wait_for_state("processed", 40, Duration::from_secs(60))
        .await;
    assert_one_recovery_each(&app, &second).await;
    assert_eq!(leaders(&app, &rest).await.len(), 1);
}

/// The partitions each of `sups` holds, by its gauge.
async fn held(app: &TestApp, sups: &[&str]) -> Vec<i64> {
    let mut held = Vec::new();
    for s in sups {
        let metrics = app.metrics(s).await;
        let n = metrics
            .lines()
            .find_map(|l| l.strip_prefix("sas_supervisor_partitions "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        held.push(n);
    }
    held
}

/// Whether the metrics text has exactly this sample line.
fn metric_is(metrics: &str, line: &str) -> bool {
    metrics.lines().any(|l| l == line)
}

async fn leaders<'a>(app: &TestApp, sups: &[&'a str]) -> Vec<&'a str> {
    let mut leaders = Vec::new();
    for s in sups {
        if metric_is(&app.metrics(s).await, "sas_supervisor_leader 1") {
            leaders.push(*s);
        }
    }
    leaders
}

/// Each expiry was recovered once: every `retry_scheduled` of an order counts
/// a different failure, and there are as many as the order's failures.
async fn assert_one_recovery_each(app: &TestApp, ids: &[Uuid]) {
    for id in ids {
        let counted: Vec<i64> = sqlx::query_scalar(
            "SELECT (detail->>'failure_count')::bigint FROM order_events \
             WHERE order_id = $1 AND event = 'retry_scheduled' ORDER BY seq",
        )
        .bind(id)
        .fetch_all(&app.db)
        .await
        .unwrap();
        let (state, failures) = app.order(*id).await.unwrap();
        assert_eq!(state, "processed");
        let expected: Vec<i64> = (1..=i64::from(failures)).collect();
        assert_eq!(counted, expected, "order {id}: recoveries per failure");
        assert!(failures >= 1, "order {id} expired at least once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn higher_priority_is_claimed_first_and_not_before_is_honoured() {
    let app = TestApp::new().await;
    // Every order waits for a claim, where priorities and not_before rule.
    app.start_submission_claiming_every_order().await;
    let low = Uuid::new_v4();
    let high = Uuid::new_v4();
    let later = Uuid::new_v4();
    let start_after = Utc::now() + chrono::Duration::milliseconds(2000);
    for body in [
        json!({ "order_id": low, "workflow": "one", "payload": {}, "priority": 1 }),
        json!({ "order_id": high, "workflow": "one", "payload": {}, "priority": 9 }),
        json!({ "order_id": later, "workflow": "one", "payload": {}, "priority": 9,
                "not_before": start_after.to_rfc3339() }),
    ] {
        app.publish_raw(body.to_string().as_bytes(), None, None)
            .await;
    }
    app.wait_for_state("pending", 3, Duration::from_secs(10))
        .await;
    for name in ["agent", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    app.start_with_env(
        "scheduler",
        "scheduler",
        &[],
        &[("SAS__SCHEDULER__CLAIM_BATCH", "1")],
    )
    .await;
    app.wait_for_state("processed", 3, Duration::from_secs(30))
        .await;
    let claimed = claim_times(&app).await;
    assert!(
        claimed[&high] < claimed[&low],
        "priority 9 before priority 1: {claimed:?}"
    );
    assert!(
        claimed[&later] >= start_after,
        "not_before honoured: {claimed:?}"
    );
}

async fn claim_times(app: &TestApp) -> BTreeMap<Uuid, DateTime<Utc>> {
    sqlx::query_as::<_, (Uuid, DateTime<Utc>)>(
        "SELECT order_id, at FROM order_events WHERE event = 'processing'",
    )
    .fetch_all(&app.db)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_orders_with_mixed_priorities_and_transient_faults_all_end_with_effects_matching_steps()
 {
    let app = TestApp::builder().step_timeout("10s").build().await;
    for step in ["a", "b", "c"] {
        app.knobs(
            step,
            Knobs {
                transient_rate: 0.05,
                ..Knobs::default()
            },
        );
    }
    // Every order waits for a claim, where priorities and not_before rule.
    app.start_submission_claiming_every_order().await;
    let mut priority = BTreeMap::new();
    let ids: Vec<Uuid> = (0..1000).map(|_| Uuid::new_v4()).collect();
    for (i, id) in ids.iter().enumerate() {
        let p = (i * 7) % 10;
        priority.insert(*id, p);
        let body = json!({ "order_id": id, "workflow": "three", "payload": {}, "priority": p });
        app.publish_raw(body.to_string().as_bytes(), None, None)
            .await;
    }
    app.wait_for_state("pending", 1000, Duration::from_secs(60))
        .await;
    for name in ["scheduler", "agent", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    app.eventually("every order ended", Duration::from_secs(240), || async {
        let s = app.states().await;
        ["processed", "compensated", "error"]
            .iter()
            .map(|k| s.get(*k).copied().unwrap_or(0))
            .sum::<i64>()
            == 1000
    })
    .await;
    let completed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM steps WHERE state IN ('completed', 'compensated')",
    )
    .fetch_one(&app.db)
    .await
    .unwrap();
    let stats = app.stats();
    let forward_applied = stats
        .keys
        .iter()
        .filter(|(k, _)| !k.ends_with(":compensate"))
        .map(|(_, v)| v.applied)
        .sum::<u64>();
    assert_eq!(
        forward_applied as i64, completed,
        "effects equal completed steps"
    );
    assert!(
        stats.keys.values().all(|k| k.applied <= 1),
        "an effect was applied twice"
    );
    // High priority finished first, on average.
    let done: BTreeMap<Uuid, DateTime<Utc>> = sqlx::query_as::<_, (Uuid, DateTime<Utc>)>(
        "SELECT order_id, at FROM order_events WHERE event IN ('processed', 'compensated', 'failed')",
    )
    .fetch_all(&app.db)
    .await
    .unwrap()
    .into_iter()
    .collect();
    let mean = |keep: &dyn Fn(usize) -> bool| {
        let times: Vec<i64> = done
            .iter()
            .filter(|(id, _)| keep(priority[*id]))
            .map(|(_, t)| t.timestamp_micros())
            .collect();
        times.iter().sum::<i64>() / times.len().max(1) as i64
    };
    let high = mean(&|p| p >= 7);
    let low = mean(&|p| p <= 2);
    assert!(
        high < low,
        "high priority orders finished later on average ({high} vs {low})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compensation_that_cannot_complete_leaves_the_order_in_error_with_an_alert() {
    let app = TestApp::builder()
        .step_timeout("500ms")
        .max_failures(2)
        .build()
        .await;
    app.knobs(
        "c",
        Knobs {
            permanent: true,
            ..Knobs::default()
        },
    );
    app.knobs(
        "b-undo",
        Knobs {
            hang: true,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let status = app.status_queue("status").await;
    let id = app.submit("three", Some(&status)).await;
    let events = app
        .collect(&status, Duration::from_secs(30), |got| {
            got.iter().any(|e| e["state"] == "failed")
        })
        .await;
    let states: Vec<&str> = events
        .iter()
        .map(|e| e["state"].as_str().unwrap())
        .collect();
    assert_eq!(
        states,
        [
            "received",
            "processing",
            "step_succeeded",
            "step_succeeded",
            "compensating",
            "retry_scheduled",
            "failed"
        ]
    );
    assert_eq!(events[5]["detail"]["compensation"], true);
    assert_eq!(app.order(id).await.unwrap().0, "error");
    // One alert when it gave up, one when the undo could not complete.
    let alerts = app
        .collect(app.queues.alerts(), Duration::from_secs(10), |got| {
            got.len() >= 2
        })
        .await;
    assert_eq!(alerts[0]["state"], "compensating");
    assert_eq!(alerts[1]["state"], "error");
    assert!(
        alerts[1]["reason"]
            .as_str()
            .unwrap()
            .contains("compensation could not complete")
    );
    // a was never undone: b's undo did not complete, so the undo stopped there.
    assert!(!app.stats().keys.contains_key(&format!("{id}:a:compensate")));
}

/// A scheduler holds at most `scheduler.max_in_flight` orders: the rest wait
/// as `pending` in Postgres, where no complete-by runs, and are claimed as
/// the held ones end. (Without the bound, a burst would become requests
/// waiting in an agent's queue until their complete-by passed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_holds_no_more_than_max_in_flight_orders_and_claims_more_as_they_end() {
    let app = TestApp::new().await;
    app.knobs(
        "a",
        Knobs {
            latency_ms: 200,
            ..Knobs::default()
        },
    );
    // The scheduler's bound: the submission starts no order itself.
    app.start_submission_claiming_every_order().await;
    app.start_with_env(
        "scheduler",
        "scheduler",
        &[],
        &[("SAS__SCHEDULER__MAX_IN_FLIGHT", "3")],
    )
    .await;
    for name in ["agent", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    app.submit_many("one", 12, None).await;
    let mut most_held = 0;
    let started = std::time::Instant::now();
    while app.count_in("processed").await < 12 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "not all processed: {:?}",
            app.states().await
        );
        most_held = most_held.max(app.count_in("processing").await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        (1..=3).contains(&most_held),
        "held {most_held} orders at once"
    );
    // Nothing waited long enough in a queue to be re-attempted.
    let retried: i64 =
        sqlx::query_scalar("SELECT count(*) FROM order_events WHERE event = 'retry_scheduled'")
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert_eq!(retried, 0);
}

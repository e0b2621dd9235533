//! Riding out outages and saying why (contract §8): the deadline ladder
//! and the fencing token every remote call carries.

use std::time::Duration;

use remote_sim::Knobs;
use sas_tests::TestApp;
use sas_tests::cli::{run, wait_state};
use serde_json::json;
use uuid::Uuid;

/// The `state` of each status event, with the rung of a `deadline_warning`.
fn story(events: &[serde_json::Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| match e["state"].as_str() {
            Some("deadline_warning") => format!("deadline_warning {}", e["detail"]["fraction"]),
            Some(state) => state.to_owned(),
            None => format!("{e}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_step_is_warned_at_each_rung_once_before_it_is_reattempted() {
    // Rungs at 0.8 s and 1.6 s, the re-attempt at 4 s: room for sweeps
    // that come late on a busy machine.
    let app = TestApp::builder()
        .step_timeout("4s")
        .supervisor_interval("100ms")
        .warn_at("[0.2, 0.4]")
        .build()
        .await;
    app.knobs(
        "a",
        Knobs {
            hang_first: 1,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let (id, events) = app.run_one("one").await;
    // The second dispatch answers at once, so its ladder is seldom reached;
    // on a busy machine (one CI run) its answer came after its first rung,
    // which is then warned, once, for attempt 2.
    let (second, again): (Vec<_>, Vec<_>) = events
        .iter()
        .cloned()
        .partition(|e| e["state"] == "deadline_warning" && e["attempt"] == 2);
    let rungs = story(&second);
    let mut once = rungs.clone();
    once.dedup();
    assert_eq!(rungs, once, "each rung of attempt 2 warned once at most");
    assert_eq!(
        story(&again),
        [
            "received",
            "processing",
            "deadline_warning 0.2",
            "deadline_warning 0.4",
            "retry_scheduled",
            "processing",
            "step_succeeded",
            "processed"
        ]
    );
    let warning = &events[2];
    assert_eq!(warning["step"], "a");
    assert_eq!(warning["attempt"], 1);
    assert!(warning["detail"]["complete_by"].is_string(), "{warning}");
    assert_eq!(app.order(id).await, Some(("processed".into(), 1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_carries_a_fencing_token_that_grows_with_each_dispatch_of_its_step() {
    let app = TestApp::builder()
        .step_timeout("800ms")
        .max_failures(2)
        .retry_schedule(r#"["100ms"]"#)
        .build()
        .await;
    // Two dispatches hang past their complete-by (two re-attempts' worth of
    // failures: the order fails), then an operator's retry goes through.
    app.knobs(
        "a",
        Knobs {
            hang_first: 2,
            fencing: true,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let id = app.submit("one", None).await;
    wait_state(&app, id, "error", Duration::from_secs(30)).await;
    run(&app, &["orders", "retry", &id.to_string()])
        .await
        .expect_code(0);
    wait_state(&app, id, "processed", Duration::from_secs(30)).await;
    let key = app.stats().keys[&format!("{id}:a")].clone();
    assert_eq!(key.applied, 1);
    let mut dispatches = key.tokens.clone();
    dispatches.dedup();
    assert_eq!(
        dispatches,
        [1, 2, 3],
        "one token per dispatch, each greater than the last: {:?}",
        key.tokens
    );
}

/// Why `sasctl orders show` says order `id` is stuck; null while the
/// order is not stored yet (the submission consumes it from its queue).
async fn stuck_of(app: &TestApp, id: Uuid) -> serde_json::Value {
    let out = run(app, &["orders", "show", &id.to_string(), "--json"]).await;
    if out.code == Some(3) && out.stderr.contains("no order") {
        return serde_json::Value::Null;
    }
    out.expect_code(0).json()["stuck"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_order_says_why_an_agent_busy_then_gone_then_its_scheduler_gone() {
    let app = TestApp::builder()
        .step_timeout("60s")
        .warn_at("[0.01]")
        .supervisor_interval("100ms")
        .build()
        .await;
    // Its second step hangs: a scheduler applied the first one's reply,
    // and holds the order from then on (the submission that started it
    // held it until then).
    app.knobs(
        "b",
        Knobs {
            hang: true,
            hang_ms: 120_000,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let id = app.submit("three", None).await;
    let stuck = async || stuck_of(&app, id).await;
    let becomes = async |reason: &str| {
        app.eventually(
            &format!("the order says {reason}"),
            Duration::from_secs(15),
            || async { stuck().await["reason"] == reason },
        )
        .await;
    };
    // Past its first rung (0.6 s), with the remote hanging.
    becomes("agent_busy").await;
    let busy = stuck().await;
    assert_eq!(busy["detail"]["agent"], "b");
    assert!(busy["since"].is_string(), "{busy}");
    // The request goes back to its queue, which nothing consumes.
    app.kill("agent");
    becomes("no_agent").await;
    // The leading supervisor counts it too.
    app.eventually(
        "the gauge counts the order as no_agent",
        Duration::from_secs(10),
        || async {
            app.metrics("supervisor")
                .await
                .contains(r#"sas_orders_stuck{reason="no_agent"} 1"#)
        },
    )
    .await;
    // The scheduler holding the order stops beating.
    app.kill("scheduler");
    becomes("scheduler_gone").await;
    let gone = stuck().await;
    assert!(
        gone["detail"]["locked_by"]
            .as_str()
            .is_some_and(|s| s.starts_with("scheduler-")),
        "{gone}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_whose_request_waits_behind_others_says_backlog() {
    let app = TestApp::builder()
        .step_timeout("60s")
        .warn_at("[0.01]")
        .supervisor_interval("100ms")
        .build()
        .await;
    app.knobs(
        "a",
        Knobs {
            hang: true,
            hang_ms: 120_000,
            ..Knobs::default()
        },
    );
    for name in ["submission", "scheduler", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    // The agent works on one request at a time: two wait behind it.
    app.start_with_env("agent", "agent", &[], &[("SAS__AGENT__CONCURRENCY", "1")])
        .await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(app.submit("one", None).await);
    }
    let last = ids[2].to_string();
    app.eventually(
        "the last order says backlog with two requests waiting",
        Duration::from_secs(15),
        || async {
            let out = run(&app, &["orders", "show", &last, "--json"]).await;
            // Submitted is not yet stored: the submission service may not have taken it.
            if out.code == Some(3) {
                return false;
            }
            let out = out.expect_code(0);
            let shown: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
            shown["stuck"]["reason"] == "backlog" && shown["stuck"]["detail"]["ahead"] == 2
        },
    )
    .await;
}

/// The shared breaker's changes for agent `a`, oldest first: (to_state, at, actor).
async fn breaker_story(app: &TestApp) -> Vec<(String, chrono::DateTime<chrono::Utc>, String)> {
    sqlx::query_as("SELECT to_state, at, actor FROM breaker_events WHERE agent = 'a' ORDER BY id")
        .fetch_all(&app.db)
        .await
        .expect("breaker events")
}

/// Orders held now.
async fn held(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders WHERE held_for IS NOT NULL")
        .fetch_one(&app.db)
        .await
        .expect("count held orders")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_outage_holds_orders_without_counting_failures_and_each_ends_processed_once_it_is_over()
 {
    // Two failures (max_failures) would take about 2 s: an 800 ms budget
    // and a 100 ms wait each. The remote is down for ten times that.
    let app = TestApp::builder()
        .step_timeout("800ms")
        .max_failures(2)
        .retry_schedule(r#"["100ms"]"#)
        .breaker(3, "1s")
        .build()
        .await;
    app.knobs(
        "a",
        Knobs {
            status: Some(503),
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let down = std::time::Instant::now();
    let status = app.status_queue("outage").await;
    let mut ids = app.submit_many("one", 10, Some(&status)).await;
    app.eventually(
        "the first ten orders are held",
        Duration::from_secs(20),
        || async { held(&app).await == 10 },
    )
    .await;
    ids.extend(app.submit_many("one", 10, Some(&status)).await);
    app.eventually(
        "twenty orders held and the outage ten times as long as two failures",
        Duration::from_secs(40),
        || async { down.elapsed() >= Duration::from_secs(20) && held(&app).await == 20 },
    )
    .await;
    app.knobs("a", Knobs::default());
    let stories = app
        .assert_invariants(&status, &ids, &[], Duration::from_secs(60))
        .await;
    let stats = app.stats();
    for id in &ids {
        let states: Vec<&str> = stories[id]
            .iter()
            .filter_map(|e| e["state"].as_str())
            .collect();
        assert_eq!(states.last(), Some(&"processed"), "{id}: {states:?}");
        assert!(!states.contains(&"compensating"), "{id}: {states:?}");
        let first_held = states.iter().position(|s| *s == "held");
        let resumed = states.iter().rposition(|s| *s == "resumed");
        assert!(
            matches!((first_held, resumed), (Some(h), Some(r)) if h < r),
            "{id}: held, then resumed: {states:?}"
        );
        // One hold, announced once and ended once, whatever the number of
        // probes (one a second for twenty seconds; contract §4c).
        let count = |state: &str| states.iter().filter(|s| **s == state).count();
        assert_eq!(
            (count("held"), count("resumed")),
            (1, 1),
            "{id}: {states:?}"
        );
        let (_, failures) = app.order(*id).await.expect("stored");
        assert!(failures <= 1, "{id}: {failures} failures: {states:?}");
        assert_eq!(stats.keys[&format!("{id}:a")].applied, 1);
    }
    let held_event = stories[&ids[0]]
        .iter()
        .find(|e| e["state"] == "held")
        .expect("held");
    assert_eq!(held_event["detail"]["agent"], "a");
    assert_eq!(held_event["detail"]["reason"], "breaker_open");
    assert!(held_event["detail"]["since"].is_string(), "{held_event}");
    let changes = breaker_story(&app).await;
    assert_eq!(
        changes.last().map(|c| c.0.as_str()),
        Some("closed"),
        "{changes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agent_instances_share_one_breaker_and_send_one_probe_per_cooldown() {
    let app = TestApp::builder()
        .step_timeout("5s")
        .breaker(3, "1s")
        .build()
        .await;
    app.knobs(
        "a",
        Knobs {
            status: Some(503),
            ..Knobs::default()
        },
    );
    for name in ["submission", "scheduler", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    app.start("agent-1", "agent", &["--agent", "a"]).await;
    app.start("agent-2", "agent", &["--agent", "a"]).await;
    let ids = app.submit_many("one", 10, None).await;
    app.eventually("all ten held", Duration::from_secs(20), || async {
        held(&app).await == 10
    })
    .await;
    // Counted when the breaker is open: a probe's call has then been made
    // and has failed.
    let open_sample = async || loop {
        let changes = breaker_story(&app).await;
        let calls = app.stats().endpoints.get("/svc/a").map_or(0, |e| e.calls);
        if changes.last().is_some_and(|c| c.0 == "open")
            && breaker_story(&app).await.len() == changes.len()
        {
            return (changes, calls);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (before, calls_before) = open_sample().await;
    app.eventually("five more probes", Duration::from_secs(30), || async {
        let probes = |c: &[(String, _, String)]| c.iter().filter(|c| c.0 == "half_open").count();
        probes(&breaker_story(&app).await) >= probes(&before) + 5
    })
    .await;
    let (after, calls_after) = tokio::time::timeout(Duration::from_secs(10), open_sample())
        .await
        .expect("the breaker opens again after a probe");
    let probes: Vec<_> = after[before.len()..]
        .iter()
        .filter(|c| c.0 == "half_open")
        .collect();
    assert!(probes.len() >= 5, "{after:?}");
    assert_eq!(
        calls_after - calls_before,
        probes.len() as u64,
        "one call per probe, never two: {after:?}"
    );
    // Each probe came a cool-down after the failure before it.
    for pair in after.windows(2) {
        if pair[1].0 == "half_open" {
            assert_eq!(pair[0].0, "open", "{after:?}");
            assert!(
                pair[1].1 - pair[0].1 >= chrono::Duration::milliseconds(990),
                "a probe within the cool-down: {after:?}"
            );
        }
    }
    // Back up: the next probe closes it and every order is done, once.
    app.knobs("a", Knobs::default());
    app.wait_for_state("processed", 10, Duration::from_secs(30))
        .await;
    let stats = app.stats();
    for id in &ids {
        assert_eq!(stats.keys[&format!("{id}:a")].applied, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_forces_a_breaker_open_its_orders_are_held_and_say_why_and_resume_once_released()
 {
    let app = TestApp::builder()
        .breaker(3, "1s")
        .supervisor_interval("100ms")
        .build()
        .await;
    app.start_all().await;
    let breaker_of_a = async || -> serde_json::Value {
        let list = run(&app, &["agents", "list", "--json"])
            .await
            .expect_code(0);
        list.json()
            .as_array()
            .and_then(|all| all.iter().find(|b| b["agent"] == "a").cloned())
            .unwrap_or_default()
    };
    app.eventually(
        "the agent declared its breakers",
        Duration::from_secs(15),
        || async { breaker_of_a().await["state"] == "closed" },
    )
    .await;
    run(&app, &["agents", "force-open", "nobody"])
        .await
        .expect_code(2);
    run(&app, &["agents", "force-open", "a"])
        .await
        .expect_code(0);
    let status = app.status_queue("forced").await;
    let id = app.submit("one", Some(&status)).await;
    let stuck = async || stuck_of(&app, id).await;
    app.eventually(
        "the order says breaker_open",
        Duration::from_secs(10),
        || async { stuck().await["reason"] == "breaker_open" },
    )
    .await;
    let why = stuck().await;
    assert_eq!(why["detail"]["agent"], "a");
    assert!(why["since"].is_string(), "{why}");
    let forced = breaker_of_a().await;
    assert_eq!(forced["state"], "open");
    assert_eq!(forced["forced"], "open");
    assert_eq!(forced["held"], 1);
    assert!(
        forced["forced_by"]
            .as_str()
            .is_some_and(|by| by.starts_with("operator:")),
        "{forced}"
    );
    app.eventually(
        "the gauge counts the held order",
        Duration::from_secs(10),
        || async {
            app.metrics("supervisor")
                .await
                .contains(r#"sas_orders_stuck{reason="breaker_open"} 1"#)
        },
    )
    .await;
    // Released, the breaker probes with the held order after its cool-down;
    // the remote answers and the breaker closes.
    run(&app, &["agents", "release", "a"]).await.expect_code(0);
    let events = app
        .collect(&status, Duration::from_secs(30), |got| {
            got.iter().any(sas_tests::is_terminal)
        })
        .await;
    assert_eq!(
        story(&events),
        [
            "received",
            "processing",
            "held",
            "resumed",
            "step_succeeded",
            "processed"
        ]
    );
    assert_eq!(app.order(id).await, Some(("processed".into(), 0)));
    let history = run(&app, &["agents", "history", "a", "--json"])
        .await
        .expect_code(0)
        .json_lines();
    let changes: Vec<(String, String)> = history
        .iter()
        .rev()
        .map(|e| {
            let by = e["actor"].as_str().unwrap_or_default();
            let who = if by.starts_with("operator:") {
                "operator"
            } else {
                "agent"
            };
            (
                e["to"].as_str().unwrap_or_default().to_owned(),
                who.to_owned(),
            )
        })
        .collect();
    assert_eq!(
        changes,
        [
            ("open".to_owned(), "operator".to_owned()),
            ("open".to_owned(), "operator".to_owned()),
            ("half_open".to_owned(), "agent".to_owned()),
            ("closed".to_owned(), "agent".to_owned()),
        ],
        "forced open, released, probed, closed: {history:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_agents_late_call_is_refused_by_its_fencing_token_and_the_order_ends_processed_once()
 {
    let app = TestApp::builder()
        .step_timeout("1s")
        .max_failures(5)
        .retry_schedule(r#"["100ms"]"#)
        .build()
        .await;
    app.knobs(
        "a",
        Knobs {
            fencing: true,
            ..Knobs::default()
        },
    );
    for name in ["submission", "scheduler", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    // It freezes just before its first call, its complete-by checked; with
    // one request at a time, RabbitMQ sends it no other while it is frozen.
    app.start_with_env(
        "zombie",
        "agent",
        &["--agent", "a"],
        &[
            ("SAS_PAUSE_AT", "agent.before_call"),
            ("SAS__AGENT__CONCURRENCY", "1"),
        ],
    )
    .await;
    let status = app.status_queue("zombie").await;
    let id = app.submit("one", Some(&status)).await;
    app.eventually(
        "the agent froze before its call",
        Duration::from_secs(15),
        || async { app.is_stopped("zombie") },
    )
    .await;
    // Its complete-by passes; the re-attempt goes to a healthy agent.
    app.start("agent", "agent", &["--agent", "a"]).await;
    wait_state(&app, id, "processed", Duration::from_secs(30)).await;
    let key = format!("{id}:a");
    assert_eq!(app.stats().keys[&key].tokens, [2]);
    // Thawed, the zombie sends its call with the first dispatch's token.
    std::process::Command::new("kill")
        .args(["-CONT", &app.pid("zombie").to_string()])
        .status()
        .expect("kill -CONT");
    app.eventually(
        "the zombie's call reached the remote",
        Duration::from_secs(15),
        || async { app.stats().keys[&key].tokens.len() == 2 },
    )
    .await;
    let stats = app.stats();
    assert_eq!(stats.keys[&key].tokens, [2, 1], "the older token came last");
    assert_eq!(stats.keys[&key].applied, 1, "refused: applied once");
    // Its answer (a 409, a permanent failure) reaches a scheduler as stale.
    app.eventually(
        "the scheduler found the zombie's answer stale",
        Duration::from_secs(15),
        || async {
            app.metrics("scheduler")
                .await
                .contains(r#"sas_replies_total{outcome="stale"} 1"#)
        },
    )
    .await;
    assert_eq!(app.order(id).await.map(|o| o.0), Some("processed".into()));
    let stories = app.stories(&status, &[id], Duration::from_secs(10)).await;
    let states = sas_tests::states(&stories[&id]);
    assert_eq!(
        states,
        [
            "received",
            "processing",
            "retry_scheduled",
            "processing",
            "step_succeeded",
            "processed"
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_held_longer_than_max_hold_counts_a_failure_each_time_and_is_given_up() {
    let app = TestApp::builder()
        .max_failures(2)
        .retry_schedule(r#"["100ms"]"#)
        .supervisor_interval("100ms")
        .build()
        .await;
    for name in ["submission", "scheduler", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    // The agent declares its policy on the breaker's row: a hold of 1 s.
    app.start_with_env("agent", "agent", &[], &[("SAS__AGENTS__A__MAX_HOLD", "1s")])
        .await;
    app.eventually(
        "the agent declared a's breaker",
        Duration::from_secs(15),
        || async {
            sqlx::query_scalar::<_, i64>("SELECT max_hold_ms FROM breakers WHERE agent = 'a'")
                .fetch_optional(&app.db)
                .await
                .ok()
                .flatten()
                == Some(1000)
        },
    )
    .await;
    run(&app, &["agents", "force-open", "a"])
        .await
        .expect_code(0);
    let (id, events) = app.run_one("one").await;
    assert_eq!(
        story(&events),
        [
            "received",
            "processing",
            "held",
            "retry_scheduled",
            "processing",
            "held",
            "failed"
        ]
    );
    let reason = events[3]["detail"]["error"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with("held longer than its agent's max_hold"),
        "{reason}"
    );
    assert_eq!(app.order(id).await, Some(("error".into(), 2)));
    assert_eq!(app.stats().keys.get(&format!("{id}:a")), None, "never sent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_orders_resume_highest_priority_first_then_oldest() {
    let app = TestApp::builder().breaker(3, "1s").build().await;
    // One order a claim, so the claims' order is the order they resume in.
    app.start_all_with_env("scheduler", &[("SAS__SCHEDULER__CLAIM_BATCH", "1")])
        .await;
    app.eventually(
        "the agent declared its breakers",
        Duration::from_secs(15),
        || async {
            let list = run(&app, &["agents", "list", "--json"])
                .await
                .expect_code(0);
            list.json()
                .as_array()
                .is_some_and(|all| all.iter().any(|b| b["agent"] == "a"))
        },
    )
    .await;
    run(&app, &["agents", "force-open", "a"])
        .await
        .expect_code(0);
    let status = app.status_queue("held").await;
    // Each stored before the next is sent: distinct creation times.
    let priorities = [0, 5, 9, 5, 0, 9, 3, 5, 0, 9];
    let mut submitted = Vec::new();
    for priority in priorities {
        let id = Uuid::new_v4();
        let body =
            json!({ "order_id": id, "workflow": "one", "payload": {}, "priority": priority });
        app.publish_raw(body.to_string().as_bytes(), Some(&status), None)
            .await;
        app.eventually("the order stored", Duration::from_secs(10), || async {
            app.order(id).await.is_some()
        })
        .await;
        submitted.push((priority, id));
    }
    app.eventually("every order held", Duration::from_secs(20), || async {
        held(&app).await == priorities.len() as i64
    })
    .await;
    run(&app, &["agents", "force-closed", "a"])
        .await
        .expect_code(0);
    let ids: Vec<Uuid> = submitted.iter().map(|(_, id)| *id).collect();
    let events = app
        .collect(&status, Duration::from_secs(60), |got| {
            got.iter().filter(|e| e["state"] == "processed").count() == ids.len()
        })
        .await;
    // In the order they were resumed: by the time of each resume's
    // transition (one order a claim), not by when its event arrived (the
    // outbox publishes different orders' events on several paths at once).
    let mut resumed: Vec<(String, String)> = events
        .iter()
        .filter(|e| e["state"] == "resumed")
        .filter_map(|e| {
            Some((
                e["at"].as_str()?.to_owned(),
                e["order_id"].as_str()?.to_owned(),
            ))
        })
        .collect();
    resumed.sort();
    let resumed: Vec<String> = resumed.into_iter().map(|(_, id)| id).collect();
    // Highest priority first; among equals, the oldest first.
    let mut expected: Vec<(i32, usize, Uuid)> = submitted
        .iter()
        .enumerate()
        .map(|(i, (p, id))| (-p, i, *id))
        .collect();
    expected.sort();
    let expected: Vec<String> = expected
        .into_iter()
        .map(|(_, _, id)| id.to_string())
        .collect();
    assert_eq!(resumed, expected);
}

/// Until the supervisor of `app` leads and has ticked three times since.
async fn leader_ticked(app: &TestApp) {
    let sweeps = |page: &str| sas_tests::sample(page, "sas_supervisor_sweeps_total");
    app.eventually("the supervisor leads", Duration::from_secs(30), || async {
        sas_tests::sample(&app.metrics("supervisor").await, "sas_supervisor_leader") == 1.0
    })
    .await;
    let led_at = sweeps(&app.metrics("supervisor").await);
    app.eventually("the leader ticks", Duration::from_secs(30), || async {
        sweeps(&app.metrics("supervisor").await) >= led_at + 3.0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_message_the_broker_lost_is_sent_again_at_once_and_only_when_the_marker_went_with_it()
 {
    // Steps have 300 s: only being sent again at once ends the order in time.
    let app = TestApp::builder()
        .step_timeout("300s")
        .supervisor_interval("100ms")
        .build()
        .await;
    for name in ["submission", "scheduler", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    let marker = app.queues.marker().to_owned();
    app.eventually("the marker", Duration::from_secs(30), || async {
        app.ready_if_declared(&marker).await == Some(1)
    })
    .await;
    let status = app.status_queue("lost").await;
    let id = app.submit("one", Some(&status)).await;
    let requests = app.queues.agent_requests("a");
    app.eventually("the request", Duration::from_secs(20), || async {
        app.ready(&requests).await == 1
    })
    .await;

    // A supervisor that restarts finds the marker: the broker lost
    // nothing, and nothing is sent twice.
    app.kill("supervisor");
    app.start("supervisor", "supervisor", &[]).await;
    leader_ticked(&app).await;
    assert_eq!(app.ready(&requests).await, 1, "sent once");
    assert_eq!(app.ready(&marker).await, 1, "one marker");

    // The broker drops its transient messages (as a restart does): the
    // request and the marker with it.
    assert_eq!(app.purge(&requests).await, 1);
    assert_eq!(app.purge(&marker).await, 1);
    app.eventually(
        "the request sent again",
        Duration::from_secs(20),
        || async { app.ready(&requests).await == 1 },
    )
    .await;
    assert_eq!(app.ready(&marker).await, 1, "a new marker");

    app.start("agent", "agent", &[]).await;
    let story = story(&app.stories(&status, &[id], Duration::from_secs(60)).await[&id]);
    assert_eq!(
        story.last().map(String::as_str),
        Some("processed"),
        "{story:?}"
    );
    assert!(
        !story.iter().any(|s| s == "retry_scheduled"),
        "no failure counted: {story:?}"
    );
    assert_eq!(app.stats().keys[&format!("{id}:a")].applied, 1);
}

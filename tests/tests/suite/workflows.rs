//! Workflows for real work (contract §4b): a workflow's own failure policy
//! and a step's own retry.

use std::time::Duration;

use remote_sim::Knobs;
use sas_tests::TestApp;
use sas_tests::cli::run;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workflows_own_max_failures_and_a_steps_own_attempts_override_the_defaults() {
    // By default two failures give an order up; this workflow allows four,
    // and its step makes two calls per dispatch, 10 ms apart.
    let app = TestApp::builder()
        .max_failures(2)
        .extra_config(
            r#"[workflows.patient]
max_failures = 4
retry_schedule = ["50ms"]
steps = [ { name = "a", agent = "a", timeout = "800ms", retry = { max_attempts = 2, backoff = "10ms", backoff_max = "10ms" } } ]
"#,
        )
        .build()
        .await;
    // Five failed calls before the remote answers: with the agent's default
    // (retry until complete-by) the first dispatch would make all six.
    app.knobs(
        "a",
        Knobs {
            fail_first: 5,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let (id, events) = app.run_one("patient").await;
    let states = sas_tests::states(&events);
    assert_eq!(
        states,
        [
            "received",
            "processing",
            "retry_scheduled",
            "processing",
            "retry_scheduled",
            "processing",
            "step_succeeded",
            "processed"
        ]
    );
    assert_eq!(app.order(id).await, Some(("processed".into(), 2)));
    let key = app.stats().keys[&format!("{id}:a")].clone();
    assert_eq!((key.calls, key.applied), (6, 1), "two calls per dispatch");
    assert_eq!(key.tokens, [1, 1, 2, 2, 3, 3]);
    let wait = &events[2]["detail"]["next_attempt_at"];
    assert!(wait.is_string(), "{wait}");
}

#[test]
fn a_zero_attempt_retry_or_an_empty_schedule_is_refused_at_start_up() {
    for (extra, says) in [
        (
            "[workflows.w]\nsteps = [ { name = \"a\", agent = \"a\", retry = { max_attempts = 0 } } ]\n",
            "retry.max_attempts must be at least 1",
        ),
        (
            "[workflows.w]\nretry_schedule = []\nsteps = [ { name = \"a\", agent = \"a\" } ]\n",
            "retry_schedule needs at least one wait",
        ),
        (
            "[workflows.w]\nmax_failures = 0\nsteps = [ { name = \"a\", agent = \"a\" } ]\n",
            "max_failures must be at least 1",
        ),
    ] {
        sas_tests::assert_refused_at_start_up(
            "scheduler",
            &format!("[agents.a]\nurl = \"http://127.0.0.1:1/a\"\n\n{extra}"),
            says,
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_in_flight_bounds_an_agents_calls_across_two_schedulers_and_three_agents_and_orders_wait_rate_limited()
 {
    let app = TestApp::builder().step_timeout("20s").build().await;
    // Agent b (the second step of `three`) takes 800 ms a call: orders
    // wait for it seconds on end.
    app.knobs(
        "b",
        Knobs {
            latency_ms: 800,
            ..Knobs::default()
        },
    );
    for name in ["submission", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    // Two schedulers share the limit (it is counted in the state store).
    for name in ["scheduler-1", "scheduler-2"] {
        app.start_with_env(
            name,
            "scheduler",
            &[],
            &[("SAS__AGENTS__B__MAX_IN_FLIGHT", "3")],
        )
        .await;
    }
    for name in ["agent-1", "agent-2", "agent-3"] {
        app.start(name, "agent", &[]).await;
    }
    let status = app.status_queue("flow").await;
    let ids = app.submit_many("three", 12, Some(&status)).await;
    // While orders wait for room, one says so.
    app.eventually(
        "a held order says rate_limited",
        Duration::from_secs(20),
        || async {
            let held: Option<uuid::Uuid> = sqlx::query_scalar(
                // The newest waits longest: the claims take the oldest first.
                "SELECT order_id FROM orders WHERE held_reason = 'rate_limited' \
                 ORDER BY created_at DESC LIMIT 1",
            )
            .fetch_optional(&app.db)
            .await
            .ok()
            .flatten();
            let Some(id) = held else { return false };
            let shown = run(&app, &["orders", "show", &id.to_string(), "--json"])
                .await
                .expect_code(0);
            let stuck = &shown.json()["stuck"];
            stuck["reason"] == "rate_limited" && stuck["detail"]["agent"] == "b"
        },
    )
    .await;
    let stories = app
        .assert_invariants(&status, &ids, &[], Duration::from_secs(60))
        .await;
    let b = app.stats().endpoints["/svc/b"].clone();
    assert_eq!(b.applied, 12);
    assert!(
        (1..=3).contains(&b.max_in_progress),
        "at most three calls at once: {b:?}"
    );
    let waited = stories
        .values()
        .filter(|events| {
            events
                .iter()
                .any(|e| e["state"] == "held" && e["detail"]["reason"] == "rate_limited")
        })
        .count();
    assert!(waited > 0, "some orders waited for room");
    for events in stories.values() {
        let states = sas_tests::states(events);
        assert_eq!(states.last(), Some(&"processed"), "{states:?}");
    }
    let listed = run(&app, &["agents", "list", "--json"])
        .await
        .expect_code(0);
    let b_row = listed
        .json()
        .as_array()
        .and_then(|all| all.iter().find(|r| r["agent"] == "b").cloned())
        .unwrap_or_default();
    assert_eq!(b_row["max_in_flight"], 3, "{b_row}");
    let in_flight: i32 = sqlx::query_scalar("SELECT in_flight FROM agent_flow WHERE agent = 'b'")
        .fetch_one(&app.db)
        .await
        .expect("b is under flow control");
    assert_eq!(in_flight, 0, "every step out was counted back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_spreads_two_hundred_dispatches_over_ten_seconds_across_two_schedulers_and_two_agents()
 {
    let app = TestApp::builder().step_timeout("60s").build().await;
    for name in ["submission", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    // Two schedulers and two agents share the rate (one token bucket in
    // the state store).
    for name in ["scheduler-1", "scheduler-2"] {
        app.start_with_env(
            name,
            "scheduler",
            &[],
            &[("SAS__AGENTS__A__RATE_LIMIT", "20/s")],
        )
        .await;
    }
    for name in ["agent-1", "agent-2"] {
        app.start(name, "agent", &[]).await;
    }
    app.submit_many("one", 200, None).await;
    app.wait_for_state("processed", 200, Duration::from_secs(60))
        .await;
    // Each order's one dispatch, on the database's clock.
    let (span, busiest): (f64, i64) = sqlx::query_as(
        "WITH d AS (SELECT started_at AS at FROM steps) \
         SELECT extract(epoch FROM max(at) - min(at))::float8, \
           (SELECT max(n) FROM (SELECT (SELECT count(*) FROM d d2 \
              WHERE d2.at >= d1.at AND d2.at < d1.at + interval '1 second') AS n FROM d d1) w) \
         FROM d",
    )
    .fetch_one(&app.db)
    .await
    .expect("dispatch times");
    // 200 at 20/s with a burst of 2: 9.9 s from the first to the last.
    assert!(span >= 9.5, "200 dispatches within {span:.2} s");
    assert!(busiest <= 22, "{busiest} dispatches within one second");
    assert!(
        busiest >= 15,
        "the rate is used: {busiest} in the busiest second"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_waiting_for_a_full_agent_do_not_hold_back_the_orders_behind_them() {
    let app = TestApp::builder().step_timeout("30s").build().await;
    app.knobs(
        "b",
        Knobs {
            latency_ms: 700,
            ..Knobs::default()
        },
    );
    for name in ["submission", "supervisor", "agent"] {
        app.start(name, name, &[]).await;
    }
    // Claims of four: the ten orders waiting for b would fill every one.
    app.start_with_env(
        "scheduler",
        "scheduler",
        &[],
        &[
            ("SAS__AGENTS__B__MAX_IN_FLIGHT", "1"),
            ("SAS__SCHEDULER__CLAIM_BATCH", "4"),
        ],
    )
    .await;
    let waiting = app.submit_many("three", 10, None).await;
    app.eventually("orders wait for b", Duration::from_secs(15), || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM orders WHERE held_reason = 'rate_limited'",
        )
        .fetch_one(&app.db)
        .await
        .unwrap_or(0)
            >= 4
    })
    .await;
    let behind = app.submit_many("one", 5, None).await;
    app.eventually(
        "the orders behind are done",
        Duration::from_secs(15),
        || async {
            let mut done = 0;
            for id in &behind {
                if app.order(*id).await.is_some_and(|o| o.0 == "processed") {
                    done += 1;
                }
            }
            done == behind.len()
        },
    )
    .await;
    let mut three_done = 0;
    for id in &waiting {
        if app.order(*id).await.is_some_and(|o| o.0 == "processed") {
            three_done += 1;
        }
    }
    // b takes one at a time, 0.7 s each: had the ten filled every claim, the
    // orders behind would have waited for most of them.
    assert!(
        three_done <= 4,
        "{three_done} of the orders waiting for b were done before those behind them"
    );
    app.wait_for_state("processed", 15, Duration::from_secs(30))
        .await;
}

/// Workflows whose one step is a long-running operation at the remote.
const LONG: &str = r#"[workflows.long]
steps = [ { name = "a", agent = "a", timeout = "2s" } ]

[workflows.bounded]
steps = [ { name = "b", agent = "b", timeout = "2s", max_duration = "5s" } ]
"#;

/// A remote that answers `202 Accepted` and finishes after `ms`, polled every second.
fn long_running(ms: u64) -> Knobs {
    Knobs {
        long_ms: ms,
        retry_after: Some(1),
        ..Knobs::default()
    }
}

/// The `complete_by` of each `heartbeat` event of `events`.
fn heartbeats(events: &[serde_json::Value]) -> Vec<chrono::DateTime<chrono::Utc>> {
    events
        .iter()
        .filter(|e| e["state"] == "heartbeat")
        .map(|e| {
            let at = e["detail"]["complete_by"].as_str().unwrap_or_default();
            chrono::DateTime::parse_from_rfc3339(at)
                .map(|t| t.to_utc())
                .unwrap_or_else(|e| panic!("{at}: {e}"))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_running_operation_is_polled_past_its_timeout_and_each_202_moves_complete_by() {
    let app = TestApp::builder()
        .max_failures(1)
        .extra_config(LONG)
        .build()
        .await;
    app.knobs("a", long_running(10_000));
    app.start_all().await;
    let (id, events) = app.run_one("long").await;
    let states = sas_tests::states(&events);
    assert_eq!(states.last(), Some(&"processed"), "{states:?}");
    assert!(!states.contains(&"retry_scheduled"), "{states:?}");
    assert_eq!(app.order(id).await, Some(("processed".into(), 0)));
    // A poll a second for ten seconds with a two-second timeout: the
    // deadline moved forward at every one.
    let moved = heartbeats(&events);
    assert!(moved.len() >= 5, "{} heartbeats: {states:?}", moved.len());
    assert!(moved.windows(2).all(|w| w[0] < w[1]), "{moved:?}");
    let stats = app.stats();
    assert_eq!(stats.keys[&format!("{id}:a")].applied, 1);
    let a = &stats.endpoints["/svc/a"];
    assert_eq!(a.accepted, 1, "one POST: {a:?}");
    assert!(a.polls >= 5, "{a:?}");
    let result = &events.last().expect("events")["detail"]["results"]["a"];
    assert!(
        result.is_object(),
        "the job's answer is the result: {result}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_running_operation_past_max_duration_times_out_as_a_failure() {
    let app = TestApp::builder()
        .max_failures(1)
        .extra_config(LONG)
        .build()
        .await;
    app.knobs("b", long_running(10_000));
    app.start_all().await;
    let (id, events) = app.run_one("bounded").await;
    let states = sas_tests::states(&events);
    assert_eq!(states.last(), Some(&"failed"), "{states:?}");
    let (started, last_error): (chrono::DateTime<chrono::Utc>, Option<String>) = sqlx::query_as(
        "SELECT s.started_at, o.last_error FROM steps s JOIN orders o USING (order_id) \
         WHERE order_id = $1",
    )
    .bind(id)
    .fetch_one(&app.db)
    .await
    .expect("order");
    assert!(
        last_error
            .as_deref()
            .is_some_and(|e| e.contains("complete-by passed")),
        "{last_error:?}"
    );
    let moved = heartbeats(&events);
    assert!(!moved.is_empty(), "{states:?}");
    let bound = started + chrono::Duration::seconds(5);
    assert!(moved.iter().all(|t| *t <= bound), "{moved:?} past {bound}");
    assert_eq!(app.stats().keys[&format!("{id}:b")].applied, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_dies_mid_poll_is_replaced_and_the_new_dispatch_polls_the_same_job() {
    let app = TestApp::builder()
        .max_failures(3)
        .retry_schedule(r#"["100ms"]"#)
        .supervisor_interval("200ms")
        .extra_config(LONG)
        .build()
        .await;
    app.knobs("a", long_running(6_000));
    app.start_all().await;
    let status = app.status_queue("long-crash").await;
    let id = app.submit("long", Some(&status)).await;
    app.eventually("the first heartbeat", Duration::from_secs(10), || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM order_events WHERE order_id = $1 AND event = 'heartbeat'",
        )
        .bind(id)
        .fetch_one(&app.db)
        .await
        .unwrap_or(0)
            >= 1
    })
    .await;
    app.crash_agent_until_reattempt(id, Duration::from_secs(10))
        .await;
    let stories = app
        .assert_invariants(&status, &[id], &[], Duration::from_secs(30))
        .await;
    let states = sas_tests::states(&stories[&id]);
    assert_eq!(states.last(), Some(&"processed"), "{states:?}");
    let stats = app.stats();
    assert_eq!(
        stats.keys[&format!("{id}:a")].applied,
        1,
        "the job ran once"
    );
    // The new dispatch's POST found the job the first one started.
    assert_eq!(stats.endpoints["/svc/a"].accepted, 2);
}

/// When the first event of `events` with state `state` was logged.
fn at_state(events: &[serde_json::Value], state: &str) -> chrono::DateTime<chrono::Utc> {
    let e = events
        .iter()
        .find(|e| e["state"] == state)
        .unwrap_or_else(|| panic!("no {state}: {events:?}"));
    chrono::DateTime::parse_from_rfc3339(e["at"].as_str().unwrap_or_default())
        .map(|t| t.to_utc())
        .expect("an RFC 3339 time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remotes_retry_after_is_waited_for_and_one_past_complete_by_means_silence() {
    // (An audit gap of #39: `Retry-After` end to end.)
    let app = TestApp::builder()
        .step_timeout("5s")
        .max_failures(1)
        .build()
        .await;
    app.start_all().await;
    // 503 with `Retry-After: 2` once, then success: the agent calls again
    // two seconds later, not after its own short backoff.
    app.knobs(
        "a",
        Knobs {
            fail_first: 1,
            retry_after: Some(2),
            ..Knobs::default()
        },
    );
    let (id, events) = app.run_one("one").await;
    assert_eq!(sas_tests::states(&events).last(), Some(&"processed"));
    let waited = at_state(&events, "step_succeeded") - at_state(&events, "processing");
    assert!(
        waited >= chrono::Duration::milliseconds(1900),
        "called again after {waited}"
    );
    assert_eq!(app.stats().keys[&format!("{id}:a")].calls, 2);

    // `Retry-After: 60` against a 5 s complete-by: one call, then the
    // agent stays silent; the supervisor ends the dispatch at complete-by.
    app.knobs(
        "a",
        Knobs {
            fail_first: 1,
            retry_after: Some(60),
            ..Knobs::default()
        },
    );
    let (id, events) = app.run_one("one").await;
    let states = sas_tests::states(&events);
    assert_eq!(states.last(), Some(&"failed"), "{states:?}");
    let timed_out = at_state(&events, "failed") - at_state(&events, "processing");
    assert!(
        timed_out >= chrono::Duration::milliseconds(4900),
        "ended after {timed_out}: {states:?}"
    );
    assert_eq!(
        app.stats().keys[&format!("{id}:a")].calls,
        1,
        "no call before the remote's Retry-After"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workflows_own_retry_schedule_paces_its_reattempts() {
    // (An audit gap of #39: a workflow's `retry_schedule`, by its timing.)
    let app = TestApp::builder()
        .retry_schedule(r#"["100ms"]"#)
        .supervisor_interval("100ms")
        .extra_config(
            r#"[workflows.paced]
retry_schedule = ["2s"]
max_failures = 3
steps = [ { name = "a", agent = "a", timeout = "700ms" } ]
"#,
        )
        .build()
        .await;
    // The first call hangs past complete-by: one re-attempt, two seconds on.
    app.knobs(
        "a",
        Knobs {
            hang_first: 1,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let (_, events) = app.run_one("paced").await;
    let states = sas_tests::states(&events);
    assert_eq!(states.last(), Some(&"processed"), "{states:?}");
    let retried = at_state(&events, "retry_scheduled");
    let again = events
        .iter()
        .filter(|e| e["state"] == "processing")
        .nth(1)
        .and_then(|e| e["at"].as_str())
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.to_utc())
        .unwrap_or_else(|| panic!("no second processing: {states:?}"));
    let waited = again - retried;
    assert!(
        waited >= chrono::Duration::milliseconds(1900),
        "re-attempted {waited} after the failure, not after the workflow's 2s"
    );
    assert!(
        waited < chrono::Duration::seconds(10),
        "re-attempted only {waited} after the failure"
    );
}

/// Contract §4d, versions: an order keeps the whole definition it was
/// submitted under (here its failure policy and its step's retry) across
/// a change of the configuration and a restart of every service; an order
/// submitted after the change runs under the new one. `sasctl orders show`
/// says which.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_keeps_its_definition_across_a_configuration_change_and_a_restart() {
    let v1 = r#"[workflows.kept]
version = "v1"
max_failures = 1
steps = [ { name = "a", agent = "a", timeout = "400ms", retry = { max_attempts = 1 } } ]
"#;
    let app = TestApp::builder()
        .max_failures(5)
        .extra_config(v1)
        .build()
        .await;
    // No agent yet: the first order's request waits in its queue.
    app.start("submission", "submission", &[]).await;
    app.start("scheduler", "scheduler", &[]).await;
    let status = app.status_queue("kept").await;
    let old = app.submit("kept", Some(&status)).await;
    sas_tests::cli::wait_state(&app, old, "processing", Duration::from_secs(20)).await;

    // Version 2 gives up only after five failures and calls twice per dispatch.
    let config = std::fs::read_to_string(&app.config).expect("config");
    let v2 = v1
        .replace("\"v1\"", "\"v2\"")
        .replace("max_failures = 1", "max_failures = 5")
        .replace("max_attempts = 1", "max_attempts = 2");
    assert!(
        config.contains(v1),
        "the test's workflow is in the configuration"
    );
    std::fs::write(&app.config, config.replace(v1, &v2)).expect("write config");
    for name in ["submission", "scheduler"] {
        assert!(
            app.terminate(name).await.success(),
            "{name} stopped cleanly"
        );
    }
    // The remote fails its first two calls, then succeeds.
    app.knobs(
        "a",
        Knobs {
            fail_first: 2,
            ..Knobs::default()
        },
    );
    app.start_all().await;

    // Under v1 the old order's first failure is its last: its one call per
    // dispatch failed (or its request outlived its deadline), and it gives up.
    sas_tests::cli::wait_state(&app, old, "error", Duration::from_secs(30)).await;
    let shown = run(&app, &["orders", "show", &old.to_string(), "--json"])
        .await
        .expect_code(0);
    let json: serde_json::Value = serde_json::from_str(&shown.stdout).expect("json");
    assert_eq!(json["order"]["version"], "v1", "{json}");
    assert_eq!(json["order"]["failure_count"], 1, "{json}");

    // A new order runs under v2: two calls per dispatch get past the
    // remote's two failures within its first re-attempt at the latest.
    let (new, events) = app.run_one("kept").await;
    assert_eq!(
        sas_tests::states(&events).last(),
        Some(&"processed"),
        "{events:?}"
    );
    let shown = run(&app, &["orders", "show", &new.to_string()])
        .await
        .expect_code(0);
    assert!(
        shown.stdout.contains("version        v2\n"),
        "{}",
        shown.stdout
    );
    let calls = app.stats().keys[&format!("{new}:a")].calls;
    assert!(calls >= 2, "{calls} calls");
}

/// Definitions as the state store reads them back (contract §4d): a stored
/// one whole; one this build cannot read (a newer sas wrote it, during a
/// rolling upgrade) and one never stored as none, so that their orders
/// follow the configuration instead of failing every transition.
#[tokio::test]
async fn a_stored_definition_reads_back_whole_and_an_unreadable_one_as_none() {
    let app = TestApp::new().await;
    let store = sas::state_store::StateStore::from_pool(app.db.clone());
    let spec: sas::spec::WorkflowSpec = serde_json::from_value(serde_json::json!({
        "version": "v7",
        "max_failures": 2,
        "steps": [ { "name": "a", "agent": "a", "retry": { "max_attempts": 2 } } ],
    }))
    .expect("spec");
    let stored = sas::spec::Definition {
        workflow: "w".into(),
        spec,
    };
    let newer = uuid::Uuid::now_v7();
    let never = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO definitions (id, workflow, version, spec) VALUES ($1, 'w', 'v7', $2), \
         ($3, 'w', NULL, '{\"steps\": [], \"when_the_future_comes\": true}')",
    )
    .bind(stored.id())
    .bind(serde_json::to_value(&stored.spec).expect("json"))
    .bind(newer)
    .execute(&app.db)
    .await
    .expect("insert");
    let found = store
        .definitions([stored.id(), newer, never, stored.id()])
        .await
        .expect("read");
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(*found[0].1, stored);
    assert_eq!(found[0].0, stored.id());
    // Read once: the second time comes from the process's own copy.
    sqlx::query("DELETE FROM definitions")
        .execute(&app.db)
        .await
        .expect("delete");
    let again = store.definitions([stored.id()]).await.expect("read");
    assert_eq!(again.len(), 1);
}

/// The events of `step` in `state`.
fn of_step<'e>(
    events: &'e [serde_json::Value],
    state: &str,
    step: &str,
) -> Vec<&'e serde_json::Value> {
    events
        .iter()
        .filter(|e| e["state"] == state && e["step"] == step)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_false_condition_skips_its_step_a_true_one_runs_it_and_a_broken_one_undoes_the_order() {
    let app = TestApp::builder()
        .extra_config(
            r#"[workflows.maybe]
steps = [
  { name = "a", agent = "a", compensate = "a-undo" },
  { name = "b", agent = "b", when = "payload.total > 0 && results.a.ok" },
  { name = "c", agent = "c" },
]
"#,
        )
        .build()
        .await;
    app.start_all().await;
    let stands = |id: uuid::Uuid, step: &str| {
        app.stats()
            .keys
            .get(&format!("{id}:{step}"))
            .is_some_and(|k| k.standing)
    };

    // False: b is skipped with its event, c runs, the order succeeds.
    let (id, events) = app
        .run_with("maybe", serde_json::json!({ "total": 0 }))
        .await;
    assert_eq!(
        sas_tests::states(&events),
        [
            "received",
            "processing",
            "step_succeeded",
            "step_skipped",
            "step_succeeded",
            "processed"
        ],
        "{events:?}"
    );
    let skipped = of_step(&events, "step_skipped", "b");
    assert_eq!(
        skipped[0]["detail"]["when"],
        "payload.total > 0 && results.a.ok"
    );
    assert!(
        !app.stats().keys.contains_key(&format!("{id}:b")),
        "b never called"
    );
    assert!(stands(id, "a") && stands(id, "c"));
    let results = &events.last().expect("terminal")["detail"]["results"];
    assert!(results.get("b").is_none(), "{results}");
    let shown = run(&app, &["orders", "show", &id.to_string(), "--json"])
        .await
        .expect_code(0);
    let json: serde_json::Value = serde_json::from_str(&shown.stdout).expect("json");
    assert_eq!(json["steps"][1]["state"], "skipped", "{json}");

    // True: b runs.
    let (id, events) = app
        .run_with("maybe", serde_json::json!({ "total": 5 }))
        .await;
    assert_eq!(
        of_step(&events, "step_succeeded", "b").len(),
        1,
        "{events:?}"
    );
    assert!(
        sas_tests::states(&events)
            .iter()
            .all(|s| *s != "step_skipped")
    );
    assert!(stands(id, "b"));

    // Broken at run time (total is no number): b fails for good with the
    // reason, and a, which ran, is undone.
    let (id, events) = app
        .run_with("maybe", serde_json::json!({ "total": "ten" }))
        .await;
    assert_eq!(
        sas_tests::states(&events).last(),
        Some(&"compensated"),
        "{events:?}"
    );
    let giving_up = events
        .iter()
        .find(|e| e["state"] == "compensating")
        .expect("compensating");
    let error = giving_up["detail"]["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("step b failed permanently: when:"),
        "{error}"
    );
    assert!(!stands(id, "a") && app.stats().keys[&format!("{id}:a")].undone);
    assert!(!app.stats().keys.contains_key(&format!("{id}:b")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapped_input_is_the_payload_the_remote_sees() {
    let app = TestApp::builder()
        .extra_config(
            r#"[workflows.mapped]
steps = [
  { name = "reserve", agent = "a" },
  { name = "charge", agent = "b",
    input = { amountCents = "payload.total * 100", reservation = "results.reserve.idempotency_key", skus = "payload.items.map(i, i.sku)" } },
]
"#,
        )
        .build()
        .await;
    for agent in ["a", "b"] {
        app.knobs(
            agent,
            Knobs {
                echo: true,
                ..Knobs::default()
            },
        );
    }
    app.start_all().await;
    let payload = serde_json::json!({ "total": 12, "items": [{ "sku": "x1" }, { "sku": "y2" }], "card": "secret" });
    let (id, events) = app.run_with("mapped", payload.clone()).await;
    assert_eq!(
        sas_tests::states(&events).last(),
        Some(&"processed"),
        "{events:?}"
    );
    let seen = |step: &str| {
        of_step(&events, "step_succeeded", step)[0]["detail"]["result"]["echo"].clone()
    };
    // A step without `input` is sent the order's payload as it came.
    assert_eq!(seen("reserve"), payload);
    assert_eq!(
        seen("charge"),
        serde_json::json!({ "amountCents": 1200, "reservation": format!("{id}:reserve"), "skus": ["x1", "y2"] })
    );
}

/// Waits until step `step` of order `id` is in `state`.
async fn wait_step(app: &TestApp, id: uuid::Uuid, step: &str, state: &str) {
    app.eventually(
        &format!("step {step} of {id} is {state}"),
        Duration::from_secs(20),
        || async {
            let found: Option<String> =
                sqlx::query_scalar("SELECT state FROM steps WHERE order_id = $1 AND name = $2")
                    .bind(id)
                    .bind(step)
                    .fetch_optional(&app.db)
                    .await
                    .expect("read step");
            found.as_deref() == Some(state)
        },
    )
    .await;
}

fn at(e: &serde_json::Value) -> chrono::DateTime<chrono::Utc> {
    e["at"].as_str().and_then(|t| t.parse().ok()).expect("at")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_is_held_by_the_state_store_across_a_crash_of_the_scheduler_and_the_supervisor() {
    let app = TestApp::builder()
        .extra_config(
            r#"[workflows.cool]
steps = [
  { name = "a", agent = "a" },
  { name = "cool-off", wait = "3s" },
  { name = "c", agent = "c" },
]
"#,
        )
        .build()
        .await;
    app.start_all().await;
    let status = app.status_queue("cool").await;
    let id = app.submit("cool", Some(&status)).await;
    wait_step(&app, id, "cool-off", "running").await;
    // Nothing sleeps in a process: both crash mid-wait and come back.
    app.kill("scheduler");
    app.kill("supervisor");
    app.start("scheduler", "scheduler", &[]).await;
    app.start("supervisor", "supervisor", &[]).await;
    let events = app
        .collect(&status, Duration::from_secs(30), |got| {
            got.iter().any(sas_tests::is_terminal)
        })
        .await;
    assert_eq!(
        sas_tests::states(&events),
        [
            "received",
            "processing",
            "step_succeeded",
            "step_succeeded",
            "step_succeeded",
            "processed"
        ],
        "{events:?}"
    );
    let (a, cool) = (&events[2], &events[3]);
    assert_eq!(cool["step"], "cool-off");
    let waited = at(cool) - at(a);
    assert!(waited >= chrono::Duration::seconds(3), "waited {waited}");
    let until: chrono::DateTime<chrono::Utc> = cool["detail"]["result"]["waited_until"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .expect("waited_until");
    assert!(until <= at(cool), "it ended no sooner than its end");
    assert!(
        app.stats().keys.keys().all(|k| !k.contains("cool-off")),
        "no agent ran it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_signal_completes_its_step_and_a_stray_one_is_refused_and_not_kept() {
    let app = TestApp::builder()
        .extra_config(
            r#"[workflows.approved]
steps = [
  { name = "reserve", agent = "a", compensate = "a-undo" },
  { name = "approve", signal = "approval", timeout = "60s" },
  { name = "charge", agent = "b", input = { approved_by = "results.approve.by" } },
]
"#,
        )
        .build()
        .await;
    app.knobs(
        "b",
        Knobs {
            echo: true,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let status = app.status_queue("approved").await;
    let id = app.submit("approved", Some(&status)).await;
    let signal = |name: &'static str, data: &'static str| {
        let id = id.to_string();
        let app = &app;
        async move { run(app, &["orders", "signal", &id, name, "--data", data]).await }
    };
    wait_step(&app, id, "approve", "running").await;
    // A signal no step waits for: refused with the reason, nothing changes.
    let stray = signal("refund", r#"{"by": "mallory"}"#)
        .await
        .expect_code(4);
    assert!(
        stray
            .stderr
            .contains("no step of the order waits for this signal"),
        "{}",
        stray.stderr
    );
    let unknown = run(
        &app,
        &[
            "orders",
            "signal",
            &uuid::Uuid::now_v7().to_string(),
            "approval",
        ],
    )
    .await;
    assert_ne!(unknown.code, Some(0), "an unknown order");
    assert_eq!(app.order(id).await, Some(("processing".into(), 0)));
    // Still waiting, without a failure counted.
    wait_step(&app, id, "approve", "running").await;
    let approved = signal("approval", r#"{"by": "ann", "note": "ok"}"#)
        .await
        .expect_code(0);
    assert!(approved.stdout.contains("signalled"), "{}", approved.stdout);
    let events = app
        .collect(&status, Duration::from_secs(30), |got| {
            got.iter().any(sas_tests::is_terminal)
        })
        .await;
    assert_eq!(
        sas_tests::states(&events).last(),
        Some(&"processed"),
        "{events:?}"
    );
    let approve = of_step(&events, "step_succeeded", "approve");
    assert_eq!(
        approve[0]["detail"]["result"],
        serde_json::json!({ "by": "ann", "note": "ok" })
    );
    assert_eq!(approve[0]["detail"]["signal"], "approval");
    let charge = of_step(&events, "step_succeeded", "charge");
    assert_eq!(
        charge[0]["detail"]["result"]["echo"],
        serde_json::json!({ "approved_by": "ann" })
    );
    // Once it is over, the same signal is refused: it was not kept.
    let late = signal("approval", "{}").await.expect_code(4);
    assert!(late.stderr.contains("not running"), "{}", late.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_on_the_queue_complete_their_step_and_hostile_ones_are_dead_lettered_with_the_neighbours_unharmed()
 {
    let app = TestApp::builder()
        .extra_config(
            r#"[workflows.approved]
steps = [
  { name = "reserve", agent = "a", compensate = "a-undo" },
  { name = "approve", signal = "approval", timeout = "60s" },
  { name = "charge", agent = "b" },
]
"#,
        )
        .build()
        .await;
    app.start_all().await;
    let status = app.status_queue("approved").await;
    let (first, second) = (
        app.submit("approved", Some(&status)).await,
        app.submit("approved", Some(&status)).await,
    );
    for id in [first, second] {
        wait_step(&app, id, "approve", "running").await;
    }
    let publisher = app.publisher();
    let send = |body: Vec<u8>| {
        let publisher = publisher.clone();
        let queue = app.queues.signals().to_owned();
        async move {
            publisher
                .publish(&sas::broker::Outgoing {
                    routing_key: &queue,
                    body: &body,
                    mandatory: true,
                    ..sas::broker::Outgoing::default()
                })
                .await
                .expect("publish signal");
        }
    };
    let deep = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
    let f = first.to_string();
    let hostile: Vec<(Vec<u8>, &str)> = vec![
        (b"".to_vec(), "not valid JSON"),
        (b"\xff\xfe".to_vec(), "UTF-8"),
        (b"[1, 2]".to_vec(), "JSON object"),
        (b"null".to_vec(), "JSON object"),
        (br#"{"signal": "approval"}"#.to_vec(), "order_id"),
        (format!(r#"{{"order_id": "{f}"}}"#).into_bytes(), "signal"),
        (
            br#"{"order_id": 7, "signal": "approval"}"#.to_vec(),
            "order_id",
        ),
        (
            format!(r#"{{"order_id": "{f}", "signal": ""}}"#).into_bytes(),
            "signal",
        ),
        (
            format!(r#"{{"order_id": "{f}", "signal": "{}"}}"#, "s".repeat(101)).into_bytes(),
            "signal",
        ),
        (
            format!(r#"{{"order_id": "{f}", "signal": "approval", "step": "approve"}}"#)
                .into_bytes(),
            "unknown field",
        ),
        (
            format!(r#"{{"order_id": "{f}", "signal": "approval", "data": {deep}}}"#).into_bytes(),
            "not valid JSON",
        ),
        (
            format!(r#"{{"order_id": "{f}", "signal": "refund"}}"#).into_bytes(),
            "no step of the order waits for this signal",
        ),
        // The signal the step waits for, with what Postgres cannot store
        // or a log line cannot hold: refused with why, never retried.
        (
            format!(r#"{{"order_id": "{f}", "signal": "approval", "data": {{"a": "x\u0000"}}}}"#)
                .into_bytes(),
            "NUL",
        ),
        (
            format!(r#"{{"order_id": "{f}", "signal": "approval", "data": "\u0000"}}"#)
                .into_bytes(),
            "NUL",
        ),
        (
            format!(r#"{{"order_id": "{f}", "signal": "approval", "data": [1e308]}}"#).into_bytes(),
            "1e300",
        ),
        (
            format!(
                r#"{{"order_id": "{f}", "signal": "approval\n2026-11-28T00:00:00Z INFO forged"}}"#
            )
            .into_bytes(),
            "control characters",
        ),
        (
            format!(
                r#"{{"order_id": "{f}", "signal": "{}"}}"#,
                app.queues.orders()
            )
            .into_bytes(),
            "no step of the order waits",
        ),
        (
            format!(
                r#"{{"order_id": "{}", "signal": "approval"}}"#,
                uuid::Uuid::now_v7()
            )
            .into_bytes(),
            "unknown order",
        ),
        (vec![b' '; 2 * 1024 * 1024], ""),
    ];
    for (body, _) in &hostile {
        send(body.clone()).await;
    }
    let dead = app.queues.signals_dead().to_owned();
    app.eventually(
        "every hostile signal dead-lettered",
        Duration::from_secs(20),
        || async { app.ready(&dead).await as usize == hostile.len() },
    )
    .await;
    let letters = app.drain(&dead).await;
    // Signals are handled concurrently: each is found by its body.
    for (body, says) in &hostile {
        let (_, reason) = letters
            .iter()
            .find(|(kept, _)| kept == body)
            .unwrap_or_else(|| {
                panic!(
                    "{:.80} dead-lettered as sent",
                    String::from_utf8_lossy(body)
                )
            });
        let reason = reason.clone().unwrap_or_default();
        assert!(reason.contains(says), "{reason:?} should say {says:?}");
    }
    // The neighbours are unharmed: both still wait, nothing counted.
    for id in [first, second] {
        assert_eq!(app.order(id).await, Some(("processing".into(), 0)));
        wait_step(&app, id, "approve", "running").await;
    }
    app.assert_running(&["submission", "scheduler", "agent", "supervisor"]);
    // A good signal on the queue completes the first; the second goes on waiting.
    send(
        format!(r#"{{"order_id": "{f}", "signal": "approval", "data": {{"by": "ann"}}}}"#)
            .into_bytes(),
    )
    .await;
    sas_tests::cli::wait_state(&app, first, "processed", Duration::from_secs(20)).await;
    assert_eq!(app.order(second).await, Some(("processing".into(), 0)));
    let steps: serde_json::Value =
        sqlx::query_scalar("SELECT result FROM steps WHERE order_id = $1 AND name = 'approve'")
            .bind(first)
            .fetch_one(&app.db)
            .await
            .expect("result");
    assert_eq!(steps, serde_json::json!({ "by": "ann" }));
    // The same signal again is refused: it was not kept.
    send(format!(r#"{{"order_id": "{f}", "signal": "approval"}}"#).into_bytes()).await;
    app.eventually(
        "the late signal dead-lettered",
        Duration::from_secs(20),
        || async { app.ready(&dead).await == 1 },
    )
    .await;
    let late = app.drain(&dead).await;
    assert!(
        late[0]
            .1
            .as_deref()
            .unwrap_or_default()
            .contains("is processed"),
        "{late:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_of_ten_items_keeps_three_at_the_remote_at_most_and_lists_their_results_in_order()
{
    let app = TestApp::builder()
        .extra_config(
            r#"[workflows.fan]
steps = [
  { name = "reserve", agent = "a", compensate = "a-undo", for_each = "payload.items", max_concurrency = 3 },
  { name = "ship", agent = "b", input = { skus = "results.reserve.map(r, r.item.sku)" } },
]
"#,
        )
        .build()
        .await;
    app.knobs(
        "b",
        Knobs {
            echo: true,
            ..Knobs::default()
        },
    );
    // Each item is in its call's body as `item`: echoed back.
    app.knobs(
        "a",
        Knobs {
            latency_ms: 150,
            echo: true,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let items: Vec<_> = (0..10)
        .map(|i| serde_json::json!({ "sku": format!("k{i}") }))
        .collect();
    let (id, events) = app
        .run_with("fan", serde_json::json!({ "items": items }))
        .await;
    assert_eq!(
        sas_tests::states(&events).last(),
        Some(&"processed"),
        "{events:?}"
    );
    let stats = app.stats();
    for i in 0..10 {
        let key = &stats.keys[&format!("{id}:reserve:{i}")];
        assert_eq!((key.calls, key.applied), (1, 1), "item {i}");
    }
    assert!(
        stats.max_in_progress <= 3,
        "{} at the remote at once",
        stats.max_in_progress
    );
    assert!(
        stats.max_in_progress >= 2,
        "the items overlap: {}",
        stats.max_in_progress
    );
    let results = &events.last().expect("terminal")["detail"]["results"];
    let reserve = results["reserve"].as_array().expect("a list");
    assert_eq!(reserve.len(), 10);
    for (i, r) in reserve.iter().enumerate() {
        assert_eq!(
            r["idempotency_key"],
            format!("{id}:reserve:{i}"),
            "in the items' order"
        );
        assert_eq!(
            (&r["index"], &r["item"]),
            (&serde_json::json!(i), &items[i])
        );
    }
    let ship = of_step(&events, "step_succeeded", "ship");
    let skus: Vec<_> = (0..10).map(|i| format!("k{i}")).collect();
    assert_eq!(
        ship[0]["detail"]["result"]["echo"],
        serde_json::json!({ "skus": skus })
    );
}

/// An order waiting both for a long wait and for the signal `approval`,
/// and a dashboard with a viewer and an operator.
async fn waiting_order_and_a_dashboard() -> (TestApp, uuid::Uuid, String) {
    let app = TestApp::builder()
        .extra_config(format!(
            r#"[workflows.held]
steps = [
  {{ name = "cool", wait = "10m", after = [] }},
  {{ name = "approve", signal = "approval", timeout = "60s", after = [] }},
]
{}"#,
            sas_tests::dashboard::token_auth()
        ))
        .spawn()
        .await;
    let id = app.submit("held", None).await;
    wait_step(&app, id, "approve", "running").await;
    wait_step(&app, id, "cool", "running").await;
    app.start("dashboard", "dashboard", &[]).await;
    let base = format!("http://127.0.0.1:{}", app.port("dashboard"));
    (app, id, base)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_dashboard_an_operator_sends_a_waiting_steps_signal_and_a_viewer_cannot() {
    use sas_tests::dashboard::{OPERATOR_TOKEN, VIEWER_TOKEN, answer};
    let (app, id, base) = waiting_order_and_a_dashboard().await;
    sas::tls::install_crypto_provider();
    let http = reqwest::Client::new();
    let (status, page) = answer(
        http.get(format!("{base}/api/orders/{id}"))
            .bearer_auth(VIEWER_TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{page}");
    let steps = page["steps"].as_array().expect("steps");
    assert_eq!(
        (&steps[0]["kind"], &steps[1]["kind"]),
        (&serde_json::json!("wait"), &serde_json::json!("signal"))
    );
    assert_eq!(steps[1]["signal"], "approval");
    assert!(
        steps[0]["complete_by"].is_string(),
        "the wait's end: {page}"
    );
    let url = |name: &str| format!("{base}/api/orders/{id}/signals/{name}");
    let body = serde_json::json!({ "data": { "by": "alice" } });
    let (status, _) = answer(
        http.post(url("approval"))
            .bearer_auth(VIEWER_TOKEN)
            .json(&body),
    )
    .await;
    assert_eq!(status, 403, "a viewer may not");
    let (status, refused) = answer(
        http.post(url("refund"))
            .bearer_auth(OPERATOR_TOKEN)
            .json(&body),
    )
    .await;
    assert_eq!(status, 409, "{refused}");
    assert!(
        refused["error"]
            .as_str()
            .unwrap_or_default()
            .contains("no step of the order waits"),
        "{refused}"
    );
    let (status, done) = answer(
        http.post(url("approval"))
            .bearer_auth(OPERATOR_TOKEN)
            .json(&body),
    )
    .await;
    assert_eq!(status, 200, "{done}");
    wait_step(&app, id, "approve", "completed").await;
    let result: serde_json::Value =
        sqlx::query_scalar("SELECT result FROM steps WHERE order_id = $1 AND name = 'approve'")
            .bind(id)
            .fetch_one(&app.db)
            .await
            .expect("result");
    assert_eq!(result, serde_json::json!({ "by": "alice" }));
    let actor: String = sqlx::query_scalar(
        "SELECT actor FROM order_events WHERE order_id = $1 AND event = 'step_succeeded'",
    )
    .bind(id)
    .fetch_one(&app.db)
    .await
    .expect("actor");
    assert_eq!(actor, "operator:alice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_chromium_the_order_page_shows_a_waits_time_left_and_sends_a_signal() {
    use fantoccini::Locator;
    use sas_tests::browser::Browser;
    let (app, id, base) = waiting_order_and_a_dashboard().await;
    let page = format!("{base}/orders/{id}");
    let browser = Browser::start()
        .await
        .expect("headless Chromium through chromedriver (Debian's chromium and chromium-driver)");
    browser.goto(&page).await.expect("open the order");
    browser
        .log_in(sas_tests::dashboard::OPERATOR_TOKEN)
        .await
        .expect("log in");
    browser.goto(&page).await.expect("open the order");
    app.eventually(
        "the wait shows its time left",
        Duration::from_secs(20),
        || async {
            let row = browser
                .text_of("#steps tr[data-step=cool]")
                .await
                .ok()
                .flatten()
                .unwrap_or_default();
            row.contains("ends in")
        },
    )
    .await;
    let send = browser
        .find(Locator::Css(
            "#steps tr[data-step=approve] button[data-action=signal]",
        ))
        .await
        .expect("the waiting step has a Send button");
    let data = browser
        .find(Locator::Css(
            "#steps tr[data-step=approve] textarea.signal-data",
        ))
        .await
        .expect("and a data box");
    data.send_keys(r#"{"by": "alice"}"#)
        .await
        .expect("type the data");
    send.click().await.expect("send");
    wait_step(&app, id, "approve", "completed").await;
    app.eventually(
        "the page shows the step completed",
        Duration::from_secs(20),
        || async {
            let row = browser
                .text_of("#steps tr[data-step=approve]")
                .await
                .ok()
                .flatten()
                .unwrap_or_default();
            row.contains("completed") && !row.contains("Send approval")
        },
    )
    .await;
    browser.quit().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_workflow_that_succeeds_completes_its_step_with_the_childs_results() {
    let app = TestApp::builder()
        .extra_config(sas_tests::CHILD_WORKFLOWS)
        .build()
        .await;
    app.start_all().await;
    let (id, events) = app.run_with("parent", serde_json::json!({ "n": 1 })).await;
    assert_eq!(
        sas_tests::states(&events).last(),
        Some(&"processed"),
        "{events:?}"
    );
    let child = sas_tests::child_of(id, "ship");
    assert_eq!(app.order(child).await, Some(("processed".into(), 0)));
    let ship = of_step(&events, "step_succeeded", "ship");
    let pack = &ship[0]["detail"]["result"]["pack"];
    assert_eq!(pack["idempotency_key"], format!("{child}:pack"), "{ship:?}");
    let stats = app.stats();
    assert!(stats.keys[&format!("{child}:pack")].standing);
    assert!(stats.keys[&format!("{id}:bill")].standing);
    // Retention prunes the child with what its parent's step asked of it.
    let remembered = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM children WHERE child_id = $1")
            .bind(child)
            .fetch_one(&app.db)
            .await
            .expect("children")
    };
    assert_eq!(remembered().await, 1);
    run(&app, &["orders", "prune", "--older-than", "1ms"])
        .await
        .expect_code(0);
    assert_eq!(app.order(child).await, None);
    assert_eq!(remembered().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_workflow_whose_parent_is_undone_is_compensated_with_it() {
    let app = TestApp::builder()
        .extra_config(sas_tests::CHILD_WORKFLOWS)
        .build()
        .await;
    app.knobs(
        "c",
        Knobs {
            permanent: true,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let (id, events) = app.run_with("parent", serde_json::json!({ "n": 1 })).await;
    assert_eq!(
        sas_tests::states(&events).last(),
        Some(&"compensated"),
        "{events:?}"
    );
    let child = sas_tests::child_of(id, "ship");
    assert_eq!(
        app.order(child).await.map(|(s, _)| s).as_deref(),
        Some("compensated")
    );
    let stats = app.stats();
    for key in [format!("{child}:pack"), format!("{id}:reserve")] {
        let k = &stats.keys[&key];
        assert!(!k.standing && k.undone, "{key} undone: {k:?}");
    }
    assert!(
        stats.standing.is_empty(),
        "no effect left anywhere: {:?}",
        stats.standing
    );
}

#[test]
fn an_unknown_child_workflow_or_a_cycle_of_children_is_refused_at_start_up() {
    sas_tests::assert_refused_at_start_up(
        "scheduler",
        r#"[workflows.p]
steps = [ { name = "s", workflow = "nowhere" } ]
"#,
        "runs workflow \"nowhere\", which is not configured",
    );
    sas_tests::assert_refused_at_start_up(
        "scheduler",
        r#"[workflows.p]
steps = [ { name = "s", workflow = "q" } ]
[workflows.q]
steps = [ { name = "t", agent = "a" }, { name = "u", workflow = "p" } ]
"#,
        "would never end: p → q → p",
    );
}

#[test]
fn a_definition_that_cannot_work_is_refused_at_start_up_in_one_line() {
    for (step, says) in [
        (
            r#"{ name = "s", agent = "a", when = "payload.total >" }"#,
            "does not compile",
        ),
        (
            r#"{ name = "s", agent = "a", input = { x = "((" } }"#,
            "does not compile",
        ),
        (r#"{ name = "s", until = "payload." }"#, "does not compile"),
        (
            r#"{ name = "s", agent = "a", for_each = "42" }"#,
            "does not give a list",
        ),
        (
            r#"{ name = "s", agent = "a", for_each = "results.r" }"#,
            "may read only payload",
        ),
        (
            r#"{ name = "s", signal = "ok", agent = "a" }"#,
            "a signal step has no agent",
        ),
        (
            r#"{ name = "s", wait = "1m", compensate = "a-undo" }"#,
            "only a step an agent runs",
        ),
        (r#"{ name = "s" }"#, "a step needs an agent"),
    ] {
        for binary in ["scheduler", "submission"] {
            sas_tests::assert_refused_at_start_up(
                binary,
                &format!("[workflows.w]\nsteps = [ {step} ]\n"),
                says,
            );
        }
    }
}

/// The relays sweep the outbox only every 30 s: what is committed without
/// being handed over to a relay waits that long.
const SLOW_SWEEPS: [(&str, &str); 2] = [
    ("SAS__OUTBOX__SWEEP_INTERVAL", "30s"),
    ("SAS__OUTBOX__SWEEP_AGE", "30s"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_signal_commits_is_published_at_once_not_at_a_relays_sweep() {
    let app = TestApp::builder()
        .extra_config(
            r#"[workflows.approved]
steps = [
  { name = "approve", signal = "approval", timeout = "60s" },
  { name = "charge", agent = "b" },
]

[workflows.last]
steps = [{ name = "approve", signal = "approval", timeout = "60s" }]
"#,
        )
        .build()
        .await;
    // A message committed without being handed over to a relay waits for
    // a sweep, unless a scheduler that claims its order publishes it (the
    // next step).
    let slow_sweeps = SLOW_SWEEPS;
    for name in ["submission", "scheduler", "agent", "supervisor"] {
        app.start_with_env(name, name, &[], &slow_sweeps).await;
    }
    let status = app.status_queue("approved").await;
    sas::tls::install_crypto_provider();
    let http = reqwest::Client::new();
    let port = app.port("submission");
    for over_http in [true, false] {
        for workflow in ["approved", "last"] {
            let id = app.submit(workflow, Some(&status)).await;
            wait_step(&app, id, "approve", "running").await;
            let started = std::time::Instant::now();
            if over_http {
                let answer = http
                    .post(format!(
                        "http://127.0.0.1:{port}/v1/orders/{id}/signals/approval"
                    ))
                    .body("{}")
                    .send()
                    .await
                    .expect("signal");
                assert_eq!(answer.status(), 202);
            } else {
                let signal =
                    serde_json::json!({ "order_id": id, "signal": "approval" }).to_string();
                app.publisher()
                    .publish(&sas::broker::Outgoing {
                        routing_key: app.queues.signals(),
                        body: signal.as_bytes(),
                        mandatory: true,
                        ..sas::broker::Outgoing::default()
                    })
                    .await
                    .expect("publish signal");
            }
            // The signal's own status event; the order's end, when the
            // signal ended it; the next step's call at the remote otherwise.
            let ends = workflow == "last";
            app.collect(&status, Duration::from_secs(40), |got| {
                got.iter().any(|e| {
                    e["order_id"] == id.to_string()
                        && if ends {
                            e["state"] == "processed"
                        } else {
                            e["state"] == "step_succeeded" && e["step"] == "approve"
                        }
                })
            })
            .await;
            let told = started.elapsed();
            let key = format!("{id}:charge");
            while !ends && !app.stats().keys.contains_key(&key) {
                assert!(
                    started.elapsed() < Duration::from_secs(40),
                    "no call of {key}"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let took = started.elapsed();
            assert!(
                told < Duration::from_millis(500) && took < Duration::from_millis(500),
                "{workflow}, signalled over {}: its event after {told:?}, done after {took:?}",
                if over_http { "HTTP" } else { "the queue" }
            );
        }
    }
    // A cancel over HTTP likewise: nothing is done yet, so it ends at once.
    let id = app.submit("approved", Some(&status)).await;
    wait_step(&app, id, "approve", "running").await;
    let started = std::time::Instant::now();
    let answer = http
        .post(format!("http://127.0.0.1:{port}/v1/orders/{id}/cancel"))
        .send()
        .await
        .expect("cancel");
    assert_eq!(answer.status(), 202);
    app.collect(&status, Duration::from_secs(40), |got| {
        got.iter()
            .any(|e| e["order_id"] == id.to_string() && sas_tests::is_terminal(e))
    })
    .await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(500),
        "a cancel's end after {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_action_from_sasctl_or_the_dashboard_is_published_at_once_not_at_a_relays_sweep()
 {
    let app = TestApp::builder()
        .extra_config(format!(
            r#"[workflows.last]
steps = [{{ name = "approve", signal = "approval", timeout = "60s" }}]
{}"#,
            sas_tests::dashboard::token_auth()
        ))
        .build()
        .await;
    // What a tool commits without publishing it itself waits for a sweep.
    let slow_sweeps = SLOW_SWEEPS;
    for name in [
        "submission",
        "scheduler",
        "agent",
        "supervisor",
        "dashboard",
    ] {
        app.start_with_env(name, name, &[], &slow_sweeps).await;
    }
    let status = app.status_queue("operated").await;
    sas::tls::install_crypto_provider();
    let http = reqwest::Client::new();
    let dashboard = format!("http://127.0.0.1:{}", app.port("dashboard"));
    // The signal ends the order; the cancel ends it too (nothing to undo).
    for (tool, action) in [
        ("sasctl", "signal"),
        ("sasctl", "cancel"),
        ("dashboard", "signal"),
        ("dashboard", "cancel"),
    ] {
        let id = app.submit("last", Some(&status)).await;
        wait_step(&app, id, "approve", "running").await;
        let order = id.to_string();
        if tool == "sasctl" {
            let args: &[&str] = match action {
                "signal" => &["orders", "signal", &order, "approval"],
                _ => &["orders", "cancel", &order],
            };
            run(&app, args).await.expect_code(0);
        } else {
            let path = match action {
                "signal" => format!("{dashboard}/api/orders/{id}/signals/approval"),
                _ => format!("{dashboard}/api/orders/{id}/cancel"),
            };
            let answer = http
                .post(path)
                .bearer_auth(sas_tests::dashboard::OPERATOR_TOKEN)
                .json(&serde_json::json!({}))
                .send()
                .await
                .expect("the dashboard answers");
            assert_eq!(answer.status(), 200, "{tool} {action}");
        }
        // Published before the tool answered: the end is on the status
        // queue at once, not after a sweep.
        let answered = std::time::Instant::now();
        app.collect(&status, Duration::from_secs(40), |got| {
            got.iter()
                .any(|e| e["order_id"] == order && sas_tests::is_terminal(e))
        })
        .await;
        let took = answered.elapsed();
        assert!(
            took < Duration::from_secs(2),
            "{tool} {action}: the order's end came {took:?} after the answer"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_action_without_the_broker_still_runs_and_its_end_waits_for_a_sweep() {
    let app = TestApp::builder()
        .extra_config(
            r#"[workflows.last]
steps = [{ name = "approve", signal = "approval", timeout = "60s" }]
"#,
        )
        .spawn()
        .await;
    let status = app.status_queue("operated").await;
    let id = app.submit("last", Some(&status)).await;
    wait_step(&app, id, "approve", "running").await;
    // sasctl alone cannot reach RabbitMQ: the cancel is committed all the
    // same, and a service's relay publishes its end at its next sweep.
    let mut cmd = sas_tests::cli::sasctl(&app);
    cmd.args(["orders", "cancel", &id.to_string()])
        .env("SAS__BROKER__URL", "amqp://guest:guest@127.0.0.1:1/%2f");
    let out = sas_tests::cli::output(cmd).await.expect_code(0);
    assert!(
        out.stderr.contains("wait for the services' relays"),
        "{out:#?}"
    );
    app.collect(&status, Duration::from_secs(40), |got| {
        got.iter()
            .any(|e| e["order_id"] == id.to_string() && sas_tests::is_terminal(e))
    })
    .await;
}

//! Hosts whose clocks disagree (contract §6a): deadlines are the state
//! store's. An agent whose wall clock runs minutes ahead of the database's
//! still calls the remote; one whose clock runs behind still goes silent
//! once the step's time is up. The agent runs with libfaketime preloaded
//! (Debian's package `faketime`), set as the `faketime` command would, but
//! in the agent's own process, so that stopping it stops the agent.

use std::time::Duration;

use remote_sim::Knobs;
use sas_tests::TestApp;

/// Where Debian's `faketime` package puts the library.
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// Starts everything, the agent with its clock moved by `offset` (e.g. `+5m`).
async fn with_agent_clock(offset: &str, app: &TestApp) {
    assert!(
        std::path::Path::new(LIBFAKETIME).exists(),
        "{LIBFAKETIME} not found: apt-get install faketime"
    );
    for name in ["submission", "scheduler", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    let env = [("LD_PRELOAD", LIBFAKETIME), ("FAKETIME", offset)];
    app.start_with_env("agent", "agent", &[], &env).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_clock_runs_five_minutes_ahead_still_calls_the_remote() {
    let app = TestApp::builder().step_timeout("5s").build().await;
    with_agent_clock("+5m", &app).await;
    let (id, events) = app.run_one("three").await;
    let states = sas_tests::states(&events);
    assert_eq!(states.last(), Some(&"processed"), "{states:?}");
    assert!(!states.contains(&"retry_scheduled"), "{states:?}");
    assert_eq!(app.stats().keys[&format!("{id}:a")].applied, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_clock_runs_five_minutes_behind_goes_silent_when_the_time_is_up() {
    let app = TestApp::builder()
        .step_timeout("2s")
        .max_failures(3)
        .retry_schedule(r#"["100ms"]"#)
        .supervisor_interval("200ms")
        .build()
        .await;
    // The remote is down: the agent retries until the step's time is up,
    // then stays silent, and the supervisor re-attempts.
    app.knobs(
        "a",
        Knobs {
            status: Some(503),
            ..Knobs::default()
        },
    );
    with_agent_clock("-5m", &app).await;
    let status = app.status_queue("clock-behind").await;
    let id = app.submit("one", Some(&status)).await;
    app.eventually("three dispatches", Duration::from_secs(20), || async {
        app.stats()
            .keys
            .get(&format!("{id}:a"))
            .is_some_and(|k| k.tokens.contains(&3))
    })
    .await;
    // Once the next dispatch calls, the one before never calls again: each
    // dispatch went silent at its complete-by, not five minutes later.
    let tokens = app.stats().keys[&format!("{id}:a")].tokens.clone();
    assert!(
        tokens.is_sorted(),
        "calls of dispatches interleaved: {tokens:?}"
    );
    app.knobs("a", Knobs::default());
    let stories = app
        .assert_invariants(&status, &[id], &[], Duration::from_secs(30))
        .await;
    let states = sas_tests::states(&stories[&id]);
    assert!(
        matches!(states.last(), Some(&("processed" | "failed"))),
        "{states:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_redelivered_to_an_agent_whose_clock_runs_ahead_is_judged_by_the_stores_clock() {
    // Contract §6a: a request that comes again (its first agent died with
    // it) is judged by the state store's clock, not by the agent's, which
    // runs five minutes ahead here and would find it long expired.
    let app = TestApp::builder()
        .step_timeout("30s")
        .retry_schedule(r#"["100ms"]"#)
        .build()
        .await;
    assert!(
        std::path::Path::new(LIBFAKETIME).exists(),
        "{LIBFAKETIME} not found: apt-get install faketime"
    );
    for name in ["submission", "scheduler", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    let ahead = [("LD_PRELOAD", LIBFAKETIME), ("FAKETIME", "+5m")];
    // The first agent takes the request and freezes before its call.
    let mut frozen = ahead.to_vec();
    frozen.extend([
        ("SAS_PAUSE_AT", "agent.before_call"),
        ("SAS__AGENT__CONCURRENCY", "1"),
    ]);
    app.start_with_env("first", "agent", &["--agent", "a"], &frozen)
        .await;
    let status = app.status_queue("clock-redelivered").await;
    let id = app.submit("one", Some(&status)).await;
    app.eventually("the first agent froze", Duration::from_secs(15), || async {
        app.is_stopped("first")
    })
    .await;
    // It dies with the request; RabbitMQ delivers it again to the next.
    app.kill("first");
    app.start_with_env("agent", "agent", &["--agent", "a"], &ahead)
        .await;
    let stories = app
        .assert_invariants(&status, &[id], &[], Duration::from_secs(25))
        .await;
    let states = sas_tests::states(&stories[&id]);
    assert_eq!(states.last(), Some(&"processed"), "{states:?}");
    assert!(
        !states.contains(&"retry_scheduled"),
        "the redelivered request was dropped as expired: {states:?}"
    );
    // The first dispatch's request itself was called, once.
    assert_eq!(app.stats().keys[&format!("{id}:a")].tokens, [1]);
}

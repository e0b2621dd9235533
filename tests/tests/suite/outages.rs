//! Riding out outages and saying why (contract §8): the deadline ladder
//! and the fencing token every remote call carries.

use std::time::Duration;

use remote_sim::Knobs;
use sas_tests::TestApp;
use sas_tests::cli::{run, wait_state};

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
    // The second dispatch answers at once: no rung of its ladder is reached.
    assert_eq!(
        story(&events),
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_order_says_why_an_agent_busy_then_gone_then_its_scheduler_gone() {
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
    app.start_all().await;
    let id = app.submit("one", None).await;
    let stuck = async || -> serde_json::Value {
        let out = run(&app, &["orders", "show", &id.to_string(), "--json"])
            .await
            .expect_code(0);
        let shown: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
        shown["stuck"].clone()
    };
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
    assert_eq!(busy["detail"]["agent"], "a");
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
            let out = run(&app, &["orders", "show", &last, "--json"])
                .await
                .expect_code(0);
            let shown: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
            shown["stuck"]["reason"] == "backlog" && shown["stuck"]["detail"]["ahead"] == 2
        },
    )
    .await;
}

//! `/metrics` after a known run: the counters equal what happened.

use std::time::Duration;

use remote_sim::Knobs;
use sas_tests::{TestApp, sample};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_counters_equal_what_happened() {
    let app = TestApp::new().await;
    app.knobs(
        "c",
        Knobs {
            permanent: true,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    // 10 orders of `one` succeed; 2 of `three` fail at c and are compensated;
    // one is submitted twice; two messages are rejected.
    let mut ids = app.submit_many("one", 10, None).await;
    ids.extend(app.submit_many("three", 2, None).await);
    let body =
        serde_json::json!({ "order_id": ids[0], "workflow": "one", "payload": {} }).to_string();
    app.publish_raw(body.as_bytes(), None, None).await;
    app.publish_raw(b"not json", None, None).await;
    app.publish_raw(br#"{"workflow":"nope","payload":{}}"#, None, None)
        .await;
    app.eventually("every order ended", Duration::from_secs(30), || async {
        app.count_in("processed").await == 10 && app.count_in("compensated").await == 2
    })
    .await;
    let submission = app.metrics("submission").await;
    assert_eq!(sample(&submission, "sas_orders_received_total"), 12.0);
    assert_eq!(sample(&submission, "sas_orders_duplicate_total"), 1.0);
    assert_eq!(
        sample(
            &submission,
            r#"sas_orders_rejected_total{reason="malformed_json"}"#
        ),
        1.0
    );
    assert_eq!(
        sample(
            &submission,
            r#"sas_orders_rejected_total{reason="unknown_workflow"}"#
        ),
        1.0
    );

    // Claimed by the submission that started them, or by a scheduler.
    let scheduler = app.metrics("scheduler").await;
    assert_eq!(
        sample(&submission, "sas_orders_claimed_total")
            + sample(&scheduler, "sas_orders_claimed_total"),
        12.0
    );
    assert_eq!(
        sample(
            &scheduler,
            r#"sas_orders_finished_total{state="processed",workflow="one"}"#
        ),
        10.0
    );
    assert_eq!(
        sample(
            &scheduler,
            r#"sas_orders_finished_total{state="compensated",workflow="three"}"#
        ),
        2.0
    );
    assert_eq!(
        sample(
            &scheduler,
            r#"sas_order_latency_seconds_count{state="processed",workflow="one"}"#
        ),
        10.0
    );
    // one: 1 reply each; three: a, b, c (failed), b undo, a undo.
    assert_eq!(
        sample(&scheduler, r#"sas_replies_total{outcome="applied"}"#),
        10.0 + 2.0 * 5.0
    );
    assert_eq!(
        sample(&scheduler, r#"sas_replies_total{outcome="stale"}"#),
        0.0
    );

    // The agent counts a request once it has answered and acknowledged it,
    // which may be after the scheduler has ended the order: wait for the
    // last one (a-undo's second answer).
    app.eventually(
        "the agent counted every request",
        Duration::from_secs(10),
        || async {
            let agent = app.metrics("agent").await;
            sample(
                &agent,
                r#"sas_agent_requests_total{agent="a-undo",outcome="succeeded"}"#,
            ) == 2.0
        },
    )
    .await;
    let agent = app.metrics("agent").await;
    assert_eq!(
        sample(
            &agent,
            r#"sas_agent_calls_total{agent="a",outcome="succeeded"}"#
        ),
        12.0
    );
    assert_eq!(
        sample(
            &agent,
            r#"sas_agent_calls_total{agent="c",outcome="permanent"}"#
        ),
        2.0
    );
    assert_eq!(
        sample(
            &agent,
            r#"sas_agent_requests_total{agent="c",outcome="failed"}"#
        ),
        2.0
    );
    assert_eq!(
        sample(
            &agent,
            r#"sas_agent_requests_total{agent="a-undo",outcome="succeeded"}"#
        ),
        2.0
    );
    assert_eq!(
        sample(
            &agent,
            r#"sas_agent_step_duration_seconds_count{agent="a",outcome="succeeded"}"#
        ),
        12.0
    );
    assert_eq!(sample(&agent, r#"sas_agent_breaker_state{agent="a"}"#), 0.0);

    // Its first sweep, and its leadership after it, may come after the
    // orders ended.
    app.eventually(
        "the supervisor swept and leads",
        Duration::from_secs(10),
        || async {
            let supervisor = app.metrics("supervisor").await;
            sample(&supervisor, "sas_supervisor_sweeps_total") >= 1.0
                && sample(&supervisor, "sas_supervisor_leader") == 1.0
        },
    )
    .await;
    let supervisor = app.metrics("supervisor").await;
    assert_eq!(
        sample(
            &supervisor,
            r#"sas_supervisor_recoveries_total{action="requeued"}"#
        ),
        0.0
    );
}

/// One order at a time, the relay is never busy: every step request goes out
/// handed over by the claim that wrote it (or, when the claim found the
/// submission still publishing `received`, right after it), none through a
/// pass of the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_low_load_the_messages_are_handed_over_not_relayed() {
    let app = TestApp::spawn().await;
    for n in 1..=3 {
        app.submit_many("one", 1, None).await;
        app.eventually("the order ended", Duration::from_secs(30), || async {
            app.count_in("processed").await == n
        })
        .await;
    }
    // The submission sends the requests of the orders it starts, the
    // schedulers those of the orders they claim: together, each once.
    let pages = [
        app.metrics("submission").await,
        app.metrics("scheduler").await,
    ];
    let request = |path: &str| -> f64 {
        pages
            .iter()
            .map(|page| {
                sample(
                    page,
                    &format!(r#"sas_outbox_published_total{{kind="request",path="{path}"}}"#),
                )
            })
            .sum()
    };
    assert_eq!(request("handoff") + request("follow"), 3.0);
    assert_eq!(request("relay"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_openmetrics_with_build_info_process_metrics_and_buckets_of_hours() {
    let app = TestApp::spawn().await;
    let url = format!("http://127.0.0.1:{}/metrics", app.port("scheduler"));
    sas::tls::install_crypto_provider();
    let response = reqwest::get(&url).await.expect("GET /metrics");
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(
        content_type.starts_with("application/openmetrics-text; version=1.0.0"),
        "{content_type}"
    );
    let text = response.text().await.expect("body");
    assert!(
        text.trim_end().ends_with("# EOF"),
        "one OpenMetrics exposition"
    );
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        sample(
            &text,
            &format!(r#"sas_build_info{{version="{version}",service="scheduler"}}"#)
        ),
        1.0,
        "{text}"
    );
    assert!(
        sample(&text, "process_resident_memory_bytes") > 1e6,
        "{text}"
    );
    assert!(sample(&text, "process_open_fds") > 3.0, "{text}");
    assert!(
        sample(&text, "process_start_time_seconds") > 1.7e9,
        "{text}"
    );
    assert!(
        text.contains("# TYPE process_cpu_seconds counter"),
        "{text}"
    );
    // Re-attempts wait up to an hour: the latency buckets reach past it.
    let id = app.submit("one", None).await;
    sas_tests::cli::wait_state(&app, id, "processed", Duration::from_secs(30)).await;
    let text = app.metrics("scheduler").await;
    let top = text
        .lines()
        .filter(|l| l.starts_with("sas_order_latency_seconds_bucket{"))
        .filter_map(|l| {
            l.split("le=\"")
                .nth(1)?
                .split('"')
                .next()?
                .parse::<f64>()
                .ok()
        })
        .filter(|le| le.is_finite())
        .fold(0.0, f64::max);
    assert!(top > 3600.0, "the largest bucket is {top} s");
}

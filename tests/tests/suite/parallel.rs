//! Steps in parallel (contract §4b): a diamond `reserve → charge ∥ notify
//! → ship`, its undo after a failure, and a re-attempt in the middle of it.

use std::time::Duration;

use remote_sim::Knobs;
use sas_tests::TestApp;
use uuid::Uuid;

/// The diamond `shop`: `reserve` (agent a), then `charge` (b) and `notify` (c)
/// together, then `ship` (d). Every step but `ship` has an undo.
const DIAMOND: &str = r#"[workflows.shop]
steps = [
  { name = "reserve", agent = "a", timeout = "5s", compensate = "a-undo" },
  { name = "charge", agent = "b", timeout = "5s", compensate = "b-undo", after = ["reserve"] },
  { name = "notify", agent = "c", timeout = "5s", compensate = "c-undo", after = ["reserve"] },
  { name = "ship", agent = "d", timeout = "5s", after = ["charge", "notify"] },
]
"#;

async fn diamond_app(max_failures: u32) -> TestApp {
    TestApp::builder()
        .max_failures(max_failures)
        .retry_schedule(r#"["100ms"]"#)
        .extra_config(DIAMOND)
        .build()
        .await
}

fn slow(ms: u64) -> Knobs {
    Knobs {
        latency_ms: ms,
        ..Knobs::default()
    }
}

/// The steps of `id` in the order their `step_succeeded` events were logged.
async fn completion_order(app: &TestApp, id: Uuid) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT step FROM order_events WHERE order_id = $1 AND event = 'step_succeeded' \
         ORDER BY seq",
    )
    .bind(id)
    .fetch_all(&app.db)
    .await
    .expect("events")
}

/// The steps of `id` that were undone, in the order their undos answered.
async fn undo_order(app: &TestApp, id: Uuid) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT name FROM steps WHERE order_id = $1 AND state = 'compensated' \
         ORDER BY finished_at, idx",
    )
    .bind(id)
    .fetch_all(&app.db)
    .await
    .expect("steps")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_diamonds_two_branches_run_at_once_and_the_join_gets_every_result() {
    let app = diamond_app(3).await;
    app.knobs("b", slow(1000));
    app.knobs("c", slow(1000));
    app.start_all().await;
    let (id, events) = app.run_one("shop").await;
    let last = events.last().expect("events");
    assert_eq!(last["state"], "processed", "{events:?}");
    let results = last["detail"]["results"].as_object().expect("results");
    assert_eq!(results.len(), 4, "{results:?}");
    // Two calls of a second each: together well under two seconds.
    let span: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM max(finished_at) - min(started_at))::float8 \
         FROM steps WHERE order_id = $1",
    )
    .bind(id)
    .fetch_one(&app.db)
    .await
    .expect("step times");
    assert!(span < 1.8, "the steps took {span:.2} s");
    let stats = app.stats();
    assert!(
        stats.max_in_progress >= 2,
        "charge and notify overlapped at the remote: {stats:?}"
    );
    for step in ["reserve", "charge", "notify", "ship"] {
        assert_eq!(stats.keys[&format!("{id}:{step}")].applied, 1, "{step}");
    }
    let succeeded = completion_order(&app, id).await;
    assert_eq!(succeeded.first().map(String::as_str), Some("reserve"));
    assert_eq!(succeeded.last().map(String::as_str), Some("ship"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_join_undoes_every_completed_branch_once_newest_completion_first() {
    let app = diamond_app(3).await;
    // notify completes well after charge.
    app.knobs("c", slow(600));
    app.knobs(
        "d",
        Knobs {
            permanent: true,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let (id, events) = app.run_one("shop").await;
    assert_eq!(
        events.last().map(|e| e["state"].clone()),
        Some("compensated".into()),
        "{events:?}"
    );
    let done = completion_order(&app, id).await;
    assert_eq!(done, ["reserve", "charge", "notify"]);
    assert_eq!(undo_order(&app, id).await, ["notify", "charge", "reserve"]);
    let stats = app.stats();
    for step in ["reserve", "charge", "notify"] {
        let undo = &stats.keys[&format!("{id}:{step}:compensate")];
        assert_eq!(undo.applied, 1, "{step} undone once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_branch_still_running_when_its_sibling_fails_is_let_finish_then_undone() {
    let app = diamond_app(3).await;
    app.knobs("c", slow(1500));
    app.knobs(
        "b",
        Knobs {
            permanent: true,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let (id, events) = app.run_one("shop").await;
    let states = sas_tests::states(&events);
    assert_eq!(states.last(), Some(&"compensated"), "{states:?}");
    // notify answered after the order began to give up, and counted.
    let compensating = states.iter().position(|s| *s == "compensating");
    let notify_done = events
        .iter()
        .position(|e| e["state"] == "step_succeeded" && e["step"] == "notify");
    assert!(
        compensating < notify_done,
        "notify finished after charge failed: {states:?}"
    );
    assert_eq!(undo_order(&app, id).await, ["notify", "reserve"]);
    let stats = app.stats();
    assert_eq!(stats.keys[&format!("{id}:notify")].applied, 1);
    assert_eq!(stats.keys[&format!("{id}:notify:compensate")].applied, 1);
    assert!(!stats.keys.contains_key(&format!("{id}:charge:compensate")));
    assert!(!stats.keys.contains_key(&format!("{id}:ship")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reattempt_after_an_agent_crash_mid_branch_redoes_no_completed_step() {
    let app = TestApp::builder()
        .max_failures(3)
        .retry_schedule(r#"["100ms"]"#)
        .supervisor_interval("200ms")
        .extra_config(DIAMOND.replace(
            r#"{ name = "charge", agent = "b", timeout = "5s""#,
            r#"{ name = "charge", agent = "b", timeout = "2s""#,
        ))
        .build()
        .await;
    // charge hangs on its first call; notify answers at once.
    app.knobs(
        "b",
        Knobs {
            hang_first: 1,
            hang_ms: 30_000,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let status = app.status_queue("crash-mid-branch").await;
    let id = app.submit("shop", Some(&status)).await;
    app.eventually(
        "notify done while charge hangs",
        Duration::from_secs(15),
        || async {
            let states: Vec<(String, String)> =
                sqlx::query_as("SELECT name, state FROM steps WHERE order_id = $1")
                    .bind(id)
                    .fetch_all(&app.db)
                    .await
                    .unwrap_or_default();
            states.contains(&("notify".into(), "completed".into()))
                && states.contains(&("charge".into(), "running".into()))
        },
    )
    .await;
    // The agent dies mid-call and stays down past charge's complete-by:
    // the supervisor re-attempts the order; a new agent takes it over.
    app.crash_agent_until_reattempt(id, Duration::from_secs(15))
        .await;
    let stories = app
        .assert_invariants(&status, &[id], &[], Duration::from_secs(30))
        .await;
    let states = sas_tests::states(&stories[&id]);
    assert!(states.contains(&"retry_scheduled"), "{states:?}");
    assert_eq!(states.last(), Some(&"processed"), "{states:?}");
    let stats = app.stats();
    for step in ["reserve", "notify"] {
        let key = &stats.keys[&format!("{id}:{step}")];
        assert_eq!(
            (key.calls, key.applied),
            (1, 1),
            "{step} was not sent again"
        );
    }
    assert_eq!(stats.keys[&format!("{id}:charge")].applied, 1);
    let dispatches: Vec<(String, i32)> =
        sqlx::query_as("SELECT name, dispatches FROM steps WHERE order_id = $1 ORDER BY idx")
            .bind(id)
            .fetch_all(&app.db)
            .await
            .expect("steps");
    assert_eq!(
        dispatches,
        [
            ("reserve".into(), 1),
            ("charge".into(), 2),
            ("notify".into(), 1),
            ("ship".into(), 1)
        ]
    );
}

#[test]
fn a_workflow_with_a_cycle_or_an_unknown_step_is_refused_at_start_up_in_one_line() {
    for (steps, says) in [
        (
            r#"{ name = "x", agent = "a", after = ["y"] }, { name = "y", agent = "a", after = ["x"] }"#,
            "has a cycle",
        ),
        (
            r#"{ name = "x", agent = "a" }, { name = "y", agent = "a", after = ["z"] }"#,
            "is after \"z\", which the workflow does not have",
        ),
    ] {
        sas_tests::assert_refused_at_start_up(
            "scheduler",
            &format!(
                "[agents.a]\nurl = \"http://127.0.0.1:1/a\"\n\n[workflows.w]\nsteps = [ {steps} ]\n"
            ),
            says,
        );
    }
}

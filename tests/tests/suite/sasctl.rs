//! `sasctl`, the operator's command line, end to end: the real binary against
//! the real Postgres and RabbitMQ of a test deployment, with the services
//! running where a command needs orders to move.

use std::process::Command;
use std::time::{Duration, Instant};

use remote_sim::Knobs;
use sas_tests::cli::{bare_sasctl, output, run, sasctl, wait_state};
use sas_tests::{TestApp, bin};
use serde_json::Value;
use uuid::Uuid;

/// The ids of a JSON array of orders, in its order.
fn ids(list: &Value) -> Vec<String> {
    list.as_array()
        .unwrap_or_else(|| panic!("not an array: {list}"))
        .iter()
        .map(|o| o["order_id"].as_str().unwrap_or("?").to_owned())
        .collect()
}

/// An order's events from `orders show --json`.
async fn events(app: &TestApp, id: Uuid) -> Vec<Value> {
    let shown = run(app, &["orders", "show", &id.to_string(), "--json"])
        .await
        .expect_code(0)
        .json();
    shown["events"].as_array().cloned().unwrap_or_default()
}

fn permanent() -> Knobs {
    Knobs {
        permanent: true,
        ..Knobs::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_retry_of_an_error_order_resumes_at_its_failed_step_and_ends_processed() {
    let app = TestApp::spawn().await;
    app.knobs("a", permanent());
    let id = app.submit("one", None).await;
    // A permanent failure with nothing to undo ends the order in error.
    wait_state(&app, id, "error", Duration::from_secs(30)).await;
    app.knobs("a", Knobs::default());

    let mut cmd = sasctl(&app);
    cmd.args(["orders", "retry", &id.to_string()])
        .env("USER", "alice");
    let out = output(cmd).await.expect_code(0);
    assert_eq!(out.stdout, format!("order {id} retried: pending\n"));

    wait_state(&app, id, "processed", Duration::from_secs(30)).await;
    assert_eq!(app.order(id).await, Some(("processed".into(), 0)));
    assert_eq!(app.stats().keys[&format!("{id}:a")].applied, 1);

    // The event log says who retried, when, from which state and why.
    let events = events(&app, id).await;
    let retry = events
        .iter()
        .find(|e| e["actor"] == "operator:alice")
        .unwrap_or_else(|| panic!("no event by the operator: {events:#?}"));
    assert_eq!(retry["from_state"], "error");
    assert_eq!(retry["to_state"], "pending");
    assert!(retry["reason"].as_str().is_some_and(|r| !r.is_empty()));
    assert!(retry["at"].is_string());
    assert_eq!(events.last().unwrap()["to_state"], "processed");
    let text = run(&app, &["orders", "show", &id.to_string()])
        .await
        .expect_code(0)
        .stdout;
    assert!(text.contains("operator:alice"), "{text}");
    assert!(text.contains("error → pending"), "{text}");

    // A processed order is not retried again.
    run(&app, &["orders", "retry", &id.to_string()])
        .await
        .expect_code(4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_whose_undo_failed_half_way_is_not_retried_forward_and_cancel_finishes_the_undo() {
    let app = TestApp::spawn().await;
    // c fails permanently: b is undone, then a's undo fails permanently, so
    // the order ends in error with b undone and a still done.
    app.knobs("c", permanent());
    app.knobs("a-undo", permanent());
    let id = app.submit("three", None).await;
    wait_state(&app, id, "error", Duration::from_secs(30)).await;
    app.knobs("c", Knobs::default());
    app.knobs("a-undo", Knobs::default());

    // Going forward would re-send b with its spent idempotency key: refused.
    let out = run(&app, &["orders", "retry", &id.to_string()])
        .await
        .expect_code(4);
    assert!(
        out.stderr.contains("cancel it to finish the undo"),
        "{}",
        out.stderr
    );
    // Cancel resumes the undo where it stopped.
    run(&app, &["orders", "cancel", &id.to_string()])
        .await
        .expect_code(0);
    wait_state(&app, id, "compensated", Duration::from_secs(30)).await;
    let stats = app.stats();
    assert_eq!(
        stats.keys[&format!("{id}:b")].calls,
        1,
        "b was not sent again"
    );
    assert_eq!(stats.keys[&format!("{id}:b:compensate")].applied, 1);
    assert_eq!(stats.keys[&format!("{id}:a:compensate")].applied, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_cancel_compensates_a_processing_order() {
    let app = TestApp::builder().step_timeout("3s").spawn().await;
    app.knobs(
        "b",
        Knobs {
            hang: true,
            ..Knobs::default()
        },
    );
    let id = app.submit("three", None).await;
    app.eventually(
        "the order is processing with step b running",
        Duration::from_secs(30),
        || async {
            let step: Option<String> = sqlx::query_scalar(
                "SELECT s.name FROM steps s JOIN orders o USING (order_id) \
                 WHERE o.order_id = $1 AND o.process_state = 'processing' AND s.state = 'running'",
            )
            .bind(id)
            .fetch_optional(&app.db)
            .await
            .expect("read steps");
            step.as_deref() == Some("b")
        },
    )
    .await;

    let out = run(&app, &["orders", "cancel", &id.to_string()])
        .await
        .expect_code(0);
    assert_eq!(out.stdout, format!("order {id} cancelled: compensating\n"));
    // b is let finish or time out (contract §4c): it times out, in doubt,
    // and is undone with the completed a, newest first.
    wait_state(&app, id, "compensated", Duration::from_secs(30)).await;

    let stats = app.stats();
    assert_eq!(stats.keys[&format!("{id}:a:compensate")].applied, 1);
    let b_undo = &stats.keys[&format!("{id}:b:compensate")];
    assert_eq!(b_undo.outcomes, ["unknown"], "undone in doubt");
    assert!(
        stats
            .keys
            .get(&format!("{id}:b"))
            .is_none_or(|k| k.applied == 0)
    );
    assert_eq!(stats.standing_for(&id.to_string()), 0);

    // Ended, it can be neither cancelled nor retried.
    let out = run(&app, &["orders", "cancel", &id.to_string()])
        .await
        .expect_code(4);
    assert!(out.stderr.contains("it is compensated"), "{out:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_ids_and_actions_not_allowed_give_clear_errors_and_exit_codes() {
    let app = TestApp::spawn().await;
    let unknown = Uuid::new_v4().to_string();
    for action in ["retry", "cancel", "show"] {
        let out = run(&app, &["orders", action, &unknown])
            .await
            .expect_code(3);
        assert_eq!(
            out.stderr,
            format!("sasctl: no order {unknown}\n"),
            "{action}"
        );
        assert_eq!(out.stdout, "", "{action}");
    }

    let id = app.submit("one", None).await;
    wait_state(&app, id, "processed", Duration::from_secs(30)).await;
    let out = run(&app, &["orders", "retry", &id.to_string()])
        .await
        .expect_code(4);
    assert_eq!(
        out.stderr,
        format!(
            "sasctl: cannot retry order {id}: it is processed (only error orders can be retried)\n"
        )
    );
    let out = run(&app, &["orders", "cancel", &id.to_string(), "--json"])
        .await
        .expect_code(4);
    assert_eq!(
        out.stderr,
        format!(
            "sasctl: cannot cancel order {id}: it is processed \
             (only pending, processing or error orders can be cancelled)\n"
        )
    );
    assert_eq!(out.stdout, "");
    // Nothing changed.
    assert_eq!(app.order(id).await, Some(("processed".into(), 0)));

    for action in ["retry", "cancel", "show"] {
        let out = run(&app, &["orders", action, "not-a-uuid"])
            .await
            .expect_code(2);
        assert!(out.stderr.contains("not-a-uuid"), "{out:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_list_filters_by_state_and_workflow() {
    let app = TestApp::spawn().await;
    let one = app.submit("one", None).await;
    let three = app.submit("three", None).await;
    wait_state(&app, one, "processed", Duration::from_secs(30)).await;
    wait_state(&app, three, "processed", Duration::from_secs(30)).await;
    app.knobs("a", permanent());
    let failed = app.submit("one", None).await;
    wait_state(&app, failed, "error", Duration::from_secs(30)).await;
    let (one, three, failed) = (one.to_string(), three.to_string(), failed.to_string());

    let all = run(&app, &["orders", "list", "--json"])
        .await
        .expect_code(0)
        .json();
    let mut listed = ids(&all);
    assert_eq!(listed.len(), 3, "{all}");
    assert_eq!(listed[0], failed, "newest first: {all}");
    listed.sort();
    let mut expected = vec![one.clone(), three.clone(), failed.clone()];
    expected.sort();
    assert_eq!(listed, expected);
    let row = &all[0];
    assert_eq!(row["state"], "error");
    assert_eq!(row["workflow"], "one");
    assert!(row["failure_count"].is_i64(), "{row}");
    assert!(row["locked_by"].is_null(), "{row}");
    assert!(row["updated_at"].is_string(), "{row}");

    let list = |args: &'static [&'static str]| {
        let app = &app;
        async move {
            let mut all = vec!["orders", "list", "--json"];
            all.extend_from_slice(args);
            let out = run(app, &all).await.expect_code(0);
            let mut got = ids(&out.json());
            got.sort();
            got
        }
    };
    let mut processed = vec![one.clone(), three.clone()];
    processed.sort();
    assert_eq!(list(&["--state", "processed"]).await, processed);
    assert_eq!(list(&["--state", "error"]).await, [failed.as_str()]);
    assert_eq!(list(&["--workflow", "three"]).await, [three.as_str()]);
    assert_eq!(
        list(&["--state", "processed", "--workflow", "one"]).await,
        [one.as_str()]
    );
    assert!(list(&["--state", "compensating"]).await.is_empty());
    assert!(list(&["--workflow", "nope"]).await.is_empty());
    assert_eq!(list(&["--limit", "1"]).await, [failed.as_str()]);

    // The table: a header and one row per order.
    let text = run(&app, &["orders", "list", "--state", "processed"])
        .await
        .expect_code(0)
        .stdout;
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines[0].starts_with("ORDER_ID"), "{text}");
    for col in [
        "STATE",
        "WORKFLOW",
        "FAILURE_COUNT",
        "LOCKED_BY",
        "COMPLETE_BY",
        "UPDATED_AT",
    ] {
        assert!(lines[0].contains(col), "{text}");
    }
    for id in [&one, &three] {
        assert!(
            lines[1..]
                .iter()
                .any(|l| l.starts_with(id.as_str()) && l.contains("processed")),
            "{text}"
        );
    }
    let empty = run(&app, &["orders", "list", "--state", "pending"])
        .await
        .expect_code(0);
    assert_eq!(empty.stdout, "(none)\n");

    let out = run(&app, &["orders", "list", "--state", "broken"])
        .await
        .expect_code(2);
    assert!(
        out.stderr
            .contains("pending, processing, processed, error, compensating, compensated"),
        "{out:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_prints_the_alert_of_a_failed_order() {
    let app = TestApp::spawn().await;
    app.knobs("a", permanent());
    let id = app.submit("one", None).await;
    wait_state(&app, id, "error", Duration::from_secs(30)).await;
    app.eventually(
        "the alert is published",
        Duration::from_secs(30),
        || async {
            let left: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM outbox WHERE order_id = $1 AND kind = 'alert'",
            )
            .bind(id)
            .fetch_one(&app.db)
            .await
            .expect("read outbox");
            left == 0
        },
    )
    .await;

    let out = run(&app, &["alerts"]).await.expect_code(0);
    let alerts: Vec<Value> = out
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(alerts.len(), 1, "{out:#?}");
    assert_eq!(alerts[0]["order_id"], id.to_string());
    assert_eq!(alerts[0]["workflow"], "one");
    assert!(alerts[0]["reason"].as_str().is_some_and(|r| !r.is_empty()));
    assert!(
        out.stderr
            .contains(&format!("1 alert from {}", app.queues.alerts())),
        "{out:#?}"
    );

    // Acknowledged: the queue is empty now, and sasctl stops by itself.
    let out = run(&app, &["alerts"]).await.expect_code(0);
    assert_eq!(out.stdout, "", "{out:#?}");

    // --follow waits for the next alert.
    let mut cmd = sasctl(&app);
    cmd.args(["alerts", "--follow", "--count", "1", "--timeout", "60s"]);
    let follower = tokio::spawn(output(cmd));
    let second = app.submit("one", None).await;
    let out = tokio::time::timeout(Duration::from_secs(90), follower)
        .await
        .expect("sasctl alerts --follow stopped after one alert")
        .expect("join")
        .expect_code(0);
    let alert: Value = serde_json::from_str(out.stdout.trim()).expect("one JSON line");
    assert_eq!(alert["order_id"], second.to_string(), "{out:#?}");
    assert!(out.stderr.contains("count reached"), "{out:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_deletes_only_old_ended_orders() {
    let app = TestApp::spawn().await;
    let ids = app.submit_many("one", 3, None).await;
    for id in &ids {
        wait_state(&app, *id, "processed", Duration::from_secs(30)).await;
    }
    // An order that has not ended: it waits for its not_before.
    let waiting = Uuid::new_v4();
    let body = serde_json::json!({
        "order_id": waiting, "workflow": "one", "payload": {},
        "not_before": "2100-01-01T00:00:00Z",
    });
    app.publish_raw(body.to_string().as_bytes(), None, None)
        .await;
    wait_state(&app, waiting, "pending", Duration::from_secs(30)).await;

    let (old, recent) = (&ids[..2], ids[2]);
    // Made and last changed two days ago.
    let age_by_two_days = |id: Uuid| {
        sqlx::query(
            "UPDATE orders SET created_at = now() - interval '2 days', \
               updated_at = now() - interval '2 days' WHERE order_id = $1",
        )
        .bind(id)
        .execute(&app.db)
    };
    for id in old.iter().copied().chain([waiting]) {
        age_by_two_days(id).await.expect("age order");
    }

    let out = run(&app, &["orders", "prune", "--older-than", "1day", "--json"])
        .await
        .expect_code(0);
    let json = out.json();
    assert_eq!(
        (
            &json["deleted"],
            &json["batches"],
            &json["steps"],
            &json["events"]
        ),
        (&2.into(), &1.into(), &2.into(), &8.into()),
        "{out:#?}"
    );
    assert_eq!(json["archived"], serde_json::json!([]));
    // An order's rows in `table` (steps and events go with their order).
    let rows_of = |table: &'static str, id: Uuid| {
        sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {table} WHERE order_id = $1"
        )))
        .bind(id)
        .fetch_one(&app.db)
    };
    for id in old {
        assert_eq!(app.order(*id).await, None);
        for table in ["steps", "order_events"] {
            let left = rows_of(table, *id).await.expect("count rows");
            assert_eq!(left, 0, "{table} of {id}");
        }
    }
    assert_eq!(app.order(recent).await, Some(("processed".into(), 0)));
    assert_eq!(app.order(waiting).await, Some(("pending".into(), 0)));
    // What is kept keeps its steps and events.
    for (table, rows) in [("steps", 1), ("order_events", 4)] {
        let kept = rows_of(table, recent).await.expect("count rows");
        assert_eq!(kept, rows, "{table} of the recent order");
    }

    let out = run(&app, &["orders", "prune", "--older-than", "1day"])
        .await
        .expect_code(0);
    assert_eq!(
        out.stdout,
        "deleted 0 ended orders last changed more than 1day ago\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasctl_reports_a_broker_that_is_down() {
    let down = "amqp://guest:guest@127.0.0.1:1/%2f";
    for args in [
        &["submit", "--workflow", "one"][..],
        &["alerts"],
        &["watch", "q"],
    ] {
        let mut cmd = bare_sasctl(args);
        cmd.env("SAS__BROKER__URL", down);
        let started = Instant::now();
        let out = output(cmd).await.expect_code(1);
        assert!(started.elapsed() < Duration::from_secs(20), "{args:?}");
        assert_eq!(out.stdout, "", "{args:?}");
        assert_eq!(out.stderr.lines().count(), 1, "{args:?}: {out:#?}");
        assert!(
            out.stderr.starts_with("sasctl: ") && out.stderr.contains("could not reach RabbitMQ"),
            "{args:?}: {out:#?}"
        );
    }

    // The same for Postgres.
    let mut cmd = bare_sasctl(&["orders", "list"]);
    cmd.env("SAS__DATABASE__URL", "postgres://postgres@127.0.0.1:1/sas");
    let out = output(cmd).await.expect_code(1);
    assert_eq!(out.stderr.lines().count(), 1, "{out:#?}");
    assert!(
        out.stderr.starts_with("sasctl: ") && out.stderr.contains("could not reach Postgres"),
        "{out:#?}"
    );
}

#[test]
fn the_help_documents_the_commands_and_exit_codes() {
    let out = Command::new(bin("sasctl"))
        .arg("--help")
        .output()
        .expect("run");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for text in [
        "alerts",
        "orders",
        "0  ok",
        "1  failure",
        "2  bad usage or configuration",
        "3  unknown order",
        "4  action not allowed in the order's state",
    ] {
        assert!(help.contains(text), "{help}");
    }
    let out = Command::new(bin("sasctl"))
        .args(["orders", "--help"])
        .output()
        .expect("run");
    let help = String::from_utf8_lossy(&out.stdout);
    for command in ["list", "show", "retry", "cancel", "prune"] {
        assert!(help.contains(command), "{help}");
    }
}

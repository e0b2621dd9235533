//! `sasctl`'s newer commands end to end: `submit --file`, `watch` with
//! filters, `dead-letters list|replay|purge`, `stats` and `--json` on every
//! command, with their error paths (broker or database down, a missing queue,
//! a purge without `--yes`).

use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, Instant};

use remote_sim::Knobs;
use sas::broker::Outgoing;
use sas_tests::cli::{Run, bare_sasctl, output, output_with, run, sasctl, wait_state};
use sas_tests::{TestApp, bin};
use serde_json::{Value, json};
use uuid::Uuid;

/// Waits until the orders' dead-letter queue holds `n` messages.
async fn wait_dead(app: &TestApp, n: u32) {
    let queue = app.queues.orders_dead();
    app.eventually(
        &format!("{n} messages in {queue}"),
        Duration::from_secs(30),
        || async { app.ready(queue).await == n },
    )
    .await;
}

/// An order of `workflow` as an application writes it.
fn order(id: Uuid, workflow: &str) -> String {
    json!({ "order_id": id, "workflow": workflow, "payload": { "n": 1 } }).to_string()
}

/// Publishes a message straight to the orders' dead-letter queue, as the
/// submission service would have put it there.
async fn dead_letter(app: &TestApp, body: &str, reply_to: Option<&str>, reason: &str) {
    app.publisher()
        .publish(&Outgoing {
            routing_key: app.queues.orders_dead(),
            body: body.as_bytes(),
            reply_to,
            headers: &[("x-sas-reason", reason)],
            mandatory: true,
            ..Outgoing::default()
        })
        .await
        .expect("publish a dead letter");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_from_a_file_publishes_the_json_lines_skips_the_bad_ones_and_the_orders_are_processed()
 {
    let app = TestApp::spawn().await;
    let status = app.status_queue("file").await;
    let ids: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
    // Line 2 is not JSON, line 4 is empty, line 6 ends with CRLF, line 7 is cut short.
    let text = format!(
        "{}\n{{\"workflow\": \"one\",\n{}\n\n{}\n{}\r\n{{\"order_id\n{}\n",
        order(ids[0], "one"),
        order(ids[1], "one"),
        order(ids[2], "three"),
        order(ids[3], "one"),
        // JSON that the submission will reject: sasctl checks only that it is JSON.
        json!({ "workflow": "one" }),
    );
    let file = app.dir.join("orders.jsonl");
    std::fs::write(&file, text).expect("write the orders file");
    let file_arg = file.to_str().expect("UTF-8 path");

    let out = run(
        &app,
        &[
            "submit",
            "--file",
            file_arg,
            "--reply-to",
            &status,
            "--json",
        ],
    )
    .await
    .expect_code(1);
    let summary = out.json();
    assert_eq!(summary["published"], 5, "{out:#?}");
    assert_eq!(summary["queue"], app.queues.orders());
    let listed: Vec<&str> = summary["order_ids"]
        .as_array()
        .expect("order_ids")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let expected: Vec<String> = ids.iter().map(Uuid::to_string).collect();
    assert_eq!(listed, expected, "{out:#?}");
    let bad = summary["bad_lines"].as_array().expect("bad_lines");
    let bad_numbers: Vec<i64> = bad.iter().filter_map(|b| b["line"].as_i64()).collect();
    assert_eq!(bad_numbers, [2, 7], "{out:#?}");
    assert!(
        bad[0]["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("not JSON")),
        "{out:#?}"
    );
    assert!(summary["elapsed_secs"].is_number(), "{out:#?}");
    assert!(summary["per_sec"].is_number(), "{out:#?}");
    // Each bad line is reported with its number, then the failure; no progress
    // bar when stderr is not a terminal.
    assert!(
        out.stderr.contains("line 2: not JSON") && out.stderr.contains("line 7: not JSON"),
        "{out:#?}"
    );
    assert_eq!(
        out.stderr.lines().last(),
        Some("sasctl: 2 lines skipped, not JSON: lines 2, 7"),
        "{out:#?}"
    );
    assert!(
        !out.stderr.contains('\r') && !out.stderr.contains('\u{1b}'),
        "{out:#?}"
    );

    for id in &ids {
        wait_state(&app, *id, "processed", Duration::from_secs(30)).await;
    }
    // Every order's events went to the reply_to, and the line without an
    // order_id was published and rejected by the submission.
    let events = app
        .collect(&status, Duration::from_secs(30), |got| {
            got.iter().filter(|e| e["state"] == "processed").count() == 4
                && got.iter().any(|e| e["state"] == "rejected")
        })
        .await;
    assert!(events.iter().any(|e| e["state"] == "rejected"));
    wait_dead(&app, 1).await;

    // From standard input, without --json: the ids on stdout, the summary on stderr.
    let id = Uuid::new_v4();
    let mut cmd = sasctl(&app);
    cmd.args(["submit", "--file", "-"]);
    let out = output_with(cmd, format!("{}\n", order(id, "one")).into_bytes())
        .await
        .expect_code(0);
    assert_eq!(out.stdout, format!("{id}\n"));
    assert!(
        out.stderr
            .starts_with(&format!("submitted 1 line to {} in ", app.queues.orders()))
            && out.stderr.trim_end().ends_with("/s)"),
        "{out:#?}"
    );
    wait_state(&app, id, "processed", Duration::from_secs(30)).await;

    // A file that cannot be opened is a usage error.
    let missing = app.dir.join("missing.jsonl");
    let out = run(
        &app,
        &["submit", "--file", missing.to_str().expect("UTF-8 path")],
    )
    .await
    .expect_code(2);
    assert!(
        out.stderr.starts_with("sasctl: cannot open") && out.stderr.lines().count() == 1,
        "{out:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_prints_only_the_matching_messages_and_stops_once_every_watched_order_has_ended() {
    let app = TestApp::spawn().await;

    // --order-id and --until-terminal: one order processed, one rejected.
    let first = app.status_queue("first").await;
    let other = app.submit("one", Some(&first)).await;
    let watched = app.submit("three", Some(&first)).await;
    let rejected = Uuid::new_v4();
    app.publish_raw(order(rejected, "nope").as_bytes(), Some(&first), None)
        .await;
    let (watched_s, rejected_s) = (watched.to_string(), rejected.to_string());
    let out = run(
        &app,
        &[
            "watch",
            &first,
            "--order-id",
            &watched_s,
            "--order-id",
            &rejected_s,
            "--until-terminal",
            "--timeout",
            "60s",
        ],
    )
    .await
    .expect_code(0);
    let lines = out.json_lines();
    let ids: BTreeSet<&str> = lines
        .iter()
        .filter_map(|e| e["order_id"].as_str())
        .collect();
    assert_eq!(
        ids,
        BTreeSet::from([watched_s.as_str(), rejected_s.as_str()]),
        "{out:#?}"
    );
    let states = |id: &str| -> Vec<&str> {
        lines
            .iter()
            .filter(|e| e["order_id"] == id)
            .filter_map(|e| e["state"].as_str())
            .collect()
    };
    assert_eq!(states(&rejected_s), ["rejected"], "{out:#?}");
    let watched_states = states(&watched_s);
    assert_eq!(watched_states.first(), Some(&"received"), "{out:#?}");
    assert_eq!(watched_states.last(), Some(&"processed"), "{out:#?}");
    assert!(
        out.stderr.contains("(every watched order ended)"),
        "{out:#?}"
    );
    wait_state(&app, other, "processed", Duration::from_secs(30)).await;

    // --state: only the terminal events are printed; the others are consumed.
    let second = app.status_queue("second").await;
    let ids = app.submit_many("one", 2, Some(&second)).await;
    let out = run(
        &app,
        &[
            "watch",
            &second,
            "--state",
            "processed",
            "--state",
            "failed",
            "--count",
            "2",
            "--timeout",
            "60s",
            "--json",
        ],
    )
    .await
    .expect_code(0);
    let lines = out.json_lines();
    assert_eq!(lines.len(), 2, "{out:#?}");
    assert!(lines.iter().all(|e| e["state"] == "processed"), "{out:#?}");
    let printed: BTreeSet<String> = lines
        .iter()
        .filter_map(|e| e["order_id"].as_str().map(str::to_owned))
        .collect();
    let submitted: BTreeSet<String> = ids.iter().map(Uuid::to_string).collect();
    assert_eq!(printed, submitted, "{out:#?}");
    assert!(
        out.stderr
            .contains(&format!("2 messages from {second} (count reached), "))
            && out.stderr.contains("others consumed"),
        "{out:#?}"
    );

    // Reading that stops before every watched order ended is a failure.
    let third = app.status_queue("third").await;
    let never = Uuid::new_v4().to_string();
    let out = run(
        &app,
        &[
            "watch",
            &third,
            "--order-id",
            &never,
            "--until-terminal",
            "--timeout",
            "1s",
        ],
    )
    .await
    .expect_code(1);
    assert_eq!(out.stdout, "");
    assert_eq!(
        out.stderr.lines().last(),
        Some(format!("sasctl: 1 of 1 watched orders had no terminal event: {never}").as_str()),
        "{out:#?}"
    );

    // --until-terminal needs the orders to wait for; a state must be one.
    let out = run(&app, &["watch", &third, "--until-terminal"])
        .await
        .expect_code(2);
    assert!(out.stderr.contains("--order-id"), "{out:#?}");
    let out = run(&app, &["watch", &third, "--state", "done"])
        .await
        .expect_code(2);
    assert!(
        out.stderr.contains("valid states: received, rejected"),
        "{out:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_list_shows_the_rejected_messages_and_leaves_them_in_the_queue_in_order() {
    let app = TestApp::new().await;
    app.start("submission", "submission", &[]).await;
    let status = app.status_queue("dead").await;
    let id = Uuid::new_v4();
    let long_payload = "x".repeat(200);
    let unknown =
        json!({ "order_id": id, "workflow": "nope", "payload": { "note": long_payload } })
            .to_string();
    app.publish_raw(b"not json at all", None, Some("m-1")).await;
    wait_dead(&app, 1).await;
    app.publish_raw(unknown.as_bytes(), Some(&status), None)
        .await;
    wait_dead(&app, 2).await;

    let first = run(&app, &["dead-letters", "list", "--json"])
        .await
        .expect_code(0);
    let letters = first.json();
    let letters = letters.as_array().expect("an array");
    assert_eq!(letters.len(), 2, "{first:#?}");
    assert_eq!(letters[0]["body"], "not json at all");
    assert_eq!(letters[0]["message_id"], "m-1");
    assert_eq!(letters[0]["reply_to"], Value::Null);
    assert!(
        letters[0]["reason"].as_str().is_some_and(|r| !r.is_empty()),
        "{first:#?}"
    );
    // The whole body in JSON.
    assert_eq!(letters[1]["body"], unknown.as_str());
    assert_eq!(letters[1]["reply_to"], status.as_str());
    assert!(
        letters[1]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("nope")),
        "{first:#?}"
    );
    assert!(
        first.stderr.contains(&format!(
            "2 of 2 dead letters in {}",
            app.queues.orders_dead()
        )),
        "{first:#?}"
    );

    // Listing removes nothing and keeps the order.
    let again = run(&app, &["dead-letters", "list", "--json"])
        .await
        .expect_code(0);
    assert_eq!(again.json(), first.json());
    // RabbitMQ puts the listed messages back as the listing's channel
    // closes, a moment after the command has ended.
    app.eventually(
        "both dead letters back",
        Duration::from_secs(10),
        || async { app.ready(app.queues.orders_dead()).await == 2 },
    )
    .await;

    // The table cuts long bodies; --limit takes the oldest.
    let table = run(&app, &["dead-letters", "list"]).await.expect_code(0);
    let lines: Vec<&str> = table.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{table:#?}");
    assert!(
        lines[0].starts_with("REASON") && lines[0].contains("MESSAGE_ID"),
        "{table:#?}"
    );
    assert!(lines[0].contains("REPLY_TO") && lines[0].ends_with("BODY"));
    assert!(
        lines[1].contains("m-1") && lines[1].ends_with("not json at all"),
        "{table:#?}"
    );
    assert!(
        lines[2].contains(&status) && lines[2].ends_with('…'),
        "{table:#?}"
    );
    assert!(!table.stdout.contains(&long_payload), "{table:#?}");
    let one = run(&app, &["dead-letters", "list", "--limit", "1", "--json"])
        .await
        .expect_code(0);
    assert_eq!(one.json(), json!([letters[0].clone()]));
    assert_eq!(app.ready(app.queues.orders_dead()).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_replay_resubmits_them_a_fixed_order_is_processed_and_a_still_bad_one_comes_back()
 {
    let app = TestApp::spawn().await;
    let status = app.status_queue("replay").await;
    // Still bad: an unknown workflow, rejected by the submission service.
    let bad = Uuid::new_v4();
    app.publish_raw(order(bad, "nope").as_bytes(), None, None)
        .await;
    wait_dead(&app, 1).await;
    // Fixed since: a valid order, dead-lettered when its workflow was missing.
    let fixed = Uuid::new_v4();
    dead_letter(
        &app,
        &order(fixed, "one"),
        Some(&status),
        "unknown workflow \"one\"",
    )
    .await;
    wait_dead(&app, 2).await;

    let out = run(&app, &["dead-letters", "replay", "--json"])
        .await
        .expect_code(0);
    assert_eq!(out.json(), json!({ "replayed": 2 }), "{out:#?}");

    wait_state(&app, fixed, "processed", Duration::from_secs(30)).await;
    // Its reply_to went along: the application hears about it.
    let events = app
        .collect(&status, Duration::from_secs(30), |got| {
            got.iter().any(|e| e["state"] == "processed")
        })
        .await;
    assert!(
        events.iter().all(|e| e["order_id"] == fixed.to_string()),
        "{events:#?}"
    );
    // The still-bad one is back, with a fresh reason; nothing else is.
    wait_dead(&app, 1).await;
    let letters = run(&app, &["dead-letters", "list", "--json"])
        .await
        .expect_code(0)
        .json();
    assert_eq!(letters.as_array().map(Vec::len), Some(1), "{letters}");
    assert_eq!(letters[0]["body"], order(bad, "nope"));
    assert!(
        letters[0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("nope")),
        "{letters}"
    );
    assert_eq!(app.order(bad).await, None);

    // --limit replays the oldest only; the text names the queues.
    let out = run(&app, &["dead-letters", "replay", "--limit", "1"])
        .await
        .expect_code(0);
    assert_eq!(
        out.stdout,
        format!(
            "replayed 1 dead letter from {} to {}\n",
            app.queues.orders_dead(),
            app.queues.orders()
        )
    );
    wait_dead(&app, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_purge_refuses_without_yes_and_empties_the_queue_with_it() {
    let app = TestApp::new().await;
    dead_letter(&app, "{}", None, "missing field workflow").await;
    dead_letter(&app, "[]", None, "not an object").await;
    wait_dead(&app, 2).await;

    let out = run(&app, &["dead-letters", "purge"]).await.expect_code(2);
    assert_eq!(out.stdout, "");
    assert_eq!(
        out.stderr,
        format!(
            "sasctl: {} holds 2 dead letters; nothing deleted: run again with --yes to delete them\n",
            app.queues.orders_dead()
        )
    );
    assert_eq!(app.ready(app.queues.orders_dead()).await, 2);

    let out = run(&app, &["dead-letters", "purge", "--yes", "--json"])
        .await
        .expect_code(0);
    assert_eq!(out.json(), json!({ "purged": 2 }));
    assert_eq!(app.ready(app.queues.orders_dead()).await, 0);

    // An empty queue: nothing to list, replay or purge.
    let out = run(&app, &["dead-letters", "list", "--json"])
        .await
        .expect_code(0);
    assert_eq!(out.json(), json!([]));
    let out = run(&app, &["dead-letters", "list"]).await.expect_code(0);
    assert_eq!(out.stdout, "(none)\n");
    let out = run(&app, &["dead-letters", "replay", "--json"])
        .await
        .expect_code(0);
    assert_eq!(out.json(), json!({ "replayed": 0 }));
    let out = run(&app, &["dead-letters", "purge", "--yes"])
        .await
        .expect_code(0);
    assert_eq!(
        out.stdout,
        format!("purged 0 dead letters from {}\n", app.queues.orders_dead())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_counts_the_orders_of_a_known_run() {
    let app = TestApp::spawn().await;
    let done = app.submit_many("one", 3, None).await;
    for id in &done {
        wait_state(&app, *id, "processed", Duration::from_secs(30)).await;
    }
    app.knobs(
        "a",
        Knobs {
            permanent: true,
            ..Knobs::default()
        },
    );
    let failed = app.submit("one", None).await;
    wait_state(&app, failed, "error", Duration::from_secs(30)).await;
    let waiting = Uuid::new_v4();
    let body = json!({
        "order_id": waiting, "workflow": "one", "payload": {},
        "not_before": "2100-01-01T00:00:00Z",
    });
    app.publish_raw(body.to_string().as_bytes(), None, None)
        .await;
    wait_state(&app, waiting, "pending", Duration::from_secs(30)).await;
    app.eventually("the outbox is empty", Duration::from_secs(30), || async {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
            .fetch_one(&app.db)
            .await
            .expect("count the outbox");
        left == 0
    })
    .await;

    let stats = run(&app, &["stats", "--json"]).await.expect_code(0).json();
    assert_eq!(
        stats["by_state"],
        json!({
            "pending": 1, "processing": 0, "processed": 3,
            "error": 1, "compensating": 0, "compensated": 0,
        }),
        "{stats}"
    );
    assert_eq!(stats["total"], 5, "{stats}");
    assert_eq!(stats["received_recently"], 5, "{stats}");
    assert_eq!(
        stats["ended_recently"],
        json!({ "processed": 3, "compensated": 0, "error": 1 }),
        "{stats}"
    );
    assert_eq!(stats["window_secs"], 300, "{stats}");
    assert_eq!(stats["received_per_sec"], 0.017, "{stats}");
    assert_eq!(stats["ended_per_sec"], 0.013, "{stats}");
    assert_eq!(stats["waiting"], 1, "{stats}");
    assert_eq!(stats["outbox_backlog"], 0, "{stats}");
    assert!(stats["oldest_pending"].is_string(), "{stats}");
    assert!(
        stats["oldest_pending_age_secs"]
            .as_u64()
            .is_some_and(|age| age < 120),
        "{stats}"
    );

    let stats = run(&app, &["stats", "--window", "1h", "--json"])
        .await
        .expect_code(0)
        .json();
    assert_eq!(stats["window_secs"], 3600, "{stats}");
    assert_eq!(stats["received_per_sec"], 0.001, "{stats}");

    let text = run(&app, &["stats"]).await.expect_code(0).stdout;
    for line in [
        "orders          5\n",
        "  processed     3\n",
        "  error         1\n",
        "last 5m: received 5 (0.02/s), ended 4 (0.01/s: processed 3, compensated 0, error 1)\n",
        "waiting         1 ",
        "outbox backlog  0\n",
    ] {
        assert!(text.contains(line), "{line:?} in\n{text}");
    }
    assert!(text.contains("oldest pending  "), "{text}");

    let out = run(&app, &["stats", "--window", "10ms"])
        .await
        .expect_code(2);
    assert!(out.stderr.contains("at least 1s"), "{out:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_data_command_takes_json() {
    let app = TestApp::new().await;
    let out = run(&app, &["migrate", "--json"]).await.expect_code(0);
    assert_eq!(out.json(), json!({ "migrated": true }));
    let out = run(&app, &["migrate"]).await.expect_code(0);
    assert_eq!(out.stdout, "migrations applied\n");
    // Always JSON lines: --json is accepted.
    let out = run(&app, &["alerts", "--json"]).await.expect_code(0);
    assert_eq!(out.stdout, "");
    let queue = app.status_queue("json").await;
    app.publisher()
        .publish(&Outgoing {
            routing_key: &queue,
            body: br#"{"order_id": "x", "seq": 1, "state": "received"}"#,
            mandatory: true,
            ..Outgoing::default()
        })
        .await
        .expect("publish");
    let out = run(&app, &["watch", &queue, "--count", "1", "--json"])
        .await
        .expect_code(0);
    assert_eq!(
        out.json(),
        json!({ "order_id": "x", "seq": 1, "state": "received" })
    );
    // submit --json in its generated mode: the ids in the summary.
    let out = run(
        &app,
        &["submit", "--workflow", "one", "--count", "3", "--json"],
    )
    .await
    .expect_code(0);
    let summary = out.json();
    assert_eq!(summary["published"], 3, "{out:#?}");
    assert_eq!(
        summary["order_ids"].as_array().map(Vec::len),
        Some(3),
        "{out:#?}"
    );
    assert_eq!(summary["bad_lines"], json!([]));
    assert_eq!(out.stderr, "");
}

/// Panics unless the run failed with exit 1 and one line naming `what`.
fn assert_one_line_failure(out: Run, args: &[&str], what: &str) {
    let out = out.expect_code(1);
    assert_eq!(out.stdout, "", "{args:?}: {out:#?}");
    assert_eq!(out.stderr.lines().count(), 1, "{args:?}: {out:#?}");
    assert!(
        out.stderr.starts_with("sasctl: ") && out.stderr.contains(what),
        "{args:?}: {out:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_new_commands_report_a_broker_or_database_that_is_down_in_one_line() {
    let file = std::env::temp_dir().join(format!("sasctl-{}.jsonl", Uuid::new_v4().simple()));
    std::fs::write(&file, "{\"workflow\": \"one\"}\n").expect("write the orders file");
    let file_arg = file.to_str().expect("UTF-8 path").to_owned();
    let down = "amqp://guest:guest@127.0.0.1:1/%2f";
    for args in [
        &["submit", "--file", file_arg.as_str(), "--json"][..],
        &["watch", "q", "--order-id", "x", "--until-terminal"],
        &["dead-letters", "list"],
        &["dead-letters", "replay", "--json"],
        &["dead-letters", "purge", "--yes"],
        &["alerts", "--json"],
    ] {
        let mut cmd = bare_sasctl(args);
        cmd.env("SAS__BROKER__URL", down);
        let started = Instant::now();
        let out = output(cmd).await;
        assert!(started.elapsed() < Duration::from_secs(20), "{args:?}");
        assert_one_line_failure(out, args, "could not reach RabbitMQ");
    }
    std::fs::remove_file(&file).ok();

    let down = "postgres://postgres@127.0.0.1:1/sas";
    for args in [&["stats", "--json"][..], &["stats"], &["migrate", "--json"]] {
        let mut cmd = bare_sasctl(args);
        cmd.env("SAS__DATABASE__URL", down);
        let out = output(cmd).await;
        assert_one_line_failure(out, args, "could not reach Postgres");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_name_a_missing_queue() {
    // A prefix no deployment uses: its dead-letter queue does not exist.
    let prefix = format!("missing{}", &Uuid::new_v4().simple().to_string()[..12]);
    for args in [
        &["dead-letters", "list"][..],
        &["dead-letters", "replay"],
        &["dead-letters", "purge", "--yes"],
    ] {
        let mut cmd = bare_sasctl(args);
        cmd.env("SAS__BROKER__URL", sas_tests::amqp())
            .env("SAS__BROKER__PREFIX", &prefix);
        let out = output(cmd).await;
        assert_one_line_failure(
            out,
            args,
            &format!("the queue {prefix}.orders.dead does not exist"),
        );
    }
}

#[test]
fn the_help_documents_the_new_commands() {
    let help = |args: &[&str]| {
        let out = Command::new(bin("sasctl"))
            .args(args)
            .output()
            .expect("run sasctl");
        assert!(out.status.success(), "{args:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let top = help(&["--help"]);
    for text in ["dead-letters", "stats", "--file"] {
        assert!(top.contains(text), "{top}");
    }
    let dead = help(&["dead-letters", "--help"]);
    for command in ["list", "replay", "purge"] {
        assert!(dead.contains(command), "{dead}");
    }
    let watch = help(&["watch", "--help"]);
    for text in [
        "--order-id",
        "--state",
        "--until-terminal",
        "consumed (acknowledged)",
    ] {
        assert!(watch.contains(text), "{watch}");
    }
    let submit = help(&["submit", "--help"]);
    for text in ["--file", "--json", "line"] {
        assert!(submit.contains(text), "{submit}");
    }
    assert!(help(&["stats", "--help"]).contains("--window"));
}

#[tokio::test]
async fn completions_and_the_manual_page_need_no_configuration() {
    for (shell, says) in [
        ("bash", "_sasctl()"),
        ("zsh", "#compdef sasctl"),
        ("fish", "complete -c sasctl"),
    ] {
        let out = output(bare_sasctl(&["completions", shell]))
            .await
            .expect_code(0);
        assert!(out.stdout.contains(says), "{shell}: {out:#?}");
        assert!(out.stdout.contains("redrive"), "subcommands are completed");
    }
    let out = output(bare_sasctl(&["man"])).await.expect_code(0);
    assert!(out.stdout.contains(".TH sasctl 1"), "{out:#?}");
    assert!(out.stdout.contains("migrate"), "the subcommands are listed");
    output(bare_sasctl(&["completions", "cmd.exe"]))
        .await
        .expect_code(2);
}

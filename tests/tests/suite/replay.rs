//! Replay (contract §9) end to end: stored status events published again,
//! byte for byte, in `seq` order per order, by order and from a `seq`, or by
//! status queue since a time; bad requests dead-lettered with a reason while
//! the service goes on; `sasctl events replay`; an order asking for its
//! terminal event only (contract §2a) and its history replayed.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::Utc;
use sas::broker::Outgoing;
use sas_client::ReplayRequest;
use sas_tests::TestApp;
use sas_tests::cli::run;
use serde_json::Value;
use uuid::Uuid;

/// Waits until `queue` holds `n` messages, then takes them all (bodies, in
/// queue order).
async fn take(app: &TestApp, queue: &str, n: u32) -> Vec<Vec<u8>> {
    app.eventually(
        &format!("{n} messages in {queue}"),
        Duration::from_secs(30),
        || async { app.ready(queue).await >= n },
    )
    .await;
    app.drain(queue)
        .await
        .into_iter()
        .map(|(body, _)| body)
        .collect()
}

/// Bodies by order, each order's in arrival order, as `(seq, body)`;
/// repeats of a `seq` (at-least-once delivery) dropped.
fn by_order(bodies: &[Vec<u8>]) -> BTreeMap<String, Vec<(i64, Vec<u8>)>> {
    let mut orders: BTreeMap<String, Vec<(i64, Vec<u8>)>> = BTreeMap::new();
    for body in bodies {
        let e: Value = serde_json::from_slice(body).expect("a status event");
        let id = e["order_id"].as_str().expect("an order id").to_owned();
        let seq = e["seq"].as_i64().expect("a seq");
        let events = orders.entry(id).or_default();
        if !events.iter().any(|(s, _)| *s == seq) {
            events.push((seq, body.clone()));
        }
    }
    orders
}

/// Runs `n` orders of `workflow` to their end with `queue` as status queue;
/// their events as the outbox sent them.
async fn run_orders(
    app: &TestApp,
    workflow: &str,
    n: usize,
    queue: &str,
    events_each: u32,
) -> BTreeMap<String, Vec<(i64, Vec<u8>)>> {
    let ids = app.submit_many(workflow, n, Some(queue)).await;
    let bodies = take(app, queue, events_each * n as u32).await;
    let sent = by_order(&bodies);
    assert_eq!(sent.len(), ids.len());
    sent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_by_order_id_and_from_seq_republishes_the_stored_events_in_seq_order() {
    let app = TestApp::spawn().await;
    let status = app.status_queue("orig").await;
    let sent = run_orders(&app, "three", 1, &status, 6).await;
    let (id, original) = sent.into_iter().next().unwrap();
    let order_id = Uuid::parse_str(&id).unwrap();
    assert_eq!(
        original.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5, 6]
    );

    // To another queue, from seq 3.
    let elsewhere = app.status_queue("elsewhere").await;
    let request = ReplayRequest::Order {
        order_id,
        from_seq: 3,
    };
    app.client()
        .replay(&request, Some(&elsewhere))
        .await
        .expect("replay");
    let replayed = take(&app, &elsewhere, 4).await;
    let expected: Vec<Vec<u8>> = original[2..].iter().map(|(_, b)| b.clone()).collect();
    assert_eq!(
        replayed,
        expected,
        "byte for byte, in seq order:\n{}",
        String::from_utf8_lossy(&replayed.concat())
    );

    // Without a reply_to property: to the order's own status queue.
    let all = ReplayRequest::Order {
        order_id,
        from_seq: 0,
    };
    app.client().replay(&all, None).await.expect("replay");
    let again = take(&app, &status, 6).await;
    let expected: Vec<Vec<u8>> = original.iter().map(|(_, b)| b.clone()).collect();
    assert_eq!(again, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_by_reply_to_and_since_republishes_every_order_of_the_queue() {
    let app = TestApp::spawn().await;
    let before = Utc::now() - chrono::Duration::seconds(1);
    let lost = app.status_queue("lost").await;
    let other = app.status_queue("other").await;
    // "one": received, processing, step_succeeded, processed.
    let sent = run_orders(&app, "one", 3, &lost, 4).await;
    let not_asked = run_orders(&app, "one", 1, &other, 4).await;

    // The application lost its events (they were drained above); it asks
    // for everything since before it submitted, to the same queue.
    let request = ReplayRequest::Queue {
        reply_to: lost.clone(),
        since: before,
    };
    app.client().replay(&request, None).await.expect("replay");
    let replayed = take(&app, &lost, 12).await;
    let got = by_order(&replayed);
    assert_eq!(got.len(), 3, "the queue's orders, and only those");
    for (id, events) in &got {
        assert!(!not_asked.contains_key(id));
        assert_eq!(events, &sent[id], "order {id}: byte for byte, in seq order");
    }
    assert_eq!(replayed.len(), 12, "each event once");

    // Since a time after everything: nothing (served: counted as replayed).
    let later = ReplayRequest::Queue {
        reply_to: lost.clone(),
        since: Utc::now() + chrono::Duration::hours(1),
    };
    app.client().replay(&later, None).await.unwrap();
    app.eventually(
        "the second replay served",
        Duration::from_secs(30),
        || async {
            app.metrics("submission")
                .await
                .contains(r#"sas_replays_total{outcome="replayed"} 2"#)
        },
    )
    .await;
    assert_eq!(app.ready(&lost).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_replay_request_is_dead_lettered_with_a_reason_and_the_service_goes_on() {
    let app = TestApp::new().await;
    app.start("submission", "submission", &[]).await;
    let publisher = app.publisher();
    let unknown = Uuid::now_v7();
    let bodies = [
        "{nope".to_owned(),
        r#"{"reply_to":"q"}"#.to_owned(),
        format!(r#"{{"order_id":"{unknown}","from_seq":1}}"#),
    ];
    for body in &bodies {
        publisher
            .publish(&Outgoing {
                routing_key: app.queues.replay(),
                body: body.as_bytes(),
                reply_to: Some("nowhere"),
                mandatory: true,
                ..Outgoing::default()
            })
            .await
            .expect("publish");
    }
    app.eventually("3 dead letters", Duration::from_secs(30), || async {
        app.ready(app.queues.replay_dead()).await >= 3
    })
    .await;
    let dead = app.drain(app.queues.replay_dead()).await;
    let reasons: Vec<String> = dead
        .iter()
        .map(|(_, r)| r.clone().unwrap_or_default())
        .collect();
    assert_eq!(
        dead.iter().map(|(b, _)| b.clone()).collect::<Vec<_>>(),
        bodies
            .iter()
            .map(|b| b.as_bytes().to_vec())
            .collect::<Vec<_>>(),
        "bodies untouched"
    );
    assert!(
        reasons[0].starts_with("body is not valid JSON"),
        "{reasons:?}"
    );
    assert_eq!(reasons[1], "missing required field `since`");
    assert_eq!(reasons[2], format!("unknown order {unknown}"));

    // The service goes on: orders are still taken, and replayed.
    assert!(!app.is_stopped("submission"));
    app.start("scheduler", "scheduler", &[]).await;
    app.start("agent", "agent", &[]).await;
    let status = app.status_queue("after").await;
    let sent = run_orders(&app, "one", 1, &status, 4).await;
    let (id, original) = sent.into_iter().next().unwrap();
    let request = ReplayRequest::Order {
        order_id: Uuid::parse_str(&id).unwrap(),
        from_seq: 1,
    };
    app.client().replay(&request, None).await.unwrap();
    let replayed = take(&app, &status, 4).await;
    assert_eq!(
        replayed,
        original.into_iter().map(|(_, b)| b).collect::<Vec<_>>()
    );
    let metrics = app.metrics("submission").await;
    for outcome in ["malformed_json", "missing_field", "unknown_order"] {
        assert!(
            metrics.contains(&format!(r#"sas_replays_total{{outcome="{outcome}"}} 1"#)),
            "{outcome}:\n{metrics}"
        );
    }
    assert!(metrics.contains(r#"sas_replays_total{outcome="replayed"} 1"#));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasctl_events_replay_publishes_an_orders_events_again() {
    let app = TestApp::spawn().await;
    let status = app.status_queue("cli").await;
    let sent = run_orders(&app, "one", 1, &status, 4).await;
    let (id, original) = sent.into_iter().next().unwrap();
    // Declared here too, only so that the test deletes it at the end.
    let to = app.status_queue("cli-replay").await;
    let done = run(
        &app,
        &[
            "events",
            "replay",
            "--order-id",
            &id,
            "--from-seq",
            "2",
            "--to",
            &to,
        ],
    )
    .await
    .expect_code(0);
    assert!(
        done.stderr.contains("asked for a replay"),
        "{}",
        done.stderr
    );
    let replayed = take(&app, &to, 3).await;
    assert_eq!(
        replayed,
        original[1..]
            .iter()
            .map(|(_, b)| b.clone())
            .collect::<Vec<_>>()
    );

    // By queue, to the queue itself.
    run(
        &app,
        &[
            "events",
            "replay",
            "--reply-to",
            &status,
            "--since",
            "2020-01-01T00:00:00Z",
        ],
    )
    .await
    .expect_code(0);
    assert_eq!(take(&app, &status, 4).await.len(), 4);
    // Bad usage is refused before anything is sent.
    run(&app, &["events", "replay", "--reply-to", &status])
        .await
        .expect_code(2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_cut_at_max_replay_events_and_the_rest_is_asked_for_from_where_it_stopped() {
    let app = TestApp::builder()
        .extra_config("[submission]\nmax_replay_events = 4\n")
        .spawn()
        .await;
    let status = app.status_queue("bounded").await;
    let sent = run_orders(&app, "three", 1, &status, 6).await;
    let (id, original) = sent.into_iter().next().unwrap();
    let order_id = Uuid::parse_str(&id).unwrap();

    let all = ReplayRequest::Order {
        order_id,
        from_seq: 1,
    };
    app.client().replay(&all, None).await.unwrap();
    let mut replayed = take(&app, &status, 4).await;
    // The rest, from one past the last event received.
    let rest = ReplayRequest::Order {
        order_id,
        from_seq: 5,
    };
    app.client().replay(&rest, None).await.unwrap();
    replayed.extend(take(&app, &status, 2).await);
    let seqs: Vec<i64> = replayed
        .iter()
        .map(|b| {
            serde_json::from_slice::<Value>(b).unwrap()["seq"]
                .as_i64()
                .unwrap()
        })
        .collect();
    assert_eq!(seqs, [1, 2, 3, 4, 5, 6], "the first four, then the rest");
    assert_eq!(
        replayed,
        original.into_iter().map(|(_, b)| b).collect::<Vec<_>>()
    );
    let metrics = app.metrics("submission").await;
    assert!(
        metrics.contains(r#"sas_replays_total{outcome="truncated"} 1"#),
        "{metrics}"
    );
    assert!(metrics.contains(r#"sas_replays_total{outcome="replayed"} 1"#));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_asking_for_terminal_events_gets_only_its_end_with_its_full_seq_and_a_replay_gives_the_rest()
 {
    let app = TestApp::spawn().await;
    let status = app.status_queue("terminal").await;
    let mut order = sas_client::Order::new("three", serde_json::Map::new());
    order.reply_to = Some(status.clone());
    order.events = sas_client::Events::Terminal;
    let order_id = app.client().submit_order(order).await.expect("submit").id();

    // Events are published in seq order per order, so any other event of
    // the order would be in the queue ahead of its terminal one.
    let sent = take(&app, &status, 1).await;
    assert_eq!(sent.len(), 1, "{}", String::from_utf8_lossy(&sent.concat()));
    let end: Value = serde_json::from_slice(&sent[0]).expect("a status event");
    assert_eq!(end["order_id"], order_id.to_string());
    assert_eq!(end["state"], "processed");
    // received, processing, three step_succeeded, processed.
    assert_eq!(end["seq"], 6);

    // The log kept everything: a replay gives the whole history, ending
    // with the very event that was sent.
    let all = ReplayRequest::Order {
        order_id,
        from_seq: 0,
    };
    app.client().replay(&all, None).await.expect("replay");
    let history = take(&app, &status, 6).await;
    let events: Vec<Value> = history
        .iter()
        .map(|b| serde_json::from_slice(b).expect("a status event"))
        .collect();
    assert_eq!(
        sas_tests::states(&events),
        [
            "received",
            "processing",
            "step_succeeded",
            "step_succeeded",
            "step_succeeded",
            "processed"
        ]
    );
    assert_eq!(history[5], sent[0], "the replayed end is the sent one");
    let stored: String = sqlx::query_scalar("SELECT events FROM orders WHERE order_id = $1")
        .bind(order_id)
        .fetch_one(&app.db)
        .await
        .expect("the order");
    assert_eq!(stored, "terminal");
}

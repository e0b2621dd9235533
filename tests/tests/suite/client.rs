//! The Rust client (`sas-client`) against a real deployment: submitting
//! typed orders and reading their typed results, waiting for an order's
//! end, reading, cancelling and signalling it over the HTTP API, the status
//! stream's deduplication, its acknowledgement after each event and its
//! resumption over a new connection; the client's examples; and its
//! dependencies, which hold nothing of the server.

use std::time::Duration;

use std::collections::BTreeMap;

use chrono::{SubsecRound as _, Utc};
use futures_util::StreamExt as _;
use sas::broker::Outgoing;
use sas::messages::{EventKind, StatusEvent};
use sas_client::{Client, Error, Options, Order};
use sas_tests::{TestApp, amqp, rabbitmq_cli};
use serde_json::{Map, Value, json};
use uuid::Uuid;

/// The next item of a stream, within 10 s.
async fn next(events: &mut sas_client::StatusStream) -> Result<StatusEvent, Error> {
    tokio::time::timeout(Duration::from_secs(10), events.next())
        .await
        .expect("an item within 10s")
        .expect("the stream goes on")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_submits_an_order_and_waits_for_its_terminal_state() {
    let app = TestApp::spawn().await;
    let queue = app.status_queue("client").await;
    let client = Client::connect_with(Options::new(amqp(), &app.prefix).status_queue(&queue))
        .await
        .expect("connect");

    let order = client
        .submit("three", &json!({"sku": "A-1"}))
        .await
        .expect("submit");
    let id = order.id();
    assert_eq!(id.get_version_num(), 7, "a UUIDv7 order id");
    let terminal = order.wait(Duration::from_secs(30)).await.expect("terminal");
    assert!(terminal.succeeded(), "{terminal:?}");
    assert_eq!(terminal.event.seq, 6);
    assert_eq!(terminal.event.order_id, json!(id.to_string()));
    assert_eq!(app.order(id).await, Some(("processed".into(), 0)));

    // Two waits at once, on one queue: whichever reads the other's
    // terminal event keeps it for it.
    let a = client.submit("one", &Map::new()).await.unwrap();
    let b = client.submit("one", &Map::new()).await.unwrap();
    let (tb, ta) = tokio::join!(
        b.wait(Duration::from_secs(30)),
        a.wait(Duration::from_secs(30))
    );
    assert_eq!(ta.unwrap().event.order_id, json!(a.id().to_string()));
    assert_eq!(tb.unwrap().event.order_id, json!(b.id().to_string()));

    // An unknown workflow is the submission's to reject: `rejected`, seq 0,
    // and no results.
    let rejected = client
        .submit("no-such-workflow", &Map::new())
        .await
        .unwrap();
    let terminal = rejected.wait(Duration::from_secs(30)).await.unwrap();
    assert_eq!(terminal.state(), EventKind::Rejected);
    assert_eq!(terminal.event.seq, 0);
    let failed = rejected
        .result_within::<Value>(Duration::from_secs(1))
        .await;
    assert!(
        matches!(&failed, Err(Error::OrderFailed { state, .. }) if state == "rejected"),
        "{failed:?}"
    );

    // What the submission would reject for its form is refused unsent:
    // a bad workflow name, a payload that is not an object, one sas cannot
    // store, a reply queue of sas's own.
    for refused in [
        client.submit("", &Map::new()).await,
        client.submit("one", &[1, 2]).await,
        client.submit("one", &json!({"a": "nul \u{0}"})).await,
        client
            .submit_order(Order {
                reply_to: Some(format!("{}.orders", app.prefix)),
                ..Order::new("one", Map::new())
            })
            .await,
    ] {
        assert!(
            matches!(refused, Err(Error::InvalidOrder(_))),
            "{refused:?}"
        );
    }
    // Waiting is bounded.
    let never = client
        .wait(Uuid::now_v7(), Duration::from_millis(300))
        .await;
    assert!(matches!(never, Err(Error::Timeout { .. })), "{never:?}");
    // Reading or cancelling needs the HTTP API.
    assert!(matches!(order.status().await, Err(Error::NoHttpApi)));
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typed_order_gives_its_typed_results_and_is_read_and_cancelled_over_http() {
    #[derive(serde::Serialize)]
    struct Checkout {
        sku: String,
        qty: u32,
    }
    let app = TestApp::spawn().await;
    let queue = app.status_queue("typed").await;
    let options = Options::new(amqp(), &app.prefix)
        .status_queue(&queue)
        .http(format!("http://127.0.0.1:{}", app.port("submission")), None);
    let client = Client::connect_with(options).await.expect("connect");

    let order = client
        .submit(
            "three",
            &Checkout {
                sku: "A-1".into(),
                qty: 2,
            },
        )
        .await
        .expect("submit");
    // The results by step name, as the processed event carries them.
    let results: BTreeMap<String, Value> = order
        .result_within(Duration::from_secs(30))
        .await
        .expect("processed");
    let view = order.status().await.expect("the order over HTTP");
    assert_eq!(view.order_id, order.id());
    assert_eq!(view.state, "processed");
    let steps: Vec<&str> = view.steps.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        results.keys().map(String::as_str).collect::<Vec<_>>().len(),
        steps.len()
    );
    for step in &view.steps {
        assert_eq!(
            Some(&results[&step.name]),
            step.result.as_ref(),
            "{}",
            step.name
        );
    }
    assert!(
        view.events
            .last()
            .is_some_and(|e| e.state == EventKind::Processed)
    );

    // An order that has not started yet, cancelled: nothing to undo, it
    // ends compensated, and its result says so.
    let later = client
        .submit_order(Order {
            not_before: Some(Utc::now() + chrono::Duration::hours(1)),
            ..Order::new("three", Map::new())
        })
        .await
        .expect("submit");
    // Confirmed by the broker is not yet stored: wait until it reads.
    app.eventually("the order is stored", Duration::from_secs(30), || async {
        later.status().await.is_ok()
    })
    .await;
    let cancelled = later.cancel().await.expect("cancel");
    assert_eq!(cancelled.order_id, later.id());
    let failed = later.result_within::<Value>(Duration::from_secs(30)).await;
    assert!(
        matches!(&failed, Err(Error::OrderFailed { state, .. }) if state == "compensated"),
        "{failed:?}"
    );
    // Cancelling it again is refused with the reason, as is an unknown order.
    match later.cancel().await {
        Err(Error::Refused {
            status: 409,
            problem,
        }) => {
            assert_eq!(problem.error, "not_allowed");
        }
        other => panic!("{other:?}"),
    }
    match client.order(Uuid::now_v7()).status().await {
        Err(Error::Refused {
            status: 404,
            problem,
        }) => assert_eq!(problem.error, "not_found"),
        other => panic!("{other:?}"),
    }
    // No workflow has signal steps yet: refused, not kept.
    match order.signal("approve", &json!({"by": "ann"})).await {
        Err(Error::Refused { status: 409, .. }) => {}
        other => panic!("{other:?}"),
    }
    client.close().await;
}

/// The `(order_id, seq)` of every event read until the terminal event of `id`.
async fn read_until_end(events: &mut sas_client::StatusStream, id: Uuid) -> Vec<(Value, i64)> {
    let id = json!(id.to_string());
    let mut seen = Vec::new();
    loop {
        let event = next(events).await.expect("an event");
        let end = event.order_id == id && event.state.is_terminal();
        seen.push((event.order_id.clone(), event.seq));
        if end {
            return seen;
        }
    }
}

/// Closes the broker's side of every connection named `name`.
async fn close_connections_named(name: &str) -> usize {
    let name = name.to_owned();
    tokio::task::spawn_blocking(move || {
        let out = rabbitmq_cli("rabbitmqctl")
            .args(["-q", "list_connections", "pid", "client_properties"])
            .output()
            .expect("rabbitmqctl");
        let listed = String::from_utf8_lossy(&out.stdout).into_owned();
        let pids: Vec<String> = listed
            .lines()
            .filter(|l| l.contains(&name))
            .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
            .collect();
        for pid in &pids {
            let closed = rabbitmq_cli("rabbitmqctl")
                .args(["close_connection", pid, "test: the connection is lost"])
                .status()
                .expect("rabbitmqctl");
            assert!(closed.success());
        }
        pids.len()
    })
    .await
    .expect("rabbitmqctl task")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_stream_and_submissions_go_on_over_a_new_connection_after_one_is_lost() {
    let app = TestApp::spawn().await;
    let queue = app.status_queue("reconnect").await;
    let name = format!("client-{}", Uuid::now_v7());
    let options = Options {
        name: name.clone(),
        ..Options::new(amqp(), &app.prefix).status_queue(&queue)
    };
    let client = Client::connect_with(options).await.expect("connect");
    let mut events = client.status(&queue).await.expect("status");
    let first = client.submit("one", &Map::new()).await.expect("submit");
    read_until_end(&mut events, first.id()).await;

    // The broker closes the client's connection (as a node's loss or a
    // missed heartbeat would): the next submission goes out on a new one,
    // and the stream consumes again by itself.
    assert!(
        close_connections_named(&name).await >= 1,
        "the client's connection listed"
    );
    app.eventually("the loss is seen", Duration::from_secs(10), || async {
        !client.is_connected()
    })
    .await;
    let second = client
        .submit("one", &Map::new())
        .await
        .expect("submit after the loss");
    let seen = read_until_end(&mut events, second.id()).await;
    let mut unique = seen.clone();
    unique.sort_by_key(|(id, seq)| (id.to_string(), *seq));
    unique.dedup();
    assert_eq!(unique.len(), seen.len(), "no event twice: {seen:?}");
    events.close().await.expect("close");
    client.close().await;
}

#[test]
fn the_client_depends_on_nothing_of_the_server() {
    let server = [
        "sqlx",
        "sqlx-core",
        "axum",
        "opentelemetry",
        "sas-core",
        "sas-store",
        "sas-broker",
        "sas-runtime",
        "sas-engine",
    ];
    sas_tests::assert_layer("sas-client", &["sas-protocol", "lapin"], &server);
}

/// Runs the client's example `name` against `app` with `args`.
fn example(app: &TestApp, name: &str, queue: &str) -> std::process::Command {
    let path = sas_tests::bin(&format!("examples/{name}"));
    assert!(
        path.exists(),
        "{} is not built: run `cargo build --workspace --all-targets` first (scripts/test.sh does)",
        path.display()
    );
    let mut cmd = std::process::Command::new(path);
    cmd.env("SAS_URL", amqp())
        .env("SAS_PREFIX", &app.prefix)
        .env("SAS_STATUS_QUEUE", queue)
        .env("RUST_LOG", "warn");
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clients_examples_run_against_the_services() {
    let app = TestApp::spawn().await;
    let queue = app.status_queue("examples").await;
    let mut submit = example(&app, "submit_and_wait", &queue);
    submit.args(["three", r#"{"sku":"A-1"}"#]);
    let out = tokio::task::spawn_blocking(move || submit.output())
        .await
        .expect("task")
        .expect("the example runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("ended processed"), "{stdout}");

    // The consumer prints what the status queue gets, from a replay of the
    // order above on, until it is interrupted.
    let since = (Utc::now() - chrono::Duration::minutes(5)).to_rfc3339();
    let mut consumer = example(&app, "consumer", &queue);
    consumer
        .args([queue.as_str(), "--replay-since", &since])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = consumer.spawn().expect("the consumer starts");
    let mut stdout = child.stdout.take().expect("stdout");
    let printed = tokio::task::spawn_blocking(move || {
        use std::io::BufRead as _;
        let mut lines = Vec::new();
        for line in std::io::BufReader::new(&mut stdout).lines() {
            let Ok(line) = line else { break };
            let done = line.contains("\"processed\"");
            lines.push(line);
            if done {
                break;
            }
        }
        lines
    });
    let lines = tokio::time::timeout(Duration::from_secs(30), printed)
        .await
        .expect("the replayed terminal event within 30 s")
        .expect("task");
    let _ = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    // Bounded: a consumer that misses its interrupt fails the test, not CI.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().expect("the consumer's status") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            child.kill().ok();
            panic!("the consumer did not exit within 10 s of its interrupt");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "interrupted, it exits 0: {status:?}");
    let events: Vec<StatusEvent> = lines
        .iter()
        .map(|l| serde_json::from_str(l).expect("a status event per line"))
        .collect();
    assert!(
        events.iter().any(|e| e.state == EventKind::Processed),
        "{lines:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_stream_yields_a_redelivered_event_once_and_acks_after_each() {
    let app = TestApp::new().await;
    let queue = app.status_queue("dedupe").await;
    let id = Uuid::now_v7();
    let event = |seq: i32, state: EventKind| {
        // Microseconds, as the wire and Postgres carry times.
        sas::messages::logged_event(
            id,
            seq,
            state,
            None,
            1,
            Utc::now().trunc_subsecs(6),
            json!({}),
        )
    };
    let (e1, e2, e3) = (
        event(1, EventKind::Received),
        event(2, EventKind::Processing),
        event(3, EventKind::Processed),
    );
    let publisher = app.publisher();
    let publish = |body: Vec<u8>| {
        let (publisher, queue) = (publisher.clone(), queue.clone());
        async move {
            publisher
                .publish(&Outgoing {
                    routing_key: &queue,
                    body: &body,
                    mandatory: true,
                    ..Outgoing::default()
                })
                .await
                .expect("publish");
        }
    };
    let bytes = |e: &StatusEvent| serde_json::to_vec(e).unwrap();
    // The same (order_id, seq) twice in a row, a stray message, and e1
    // again after e2, as a republishing relay could.
    for body in [
        bytes(&e1),
        bytes(&e1),
        b"not a status event".to_vec(),
        bytes(&e2),
        bytes(&e1),
        bytes(&e3),
    ] {
        publish(body).await;
    }

    let client = app.client();
    let mut events = client.status(&queue).await.expect("status");
    assert_eq!(next(&mut events).await.unwrap(), e1);
    assert!(matches!(
        next(&mut events).await,
        Err(Error::NotAStatusEvent { .. })
    ));
    assert_eq!(next(&mut events).await.unwrap(), e2);
    // The repeats of e1 are dropped: e3 comes next.
    assert_eq!(next(&mut events).await.unwrap(), e3);
    events.close().await.expect("close");
    app.eventually(
        "every message acknowledged",
        Duration::from_secs(10),
        || async { app.ready(&queue).await == 0 },
    )
    .await;

    // An event is acknowledged only once the next is asked for: a consumer
    // that stops after receiving it (a crash) gets it again.
    let e4 = event(4, EventKind::Processed);
    publish(bytes(&e4)).await;
    let mut first = client.status(&queue).await.unwrap();
    assert_eq!(next(&mut first).await.unwrap(), e4);
    drop(first);
    let mut again = client.status(&queue).await.unwrap();
    assert_eq!(
        next(&mut again).await.unwrap(),
        e4,
        "handed back, delivered again"
    );
    again.close().await.unwrap();
    app.eventually("e4 acknowledged", Duration::from_secs(10), || async {
        app.ready(&queue).await == 0
    })
    .await;
}

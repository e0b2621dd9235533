//! The Rust client (`sas-client`) against a real deployment: submitting and
//! waiting for an order's end, the status stream's deduplication and its
//! acknowledgement after each event.

use std::time::Duration;

use chrono::{SubsecRound as _, Utc};
use futures_util::StreamExt as _;
use sas::broker::Outgoing;
use sas::messages::{EventKind, StatusEvent};
use sas_client::{Client, Error, Order};
use sas_tests::{TestApp, amqp};
use serde_json::{Map, json};
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
    let client = Client::connect(amqp(), &app.prefix)
        .await
        .expect("connect")
        .with_status_queue(&queue)
        .await
        .expect("status queue");

    let id = client
        .submit(Order::new("three", Map::new()))
        .await
        .expect("submit");
    assert_eq!(id.get_version_num(), 7, "a UUIDv7 order id");
    let terminal = client
        .wait(id, Duration::from_secs(30))
        .await
        .expect("terminal");
    assert!(terminal.succeeded(), "{terminal:?}");
    assert_eq!(terminal.event.seq, 6);
    assert_eq!(terminal.event.order_id, json!(id.to_string()));
    assert_eq!(app.order(id).await, Some(("processed".into(), 0)));

    // Two waits at once, on one queue: whichever reads the other's
    // terminal event keeps it for it.
    let a = client.submit(Order::new("one", Map::new())).await.unwrap();
    let b = client.submit(Order::new("one", Map::new())).await.unwrap();
    let (tb, ta) = tokio::join!(
        client.wait(b, Duration::from_secs(30)),
        client.wait(a, Duration::from_secs(30))
    );
    assert_eq!(ta.unwrap().event.order_id, json!(a.to_string()));
    assert_eq!(tb.unwrap().event.order_id, json!(b.to_string()));

    // An unknown workflow is the submission's to reject: `rejected`, seq 0.
    let rejected = client
        .submit(Order::new("no-such-workflow", Map::new()))
        .await
        .unwrap();
    let terminal = client
        .wait(rejected, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(terminal.state(), EventKind::Rejected);
    assert_eq!(terminal.event.seq, 0);

    // What the submission would reject for its form is refused unsent.
    let refused = client.submit(Order::new("", Map::new())).await;
    assert!(
        matches!(refused, Err(Error::InvalidOrder(_))),
        "{refused:?}"
    );
    // Waiting is bounded.
    let never = client
        .wait(Uuid::now_v7(), Duration::from_millis(300))
        .await;
    assert!(matches!(never, Err(Error::Timeout { .. })), "{never:?}");
    client.close().await;
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

//! Hostile input (contract §1a), against the real services, Postgres and
//! RabbitMQ: each class of the security review's findings alone among good
//! orders, then thousands of generated hostile orders mixed with good ones.
//! Every good order is processed, every bad one is rejected with a reason
//! or dead-lettered with `x-sas-reason`, no service restarts and the broker
//! closes no connection.

use std::collections::BTreeSet;
use std::time::Duration;

use proptest::prelude::*;
use remote_sim::Knobs;
use sas::broker::Outgoing;
use sas_tests::TestApp;
use sas_tests::hostile::{assert_unharmed, draw, ends, seeded};
use serde_json::{Value, json};
use uuid::Uuid;

/// Marks a message the submission panics on (`SAS_PANIC_ON`).
const SUBMISSION_PANICS: &str = "panic-in-the-submission";
/// Marks a step request the agent panics on.
const AGENT_PANICS: &str = "panic-in-the-agent";

/// Starts the four services, with the panic markers armed.
async fn start(app: &TestApp) {
    app.start_with_env(
        "submission",
        "submission",
        &[],
        &[("SAS_PANIC_ON", SUBMISSION_PANICS)],
    )
    .await;
    app.start("scheduler", "scheduler", &[]).await;
    app.start_with_env("agent", "agent", &[], &[("SAS_PANIC_ON", AGENT_PANICS)])
        .await;
    app.start("supervisor", "supervisor", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_class_of_the_review_is_set_aside_alone_and_the_orders_around_it_are_processed() {
    let app = TestApp::builder()
        // Long enough for a debug remote-sim to build a 20 MB answer on a
        // busy machine; the agent's panics use it up twice.
        .step_timeout("6s")
        .max_failures(2)
        .build()
        .await;
    start(&app).await;
    let status = app.status_queue("status").await;
    // The third step's remote answers 20 MB: more than max_response_bytes.
    app.knobs(
        "c",
        Knobs {
            pad_bytes: 20 * 1024 * 1024,
            ..Knobs::default()
        },
    );
    let bad: Vec<(String, &str)> = vec![
        (
            json!({ "workflow": "one", "payload": {}, "reply_to": "q".repeat(300) }).to_string(),
            "field `reply_to` must be a queue name",
        ),
        (
            json!({ "workflow": "w".repeat(200_000), "payload": {} }).to_string(),
            "field `workflow` must be a name of 1 to 255 bytes",
        ),
        (
            json!({ "workflow": "one", "payload": {}, "not_before": "9999-12-31T23:59:59-23:00" })
                .to_string(),
            "field `not_before` must be an RFC 3339 timestamp from year 0001 to 9999",
        ),
        (
            json!({ "workflow": "x".repeat(200), "payload": {} }).to_string(),
            "unknown workflow",
        ),
        (
            json!({ "workflow": "one", "payload": { "note": SUBMISSION_PANICS } }).to_string(),
            "internal_error",
        ),
    ];
    let mut good = Vec::new();
    for (body, _) in &bad {
        good.push(app.submit("one", Some(&status)).await);
        app.publish_raw(body.as_bytes(), Some(&status), None).await;
    }
    good.push(app.submit("one", Some(&status)).await);
    // A step request the agent panics on, and an answer too large to keep.
    let agent_panics = Uuid::new_v4();
    let body =
        json!({ "order_id": agent_panics, "workflow": "one", "payload": { "note": AGENT_PANICS } });
    app.publish_raw(body.to_string().as_bytes(), Some(&status), None)
        .await;
    let too_large = app.submit("three", Some(&status)).await;
    good.push(app.submit("one", Some(&status)).await);

    let events = app
        .collect(&status, Duration::from_secs(60), |got| {
            let ended = ends(got);
            good.iter()
                .chain([&agent_panics, &too_large])
                .all(|id| ended.contains_key(&id.to_string()))
                && got.iter().filter(|e| e["state"] == "rejected").count() >= bad.len() - 2
        })
        .await;
    let ended = ends(&events);
    for id in &good {
        assert_eq!(ended[&id.to_string()], "processed", "{id}");
    }
    // The agent panicked on every dispatch: the supervisor gave up.
    assert_eq!(ended[&agent_panics.to_string()], "failed");
    // The 20 MB answer failed its step for good: the first two are undone.
    assert_eq!(ended[&too_large.to_string()], "compensated");
    let story: Vec<&Value> = events
        .iter()
        .filter(|e| e["order_id"] == too_large.to_string())
        .collect();
    assert!(
        story
            .iter()
            .any(|e| e.to_string().contains("max_response_bytes")),
        "{story:?}"
    );

    // Every bad order is in the dead-letter queue, body untouched, with a
    // bounded reason; those whose reply queue was usable were told.
    let dead = app.drain(app.queues.orders_dead()).await;
    assert_eq!(dead.len(), bad.len(), "{dead:?}");
    for (body, reason) in &bad {
        let (_, why) = dead
            .iter()
            .find(|(b, _)| b == body.as_bytes())
            .unwrap_or_else(|| panic!("{reason}: not dead-lettered"));
        let why = why.as_deref().unwrap_or_default();
        assert!(why.contains(reason), "{why:?} does not say {reason:?}");
        assert!(why.len() <= 512, "a reason of {} bytes", why.len());
    }
    let agent_dead = app
        .drain(&format!("{}.dead", app.queues.agent_requests("a")))
        .await;
    assert!(!agent_dead.is_empty());
    assert!(
        agent_dead
            .iter()
            .all(|(_, why)| why.as_deref() == Some("internal_error")),
        "{agent_dead:?}"
    );
    for name in ["submission", "agent"] {
        let metrics = app.metrics(name).await;
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("sas_handler_panics_total ") && !l.ends_with(" 0")),
            "{name}: {metrics}"
        );
    }
    assert_unharmed(&app).await;
}

/// A JSON string literal of hostile text.
fn hostile_text() -> impl Strategy<Value = String> + Clone {
    prop_oneof![
        Just(String::new()),
        Just("\\u0000".to_owned()),
        Just("\\ud800".to_owned()),
        Just("\\udc00\\ud800".to_owned()),
        Just("\\u001b[2J\\u0007".to_owned()),
        (256usize..2000).prop_map(|n| "q".repeat(n)),
        (0usize..300).prop_map(|n| "é".repeat(n)),
        Just("a\\nb".to_owned()),
    ]
}

/// One order that must be refused, with the property reply queue set to
/// the test's status queue so its rejection can be told.
fn bad_order() -> impl Strategy<Value = Vec<u8>> {
    let text = hostile_text();
    prop_oneof![
        // Not JSON, or not an object.
        proptest::collection::vec(any::<u8>(), 0..64).prop_map(|mut b| {
            b.insert(0, b'{');
            b
        }),
        Just(b"[1,2,3]".to_vec()),
        Just(b"\"order\"".to_vec()),
        Just(format!("{}{}", "[".repeat(5000), "]".repeat(5000)).into_bytes()),
        // A required field missing or of the wrong kind.
        Just(br#"{"payload":{}}"#.to_vec()),
        Just(br#"{"workflow":"one"}"#.to_vec()),
        Just(br#"{"workflow":"one","payload":[]}"#.to_vec()),
        // Names beyond what can be routed or stored.
        text.clone()
            .prop_map(|t| format!(r#"{{"workflow":"{t}","payload":{{}}}}"#).into_bytes()),
        // (A reply queue that is a name would be where the rejection goes:
        // only unusable ones here, so the test's queue hears of each.)
        prop_oneof![
            (256usize..2000).prop_map(|n| "q".repeat(n)),
            Just(String::new()),
            Just("a\\nb".to_owned()),
            Just("\\u0000".to_owned()),
        ]
        .prop_map(|t| {
            format!(r#"{{"workflow":"one","payload":{{}},"reply_to":"{t}","priority":99}}"#)
                .into_bytes()
        }),
        // Unstorable payloads, numbers and times.
        text.prop_map(|t| {
            format!(r#"{{"workflow":"one","payload":{{"k":"\u0000{t}"}}}}"#).into_bytes()
        }),
        Just(br#"{"workflow":"one","payload":{"k":"\ud800"}}"#.to_vec()),
        Just(br#"{"workflow":"one","payload":{"n":1e400}}"#.to_vec()),
        Just(br#"{"workflow":"one","payload":{"n":1.7976931348623157e308}}"#.to_vec()),
        (64usize..200).prop_map(|n| {
            format!(
                r#"{{"workflow":"one","payload":{{"d":{}{}}}}}"#,
                "[".repeat(n),
                "]".repeat(n)
            )
            .into_bytes()
        }),
        prop_oneof![
            Just("10"),
            Just("-1"),
            Just("1.5"),
            Just("18446744073709551616"),
            Just("\"9\"")
        ]
        .prop_map(
            |p| format!(r#"{{"workflow":"one","payload":{{}},"priority":{p}}}"#).into_bytes()
        ),
        prop_oneof![
            Just("9999-12-31T23:59:59-23:00"),
            Just("+10000-01-01T00:00:00Z"),
            Just("2030-02-30T00:00:00Z"),
            Just("0000-01-01T00:00:00Z"),
            Just("yesterday"),
        ]
        .prop_map(
            |t| format!(r#"{{"workflow":"one","payload":{{}},"not_before":"{t}"}}"#).into_bytes()
        ),
        // Ids of the wrong kind, however large.
        (0usize..5000).prop_map(|n| {
            format!(
                r#"{{"order_id":{{"x":"{}"}},"workflow":"one","payload":{{}}}}"#,
                "i".repeat(n)
            )
            .into_bytes()
        }),
        // Duplicate keys: the last one counts, and names no workflow.
        Just(br#"{"workflow":"one","workflow":"none","payload":{}}"#.to_vec()),
    ]
}

/// One order that must be processed, however odd its (legal) content.
fn good_order(id: Uuid) -> impl Strategy<Value = Vec<u8>> {
    let payload = prop_oneof![
        Just("{}".to_owned()),
        Just(r#"{"k":"\u001b[31m\u0007 control characters are data"}"#.to_owned()),
        Just(r#"{"k":"\ud83d\ude00 a surrogate pair","k":"duplicate key: last wins"}"#.to_owned()),
        Just(format!(
            r#"{{"deep":{}1{}}}"#,
            "[".repeat(60),
            "]".repeat(60)
        )),
        Just(format!(r#"{{"many":[{}]}}"#, vec!["1"; 20_000].join(","))),
        Just(r#"{"n":-9223372036854775808,"m":1e300,"t":5e-324}"#.to_owned()),
        (0usize..5000).prop_map(|n| format!(r#"{{"text":"{}"}}"#, "ж".repeat(n))),
    ];
    (payload, 0u8..=9).prop_map(move |(payload, priority)| {
        format!(
            r#"{{"order_id":"{id}","workflow":"one","payload":{payload},"priority":{priority},"not_before":"2001-01-01T00:00:00Z"}}"#
        )
        .into_bytes()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_thousand_generated_hostile_orders_among_a_thousand_good_ones_harm_none() {
    const BAD: usize = 5000;
    const GOOD: usize = 1000;
    let app = TestApp::new().await;
    start(&app).await;
    let status = app.status_queue("status").await;
    // A fixed seed: a failure can be replayed.
    let mut runner = seeded(7);
    let mut good = BTreeSet::new();
    let mut messages = Vec::with_capacity(BAD + GOOD);
    for i in 0..BAD + GOOD {
        if i % 6 == 0 {
            let id = Uuid::new_v4();
            good.insert(id.to_string());
            messages.push(draw(&mut runner, good_order(id)));
        } else {
            messages.push(draw(&mut runner, bad_order()));
        }
    }
    let bad = messages.len() - good.len();
    // A few bodies over the size limit too.
    for _ in 0..3 {
        messages.push(vec![b' '; 2 * 1024 * 1024]);
    }
    let bad = bad + 3;
    let publisher = app.publisher();
    for chunk in messages.chunks(200) {
        let mut pending = Vec::new();
        for body in chunk {
            let msg = Outgoing {
                routing_key: app.queues.orders(),
                body,
                reply_to: Some(&status),
                mandatory: true,
                ..Outgoing::default()
            };
            pending.push(publisher.send(&msg).await.expect("publish"));
        }
        for p in pending {
            p.wait().await.expect("confirm");
        }
    }
    let events = app
        .collect(&status, Duration::from_secs(240), |got| {
            let rejected = got.iter().filter(|e| e["state"] == "rejected").count();
            rejected >= bad && ends(got).len() >= good.len()
        })
        .await;
    let ended = ends(&events);
    for id in &good {
        assert_eq!(
            ended.get(id).map(String::as_str),
            Some("processed"),
            "good order {id}"
        );
    }
    let rejected: Vec<&Value> = events.iter().filter(|e| e["state"] == "rejected").collect();
    assert_eq!(rejected.len(), bad);
    for r in &rejected {
        let error = r["detail"]["error"].as_str().unwrap_or_default();
        assert!(!error.is_empty() && error.len() <= 512, "{r}");
        assert!(
            !good.contains(r["order_id"].as_str().unwrap_or_default()),
            "a good order was rejected: {r}"
        );
    }
    let dead = app.drain(app.queues.orders_dead()).await;
    assert_eq!(dead.len(), bad);
    // Bodies over the limit are dead-lettered by the broker, not copied
    // with a reason (a copy would hold them twice).
    assert!(
        dead.iter().all(|(body, why)| match why {
            Some(w) => !w.is_empty() && w.len() <= 512,
            None => body.len() > 1 << 20,
        }),
        "a dead letter without a bounded reason"
    );
    assert_unharmed(&app).await;
}

/// Consumes `queue` with a handler that fails every message the way no retry
/// mends, until its dead-letter queue holds one; returns how many times the
/// handler ran and the dead letter's reason.
async fn fail_until_dead_lettered(
    app: &TestApp,
    queue: &str,
    dead: &str,
    max_tries: u32,
) -> (usize, Option<String>) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use sas::broker::{self, DeadLetters};
    use tokio_util::sync::CancellationToken;

    app.publisher()
        .publish(&Outgoing {
            routing_key: queue,
            body: b"{\"poison\":true}",
            mandatory: true,
            ..Outgoing::default()
        })
        .await
        .expect("published");
    let runs = Arc::new(AtomicUsize::new(0));
    let subscription = app
        .subscribe(queue, 4)
        .await
        .with_dead_letters(DeadLetters::new(
            app.publisher(),
            queue,
            max_tries,
            Default::default(),
        ));
    let stop = CancellationToken::new();
    let consuming = {
        let (runs, stop) = (runs.clone(), stop.clone());
        tokio::spawn(async move {
            let lost = CancellationToken::new();
            broker::consume(subscription, &stop, &lost, Duration::from_secs(2), |d| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    broker::retry_counted(&d, "could not apply: always fails").await
                }
            })
            .await
        })
    };
    app.eventually(
        "the poison message is dead-lettered",
        Duration::from_secs(20),
        || async { app.ready(dead).await == 1 },
    )
    .await;
    stop.cancel();
    consuming.await.expect("consumer").expect("no broker error");
    let taken = app.drain(dead).await;
    assert_eq!(app.ready(queue).await, 0, "nothing left in {queue}");
    let (body, reason) = taken.into_iter().next().expect("one dead letter");
    assert_eq!(body, b"{\"poison\":true}", "the body is untouched");
    (runs.load(Ordering::SeqCst), reason)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_fails_every_time_is_dead_lettered_after_bounded_tries_on_classic_and_quorum_queues()
 {
    let app = TestApp::new().await;
    // The test deployment's step queues are classic (the default); a
    // quorum queue of the test's own beside them.
    let classic = app.queues.replies().to_owned();
    let (runs, reason) =
        fail_until_dead_lettered(&app, &classic, app.queues.replies_dead(), 3).await;
    assert_eq!(runs, 3, "one run per try");
    assert_eq!(reason.as_deref(), Some("could not apply: always fails"));

    let quorum = format!("{}.app.quorum-steps", app.prefix);
    let quorum_dead = format!("{quorum}.dead");
    app.declare_queue(&quorum_dead, None).await;
    app.declare_queue(&quorum, Some(&quorum_dead)).await;
    let (runs, reason) = fail_until_dead_lettered(&app, &quorum, &quorum_dead, 4).await;
    assert_eq!(runs, 4);
    assert_eq!(reason.as_deref(), Some("could not apply: always fails"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_or_replay_naming_a_queue_of_sas_as_its_reply_to_is_refused_and_publishes_nothing_there()
 {
    let app = TestApp::new().await;
    start(&app).await;
    let status = app.status_queue("status").await;
    let q = &app.queues;
    let agent_requests = q.agent_requests("a");
    let own = [
        q.replay(),
        q.alerts(),
        q.orders_dead(),
        q.replay_dead(),
        agent_requests.as_str(),
        q.replies(),
        // (RabbitMQ itself refuses a publish naming its direct reply-to
        // without a consumer: a name of the broker's that it lets through.)
        "amq.gen-forged",
    ];
    // Each of sas's queues named in the body, then as the AMQP property,
    // with a good order before each.
    let mut good = Vec::new();
    let mut bad = Vec::new();
    for queue in own {
        good.push(app.submit("one", Some(&status)).await);
        let body = json!({ "order_id": Uuid::new_v4(), "workflow": "one", "payload": {}, "reply_to": queue });
        app.publish_raw(body.to_string().as_bytes(), Some(&status), None)
            .await;
        bad.push(body.to_string());
        let body = json!({ "order_id": Uuid::new_v4(), "workflow": "one", "payload": {} });
        app.publish_raw(body.to_string().as_bytes(), Some(queue), None)
            .await;
        bad.push(body.to_string());
    }
    let events = app
        .collect(&status, Duration::from_secs(60), |got| {
            ends(got).len() >= good.len()
                && got.iter().filter(|e| e["state"] == "rejected").count() >= own.len()
        })
        .await;
    let ended = ends(&events);
    for id in &good {
        assert_eq!(ended[&id.to_string()], "processed", "{id}");
    }
    // Only the body-named ones could be told (the property was the reply queue).
    let rejected: Vec<&Value> = events.iter().filter(|e| e["state"] == "rejected").collect();
    assert_eq!(rejected.len(), own.len(), "{rejected:?}");
    let dead = app.drain(q.orders_dead()).await;
    assert_eq!(dead.len(), bad.len(), "{dead:?}");
    for (body, why) in &dead {
        let why = why.as_deref().unwrap_or_default();
        assert!(bad.iter().any(|b| b.as_bytes() == body), "{why}");
        assert!(why.contains("a queue of sas"), "{why}");
    }

    // Replay requests into sas's queues, or a status event posing as one:
    // refused, and nothing replays into the replay queue.
    let first = good[0];
    let publisher = app.publisher();
    for to in [q.replay(), q.alerts(), agent_requests.as_str()] {
        publisher
            .publish(&Outgoing {
                routing_key: q.replay(),
                body: json!({ "order_id": first, "from_seq": 1 })
                    .to_string()
                    .as_bytes(),
                reply_to: Some(to),
                mandatory: true,
                ..Outgoing::default()
            })
            .await
            .expect("published");
    }
    let event = events
        .iter()
        .find(|e| e["order_id"] == first.to_string())
        .expect("an event of the first order");
    publisher
        .publish(&Outgoing {
            routing_key: q.replay(),
            body: event.to_string().as_bytes(),
            mandatory: true,
            ..Outgoing::default()
        })
        .await
        .expect("published");
    app.eventually(
        "four replay requests dead-lettered",
        Duration::from_secs(20),
        || async { app.ready(q.replay_dead()).await >= 4 },
    )
    .await;
    let refused = app.drain(q.replay_dead()).await;
    assert_eq!(refused.len(), 4, "{refused:?}");
    let reasons: Vec<String> = refused.into_iter().filter_map(|(_, w)| w).collect();
    assert_eq!(
        reasons
            .iter()
            .filter(|w| w.contains("a queue of sas"))
            .count(),
        3,
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|w| w.contains("unknown field")),
        "{reasons:?}"
    );
    // Nothing went where an application pointed: no alert, no stray
    // request, no replay feeding itself.
    assert_eq!(app.ready(q.alerts()).await, 0, "a forged alert");
    assert_eq!(app.ready(q.replay()).await, 0);
    assert_eq!(app.ready(q.orders_dead()).await, 0);
    let replays = app.metrics("submission").await;
    let served: u64 = replays
        .lines()
        .filter(|l| l.starts_with("sas_replays_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    assert_eq!(served, 4, "{replays}");
    assert_unharmed(&app).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_nested_thousands_deep_or_filling_a_frame_stop_no_service_and_delay_no_order() {
    use sas_tests::raw_amqp::{Properties, RawPublisher, nested_arrays, wide_table};

    let app = TestApp::new().await;
    start(&app).await;
    let status = app.status_queue("status").await;
    let q = &app.queues;
    let mut raw = RawPublisher::connect().await.expect("raw connection");
    // Fills the largest frame a publisher may send, less the rest of the
    // content header.
    let frame = raw.frame_max() as usize;
    let deep = nested_arrays("x-deep", 24_000);
    let deep_table = {
        // The same depth through tables: {"t": {"t": …}}.
        let levels = 12_000;
        let mut t = Vec::with_capacity(7 * levels);
        for level in 1..=levels {
            t.extend_from_slice(&[1, b't', b'F']);
            t.extend_from_slice(&((7 * (levels - level)) as u32).to_be_bytes());
        }
        t
    };
    let good_body = |id: Uuid| {
        json!({ "order_id": id, "workflow": "one", "payload": {} })
            .to_string()
            .into_bytes()
    };
    let mut good = Vec::new();
    let mut refused = Vec::new();
    // Deep headers on a good order: refused unread, with the reason.
    for headers in [&deep, &deep_table] {
        good.push(app.submit("one", Some(&status)).await);
        let id = Uuid::new_v4();
        refused.push(id);
        raw.publish(
            q.orders(),
            &Properties::new(Some(&status), Some(headers)),
            &good_body(id),
        )
        .await
        .expect("the broker takes it");
    }
    // Headers that fill a frame on a good order: it is processed.
    let mut wide_good = Vec::new();
    for size in [20 * 1024, frame - 1024] {
        good.push(app.submit("one", Some(&status)).await);
        let id = Uuid::new_v4();
        wide_good.push(id);
        raw.publish(
            q.orders(),
            &Properties::new(Some(&status), Some(&wide_table(1, size))),
            &good_body(id),
        )
        .await
        .expect("the broker takes it");
    }
    // Headers that fill a frame on a bad order: its dead-letter copy
    // (original headers and x-sas-reason) must still fit a frame.
    for size in [16 * 1024 - 200, frame - 1024] {
        good.push(app.submit("one", Some(&status)).await);
        raw.publish(
            q.orders(),
            &Properties::new(Some(&status), Some(&wide_table(1, size))),
            b"not json",
        )
        .await
        .expect("the broker takes it");
    }
    // The same at every other queue sas consumes.
    let agent_requests = q.agent_requests("a");
    for queue in [q.replay(), q.replies(), agent_requests.as_str()] {
        for headers in [&deep, &wide_table(1, frame - 1024)] {
            raw.publish(queue, &Properties::new(None, Some(headers)), b"{}")
                .await
                .expect("the broker takes it");
        }
    }
    good.push(app.submit("one", Some(&status)).await);
    raw.close().await;

    let all: Vec<Uuid> = good.iter().chain(&wide_good).copied().collect();
    let events = app
        .collect(&status, Duration::from_secs(60), |got| {
            let ended = ends(got);
            all.iter().all(|id| ended.contains_key(&id.to_string()))
                && got.iter().filter(|e| e["state"] == "rejected").count() >= 2
        })
        .await;
    let ended = ends(&events);
    for id in &all {
        assert_eq!(ended[&id.to_string()], "processed", "{id}");
    }
    for id in &refused {
        assert!(
            !events.iter().any(|e| e["order_id"] == id.to_string()),
            "an order with unreadable headers got events"
        );
    }
    app.eventually(
        "every hostile message dead-lettered",
        Duration::from_secs(30),
        || async {
            app.ready(q.orders_dead()).await == 4
                && app.ready(q.replay_dead()).await == 2
                && app.ready(q.replies_dead()).await == 2
                && app.ready(&q.agent_requests_dead("a")).await == 2
        },
    )
    .await;
    let dead = app.drain(q.orders_dead()).await;
    let nested = dead
        .iter()
        .filter(|(_, why)| {
            why.as_deref()
                .is_some_and(|w| w.contains("nested 64 levels"))
        })
        .count();
    assert_eq!(
        nested,
        2,
        "{:?}",
        dead.iter().map(|d| &d.1).collect::<Vec<_>>()
    );
    for queue in [
        q.replay_dead(),
        q.replies_dead(),
        &q.agent_requests_dead("a"),
    ] {
        let dead = app.drain(queue).await;
        assert!(
            dead.iter().any(|(_, why)| why
                .as_deref()
                .is_some_and(|w| w.contains("nested 64 levels"))),
            "{queue}: {:?}",
            dead.iter().map(|d| &d.1).collect::<Vec<_>>()
        );
    }
    assert_unharmed(&app).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packs_and_replies_larger_than_agents_send_are_set_aside_unread_and_orders_go_on() {
    let app = TestApp::new().await;
    start(&app).await;
    let status = app.status_queue("status").await;
    let q = &app.queues;
    let reply = json!({
        "order_id": Uuid::new_v4(), "step": "a", "attempt": 1, "direction": "forward",
        "dispatch_id": Uuid::new_v4(), "locked_by": "nobody", "outcome": "succeeded", "result": {}
    })
    .to_string();
    let hostile = [
        // 100,000 replies in one pack (20 MB), far beyond any message of
        // replies: dead-lettered by the broker, unread and uncopied.
        format!("[{}]", vec![reply.as_str(); 100_000].join(",")).into_bytes(),
        // A pack over an agent's 128 KiB, within a single reply's bound.
        format!("[{}]", vec![reply.as_str(); 1000].join(",")).into_bytes(),
        // More replies than any pack of an agent holds, in few bytes.
        format!("[{}]", vec!["{}"; 5000].join(",")).into_bytes(),
        // One reply far larger than any remote's answer may make it.
        format!(r#"{{"pad":"{}"}}"#, "p".repeat(16 << 20)).into_bytes(),
    ];
    let publisher = app.publisher();
    let mut good = Vec::new();
    for body in &hostile {
        good.push(app.submit("one", Some(&status)).await);
        publisher
            .publish(&Outgoing {
                routing_key: q.replies(),
                body,
                mandatory: true,
                ..Outgoing::default()
            })
            .await
            .expect("published");
    }
    good.push(app.submit("one", Some(&status)).await);
    let events = app
        .collect(&status, Duration::from_secs(60), |got| {
            ends(got).len() >= good.len()
        })
        .await;
    let ended = ends(&events);
    for id in &good {
        assert_eq!(ended[&id.to_string()], "processed", "{id}");
    }
    app.eventually("the four set aside", Duration::from_secs(20), || async {
        app.ready(q.replies_dead()).await == 4
    })
    .await;
    let dead = app.drain(q.replies_dead()).await;
    let reasons: Vec<Option<String>> = dead.into_iter().map(|(_, why)| why).collect();
    assert!(
        reasons
            .iter()
            .flatten()
            .any(|w| w.contains("agents pack at most")),
        "{reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .flatten()
            .any(|w| w.contains("at most 1024 replies")),
        "{reasons:?}"
    );
    // The 20 MB pack and the 16 MiB reply went through the broker's own
    // dead-lettering, uncopied.
    assert_eq!(
        reasons
            .iter()
            .flatten()
            .filter(|w| w.starts_with("dead-lettered by the broker"))
            .count(),
        2,
        "{reasons:?}"
    );
    assert_unharmed(&app).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_message_carrying_a_live_orders_id_never_reaches_its_application_as_a_rejection() {
    let app = TestApp::new().await;
    start(&app).await;
    let status = app.status_queue("status").await;
    let live = app.submit("three", Some(&status)).await;
    app.eventually("the live order stored", Duration::from_secs(20), || async {
        app.order(live).await.is_some()
    })
    .await;
    // A stranger's bad messages with the live order's id, naming its
    // status queue: an unknown workflow, a missing payload, a wrong type.
    let forged = [
        json!({ "order_id": live, "workflow": "no-such-workflow", "payload": {} }),
        json!({ "order_id": live, "workflow": "one" }),
        json!({ "order_id": live, "workflow": "one", "payload": {}, "priority": 99 }),
    ];
    for body in &forged {
        app.publish_raw(body.to_string().as_bytes(), Some(&status), None)
            .await;
    }
    // And one with an id no order has: that one is echoed as given.
    let unknown = Uuid::new_v4();
    let body = json!({ "order_id": unknown, "workflow": "one" });
    app.publish_raw(body.to_string().as_bytes(), Some(&status), None)
        .await;
    let events = app
        .collect(&status, Duration::from_secs(60), |got| {
            ends(got).contains_key(&live.to_string())
                && got.iter().filter(|e| e["state"] == "rejected").count() > forged.len()
        })
        .await;
    assert_eq!(ends(&events)[&live.to_string()], "processed");
    let rejected: Vec<&Value> = events.iter().filter(|e| e["state"] == "rejected").collect();
    assert!(
        rejected.iter().all(|e| e["order_id"] != live.to_string()),
        "a rejection echoed the live order's id: {rejected:?}"
    );
    assert_eq!(
        rejected.iter().filter(|e| e["order_id"].is_null()).count(),
        forged.len(),
        "{rejected:?}"
    );
    assert!(
        rejected
            .iter()
            .any(|e| e["order_id"] == unknown.to_string()),
        "{rejected:?}"
    );
    assert_eq!(
        app.drain(app.queues.orders_dead()).await.len(),
        forged.len() + 1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_child_workflow_requests_and_ends_touch_no_child_and_no_parent() {
    // sas's own agent of child workflows reads `<prefix>.children.requests`
    // and `<prefix>.children.ended`. A stranger who can publish there and
    // knows a parent's id and its step's name (ids and step names are the
    // applications' own) tries to undo a live child, to take its parent's
    // step over with the largest fencing token, and to end a child early.
    let app = TestApp::builder()
        .extra_config(sas_tests::CHILD_WORKFLOWS)
        .build()
        .await;
    // The children's one step is slow: they are live while the forgeries come.
    app.knobs(
        "b",
        Knobs {
            latency_ms: 1500,
            ..Knobs::default()
        },
    );
    start(&app).await;
    let status = app.status_queue("status").await;
    let q = &app.queues;
    let parents = [
        app.submit("parent", Some(&status)).await,
        app.submit("parent", Some(&status)).await,
    ];
    let children = parents.map(|p| sas_tests::child_of(p, "ship"));
    // Each child's request as the step sent it: what a forgery starts from.
    let mut real = Vec::new();
    for child in children {
        let remembered = || async {
            sqlx::query_scalar::<_, Value>("SELECT request FROM children WHERE child_id = $1")
                .bind(child)
                .fetch_optional(&app.db)
                .await
                .expect("children")
        };
        app.eventually("the child started", Duration::from_secs(20), || async {
            remembered().await.is_some()
        })
        .await;
        real.push(remembered().await.expect("remembered"));
    }
    let forge = |real: &Value, changes: Value| {
        let mut forged = real.clone();
        for (k, v) in changes.as_object().expect("changes") {
            forged[k] = v.clone();
        }
        forged.to_string().into_bytes()
    };
    let token = json!(i64::MAX);
    let requests = [
        // Undo the first child, with a token above every dispatch's.
        forge(
            &real[0],
            json!({ "direction": "compensate", "dispatch_id": Uuid::new_v4(), "fencing_token": token }),
        ),
        // Take the second parent's step over: its child's end would answer
        // this request, and the step's next dispatch be refused as older.
        forge(
            &real[1],
            json!({ "dispatch_id": Uuid::new_v4(), "fencing_token": token }),
        ),
        // The real dispatch id with another token, or as an undo.
        forge(&real[1], json!({ "fencing_token": token })),
        forge(&real[0], json!({ "direction": "compensate" })),
        // A step that is not a child workflow's, and a step of no order.
        forge(
            &real[0],
            json!({ "step": "reserve", "step_index": 0, "direction": "compensate" }),
        ),
        forge(&real[0], json!({ "order_id": Uuid::new_v4() })),
        b"not a request".to_vec(),
    ];
    // Ends no child reached: failed, compensated, processed with results
    // of the stranger's own.
    let event = |child: Uuid, state: &str, detail: Value| {
        json!({ "order_id": child, "seq": 3, "state": state, "at": "2026-01-01T00:00:00Z", "detail": detail })
            .to_string()
            .into_bytes()
    };
    let forged_ends = [
        event(children[0], "failed", json!({ "error": "forged" })),
        event(
            children[1],
            "processed",
            json!({ "results": { "forged": true } }),
        ),
        event(children[0], "compensated", json!({})),
    ];
    let publisher = app.publisher();
    for (queue, bodies) in [
        (q.children(), &requests[..]),
        (q.children_ended(), &forged_ends[..]),
    ] {
        for body in bodies {
            publisher
                .publish(&Outgoing {
                    routing_key: queue,
                    body,
                    mandatory: true,
                    ..Outgoing::default()
                })
                .await
                .expect("published");
        }
    }
    let events = app
        .collect(&status, Duration::from_secs(60), |got| {
            ends(got).len() >= parents.len()
        })
        .await;
    let ended = ends(&events);
    for parent in parents {
        assert_eq!(ended[&parent.to_string()], "processed", "{events:?}");
    }
    for child in children {
        assert_eq!(
            app.order(child).await.map(|(s, _)| s).as_deref(),
            Some("processed")
        );
    }
    // Each step's result is its child's, not the stranger's.
    assert!(
        !events.iter().any(|e| e.to_string().contains("forged")),
        "{events:?}"
    );
    app.eventually(
        "the forged requests set aside",
        Duration::from_secs(20),
        || async { app.ready(q.children_dead()).await == requests.len() as u32 },
    )
    .await;
    let dead = app.drain(q.children_dead()).await;
    for (_, why) in &dead {
        assert!(why.is_some(), "{dead:?}");
    }
    let stats = app.stats();
    assert!(
        stats.keys.values().all(|k| !k.undone),
        "nothing was undone: {:?}",
        stats.keys
    );
    assert_unharmed(&app).await;
}

//! Deadlines and fencing: an agent drops requests past complete-by and stays
//! silent when complete-by passes mid-call; a reply that answers a superseded
//! dispatch or attempt changes nothing.

use std::time::Duration;

use chrono::Utc;
use remote_sim::Knobs;
use sas::messages::{Direction, StepOutcome, StepReply, StepRequest};
use sas_tests::TestApp;
use serde_json::{Map, Value, json};
use uuid::Uuid;

fn request(complete_in_ms: i64) -> StepRequest {
    StepRequest {
        order_id: Uuid::new_v4(),
        workflow: "one".into(),
        step: "a".into(),
        step_index: 0,
        direction: Direction::Forward,
        attempt: 1,
        dispatch_id: Uuid::new_v4(),
        locked_by: "nobody".into(),
        complete_by: Utc::now() + chrono::Duration::milliseconds(complete_in_ms),
        payload: json!({}),
        results: Map::new(),
        fencing_token: 1,
        timeout_ms: None,
        max_complete_by: None,
        time_left_ms: None,
        redrive: 0,
        in_doubt: false,
        retry: None,
        item: None,
        index: None,
    }
}

/// Sends `req` to the agent of its step (named alike in these workflows).
async fn send_request(app: &TestApp, req: &StepRequest, reply_to: &str) {
    let sent = app.send_request(&req.step, req, reply_to).await;
    sent.wait().await.unwrap();
}

/// The replies on `replies` up to that of a marker: a request that agent
/// `b` answers at once, sent now. What the agent would have said about an
/// earlier request comes before it, so an absence check need not sleep.
async fn replies_up_to_a_marker(app: &TestApp, replies: &str) -> Vec<Value> {
    let marker = StepRequest {
        step: "b".into(),
        ..request(10_000)
    };
    send_request(app, &marker, replies).await;
    let marker = marker.order_id.to_string();
    app.collect_replies(replies, Duration::from_secs(20), |got| {
        got.iter().any(|r| r["order_id"] == marker.as_str())
    })
    .await
    .0
}

/// Whether any of `replies` answers `req`.
fn answers(replies: &[Value], req: &StepRequest) -> bool {
    let id = req.order_id.to_string();
    replies.iter().any(|r| r["order_id"] == id.as_str())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_its_complete_by_is_dropped_without_a_call() {
    let app = TestApp::new().await;
    app.start("agent", "agent", &[]).await;
    let replies = app.status_queue("replies").await;
    let req = request(-1000);
    send_request(&app, &req, &replies).await;
    app.eventually(
        "the agent counted the expired request",
        Duration::from_secs(10),
        || async {
            app.metrics("agent")
                .await
                .contains(r#"outcome="expired"} 1"#)
        },
    )
    .await;
    assert_eq!(app.stats().total_calls, 0);
    let before_marker = replies_up_to_a_marker(&app, &replies).await;
    assert!(!answers(&before_marker, &req), "{before_marker:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_stays_silent_once_complete_by_passes_mid_call() {
    let app = TestApp::new().await;
    app.knobs(
        "a",
        Knobs {
            status: Some(503),
            ..Knobs::default()
        },
    );
    app.start("agent", "agent", &[]).await;
    let replies = app.status_queue("replies").await;
    let req = request(600);
    send_request(&app, &req, &replies).await;
    app.eventually(
        "the agent gave up silently",
        Duration::from_secs(10),
        || async {
            app.metrics("agent")
                .await
                .contains(r#"outcome="expired"} 1"#)
        },
    )
    .await;
    let key = format!("{}:a", req.order_id);
    assert!(
        app.stats().keys[&key].calls >= 2,
        "transient failures were retried"
    );
    let before_marker = replies_up_to_a_marker(&app, &replies).await;
    assert!(
        !answers(&before_marker, &req),
        "nothing is sent after complete-by: {before_marker:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_packs_the_replies_ready_together_into_few_messages_each_reply_once() {
    let app = TestApp::new().await;
    // The remote answers the 40 calls at once, however their starts are
    // spread: the replies are ready together whatever the machine's load
    // (one CI run on a busy machine spread them so that each went alone).
    app.knobs(
        "a",
        Knobs {
            together: 40,
            hang_ms: 15_000,
            ..Knobs::default()
        },
    );
    app.start("agent", "agent", &[]).await;
    let replies = app.status_queue("replies").await;
    let requests: Vec<StepRequest> = (0..40).map(|_| request(20_000)).collect();
    // Sent at once (confirms awaited after), so that the calls overlap.
    let mut confirms = Vec::new();
    for req in &requests {
        confirms.push(app.send_request("a", req, &replies).await);
    }
    for sent in confirms {
        sent.wait().await.unwrap();
    }
    let (got, messages) = app
        .collect_replies(&replies, Duration::from_secs(20), |g| g.len() >= 40)
        .await;
    let mut dispatches: Vec<Uuid> = got
        .iter()
        .map(|r| {
            serde_json::from_value::<StepReply>(r.clone())
                .unwrap()
                .dispatch_id
        })
        .collect();
    dispatches.sort_unstable();
    let mut sent: Vec<Uuid> = requests.iter().map(|r| r.dispatch_id).collect();
    sent.sort_unstable();
    assert_eq!(dispatches, sent, "every request answered once");
    // Seen: 2 to 7 messages (debug build, both cores busy); without
    // packs, one each.
    assert!(
        messages <= 30,
        "40 replies ready together went as {messages} messages"
    );
    // Each request is acknowledged once its pack is confirmed.
    app.eventually("no request left", Duration::from_secs(10), || async {
        app.metrics("agent")
            .await
            .contains(r#"sas_agent_requests_total{agent="a",outcome="succeeded"} 40"#)
            && app.ready(&app.queues.agent_requests("a")).await == 0
    })
    .await;
    assert!(
        app.metrics("agent")
            .await
            .contains(&format!("sas_reply_messages_total {messages}\n")),
        "the agent counts each message of replies once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_replies_a_permanent_error_at_once() {
    let app = TestApp::new().await;
    app.knobs(
        "a",
        Knobs {
            status: Some(404),
            ..Knobs::default()
        },
    );
    app.start("agent", "agent", &[]).await;
    let replies = app.status_queue("replies").await;
    let req = request(5000);
    send_request(&app, &req, &replies).await;
    let (got, _) = app
        .collect_replies(&replies, Duration::from_secs(10), |g| !g.is_empty())
        .await;
    let reply: StepReply = serde_json::from_value(got[0].clone()).unwrap();
    assert_eq!(reply.dispatch_id, req.dispatch_id);
    assert!(
        matches!(reply.outcome, StepOutcome::Failed { ref error } if error.contains("HTTP 404"))
    );
    assert_eq!(app.stats().keys[&format!("{}:a", req.order_id)].calls, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_to_a_superseded_dispatch_or_attempt_changes_nothing() {
    let app = TestApp::new().await;
    app.knobs(
        "b",
        Knobs {
            hang: true,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let id = app.submit("three", None).await;
    app.eventually("step b is running", Duration::from_secs(20), || async {
        running_dispatch(&app, id).await.is_some()
    })
    .await;
    let (dispatch, locked_by) = running_dispatch(&app, id).await.unwrap();
    let before = snapshot(&app, id).await;
    let reply = |dispatch_id: Uuid, attempt: i32, locked_by: &str| StepReply {
        order_id: id,
        step: "b".into(),
        step_index: 1,
        direction: Direction::Forward,
        attempt,
        dispatch_id,
        locked_by: locked_by.into(),
        traceparent: None,
        outcome: StepOutcome::Succeeded {
            result: json!({ "late": true }),
        },
    };
    // Two in one message (an agent's pack), one alone.
    app.publish_pack(
        &[
            reply(Uuid::new_v4(), 1, &locked_by),
            reply(dispatch, 7, &locked_by),
        ],
        &[],
    )
    .await;
    app.publish_reply(&reply(dispatch, 1, "scheduler-gone"))
        .await;
    app.eventually(
        "three stale replies counted",
        Duration::from_secs(10),
        || async {
            app.metrics("scheduler")
                .await
                .contains(r#"sas_replies_total{outcome="stale"} 3"#)
        },
    )
    .await;
    assert_eq!(
        snapshot(&app, id).await,
        before,
        "a stale reply changed the order"
    );
    // The reply the running dispatch is waiting for moves the order on,
    // packed with a stale one and one that cannot be read: that one is the
    // message's own, dead-lettered, and keeps no other reply from its order.
    app.knobs("b", Knobs::default());
    app.publish_pack(
        &[
            reply(Uuid::new_v4(), 1, &locked_by),
            reply(dispatch, 1, &locked_by),
        ],
        &[r#"{"not":"a reply"}"#],
    )
    .await;
    app.eventually(
        "the order is processed",
        Duration::from_secs(20),
        || async { app.order(id).await.is_some_and(|(s, _)| s == "processed") },
    )
    .await;
    assert!(
        app.metrics("scheduler")
            .await
            .contains(r#"sas_replies_total{outcome="stale"} 4"#),
        "the pack's stale reply counted, its live one applied"
    );
    app.eventually(
        "the pack dead-lettered",
        Duration::from_secs(10),
        || async { app.ready(app.queues.replies_dead()).await == 1 },
    )
    .await;
    let dead = app.drain(app.queues.replies_dead()).await;
    let reason = dead[0].1.as_deref().unwrap_or_default();
    assert!(reason.starts_with("unreadable reply"), "{reason}");
    assert!(
        app.metrics("scheduler")
            .await
            .contains(r#"sas_replies_total{outcome="malformed"} 1"#)
    );
}

async fn running_dispatch(app: &TestApp, id: Uuid) -> Option<(Uuid, String)> {
    sqlx::query_as(
        "SELECT s.dispatch_id, o.locked_by FROM steps s JOIN orders o USING (order_id) \
         WHERE s.order_id = $1 AND s.idx = 1 AND s.state = 'running'",
    )
    .bind(id)
    .fetch_optional(&app.db)
    .await
    .unwrap()
}

async fn snapshot(app: &TestApp, id: Uuid) -> Value {
    let row: (Value,) = sqlx::query_as(
        "SELECT jsonb_build_object('order', (SELECT to_jsonb(o) - 'updated_at' FROM orders o WHERE order_id = $1), \
           'steps', (SELECT jsonb_agg(to_jsonb(s) ORDER BY idx) FROM steps s WHERE order_id = $1))",
    )
    .bind(id)
    .fetch_one(&app.db)
    .await
    .unwrap();
    row.0
}

/// A reply whose order another transaction holds waits for it to write back,
/// then, as that transaction changed the order meanwhile, judges the reply
/// again against the order and steps as that transaction left them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_that_waited_for_the_orders_lock_sees_the_steps_as_they_were_left() {
    use sas::engine::{Actor, ClaimBounds, ReplyOutcome, Transitions};
    use sas::state_store::{NewOrder, StateStore};
    use sqlx::Connection as _;

    let app = TestApp::new().await;
    let settings = sas::config::Settings::load(Some(&app.config)).expect("settings");
    let wf = settings.workflow("one").expect("workflow");
    let store = StateStore::from_pool(app.db.clone());
    let t = Transitions::new(store, app.queues.clone());
    let order = NewOrder {
        order_id: Uuid::new_v4(),
        workflow: "one".into(),
        payload: json!({}),
        reply_to: None,
        priority: 0,
        not_before: None,
        trace_id: None,
        trace_span: None,
        events: sas::messages::Events::All,
        application: None,
        app_order_id: None,
    };
    t.submit(&order, &wf).await.expect("submit");
    let me = Actor::new_instance("scheduler");
    let claimed = t
        .claim(&me, ClaimBounds::orders(1, 1))
        .await
        .expect("claim");
    assert_eq!(claimed.ids.len(), 1);
    let (dispatch_id, attempt): (Uuid, i32) = sqlx::query_as(
        "SELECT s.dispatch_id, o.failure_count + 1 FROM steps s JOIN orders o USING (order_id) \
         WHERE order_id = $1",
    )
    .bind(order.order_id)
    .fetch_one(&app.db)
    .await
    .expect("dispatch");
    let mut req = request(60_000);
    req.order_id = order.order_id;
    req.dispatch_id = dispatch_id;
    req.attempt = attempt;
    req.locked_by = me.name.clone();
    let reply = StepReply::to(
        &req,
        StepOutcome::Succeeded {
            result: json!({ "ok": true }),
        },
    );

    // Another transaction holds the order and re-dispatches its step.
    let mut other = sqlx::PgConnection::connect(&app.db_url)
        .await
        .expect("connect");
    let mut tx = other.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM orders WHERE order_id = $1 FOR UPDATE")
        .bind(order.order_id)
        .execute(&mut *tx)
        .await
        .expect("lock");
    let applying = tokio::spawn({
        let t = t.clone();
        let me = me.clone();
        async move { t.apply_reply(&me, &reply).await }
    });
    app.wait_for_lock_waiters(1).await;
    assert!(
        !applying.is_finished(),
        "the reply's write-back waits for the order's lock"
    );
    sqlx::query("UPDATE steps SET dispatch_id = $2 WHERE order_id = $1")
        .bind(order.order_id)
        .bind(Uuid::new_v4())
        .execute(&mut *tx)
        .await
        .expect("re-dispatch");
    sqlx::query("UPDATE orders SET updated_at = now() WHERE order_id = $1")
        .bind(order.order_id)
        .execute(&mut *tx)
        .await
        .expect("touch");
    tx.commit().await.expect("commit");

    let outcome = applying
        .await
        .expect("task")
        .expect("applied without error");
    assert_eq!(
        outcome,
        ReplyOutcome::Stale("the dispatch was superseded".into())
    );
    // The write-back it first tried failed whole: no event of it stayed.
    let events: Vec<String> =
        sqlx::query_scalar("SELECT event FROM order_events WHERE order_id = $1 ORDER BY seq")
            .bind(order.order_id)
            .fetch_all(&app.db)
            .await
            .expect("events");
    assert_eq!(events, ["received", "processing"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_answering_into_a_queue_of_sas_is_dead_lettered_and_calls_no_remote() {
    let app = TestApp::new().await;
    app.start("agent", "agent", &[]).await;
    let q = app.queues.clone();
    let agent_requests = q.agent_requests("b");
    for reply_to in [q.replay(), q.alerts(), q.orders(), agent_requests.as_str()] {
        send_request(&app, &request(10_000), reply_to).await;
    }
    let dead = q.agent_requests_dead("a");
    app.eventually(
        "four requests dead-lettered",
        Duration::from_secs(20),
        || async { app.ready(&dead).await == 4 },
    )
    .await;
    let refused = app.drain(&dead).await;
    assert!(
        refused
            .iter()
            .all(|(_, why)| why.as_deref().is_some_and(|w| w.contains("a queue of sas"))),
        "{refused:?}"
    );
    // The schedulers' own reply queue (and one outside sas's names) is answered.
    let replies = app.status_queue("replies").await;
    send_request(&app, &request(10_000), &replies).await;
    send_request(&app, &request(10_000), q.replies()).await;
    app.eventually("both answered", Duration::from_secs(20), || async {
        app.ready(&replies).await == 1 && app.ready(q.replies()).await == 1
    })
    .await;
    assert_eq!(
        app.stats().total_calls,
        2,
        "only the two answerable requests reached the remote"
    );
    for queue in [q.replay(), q.alerts(), q.orders()] {
        assert_eq!(app.ready(queue).await, 0, "{queue}");
    }
}

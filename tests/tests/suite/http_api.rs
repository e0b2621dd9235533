//! The HTTP API of the submission service (contract §9a), end to end: an
//! order posted is processed and shown with its steps and events; one id
//! over HTTP and the queue is one order, whichever comes first (with
//! `[applications]` identities too); `Idempotency-Key`; the event stream,
//! from a `seq` and resumed, ending after the terminal event; cancel and
//! signals; bearer tokens, each application seeing only its own orders; a
//! batch of hostile requests refused while the service goes on; and the
//! OpenAPI document, served and kept in `docs/openapi.json` (run with
//! `SAS_BLESS=1` to write it again), naming every route the service serves.

use std::path::Path;
use std::time::Duration;

use remote_sim::Knobs;
use sas_tests::TestApp;
use sas_tests::app_tokens::{BILLING_HASH, BILLING_TOKEN, SHOP_HASH, SHOP_TOKEN};
use sas_tests::broker_users::BrokerUser;
use sas_tests::raw_amqp::{Properties, RawPublisher, flag, short_string};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use uuid::Uuid;

/// Bound on every wait of these tests.
const WAIT: Duration = Duration::from_secs(30);

/// A client of one submission's API.
struct Api {
    base: String,
    http: reqwest::Client,
}

/// An answer: status, headers, body as JSON (null when not JSON).
struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Value,
}

impl Api {
    fn new(app: &TestApp) -> Self {
        sas::tls::install_crypto_provider();
        let port = app.port("submission");
        Self {
            base: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::builder()
                .timeout(WAIT)
                .build()
                .expect("HTTP client"),
        }
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> Answer {
        let response = request.send().await.expect("the API answers");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let bytes = response.bytes().await.expect("a body");
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Answer {
            status,
            headers,
            body,
        }
    }

    fn with_token(
        request: reqwest::RequestBuilder,
        token: Option<&str>,
    ) -> reqwest::RequestBuilder {
        match token {
            Some(t) => request.bearer_auth(t),
            None => request,
        }
    }

    /// `POST /v1/orders` with `body`, an `Idempotency-Key` and a token.
    async fn submit(&self, body: &Value, key: Option<&str>, token: Option<&str>) -> Answer {
        let mut request = self
            .http
            .post(format!("{}/v1/orders", self.base))
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        self.send(Self::with_token(request, token)).await
    }

    async fn get(&self, path: &str, token: Option<&str>) -> Answer {
        let request = self.http.get(format!("{}{path}", self.base));
        self.send(Self::with_token(request, token)).await
    }

    async fn post(&self, path: &str, body: &str, token: Option<&str>) -> Answer {
        let request = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_owned());
        self.send(Self::with_token(request, token)).await
    }

    /// An event stream read to its end: status, content type, the events
    /// as `(id, data)`.
    async fn stream(
        &self,
        path: &str,
        last_event_id: Option<&str>,
        token: Option<&str>,
    ) -> (u16, String, Vec<(i64, Value)>) {
        let mut request = self.http.get(format!("{}{path}", self.base));
        if let Some(id) = last_event_id {
            request = request.header("last-event-id", id);
        }
        let response = Self::with_token(request, token)
            .send()
            .await
            .expect("the API answers");
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        // Bounded by the client's timeout: a stream that does not end fails.
        let text = response.text().await.expect("the stream ends");
        (status, content_type, sse_events(&text))
    }

    /// The order's view once `done` holds of it.
    async fn wait_for(&self, app: &TestApp, id: Uuid, token: Option<&str>, state: &str) -> Value {
        let path = format!("/v1/orders/{id}");
        app.eventually(&format!("order {id} {state}"), WAIT, || async {
            self.get(&path, token).await.body["state"] == state
        })
        .await;
        self.get(&path, token).await.body
    }
}

/// The events of an event stream's text: `id:` and `data:` of each.
fn sse_events(text: &str) -> Vec<(i64, Value)> {
    text.split("\n\n")
        .filter_map(|block| {
            let mut id = None;
            let mut data = None;
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("id:") {
                    id = v.trim().parse().ok();
                } else if let Some(v) = line.strip_prefix("data:") {
                    assert!(data.is_none(), "one data: line per event: {block}");
                    data = serde_json::from_str(v.trim()).ok();
                }
            }
            Some((id?, data?))
        })
        .collect()
}

/// An order of `workflow` with `extra` fields.
fn order(workflow: &str, extra: Value) -> Value {
    let mut body = json!({ "workflow": workflow, "payload": { "n": 1 } });
    if let (Some(b), Value::Object(e)) = (body.as_object_mut(), extra) {
        b.extend(e);
    }
    body
}

/// How many orders are stored under this id, and how many `received`
/// events they have.
async fn stored(app: &TestApp, id: Uuid) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM orders WHERE order_id = $1 OR app_order_id = $1), \
                (SELECT count(*) FROM order_events e JOIN orders o USING (order_id) \
                 WHERE (o.order_id = $1 OR o.app_order_id = $1) AND e.event = 'received')",
    )
    .bind(id)
    .fetch_one(&app.db)
    .await
    .expect("count orders")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_posted_is_processed_and_shown_with_its_steps_and_events() {
    let app = TestApp::spawn().await;
    let api = Api::new(&app);

    let posted = api.submit(&order("three", json!({})), None, None).await;
    assert_eq!(posted.status, 202, "{}", posted.body);
    let id: Uuid = serde_json::from_value(posted.body["order_id"].clone()).expect("an order_id");
    assert_eq!(
        posted.headers["location"].to_str().unwrap(),
        format!("/v1/orders/{id}")
    );

    let view = api.wait_for(&app, id, None, "processed").await;
    assert_eq!(view["order_id"], id.to_string());
    assert_eq!(view["workflow"], "three");
    assert_eq!(view["attempt"], 1);
    let steps: Vec<(&str, &str)> = view["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["name"].as_str().unwrap(), s["state"].as_str().unwrap()))
        .collect();
    assert_eq!(
        steps,
        [("a", "completed"), ("b", "completed"), ("c", "completed")]
    );
    assert!(view["steps"][0]["result"].is_object(), "{view}");
    let events = view["events"].as_array().unwrap();
    let states: Vec<&str> = events
        .iter()
        .map(|e| e["state"].as_str().unwrap())
        .collect();
    assert_eq!(
        states,
        [
            "received",
            "processing",
            "step_succeeded",
            "step_succeeded",
            "step_succeeded",
            "processed"
        ]
    );
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["seq"], i + 1);
        assert_eq!(e["order_id"], id.to_string());
    }

    // The same id again: 200, the same answer, nothing new.
    let again = api
        .submit(&order("one", json!({ "order_id": id })), None, None)
        .await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.body, json!({ "order_id": id }));
    assert_eq!(stored(&app, id).await, (1, 1));
    // Unknown: 404.
    let unknown = api
        .get(&format!("/v1/orders/{}", Uuid::new_v4()), None)
        .await;
    assert_eq!(unknown.status, 404);
    assert_eq!(unknown.body["error"], "not_found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_id_over_http_and_the_queue_is_one_order_whichever_comes_first() {
    let app = TestApp::spawn().await;
    let api = Api::new(&app);

    // HTTP first, then the queue.
    let first = Uuid::new_v4();
    let posted = api
        .submit(&order("one", json!({ "order_id": first })), None, None)
        .await;
    assert_eq!(posted.status, 202, "{}", posted.body);
    let body = order("one", json!({ "order_id": first, "payload": { "n": 2 } }));
    app.publish_raw(body.to_string().as_bytes(), None, None)
        .await;

    // The queue first, then HTTP (once stored): 200.
    let second = Uuid::new_v4();
    let body = order("one", json!({ "order_id": second }));
    app.publish_raw(body.to_string().as_bytes(), None, None)
        .await;
    app.eventually("the queued order stored", WAIT, || async {
        stored(&app, second).await.0 == 1
    })
    .await;
    let posted = api
        .submit(&order("one", json!({})), Some(&second.to_string()), None)
        .await;
    assert_eq!(posted.status, 200, "{}", posted.body);
    assert_eq!(posted.body, json!({ "order_id": second }));

    for id in [first, second] {
        let view = api.wait_for(&app, id, None, "processed").await;
        assert_eq!(stored(&app, id).await, (1, 1), "{view}");
    }
    // The first body stands: the queue's copy of `first` changed nothing.
    let payload: Value = sqlx::query_scalar("SELECT payload FROM orders WHERE order_id = $1")
        .bind(first)
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(payload, json!({ "n": 1 }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_is_the_order_id_and_must_agree_with_the_body() {
    let app = TestApp::builder().build().await;
    app.start("submission", "submission", &[]).await;
    let api = Api::new(&app);
    let key = Uuid::new_v4();
    // Not before a time far ahead: the order stays pending (no scheduler
    // runs anyway).
    let later = json!({ "not_before": "2999-01-01T00:00:00Z" });
    let first = api
        .submit(&order("one", later.clone()), Some(&key.to_string()), None)
        .await;
    assert_eq!(first.status, 202, "{}", first.body);
    assert_eq!(first.body, json!({ "order_id": key }));
    let again = api
        .submit(&order("one", later.clone()), Some(&key.to_string()), None)
        .await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.body, first.body);
    // The same id in both places is fine; different ids are refused.
    let both = order("one", json!({ "order_id": key }));
    assert_eq!(
        api.submit(&both, Some(&key.to_string()), None).await.status,
        200
    );
    let other = Uuid::new_v4().to_string();
    let conflict = api.submit(&both, Some(&other), None).await;
    assert_eq!(conflict.status, 400);
    assert_eq!(conflict.body["error"], "conflicting_order_id");
    assert!(conflict.body["reason"].is_string());
    for bad in ["abc", "", "00000000-0000-0000-0000-00000000000g"] {
        let refused = api.submit(&order("one", json!({})), Some(bad), None).await;
        assert_eq!(refused.status, 400, "{bad:?}");
        assert_eq!(refused.body["error"], "bad_idempotency_key");
    }
    assert_eq!(stored(&app, key).await, (1, 1));
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(count, 1, "a refused request stored an order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_starts_where_asked_resumes_and_ends_after_the_terminal_event() {
    let app = TestApp::builder().build().await;
    // Slow steps: the stream opens while the order runs, and waits.
    app.knobs(
        "b",
        Knobs {
            latency_ms: 300,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    let api = Api::new(&app);
    let posted = api.submit(&order("three", json!({})), None, None).await;
    assert_eq!(posted.status, 202, "{}", posted.body);
    let id = posted.body["order_id"].as_str().unwrap().to_owned();
    let path = format!("/v1/orders/{id}/events");

    let (status, content_type, live) = api.stream(&path, None, None).await;
    assert_eq!(status, 200);
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    let seqs: Vec<i64> = live.iter().map(|(seq, _)| *seq).collect();
    assert_eq!(seqs, (1..=6).collect::<Vec<_>>());
    for (seq, event) in &live {
        assert_eq!(event["seq"], *seq);
        assert_eq!(event["order_id"], id);
    }
    assert_eq!(live.last().unwrap().1["state"], "processed");
    // The same events as the order's view.
    let view = api.get(&format!("/v1/orders/{id}"), None).await.body;
    let streamed: Vec<Value> = live.iter().map(|(_, e)| e.clone()).collect();
    assert_eq!(view["events"], Value::Array(streamed));

    // From a seq; resumed after a Last-Event-ID (which wins).
    let (_, _, from) = api.stream(&format!("{path}?from_seq=4"), None, None).await;
    assert_eq!(from.iter().map(|e| e.0).collect::<Vec<_>>(), [4, 5, 6]);
    let (_, _, resumed) = api
        .stream(&format!("{path}?from_seq=1"), Some("4"), None)
        .await;
    assert_eq!(resumed.iter().map(|e| e.0).collect::<Vec<_>>(), [5, 6]);
    // After the end: nothing, at once.
    let (status, _, none) = api.stream(&format!("{path}?from_seq=7"), None, None).await;
    assert_eq!((status, none.len()), (200, 0));
    let (_, _, none) = api.stream(&path, Some("6"), None).await;
    assert!(none.is_empty());

    // Refusals.
    for bad in ["?from_seq=x", "?from_seq=-1", "?from_seq=99999999999"] {
        let answer = api.get(&format!("{path}{bad}"), None).await;
        assert_eq!(answer.status, 400, "{bad}");
    }
    let (status, _, _) = api
        .stream(&format!("/v1/orders/{}/events", Uuid::new_v4()), None, None)
        .await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_answers_202_then_409_once_ended_and_signals_are_refused() {
    let app = TestApp::spawn().await;
    let api = Api::new(&app);
    // Pending until far ahead: cancelled before it starts.
    let posted = api
        .submit(
            &order("three", json!({ "not_before": "2999-01-01T00:00:00Z" })),
            None,
            None,
        )
        .await;
    let id = posted.body["order_id"].as_str().unwrap().to_owned();
    let cancelled = api.post(&format!("/v1/orders/{id}/cancel"), "", None).await;
    assert_eq!(cancelled.status, 202, "{}", cancelled.body);
    assert_eq!(cancelled.body["order_id"], id);
    assert_eq!(cancelled.body["state"], "compensated");
    let view = api.get(&format!("/v1/orders/{id}"), None).await.body;
    assert_eq!(view["state"], "compensated");
    assert_eq!(
        view["events"].as_array().unwrap().last().unwrap()["state"],
        "compensated"
    );
    let actor: String = sqlx::query_scalar(
        "SELECT actor FROM order_events WHERE order_id = $1::uuid ORDER BY seq DESC LIMIT 1",
    )
    .bind(&id)
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert_eq!(actor, "http");

    // Ended: 409 with the reason and the state.
    let again = api.post(&format!("/v1/orders/{id}/cancel"), "", None).await;
    assert_eq!(again.status, 409, "{}", again.body);
    assert_eq!(again.body["state"], "compensated");
    assert!(
        again.body["reason"]
            .as_str()
            .unwrap()
            .contains("cannot cancel")
    );

    // A processed order cannot be cancelled either.
    let done = api.submit(&order("one", json!({})), None, None).await;
    let done_id: Uuid = serde_json::from_value(done.body["order_id"].clone()).unwrap();
    api.wait_for(&app, done_id, None, "processed").await;
    let refused = api
        .post(&format!("/v1/orders/{done_id}/cancel"), "", None)
        .await;
    assert_eq!(refused.status, 409);
    assert_eq!(refused.body["state"], "processed");

    // Signals: nothing of an ended order waits for one.
    let signal = api
        .post(
            &format!("/v1/orders/{id}/signals/approval"),
            r#"{"ok": true}"#,
            None,
        )
        .await;
    assert_eq!(signal.status, 409, "{}", signal.body);
    assert_eq!(signal.body["error"], "not_waiting");
    assert_eq!(signal.body["state"], "compensated");
    assert!(
        signal.body["reason"]
            .as_str()
            .unwrap()
            .contains("the order is not running"),
        "{}",
        signal.body
    );
    let unknown = Uuid::new_v4();
    for path in [
        format!("/v1/orders/{unknown}/cancel"),
        format!("/v1/orders/{unknown}/signals/approval"),
    ] {
        assert_eq!(api.post(&path, "{}", None).await.status, 404, "{path}");
    }
    let bad = api
        .post(&format!("/v1/orders/{id}/signals/approval"), "{oops", None)
        .await;
    assert_eq!(bad.status, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_over_http_completes_the_step_waiting_for_it_and_a_stray_one_is_a_409() {
    let app = TestApp::builder()
        .extra_config(
            r#"[workflows.approved]
steps = [
  { name = "reserve", agent = "a" },
  { name = "approve", signal = "approval", timeout = "60s" },
]
"#,
        )
        .spawn()
        .await;
    let api = Api::new(&app);
    let posted = api.submit(&order("approved", json!({})), None, None).await;
    let id: Uuid = serde_json::from_value(posted.body["order_id"].clone()).unwrap();
    app.eventually(
        "the approve step waits",
        Duration::from_secs(20),
        || async {
            let state: Option<String> = sqlx::query_scalar(
                "SELECT state FROM steps WHERE order_id = $1 AND name = 'approve'",
            )
            .bind(id)
            .fetch_optional(&app.db)
            .await
            .unwrap();
            state.as_deref() == Some("running")
        },
    )
    .await;
    let stray = api
        .post(&format!("/v1/orders/{id}/signals/refund"), "{}", None)
        .await;
    assert_eq!(stray.status, 409, "{}", stray.body);
    assert_eq!(stray.body["state"], "processing");
    // What the store cannot keep, or a log line cannot hold, is a 400 with
    // why (a NUL in the data was a 500), and the step still waits.
    for (path, body, says) in [
        ("approval", r#"{"a": "x\u0000"}"#, "NUL"),
        ("approval", r#""\u0000""#, "NUL"),
        ("approval", r#"{"k\u0000": 1}"#, "NUL"),
        ("approval", "[1e308]", "1e300"),
        ("approval%0AINFO%20forged", "{}", "control characters"),
        ("approval%1B%5B31m", "{}", "control characters"),
    ] {
        let refused = api
            .post(&format!("/v1/orders/{id}/signals/{path}"), body, None)
            .await;
        assert_eq!(refused.status, 400, "{path} {body}: {}", refused.body);
        assert!(
            refused.body["reason"].as_str().unwrap().contains(says),
            "{path} {body}: {}",
            refused.body
        );
    }
    assert!(
        stray.body["reason"]
            .as_str()
            .unwrap()
            .contains("no step of the order waits for this signal")
    );
    let signalled = api
        .post(
            &format!("/v1/orders/{id}/signals/approval"),
            r#"{"by": "ann"}"#,
            None,
        )
        .await;
    assert_eq!(signalled.status, 202, "{}", signalled.body);
    assert_eq!(signalled.body["signal"], "approval");
    assert_eq!(signalled.body["state"], "processed", "its last step");
    let view = api.get(&format!("/v1/orders/{id}"), None).await.body;
    assert_eq!(view["steps"][1]["result"], json!({ "by": "ann" }));
    // The same again: nothing waits any more.
    let again = api
        .post(&format!("/v1/orders/{id}/signals/approval"), "", None)
        .await;
    assert_eq!(again.status, 409, "{}", again.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_name_applications_and_each_sees_only_its_own_orders() {
    // shop submits over AMQP (as its RabbitMQ user) and over HTTP; billing
    // over HTTP only.
    let run = format!("h{}", &Uuid::new_v4().simple().to_string()[..10]);
    let shop_user = BrokerUser::create(&format!("{run}-shop"), ".*", ".*", ".*");
    let config = format!(
        "[applications.shop]\nuser = \"{}\"\nreply_to = [\"{run}-shop.*\"]\ntokens = [\"{SHOP_HASH}\"]\n\n\
         [applications.billing]\nreply_to = [\"{run}-billing.*\"]\ntokens = [\"{BILLING_HASH}\"]\n",
        shop_user.name
    );
    let app = TestApp::builder().extra_config(config).build().await;
    app.start_all().await;
    let api = Api::new(&app);
    let (shop, billing) = (Some(SHOP_TOKEN), Some(BILLING_TOKEN));

    // No token (loopback too), a wrong one, another scheme: 401.
    let body = order("one", json!({}));
    for token in [None, Some("nope"), Some("shop-token-")] {
        let answer = api.submit(&body, None, token).await;
        assert_eq!(answer.status, 401, "{token:?}");
        assert_eq!(answer.body["error"], "unauthenticated");
        assert!(answer.headers.contains_key("www-authenticate"));
    }
    let basic = api
        .send(
            api.http
                .get(format!("{}/v1/orders/{}", api.base, Uuid::new_v4()))
                .basic_auth("shop", Some(SHOP_TOKEN)),
        )
        .await;
    assert_eq!(basic.status, 401);

    // One id from both applications: two orders, each its own.
    let id = Uuid::new_v4();
    let mine = order("one", json!({ "order_id": id }));
    assert_eq!(api.submit(&mine, None, shop).await.status, 202);
    let theirs = order("one", json!({ "order_id": id }));
    assert_eq!(api.submit(&theirs, None, billing).await.status, 202);
    let view = api.wait_for(&app, id, shop, "processed").await;
    assert_eq!(view["order_id"], id.to_string());
    api.wait_for(&app, id, billing, "processed").await;
    assert_eq!(stored(&app, id).await, (2, 2));
    // Another application's queue as reply_to: 400.
    let foreign = order("one", json!({ "reply_to": format!("{run}-shop.status") }));
    let refused = api.submit(&foreign, None, billing).await;
    assert_eq!(refused.status, 400);
    assert_eq!(refused.body["error"], "not_the_applications_queue");

    // billing cannot see, follow, cancel or signal shop's order: 404.
    let only_shop = Uuid::new_v4();
    let later = json!({ "order_id": only_shop, "not_before": "2999-01-01T00:00:00Z" });
    assert_eq!(
        api.submit(&order("one", later), None, shop).await.status,
        202
    );
    assert_eq!(
        api.get(&format!("/v1/orders/{only_shop}"), shop)
            .await
            .status,
        200
    );
    for (path, post) in [
        (format!("/v1/orders/{only_shop}"), false),
        (format!("/v1/orders/{only_shop}/events"), false),
        (format!("/v1/orders/{only_shop}/cancel"), true),
        (format!("/v1/orders/{only_shop}/signals/x"), true),
    ] {
        let answer = if post {
            api.post(&path, "", billing).await
        } else {
            api.get(&path, billing).await
        };
        assert_eq!(answer.status, 404, "{path}");
        assert_eq!(answer.body["reason"], format!("no order {only_shop}"));
    }
    let view = api.get(&format!("/v1/orders/{only_shop}"), shop).await.body;
    assert_eq!(view["state"], "pending", "billing changed shop's order");
    let cancelled = api
        .post(&format!("/v1/orders/{only_shop}/cancel"), "", shop)
        .await;
    assert_eq!(cancelled.status, 202);

    // The same id over AMQP (as shop's user) and HTTP (shop's token) is one
    // order: the same namespace both ways.
    let both = Uuid::new_v4();
    let mut raw = RawPublisher::connect_to(
        sas_tests::amqp_address(),
        &shop_user.name,
        &shop_user.password,
    )
    .await
    .expect("shop's user connects");
    let mut props = Properties::new(None, None);
    props.flags |= flag::USER_ID;
    short_string(&mut props.list, &shop_user.name);
    let body = order("one", json!({ "order_id": both }));
    raw.publish(app.queues.orders(), &props, body.to_string().as_bytes())
        .await
        .expect("the broker takes it");
    app.eventually("shop's queued order stored", WAIT, || async {
        stored(&app, both).await.0 == 1
    })
    .await;
    let posted = api.submit(&body, None, shop).await;
    assert_eq!(posted.status, 200, "{}", posted.body);
    assert_eq!(
        api.get(&format!("/v1/orders/{both}"), billing).await.status,
        404
    );
    api.wait_for(&app, both, shop, "processed").await;
    assert_eq!(stored(&app, both).await, (1, 1));
}

/// Sends raw bytes to the port; the answer's status, `None` when the
/// server closed the connection without one (a refusal too).
async fn raw(port: u16, request: &[u8]) -> Option<u16> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    // The server may refuse before reading it all.
    let _ = stream.write_all(request).await;
    let mut buf = Vec::new();
    let read = tokio::time::timeout(WAIT, stream.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "no answer within {WAIT:?}");
    let text = String::from_utf8_lossy(&buf);
    text.split_whitespace().nth(1)?.parse().ok()
}

/// A POST of `body` to `path` with `content_type`, closing the connection.
fn post(path: &str, content_type: Option<&str>, extra: &str, body: &[u8]) -> Vec<u8> {
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n{extra}",
        body.len()
    );
    if let Some(ct) = content_type {
        head.push_str(&format!("Content-Type: {ct}\r\n"));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

fn get(path: &str, extra: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{extra}\r\n")
        .into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_are_refused_with_4xx_and_the_next_order_is_processed() {
    let app = TestApp::spawn().await;
    let port = app.port("submission");
    let json_ct = Some("application/json");
    let id = Uuid::new_v4();
    let prefix = &app.prefix;
    let max_body = 1024 * 1024;
    let deep = format!(
        r#"{{"workflow":"one","payload":{}1{}}}"#,
        "{\"a\":".repeat(100),
        "}".repeat(100)
    );
    let mut batch: Vec<(String, Vec<u8>)> = vec![
        ("too large".into(), post("/v1/orders", json_ct, "", &vec![b' '; max_body + 1])),
        ("not JSON".into(), post("/v1/orders", json_ct, "", b"{oops")),
        ("an array".into(), post("/v1/orders", json_ct, "", b"[1,2]")),
        ("not UTF-8".into(), post("/v1/orders", json_ct, "", b"\xff\xfe{}")),
        ("empty".into(), post("/v1/orders", json_ct, "", b"")),
        ("no workflow".into(), post("/v1/orders", json_ct, "", br#"{"payload":{}}"#)),
        ("unknown workflow".into(), post("/v1/orders", json_ct, "", br#"{"workflow":"nope","payload":{}}"#)),
        ("payload not an object".into(), post("/v1/orders", json_ct, "", br#"{"workflow":"one","payload":[]}"#)),
        ("order_id not a UUID".into(), post("/v1/orders", json_ct, "", br#"{"workflow":"one","payload":{},"order_id":"x"}"#)),
        ("priority 10".into(), post("/v1/orders", json_ct, "", br#"{"workflow":"one","payload":{},"priority":10}"#)),
        ("too deep".into(), post("/v1/orders", json_ct, "", deep.as_bytes())),
        (
            "sas's own queue as reply_to".into(),
            post("/v1/orders", json_ct, "", format!(r#"{{"workflow":"one","payload":{{}},"reply_to":"{prefix}.orders"}}"#).as_bytes()),
        ),
        ("amq. reply_to".into(), post("/v1/orders", json_ct, "", br#"{"workflow":"one","payload":{},"reply_to":"amq.x"}"#)),
        ("no content type".into(), post("/v1/orders", None, "", br#"{"workflow":"one","payload":{}}"#)),
        ("text/plain".into(), post("/v1/orders", Some("text/plain"), "", br#"{"workflow":"one","payload":{}}"#)),
        ("form".into(), post("/v1/orders", Some("application/x-www-form-urlencoded"), "", b"workflow=one")),
        ("json-ish type".into(), post("/v1/orders", Some("application/jsonx"), "", br#"{"workflow":"one","payload":{}}"#)),
        ("bad Idempotency-Key".into(), post("/v1/orders", json_ct, "Idempotency-Key: ../../x\r\n", br#"{"workflow":"one","payload":{}}"#)),
        ("a web page's request".into(), post("/v1/orders", json_ct, "Origin: http://evil.example\r\n", br#"{"workflow":"one","payload":{}}"#)),
        ("dot-dot in the path".into(), get("/v1/orders/..%2f..%2fetc%2fpasswd", "")),
        ("NUL in the path".into(), get("/v1/orders/%00", "")),
        ("a bad escape".into(), get("/v1/orders/%ff%fe", "")),
        ("segments after the id".into(), get(&format!("/v1/orders/{id}/../../x"), "")),
        ("a long id".into(), get(&format!("/v1/orders/{}", "a".repeat(8000)), "")),
        ("a bad from_seq".into(), get(&format!("/v1/orders/{id}/events?from_seq=1e9"), "")),
        ("a bad Last-Event-ID".into(), get(&format!("/v1/orders/{id}/events"), "Last-Event-ID: x\r\n")),
        ("an unknown route".into(), get("/v1/nothing", "")),
        ("a wrong method".into(), post("/v1/openapi.json", json_ct, "", b"{}")),
        ("a huge header".into(), get("/v1/openapi.json", &format!("X-Big: {}\r\n", "a".repeat(1_000_000)))),
        (
            "a header flood".into(),
            get("/v1/openapi.json", &(0..500).map(|i| format!("X-H{i}: v\r\n")).collect::<String>()),
        ),
        ("two content lengths".into(), b"POST /v1/orders HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\nContent-Length: 3\r\nContent-Type: application/json\r\n\r\n{}".to_vec()),
        ("not HTTP".into(), b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03garbage\r\n\r\n".to_vec()),
    ];
    // And generated ones: truncations and byte flips of a good body.
    let good = br#"{"workflow":"one","payload":{"k":[1,2,{"x":"y"}]},"priority":3}"#;
    let mut seed: u64 = 0x5eed;
    for i in 0..40 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut body = good.to_vec();
        let at = (seed >> 33) as usize % body.len();
        if i % 2 == 0 {
            body.truncate(at.max(1));
        } else {
            body[at] = b"\"{}[]:,\\\x00"[(seed >> 20) as usize % 9];
        }
        // A flip may leave it valid (and stored): only truncations must
        // be refused.
        if i % 2 == 0 {
            batch.push((
                format!("truncated at {at}"),
                post("/v1/orders", json_ct, "", &body),
            ));
        } else {
            let _ = raw(port, &post("/v1/orders", json_ct, "", &body)).await;
        }
    }
    for (what, request) in &batch {
        let status = raw(port, request).await;
        let closed_ok = what.starts_with("a huge header")
            || what.starts_with("a header flood")
            || what == "not HTTP";
        match status {
            Some(s) => assert!((400..500).contains(&s), "{what}: answered {s}"),
            None => assert!(closed_ok, "{what}: no answer"),
        }
    }
    app.assert_running(&["submission"]);

    // A well-formed order right after: processed.
    let api = Api::new(&app);
    let posted = api.submit(&order("one", json!({})), None, None).await;
    assert_eq!(posted.status, 202, "{}", posted.body);
    let id: Uuid = serde_json::from_value(posted.body["order_id"].clone()).unwrap();
    api.wait_for(&app, id, None, "processed").await;
    let refused: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE workflow <> 'one'")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(refused, 0);
    // Refused over HTTP, counted as on the queue.
    let metrics = app.metrics("submission").await;
    assert!(
        metrics.contains(r#"sas_orders_rejected_total{reason="malformed_json"}"#),
        "{metrics}"
    );
}

fn openapi_file() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/openapi.json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_is_served_kept_in_docs_and_names_every_route() {
    let app = TestApp::builder().build().await;
    app.start("submission", "submission", &[]).await;
    let api = Api::new(&app);
    let served = api.get("/v1/openapi.json", None).await;
    assert_eq!(served.status, 200);
    let doc = served.body;
    assert_eq!(doc["openapi"], "3.1.0");
    let want = serde_json::to_string_pretty(&doc).unwrap() + "\n";
    if std::env::var_os("SAS_BLESS").is_some() {
        std::fs::write(openapi_file(), &want).expect("write docs/openapi.json");
    }
    let kept: Value =
        serde_json::from_str(&std::fs::read_to_string(openapi_file()).expect("docs/openapi.json"))
            .expect("docs/openapi.json is JSON");
    assert!(
        kept == doc,
        "docs/openapi.json drifted from what the submission serves; run \
         `SAS_BLESS=1 cargo nextest run -p sas-tests -E 'test(/^http_api::the_openapi/)'` and commit"
    );

    // Every documented operation is served: not the fallback's `no_route`,
    // nor 405.
    let id = Uuid::new_v4();
    let mut documented = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            documented.push((method.clone(), path.clone()));
            let concrete = path.replace("{id}", &id.to_string()).replace("{name}", "s");
            let answer = match method.as_str() {
                "get" => api.get(&concrete, None).await,
                "post" => api.post(&concrete, "{}", None).await,
                other => panic!("an unexpected method {other}"),
            };
            assert_ne!(answer.body["error"], "no_route", "{method} {path}");
            assert_ne!(answer.status, 405, "{method} {path}");
        }
    }
    assert_eq!(documented.len(), 6, "{documented:?}");
    // And what is not documented is not served under /v1.
    for (method, path) in [
        ("get", "/v1/orders".to_owned()),
        ("post", format!("/v1/orders/{id}")),
        ("get", format!("/v1/orders/{id}/cancel")),
        ("get", format!("/v1/orders/{id}/other")),
        ("get", "/v1/openapi.yaml".to_owned()),
        ("get", "/v2/orders".to_owned()),
    ] {
        let answer = match method {
            "get" => api.get(&path, None).await,
            _ => api.post(&path, "{}", None).await,
        };
        assert!(
            answer.status == 405 || answer.body["error"] == "no_route",
            "{method} {path}: {} {}",
            answer.status,
            answer.body
        );
    }
}

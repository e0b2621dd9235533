//! The HTTP API's event streams (contract §9a, issue 56): open streams on
//! waiting orders cost the database nothing while they wait (counted by
//! Postgres's own commit counter), yet each gets its order's events as
//! they are written; one application's streams cannot shut another's out;
//! a stream ends cleanly after its lifetime and resumes from
//! `Last-Event-ID`; an idle stream sends heartbeat comments.

use std::time::{Duration, Instant};

use sas_tests::TestApp;
use sas_tests::app_tokens::{BILLING_HASH, BILLING_TOKEN, SHOP_HASH, SHOP_TOKEN};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::TcpStream;
use uuid::Uuid;

/// A workflow whose orders wait for a signal for an hour.
const WAITING: &str = r#"[workflows.waiting]
steps = [
  { name = "reserve", agent = "a" },
  { name = "approve", signal = "approval", timeout = "1h" },
]
"#;

/// One open `text/event-stream` response, read line by line.
struct Stream {
    lines: tokio::io::Lines<BufReader<TcpStream>>,
    /// The head's status.
    status: u16,
}

impl Stream {
    /// `GET path` on the submission's port with `headers` (each line
    /// ending in CRLF), its head read.
    async fn open(port: u16, path: &str, headers: &str) -> Self {
        let mut socket = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        // Closed after the response: its end is the connection's.
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n{headers}\r\n"
        );
        socket.write_all(request.as_bytes()).await.expect("request");
        let mut lines = BufReader::new(socket).lines();
        let head = lines.next_line().await.expect("head").unwrap_or_default();
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        // The rest of the head, to the empty line.
        while let Ok(Some(line)) = lines.next_line().await {
            if line.is_empty() {
                break;
            }
        }
        Self { lines, status }
    }

    /// Lines until one satisfies `stop` (returned with those before it),
    /// or the stream ends (`None` last), within `within`.
    async fn until(
        &mut self,
        within: Duration,
        stop: impl Fn(&str) -> bool,
    ) -> Vec<Option<String>> {
        let mut seen = Vec::new();
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let line = tokio::time::timeout_at(deadline, self.lines.next_line())
                .await
                .unwrap_or_else(|_| panic!("no such line within {within:?}; read {seen:?}"));
            match line {
                Ok(Some(line)) => {
                    let done = stop(&line);
                    seen.push(Some(line));
                    if done {
                        return seen;
                    }
                }
                Ok(None) | Err(_) => {
                    seen.push(None);
                    return seen;
                }
            }
        }
    }
}

/// The `data:` lines' events among `lines` (chunk sizes of the chunked
/// encoding are skipped: they are no `data:` line).
fn events(lines: &[Option<String>]) -> Vec<Value> {
    lines
        .iter()
        .flatten()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect()
}

/// A plain HTTP client (reqwest needs the process's TLS provider).
fn http() -> reqwest::Client {
    sas::tls::install_crypto_provider();
    reqwest::Client::new()
}

/// Commits per second over `window`.
async fn rate(app: &TestApp, window: Duration) -> f64 {
    let commits = || sas_tests::pg_commits(&app.db_name);
    let (before, started) = (commits().await, Instant::now());
    tokio::time::sleep(window).await;
    let after = commits().await;
    (after - before) as f64 / started.elapsed().as_secs_f64()
}

/// Submits `n` orders of `waiting` over HTTP and waits until each waits
/// for its signal; their ids.
async fn waiting_orders(app: &TestApp, n: usize, token: Option<&str>) -> Vec<Uuid> {
    let http = http();
    let base = format!("http://127.0.0.1:{}", app.port("submission"));
    let mut ids = Vec::new();
    for _ in 0..n {
        let mut post = http
            .post(format!("{base}/v1/orders"))
            .header("content-type", "application/json")
            .body(json!({ "workflow": "waiting", "payload": {} }).to_string());
        if let Some(token) = token {
            post = post.bearer_auth(token);
        }
        let answer: Value = post
            .send()
            .await
            .expect("posted")
            .json()
            .await
            .expect("JSON");
        ids.push(
            answer["order_id"]
                .as_str()
                .and_then(|s| s.parse().ok())
                .expect("an id"),
        );
    }
    app.eventually(
        "every order waits for its signal",
        Duration::from_secs(60),
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM steps WHERE name = 'approve' AND state = 'running'",
            )
            .fetch_one(&app.db)
            .await
            .unwrap_or(0);
            waiting as usize >= n
        },
    )
    .await;
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_streams_on_waiting_orders_cost_the_database_nothing_while_they_wait_yet_get_each_event()
 {
    const ORDERS: usize = 16;
    const STREAMS: usize = 256;
    let app = TestApp::builder().extra_config(WAITING).spawn().await;
    let ids = waiting_orders(&app, ORDERS, None).await;
    let port = app.port("submission");

    // Idle first: the deployment's own polls, sweeps and heartbeats.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle = rate(&app, Duration::from_secs(15)).await;

    let mut streams = Vec::new();
    for i in 0..STREAMS {
        let id = ids[i % ORDERS];
        let mut stream = Stream::open(port, &format!("/v1/orders/{id}/events"), "").await;
        assert_eq!(stream.status, 200, "stream {i}");
        // Its events so far: received, processing, reserve's success.
        let read = stream
            .until(Duration::from_secs(30), |l| l.contains("step_succeeded"))
            .await;
        assert!(read.last().is_some_and(Option::is_some), "{read:?}");
        streams.push((id, stream));
    }
    // Past each stream's one read after it opened.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let open = rate(&app, Duration::from_secs(15)).await;
    eprintln!("commits/s: {idle:.2} idle, {open:.2} with {STREAMS} streams open");
    // Each polled the log every 200 ms before: thousands a second.
    assert!(
        open <= idle * 1.05 + 0.2,
        "{STREAMS} waiting streams: {open:.2} commits/s against {idle:.2} idle"
    );

    // Yet a signal's events reach every stream of its order at once.
    let signalled = ids[0];
    let answer = http()
        .post(format!(
            "http://127.0.0.1:{port}/v1/orders/{signalled}/signals/approval"
        ))
        .body("{}")
        .send()
        .await
        .expect("signal");
    assert_eq!(answer.status(), 202);
    for (id, stream) in streams.iter_mut().filter(|(id, _)| *id == signalled) {
        let read = stream
            .until(Duration::from_secs(10), |l| l.contains("\"processed\""))
            .await;
        let got = events(&read);
        assert!(
            got.iter()
                .any(|e| e["state"] == "processed" && e["order_id"] == id.to_string()),
            "{read:?}"
        );
        // Then the stream ends: the order has.
        let rest = stream.until(Duration::from_secs(10), |_| false).await;
        assert_eq!(rest.last(), Some(&None), "{rest:?}");
    }
    app.assert_running(&["submission", "scheduler", "agent", "supervisor"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_applications_streams_cannot_shut_another_out() {
    let config = format!(
        "{WAITING}\n[submission]\nmax_streams = 6\nmax_streams_per_application = 4\n\n\
         [applications.shop]\nreply_to = [\"shop.*\"]\ntokens = [\"{SHOP_HASH}\"]\n\n\
         [applications.billing]\nreply_to = [\"billing.*\"]\ntokens = [\"{BILLING_HASH}\"]\n"
    );
    let app = TestApp::builder().extra_config(config).spawn().await;
    let port = app.port("submission");
    let shop_order = waiting_orders(&app, 1, Some(SHOP_TOKEN)).await[0];
    let billing_order = waiting_orders(&app, 1, Some(BILLING_TOKEN)).await[0];
    let auth = |token: &str| format!("Authorization: Bearer {token}\r\n");
    let mut open = Vec::new();
    for _ in 0..4 {
        let stream = Stream::open(
            port,
            &format!("/v1/orders/{shop_order}/events"),
            &auth(SHOP_TOKEN),
        )
        .await;
        assert_eq!(stream.status, 200);
        open.push(stream);
    }
    // shop has its four: a fifth is refused, billing still gets its own.
    let fifth = Stream::open(
        port,
        &format!("/v1/orders/{shop_order}/events"),
        &auth(SHOP_TOKEN),
    )
    .await;
    assert_eq!(fifth.status, 503, "shop past its share");
    for _ in 0..2 {
        let stream = Stream::open(
            port,
            &format!("/v1/orders/{billing_order}/events"),
            &auth(BILLING_TOKEN),
        )
        .await;
        assert_eq!(stream.status, 200, "billing is not shut out");
        open.push(stream);
    }
    // The instance's six are taken: anyone's next waits for a place.
    let seventh = Stream::open(
        port,
        &format!("/v1/orders/{billing_order}/events"),
        &auth(BILLING_TOKEN),
    )
    .await;
    assert_eq!(seventh.status, 503, "past the instance's places");
    // A closed stream gives its place back.
    drop(open.pop());
    app.eventually("a place comes back", Duration::from_secs(10), || async {
        Stream::open(
            port,
            &format!("/v1/orders/{billing_order}/events"),
            &auth(BILLING_TOKEN),
        )
        .await
        .status
            == 200
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_sends_heartbeats_ends_after_its_lifetime_and_resumes_from_last_event_id() {
    let config =
        format!("{WAITING}\n[submission]\nstream_lifetime = \"3s\"\nstream_heartbeat = \"1s\"\n");
    let app = TestApp::builder().extra_config(config).spawn().await;
    let port = app.port("submission");
    let id = waiting_orders(&app, 1, None).await[0];
    let started = Instant::now();
    let mut stream = Stream::open(port, &format!("/v1/orders/{id}/events"), "").await;
    assert_eq!(stream.status, 200);
    let lived = stream.until(Duration::from_secs(10), |_| false).await;
    let lifetime = started.elapsed();
    assert_eq!(lived.last(), Some(&None), "it ends: {lived:?}");
    assert!(
        lifetime >= Duration::from_millis(2900) && lifetime < Duration::from_secs(8),
        "{lifetime:?}"
    );
    assert!(
        lived
            .iter()
            .flatten()
            .filter(|l| *l == ": heartbeat")
            .count()
            >= 2,
        "heartbeat comments while it waited: {lived:?}"
    );
    let seen = events(&lived);
    let last = seen.last().and_then(|e| e["seq"].as_i64()).expect("events");
    // Resumed after the last event it had: the order's next events only.
    let mut resumed = Stream::open(
        port,
        &format!("/v1/orders/{id}/events"),
        &format!("Last-Event-ID: {last}\r\n"),
    )
    .await;
    assert_eq!(resumed.status, 200);
    http()
        .post(format!(
            "http://127.0.0.1:{port}/v1/orders/{id}/signals/approval"
        ))
        .body("{}")
        .send()
        .await
        .expect("signal");
    let rest = resumed
        .until(Duration::from_secs(10), |l| l.contains("\"processed\""))
        .await;
    let got = events(&rest);
    assert!(
        got.iter().all(|e| e["seq"].as_i64() > Some(last)),
        "only what came after {last}: {got:?}"
    );
    assert!(got.iter().any(|e| e["state"] == "processed"), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_stored_while_the_last_ones_deletion_is_on_its_way_stays() {
    // A stream that opens as the last one of its order closes stores its
    // watch again before the closing one's deletion runs: the deletion,
    // which names the watch it ends, must spare the newer one.
    let app = TestApp::new().await;
    let store = sas::state_store::StateStore::from_pool(app.db.clone());
    let order = Uuid::now_v7();
    let first = chrono::Utc::now() + chrono::Duration::minutes(30);
    let later = first + chrono::Duration::milliseconds(5);
    store
        .watch_events("submission-x", &[order], first)
        .await
        .expect("watch");
    store
        .watch_events("submission-x", &[order], later)
        .await
        .expect("watch again");
    store
        .unwatch_events("submission-x", order, first)
        .await
        .expect("unwatch");
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM event_watches WHERE order_id = $1")
        .bind(order)
        .fetch_one(&app.db)
        .await
        .expect("count");
    assert_eq!(kept, 1, "the later watch stays");
    store
        .unwatch_events("submission-x", order, later)
        .await
        .expect("unwatch");
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM event_watches WHERE order_id = $1")
        .bind(order)
        .fetch_one(&app.db)
        .await
        .expect("count");
    assert_eq!(kept, 0, "the last one's own deletion ends it");
}

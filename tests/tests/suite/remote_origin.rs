//! Remote calls stay on the remote's origin (contract §1b), against the real
//! services, Postgres and RabbitMQ, with a hostile remote served here on two
//! ports of 127.0.0.1 (two origins): `home`, the agent's URL, and `away`,
//! standing for an internal address (a cloud metadata path) that a remote
//! would send the agent to. The agent follows no redirect unless told to,
//! and then only home; polls a `202`'s `Location` only at home; polls at
//! least `min_poll` apart whatever `Retry-After` says; tells a heartbeat at
//! most once a quarter of the step's timeout; and quotes a `Location` at
//! most 512 bytes long.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use sas_tests::TestApp;
use serde_json::{Value, json};
use uuid::Uuid;

/// What `away` answers: it must never become a step's result.
const SECRET: &str = "metadata-token-of-the-host";

/// How long the flood's job answers `202` before it is done.
const FLOOD_FOR: Duration = Duration::from_secs(3);

/// The flood's `min_poll` (its agent's setting) and its step's timeout.
const MIN_POLL: Duration = Duration::from_millis(300);
const FLOOD_TIMEOUT: Duration = Duration::from_secs(2);

/// One workflow per behaviour of the remote, each one step named as the
/// behaviour on agent `d` (whose URL the tests point at `home`).
const WORKFLOWS: &str = r#"[workflows.away]
steps = [ { name = "away", agent = "d", timeout = "3s" } ]

[workflows.home]
steps = [ { name = "home", agent = "d", timeout = "3s" } ]

[workflows.accept_away]
steps = [ { name = "accept_away", agent = "d", timeout = "3s" } ]

[workflows.flood]
steps = [ { name = "flood", agent = "d", timeout = "2s" } ]
"#;

/// Which of the two origins a request reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Home,
    Away,
}

/// One request the hostile remote got.
#[derive(Debug, Clone)]
struct Hit {
    side: Side,
    method: Method,
    path: String,
    at: Instant,
}

/// The hostile remote: the two origins and every request they got.
struct Remote {
    home: SocketAddr,
    away: SocketAddr,
    hits: Mutex<Vec<Hit>>,
    /// When the flood's job was started (its first `POST`).
    flood_started: Mutex<Option<Instant>>,
}

impl Remote {
    /// Serves both origins on 127.0.0.1 until the test's runtime ends.
    async fn start() -> Arc<Self> {
        let home = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind home");
        let away = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind away");
        let remote = Arc::new(Self {
            home: home.local_addr().expect("home address"),
            away: away.local_addr().expect("away address"),
            hits: Mutex::new(Vec::new()),
            flood_started: Mutex::new(None),
        });
        for (listener, side) in [(home, Side::Home), (away, Side::Away)] {
            let router = Router::new()
                .fallback(answer)
                .with_state((remote.clone(), side));
            tokio::spawn(async move { axum::serve(listener, router).await });
        }
        remote
    }

    /// The agent's URL.
    fn url(&self) -> String {
        format!("http://{}/step", self.home)
    }

    fn hits(&self) -> Vec<Hit> {
        self.hits.lock().unwrap().clone()
    }

    fn hits_on(&self, side: Side) -> Vec<Hit> {
        self.hits().into_iter().filter(|h| h.side == side).collect()
    }

    /// The flood's `Location`: 8 KB, on the home origin.
    fn flood_location() -> String {
        format!("/jobs/{}", "j".repeat(8 * 1024))
    }
}

/// The hostile remote's answers, by origin, path and the step named in the body.
async fn answer(
    State((remote, side)): State<(Arc<Remote>, Side)>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> Response {
    let path = uri.path().to_owned();
    remote.hits.lock().unwrap().push(Hit {
        side,
        method: method.clone(),
        path: path.clone(),
        at: Instant::now(),
    });
    if side == Side::Away {
        return axum::Json(json!({ "secret": SECRET })).into_response();
    }
    let step = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|b| b["step"].as_str().map(str::to_owned));
    let redirect = |status: StatusCode, to: String| {
        (status, [(header::LOCATION, to)], "moved").into_response()
    };
    match (&method, path.as_str(), step.as_deref()) {
        (&Method::POST, "/step", Some("away")) => redirect(
            StatusCode::FOUND,
            format!("http://{}/latest/meta-data/iam", remote.away),
        ),
        (&Method::POST, "/step", Some("home")) => {
            redirect(StatusCode::TEMPORARY_REDIRECT, "/final".into())
        }
        (&Method::POST, "/final", Some("home")) => {
            axum::Json(json!({ "followed": true })).into_response()
        }
        (&Method::POST, "/step", Some("accept_away")) => redirect(
            StatusCode::ACCEPTED,
            format!("http://{}/jobs/1", remote.away),
        ),
        (&Method::POST, "/step", Some("flood")) => {
            remote
                .flood_started
                .lock()
                .unwrap()
                .get_or_insert_with(Instant::now);
            flood_accepted()
        }
        (&Method::GET, jobs, None) if jobs.starts_with("/jobs/") => {
            let started = *remote.flood_started.lock().unwrap();
            if started.is_some_and(|at| at.elapsed() >= FLOOD_FOR) {
                axum::Json(json!({ "done": true })).into_response()
            } else {
                flood_accepted()
            }
        }
        _ => StatusCode::NOT_FOUND.into_response(),
    }
}

/// `202 Accepted`, poll again at once, at an 8 KB `Location`.
fn flood_accepted() -> Response {
    let mut response = (StatusCode::ACCEPTED, "running").into_response();
    let headers = response.headers_mut();
    headers.insert(header::RETRY_AFTER, HeaderValue::from_static("0"));
    headers.insert(
        header::LOCATION,
        HeaderValue::from_str(&Remote::flood_location()).expect("an ASCII Location"),
    );
    response
}

/// The deployment, with agent `d` calling `remote` with the agent
/// settings `env` (`SAS__AGENTS__D__…`).
async fn deploy(remote: &Remote, env: &[(&str, &str)]) -> TestApp {
    let app = TestApp::builder()
        .max_failures(3)
        .extra_config(WORKFLOWS)
        .build()
        .await;
    for name in ["submission", "scheduler", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    let url = remote.url();
    let mut env = env.to_vec();
    env.push(("SAS__AGENTS__D__URL", &url));
    app.start_with_env("agent", "agent", &[], &env).await;
    app
}

/// The order's `last_error`.
async fn last_error(app: &TestApp, id: Uuid) -> String {
    sqlx::query_scalar::<_, Option<String>>("SELECT last_error FROM orders WHERE order_id = $1")
        .bind(id)
        .fetch_one(&app.db)
        .await
        .expect("order")
        .unwrap_or_default()
}

/// Asserts that order `id` (with `events`) failed for good at its first
/// attempt with a reason saying `says`, and that nothing of `away`'s
/// answer reached its events.
async fn assert_failed_for_good(app: &TestApp, id: Uuid, events: &[Value], says: &str) {
    let states = sas_tests::states(events);
    assert_eq!(states.last(), Some(&"failed"), "{states:?}");
    assert!(!states.contains(&"retry_scheduled"), "{states:?}");
    let error = last_error(app, id).await;
    assert!(error.contains(says), "{error}");
    let text = serde_json::to_string(events).expect("events");
    assert!(!text.contains(SECRET), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_not_followed_by_default_and_the_other_origin_is_never_called() {
    let remote = Remote::start().await;
    let app = deploy(&remote, &[]).await;
    let (id, events) = app.run_one("away").await;
    assert_failed_for_good(&app, id, &events, "redirect").await;
    assert!(
        last_error(&app, id)
            .await
            .contains("follow_redirects = \"none\""),
        "{}",
        last_error(&app, id).await
    );
    // Not even a redirect home is followed unless the agent is told to.
    let (id, events) = app.run_one("home").await;
    assert_failed_for_good(&app, id, &events, "redirect").await;
    assert_eq!(remote.hits_on(Side::Away).len(), 0, "{:?}", remote.hits());
    assert!(
        remote.hits().iter().all(|h| h.path == "/step"),
        "{:?}",
        remote.hits()
    );
    // One call each: a 3xx is permanent, never retried.
    assert_eq!(remote.hits().len(), 2, "{:?}", remote.hits());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_same_origin_a_redirect_home_is_followed_and_one_to_another_origin_fails() {
    let remote = Remote::start().await;
    let app = deploy(
        &remote,
        &[("SAS__AGENTS__D__FOLLOW_REDIRECTS", "same-origin")],
    )
    .await;
    let (_, events) = app.run_one("home").await;
    let states = sas_tests::states(&events);
    assert_eq!(states.last(), Some(&"processed"), "{states:?}");
    let result = &events.last().expect("events")["detail"]["results"]["home"];
    assert_eq!(result, &json!({ "followed": true }), "{events:?}");
    let (id, events) = app.run_one("away").await;
    assert_failed_for_good(&app, id, &events, "redirect to another origin").await;
    assert_eq!(remote.hits_on(Side::Away).len(), 0, "{:?}", remote.hits());
    // The 307 kept the method (and so the body naming the step).
    let home: Vec<(Method, String)> = remote
        .hits()
        .into_iter()
        .map(|h| (h.method, h.path))
        .collect();
    assert!(
        home.contains(&(Method::POST, "/final".to_owned())),
        "{home:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_202_whose_location_is_on_another_origin_fails_for_good_and_is_never_polled() {
    let remote = Remote::start().await;
    let app = deploy(&remote, &[]).await;
    let (id, events) = app.run_one("accept_away").await;
    assert_failed_for_good(&app, id, &events, "Location on another origin").await;
    assert_eq!(remote.hits_on(Side::Away).len(), 0, "{:?}", remote.hits());
    assert_eq!(remote.hits().len(), 1, "one POST: {:?}", remote.hits());
    let states = sas_tests::states(&events);
    assert!(!states.contains(&"heartbeat"), "{states:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_202_flood_is_polled_min_poll_apart_with_few_heartbeats_and_short_locations() {
    let remote = Remote::start().await;
    let min_poll = format!("{}ms", MIN_POLL.as_millis());
    let app = deploy(&remote, &[("SAS__AGENTS__D__MIN_POLL", &min_poll)]).await;
    let (_, events) = app.run_one("flood").await;
    let states = sas_tests::states(&events);
    assert_eq!(states.last(), Some(&"processed"), "{states:?}");
    let hits = remote.hits();
    let post = hits
        .iter()
        .find(|h| h.method == Method::POST)
        .expect("the POST");
    let polls: Vec<Instant> = hits
        .iter()
        .filter(|h| h.method == Method::GET)
        .map(|h| h.at)
        .collect();
    let last = *polls.last().expect("polls");
    let window = last - post.at;
    // Past the job's end: the remote answered 202 all that while.
    assert!(window >= FLOOD_FOR, "{window:?}");
    let apart = [post.at]
        .iter()
        .chain(&polls)
        .collect::<Vec<_>>()
        .windows(2)
        .map(|w| *w[1] - *w[0])
        .collect::<Vec<_>>();
    let closest = apart.iter().min().expect("a poll");
    assert!(
        *closest >= MIN_POLL,
        "{} polls, {closest:?} apart at the closest",
        polls.len()
    );
    let most = |every: Duration| (window.as_millis() / every.as_millis()) as usize + 1;
    assert!(
        polls.len() <= most(MIN_POLL),
        "{} polls in {window:?}",
        polls.len()
    );
    let beats: Vec<&Value> = events
        .iter()
        .filter(|e| e["state"] == "heartbeat")
        .collect();
    assert!(!beats.is_empty(), "{states:?}");
    assert!(
        beats.len() <= most(FLOOD_TIMEOUT / 4),
        "{} heartbeats in {window:?}",
        beats.len()
    );
    // The Location is quoted cut, in events and in the agent's log.
    let long = format!("http://{}{}", remote.home, Remote::flood_location());
    for beat in &beats {
        let quoted = beat["detail"]["location"].as_str().expect("a location");
        assert!(quoted.len() <= 512, "{} bytes", quoted.len());
        assert!(long.starts_with(quoted.trim_end_matches("...")), "{quoted}");
    }
    let cut = &Remote::flood_location()[..513];
    let text = serde_json::to_string(&events).expect("events");
    assert!(!text.contains(cut), "an event quotes more than 512 bytes");
    assert!(
        !app.log("agent").contains(cut),
        "the agent's log quotes more than 512 bytes"
    );
}

#[test]
fn a_redirect_policy_or_poll_interval_sas_cannot_hold_is_refused_at_start_up() {
    for (setting, says) in [
        (
            r#"follow_redirects = "any""#,
            r#""any" is neither "none" nor "same-origin""#,
        ),
        (r#"min_poll = "0s""#, "agents.x.min_poll"),
    ] {
        sas_tests::assert_refused_at_start_up(
            "agent",
            &format!("[agents.x]\nurl = \"http://127.0.0.1:1/x\"\n{setting}\n"),
            says,
        );
    }
}

//! The operator dashboard end to end: the real services and the real
//! `dashboard` binary against the test's Postgres and RabbitMQ, the overview
//! and an order's page driven in a real headless Chromium (through
//! chromedriver), and the JSON API with plain HTTP, in each of
//! `dashboard.auth`'s modes.
//!
//! The browser test keeps a screenshot of the overview with its data in
//! `target/ci-artifacts/dashboard.png` (and the order page beside it).

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use fantoccini::Locator;
use remote_sim::Knobs;
use sas_tests::TestApp;
use sas_tests::browser::Browser;
use sas_tests::cli::wait_state;
use sas_tests::dashboard::{OPERATOR_TOKEN, VIEWER_TOKEN, answer};
use serde_json::{Value, json};
use uuid::Uuid;

/// `[dashboard]` with token authentication (the other modes are chosen with
/// `SAS__DASHBOARD__AUTH` when a test starts a dashboard).
fn dashboard_auth() -> String {
    format!(
        r#"{}users = [
  {{ name = "bob", password = "bob-secret", role = "operator" }},
  {{ name = "val", password = "val-secret", role = "viewer" }},
]
role_header = "X-Forwarded-Role"
"#,
        sas_tests::dashboard::token_auth()
    )
}

/// An HTTP client that shows redirects instead of following them.
fn client() -> reqwest::Client {
    sas::tls::install_crypto_provider();
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("HTTP client")
}

/// The page's path.
async fn path(browser: &Browser) -> String {
    browser
        .run("return location.pathname;")
        .await
        .expect("location")
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// Starts the dashboard and returns its base URL.
async fn start_dashboard(app: &TestApp) -> String {
    app.start("dashboard", "dashboard", &[]).await;
    format!("http://127.0.0.1:{}", app.port("dashboard"))
}

/// Where CI keeps artifacts: `target/ci-artifacts/` of the workspace.
fn artifact(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("target")
        .join("ci-artifacts");
    std::fs::create_dir_all(&dir).expect("artifact directory");
    dir.join(name)
}

/// Waits until the text of `selector` satisfies `ok`, polling; panics as
/// [`wait_page`] does.
async fn wait_text(
    browser: &Browser,
    what: &str,
    selector: &str,
    timeout: Duration,
    ok: impl Fn(&str) -> bool,
) {
    wait_page(browser, what, timeout, || async {
        let text = browser.text_of(selector).await?.unwrap_or_default();
        Ok(if ok(&text) { Ok(()) } else { Err(text) })
    })
    .await;
}

/// Waits until `check` holds in the page, polling; panics with `what`, the
/// last thing seen and a screenshot's path after `timeout`.
async fn wait_page<F, Fut>(browser: &Browser, what: &str, timeout: Duration, check: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = anyhow::Result<Result<(), String>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let last = match check().await {
            Ok(Ok(())) => return,
            Ok(Err(seen)) => seen,
            Err(e) => format!("{e:#}"),
        };
        if Instant::now() > deadline {
            let shot = artifact("dashboard-failure.png");
            if let Ok(png) = browser.screenshot().await {
                std::fs::write(&shot, png).ok();
            }
            panic!(
                "not within {timeout:?}: {what}; last seen: {last}; screenshot in {}",
                shot.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The counters the overview shows, by element id.
async fn shown_counts(browser: &Browser, ids: &[&str]) -> anyhow::Result<BTreeMap<String, String>> {
    let mut shown = BTreeMap::new();
    for id in ids {
        let text = browser
            .text_of(&format!("#{id}"))
            .await?
            .unwrap_or_default();
        shown.insert((*id).to_owned(), text);
    }
    Ok(shown)
}

fn permanent() -> Knobs {
    Knobs {
        permanent: true,
        ..Knobs::default()
    }
}

/// Whether an order is pending after a counted failure, waiting for its re-attempt.
async fn waits_for_retry(app: &TestApp, id: Uuid) -> bool {
    let row: Option<(String, i32, bool)> = sqlx::query_as(
        "SELECT process_state, failure_count, coalesce(not_before > now(), false) \
         FROM orders WHERE order_id = $1",
    )
    .bind(id)
    .fetch_optional(&app.db)
    .await
    .expect("read order");
    matches!(row, Some((state, 1, true)) if state == "pending")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_a_known_run_in_chromium_to_a_logged_in_viewer_without_buttons_and_an_operators_retry_is_audited_under_their_name()
 {
    let app = TestApp::builder()
        .step_timeout("3s")
        // A step that runs out of time waits an hour for its re-attempt: it
        // stays in the "waiting" table for the whole test.
        .retry_schedule(r#"["1h"]"#)
        .extra_config(dashboard_auth())
        .spawn()
        .await;

    // Three orders that succeed.
    let processed: Vec<Uuid> = {
        let mut ids = Vec::new();
        for _ in 0..3 {
            ids.push(app.submit("three", None).await);
        }
        ids
    };
    for id in &processed {
        wait_state(&app, *id, "processed", Duration::from_secs(30)).await;
    }
    // One that fails permanently with nothing to undo: `error`, an open alert.
    app.knobs("a", permanent());
    let failed = app.submit("one", None).await;
    wait_state(&app, failed, "error", Duration::from_secs(30)).await;
    app.knobs("a", Knobs::default());
    // One that fails at its last step and is undone: `compensated`.
    app.knobs("c", permanent());
    let compensated = app.submit("three", None).await;
    wait_state(&app, compensated, "compensated", Duration::from_secs(30)).await;
    app.knobs("c", Knobs::default());
    // One whose step hangs past its complete-by: re-queued for an hour later.
    app.knobs(
        "b",
        Knobs {
            hang: true,
            ..Knobs::default()
        },
    );
    let waiting = app.submit("three", None).await;
    app.eventually(
        "the hanging order waits for its re-attempt",
        Duration::from_secs(30),
        || waits_for_retry(&app, waiting),
    )
    .await;
    // The agent reports a breaker per endpoint it serves.
    app.eventually(
        "the agent reported a breaker per agent",
        Duration::from_secs(15),
        || async {
            let n: i64 =
                sqlx::query_scalar("SELECT count(*) FROM agent_breakers WHERE state = 'closed'")
                    .fetch_one(&app.db)
                    .await
                    .expect("count breakers");
            n == sas_tests::AGENTS.len() as i64
        },
    )
    .await;

    let base = start_dashboard(&app).await;
    let browser = Browser::start()
        .await
        .expect("headless Chromium through chromedriver (Debian's chromium and chromium-driver)");
    // Nobody is logged in: the overview sends the browser to the login page.
    browser.goto(&format!("{base}/")).await.expect("open /");
    assert_eq!(path(&browser).await, "/login");
    // A wrong token is refused there.
    browser
        .log_in("not-a-token-not-a-token")
        .await
        .expect("log in");
    wait_text(
        &browser,
        "the login page says the token is not valid",
        "#login-error",
        Duration::from_secs(10),
        |error| error.contains("not valid"),
    )
    .await;

    // A viewer sees the failed order and no button to act on it.
    browser.log_in(VIEWER_TOKEN).await.expect("log in");
    let failed_row = format!("#failed tr[data-order-id=\"{failed}\"]");
    wait_page(
        &browser,
        "the viewer lands on the overview with the failed order",
        Duration::from_secs(20),
        || async {
            let who = browser.text_of("#me-name").await?.unwrap_or_default();
            let row = browser.text_of(&failed_row).await?.unwrap_or_default();
            Ok(if who == "vera (viewer)" && row.contains("error") {
                Ok(())
            } else {
                Err(format!("me {who:?}, failed row {row:?}"))
            })
        },
    )
    .await;
    assert_eq!(path(&browser).await, "/");
    assert!(
        browser
            .find_all(Locator::Css("button.retry, button.cancel"))
            .await
            .expect("find buttons")
            .is_empty(),
        "a viewer is shown no retry or cancel button"
    );
    // Nor can the page's own code act for a viewer: the server refuses.
    browser
        .run(&format!("sas.act('retry', '{failed}'); return true;"))
        .await
        .expect("run the page's retry");
    wait_text(
        &browser,
        "the page shows the viewer's 403",
        "#message",
        Duration::from_secs(10),
        |message| message.starts_with("403: vera is a viewer"),
    )
    .await;
    assert_eq!(
        app.order(failed).await.map(|(state, _)| state).as_deref(),
        Some("error"),
        "the viewer changed nothing"
    );
    std::fs::write(
        artifact("dashboard-viewer.png"),
        browser.screenshot().await.expect("screenshot"),
    )
    .expect("write screenshot");

    // Log out, and in again as the operator alice.
    browser
        .goto(&format!("{base}/logout"))
        .await
        .expect("log out");
    assert_eq!(path(&browser).await, "/login");
    browser.goto(&format!("{base}/")).await.expect("open /");
    assert_eq!(path(&browser).await, "/login", "the session is gone");
    browser.log_in(OPERATOR_TOKEN).await.expect("log in");

    let expected: BTreeMap<String, String> = [
        ("count-pending", "1"),
        ("count-processing", "0"),
        ("count-processed", "3"),
        ("count-error", "1"),
        ("count-compensating", "0"),
        ("count-compensated", "1"),
        ("count-alerts", "1"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let ids: Vec<&str> = expected.keys().map(String::as_str).collect();
    wait_page(
        &browser,
        "the counters show the known run",
        Duration::from_secs(20),
        || async {
            let shown = shown_counts(&browser, &ids).await?;
            Ok(if shown == expected {
                Ok(())
            } else {
                Err(format!("{shown:?}"))
            })
        },
    )
    .await;

    // The tables: the failed and the compensated order with their buttons,
    // the waiting one with its next attempt, six closed breakers.
    let compensated_row = format!("#failed tr[data-order-id=\"{compensated}\"]");
    let waiting_row = format!("#waiting tr[data-order-id=\"{waiting}\"]");
    let who = browser.text_of("#me-name").await.expect("me");
    assert_eq!(who.as_deref(), Some("alice (operator)"));
    wait_page(
        &browser,
        "the tables and charts are drawn",
        Duration::from_secs(20),
        || async {
            let failed_text = browser.text_of(&failed_row).await?.unwrap_or_default();
            let waiting_text = browser.text_of(&waiting_row).await?.unwrap_or_default();
            let breakers = browser
                .find_all(Locator::Css("#breakers tbody tr[data-state=\"closed\"]"))
                .await?
                .len();
            let bars = browser
                .find_all(Locator::Css("#throughput-chart rect.bar"))
                .await?
                .len();
            let dots = browser
                .find_all(Locator::Css("#latency-chart circle.dot"))
                .await?
                .len();
            let ok = failed_text.contains("error")
                && failed_text.contains("open")
                && !browser
                    .find_all(Locator::Css(&compensated_row))
                    .await?
                    .is_empty()
                && waiting_text.contains("in 59m")
                && waiting_text.contains("2 (retry)")
                && breakers == sas_tests::AGENTS.len()
                && bars > 0
                && dots > 0;
            Ok(if ok {
                Ok(())
            } else {
                Err(format!(
                    "failed row {failed_text:?}, waiting row {waiting_text:?}, {breakers} breakers, \
                     {bars} bars, {dots} latency points"
                ))
            })
        },
    )
    .await;
    let png = browser.screenshot().await.expect("screenshot");
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    let shot = artifact("dashboard.png");
    std::fs::write(&shot, &png).expect("write screenshot");
    eprintln!("screenshot: {}", shot.display());

    // A compensated order cannot be retried: its button is greyed out.
    let disabled = browser
        .find(Locator::Css(&format!("{compensated_row} button.retry")))
        .await
        .expect("the compensated order has a retry button");
    assert!(
        disabled
            .attr("disabled")
            .await
            .expect("attribute")
            .is_some(),
        "retry of a compensated order is disabled"
    );

    // Retry the failed order; remote-sim lets it through now.
    let retry = browser
        .find(Locator::Css(&format!("{failed_row} button.retry")))
        .await
        .expect("the failed order has a retry button");
    retry.click().await.expect("click retry");
    wait_page(
        &browser,
        "the page says the order was retried",
        Duration::from_secs(10),
        || async {
            let message = browser.text_of("#message").await?.unwrap_or_default();
            Ok(
                if message.contains(&format!("Order {failed} retried: now pending")) {
                    Ok(())
                } else {
                    Err(message)
                },
            )
        },
    )
    .await;
    // It left `error` in Postgres, through alice's retry in its event log…
    let retried: Vec<(String, Option<String>, String)> = sqlx::query_as(
        "SELECT actor, from_state, to_state FROM order_events \
         WHERE order_id = $1 AND event = 'retry_scheduled' ORDER BY seq",
    )
    .bind(failed)
    .fetch_all(&app.db)
    .await
    .expect("read events");
    assert_eq!(
        retried,
        vec![(
            "operator:alice".to_owned(),
            Some("error".to_owned()),
            "pending".to_owned()
        )]
    );
    // …and runs to the end; the page follows.
    wait_state(&app, failed, "processed", Duration::from_secs(30)).await;
    wait_page(
        &browser,
        "the counters show the retried order processed",
        Duration::from_secs(20),
        || async {
            let shown = shown_counts(
                &browser,
                &["count-processed", "count-error", "count-alerts"],
            )
            .await?;
            let gone = browser
                .find_all(Locator::Css(&failed_row))
                .await?
                .is_empty();
            Ok(
                if gone
                    && shown["count-processed"] == "4"
                    && shown["count-error"] == "0"
                    && shown["count-alerts"] == "0"
                {
                    Ok(())
                } else {
                    Err(format!("{shown:?}, row gone: {gone}"))
                },
            )
        },
    )
    .await;

    // A retry the state no longer allows (a second operator's late click, say)
    // is refused with the server's reason shown in the page.
    browser
        .run(&format!("sas.act('retry', '{failed}'); return true;"))
        .await
        .expect("run the page's retry");
    wait_page(
        &browser,
        "the page shows the 409",
        Duration::from_secs(10),
        || async {
            let message = browser.text_of("#message").await?.unwrap_or_default();
            Ok(
                if message.starts_with(&format!(
                    "409: cannot retry order {failed}: it is processed"
                )) {
                    Ok(())
                } else {
                    Err(message)
                },
            )
        },
    )
    .await;

    // The order's page: its steps and its whole timeline, the retry included.
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM order_events WHERE order_id = $1")
        .bind(failed)
        .fetch_one(&app.db)
        .await
        .expect("count events");
    browser
        .goto(&format!("{base}/orders/{failed}"))
        .await
        .expect("open the order page");
    wait_page(
        &browser,
        "the order page shows the timeline",
        Duration::from_secs(20),
        || async {
            let rows = browser
                .find_all(Locator::Css("#timeline tbody tr"))
                .await?
                .len();
            let state = browser.text_of("#order-state").await?.unwrap_or_default();
            let timeline = browser.text_of("#timeline").await?.unwrap_or_default();
            let step = browser
                .text_of("#steps tr[data-step=\"a\"]")
                .await?
                .unwrap_or_default();
            let ok = rows as i64 == events
                && state == "processed"
                && timeline.contains("operator:alice")
                && timeline.contains("error → pending")
                && timeline.contains("retried by an operator")
                && timeline.contains("failed")
                && step.contains("completed");
            Ok(if ok {
                Ok(())
            } else {
                Err(format!(
                    "{rows} of {events} rows, state {state:?}, step a {step:?}"
                ))
            })
        },
    )
    .await;
    let png = browser.screenshot().await.expect("screenshot");
    std::fs::write(artifact("dashboard-order.png"), &png).expect("write screenshot");
    browser.quit().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_answers_404_for_an_unknown_order_and_409_for_an_action_its_state_does_not_allow() {
    let app = TestApp::spawn().await;
    let (done, _) = app.run_one("one").await;
    let base = start_dashboard(&app).await;
    sas::tls::install_crypto_provider();
    let http = reqwest::Client::new();
    let unknown = Uuid::new_v4();

    let (status, body) = answer(http.get(format!("{base}/api/orders/{unknown}"))).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"], format!("no order {unknown}"));
    for action in ["retry", "cancel"] {
        let (status, body) = answer(
            http.post(format!("{base}/api/orders/{unknown}/{action}"))
                .json(&serde_json::json!({})),
        )
        .await;
        assert_eq!(status, 404, "{action}: {body}");
        assert!(body["error"].is_string(), "{body}");
    }

    // Neither retry nor cancel applies to a processed order: the same guards as sasctl.
    let (status, body) = answer(
        http.post(format!("{base}/api/orders/{done}/retry"))
            .json(&serde_json::json!({})),
    )
    .await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["state"], "processed");
    assert_eq!(
        body["error"],
        format!("cannot retry order {done}: it is processed (only error orders can be retried)")
    );
    let (status, body) = answer(
        http.post(format!("{base}/api/orders/{done}/cancel"))
            .json(&serde_json::json!({})),
    )
    .await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"].as_str().is_some_and(
            |e| e.contains("only pending, processing or error orders can be cancelled")
        ),
        "{body}"
    );
    // An action must be a JSON request, which a form on another site cannot send.
    let (status, _) = answer(http.post(format!("{base}/api/orders/{done}/retry"))).await;
    assert_eq!(status, 415);
    let (status, body) = answer(http.get(format!("{base}/api/orders/not-an-id"))).await;
    assert_eq!(status, 400, "{body}");

    // Nothing changed, and the order's details are there.
    assert_eq!(app.order(done).await, Some(("processed".into(), 0)));
    let (status, body) = answer(http.get(format!("{base}/api/orders/{done}"))).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["order"]["state"], "processed");
    assert_eq!(body["actions"]["retry"], false);
    let events = body["events"].as_array().expect("events");
    assert!(
        !events.iter().any(|e| e["actor"]
            .as_str()
            .is_some_and(|a| a.starts_with("operator:"))),
        "no operator event: {events:#?}"
    );
    assert_eq!(events.last().expect("events")["to_state"], "processed");
    assert_eq!(body["steps"][0]["state"], "completed");
    assert!(body["steps"][0]["duration_ms"].is_i64(), "{body}");
    // The branches (one step here: one stage) and what each step waits for.
    assert_eq!(body["stages"], serde_json::json!([["a"]]), "{body}");
    assert_eq!(body["steps"][0]["after"], serde_json::json!([]), "{body}");

    // The pages and their files are served.
    for path in [
        "/",
        "/orders/x",
        "/assets/style.css",
        "/assets/common.js",
        "/assets/overview.js",
        "/assets/order.js",
        "/assets/find.js",
    ] {
        let response = http
            .get(format!("{base}{path}"))
            .send()
            .await
            .expect("page");
        assert_eq!(response.status().as_u16(), 200, "{path}");
    }
    let (status, metrics) = answer(http.get(format!("{base}/metrics"))).await;
    assert_eq!(status, 200, "{metrics}");
    let (status, body) = answer(http.get(format!("{base}/readyz"))).await;
    assert_eq!(status, 200);
    assert_eq!(
        body["rabbitmq"],
        Value::Null,
        "the dashboard uses no broker"
    );
    assert!(
        app.terminate("dashboard").await.success(),
        "SIGTERM stops it with 0"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_records_its_breakers_in_postgres_and_the_dashboard_shows_them_with_the_held_order()
 {
    let app = TestApp::new().await;
    for name in ["submission", "scheduler", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    // A low threshold and a long cool-down: the breaker opens and stays open.
    app.start_with_env(
        "agent",
        "agent",
        &["--agent", "a"],
        &[
            ("SAS__AGENT__BREAKER_THRESHOLD", "2"),
            ("SAS__AGENT__BREAKER_COOLDOWN", "1h"),
        ],
    )
    .await;
    let base = start_dashboard(&app).await;
    sas::tls::install_crypto_provider();
    let http = reqwest::Client::new();
    let of_a = |list: &'static str| {
        let (http, base) = (http.clone(), base.clone());
        async move {
            let (_, body) = answer(http.get(format!("{base}/api/overview"))).await;
            body[list]
                .as_array()
                .and_then(|rows| rows.iter().find(|b| b["agent"] == "a").cloned())
        }
    };
    app.eventually(
        "both breakers of a reported closed",
        Duration::from_secs(15),
        || async {
            of_a("breakers")
                .await
                .is_some_and(|b| b["state"] == "closed")
                && of_a("shared_breakers")
                    .await
                    .is_some_and(|b| b["state"] == "closed")
        },
    )
    .await;
    let instance = of_a("breakers").await.expect("instance breaker of a");
    assert!(
        instance["endpoint"]
            .as_str()
            .is_some_and(|e| e.ends_with("/svc/a")),
        "{instance}"
    );
    assert!(
        instance["instance"]
            .as_str()
            .is_some_and(|i| i.contains(':')),
        "{instance}"
    );

    app.knobs(
        "a",
        Knobs {
            status: Some(503),
            ..Knobs::default()
        },
    );
    let id = app.submit("one", None).await;
    // The remote is down for every instance: the shared breaker opens and
    // holds the order.
    app.eventually(
        "the shared breaker of a open, holding the order",
        Duration::from_secs(15),
        || async {
            of_a("shared_breakers").await.is_some_and(|b| {
                b["state"] == "open"
                    && b["failures"].as_i64().is_some_and(|n| n >= 2)
                    && b["held"] == 1
                    && b["opened_at"].is_string()
            })
        },
    )
    .await;
    let (_, overview) = answer(http.get(format!("{base}/api/overview"))).await;
    let waiting = &overview["waiting"][0];
    assert_eq!(waiting["order_id"], id.to_string(), "{overview}");
    assert_eq!(waiting["kind"], "held", "{overview}");
    let (_, order) = answer(http.get(format!("{base}/api/orders/{id}"))).await;
    assert_eq!(order["stuck"]["reason"], "breaker_open", "{order}");
    assert_eq!(order["stuck"]["detail"]["agent"], "a", "{order}");

    // A clean stop takes the instance's rows with it; the shared breaker stays.
    assert!(app.terminate("agent").await.success());
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_breakers")
        .fetch_one(&app.db)
        .await
        .expect("count breakers");
    assert_eq!(rows, 0);
    assert!(of_a("shared_breakers").await.is_some());
}

#[test]
fn the_dashboard_starts_and_stops_like_every_service() {
    let out = std::process::Command::new(sas_tests::bin("dashboard"))
        .arg("--help")
        .output()
        .expect("run --help");
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("Usage"));

    // Bad configuration: one line, exit code 2.
    let out = std::process::Command::new(sas_tests::bin("dashboard"))
        .env("SAS__DATABASE__MAX_CONNECTIONS", "0")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.starts_with("dashboard: "), "{err}");

    // Postgres unreachable: exit code 1 after bounded retries.
    let started = Instant::now();
    let out = std::process::Command::new(sas_tests::bin("dashboard"))
        .env("SAS__DATABASE__URL", "postgres://postgres@127.0.0.1:1/nope")
        .env("SAS__DATABASE__CONNECT_TIMEOUT", "1s")
        .env("SAS__HTTP__PORT", "0")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    assert!(started.elapsed() < Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("could not reach"), "{err}");
}

/// The event log's actors of an order's operator events, through the API.
async fn operator_actors(http: &reqwest::Client, base: &str, id: Uuid) -> Vec<String> {
    let (status, body) = answer(
        http.get(format!("{base}/api/orders/{id}"))
            .bearer_auth(VIEWER_TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    body["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["actor"].as_str())
        .filter(|a| a.starts_with("operator:"))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_token_auth_the_api_refuses_strangers_lets_a_viewer_read_and_names_the_operator_who_retried()
 {
    let app = TestApp::builder()
        .extra_config(dashboard_auth())
        .spawn()
        .await;
    app.knobs("a", permanent());
    let failed = app.submit("one", None).await;
    wait_state(&app, failed, "error", Duration::from_secs(30)).await;
    app.knobs("a", Knobs::default());
    let base = start_dashboard(&app).await;
    let http = client();
    let retry = format!("{base}/api/orders/{failed}/retry");
    let json = serde_json::json!({});

    // No credentials, or wrong ones: 401, and the pages go to the login page.
    let response = http
        .get(format!("{base}/api/overview"))
        .send()
        .await
        .expect("answer");
    assert_eq!(response.status().as_u16(), 401);
    assert!(
        response
            .headers()
            .get("www-authenticate")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("Bearer")),
        "{:?}",
        response.headers()
    );
    let (status, _) = answer(http.post(&retry).json(&json)).await;
    assert_eq!(status, 401);
    let (status, _) = answer(
        http.get(format!("{base}/api/overview"))
            .bearer_auth("operator-token-of-alice-0124"),
    )
    .await;
    assert_eq!(status, 401, "a wrong token");
    for page in ["/", &format!("/orders/{failed}")] {
        let response = http
            .get(format!("{base}{page}"))
            .send()
            .await
            .expect("answer");
        assert_eq!(response.status().as_u16(), 303, "{page}");
        assert_eq!(response.headers()["location"], "/login", "{page}");
    }
    // The health and metrics endpoints, the login page and the pages' files need none.
    for open in [
        "/healthz",
        "/readyz",
        "/metrics",
        "/login",
        "/assets/common.js",
    ] {
        let response = http
            .get(format!("{base}{open}"))
            .send()
            .await
            .expect("answer");
        assert_eq!(response.status().as_u16(), 200, "{open}");
    }

    // A viewer reads, and may not act.
    let (status, me) = answer(http.get(format!("{base}/api/me")).bearer_auth(VIEWER_TOKEN)).await;
    assert_eq!(status, 200, "{me}");
    assert_eq!(
        me,
        serde_json::json!({ "name": "vera", "role": "viewer", "auth": "token" })
    );
    let (status, body) = answer(
        http.get(format!("{base}/api/overview"))
            .bearer_auth(VIEWER_TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["by_state"]["error"], 1, "{body}");
    let (status, body) = answer(http.post(&retry).bearer_auth(VIEWER_TOKEN).json(&json)).await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(
        app.order(failed).await.map(|(s, _)| s).as_deref(),
        Some("error")
    );

    // Requests for another host name (DNS rebinding) and actions from another
    // site are refused, even with a valid token.
    let (status, _) = answer(
        http.get(format!("{base}/api/overview"))
            .bearer_auth(OPERATOR_TOKEN)
            .header("host", "evil.example"),
    )
    .await;
    assert_eq!(status, 421);
    let (status, _) = answer(
        http.post(&retry)
            .bearer_auth(OPERATOR_TOKEN)
            .header("origin", "http://evil.example")
            .json(&json),
    )
    .await;
    assert_eq!(status, 403);
    assert_eq!(
        app.order(failed).await.map(|(s, _)| s).as_deref(),
        Some("error")
    );

    // The operator retries; a forged proxy header changes nobody's name.
    let (status, body) = answer(
        http.post(&retry)
            .bearer_auth(OPERATOR_TOKEN)
            .header("x-forwarded-user", "mallory")
            .header("origin", &base)
            .json(&json),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["state"], "pending");
    assert_eq!(
        operator_actors(&http, &base, failed).await,
        ["operator:alice"]
    );
    let actor: String = sqlx::query_scalar(
        "SELECT actor FROM order_events WHERE order_id = $1 AND event = 'retry_scheduled'",
    )
    .bind(failed)
    .fetch_one(&app.db)
    .await
    .expect("read the retry's event");
    assert_eq!(actor, "operator:alice");

    // The login form trades a token for an HttpOnly, SameSite=Strict session
    // cookie; logging out ends the session.
    let login = |token: &str, origin: &str| {
        http.post(format!("{base}/login"))
            .header("content-type", "application/x-www-form-urlencoded")
            .header("origin", origin)
            .body(format!("token={token}"))
    };
    let response = login("not-a-token-not-a-token", &base)
        .send()
        .await
        .expect("answer");
    assert_eq!(response.status().as_u16(), 401);
    assert!(response.headers().get("set-cookie").is_none());
    let huge = "x".repeat(100_000);
    // The server answers before reading the whole body and closes the
    // connection: the client must not reuse it.
    let response = login(&huge, &base)
        .header("connection", "close")
        .send()
        .await
        .expect("answer");
    assert_eq!(response.status().as_u16(), 413, "a login form is small");
    let response = login(OPERATOR_TOKEN, &base).send().await.expect("answer");
    assert_eq!(response.status().as_u16(), 303);
    assert_eq!(response.headers()["location"], "/");
    let set_cookie = response.headers()["set-cookie"]
        .to_str()
        .expect("cookie")
        .to_owned();
    assert!(
        set_cookie.starts_with("sas_session=")
            && set_cookie.contains("HttpOnly")
            && set_cookie.contains("SameSite=Strict"),
        "{set_cookie}"
    );
    assert!(
        !set_cookie.contains(OPERATOR_TOKEN),
        "the cookie is not the token"
    );
    let cookie = set_cookie
        .split(';')
        .next()
        .expect("cookie pair")
        .to_owned();
    let (status, me) = answer(http.get(format!("{base}/api/me")).header("cookie", &cookie)).await;
    assert_eq!(status, 200, "{me}");
    assert_eq!(me["name"], "alice");
    // A login posted from another site is refused before the token is looked at.
    let response = login(OPERATOR_TOKEN, "http://evil.example")
        .send()
        .await
        .expect("answer");
    assert_eq!(response.status().as_u16(), 403);
    let response = http
        .get(format!("{base}/logout"))
        .header("cookie", &cookie)
        .send()
        .await
        .expect("answer");
    assert_eq!(response.status().as_u16(), 303);
    assert_eq!(response.headers()["location"], "/login");
    let (status, _) = answer(http.get(format!("{base}/api/me")).header("cookie", &cookie)).await;
    assert_eq!(status, 401, "the session ended");

    // No token ever reaches the log.
    let log = app.log("dashboard");
    for secret in [VIEWER_TOKEN, OPERATOR_TOKEN] {
        assert!(!log.contains(secret), "a token in the log");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic_auth_and_a_trusted_proxy_identify_their_users_an_untrusted_peer_is_refused_and_no_auth_off_loopback_warns()
 {
    let app = TestApp::builder()
        .extra_config(dashboard_auth())
        .build()
        .await;
    let http = client();
    let unknown = Uuid::new_v4();
    let json = serde_json::json!({});

    // Basic: the configured users with their roles, nobody else.
    app.start_with_env(
        "dashboard-basic",
        "dashboard",
        &[],
        &[("SAS__DASHBOARD__AUTH", "basic")],
    )
    .await;
    let base = format!("http://127.0.0.1:{}", app.port("dashboard-basic"));
    let response = http.get(format!("{base}/")).send().await.expect("answer");
    assert_eq!(response.status().as_u16(), 401);
    assert!(
        response
            .headers()
            .get("www-authenticate")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("Basic")),
        "the browser is asked for a password"
    );
    for (user, password) in [("bob", "bob-secrets"), ("eve", "bob-secret")] {
        let (status, _) = answer(
            http.get(format!("{base}/api/me"))
                .basic_auth(user, Some(password)),
        )
        .await;
        assert_eq!(status, 401, "{user}:{password}");
    }
    let (status, _) = answer(
        http.get(format!("{base}/api/me"))
            .bearer_auth(OPERATOR_TOKEN),
    )
    .await;
    assert_eq!(status, 401, "a token is not a Basic password");
    let (status, me) = answer(
        http.get(format!("{base}/api/me"))
            .basic_auth("bob", Some("bob-secret")),
    )
    .await;
    assert_eq!(status, 200, "{me}");
    assert_eq!(
        me,
        serde_json::json!({ "name": "bob", "role": "operator", "auth": "basic" })
    );
    let act = |user: &str, password: &str| {
        http.post(format!("{base}/api/orders/{unknown}/retry"))
            .basic_auth(user, Some(password))
            .json(&json)
    };
    let (status, _) = answer(act("val", "val-secret")).await;
    assert_eq!(status, 403, "a viewer");
    let (status, _) = answer(act("bob", "bob-secret")).await;
    assert_eq!(status, 404, "an operator gets as far as the order");

    // Proxy, from a peer that is not the proxy: its identity header is refused.
    app.start_with_env(
        "dashboard-far",
        "dashboard",
        &[],
        &[
            ("SAS__DASHBOARD__AUTH", "proxy"),
            ("SAS__DASHBOARD__TRUSTED_PROXIES", "10.9.9.9,192.168.0.0/16"),
        ],
    )
    .await;
    let far = format!("http://127.0.0.1:{}", app.port("dashboard-far"));
    let (status, _) = answer(
        http.get(format!("{far}/api/me"))
            .header("x-forwarded-user", "carol")
            .header("x-forwarded-role", "operator"),
    )
    .await;
    assert_eq!(status, 403);
    let (status, _) = answer(http.get(format!("{far}/healthz"))).await;
    assert_eq!(status, 200, "health needs no identity");

    // Proxy, from the trusted peer: its headers name the user and the role.
    app.start_with_env(
        "dashboard-proxy",
        "dashboard",
        &[],
        &[
            ("SAS__DASHBOARD__AUTH", "proxy"),
            ("SAS__DASHBOARD__TRUSTED_PROXIES", "127.0.0.1"),
        ],
    )
    .await;
    let near = format!("http://127.0.0.1:{}", app.port("dashboard-proxy"));
    let (status, _) = answer(http.get(format!("{near}/api/me"))).await;
    assert_eq!(status, 401, "the proxy named nobody");
    let (status, me) = answer(
        http.get(format!("{near}/api/me"))
            .header("x-forwarded-user", "carol"),
    )
    .await;
    assert_eq!(status, 200, "{me}");
    assert_eq!(
        me,
        serde_json::json!({ "name": "carol", "role": "viewer", "auth": "proxy" })
    );
    let (status, _) = answer(
        http.post(format!("{near}/api/orders/{unknown}/retry"))
            .header("x-forwarded-user", "carol")
            .json(&json),
    )
    .await;
    assert_eq!(status, 403, "viewer unless the proxy says operator");
    let (status, _) = answer(
        http.post(format!("{near}/api/orders/{unknown}/retry"))
            .header("x-forwarded-user", "carol")
            .header("x-forwarded-role", "operator")
            .json(&json),
    )
    .await;
    assert_eq!(status, 404);
    let (status, _) = answer(
        http.get(format!("{near}/api/me"))
            .header("x-forwarded-user", "carol; DROP TABLE"),
    )
    .await;
    assert_eq!(status, 401, "a name that is not a plain word");

    // No authentication on an address other machines can reach: it serves,
    // everyone is the operator `dashboard`, and the log says so loudly.
    app.start_with_env(
        "dashboard-open",
        "dashboard",
        &[],
        &[
            ("SAS__DASHBOARD__AUTH", "none"),
            ("SAS__HTTP__HOST", "0.0.0.0"),
        ],
    )
    .await;
    let open = format!("http://127.0.0.1:{}", app.port("dashboard-open"));
    let (status, me) = answer(
        http.get(format!("{open}/api/me"))
            .header("x-forwarded-user", "mallory"),
    )
    .await;
    assert_eq!(status, 200, "{me}");
    assert_eq!(
        (&me["name"], &me["role"], &me["auth"]),
        (&json!("dashboard"), &json!("operator"), &json!("none"))
    );
    // Off loopback with no [applications]: every page says so too.
    assert!(
        me["warnings"][0]
            .as_str()
            .is_some_and(|w| w.contains("no [applications]")),
        "{me}"
    );
    let log = app.log("dashboard-open");
    assert!(
        log.contains("WARN") && log.contains("non-loopback address"),
        "{log}"
    );
    assert!(
        !app.log("dashboard-basic").contains("non-loopback"),
        "no warning when authenticated"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployment_open_beyond_loopback_without_applications_says_so_at_start_and_on_the_dashboard()
 {
    let app = TestApp::builder()
        .extra_config(dashboard_auth())
        .build()
        .await;
    let anywhere = [("SAS__HTTP__HOST", "0.0.0.0")];
    app.start_with_env("submission", "submission", &[], &anywhere)
        .await;
    app.start_with_env("dashboard", "dashboard", &[], &anywhere)
        .await;
    let says = "no [applications] are configured while the HTTP port on 0.0.0.0 is beyond loopback";
    for service in ["submission", "dashboard"] {
        app.eventually(
            "the warning in the service's log",
            Duration::from_secs(10),
            || async { app.log(service).contains(says) },
        )
        .await;
    }
    let base = format!("http://127.0.0.1:{}", app.port("dashboard"));
    let http = client();
    let (status, me) = answer(http.get(format!("{base}/api/me")).bearer_auth(VIEWER_TOKEN)).await;
    assert_eq!(status, 200, "{me}");
    assert!(
        me["warnings"][0].as_str().is_some_and(|w| w.contains(says)),
        "{me}"
    );
    // On loopback, as the tests' other deployments are: nothing to say.
    app.start("scheduler", "scheduler", &[]).await;
    app.eventually("the scheduler started", Duration::from_secs(10), || async {
        app.log("scheduler").contains("scheduler started")
    })
    .await;
    assert!(!app.log("scheduler").contains("no [applications]"));
}

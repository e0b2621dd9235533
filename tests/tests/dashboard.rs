//! The operator dashboard end to end: the real services and the real
//! `dashboard` binary against the test's Postgres and RabbitMQ, the overview
//! and an order's page driven in a real headless Chromium (through
//! chromedriver), and the JSON API with plain HTTP.
//!
//! The browser test keeps a screenshot of the overview with its data in
//! `target/ci-artifacts/dashboard.png` (and the order page beside it).

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use remote_sim::Knobs;
use sas_tests::browser::Browser;
use sas_tests::cli::wait_state;
use sas_tests::{Options, TestApp};
use serde_json::Value;
use uuid::Uuid;

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
async fn the_dashboard_shows_a_known_run_in_chromium_and_a_click_on_retry_sends_the_failed_order_back()
 {
    let app = TestApp::with(Options {
        step_timeout: "3s",
        // A step that runs out of time waits an hour for its re-attempt: it
        // stays in the "waiting" table for the whole test.
        retry_schedule: r#"["1h"]"#,
        ..Options::default()
    })
    .await;
    app.start_all().await;

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
        "the agent reported its six breakers",
        Duration::from_secs(15),
        || async {
            let n: i64 =
                sqlx::query_scalar("SELECT count(*) FROM agent_breakers WHERE state = 'closed'")
                    .fetch_one(&app.db)
                    .await
                    .expect("count breakers");
            n == 6
        },
    )
    .await;

    let base = start_dashboard(&app).await;
    let browser = Browser::start()
        .await
        .expect("headless Chromium through chromedriver (Debian's chromium and chromium-driver)");
    browser.goto(&format!("{base}/")).await.expect("open /");

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
    let failed_row = format!("#failed tr[data-order-id=\"{failed}\"]");
    let compensated_row = format!("#failed tr[data-order-id=\"{compensated}\"]");
    let waiting_row = format!("#waiting tr[data-order-id=\"{waiting}\"]");
    wait_page(
        &browser,
        "the tables and charts are drawn",
        Duration::from_secs(20),
        || async {
            let failed_text = browser.text_of(&failed_row).await?.unwrap_or_default();
            let waiting_text = browser.text_of(&waiting_row).await?.unwrap_or_default();
            let breakers = browser
                .find_all("#breakers tbody tr[data-state=\"closed\"]")
                .await?
                .len();
            let bars = browser.find_all("#throughput-chart rect.bar").await?.len();
            let dots = browser.find_all("#latency-chart circle.dot").await?.len();
            let ok = failed_text.contains("error")
                && failed_text.contains("open")
                && browser.find(&compensated_row).await?.is_some()
                && waiting_text.contains("in 59m")
                && waiting_text.contains("2 (retry)")
                && breakers == 6
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
        .find(&format!("{compensated_row} button.retry"))
        .await
        .expect("find")
        .expect("the compensated order has a retry button");
    assert!(
        browser
            .attribute(&disabled, "disabled")
            .await
            .expect("attribute")
            .is_some(),
        "retry of a compensated order is disabled"
    );

    // Retry the failed order; remote-sim lets it through now.
    let retry = browser
        .find(&format!("{failed_row} button.retry"))
        .await
        .expect("find")
        .expect("the failed order has a retry button");
    browser.click(&retry).await.expect("click retry");
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
    // It left `error` in Postgres, through an operator's retry in its event log…
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
            "operator:dashboard".to_owned(),
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
            let gone = browser.find(&failed_row).await?.is_none();
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
        .execute(&format!("sas.act('retry', '{failed}'); return true;"))
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
            let rows = browser.find_all("#timeline tbody tr").await?.len();
            let state = browser.text_of("#order-state").await?.unwrap_or_default();
            let timeline = browser.text_of("#timeline").await?.unwrap_or_default();
            let step = browser
                .text_of("#steps tr[data-step=\"a\"]")
                .await?
                .unwrap_or_default();
            let ok = rows as i64 == events
                && state == "processed"
                && timeline.contains("operator:dashboard")
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

/// `(status, JSON body)` of a request.
async fn answer(request: reqwest::RequestBuilder) -> (u16, Value) {
    let response = request.send().await.expect("dashboard answers");
    let status = response.status().as_u16();
    let body = response.json().await.unwrap_or(Value::Null);
    (status, body)
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

    // The pages and their files are served.
    for path in [
        "/",
        "/orders/x",
        "/assets/style.css",
        "/assets/common.js",
        "/assets/overview.js",
        "/assets/order.js",
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
async fn an_agent_records_its_breaker_state_in_postgres_and_the_dashboard_shows_it() {
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
    let breaker_a = || async {
        let (_, body) = answer(http.get(format!("{base}/api/overview"))).await;
        body["breakers"]
            .as_array()
            .and_then(|rows| rows.iter().find(|b| b["agent"] == "a").cloned())
    };
    app.eventually(
        "breaker a reported closed",
        Duration::from_secs(15),
        || async { breaker_a().await.is_some_and(|b| b["state"] == "closed") },
    )
    .await;

    app.knobs(
        "a",
        Knobs {
            status: Some(503),
            ..Knobs::default()
        },
    );
    app.submit("one", None).await;
    app.eventually(
        "breaker a reported open",
        Duration::from_secs(15),
        || async {
            breaker_a().await.is_some_and(|b| {
                b["state"] == "open"
                    && b["consecutive_failures"].as_i64().is_some_and(|n| n >= 2)
                    && b["stale"] == false
            })
        },
    )
    .await;
    let b = breaker_a().await.expect("breaker a");
    assert!(
        b["endpoint"]
            .as_str()
            .is_some_and(|e| e.ends_with("/svc/a")),
        "{b}"
    );
    assert!(
        b["instance"].as_str().is_some_and(|i| i.contains(':')),
        "{b}"
    );

    // A clean stop takes the instance's rows with it.
    assert!(app.terminate("agent").await.success());
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_breakers")
        .fetch_one(&app.db)
        .await
        .expect("count breakers");
    assert_eq!(rows, 0);
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

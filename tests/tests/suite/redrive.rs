//! Redrive (contract §9): an operator starts an ended order that did not
//! complete again, maybe with a patched payload, through `sasctl orders
//! redrive` or the dashboard. The steps done and not undone are kept; every
//! other step runs again under the key `<order_id>:<step>:r<N>`, with a
//! fencing token above every one before, and the status events go on with
//! the order's next `seq`.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use fantoccini::Locator;
use remote_sim::{Knobs, Stats};
use sas_tests::TestApp;
use sas_tests::browser::Browser;
use sas_tests::cli::{output, run, sasctl, wait_state};
use sas_tests::dashboard::{OPERATOR_TOKEN, VIEWER_TOKEN, answer};
use serde_json::{Value, json};
use uuid::Uuid;

/// A workflow of three steps that nothing undoes: an order whose third
/// step fails permanently ends `error` with the first two done.
const PLAIN: &str = r#"
[workflows.plain]
steps = [
  { name = "a", agent = "a", timeout = "5s" },
  { name = "b", agent = "b", timeout = "5s" },
  { name = "c", agent = "c", timeout = "5s" },
]
"#;

fn permanent() -> Knobs {
    Knobs {
        permanent: true,
        ..Knobs::default()
    }
}

/// `orders show --json` of an order.
async fn shown(app: &TestApp, id: Uuid) -> Value {
    run(app, &["orders", "show", &id.to_string(), "--json"])
        .await
        .expect_code(0)
        .json()
}

/// The order's event log, from `orders show --json`.
async fn events(app: &TestApp, id: Uuid) -> Vec<Value> {
    shown(app, id).await["events"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Its `redriven` events, in order.
fn redriven(events: &[Value]) -> Vec<Value> {
    events
        .iter()
        .filter(|e| e["event"] == "redriven")
        .cloned()
        .collect()
}

/// Panics unless the log's `seq` numbers are 1, 2, 3 … with no gap.
fn assert_no_gap(events: &[Value]) {
    let seqs: Vec<i64> = events.iter().filter_map(|e| e["seq"].as_i64()).collect();
    let expected: Vec<i64> = (1..=i64::try_from(seqs.len()).expect("few")).collect();
    assert_eq!(seqs, expected, "{events:#?}");
}

/// Writes a patch file into the test's directory; returns its path.
fn patch_file(app: &TestApp, name: &str, text: &str) -> String {
    let path = app.dir.join(name);
    std::fs::write(&path, text).expect("write the patch");
    path.display().to_string()
}

/// The fencing tokens the remote saw under `key`.
fn tokens(stats: &Stats, key: &str) -> Vec<i64> {
    stats
        .keys
        .get(key)
        .map(|k| k.tokens.clone())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_order_redriven_with_a_patch_runs_only_its_failed_step_again_under_a_new_key_and_ends_processed()
 {
    let app = TestApp::builder().extra_config(PLAIN).spawn().await;
    let status = app.status_queue("redrive").await;
    app.knobs("c", permanent());
    let id = app.submit("plain", Some(&status)).await;
    // c fails permanently; nothing has an undo: the order ends in error
    // with a and b done.
    wait_state(&app, id, "error", Duration::from_secs(30)).await;
    app.knobs("c", Knobs::default());

    let patch = patch_file(&app, "fix.json", r#"{"n": 2, "note": "fixed by hand"}"#);
    let mut cmd = sasctl(&app);
    cmd.args(["orders", "redrive", &id.to_string(), "--patch", &patch])
        .env("USER", "alice");
    let out = output(cmd).await.expect_code(0);
    assert_eq!(out.stdout, format!("order {id} redriven: pending\n"));
    wait_state(&app, id, "processed", Duration::from_secs(30)).await;

    // The remote saw c again under the new key, and a and b never again.
    let stats = app.stats();
    for kept in ["a", "b"] {
        assert_eq!(stats.keys[&format!("{id}:{kept}")].calls, 1, "{kept}");
        assert!(
            !stats.keys.contains_key(&format!("{id}:{kept}:r1")),
            "{kept} was kept"
        );
    }
    assert_eq!(stats.keys[&format!("{id}:c")].applied, 0);
    assert_eq!(stats.keys[&format!("{id}:c:r1")].applied, 1);
    // The fencing token of the redrive's dispatch is above the old ones.
    let old = tokens(&stats, &format!("{id}:c"));
    let new = tokens(&stats, &format!("{id}:c:r1"));
    assert!(!old.is_empty() && !new.is_empty(), "{old:?} {new:?}");
    assert!(
        new.iter().min() > old.iter().max(),
        "old {old:?}, new {new:?}"
    );

    // The order carries the patched payload; c's result came under r1.
    let order = shown(&app, id).await;
    let after = json!({ "n": 2, "note": "fixed by hand" });
    assert_eq!(order["order"]["payload"], after);
    let c = &order["steps"][2];
    assert_eq!(c["result"]["idempotency_key"], format!("{id}:c:r1"), "{c}");

    // The event log: who redrove it, when, the payload before and after,
    // and the numbers go on without a gap.
    let events = order["events"].as_array().cloned().unwrap_or_default();
    assert_no_gap(&events);
    let redrives = redriven(&events);
    assert_eq!(redrives.len(), 1, "{events:#?}");
    let r = &redrives[0];
    assert_eq!(r["actor"], "operator:alice");
    assert_eq!(
        (&r["from_state"], &r["to_state"]),
        (&json!("error"), &json!("pending"))
    );
    assert!(r["at"].is_string());
    assert_eq!(r["detail"]["before"], json!({ "n": 1 }));
    assert_eq!(r["detail"]["after"], after);
    assert_eq!(r["detail"]["redrive"], 1);
    assert_eq!(events.last().expect("events")["to_state"], "processed");
    let text = run(&app, &["orders", "show", &id.to_string()])
        .await
        .expect_code(0)
        .stdout;
    assert!(text.contains("operator:alice"), "{text}");
    assert!(text.contains("redriven"), "{text}");

    // The application's status events go on with the next seq: two
    // terminal events, `failed` then `processed`, and no gap between.
    let got = app
        .collect(&status, Duration::from_secs(30), |got| {
            got.iter().any(|e| e["state"] == "processed")
        })
        .await;
    let seqs: BTreeSet<i64> = got.iter().filter_map(|e| e["seq"].as_i64()).collect();
    let last = *seqs.last().expect("events");
    assert_eq!(seqs, (1..=last).collect(), "{got:#?}");
    let states = sas_tests::states(&got);
    let at = |state: &str| {
        states
            .iter()
            .position(|s| *s == state)
            .unwrap_or_else(|| panic!("no {state} event: {states:?}"))
    };
    assert!(
        at("failed") < at("redriven") && at("redriven") < at("processed"),
        "{states:?}"
    );
    let announced = got
        .iter()
        .find(|e| e["state"] == "redriven")
        .expect("a redriven event");
    assert_eq!(announced["detail"]["after"], after);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_redrive_runs_under_r2_and_every_undo_and_dispatch_has_a_key_and_token_of_its_own()
{
    let app = TestApp::spawn().await;
    // c fails permanently: b and a are undone, the order ends compensated.
    app.knobs("c", permanent());
    let id = app.submit("three", None).await;
    wait_state(&app, id, "compensated", Duration::from_secs(30)).await;

    // Redrive 1, with c still failing: a and b run again as r1, c fails
    // again, and they are undone under r1's undo keys.
    run(&app, &["orders", "redrive", &id.to_string()])
        .await
        .expect_code(0);
    wait_state(&app, id, "compensated", Duration::from_secs(30)).await;
    // Redrive 2, once c is mended: every step runs as r2.
    app.knobs("c", Knobs::default());
    let out = run(&app, &["orders", "redrive", &id.to_string(), "--json"])
        .await
        .expect_code(0);
    assert_eq!(
        out.json(),
        json!({ "order_id": id.to_string(), "state": "pending" })
    );
    wait_state(&app, id, "processed", Duration::from_secs(30)).await;

    let stats = app.stats();
    for key in [
        "a",
        "a:compensate",
        "a:r1",
        "a:compensate:r1",
        "a:r2",
        "c:r2",
    ] {
        let k = &stats.keys[&format!("{id}:{key}")];
        assert_eq!(k.applied, 1, "{key}: {k:?}");
    }
    for key in ["c", "c:r1"] {
        assert_eq!(stats.keys[&format!("{id}:{key}")].applied, 0, "{key}");
    }
    assert!(!stats.keys.contains_key(&format!("{id}:b:compensate:r2")));
    // Step a's fencing token climbs over every dispatch, undos included.
    let a: Vec<i64> = ["a", "a:compensate", "a:r1", "a:compensate:r1", "a:r2"]
        .iter()
        .flat_map(|key| tokens(&stats, &format!("{id}:{key}")))
        .collect();
    assert!(a.windows(2).all(|w| w[0] < w[1]), "{a:?}");

    let events = events(&app, id).await;
    assert_no_gap(&events);
    let numbers: Vec<Value> = redriven(&events)
        .iter()
        .map(|e| e["detail"]["redrive"].clone())
        .collect();
    assert_eq!(numbers, [json!(1), json!(2)]);
    for e in redriven(&events) {
        assert_eq!(e["from_state"], "compensated");
        assert_eq!(e["detail"]["before"], e["detail"]["after"], "no patch");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_of_an_order_that_did_not_end_in_failure_or_with_a_bad_patch_is_refused_with_a_clear_error()
 {
    // Long enough that a hanging step keeps its order processing.
    let app = TestApp::builder().step_timeout("30s").spawn().await;
    let unknown = Uuid::new_v4().to_string();
    let out = run(&app, &["orders", "redrive", &unknown])
        .await
        .expect_code(3);
    assert_eq!(out.stderr, format!("sasctl: no order {unknown}\n"));

    let (done, _) = app.run_one("one").await;
    let out = run(&app, &["orders", "redrive", &done.to_string()])
        .await
        .expect_code(4);
    assert_eq!(
        out.stderr,
        format!(
            "sasctl: cannot redrive order {done}: it is processed (only ended orders that did \
             not complete (error or compensated) can be redriven)\n"
        )
    );
    assert_eq!(out.stdout, "");

    // An order still running is not redriven either.
    app.knobs(
        "b",
        Knobs {
            hang: true,
            ..Knobs::default()
        },
    );
    let running = app.submit("three", None).await;
    wait_state(&app, running, "processing", Duration::from_secs(30)).await;
    let out = run(&app, &["orders", "redrive", &running.to_string()])
        .await
        .expect_code(4);
    assert_eq!(
        out.stderr,
        format!(
            "sasctl: cannot redrive order {running}: it is processing (only ended orders that \
             did not complete (error or compensated) can be redriven)\n"
        )
    );
    assert!(redriven(&events(&app, running).await).is_empty());

    // A patch that cannot be read, is not JSON, or gives a payload no
    // order may carry: exit 2, and the order is as it was.
    app.knobs("a", permanent());
    let failed = app.submit("one", None).await;
    wait_state(&app, failed, "error", Duration::from_secs(30)).await;
    let id = failed.to_string();
    let before = events(&app, failed).await;
    let missing = app.dir.join("missing.json").display().to_string();
    for (patch, says) in [
        (missing, "cannot open the patch".to_owned()),
        (
            patch_file(&app, "bad.json", "{nope"),
            "is not JSON".to_owned(),
        ),
        (
            patch_file(&app, "array.json", "[1, 2]"),
            format!(
                "sasctl: cannot redrive order {id}: the patched payload is refused: field `payload` must be an object\n"
            ),
        ),
        (
            patch_file(&app, "nul.json", r#"{"n": "a\u0000b"}"#),
            "NUL characters".to_owned(),
        ),
    ] {
        let out = run(&app, &["orders", "redrive", &id, "--patch", &patch])
            .await
            .expect_code(2);
        assert!(out.stderr.contains(&says), "{says}: {out:#?}");
    }
    assert_eq!(
        app.order(failed).await.map(|(s, _)| s).as_deref(),
        Some("error")
    );
    assert_eq!(events(&app, failed).await, before, "nothing was logged");
}

/// An order of `one` failed for good (its remote mended since), and a
/// dashboard with token logins: `(app, order, the dashboard's URL)`.
async fn failed_order_and_a_dashboard() -> (TestApp, Uuid, String) {
    let app = TestApp::builder()
        .extra_config(sas_tests::dashboard::token_auth())
        .spawn()
        .await;
    app.knobs("a", permanent());
    let id = app.submit("one", None).await;
    wait_state(&app, id, "error", Duration::from_secs(30)).await;
    app.knobs("a", Knobs::default());
    app.start("dashboard", "dashboard", &[]).await;
    let base = format!("http://127.0.0.1:{}", app.port("dashboard"));
    (app, id, base)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_dashboard_an_operator_redrives_an_order_and_a_viewer_cannot() {
    let (app, id, base) = failed_order_and_a_dashboard().await;
    sas::tls::install_crypto_provider();
    let http = reqwest::Client::new();
    let url = format!("{base}/api/orders/{id}/redrive");
    let fix = json!({ "patch": { "n": 5 } });

    // The page may offer it: the order is in error.
    let (status, page) = answer(
        http.get(format!("{base}/api/orders/{id}"))
            .bearer_auth(VIEWER_TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["actions"]["redrive"], true, "{page}");

    // A viewer may not.
    let (status, body) = answer(http.post(&url).bearer_auth(VIEWER_TOKEN).json(&fix)).await;
    assert_eq!(status, 403, "{body}");
    // Nor may a request that is not JSON, nor a body that is not an object.
    let response = http
        .post(&url)
        .bearer_auth(OPERATOR_TOKEN)
        .body("patch=1")
        .send()
        .await
        .expect("answer");
    assert_eq!(response.status().as_u16(), 415);
    let (status, body) = answer(
        http.post(&url)
            .bearer_auth(OPERATOR_TOKEN)
            .json(&json!([1])),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    // A patch that leaves no object payload: 422.
    let (status, body) = answer(
        http.post(&url)
            .bearer_auth(OPERATOR_TOKEN)
            .json(&json!({ "patch": "x" })),
    )
    .await;
    assert_eq!(status, 422, "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("must be an object")),
        "{body}"
    );
    assert_eq!(
        app.order(id).await.map(|(s, _)| s).as_deref(),
        Some("error")
    );

    // An operator may, under their own name.
    let (status, body) = answer(
        http.post(&url)
            .bearer_auth(OPERATOR_TOKEN)
            .header("origin", &base)
            .json(&fix),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({ "order_id": id.to_string(), "state": "pending" })
    );
    wait_state(&app, id, "processed", Duration::from_secs(30)).await;
    assert_eq!(app.stats().keys[&format!("{id}:a:r1")].applied, 1);
    let (_, page) = answer(
        http.get(format!("{base}/api/orders/{id}"))
            .bearer_auth(VIEWER_TOKEN),
    )
    .await;
    let events = page["events"].as_array().cloned().unwrap_or_default();
    let r = redriven(&events);
    assert_eq!(r.len(), 1, "{page}");
    assert_eq!(r[0]["actor"], "operator:alice");
    assert_eq!(r[0]["detail"]["before"], json!({ "n": 1 }));
    assert_eq!(r[0]["detail"]["after"], json!({ "n": 5 }));
    assert_eq!(page["order"]["payload"], json!({ "n": 5 }));
    assert_eq!(page["actions"]["redrive"], false, "processed");

    // Processed, it is not redriven again.
    let (status, body) = answer(http.post(&url).bearer_auth(OPERATOR_TOKEN).json(&fix)).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["state"], "processed");
}

/// Waits until `check` finds what it wants in the page; panics with what
/// it saw last after `timeout`.
async fn wait_page<F, Fut>(what: &str, timeout: Duration, check: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let seen = match check().await {
            Ok(()) => return,
            Err(seen) => seen,
        };
        assert!(
            Instant::now() < deadline,
            "not within {timeout:?}: {what}; last seen: {seen}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_chromium_an_operator_redrives_from_the_order_page_and_its_timeline_shows_the_payload_change()
 {
    let (app, id, base) = failed_order_and_a_dashboard().await;
    let page = format!("{base}/orders/{id}");
    let browser = Browser::start()
        .await
        .expect("headless Chromium through chromedriver (Debian's chromium and chromium-driver)");
    let loaded = || async {
        let state = browser
            .text_of("#order-state")
            .await
            .map_err(|e| e.to_string())?;
        match state.as_deref() {
            Some("error") => Ok(()),
            other => Err(format!("state {other:?}")),
        }
    };

    // A viewer's page has no Redrive button.
    browser.goto(&page).await.expect("open the order");
    browser.log_in(VIEWER_TOKEN).await.expect("log in");
    browser.goto(&page).await.expect("open the order");
    wait_page("the viewer sees the order", Duration::from_secs(20), loaded).await;
    let buttons = browser
        .find_all(Locator::Css("button.redrive"))
        .await
        .expect("find");
    assert!(buttons.is_empty(), "a viewer is shown no redrive button");

    // The operator opens the form, types a patch and redrives.
    browser
        .goto(&format!("{base}/logout"))
        .await
        .expect("log out");
    browser.log_in(OPERATOR_TOKEN).await.expect("log in");
    browser.goto(&page).await.expect("open the order");
    wait_page(
        "the operator sees the order",
        Duration::from_secs(20),
        loaded,
    )
    .await;
    let open = browser
        .find(Locator::Css("button.redrive[data-action=redrive]"))
        .await
        .expect("an operator has a Redrive button");
    open.click().await.expect("open the redrive form");
    let patch = browser
        .find(Locator::Css("#redrive-patch"))
        .await
        .expect("the form has a patch box");
    patch
        .send_keys(r#"{"n": 5, "why": "fixed"}"#)
        .await
        .expect("type the patch");
    let go = browser
        .find(Locator::Css("#redrive-go"))
        .await
        .expect("the form has a Redrive button");
    go.click().await.expect("redrive");
    wait_state(&app, id, "processed", Duration::from_secs(30)).await;

    // The timeline's redriven row names alice and lists what changed.
    wait_page(
        "the timeline shows the redrive's payload change",
        Duration::from_secs(20),
        || async {
            let row = browser
                .text_of("#timeline tr[data-event=redriven]")
                .await
                .map_err(|e| e.to_string())?
                .unwrap_or_default();
            let wanted = [
                "operator:alice",
                "redrive 1",
                "n: 1 → 5",
                "why: (absent) → \"fixed\"",
            ];
            if wanted.iter().all(|w| row.contains(w)) {
                Ok(())
            } else {
                Err(row)
            }
        },
    )
    .await;
    let after: Value = browser
        .run("return document.querySelector('#timeline pre[data-payload=after]').textContent;")
        .await
        .expect("read the payload after");
    let after: Value = serde_json::from_str(after.as_str().unwrap_or_default()).expect("JSON");
    assert_eq!(after, json!({ "n": 5, "why": "fixed" }));
    browser.quit().await;
}

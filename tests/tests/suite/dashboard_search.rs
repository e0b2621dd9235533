//! The dashboard finds things: the order search (`GET /api/orders`) by each
//! filter, paged without repeats or gaps, and proof against hostile input;
//! the dead-letter panel's API (list, replay, purge; operators only); and
//! the search form in a real headless Chromium.

use std::collections::BTreeSet;
use std::time::Duration;

use fantoccini::Locator;
use remote_sim::Knobs;
use sas::broker::Outgoing;
use sas_tests::TestApp;
use sas_tests::browser::Browser;
use sas_tests::cli::wait_state;
use sas_tests::dashboard::{OPERATOR_TOKEN, VIEWER_TOKEN, answer, token_auth};
use serde_json::{Value, json};
use uuid::Uuid;

fn http() -> reqwest::Client {
    sas::tls::install_crypto_provider();
    reqwest::Client::new()
}

/// Publishes an order of `workflow` with `payload`; returns its id.
async fn submit(app: &TestApp, workflow: &str, payload: Value) -> Uuid {
    let id = Uuid::new_v4();
    let body = json!({ "order_id": id, "workflow": workflow, "payload": payload });
    app.publish_raw(body.to_string().as_bytes(), None, None)
        .await;
    id
}

/// Waits until the state store holds `n` orders.
async fn wait_stored(app: &TestApp, n: i64) {
    app.eventually(
        &format!("{n} orders stored"),
        Duration::from_secs(30),
        || async { app.states().await.values().sum::<i64>() == n },
    )
    .await;
}

/// The ids of a search's answer, in its order.
fn ids(body: &Value) -> Vec<Uuid> {
    body["orders"]
        .as_array()
        .unwrap_or_else(|| panic!("no orders in {body}"))
        .iter()
        .map(|o| {
            o["order_id"]
                .as_str()
                .and_then(|s| s.parse().ok())
                .expect("an id")
        })
        .collect()
}

/// Every page of a search of `query` with `limit` per page: the ids in order
/// and how many pages it took.
async fn all_pages(
    http: &reqwest::Client,
    base: &str,
    query: &str,
    limit: u32,
) -> (Vec<Uuid>, usize) {
    let mut found = Vec::new();
    let mut after: Option<String> = None;
    for page in 1..=100 {
        let mut url = format!("{base}/api/orders?{query}&limit={limit}");
        if let Some(cursor) = &after {
            url.push_str(&format!("&after={cursor}"));
        }
        let (status, body) = answer(http.get(&url)).await;
        assert_eq!(status, 200, "{url}: {body}");
        let page_ids = ids(&body);
        assert!(page_ids.len() <= limit as usize, "{body}");
        found.extend(page_ids);
        match body["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => return (found, page),
        }
    }
    panic!("more than 100 pages for {query}");
}

async fn search(http: &reqwest::Client, base: &str, query: &str) -> Vec<Uuid> {
    let (status, body) = answer(http.get(format!("{base}/api/orders?{query}"))).await;
    assert_eq!(status, 200, "{query}: {body}");
    ids(&body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_search_finds_orders_by_id_state_workflow_time_range_and_payload_field_and_pages_through_them_without_repeats_or_gaps()
 {
    let app = TestApp::spawn().await;
    // One order that fails: `error`.
    app.knobs(
        "a",
        Knobs {
            permanent: true,
            ..Knobs::default()
        },
    );
    let failed = submit(&app, "one", json!({ "customer": { "id": 7 } })).await;
    wait_state(&app, failed, "error", Duration::from_secs(30)).await;
    app.knobs("a", Knobs::default());
    // A first batch: 45 orders tagged "bulk".
    let mut bulk = Vec::new();
    for i in 0..45 {
        bulk.push(
            submit(
                &app,
                "one",
                json!({ "customer": { "id": 1000 + i }, "tag": "bulk" }),
            )
            .await,
        );
    }
    wait_stored(&app, 46).await;
    let (first_end,): (chrono::DateTime<chrono::Utc>,) =
        sqlx::query_as("SELECT max(created_at) FROM orders")
            .fetch_one(&app.db)
            .await
            .expect("latest creation");
    // A second batch, created after the first was stored: customer 42's
    // orders (a number in one payload, a string in another). Each is
    // stored before the next is sent, so that no two share a submission
    // batch (and its creation time): newest first is then one order.
    let stored_before = (bulk.len() + 1) as i64;
    let mut later = Vec::new();
    for (workflow, id) in [
        ("three", json!(42)),
        ("three", json!("42")),
        ("one", json!(43)),
    ] {
        later.push(submit(&app, workflow, json!({ "customer": { "id": id } })).await);
        wait_stored(&app, stored_before + later.len() as i64).await;
    }
    for id in bulk.iter().chain(&later) {
        wait_state(&app, *id, "processed", Duration::from_secs(60)).await;
    }

    let base = {
        app.start("dashboard", "dashboard", &[]).await;
        format!("http://127.0.0.1:{}", app.port("dashboard"))
    };
    let http = http();

    // By id: that order alone.
    assert_eq!(
        search(&http, &base, &format!("id={failed}")).await,
        [failed]
    );
    assert!(
        search(&http, &base, &format!("id={}", Uuid::new_v4()))
            .await
            .is_empty()
    );
    // By state.
    assert_eq!(search(&http, &base, "state=error").await, [failed]);
    assert_eq!(
        search(&http, &base, "state=processed&limit=200")
            .await
            .len(),
        48
    );
    // By workflow, newest first.
    let three = search(&http, &base, "workflow=three").await;
    assert_eq!(three, [later[1], later[0]]);
    // By payload field: compared as text, so 42 and "42" both match.
    let customer_42 = search(&http, &base, "field=customer.id&value=42").await;
    assert_eq!(customer_42, [later[1], later[0]]);
    assert_eq!(
        search(&http, &base, "field=customer.id&value=7").await,
        [failed]
    );
    assert!(
        search(&http, &base, "field=customer.id&value=4")
            .await
            .is_empty()
    );
    assert!(
        search(&http, &base, "field=customer.name&value=42")
            .await
            .is_empty()
    );
    // By time range: from the second batch on, and before it.
    let cut = (first_end + chrono::Duration::microseconds(1)).to_rfc3339();
    let cut = urlencode(&cut);
    let after_cut: BTreeSet<Uuid> = search(&http, &base, &format!("from={cut}"))
        .await
        .into_iter()
        .collect();
    assert_eq!(after_cut, later.iter().copied().collect());
    let before_cut = search(&http, &base, &format!("to={cut}&limit=200")).await;
    assert_eq!(before_cut.len(), 46);
    assert!(before_cut.contains(&failed) && !before_cut.contains(&later[0]));
    // Filters together.
    assert_eq!(
        search(
            &http,
            &base,
            &format!("from={cut}&workflow=one&state=processed")
        )
        .await,
        [later[2]]
    );

    // Paging: 45 bulk orders, 7 a page: 7 pages, each order once, newest first.
    let (paged, pages) = all_pages(&http, &base, "field=tag&value=bulk", 7).await;
    assert_eq!(pages, 7);
    assert_eq!(paged.len(), 45, "{paged:?}");
    let unique: BTreeSet<Uuid> = paged.iter().copied().collect();
    assert_eq!(unique.len(), 45, "no order twice");
    assert_eq!(unique, bulk.iter().copied().collect(), "no order missed");
    let newest_first: Vec<Uuid> = sqlx::query_scalar(
        "SELECT order_id FROM orders WHERE payload->>'tag' = 'bulk' \
         ORDER BY created_at DESC, order_id DESC",
    )
    .fetch_all(&app.db)
    .await
    .expect("read orders");
    assert_eq!(paged, newest_first);
    // An order arriving between two pages does not shift the next page.
    let (status, first) =
        answer(http.get(format!("{base}/api/orders?field=tag&value=bulk&limit=20"))).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(ids(&first), paged[..20]);
    let next = first["next"].as_str().expect("a next page").to_owned();
    let newcomer = submit(&app, "one", json!({ "tag": "bulk" })).await;
    wait_stored(&app, 50).await;
    let (status, second) = answer(http.get(format!(
        "{base}/api/orders?field=tag&value=bulk&limit=20&after={}",
        urlencode(&next)
    )))
    .await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(ids(&second), paged[20..40]);
    // The newcomer heads a new search.
    assert_eq!(
        search(&http, &base, "field=tag&value=bulk&limit=1").await,
        [newcomer]
    );
}

/// Percent-encodes a query value.
fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_search_input_is_refused_with_400_or_matches_nothing_never_a_500_nor_an_injection()
{
    let app = TestApp::new().await;
    app.start("submission", "submission", &[]).await;
    // Quotes and SQL in the payload's own keys and values are plain data.
    let odd = submit(
        &app,
        "one",
        json!({ "we'ird": { "k\"ey": "v'al; DROP TABLE orders; --" }, "n": 1 }),
    )
    .await;
    let plain = submit(&app, "one", json!({ "n": 2 })).await;
    wait_stored(&app, 2).await;
    let base = {
        app.start("dashboard", "dashboard", &[]).await;
        format!("http://127.0.0.1:{}", app.port("dashboard"))
    };
    let http = http();

    assert_eq!(
        search(
            &http,
            &base,
            &format!(
                "field={}&value={}",
                urlencode("we'ird.k\"ey"),
                urlencode("v'al; DROP TABLE orders; --")
            )
        )
        .await,
        [odd]
    );

    // Long, yet under what an HTTP client sends in a URL (64 KiB).
    let long = "x".repeat(20_000);
    let deep = vec!["k"; 17].join(".");
    let hostile: Vec<(String, String)> = vec![
        ("'".into(), "'".into()),
        ("n' OR '1'='1".into(), "1".into()),
        ("n".into(), "1' OR '1'='1".into()),
        ("n".into(), "2'); DROP TABLE orders; --".into()),
        ("n\"; DROP TABLE orders; --".into(), "2".into()),
        ("{n}".into(), "2".into()),
        ("n}".into(), "2".into()),
        ("\\".into(), "\\".into()),
        ("$1".into(), "$2".into()),
        ("n::text".into(), "2".into()),
        ("..".into(), "2".into()),
        (".n".into(), "2".into()),
        (deep, "2".into()),
        ("n".into(), "\u{0}".into()),
        ("n\u{0}".into(), "2".into()),
        ("n".into(), "\u{1b}[2J".into()),
        ("😀.🎉".into(), "💥".into()),
        ("n".into(), "\u{fffd}\u{feff}".into()),
        ("k".repeat(300), "2".into()),
        ("n".into(), "v".repeat(2_000)),
        (long.clone(), "2".into()),
        ("n".into(), long.clone()),
    ];
    for (field, value) in &hostile {
        let url = format!(
            "{base}/api/orders?field={}&value={}",
            urlencode(field),
            urlencode(value)
        );
        let (status, body) = answer(http.get(&url)).await;
        let shown = sas::messages::truncate_bytes(field, 40);
        assert!(
            status == 400 || (status == 200 && ids(&body).is_empty()),
            "field {shown:?}: {status} {body}"
        );
        if status == 400 {
            assert!(body["error"].is_string(), "{body}");
        }
    }
    // Every other parameter too.
    for query in [
        "id=1' OR '1'='1".to_owned(),
        "id=00000000-0000-0000-0000-000000000000'--".to_owned(),
        "state=error' OR '1'='1".to_owned(),
        format!("workflow={}", urlencode("one' OR '1'='1")),
        format!("workflow={}", urlencode("one\u{0}")),
        format!("workflow={long}"),
        format!("from={}", urlencode("2026-01-01T00:00:00Z' OR '1'='1")),
        "from=2026-01-02T00:00:00Z&to=2026-01-01T00:00:00Z".to_owned(),
        "from=+275760-09-13T00:00:00Z".to_owned(),
        "after=1.2".to_owned(),
        format!("after={}", urlencode("1' OR '1'='1")),
        format!("after={}.{}", i64::MAX, Uuid::nil()),
        // Year -100000: a time chrono holds and Postgres does not.
        format!("after=-3155760000000000000.{}", Uuid::nil()),
        format!("after=-99999999999999999.{}", Uuid::nil()),
        "limit=-1".to_owned(),
        "limit=99999999999999999999".to_owned(),
        "field=n".to_owned(),
        "order=1;DROP TABLE orders".to_owned(),
        "%FF%FE=%FF".to_owned(),
    ] {
        let (status, body) = answer(http.get(format!("{base}/api/orders?{query}"))).await;
        let shown = sas::messages::truncate_bytes(&query, 60);
        assert!(
            status == 400 || (status == 200 && ids(&body).is_empty()),
            "{shown}: {status} {body}"
        );
    }
    // Nothing was dropped or changed, and the dashboard still answers.
    wait_stored(&app, 2).await;
    assert_eq!(search(&http, &base, "field=n&value=2").await, [plain]);
    assert!(
        app.log("dashboard")
            .lines()
            .all(|l| !l.contains("panicked"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letter_panel_lists_a_rejected_order_an_operator_replays_and_purges_it_and_a_viewer_is_refused_with_403()
 {
    let app = TestApp::builder().extra_config(token_auth()).spawn().await;
    let dead = app.queues.orders_dead().to_owned();
    let wait_dead = |n: u32| {
        let app = &app;
        let dead = dead.clone();
        async move {
            app.eventually(
                &format!("{n} in {dead}"),
                Duration::from_secs(30),
                || async { app.ready(&dead).await == n },
            )
            .await;
        }
    };
    // A bad order: its workflow does not exist; the submission rejects it.
    let bad = Uuid::new_v4();
    let bad_body = json!({ "order_id": bad, "workflow": "nope", "payload": {} }).to_string();
    app.publish_raw(bad_body.as_bytes(), None, Some("bad-1"))
        .await;
    wait_dead(1).await;
    // And a step request an agent could not read, in agent a's dead-letter queue.
    let requests_dead = app.queues.agent_requests_dead("a");
    app.publisher()
        .publish(&Outgoing {
            routing_key: &requests_dead,
            body: b"{\"not\": \"a request\"}",
            headers: &[("x-sas-reason", "unreadable request")],
            mandatory: true,
            ..Outgoing::default()
        })
        .await
        .expect("publish a dead request");

    app.start("dashboard", "dashboard", &[]).await;
    let base = format!("http://127.0.0.1:{}", app.port("dashboard"));
    let http = http();
    let viewer = |r: reqwest::RequestBuilder| r.bearer_auth(VIEWER_TOKEN);
    let operator = |r: reqwest::RequestBuilder| r.bearer_auth(OPERATOR_TOKEN);

    // The panel: every dead-letter queue with its count, for a viewer too.
    let (status, body) = answer(viewer(http.get(format!("{base}/api/dead-letters")))).await;
    assert_eq!(status, 200, "{body}");
    let queues = body["queues"].as_array().expect("queues");
    assert_eq!(queues.len(), 2 + sas_tests::AGENTS.len(), "{body}");
    let total = |queue: &str| {
        queues
            .iter()
            .find(|q| q["queue"] == queue)
            .map(|q| q["total"].clone())
            .unwrap_or_else(|| panic!("{queue} in {body}"))
    };
    assert_eq!(total(&dead), 1);
    assert_eq!(total(&requests_dead), 1);
    assert_eq!(total(app.queues.replies_dead()), 0);
    assert_eq!(queues[0]["kind"], "orders");
    assert_eq!(queues[0]["origin"], app.queues.orders());
    // Its messages, left in the queue.
    let (status, body) = answer(viewer(http.get(format!("{base}/api/dead-letters/{dead}")))).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["total"], 1);
    assert_eq!(body["letters"][0]["body"], bad_body.as_str());
    assert_eq!(body["letters"][0]["message_id"], "bad-1");
    assert!(
        body["letters"][0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("nope")),
        "{body}"
    );
    let (status, body) = answer(viewer(
        http.get(format!("{base}/api/dead-letters/{requests_dead}?limit=5")),
    ))
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["letters"][0]["reason"], "unreadable request");
    assert_eq!(app.ready(&dead).await, 1);

    // A viewer may not act.
    for action in ["replay", "purge"] {
        let (status, body) = answer(
            viewer(http.post(format!("{base}/api/dead-letters/{dead}/{action}"))).json(&json!({})),
        )
        .await;
        assert_eq!(status, 403, "{action}: {body}");
        assert!(
            body["error"]
                .as_str()
                .is_some_and(|e| e.contains("vera is a viewer")),
            "{body}"
        );
    }
    assert_eq!(app.ready(&dead).await, 1);
    // Nor may anyone without credentials, and an action must be JSON.
    let (status, _) = answer(
        http.post(format!("{base}/api/dead-letters/{dead}/purge"))
            .json(&json!({})),
    )
    .await;
    assert_eq!(status, 401);
    let (status, _) = answer(operator(
        http.post(format!("{base}/api/dead-letters/{dead}/purge")),
    ))
    .await;
    assert_eq!(status, 415);
    // Only this deployment's dead-letter queues.
    for queue in [
        app.queues.orders(),
        "other.orders.dead",
        "amq.rabbitmq.trace",
    ] {
        let (status, body) = answer(
            operator(http.post(format!("{base}/api/dead-letters/{queue}/purge"))).json(&json!({})),
        )
        .await;
        assert_eq!(status, 404, "{queue}: {body}");
        let (status, _) = answer(operator(
            http.get(format!("{base}/api/dead-letters/{queue}")),
        ))
        .await;
        assert_eq!(status, 404, "{queue}");
    }
    assert_eq!(app.ready(app.queues.orders()).await, 0);

    // The operator replays it: still bad, it comes back with a fresh reason.
    let (status, body) = answer(
        operator(http.post(format!("{base}/api/dead-letters/{dead}/replay"))).json(&json!({})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["replayed"], 1);
    wait_dead(1).await;
    // A fixed order in the dead-letter queue is replayed and processed.
    let fixed = Uuid::new_v4();
    let fixed_body = json!({ "order_id": fixed, "workflow": "one", "payload": {} }).to_string();
    app.publisher()
        .publish(&Outgoing {
            routing_key: &dead,
            body: fixed_body.as_bytes(),
            headers: &[("x-sas-reason", "unknown workflow \"one\"")],
            mandatory: true,
            ..Outgoing::default()
        })
        .await
        .expect("publish a dead letter");
    wait_dead(2).await;
    let (status, body) = answer(
        operator(http.post(format!("{base}/api/dead-letters/{dead}/replay"))).json(&json!({})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["replayed"], 2);
    wait_state(&app, fixed, "processed", Duration::from_secs(30)).await;
    wait_dead(1).await;
    assert_eq!(app.order(bad).await, None);

    // And purges what is left.
    let (status, body) = answer(
        operator(http.post(format!("{base}/api/dead-letters/{dead}/purge"))).json(&json!({})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["purged"], 1);
    assert_eq!(app.ready(&dead).await, 0);
    let (status, body) = answer(
        operator(http.post(format!("{base}/api/dead-letters/{requests_dead}/purge")))
            .json(&json!({})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["purged"], 1);
    let (_, body) = answer(viewer(http.get(format!("{base}/api/dead-letters")))).await;
    assert!(
        body["queues"]
            .as_array()
            .expect("queues")
            .iter()
            .all(|q| q["total"] == 0),
        "{body}"
    );
    // The operator's actions are logged under their name.
    let log = app.log("dashboard");
    assert!(
        log.contains("dead letters purged by an operator") && log.contains("alice"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_search_form_finds_an_order_by_its_payload_in_chromium_and_the_dead_letter_panel_shows_the_queues()
 {
    let app = TestApp::spawn().await;
    let wanted = submit(&app, "one", json!({ "customer": { "id": 4242 } })).await;
    let other = submit(&app, "one", json!({ "customer": { "id": 17 } })).await;
    wait_state(&app, wanted, "processed", Duration::from_secs(30)).await;
    wait_state(&app, other, "processed", Duration::from_secs(30)).await;
    app.start("dashboard", "dashboard", &[]).await;
    let base = format!("http://127.0.0.1:{}", app.port("dashboard"));

    let browser = Browser::start()
        .await
        .expect("headless Chromium through chromedriver (Debian's chromium and chromium-driver)");
    browser.goto(&format!("{base}/")).await.expect("open /");
    // Typed into the form as a user would.
    for (name, text) in [("field", "customer.id"), ("value", "4242")] {
        browser
            .find(Locator::Css(&format!("#search input[name='{name}']")))
            .await
            .expect("the overview has the search form")
            .send_keys(text)
            .await
            .expect("type");
    }
    browser
        .find(Locator::Css("#search-go"))
        .await
        .expect("a search button")
        .click()
        .await
        .expect("click search");
    let row = format!("#search-results tr[data-order-id=\"{wanted}\"]");
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let (text, rows) = loop {
        let text = browser
            .text_of(&row)
            .await
            .expect("read")
            .unwrap_or_default();
        let rows = browser
            .find_all(Locator::Css("#search-results tbody tr"))
            .await
            .expect("rows")
            .len();
        if (text.contains("processed") && rows == 1) || std::time::Instant::now() > deadline {
            break (text, rows);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // The dead-letter panel lists the orders' queue (empty) among the others.
    let dead_row = format!(
        "#dead-letters tr[data-queue=\"{}\"]",
        app.queues.orders_dead()
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let dead_text = loop {
        let t = browser
            .text_of(&dead_row)
            .await
            .expect("read")
            .unwrap_or_default();
        if t.contains("orders") || std::time::Instant::now() > deadline {
            break t;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let shot = browser.screenshot().await.expect("screenshot");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/ci-artifacts");
    std::fs::create_dir_all(&dir).expect("artifact directory");
    std::fs::write(dir.join("dashboard-search.png"), shot).expect("screenshot");
    browser.quit().await;
    assert!(
        text.contains("processed") && text.contains("one"),
        "the search shows {text:?}"
    );
    assert_eq!(rows, 1, "only the order of customer 4242");
    assert!(dead_text.contains(app.queues.orders()), "{dead_text:?}");
}

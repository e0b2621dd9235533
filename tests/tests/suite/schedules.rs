//! Recurring orders (contract §4b): one order per tick however many
//! supervisors run, the ticks missed while none ran by `catch_up`, and what
//! `sasctl schedules list` and the dashboard show. The schedules tick every
//! two seconds (a six-field expression, seconds first).

use std::time::Duration;

use chrono::{DateTime, SubsecRound as _, TimeDelta, Utc};
use sas::rules::schedule::{ScheduleKey, order_id};
use sas_tests::TestApp;
use sas_tests::cli::run;
use uuid::Uuid;

/// Every two seconds, on the even seconds.
const EVERY_2S: &str = "*/2 * * * * *";

/// A schedule of workflow `one` every two seconds.
fn schedule(name: &str, catch_up: &str) -> String {
    format!(
        "[schedules.{name}]\nworkflow = \"one\"\ncron = \"{EVERY_2S}\"\n\
         catch_up = \"{catch_up}\"\npayload = {{ schedule = \"{name}\" }}\n\n"
    )
}

/// The ticks of [`EVERY_2S`] in `(from, to]`.
fn ticks_between(from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<DateTime<Utc>> {
    let mut t = from.trunc_subsecs(0) + TimeDelta::seconds(1);
    let mut ticks = Vec::new();
    while t <= to {
        if t.timestamp() % 2 == 0 {
            ticks.push(t);
        }
        t += TimeDelta::seconds(1);
    }
    ticks
}

/// The test deployment's namespace of scheduled orders' ids.
async fn key(app: &TestApp) -> ScheduleKey {
    ScheduleKey(
        sqlx::query_scalar("SELECT key FROM schedule_key")
            .fetch_one(&app.db)
            .await
            .expect("the schedules' key"),
    )
}

async fn db_now(app: &TestApp) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT now()")
        .fetch_one(&app.db)
        .await
        .expect("now")
}

/// The ticks of `name` in `(from, to]` that have an order.
async fn ordered(
    app: &TestApp,
    name: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Vec<DateTime<Utc>> {
    let ticks = ticks_between(from, to);
    let key = key(app).await;
    let ids: Vec<Uuid> = ticks.iter().map(|t| order_id(key, name, *t)).collect();
    let found: Vec<Uuid> =
        sqlx::query_scalar("SELECT order_id FROM orders WHERE order_id = ANY($1)")
            .bind(&ids)
            .fetch_all(&app.db)
            .await
            .expect("orders");
    ticks
        .into_iter()
        .filter(|t| found.contains(&order_id(key, name, *t)))
        .collect()
}

/// `name`'s mark, if a supervisor has seen it.
async fn mark(app: &TestApp, name: &str) -> Option<DateTime<Utc>> {
    sqlx::query_scalar("SELECT last_tick FROM schedules WHERE name = $1")
        .bind(name)
        .fetch_optional(&app.db)
        .await
        .expect("mark")
}

async fn orders_of(app: &TestApp, name: &str) -> Vec<(Uuid, String)> {
    sqlx::query_as(
        "SELECT order_id, process_state FROM orders WHERE payload->>'schedule' = $1 \
         ORDER BY created_at",
    )
    .bind(name)
    .fetch_all(&app.db)
    .await
    .expect("orders")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_supervisors_make_exactly_one_order_per_tick_and_each_is_processed() {
    let app = TestApp::builder()
        .extra_config(schedule("every-2s", "all"))
        .build()
        .await;
    for name in ["submission", "scheduler", "agent"] {
        app.start(name, name, &[]).await;
    }
    let start = db_now(&app).await;
    for name in ["supervisor-1", "supervisor-2", "supervisor-3"] {
        app.start(name, "supervisor", &[]).await;
    }
    app.eventually("four ticks ordered", Duration::from_secs(30), || async {
        orders_of(&app, "every-2s").await.len() >= 4
    })
    .await;
    let orders = orders_of(&app, "every-2s").await;
    let end = db_now(&app).await;
    // Every order is a tick's, and the ticks follow each other 2 s apart.
    let ticks = ticks_between(start - TimeDelta::seconds(2), end);
    let key = key(&app).await;
    let mut got: Vec<DateTime<Utc>> = orders
        .iter()
        .map(|(id, _)| {
            *ticks
                .iter()
                .find(|t| order_id(key, "every-2s", **t) == *id)
                .unwrap_or_else(|| panic!("order {id} is no tick's"))
        })
        .collect();
    got.sort();
    assert!(
        got.windows(2).all(|w| w[1] - w[0] == TimeDelta::seconds(2)),
        "a tick missing or twice: {got:?}"
    );
    let not_once: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM orders o WHERE o.payload->>'schedule' = 'every-2s' \
         AND (SELECT count(*) FROM order_events e \
              WHERE e.order_id = o.order_id AND e.event = 'received') <> 1",
    )
    .fetch_one(&app.db)
    .await
    .expect("events");
    assert_eq!(not_once, 0, "one received event per order");
    // One supervisor leads and submits; the others stand by.
    let submitting = ["supervisor-1", "supervisor-2", "supervisor-3"]
        .iter()
        .filter(|s| app.log(s).contains("scheduled order submitted"))
        .count();
    assert_eq!(submitting, 1, "{}", app.logs_tail());
    let first_four: Vec<Uuid> = orders.iter().take(4).map(|(id, _)| *id).collect();
    app.eventually("the orders processed", Duration::from_secs(30), || async {
        let states = orders_of(&app, "every-2s").await;
        first_four.iter().all(|id| {
            states
                .iter()
                .any(|(o, state)| o == id && state == "processed")
        })
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_cannot_take_a_coming_ticks_order_by_submitting_its_id_first() {
    let app = TestApp::builder()
        .extra_config(schedule("nightly", "none"))
        .build()
        .await;
    for name in ["submission", "scheduler", "agent"] {
        app.start(name, name, &[]).await;
    }
    let status = app.status_queue("status").await;
    // The ids anyone could derive before (a public namespace), and any
    // other guess, for the coming ticks: submitted first, with the
    // application's payload.
    let public = Uuid::new_v5(&Uuid::NAMESPACE_URL, b"urn:sas:schedules");
    let now = db_now(&app).await;
    let coming = ticks_between(now, now + TimeDelta::seconds(12));
    let mut squatted = Vec::new();
    for tick in &coming {
        for namespace in [public, Uuid::NAMESPACE_OID, Uuid::nil()] {
            let id = order_id(ScheduleKey(namespace), "nightly", *tick);
            let body = serde_json::json!({ "order_id": id, "workflow": "one", "payload": { "schedule": "squatter" } });
            app.publish_raw(body.to_string().as_bytes(), Some(&status), None)
                .await;
            squatted.push(id);
        }
    }
    app.eventually("the squatters stored", Duration::from_secs(20), || async {
        orders_of(&app, "squatter").await.len() == squatted.len()
    })
    .await;
    app.start("supervisor", "supervisor", &[]).await;
    app.eventually(
        "three ticks ordered with the schedule's payload",
        Duration::from_secs(30),
        || async { orders_of(&app, "nightly").await.len() >= 3 },
    )
    .await;
    let ours = orders_of(&app, "nightly").await;
    assert!(
        ours.iter().all(|(id, _)| !squatted.contains(id)),
        "a tick's order has a squatted id"
    );
    // Each is a tick's, in the deployment's own namespace.
    let end = db_now(&app).await;
    let ticks = ordered(&app, "nightly", now - TimeDelta::seconds(2), end).await;
    assert_eq!(ticks.len(), ours.len(), "{ticks:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ticks_missed_while_no_supervisor_ran_get_none_one_or_every_order_by_catch_up() {
    let names = ["miss-none", "miss-last", "miss-all"];
    let app = TestApp::builder()
        .extra_config(
            schedule("miss-none", "none")
                + &schedule("miss-last", "last")
                + &schedule("miss-all", "all"),
        )
        .build()
        .await;
    for name in ["submission", "scheduler", "agent"] {
        app.start(name, name, &[]).await;
    }
    for name in ["supervisor-1", "supervisor-2"] {
        app.start(name, "supervisor", &[]).await;
    }
    app.eventually("an order of each", Duration::from_secs(30), || async {
        let mut all = true;
        for name in names {
            all &= !orders_of(&app, name).await.is_empty();
        }
        all
    })
    .await;
    for name in ["supervisor-1", "supervisor-2"] {
        app.terminate(name).await;
    }
    let mut stopped_at = Vec::new();
    for name in names {
        stopped_at.push(mark(&app, name).await.expect("seen"));
    }
    let last_seen = stopped_at.iter().max().copied().expect("marks");
    // Several ticks pass with no supervisor; come back half a second after
    // a tick, so that it is late (two supervisor intervals: 400 ms) when
    // the first pass sees it, and the next tick is not (the supervisor is
    // ready well within the 1.6 s left).
    app.eventually("three ticks missed", Duration::from_secs(20), || async {
        let now = db_now(&app).await;
        let since_tick = now - now.trunc_subsecs(0) + TimeDelta::seconds(now.timestamp() % 2);
        now - last_seen >= TimeDelta::seconds(7)
            && (TimeDelta::milliseconds(450)..TimeDelta::milliseconds(750)).contains(&since_tick)
    })
    .await;
    let back = db_now(&app).await;
    app.start("supervisor-3", "supervisor", &[]).await;
    app.eventually(
        "the marks past the return",
        Duration::from_secs(20),
        || async {
            let mut all = true;
            for name in names {
                all &= mark(&app, name)
                    .await
                    .is_some_and(|m| m > back + TimeDelta::seconds(2));
            }
            all
        },
    )
    .await;
    let missed = ticks_between(last_seen, back);
    assert!(missed.len() >= 3, "{missed:?}");
    for (name, from) in names.iter().zip(stopped_at) {
        let missed = ticks_between(from, back);
        let got = ordered(&app, name, from, back).await;
        match *name {
            "miss-none" => assert!(got.is_empty(), "{name}: {got:?} of {missed:?}"),
            "miss-last" => assert_eq!(
                got,
                missed[missed.len() - 1..],
                "{name}: one order, for the latest missed tick"
            ),
            _ => assert_eq!(got, missed, "{name}"),
        }
        // After the return, the ticks go on as before.
        app.eventually(
            &format!("{name} ordering again"),
            Duration::from_secs(15),
            || async {
                let now = db_now(&app).await;
                !ordered(&app, name, back, now).await.is_empty()
            },
        )
        .await;
    }
    let log = app.log("supervisor-3");
    assert!(log.contains("missed ticks passed over"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasctl_and_the_dashboard_show_each_schedules_zone_next_tick_and_last_order() {
    let app = TestApp::builder()
        .extra_config(
            "[schedules.paris]\nworkflow = \"one\"\ncron = \"* * * * * *\"\n\
             timezone = \"Europe/Paris\"\n",
        )
        .build()
        .await;
    // No scheduler: the orders stay pending.
    app.start("supervisor", "supervisor", &[]).await;
    app.eventually("an order made", Duration::from_secs(20), || async {
        sqlx::query_scalar::<_, Option<Uuid>>(
            "SELECT last_order_id FROM schedules WHERE name = 'paris'",
        )
        .fetch_optional(&app.db)
        .await
        .ok()
        .flatten()
        .flatten()
        .is_some()
    })
    .await;
    app.terminate("supervisor").await;
    let listed = run(&app, &["schedules", "list", "--json"])
        .await
        .expect_code(0)
        .json();
    let paris = &listed[0];
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(paris["name"], "paris");
    assert_eq!(paris["cron"], "* * * * * *");
    assert_eq!(paris["timezone"], "Europe/Paris");
    assert_eq!(paris["catch_up"], "last");
    assert_eq!(paris["last_order_state"], "pending");
    let time = |key: &str| {
        DateTime::parse_from_rfc3339(paris[key].as_str().unwrap_or_default())
            .unwrap_or_else(|e| panic!("{key}: {e}: {listed}"))
            .with_timezone(&Utc)
    };
    let (last_tick, next_tick) = (time("last_tick"), time("next_tick"));
    assert!(next_tick > last_tick, "{listed}");
    let last_order: Uuid = paris["last_order_id"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("an order id");
    assert_eq!(last_order, order_id(key(&app).await, "paris", last_tick));
    assert_eq!(
        app.order(last_order).await.map(|o| o.0).as_deref(),
        Some("pending")
    );
    let table = run(&app, &["schedules", "list"]).await.expect_code(0);
    assert!(table.stdout.contains("Europe/Paris"), "{}", table.stdout);
    assert!(
        table.stdout.contains(&last_order.to_string()),
        "{}",
        table.stdout
    );

    app.start("dashboard", "dashboard", &[]).await;
    let url = format!("http://127.0.0.1:{}/api/schedules", app.port("dashboard"));
    let (code, body) = sas_tests::http_get(&url)
        .await
        .expect("the dashboard answers");
    assert_eq!(code, 200, "{body}");
    let shown: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(
        shown["schedules"][0]["last_order_id"],
        last_order.to_string()
    );
    assert!(shown["now"].is_string(), "{shown}");

    // The overview page's panel shows the same.
    let browser = sas_tests::browser::Browser::start()
        .await
        .expect("headless Chromium through chromedriver (Debian's chromium and chromium-driver)");
    let base = format!("http://127.0.0.1:{}", app.port("dashboard"));
    browser.goto(&format!("{base}/")).await.expect("open /");
    let row = "#schedules tr[data-schedule='paris']";
    let short_id = &last_order.to_string()[..8];
    let shows = |text: &str| {
        text.contains("Europe/Paris") && text.contains(short_id) && text.contains("pending")
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let text = loop {
        let text = browser
            .text_of(row)
            .await
            .ok()
            .flatten()
            .unwrap_or_default();
        if shows(&text) || std::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let shot = browser.screenshot().await.expect("screenshot");
    browser.quit().await;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/ci-artifacts");
    std::fs::create_dir_all(&dir).expect("artifact directory");
    std::fs::write(dir.join("dashboard-schedules.png"), shot).expect("screenshot");
    assert!(shows(&text), "the schedules panel shows {text:?}");
}

#[test]
fn a_bad_schedule_is_refused_at_start_up_with_one_line() {
    for (extra, says) in [
        (
            "[schedules.s]\nworkflow = \"nope\"\ncron = \"0 2 * * *\"\n",
            "schedules.s.workflow \"nope\" is not a configured workflow",
        ),
        (
            "[schedules.s]\nworkflow = \"w\"\ncron = \"0 25 * * *\"\n",
            "schedules.s.cron \"0 25 * * *\"",
        ),
        (
            "[schedules.s]\nworkflow = \"w\"\ncron = \"0 2 * * *\"\ntimezone = \"Europe/Pariss\"\n",
            "schedules.s.timezone \"Europe/Pariss\"",
        ),
        (
            "[schedules.s]\nworkflow = \"w\"\ncron = \"0 2 * * *\"\ncatch_up = \"some\"\n",
            "catch_up \"some\" is not none, last or all for key `schedules.s.catch_up`",
        ),
    ] {
        sas_tests::assert_refused_at_start_up(
            "supervisor",
            &format!(
                "[agents.a]\nurl = \"http://127.0.0.1:1/a\"\n\n\
                 [workflows.w]\nsteps = [ {{ name = \"a\", agent = \"a\" }} ]\n\n{extra}"
            ),
            says,
        );
    }
}

//! Retention (contract §10): old ended orders deleted in batches with their
//! steps, events and messages, archived first when asked; orders in `error`
//! and live ones kept; no live order's lock waited for or taken; the
//! leading supervisor doing it by itself, and `sasctl orders prune` by hand.
//!
//! Orders are written straight into the test's database, in the state and
//! at the age a test needs (old ones as if made hours or days ago), except
//! where the services make them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sas::rules::retention::more_after;
use sas::state_store::{Archive, Plans, Policy, PruneError, Pruned, StateStore, Totals};
use sas_tests::TestApp;
use sas_tests::cli::{output, run, sasctl, wait_state};
use serde_json::Value;
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

/// Orders last changed more than an hour ago, two per batch.
const POLICY: Policy = Policy {
    ended_after: Duration::from_secs(3600),
    batch: 2,
    states: sas::rules::retention::PRUNABLE,
};

/// An order in `state`, created and last changed `age` ago (`"3 hours"`),
/// of workflow `one` with payload `{"n": n}`: its step `a`, its events
/// (`received`, then one into `state`) and, with `message`, a status
/// event never published.
async fn insert(app: &TestApp, state: &str, age: &str, n: i32, message: bool) -> Uuid {
    let id = Uuid::new_v4();
    let (step, event) = match state {
        "processed" => ("completed", "processed"),
        "compensated" => ("compensated", "compensated"),
        "error" => ("failed", "failed"),
        "pending" => ("not_started", "retry_scheduled"),
        "processing" => ("running", "processing"),
        "compensating" => ("compensating", "compensating"),
        other => panic!("no such state {other}"),
    };
    sqlx::query(
        "WITH o AS ( \
           INSERT INTO orders (order_id, workflow, payload, process_state, locked_by, last_seq, \
             created_at, updated_at) \
           VALUES ($1, 'one', jsonb_build_object('n', $5::int), $2, \
             CASE WHEN $2 = 'processing' THEN 'scheduler-elsewhere' END, 2, \
             now() - $3::interval, now() - $3::interval)), \
         s AS (INSERT INTO steps (order_id, idx, name, agent, compensate, timeout_ms, state) \
           VALUES ($1, 0, 'a', 'a', 'a-undo', 5000, $4)), \
         e AS (INSERT INTO order_events (order_id, seq, event, from_state, to_state, attempt, \
             actor, at) \
           VALUES ($1, 1, 'received', NULL, 'pending', 1, 'test', now() - $3::interval), \
                  ($1, 2, $6, 'pending', $2, 1, 'test', now() - $3::interval)), \
         m AS (INSERT INTO outbox (order_id, kind, routing_key, body) \
           SELECT $1, 'status', 'gone-queue', convert_to('{}', 'UTF8') WHERE $7) \
         SELECT 1",
    )
    .bind(id)
    .bind(state)
    .bind(age)
    .bind(step)
    .bind(n)
    .bind(event)
    .bind(message)
    .execute(&app.db)
    .await
    .expect("insert an order");
    id
}

/// How many rows of `table` belong to the order.
async fn rows_of(app: &TestApp, table: &str, id: Uuid) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {table} WHERE order_id = $1"
    )))
    .bind(id)
    .fetch_one(&app.db)
    .await
    .expect("count rows")
}

/// Whether the order is still there (with its steps and events, which go
/// with it).
async fn exists(app: &TestApp, id: Uuid) -> bool {
    rows_of(app, "orders", id).await == 1
}

/// Batches until one comes back short; each batch's orders.
async fn prune_all(store: &StateStore, policy: Policy, archive: Option<&Archive>) -> Vec<Pruned> {
    let mut batches = Vec::new();
    loop {
        let pruned = store.prune(policy, archive).await.expect("prune");
        let more = more_after(pruned.orders.len(), policy.batch);
        batches.push(pruned);
        if !more {
            return batches;
        }
    }
}

fn temp_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sas-{what}-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// The lines of every archive file in `dir`, as JSON.
fn archived(dir: &Path) -> Vec<Value> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("archive dir")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    files
        .iter()
        .flat_map(|f| {
            std::fs::read_to_string(f)
                .expect("archive file")
                .lines()
                .map(|l| serde_json::from_str::<Value>(l).expect("a JSON line"))
                .collect::<Vec<_>>()
        })
        .collect()
}

fn order_id(line: &Value) -> Uuid {
    line["order"]["order_id"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no order id in {line}"))
}

#[tokio::test]
async fn old_ended_orders_go_in_batches_with_their_steps_events_and_unsent_messages() {
    let app = TestApp::new().await;
    let store = StateStore::from_pool(app.db.clone());
    // Oldest first: 5 h, 4 h 59 … ago; one with a message it never sent.
    let mut old = Vec::new();
    for i in 0..5 {
        let state = if i % 2 == 0 {
            "processed"
        } else {
            "compensated"
        };
        old.push(insert(&app, state, &format!("{} minutes", 300 - i), i, i == 3).await);
    }
    let young = insert(&app, "processed", "10 minutes", 9, true).await;

    let batches = prune_all(&store, POLICY, None).await;
    // Three transactions: two full batches and the rest, oldest first.
    let sizes: Vec<usize> = batches.iter().map(|b| b.orders.len()).collect();
    assert_eq!(sizes, [2, 2, 1]);
    let deleted: Vec<Uuid> = batches.iter().flat_map(|b| b.orders.clone()).collect();
    assert_eq!(deleted, old);
    let mut totals = Totals::default();
    batches.iter().for_each(|b| totals.add(b));
    assert_eq!(
        (totals.batches, totals.steps, totals.events, totals.outbox),
        (3, 5, 10, 1)
    );
    for id in &old {
        for table in ["orders", "steps", "order_events", "outbox"] {
            assert_eq!(rows_of(&app, table, *id).await, 0, "{table} of {id}");
        }
    }
    // What is young stays whole.
    for (table, n) in [
        ("orders", 1),
        ("steps", 1),
        ("order_events", 2),
        ("outbox", 1),
    ] {
        assert_eq!(
            rows_of(&app, table, young).await,
            n,
            "{table} of the young order"
        );
    }
    assert_eq!(
        store.prune(POLICY, None).await.expect("prune"),
        Pruned::default()
    );
}

#[tokio::test]
async fn orders_in_error_and_live_orders_are_kept_however_old() {
    let app = TestApp::new().await;
    let store = StateStore::from_pool(app.db.clone());
    let mut kept = Vec::new();
    for state in ["error", "pending", "processing", "compensating"] {
        kept.push((state, insert(&app, state, "400 days", 0, false).await));
    }
    let ended = insert(&app, "compensated", "400 days", 0, false).await;

    let batches = prune_all(&store, POLICY, None).await;
    let deleted: Vec<Uuid> = batches.iter().flat_map(|b| b.orders.clone()).collect();
    assert_eq!(deleted, [ended]);
    for (state, id) in kept {
        // An order in error waits for an operator: its alert is open.
        assert!(exists(&app, id).await, "the {state} order was deleted");
        assert_eq!(rows_of(&app, "order_events", id).await, 2, "{state}");
    }
}

#[tokio::test]
async fn pruning_never_waits_for_a_live_orders_lock_nor_takes_one() {
    let app = TestApp::new().await;
    let store = StateStore::from_pool(app.db.clone());
    let live = insert(&app, "pending", "3 hours", 0, false).await;
    // Ended and old, but held by a transition on its way (a redrive, say).
    let held = insert(&app, "compensated", "3 hours", 0, false).await;
    let mut old = BTreeSet::new();
    for n in 0..3 {
        old.insert(insert(&app, "processed", "3 hours", n, false).await);
    }
    let mut blocker = PgConnection::connect(&app.db_url).await.expect("connect");
    let mut tx = blocker.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM orders WHERE order_id = ANY($1) FOR UPDATE")
        .bind(&[live, held][..])
        .execute(&mut *tx)
        .await
        .expect("row locks");

    let batches = tokio::time::timeout(Duration::from_secs(15), prune_all(&store, POLICY, None))
        .await
        .expect("pruning finished while another transaction held a live order");
    let deleted: BTreeSet<Uuid> = batches.iter().flat_map(|b| b.orders.clone()).collect();
    assert_eq!(deleted, old);
    assert!(exists(&app, live).await);
    assert!(
        exists(&app, held).await,
        "an order someone holds is passed by"
    );
    tx.rollback().await.expect("rollback");

    // While a batch is open, it holds the locks of the orders it deletes,
    // and of nothing else.
    let more = insert(&app, "processed", "3 hours", 7, false).await;
    let batch = store
        .prune_begin(
            Policy {
                batch: 10,
                ..POLICY
            },
            false,
        )
        .await
        .expect("begin");
    let open: BTreeSet<Uuid> = batch.orders().iter().copied().collect();
    assert_eq!(open, BTreeSet::from([held, more]));
    let lock = |id: Uuid| {
        let url = app.db_url.clone();
        async move {
            let mut c = PgConnection::connect(&url).await.expect("connect");
            let mut tx = c.begin().await.expect("begin");
            sqlx::query("SELECT 1 FROM orders WHERE order_id = $1 FOR UPDATE NOWAIT")
                .bind(id)
                .execute(&mut *tx)
                .await
                .map(drop)
        }
    };
    lock(live).await.expect("the live order's lock is free");
    let taken = lock(more)
        .await
        .expect_err("the deleted order's lock is held");
    let code = match &taken {
        sqlx::Error::Database(e) => e.code().map(|c| c.into_owned()),
        _ => None,
    };
    assert_eq!(code.as_deref(), Some("55P03"), "{taken}");
    let pruned = batch.commit().await.expect("commit");
    assert_eq!(pruned.orders.len(), 2);
    assert!(exists(&app, live).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_redriven_while_pruning_runs_is_not_deleted_and_one_deleted_first_is_not_redriven()
{
    let app = TestApp::new().await;
    let store = StateStore::from_pool(app.db.clone());
    let one_per_batch = Policy { batch: 1, ..POLICY };
    let first = insert(&app, "compensated", "5 hours", 1, false).await;
    let redriven = insert(&app, "compensated", "4 hours", 2, false).await;
    let last = insert(&app, "compensated", "3 hours", 3, false).await;

    let pruned = store.prune(one_per_batch, None).await.expect("first batch");
    assert_eq!(pruned.orders, [first]);
    // An operator redrives the next one between two batches.
    run(&app, &["orders", "redrive", &redriven.to_string()])
        .await
        .expect_code(0);
    let rest = prune_all(&store, one_per_batch, None).await;
    let deleted: Vec<Uuid> = rest.iter().flat_map(|b| b.orders.clone()).collect();
    assert_eq!(deleted, [last]);
    assert_eq!(app.order(redriven).await, Some(("pending".into(), 0)));
    assert_eq!(rows_of(&app, "order_events", redriven).await, 3);
    assert_eq!(rows_of(&app, "steps", redriven).await, 1);

    // The other way round: a redrive that comes while a batch deletes its
    // order waits for the batch, then finds nothing to redrive, and leaves
    // nothing behind (no step, event or message of a half-redriven order).
    let late = insert(&app, "compensated", "3 hours", 4, false).await;
    let batch = store
        .prune_begin(one_per_batch, false)
        .await
        .expect("begin");
    assert_eq!(batch.orders(), [late]);
    let mut cmd = sasctl(&app);
    cmd.args(["orders", "redrive", &late.to_string()]);
    let redrive = tokio::spawn(output(cmd));
    app.wait_for_lock_waiters(1).await;
    batch.commit().await.expect("commit");
    let out = tokio::time::timeout(Duration::from_secs(30), redrive)
        .await
        .expect("the redrive ended")
        .expect("join");
    assert_eq!(out.code, Some(3), "no such order any more: {out:#?}");
    for table in ["orders", "steps", "order_events", "outbox"] {
        assert_eq!(rows_of(&app, table, late).await, 0, "{table}");
    }
}

#[tokio::test]
async fn the_archive_holds_one_line_per_deleted_order_on_disk_before_the_batch_commits() {
    let app = TestApp::new().await;
    let store = StateStore::from_pool(app.db.clone());
    let dir = temp_dir("archive");
    let archive = Archive::new(&dir);
    let mut old = Vec::new();
    for n in 0..3 {
        old.push(
            insert(
                &app,
                "processed",
                &format!("{} minutes", 200 - n),
                n,
                n == 0,
            )
            .await,
        );
    }
    let young = insert(&app, "processed", "1 minute", 9, false).await;
    let kept = insert(&app, "error", "1 year", 8, false).await;

    // The first batch, step by step: deleted, not yet committed…
    let batch = store.prune_begin(POLICY, true).await.expect("begin");
    assert_eq!(batch.orders(), &old[..2]);
    assert_eq!(batch.lines().len(), 2);
    let day = batch.day().expect("the batch's day");
    let path = archive.append(day, batch.lines()).await.expect("archive");
    // …written to disk while the orders are still there for everyone else…
    assert_eq!(archived(&dir).len(), 2);
    for id in &old {
        assert!(
            exists(&app, *id).await,
            "deleted before its batch committed"
        );
    }
    batch.commit().await.expect("commit");
    assert!(!exists(&app, old[0]).await && !exists(&app, old[1]).await);
    // …and the rest through the one call that does all three.
    let pruned = store.prune(POLICY, Some(&archive)).await.expect("prune");
    assert_eq!(pruned.orders, &old[2..]);
    assert_eq!(pruned.archived.as_deref(), Some(path.as_path()));
    assert_eq!(
        path.file_name().and_then(|f| f.to_str()),
        Some(format!("orders-{}.jsonl", day.format("%Y-%m-%d")).as_str())
    );
    assert!(
        store
            .prune(POLICY, Some(&archive))
            .await
            .expect("prune")
            .orders
            .is_empty()
    );

    // One line per deleted order, and only those: the order row, its steps
    // and its events as they were.
    let lines = archived(&dir);
    let ids: Vec<Uuid> = lines.iter().map(order_id).collect();
    assert_eq!(ids, old);
    assert!(!ids.contains(&young) && !ids.contains(&kept));
    for (n, line) in lines.iter().enumerate() {
        let order = &line["order"];
        assert_eq!(order["process_state"], "processed", "{line}");
        assert_eq!(order["workflow"], "one");
        assert_eq!(order["payload"], serde_json::json!({ "n": n }));
        assert!(
            order["created_at"]
                .as_str()
                .is_some_and(|t| t.ends_with("+00:00")),
            "{line}"
        );
        let steps = line["steps"].as_array().expect("steps");
        assert_eq!(steps.len(), 1);
        assert_eq!(
            (&steps[0]["name"], &steps[0]["state"]),
            (&"a".into(), &"completed".into())
        );
        let events: Vec<(i64, &str)> = line["events"]
            .as_array()
            .expect("events")
            .iter()
            .map(|e| (e["seq"].as_i64().unwrap(), e["event"].as_str().unwrap()))
            .collect();
        assert_eq!(events, [(1, "received"), (2, "processed")], "{line}");
    }
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn a_batch_whose_archive_cannot_be_written_deletes_nothing() {
    let app = TestApp::new().await;
    let store = StateStore::from_pool(app.db.clone());
    let dir = temp_dir("archive");
    let archive = Archive::new(&dir);
    let old = [
        insert(&app, "processed", "3 hours", 0, false).await,
        insert(&app, "compensated", "3 hours", 1, false).await,
    ];
    let today: chrono::NaiveDate = sqlx::query_scalar("SELECT (now() AT TIME ZONE 'UTC')::date")
        .fetch_one(&app.db)
        .await
        .expect("date");
    // Something that is no file where today's file goes.
    let blocker = archive.path_for(today);
    std::fs::create_dir(&blocker).expect("blocker");
    let e = store
        .prune(POLICY, Some(&archive))
        .await
        .expect_err("the archive cannot be written");
    assert!(matches!(e, PruneError::Archive { .. }), "{e}");
    assert!(e.to_string().contains("nothing was deleted"), "{e}");
    for id in old {
        assert!(exists(&app, id).await);
        assert_eq!(rows_of(&app, "order_events", id).await, 2);
    }
    // A directory that is not there at all: the same.
    let missing = Archive::new(dir.join("missing"));
    store
        .prune(POLICY, Some(&missing))
        .await
        .expect_err("no directory");
    assert!(exists(&app, old[0]).await);

    // Once the archive can be written, the same orders go, archived once.
    std::fs::remove_dir(&blocker).expect("unblock");
    let pruned = store.prune(POLICY, Some(&archive)).await.expect("prune");
    assert_eq!(pruned.orders, old);
    let ids: Vec<Uuid> = archived(&dir).iter().map(order_id).collect();
    assert_eq!(ids, old);
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn the_supervisors_connections_find_old_orders_through_the_creation_index() {
    // Planned as the services' connections plan (once, generically, no
    // sequential scan where an index serves): the batch must read old
    // orders by `orders_created`, not every ended order by `orders_state`.
    let app = TestApp::new().await;
    for n in 0..20 {
        insert(&app, "processed", "1 minute", n, false).await;
    }
    for n in 0..3 {
        insert(&app, "processed", "3 hours", n, false).await;
    }
    let settings = sas::config::DatabaseSettings {
        url: app.db_url.clone(),
        max_connections: 1,
        ..Default::default()
    };
    let store = StateStore::connect_with(&settings, "test", Plans::Generic)
        .await
        .expect("connect");
    let scans = async || {
        let mut c = PgConnection::connect(&app.db_url).await.expect("connect");
        let read: Vec<(String, i64)> = sqlx::query_as(
            "SELECT indexrelname::text, idx_scan FROM pg_stat_user_indexes \
             WHERE indexrelname IN ('orders_created', 'orders_state') \
             UNION ALL SELECT 'seq', seq_scan FROM pg_stat_user_tables WHERE relname = 'orders' \
             ORDER BY 1",
        )
        .fetch_all(&mut c)
        .await
        .expect("pg_stat");
        c.close().await.ok();
        read
    };
    let settle = async || {
        let mut last = scans().await;
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let now = scans().await;
            if now == last {
                return now;
            }
            last = now;
        }
        panic!("statistics did not settle");
    };
    let before = settle().await;
    let batches = prune_all(&store, Policy { batch: 2, ..POLICY }, None).await;
    assert_eq!(batches.iter().map(|b| b.orders.len()).sum::<usize>(), 3);
    store.close().await;
    let after = settle().await;
    let delta: Vec<(String, i64)> = after
        .iter()
        .zip(&before)
        .map(|((name, a), (_, b))| (name.clone(), a - b))
        .collect();
    // Two batches, each one scan of the creation index.
    assert_eq!(
        delta,
        [
            ("orders_created".into(), 2),
            ("orders_state".into(), 0),
            ("seq".into(), 0)
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leading_supervisor_deletes_and_archives_old_ended_orders_by_itself() {
    let dir = temp_dir("archive");
    let app = TestApp::builder()
        .extra_config(format!(
            "[retention]\nended_after = \"1h\"\ninterval = \"300ms\"\nbatch = 2\narchive = \"{}\"\n",
            dir.display()
        ))
        .spawn()
        .await;
    let ids = app.submit_many("one", 4, None).await;
    for id in &ids {
        wait_state(&app, *id, "processed", Duration::from_secs(30)).await;
    }
    let (old, young) = (&ids[..3], ids[3]);
    sqlx::query(
        "UPDATE orders SET created_at = created_at - interval '2 hours', \
           updated_at = updated_at - interval '2 hours' WHERE order_id = ANY($1)",
    )
    .bind(old)
    .execute(&app.db)
    .await
    .expect("age orders");
    let failed = insert(&app, "error", "2 days", 0, false).await;

    app.eventually(
        "the supervisor deleted the old orders",
        Duration::from_secs(30),
        || async {
            let mut left = 0;
            for id in old {
                left += rows_of(&app, "orders", *id).await;
            }
            left == 0
        },
    )
    .await;
    for id in old {
        for table in ["steps", "order_events", "outbox"] {
            assert_eq!(rows_of(&app, table, *id).await, 0, "{table} of {id}");
        }
    }
    assert_eq!(app.order(young).await, Some(("processed".into(), 0)));
    assert_eq!(app.order(failed).await, Some(("error".into(), 0)));
    let archived: BTreeSet<Uuid> = archived(&dir).iter().map(order_id).collect();
    assert_eq!(archived, old.iter().copied().collect());
    // Its log says what it deleted (in two batches of at most two).
    app.eventually("the run is logged", Duration::from_secs(10), || async {
        app.log("supervisor")
            .contains("deleted ended orders older than retention.ended_after")
    })
    .await;
    // The leader counts what it deleted.
    app.eventually(
        "the metric counts them",
        Duration::from_secs(10),
        || async {
            app.metrics("supervisor")
                .await
                .contains("sas_orders_pruned_total 3")
        },
    )
    .await;
    app.assert_running(&["supervisor"]);
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasctl_prunes_by_the_settings_in_batches_and_archives() {
    let app = TestApp::new().await;
    let dir = temp_dir("archive");
    // retention.ended_after is 30 days by default.
    let mut old = Vec::new();
    for n in 0..5 {
        old.push(insert(&app, "processed", &format!("{} days", 40 - n), n, n == 0).await);
    }
    let recent = insert(&app, "compensated", "29 days", 9, false).await;
    let failed = insert(&app, "error", "400 days", 8, false).await;

    let out = run(
        &app,
        &[
            "orders",
            "prune",
            "--batch",
            "2",
            "--archive",
            &dir.display().to_string(),
            "--json",
        ],
    )
    .await
    .expect_code(0);
    let json = out.json();
    assert_eq!(
        (
            &json["deleted"],
            &json["batches"],
            &json["steps"],
            &json["events"],
            &json["outbox"]
        ),
        (&5.into(), &3.into(), &5.into(), &10.into(), &1.into()),
        "{out:#?}"
    );
    assert_eq!(
        json["archived"].as_array().map(Vec::len),
        Some(1),
        "{out:#?}"
    );
    let ids: Vec<Uuid> = archived(&dir).iter().map(order_id).collect();
    assert_eq!(ids, old);
    assert!(exists(&app, recent).await && exists(&app, failed).await);

    // Retention off: say how old, or nothing happens.
    let mut cmd = sasctl(&app);
    cmd.args(["orders", "prune"])
        .env("SAS__RETENTION__ENDED_AFTER", "off");
    let out = output(cmd).await.expect_code(2);
    assert!(out.stderr.contains("--older-than"), "{out:#?}");
    let mut cmd = sasctl(&app);
    cmd.args(["orders", "prune", "--older-than", "20days"])
        .env("SAS__RETENTION__ENDED_AFTER", "off");
    let out = output(cmd).await.expect_code(0);
    assert_eq!(
        out.stdout,
        "deleted 1 ended order last changed more than 20days ago\n"
    );
    assert!(!exists(&app, recent).await && exists(&app, failed).await);

    // An archive directory that is not there: refused before anything goes.
    let young = insert(&app, "processed", "2 hours", 0, false).await;
    let missing = dir.join("missing").display().to_string();
    let out = run(
        &app,
        &[
            "orders",
            "prune",
            "--older-than",
            "1h",
            "--archive",
            &missing,
        ],
    )
    .await
    .expect_code(2);
    assert!(out.stderr.contains("does not exist"), "{out:#?}");
    assert!(exists(&app, young).await);
    std::fs::remove_dir_all(dir).ok();
}

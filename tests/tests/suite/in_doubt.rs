//! As a whole, even when the outcome is unknown (contract §4c): a step
//! whose remote applied it but answered after complete-by, and a step an
//! operator's cancel caught mid-call, are undone; an order that does not
//! end `processed` leaves no net effect at any remote.

use std::time::Duration;

use remote_sim::Knobs;
use sas_tests::TestApp;
use sas_tests::cli::{run, wait_state};
use serde_json::Value;
use uuid::Uuid;

/// Applies at once, answers `ms` later.
fn late(ms: u64) -> Knobs {
    Knobs {
        late_answer_ms: ms,
        ..Knobs::default()
    }
}

/// The detail of `id`'s `event`, from the event log.
async fn detail(app: &TestApp, id: Uuid, event: &str) -> Value {
    sqlx::query_scalar("SELECT detail FROM order_events WHERE order_id = $1 AND event = $2")
        .bind(id)
        .bind(event)
        .fetch_one(&app.db)
        .await
        .unwrap_or_else(|e| panic!("{id} has no {event} event: {e}"))
}

/// Waits until step `step` of each order was applied at its remote (the
/// call is out, its answer still to come).
async fn wait_applied(app: &TestApp, ids: &[Uuid], step: &str) {
    app.eventually(
        &format!("step {step} applied for every order"),
        Duration::from_secs(30),
        || async {
            let stats = app.stats();
            ids.iter().all(|id| {
                stats
                    .keys
                    .get(&format!("{id}:{step}"))
                    .is_some_and(|k| k.applied == 1)
            })
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_applied_but_answered_after_complete_by_is_undone_in_doubt() {
    // One attempt: the first late answer gives the order up.
    let app = TestApp::builder()
        .step_timeout("1500ms")
        .max_failures(1)
        .spawn()
        .await;
    app.knobs("b", late(4_000));
    let ids: Vec<Uuid> = {
        let mut ids = Vec::new();
        for _ in 0..5 {
            ids.push(app.submit("three", None).await);
        }
        ids
    };
    for id in &ids {
        wait_state(&app, *id, "compensated", Duration::from_secs(40)).await;
    }
    let stats = app.stats();
    for id in &ids {
        // Its charge took effect, and was undone, told it was in doubt.
        assert_eq!(stats.keys[&format!("{id}:b")].applied, 1);
        let undo = &stats.keys[&format!("{id}:b:compensate")];
        assert_eq!(
            (undo.applied, &undo.outcomes[..]),
            (1, &["unknown".to_owned()][..])
        );
        // The reservation completed: undone as completed, after b (newest first).
        let reserve = &stats.keys[&format!("{id}:a:compensate")];
        assert_eq!(reserve.outcomes, ["completed"]);
        assert_eq!(
            stats.standing_for(&id.to_string()),
            0,
            "order {id} left an effect: {:?}",
            stats.standing.get(&id.to_string())
        );
        // The undo's fencing token is above every forward call's.
        let forward = stats.keys[&format!("{id}:b")].tokens.iter().max().copied();
        assert!(undo.tokens.iter().all(|t| Some(*t) > forward), "{undo:?}");
        let done = detail(&app, *id, "compensated").await;
        assert_eq!(done["in_doubt"], true, "{done}");
        assert_eq!(done["in_doubt_steps"], serde_json::json!(["b"]), "{done}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_cancelled_mid_call_waits_for_the_late_success_then_undoes_it() {
    let app = TestApp::builder().step_timeout("20s").spawn().await;
    app.knobs("b", late(2_000));
    let mut ids = Vec::new();
    for _ in 0..5 {
        ids.push(app.submit("three", None).await);
    }
    wait_applied(&app, &ids, "b").await;
    for id in &ids {
        let out = run(&app, &["orders", "cancel", &id.to_string()])
            .await
            .expect_code(0);
        assert_eq!(out.stdout, format!("order {id} cancelled: compensating\n"));
    }
    // Well before b's complete-by: its late success came, and was undone.
    for id in &ids {
        wait_state(&app, *id, "compensated", Duration::from_secs(15)).await;
    }
    let stats = app.stats();
    for id in &ids {
        let undo = &stats.keys[&format!("{id}:b:compensate")];
        assert_eq!(undo.outcomes, ["completed"], "{id}");
        assert_eq!(stats.keys[&format!("{id}:a:compensate")].applied, 1);
        assert_eq!(
            stats.standing_for(&id.to_string()),
            0,
            "order {id} left an effect: {:?}",
            stats.standing.get(&id.to_string())
        );
        // c never ran.
        assert!(!stats.keys.contains_key(&format!("{id}:c")));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_cancelled_mid_call_whose_answer_never_comes_undoes_the_step_in_doubt() {
    let app = TestApp::builder().step_timeout("2s").spawn().await;
    // Applied, and the answer comes long after complete-by.
    app.knobs("b", late(60_000));
    let id = app.submit("three", None).await;
    wait_applied(&app, &[id], "b").await;
    run(&app, &["orders", "cancel", &id.to_string()])
        .await
        .expect_code(0);
    wait_state(&app, id, "compensated", Duration::from_secs(30)).await;
    let stats = app.stats();
    assert_eq!(
        stats.keys[&format!("{id}:b:compensate")].outcomes,
        ["unknown"]
    );
    assert_eq!(
        stats.standing_for(&id.to_string()),
        0,
        "{:?}",
        stats.standing
    );
    // A cancel is no failure: nothing was counted.
    assert_eq!(app.order(id).await, Some(("compensated".into(), 0)));
    let cancelled = detail(&app, id, "compensating").await;
    assert_eq!(cancelled["cancelled"], true);
    assert_eq!(cancelled["running"], serde_json::json!(["b"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_forward_call_after_its_undo_is_refused_by_a_fencing_remote() {
    // b's dispatch hangs without applying; the order is given up and b
    // undone in doubt (nothing to undo yet). A zombie call of that dispatch
    // that reaches the remote only now, when it would apply, carries an
    // older token than the undo's, and a remote that fences refuses it: no
    // effect is left behind.
    let app = TestApp::builder()
        .step_timeout("1s")
        .max_failures(1)
        .spawn()
        .await;
    app.knobs(
        "b",
        Knobs {
            hang: true,
            hang_ms: 3_000,
            fencing: true,
            ..Knobs::default()
        },
    );
    let id = app.submit("three", None).await;
    wait_state(&app, id, "compensated", Duration::from_secs(30)).await;
    let key = format!("{id}:b");
    let forward_token = app.stats().keys[&key].tokens[0];
    assert_eq!(app.stats().keys[&key].applied, 0, "it hung");
    app.knobs(
        "b",
        Knobs {
            fencing: true,
            ..Knobs::default()
        },
    );
    // The zombie: the first dispatch's call, again, after the undo.
    let url = format!("http://{}/svc/b", app.sim_addr);
    sas::tls::install_crypto_provider();
    let status = reqwest::Client::new()
        .post(&url)
        .header("Idempotency-Key", &key)
        .header("X-Sas-Fencing-Token", forward_token)
        .json(&serde_json::json!({ "order_id": id, "step": "b" }))
        .send()
        .await
        .expect("the remote answers")
        .status();
    assert_eq!(status.as_u16(), 409, "older than the undo");
    assert_eq!(app.stats().standing_for(&id.to_string()), 0);
}

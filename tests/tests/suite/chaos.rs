//! `sas-chaos`, the soak run, end to end: the real binary starts the real
//! services itself, kills one at random every second and starts it again,
//! while the test deployment's remote-sim fails 5% of the calls transiently
//! and 2% permanently. Its verdict must be clean: nothing lost, nothing
//! applied twice, no gap in any order's events. The same with one message
//! in five hostile (`--hostile 0.2`): no good order harmed.

use std::process::Command;
use std::time::Duration;

use sas_tests::{TestApp, bin};
use serde_json::Value;

/// Runs `sas-chaos --spawn` against `app`'s deployment, 300 three-step
/// orders at most 100 a second with a kill every second, and `extra`
/// arguments: its JSON report and the context of a failure. Asserts it
/// exits 0.
async fn run_chaos(app: &TestApp, extra: &[&str]) -> (Value, String) {
    let bin_dir = bin("submission")
        .parent()
        .expect("the binaries' directory")
        .to_owned();
    let mut cmd = Command::new(bin("sas-chaos"));
    cmd.env("SAS_CONFIG", &app.config)
        .env_remove("RUST_LOG")
        .arg("--spawn")
        .arg(&bin_dir)
        .args(["--sim", &format!("http://{}", app.sim_addr)])
        .args(["--orders", "300", "--workflow", "three"])
        .args(extra)
        .args(["--kill-every", "1s", "--timeout", "120s", "--json"])
        // At most 100 orders a second: the run lasts long enough for kills.
        .args(["--rate", "100"]);
    // Off the runtime's threads: the test's remote-sim serves on them.
    let out = tokio::time::timeout(
        Duration::from_secs(280),
        tokio::task::spawn_blocking(move || cmd.output()),
    )
    .await
    .expect("sas-chaos ends within its timeout")
    .expect("join")
    .expect("run sas-chaos (run `cargo build --workspace` first)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let context = format!(
        "status {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    // Shown with --nocapture (and by nextest for a failure).
    eprintln!("{context}");
    assert_eq!(out.status.code(), Some(0), "{context}");
    let report: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {context}"));
    (report, context)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_soak_of_three_hundred_orders_with_kills_loses_and_doubles_nothing() {
    let app = TestApp::new().await;
    let (report, context) = run_chaos(&app, &["--transient", "0.05", "--permanent", "0.02"]).await;
    assert_eq!(report["ok"], true, "{context}");
    assert_eq!(report["submitted"], 300, "{context}");
    assert_eq!(report["lost"], 0, "{context}");
    assert_eq!(report["duplicates"], 0, "{context}");
    assert_eq!(report["half_done"], 0, "{context}");
    assert_eq!(report["gaps"], 0, "{context}");
    assert_eq!(report["multiple_terminal"], 0, "{context}");
    assert!(report["kills"].as_u64().unwrap_or(0) >= 1, "{context}");
    let ended: u64 = ["processed", "compensated", "failed"]
        .iter()
        .map(|s| report[*s].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(ended, 300, "{context}");
    // 2% permanent faults over three steps: some orders give up.
    assert!(report["processed"].as_u64().unwrap_or(0) > 200, "{context}");

    // The sim saw the calls, and chaos put its knobs back.
    assert!(app.stats().total_applied >= 300, "{context}");
    assert_eq!(app.sim.all_knobs().len(), 0, "{context}");
    // Spawned services' logs are kept for a failing run only.
    let logs = report["logs"].as_str().unwrap_or_default().to_owned();
    if !logs.is_empty() {
        std::fs::remove_dir_all(&logs).ok();
    }
}

/// The soak with one message in five hostile: 75 hostile messages, every
/// class of the catalogue, among 300 good orders, with kills and no
/// faults. No good order may be harmed (each ends `processed`, once, with
/// its own payload), every hostile message must be dead-lettered, rejected
/// or ignored, no service may exit or lose its connection, and the run
/// leaves nothing of its own in the dead-letter queues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_soak_with_a_fifth_of_hostile_messages_harms_no_good_order() {
    let app = TestApp::new().await;
    let (report, context) = run_chaos(&app, &["--hostile", "0.2", "--seed", "38"]).await;
    assert_eq!(report["ok"], true, "{context}");
    assert_eq!(report["submitted"], 300, "{context}");
    assert_eq!(report["harmed"], 0, "{context}");
    // Without faults every good order is processed.
    assert_eq!(report["processed"], 300, "{context}");
    let hostile = &report["hostile"];
    // 20% of 375 messages.
    assert_eq!(hostile["sent"], 75, "{context}");
    assert_eq!(hostile["accounted"], 75, "{context}");
    assert_eq!(hostile["unaccounted"], 0, "{context}");
    assert_eq!(hostile["forged_rejections"], 0, "{context}");
    assert_eq!(hostile["connections_lost"], 0, "{context}");
    assert_eq!(report["unexpected_exits"], 0, "{context}");
    // Every class of the catalogue was sent.
    assert_eq!(
        hostile["classes"].as_object().map(|c| c.len()),
        Some(17),
        "{context}"
    );
    assert!(
        hostile["dead_lettered"].as_u64().unwrap_or(0) > 0,
        "{context}"
    );
    // Repeats of running orders' ids, read and ignored.
    assert!(hostile["ignored"].as_u64().unwrap_or(0) > 0, "{context}");

    // The run took its hostile messages out of the dead-letter queues.
    let q = &app.queues;
    for dead in [
        q.orders_dead().to_owned(),
        q.replay_dead().to_owned(),
        q.replies_dead().to_owned(),
        q.agent_requests_dead("a"),
    ] {
        let left: Vec<String> = app
            .drain(&dead)
            .await
            .into_iter()
            .map(|(body, reason)| format!("{reason:?}: {}", String::from_utf8_lossy(&body)))
            .collect();
        assert!(left.is_empty(), "{dead} holds {left:#?}\n{context}");
    }
    let logs = report["logs"].as_str().unwrap_or_default().to_owned();
    if !logs.is_empty() {
        std::fs::remove_dir_all(&logs).ok();
    }
}

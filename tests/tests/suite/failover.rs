//! A Postgres failover (contract §6a, issue #26): the services are given
//! both hosts of a primary and its synchronous standby
//! (`scripts/pg-ha.sh`), the primary is stopped (`-m immediate`) under a
//! steady load and the standby promoted; the services find the new
//! primary by themselves. Run alone, after the rest: it starts servers of
//! its own (ports 5441 and 5442).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use sas_tests::TestApp;

const ALL: [&str; 4] = ["submission", "scheduler", "agent", "supervisor"];
const ADMIN: &str = "postgres://postgres@127.0.0.1:5441/postgres";
const HOSTS: &str =
    "postgres://postgres@127.0.0.1:5441,127.0.0.1:5442/{db}?target_session_attrs=read-write";

fn pg_ha(command: &str) -> bool {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/pg-ha.sh");
    Command::new(script)
        .arg(command)
        .env("SAS_PG_HA_DIR", std::env::temp_dir().join("sas-pg-ha-test"))
        .status()
        .is_ok_and(|s| s.success())
}

/// The primary and its standby, taken down when dropped, whatever the
/// test did.
struct Pair;

impl Pair {
    fn up() -> Self {
        // A pair left by an earlier run that did not clean up.
        pg_ha("down");
        assert!(
            pg_ha("up"),
            "scripts/pg-ha.sh up failed (its output is above)"
        );
        Self
    }

    fn failover(&self) {
        assert!(pg_ha("failover"), "scripts/pg-ha.sh failover failed");
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        pg_ha("down");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_services_follow_the_promoted_standby_and_lose_no_acknowledged_order() {
    let pair = Pair::up();
    let app = TestApp::builder().postgres(ADMIN, HOSTS).spawn().await;
    let status = app.status_queue("status").await;
    let every = Duration::from_millis(50);
    let mut ids = app
        .submit_steadily("three", 100, every, Some(&status))
        .await;
    pair.failover();
    let promoted = std::time::Instant::now();
    // The load goes on through the failover and after it, while the
    // services' logs are read for the line each writes when its pool moves
    // to host 2.
    let follows = || {
        ALL.iter()
            .all(|name| app.log(name).contains("following host 2"))
    };
    let mut followed = None;
    for _ in 0..100 {
        ids.push(app.submit("three", Some(&status)).await);
        if followed.is_none() && follows() {
            followed = Some(promoted.elapsed());
        }
        tokio::time::sleep(every).await;
    }
    if followed.is_none() {
        app.eventually(
            "every service follows the promoted standby",
            Duration::from_secs(30),
            || async { follows() },
        )
        .await;
    }
    let followed = followed.unwrap_or_else(|| promoted.elapsed());
    let stories = app
        .assert_invariants(&status, &ids, &[], Duration::from_secs(90))
        .await;
    assert!(
        sas_tests::all_end_in(&stories, "processed"),
        "every order ends processed"
    );
    app.assert_running(&ALL);
    eprintln!(
        "{} orders, every one processed; every service followed the promoted standby \
         within {followed:?} of the promotion",
        ids.len()
    );
    drop(app);
}

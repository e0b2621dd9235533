//! The Python client (`clients/python`, issue #41) against a real
//! deployment: its own pytest suite (`clients/python/tests`), run by the
//! interpreter `SAS_TEST_PYTHON` (default `target/sas-python/bin/python`,
//! the virtual environment `scripts/test.sh` makes with the package, pika
//! and pytest), with the deployment in its environment:
//!
//! - `SAS_BROKER_URL`, `SAS_PREFIX`: the broker and the deployment's prefix;
//! - `SAS_WORKFLOW`: `one`, whose one step (agent `a`) succeeds;
//! - `SAS_FAILING_WORKFLOW`: `three`, whose last step (agent `c`, made to
//!   answer 422 every time) fails for good, so the order is compensated.
//!
//! The tests import the package from the tree (`clients/python/src` on
//! `PYTHONPATH`), so an edit is tested without reinstalling it. A missing
//! interpreter fails the test (one line: how to make it), never skips it.

use std::path::{Path, PathBuf};
use std::process::Command;

use remote_sim::Knobs;
use sas_tests::{TestApp, amqp};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
}

/// The interpreter of the Python tests.
fn python() -> PathBuf {
    match std::env::var_os("SAS_TEST_PYTHON") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => root().join("target/sas-python/bin/python"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_passes_its_pytest_suite_against_a_real_deployment() {
    let python = python();
    let usable = Command::new(&python)
        .args(["-c", "import pika, pytest"])
        .output()
        .is_ok_and(|out| out.status.success());
    assert!(
        usable,
        "no Python with pika and pytest at {} (SAS_TEST_PYTHON): run scripts/test.sh, which makes it",
        python.display()
    );

    let app = TestApp::builder().build().await;
    app.knobs(
        "c",
        Knobs {
            permanent: true,
            ..Knobs::default()
        },
    );
    for name in ["submission", "scheduler", "agent", "supervisor"] {
        app.start(name, name, &[]).await;
    }

    let mut pytest = Command::new(&python);
    pytest
        .args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"])
        .arg(root().join("clients/python/tests"))
        .current_dir(root().join("clients/python"))
        .env("PYTHONPATH", root().join("clients/python/src"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("SAS_BROKER_URL", amqp())
        .env("SAS_PREFIX", &app.prefix)
        .env("SAS_WORKFLOW", "one")
        .env("SAS_FAILING_WORKFLOW", "three")
        .env("SAS_REQUIRE_DEPLOYMENT", "1");
    let out = tokio::task::spawn_blocking(move || pytest.output())
        .await
        .expect("pytest's thread")
        .expect("pytest runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "pytest exited with {}:\n{stdout}\n{stderr}\nservices' logs:\n{}",
        out.status,
        app.logs_tail()
    );
    // The summary, e.g. `35 passed in 21.50s`: nothing skipped.
    let summary = stdout.lines().last().unwrap_or_default();
    assert!(
        summary.contains("passed") && !summary.contains("skipped"),
        "every Python test must run here:\n{stdout}"
    );
}

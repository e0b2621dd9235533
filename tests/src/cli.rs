//! Running `sasctl` as a real process against a test deployment.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use uuid::Uuid;

use crate::{TestApp, bin};

/// How a `sasctl` run ended.
#[derive(Debug)]
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// Panics unless the run exited with `code`.
    pub fn expect_code(self, code: i32) -> Self {
        assert_eq!(self.code, Some(code), "{self:#?}");
        self
    }

    /// Stdout as one JSON value.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:#?}"))
    }

    /// Stdout as JSON lines.
    pub fn json_lines(&self) -> Vec<Value> {
        self.stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}\n{self:#?}")))
            .collect()
    }
}

/// `sasctl` reading the test deployment's configuration.
pub fn sasctl(app: &TestApp) -> Command {
    let mut cmd = Command::new(bin("sasctl"));
    cmd.env("SAS_CONFIG", &app.config).env_remove("RUST_LOG");
    cmd
}

/// `sasctl` without a deployment: nothing but the environment, and short
/// connect timeouts so an unreachable server fails fast.
pub fn bare_sasctl(args: &[&str]) -> Command {
    let mut cmd = Command::new(bin("sasctl"));
    cmd.args(args)
        .env_remove("SAS_CONFIG")
        .env_remove("RUST_LOG")
        .env("SAS__BROKER__CONNECT_TIMEOUT", "1s")
        .env("SAS__DATABASE__CONNECT_TIMEOUT", "1s");
    cmd
}

/// Runs a command to its end, `input` on its stdin, without blocking the runtime.
pub async fn output_with(mut cmd: Command, input: Vec<u8>) -> Run {
    let out = tokio::task::spawn_blocking(move || {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(&input)?;
        }
        child.wait_with_output()
    })
    .await
    .expect("join")
    .expect("run sasctl (run `cargo build --workspace` first)");
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs a command to its end with nothing on its stdin.
pub async fn output(cmd: Command) -> Run {
    output_with(cmd, Vec::new()).await
}

/// Runs `sasctl <args>` against the test deployment.
pub async fn run(app: &TestApp, args: &[&str]) -> Run {
    let mut cmd = sasctl(app);
    cmd.args(args);
    output(cmd).await
}

/// Waits until the order is in `state`.
pub async fn wait_state(app: &TestApp, id: Uuid, state: &str, timeout: Duration) {
    app.eventually(&format!("order {id} is {state}"), timeout, || async {
        app.order(id).await.is_some_and(|(s, _)| s == state)
    })
    .await;
}

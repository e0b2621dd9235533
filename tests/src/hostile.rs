//! Helpers of the hostile-input tests: a seeded proptest runner (a failure
//! replays), one draw of a strategy, the end of each order in a stream of
//! status events, and the check that no service was harmed.

use std::collections::BTreeMap;

use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use serde_json::Value;

use crate::{TestApp, is_terminal};

/// A runner whose draws depend on `seed` alone.
pub fn seeded(seed: u8) -> TestRunner {
    TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]),
    )
}

/// Draws one value of `strategy`.
pub fn draw<T: std::fmt::Debug>(runner: &mut TestRunner, strategy: impl Strategy<Value = T>) -> T {
    strategy
        .new_tree(runner)
        .map(|tree| tree.current())
        .unwrap_or_else(|e| panic!("cannot draw: {e}"))
}

/// The terminal state of each order in `events` (rejections, `seq` 0,
/// left out: they end no stored order).
pub fn ends(events: &[Value]) -> BTreeMap<String, String> {
    events
        .iter()
        .filter(|e| is_terminal(e) && e["seq"] != 0)
        .map(|e| {
            (
                e["order_id"].as_str().unwrap_or_default().to_owned(),
                e["state"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// No service restarted its broker session (the broker closed no
/// connection), none exited, and every one still answers.
pub async fn assert_unharmed(app: &TestApp) {
    let names = ["submission", "scheduler", "agent", "supervisor"];
    app.assert_running(&names);
    for name in names {
        let log = app.log(name);
        assert!(
            !log.contains("lost RabbitMQ"),
            "{name} lost its connection:\n{}",
            app.logs_tail()
        );
        assert!(
            !app.metrics(name).await.is_empty(),
            "{name} no longer answers"
        );
    }
}

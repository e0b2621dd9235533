//! Crash and panic points for the fault suite. With `SAS_CRASH_AT=<point>` (or
//! `<point>:<n>` for the n-th pass), the process aborts at that point, as a
//! SIGKILL would stop it there: the tests use this to crash a service between
//! a commit and an ack, or between a publish and its bookkeeping. Unset, a
//! crash point costs one relaxed atomic load.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

struct Target {
    point: String,
    nth: u64,
    passes: AtomicU64,
}

fn target() -> Option<&'static Target> {
    static TARGET: OnceLock<Option<Target>> = OnceLock::new();
    TARGET
        .get_or_init(|| {
            let spec = std::env::var("SAS_CRASH_AT").ok()?;
            let (point, nth) = match spec.split_once(':') {
                Some((p, n)) => (p.to_owned(), n.parse().unwrap_or(1)),
                None => (spec, 1),
            };
            Some(Target {
                point,
                nth,
                passes: AtomicU64::new(0),
            })
        })
        .as_ref()
}

/// Aborts the process here if `SAS_CRASH_AT` names this point (and pass).
pub fn point(name: &str) {
    if let Some(t) = target()
        && t.point == name
        && t.passes.fetch_add(1, Ordering::Relaxed) + 1 == t.nth
    {
        eprintln!("crash point {name} reached: aborting");
        std::process::abort();
    }
}

/// Panics if `SAS_PANIC_ON` is set and `body` contains its text: the tests
/// use this to prove that a handler's panic costs only its own delivery
/// (dead-lettered with `internal_error`). Unset, it costs one load.
pub fn panic_if_marked(body: &[u8]) {
    static MARKER: OnceLock<Option<Vec<u8>>> = OnceLock::new();
    let marker = MARKER.get_or_init(|| {
        std::env::var("SAS_PANIC_ON")
            .ok()
            .filter(|m| !m.is_empty())
            .map(String::into_bytes)
    });
    if let Some(marker) = marker
        && body.windows(marker.len()).any(|w| w == marker.as_slice())
    {
        panic!("SAS_PANIC_ON marker found in a message");
    }
}

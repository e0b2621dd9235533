//! Crash, pause and panic points for the fault suite. With
//! `SAS_CRASH_AT=<point>` (or `<point>:<n>` for the n-th pass), the process
//! aborts at that point, as a SIGKILL would stop it there: the tests use
//! this to crash a service between a commit and an ack, or between a
//! publish and its bookkeeping. With `SAS_PAUSE_AT=<point>[:<n>]` it stops
//! itself there (SIGSTOP) until a SIGCONT, as a process the kernel or a VM
//! froze would: the tests make a zombie of an agent that way. Unset, a
//! point costs one relaxed atomic load.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

struct Target {
    point: String,
    nth: u64,
    passes: AtomicU64,
}

impl Target {
    /// The target named by the variable `var`, if set.
    fn from_env(var: &str) -> Option<Self> {
        let spec = std::env::var(var).ok()?;
        let (point, nth) = match spec.split_once(':') {
            Some((p, n)) => (p.to_owned(), n.parse().unwrap_or(1)),
            None => (spec, 1),
        };
        Some(Self {
            point,
            nth,
            passes: AtomicU64::new(0),
        })
    }

    /// Whether this pass of `name` is the one aimed at.
    fn hit(&self, name: &str) -> bool {
        self.point == name && self.passes.fetch_add(1, Ordering::Relaxed) + 1 == self.nth
    }
}

/// Aborts the process here if `SAS_CRASH_AT` names this point (and pass).
pub fn point(name: &str) {
    static TARGET: OnceLock<Option<Target>> = OnceLock::new();
    let target = TARGET.get_or_init(|| Target::from_env("SAS_CRASH_AT"));
    if target.as_ref().is_some_and(|t| t.hit(name)) {
        eprintln!("crash point {name} reached: aborting");
        std::process::abort();
    }
}

/// Stops the process here (SIGSTOP, until a SIGCONT) if `SAS_PAUSE_AT`
/// names this point (and pass). The points: `agent.before_call`, just
/// before a remote call is sent (its complete-by checked).
pub fn pause(name: &str) {
    static TARGET: OnceLock<Option<Target>> = OnceLock::new();
    let target = TARGET.get_or_init(|| Target::from_env("SAS_PAUSE_AT"));
    if target.as_ref().is_some_and(|t| t.hit(name)) {
        eprintln!("pause point {name} reached: stopping until SIGCONT");
        // `kill` rather than an unsafe libc call; the process stops inside it.
        let stopped = std::process::Command::new("kill")
            .args(["-STOP", &std::process::id().to_string()])
            .status();
        if let Err(e) = stopped {
            eprintln!("pause point {name}: cannot stop: {e}");
        }
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

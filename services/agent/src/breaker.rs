//! A circuit breaker per remote endpoint. After `threshold` consecutive
//! transient failures it opens: the agent stops consuming that endpoint's
//! requests, so they flow to healthy agent instances. After `cooldown` it
//! half-opens and lets one probe through: success closes it, failure opens it
//! again. A permanent (4xx) answer shows the endpoint is up and counts as success.

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The breaker's state, as shown in `/metrics` (0, 1, 2) and `/readyz`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Closed,
    HalfOpen,
    Open,
}

impl State {
    /// The name shown in `/readyz`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::HalfOpen => "half_open",
            Self::Open => "open",
        }
    }

    /// The value of the `sas_agent_breaker_state` gauge.
    pub fn gauge(self) -> i64 {
        match self {
            Self::Closed => 0,
            Self::HalfOpen => 1,
            Self::Open => 2,
        }
    }
}

struct Inner {
    state: State,
    failures: u32,
    open_until: Instant,
    /// Cancelled when consumption must restart with other settings (opened, or closed after a probe).
    change: CancellationToken,
}

/// One endpoint's breaker.
pub struct Breaker {
    threshold: u32,
    cooldown: Duration,
    inner: Mutex<Inner>,
    /// Woken at every state change (half-open too), so the state reporter
    /// writes it to Postgres at once, off the calls' path.
    reported: Notify,
}

impl Breaker {
    /// A closed breaker.
    pub fn new(threshold: u32, cooldown: Duration) -> Self {
        Self {
            threshold: threshold.max(1),
            cooldown,
            inner: Mutex::new(Inner {
                state: State::Closed,
                failures: 0,
                open_until: Instant::now(),
                change: CancellationToken::new(),
            }),
            reported: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The state now.
    pub fn state(&self) -> State {
        self.lock().state
    }

    /// The state now and the consecutive transient failures counted.
    pub fn snapshot(&self) -> (State, u32) {
        let inner = self.lock();
        (inner.state, inner.failures)
    }

    /// Waits for the next state change (returns at once if one happened
    /// since the last call).
    pub async fn state_changed(&self) {
        self.reported.notified().await;
    }

    /// Whether calls must stop (the breaker is open).
    pub fn is_open(&self) -> bool {
        self.state() == State::Open
    }

    /// A token cancelled at the next change that needs the consumer restarted.
    pub fn change_token(&self) -> CancellationToken {
        self.lock().change.clone()
    }

    /// Records an answer that shows the endpoint works. Returns the new state if it changed.
    pub fn succeeded(&self) -> Option<State> {
        let mut inner = self.lock();
        inner.failures = 0;
        if inner.state == State::Closed {
            return None;
        }
        inner.state = State::Closed;
        self.changed(&mut inner);
        Some(State::Closed)
    }

    /// Records a transient failure. Returns the new state if it changed.
    pub fn failed(&self) -> Option<State> {
        let mut inner = self.lock();
        inner.failures += 1;
        let trip = match inner.state {
            State::Closed => inner.failures >= self.threshold,
            State::HalfOpen => true,
            State::Open => false,
        };
        if !trip {
            return None;
        }
        inner.state = State::Open;
        inner.open_until = Instant::now() + self.cooldown;
        self.changed(&mut inner);
        Some(State::Open)
    }

    /// Waits until the breaker lets requests in: at once when closed or
    /// half-open; after the cool-down (then half-open) when open.
    pub async fn wait_until_usable(&self) -> State {
        let until = {
            let inner = self.lock();
            if inner.state != State::Open {
                return inner.state;
            }
            inner.open_until
        };
        tokio::time::sleep_until(until).await;
        let mut inner = self.lock();
        if inner.state == State::Open {
            inner.state = State::HalfOpen;
            self.reported.notify_one();
        }
        inner.state
    }

    fn changed(&self, inner: &mut Inner) {
        inner.change.cancel();
        inner.change = CancellationToken::new();
        self.reported.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn opens_after_the_threshold_half_opens_after_the_cooldown_and_closes_on_success() {
        let b = Breaker::new(3, Duration::from_secs(5));
        let token = b.change_token();
        assert_eq!(b.failed(), None);
        assert_eq!(b.failed(), None);
        assert_eq!(b.failed(), Some(State::Open));
        assert!(token.is_cancelled(), "opening restarts the consumer");
        let started = Instant::now();
        assert_eq!(b.wait_until_usable().await, State::HalfOpen);
        assert!(started.elapsed() >= Duration::from_secs(5));
        assert_eq!(b.succeeded(), Some(State::Closed));
        assert_eq!(b.state(), State::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_probe_opens_it_again_and_success_resets_the_count() {
        let b = Breaker::new(2, Duration::from_secs(1));
        b.failed();
        b.succeeded();
        assert_eq!(b.failed(), None, "the count was reset");
        assert_eq!(b.failed(), Some(State::Open));
        assert_eq!(b.wait_until_usable().await, State::HalfOpen);
        assert_eq!(b.failed(), Some(State::Open));
    }
}

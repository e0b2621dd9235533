//! The login throttle: how many wrong secrets (a login form's token, a
//! bearer token, a Basic password) a client, and all clients together, may
//! send per window (`dashboard.login_failures_*`).
//!
//! Each limit is a token bucket kept as one instant (the generic cell rate
//! algorithm): a failure moves the bucket's `clear_at` one interval
//! (`window / limit`) later, from now at the earliest; the bucket is full
//! while `clear_at` is more than `window - interval` ahead, so `limit`
//! failures in a burst fill it and one more is allowed every interval
//! after. Invariants:
//!
//! - A throttled attempt is answered before its secret is looked at and is
//!   not counted, so a right secret is refused like a wrong one while
//!   throttled (the answer says nothing) and waiting is enough to get in.
//! - Checking, verifying and counting happen under one lock: concurrent
//!   attempts cannot all pass the check before any is counted.
//! - Only failures are counted: a client that logs in, or whose session
//!   cookie is valid, is never slowed, and another client's failures
//!   refuse it only through the total limit.
//! - Memory is bounded: a client whose failures are all forgotten is
//!   dropped, and at most [`MAX_CLIENTS`] are held (a client key is an
//!   IPv4 address or an IPv6 /64, so rotating addresses within one network
//!   does not make new clients; the total limit bounds how fast any
//!   attacker adds them).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Most clients remembered at once; one more replaces the one whose
/// failures would be forgotten first.
pub const MAX_CLIENTS: usize = 10_000;

/// The limits, from `[dashboard]`.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Failures per client per window.
    pub per_client: u32,
    /// Failures of all clients per window.
    pub total: u32,
    /// The window both limits count in.
    pub window: Duration,
}

/// One limit's bucket: the instant at which all its failures are forgotten.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    clear_at: Instant,
}

impl Bucket {
    fn new(now: Instant) -> Self {
        Self { clear_at: now }
    }

    /// `None` when one more failure fits; else how long until it does.
    fn wait(&self, now: Instant, limit: u32, window: Duration) -> Option<Duration> {
        let debt = self.clear_at.saturating_duration_since(now);
        let room = window.saturating_sub(interval(limit, window));
        (debt > room).then(|| debt - room)
    }

    fn fail(&mut self, now: Instant, limit: u32, window: Duration) {
        self.clear_at = self.clear_at.max(now) + interval(limit, window);
    }
}

/// The time one failure takes to be forgotten (at least a nanosecond, so
/// that a failure always counts).
fn interval(limit: u32, window: Duration) -> Duration {
    (window / limit.max(1)).max(Duration::from_nanos(1))
}

/// The throttle's memory, with explicit time: the rule, free of locks and
/// clocks.
#[derive(Debug)]
pub struct State {
    limits: Limits,
    total: Bucket,
    clients: HashMap<IpAddr, Bucket>,
}

impl State {
    /// No failures yet.
    pub fn new(limits: Limits, now: Instant) -> Self {
        Self {
            limits,
            total: Bucket::new(now),
            clients: HashMap::new(),
        }
    }

    /// `None` when `client` may try a secret at `now`; else how long it must
    /// wait (the longer of its own limit's and the total's).
    pub fn wait(&self, client: IpAddr, now: Instant) -> Option<Duration> {
        let Limits {
            per_client,
            total,
            window,
        } = self.limits;
        let own = self
            .clients
            .get(&key(client))
            .and_then(|b| b.wait(now, per_client, window));
        let all = self.total.wait(now, total, window);
        own.max(all)
    }

    /// Counts a failure of `client` at `now`.
    pub fn fail(&mut self, client: IpAddr, now: Instant) {
        let Limits {
            per_client,
            total,
            window,
        } = self.limits;
        self.total.fail(now, total, window);
        let client = key(client);
        if !self.clients.contains_key(&client) && self.clients.len() >= MAX_CLIENTS {
            self.clients.retain(|_, b| b.clear_at > now);
            if self.clients.len() >= MAX_CLIENTS
                && let Some(first) = self
                    .clients
                    .iter()
                    .min_by_key(|(_, b)| b.clear_at)
                    .map(|(k, _)| *k)
            {
                self.clients.remove(&first);
            }
        }
        self.clients
            .entry(client)
            .or_insert_with(|| Bucket::new(now))
            .fail(now, per_client, window);
    }

    /// Clients remembered.
    #[cfg(test)]
    fn clients(&self) -> usize {
        self.clients.len()
    }
}

/// The key a client is remembered by: an IPv4 address (an IPv4-mapped IPv6
/// address counts as its IPv4 address), or an IPv6 address's /64, the
/// smallest network a site is usually given.
fn key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(bits.into())
        }
        v4 => v4,
    }
}

/// What became of an attempt.
#[derive(Debug, PartialEq, Eq)]
pub enum Attempt<T> {
    /// The secret was checked: its result.
    Checked(T),
    /// The client must wait this long; nothing was checked.
    Throttled(Duration),
}

/// The throttle shared by the dashboard's requests.
#[derive(Debug)]
pub struct Throttle {
    state: Mutex<State>,
}

impl Throttle {
    /// No failures yet.
    pub fn new(limits: Limits) -> Self {
        Self {
            state: Mutex::new(State::new(limits, Instant::now())),
        }
    }

    /// Runs `check` (a secret's comparison) for `client` unless it is
    /// throttled, and counts a failure when `failed` says its result is one.
    pub fn attempt<T>(
        &self,
        client: IpAddr,
        check: impl FnOnce() -> T,
        failed: impl FnOnce(&T) -> bool,
    ) -> Attempt<T> {
        let now = Instant::now();
        // The comparison is a few microseconds: holding the lock over it
        // keeps concurrent attempts from passing the check together.
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(wait) = state.wait(client, now) {
            return Attempt::Throttled(wait);
        }
        let result = check();
        if failed(&result) {
            state.fail(client, now);
        }
        Attempt::Checked(result)
    }
}

/// The `Retry-After` value for a wait: whole seconds, rounded up, at least 1.
pub fn retry_after_secs(wait: Duration) -> u64 {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    secs.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    fn limits(per_client: u32, total: u32) -> Limits {
        Limits {
            per_client,
            total,
            window: MINUTE,
        }
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("address")
    }

    #[test]
    fn a_client_may_fail_its_limit_then_waits_one_interval_per_attempt() {
        let t0 = Instant::now();
        let mut s = State::new(limits(10, 100), t0);
        let eve = ip("192.0.2.1");
        for _ in 0..10 {
            assert_eq!(s.wait(eve, t0), None);
            s.fail(eve, t0);
        }
        // The 11th attempt waits one interval (60 s / 10).
        assert_eq!(s.wait(eve, t0), Some(Duration::from_secs(6)));
        let later = t0 + Duration::from_secs(2);
        assert_eq!(s.wait(eve, later), Some(Duration::from_secs(4)));
        let t1 = t0 + Duration::from_secs(6);
        assert_eq!(s.wait(eve, t1), None, "one more after an interval");
        s.fail(eve, t1);
        assert_eq!(s.wait(eve, t1), Some(Duration::from_secs(6)));
        // After the whole window everything is forgotten.
        let t2 = t1 + MINUTE;
        for _ in 0..10 {
            assert_eq!(s.wait(eve, t2), None);
            s.fail(eve, t2);
        }
        assert!(s.wait(eve, t2).is_some());
    }

    #[test]
    fn another_client_is_refused_only_by_the_total_limit() {
        let t0 = Instant::now();
        let mut s = State::new(limits(3, 5), t0);
        let (eve, alice, bob) = (ip("192.0.2.1"), ip("198.51.100.7"), ip("203.0.113.9"));
        for _ in 0..3 {
            s.fail(eve, t0);
        }
        assert!(s.wait(eve, t0).is_some());
        assert_eq!(s.wait(alice, t0), None, "eve's failures are not alice's");
        s.fail(bob, t0);
        s.fail(bob, t0);
        // Five failures in all: the total is full, for everyone.
        assert_eq!(s.wait(alice, t0), Some(Duration::from_secs(12)));
        assert_eq!(s.wait(alice, t0 + Duration::from_secs(12)), None);
        assert_eq!(
            s.wait(eve, t0 + Duration::from_secs(12)),
            Some(Duration::from_secs(8)),
            "eve's own limit is longer"
        );
    }

    #[test]
    fn an_ipv6_network_is_one_client_and_a_mapped_ipv4_address_its_address() {
        let t0 = Instant::now();
        let mut s = State::new(limits(2, 100), t0);
        s.fail(ip("2001:db8:1:2::1"), t0);
        s.fail(ip("2001:db8:1:2:ffff::9"), t0);
        assert!(s.wait(ip("2001:db8:1:2::77"), t0).is_some(), "same /64");
        assert_eq!(s.wait(ip("2001:db8:1:3::1"), t0), None, "another /64");
        s.fail(ip("::ffff:192.0.2.1"), t0);
        s.fail(ip("192.0.2.1"), t0);
        assert!(s.wait(ip("192.0.2.1"), t0).is_some());
    }

    #[test]
    fn clients_remembered_are_bounded_and_forgotten_when_clear() {
        let t0 = Instant::now();
        let mut s = State::new(
            Limits {
                per_client: 5,
                total: u32::MAX,
                window: MINUTE,
            },
            t0,
        );
        let throttled = ip("10.0.0.1");
        for _ in 0..5 {
            s.fail(throttled, t0);
        }
        // An attacker rotating addresses, one failure each.
        for i in 0..(MAX_CLIENTS as u32 + 500) {
            let rotating = IpAddr::V4((0x0b00_0000 + i).into());
            s.fail(rotating, t0 + Duration::from_micros(u64::from(i)));
            assert!(s.clients() <= MAX_CLIENTS);
        }
        assert!(
            s.wait(throttled, t0).is_some(),
            "the oldest one-failure clients went first"
        );
        // A later failure finds every old client forgotten.
        let late = t0 + 2 * MINUTE;
        s.fail(ip("10.9.9.9"), late);
        s.fail(ip("10.9.9.8"), late);
        assert!(s.clients() <= MAX_CLIENTS);
    }

    #[test]
    fn a_throttled_attempt_is_not_checked_and_only_failures_count() {
        let throttle = Throttle::new(limits(2, 100));
        let eve = ip("192.0.2.1");
        assert_eq!(
            throttle.attempt(eve, || true, |ok| !ok),
            Attempt::Checked(true)
        );
        assert_eq!(
            throttle.attempt(eve, || true, |ok| !ok),
            Attempt::Checked(true)
        );
        assert_eq!(
            throttle.attempt(eve, || false, |ok| !ok),
            Attempt::Checked(false)
        );
        assert_eq!(
            throttle.attempt(eve, || false, |ok| !ok),
            Attempt::Checked(false)
        );
        let mut checked = false;
        let third = throttle.attempt(
            eve,
            || {
                checked = true;
                true
            },
            |ok| !ok,
        );
        assert!(matches!(third, Attempt::Throttled(_)), "{third:?}");
        assert!(!checked, "a right secret is refused unread while throttled");
    }

    #[test]
    fn retry_after_is_whole_seconds_rounded_up() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(200)), 1);
        assert_eq!(retry_after_secs(Duration::from_secs(6)), 6);
        assert_eq!(retry_after_secs(Duration::from_millis(6001)), 7);
    }
}

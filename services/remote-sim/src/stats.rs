//! Call and effect counters exposed on `GET /stats`.
//!
//! The types derive both `Serialize` and `Deserialize`, so tests in other
//! crates can decode the `/stats` answer into [`Stats`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Snapshot of everything the simulator has counted since start or the last reset.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Calls to simulated endpoints (control API calls are not counted).
    pub total_calls: u64,
    /// Calls whose effect was applied.
    pub total_applied: u64,
    /// Per idempotency key.
    pub keys: BTreeMap<String, KeyStats>,
    /// Per endpoint path.
    pub endpoints: BTreeMap<String, EndpointStats>,
    /// Calls in progress now, on every endpoint.
    #[serde(default)]
    pub in_progress: u64,
    /// The most calls ever in progress at once on all endpoints together
    /// (steps in parallel overlap).
    #[serde(default)]
    pub max_in_progress: u64,
}

/// Counters for one idempotency key.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyStats {
    /// Endpoint the key was first used on.
    pub endpoint: String,
    /// Calls carrying this key.
    pub calls: u64,
    /// Times the effect was applied for this key (at most 1 while `idempotent`).
    pub applied: u64,
    /// The `X-Sas-Fencing-Token` of each call carrying one, in arrival order.
    #[serde(default)]
    pub tokens: Vec<i64>,
}

/// Counters for one endpoint path.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointStats {
    /// All calls, whatever their outcome.
    pub calls: u64,
    /// Calls whose effect was applied.
    pub applied: u64,
    /// Calls answered with a transient failure (408, 429, 5xx).
    pub transient: u64,
    /// Calls answered with a permanent failure (other 4xx).
    pub permanent: u64,
    /// Calls that hung.
    pub hung: u64,
    /// Calls answered by replaying a stored response.
    pub replayed: u64,
    /// Calls in progress now.
    #[serde(default)]
    pub in_progress: u64,
    /// The most calls ever in progress at once (flow control keeps it down).
    #[serde(default)]
    pub max_in_progress: u64,
    /// Calls answered `202 Accepted` (long-running operations).
    #[serde(default)]
    pub accepted: u64,
    /// Polls (`GET` of a job's `Location`).
    #[serde(default)]
    pub polls: u64,
}

/// How a call ended, for [`EndpointStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Applied,
    Replayed,
    Transient,
    Permanent,
    Hung,
    /// Answered with a forced status that is neither transient nor permanent (e.g. 2xx).
    Other,
}

impl Outcome {
    /// Classifies an HTTP status the way the sas agent does.
    pub(crate) fn of_status(status: u16) -> Self {
        match status {
            408 | 429 | 500..=599 => Self::Transient,
            400..=499 => Self::Permanent,
            _ => Self::Other,
        }
    }
}

impl Stats {
    /// Counts a call on `endpoint`; returns nothing, key counters are separate.
    pub(crate) fn count_call(&mut self, endpoint: &str) {
        self.total_calls += 1;
        self.endpoint_mut(endpoint).calls += 1;
    }

    /// Counts a `202 Accepted` answer on `endpoint`.
    pub(crate) fn accepted(&mut self, endpoint: &str) {
        self.endpoint_mut(endpoint).accepted += 1;
    }

    /// Counts a poll of a job started on `endpoint`.
    pub(crate) fn polled(&mut self, endpoint: &str) {
        self.endpoint_mut(endpoint).polls += 1;
    }

    /// A call on `endpoint` starts (`true`) or ends.
    pub(crate) fn in_progress(&mut self, endpoint: &str, starts: bool) {
        fn count(now: &mut u64, max: &mut u64, starts: bool) {
            if starts {
                *now += 1;
                *max = (*max).max(*now);
            } else {
                *now = now.saturating_sub(1);
            }
        }
        let stats = self.endpoint_mut(endpoint);
        count(&mut stats.in_progress, &mut stats.max_in_progress, starts);
        count(&mut self.in_progress, &mut self.max_in_progress, starts);
    }

    /// Counts a call carrying `key`, returning how many calls the key has seen (1-based).
    pub(crate) fn count_key_call(&mut self, key: &str, endpoint: &str) -> u64 {
        let entry = self.key_mut(key, endpoint);
        entry.calls += 1;
        entry.calls
    }

    /// Records a call's fencing token for `key`; returns the highest one
    /// seen before it, if any.
    pub(crate) fn note_token(&mut self, key: &str, endpoint: &str, token: i64) -> Option<i64> {
        let entry = self.key_mut(key, endpoint);
        let highest = entry.tokens.iter().copied().max();
        entry.tokens.push(token);
        highest
    }

    /// Records the outcome of a call on `endpoint` (and `key`, for applied effects).
    pub(crate) fn record(&mut self, endpoint: &str, key: Option<&str>, outcome: Outcome) {
        let stats = self.endpoint_mut(endpoint);
        match outcome {
            Outcome::Applied => stats.applied += 1,
            Outcome::Replayed => stats.replayed += 1,
            Outcome::Transient => stats.transient += 1,
            Outcome::Permanent => stats.permanent += 1,
            Outcome::Hung => stats.hung += 1,
            Outcome::Other => {}
        }
        if outcome == Outcome::Applied {
            self.total_applied += 1;
            if let Some(key) = key {
                self.key_mut(key, endpoint).applied += 1;
            }
        }
    }

    /// The endpoint a key was first used on, if the key is known.
    pub(crate) fn key_endpoint(&self, key: &str) -> Option<&str> {
        self.keys.get(key).map(|k| k.endpoint.as_str())
    }

    fn endpoint_mut(&mut self, endpoint: &str) -> &mut EndpointStats {
        self.endpoints.entry(endpoint.to_owned()).or_default()
    }

    fn key_mut(&mut self, key: &str, endpoint: &str) -> &mut KeyStats {
        self.keys.entry(key.to_owned()).or_insert_with(|| KeyStats {
            endpoint: endpoint.to_owned(),
            ..KeyStats::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_classification() {
        assert_eq!(Outcome::of_status(408), Outcome::Transient);
        assert_eq!(Outcome::of_status(429), Outcome::Transient);
        assert_eq!(Outcome::of_status(503), Outcome::Transient);
        assert_eq!(Outcome::of_status(400), Outcome::Permanent);
        assert_eq!(Outcome::of_status(204), Outcome::Other);
    }

    #[test]
    fn counting() {
        let mut stats = Stats::default();
        stats.count_call("/a");
        assert_eq!(stats.count_key_call("k", "/a"), 1);
        stats.record("/a", Some("k"), Outcome::Applied);
        stats.count_call("/a");
        assert_eq!(stats.count_key_call("k", "/a"), 2);
        stats.record("/a", Some("k"), Outcome::Replayed);
        assert_eq!(stats.total_calls, 2);
        assert_eq!(stats.total_applied, 1);
        assert_eq!(stats.keys["k"].applied, 1);
        assert_eq!(stats.keys["k"].calls, 2);
        assert_eq!(stats.endpoints["/a"].replayed, 1);
        assert_eq!(stats.key_endpoint("k"), Some("/a"));
    }
}

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
    /// Order id (a key's part before its first `:`) → the forward keys
    /// whose effect stands now, sorted. Only orders with at least one
    /// standing effect appear (see [`KeyStats::standing`]).
    #[serde(default)]
    pub standing: BTreeMap<String, Vec<String>>,
}

/// Counters for one idempotency key.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyStats {
    /// Endpoint the key was first used on; empty for a forward key that
    /// has only been undone so far (its undo was applied before any call
    /// with the key itself).
    pub endpoint: String,
    /// Calls carrying this key.
    pub calls: u64,
    /// Times the effect was applied for this key (at most 1 while `idempotent`).
    pub applied: u64,
    /// The `X-Sas-Fencing-Token` of each call carrying one, in arrival order.
    #[serde(default)]
    pub tokens: Vec<i64>,
    /// The `X-Sas-Outcome` of each call carrying one, in arrival order
    /// (`unknown`, `completed`, or whatever else was sent).
    #[serde(default)]
    pub outcomes: Vec<String>,
    /// For a forward key: its effect stands now (a call with it was applied
    /// and no undo was applied since).
    #[serde(default)]
    pub standing: bool,
    /// For a forward key: an undo of it (`<key>:compensate`) was applied,
    /// whether or not the key's own effect ever was.
    #[serde(default)]
    pub undone: bool,
}

/// The undo suffix of an idempotency key: `<base>:compensate[:r<N>]`
/// undoes the forward key `<base>[:r<N>]`.
const COMPENSATE: &str = "compensate";

/// The forward key that `key` undoes, when `key` is an undo key: its
/// `compensate` segment is the last one, or is followed by a redrive
/// segment `r<digits>`, and something comes before it. `o:s:compensate`
/// undoes `o:s`; `o:s:compensate:r1` undoes `o:s:r1`.
pub(crate) fn undone_key(key: &str) -> Option<String> {
    let (rest, last) = key.rsplit_once(':')?;
    if last == COMPENSATE {
        return (!rest.is_empty()).then(|| rest.to_owned());
    }
    let redrive = last
        .strip_prefix('r')
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    let base = rest.strip_suffix(COMPENSATE)?.strip_suffix(':')?;
    (redrive && !base.is_empty()).then(|| format!("{base}:{last}"))
}

/// The order id of a forward key: its part before the first `:` (the
/// whole key when it has none).
pub(crate) fn order_of(key: &str) -> &str {
    key.split_once(':').map_or(key, |(order, _)| order)
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

    /// Records a call's `X-Sas-Outcome` for `key`.
    pub(crate) fn note_outcome(&mut self, key: &str, endpoint: &str, outcome: &str) {
        self.key_mut(key, endpoint)
            .outcomes
            .push(outcome.to_owned());
    }

    /// The forward keys whose effect stands now for `order_id`.
    pub fn standing_for(&self, order_id: &str) -> usize {
        self.standing.get(order_id).map_or(0, Vec::len)
    }

    /// Records the outcome of a call on `endpoint` (and `key`, for applied
    /// effects: an applied forward key stands, an applied undo key clears
    /// its forward key).
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
                match undone_key(key) {
                    Some(forward) => {
                        // Created without an endpoint when the forward key
                        // was never called; its first call fills it in.
                        self.keys.entry(forward.clone()).or_default().undone = true;
                        self.set_standing(&forward, false);
                    }
                    None => self.set_standing(key, true),
                }
            }
        }
    }

    /// Marks the effect of the (known) forward key `key` standing or not,
    /// keeping [`Stats::standing`] in step.
    fn set_standing(&mut self, key: &str, stands: bool) {
        if let Some(entry) = self.keys.get_mut(key) {
            entry.standing = stands;
        }
        let order = order_of(key);
        if stands {
            let keys = self.standing.entry(order.to_owned()).or_default();
            if let Err(at) = keys.binary_search_by(|k| k.as_str().cmp(key)) {
                keys.insert(at, key.to_owned());
            }
        } else if let Some(keys) = self.standing.get_mut(order)
            && let Ok(at) = keys.binary_search_by(|k| k.as_str().cmp(key))
        {
            keys.remove(at);
            if keys.is_empty() {
                self.standing.remove(order);
            }
        }
    }

    /// The endpoint a key was first used on, if the key is known.
    pub(crate) fn key_endpoint(&self, key: &str) -> Option<&str> {
        self.keys
            .get(key)
            .map(|k| k.endpoint.as_str())
            .filter(|endpoint| !endpoint.is_empty())
    }

    fn endpoint_mut(&mut self, endpoint: &str) -> &mut EndpointStats {
        self.endpoints.entry(endpoint.to_owned()).or_default()
    }

    fn key_mut(&mut self, key: &str, endpoint: &str) -> &mut KeyStats {
        let entry = self.keys.entry(key.to_owned()).or_default();
        // Empty when only an undo of the key was seen so far.
        if entry.endpoint.is_empty() {
            endpoint.clone_into(&mut entry.endpoint);
        }
        entry
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

    #[test]
    fn undo_keys_pair_with_their_forward_keys() {
        for (key, forward) in [
            ("o:s:compensate", Some("o:s")),
            ("o:s:compensate:r1", Some("o:s:r1")),
            ("o:s:compensate:r12", Some("o:s:r12")),
            ("o:compensate", Some("o")),
            ("o:s", None),
            ("o:s:r1", None),
            ("compensate", None),
            (":compensate", None),
            (":compensate:r1", None),
            ("o:s:compensate:r", None),
            ("o:s:compensate:rx", None),
            ("o:s:compensate:x", None),
            ("o:s:xcompensate", None),
            ("o:s:xcompensate:r1", None),
            ("plain", None),
            ("", None),
        ] {
            assert_eq!(undone_key(key).as_deref(), forward, "{key}");
        }
        assert_eq!(order_of("o:s:r1"), "o");
        assert_eq!(order_of("plain"), "plain");
    }

    #[test]
    fn standing_effects_per_order() {
        let mut stats = Stats::default();
        for key in ["o:b", "o:a", "p", "o:a"] {
            stats.count_key_call(key, "/f");
            stats.record("/f", Some(key), Outcome::Applied);
        }
        assert_eq!(stats.standing["o"], ["o:a", "o:b"]);
        assert_eq!(stats.standing["p"], ["p"]);
        stats.record("/u", Some("o:a:compensate"), Outcome::Applied);
        stats.record("/u", Some("o:b:compensate"), Outcome::Replayed);
        assert_eq!(stats.standing_for("o"), 1);
        assert!(stats.keys["o:a"].undone && !stats.keys["o:a"].standing);
        assert!(stats.keys["o:b"].standing && !stats.keys["o:b"].undone);
        stats.record("/u", Some("o:b:compensate"), Outcome::Applied);
        assert!(!stats.standing.contains_key("o"));
        assert_eq!(stats.standing_for("o"), 0);
        // Undone before ever called: known, but with no endpoint yet.
        stats.record("/u", Some("q:s:compensate"), Outcome::Applied);
        assert!(stats.keys["q:s"].undone);
        assert_eq!(stats.key_endpoint("q:s"), None);
        stats.count_key_call("q:s", "/f");
        assert_eq!(stats.key_endpoint("q:s"), Some("/f"));
        assert!(!stats.standing.contains_key("q"));
    }

    #[test]
    fn stats_without_the_new_fields_decode() {
        let json = r#"{"total_calls":1,"total_applied":1,
            "keys":{"o:s":{"endpoint":"/f","calls":1,"applied":1}},"endpoints":{}}"#;
        let stats: Stats = serde_json::from_str(json).expect("old stats");
        assert!(stats.standing.is_empty());
        let key = &stats.keys["o:s"];
        assert!(key.outcomes.is_empty() && !key.standing && !key.undone);
    }
}

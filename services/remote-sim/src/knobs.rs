//! Fault knobs: per-endpoint settings that decide how the simulator answers a call.
//!
//! Knobs are plain JSON; every field is optional and falls back to the
//! well-behaved default (answer immediately, apply once per idempotency key).

use std::collections::HashMap;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

/// Default duration of a simulated hang: one hour, i.e. "until the client gives up".
pub const DEFAULT_HANG_MS: u64 = 3_600_000;

/// Path prefix reserved for the control API; it can never be a simulated endpoint.
pub const CONTROL_PREFIX: &str = "/_sim";

/// Fault knobs for one endpoint path.
///
/// Evaluation order per call (see the crate docs): count the call →
/// `fencing` → `permanent` → `status` → `hang` / `hang_first` →
/// `fail_first` → `transient_rate` → replay when already applied (if
/// `idempotent`) → `permanent_rate` → `long_ms` (202 Accepted) →
/// `latency_ms` → `together` → apply → `late_answer_ms` (the effect
/// stands, the answer comes late).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Knobs {
    /// Sleep this long before answering a call that will be applied.
    pub latency_ms: u64,
    /// Probability (0..=1) of answering 503 without applying.
    pub transient_rate: f64,
    /// Probability (0..=1) of answering 422 without applying, drawn per call.
    /// A key already applied replays its stored answer instead, and a key
    /// refused this way is refused again (while `idempotent`): a service
    /// that deduplicates answers a repeat from its store, so an effect it
    /// applied is never reported as failed, nor one it refused applied by a
    /// duplicate of the request later (either would leave it undone).
    pub permanent_rate: f64,
    /// The first N calls per idempotency key answer 503 without applying.
    pub fail_first: u32,
    /// The first N calls per idempotency key hang (see `hang_ms`) and are never applied.
    pub hang_first: u32,
    /// Every call hangs and is never applied.
    pub hang: bool,
    /// How long a hanging call sleeps before it answers 504 (never applied).
    pub hang_ms: u64,
    /// Every call answers 422 with a JSON error body, without applying.
    pub permanent: bool,
    /// Every call answers this HTTP status, without applying (e.g. 408, 429, 400).
    pub status: Option<u16>,
    /// Seconds to announce in a `Retry-After` header on 503 and 429 answers.
    pub retry_after: Option<u64>,
    /// When false, deduplication is off: every successful call applies again.
    pub idempotent: bool,
    /// Pads an applied call's JSON answer with a `pad` string of this many
    /// bytes (to try a client's answer-size limit).
    pub pad_bytes: usize,
    /// Refuses (409, without applying) a call whose `X-Sas-Fencing-Token`
    /// is lower than the highest its key has seen, or than the highest of a
    /// call undoing the key (`<key>:compensate`, on any endpoint), as a
    /// remote that honours fencing tokens would: a call from a dispatch that
    /// was superseded.
    pub fencing: bool,
    /// Long-running operations (contract §4b): a call that would be applied
    /// answers `202 Accepted` with a `Location` to poll instead, and the job
    /// is done (applied once) this many milliseconds after the first call
    /// of its key; a repeated call while it runs answers 202 with the same
    /// `Location`. 0: off.
    pub long_ms: u64,
    /// A call that is applied has its effect applied (and stored for
    /// replay) at once, and its answer is sent this many milliseconds
    /// later: a remote that acts, then answers after the client's deadline.
    /// A retry of the key meanwhile finds the effect applied. If the
    /// simulator shuts down meanwhile, the call answers 503, but its effect
    /// stands. Not applied to polls of long-running operations. 0: off.
    pub late_answer_ms: u64,
    /// An applied call's answer quotes the request's `payload` as `echo`
    /// (and a fan-out's `item` and `index`): what the remote was sent, for
    /// tests of the payload sas builds.
    pub echo: bool,
    /// Calls of the endpoint that are to be applied wait, after
    /// `latency_ms`, until this many are waiting, then all go on at once
    /// (a call that waits `hang_ms` goes on alone): answers that come back
    /// together, whatever the spread of the calls. Calls on one key wait
    /// one after another (the key's calls are serialised), so only calls
    /// on distinct keys gather. 0 or 1: off.
    pub together: u32,
}

impl Default for Knobs {
    fn default() -> Self {
        Self {
            latency_ms: 0,
            transient_rate: 0.0,
            permanent_rate: 0.0,
            fail_first: 0,
            hang_first: 0,
            hang: false,
            hang_ms: DEFAULT_HANG_MS,
            permanent: false,
            status: None,
            retry_after: None,
            idempotent: true,
            pad_bytes: 0,
            fencing: false,
            long_ms: 0,
            late_answer_ms: 0,
            echo: false,
            together: 0,
        }
    }
}

impl Knobs {
    /// Checks value ranges: `transient_rate` and `permanent_rate` in 0..=1
    /// and `status` a valid HTTP status.
    pub fn validate(&self) -> anyhow::Result<()> {
        for (name, rate) in [
            ("transient_rate", self.transient_rate),
            ("permanent_rate", self.permanent_rate),
        ] {
            // `contains` is false for NaN too.
            if !(0.0..=1.0).contains(&rate) {
                bail!("{name} must be within 0..=1, got {rate}");
            }
        }
        if let Some(status) = self.status
            && !(100..=999).contains(&status)
        {
            bail!("status must be an HTTP status code (100..=999), got {status}");
        }
        Ok(())
    }
}

/// Checks that `path` can carry knobs: it starts with `/` and is not a control path.
pub fn validate_endpoint_path(path: &str) -> anyhow::Result<()> {
    if !path.starts_with('/') {
        bail!("endpoint path must start with '/': {path:?}");
    }
    if is_control_path(path) {
        bail!("{path:?} is a control path of the simulator, not an endpoint");
    }
    Ok(())
}

/// True for the paths served by the control API (`/healthz`, `/stats`, `/_sim/...`).
pub fn is_control_path(path: &str) -> bool {
    path == "/healthz" || path == "/stats" || path == CONTROL_PREFIX || path.starts_with("/_sim/")
}

/// Parses a knobs file: a JSON object mapping endpoint path to [`Knobs`].
///
/// Every path and every set of knobs is validated.
pub fn parse_knobs_map(json: &str) -> anyhow::Result<HashMap<String, Knobs>> {
    let map: HashMap<String, Knobs> =
        serde_json::from_str(json).context("knobs must be a JSON object: path -> knobs")?;
    for (path, knobs) in &map {
        validate_endpoint_path(path)?;
        knobs
            .validate()
            .with_context(|| format!("invalid knobs for {path}"))?;
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_object_gives_defaults() {
        let knobs: Knobs = serde_json::from_str("{}").unwrap();
        assert_eq!(knobs, Knobs::default());
        assert!(knobs.idempotent);
        assert_eq!(knobs.hang_ms, DEFAULT_HANG_MS);
    }

    #[test]
    fn partial_object_keeps_other_defaults() {
        let knobs: Knobs = serde_json::from_str(r#"{"fail_first":2,"retry_after":1}"#).unwrap();
        assert_eq!(knobs.fail_first, 2);
        assert_eq!(knobs.retry_after, Some(1));
        assert!(knobs.idempotent);
    }

    #[test]
    fn unknown_fields_are_rejected() {
        assert!(serde_json::from_str::<Knobs>(r#"{"fail_frist":2}"#).is_err());
    }

    #[test]
    fn validation() {
        let bad_rate = Knobs {
            transient_rate: 1.5,
            ..Knobs::default()
        };
        assert!(bad_rate.validate().is_err());
        let bad_status = Knobs {
            status: Some(42),
            ..Knobs::default()
        };
        assert!(bad_status.validate().is_err());
        assert!(Knobs::default().validate().is_ok());
    }

    #[test]
    fn permanent_rate_is_a_probability() {
        let knobs: Knobs = serde_json::from_str(r#"{"permanent_rate":0.25}"#).unwrap();
        assert_eq!(knobs.permanent_rate, 0.25);
        assert!(knobs.validate().is_ok());
        assert_eq!(Knobs::default().permanent_rate, 0.0);
        for rate in [-0.1, 1.01, f64::NAN] {
            let knobs = Knobs {
                permanent_rate: rate,
                ..Knobs::default()
            };
            let e = knobs.validate().unwrap_err().to_string();
            assert!(e.contains("permanent_rate"), "{e}");
        }
        for rate in [0.0, 1.0] {
            let knobs = Knobs {
                permanent_rate: rate,
                ..Knobs::default()
            };
            assert!(knobs.validate().is_ok());
        }
        assert!(parse_knobs_map(r#"{"/x":{"permanent_rate":2}}"#).is_err());
    }

    #[test]
    fn knobs_map_checks_paths() {
        let map = parse_knobs_map(r#"{"/payments/charge":{"fail_first":1}}"#).unwrap();
        assert_eq!(map["/payments/charge"].fail_first, 1);
        assert!(parse_knobs_map(r#"{"payments":{}}"#).is_err());
        assert!(parse_knobs_map(r#"{"/_sim/knobs":{}}"#).is_err());
        assert!(parse_knobs_map(r#"{"/x":{"transient_rate":-1}}"#).is_err());
        assert!(parse_knobs_map("[]").is_err());
    }
}

//! Simulator state and the decision logic for one call to a simulated endpoint.
//!
//! [`RemoteSim`] owns the knobs, the counters and the deduplication store
//! (idempotency key → stored response). The HTTP layer in `http.rs` only
//! translates requests into [`RemoteSim::call`] and its [`Reply`] back into a
//! response.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Duration;

use axum::http::StatusCode;
use serde_json::{Map, Value, json};
use tokio::sync::{Mutex as AsyncMutex, watch};

use crate::knobs::{Knobs, validate_endpoint_path};
use crate::stats::{Outcome, Stats, undone_key};

/// Stored response of an applied call; `None` until the key is applied.
type Slot = Arc<AsyncMutex<Option<Value>>>;

/// Shared state of the simulator; wrap it in an [`Arc`] and hand it to [`crate::router`].
pub struct RemoteSim {
    knobs: RwLock<HashMap<String, Knobs>>,
    inner: Mutex<Inner>,
    shutdown: watch::Sender<bool>,
}

/// Counters and the deduplication store, reset together by [`RemoteSim::reset_stats`].
#[derive(Default)]
struct Inner {
    stats: Stats,
    /// One slot per idempotency key; its async mutex serialises calls on that key.
    slots: HashMap<String, Slot>,
    /// Long-running operations by job id (the last part of their `Location`).
    jobs: HashMap<String, Job>,
    /// The job of each idempotency key that has one.
    job_of_key: HashMap<String, String>,
    /// Forward key → the highest fencing token of a call undoing it: with
    /// `fencing`, a forward call older than its undo is refused. Kept apart
    /// from the key's own `tokens`, which list only calls carrying the key.
    undo_tokens: HashMap<String, i64>,
    /// Keys refused by `permanent_rate`: a remote that deduplicates answers
    /// a repeat of the key (a redelivered or duplicated request) with the
    /// same refusal, and never applies it later.
    refused: std::collections::HashSet<String>,
    /// Knob `together`: per endpoint, the calls waiting and the gate they
    /// wait on (its value turns once they all go).
    gathered: HashMap<String, (u32, watch::Sender<u64>)>,
}

/// A long-running operation (knob `long_ms`).
#[derive(Debug, Clone)]
struct Job {
    endpoint: String,
    key: String,
    /// The body of the call that started it.
    body: Value,
    /// When it is done.
    done_at: tokio::time::Instant,
}

/// Where a job started on `endpoint` is polled: a path under the endpoint.
pub fn job_location(endpoint: &str, job: &str) -> String {
    format!("{}/jobs/{job}", endpoint.trim_end_matches('/'))
}

/// What to answer to a call on a simulated endpoint.
#[derive(Debug, Clone)]
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) body: Value,
    /// Seconds for a `Retry-After` header.
    pub(crate) retry_after: Option<u64>,
    /// Adds `Idempotent-Replayed: true`.
    pub(crate) replayed: bool,
    /// A `Location` header (with `202 Accepted`).
    pub(crate) location: Option<String>,
}

impl Reply {
    fn error(status: StatusCode, endpoint: &str, key: Option<&str>, error: &str) -> Self {
        Self {
            status,
            body: json!({
                "ok": false,
                "error": error,
                "endpoint": endpoint,
                "idempotency_key": key,
            }),
            retry_after: None,
            replayed: false,
            location: None,
        }
    }

    /// `200 OK` with `body`, replayed from the deduplication store or not.
    fn ok(body: Value, replayed: bool) -> Self {
        Self {
            status: StatusCode::OK,
            body,
            retry_after: None,
            replayed,
            location: None,
        }
    }

    fn with_retry_after(mut self, retry_after: Option<u64>) -> Self {
        if matches!(
            self.status,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
        ) {
            self.retry_after = retry_after;
        }
        self
    }
}

impl RemoteSim {
    /// Creates the state with `initial` knobs (path → knobs); fails on invalid paths or knobs.
    pub fn new(initial: HashMap<String, Knobs>) -> anyhow::Result<Self> {
        for (path, knobs) in &initial {
            validate_endpoint_path(path)?;
            knobs.validate()?;
        }
        Ok(Self {
            knobs: RwLock::new(initial),
            inner: Mutex::new(Inner::default()),
            shutdown: watch::Sender::new(false),
        })
    }

    /// Effective knobs of `path` (the defaults when none were set).
    pub fn knobs(&self, path: &str) -> Knobs {
        self.read_knobs().get(path).cloned().unwrap_or_default()
    }

    /// All explicitly set knobs, by path.
    pub fn all_knobs(&self) -> BTreeMap<String, Knobs> {
        self.read_knobs()
            .iter()
            .map(|(path, knobs)| (path.clone(), knobs.clone()))
            .collect()
    }

    /// Sets the knobs of `path`; fails on an invalid path or invalid knobs.
    pub fn set_knobs(&self, path: &str, knobs: Knobs) -> anyhow::Result<()> {
        validate_endpoint_path(path)?;
        knobs.validate()?;
        self.write_knobs().insert(path.to_owned(), knobs);
        Ok(())
    }

    /// Resets the knobs of `path` to the defaults.
    pub fn remove_knobs(&self, path: &str) {
        self.write_knobs().remove(path);
    }

    /// Resets the knobs of every path to the defaults.
    pub fn reset_knobs(&self) {
        self.write_knobs().clear();
    }

    /// Snapshot of the counters.
    pub fn stats(&self) -> Stats {
        self.lock_inner().stats.clone()
    }

    /// Resets the counters and the deduplication store.
    pub fn reset_stats(&self) {
        *self.lock_inner() = Inner::default();
    }

    /// Wakes every hanging or sleeping call (they answer 503 without applying),
    /// so a graceful shutdown does not wait for simulated hangs.
    pub fn shutdown(&self) {
        self.shutdown.send_replace(true);
    }

    /// Handles one call on the simulated `endpoint`.
    ///
    /// `key` is the `Idempotency-Key` header, `token` the
    /// `X-Sas-Fencing-Token`, `outcome` the `X-Sas-Outcome` (recorded as
    /// given), `body` the raw request body.
    pub(crate) async fn call(
        &self,
        endpoint: &str,
        key: Option<&str>,
        token: Option<i64>,
        outcome: Option<&str>,
        body: &[u8],
    ) -> Reply {
        /// Counts the call in progress until it ends, answered or dropped.
        struct InProgress<'a>(&'a RemoteSim, &'a str);
        impl Drop for InProgress<'_> {
            fn drop(&mut self) {
                self.0.lock_inner().stats.in_progress(self.1, false);
            }
        }
        self.lock_inner().stats.in_progress(endpoint, true);
        let _counted = InProgress(self, endpoint);
        self.answer(endpoint, key, token, outcome, body).await
    }

    async fn answer(
        &self,
        endpoint: &str,
        key: Option<&str>,
        token: Option<i64>,
        outcome: Option<&str>,
        body: &[u8],
    ) -> Reply {
        let knobs = self.knobs(endpoint);
        let parsed = serde_json::from_slice::<Value>(body);

        // Count the call and find the key's slot, under one short lock.
        let (key, calls_for_key, slot) = {
            let mut inner = self.lock_inner();
            inner.stats.count_call(endpoint);
            let Some(key) = key else {
                inner.stats.record(endpoint, None, Outcome::Permanent);
                return Reply::error(
                    StatusCode::BAD_REQUEST,
                    endpoint,
                    None,
                    "missing Idempotency-Key header",
                );
            };
            if parsed.is_err() {
                inner.stats.record(endpoint, Some(key), Outcome::Permanent);
                return Reply::error(
                    StatusCode::BAD_REQUEST,
                    endpoint,
                    Some(key),
                    "request body is not JSON",
                );
            }
            if let Some(first) = inner.stats.key_endpoint(key)
                && first != endpoint
            {
                let error = format!("Idempotency-Key already used on {first}");
                inner.stats.record(endpoint, Some(key), Outcome::Permanent);
                return Reply::error(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    endpoint,
                    Some(key),
                    &error,
                );
            }
            let calls = inner.stats.count_key_call(key, endpoint);
            if let Some(outcome) = outcome {
                inner.stats.note_outcome(key, endpoint, outcome);
            }
            let newest = token.and_then(|t| inner.stats.note_token(key, endpoint, t));
            let undone = undone_key(key);
            // An undo supersedes every dispatch of its forward key, whichever
            // endpoint it arrives on, applied or not.
            if let (Some(forward), Some(token)) = (&undone, token) {
                let highest = inner.undo_tokens.entry(forward.clone()).or_insert(token);
                *highest = (*highest).max(token);
            }
            let undo = match undone {
                None => inner.undo_tokens.get(key).copied(),
                Some(_) => None,
            };
            if let (true, Some(token)) = (knobs.fencing, token) {
                let error = match (undo, newest) {
                    (Some(undo), _) if token < undo => Some(format!(
                        "fencing token {token} is older than the undo's {undo}"
                    )),
                    (_, Some(newest)) if token < newest => {
                        Some(format!("fencing token {token} is older than {newest}"))
                    }
                    _ => None,
                };
                if let Some(error) = error {
                    inner.stats.record(endpoint, Some(key), Outcome::Permanent);
                    return Reply::error(StatusCode::CONFLICT, endpoint, Some(key), &error);
                }
            }
            let slot = inner.slots.entry(key.to_owned()).or_default().clone();
            (key, calls, slot)
        };
        let record = |outcome| self.lock_inner().stats.record(endpoint, Some(key), outcome);

        if knobs.permanent {
            record(Outcome::Permanent);
            let error = "simulated permanent failure";
            return Reply::error(StatusCode::UNPROCESSABLE_ENTITY, endpoint, Some(key), error);
        }
        if let Some(status) = knobs.status {
            record(Outcome::of_status(status));
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let error = format!("simulated status {}", status.as_u16());
            return Reply::error(status, endpoint, Some(key), &error)
                .with_retry_after(knobs.retry_after);
        }
        if knobs.hang || calls_for_key <= u64::from(knobs.hang_first) {
            record(Outcome::Hung);
            return if self.sleep_unless_shutdown(knobs.hang_ms).await {
                let error = "simulated hang elapsed";
                Reply::error(StatusCode::GATEWAY_TIMEOUT, endpoint, Some(key), error)
            } else {
                self.shutting_down(endpoint, key)
            };
        }
        if calls_for_key <= u64::from(knobs.fail_first) {
            record(Outcome::Transient);
            let error = format!("simulated failure {calls_for_key} of {}", knobs.fail_first);
            return Reply::error(StatusCode::SERVICE_UNAVAILABLE, endpoint, Some(key), &error)
                .with_retry_after(knobs.retry_after);
        }
        if knobs.transient_rate > 0.0 && fastrand::f64() < knobs.transient_rate {
            record(Outcome::Transient);
            let error = "simulated transient failure";
            return Reply::error(StatusCode::SERVICE_UNAVAILABLE, endpoint, Some(key), error)
                .with_retry_after(knobs.retry_after);
        }

        // From here on, calls with the same key are serialised.
        let mut stored = slot.lock().await;
        if knobs.idempotent
            && let Some(response) = stored.as_ref()
        {
            record(Outcome::Replayed);
            return Reply::ok(response.clone(), true);
        }
        // After the replay check, so an applied key keeps answering success.
        let refused_before = knobs.idempotent && self.lock_inner().refused.contains(key);
        if refused_before || (knobs.permanent_rate > 0.0 && fastrand::f64() < knobs.permanent_rate)
        {
            record(Outcome::Permanent);
            self.lock_inner().refused.insert(key.to_owned());
            let error = "simulated permanent failure (permanent_rate)";
            return Reply::error(StatusCode::UNPROCESSABLE_ENTITY, endpoint, Some(key), error);
        }
        if knobs.long_ms > 0 {
            return self.accept(endpoint, key, parsed.unwrap_or_default(), &knobs);
        }
        if knobs.latency_ms > 0 && !self.sleep_unless_shutdown(knobs.latency_ms).await {
            record(Outcome::Transient);
            return self.shutting_down(endpoint, key);
        }
        if knobs.together > 1 {
            self.gather(endpoint, knobs.together, knobs.hang_ms).await;
        }
        let body = parsed.unwrap_or_default();
        let mut response = applied_response(endpoint, key, &body);
        if knobs.pad_bytes > 0
            && let Value::Object(fields) = &mut response
        {
            fields.insert("pad".into(), "x".repeat(knobs.pad_bytes).into());
        }
        if knobs.echo
            && let Value::Object(fields) = &mut response
        {
            let sent = body.get("payload").cloned().unwrap_or_default();
            fields.insert("echo".into(), sent);
            // An item of a fan-out (§4d) is quoted too.
            for field in ["item", "index"] {
                if let Some(value) = body.get(field) {
                    fields.insert(field.into(), value.clone());
                }
            }
        }
        *stored = Some(response.clone());
        record(Outcome::Applied);
        if knobs.late_answer_ms > 0 {
            // Applied already: a retry of the key meanwhile replays it.
            drop(stored);
            if !self.sleep_unless_shutdown(knobs.late_answer_ms).await {
                // Counted as applied only: the effect stands, whatever the answer.
                return self.shutting_down(endpoint, key);
            }
        }
        Reply::ok(response, false)
    }

    /// Starts the key's long-running operation, or finds the one it has,
    /// and answers `202 Accepted` with where to poll it.
    fn accept(&self, endpoint: &str, key: &str, body: Value, knobs: &Knobs) -> Reply {
        let mut inner = self.lock_inner();
        let job = match inner.job_of_key.get(key) {
            Some(job) => job.clone(),
            None => {
                let job = uuid::Uuid::new_v4().simple().to_string();
                let done_at = tokio::time::Instant::now() + Duration::from_millis(knobs.long_ms);
                inner.jobs.insert(
                    job.clone(),
                    Job {
                        endpoint: endpoint.to_owned(),
                        key: key.to_owned(),
                        body,
                        done_at,
                    },
                );
                inner.job_of_key.insert(key.to_owned(), job.clone());
                job
            }
        };
        inner.stats.accepted(endpoint);
        accepted(endpoint, key, &job, knobs.retry_after)
    }

    /// A poll of job `job` (`GET` of its `Location`): 202 while it runs,
    /// then its result, applied once however often it is polled; 404 for
    /// an unknown job.
    pub(crate) async fn poll(&self, job: &str) -> Reply {
        let found = {
            let mut inner = self.lock_inner();
            let found = inner.jobs.get(job).cloned();
            if let Some(j) = &found {
                inner.stats.polled(&j.endpoint);
            }
            found
        };
        let Some(j) = found else {
            return Reply::error(StatusCode::NOT_FOUND, "", None, "no such job");
        };
        if tokio::time::Instant::now() < j.done_at {
            let retry_after = self.knobs(&j.endpoint).retry_after;
            return accepted(&j.endpoint, &j.key, job, retry_after);
        }
        let slot = self
            .lock_inner()
            .slots
            .entry(j.key.clone())
            .or_default()
            .clone();
        let mut stored = slot.lock().await;
        if let Some(response) = stored.as_ref() {
            // Counted as a POST's replay is.
            self.lock_inner()
                .stats
                .record(&j.endpoint, Some(&j.key), Outcome::Replayed);
            return Reply::ok(response.clone(), true);
        }
        let response = applied_response(&j.endpoint, &j.key, &j.body);
        *stored = Some(response.clone());
        self.lock_inner()
            .stats
            .record(&j.endpoint, Some(&j.key), Outcome::Applied);
        Reply::ok(response, false)
    }

    fn shutting_down(&self, endpoint: &str, key: &str) -> Reply {
        let status = StatusCode::SERVICE_UNAVAILABLE;
        Reply::error(status, endpoint, Some(key), "simulator is shutting down")
    }

    /// Waits until `count` calls of `endpoint` wait here (knob `together`),
    /// or `limit_ms` has passed. (A call whose client hangs up meanwhile
    /// stays counted until that turn goes: a test aid, not a remote.)
    async fn gather(&self, endpoint: &str, count: u32, limit_ms: u64) {
        let mut gate = {
            let mut inner = self.lock_inner();
            let (waiting, gate) = inner
                .gathered
                .entry(endpoint.to_owned())
                .or_insert_with(|| (0, watch::channel(0).0));
            *waiting += 1;
            if *waiting >= count {
                *waiting = 0;
                gate.send_modify(|turn| *turn += 1);
                return;
            }
            gate.subscribe()
        };
        let mut shutdown = self.shutdown.subscribe();
        let turn = *gate.borrow_and_update();
        tokio::select! {
            _ = gate.changed() => return,
            _ = shutdown.wait_for(|down| *down) => {}
            () = tokio::time::sleep(Duration::from_millis(limit_ms)) => {}
        }
        // Gone alone: no longer counted among those waiting for this turn.
        let mut inner = self.lock_inner();
        if let Some((waiting, gate)) = inner.gathered.get_mut(endpoint)
            && *gate.borrow() == turn
        {
            *waiting = waiting.saturating_sub(1);
        }
    }

    /// Sleeps `ms` milliseconds; returns false early if [`Self::shutdown`] is called.
    async fn sleep_unless_shutdown(&self, ms: u64) -> bool {
        let mut shutdown = self.shutdown.subscribe();
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(ms)) => true,
            _ = shutdown.wait_for(|down| *down) => false,
        }
    }

    fn lock_inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn read_knobs(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Knobs>> {
        self.knobs.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_knobs(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Knobs>> {
        self.knobs.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// `202 Accepted` for job `job` of `key` on `endpoint`.
fn accepted(endpoint: &str, key: &str, job: &str, retry_after: Option<u64>) -> Reply {
    let location = job_location(endpoint, job);
    Reply {
        status: StatusCode::ACCEPTED,
        body: json!({
            "ok": true,
            "status": "running",
            "endpoint": endpoint,
            "idempotency_key": key,
            "location": location,
        }),
        retry_after,
        replayed: false,
        location: Some(location),
    }
}

/// The JSON result of an applied call.
fn applied_response(endpoint: &str, key: &str, body: &Value) -> Value {
    let mut response = Map::new();
    response.insert("ok".into(), Value::Bool(true));
    response.insert("endpoint".into(), endpoint.into());
    response.insert("idempotency_key".into(), key.into());
    response.insert("effect_id".into(), uuid::Uuid::new_v4().to_string().into());
    for field in ["order_id", "step"] {
        if let Some(value) = body.get(field) {
            response.insert(field.into(), value.clone());
        }
    }
    Value::Object(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_long_operation_answers_accepted_until_done_then_applies_once() {
        let knobs = Knobs {
            long_ms: 10_000,
            retry_after: Some(1),
            ..Knobs::default()
        };
        let sim = RemoteSim::new(HashMap::from([("/report".to_owned(), knobs)])).expect("sim");
        let body = br#"{"order_id": "o", "step": "s"}"#;
        let started = sim.call("/report", Some("o:s"), Some(1), None, body).await;
        assert_eq!(started.status, StatusCode::ACCEPTED);
        assert_eq!(started.retry_after, Some(1));
        let location = started.location.clone().expect("a Location");
        assert!(location.starts_with("/report/jobs/"), "{location}");
        let job = location
            .rsplit_once("/jobs/")
            .map(|(_, j)| j.to_owned())
            .unwrap();
        // The remote remembers the key: a repeated call finds the same job.
        let again = sim.call("/report", Some("o:s"), Some(2), None, body).await;
        assert_eq!(again.location, Some(location.clone()));
        assert_eq!(sim.poll(&job).await.status, StatusCode::ACCEPTED);
        tokio::time::advance(Duration::from_secs(10)).await;
        let done = sim.poll(&job).await;
        assert_eq!(done.status, StatusCode::OK);
        assert_eq!(done.body["order_id"], "o");
        assert!(
            sim.poll(&job).await.replayed,
            "polled again: the same answer"
        );
        let after = sim.call("/report", Some("o:s"), Some(3), None, body).await;
        assert_eq!((after.status, after.replayed), (StatusCode::OK, true));
        let stats = sim.stats();
        let endpoint = &stats.endpoints["/report"];
        assert_eq!(
            (endpoint.accepted, endpoint.polls, endpoint.applied),
            (2, 3, 1)
        );
        assert_eq!(stats.keys["o:s"].applied, 1);
        assert_eq!(sim.poll("nope").await.status, StatusCode::NOT_FOUND);
    }

    #[tokio::test(start_paused = true)]
    async fn calls_held_together_go_on_once_that_many_wait_and_a_lone_one_after_hang_ms() {
        let knobs = Knobs {
            together: 3,
            hang_ms: 60_000,
            ..Knobs::default()
        };
        let sim = Arc::new(sim_with([("/pay", knobs)]));
        let call = |key: &'static str| {
            let sim = Arc::clone(&sim);
            tokio::spawn(async move { sim.call("/pay", Some(key), None, None, b"{}").await })
        };
        let (a, b) = (call("a"), call("b"));
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(!a.is_finished() && !b.is_finished(), "two of three wait");
        let waiting = || sim.lock_inner().gathered["/pay"].0;
        assert_eq!(waiting(), 2);
        let c = call("c");
        for held in [a, b, c] {
            assert_eq!(held.await.expect("call").status, StatusCode::OK);
        }
        // A lone call goes on after hang_ms, and is no longer counted: the
        // next three still wait for each other.
        let lone = call("d");
        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(lone.await.expect("call").status, StatusCode::OK);
        let (e, f) = (call("e"), call("f"));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!e.is_finished() && !f.is_finished(), "d left the count");
        assert_eq!(waiting(), 2);
        let g = call("g");
        for held in [e, f, g] {
            assert_eq!(held.await.expect("call").status, StatusCode::OK);
        }
        assert_eq!(sim.stats().endpoints["/pay"].applied, 7);
    }

    #[tokio::test]
    async fn with_fencing_on_a_call_older_than_the_newest_token_of_its_key_is_refused() {
        let knobs = Knobs {
            fencing: true,
            idempotent: false,
            ..Knobs::default()
        };
        let sim = RemoteSim::new(HashMap::from([("/pay".to_owned(), knobs)])).expect("sim");
        let call = |token| sim.call("/pay", Some("o:s"), token, None, b"{}");
        assert_eq!(call(Some(2)).await.status, StatusCode::OK);
        assert_eq!(call(Some(2)).await.status, StatusCode::OK, "a retry");
        assert_eq!(
            call(Some(3)).await.status,
            StatusCode::OK,
            "a newer dispatch"
        );
        let zombie = call(Some(2)).await;
        assert_eq!(zombie.status, StatusCode::CONFLICT, "an older one");
        assert_eq!(
            call(None).await.status,
            StatusCode::OK,
            "no token: not fenced"
        );
        assert_eq!(sim.stats().keys["o:s"].tokens, [2, 2, 3, 2]);
        assert_eq!(sim.stats().keys["o:s"].applied, 4);
    }

    #[tokio::test]
    async fn a_key_refused_by_permanent_rate_is_refused_again_and_never_applied() {
        let sim = sim_with([(
            "/pay",
            Knobs {
                permanent_rate: 1.0,
                ..Knobs::default()
            },
        )]);
        let first = sim.call("/pay", Some("o:s"), Some(1), None, b"{}").await;
        assert_eq!(first.status, StatusCode::UNPROCESSABLE_ENTITY);
        sim.set_knobs("/pay", Knobs::default()).expect("knobs");
        // A duplicate of the request, after the refusal: refused again.
        let again = sim.call("/pay", Some("o:s"), Some(1), None, b"{}").await;
        assert_eq!(again.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(sim.stats().keys["o:s"].applied, 0);
        let other = sim.call("/pay", Some("o:t"), Some(1), None, b"{}").await;
        assert_eq!(other.status, StatusCode::OK);
    }

    #[tokio::test]
    async fn without_fencing_tokens_are_recorded_and_nothing_is_refused() {
        let sim = RemoteSim::new(HashMap::new()).expect("sim");
        for token in [5, 1] {
            let reply = sim
                .call("/pay", Some("o:t"), Some(token), None, b"{}")
                .await;
            assert_eq!(reply.status, StatusCode::OK);
        }
        assert_eq!(sim.stats().keys["o:t"].tokens, [5, 1]);
    }

    fn sim_with<const N: usize>(knobs: [(&str, Knobs); N]) -> RemoteSim {
        let knobs = knobs.map(|(path, knobs)| (path.to_owned(), knobs));
        RemoteSim::new(HashMap::from(knobs)).expect("sim")
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_answer_comes_after_the_effect_is_applied() {
        let late = Knobs {
            late_answer_ms: 1_000,
            ..Knobs::default()
        };
        let sim = Arc::new(sim_with([("/pay", late)]));
        let body = br#"{"order_id": "o", "step": "s"}"#;
        let first = tokio::spawn({
            let sim = Arc::clone(&sim);
            async move { sim.call("/pay", Some("o:s"), Some(1), None, body).await }
        });
        // The call runs up to its late sleep before this wakes.
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(!first.is_finished(), "still answering late");
        let stats = sim.stats();
        assert_eq!(stats.keys["o:s"].applied, 1);
        assert!(stats.keys["o:s"].standing);
        assert_eq!(stats.standing_for("o"), 1);
        assert_eq!(stats.in_progress, 1);
        // A retry meanwhile finds the effect: the key is not held while late.
        let retry = sim.call("/pay", Some("o:s"), Some(1), None, body).await;
        assert_eq!((retry.status, retry.replayed), (StatusCode::OK, true));
        tokio::time::sleep(Duration::from_millis(600)).await;
        let first = first.await.expect("the late call");
        assert_eq!((first.status, first.replayed), (StatusCode::OK, false));
        assert_eq!(first.body["effect_id"], retry.body["effect_id"]);
        let stats = sim.stats();
        assert_eq!((stats.total_applied, stats.in_progress), (1, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_answer_cut_short_by_shutdown_leaves_the_effect_applied() {
        let late = Knobs {
            late_answer_ms: 60_000,
            ..Knobs::default()
        };
        let sim = Arc::new(sim_with([("/pay", late)]));
        let call = tokio::spawn({
            let sim = Arc::clone(&sim);
            async move { sim.call("/pay", Some("o:s"), None, None, b"{}").await }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        sim.shutdown();
        let reply = call.await.expect("the late call");
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
        let stats = sim.stats();
        assert_eq!(stats.keys["o:s"].applied, 1);
        assert_eq!(stats.endpoints["/pay"].transient, 0, "counted as applied");
        assert_eq!(stats.standing["o"], ["o:s"]);
    }

    #[tokio::test]
    async fn an_applied_undo_clears_its_forward_effect() {
        let sim = sim_with([]);
        let forward = sim.call("/charge", Some("o:s"), Some(1), None, b"{}").await;
        assert_eq!(forward.status, StatusCode::OK);
        sim.call("/reserve", Some("o:t"), Some(1), None, b"{}")
            .await;
        assert_eq!(sim.stats().standing["o"], ["o:s", "o:t"]);
        let undo = sim.call(
            "/refund",
            Some("o:s:compensate"),
            Some(2),
            Some("completed"),
            b"{}",
        );
        assert_eq!(undo.await.status, StatusCode::OK);
        // A replayed undo is not a new apply, and changes nothing.
        let again = sim.call(
            "/refund",
            Some("o:s:compensate"),
            Some(2),
            Some("completed"),
            b"{}",
        );
        assert!(again.await.replayed);
        let stats = sim.stats();
        let key = &stats.keys["o:s"];
        assert!(!key.standing && key.undone);
        assert_eq!(key.tokens, [1], "the undo's token is not the key's");
        let undo = &stats.keys["o:s:compensate"];
        assert!(!undo.standing && !undo.undone);
        assert_eq!(undo.outcomes, ["completed", "completed"]);
        assert_eq!(stats.standing["o"], ["o:t"]);
        sim.call(
            "/release",
            Some("o:t:compensate"),
            None,
            Some("unknown"),
            b"{}",
        )
        .await;
        let stats = sim.stats();
        assert!(stats.standing.is_empty());
        assert_eq!(stats.standing_for("o"), 0);
        assert_eq!(stats.keys["o:t:compensate"].outcomes, ["unknown"]);
        assert!(stats.keys["o:t"].outcomes.is_empty());
    }

    #[tokio::test]
    async fn an_undo_of_a_key_never_applied_succeeds_and_leaves_nothing_standing() {
        let sim = sim_with([(
            "/charge",
            Knobs {
                permanent: true,
                ..Knobs::default()
            },
        )]);
        let failed = sim.call("/charge", Some("o:s"), None, None, b"{}").await;
        assert_eq!(failed.status, StatusCode::UNPROCESSABLE_ENTITY);
        let undo = sim.call(
            "/refund",
            Some("o:s:compensate"),
            None,
            Some("unknown"),
            b"{}",
        );
        assert_eq!(undo.await.status, StatusCode::OK);
        // Never called at all: the undo answers the same.
        let undo = sim.call(
            "/refund",
            Some("o:u:compensate"),
            None,
            Some("unknown"),
            b"{}",
        );
        assert_eq!(undo.await.status, StatusCode::OK);
        let stats = sim.stats();
        assert!(stats.standing.is_empty());
        assert!(stats.keys["o:s"].undone && !stats.keys["o:s"].standing);
        assert_eq!(stats.keys["o:s"].applied, 0);
        let never = &stats.keys["o:u"];
        assert_eq!((never.calls, never.endpoint.as_str()), (0, ""));
        assert!(never.undone && !never.standing);
        // Its first call still takes the key on its own endpoint.
        let late = sim.call("/ship", Some("o:u"), None, None, b"{}").await;
        assert_eq!(late.status, StatusCode::OK);
        assert_eq!(sim.stats().keys["o:u"].endpoint, "/ship");
    }

    #[tokio::test]
    async fn without_fencing_a_forward_call_after_its_undo_stands_again() {
        let sim = sim_with([]);
        let undo = sim.call(
            "/refund",
            Some("o:s:compensate"),
            Some(3),
            Some("unknown"),
            b"{}",
        );
        assert_eq!(undo.await.status, StatusCode::OK);
        // The forward call was in flight all along, and lands after the undo.
        let zombie = sim.call("/charge", Some("o:s"), Some(2), None, b"{}").await;
        assert_eq!(zombie.status, StatusCode::OK);
        let stats = sim.stats();
        assert!(stats.keys["o:s"].standing && stats.keys["o:s"].undone);
        assert_eq!(stats.standing["o"], ["o:s"]);
        assert_eq!(stats.standing_for("o"), 1);
    }

    #[tokio::test]
    async fn with_fencing_a_forward_call_older_than_its_undo_is_refused() {
        let fencing = Knobs {
            fencing: true,
            ..Knobs::default()
        };
        let sim = sim_with([("/charge", fencing)]);
        let undo = sim.call(
            "/refund",
            Some("o:s:compensate"),
            Some(5),
            Some("unknown"),
            b"{}",
        );
        assert_eq!(undo.await.status, StatusCode::OK);
        let zombie = sim.call("/charge", Some("o:s"), Some(4), None, b"{}").await;
        assert_eq!(zombie.status, StatusCode::CONFLICT);
        let error = zombie.body["error"].as_str().unwrap_or_default();
        assert!(error.contains("older than the undo"), "{error}");
        let stats = sim.stats();
        assert!(stats.standing.is_empty());
        let key = &stats.keys["o:s"];
        assert_eq!((key.applied, key.tokens.as_slice()), (0, &[4][..]));
        assert!(!key.standing && key.undone);
        // No token: not fenced, as for any call.
        let untokened = sim.call("/charge", Some("o:s"), None, None, b"{}").await;
        assert_eq!(untokened.status, StatusCode::OK);
        assert_eq!(sim.stats().standing_for("o"), 1);
    }

    #[tokio::test]
    async fn an_undo_fences_its_forward_key_even_before_it_is_applied() {
        let sim = sim_with([
            (
                "/charge",
                Knobs {
                    fencing: true,
                    ..Knobs::default()
                },
            ),
            (
                "/refund",
                Knobs {
                    fail_first: 1,
                    ..Knobs::default()
                },
            ),
        ]);
        let undo = sim.call(
            "/refund",
            Some("o:s:compensate"),
            Some(7),
            Some("unknown"),
            b"{}",
        );
        assert_eq!(undo.await.status, StatusCode::SERVICE_UNAVAILABLE);
        let zombie = sim.call("/charge", Some("o:s"), Some(6), None, b"{}").await;
        assert_eq!(zombie.status, StatusCode::CONFLICT);
        let newer = sim.call("/charge", Some("o:s"), Some(7), None, b"{}").await;
        assert_eq!(newer.status, StatusCode::OK, "as new as the undo");
        let stats = sim.stats();
        assert!(stats.keys["o:s"].standing && !stats.keys["o:s"].undone);
    }

    #[tokio::test]
    async fn redrive_keys_pair_with_their_own_undo() {
        let fencing = Knobs {
            fencing: true,
            ..Knobs::default()
        };
        let sim = sim_with([("/charge", fencing)]);
        for key in ["o:s", "o:s:r1", "o:s:r2"] {
            let reply = sim.call("/charge", Some(key), Some(1), None, b"{}").await;
            assert_eq!(reply.status, StatusCode::OK, "{key}");
        }
        let undo = sim.call(
            "/refund",
            Some("o:s:compensate:r1"),
            Some(9),
            Some("unknown"),
            b"{}",
        );
        assert_eq!(undo.await.status, StatusCode::OK);
        let stats = sim.stats();
        assert_eq!(stats.standing["o"], ["o:s", "o:s:r2"]);
        assert!(stats.keys["o:s:r1"].undone && !stats.keys["o:s:r1"].standing);
        assert!(!stats.keys["o:s"].undone && !stats.keys["o:s:r2"].undone);
        // The undo's token fences its own forward key only.
        let older = sim
            .call("/charge", Some("o:s:r2"), Some(2), None, b"{}")
            .await;
        assert_eq!(older.status, StatusCode::OK);
        let zombie = sim
            .call("/charge", Some("o:s:r1"), Some(2), None, b"{}")
            .await;
        assert_eq!(zombie.status, StatusCode::CONFLICT);
    }
}

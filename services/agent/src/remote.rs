//! One step's call to its remote service (contract §4): `POST <url>` with the
//! step body, `Idempotency-Key` and `X-Complete-By`; transient failures
//! (408, 429, 5xx, connection errors, timeouts) retried with exponential
//! backoff and full jitter, honouring `Retry-After`, until complete-by.
//! A long-running operation (§4b) answers `202 Accepted` with a `Location`:
//! it is polled with `GET` and the same key, each `202` a heartbeat that
//! moves complete-by forward, until it answers for good.
//!
//! A remote is trusted with its own origin only (contract §1b): the agent
//! follows no redirect unless `follow_redirects = "same-origin"`, and then
//! only within the origin (scheme, host, port) of its URL; it polls a
//! `Location` only on that origin; polls are at least `min_poll` apart and
//! heartbeats at most one per quarter of the step's timeout, whatever the
//! remote answers; a `Location` is quoted at most [`MAX_LOCATION_BYTES`] long.

use std::time::Duration;

use chrono::{DateTime, Utc};
use reqwest::header::{HeaderMap, LOCATION, RETRY_AFTER};
use reqwest::{StatusCode, Url};
use sas::config::{AgentSettings, AgentSpec, FollowRedirects, RetrySpec};
use sas::messages::{
    FENCING_TOKEN_HEADER, OUTCOME_HEADER, Quoted, StepOutcome, StepRequest, rfc3339,
};
use sas::trace::TraceContext;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::breaker::Breaker;
use crate::deadline::Deadline;
use crate::shared::Shared;

/// How a call ended.
#[derive(Debug)]
pub enum CallEnd {
    /// Success or a permanent failure: answer the scheduler.
    Answer(StepOutcome),
    /// Complete-by passed: stop and send nothing; the supervisor takes over.
    Expired,
    /// Shutdown or this instance's open circuit interrupted the call: hand
    /// the request back (another instance may reach the remote).
    Interrupted,
    /// The shared breaker is open: answer `held`, the order waits for it.
    /// `tried`: the remote was called (its transient failures opened the
    /// breaker), so it may have applied the step (contract §4c).
    Held { tried: bool },
}

/// One attempt's verdict.
enum Attempt {
    Done(StepOutcome),
    Transient {
        error: String,
        retry_after: Option<Duration>,
    },
    /// `202 Accepted`: the operation goes on; poll `location`.
    Accepted {
        location: Option<String>,
        retry_after: Option<Duration>,
    },
}

/// Where a call tells of each heartbeat: the step's new complete-by and the
/// URL it polls.
pub type Heartbeats = tokio::sync::mpsc::UnboundedSender<(DateTime<Utc>, String)>;

/// How long to wait between polls when the remote's `202` names no
/// `Retry-After` (and `min_poll` is shorter).
const DEFAULT_POLL_WAIT: Duration = Duration::from_secs(1);

/// The longest a `Location` is quoted in heartbeats, events and logs
/// (contract §1b): a remote's header must not fill the event log.
pub const MAX_LOCATION_BYTES: usize = 512;

/// Redirects followed in a row, at most, with `follow_redirects =
/// "same-origin"` (reqwest's own default bound).
const MAX_REDIRECTS: usize = 10;

/// How a call is retried within one dispatch: the step's `retry` over the
/// agent's defaults (contract §4b).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retry {
    /// Calls at most (the first included); `None`: until complete-by.
    pub max_attempts: Option<u32>,
    /// First wait; doubles per retry, with full jitter.
    pub initial: Duration,
    /// Longest wait.
    pub max: Duration,
}

impl Retry {
    /// The step's `retry` (if any) over the agent's settings.
    pub fn of(step: Option<RetrySpec>, agent: &AgentSettings) -> Self {
        let step = step.unwrap_or_default();
        Self {
            max_attempts: step.max_attempts,
            initial: step.backoff.unwrap_or(agent.backoff_initial),
            max: step.backoff_max.unwrap_or(agent.backoff_max),
        }
    }
}

/// One remote endpoint as an agent calls it.
pub struct Endpoint<'a> {
    pub client: &'a reqwest::Client,
    pub spec: &'a AgentSpec,
    /// Cancelled when in-flight calls must stop (the end of the shutdown grace).
    pub stop: &'a CancellationToken,
    /// This instance's breaker.
    pub breaker: &'a Breaker,
    /// The breaker the agent's instances share.
    pub shared: &'a Shared,
}

/// Calls the remote service for `request` until it answers for good,
/// complete-by passes, the endpoint's `stop` is cancelled or a breaker
/// opens. `on_attempt` sees each attempt's outcome label (`succeeded`,
/// `permanent`, `transient`, `accepted`); `heartbeats` each heartbeat of a
/// long-running operation: the step's new complete-by and where it is polled.
pub async fn call(
    endpoint: &Endpoint<'_>,
    request: &StepRequest,
    deadline: Deadline,
    retry: Retry,
    trace: Option<&TraceContext>,
    on_attempt: impl Fn(&'static str),
    heartbeats: Heartbeats,
) -> CallEnd {
    let Endpoint {
        client,
        spec,
        stop,
        breaker,
        shared,
    } = *endpoint;
    let body = request.remote_body();
    let key = request.idempotency_key();
    // The origin the remote is trusted with (§1b). The configuration
    // checked its scheme only: a URL that does not parse cannot be called.
    let base = match Url::parse(&spec.url) {
        Ok(url) => url,
        Err(e) => {
            return CallEnd::Answer(StepOutcome::Failed {
                error: format!("the agent's url is no URL: {e}"),
            });
        }
    };
    // When the last heartbeat was told: they are rate-bounded (§1b).
    let mut last_beat: Option<Instant> = None;
    // Moved forward by each heartbeat of a long-running operation.
    let mut deadline = deadline;
    // Where a long-running operation is polled, once it answered 202.
    let mut poll: Option<reqwest::Url> = None;
    // Transient failures in a row (a 202 starts the count again).
    let mut tried = 0u32;
    'calls: loop {
        let Some(left) = deadline.remaining() else {
            return CallEnd::Expired;
        };
        // Another instance may still reach the endpoint: let it have the request.
        if breaker.is_open() {
            return CallEnd::Interrupted;
        }
        // The fault suite freezes an agent here to make a zombie of it.
        sas::crash::pause("agent.before_call");
        let timeout = spec.timeout.map_or(left, |t| t.min(left));
        let mut http = match &poll {
            Some(url) => client.get(url.clone()),
            None => client.post(base.clone()).json(&body),
        };
        // The remote call is a span of its own in the order's trace.
        let call_span = if sas::telemetry::exporting() {
            tracing::info_span!("remote_call", tried, polling = poll.is_some())
        } else {
            tracing::Span::none()
        };
        if let Some(t) = trace {
            let hop = sas::telemetry::hop(&call_span, Some(&t.trace_id));
            http = http.header(sas::trace::HEADER, hop.to_string());
        }
        if let Some(outcome) = request.outcome() {
            http = http.header(OUTCOME_HEADER, outcome);
        }
        let send = http
            .header("Idempotency-Key", &key)
            .header("X-Complete-By", rfc3339::format(&deadline.wall()))
            .header(FENCING_TOKEN_HEADER, request.fencing_token)
            .timeout(timeout)
            .send();
        let attempt = tokio::select! {
            () = stop.cancelled() => return CallEnd::Interrupted,
            sent = send.instrument(call_span) => judge(sent, spec).await,
        };
        let (error, retry_after) = match attempt {
            Attempt::Done(outcome) => {
                shared.succeeded().await;
                on_attempt(match outcome {
                    StepOutcome::Failed { .. } => "permanent",
                    _ => "succeeded",
                });
                return CallEnd::Answer(outcome);
            }
            Attempt::Accepted {
                location,
                retry_after,
            } => 'accepted: {
                let url = match resolve(&base, location.as_deref()) {
                    Ok(url) => url,
                    Err(NoPoll::Unreadable(error)) => {
                        on_attempt("transient");
                        // Asked again no sooner than it would be polled.
                        let wait = poll_wait(retry_after, spec.min_poll, Duration::MAX);
                        break 'accepted (error, Some(wait));
                    }
                    Err(NoPoll::Foreign(error)) => {
                        shared.succeeded().await;
                        on_attempt("permanent");
                        return CallEnd::Answer(StepOutcome::Failed { error });
                    }
                };
                shared.succeeded().await;
                on_attempt("accepted");
                tried = 0;
                let location = quote_location(url.as_str());
                let now = Instant::now();
                if let Some(moved) = heartbeat(request, deadline, last_beat, now) {
                    deadline = moved;
                    last_beat = Some(now);
                    // The receiver goes only with the call: nothing to do if it went.
                    let _ = heartbeats.send((deadline.wall(), location.clone()));
                }
                tracing::debug!(%location, complete_by = %deadline.wall(), "accepted; polling");
                poll = Some(url);
                let Some(left) = deadline.remaining() else {
                    return CallEnd::Expired;
                };
                let wait = poll_wait(retry_after, spec.min_poll, left);
                tokio::select! {
                    () = stop.cancelled() => return CallEnd::Interrupted,
                    () = tokio::time::sleep(wait) => {}
                }
                continue 'calls;
            }
            Attempt::Transient { error, retry_after } => {
                on_attempt("transient");
                if shared.failed().await {
                    tracing::info!(%error, "transient failure and the shared breaker is open");
                    return CallEnd::Held { tried: true };
                }
                (error, retry_after)
            }
        };
        if retry.max_attempts.is_some_and(|n| tried + 1 >= n) {
            tracing::info!(%error, attempts = tried + 1, "transient failure and no attempt left; staying silent");
            return CallEnd::Expired;
        }
        let mut wait = retry_after.unwrap_or_else(|| backoff(retry, tried));
        if poll.is_some() {
            // A retried poll is a poll: `min_poll` apart too.
            wait = wait.max(spec.min_poll);
        }
        let Some(left) = deadline.remaining() else {
            return CallEnd::Expired;
        };
        // A wait that ends past complete-by would only lead to silence.
        if wait >= left {
            tracing::info!(%error, ?wait, "transient failure and no time left to retry");
            return CallEnd::Expired;
        }
        tracing::info!(%error, ?wait, retry = tried + 1, "transient failure; retrying");
        tokio::select! {
            () = stop.cancelled() => return CallEnd::Interrupted,
            () = tokio::time::sleep(wait) => {}
        }
        tried += 1;
    }
}

/// The deadline a `202` at `now` gives the step: its timeout from now,
/// never past its first dispatch plus its `max_duration`; `None` when no
/// heartbeat is due since the one told at `last`, when that is no later
/// than `deadline`, or when the request (from an older scheduler) says
/// neither. The deadline moves only with a heartbeat told, so that the
/// agent, `X-Complete-By` and the state store agree on it.
fn heartbeat(
    request: &StepRequest,
    deadline: Deadline,
    last: Option<Instant>,
    now: Instant,
) -> Option<Deadline> {
    let timeout = Duration::from_millis(u64::try_from(request.timeout_ms?).ok()?);
    if !heartbeat_due(last, now, timeout) {
        return None;
    }
    deadline.extended(timeout, request.max_complete_by?)
}

/// Whether a `202` at `now` may be told as a heartbeat (contract §1b): the
/// first is; later ones once a quarter of the step's `timeout` has passed
/// since the last told. The deadline told last is then still at least
/// three quarters of the timeout away, so no step expires for want of one.
fn heartbeat_due(last: Option<Instant>, now: Instant, timeout: Duration) -> bool {
    last.is_none_or(|at| now.saturating_duration_since(at) >= timeout / 4)
}

/// How long to wait before the next poll (contract §1b): the remote's
/// `Retry-After` (or [`DEFAULT_POLL_WAIT`]), never less than `min_poll`,
/// never past the `left` before complete-by.
fn poll_wait(retry_after: Option<Duration>, min_poll: Duration, left: Duration) -> Duration {
    retry_after
        .unwrap_or(DEFAULT_POLL_WAIT)
        .max(min_poll)
        .min(left)
}

/// Why a `202`'s `Location` is not polled.
#[derive(Debug, PartialEq, Eq)]
enum NoPoll {
    /// None, or not a URL: the remote may answer better on the next call.
    Unreadable(String),
    /// Not on the agent's origin: never polled, the step fails for good (§1b).
    Foreign(String),
}

/// A `Location` (absolute, or relative to the step's URL `base`) as a URL
/// to poll, or why there is none: a remote's header is input, and only a
/// URL on the origin of `base` is polled.
fn resolve(base: &Url, location: Option<&str>) -> Result<Url, NoPoll> {
    let Some(location) = location else {
        return Err(NoPoll::Unreadable(
            "202 Accepted without a Location to poll".into(),
        ));
    };
    let quoted = Quoted::new(location);
    let url = base.join(location).map_err(|e| {
        NoPoll::Unreadable(format!(
            "202 Accepted with a Location that is no URL ({quoted}): {e}"
        ))
    })?;
    if !same_origin(&url, base) {
        return Err(NoPoll::Foreign(format!(
            "202 Accepted with a Location on another origin than the agent's ({}): {quoted}",
            base.origin().ascii_serialization()
        )));
    }
    Ok(url)
}

/// Whether `a` and `b` have one origin: scheme, host and port, a default
/// port written or not (`http://h` is `http://h:80`). Only http(s) URLs
/// have one; any other scheme is no origin of a remote's.
fn same_origin(a: &Url, b: &Url) -> bool {
    matches!(a.scheme(), "http" | "https") && a.origin() == b.origin()
}

/// The client's redirect policy for `follow` (contract §1b). A redirect
/// not followed comes back as the `3xx` answer, which fails the step.
pub fn redirect_policy(follow: FollowRedirects) -> reqwest::redirect::Policy {
    match follow {
        FollowRedirects::None => reqwest::redirect::Policy::none(),
        FollowRedirects::SameOrigin => reqwest::redirect::Policy::custom(|attempt| {
            match hop(attempt.url(), attempt.previous()) {
                Hop::Follow => attempt.follow(),
                Hop::Stop => attempt.stop(),
                Hop::TooMany => attempt.error(format!("more than {MAX_REDIRECTS} redirects")),
            }
        }),
    }
}

/// What the same-origin policy does with one redirect.
#[derive(Debug, PartialEq, Eq)]
enum Hop {
    Follow,
    /// To another origin: not followed.
    Stop,
    /// A loop, or a chain too long to be one.
    TooMany,
}

/// The same-origin policy for a redirect to `next` after the URLs
/// `previous` (the first being the one first called): followed while it
/// stays on the first URL's origin.
fn hop(next: &Url, previous: &[Url]) -> Hop {
    let Some(first) = previous.first() else {
        return Hop::Stop;
    };
    if !same_origin(next, first) {
        Hop::Stop
    } else if previous.len() > MAX_REDIRECTS {
        Hop::TooMany
    } else {
        Hop::Follow
    }
}

/// Why a `3xx` answer the client did not follow fails the step (§1b).
/// `from` is the URL that answered.
fn redirect_refused(
    status: StatusCode,
    from: &Url,
    location: Option<&str>,
    follow: FollowRedirects,
) -> String {
    let code = status.as_u16();
    let Some(location) = location else {
        return format!("HTTP {code}: a redirect without a Location, not followed");
    };
    let quoted = Quoted::new(location);
    match follow {
        FollowRedirects::None => format!(
            "HTTP {code}: a redirect to {quoted}, not followed (follow_redirects = \"none\")"
        ),
        FollowRedirects::SameOrigin => match from.join(location) {
            Ok(to) if same_origin(&to, from) => {
                format!("HTTP {code}: a redirect to {quoted}, not followed")
            }
            _ => format!(
                "HTTP {code}: a redirect to another origin than the agent's ({}), \
                 not followed: {quoted}",
                from.origin().ascii_serialization()
            ),
        },
    }
}

/// `location` as quoted in heartbeats, events and logs: at most
/// [`MAX_LOCATION_BYTES`] long, a cut one ending in `...`.
fn quote_location(location: &str) -> String {
    if location.len() <= MAX_LOCATION_BYTES {
        return location.to_owned();
    }
    let kept = sas::messages::truncate_bytes(location, MAX_LOCATION_BYTES - 3);
    format!("{kept}...")
}

/// Exponential backoff with full jitter: uniform in [0, min(max, initial·2^retry)].
fn backoff(policy: Retry, retry: u32) -> Duration {
    let ceiling = policy
        .initial
        .saturating_mul(2u32.saturating_pow(retry.min(20)))
        .min(policy.max);
    ceiling.mul_f64(fastrand::f64())
}

async fn judge(sent: Result<reqwest::Response, reqwest::Error>, spec: &AgentSpec) -> Attempt {
    let max_bytes = spec.max_response_bytes;
    let response = match sent {
        Ok(r) => r,
        // The same-origin policy refused a redirect chain: no call will end it.
        Err(e) if e.is_redirect() => {
            return Attempt::Done(StepOutcome::Failed {
                error: format!("redirects not followed: {}", causes(e)),
            });
        }
        Err(e) => {
            return Attempt::Transient {
                error: format!("request failed: {}", causes(e)),
                retry_after: None,
            };
        }
    };
    let status = response.status();
    let retry_after = retry_after(response.headers());
    let location = response
        .headers()
        .get(LOCATION)
        .and_then(|l| l.to_str().ok());
    if status == StatusCode::ACCEPTED {
        return Attempt::Accepted {
            location: location.map(str::to_owned),
            retry_after,
        };
    }
    if status.is_redirection() {
        let error = redirect_refused(status, response.url(), location, spec.follow_redirects);
        return Attempt::Done(StepOutcome::Failed { error });
    }
    if !status.is_success() {
        // An error's text is only quoted: read no more than that.
        let text = match read_up_to(response, ERROR_QUOTE_BYTES).await {
            Ok(Body::Whole(b) | Body::TooLong(b)) => {
                String::from_utf8_lossy(&b[..b.len().min(ERROR_QUOTE_BYTES)]).into_owned()
            }
            Err(_) => String::new(),
        };
        let error = format!("HTTP {}: {}", status.as_u16(), text.trim());
        return if is_transient(status) {
            Attempt::Transient { error, retry_after }
        } else {
            Attempt::Done(StepOutcome::Failed { error })
        };
    }
    let announced = response.content_length();
    if announced.is_some_and(|n| usize::try_from(n).map_or(true, |n| n > max_bytes)) {
        return too_long(max_bytes);
    }
    match read_up_to(response, max_bytes).await {
        Ok(Body::Whole(b)) => {
            let result = serde_json::from_slice(&b).unwrap_or(serde_json::Value::Null);
            // What the scheduler could not store, or a later step not read.
            match sas::messages::json_limit_broken(&result) {
                Some(limit) => Attempt::Done(StepOutcome::Failed {
                    error: format!("the answer must be {limit}"),
                }),
                None => Attempt::Done(StepOutcome::Succeeded { result }),
            }
        }
        Ok(Body::TooLong(_)) => too_long(max_bytes),
        Err(e) => Attempt::Transient {
            error: format!("reading the answer failed: {}", causes(e)),
            retry_after: None,
        },
    }
}

/// A 2xx answer over the limit: no retry will make it shorter.
fn too_long(max_bytes: usize) -> Attempt {
    Attempt::Done(StepOutcome::Failed {
        error: format!("the answer is larger than max_response_bytes ({max_bytes} bytes)"),
    })
}

/// Bytes of an error answer quoted in the step's error.
const ERROR_QUOTE_BYTES: usize = 512;

/// An answer's body as far as it was read.
enum Body {
    /// All of it, within the limit.
    Whole(Vec<u8>),
    /// The first bytes of one longer than the limit (the rest unread).
    TooLong(Vec<u8>),
}

/// Reads at most `max` bytes of the body, never holding more than that
/// (plus one chunk): a remote cannot make the agent buffer an answer of
/// any size.
async fn read_up_to(mut response: reqwest::Response, max: usize) -> Result<Body, reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        body.extend_from_slice(&chunk);
        if body.len() > max {
            return Ok(Body::TooLong(body));
        }
    }
    Ok(Body::Whole(body))
}

/// A failed request's message with its causes (reqwest's own message says
/// only "error sending request"; the cause says which: refused, timed out,
/// an unknown certificate issuer), and its URL without a password.
fn causes(e: reqwest::Error) -> String {
    // The URL may be a remote's `Location`: quoted as one.
    let url = e
        .url()
        .map(|u| quote_location(&sas::tls::redact_url(u.as_str())));
    let e = e.without_url();
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    match url {
        Some(url) => format!("{text} ({url})"),
        None => text,
    }
}

/// 408, 429 and 5xx are worth retrying; any other non-2xx answer is final.
fn is_transient(status: StatusCode) -> bool {
    status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status.is_server_error()
}

/// `Retry-After` as seconds or an HTTP date.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(text: &str) -> Url {
        Url::parse(text).unwrap()
    }

    #[test]
    fn a_location_is_polled_relative_to_the_step_or_absolute_on_its_origin_only() {
        let base = url("http://remote:8081/svc/a");
        let at = |l| resolve(&base, l).map(|u| u.to_string());
        assert_eq!(
            at(Some("/svc/a/jobs/1")).as_deref(),
            Ok("http://remote:8081/svc/a/jobs/1")
        );
        assert_eq!(
            at(Some("jobs/1")).as_deref(),
            Ok("http://remote:8081/svc/jobs/1")
        );
        assert_eq!(
            at(Some("http://REMOTE:8081/j/1")).as_deref(),
            Ok("http://remote:8081/j/1")
        );
        // A scheme-relative Location names a host: it is checked as one.
        assert!(at(Some("//remote:8081/j")).is_ok());
        let unreadable = |r: Result<String, NoPoll>, says: &str| {
            assert!(
                matches!(&r, Err(NoPoll::Unreadable(e)) if e.contains(says)),
                "{r:?}"
            );
        };
        unreadable(at(None), "without a Location");
        unreadable(at(Some("http://[bad")), "no URL");
        for foreign in [
            "https://status.example/j/1",
            "http://169.254.169.254/latest/meta-data/",
            "http://remote:8082/svc/a/jobs/1",
            "https://remote:8081/svc/a/jobs/1",
            "http://remote/svc/a/jobs/1",
            "//other:8081/j",
            "file:///etc/passwd",
            "data:text/plain,hi",
        ] {
            let r = at(Some(foreign));
            assert!(
                matches!(&r, Err(NoPoll::Foreign(e)) if e.contains("another origin") && e.contains("http://remote:8081")),
                "{foreign}: {r:?}"
            );
        }
    }

    #[test]
    fn an_origin_is_scheme_host_and_port_with_the_default_port_written_or_not() {
        let same = |a: &str, b: &str| same_origin(&url(a), &url(b));
        assert!(same("http://h/a", "http://h:80/b"));
        assert!(same("https://h:443/a", "https://h/b?q"));
        assert!(same("http://u:p@h:8080/a", "http://h:8080/"));
        assert!(same("http://H/", "http://h/"));
        assert!(!same("http://h/", "https://h/"));
        assert!(!same("http://h:80/", "http://h:8080/"));
        assert!(!same("https://h/", "https://h:80/"));
        assert!(!same("http://h/", "http://h.evil/"));
        assert!(!same("http://127.0.0.1/", "http://localhost/"));
        assert!(!same("file:///a", "file:///a"));
    }

    #[test]
    fn the_same_origin_policy_follows_within_the_first_urls_origin_and_not_for_ever() {
        let first = url("http://remote:8081/svc/a");
        let once = std::slice::from_ref(&first);
        assert_eq!(hop(&url("http://remote:8081/v2/a"), once), Hop::Follow);
        assert_eq!(hop(&url("http://remote:80/v2/a"), once), Hop::Stop);
        assert_eq!(hop(&url("http://169.254.169.254/"), once), Hop::Stop);
        // The first URL is the judge, not the last hop's.
        let elsewhere = url("http://other/");
        assert_eq!(
            hop(&url("http://other/x"), &[first.clone(), elsewhere]),
            Hop::Stop
        );
        let chain = vec![first.clone(); MAX_REDIRECTS];
        assert_eq!(hop(&first, &chain), Hop::Follow);
        let chain = vec![first.clone(); MAX_REDIRECTS + 1];
        assert_eq!(hop(&first, &chain), Hop::TooMany);
    }

    #[test]
    fn a_redirect_not_followed_says_why() {
        let from = url("http://remote:8081/svc/a");
        let found = StatusCode::FOUND;
        let none = redirect_refused(found, &from, Some("/elsewhere"), FollowRedirects::None);
        assert!(
            none.contains("HTTP 302") && none.contains("follow_redirects = \"none\""),
            "{none}"
        );
        let away = redirect_refused(
            StatusCode::TEMPORARY_REDIRECT,
            &from,
            Some("http://169.254.169.254/latest"),
            FollowRedirects::SameOrigin,
        );
        assert!(
            away.contains("another origin") && away.contains("http://remote:8081"),
            "{away}"
        );
        let home = redirect_refused(
            StatusCode::NOT_MODIFIED,
            &from,
            Some("/svc/b"),
            FollowRedirects::SameOrigin,
        );
        assert!(
            home.contains("HTTP 304") && !home.contains("another origin"),
            "{home}"
        );
        let nowhere = redirect_refused(found, &from, None, FollowRedirects::SameOrigin);
        assert!(nowhere.contains("without a Location"), "{nowhere}");
        // A remote's header is quoted, bounded.
        let long = format!("/{}", "x".repeat(8000));
        let quoted = redirect_refused(found, &from, Some(&long), FollowRedirects::None);
        assert!(quoted.len() < 300, "{}", quoted.len());
    }

    #[test]
    fn polls_are_min_poll_apart_whatever_retry_after_says_and_never_past_complete_by() {
        let (ms, s) = (Duration::from_millis, Duration::from_secs);
        let left = s(60);
        assert_eq!(poll_wait(Some(Duration::ZERO), ms(300), left), ms(300));
        assert_eq!(poll_wait(Some(ms(100)), s(1), left), s(1));
        assert_eq!(poll_wait(Some(s(5)), s(1), left), s(5));
        assert_eq!(poll_wait(None, ms(300), left), DEFAULT_POLL_WAIT);
        assert_eq!(poll_wait(None, s(3), left), s(3));
        // Complete-by bounds every wait, the floor included.
        assert_eq!(poll_wait(Some(Duration::ZERO), s(1), ms(200)), ms(200));
        assert_eq!(poll_wait(Some(s(30)), s(1), ms(200)), ms(200));
    }

    #[test]
    fn a_heartbeat_is_told_at_most_once_a_quarter_of_the_timeout() {
        let timeout = Duration::from_secs(2);
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        assert!(heartbeat_due(None, t0, timeout));
        assert!(!heartbeat_due(Some(t0), t0, timeout));
        assert!(!heartbeat_due(Some(t0), at(499), timeout));
        assert!(heartbeat_due(Some(t0), at(500), timeout));
        assert!(heartbeat_due(Some(t0), at(1700), timeout));
        // A clock that went back (it cannot, monotonic) tells nothing.
        assert!(!heartbeat_due(Some(at(10)), t0, timeout));
        // 202s as fast as a remote can answer them, for ten seconds: one
        // heartbeat, then one each 500 ms.
        let mut last = None;
        let mut told = 0;
        for ms in 0..10_000 {
            if heartbeat_due(last, at(ms), timeout) {
                last = Some(at(ms));
                told += 1;
            }
        }
        assert_eq!(told, 20);
    }

    #[tokio::test(start_paused = true)]
    async fn a_202_moves_the_deadline_only_with_a_heartbeat_told() {
        let complete_by = chrono::Utc::now() + chrono::Duration::seconds(2);
        let request = StepRequest {
            order_id: uuid::Uuid::new_v4(),
            workflow: "w".into(),
            step: "a".into(),
            step_index: 0,
            direction: sas::messages::Direction::Forward,
            attempt: 1,
            dispatch_id: uuid::Uuid::new_v4(),
            locked_by: "s1".into(),
            complete_by,
            payload: serde_json::Value::Null,
            results: serde_json::Map::new(),
            fencing_token: 1,
            timeout_ms: Some(2000),
            max_complete_by: Some(complete_by + chrono::Duration::hours(1)),
            time_left_ms: Some(2000),
            redrive: 0,
            in_doubt: false,
            retry: None,
            item: None,
            index: None,
        };
        let d = Deadline::of(&request, Instant::now(), false, None);
        tokio::time::advance(Duration::from_millis(100)).await;
        let now = Instant::now();
        let first = heartbeat(&request, d, None, now).expect("the first 202 is told");
        assert_eq!(first.remaining(), Some(Duration::from_secs(2)));
        tokio::time::advance(Duration::from_millis(300)).await;
        assert_eq!(heartbeat(&request, first, Some(now), Instant::now()), None);
        tokio::time::advance(Duration::from_millis(200)).await;
        let second = heartbeat(&request, first, Some(now), Instant::now()).expect("due");
        assert_eq!(second.remaining(), Some(Duration::from_secs(2)));
    }

    #[test]
    fn a_location_is_quoted_at_most_512_bytes_long() {
        assert_eq!(quote_location("http://r/j/1"), "http://r/j/1");
        let exact = format!("http://r/{}", "j".repeat(MAX_LOCATION_BYTES - 9));
        assert_eq!(quote_location(&exact), exact);
        let long = format!("http://r/{}", "j".repeat(8192));
        let quoted = quote_location(&long);
        assert_eq!(quoted.len(), MAX_LOCATION_BYTES);
        assert!(quoted.ends_with("...") && long.starts_with(&quoted[..500]));
        // Cut on a character's boundary.
        let wide = "é".repeat(600);
        assert!(quote_location(&wide).len() <= MAX_LOCATION_BYTES);
    }

    #[test]
    fn statuses_are_classified_as_the_contract_says() {
        for s in [408, 429, 500, 502, 503, 504] {
            assert!(is_transient(StatusCode::from_u16(s).unwrap()), "{s}");
        }
        for s in [400, 401, 404, 409, 422] {
            assert!(!is_transient(StatusCode::from_u16(s).unwrap()), "{s}");
        }
    }

    #[tokio::test]
    async fn a_failed_request_says_why_and_never_shows_the_urls_password() {
        sas::tls::install_crypto_provider();
        let client = reqwest::Client::new();
        // Port 1 on the loopback: nothing listens there.
        let e = client
            .post("http://user:s3cret@127.0.0.1:1/charge")
            .send()
            .await
            .expect_err("nothing listens on port 1");
        let text = causes(e);
        assert!(!text.contains("s3cret"), "{text}");
        // reqwest moves the credentials into a header; the rest is kept.
        assert!(text.contains("127.0.0.1:1/charge"), "{text}");
        // reqwest's own message alone would not say what failed.
        assert!(text.matches(": ").count() >= 2, "{text}");
    }

    #[test]
    fn backoff_grows_and_stays_under_the_cap() {
        let policy = Retry::of(None, &AgentSettings::default());
        for retry in 0..30 {
            assert!(backoff(policy, retry) <= policy.max);
        }
    }

    #[test]
    fn a_steps_retry_overrides_the_agents_defaults_key_by_key() {
        let agent = AgentSettings::default();
        let own = RetrySpec {
            max_attempts: Some(2),
            backoff: Some(Duration::from_millis(5)),
            backoff_max: None,
        };
        assert_eq!(
            Retry::of(Some(own), &agent),
            Retry {
                max_attempts: Some(2),
                initial: Duration::from_millis(5),
                max: agent.backoff_max,
            }
        );
        assert_eq!(Retry::of(None, &agent).max_attempts, None);
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, "3".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(3)));
        let later = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(60));
        h.insert(RETRY_AFTER, later.parse().unwrap());
        let d = retry_after(&h).unwrap();
        assert!(
            d > Duration::from_secs(50) && d <= Duration::from_secs(60),
            "{d:?}"
        );
    }
}

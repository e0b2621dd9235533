//! One step's call to its remote service (contract §4): `POST <url>` with the
//! step body, `Idempotency-Key` and `X-Complete-By`; transient failures
//! (408, 429, 5xx, connection errors, timeouts) retried with exponential
//! backoff and full jitter, honouring `Retry-After`, until complete-by.
//! A long-running operation (§4b) answers `202 Accepted` with a `Location`:
//! it is polled with `GET` and the same key, each `202` a heartbeat that
//! moves complete-by forward, until it answers for good.

use std::time::Duration;

use chrono::{DateTime, Utc};
use reqwest::StatusCode;
use reqwest::header::{HeaderMap, RETRY_AFTER};
use sas::config::{AgentSettings, AgentSpec, RetrySpec};
use sas::messages::{FENCING_TOKEN_HEADER, StepOutcome, StepRequest, rfc3339};
use sas::trace::TraceContext;
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
    Held,
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

/// How long to wait between polls when the remote's `202` names no `Retry-After`.
const DEFAULT_POLL_WAIT: Duration = Duration::from_secs(1);

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
            None => client.post(&spec.url).json(&body),
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
        let send = http
            .header("Idempotency-Key", &key)
            .header("X-Complete-By", rfc3339::format(&deadline.wall()))
            .header(FENCING_TOKEN_HEADER, request.fencing_token)
            .timeout(timeout)
            .send();
        let attempt = tokio::select! {
            () = stop.cancelled() => return CallEnd::Interrupted,
            sent = send.instrument(call_span) => judge(sent, endpoint.spec.max_response_bytes).await,
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
                let url = match resolve(&spec.url, location.as_deref()) {
                    Ok(url) => url,
                    Err(error) => {
                        on_attempt("transient");
                        break 'accepted (error, retry_after);
                    }
                };
                shared.succeeded().await;
                on_attempt("accepted");
                tried = 0;
                if let Some(moved) = heartbeat(request, deadline) {
                    deadline = moved;
                    // The receiver goes only with the call: nothing to do if it went.
                    let _ = heartbeats.send((deadline.wall(), url.to_string()));
                }
                tracing::debug!(location = %url, complete_by = %deadline.wall(), "accepted; polling");
                poll = Some(url);
                let Some(left) = deadline.remaining() else {
                    return CallEnd::Expired;
                };
                let wait = retry_after.unwrap_or(DEFAULT_POLL_WAIT).min(left);
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
                    return CallEnd::Held;
                }
                (error, retry_after)
            }
        };
        if retry.max_attempts.is_some_and(|n| tried + 1 >= n) {
            tracing::info!(%error, attempts = tried + 1, "transient failure and no attempt left; staying silent");
            return CallEnd::Expired;
        }
        let wait = retry_after.unwrap_or_else(|| backoff(retry, tried));
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

/// The deadline a `202` gives the step now: its timeout from now, never
/// past its first dispatch plus its `max_duration`; `None` when that is no
/// later than `deadline` (or the request, from an older scheduler, says
/// neither).
fn heartbeat(request: &StepRequest, deadline: Deadline) -> Option<Deadline> {
    let timeout = Duration::from_millis(u64::try_from(request.timeout_ms?).ok()?);
    deadline.extended(timeout, request.max_complete_by?)
}

/// A `Location` (absolute, or relative to the step's URL) as a URL to
/// poll, or why there is none: a remote's header is input, and only an
/// http(s) URL is polled.
fn resolve(base: &str, location: Option<&str>) -> Result<reqwest::Url, String> {
    let Some(location) = location else {
        return Err("202 Accepted without a Location to poll".into());
    };
    let quoted = sas::messages::Quoted::new(location);
    let url = reqwest::Url::parse(base)
        .and_then(|b| b.join(location))
        .map_err(|e| format!("202 Accepted with a Location that is no URL ({quoted}): {e}"))?;
    match url.scheme() {
        "http" | "https" => Ok(url),
        other => Err(format!(
            "202 Accepted with a Location of scheme {other:?}, not http(s): {quoted}"
        )),
    }
}

/// Exponential backoff with full jitter: uniform in [0, min(max, initial·2^retry)].
fn backoff(policy: Retry, retry: u32) -> Duration {
    let ceiling = policy
        .initial
        .saturating_mul(2u32.saturating_pow(retry.min(20)))
        .min(policy.max);
    ceiling.mul_f64(fastrand::f64())
}

async fn judge(sent: Result<reqwest::Response, reqwest::Error>, max_bytes: usize) -> Attempt {
    let response = match sent {
        Ok(r) => r,
        Err(e) => {
            return Attempt::Transient {
                error: format!("request failed: {}", causes(e)),
                retry_after: None,
            };
        }
    };
    let status = response.status();
    let retry_after = retry_after(response.headers());
    if status == StatusCode::ACCEPTED {
        let location = response
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|l| l.to_str().ok())
            .map(str::to_owned);
        return Attempt::Accepted {
            location,
            retry_after,
        };
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
    let url = e.url().map(|u| sas::tls::redact_url(u.as_str()));
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

    #[test]
    fn a_location_is_polled_relative_to_the_step_or_absolute_and_only_over_http() {
        let base = "http://remote:8081/svc/a";
        let at = |l| resolve(base, l).map(|u| u.to_string());
        assert_eq!(
            at(Some("/svc/a/jobs/1")).as_deref(),
            Ok("http://remote:8081/svc/a/jobs/1")
        );
        assert_eq!(
            at(Some("jobs/1")).as_deref(),
            Ok("http://remote:8081/svc/jobs/1")
        );
        assert_eq!(
            at(Some("https://status.example/j/1")).as_deref(),
            Ok("https://status.example/j/1")
        );
        assert!(at(None).is_err_and(|e| e.contains("without a Location")));
        assert!(at(Some("file:///etc/passwd")).is_err_and(|e| e.contains("\"file\"")));
        assert!(at(Some("http://[bad")).is_err_and(|e| e.contains("no URL")));
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

//! `GET /v1/orders/{id}/events`: an order's status events as
//! `text/event-stream` (contract §9a), read from the event log, not the
//! broker: one `data:` line per event (the status event of §2, as its
//! queue gets it), `id:` its `seq`.
//!
//! The stream starts at `from_seq` (default 1), or after the `seq` of a
//! `Last-Event-ID` header (which wins: it is how an `EventSource`
//! resumes). It reads the log when it opens and then only when the order
//! may have new events: the instance's one listener wakes it
//! ([`super::watches`]), so an open stream costs the database nothing
//! while it waits, however many are open. It ends after the order's
//! terminal event, at once when the order has ended and no event at or
//! after `from_seq` exists, after `submission.stream_lifetime` (the
//! client resumes with `Last-Event-ID`), or with the service. A comment
//! line every `submission.stream_heartbeat` keeps proxies from closing an
//! idle stream. At
//! most `submission.max_streams` are open at once, of which
//! `submission.max_streams_per_application` per application (a `503`
//! beyond).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::Stream;
use sas::config::SubmissionSettings;
use sas::messages::{ReplayRequest, StatusEvent};
use sas::service::Context;
use sas::state_store::StateStore;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use uuid::Uuid;

use super::auth::Caller;
use super::watches::{Watch, Watches};
use super::{Api, ApiError, owned, parse_id};

/// When a stream reads the log once more after it opened: a write-back
/// that began before the stream's watch was stored notifies no one, and
/// may commit after the stream's first read.
const RECHECK_AFTER: Duration = Duration::from_secs(1);

/// How much longer a stored watch lasts than its stream may.
const WATCH_MARGIN: Duration = Duration::from_secs(60);

/// Events read from the log at once.
const BATCH: u32 = 500;

/// A failing read of the log ends the stream after this many in a row (the
/// caller resumes with `Last-Event-ID`).
const MAX_FAILED_READS: u32 = 25;

/// A failed read of the log is tried again after this long.
const RETRY_READ: Duration = Duration::from_millis(200);

/// The instance's open streams: how many there may be, and their watches.
pub struct Streams {
    all: Arc<Semaphore>,
    per_application: Mutex<HashMap<String, Arc<Semaphore>>>,
    max_per_application: usize,
    lifetime: Duration,
    heartbeat: Duration,
    watches: Arc<Watches>,
}

/// A stream's places among the open ones, held while it is open.
struct Admitted {
    _all: OwnedSemaphorePermit,
    _own: Option<OwnedSemaphorePermit>,
}

impl Streams {
    /// The streams of `settings`, their watches stored in `store` and
    /// listened for until `shutdown`.
    pub fn new(
        settings: &SubmissionSettings,
        store: StateStore,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> Self {
        let size = |n: u32| usize::try_from(n).unwrap_or(usize::MAX);
        Self {
            all: Arc::new(Semaphore::new(size(settings.max_streams))),
            per_application: Mutex::new(HashMap::new()),
            max_per_application: size(settings.max_streams_per_application),
            lifetime: settings.stream_lifetime,
            heartbeat: settings.stream_heartbeat,
            // A watch outlives its stream by a margin: a stream ends first.
            watches: Watches::start(store, settings.stream_lifetime + WATCH_MARGIN, shutdown),
        }
    }

    /// A place for a new stream of `application`'s (all callers of none
    /// share the instance's places), or `503`.
    fn admit(&self, application: Option<&str>) -> Result<Admitted, ApiError> {
        let full = |whose: &str| {
            ApiError::unavailable(format!("too many event streams are open{whose}; try again"))
        };
        let own = match application {
            Some(name) => {
                let places = self
                    .per_application
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(name.to_owned())
                    .or_insert_with(|| Arc::new(Semaphore::new(self.max_per_application)))
                    .clone();
                Some(
                    places
                        .try_acquire_owned()
                        .map_err(|_| full(" for this application"))?,
                )
            }
            None => None,
        };
        let all = self.all.clone().try_acquire_owned().map_err(|_| full(""))?;
        Ok(Admitted {
            _all: all,
            _own: own,
        })
    }
}

/// The query of an event stream.
#[derive(Debug, serde::Deserialize)]
pub struct From {
    /// The first `seq` wanted.
    from_seq: Option<i32>,
}

/// `GET /v1/orders/{id}/events`.
pub async fn events(
    State(api): State<Arc<Api>>,
    caller: Caller,
    Path(id): Path<String>,
    query: Result<Query<From>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let given = parse_id(&id)?;
    let from = first_seq(query.map(|Query(q)| q.from_seq), &headers)?;
    let row = owned(&api, &caller, given).await?;
    let store = api.ctx.store().map_err(|e| ApiError::internal(&e))?.clone();
    let application = caller.application().map(|app| app.name.clone());
    let admitted = api.streams.admit(application.as_deref())?;
    // Before the first read: an event written after it is notified.
    let watch = api
        .streams
        .watches
        .watch(row.order_id)
        .await
        .map_err(|e| ApiError::store(&e))?;
    let now = Instant::now();
    let reading = Reading {
        store,
        order_id: row.order_id,
        application,
        from,
        ready: VecDeque::new(),
        done: false,
        failed_reads: 0,
        ctx: api.ctx.clone(),
        watch,
        recheck_at: Some(now + RECHECK_AFTER),
        ends_at: now + api.streams.lifetime,
        _admitted: admitted,
    };
    Ok(Sse::new(reading.into_stream())
        .keep_alive(
            KeepAlive::new()
                .interval(api.streams.heartbeat)
                .text("heartbeat"),
        )
        .into_response())
}

/// The first `seq` a request asks for: after its `Last-Event-ID`, else its
/// `from_seq`, else 1.
fn first_seq(
    query: Result<Option<i32>, QueryRejection>,
    headers: &HeaderMap,
) -> Result<i32, ApiError> {
    let bad = |why: &str| ApiError::bad_request("bad_from_seq", why.to_owned());
    if let Some(last) = headers.get("last-event-id") {
        return last
            .to_str()
            .ok()
            .and_then(|t| t.trim().parse::<i32>().ok())
            .filter(|seq| *seq >= 0)
            .and_then(|seq| seq.checked_add(1))
            .ok_or_else(|| bad("Last-Event-ID must be the seq of an event"));
    }
    let from_seq = query.map_err(|_| bad("from_seq must be an integer from 0"))?;
    match from_seq {
        Some(n) if n < 0 => Err(bad("from_seq must be an integer from 0")),
        Some(n) => Ok(n),
        None => Ok(1),
    }
}

/// A stream's place in an order's event log.
struct Reading {
    store: StateStore,
    /// The stored id.
    order_id: Uuid,
    /// The caller's application, which the log's reads are confined to.
    application: Option<String>,
    /// The next `seq` to read.
    from: i32,
    /// Events read and not yet sent.
    ready: VecDeque<StatusEvent>,
    /// The terminal event is sent (or there will be none): end.
    done: bool,
    failed_reads: u32,
    /// The service's: its shutdown ends the stream.
    ctx: Arc<Context>,
    /// Wakes the stream when the order may have new events.
    watch: Watch,
    /// When to read once more without being woken ([`RECHECK_AFTER`]).
    recheck_at: Option<Instant>,
    /// The end of the stream's lifetime.
    ends_at: Instant,
    /// Held while the stream is open.
    _admitted: Admitted,
}

impl Reading {
    fn into_stream(self) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
        futures_util::stream::unfold(self, |mut r| async move {
            let event = r.next().await?;
            Some((Ok(sse_event(&event)), r))
        })
    }

    /// The next event to send, `None` at the end.
    async fn next(&mut self) -> Option<StatusEvent> {
        loop {
            if let Some(event) = self.ready.pop_front() {
                if event.is_terminal() {
                    self.done = true;
                    self.ready.clear();
                }
                return Some(event);
            }
            if self.done {
                return None;
            }
            if Instant::now() >= self.ends_at {
                return None;
            }
            let failed = match self.read().await {
                Ok(true) => continue,
                Ok(false) => false,
                Err(e) => {
                    self.failed_reads += 1;
                    tracing::warn!(error = %e, order_id = %self.order_id, "event stream: cannot read the event log");
                    if self.failed_reads >= MAX_FAILED_READS {
                        return None;
                    }
                    true
                }
            };
            if self.done {
                return None;
            }
            // The read after opening stands until its time, whatever woke
            // the stream before.
            let now = Instant::now();
            if self.recheck_at.is_some_and(|at| at <= now) {
                self.recheck_at = None;
            }
            let again = if failed {
                Some(now + RETRY_READ)
            } else {
                self.recheck_at
            };
            tokio::select! {
                () = self.watch.changed() => {}
                () = sleep_until(again) => {}
                () = tokio::time::sleep_until(self.ends_at) => return None,
                () = self.ctx.shutdown.cancelled() => return None,
            }
        }
    }

    /// Reads what is new; whether there was anything. Marks the stream
    /// done when the order is gone, or has ended with nothing left to send.
    async fn read(&mut self) -> Result<bool, sas::state_store::StoreError> {
        let request = ReplayRequest::Order {
            order_id: self.order_id,
            from_seq: self.from,
        };
        let replay = self
            .store
            .replay(&request, self.application.as_deref(), BATCH)
            .await?;
        self.failed_reads = 0;
        let Some(replay) = replay else {
            // Deleted (retention) since the stream began.
            self.done = true;
            return Ok(false);
        };
        if let Some(last) = replay.events.last() {
            self.from = i32::try_from(last.seq)
                .unwrap_or(i32::MAX)
                .saturating_add(1);
            self.ready.extend(replay.events);
            return Ok(true);
        }
        // Nothing new: has the order ended before `from`? Its events are
        // written with its state, so all of them up to `last_seq` are read.
        match self.store.order(self.order_id).await? {
            None => self.done = true,
            Some(row) if row.process_state.is_terminal() && row.last_seq < self.from => {
                self.done = true;
            }
            Some(_) => {}
        }
        Ok(false)
    }
}

/// Resolves at `at`, or never.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A status event as an SSE event: `id:` its `seq`, `data:` its JSON.
fn sse_event(event: &StatusEvent) -> Event {
    let data = serde_json::to_string(event).unwrap_or_else(|_| "{}".to_owned());
    Event::default().id(event.seq.to_string()).data(data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn with_last(id: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("last-event-id", HeaderValue::from_str(id).unwrap());
        h
    }

    #[test]
    fn the_first_seq_is_after_last_event_id_else_from_seq_else_one() {
        let none = HeaderMap::new();
        assert_eq!(first_seq(Ok(None), &none).unwrap(), 1);
        assert_eq!(first_seq(Ok(Some(4)), &none).unwrap(), 4);
        assert_eq!(first_seq(Ok(Some(0)), &none).unwrap(), 0);
        assert!(first_seq(Ok(Some(-1)), &none).is_err());
        assert_eq!(first_seq(Ok(Some(4)), &with_last("7")).unwrap(), 8);
        assert_eq!(first_seq(Ok(None), &with_last(" 0 ")).unwrap(), 1);
        for bad in ["x", "-1", "2147483647", "1.5", ""] {
            assert!(first_seq(Ok(None), &with_last(bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn an_event_is_one_data_line_with_its_seq_as_id() {
        let event: StatusEvent = serde_json::from_value(serde_json::json!({
            "order_id": "0192a0c0-0000-7000-8000-000000000001", "seq": 3,
            "state": "processed", "at": "2026-11-27T10:00:00Z",
            "detail": {"text": "a\nb"}
        }))
        .unwrap();
        let text = format!("{:?}", sse_event(&event));
        assert!(text.contains("id: 3"), "{text}");
        assert_eq!(text.matches("data:").count(), 1, "{text}");
    }
}

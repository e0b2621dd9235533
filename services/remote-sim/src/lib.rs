//! `remote-sim`: plays the *remote services* of the sas demo workflow
//! (`POST /inventory/reserve`, `/inventory/release`, `/payments/charge`,
//! `/payments/refund`, `/shipping/ship`, ... — every path is a valid endpoint)
//! for demos and tests.
//!
//! # Calls
//!
//! Agents call `POST <path>` with a JSON body
//! `{"order_id","step","attempt","payload","results"}` and the headers
//! `Idempotency-Key: <order_id>:<step>[:compensate][:r<N>]`, `X-Complete-By`
//! and `X-Sas-Fencing-Token` (recorded per key, in order, in the stats).
//! Compensating calls also carry `X-Sas-Outcome: unknown` (sas does not
//! know whether the forward step was applied) or `completed`; each value is
//! recorded per key, in order, as given (cut to [`OUTCOME_LIMIT`] bytes).
//! An applied call answers 200 with
//! `{"ok":true,"endpoint","idempotency_key","effect_id","order_id","step"}`
//! (`order_id` and `step` copied from the body when present).
//! A call without `Idempotency-Key` or with a body that is not JSON answers 400.
//! A key may only be used on one endpoint; reusing it on another answers 422.
//!
//! # Faults
//!
//! Each endpoint has [`Knobs`], evaluated per call in this order:
//! count the call → `fencing` (409 for a token lower than the highest the
//! key has seen, or than the highest of an undo of the key, see below) →
//! `permanent` (422) → `status` (that status) →
//! `hang` / `hang_first` (sleep `hang_ms`, then 504) → `fail_first` (503) →
//! `transient_rate` (503) → if `idempotent` and the key was already applied:
//! replay the stored response (200, `Idempotent-Replayed: true`) →
//! `permanent_rate` (422) → `long_ms` (202 Accepted with a `Location`, see
//! below) → `latency_ms` → `together` (wait until that many calls wait) →
//! apply → `late_answer_ms` (sleep, then answer).
//! Only the apply step applies an effect; with `late_answer_ms` the effect
//! is applied and stored first and the answer comes late (503 if the
//! simulator shuts down meanwhile; the effect stands either way), as a
//! remote that acts but answers after the client's deadline.
//!
//! With `long_ms`, a call starts a long-running operation (contract §4b) and
//! answers `202 Accepted`, `Location: <endpoint>/jobs/<id>` (and
//! `Retry-After` when `retry_after` is set); a repeated call with the key
//! answers 202 with the same `Location`. `GET` of the `Location` answers 202
//! until `long_ms` after the first call, then the result, applied once (a
//! repeat replays it); an unknown job answers 404. Polls are counted.
//! `hang_first` and `fail_first` both count calls per key from the first call,
//! so `hang_first: 1, fail_first: 2` hangs call 1, fails call 2, applies call 3.
//! Calls on one key are serialised from the replay check on (up to the
//! apply; not during a late answer), so concurrent calls with the same key
//! apply at most once.
//!
//! # Net effects
//!
//! An undo key `<base>:compensate` or `<base>:compensate:r<N>` (the
//! `compensate` segment last, or followed by a redrive segment `r<digits>`)
//! undoes the forward key `<base>` or `<base>:r<N>`, whatever endpoints
//! they are used on; any other key is a forward key. Its order id is its
//! part before the first `:` (the whole key when it has none). Per forward
//! key the stats tell whether its effect stands: an applied call with it
//! sets [`KeyStats::standing`], an applied undo clears it and sets
//! [`KeyStats::undone`] (an undo of a key never applied answers as any
//! applied call and leaves nothing standing), and a forward call applied
//! after its undo stands again (the hazard fencing guards against). A
//! replayed answer is not a new apply. [`Stats::standing`] lists, per order
//! id, the forward keys that stand now.
//!
//! The fencing token of an undo call counts as seen by its forward key too
//! (not in that key's `tokens`): with `fencing` on the forward endpoint, a
//! later forward call with a lower token answers 409 without applying.
//!
//! # Control API
//!
//! - `GET /healthz` → `ok`.
//! - `GET /_sim/knobs` → all set knobs (path → [`Knobs`]);
//!   `DELETE /_sim/knobs` resets all knobs (204).
//! - `GET|PUT|DELETE /_sim/knobs/{*path}` → effective knobs of `/<path>`,
//!   set them (JSON [`Knobs`] body; 204), reset them (204).
//! - `GET /stats` → [`Stats`]; `DELETE /stats` resets counters and the
//!   deduplication store (204).
//!
//! Request bodies are limited to [`BODY_LIMIT`] (413 beyond).
//!
//! # HTTPS
//!
//! `serve_tls_with` (the binary's `--tls-cert` and `--tls-key`) serves the
//! same API over TLS with a given certificate, so agents' `https://` calls
//! and their certificate checks can be tested.
//!
//! Its HTTP layer (the control API and the simulated endpoints) is `http`.

mod http;
mod knobs;
mod sim;
mod stats;
mod tls;

use std::collections::HashMap;
use std::sync::Arc;

pub use http::{
    BODY_LIMIT, FENCING_TOKEN, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, OUTCOME_LIMIT, SAS_OUTCOME,
    router,
};
pub use knobs::{DEFAULT_HANG_MS, Knobs, parse_knobs_map};
/// Installs the process's TLS crypto provider (sas's own, shared by every
/// binary): a reqwest client in this crate's tests needs one.
pub use sas::tls::install_crypto_provider;
pub use sim::RemoteSim;
pub use stats::{EndpointStats, KeyStats, Stats};
pub use tls::tls_config;

/// Serves the simulator on `listener` with `initial` knobs (path → knobs)
/// until `shutdown` completes, then drains in-flight calls (hanging calls
/// are woken and answer 503).
pub async fn serve(
    listener: tokio::net::TcpListener,
    initial: HashMap<String, Knobs>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let sim = Arc::new(RemoteSim::new(initial)?);
    serve_with(listener, sim, shutdown).await
}

/// Like [`serve`], with caller-owned state (so tests can inspect it directly).
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    sim: Arc<RemoteSim>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_on(sas::server::no_delay(listener), sim, shutdown).await
}

/// Like [`serve_with`], over TLS with `tls` (see [`tls_config`]). A client
/// that fails the handshake (e.g. it does not trust the certificate) is
/// logged and never reaches the API.
pub async fn serve_tls_with(
    listener: tokio::net::TcpListener,
    tls: Arc<rustls::ServerConfig>,
    sim: Arc<RemoteSim>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_on(tls::TlsListener::new(listener, tls)?, sim, shutdown).await
}

/// Serves the API on `listener` until `shutdown`, then wakes hanging calls.
async fn serve_on<L>(
    listener: L,
    sim: Arc<RemoteSim>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()>
where
    L: axum::serve::Listener<Addr = std::net::SocketAddr>,
{
    let app = router(Arc::clone(&sim));
    let signal = async move {
        shutdown.await;
        tracing::info!("shutting down");
        sim.shutdown();
    };
    sas::server::serve(listener, app, limits(), signal).await?;
    Ok(())
}

/// The bounds of sas's own servers (header and idle timeout, body limit),
/// but no bound on the time to answer: a hanging endpoint is a knob.
fn limits() -> sas::server::Limits {
    sas::server::Limits {
        request: None,
        body_bytes: BODY_LIMIT,
        ..sas::server::Limits::default()
    }
}

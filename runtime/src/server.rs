//! The HTTP server under every sas port (each service's `/healthz`,
//! `/readyz` and `/metrics`, and the dashboard), with bounds a stranger
//! cannot stretch (contract §1a): a client has [`HEADER_READ_TIMEOUT`] to
//! send a request's headers (which also closes a keep-alive connection idle
//! that long), a request gets an answer within [`REQUEST_TIMEOUT`], and a
//! body is read up to [`MAX_BODY_BYTES`]. `axum::serve` sets none of these.
//!
//! Each request carries the peer's address as axum's `ConnectInfo`, so a
//! handler can tell who connected (the dashboard trusts an identity header
//! only from configured proxies).
//!
//! Accepted TCP connections get `TCP_NODELAY` ([`no_delay`]): with Nagle's
//! algorithm on, an answer written in two parts waits for the client's
//! delayed ACK, 40 ms on Linux.

use std::time::Duration;

use std::future::Future;
use std::net::SocketAddr;

use axum::Router;
use axum::extract::{ConnectInfo, DefaultBodyLimit};
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::serve::{Listener, ListenerExt as _};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

/// Time a client has to send a request's headers, and longest idle time
/// of a kept-alive connection.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest time from a request's headers to its answer (reading its body
/// included).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Largest request body read.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Longest a connection may stay open after shutdown begins.
const DRAIN: Duration = Duration::from_secs(5);

/// How long a server waits and how much it reads.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Time to send a request's headers; also the longest idle keep-alive.
    pub header_read: Duration,
    /// Longest time to an answer, if bounded.
    pub request: Option<Duration>,
    /// Largest request body read.
    pub body_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_read: HEADER_READ_TIMEOUT,
            request: Some(REQUEST_TIMEOUT),
            body_bytes: MAX_BODY_BYTES,
        }
    }
}

/// `listener`, with Nagle's algorithm off on every connection it accepts
/// (see [`set_no_delay`]).
pub fn no_delay(listener: TcpListener) -> impl Listener<Io = TcpStream, Addr = SocketAddr> {
    listener.tap_io(|tcp| set_no_delay(tcp))
}

/// Turns Nagle's algorithm off on `tcp`, so that a small write goes out at
/// once instead of waiting for the ACK of the last one. A socket that
/// refuses is logged and served as it is: only its latency suffers.
pub fn set_no_delay(tcp: &TcpStream) {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!(error = %e, "cannot set TCP_NODELAY on an accepted connection");
    }
}

/// Serves `app` on `listener` (plain TCP, or a TLS listener) within
/// `limits` until `shutdown` resolves, then lets open connections finish
/// their request (for at most a few seconds).
pub async fn serve<L>(
    mut listener: L,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()>
where
    L: Listener<Addr = SocketAddr>,
{
    let app = app.layer(DefaultBodyLimit::max(limits.body_bytes));
    let stopping = CancellationToken::new();
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => accepted,
        };
        let app = app.clone();
        let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo(peer));
            let answer = app.clone().oneshot(request.map(axum::body::Body::new));
            async move {
                let answered = match limits.request {
                    Some(bound) => tokio::time::timeout(bound, answer).await,
                    None => Ok(answer.await),
                };
                Ok::<Response, std::convert::Infallible>(match answered {
                    Ok(Ok(response)) => response,
                    Ok(Err(never)) => match never {},
                    Err(_) => {
                        (StatusCode::SERVICE_UNAVAILABLE, "request timed out\n").into_response()
                    }
                })
            }
        });
        let stop = stopping.clone();
        connections.spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            let served = tokio::select! {
                served = connection.as_mut() => served,
                () = stop.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    tokio::time::timeout(DRAIN, connection).await.unwrap_or(Ok(()))
                }
            };
            if let Err(e) = served {
                tracing::debug!(error = %e, %peer, "HTTP connection ended with an error");
            }
        });
    }
    stopping.cancel();
    let _ = tokio::time::timeout(DRAIN, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn accepted_connections_have_nagle_off() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut listener = no_delay(listener);
        let client = TcpStream::connect(addr).await.unwrap();
        let (accepted, peer) = listener.accept().await;
        assert_eq!(peer, client.local_addr().unwrap());
        assert!(accepted.nodelay().unwrap(), "TCP_NODELAY is not set");
        // The plain listener leaves it off: the test can tell the two apart.
        let mut plain = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let _client = TcpStream::connect(plain.local_addr().unwrap())
            .await
            .unwrap();
        let (accepted, _) = Listener::accept(&mut plain).await;
        assert!(!accepted.nodelay().unwrap());
    }
}

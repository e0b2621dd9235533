//! A TCP proxy that partitions silently (contract §6a): the fault a NAT
//! that forgets its flows, or a failover that moves an address, makes.
//!
//! While partitioned, bytes are dropped both ways and no socket is closed:
//! a peer that waits for an answer waits. Connections open during a
//! partition stay silent after it ends; only new ones carry bytes again.
//! When one side of a silent connection closes its socket, the other side
//! learns of it only once the partition is over: what a server's TCP
//! keepalive would find out by itself on a real network, where this
//! proxy's own kernel, which answers the keepalive probes, is not in the way.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

#[derive(Default)]
struct State {
    partitioned: AtomicBool,
    /// Partitions started so far: a connection opened before the last one
    /// began is silent for good.
    partitions: AtomicU64,
}

impl State {
    fn partitioned(&self) -> bool {
        self.partitioned.load(Ordering::SeqCst)
    }
}

/// A proxy to one server, on a port of its own on 127.0.0.1. Dropped, it
/// closes every connection it carries.
pub struct Proxy {
    port: u16,
    state: Arc<State>,
    tasks: Arc<Mutex<Vec<AbortHandle>>>,
}

impl Proxy {
    /// Starts a proxy to `upstream`, `host:port` (e.g. `127.0.0.1:5432`).
    pub async fn start(upstream: &str) -> Self {
        let upstream: SocketAddr = tokio::net::lookup_host(upstream)
            .await
            .ok()
            .and_then(|mut addresses| addresses.next())
            .unwrap_or_else(|| panic!("no address for upstream {upstream}"));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let state = Arc::new(State::default());
        let tasks = Arc::new(Mutex::new(Vec::new()));
        let accept = {
            let (state, tasks) = (state.clone(), tasks.clone());
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let carry = tokio::spawn(carry(client, upstream, state.clone()));
                    tasks.lock().unwrap().push(carry.abort_handle());
                }
            })
        };
        tasks.lock().unwrap().push(accept.abort_handle());
        Self { port, state, tasks }
    }

    /// The port to connect to instead of the server's.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// From now on, drops every byte, on every connection.
    pub fn partition(&self) {
        self.state.partitions.fetch_add(1, Ordering::SeqCst);
        self.state.partitioned.store(true, Ordering::SeqCst);
    }

    /// New connections carry bytes again; those open until now stay silent.
    pub fn heal(&self) {
        self.state.partitioned.store(false, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

/// Carries one connection both ways until either side closes.
async fn carry(client: TcpStream, upstream: SocketAddr, state: Arc<State>) {
    let born = state.partitions.load(Ordering::SeqCst);
    let doomed = state.partitioned();
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    client.set_nodelay(true).ok();
    server.set_nodelay(true).ok();
    let silent =
        || doomed || state.partitioned() || state.partitions.load(Ordering::SeqCst) != born;
    let (mut client_in, mut client_out) = client.into_split();
    let (mut server_in, mut server_out) = server.into_split();
    let (mut up, mut down) = (vec![0u8; 16 * 1024], vec![0u8; 16 * 1024]);
    loop {
        tokio::select! {
            read = client_in.read(&mut up) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) if !silent() => {
                    if server_out.write_all(&up[..n]).await.is_err() {
                        break;
                    }
                }
                Ok(_) => {}
            },
            read = server_in.read(&mut down) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) if !silent() => {
                    if client_out.write_all(&down[..n]).await.is_err() {
                        break;
                    }
                }
                Ok(_) => {}
            },
        }
    }
    while state.partitioned() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Dropping the halves closes both sockets.
}

//! `[broker]` of the configuration: how sas reaches RabbitMQ and declares
//! its queues.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

/// `[broker]`: RabbitMQ.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct BrokerSettings {
    /// AMQP URL: `amqp://` in plaintext, `amqps://` over verified TLS (the
    /// certificate must name the URL's host). Several, separated by commas,
    /// name the nodes of one cluster (§6a): a service connects to one of
    /// them, tried in a random order, and to another when it loses it.
    pub url: String,
    /// A PEM file of CA certificates that RabbitMQ's certificate may chain
    /// to, trusted beside the system's roots (`amqps://` only).
    pub ca_file: Option<PathBuf>,
    /// A PEM client certificate (chain) to present, with `client_key`, to a
    /// broker that asks for one (`amqps://` only).
    pub client_cert: Option<PathBuf>,
    /// The PEM private key (PKCS#8, PKCS#1 or SEC1) of `client_cert`.
    pub client_key: Option<PathBuf>,
    /// Every queue is named under this prefix, so deployments can share a broker.
    pub prefix: String,
    /// Unacknowledged deliveries per consumer (the submission's orders, a
    /// scheduler's replies): twice `database.batch_size`, so that a full
    /// batch can gather while the one before it commits.
    pub prefetch: u16,
    /// Deliveries of one message before the broker dead-letters it (quorum
    /// queues only: the orders queue, and the step queues when quorum).
    pub delivery_limit: u32,
    /// How long start-up keeps trying to reach RabbitMQ before giving up.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// The AMQP heartbeat asked of the broker, unless the URL names one
    /// (`?heartbeat=`): a connection that goes silent is given up after
    /// about two of them (§6a), not the server's default minute.
    #[serde(with = "humantime_serde")]
    pub heartbeat: Duration,
    /// The type of the step queues (the agents' request queues and the
    /// schedulers' reply queue) when sas declares them. Classic by default:
    /// they carry nothing Postgres does not hold (a lost request or reply
    /// is re-dispatched once complete-by passes), and a classic queue hands
    /// a message to a waiting consumer without first writing it to a
    /// replicated log, which is most of a step's latency at low load.
    pub step_queues: QueueType,
    /// Whether the step messages (requests and replies) are persistent.
    /// Transient by default: Postgres holds every step, and when a broker
    /// restart drops them the supervisor's leader sends each step sent
    /// before it again at once, with its idempotency key (it keeps a marker
    /// message that goes with them, `<prefix>.supervisor.marker`); a step
    /// it misses is sent again once its complete-by passes. `persistent`
    /// writes each one to a classic queue's disk before the broker confirms
    /// it; on a quorum queue every message is on disk either way.
    pub step_messages: Durability,
}

/// Whether messages outlive a broker restart (AMQP `delivery-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Durability {
    /// Written to disk before the broker confirms them (delivery mode 2).
    Persistent,
    /// Kept in memory only (delivery mode 1).
    #[default]
    Transient,
}

impl Durability {
    /// Whether messages are sent non-persistent.
    pub fn transient(self) -> bool {
        self == Self::Transient
    }
}

/// A RabbitMQ queue type (`x-queue-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueType {
    /// Replicated (Raft), with a delivery limit against poison messages.
    Quorum,
    /// One node's durable queue: persistent messages are on disk before they
    /// are confirmed, and one consumed at once is never written at all.
    Classic,
}

impl QueueType {
    /// The `x-queue-type` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Quorum => "quorum",
            Self::Classic => "classic",
        }
    }
}

impl Default for BrokerSettings {
    fn default() -> Self {
        Self {
            url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            ca_file: None,
            client_cert: None,
            client_key: None,
            prefix: "sas".into(),
            prefetch: 512,
            delivery_limit: 20,
            connect_timeout: Duration::from_secs(30),
            heartbeat: Duration::from_secs(10),
            step_queues: QueueType::Classic,
            step_messages: Durability::Transient,
        }
    }
}

impl BrokerSettings {
    /// The nodes `url` names: one, or several separated by commas.
    pub fn nodes(&self) -> Vec<&str> {
        self.url
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .collect()
    }
}

//! What the end-to-end tests (`sas-tests`) and the benchmark (`sas-bench`)
//! share to stand up a sas deployment of their own beside others on the same
//! Postgres and RabbitMQ:
//!
//! - [`config`]: the configuration file its services read, with the
//!   workflows and agents every deployment has;
//! - [`database`]: a database of its own, created, migrated and dropped;
//! - [`broker`]: its queues under a prefix of its own, declared and deleted;
//! - [`fixtures`]: orders as the library takes them.
//!
//! Errors are `anyhow`: a harness that cannot set up reports why and stops.
//!
//! Beside them, [`otlp`]: a small OTLP receiver the services export their
//! spans to, read back by tests and the benchmark.

pub mod broker;
pub mod config;
pub mod database;
pub mod fixtures;
pub mod otlp;

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

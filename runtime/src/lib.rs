//! # sas-runtime: what every sas service runs around its own work
//!
//! Configuration, telemetry, metrics, health and the service's wiring: a
//! service is built from its settings (`service::main`), its state store
//! connected as it declares, its broker sessions run again on a new
//! connection whenever one is lost. It holds no rule and drives no order:
//! that is the engine's (crate `sas`).
//!
//! - [`config`]: `Settings` from defaults, a TOML file and `SAS__*` variables.
//! - [`service`]: a service's start, context, HTTP port and stop; how it
//!   uses the state store ([`service::StoreUse`]).
//! - [`broker`]: `sas-broker`, and the sessions a service runs over it.
//! - [`http`] (on [`server`], bounded against slow or large requests):
//!   `/healthz`, `/readyz`, `/metrics`.
//! - [`metrics`], [`telemetry`] (logs and spans), [`shutdown`] (SIGTERM,
//!   SIGINT), [`memory`] (the allocator's arenas).
//! - [`heartbeat`]: each instance's record that it is alive.
//! - [`store_cell`]: a state store connected off a service's start path.
//! - [`crash`]: crash points that let the fault suite stop a process at an
//!   exact spot.

// The modules below name these as the rest of sas does.
use sas_core::{applications, messages, rules, spec, state, topology, trace, workflow};
use sas_store as state_store;
use sas_tls as tls;

/// RabbitMQ: crate `sas-broker`, and the sessions a service runs over it.
pub mod broker {
    pub use crate::sessions::run_sessions;
    pub use sas_broker::*;
}
pub mod config;
pub mod crash;
pub mod heartbeat;
pub mod http;
pub mod memory;
pub mod metrics;
pub mod server;
pub mod service;
mod sessions;
pub mod shutdown;
pub mod store_cell;
pub mod telemetry;

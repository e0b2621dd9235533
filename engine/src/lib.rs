//! # sas: the Scheduler Agent Supervisor pattern over RabbitMQ and Postgres
//!
//! The engine, and the library every sas binary links: it drives orders
//! through the rules, and re-exports the layers below it under the names
//! the services use. The layers, each a crate the compiler holds apart:
//!
//! - `sas-core` (no I/O): [`model`], [`spec`], [`workflow`], [`expr`],
//!   [`messages`], [`state`], [`rules`], [`topology`], [`applications`],
//!   [`trace`].
//! - `sas-store` ([`state_store`]): every SQL statement, as verbs (load,
//!   guarded write-back, prune); no rule, no broker.
//! - `sas-broker` ([`broker`], [`dead_letters`]): every lapin call; no SQL.
//! - `sas-tls` ([`tls`]): TLS files and the redaction of passwords.
//! - `sas-runtime`: [`config`], [`service`] (a service's wiring), [`http`]
//!   (on [`server`]), [`metrics`], [`telemetry`], [`shutdown`],
//!   [`memory`], [`heartbeat`], [`store_cell`], [`crash`], and the broker
//!   sessions ([`broker::run_sessions`]).
//!
//! The engine's own modules:
//!
//! - [`engine`]: load ▶ rule ▶ write back ▶ hand over: the transitions,
//!   their outlet (the relay's port) and the shared breaker's transitions.
//! - [`pipeline`]: a service's transitions with its outbox relay, as one
//!   value: what a transition commits is published once it has.
//! - [`outbox`]: the relay from committed outbox rows to confirmed publishes.
//! - [`operate`]: an operator's action from a tool (sasctl, the dashboard),
//!   published at once through a relay of the action's own.
//! - [`batch`]: group commit: deliveries that arrive together share a transaction.
//! - [`diagnosis`]: gathers the facts of why orders are stuck and asks the rule.

// The domain without I/O lives in `sas-core`; its modules are this
// crate's too, under the same names.
pub use sas_core::{
    applications, expr, messages, model, rules, spec, state, topology, trace, workflow,
};
// The state store, the broker, TLS and the runtime are crates of their
// own, re-exported under the names the services use.
pub use sas_broker::dead_letters;
pub use sas_runtime::{
    broker, config, crash, heartbeat, http, memory, metrics, server, service, shutdown, store_cell,
    telemetry,
};
pub use sas_store as state_store;
pub use sas_tls as tls;

pub mod batch;
pub mod diagnosis;
pub mod engine;
pub mod operate;
pub mod outbox;
pub mod pipeline;

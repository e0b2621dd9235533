//! # sas: the Scheduler Agent Supervisor pattern over RabbitMQ and Postgres
//!
//! The library every sas binary links. Which module owns what (those
//! marked pure are `sas-core`'s, re-exported here):
//!
//! - [`config`]: `Settings` from defaults, a TOML file and `SAS__*` variables.
//! - [`spec`]: what an operator declares: workflows, steps, schedules,
//!   applications, the supervisor's policy. Pure.
//! - [`model`]: the records the rules decide on (`OrderRow`, `StepRow`,
//!   `NewOrder`). Pure.
//! - [`workflow`]: workflows and the step plan (what runs next). Pure.
//! - [`expr`]: the CEL expressions of workflows, compiled once. Pure.
//! - [`messages`]: the wire types of every queue (an application's are
//!   `sas-protocol`'s, re-exported) and the submission's validation. Pure.
//! - [`state`]: the states of orders and steps. Pure.
//! - [`rules`]: the pattern's rules as pure functions: what the supervisor
//!   decides at a deadline, what a reply does, what an operator may do, the
//!   shared breaker, flow control, schedules, why an order is stuck. Pure.
//! - [`topology`]: the queue names of a deployment. Pure.
//! - [`applications`]: application identities: who sent a message, where
//!   its events may go, which order its ids mean. Pure.
//! - [`trace`]: W3C trace context carried from hop to hop. Pure.
//! - [`state_store`]: every SQL statement, as verbs (crate `sas-store`,
//!   re-exported): load, guarded write-back, prune; no rule.
//! - [`engine`]: load ▶ rule ▶ write back ▶ hand over: the transitions,
//!   their outlet (the relay's port) and the shared breaker's transitions.
//! - [`pipeline`]: a service's transitions with its outbox relay, as one
//!   value: what a transition commits is published once it has.
//! - [`broker`]: every lapin call (crate `sas-broker`, re-exported):
//!   connect, topology, confirmed publish, consume; and the sessions a
//!   service runs over a connection, again on a new one when it is lost.
//! - [`dead_letters`]: the dead-letter queues for operators: list, replay,
//!   purge (`sas-broker`'s).
//! - [`batch`]: group commit: deliveries that arrive together share a transaction.
//! - [`outbox`]: the relay from committed outbox rows to confirmed publishes.
//! - [`http`] (on [`server`], bounded against slow or large requests),
//!   [`metrics`], [`telemetry`], [`shutdown`], [`service`]: what
//!   every service runs around its own work.
//! - [`tls`] (crate `sas-tls`, re-exported): the rustls crypto provider, the TLS files of the
//!   configuration, and the redaction of passwords from connection URLs.
//! - [`heartbeat`]: each instance's record that it is alive.
//! - [`store_cell`]: a state store connected off a service's start path.
//! - [`diagnosis`]: gathers the facts of why orders are stuck and asks the rule.
//! - [`crash`]: crash points that let the fault suite stop a process at an exact spot.
//! - [`memory`]: the allocator's arenas, few, so that a service's memory stays small.

// The domain without I/O lives in `sas-core`; its modules are this
// crate's too, under the same names.
pub use sas_core::{
    applications, expr, messages, model, rules, spec, state, topology, trace, workflow,
};
// The state store and TLS are crates of their own, under their old names.
pub use sas_store as state_store;
pub use sas_tls as tls;

pub mod batch;
/// RabbitMQ: crate `sas-broker`, and the sessions a service runs over it.
pub mod broker {
    pub use crate::sessions::run_sessions;
    pub use sas_broker::*;
}
pub mod config;
pub mod crash;
pub use sas_broker::dead_letters;
pub mod diagnosis;
pub mod engine;
pub mod heartbeat;
pub mod http;
pub mod memory;
pub mod metrics;
pub mod outbox;
pub mod pipeline;
pub mod server;
pub mod service;
mod sessions;
pub mod shutdown;
pub mod store_cell;
pub mod telemetry;

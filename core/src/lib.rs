//! # sas-core: the Scheduler Agent Supervisor pattern, without I/O
//!
//! What sas decides, as types and pure functions: no clock read, no
//! database, no broker, no runtime. The engine `sas-engine` (crate `sas`)
//! re-exports every module, loads and writes back what these decide.
//!
//! - [`model`]: the rows of orders and steps as the rules see them.
//! - [`state`]: the states of orders and steps.
//! - [`spec`]: workflows, steps, schedules and applications as configured.
//! - [`workflow`]: workflows compiled, and the step plan (what runs next).
//! - [`expr`]: CEL expressions of workflows (`when`, `input`, `for_each`,
//!   `until`), compiled once.
//! - [`messages`]: the wire types of every queue (an application's are
//!   `sas-protocol`'s, re-exported) and their validation.
//! - [`rules`]: the pattern's rules: what the scheduler does next, what the
//!   supervisor decides at a deadline, what a reply does, what an operator
//!   may do, the shared breaker, flow control, schedules, waits, signals,
//!   why an order is stuck.
//! - [`topology`]: the queue names of a deployment.
//! - [`applications`]: application identities: who sent a message, where
//!   its events may go, which order its ids mean.
//! - [`trace`]: W3C trace context carried from hop to hop.

pub mod applications;
pub mod expr;
pub mod messages;
pub mod model;
pub mod rules;
pub mod spec;
pub mod state;
pub mod topology;
pub mod trace;
pub mod workflow;

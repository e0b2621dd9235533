//! The rules of the pattern as pure functions over an order: what the
//! supervisor decides at a deadline ([`supervisor`]), whether an agent's
//! reply still counts and what it does to its step ([`scheduler`]), and
//! what an operator may do ([`operator`]), and when the breaker shared by
//! an agent's instances opens, probes and closes ([`breaker`]), and which
//! ticks of a recurring order's schedule get an order ([`schedule`]). No I/O, no clock
//! reads (`now` is an argument, from the database): the state store loads
//! the order, asks the rule, and writes the decision back.

pub mod breaker;
pub mod flow;
pub mod operator;
pub mod order;
pub mod schedule;
pub mod scheduler;
pub mod stuck;
pub mod submission;
pub mod supervisor;

#[cfg(test)]
mod net_effect;
#[cfg(test)]
mod properties;

pub use order::{Context, Decision, Effect, Logged, Order, RuleError};

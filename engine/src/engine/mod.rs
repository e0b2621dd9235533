//! The engine: a transition loads its orders through the store's verbs,
//! asks the rules, takes their decisions into a unit, writes it back, and
//! hands what it committed to its [`Outlet`] (the service's relay), which
//! publishes at once. The store holds no rule and never learns whether
//! the relay is ready.
//!
//! - [`transitions`]: submit, claim, apply replies, recover expired
//!   orders, warn late ones, and the operators' and applications' actions.
//! - [`outlet`]: the port to whoever publishes what a transition committed.
//! - [`breakers`]: the shared breaker's transitions.
//! - `apply`: a decision taken into a transition's unit.
//! - `room`: the room new orders start in, kept between write-backs.
//! - `kept`: the orders a scheduler keeps between their transitions.

mod apply;
pub mod breakers;
mod kept;
pub mod outlet;
mod room;
pub mod transitions;

pub use breakers::Breakers;
pub use outlet::{Outlet, Sweep};
pub use transitions::{
    Actor, ClaimBounds, Claimed, Ending, Operated, Recovered, ReplyOutcome, Submitted, Transitions,
    any_undone,
};

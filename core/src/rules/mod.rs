//! The rules of the pattern as pure functions over an order: what the
//! supervisor decides at a deadline ([`supervisor`]), whether an agent's
//! reply still counts and what it does to its step ([`scheduler`]), and
//! what an operator may do ([`operator`]), and when the breaker shared by
//! an agent's instances opens, probes and closes ([`breaker`]), and which
//! ticks of a recurring order's schedule get an order ([`schedule`]), and
//! whether a ready step runs, with what, or is skipped ([`conditions`]), and
//! the steps sas runs itself, waits and signals ([`waits`]), and which steps
//! go again when the broker lost their messages ([`resend`]). No I/O, no clock
//! reads (`now` is an argument, from the database): the state store loads
//! the order, asks the rule, and writes the decision back.

pub mod breaker;
pub mod conditions;
pub mod flow;
pub mod operator;
pub mod order;
pub mod resend;
pub mod retention;
pub mod schedule;
pub mod scheduler;
pub mod stuck;
pub mod submission;
pub mod supervisor;
pub mod waits;

#[cfg(test)]
mod net_effect;
#[cfg(test)]
mod properties;

pub use order::{Decision, Effect, Given, Logged, Order, RuleError};

#[cfg(test)]
mod imports {
    /// The pure core, file by file: the rules, the workflows' plan, the
    /// records they decide on and the wire types.
    const CORE: &[(&str, &str)] = &[
        ("rules/mod.rs", include_str!("mod.rs")),
        ("rules/breaker.rs", include_str!("breaker.rs")),
        ("rules/conditions.rs", include_str!("conditions.rs")),
        ("rules/flow.rs", include_str!("flow.rs")),
        ("rules/operator.rs", include_str!("operator.rs")),
        ("rules/order.rs", include_str!("order.rs")),
        ("rules/resend.rs", include_str!("resend.rs")),
        ("rules/retention.rs", include_str!("retention.rs")),
        ("rules/schedule.rs", include_str!("schedule.rs")),
        ("rules/scheduler.rs", include_str!("scheduler.rs")),
        ("rules/stuck.rs", include_str!("stuck.rs")),
        ("rules/submission.rs", include_str!("submission.rs")),
        ("rules/supervisor.rs", include_str!("supervisor.rs")),
        ("rules/waits.rs", include_str!("waits.rs")),
        ("rules/net_effect.rs", include_str!("net_effect.rs")),
        ("rules/properties.rs", include_str!("properties.rs")),
        ("model.rs", include_str!("../model.rs")),
        ("workflow.rs", include_str!("../workflow.rs")),
        ("messages/mod.rs", include_str!("../messages/mod.rs")),
        (
            "messages/validation.rs",
            include_str!("../messages/validation.rs"),
        ),
        ("trace.rs", include_str!("../trace.rs")),
        ("spec.rs", include_str!("../spec.rs")),
        ("expr.rs", include_str!("../expr.rs")),
        ("applications.rs", include_str!("../applications.rs")),
    ];

    #[test]
    fn the_core_imports_neither_the_store_the_configuration_nor_a_driver() {
        // Built from pieces, so that this file's own list does not match.
        let forbidden = [
            ["crate::", "state_store"].concat(),
            ["sqlx", "::"].concat(),
            ["lapin", "::"].concat(),
            ["use ", "sqlx"].concat(),
            ["use ", "lapin"].concat(),
            ["crate::", "config"].concat(),
        ];
        for (file, text) in CORE {
            for (n, line) in text.lines().enumerate() {
                let code = line.trim_start();
                if code.starts_with("//") {
                    continue;
                }
                for word in &forbidden {
                    assert!(
                        !code.contains(word.as_str()),
                        "{file}:{}: {word} in the pure core: {line}",
                        n + 1
                    );
                }
            }
        }
    }
}

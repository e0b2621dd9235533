//! The states of an order and of its steps (contract §3), as stored in the
//! state store and named on the wire.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// An order's `process_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProcessState {
    /// Accepted, waiting for a scheduler (or for `not_before`).
    Pending,
    /// Claimed by a scheduler (`locked_by`); a step is running until `complete_by`.
    Processing,
    /// Every step completed.
    Processed,
    /// Given up and nothing (more) could be compensated: an operator's turn.
    Error,
    /// Undoing completed steps, newest first.
    Compensating,
    /// Every completed step that can be undone was undone.
    Compensated,
}

/// A step's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepState {
    NotStarted,
    /// Dispatched to an agent; its `dispatch_id` fences the reply.
    Running,
    Completed,
    /// Failed permanently.
    Failed,
    /// Its compensation is dispatched (an extension of the contract's list).
    Compensating,
    Compensated,
    /// Passed over: its `when` was false (contract §4d). Satisfies the
    /// steps after it, has no result and nothing to undo.
    Skipped,
}

impl StepState {
    /// Whether the order has gone past the step forward: completed, or
    /// skipped by its condition.
    pub fn passed(self) -> bool {
        matches!(self, Self::Completed | Self::Skipped)
    }
}

macro_rules! names {
    ($ty:ty { $($variant:ident => $name:literal),* $(,)? }) => {
        impl $ty {
            /// The name used in the state store and on the wire.
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $name),* }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
        impl TryFrom<String> for $ty {
            type Error = UnknownState;
            fn try_from(s: String) -> Result<Self, UnknownState> {
                s.parse()
            }
        }
        impl FromStr for $ty {
            type Err = UnknownState;
            fn from_str(s: &str) -> Result<Self, UnknownState> {
                match s {
                    $($name => Ok(Self::$variant),)*
                    other => Err(UnknownState(other.to_owned())),
                }
            }
        }
    };
}

names!(ProcessState {
    Pending => "pending",
    Processing => "processing",
    Processed => "processed",
    Error => "error",
    Compensating => "compensating",
    Compensated => "compensated",
});

names!(StepState {
    NotStarted => "not_started",
    Running => "running",
    Completed => "completed",
    Failed => "failed",
    Compensating => "compensating",
    Compensated => "compensated",
    Skipped => "skipped",
});

/// A state name the code does not know (a newer schema, or a typo).
#[derive(Debug, thiserror::Error)]
#[error("unknown state {0:?}")]
pub struct UnknownState(pub String);

impl ProcessState {
    /// Every state, in the order of an order's life.
    pub const ALL: [Self; 6] = [
        Self::Pending,
        Self::Processing,
        Self::Processed,
        Self::Error,
        Self::Compensating,
        Self::Compensated,
    ];

    /// Whether the order has ended (until an operator's retry).
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Processed | Self::Error | Self::Compensated)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for s in [
            "pending",
            "processing",
            "processed",
            "error",
            "compensating",
            "compensated",
        ] {
            assert_eq!(s.parse::<ProcessState>().unwrap().as_str(), s);
        }
        for s in [
            "not_started",
            "running",
            "completed",
            "failed",
            "compensating",
            "compensated",
            "skipped",
        ] {
            assert_eq!(s.parse::<StepState>().unwrap().as_str(), s);
        }
        assert!("done".parse::<ProcessState>().is_err());
    }
}

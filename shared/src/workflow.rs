//! Workflows: the steps an order runs, compiled from configuration, and the
//! step plan that says what an order does next. Pure: no I/O.

use std::collections::HashSet;
use std::time::Duration;

use crate::config::WorkflowSpec;
use crate::state::StepState;

/// Why a workflow cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkflowError {
    #[error("unknown workflow {0:?}")]
    Unknown(String),
    #[error("workflow {0:?} has no steps")]
    NoSteps(String),
    #[error("workflow {workflow:?} names step {step:?} twice")]
    DuplicateStep { workflow: String, step: String },
    #[error("workflow {workflow:?} step {step:?}: {problem}")]
    BadStep {
        workflow: String,
        step: String,
        problem: &'static str,
    },
}

/// A workflow ready to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workflow {
    pub name: String,
    pub steps: Vec<Step>,
}

/// One step of a workflow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub name: String,
    pub agent: String,
    /// Complete-by of one dispatch, counted from the dispatch.
    pub timeout: Duration,
    /// The agent that undoes this step, if any.
    pub compensate: Option<String>,
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 100
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

impl Workflow {
    /// Checks a configured workflow: at least one step, unique names, usable agents and timeouts.
    pub fn compile(name: &str, spec: &WorkflowSpec) -> Result<Self, WorkflowError> {
        if spec.steps.is_empty() {
            return Err(WorkflowError::NoSteps(name.to_owned()));
        }
        let mut seen = HashSet::new();
        let mut steps = Vec::with_capacity(spec.steps.len());
        for s in &spec.steps {
            let bad = |problem| WorkflowError::BadStep {
                workflow: name.to_owned(),
                step: s.name.clone(),
                problem,
            };
            if !valid_name(&s.name) {
                return Err(bad(
                    "the name must be ASCII letters, digits, '-', '_' or '.'",
                ));
            }
            if !seen.insert(s.name.as_str()) {
                return Err(WorkflowError::DuplicateStep {
                    workflow: name.to_owned(),
                    step: s.name.clone(),
                });
            }
            if !valid_name(&s.agent) || s.compensate.as_deref().is_some_and(|c| !valid_name(c)) {
                return Err(bad(
                    "agent names must be ASCII letters, digits, '-', '_' or '.'",
                ));
            }
            if s.timeout < Duration::from_millis(10) {
                return Err(bad("the timeout must be at least 10ms"));
            }
            steps.push(Step {
                name: s.name.clone(),
                agent: s.agent.clone(),
                timeout: s.timeout,
                compensate: s.compensate.clone(),
            });
        }
        Ok(Self {
            name: name.to_owned(),
            steps,
        })
    }
}

/// What the step plan needs to know of a stored step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepView<'a> {
    pub idx: i32,
    pub state: StepState,
    pub compensate: Option<&'a str>,
}

/// What an order does next, decided from its steps alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Dispatch the step at this index (forward), resuming where the order stopped.
    Run(i32),
    /// Every step completed.
    Finished,
}

/// The next forward step: the first one not completed. Completed steps are never redone.
pub fn next_forward(steps: &[StepView<'_>]) -> Next {
    steps
        .iter()
        .find(|s| s.state != StepState::Completed)
        .map_or(Next::Finished, |s| Next::Run(s.idx))
}

/// The next step to undo: the newest completed (or half-undone) step that has a compensation.
pub fn next_compensation(steps: &[StepView<'_>]) -> Next {
    steps
        .iter()
        .rev()
        .find(|s| {
            s.compensate.is_some()
                && matches!(s.state, StepState::Completed | StepState::Compensating)
        })
        .map_or(Next::Finished, |s| Next::Run(s.idx))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StepSpec;

    fn spec(names: &[&str]) -> WorkflowSpec {
        WorkflowSpec {
            steps: names
                .iter()
                .map(|n| StepSpec {
                    name: (*n).into(),
                    agent: format!("{n}-agent"),
                    timeout: Duration::from_secs(1),
                    compensate: None,
                    retry: None,
                })
                .collect(),
            ..WorkflowSpec::default()
        }
    }

    #[test]
    fn compile_rejects_empty_and_duplicate_steps() {
        assert_eq!(
            Workflow::compile("w", &spec(&[])),
            Err(WorkflowError::NoSteps("w".into()))
        );
        assert!(matches!(
            Workflow::compile("w", &spec(&["a", "a"])),
            Err(WorkflowError::DuplicateStep { .. })
        ));
        assert!(Workflow::compile("w", &spec(&["a", "b c"])).is_err());
        assert_eq!(
            Workflow::compile("w", &spec(&["a", "b"]))
                .unwrap()
                .steps
                .len(),
            2
        );
    }

    fn view(idx: i32, state: StepState, comp: bool) -> StepView<'static> {
        StepView {
            idx,
            state,
            compensate: comp.then_some("undo"),
        }
    }

    #[test]
    fn forward_resumes_at_the_first_incomplete_step() {
        use StepState::*;
        let steps = [
            view(0, Completed, true),
            view(1, Running, true),
            view(2, NotStarted, false),
        ];
        assert_eq!(next_forward(&steps), Next::Run(1));
        let done = [view(0, Completed, true), view(1, Completed, false)];
        assert_eq!(next_forward(&done), Next::Finished);
    }

    #[test]
    fn compensation_goes_newest_first_and_skips_what_cannot_be_undone() {
        use StepState::*;
        let steps = [
            view(0, Completed, true),
            view(1, Completed, false),
            view(2, Failed, true),
        ];
        assert_eq!(next_compensation(&steps), Next::Run(0));
        let steps = [view(0, Completed, true), view(1, Compensated, true)];
        assert_eq!(next_compensation(&steps), Next::Run(0));
        let steps = [view(0, Compensated, true), view(1, NotStarted, true)];
        assert_eq!(next_compensation(&steps), Next::Finished);
    }
}

//! Workflows: the steps an order runs, compiled from configuration, and the
//! step plan that says what an order does next. Pure: no I/O.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::spec::WorkflowSpec;
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
    #[error(
        "workflow {workflow:?} step {step:?} is after {after:?}, which the workflow does not have"
    )]
    UnknownAfter {
        workflow: String,
        step: String,
        after: String,
    },
    #[error(
        "workflow {workflow:?} has a cycle: steps {steps:?} wait for each other and would never start"
    )]
    Cycle {
        workflow: String,
        steps: Vec<String>,
    },
}

/// A workflow ready to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workflow {
    pub name: String,
    pub steps: Vec<Step>,
    /// Its whole definition, which each of its orders keeps until it ends.
    pub definition: std::sync::Arc<crate::spec::Definition>,
    /// The definition's id ([`crate::spec::Definition::id`]).
    pub definition_id: uuid::Uuid,
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
    /// The indices of the steps that must have completed before this one starts.
    pub after: Vec<i32>,
    /// How far `202 Accepted` heartbeats may move its complete-by, from its first dispatch.
    pub max_duration: Duration,
    /// Its `for_each` list (§4d), if it runs once per item.
    pub for_each: Option<crate::expr::Expr>,
}

/// The most items a `for_each` step runs: a longer list fails the step.
pub const MAX_ITEMS: usize = 1000;

/// The most bytes of payload a `for_each` step's requests may carry in
/// all (each item's request carries the order's payload): a longer list of
/// a large payload fails the step rather than flood the broker.
pub const MAX_FAN_OUT_BYTES: usize = 64 << 20;

/// Why a list of `items` items of a step cannot run over `payload`: too
/// many, or too many bytes for the broker in all.
pub fn fan_out_refusal(items: usize, payload: &serde_json::Value) -> Option<String> {
    if items > MAX_ITEMS {
        return Some(format!(
            "{items} items, more than the {MAX_ITEMS} a step may run"
        ));
    }
    let bytes = serde_json::to_vec(payload).map_or(0, |b| b.len());
    (items.saturating_mul(bytes) > MAX_FAN_OUT_BYTES).then(|| {
        format!(
            "{items} items of a payload of {bytes} bytes: more than the {MAX_FAN_OUT_BYTES} bytes the requests of a step may carry"
        )
    })
}

pub use crate::spec::item_of;

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
            let kind = kind_of(s).map_err(bad)?;
            if s.compensate.as_deref().is_some_and(|c| !valid_name(c)) {
                return Err(bad(
                    "agent names must be ASCII letters, digits, '-', '_' or '.'",
                ));
            }
            if s.timeout < Duration::from_millis(10) {
                return Err(bad("the timeout must be at least 10ms"));
            }
            // A wait's complete-by is its end: its timeout is its duration.
            let timeout = s.wait.unwrap_or(s.timeout);
            if kind.agent().is_some() && s.max_duration < s.timeout {
                return Err(bad("max_duration must be at least the timeout"));
            }
            if let Some(problem) = for_each_problem(s, kind) {
                return Err(bad(problem));
            }
            // A child is undone by compensating it, through the same agent.
            let compensate = match kind {
                StepKind::Child(_) => Some(kind.column()),
                _ => s.compensate.clone(),
            };
            steps.push(Step {
                name: s.name.clone(),
                agent: kind.column(),
                timeout,
                compensate,
                after: Vec::new(),
                max_duration: s.max_duration.max(timeout),
                for_each: s.for_each.clone(),
            });
        }
        for (i, s) in spec.steps.iter().enumerate() {
            steps[i].after = match &s.after {
                // A plain list is the sequential workflow: each step after the one before.
                None => i.checked_sub(1).map(idx).into_iter().collect(),
                Some(names) => {
                    let mut after = Vec::with_capacity(names.len());
                    for a in names {
                        let pos =
                            spec.steps
                                .iter()
                                .position(|p| &p.name == a)
                                .ok_or_else(|| WorkflowError::UnknownAfter {
                                    workflow: name.to_owned(),
                                    step: s.name.clone(),
                                    after: a.clone(),
                                })?;
                        if !after.contains(&idx(pos)) {
                            after.push(idx(pos));
                        }
                    }
                    after
                }
            };
        }
        let stuck = never_start(&steps);
        if !stuck.is_empty() {
            return Err(WorkflowError::Cycle {
                workflow: name.to_owned(),
                steps: stuck.into_iter().map(|i| steps[i].name.clone()).collect(),
            });
        }
        let definition = crate::spec::Definition {
            workflow: name.to_owned(),
            spec: spec.clone(),
        };
        Ok(Self {
            name: name.to_owned(),
            steps,
            definition_id: definition.id(),
            definition: std::sync::Arc::new(definition),
        })
    }
}

/// What runs a step. Stored in the step's `agent` column: an agent's name,
/// or, for the steps sas runs itself (§4d), a name no agent can have
/// (agent names have no ':'): `wait:for`, `wait:until`, `signal:<name>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind<'a> {
    /// The agent of this name calls its remote.
    Agent(&'a str),
    /// The step waits: for its timeout, or (`until`) until a time its
    /// definition's expression gives.
    Wait { until: bool },
    /// The step waits for the application's signal of this name.
    Signal(&'a str),
    /// The step runs this workflow as a child order (`workflow:<name>`):
    /// sas's own agent for children takes its requests.
    Child(&'a str),
}

impl<'a> StepKind<'a> {
    /// The kind of a step whose `agent` column holds `column`.
    pub fn of(column: &'a str) -> Self {
        match column.split_once(':') {
            Some(("wait", "until")) => Self::Wait { until: true },
            Some(("wait", _)) => Self::Wait { until: false },
            Some(("signal", name)) => Self::Signal(name),
            Some(("workflow", name)) => Self::Child(name),
            _ => Self::Agent(column),
        }
    }

    /// Whether sas itself holds the step while it is out (a wait, a
    /// signal): nothing is sent, nothing can have been done anywhere.
    pub fn held_by_sas(self) -> bool {
        matches!(self, Self::Wait { .. } | Self::Signal(_))
    }

    /// What the step's `agent` column holds for this kind.
    pub fn column(self) -> String {
        match self {
            Self::Agent(agent) => agent.to_owned(),
            Self::Wait { until: false } => "wait:for".into(),
            Self::Wait { until: true } => "wait:until".into(),
            Self::Signal(name) => format!("signal:{name}"),
            Self::Child(name) => format!("workflow:{name}"),
        }
    }

    /// The agent that runs it, for a step an agent runs.
    pub fn agent(self) -> Option<&'a str> {
        match self {
            Self::Agent(agent) => Some(agent),
            _ => None,
        }
    }
}

/// The kind of step `s` declares: exactly one of `agent`, `wait`, `until`
/// and `signal`; only an agent's step has `compensate` or `retry`.
fn kind_of(s: &crate::spec::StepSpec) -> Result<StepKind<'_>, &'static str> {
    let set = [
        s.agent.is_some(),
        s.wait.is_some(),
        s.until.is_some(),
        s.signal.is_some(),
        s.workflow.is_some(),
    ];
    if s.signal.is_some() && s.agent.is_some() {
        return Err("a signal step has no agent: sas waits for the signal itself");
    }
    match set.iter().filter(|b| **b).count() {
        0 => return Err("a step needs an agent, or is a wait, until, signal or workflow step"),
        1 => {}
        _ => return Err("a step has one of agent, wait, until, signal and workflow"),
    }
    let kind = match (&s.agent, &s.signal, &s.workflow) {
        (Some(agent), _, _) => {
            if !valid_name(agent) {
                return Err("agent names must be ASCII letters, digits, '-', '_' or '.'");
            }
            return Ok(StepKind::Agent(agent));
        }
        (None, Some(name), _) | (None, None, Some(name)) if !valid_name(name) => {
            return Err("signal and workflow names must be ASCII letters, digits, '-', '_' or '.'");
        }
        (None, Some(name), _) => StepKind::Signal(name),
        (None, None, Some(name)) => StepKind::Child(name),
        (None, None, None) => StepKind::Wait {
            until: s.until.is_some(),
        },
    };
    if s.compensate.is_some() || s.retry.is_some() {
        return Err("only a step an agent runs has compensate or retry");
    }
    Ok(kind)
}

/// Why the workflows' child steps cannot work, in one line: a child
/// workflow that is not configured, or workflows that start each other as
/// children (a cycle: an order would never end).
pub fn child_problem(
    workflows: &std::collections::BTreeMap<String, WorkflowSpec>,
) -> Option<String> {
    let children = |name: &str| -> Vec<&str> {
        workflows.get(name).map_or_else(Vec::new, |w| {
            w.steps
                .iter()
                .filter_map(|s| s.workflow.as_deref())
                .collect()
        })
    };
    for (name, spec) in workflows {
        for step in &spec.steps {
            if let Some(child) = &step.workflow
                && !workflows.contains_key(child)
            {
                return Some(format!(
                    "workflow {name:?} step {:?} runs workflow {child:?}, which is not configured",
                    step.name
                ));
            }
        }
    }
    // Depth-first from each workflow: reaching it again is a cycle.
    for start in workflows.keys() {
        let mut path = vec![start.as_str()];
        let mut stack = vec![children(start).into_iter()];
        while let Some(next) = stack.last_mut().map(Iterator::next) {
            match next {
                None => {
                    stack.pop();
                    path.pop();
                }
                Some(child) if child == start => {
                    path.push(child);
                    return Some(format!(
                        "workflows start each other as children and would never end: {}",
                        path.join(" → ")
                    ));
                }
                // Another cycle is found from its own start.
                Some(child) if path.contains(&child) => {}
                Some(child) => {
                    path.push(child);
                    stack.push(children(child).into_iter());
                }
            }
        }
    }
    None
}

/// Why step `s`'s `for_each` cannot work: only an agent's step runs per
/// item; its list is planned when the order is stored, so it may read only
/// `payload`; a constant must be a list; `max_concurrency` goes with it
/// and is at least 1.
fn for_each_problem(s: &crate::spec::StepSpec, kind: StepKind<'_>) -> Option<&'static str> {
    let Some(each) = &s.for_each else {
        return s
            .max_concurrency
            .is_some()
            .then_some("max_concurrency needs a for_each");
    };
    if kind.agent().is_none() {
        return Some("only a step an agent runs has a for_each");
    }
    if s.max_concurrency == Some(0) {
        return Some("max_concurrency must be at least 1");
    }
    let refs = each.references();
    // (A macro's own variables, `items.map(i, …)`, are references too.)
    if refs.iter().any(|r| r == "results") {
        return Some(
            "a for_each may read only payload: its items are planned when the order is stored",
        );
    }
    if refs.is_empty() {
        let empty = serde_json::Map::new();
        let vars = crate::expr::Vars {
            payload: &serde_json::Value::Null,
            results: &empty,
        };
        if !each.eval(vars).is_ok_and(|v| v.is_array()) {
            return Some("the for_each does not give a list");
        }
    }
    None
}

impl Workflow {
    /// The steps an order of `payload` stores: each step as compiled, but a
    /// `for_each` step as one step per item of its list (`<step>:<index>`,
    /// each with the step's agent, undo and `after`; the steps after it
    /// wait for every item). A list that cannot be read, is empty or too
    /// large ([`fan_out_refusal`]) leaves the step whole, and its dispatch
    /// says why (an empty one skips it).
    pub fn plan(&self, payload: &serde_json::Value) -> Vec<Step> {
        if self.steps.iter().all(|s| s.for_each.is_none()) {
            return self.steps.clone();
        }
        let empty = serde_json::Map::new();
        let vars = crate::expr::Vars {
            payload,
            results: &empty,
        };
        let mut rows: Vec<Step> = Vec::with_capacity(self.steps.len());
        // The rows of each step of the workflow, by the step's index.
        let mut rows_of: Vec<Vec<i32>> = Vec::with_capacity(self.steps.len());
        for s in &self.steps {
            let items = s
                .for_each
                .as_ref()
                .and_then(|each| each.eval(vars).ok())
                .and_then(|list| list.as_array().map(Vec::len))
                .filter(|&n| n > 0 && fan_out_refusal(n, payload).is_none());
            let first = rows.len();
            match items {
                Some(n) => rows.extend((0..n).map(|i| Step {
                    name: format!("{}:{i}", s.name),
                    ..s.clone()
                })),
                None => rows.push(s.clone()),
            }
            rows_of.push((first..rows.len()).map(idx).collect());
        }
        for row in &mut rows {
            row.after = row
                .after
                .iter()
                .filter_map(|a| usize::try_from(*a).ok().and_then(|a| rows_of.get(a)))
                .flatten()
                .copied()
                .collect();
        }
        rows
    }
}

/// The step before step `idx` in the list, which a step without `after`
/// follows (none for the first).
pub fn previous(idx: i32) -> Option<i32> {
    (idx > 0).then(|| idx - 1)
}

/// A step's index as stored (workflows have far fewer than 2^31 steps).
fn idx(pos: usize) -> i32 {
    i32::try_from(pos).unwrap_or(i32::MAX)
}

/// The positions of the steps that could never start, because they wait
/// (directly or through others) on themselves: what is left once every
/// step whose `after` steps can all run has been taken, repeatedly (Kahn).
fn never_start(steps: &[Step]) -> Vec<usize> {
    let mut started = vec![false; steps.len()];
    loop {
        let ready: Vec<usize> = (0..steps.len())
            .filter(|&i| {
                !started[i]
                    && steps[i].after.iter().all(|&a| {
                        usize::try_from(a).is_ok_and(|a| started.get(a).copied().unwrap_or(false))
                    })
            })
            .collect();
        if ready.is_empty() {
            break;
        }
        for i in ready {
            started[i] = true;
        }
    }
    (0..steps.len()).filter(|&i| !started[i]).collect()
}

/// What the step plan needs to know of a stored step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepView<'a> {
    pub idx: i32,
    pub state: StepState,
    pub compensate: Option<&'a str>,
    /// The steps it starts after; `None` (steps stored before `after`
    /// existed): the step before it.
    pub after: Option<&'a [i32]>,
    /// When it last finished: for a completed step, when it completed; for
    /// a step in doubt, when its outcome became unknown.
    pub finished_at: Option<DateTime<Utc>>,
    /// Dispatched with no answer that decided it (contract §4c).
    pub in_doubt: bool,
}

impl StepView<'_> {
    /// Whether the step waits on step `idx`.
    fn waits_on(&self, idx: i32) -> bool {
        match self.after {
            Some(after) => after.contains(&idx),
            None => previous(self.idx) == Some(idx),
        }
    }

    /// Whether the step is out with an agent (forward or undo).
    pub fn is_out(&self) -> bool {
        matches!(self.state, StepState::Running | StepState::Compensating)
    }

    /// Whether the step is to be undone when its order gives up (contract
    /// §4c): it has a compensation and it completed, or it is in doubt and
    /// not out (a remote may have applied it). A step that failed
    /// permanently at its only dispatches, or never went out, is left alone.
    pub fn undoable(&self) -> bool {
        self.compensate.is_some()
            && match self.state {
                StepState::Completed => true,
                StepState::NotStarted | StepState::Failed => self.in_doubt,
                _ => false,
            }
    }
}

/// What an order does next, decided from its steps alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Dispatch the steps at these indices, in index order (forward: every
    /// step not completed whose `after` steps all completed; undo: the
    /// newest completed step with a compensation).
    Run(Vec<i32>),
    /// Steps are out with their agents and nothing else can start yet.
    Wait,
    /// Nothing is left to run.
    Finished,
}

/// The next forward steps: every step not passed (completed or skipped)
/// and not running whose `after` steps have all passed. Passed steps are
/// never redone.
pub fn next_forward(steps: &[StepView<'_>]) -> Next {
    if steps.iter().all(|s| s.state.passed()) {
        return Next::Finished;
    }
    let done = |idx: i32| steps.iter().any(|s| s.idx == idx && s.state.passed());
    let ready: Vec<i32> = steps
        .iter()
        .filter(|s| !s.state.passed() && s.state != StepState::Running)
        .filter(|s| {
            steps
                .iter()
                .filter(|p| s.waits_on(p.idx))
                .all(|p| done(p.idx))
        })
        .map(|s| s.idx)
        .collect();
    if ready.is_empty() {
        Next::Wait
    } else {
        Next::Run(ready)
    }
}

/// The next step to undo: none while any step is still out (siblings of a
/// failed step are let finish or time out first); then the newest step
/// completed or in doubt ([`StepView::undoable`]), newest by when it
/// completed or its outcome became unknown (then by index). A step starts
/// only after the steps it waits for completed, so this undoes every path
/// of the graph in the reverse of its dispatch order.
pub fn next_compensation(steps: &[StepView<'_>]) -> Next {
    if steps.iter().any(StepView::is_out) {
        return Next::Wait;
    }
    steps
        .iter()
        .filter(|s| s.undoable())
        .max_by_key(|s| (s.finished_at, s.idx))
        .map_or(Next::Finished, |s| Next::Run(vec![s.idx]))
}

/// The steps by stage, for showing an order's branches: a step's stage is
/// one more than the latest stage of the steps it starts after, so the
/// steps of one stage may run at the same time. Each stage lists its step
/// indices in order; a stage line reads `reserve → charge ∥ notify → ship`.
pub fn stages(steps: &[StepView<'_>]) -> Vec<Vec<i32>> {
    let mut stage: Vec<Option<usize>> = vec![None; steps.len()];
    // At most one pass per step: a workflow is acyclic (checked at compile).
    for _ in 0..steps.len() {
        for (i, s) in steps.iter().enumerate() {
            let before: Option<Vec<usize>> = steps
                .iter()
                .enumerate()
                .filter(|(_, p)| s.waits_on(p.idx))
                .map(|(j, _)| stage[j])
                .collect();
            if let Some(before) = before {
                stage[i] = Some(before.into_iter().max().map_or(0, |m| m + 1));
            }
        }
    }
    let mut out: Vec<Vec<i32>> = Vec::new();
    for (s, st) in steps.iter().zip(stage) {
        // A step on a cycle (never stored) shows last rather than not at all.
        let st = st.unwrap_or(steps.len());
        if out.len() <= st {
            out.resize(st + 1, Vec::new());
        }
        out[st].push(s.idx);
    }
    out.retain(|stage| !stage.is_empty());
    out
}

/// Whether anything completed or in doubt is left to undo, now or once
/// the steps still out have answered.
pub fn anything_to_undo(steps: &[StepView<'_>]) -> bool {
    steps.iter().any(|s| {
        s.undoable()
            || (s.compensate.is_some()
                && matches!(s.state, StepState::Compensating | StepState::Running))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::StepSpec;

    fn spec(names: &[&str]) -> WorkflowSpec {
        WorkflowSpec {
            steps: names
                .iter()
                .map(|n| StepSpec {
                    name: (*n).into(),
                    agent: Some(format!("{n}-agent")),
                    wait: None,
                    until: None,
                    signal: None,
                    workflow: None,
                    for_each: None,
                    max_concurrency: None,
                    timeout: Duration::from_secs(1),
                    compensate: None,
                    retry: None,
                    after: None,
                    max_duration: Duration::from_secs(3600),
                    when: None,
                    input: None,
                })
                .collect(),
            ..WorkflowSpec::default()
        }
    }

    #[test]
    fn a_step_is_one_of_agent_wait_until_and_signal_and_only_an_agents_step_is_undone() {
        let compile = |steps: serde_json::Value| {
            let spec: WorkflowSpec =
                serde_json::from_value(serde_json::json!({ "steps": steps })).expect("spec");
            Workflow::compile("w", &spec)
        };
        let problem = |steps| match compile(steps) {
            Err(WorkflowError::BadStep { problem, .. }) => problem,
            other => panic!("{other:?}"),
        };
        use serde_json::json;
        assert!(
            problem(json!([{ "name": "a", "signal": "ok", "agent": "x" }])).contains("no agent")
        );
        assert!(problem(json!([{ "name": "a" }])).contains("needs an agent"));
        assert!(
            problem(json!([{ "name": "a", "wait": "1s", "until": "payload.t" }]))
                .contains("one of")
        );
        assert!(
            problem(json!([{ "name": "a", "wait": "1s", "compensate": "u" }]))
                .contains("compensate")
        );
        assert!(
            problem(json!([{ "name": "a", "signal": "a b" }]))
                .contains("signal and workflow names")
        );
        let w = compile(json!([
            { "name": "a", "agent": "x" },
            { "name": "b", "wait": "10m" },
            { "name": "c", "until": "payload.t" },
            { "name": "d", "signal": "approval", "timeout": "24h" },
        ]))
        .expect("compiles");
        let kinds: Vec<_> = w.steps.iter().map(|s| StepKind::of(&s.agent)).collect();
        assert_eq!(
            kinds,
            [
                StepKind::Agent("x"),
                StepKind::Wait { until: false },
                StepKind::Wait { until: true },
                StepKind::Signal("approval")
            ]
        );
        assert_eq!(w.steps[1].timeout, Duration::from_secs(600), "a wait's end");
        assert_eq!(w.steps[3].timeout, Duration::from_secs(24 * 3600));
        // An expression that does not compile is refused as the
        // configuration is read.
        let bad: Result<WorkflowSpec, _> =
            serde_json::from_value(json!({ "steps": [{ "name": "c", "until": "payload." }] }));
        assert!(bad.is_err());
    }

    #[test]
    fn a_child_workflow_step_is_undone_through_its_own_agent_and_unknown_children_or_cycles_are_refused()
     {
        use serde_json::json;
        let spec = |steps: serde_json::Value| -> WorkflowSpec {
            serde_json::from_value(json!({ "steps": steps })).expect("spec")
        };
        let w = Workflow::compile(
            "p",
            &spec(json!([{ "name": "ship", "workflow": "shipping" }])),
        )
        .expect("compiles");
        assert_eq!(StepKind::of(&w.steps[0].agent), StepKind::Child("shipping"));
        assert_eq!(w.steps[0].compensate.as_deref(), Some("workflow:shipping"));
        assert!(!StepKind::Child("x").held_by_sas());
        assert!(
            Workflow::compile(
                "p",
                &spec(json!([{ "name": "s", "workflow": "q", "compensate": "u" }]))
            )
            .is_err()
        );
        let mut all = std::collections::BTreeMap::new();
        all.insert(
            "p".to_owned(),
            spec(json!([{ "name": "s", "workflow": "q" }])),
        );
        assert!(child_problem(&all).is_some_and(|p| p.contains("not configured")));
        all.insert("q".to_owned(), spec(json!([{ "name": "t", "agent": "a" }])));
        assert_eq!(child_problem(&all), None, "p runs q: fine");
        all.insert(
            "r".to_owned(),
            spec(json!([{ "name": "u", "workflow": "r" }])),
        );
        assert!(
            child_problem(&all).is_some_and(|p| p.ends_with("r → r")),
            "itself"
        );
        all.remove("r");
        all.insert(
            "q".to_owned(),
            spec(json!([{ "name": "t", "workflow": "s" }])),
        );
        all.insert(
            "s".to_owned(),
            spec(json!([{ "name": "v", "workflow": "p" }])),
        );
        let cycle = child_problem(&all).unwrap_or_default();
        assert!(cycle.contains("p → q → s → p"), "{cycle}");
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

    fn with_after(mut spec: WorkflowSpec, after: &[(&str, &[&str])]) -> WorkflowSpec {
        for (step, names) in after {
            if let Some(s) = spec.steps.iter_mut().find(|s| s.name == *step) {
                s.after = Some(names.iter().map(|n| (*n).to_owned()).collect());
            }
        }
        spec
    }

    #[test]
    fn after_names_the_steps_a_step_waits_for_and_a_plain_list_is_sequential() {
        let plain = Workflow::compile("w", &spec(&["a", "b", "c"])).unwrap();
        let after: Vec<_> = plain.steps.iter().map(|s| s.after.clone()).collect();
        assert_eq!(after, [vec![], vec![0], vec![1]]);
        let diamond = with_after(
            spec(&["reserve", "charge", "notify", "ship"]),
            &[("notify", &["reserve"]), ("ship", &["charge", "notify"])],
        );
        let diamond = Workflow::compile("w", &diamond).unwrap();
        let after: Vec<_> = diamond.steps.iter().map(|s| s.after.clone()).collect();
        assert_eq!(after, [vec![], vec![0], vec![0], vec![1, 2]]);
    }

    #[test]
    fn unknown_names_and_cycles_are_refused_with_one_line() {
        let unknown = with_after(spec(&["a", "b"]), &[("b", &["nope"])]);
        let err = Workflow::compile("w", &unknown).unwrap_err();
        assert_eq!(
            err.to_string(),
            "workflow \"w\" step \"b\" is after \"nope\", which the workflow does not have"
        );
        let cycle = with_after(spec(&["a", "b", "c"]), &[("a", &["c"])]);
        let err = Workflow::compile("w", &cycle).unwrap_err();
        assert_eq!(
            err,
            WorkflowError::Cycle {
                workflow: "w".into(),
                steps: vec!["a".into(), "b".into(), "c".into()],
            }
        );
        assert!(!err.to_string().contains('\n'));
        let own = with_after(spec(&["a", "b"]), &[("b", &["b"])]);
        assert!(matches!(
            Workflow::compile("w", &own),
            Err(WorkflowError::Cycle { steps, .. }) if steps == ["b"]
        ));
        // Unreachable behind a cycle: c waits on the cycle a ⇄ b.
        let behind = with_after(spec(&["a", "b", "c"]), &[("a", &["b"])]);
        assert!(matches!(
            Workflow::compile("w", &behind),
            Err(WorkflowError::Cycle { steps, .. }) if steps == ["a", "b", "c"]
        ));
    }

    #[test]
    fn ready_steps_start_together_and_a_join_waits_for_all() {
        use StepState::*;
        let after: [&[i32]; 4] = [&[], &[0], &[0], &[1, 2]];
        let steps = |states: [StepState; 4]| -> Vec<StepView<'static>> {
            states
                .iter()
                .zip(after)
                .enumerate()
                .map(|(i, (state, after))| StepView {
                    idx: i as i32,
                    state: *state,
                    compensate: Some("undo"),
                    after: Some(after),
                    finished_at: None,
                    in_doubt: false,
                })
                .collect()
        };
        assert_eq!(next_forward(&steps([NotStarted; 4])), Next::Run(vec![0]));
        let split = steps([Completed, NotStarted, NotStarted, NotStarted]);
        assert_eq!(next_forward(&split), Next::Run(vec![1, 2]));
        let half = steps([Completed, Completed, Running, NotStarted]);
        assert_eq!(next_forward(&half), Next::Wait);
        let joined = steps([Completed, Completed, Completed, NotStarted]);
        assert_eq!(next_forward(&joined), Next::Run(vec![3]));
        // While a sibling runs, nothing is undone yet.
        let giving_up = steps([Completed, Failed, Running, NotStarted]);
        assert_eq!(next_compensation(&giving_up), Next::Wait);
        assert!(anything_to_undo(&giving_up));
    }

    #[test]
    fn stages_group_the_steps_that_may_run_together() {
        let after: [&[i32]; 4] = [&[], &[0], &[0], &[1, 2]];
        let steps: Vec<StepView<'static>> = after
            .iter()
            .enumerate()
            .map(|(i, after)| StepView {
                idx: i as i32,
                state: StepState::NotStarted,
                compensate: None,
                after: Some(after),
                finished_at: None,
                in_doubt: false,
            })
            .collect();
        assert_eq!(stages(&steps), [vec![0], vec![1, 2], vec![3]]);
        let plain = [
            view(0, StepState::Completed, false),
            view(1, StepState::NotStarted, false),
        ];
        assert_eq!(stages(&plain), [vec![0], vec![1]]);
    }

    fn view(idx: i32, state: StepState, comp: bool) -> StepView<'static> {
        StepView {
            idx,
            state,
            compensate: comp.then_some("undo"),
            after: None,
            finished_at: None,
            in_doubt: false,
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
        assert_eq!(next_forward(&steps), Next::Wait, "step 1 is out");
        let steps = [
            view(0, Completed, true),
            view(1, Failed, true),
            view(2, NotStarted, false),
        ];
        assert_eq!(next_forward(&steps), Next::Run(vec![1]));
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
        assert_eq!(next_compensation(&steps), Next::Run(vec![0]));
        let steps = [view(0, Completed, true), view(1, Compensated, true)];
        assert_eq!(next_compensation(&steps), Next::Run(vec![0]));
        let steps = [view(0, Completed, true), view(1, Compensating, true)];
        assert_eq!(next_compensation(&steps), Next::Wait, "one undo at a time");
        let steps = [view(0, Compensated, true), view(1, NotStarted, true)];
        assert_eq!(next_compensation(&steps), Next::Finished);
    }
}

//! The pattern's records: an order and its steps as the rules decide on
//! them. Plain data, no I/O: the state store reads its rows into these
//! types and writes them back (`sas::state_store`, the crate `sas-store`), and nothing here
//! knows SQL.

use chrono::{DateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

use crate::messages::Events;
use crate::state::{ProcessState, StepState};
use crate::workflow::StepView;

/// An order row.
#[derive(Debug, Clone, PartialEq)]
pub struct OrderRow {
    pub order_id: Uuid,
    pub workflow: String,
    pub payload: Value,
    pub reply_to: Option<String>,
    pub priority: i16,
    pub not_before: Option<DateTime<Utc>>,
    pub process_state: ProcessState,
    pub locked_by: Option<String>,
    pub complete_by: Option<DateTime<Utc>>,
    pub failure_count: i32,
    pub compensation_failures: i32,
    pub last_seq: i32,
    pub last_error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// The W3C trace id every hop of this order reports.
    pub trace_id: Option<String>,
    /// The span id of the order's root span (its submission), which the
    /// spans of its transitions are children of when spans are exported.
    pub trace_span: Option<String>,
    /// The agent whose breaker the order waits for (contract §8), if held.
    pub held_for: Option<String>,
    /// When it was held.
    pub held_since: Option<DateTime<Utc>>,
    /// When a hold that lasts is handled as a failure (the agent's `max_hold`).
    pub hold_until: Option<DateTime<Utc>>,
    /// Why it is held: `breaker_open`, `forced_open` or `rate_limited`.
    pub held_reason: Option<String>,
    /// How many times an operator redrove the order (contract §9): its
    /// steps' idempotency keys carry `:r<N>` from the first.
    pub redrives: i32,
    /// Which status events it is sent (contract §2a).
    pub events: Events,
    /// The application that submitted it (contract §1b), if applications
    /// are configured.
    pub application: Option<String>,
    /// The id the application gave it, which its status events say; the
    /// stored id is in the application's namespace.
    pub app_order_id: Option<Uuid>,
    /// The definition it runs under until it ends
    /// ([`crate::spec::Definition`]); `None` for orders stored before
    /// definitions were kept, which follow the configuration.
    pub definition: Option<Uuid>,
}

impl OrderRow {
    /// `order` as it is first stored: `pending`, nothing run, at `now`,
    /// under no definition yet.
    pub fn pending(order: &NewOrder, now: DateTime<Utc>) -> Self {
        Self {
            order_id: order.order_id,
            workflow: order.workflow.clone(),
            payload: order.payload.clone(),
            reply_to: order.reply_to.clone(),
            priority: order.priority,
            not_before: order.not_before,
            process_state: ProcessState::Pending,
            locked_by: None,
            complete_by: None,
            failure_count: 0,
            compensation_failures: 0,
            last_seq: 0,
            last_error: None,
            created_at: now,
            updated_at: now,
            trace_id: order.trace_id.clone(),
            held_for: None,
            held_since: None,
            hold_until: None,
            held_reason: None,
            trace_span: order.trace_span.clone(),
            redrives: 0,
            events: order.events,
            application: order.application.clone(),
            app_order_id: order.app_order_id,
            definition: None,
        }
    }

    /// The id its status events carry: the application's own (contract §1b).
    pub fn public_id(&self) -> Uuid {
        self.app_order_id.unwrap_or(self.order_id)
    }

    /// The attempt now running or coming: 1 + failure count.
    pub fn attempt(&self) -> i32 {
        self.failure_count + 1
    }

    /// The row as operators' tools show it (`sasctl orders show --json`,
    /// the dashboard's order page).
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "order_id": self.order_id,
            "workflow": self.workflow,
            "state": self.process_state.as_str(),
            "payload": self.payload,
            "reply_to": self.reply_to,
            "priority": self.priority,
            "not_before": time(self.not_before.as_ref()),
            "events": self.events.as_str(),
            "locked_by": self.locked_by,
            "complete_by": time(self.complete_by.as_ref()),
            "failure_count": self.failure_count,
            "compensation_failures": self.compensation_failures,
            "attempt": self.attempt(),
            "last_seq": self.last_seq,
            "last_error": self.last_error,
            "redrives": self.redrives,
            "trace_id": self.trace_id,
            "definition": self.definition,
            "created_at": time(Some(&self.created_at)),
            "updated_at": time(Some(&self.updated_at)),
        })
    }
}

/// A time as operators' tools show it: RFC 3339, UTC.
fn time(t: Option<&DateTime<Utc>>) -> Option<String> {
    t.map(crate::messages::rfc3339::format)
}

/// An accepted order, ready to be stored.
#[derive(Debug, Clone)]
pub struct NewOrder {
    pub order_id: Uuid,
    pub workflow: String,
    pub payload: Value,
    pub reply_to: Option<String>,
    pub priority: i16,
    pub not_before: Option<DateTime<Utc>>,
    pub trace_id: Option<String>,
    /// The span id of its submission's span (see [`OrderRow::trace_span`]).
    pub trace_span: Option<String>,
    /// Which status events it is sent (contract §2a).
    pub events: Events,
    /// See [`OrderRow::application`].
    pub application: Option<String>,
    /// See [`OrderRow::app_order_id`].
    pub app_order_id: Option<Uuid>,
}

impl NewOrder {
    /// An order of `workflow` with `payload` under `order_id`; every other
    /// field at its default (no reply queue, priority 0, no trace, every
    /// event, no application).
    pub fn new(order_id: Uuid, workflow: impl Into<String>, payload: Value) -> Self {
        Self {
            order_id,
            workflow: workflow.into(),
            payload,
            reply_to: None,
            priority: 0,
            not_before: None,
            trace_id: None,
            trace_span: None,
            events: Events::All,
            application: None,
            app_order_id: None,
        }
    }
}

/// A step row.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct StepRow {
    pub order_id: Uuid,
    pub idx: i32,
    pub name: String,
    pub agent: String,
    pub compensate: Option<String>,
    pub timeout_ms: i64,
    pub state: StepState,
    pub dispatches: i32,
    pub dispatch_id: Option<Uuid>,
    pub complete_by: Option<DateTime<Utc>>,
    pub result: Option<Value>,
    pub error: Option<String>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    /// Rungs of the deadline ladder its current dispatch was warned of.
    pub warned: i16,
    /// The indices of the steps it starts after (§4b); `None` for steps
    /// stored before workflows had `after`: the step before it.
    #[serde(default)]
    pub after_steps: Option<Vec<i32>>,
    /// How far `202` heartbeats may move its complete-by from its first
    /// dispatch (§4b); `None` for steps stored before: [`DEFAULT_MAX_DURATION_MS`].
    #[serde(default)]
    pub max_duration_ms: Option<i64>,
    /// Dispatched, and no answer decided it (contract §4c): a remote may
    /// have applied it, so it is undone with the completed steps.
    #[serde(default)]
    pub in_doubt: bool,
    /// Its undo went out and no answer decided it: the remote may have
    /// undone it. It is undone again before a retry or redrive may go on.
    #[serde(default)]
    pub undo_in_doubt: bool,
}

/// A step's `max_duration` when its row has none: an hour.
pub const DEFAULT_MAX_DURATION_MS: i64 = 3_600_000;

impl StepRow {
    /// Step `idx` of a new order, as its workflow plans it: not started.
    pub fn planned(order_id: Uuid, idx: i32, step: &crate::workflow::Step) -> Self {
        Self {
            order_id,
            idx,
            name: step.name.clone(),
            agent: step.agent.clone(),
            compensate: step.compensate.clone(),
            timeout_ms: i64::try_from(step.timeout.as_millis()).unwrap_or(i64::MAX),
            state: StepState::NotStarted,
            dispatches: 0,
            dispatch_id: None,
            complete_by: None,
            result: None,
            error: None,
            started_at: None,
            finished_at: None,
            warned: 0,
            after_steps: Some(step.after.clone()),
            max_duration_ms: Some(i64::try_from(step.max_duration.as_millis()).unwrap_or(i64::MAX)),
            in_doubt: false,
            undo_in_doubt: false,
        }
    }

    /// The agent whose answer the step waits for while it is out: its own
    /// while `running`, its undo's while `compensating`; `None` otherwise.
    /// For a step sas runs itself, its `agent` column ([`Self::kind`]):
    /// no breaker or flow control knows it.
    pub fn out_with(&self) -> Option<&str> {
        match self.state {
            StepState::Running => Some(self.agent.as_str()),
            StepState::Compensating => self.compensate.as_deref(),
            _ => None,
        }
    }

    /// What runs it (§4d): an agent, or sas itself (a wait, a signal).
    pub fn kind(&self) -> crate::workflow::StepKind<'_> {
        crate::workflow::StepKind::of(&self.agent)
    }

    /// The indices of the steps it starts after.
    pub fn after(&self) -> Vec<i32> {
        match &self.after_steps {
            Some(after) => after.clone(),
            None => crate::workflow::previous(self.idx).into_iter().collect(),
        }
    }

    /// The latest complete-by a `202` heartbeat may give it: its first
    /// dispatch plus its `max_duration` (none before its first dispatch).
    pub fn max_complete_by(&self) -> Option<DateTime<Utc>> {
        let max = self.max_duration_ms.unwrap_or(DEFAULT_MAX_DURATION_MS);
        self.started_at?
            .checked_add_signed(chrono::Duration::milliseconds(max))
    }

    /// The row as operators' tools show it, among `steps` (its order's).
    pub fn to_json(&self, steps: &[StepRow]) -> Value {
        use crate::workflow::StepKind;
        // What runs it (§4d): an agent, a wait, or a signal (its name).
        let (kind, signal) = match self.kind() {
            StepKind::Agent(_) => ("agent", None),
            StepKind::Wait { .. } => ("wait", None),
            StepKind::Signal(name) => ("signal", Some(name)),
            StepKind::Child(_) => ("workflow", None),
        };
        serde_json::json!({
            "idx": self.idx,
            "name": self.name,
            "after": self.after_names(steps),
            "kind": kind,
            "signal": signal,
            "agent": self.agent,
            "compensate": self.compensate,
            "timeout_ms": self.timeout_ms,
            "state": self.state.as_str(),
            "dispatches": self.dispatches,
            "dispatch_id": self.dispatch_id,
            "complete_by": time(self.complete_by.as_ref()),
            "result": self.result,
            "error": self.error,
            "started_at": time(self.started_at.as_ref()),
            "finished_at": time(self.finished_at.as_ref()),
        })
    }

    /// The names of the steps it starts after, among `steps` (its order's).
    pub fn after_names(&self, steps: &[StepRow]) -> Vec<String> {
        self.after()
            .iter()
            .filter_map(|i| steps.iter().find(|s| s.idx == *i))
            .map(|s| s.name.clone())
            .collect()
    }

    /// What the step plan needs of this row.
    pub fn view(&self) -> StepView<'_> {
        StepView {
            idx: self.idx,
            state: self.state,
            compensate: self.compensate.as_deref(),
            after: self.after_steps.as_deref(),
            finished_at: self.finished_at,
            in_doubt: self.in_doubt,
        }
    }
}

/// An order's step names by stage ([`crate::workflow::stages`]): the
/// branches, as `sasctl` and the dashboard show them.
pub fn stage_names(steps: &[StepRow]) -> Vec<Vec<String>> {
    let views: Vec<_> = steps.iter().map(StepRow::view).collect();
    crate::workflow::stages(&views)
        .into_iter()
        .map(|stage| {
            stage
                .iter()
                .filter_map(|i| steps.iter().find(|s| s.idx == *i))
                .map(|s| s.name.clone())
                .collect()
        })
        .collect()
}

//! The transitions of an order, each one transaction: submit, claim, apply a
//! step's reply, and recover an expired order. Status events, step requests
//! and alerts are queued in the outbox inside the same transaction.

use chrono::{DateTime, Utc};
use serde_json::{Map, Value, json};
use sqlx::PgConnection;
use uuid::Uuid;

use super::events::{self, Event};
use super::orders::{self, NewOrder, OrderRow};
use super::outbox;
use super::steps::{self, StepRow};
use super::{StateStore, StoreError, WAKE_CHANNEL};
use crate::config::SupervisorSettings;
use crate::messages::{Alert, Direction, EventKind, StepOutcome, StepReply, StepRequest};
use crate::state::{ProcessState, StepState};
use crate::topology::QueueNames;
use crate::workflow::{self, Next, Workflow};

/// Who makes a transition: written to the event log and, for schedulers, to `locked_by`.
#[derive(Debug, Clone)]
pub struct Actor {
    /// E.g. `submission`, `scheduler-3f2a…`, `supervisor-91c0…`.
    pub name: String,
}

impl Actor {
    /// An actor of that kind with a fresh instance id, e.g. `scheduler-0190c5…`.
    pub fn new_instance(kind: &str) -> Self {
        Self {
            name: format!("{kind}-{}", Uuid::now_v7().simple()),
        }
    }
}

/// How a submission ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Submitted {
    /// A new order was stored.
    Created,
    /// An order with this id exists; nothing changed.
    Duplicate,
}

/// How a reply ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyOutcome {
    /// The reply moved the order on; `ended` says how, if the order ended,
    /// `age` is the time since it was submitted.
    Applied {
        ended: Option<ProcessState>,
        age: std::time::Duration,
    },
    /// The reply answers a dispatch that no longer counts; nothing changed.
    Stale(String),
}

/// An expired order the supervisor recovered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expired {
    /// Put back for another attempt at that time.
    Requeued {
        order_id: Uuid,
        not_before: DateTime<Utc>,
    },
    /// Given up: compensating, or ended (`error`) when there was nothing to undo.
    GaveUp {
        order_id: Uuid,
        ended: Option<ProcessState>,
    },
}

/// How an operator's action ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Operated {
    /// Done; the order is now in this state.
    Done(ProcessState),
    /// No such order.
    NotFound,
    /// The action is not allowed: the order's state, and why.
    NotAllowed(ProcessState, &'static str),
}

/// The transitions, bound to a state store and the queue names of a deployment.
#[derive(Clone, Debug)]
pub struct Transitions {
    store: StateStore,
    queues: QueueNames,
}

impl Transitions {
    /// Transitions over `store`, routing messages to the queues of `queues`.
    pub fn new(store: StateStore, queues: QueueNames) -> Self {
        Self { store, queues }
    }

    /// The state store underneath.
    pub fn store(&self) -> &StateStore {
        &self.store
    }

    /// Stores a new order, its steps and its `received` event in one
    /// transaction, and wakes the schedulers. An existing id changes nothing.
    pub async fn submit(
        &self,
        order: &NewOrder,
        workflow: &Workflow,
    ) -> Result<Submitted, StoreError> {
        let mut tx = self.store.pool().begin().await?;
        if !orders::insert(&mut tx, order).await? {
            return Ok(Submitted::Duplicate);
        }
        steps::insert_all(&mut tx, order.order_id, &workflow.steps).await?;
        let event = Event {
            kind: EventKind::Received,
            from: None,
            to: ProcessState::Pending,
            step: None,
            attempt: 1,
            actor: "submission",
            reason: None,
            detail: json!({ "workflow": workflow.name, "priority": order.priority }),
        };
        events::append(&mut tx, order.order_id, &event).await?;
        wake(&mut tx).await?;
        tx.commit().await?;
        Ok(Submitted::Created)
    }

    /// Claims up to `limit` orders for `me` and dispatches each one's next
    /// step, all in one transaction. Returns the claimed orders' ids.
    pub async fn claim(&self, me: &Actor, limit: u32) -> Result<Vec<Uuid>, StoreError> {
        let mut tx = self.store.pool().begin().await?;
        let claimed = orders::claim(&mut tx, &me.name, i64::from(limit)).await?;
        if claimed.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<Uuid> = claimed.iter().map(|o| o.order_id).collect();
        let all_steps = steps::for_orders(&mut tx, &ids).await?;
        for order in &claimed {
            let mut steps: Vec<StepRow> = all_steps
                .iter()
                .filter(|s| s.order_id == order.order_id)
                .cloned()
                .collect();
            if order.process_state == ProcessState::Processing {
                let event = Event {
                    kind: EventKind::Processing,
                    from: Some(ProcessState::Pending),
                    to: ProcessState::Processing,
                    step: None,
                    attempt: order.attempt(),
                    actor: &me.name,
                    reason: None,
                    detail: json!({ "locked_by": me.name }),
                };
                events::append(&mut tx, order.order_id, &event).await?;
            }
            self.advance(&mut tx, order, &mut steps, me).await?;
        }
        tx.commit().await?;
        Ok(ids)
    }

    /// Applies an agent's reply, guarded by the order's state, its lock holder,
    /// its attempt and the step's current dispatch; then dispatches what comes
    /// next. `me` takes over the order's lock.
    pub async fn apply_reply(
        &self,
        me: &Actor,
        reply: &StepReply,
    ) -> Result<ReplyOutcome, StoreError> {
        let mut tx = self.store.pool().begin().await?;
        let Some(mut order) = orders::lock(&mut tx, reply.order_id).await? else {
            return Ok(ReplyOutcome::Stale("unknown order".into()));
        };
        let (expect_order, expect_step, done) = match reply.direction {
            Direction::Forward => (
                ProcessState::Processing,
                StepState::Running,
                StepState::Completed,
            ),
            Direction::Compensate => (
                ProcessState::Compensating,
                StepState::Compensating,
                StepState::Compensated,
            ),
        };
        if order.process_state != expect_order {
            return Ok(ReplyOutcome::Stale(format!(
                "order is {}",
                order.process_state
            )));
        }
        if order.locked_by.as_deref() != Some(reply.locked_by.as_str()) {
            return Ok(ReplyOutcome::Stale("order is held by another claim".into()));
        }
        if reply.direction == Direction::Forward && order.attempt() != reply.attempt {
            return Ok(ReplyOutcome::Stale(format!(
                "attempt {} was superseded by attempt {}",
                reply.attempt,
                order.attempt()
            )));
        }
        let mut steps = steps::for_orders(&mut tx, &[order.order_id]).await?;
        let Some(pos) = steps
            .iter()
            .position(|s| s.idx == reply.step_index && s.name == reply.step)
        else {
            return Ok(ReplyOutcome::Stale("unknown step".into()));
        };
        let (to, result, error) = match (&reply.outcome, reply.direction) {
            (StepOutcome::Succeeded { result }, Direction::Forward) => (done, Some(result), None),
            (StepOutcome::Succeeded { .. }, Direction::Compensate) => (done, None, None),
            (StepOutcome::Failed { error }, Direction::Forward) => {
                (StepState::Failed, None, Some(error.as_str()))
            }
            // An undo that failed leaves the step done and not undone.
            (StepOutcome::Failed { error }, Direction::Compensate) => {
                (StepState::Completed, None, Some(error.as_str()))
            }
        };
        let finish = steps::Finish {
            idx: reply.step_index,
            expected: expect_step,
            dispatch_id: reply.dispatch_id,
            to,
            result,
            error,
        };
        let applied = steps::finish(&mut tx, order.order_id, &finish).await?;
        if !applied {
            return Ok(ReplyOutcome::Stale("the dispatch was superseded".into()));
        }
        steps[pos].state = to;
        if let Some(r) = result {
            steps[pos].result = Some(r.clone());
        }
        // Take over the claim: whoever applies the reply drives the order on.
        must_transition(
            &mut tx,
            order.order_id,
            expect_order,
            Some(&reply.locked_by),
            expect_order,
            Some(&me.name),
            None,
        )
        .await?;
        order.locked_by = Some(me.name.clone());
        let ended = match (&reply.outcome, reply.direction) {
            (StepOutcome::Succeeded { result }, Direction::Forward) => {
                let event = Event {
                    kind: EventKind::StepSucceeded,
                    from: Some(ProcessState::Processing),
                    to: ProcessState::Processing,
                    step: Some(&reply.step),
                    attempt: order.attempt(),
                    actor: &me.name,
                    reason: None,
                    detail: json!({ "result": result }),
                };
                events::append(&mut tx, order.order_id, &event).await?;
                self.advance(&mut tx, &order, &mut steps, me).await?
            }
            (StepOutcome::Succeeded { .. }, Direction::Compensate) => {
                self.advance(&mut tx, &order, &mut steps, me).await?
            }
            (StepOutcome::Failed { error }, Direction::Forward) => {
                let reason = format!("step {} failed permanently: {error}", reply.step);
                self.give_up(&mut tx, &order, &mut steps, &reason, me, Some(me))
                    .await?
            }
            (StepOutcome::Failed { error }, Direction::Compensate) => {
                let reason = format!(
                    "compensation of step {} failed permanently: {error}",
                    reply.step
                );
                self.fail(&mut tx, &order, &reason, me).await?
            }
        };
        tx.commit().await?;
        let age = (Utc::now() - order.created_at).to_std().unwrap_or_default();
        Ok(ReplyOutcome::Applied { ended, age })
    }

    /// Recovers orders whose complete-by has passed: counts the failure and
    /// either re-queues the order after the retry schedule's wait or gives it up.
    /// Knows nothing of the steps' business: only deadlines and counts.
    pub async fn recover_expired(
        &self,
        me: &Actor,
        settings: &SupervisorSettings,
    ) -> Result<Vec<Expired>, StoreError> {
        let mut tx = self.store.pool().begin().await?;
        let expired = orders::expired(&mut tx, i64::from(settings.batch)).await?;
        let mut recovered = Vec::with_capacity(expired.len());
        let mut wake_now = false;
        for order in expired {
            steps::withdraw_running(&mut tx, order.order_id).await?;
            let compensating = order.process_state == ProcessState::Compensating;
            let failures = if compensating {
                order.compensation_failures
            } else {
                order.failure_count
            } + 1;
            let failures_u32 = u32::try_from(failures).unwrap_or(u32::MAX);
            let late = format!(
                "complete-by passed ({failures} of {} allowed)",
                settings.max_failures
            );
            if failures_u32 >= settings.max_failures {
                orders::count_failure(&mut tx, &order).await?;
                let mut order = order;
                let ended = if compensating {
                    order.compensation_failures = failures;
                    let reason = format!("compensation could not complete: {late}");
                    self.fail(&mut tx, &order, &reason, me).await?
                } else {
                    order.failure_count = failures;
                    let mut steps = steps::for_orders(&mut tx, &[order.order_id]).await?;
                    wake_now = true;
                    self.give_up(&mut tx, &order, &mut steps, &late, me, None)
                        .await?
                };
                recovered.push(Expired::GaveUp {
                    order_id: order.order_id,
                    ended,
                });
                continue;
            }
            let delay = settings.retry_delay(failures_u32);
            let delay_ms = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
            wake_now |= delay_ms == 0;
            let to = if compensating {
                ProcessState::Compensating
            } else {
                ProcessState::Pending
            };
            let Some(not_before) =
                orders::requeue_after_failure(&mut tx, &order, to, delay_ms).await?
            else {
                continue;
            };
            let event = Event {
                kind: EventKind::RetryScheduled,
                from: Some(order.process_state),
                to,
                step: None,
                attempt: if compensating {
                    order.attempt()
                } else {
                    failures + 1
                },
                actor: &me.name,
                reason: Some(&late),
                detail: json!({
                    "next_attempt_at": crate::messages::rfc3339::format(&not_before),
                    "failure_count": if compensating { order.failure_count } else { failures },
                    "compensation": compensating,
                    "error": late,
                }),
            };
            events::append(&mut tx, order.order_id, &event).await?;
            recovered.push(Expired::Requeued {
                order_id: order.order_id,
                not_before,
            });
            crate::crash::point("supervisor.mid_sweep");
        }
        if wake_now {
            wake(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(recovered)
    }

    /// An operator's retry of an `error` order: back to `pending` with its
    /// failure counts reset; it resumes at its first incomplete step (the
    /// failed one runs again, completed ones do not).
    ///
    /// An order some of whose steps were already undone is not retried: its
    /// steps' idempotency keys are spent, so a remote that deduplicates would
    /// replay the old answer instead of doing the step again. `cancel` finishes
    /// its undo instead.
    pub async fn retry(&self, operator: &Actor, order_id: Uuid) -> Result<Operated, StoreError> {
        let mut tx = self.store.pool().begin().await?;
        let Some(order) = orders::lock(&mut tx, order_id).await? else {
            return Ok(Operated::NotFound);
        };
        if order.process_state != ProcessState::Error {
            return Ok(Operated::NotAllowed(
                order.process_state,
                "only error orders can be retried",
            ));
        }
        let steps = steps::for_orders(&mut tx, &[order_id]).await?;
        if steps
            .iter()
            .any(|s| matches!(s.state, StepState::Compensated | StepState::Compensating))
        {
            return Ok(Operated::NotAllowed(
                order.process_state,
                "some of its steps were undone; cancel it to finish the undo",
            ));
        }
        steps::reset_for_retry(&mut tx, order_id).await?;
        if !orders::reset_for_retry(&mut tx, order_id).await? {
            return Err(StoreError::Corrupt(
                "order changed under its row lock".into(),
            ));
        }
        let event = Event {
            kind: EventKind::RetryScheduled,
            from: Some(ProcessState::Error),
            to: ProcessState::Pending,
            step: None,
            attempt: 1,
            actor: &operator.name,
            reason: Some("retried by an operator"),
            detail: json!({ "operator": true, "next_attempt_at": crate::messages::rfc3339::format(&Utc::now()) }),
        };
        events::append(&mut tx, order_id, &event).await?;
        wake(&mut tx).await?;
        tx.commit().await?;
        Ok(Operated::Done(ProcessState::Pending))
    }

    /// An operator's cancel of a `pending`, `processing` or `error` order: the
    /// running step (if any) is withdrawn and the completed steps are undone,
    /// newest first, by the schedulers. With nothing to undo the order ends
    /// `compensated` at once.
    pub async fn cancel(&self, operator: &Actor, order_id: Uuid) -> Result<Operated, StoreError> {
        let mut tx = self.store.pool().begin().await?;
        let Some(order) = orders::lock(&mut tx, order_id).await? else {
            return Ok(Operated::NotFound);
        };
        if !matches!(
            order.process_state,
            ProcessState::Pending | ProcessState::Processing | ProcessState::Error
        ) {
            return Ok(Operated::NotAllowed(
                order.process_state,
                "only pending, processing or error orders can be cancelled",
            ));
        }
        steps::withdraw_running(&mut tx, order_id).await?;
        let steps = steps::for_orders(&mut tx, &[order_id]).await?;
        let views: Vec<_> = steps.iter().map(StepRow::view).collect();
        let undo = workflow::next_compensation(&views) != Next::Finished;
        let to = if undo {
            ProcessState::Compensating
        } else {
            ProcessState::Compensated
        };
        must_transition(
            &mut tx,
            order_id,
            order.process_state,
            order.locked_by.as_deref(),
            to,
            None,
            None,
        )
        .await?;
        let reason = "cancelled by an operator";
        orders::set_last_error(&mut tx, order_id, reason).await?;
        let event = Event {
            kind: if undo {
                EventKind::Compensating
            } else {
                EventKind::Compensated
            },
            from: Some(order.process_state),
            to,
            step: None,
            attempt: order.attempt(),
            actor: &operator.name,
            reason: Some(reason),
            detail: json!({ "cancelled": true }),
        };
        events::append(&mut tx, order_id, &event).await?;
        if undo {
            wake(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(Operated::Done(to))
    }

    /// Dispatches the order's next step (forward or undo), or finishes it.
    /// The order is held by `me`.
    async fn advance(
        &self,
        conn: &mut PgConnection,
        order: &OrderRow,
        steps: &mut [StepRow],
        me: &Actor,
    ) -> Result<Option<ProcessState>, StoreError> {
        let views: Vec<_> = steps.iter().map(StepRow::view).collect();
        let (next, direction, finished, kind) = match order.process_state {
            ProcessState::Processing => (
                workflow::next_forward(&views),
                Direction::Forward,
                ProcessState::Processed,
                EventKind::Processed,
            ),
            ProcessState::Compensating => (
                workflow::next_compensation(&views),
                Direction::Compensate,
                ProcessState::Compensated,
                EventKind::Compensated,
            ),
            other => {
                return Err(StoreError::Corrupt(format!(
                    "cannot advance an order that is {other}"
                )));
            }
        };
        match next {
            Next::Run(idx) => {
                self.dispatch(conn, order, steps, idx, direction, me)
                    .await?;
                Ok(None)
            }
            Next::Finished => {
                must_transition(
                    conn,
                    order.order_id,
                    order.process_state,
                    Some(&me.name),
                    finished,
                    None,
                    None,
                )
                .await?;
                let event = Event {
                    kind,
                    from: Some(order.process_state),
                    to: finished,
                    step: None,
                    attempt: order.attempt(),
                    actor: &me.name,
                    reason: None,
                    detail: json!({ "results": results(steps) }),
                };
                events::append(conn, order.order_id, &event).await?;
                Ok(Some(finished))
            }
        }
    }

    /// Sends step `idx` to its agent (or its compensating agent) through the
    /// outbox, with a fresh dispatch id and a complete-by from the database clock.
    async fn dispatch(
        &self,
        conn: &mut PgConnection,
        order: &OrderRow,
        steps: &mut [StepRow],
        idx: i32,
        direction: Direction,
        me: &Actor,
    ) -> Result<(), StoreError> {
        let pos = steps.iter().position(|s| s.idx == idx).ok_or_else(|| {
            StoreError::Corrupt(format!("order {} has no step {idx}", order.order_id))
        })?;
        let (agent, state) = match direction {
            Direction::Forward => (steps[pos].agent.clone(), StepState::Running),
            Direction::Compensate => (
                steps[pos].compensate.clone().ok_or_else(|| {
                    StoreError::Corrupt(format!("step {} has no compensation", steps[pos].name))
                })?,
                StepState::Compensating,
            ),
        };
        let dispatch_id = Uuid::now_v7();
        let complete_by = steps::dispatch(conn, order.order_id, idx, state, dispatch_id).await?;
        steps[pos].state = state;
        steps[pos].dispatch_id = Some(dispatch_id);
        must_transition(
            conn,
            order.order_id,
            order.process_state,
            Some(&me.name),
            order.process_state,
            Some(&me.name),
            Some(complete_by),
        )
        .await?;
        let request = StepRequest {
            order_id: order.order_id,
            workflow: order.workflow.clone(),
            step: steps[pos].name.clone(),
            step_index: idx,
            direction,
            attempt: order.attempt(),
            dispatch_id,
            locked_by: me.name.clone(),
            complete_by,
            payload: order.payload.clone(),
            results: results(steps),
        };
        let body =
            serde_json::to_value(&request).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let trace = traceparent(order);
        let correlation = dispatch_id.to_string();
        let message = outbox::Message {
            order_id: order.order_id,
            kind: "request",
            routing_key: &self.queues.agent_requests(&agent),
            correlation_id: Some(&correlation),
            reply_to: Some(self.queues.replies()),
            traceparent: trace.as_deref(),
            body: &body,
        };
        outbox::enqueue(conn, &message).await?;
        Ok(())
    }

    /// Gives the order up (contract §4a): alerts, then compensates the completed
    /// steps, or fails it when there is nothing to undo. With `driver`, that
    /// scheduler dispatches the first compensation at once; without, the order
    /// is left for any scheduler to claim.
    async fn give_up(
        &self,
        conn: &mut PgConnection,
        order: &OrderRow,
        steps: &mut [StepRow],
        reason: &str,
        me: &Actor,
        driver: Option<&Actor>,
    ) -> Result<Option<ProcessState>, StoreError> {
        let views: Vec<_> = steps.iter().map(StepRow::view).collect();
        if workflow::next_compensation(&views) == Next::Finished {
            return self.fail(conn, order, reason, me).await;
        }
        self.alert(conn, order, ProcessState::Compensating, reason)
            .await?;
        orders::set_last_error(conn, order.order_id, reason).await?;
        let holder = driver.map(|d| d.name.as_str());
        must_transition(
            conn,
            order.order_id,
            order.process_state,
            order.locked_by.as_deref(),
            ProcessState::Compensating,
            holder,
            None,
        )
        .await?;
        let event = Event {
            kind: EventKind::Compensating,
            from: Some(order.process_state),
            to: ProcessState::Compensating,
            step: None,
            attempt: order.attempt(),
            actor: &me.name,
            reason: Some(reason),
            detail: json!({ "error": reason }),
        };
        events::append(conn, order.order_id, &event).await?;
        if let Some(driver) = driver {
            let mut order = order.clone();
            order.process_state = ProcessState::Compensating;
            order.locked_by = Some(driver.name.clone());
            return self.advance(conn, &order, steps, driver).await;
        }
        Ok(None)
    }

    /// Ends the order in `error` with an alert and a `failed` event; returns `Some(Error)`.
    async fn fail(
        &self,
        conn: &mut PgConnection,
        order: &OrderRow,
        reason: &str,
        me: &Actor,
    ) -> Result<Option<ProcessState>, StoreError> {
        self.alert(conn, order, ProcessState::Error, reason).await?;
        orders::set_last_error(conn, order.order_id, reason).await?;
        must_transition(
            conn,
            order.order_id,
            order.process_state,
            order.locked_by.as_deref(),
            ProcessState::Error,
            None,
            None,
        )
        .await?;
        let event = Event {
            kind: EventKind::Failed,
            from: Some(order.process_state),
            to: ProcessState::Error,
            step: None,
            attempt: order.attempt(),
            actor: &me.name,
            reason: Some(reason),
            detail: json!({ "error": reason, "failure_count": order.failure_count }),
        };
        events::append(conn, order.order_id, &event).await?;
        Ok(Some(ProcessState::Error))
    }

    /// Queues an operator alert; the relay publishes it before the order's later events.
    async fn alert(
        &self,
        conn: &mut PgConnection,
        order: &OrderRow,
        state: ProcessState,
        reason: &str,
    ) -> Result<(), StoreError> {
        let alert = Alert {
            order_id: order.order_id,
            workflow: order.workflow.clone(),
            state: state.as_str().into(),
            reason: reason.into(),
            failure_count: order.failure_count,
            at: Utc::now(),
        };
        let body = serde_json::to_value(&alert).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let trace = traceparent(order);
        let message = outbox::Message {
            order_id: order.order_id,
            kind: "alert",
            routing_key: self.queues.alerts(),
            correlation_id: None,
            reply_to: None,
            traceparent: trace.as_deref(),
            body: &body,
        };
        outbox::enqueue(conn, &message).await?;
        Ok(())
    }
}

/// A `traceparent` for a message of this order: its trace, a new span.
fn traceparent(order: &OrderRow) -> Option<String> {
    let trace_id = order.trace_id.as_deref()?;
    crate::trace::TraceContext::child_of(trace_id).map(|t| t.to_string())
}

/// The results of the completed steps, by step name.
fn results(steps: &[StepRow]) -> Map<String, Value> {
    steps
        .iter()
        .filter_map(|s| s.result.clone().map(|r| (s.name.clone(), r)))
        .collect()
}

/// Moves an order whose row this transaction has locked. The guard cannot
/// fail under our own lock; if it does, the data is not what we read.
async fn must_transition(
    conn: &mut PgConnection,
    order_id: Uuid,
    from: ProcessState,
    holder: Option<&str>,
    to: ProcessState,
    locked_by: Option<&str>,
    deadline: Option<DateTime<Utc>>,
) -> Result<(), StoreError> {
    if orders::transition(conn, order_id, from, holder, to, locked_by, deadline).await? {
        Ok(())
    } else {
        Err(StoreError::Corrupt(format!(
            "order {order_id} changed under its row lock"
        )))
    }
}

/// Wakes the schedulers when this transaction commits.
async fn wake(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(WAKE_CHANNEL)
        .execute(conn)
        .await?;
    Ok(())
}

impl StateStore {
    /// Relays the queued messages of these orders in one transaction: takes
    /// the orders no other relay holds, runs `publish` on their messages,
    /// deletes the ones it reports published, and commits. Returns the orders
    /// another relay held (to try again shortly) and `publish`'s verdict.
    pub async fn relay_outbox<F, Fut, E>(
        &self,
        order_ids: &[Uuid],
        publish: F,
    ) -> Result<(Vec<Uuid>, Result<usize, E>), StoreError>
    where
        F: FnOnce(Vec<outbox::OutboxRow>) -> Fut,
        Fut: std::future::Future<Output = (Vec<i64>, Result<(), E>)>,
    {
        let mut tx = self.pool().begin().await?;
        let taken = outbox::take_orders(&mut tx, order_ids).await?;
        let held: Vec<Uuid> = order_ids
            .iter()
            .filter(|id| !taken.contains(id))
            .copied()
            .collect();
        let rows = outbox::for_orders(&mut tx, &taken).await?;
        if rows.is_empty() {
            return Ok((held, Ok(0)));
        }
        let (done, outcome) = publish(rows).await;
        crate::crash::point("outbox.after_publish");
        if !done.is_empty() {
            outbox::delete(&mut tx, &done).await?;
        }
        tx.commit().await?;
        Ok((held, outcome.map(|()| done.len())))
    }

    /// Messages waiting in the outbox.
    pub async fn outbox_backlog(&self) -> Result<i64, StoreError> {
        let mut conn = self.pool().acquire().await?;
        Ok(outbox::backlog(&mut conn).await?)
    }

    /// Orders with messages left behind by a process that died.
    pub async fn outbox_stale_orders(
        &self,
        age_ms: i64,
        limit: i64,
    ) -> Result<Vec<Uuid>, StoreError> {
        let mut conn = self.pool().acquire().await?;
        Ok(outbox::stale_orders(&mut conn, age_ms, limit).await?)
    }
}

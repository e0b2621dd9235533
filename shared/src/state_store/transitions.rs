//! The transitions of an order, each one transaction: submit, claim, apply a
//! step's reply, and recover an expired order. Status events, step requests
//! and alerts are queued in the outbox inside the same transaction.
//!
//! Each transition locks its orders, decides in memory on a [`Unit`], and
//! writes the unit back with a few set-based statements; batches of orders
//! (submissions, claims, replies) share one transaction.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde_json::{Map, Value, json};
use sqlx::pool::PoolConnection;
use sqlx::{Acquire as _, PgConnection, Postgres};
use uuid::Uuid;

use super::events::Event;
use super::orders::{self, NewOrder, OrderRow};
use super::outbox::{self, Handoff, Held};
use super::steps::StepRow;
use super::unit::{Flushed, Unit, WriteBack};
use super::{StateStore, StoreError};
use crate::config::SupervisorSettings;
use crate::messages::{Alert, Direction, EventKind, StepOutcome, StepReply, StepRequest};
use crate::rules;
use crate::rules::operator::{cancel_refusal, retry_refusal};
use crate::rules::scheduler::Advance;
use crate::rules::supervisor::{Expiry, Next as AtDeadline};
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

/// A transaction that [`orders::begin_claimable`],
/// [`orders::begin_lock_many`] or [`outbox::begin_take`] opened with its
/// first statement, outside sqlx's own transaction tracking. Dropped before
/// it [ends](Self::end) (an error, a cancelled task), it closes the
/// connection rather than let it go back to the pool with the transaction
/// open; the server then rolls the transaction back.
struct Begun<'c> {
    conn: &'c mut PoolConnection<Postgres>,
    open: bool,
}

impl<'c> Begun<'c> {
    fn new(conn: &'c mut PoolConnection<Postgres>) -> Self {
        Self { conn, open: true }
    }

    fn conn(&mut self) -> &mut PgConnection {
        self.conn
    }

    async fn commit(self) -> Result<(), sqlx::Error> {
        self.end("COMMIT").await
    }

    /// The transaction was ended by the last statement sent on it.
    fn ended(mut self) {
        self.open = false;
    }

    /// Ends the transaction with `COMMIT` or `ROLLBACK`.
    async fn end(mut self, how: &'static str) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(how).execute(&mut **self.conn).await?;
        self.open = false;
        Ok(())
    }
}

impl Drop for Begun<'_> {
    fn drop(&mut self) {
        if self.open {
            self.conn.close_on_drop();
        }
    }
}

/// The transitions, bound to a state store and the queue names of a deployment.
#[derive(Clone, Debug)]
pub struct Transitions {
    store: StateStore,
    queues: QueueNames,
    /// Takes the messages a transition committed, to publish them at once.
    handoff: Option<Arc<dyn Handoff>>,
}

impl Transitions {
    /// Transitions over `store`, routing messages to the queues of `queues`.
    /// Their messages wait in the outbox for a relay's pass.
    pub fn new(store: StateStore, queues: QueueNames) -> Self {
        Self {
            store,
            queues,
            handoff: None,
        }
    }

    /// The same transitions, handing the messages of each submission, claim,
    /// reply and recovery to `handoff` as soon as they are committed, while
    /// it is [`ready`](Handoff::ready): the transition keeps its orders'
    /// outbox locks past its commit and passes them on with the connection,
    /// so the messages go out at once and in order, without a relay's
    /// transaction of their own. Otherwise, and for the messages it cannot
    /// send in order, it tells `handoff` which orders the relay should take.
    pub fn with_handoff(mut self, handoff: Arc<dyn Handoff>) -> Self {
        self.handoff = Some(handoff);
        self
    }

    /// Whether the transition about to run takes its orders' outbox locks
    /// for a hand-over (decided once per transition).
    fn direct(&self) -> bool {
        self.handoff.as_ref().is_some_and(|h| h.ready())
    }

    /// Ends a transition run on `conn`: hands its committed messages on, or,
    /// when it failed while the connection may hold outbox locks, closes the
    /// connection so that the server lets them go.
    fn settle<T>(
        &self,
        conn: PoolConnection<Postgres>,
        direct: bool,
        outcome: Result<(T, Flushed), StoreError>,
    ) -> Result<(T, Vec<Uuid>), StoreError> {
        let (value, flushed) = match outcome {
            Ok(done) => done,
            Err(e) => {
                if direct {
                    drop(Held::new(conn));
                }
                return Err(e);
            }
        };
        if let Some(handoff) = &self.handoff {
            if !flushed.later.is_empty() {
                handoff.later(flushed.later);
            }
            if !flushed.follow.is_empty() {
                handoff.clone().follow(flushed.follow);
            }
            if flushed.holds_locks {
                handoff.clone().publish(Held::new(conn), flushed.publish);
            }
        }
        Ok((value, flushed.created))
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
        let mut outcome = self.submit_many(&[(order, workflow)]).await?;
        outcome.pop().ok_or(StoreError::NoOutcome)
    }

    /// Stores a batch of new orders, with their steps and `received` events,
    /// in one transaction with one wake-up for the schedulers; one outcome
    /// per order, in order. An id that exists, or came earlier in the batch,
    /// is a duplicate and changes nothing.
    pub async fn submit_many(
        &self,
        batch: &[(&NewOrder, &Workflow)],
    ) -> Result<Vec<Submitted>, StoreError> {
        let mut unit = Unit::empty(Utc::now());
        let mut seen = std::collections::HashSet::with_capacity(batch.len());
        for &(order, workflow) in batch {
            if !seen.insert(order.order_id) {
                continue;
            }
            let i = unit.insert(order, &workflow.steps);
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
            unit.event(i, &event);
        }
        unit.wake();
        // One statement: atomic on its own, no transaction to open and close.
        let mut conn = self.store.pool().acquire().await?;
        let direct = self.direct();
        let flushed = unit.flush(&mut conn, direct, WriteBack::Alone).await;
        let ((), created) = self.settle(conn, direct, flushed.map(|f| ((), f)))?;
        let mut outcome = vec![Submitted::Duplicate; batch.len()];
        for id in created {
            if let Some(pos) = batch.iter().position(|(o, _)| o.order_id == id) {
                outcome[pos] = Submitted::Created;
            }
        }
        Ok(outcome)
    }

    /// Claims up to `limit` orders for `me`, as long as `me` then holds no
    /// more than `max_held`, and dispatches each one's next step, all in one
    /// transaction. Returns the claimed orders' ids.
    pub async fn claim(
        &self,
        me: &Actor,
        limit: u32,
        max_held: u32,
    ) -> Result<Vec<Uuid>, StoreError> {
        let mut conn = self.store.pool().acquire().await?;
        let direct = self.direct();
        let outcome = self.claim_on(&mut conn, me, limit, max_held, direct).await;
        self.settle(conn, direct, outcome).map(|(ids, _)| ids)
    }

    async fn claim_on(
        &self,
        conn: &mut PoolConnection<Postgres>,
        me: &Actor,
        limit: u32,
        max_held: u32,
        direct: bool,
    ) -> Result<(Vec<Uuid>, Flushed), StoreError> {
        let mut tx = Begun::new(conn);
        let claimed = orders::begin_claimable(
            tx.conn(),
            i64::from(limit),
            &me.name,
            i64::from(max_held),
            direct,
        )
        .await?;
        if claimed.is_empty() {
            tx.commit().await?;
            return Ok((Vec::new(), Flushed::default()));
        }
        let ids: Vec<Uuid> = claimed.iter().map(|l| l.order.order_id).collect();
        let mut unit = Unit::load(tx.conn(), claimed).await?;
        for i in 0..unit.len() {
            let o = &unit.get(i).order;
            let (state, holder) = (o.process_state, o.locked_by.clone());
            let to = if state == ProcessState::Pending {
                ProcessState::Processing
            } else {
                state
            };
            unit.transition(i, state, holder.as_deref(), to, Some(&me.name), None)?;
            unit.get_mut(i).order.not_before = None;
            if to == ProcessState::Processing {
                let event = Event {
                    kind: EventKind::Processing,
                    from: Some(ProcessState::Pending),
                    to: ProcessState::Processing,
                    step: None,
                    attempt: unit.get(i).order.attempt(),
                    actor: &me.name,
                    reason: None,
                    detail: json!({ "locked_by": me.name }),
                };
                unit.event(i, &event);
            }
            self.advance(&mut unit, i, me)?;
        }
        let flushed = unit.flush(tx.conn(), direct, WriteBack::Commit).await?;
        tx.ended();
        Ok((ids, flushed))
    }

    /// Applies an agent's reply, guarded by the order's state, its lock holder,
    /// its attempt and the step's current dispatch; then dispatches what comes
    /// next. `me` takes over the order's lock.
    pub async fn apply_reply(
        &self,
        me: &Actor,
        reply: &StepReply,
    ) -> Result<ReplyOutcome, StoreError> {
        let mut outcome = self.apply_replies(me, std::slice::from_ref(reply)).await?;
        outcome.pop().ok_or(StoreError::NoOutcome)
    }

    /// Applies a batch of replies in one transaction, each as
    /// [`apply_reply`](Self::apply_reply) would, in the order given (a
    /// duplicate later in the batch finds its dispatch answered already).
    /// One outcome per reply, in order.
    pub async fn apply_replies(
        &self,
        me: &Actor,
        replies: &[StepReply],
    ) -> Result<Vec<ReplyOutcome>, StoreError> {
        let mut conn = self.store.pool().acquire().await?;
        let direct = self.direct();
        let outcome = self.apply_on(&mut conn, me, replies, direct).await;
        self.settle(conn, direct, outcome)
            .map(|(outcome, _)| outcome)
    }

    async fn apply_on(
        &self,
        conn: &mut PoolConnection<Postgres>,
        me: &Actor,
        replies: &[StepReply],
        direct: bool,
    ) -> Result<(Vec<ReplyOutcome>, Flushed), StoreError> {
        let mut ids: Vec<Uuid> = replies.iter().map(|r| r.order_id).collect();
        ids.sort_unstable();
        ids.dedup();
        let mut tx = Begun::new(conn);
        let locked = orders::begin_lock_many(tx.conn(), &ids, direct).await?;
        let mut unit = Unit::load(tx.conn(), locked).await?;
        let mut outcome = Vec::with_capacity(replies.len());
        for reply in replies {
            outcome.push(self.apply_one(&mut unit, me, reply)?);
        }
        let flushed = unit.flush(tx.conn(), direct, WriteBack::Commit).await?;
        tx.ended();
        Ok((outcome, flushed))
    }

    /// One reply against the unit's orders (see [`apply_reply`](Self::apply_reply)).
    fn apply_one(
        &self,
        unit: &mut Unit,
        me: &Actor,
        reply: &StepReply,
    ) -> Result<ReplyOutcome, StoreError> {
        let Some(i) = unit.find(reply.order_id) else {
            return Ok(ReplyOutcome::Stale("unknown order".into()));
        };
        let entry = unit.get(i);
        let created_at = entry.order.created_at;
        let change = match rules::scheduler::judge_reply(&entry.order, &entry.steps, reply) {
            Ok(change) => change,
            Err(why) => return Ok(ReplyOutcome::Stale(why)),
        };
        let expect_order = change.order_state;
        let now = unit.now;
        let step = &mut unit.get_mut(i).steps[change.pos];
        step.state = change.to;
        if let Some(r) = change.result {
            step.result = Some(r.clone());
        }
        step.error = change.error.map(str::to_owned);
        step.finished_at = Some(now);
        step.complete_by = None;
        // Take over the claim: whoever applies the reply drives the order on.
        unit.transition(
            i,
            expect_order,
            Some(&reply.locked_by),
            expect_order,
            Some(&me.name),
            None,
        )?;
        let ended = match (&reply.outcome, reply.direction) {
            (StepOutcome::Succeeded { result }, Direction::Forward) => {
                let event = Event {
                    kind: EventKind::StepSucceeded,
                    from: Some(ProcessState::Processing),
                    to: ProcessState::Processing,
                    step: Some(&reply.step),
                    attempt: unit.get(i).order.attempt(),
                    actor: &me.name,
                    reason: None,
                    detail: json!({ "result": result }),
                };
                unit.event(i, &event);
                self.advance(unit, i, me)?
            }
            (StepOutcome::Succeeded { .. }, Direction::Compensate) => self.advance(unit, i, me)?,
            (StepOutcome::Failed { error }, Direction::Forward) => {
                let reason = format!("step {} failed permanently: {error}", reply.step);
                self.give_up(unit, i, &reason, me, Some(me))?
            }
            (StepOutcome::Failed { error }, Direction::Compensate) => {
                let reason = format!(
                    "compensation of step {} failed permanently: {error}",
                    reply.step
                );
                self.fail(unit, i, &reason, me)?
            }
        };
        let age = (Utc::now() - created_at).to_std().unwrap_or_default();
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
        let mut conn = self.store.pool().acquire().await?;
        let direct = self.direct();
        let outcome = self.recover_on(&mut conn, me, settings, direct).await;
        self.settle(conn, direct, outcome)
            .map(|(recovered, _)| recovered)
    }

    async fn recover_on(
        &self,
        conn: &mut PgConnection,
        me: &Actor,
        settings: &SupervisorSettings,
        direct: bool,
    ) -> Result<(Vec<Expired>, Flushed), StoreError> {
        let mut tx = conn.begin().await?;
        let expired = orders::expired(&mut tx, i64::from(settings.batch), direct).await?;
        if expired.is_empty() {
            return Ok((Vec::new(), Flushed::default()));
        }
        let mut unit = Unit::load(&mut tx, expired).await?;
        let mut recovered = Vec::with_capacity(unit.len());
        for i in 0..unit.len() {
            withdraw_running(&mut unit.get_mut(i).steps);
            let order = unit.get(i).order.clone();
            let expiry = Expiry {
                state: order.process_state,
                failure_count: order.failure_count,
                compensation_failures: order.compensation_failures,
            };
            let decision = rules::supervisor::at_deadline(expiry, unit.now, settings);
            let failures = decision.failures;
            if decision.compensating {
                unit.get_mut(i).order.compensation_failures = failures;
            } else {
                unit.get_mut(i).order.failure_count = failures;
            }
            let (to, not_before, attempt) = match decision.next {
                AtDeadline::Fail => {
                    let ended = self.fail(&mut unit, i, &decision.reason, me)?;
                    recovered.push(Expired::GaveUp {
                        order_id: order.order_id,
                        ended,
                    });
                    continue;
                }
                AtDeadline::GiveUp => {
                    unit.wake();
                    let ended = self.give_up(&mut unit, i, &decision.reason, me, None)?;
                    recovered.push(Expired::GaveUp {
                        order_id: order.order_id,
                        ended,
                    });
                    continue;
                }
                AtDeadline::Retry {
                    to,
                    not_before,
                    attempt,
                    now,
                } => {
                    if now {
                        unit.wake();
                    }
                    (to, not_before, attempt)
                }
            };
            unit.transition(
                i,
                order.process_state,
                order.locked_by.as_deref(),
                to,
                None,
                None,
            )?;
            unit.get_mut(i).order.not_before = Some(not_before);
            let late = &decision.reason;
            let event = Event {
                kind: EventKind::RetryScheduled,
                from: Some(order.process_state),
                to,
                step: None,
                attempt,
                actor: &me.name,
                reason: Some(late),
                detail: json!({
                    "next_attempt_at": crate::messages::rfc3339::format(&not_before),
                    "failure_count": if decision.compensating { order.failure_count } else { failures },
                    "compensation": decision.compensating,
                    "error": late,
                }),
            };
            unit.event(i, &event);
            recovered.push(Expired::Requeued {
                order_id: order.order_id,
                not_before,
            });
            crate::crash::point("supervisor.mid_sweep");
        }
        let flushed = unit
            .flush(&mut tx, direct, WriteBack::InTransaction)
            .await?;
        tx.commit().await?;
        Ok((recovered, flushed))
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
        let locked = orders::lock_many(&mut tx, &[order_id], false).await?;
        if locked.is_empty() {
            return Ok(Operated::NotFound);
        }
        let mut unit = Unit::load(&mut tx, locked).await?;
        let t = unit.get_mut(0);
        if let Some(why) = retry_refusal(t.order.process_state, any_undone(&t.steps)) {
            return Ok(Operated::NotAllowed(t.order.process_state, why));
        }
        for s in &mut t.steps {
            if matches!(
                s.state,
                StepState::Failed
                    | StepState::Compensating
                    | StepState::Compensated
                    | StepState::Running
            ) {
                s.state = StepState::NotStarted;
                s.dispatch_id = None;
                s.complete_by = None;
                s.error = None;
            }
        }
        let o = &mut t.order;
        let holder = o.locked_by.clone();
        o.not_before = None;
        o.failure_count = 0;
        o.compensation_failures = 0;
        o.last_error = None;
        unit.transition(
            0,
            ProcessState::Error,
            holder.as_deref(),
            ProcessState::Pending,
            None,
            None,
        )?;
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
        unit.event(0, &event);
        unit.wake();
        unit.flush(&mut tx, false, WriteBack::InTransaction).await?;
        tx.commit().await?;
        Ok(Operated::Done(ProcessState::Pending))
    }

    /// An operator's cancel of a `pending`, `processing` or `error` order: the
    /// running step (if any) is withdrawn and the completed steps are undone,
    /// newest first, by the schedulers. With nothing to undo the order ends
    /// `compensated` at once.
    pub async fn cancel(&self, operator: &Actor, order_id: Uuid) -> Result<Operated, StoreError> {
        let mut tx = self.store.pool().begin().await?;
        let locked = orders::lock_many(&mut tx, &[order_id], false).await?;
        if locked.is_empty() {
            return Ok(Operated::NotFound);
        }
        let mut unit = Unit::load(&mut tx, locked).await?;
        let order = unit.get(0).order.clone();
        if let Some(why) = cancel_refusal(order.process_state) {
            return Ok(Operated::NotAllowed(order.process_state, why));
        }
        withdraw_running(&mut unit.get_mut(0).steps);
        let views: Vec<_> = unit.get(0).steps.iter().map(StepRow::view).collect();
        let undo = workflow::next_compensation(&views) != Next::Finished;
        let to = if undo {
            ProcessState::Compensating
        } else {
            ProcessState::Compensated
        };
        unit.transition(
            0,
            order.process_state,
            order.locked_by.as_deref(),
            to,
            None,
            None,
        )?;
        let reason = "cancelled by an operator";
        unit.get_mut(0).order.last_error = Some(reason.into());
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
        unit.event(0, &event);
        if undo {
            unit.wake();
        }
        unit.flush(&mut tx, false, WriteBack::InTransaction).await?;
        tx.commit().await?;
        Ok(Operated::Done(to))
    }

    /// Dispatches the order's next step (forward or undo), or finishes it.
    /// The order is held by `me`.
    fn advance(
        &self,
        unit: &mut Unit,
        i: usize,
        me: &Actor,
    ) -> Result<Option<ProcessState>, StoreError> {
        let t = unit.get(i);
        let views: Vec<_> = t.steps.iter().map(StepRow::view).collect();
        let Some(next) = rules::scheduler::advance(t.order.process_state, &views) else {
            return Err(StoreError::UnexpectedState {
                order_id: t.order.order_id,
                found: t.order.process_state.to_string(),
                expected: "processing or compensating".into(),
            });
        };
        match next {
            Advance::Dispatch { idx, direction } => {
                self.dispatch(unit, i, idx, direction, me)?;
                Ok(None)
            }
            Advance::Finish {
                state: finished,
                event: kind,
            } => {
                let from = t.order.process_state;
                let attempt = t.order.attempt();
                let detail = json!({ "results": results(&t.steps) });
                unit.transition(i, from, Some(&me.name), finished, None, None)?;
                let event = Event {
                    kind,
                    from: Some(from),
                    to: finished,
                    step: None,
                    attempt,
                    actor: &me.name,
                    reason: None,
                    detail,
                };
                unit.event(i, &event);
                Ok(Some(finished))
            }
        }
    }

    /// Sends step `idx` to its agent (or its compensating agent) through the
    /// outbox, with a fresh dispatch id and a complete-by from the database clock.
    fn dispatch(
        &self,
        unit: &mut Unit,
        i: usize,
        idx: i32,
        direction: Direction,
        me: &Actor,
    ) -> Result<(), StoreError> {
        let now = unit.now;
        let t = unit.get_mut(i);
        let order_id = t.order.order_id;
        let pos = t
            .steps
            .iter()
            .position(|s| s.idx == idx)
            .ok_or_else(|| StoreError::MissingStep { order_id, idx })?;
        let step = &mut t.steps[pos];
        let (agent, state) = match direction {
            Direction::Forward => (step.agent.clone(), StepState::Running),
            Direction::Compensate => (
                step.compensate
                    .clone()
                    .ok_or_else(|| StoreError::NoCompensation(step.name.clone()))?,
                StepState::Compensating,
            ),
        };
        let dispatch_id = Uuid::now_v7();
        let complete_by = now + chrono::Duration::milliseconds(step.timeout_ms);
        step.state = state;
        step.dispatch_id = Some(dispatch_id);
        step.dispatches += 1;
        step.complete_by = Some(complete_by);
        step.started_at.get_or_insert(now);
        let state = t.order.process_state;
        unit.transition(
            i,
            state,
            Some(&me.name),
            state,
            Some(&me.name),
            Some(complete_by),
        )?;
        let t = unit.get(i);
        let request = StepRequest {
            order_id,
            workflow: t.order.workflow.clone(),
            step: t.steps[pos].name.clone(),
            step_index: idx,
            direction,
            attempt: t.order.attempt(),
            dispatch_id,
            locked_by: me.name.clone(),
            complete_by,
            payload: t.order.payload.clone(),
            results: results(&t.steps),
        };
        let body = serde_json::to_value(&request)?;
        let trace = traceparent(&t.order);
        let correlation = dispatch_id.to_string();
        let message = outbox::Message {
            order_id,
            kind: "request",
            routing_key: &self.queues.agent_requests(&agent),
            correlation_id: Some(&correlation),
            reply_to: Some(self.queues.replies()),
            traceparent: trace.as_deref(),
            body: &body,
        };
        unit.message(&message);
        Ok(())
    }

    /// Gives the order up (contract §4a): alerts, then compensates the completed
    /// steps, or fails it when there is nothing to undo. With `driver`, that
    /// scheduler dispatches the first compensation at once; without, the order
    /// is left for any scheduler to claim.
    fn give_up(
        &self,
        unit: &mut Unit,
        i: usize,
        reason: &str,
        me: &Actor,
        driver: Option<&Actor>,
    ) -> Result<Option<ProcessState>, StoreError> {
        let views: Vec<_> = unit.get(i).steps.iter().map(StepRow::view).collect();
        if workflow::next_compensation(&views) == Next::Finished {
            return self.fail(unit, i, reason, me);
        }
        self.alert(unit, i, ProcessState::Compensating, reason)?;
        let order = unit.get(i).order.clone();
        unit.get_mut(i).order.last_error = Some(reason.into());
        let holder = driver.map(|d| d.name.as_str());
        unit.transition(
            i,
            order.process_state,
            order.locked_by.as_deref(),
            ProcessState::Compensating,
            holder,
            None,
        )?;
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
        unit.event(i, &event);
        if let Some(driver) = driver {
            return self.advance(unit, i, driver);
        }
        Ok(None)
    }

    /// Ends the order in `error` with an alert and a `failed` event; returns `Some(Error)`.
    fn fail(
        &self,
        unit: &mut Unit,
        i: usize,
        reason: &str,
        me: &Actor,
    ) -> Result<Option<ProcessState>, StoreError> {
        self.alert(unit, i, ProcessState::Error, reason)?;
        let order = unit.get(i).order.clone();
        unit.get_mut(i).order.last_error = Some(reason.into());
        unit.transition(
            i,
            order.process_state,
            order.locked_by.as_deref(),
            ProcessState::Error,
            None,
            None,
        )?;
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
        unit.event(i, &event);
        Ok(Some(ProcessState::Error))
    }

    /// Queues an operator alert; the relay publishes it before the order's later events.
    fn alert(
        &self,
        unit: &mut Unit,
        i: usize,
        state: ProcessState,
        reason: &str,
    ) -> Result<(), StoreError> {
        let order = &unit.get(i).order;
        let alert = Alert {
            order_id: order.order_id,
            workflow: order.workflow.clone(),
            state: state.as_str().into(),
            reason: reason.into(),
            failure_count: order.failure_count,
            at: Utc::now(),
        };
        let body = serde_json::to_value(&alert)?;
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
        unit.message(&message);
        Ok(())
    }
}

/// Whether any of these steps was undone or is being undone (see
/// [`rules::operator::any_undone`]).
pub fn any_undone(steps: &[StepRow]) -> bool {
    rules::operator::any_undone(steps.iter().map(|s| s.state))
}

/// Withdraws the running dispatch of an order (its deadline passed, or an
/// operator cancelled): a forward step goes back to `not_started`, a
/// compensation back to `completed`, and any late reply to the old dispatch
/// becomes stale.
fn withdraw_running(steps: &mut [StepRow]) {
    for s in steps {
        let back = match s.state {
            StepState::Running => StepState::NotStarted,
            StepState::Compensating => StepState::Completed,
            _ => continue,
        };
        s.state = back;
        s.dispatch_id = None;
        s.complete_by = None;
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

impl StateStore {
    /// Relays the queued messages of these orders in one transaction: takes
    /// the orders no other relay holds, runs `publish` on their messages,
    /// deletes the ones it reports published, and commits. Returns the orders
    /// another relay held (to try again shortly) and `publish`'s verdict.
    /// With `wait`, it waits for those instead ([`outbox::take`]).
    pub async fn relay_outbox<F, Fut, E>(
        &self,
        order_ids: &[Uuid],
        wait: bool,
        publish: F,
    ) -> Result<(Vec<Uuid>, Result<usize, E>), StoreError>
    where
        F: FnOnce(Vec<outbox::OutboxRow>) -> Fut,
        Fut: std::future::Future<Output = (Vec<i64>, Result<(), E>)>,
    {
        let mut conn = self.pool().acquire().await?;
        let mut tx = Begun::new(&mut conn);
        let (taken, rows) = outbox::begin_take(tx.conn(), order_ids, wait).await?;
        let held: Vec<Uuid> = order_ids
            .iter()
            .filter(|id| !taken.contains(id))
            .copied()
            .collect();
        if rows.is_empty() {
            tx.end("COMMIT").await?;
            return Ok((held, Ok(0)));
        }
        let all = rows.len();
        let (done, outcome) = publish(rows).await;
        crate::crash::point("outbox.after_publish");
        if done.len() == all {
            tx.end("COMMIT").await?;
        } else {
            // Some were not confirmed: keep every row, then delete the
            // confirmed ones alone.
            tx.end("ROLLBACK").await?;
            if !done.is_empty() {
                outbox::delete(&mut conn, &done).await?;
            }
        }
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

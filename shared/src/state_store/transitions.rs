//! The transitions of an order, each one transaction: submit, claim, apply a
//! step's reply, and recover an expired order. Status events, step requests
//! and alerts are queued in the outbox inside the same transaction.
//!
//! Each transition locks its orders, decides in memory on a [`Unit`], and
//! writes the unit back with a few set-based statements; batches of orders
//! (submissions, claims, replies) share one transaction.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use sqlx::pool::PoolConnection;
use sqlx::{Acquire as _, PgConnection, Postgres};
use uuid::Uuid;

use super::orders::{self, NewOrder};
use super::outbox::{self, Handoff, Held};
use super::steps::StepRow;
use super::unit::{Flushed, Unit, WriteBack};
use super::{StateStore, StoreError};
use crate::config::SupervisorSettings;
use crate::messages::StepReply;
use crate::rules::scheduler::Replied;
use crate::rules::{self, Context, Decision, Order};
use crate::state::ProcessState;
use crate::topology::QueueNames;
use crate::workflow::Workflow;

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
            let decision =
                rules::submission::receive(&unit.get(i).order, context(&unit, "submission"));
            unit.apply(i, decision, &self.queues)?;
        }
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
            let decision = rules::scheduler::claim(&unit.get(i).order, context(&unit, &me.name))?;
            unit.apply(i, decision, &self.queues)?;
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
        let ctx = context(unit, &me.name);
        match rules::scheduler::apply_reply(&unit.get(i).order, reply, ctx)? {
            Replied::Stale(why) => Ok(ReplyOutcome::Stale(why)),
            Replied::Applied(decision) => {
                let (ended, created_at) = (decision.ended, decision.order.row.created_at);
                unit.apply(i, *decision, &self.queues)?;
                let age = (Utc::now() - created_at).to_std().unwrap_or_default();
                Ok(ReplyOutcome::Applied { ended, age })
            }
        }
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
            let ctx = context(&unit, &me.name);
            let (decision, requeued) = rules::supervisor::expire(&unit.get(i).order, settings, ctx);
            let (order_id, ended) = (decision.order.row.order_id, decision.ended);
            unit.apply(i, decision, &self.queues)?;
            recovered.push(match requeued {
                Some(not_before) => Expired::Requeued {
                    order_id,
                    not_before,
                },
                None => Expired::GaveUp { order_id, ended },
            });
            if requeued.is_some() {
                crate::crash::point("supervisor.mid_sweep");
            }
        }
        let flushed = unit
            .flush(&mut tx, direct, WriteBack::InTransaction)
            .await?;
        tx.commit().await?;
        Ok((recovered, flushed))
    }

    /// An operator's retry of an `error` order ([`rules::operator::retry`]):
    /// back to `pending` with its failure counts reset.
    pub async fn retry(&self, operator: &Actor, order_id: Uuid) -> Result<Operated, StoreError> {
        self.operate(operator, order_id, rules::operator::retry)
            .await
    }

    /// An operator's cancel of a `pending`, `processing` or `error` order
    /// ([`rules::operator::cancel`]): its completed steps are undone, newest
    /// first, by the schedulers.
    pub async fn cancel(&self, operator: &Actor, order_id: Uuid) -> Result<Operated, StoreError> {
        self.operate(operator, order_id, rules::operator::cancel)
            .await
    }

    /// Locks the order, asks `rule` and writes its decision back.
    async fn operate(
        &self,
        operator: &Actor,
        order_id: Uuid,
        rule: fn(&Order, Context<'_>) -> Result<Decision, &'static str>,
    ) -> Result<Operated, StoreError> {
        let mut tx = self.store.pool().begin().await?;
        let locked = orders::lock_many(&mut tx, &[order_id], false).await?;
        if locked.is_empty() {
            return Ok(Operated::NotFound);
        }
        let mut unit = Unit::load(&mut tx, locked).await?;
        let order = &unit.get(0).order;
        let decision = match rule(order, context(&unit, &operator.name)) {
            Ok(decision) => decision,
            Err(why) => return Ok(Operated::NotAllowed(order.row.process_state, why)),
        };
        let to = decision.order.row.process_state;
        unit.apply(0, decision, &self.queues)?;
        unit.flush(&mut tx, false, WriteBack::InTransaction).await?;
        tx.commit().await?;
        Ok(Operated::Done(to))
    }
}

/// Whether any of these steps was undone or is being undone (see
/// [`rules::operator::any_undone`]).
pub fn any_undone(steps: &[StepRow]) -> bool {
    rules::operator::any_undone(steps.iter().map(|s| s.state))
}

/// The context of the rules for `actor` in `unit`'s transaction.
fn context<'a>(unit: &Unit, actor: &'a str) -> Context<'a> {
    Context {
        now: unit.now,
        actor,
        new_id: Uuid::now_v7,
    }
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

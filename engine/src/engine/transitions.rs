//! The transitions of an order: submit, claim, apply a step's reply, recover
//! an expired order, and an operator's retry, cancel and redrive. Each one
//! loads its orders with their steps (one statement, a store verb), asks the
//! pattern's rules ([`crate::rules`]) what to do, takes the decisions into
//! a [`Unit`] and writes it back (one statement, atomic on its own): the
//! rows, the event log, and the status events, step requests and alerts
//! queued in the outbox. What it committed goes to its [`Outlet`] (the
//! service's relay), which publishes at once. Batches of orders
//! (submissions, claims, replies) share both statements.
//!
//! No transaction spans the two statements: the write-back is guarded by
//! each order row's version, so when another transition changed an order
//! in between (a duplicate reply applied by another scheduler, a reply
//! racing the supervisor's expiry), the write-back writes nothing and the
//! transition runs again on what is there now. Claims keep out of each
//! other's way by row locks while they read and claim locks until they
//! write ([`Session::load_claimable`]).

use std::sync::Arc;

use chrono::Utc;
use sas_store::{NewOrder, OutboxLocks, Session, StateStore, StepRow, StoreError, Unit, Written};
use uuid::Uuid;

use super::apply::apply;
use super::kept::{self, KeptOrders};
use super::outlet::{Outlet, Sweep};
use super::room::KeptRoom;
use crate::config::{Settings, SupervisorSettings};
use crate::messages::StepReply;
use crate::rules::scheduler::Replied;
use crate::rules::supervisor::Recovery;
use crate::rules::{self, Decision, Given, Order};
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
    /// A new order was stored; `started` when it started at once, its first
    /// steps dispatched in the same write-back ([`Transitions::submit_and_start`]).
    Created { started: bool },
    /// An order with this id exists; nothing changed.
    Duplicate,
}

/// How an order ended, for the metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ending {
    pub state: ProcessState,
    pub workflow: String,
}

impl Ending {
    /// How `decision`'s order ended, if it did.
    fn of(decision: &crate::rules::Decision) -> Option<Self> {
        decision.ended.map(|state| Self {
            state,
            workflow: decision.order.row.workflow.clone(),
        })
    }
}

/// How a reply ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyOutcome {
    /// The reply moved the order on; `ended` says how, if the order ended,
    /// `age` is the time since it was submitted.
    Applied {
        ended: Option<Ending>,
        age: std::time::Duration,
    },
    /// The reply answers a dispatch that no longer counts; nothing changed.
    Stale(String),
}

/// An expired order the supervisor recovered: what became of it (the
/// rule's [`Recovery`]) and, when it ended, how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    pub order_id: Uuid,
    pub recovery: Recovery,
    pub ended: Option<Ending>,
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
    /// What the action carries is refused, unstored: a redrive's patch
    /// that gives a payload no order may carry, a signal whose name or data
    /// sas cannot store ([`crate::messages::signal_refusal`]). Why.
    PayloadRefused(crate::messages::RejectReason),
}

/// What a claim took.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Claimed {
    /// The orders claimed, in the order they were decided.
    pub ids: Vec<Uuid>,
    /// The claim stopped at its bound of requests with orders it had read
    /// left undecided: claim again at once.
    pub more: bool,
}

/// The bounds of one claim ([`Transitions::claim`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimBounds {
    /// Most orders read and claimed.
    pub orders: u32,
    /// Most orders the claimer may hold once it has claimed.
    pub max_held: u32,
    /// Once the claimed orders' step requests reach this many, the claim
    /// stops deciding: a burst of fan-out orders (many requests each) is
    /// then claimed in several smaller write-backs, each holding fewer
    /// requests in memory at once, rather than one of `orders` times their
    /// fan-out. (Status events do not count: they are small.)
    pub requests: u32,
}

impl ClaimBounds {
    /// Up to `orders` orders while holding at most `max_held`, with no
    /// bound on their requests.
    pub fn orders(orders: u32, max_held: u32) -> Self {
        Self {
            orders,
            max_held,
            requests: u32::MAX,
        }
    }
}

/// How many times a transition runs again when its write-back finds that
/// another transition changed one of its orders first.
const RACES: u32 = 3;

/// The transitions, bound to a state store, the queue names of a
/// deployment and the outlet of what they commit.
#[derive(Clone, Debug)]
pub struct Transitions {
    store: StateStore,
    queues: QueueNames,
    outlet: Arc<dyn Outlet>,
    /// The room the last start's write-back left, for the next start.
    room: Arc<KeptRoom>,
    /// The orders kept between their transitions (a scheduler's), if any.
    kept: Option<Arc<KeptOrders>>,
}

impl Transitions {
    /// Transitions over `store`, routing messages to the queues of
    /// `queues`, whose messages wait in the outbox for the services'
    /// relays ([`Sweep`]): for tools with no relay of their own.
    pub fn new(store: StateStore, queues: QueueNames) -> Self {
        Self::with_outlet(store, queues, Arc::new(Sweep))
    }

    /// Transitions whose committed messages go to `outlet`. While it is
    /// ready, a transition takes its orders' outbox locks and keeps them
    /// past its write-back, and hands the messages over with the
    /// connection that holds the locks, so they go out at once and in
    /// order, without a relay's pass; otherwise, and for the messages it
    /// cannot send in order, it names the orders the relay should take.
    pub fn with_outlet(store: StateStore, queues: QueueNames, outlet: Arc<dyn Outlet>) -> Self {
        Self {
            store,
            queues,
            outlet,
            room: Arc::default(),
            kept: None,
        }
    }

    /// The same transitions (the room and the orders they keep too),
    /// handing what they commit to `outlet`.
    pub fn handing_to(&self, outlet: Arc<dyn Outlet>) -> Self {
        Self {
            outlet,
            ..self.clone()
        }
    }

    /// The state store underneath.
    pub fn store(&self) -> &StateStore {
        &self.store
    }

    /// A session for one run of a transition: it takes its orders' outbox
    /// locks when the outlet would publish at once.
    async fn session(&self) -> Result<Session, StoreError> {
        if self.outlet.ready() {
            let publisher = self.outlet.publisher();
            self.store
                .session(OutboxLocks::Take, publisher.as_deref())
                .await
        } else {
            self.store.session(OutboxLocks::Leave, None).await
        }
    }

    /// The same transitions, starting new orders in the room the last
    /// start's write-back read for `fresh_for` after it (zero: each start
    /// reads the room first).
    #[must_use]
    pub fn keeping_room_for(mut self, fresh_for: std::time::Duration) -> Self {
        self.room = Arc::new(KeptRoom::fresh_for(fresh_for));
        self
    }

    /// The same transitions, keeping up to `max` orders that wait for a
    /// reply at the row versions their write-backs left them, so that the
    /// reply is applied without loading the order again (a scheduler's).
    #[must_use]
    pub fn keeping_orders(mut self, max: usize) -> Self {
        self.kept = Some(Arc::new(KeptOrders::new(max)));
        self
    }

    /// How many orders these transitions keep now.
    pub fn kept(&self) -> usize {
        self.kept.as_ref().map_or(0, |k| k.len())
    }

    /// Writes back the unit a transition `decided` in `session`, with the
    /// flow-control counts its changes move, and hands what it committed
    /// to the outlet; returns the decided value and the orders created.
    async fn write_back<T>(
        &self,
        session: Session,
        (value, unit): (T, Unit),
    ) -> Result<(T, Vec<Uuid>), StoreError> {
        let (value, written) = self.write_back_reading(session, (value, unit)).await?;
        Ok((value, written.created))
    }

    /// [`Self::write_back`], returning what was written: also the room
    /// when the unit asked for it.
    async fn write_back_reading<T>(
        &self,
        session: Session,
        (value, mut unit): (T, Unit),
    ) -> Result<(T, Written), StoreError> {
        let flows = rules::flow::deltas(&unit.flows, unit.changes(), &unit.dispatched);
        let keep = self
            .kept
            .as_ref()
            .map(|k| (k, unit.awaiting_replies(kept::MAX_BYTES)));
        // The messages this process published that wait to be deleted go
        // with the write-back, instead of a statement of their own.
        let published = self.outlet.take_published();
        unit.delete_published(published.clone());
        let mut written = match session.write_back(unit, flows).await {
            Ok(written) => written,
            Err(e) => {
                self.outlet.keep_published(published);
                return Err(e);
            }
        };
        if let Some((kept, orders)) = keep {
            kept.keep(orders, &written.versions, written.room.clone());
        }
        self.outlet
            .hand_over(std::mem::take(&mut written.committed));
        Ok((value, written))
    }

    /// Stores a new order, its steps and its `received` event, and wakes
    /// the schedulers. An existing id changes nothing.
    pub async fn submit(
        &self,
        order: &NewOrder,
        workflow: &Workflow,
    ) -> Result<Submitted, StoreError> {
        let mut outcome = self.submit_many(&[(order, workflow)]).await?;
        outcome.pop().ok_or(StoreError::NoOutcome)
    }

    /// Stores a batch of new orders, with their steps and `received` events,
    /// in one statement with one wake-up for the schedulers; one outcome
    /// per order, in order. An id that exists, or came earlier in the batch,
    /// is a duplicate and changes nothing.
    pub async fn submit_many(
        &self,
        batch: &[(&NewOrder, &Workflow)],
    ) -> Result<Vec<Submitted>, StoreError> {
        self.store_new(batch, None).await
    }

    /// Stores a batch of new orders as [`Self::submit_many`] does and,
    /// while fewer than `room` orders are held (driven by an instance)
    /// deployment-wide, starts, as `me`, each one whose first steps may go
    /// now: claimed and dispatched in the same write-back
    /// ([`rules::submission::receive_and_start`]), so no scheduler is woken
    /// to read back and claim what was just written. The others wait,
    /// pending, for the schedulers, whose claims keep their bounds and
    /// priorities under load. Once the started orders' step requests reach
    /// `requests`, the rest wait too, as a claim stops at its bound
    /// ([`ClaimBounds::requests`]): a burst of fan-out orders never holds
    /// a batch times its fan-out in the submission's memory.
    pub async fn submit_and_start(
        &self,
        me: &Actor,
        room: u32,
        requests: u32,
        batch: &[(&NewOrder, &Workflow)],
    ) -> Result<Vec<Submitted>, StoreError> {
        let requests = usize::try_from(requests).unwrap_or(usize::MAX);
        self.store_new(batch, Some((me, room, requests))).await
    }

    async fn store_new(
        &self,
        batch: &[(&NewOrder, &Workflow)],
        starter: Option<(&Actor, u32, usize)>,
    ) -> Result<Vec<Submitted>, StoreError> {
        let mut session = self.session().await?;
        // The starter, and how many more orders it may start. Only while
        // the outlet publishes at once: a busy one (under load) would leave
        // the started orders' requests to its passes, where the schedulers'
        // batched claims serve better.
        let max_requests = starter.map_or(0, |(_, _, requests)| requests);
        let (mut unit, mut starter) = match starter {
            Some((me, bound, _)) if session.locks() == OutboxLocks::Take => {
                let bound = i64::from(bound);
                // The room the last start left, or read now.
                let room = match self.room.fresh() {
                    Some(room) => room,
                    None => session.room(bound).await?,
                };
                let mut unit = session.empty_in(&room);
                unit.room = Some(bound);
                (unit, Some((me, bound - room.held)))
            }
            _ => (session.empty(), None),
        };
        let mut seen = std::collections::HashSet::with_capacity(batch.len());
        let mut started = std::collections::HashSet::new();
        for &(order, workflow) in batch {
            if !seen.insert(order.order_id) {
                continue;
            }
            let steps = workflow
                .plan(&order.payload)
                .iter()
                .zip(0..)
                .map(|(s, idx)| StepRow::planned(order.order_id, idx, s))
                .collect();
            let definition = (workflow.definition_id, &workflow.definition);
            let i = unit.insert(order, definition, steps);
            let decision = match &mut starter {
                Some((me, left)) if *left > 0 && unit.requests() < max_requests => {
                    let ctx = context(&unit, &me.name);
                    rules::submission::receive_and_start(&unit.get(i).order, ctx)?
                }
                _ => rules::submission::receive(&unit.get(i).order, context(&unit, "submission")),
            };
            // Started: held by its starter, one fewer it may start.
            if decision.order.row.locked_by.is_some() {
                started.insert(order.order_id);
                if let Some((_, left)) = &mut starter {
                    *left -= 1;
                }
            }
            apply(&mut unit, i, decision, &self.queues)?;
        }
        // Inserts only (a start takes no flow-control room): no guard to
        // fail, nothing to run again.
        let ((), written) = self.write_back_reading(session, ((), unit)).await?;
        if let Some(room) = written.room {
            let begun = written.created.iter().filter(|id| started.contains(id));
            self.room.keep(room, begun.count());
        }
        let mut outcome = vec![Submitted::Duplicate; batch.len()];
        for id in written.created {
            if let Some(pos) = batch.iter().position(|(o, _)| o.order_id == id) {
                outcome[pos] = Submitted::Created {
                    started: started.contains(&id),
                };
            }
        }
        Ok(outcome)
    }

    /// Claims up to `bounds.orders` orders for `me`, as long as `me` then
    /// holds no more than `bounds.max_held`, and dispatches each one's next
    /// step ([`rules::scheduler::claim`]), stopping early once their
    /// requests reach `bounds.requests`.
    pub async fn claim(&self, me: &Actor, bounds: ClaimBounds) -> Result<Claimed, StoreError> {
        again(|| self.claim_once(me, bounds)).await
    }

    async fn claim_once(&self, me: &Actor, bounds: ClaimBounds) -> Result<Claimed, StoreError> {
        let mut session = self.session().await?;
        let (limit, max_held) = (i64::from(bounds.orders), i64::from(bounds.max_held));
        let max_requests = usize::try_from(bounds.requests).unwrap_or(usize::MAX);
        let mut unit = session.load_claimable(limit, &me.name, max_held).await?;
        let decided = {
            let mut claimed = Claimed {
                ids: Vec::with_capacity(unit.len()),
                more: false,
            };
            for i in 0..unit.len() {
                if unit.requests() >= max_requests {
                    // The rest stay as they were read, for the next claim.
                    claimed.more = true;
                    break;
                }
                let order = &unit.get(i).order;
                let decision =
                    match rules::scheduler::claim_or_wait(order, context(&unit, &me.name))? {
                        rules::scheduler::Claim::Decided(decision) => *decision,
                        // Held for its agent's room already: left as it was.
                        rules::scheduler::Claim::Waits => continue,
                    };
                claimed.ids.push(order.row.order_id);
                apply(&mut unit, i, decision, &self.queues)?;
            }
            claimed
        };
        Ok(self.write_back(session, (decided, unit)).await?.0)
    }

    /// Applies an agent's reply ([`rules::scheduler::apply_reply`]): fenced
    /// by the order's state, its lock holder, its attempt and the step's
    /// current dispatch; then dispatches what comes next. `me` takes over
    /// the order's claim.
    pub async fn apply_reply(
        &self,
        me: &Actor,
        reply: &StepReply,
    ) -> Result<ReplyOutcome, StoreError> {
        let mut outcome = self.apply_replies(me, std::slice::from_ref(reply)).await?;
        outcome.pop().ok_or(StoreError::NoOutcome)
    }

    /// Applies a batch of replies together, each as
    /// [`apply_reply`](Self::apply_reply) would, in the order given (a
    /// duplicate later in the batch finds its dispatch answered already).
    /// One outcome per reply, in order.
    pub async fn apply_replies(
        &self,
        me: &Actor,
        replies: &[StepReply],
    ) -> Result<Vec<ReplyOutcome>, StoreError> {
        again(|| self.apply_once(me, replies)).await
    }

    async fn apply_once(
        &self,
        me: &Actor,
        replies: &[StepReply],
    ) -> Result<Vec<ReplyOutcome>, StoreError> {
        let mut ids: Vec<Uuid> = replies.iter().map(|r| r.order_id).collect();
        ids.sort_unstable();
        ids.dedup();
        let mut session = self.session().await?;
        let (unit, outcome) = match &self.kept {
            // The orders kept are not loaded again; the write-back reads
            // the room for the next replies to decide in.
            Some(kept) => {
                let answered: Vec<(Uuid, Uuid)> = replies
                    .iter()
                    .map(|r| (r.order_id, r.dispatch_id))
                    .collect();
                let (orders, load, room) = kept.take(&answered);
                let mut unit = session.load_keeping(&load, orders, room.as_ref()).await?;
                unit.room = Some(0);
                let outcome = self.apply_all(&mut unit, me, replies)?;
                if !unit.unchecked_kept() {
                    (unit, outcome)
                } else {
                    // Judged on a kept order that the write-back would
                    // leave unwritten, so that no version guard checks it
                    // (a reply judged stale): judge again on it loaded.
                    let mut unit = session.load(&ids).await?;
                    unit.room = Some(0);
                    let outcome = self.apply_all(&mut unit, me, replies)?;
                    (unit, outcome)
                }
            }
            None => {
                let mut unit = session.load(&ids).await?;
                let outcome = self.apply_all(&mut unit, me, replies)?;
                (unit, outcome)
            }
        };
        Ok(self.write_back(session, (outcome, unit)).await?.0)
    }

    /// The replies against the unit's orders, in order.
    fn apply_all(
        &self,
        unit: &mut Unit,
        me: &Actor,
        replies: &[StepReply],
    ) -> Result<Vec<ReplyOutcome>, StoreError> {
        replies
            .iter()
            .map(|reply| self.apply_one(unit, me, reply))
            .collect()
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
                // Its request is done with: the write-back deletes it.
                unit.answered(reply.order_id, reply.dispatch_id);
                let (ended, created_at) = (Ending::of(&decision), decision.order.row.created_at);
                apply(unit, i, *decision, &self.queues)?;
                let age = (Utc::now() - created_at).to_std().unwrap_or_default();
                Ok(ReplyOutcome::Applied { ended, age })
            }
        }
    }

    /// Recovers the orders of `partitions` whose complete-by has passed
    /// ([`rules::supervisor::recover`], under each order's workflow's
    /// policy, [`rules::supervisor::policy`]): wakes an ended wait, or counts
    /// the failure and re-queues, holds or gives up the order.
    /// Knows nothing of the steps' business: only deadlines and counts.
    pub async fn recover_expired(
        &self,
        me: &Actor,
        settings: &Settings,
        partitions: &[i32],
    ) -> Result<Vec<Recovered>, StoreError> {
        again(|| self.recover_once(me, settings, partitions)).await
    }

    async fn recover_once(
        &self,
        me: &Actor,
        settings: &Settings,
        partitions: &[i32],
    ) -> Result<Vec<Recovered>, StoreError> {
        let mut session = self.session().await?;
        let count = i32::try_from(settings.supervisor.partitions).unwrap_or(i32::MAX);
        let batch = i64::from(settings.supervisor.batch);
        let mut unit = session.load_expired(batch, partitions, count).await?;
        let decided = {
            let mut recovered = Vec::with_capacity(unit.len());
            for i in 0..unit.len() {
                let ctx = context(&unit, &me.name);
                let order = &unit.get(i).order;
                let configured = settings.workflows.get(&order.row.workflow);
                let policy =
                    rules::supervisor::policy(order, &settings.supervisor, configured, ctx);
                let (decision, recovery) = rules::supervisor::recover(order, &policy, ctx);
                let (order_id, ended) = (decision.order.row.order_id, Ending::of(&decision));
                apply(&mut unit, i, decision, &self.queues)?;
                recovered.push(Recovered {
                    order_id,
                    recovery,
                    ended,
                });
                if matches!(recovery, Recovery::Requeued { .. }) {
                    crate::crash::point("supervisor.mid_sweep");
                }
            }
            recovered
        };
        Ok(self.write_back(session, (decided, unit)).await?.0)
    }

    /// Climbs the deadline ladder ([`rules::supervisor::warn`]): warns the
    /// orders whose running step has passed a rung of `settings.warn_at`
    /// since its dispatch. Returns how many orders were warned.
    pub async fn warn_late(
        &self,
        me: &Actor,
        settings: &SupervisorSettings,
    ) -> Result<usize, StoreError> {
        if settings.warn_at.is_empty() {
            return Ok(0);
        }
        again(|| self.warn_once(me, settings)).await
    }

    async fn warn_once(
        &self,
        me: &Actor,
        settings: &SupervisorSettings,
    ) -> Result<usize, StoreError> {
        let mut session = self.session().await?;
        let limit = i64::from(settings.batch);
        let mut unit = session.load_warnable(&settings.warn_at, limit).await?;
        let mut warned = 0;
        for i in 0..unit.len() {
            let ctx = context(&unit, &me.name);
            if let Some(decision) = rules::supervisor::warn(&unit.get(i).order, settings, ctx) {
                apply(&mut unit, i, decision, &self.queues)?;
                warned += 1;
            }
        }
        Ok(self.write_back(session, (warned, unit)).await?.0)
    }

    /// Sends again, at once, the steps sent before `before` that the broker
    /// may have lost ([`rules::resend::resend`]), up to `settings.batch`
    /// orders per call. Returns the orders whose steps went again.
    pub async fn resend(
        &self,
        me: &Actor,
        before: Uuid,
        settings: &SupervisorSettings,
    ) -> Result<Vec<Uuid>, StoreError> {
        again(|| self.resend_once(me, before, settings)).await
    }

    async fn resend_once(
        &self,
        me: &Actor,
        before: Uuid,
        settings: &SupervisorSettings,
    ) -> Result<Vec<Uuid>, StoreError> {
        let mut session = self.session().await?;
        let limit = i64::from(settings.batch);
        let mut unit = session.load_unsent(before, limit).await?;
        let mut resent = Vec::with_capacity(unit.len());
        for i in 0..unit.len() {
            let ctx = context(&unit, &me.name);
            if let Some(decision) = rules::resend::resend(&unit.get(i).order, before, ctx)? {
                resent.push(decision.order.row.order_id);
                apply(&mut unit, i, decision, &self.queues)?;
            }
        }
        Ok(self.write_back(session, (resent, unit)).await?.0)
    }

    /// An operator's retry of an `error` order ([`rules::operator::retry`]):
    /// back to `pending` with its failure counts reset.
    pub async fn retry(&self, operator: &Actor, order_id: Uuid) -> Result<Operated, StoreError> {
        self.operate(operator, order_id, |order, ctx| {
            rules::operator::retry(order, ctx)
                .map_err(|why| Operated::NotAllowed(order.row.process_state, why))
        })
        .await
    }

    /// An operator's cancel of a `pending`, `processing` or `error` order
    /// ([`rules::operator::cancel`]): its completed steps are undone, newest
    /// first, by the schedulers.
    pub async fn cancel(&self, operator: &Actor, order_id: Uuid) -> Result<Operated, StoreError> {
        self.operate(operator, order_id, |order, ctx| {
            rules::operator::cancel(order, ctx)
                .map_err(|why| Operated::NotAllowed(order.row.process_state, why))
        })
        .await
    }

    /// The undo of child order `order_id` by its parent's step (contract
    /// §4d, [`rules::operator::undo_child`]): a cancel, which also undoes a
    /// processed child.
    pub async fn undo_child(&self, actor: &Actor, order_id: Uuid) -> Result<Operated, StoreError> {
        self.operate(actor, order_id, |order, ctx| {
            rules::operator::undo_child(order, ctx)
                .map_err(|why| Operated::NotAllowed(order.row.process_state, why))
        })
        .await
    }

    /// The application's signal `name` with `data` for an order (contract
    /// §4d, [`rules::waits::signal`]): the step waiting for it completes
    /// with `data` as its result and the order goes on. Refused with why
    /// when nothing of the order waits for it; a refused signal is not kept.
    pub async fn signal(
        &self,
        actor: &Actor,
        order_id: Uuid,
        name: &str,
        data: &serde_json::Value,
    ) -> Result<Operated, StoreError> {
        // Every way in (queue, HTTP, sasctl, dashboard) gets this answer.
        if let Some(why) = crate::messages::signal_refusal(name, data) {
            return Ok(Operated::PayloadRefused(why));
        }
        self.operate(actor, order_id, |order, ctx| {
            rules::waits::signal(order, name, data, ctx)
                .map_err(|why| Operated::NotAllowed(order.row.process_state, why))
        })
        .await
    }

    /// An operator's redrive of an `error` or `compensated` order
    /// ([`rules::operator::redrive`], contract §9): its payload merged
    /// with `patch` (RFC 7386) when there is one, which must then pass a
    /// submission's checks with `max_payload_bytes` as its limit
    /// (`submission.max_body_bytes`); back to `pending` as the order's next
    /// redrive, to run every step not completed (or undone) again under
    /// new idempotency keys.
    pub async fn redrive(
        &self,
        operator: &Actor,
        order_id: Uuid,
        patch: Option<&serde_json::Value>,
        max_payload_bytes: usize,
    ) -> Result<Operated, StoreError> {
        use rules::operator::RedriveError;
        self.operate(operator, order_id, |order, ctx| {
            let state = order.row.process_state;
            rules::operator::redrive(order, patch, max_payload_bytes, ctx).map_err(|e| match e {
                RedriveError::NotAllowed(why) => Operated::NotAllowed(state, why),
                RedriveError::Payload(why) => Operated::PayloadRefused(why),
                RedriveError::TooMany(_) => Operated::NotAllowed(state, "redriven too many times"),
            })
        })
        .await
    }

    /// Loads the order, asks `rule` and writes its decision back; a rule's
    /// refusal is the outcome as it is.
    async fn operate<R>(
        &self,
        operator: &Actor,
        order_id: Uuid,
        rule: R,
    ) -> Result<Operated, StoreError>
    where
        R: Fn(&Order, Given<'_>) -> Result<Decision, Operated>,
    {
        use tracing::Instrument as _;
        let span = tracing::info_span!("operate", %order_id, operator = %operator.name);
        again(|| self.operate_once(operator, order_id, &rule))
            .instrument(span)
            .await
    }

    async fn operate_once<R>(
        &self,
        operator: &Actor,
        order_id: Uuid,
        rule: &R,
    ) -> Result<Operated, StoreError>
    where
        R: Fn(&Order, Given<'_>) -> Result<Decision, Operated>,
    {
        let mut session = self.session().await?;
        let mut unit = session.load(&[order_id]).await?;
        let decided = if unit.is_empty() {
            Operated::NotFound
        } else {
            match rule(&unit.get(0).order, context(&unit, &operator.name)) {
                Ok(decision) => {
                    let to = decision.order.row.process_state;
                    apply(&mut unit, 0, decision, &self.queues)?;
                    Operated::Done(to)
                }
                Err(refused) => refused,
            }
        };
        Ok(self.write_back(session, (decided, unit)).await?.0)
    }
}

/// Runs `transition` again (up to [`RACES`] times) when its write-back
/// found that another transition changed one of its orders first.
async fn again<T, F>(mut transition: impl FnMut() -> F) -> Result<T, StoreError>
where
    F: Future<Output = Result<T, StoreError>>,
{
    let mut races = 0;
    loop {
        match transition().await {
            Err(e @ StoreError::WriteBackRefused(_)) if races < RACES => {
                races += 1;
                tracing::debug!(error = %e, "an order changed meanwhile; running again");
            }
            done => return done,
        }
    }
}

/// Whether any of these steps was undone or is being undone (see
/// [`rules::operator::any_undone`]).
pub fn any_undone(steps: &[StepRow]) -> bool {
    rules::operator::any_undone(steps)
}

/// The context of the rules for `actor` in `unit`'s transition.
fn context<'a>(unit: &'a Unit, actor: &'a str) -> Given<'a> {
    Given {
        now: unit.now,
        actor,
        new_id: Uuid::now_v7,
        gates: &unit.gates,
        flows: &unit.flows,
        definitions: &unit.definitions,
    }
}

//! A unit of work: the orders one transaction has locked (or is about to
//! insert), with their steps, changed in memory by the transitions and then
//! written back by one statement, however many orders the unit holds: the
//! new orders and their steps, one `UPDATE` of `orders`, one of `steps`, the
//! `order_events` and `outbox` rows, and the wake-up, each a data-modifying
//! part of one `WITH` over arrays.
//!
//! Why: a statement per change cost a round trip and, for `orders`, a new
//! row version (with an entry in every index) per change. Now each order row
//! gets one new version per transaction, and a batch of orders costs no more
//! round trips than one.
//!
//! The guards stay in the `WHERE` clauses: each row is written only if it
//! still holds what the transaction read (state, lock holder, event number,
//! step dispatch). The rows are locked, so a guard that fails means the data
//! is not what we read, and the whole transaction is rolled back.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use super::literal::Args;
use super::orders::{Locked, NewOrder, OrderRow};
use super::prepared;
use super::steps::{self, StepRow};
use super::{StoreError, WAKE_CHANNEL};
use crate::messages::StatusEvent;
use crate::rules::{Decision, Effect, Logged, Order};
use crate::state::ProcessState;
use crate::topology::QueueNames;
use crate::workflow::Step;

/// One locked order: as read, and as the rules have changed it.
#[derive(Debug)]
pub(super) struct Tracked {
    /// The order as changed so far.
    pub order: Order,
    read: Order,
    /// New: written by the unit's insert, nothing to update.
    inserted: bool,
    /// This connection holds the order's outbox lock.
    outbox_locked: bool,
}

/// An event row to insert.
#[derive(Debug)]
struct NewEvent {
    order_id: Uuid,
    seq: i32,
    kind: &'static str,
    from: Option<&'static str>,
    to: &'static str,
    step: Option<String>,
    attempt: i32,
    actor: String,
    reason: Option<String>,
    detail: Value,
}

/// An outbox row to insert.
#[derive(Debug)]
struct NewMessage {
    order_id: Uuid,
    kind: String,
    routing_key: String,
    correlation_id: Option<String>,
    reply_to: Option<String>,
    traceparent: Option<String>,
    /// The JSON to publish, encoded once here.
    body: Vec<u8>,
}

/// The locked orders of one transaction and what it will write.
#[derive(Debug)]
pub(super) struct Unit {
    /// Every timestamp the unit writes: the transaction's `now()`, or for
    /// new orders the submitting process's clock.
    pub now: DateTime<Utc>,
    orders: Vec<Tracked>,
    events: Vec<NewEvent>,
    messages: Vec<NewMessage>,
    /// The steps of the orders this unit inserts.
    new_steps: Vec<(Uuid, Vec<Step>)>,
    wake: bool,
}

impl Unit {
    /// A unit over `locked`, which this transaction has locked, with their
    /// steps (read again for the orders whose steps did not come with them).
    pub async fn load(conn: &mut PgConnection, locked: Vec<Locked>) -> Result<Self, StoreError> {
        let now = locked.first().map_or_else(Utc::now, |l| l.tx_now);
        let stale: Vec<Uuid> = locked
            .iter()
            .filter(|l| l.steps.is_none())
            .map(|l| l.order.order_id)
            .collect();
        let mut all_steps = if stale.is_empty() {
            Vec::new()
        } else {
            steps::for_orders(conn, &stale).await?
        };
        let mut unit = Self::empty(now);
        for l in locked {
            let (order, outbox_locked) = (l.order, l.outbox_locked.unwrap_or(false));
            let mine = match l.steps {
                Some(steps) => steps.0,
                None => {
                    let (mine, rest): (Vec<StepRow>, Vec<StepRow>) = all_steps
                        .into_iter()
                        .partition(|s| s.order_id == order.order_id);
                    all_steps = rest;
                    mine
                }
            };
            unit.track(order, mine, false);
            if let Some(t) = unit.orders.last_mut() {
                t.outbox_locked = outbox_locked;
            }
        }
        Ok(unit)
    }

    /// A unit with no orders yet, at `now`.
    pub fn empty(now: DateTime<Utc>) -> Self {
        Self {
            now,
            orders: Vec::new(),
            events: Vec::new(),
            messages: Vec::new(),
            new_steps: Vec::new(),
            wake: false,
        }
    }

    /// Adds a new order, to be inserted as `pending` with its steps unless
    /// its id exists (then nothing of it is written); returns its position.
    pub fn insert(&mut self, order: &NewOrder, steps: &[Step]) -> usize {
        let row = OrderRow {
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
            created_at: self.now,
            updated_at: self.now,
            trace_id: order.trace_id.clone(),
        };
        self.track(row, Vec::new(), true);
        self.new_steps.push((order.order_id, steps.to_vec()));
        self.orders.len() - 1
    }

    /// Adds an order; `inserted` when this unit creates it.
    fn track(&mut self, row: OrderRow, steps: Vec<StepRow>, inserted: bool) {
        let order = Order { row, steps };
        self.orders.push(Tracked {
            read: order.clone(),
            order,
            inserted,
            outbox_locked: false,
        });
    }

    /// How many orders the unit holds.
    pub fn len(&self) -> usize {
        self.orders.len()
    }

    /// The `i`-th order.
    pub fn get(&self, i: usize) -> &Tracked {
        &self.orders[i]
    }

    /// The position of an order, if the unit holds it.
    pub fn find(&self, order_id: Uuid) -> Option<usize> {
        self.orders
            .iter()
            .position(|t| t.order.row.order_id == order_id)
    }

    /// Takes `decision` for order `i`: its rows replace the order's, its
    /// events are logged (and announced on the order's status queue), and
    /// its requests and alerts are queued, in the order decided.
    pub fn apply(
        &mut self,
        i: usize,
        decision: Decision,
        queues: &QueueNames,
    ) -> Result<(), StoreError> {
        self.orders[i].order = decision.order;
        self.wake |= decision.wake;
        for effect in decision.effects {
            match effect {
                Effect::Event(logged) => self.event(i, logged),
                Effect::Request { agent, request } => {
                    let message = self.message(
                        i,
                        "request",
                        queues.agent_requests(&agent),
                        serde_json::to_vec(&request)?,
                    );
                    self.messages.push(NewMessage {
                        correlation_id: Some(request.dispatch_id.to_string()),
                        reply_to: Some(queues.replies().to_owned()),
                        ..message
                    });
                }
                Effect::Alert(alert) => {
                    let message = self.message(
                        i,
                        "alert",
                        queues.alerts().to_owned(),
                        serde_json::to_vec(&alert)?,
                    );
                    self.messages.push(message);
                }
            }
        }
        Ok(())
    }

    /// Logs an event of order `i` and, when the order has a status queue,
    /// queues the status event (contract §2).
    fn event(&mut self, i: usize, e: Logged) {
        let now = self.now;
        let o = &self.orders[i].order.row;
        if let Some(queue) = &o.reply_to {
            let event = StatusEvent {
                order_id: Value::String(o.order_id.to_string()),
                seq: i64::from(e.seq),
                state: e.kind,
                step: e.step.clone(),
                attempt: Some(e.attempt),
                at: now,
                detail: e.detail.clone(),
            };
            // A status event always serializes.
            let body = serde_json::to_vec(&event).unwrap_or_default();
            let message = self.message(i, "status", queue.clone(), body);
            self.messages.push(NewMessage {
                correlation_id: Some(o.order_id.to_string()),
                ..message
            });
        }
        self.events.push(NewEvent {
            order_id: o.order_id,
            seq: e.seq,
            kind: e.kind.as_str(),
            from: e.from.map(ProcessState::as_str),
            to: e.to.as_str(),
            step: e.step,
            attempt: e.attempt,
            actor: e.actor,
            reason: e.reason,
            detail: e.detail,
        });
    }

    /// A message of order `i`, with a new span of the order's trace.
    fn message(&self, i: usize, kind: &str, routing_key: String, body: Vec<u8>) -> NewMessage {
        let o = &self.orders[i].order.row;
        NewMessage {
            order_id: o.order_id,
            kind: kind.to_owned(),
            routing_key,
            correlation_id: None,
            reply_to: None,
            traceparent: o
                .trace_id
                .as_deref()
                .and_then(crate::trace::TraceContext::child_of)
                .map(|t| t.to_string()),
            body,
        }
    }

    /// Writes everything back in one statement: the new orders with their
    /// steps, the orders' and steps' updates, the events, the messages and
    /// the wake-up, each a data-modifying part of one `WITH`. Fails on the
    /// server, writing nothing, if a row no longer holds what was read.
    ///
    /// With `direct`, the new orders' outbox locks are taken too (the
    /// locked orders' were taken when they were read), and the messages of
    /// locked orders with no older message waiting come back to be
    /// published at once; those of orders whose lock another publisher held
    /// follow it ([`Flushed::follow`]), the others' are left to the relay.
    ///
    /// The statement runs by name with its arguments as literals
    /// ([`super::prepared`]); `how` says whether it ends the transaction.
    pub async fn flush(
        self,
        conn: &mut PgConnection,
        direct: bool,
        how: WriteBack,
    ) -> Result<Flushed, StoreError> {
        let orders: Vec<&Tracked> = self
            .orders
            .iter()
            .filter(|t| !t.inserted && t.order.row != t.read.row)
            .collect();
        let steps: Vec<(&StepRow, &StepRow)> = self
            .orders
            .iter()
            .filter(|t| !t.inserted)
            .flat_map(|t| t.order.steps.iter().zip(&t.read.steps))
            .filter(|(now, read)| now != read)
            .collect();
        let locked: Vec<Uuid> = self
            .orders
            .iter()
            .filter(|t| t.outbox_locked)
            .map(|t| t.order.row.order_id)
            .collect();
        if self.new_steps.is_empty()
            && orders.is_empty()
            && steps.is_empty()
            && self.events.is_empty()
            && self.messages.is_empty()
            && !self.wake
        {
            if how == WriteBack::Commit {
                sqlx::raw_sql("COMMIT").execute(&mut *conn).await?;
            }
            return Ok(Flushed {
                holds_locks: !locked.is_empty(),
                ..Flushed::default()
            });
        }
        let inserted: Vec<&Tracked> = self.orders.iter().filter(|t| t.inserted).collect();
        let args = bind_orders(Args::default(), &orders);
        let args = bind_steps(args, &steps);
        let args = bind_events(args, &self.events);
        let args = bind_messages(args, &self.messages);
        let args = args.scalar(WAKE_CHANNEL).scalar(self.wake);
        let mut sql = bind_inserts(args, &inserted, &self.new_steps)
            .scalar(self.now)
            .scalar(direct)
            .array(&locked)
            .scalar(orders.len() as i64)
            .scalar(steps.len() as i64)
            .execute("sas_flush");
        match how {
            WriteBack::Alone => {}
            WriteBack::InTransaction => prepared::ensure(conn).await?,
            WriteBack::Commit => sql.push_str("; COMMIT"),
        }
        let found: Result<Vec<FlushRow>, sqlx::Error> =
            prepared::run(conn, sql, how != WriteBack::Alone).await;
        let row = match found {
            Ok(mut rows) => rows
                .pop()
                .ok_or_else(|| StoreError::WriteBackRefused("it returned no row".into()))?,
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(GUARD_FAILED) => {
                return Err(StoreError::WriteBackRefused(e.message().to_owned()));
            }
            Err(e) => return Err(e.into()),
        };
        let new: std::collections::HashSet<Uuid> =
            inserted.iter().map(|t| t.order.row.order_id).collect();
        Ok(row.sort(self.messages, &new, locked, direct))
    }
}

/// How [`Unit::flush`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WriteBack {
    /// On its own: a statement commits as it ends.
    Alone,
    /// Inside a transaction that sqlx opened and the caller commits.
    InTransaction,
    /// Last in a transaction opened with [`super::prepared::begin_with`]:
    /// `COMMIT` goes in the same round trip. The statement's guards fail it
    /// (and so the transaction) on the server, before the `COMMIT` runs.
    Commit,
}

/// The SQLSTATE of `sas_fail`, raised when a guard of [`FLUSH`] finds a row
/// changed under its lock.
const GUARD_FAILED: &str = "SAS01";

/// What [`Unit::flush`] wrote, and where its messages go.
#[derive(Debug, Default)]
pub(super) struct Flushed {
    /// The new orders inserted (an id that existed is not).
    pub created: Vec<Uuid>,
    /// Messages to publish at once, in order, with their outbox ids: those
    /// of orders whose outbox lock this connection holds and that have no
    /// older message waiting.
    pub publish: Vec<super::OutboxRow>,
    /// Orders whose new messages are left to the relay.
    pub later: Vec<Uuid>,
    /// Orders whose outbox lock another publisher held (in a transition
    /// that asked for the locks): their messages follow once it lets go.
    pub follow: Vec<Uuid>,
    /// This connection holds outbox locks, to let go after publishing.
    pub holds_locks: bool,
}

/// The row [`FLUSH`] returns.
#[derive(Debug, sqlx::FromRow)]
struct FlushRow {
    created: Vec<Uuid>,
    /// The ids of the messages written, ascending: the order they were given in.
    message_ids: Vec<i64>,
    /// New orders whose outbox lock this connection took.
    locked_new: Vec<Uuid>,
    /// Locked orders that had messages waiting from earlier transitions.
    waiting: Vec<Uuid>,
}

impl FlushRow {
    /// Pairs the messages written with their ids and splits them between
    /// publishing now and the relay. `new` are the orders the unit inserted
    /// (the messages of one that existed were not written); `locked` the
    /// existing orders whose outbox lock this connection holds.
    fn sort(
        self,
        messages: Vec<NewMessage>,
        new: &std::collections::HashSet<Uuid>,
        mut locked: Vec<Uuid>,
        direct: bool,
    ) -> Flushed {
        locked.extend(&self.locked_new);
        let written: Vec<NewMessage> = messages
            .into_iter()
            .filter(|m| !new.contains(&m.order_id) || self.created.contains(&m.order_id))
            .collect();
        let mut out = Flushed {
            holds_locks: !locked.is_empty(),
            ..Flushed::default()
        };
        // Written as many as given: ids ascend in the order given.
        let paired = written.len() == self.message_ids.len();
        for (i, m) in written.into_iter().enumerate() {
            let now = paired && locked.contains(&m.order_id) && !self.waiting.contains(&m.order_id);
            match self.message_ids.get(i) {
                Some(&id) if now => out.publish.push(super::OutboxRow {
                    id,
                    order_id: m.order_id,
                    kind: m.kind,
                    routing_key: m.routing_key,
                    correlation_id: m.correlation_id,
                    reply_to: m.reply_to,
                    traceparent: m.traceparent,
                    body: m.body,
                }),
                _ => {
                    let busy = direct && paired && !locked.contains(&m.order_id);
                    let to = if busy {
                        &mut out.follow
                    } else {
                        &mut out.later
                    };
                    if !to.contains(&m.order_id) {
                        to.push(m.order_id);
                    }
                }
            }
        }
        out.created = self.created;
        out
    }
}

/// The one statement of [`Unit::flush`]. Each part reads its rows from
/// arrays (`unnest`), so it costs one round trip for any number of orders.
/// Guards: an order is written only if its state, lock holder and event
/// number are still what was read; a step only if its state and dispatch
/// are; and when a guard leaves a row unwritten (`$61` orders and `$62`
/// steps are expected), `sas_fail` fails the statement, so that nothing of
/// it stays and the transaction cannot commit.
pub(super) const FLUSH: &str = "\
WITH n AS ( \
  INSERT INTO orders (order_id, workflow, payload, reply_to, priority, not_before, trace_id, \
    last_seq, created_at, updated_at) \
  SELECT id, workflow, payload::jsonb, reply_to, priority, not_before, trace_id, seq, $58, $58 \
  FROM unnest($44::uuid[], $45::text[], $46::text[], $47::text[], $48::smallint[], \
              $49::timestamptz[], $50::text[], $51::int[]) \
    AS u(id, workflow, payload, reply_to, priority, not_before, trace_id, seq) \
  ON CONFLICT (order_id) DO NOTHING \
  RETURNING order_id, CASE WHEN $59 \
    THEN pg_try_advisory_lock(hashtextextended('sas.outbox:' || order_id::text, 0)) ELSE false END AS locked), \
ns AS ( \
  INSERT INTO steps (order_id, idx, name, agent, compensate, timeout_ms) \
  SELECT * FROM unnest($52::uuid[], $53::int[], $54::text[], $55::text[], $56::text[], $57::bigint[]) \
    AS u(id, idx, name, agent, compensate, timeout_ms) \
  WHERE u.id IN (SELECT order_id FROM n)), \
o AS ( \
  UPDATE orders o SET process_state = u.state, locked_by = u.locked_by, \
    complete_by = u.complete_by, not_before = u.not_before, failure_count = u.failures, \
    compensation_failures = u.comp_failures, last_seq = u.seq, last_error = u.error, \
    updated_at = now() \
  FROM unnest($1::uuid[], $2::text[], $3::text[], $4::timestamptz[], $5::timestamptz[], \
              $6::int[], $7::int[], $8::int[], $9::text[], $10::text[], $11::text[], $12::int[]) \
    AS u(id, state, locked_by, complete_by, not_before, failures, comp_failures, seq, error, \
         was_state, was_locked_by, was_seq) \
  WHERE o.order_id = u.id AND o.process_state = u.was_state \
    AND o.locked_by IS NOT DISTINCT FROM u.was_locked_by AND o.last_seq = u.was_seq \
  RETURNING 1), \
s AS ( \
  UPDATE steps s SET state = u.state, dispatches = u.dispatches, dispatch_id = u.dispatch_id, \
    complete_by = u.complete_by, result = u.result::jsonb, error = u.error, \
    started_at = u.started_at, finished_at = u.finished_at \
  FROM unnest($13::uuid[], $14::int[], $15::text[], $16::int[], $17::uuid[], $18::timestamptz[], \
              $19::text[], $20::text[], $21::timestamptz[], $22::timestamptz[], $23::text[], $24::uuid[]) \
    AS u(id, idx, state, dispatches, dispatch_id, complete_by, result, error, started_at, \
         finished_at, was_state, was_dispatch) \
  WHERE s.order_id = u.id AND s.idx = u.idx AND s.state = u.was_state \
    AND s.dispatch_id IS NOT DISTINCT FROM u.was_dispatch \
  RETURNING 1), \
e AS ( \
  INSERT INTO order_events (order_id, seq, event, from_state, to_state, step, attempt, actor, reason, detail, at) \
  SELECT id, seq, event, from_state, to_state, step, attempt, actor, reason, detail::jsonb, $58 \
  FROM unnest($25::uuid[], $26::int[], $27::text[], $28::text[], $29::text[], $30::text[], $31::int[], \
              $32::text[], $33::text[], $34::text[]) \
    AS u(id, seq, event, from_state, to_state, step, attempt, actor, reason, detail) \
  WHERE u.id <> ALL($44) OR u.id IN (SELECT order_id FROM n)), \
m AS ( \
  INSERT INTO outbox (order_id, kind, routing_key, correlation_id, reply_to, traceparent, body) \
  SELECT id, kind, routing_key, correlation_id, reply_to, traceparent, body \
  FROM unnest($35::uuid[], $36::text[], $37::text[], $38::text[], $39::text[], $40::text[], $41::bytea[]) \
    WITH ORDINALITY AS u(id, kind, routing_key, correlation_id, reply_to, traceparent, body, n) \
  WHERE u.id <> ALL($44) OR u.id IN (SELECT order_id FROM n) \
  ORDER BY n RETURNING id), \
w AS (SELECT pg_notify($42, '') WHERE $43 AND (cardinality($44) = 0 OR EXISTS (SELECT 1 FROM n))) \
SELECT (SELECT count(*) FROM w) AS woken, ARRAY(SELECT order_id FROM n) AS created, \
  ARRAY(SELECT id FROM m ORDER BY id) AS message_ids, \
  ARRAY(SELECT order_id FROM n WHERE locked) AS locked_new, \
  ARRAY(SELECT DISTINCT order_id FROM outbox WHERE order_id = ANY($60::uuid[])) AS waiting, \
  CASE WHEN (SELECT count(*) FROM o) = $61::bigint AND (SELECT count(*) FROM s) = $62::bigint \
    THEN true ELSE sas_fail('rows changed under their row locks') END AS guarded";

/// JSON as text, for a `text[]` parameter cast to `jsonb[]`.
fn json_text(v: &Value) -> String {
    v.to_string()
}

/// The new orders and their steps; the events and messages of a new order
/// whose id existed are left out.
fn bind_inserts(q: Args, new: &[&Tracked], steps: &[(Uuid, Vec<Step>)]) -> Args {
    let ids: Vec<Uuid> = new.iter().map(|t| t.order.row.order_id).collect();
    let workflows: Vec<String> = new.iter().map(|t| t.order.row.workflow.clone()).collect();
    let payloads: Vec<String> = new
        .iter()
        .map(|t| json_text(&t.order.row.payload))
        .collect();
    let reply_tos: Vec<Option<String>> = new.iter().map(|t| t.order.row.reply_to.clone()).collect();
    let priorities: Vec<i16> = new.iter().map(|t| t.order.row.priority).collect();
    let not_before: Vec<Option<DateTime<Utc>>> =
        new.iter().map(|t| t.order.row.not_before).collect();
    let traces: Vec<Option<String>> = new.iter().map(|t| t.order.row.trace_id.clone()).collect();
    let seqs: Vec<i32> = new.iter().map(|t| t.order.row.last_seq).collect();
    let mut step_ids = Vec::new();
    let mut idx = Vec::new();
    let mut names = Vec::new();
    let mut agents = Vec::new();
    let mut comps = Vec::new();
    let mut timeouts = Vec::new();
    for (order_id, steps) in steps {
        for (i, s) in steps.iter().enumerate() {
            step_ids.push(*order_id);
            idx.push(i32::try_from(i).unwrap_or(i32::MAX));
            names.push(s.name.clone());
            agents.push(s.agent.clone());
            comps.push(s.compensate.clone());
            timeouts.push(i64::try_from(s.timeout.as_millis()).unwrap_or(i64::MAX));
        }
    }
    q.array(&ids)
        .array(&workflows)
        .array(&payloads)
        .array(&reply_tos)
        .array(&priorities)
        .array(&not_before)
        .array(&traces)
        .array(&seqs)
        .array(&step_ids)
        .array(&idx)
        .array(&names)
        .array(&agents)
        .array(&comps)
        .array(&timeouts)
}

fn bind_orders(q: Args, changed: &[&Tracked]) -> Args {
    let col = |f: fn(&Tracked) -> Option<String>| changed.iter().map(|t| f(t)).collect::<Vec<_>>();
    let ids: Vec<Uuid> = changed.iter().map(|t| t.order.row.order_id).collect();
    let states = col(|t| Some(t.order.row.process_state.as_str().to_owned()));
    let locks = col(|t| t.order.row.locked_by.clone());
    let deadlines: Vec<Option<DateTime<Utc>>> =
        changed.iter().map(|t| t.order.row.complete_by).collect();
    let not_before: Vec<Option<DateTime<Utc>>> =
        changed.iter().map(|t| t.order.row.not_before).collect();
    let failures: Vec<i32> = changed.iter().map(|t| t.order.row.failure_count).collect();
    let comp_failures: Vec<i32> = changed
        .iter()
        .map(|t| t.order.row.compensation_failures)
        .collect();
    let seqs: Vec<i32> = changed.iter().map(|t| t.order.row.last_seq).collect();
    let errors = col(|t| t.order.row.last_error.clone());
    let was_states = col(|t| Some(t.read.row.process_state.as_str().to_owned()));
    let was_locks = col(|t| t.read.row.locked_by.clone());
    let was_seqs: Vec<i32> = changed.iter().map(|t| t.read.row.last_seq).collect();
    q.array(&ids)
        .array(&states)
        .array(&locks)
        .array(&deadlines)
        .array(&not_before)
        .array(&failures)
        .array(&comp_failures)
        .array(&seqs)
        .array(&errors)
        .array(&was_states)
        .array(&was_locks)
        .array(&was_seqs)
}

fn bind_steps(q: Args, changed: &[(&StepRow, &StepRow)]) -> Args {
    let ids: Vec<Uuid> = changed.iter().map(|(s, _)| s.order_id).collect();
    let idx: Vec<i32> = changed.iter().map(|(s, _)| s.idx).collect();
    let states: Vec<&'static str> = changed.iter().map(|(s, _)| s.state.as_str()).collect();
    let dispatches: Vec<i32> = changed.iter().map(|(s, _)| s.dispatches).collect();
    let dispatch_ids: Vec<Option<Uuid>> = changed.iter().map(|(s, _)| s.dispatch_id).collect();
    let deadlines: Vec<Option<DateTime<Utc>>> =
        changed.iter().map(|(s, _)| s.complete_by).collect();
    let results: Vec<Option<String>> = changed
        .iter()
        .map(|(s, _)| s.result.as_ref().map(json_text))
        .collect();
    let errors: Vec<Option<String>> = changed.iter().map(|(s, _)| s.error.clone()).collect();
    let started: Vec<Option<DateTime<Utc>>> = changed.iter().map(|(s, _)| s.started_at).collect();
    let finished: Vec<Option<DateTime<Utc>>> = changed.iter().map(|(s, _)| s.finished_at).collect();
    let was_states: Vec<&'static str> = changed.iter().map(|(_, r)| r.state.as_str()).collect();
    let was_dispatch: Vec<Option<Uuid>> = changed.iter().map(|(_, r)| r.dispatch_id).collect();
    q.array(&ids)
        .array(&idx)
        .array(&states)
        .array(&dispatches)
        .array(&dispatch_ids)
        .array(&deadlines)
        .array(&results)
        .array(&errors)
        .array(&started)
        .array(&finished)
        .array(&was_states)
        .array(&was_dispatch)
}

fn bind_events(q: Args, events: &[NewEvent]) -> Args {
    let ids: Vec<Uuid> = events.iter().map(|e| e.order_id).collect();
    let seqs: Vec<i32> = events.iter().map(|e| e.seq).collect();
    let kinds: Vec<&'static str> = events.iter().map(|e| e.kind).collect();
    let froms: Vec<Option<&'static str>> = events.iter().map(|e| e.from).collect();
    let tos: Vec<&'static str> = events.iter().map(|e| e.to).collect();
    let steps: Vec<Option<String>> = events.iter().map(|e| e.step.clone()).collect();
    let attempts: Vec<i32> = events.iter().map(|e| e.attempt).collect();
    let actors: Vec<String> = events.iter().map(|e| e.actor.clone()).collect();
    let reasons: Vec<Option<String>> = events.iter().map(|e| e.reason.clone()).collect();
    let details: Vec<String> = events.iter().map(|e| json_text(&e.detail)).collect();
    q.array(&ids)
        .array(&seqs)
        .array(&kinds)
        .array(&froms)
        .array(&tos)
        .array(&steps)
        .array(&attempts)
        .array(&actors)
        .array(&reasons)
        .array(&details)
}

fn bind_messages(q: Args, messages: &[NewMessage]) -> Args {
    let ids: Vec<Uuid> = messages.iter().map(|m| m.order_id).collect();
    let kinds: Vec<String> = messages.iter().map(|m| m.kind.clone()).collect();
    let keys: Vec<String> = messages.iter().map(|m| m.routing_key.clone()).collect();
    let correlations: Vec<Option<String>> =
        messages.iter().map(|m| m.correlation_id.clone()).collect();
    let reply_tos: Vec<Option<String>> = messages.iter().map(|m| m.reply_to.clone()).collect();
    let traces: Vec<Option<String>> = messages.iter().map(|m| m.traceparent.clone()).collect();
    let bodies: Vec<Vec<u8>> = messages.iter().map(|m| m.body.clone()).collect();
    // In the order given: the relay publishes an order's messages by `id`.
    q.array(&ids)
        .array(&kinds)
        .array(&keys)
        .array(&correlations)
        .array(&reply_tos)
        .array(&traces)
        .array(&bodies)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_write_back_takes_new_orders_outbox_locks_by_the_relays_key() {
        // A literal in the statement: it must stay the key the relay try-locks.
        assert!(FLUSH.contains(&super::super::outbox::lock_key("order_id")));
    }
}

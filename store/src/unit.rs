//! A unit of work: the orders one transition has loaded (or is about to
//! insert), as the rules changed them, written back by one statement however
//! many orders the unit holds: the new orders and their steps, one `UPDATE`
//! of `orders`, one of `steps`, the `order_events` and `outbox` rows, and
//! the wake-up, each a data-modifying part of one `WITH`. Each table's rows
//! are one parameter, a JSON array read by `jsonb_to_recordset` (message
//! bodies, bytes, are an array of `bytea` beside it): a column added is a
//! field of one struct here and a name in [`FLUSH`].
//!
//! Why one statement: a statement per change cost a round trip and, for
//! `orders`, a new row version (with an entry in every index) per change.
//! Now each order row gets one new version per transition, a batch of
//! orders costs no more round trips than one, and the statement is atomic
//! on its own: no transaction to open and close around it.
//!
//! The guards are in the `WHERE` clauses: an order row is written only if
//! it is still the version that was loaded (`xmin`), and a step only if it
//! still holds its state and dispatch. A guard that fails means another
//! transition got there first: the statement fails as a whole
//! ([`StoreError::WriteBackRefused`]), and the transition runs again on
//! what is there now.

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgConnection;
use sqlx::types::Json;
use uuid::Uuid;

use super::orders::{Loaded, NewOrder, OrderRow};
use super::outbox::OutboxLocks;
use super::steps::StepRow;
use super::{StoreError, WAKE_CHANNEL};
use sas_core::rules::Order;
use sas_core::rules::breaker::Gate;
use sas_core::rules::flow::{Flow, FlowDelta};
use sas_core::spec::Definition;

/// One loaded order: as read, and as the rules have changed it.
#[derive(Debug)]
pub struct Tracked {
    /// The order as changed so far.
    pub order: Order,
    /// The order as read (or inserted).
    pub read: Order,
    /// The row version read; the write-back's guard.
    version: i64,
    /// New: written by the unit's insert, nothing to update.
    inserted: bool,
    /// Kept by the process from its last write-back, not loaded
    /// ([`Unit::keep`]).
    kept: bool,
    /// The `traceparent` of the messages of its latest decision: that
    /// decision's exported span; `None` when nothing is exported (each
    /// message gets a new span id of its trace).
    pub hop: Option<String>,
}

/// An `order_events` row to insert.
#[derive(Debug, Serialize)]
pub struct NewEvent {
    pub order_id: Uuid,
    pub seq: i32,
    pub event: &'static str,
    pub from_state: Option<&'static str>,
    pub to_state: &'static str,
    pub step: Option<String>,
    pub attempt: i32,
    pub actor: String,
    pub reason: Option<String>,
    /// JSON text: `jsonb` exactly as given, a JSON `null` included.
    pub detail: String,
}

/// An `outbox` row to insert; its body goes beside it, as `bytea`.
#[derive(Debug, Serialize)]
pub struct NewMessage {
    pub order_id: Uuid,
    /// `status`, `request` or `alert`.
    pub kind: String,
    pub routing_key: String,
    pub correlation_id: Option<String>,
    pub reply_to: Option<String>,
    pub traceparent: Option<String>,
    /// The JSON to publish, encoded once.
    #[serde(skip)]
    pub body: Vec<u8>,
}

/// How a write-back keeps an order's messages in order behind its older
/// ones, by what it sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keeping {
    /// Its outbox lock, kept past the commit until the messages are
    /// published and deleted ([`super::Held`]): any message, when nothing
    /// is handed to a publisher that beats; and the status events (or
    /// alerts) of an order that goes on (its requests stay handed).
    Lock,
    /// Nothing: step requests alone stay handed over until their replies.
    Nothing,
    /// Its lock for the write-back only, then every message handed over,
    /// deleted by the publisher in a batch once confirmed: the events of an
    /// order that ended (nothing follows them but an operator's retry; a
    /// crash before the delete sends them again, which at-least-once
    /// delivery allows). Until then, a relay takes none of the order's
    /// later messages.
    Handed,
}

/// A dispatch a reply answers: its request leaves the outbox.
#[derive(Debug, Serialize)]
struct Answered {
    order_id: Uuid,
    /// As the request's `correlation_id`.
    dispatch: String,
}

/// A new `orders` row.
#[derive(Debug, Serialize)]
struct OrderInsert<'a> {
    order_id: Uuid,
    workflow: &'a str,
    /// JSON text, as [`NewEvent::detail`].
    payload: String,
    reply_to: Option<&'a str>,
    priority: i16,
    not_before: Option<DateTime<Utc>>,
    trace_id: Option<&'a str>,
    trace_span: Option<&'a str>,
    last_seq: i32,
    events: &'static str,
    application: Option<&'a str>,
    app_order_id: Option<Uuid>,
    definition: Option<Uuid>,
    /// As the rules left it: `pending`, or started at once (its claim and
    /// complete-by with it).
    process_state: &'static str,
    locked_by: Option<&'a str>,
    complete_by: Option<DateTime<Utc>>,
}

/// A `definitions` row, stored unless it is already.
#[derive(Debug, Serialize)]
struct DefinitionInsert<'a> {
    id: Uuid,
    workflow: &'a str,
    version: Option<&'a str>,
    spec: &'a sas_core::spec::WorkflowSpec,
}

/// A new `steps` row.
#[derive(Debug, Serialize)]
struct StepInsert<'a> {
    order_id: Uuid,
    idx: i32,
    name: &'a str,
    agent: &'a str,
    compensate: Option<&'a str>,
    timeout_ms: i64,
    after_steps: Option<&'a [i32]>,
    max_duration_ms: Option<i64>,
    /// As the rules left it: not started, or (its order started at once)
    /// dispatched or skipped already.
    state: &'static str,
    dispatches: i32,
    dispatch_id: Option<Uuid>,
    complete_by: Option<DateTime<Utc>>,
    /// JSON text, as [`NewEvent::detail`].
    result: Option<String>,
    error: Option<&'a str>,
    started_at: Option<DateTime<Utc>>,
    finished_at: Option<DateTime<Utc>>,
}

/// An `orders` row's new values, guarded by the version that was read.
#[derive(Debug, Serialize)]
struct OrderUpdate<'a> {
    order_id: Uuid,
    process_state: &'static str,
    locked_by: Option<&'a str>,
    complete_by: Option<DateTime<Utc>>,
    not_before: Option<DateTime<Utc>>,
    failure_count: i32,
    compensation_failures: i32,
    last_seq: i32,
    last_error: Option<&'a str>,
    held_for: Option<&'a str>,
    held_since: Option<DateTime<Utc>>,
    hold_until: Option<DateTime<Utc>>,
    held_reason: Option<&'a str>,
    /// JSON text, as [`NewEvent::detail`], only when the payload changed
    /// (an operator's redrive with a patch): left out, the stored one stays.
    #[serde(skip_serializing_if = "Option::is_none")]
    payload: Option<String>,
    redrives: i32,
    version: i64,
}

/// A `steps` row's new values, guarded by the state and dispatch read.
#[derive(Debug, Serialize)]
struct StepUpdate<'a> {
    order_id: Uuid,
    idx: i32,
    state: &'static str,
    dispatches: i32,
    dispatch_id: Option<Uuid>,
    complete_by: Option<DateTime<Utc>>,
    /// JSON text, as [`NewEvent::detail`].
    result: Option<String>,
    error: Option<&'a str>,
    started_at: Option<DateTime<Utc>>,
    finished_at: Option<DateTime<Utc>>,
    warned: i16,
    in_doubt: bool,
    undo_in_doubt: bool,
    was_state: &'static str,
    was_dispatch: Option<Uuid>,
}

/// The orders of one transition and what it will write: the engine
/// applies its decisions to them ([`Unit::set`], [`Unit::push_event`],
/// [`Unit::push_message`]), the store writes them back.
#[derive(Debug)]
pub struct Unit {
    /// Every timestamp the unit writes: the database's `now()` when the
    /// orders were loaded, or for new orders the submitting process's clock.
    pub now: DateTime<Utc>,
    orders: Vec<Tracked>,
    events: Vec<NewEvent>,
    messages: Vec<NewMessage>,
    /// The orders whose claim locks this connection holds, let go by the write-back.
    claimed: Vec<Uuid>,
    wake: bool,
    /// The agents' breakers that are not closed, read with the orders.
    pub gates: Vec<Gate>,
    /// The agents under flow control, read with the orders; their counts
    /// grow with the unit's dispatches, so that later decisions see them.
    pub flows: Vec<Flow>,
    /// The agent of each request to an agent under flow control.
    pub dispatched: Vec<String>,
    /// The definitions the orders run under ([`sas_core::rules::Given::definitions`]).
    pub definitions: super::definitions::Definitions,
    /// Whether the write-back takes the outbox locks of the orders it
    /// writes messages for, so that they go out at once.
    locks: OutboxLocks,
    /// The instance that publishes what the write-back hands over, and
    /// whose heartbeat covers the step requests it sent: they stay in the
    /// outbox, handed to it, until their replies delete them. `None`: every
    /// message is deleted once published (a tool's hand-overs).
    pub(super) handed_to: Option<String>,
    /// The dispatches the unit's replies answer, `(order, dispatch)`: the
    /// write-back deletes their requests from the outbox.
    answered: Vec<(Uuid, Uuid)>,
    /// Outbox rows this process published (handed over, confirmed) that
    /// the write-back deletes too.
    published: Vec<i64>,
    /// Asks the write-back to read the room as it leaves it (its held
    /// count bounded by this), for the next orders to start in
    /// ([`super::session::Room`]).
    pub room: Option<i64>,
}

impl Unit {
    /// A unit over the orders `loaded`, which run under `definitions`;
    /// `claimed` when this connection took their claim locks
    /// ([`super::orders::claimable`]).
    pub(super) fn load(
        loaded: Vec<Loaded>,
        claimed: bool,
        definitions: super::definitions::Definitions,
        locks: OutboxLocks,
    ) -> Self {
        let now = loaded.first().map_or_else(Utc::now, |l| l.tx_now);
        let mut unit = Self::empty(now, locks);
        unit.definitions = definitions;
        if let Some(first) = loaded.first() {
            unit.gates = first.gates.0.clone();
            unit.flows = first.flows.0.clone();
        }
        for l in loaded {
            if claimed {
                unit.claimed.push(l.order.order_id);
            }
            let order = Order {
                row: l.order,
                steps: l.steps.0,
            };
            unit.orders.push(Tracked {
                read: order.clone(),
                order,
                version: l.version,
                inserted: false,
                kept: false,
                hop: None,
            });
        }
        unit
    }

    /// A unit with no orders yet, at `now`, whose write-back takes the
    /// outbox locks of its new orders as `locks` says.
    pub fn empty(now: DateTime<Utc>, locks: OutboxLocks) -> Self {
        Self {
            now,
            orders: Vec::new(),
            events: Vec::new(),
            messages: Vec::new(),
            claimed: Vec::new(),
            wake: false,
            gates: Vec::new(),
            flows: Vec::new(),
            dispatched: Vec::new(),
            definitions: Vec::new(),
            locks,
            handed_to: None,
            answered: Vec::new(),
            published: Vec::new(),
            room: None,
        }
    }

    /// Adds a new order, to be inserted as `pending` with `steps` (its
    /// workflow's plan) under `definition` unless its id exists (then
    /// nothing of it is written); returns its position.
    pub fn insert(
        &mut self,
        order: &NewOrder,
        (definition_id, definition): (Uuid, &std::sync::Arc<Definition>),
        steps: Vec<StepRow>,
    ) -> usize {
        if !self.definitions.iter().any(|(id, _)| *id == definition_id) {
            self.definitions.push((definition_id, definition.clone()));
        }
        let row = OrderRow {
            definition: Some(definition_id),
            ..OrderRow::pending(order, self.now)
        };
        let order = Order { row, steps };
        self.orders.push(Tracked {
            read: order.clone(),
            order,
            version: 0,
            inserted: true,
            kept: false,
            hop: None,
        });
        self.orders.len() - 1
    }

    /// Adds an order this process kept from the write-back that last
    /// wrote it, at the row version that write-back left, instead of
    /// loading it: the write-back's guard refuses it if anyone wrote it
    /// since. Returns its position.
    pub fn keep(&mut self, order: Order, version: i64) -> usize {
        self.orders.push(Tracked {
            read: order.clone(),
            order,
            version,
            inserted: false,
            kept: true,
            hop: None,
        });
        self.orders.len() - 1
    }

    /// The orders the unit updates that wait for a reply (it sends them a
    /// step request) and whose messages come to at most `max_bytes`, as its
    /// decisions left them: what a scheduler keeps after the write-back,
    /// at the versions it returns, for the replies to find.
    pub fn awaiting_replies(&self, max_bytes: usize) -> Vec<Order> {
        let mut sent: std::collections::HashMap<Uuid, (bool, usize)> =
            std::collections::HashMap::new();
        for m in &self.messages {
            let (request, bytes) = sent.entry(m.order_id).or_default();
            *request |= m.kind == "request";
            *bytes += m.body.len();
        }
        self.orders
            .iter()
            .filter(|t| !t.inserted && t.order != t.read)
            .filter(|t| {
                sent.get(&t.order.row.order_id)
                    .is_some_and(|&(request, bytes)| request && bytes <= max_bytes)
            })
            .map(|t| t.order.clone())
            .collect()
    }

    /// Whether the decisions left an order kept ([`Unit::keep`]) as it
    /// was: its write-back would not check its version, so nothing shows
    /// that what they judged by (a reply judged stale, say) is still so.
    pub fn unchecked_kept(&self) -> bool {
        self.orders.iter().any(|t| t.kept && t.order == t.read)
    }

    /// How many orders the unit holds.
    pub fn len(&self) -> usize {
        self.orders.len()
    }

    /// Whether the unit holds no order.
    pub fn is_empty(&self) -> bool {
        self.orders.is_empty()
    }

    /// How many step requests the unit's decisions have produced so far:
    /// what a claim's and a start's bound counts, since a request carries
    /// its order's payload (status events are small, and every order of an
    /// every-event claim has one).
    pub fn requests(&self) -> usize {
        self.messages.iter().filter(|m| m.kind == "request").count()
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

    /// Order `i` as a decision left it, and the `traceparent` of that
    /// decision's messages.
    pub fn set(&mut self, i: usize, order: Order, hop: Option<String>) {
        self.orders[i].order = order;
        self.orders[i].hop = hop;
    }

    /// Wakes the schedulers once written: work became claimable.
    pub fn wake(&mut self) {
        self.wake = true;
    }

    /// Logs an event.
    pub fn push_event(&mut self, event: NewEvent) {
        self.events.push(event);
    }

    /// Queues a message in the outbox, after the ones queued before.
    pub fn push_message(&mut self, message: NewMessage) {
        self.messages.push(message);
    }

    /// Has the write-back delete these outbox rows, published and
    /// confirmed: it is a statement the process makes anyway.
    pub fn delete_published(&mut self, ids: Vec<i64>) {
        self.published.extend(ids);
    }

    /// Records that a reply answers `dispatch` of `order` (applied or
    /// judged stale): its step request is done with, and the write-back
    /// deletes it from the outbox.
    pub fn answered(&mut self, order: Uuid, dispatch: Uuid) {
        self.answered.push((order, dispatch));
    }

    /// How the write-back keeps each order's messages in order, by what
    /// it sends ([`Keeping`]).
    fn keeping(&self) -> std::collections::HashMap<Uuid, Keeping> {
        let mut sends: std::collections::HashMap<Uuid, (bool, bool)> =
            std::collections::HashMap::new();
        for m in &self.messages {
            let (requests, seen) = sends.entry(m.order_id).or_default();
            *requests |= m.kind == "request";
            *seen |= m.kind != "request";
        }
        let ended = |order: Uuid| {
            self.find(order)
                .is_some_and(|i| self.orders[i].order.row.process_state.is_terminal())
        };
        sends
            .into_iter()
            .map(|(order, (requests, seen))| {
                let keeping = match (&self.handed_to, requests, seen) {
                    (Some(_), true, false) => Keeping::Nothing,
                    (Some(_), false, true) if ended(order) => Keeping::Handed,
                    _ => Keeping::Lock,
                };
                (order, keeping)
            })
            .collect()
    }

    /// The steps of each order changed so far, as read and as they are now
    /// (new orders left out): what flow control counts.
    pub fn changes(&self) -> impl Iterator<Item = (&[StepRow], &[StepRow])> {
        self.orders
            .iter()
            .filter(|t| !t.inserted && t.order != t.read)
            .map(|t| (t.read.steps.as_slice(), t.order.steps.as_slice()))
    }

    /// Writes everything back in one statement ([`FLUSH`]): the new orders
    /// with their steps, the orders' and steps' updates, the events, the
    /// messages and the wake-up; and lets the claim locks go. Fails on the
    /// server, writing nothing, if a row is no longer what was loaded.
    ///
    /// `flows` are the flow-control counts to move, as the rules count
    /// them from the unit's changes ([`Unit::changes`]).
    ///
    /// With [`OutboxLocks::Take`], the messages come back to be published
    /// at once, in order, where they may go now: the write-back tries the
    /// outbox lock of each order as [`Keeping`] says, and its messages go
    /// now when no older message of the order waits; those of orders whose
    /// lock another publisher held follow it ([`Flushed::follow`]), the
    /// others' are left to the relay. Messages that go now are written
    /// handed to [`Unit::handed_to`], if any, but for status events before
    /// a request: a request stays until a reply's write-back deletes it
    /// ([`Unit::answered`]), a status event until its publisher does.
    pub(super) async fn flush(
        self,
        conn: &mut PgConnection,
        flows: Vec<FlowDelta>,
    ) -> Result<Flushed, StoreError> {
        let direct = self.locks == OutboxLocks::Take;
        let inserted: Vec<&Tracked> = self.orders.iter().filter(|t| t.inserted).collect();
        // An order whose steps changed is written too: its version guards them.
        let changed: Vec<&Tracked> = self
            .orders
            .iter()
            .filter(|t| !t.inserted && t.order != t.read)
            .collect();
        // The orders whose locks the write-back tries: kept past it, or
        // for its own transaction.
        let keeping = self.keeping();
        let tried = |how: Keeping| -> Vec<Uuid> {
            keeping
                .iter()
                .filter(|&(_, &k)| direct && k == how)
                .map(|(&id, _)| id)
                .collect()
        };
        let (to_lock, to_hand) = (tried(Keeping::Lock), tried(Keeping::Handed));
        if inserted.is_empty()
            && changed.is_empty()
            && self.events.is_empty()
            && self.messages.is_empty()
            && self.claimed.is_empty()
            && self.answered.is_empty()
            && self.published.is_empty()
            && !self.wake
            && flows.is_empty()
        {
            return Ok(Flushed::default());
        }
        let new_orders: Vec<OrderInsert> = inserted
            .iter()
            .map(|t| order_insert(&t.order.row))
            .collect();
        let new_steps: Vec<StepInsert> = inserted
            .iter()
            .flat_map(|t| t.order.steps.iter().map(step_insert))
            .collect();
        let orders: Vec<OrderUpdate> = changed.iter().map(|t| order_update(t)).collect();
        let changed_ids: Vec<Uuid> = changed.iter().map(|t| t.order.row.order_id).collect();
        let steps: Vec<StepUpdate> = changed
            .iter()
            .flat_map(|t| t.order.steps.iter().zip(&t.read.steps))
            .filter(|(now, read)| now != read)
            .map(|(now, read)| step_update(now, read))
            .collect();
        // Room came free under flow control: orders may wait for it.
        let wake = self.wake || flows.iter().any(|f| f.delta < 0);
        let bodies: Vec<&[u8]> = self.messages.iter().map(|m| m.body.as_slice()).collect();
        let answered: Vec<Answered> = self
            .answered
            .iter()
            .map(|&(order_id, dispatch)| Answered {
                order_id,
                dispatch: dispatch.to_string(),
            })
            .collect();
        // The definitions the new orders run under, stored with them (§4d).
        let definitions: Vec<DefinitionInsert> = if inserted.is_empty() {
            Vec::new()
        } else {
            self.definitions
                .iter()
                .map(|(id, d)| DefinitionInsert {
                    id: *id,
                    workflow: &d.workflow,
                    version: d.spec.version.as_deref(),
                    spec: &d.spec,
                })
                .collect()
        };
        let found = sqlx::query_as::<_, FlushRow>(sqlx::AssertSqlSafe(FLUSH.as_str()))
            .bind(Json(&new_orders))
            .bind(Json(&new_steps))
            .bind(Json(&orders))
            .bind(Json(&steps))
            .bind(Json(&self.events))
            .bind(Json(&self.messages))
            .bind(&bodies)
            .bind(self.now)
            .bind(direct)
            .bind(self.handed_to.as_deref())
            .bind(WAKE_CHANNEL)
            .bind(wake)
            .bind(&self.claimed)
            .bind(Json(&flows))
            .bind(&changed_ids)
            .bind(Json(&definitions))
            .bind(self.room)
            .bind(&to_lock)
            .bind(Json(&answered))
            .bind(&to_hand)
            .bind(&self.published)
            .fetch_one(&mut *conn)
            .await;
        let row = match found {
            Ok(row) => row,
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(GUARD_FAILED) => {
                return Err(StoreError::WriteBackRefused(e.message().to_owned()));
            }
            // An event numbered as another transition numbered one of its
            // own first: that transition changed the order since it was
            // loaded (the insert ran before the guard could say so).
            Err(sqlx::Error::Database(e)) if e.constraint() == Some("order_events_pkey") => {
                return Err(StoreError::WriteBackRefused(e.message().to_owned()));
            }
            Err(e) => return Err(e.into()),
        };
        let new: std::collections::HashSet<Uuid> =
            inserted.iter().map(|t| t.order.row.order_id).collect();
        let handing = self.handed_to.is_some();
        Ok(row.sort(self.messages, &new, &keeping, direct, handing))
    }
}

/// JSON as text, for a `text` field cast to `jsonb`.
fn json_text(v: &Value) -> String {
    v.to_string()
}

fn order_insert(o: &OrderRow) -> OrderInsert<'_> {
    OrderInsert {
        order_id: o.order_id,
        workflow: &o.workflow,
        payload: json_text(&o.payload),
        reply_to: o.reply_to.as_deref(),
        priority: o.priority,
        not_before: o.not_before,
        trace_id: o.trace_id.as_deref(),
        trace_span: o.trace_span.as_deref(),
        last_seq: o.last_seq,
        events: o.events.as_str(),
        application: o.application.as_deref(),
        app_order_id: o.app_order_id,
        definition: o.definition,
        process_state: o.process_state.as_str(),
        locked_by: o.locked_by.as_deref(),
        complete_by: o.complete_by,
    }
}

fn step_insert(s: &StepRow) -> StepInsert<'_> {
    StepInsert {
        order_id: s.order_id,
        idx: s.idx,
        name: &s.name,
        agent: &s.agent,
        compensate: s.compensate.as_deref(),
        timeout_ms: s.timeout_ms,
        after_steps: s.after_steps.as_deref(),
        max_duration_ms: s.max_duration_ms,
        state: s.state.as_str(),
        dispatches: s.dispatches,
        dispatch_id: s.dispatch_id,
        complete_by: s.complete_by,
        result: s.result.as_ref().map(json_text),
        error: s.error.as_deref(),
        started_at: s.started_at,
        finished_at: s.finished_at,
    }
}

fn order_update(t: &Tracked) -> OrderUpdate<'_> {
    let o = &t.order.row;
    OrderUpdate {
        order_id: o.order_id,
        process_state: o.process_state.as_str(),
        locked_by: o.locked_by.as_deref(),
        complete_by: o.complete_by,
        not_before: o.not_before,
        failure_count: o.failure_count,
        compensation_failures: o.compensation_failures,
        last_seq: o.last_seq,
        last_error: o.last_error.as_deref(),
        held_for: o.held_for.as_deref(),
        held_since: o.held_since,
        hold_until: o.hold_until,
        held_reason: o.held_reason.as_deref(),
        payload: (o.payload != t.read.row.payload).then(|| json_text(&o.payload)),
        redrives: o.redrives,
        version: t.version,
    }
}

fn step_update<'a>(s: &'a StepRow, read: &StepRow) -> StepUpdate<'a> {
    StepUpdate {
        order_id: s.order_id,
        idx: s.idx,
        state: s.state.as_str(),
        dispatches: s.dispatches,
        dispatch_id: s.dispatch_id,
        complete_by: s.complete_by,
        result: s.result.as_ref().map(json_text),
        error: s.error.as_deref(),
        started_at: s.started_at,
        finished_at: s.finished_at,
        warned: s.warned,
        in_doubt: s.in_doubt,
        undo_in_doubt: s.undo_in_doubt,
        was_state: read.state.as_str(),
        was_dispatch: read.dispatch_id,
    }
}

/// The SQLSTATE of `sas_fail`, raised when a guard of [`FLUSH`] finds a row
/// changed since it was loaded.
const GUARD_FAILED: &str = "SAS01";

/// What [`Unit::flush`] wrote, and where its messages go.
#[derive(Debug, Default)]
pub struct Flushed {
    /// The new orders inserted (an id that existed is not).
    pub created: Vec<Uuid>,
    /// Messages to publish at once, in order, with their outbox ids: those
    /// of orders whose outbox lock this connection holds and that have no
    /// older message waiting, and the handed requests of orders with no
    /// other message.
    pub publish: Vec<super::OutboxRow>,
    /// Orders whose new messages are left to the relay.
    pub later: Vec<Uuid>,
    /// Orders whose outbox lock another publisher held (in a transition
    /// that asked for the locks): their messages follow once it lets go.
    pub follow: Vec<Uuid>,
    /// This connection holds outbox locks, to let go after publishing.
    pub holds_locks: bool,
    /// The room as the write-back left it, if asked ([`Unit::room`]).
    pub room: Option<super::session::Room>,
    /// The orders updated, with the row version each was left at.
    pub versions: Vec<(Uuid, i64)>,
}

/// The row [`FLUSH`] returns.
#[derive(Debug, sqlx::FromRow)]
struct FlushRow {
    created: Vec<Uuid>,
    /// The ids of the messages written, ascending: the order they were given in.
    message_ids: Vec<i64>,
    /// Orders whose outbox lock this connection took, kept past the commit.
    locked: Vec<Uuid>,
    /// Orders whose outbox lock the write-back's transaction took.
    handed: Vec<Uuid>,
    /// Orders whose messages go now.
    now_orders: Vec<Uuid>,
    /// The orders updated, ascending, and the row version each was left at.
    updated_ids: Vec<Uuid>,
    updated_versions: Vec<i64>,
    /// The room, if asked: its clock, breakers, flow control, held count.
    room_now: Option<DateTime<Utc>>,
    room_gates: Option<Json<Vec<Gate>>>,
    room_flows: Option<Json<Vec<Flow>>>,
    room_held: Option<i64>,
}

impl FlushRow {
    /// Pairs the messages written with their ids and splits them between
    /// publishing now and the relay. `new` are the orders the unit inserted
    /// (the messages of one that existed were not written); `keeping` how
    /// each order's messages are kept in order; `handing` whether its
    /// requests stay handed over.
    fn sort(
        self,
        messages: Vec<NewMessage>,
        new: &std::collections::HashSet<Uuid>,
        keeping: &std::collections::HashMap<Uuid, Keeping>,
        direct: bool,
        handing: bool,
    ) -> Flushed {
        let written: Vec<NewMessage> = messages
            .into_iter()
            .filter(|m| !new.contains(&m.order_id) || self.created.contains(&m.order_id))
            .collect();
        let mut out = Flushed {
            holds_locks: !self.locked.is_empty(),
            ..Flushed::default()
        };
        // Written as many as given: ids ascend in the order given.
        let paired = written.len() == self.message_ids.len();
        for (i, m) in written.into_iter().enumerate() {
            let now = paired && self.now_orders.contains(&m.order_id);
            match self.message_ids.get(i) {
                Some(&id) if now => out.publish.push(super::OutboxRow {
                    id,
                    handed: match keeping.get(&m.order_id) {
                        Some(Keeping::Handed) => true,
                        Some(Keeping::Nothing) => m.kind == "request",
                        // Requests after status events, when handed over.
                        Some(Keeping::Lock) | None => handing && m.kind == "request",
                    },
                    order_id: m.order_id,
                    kind: m.kind,
                    routing_key: m.routing_key,
                    correlation_id: m.correlation_id,
                    reply_to: m.reply_to,
                    traceparent: m.traceparent,
                    body: m.body,
                }),
                _ => {
                    let tried = keeping.get(&m.order_id).copied();
                    let busy = direct
                        && paired
                        && match tried {
                            Some(Keeping::Lock) => !self.locked.contains(&m.order_id),
                            Some(Keeping::Handed) => !self.handed.contains(&m.order_id),
                            Some(Keeping::Nothing) | None => false,
                        };
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
        out.versions = self
            .updated_ids
            .into_iter()
            .zip(self.updated_versions)
            .collect();
        if let (Some(now), Some(gates), Some(flows), Some(held)) = (
            self.room_now,
            self.room_gates,
            self.room_flows,
            self.room_held,
        ) {
            out.room = Some(super::session::Room {
                now,
                gates: gates.0,
                flows: flows.0,
                held,
            });
        }
        out
    }
}

/// The one statement of [`Unit::flush`]: `$1` the new orders, `$2` their
/// steps, `$3` the orders' updates, `$4` the steps', `$5` the events, `$6`
/// the messages (JSON arrays of the structs above) and `$7` their bodies;
/// `$8` the unit's time, `$9` whether to take outbox locks and hand the
/// messages over, `$10` the instance handed the messages that go now
/// ([`Unit::handed_to`]; with none, every order with messages locks), `$11` and
/// `$12` the channel to notify and whether to, `$13` the orders whose claim
/// locks to let go, `$14` the flow-control counts to move, `$15` the ids
/// of the orders updated, `$16` the definitions the new orders run under
/// (contract §4d), stored with them unless stored already, `$17` the bound
/// of the held count when the room is asked for ([`Unit::room`]; read in
/// the statement's snapshot, so without the orders it inserts), `$18` the
/// orders whose outbox locks to try and keep, with `$9` ([`Keeping::Lock`];
/// a new order's as it is inserted), `$20` those whose locks to try for the
/// statement only, their messages handed over ([`Keeping::Handed`]): a lock
/// another publisher holds sends the order's messages to follow it, older
/// messages still waiting (or handed over, not yet deleted) send them to
/// the relay; `$19` the dispatches replies answer, whose requests leave
/// the outbox; `$21` rows this process published, to delete
/// ([`Unit::delete_published`]). Each order
/// given events that an HTTP event stream watches (`event_watches`) is
/// notified on [`super::watches::EVENTS_CHANNEL`], so that streams wait
/// without polling. The updates look their rows up by those ids: a
/// plan that joined the JSON to a whole table (a hash join, as Postgres
/// picks while the tables are small and then keeps with the connection)
/// would read every order kept on every write-back. Guards: an order
/// is written only if its row is still the version loaded, a step only if
/// its state and dispatch are, an agent's count only if it stays within its
/// `max_in_flight` and its bucket holds a token per dispatch (the row lock
/// makes concurrent write-backs take turns, each checking the count the
/// other left); and when a guard leaves a row unwritten, `sas_fail` fails
/// the statement, so that nothing of it stays. The flow-control check is a
/// guard like the version's, not a rule: the rules decided on the room as
/// loaded (`sas_core::rules::flow`), another write-back may have taken it
/// since, and a refused write-back runs the transition again on the room as
/// it is now. The claim locks go once the rows are written.
pub(super) static FLUSH: LazyLock<String> = LazyLock::new(|| {
    format!(
        "\
WITH new AS (SELECT order_id FROM jsonb_to_recordset($1) AS i(order_id uuid)), \
n AS ( \
  INSERT INTO orders (order_id, workflow, payload, reply_to, priority, not_before, trace_id, \
    trace_span, last_seq, events, application, app_order_id, definition, process_state, \
    locked_by, complete_by, created_at, updated_at) \
  SELECT order_id, workflow, payload::jsonb, reply_to, priority, not_before, trace_id, trace_span, \
    last_seq, events, application, app_order_id, definition, process_state, locked_by, \
    complete_by, $8, $8 \
  FROM jsonb_to_recordset($1) AS u(order_id uuid, workflow text, payload text, reply_to text, \
    priority smallint, not_before timestamptz, trace_id text, trace_span text, last_seq int, \
    events text, application text, app_order_id uuid, definition uuid, process_state text, \
    locked_by text, complete_by timestamptz) \
  ON CONFLICT (order_id) DO NOTHING \
  RETURNING order_id, CASE WHEN $9 AND order_id = ANY($18::uuid[]) \
    THEN pg_try_advisory_lock(hashtextextended('sas.outbox:' || order_id::text, 0)) ELSE false END AS locked), \
nd AS ( \
  INSERT INTO definitions (id, workflow, version, spec) \
  SELECT id, workflow, version, spec FROM jsonb_to_recordset($16) \
    AS d(id uuid, workflow text, version text, spec jsonb) \
  ON CONFLICT (id) DO NOTHING), \
ns AS ( \
  INSERT INTO steps (order_id, idx, name, agent, compensate, timeout_ms, after_steps, \
    max_duration_ms, state, dispatches, dispatch_id, complete_by, result, error, started_at, \
    finished_at) \
  SELECT order_id, idx, name, agent, compensate, timeout_ms, after_steps, max_duration_ms, \
    state, dispatches, dispatch_id, complete_by, result::jsonb, error, started_at, finished_at \
  FROM jsonb_to_recordset($2) AS u(order_id uuid, idx int, name text, agent text, compensate text, \
    timeout_ms bigint, after_steps int[], max_duration_ms bigint, state text, dispatches int, \
    dispatch_id uuid, complete_by timestamptz, result text, error text, started_at timestamptz, \
    finished_at timestamptz) \
  WHERE u.order_id IN (SELECT order_id FROM n)), \
o AS ( \
  UPDATE orders o SET process_state = u.process_state, locked_by = u.locked_by, \
    complete_by = u.complete_by, not_before = u.not_before, failure_count = u.failure_count, \
    compensation_failures = u.compensation_failures, last_seq = u.last_seq, \
    last_error = u.last_error, held_for = u.held_for, held_since = u.held_since, \
    hold_until = u.hold_until, held_reason = u.held_reason, \
    payload = coalesce(u.payload::jsonb, o.payload), redrives = u.redrives, updated_at = now() \
  FROM jsonb_to_recordset($3) AS u(order_id uuid, process_state text, locked_by text, \
    complete_by timestamptz, not_before timestamptz, failure_count int, \
    compensation_failures int, last_seq int, last_error text, held_for text, \
    held_since timestamptz, hold_until timestamptz, held_reason text, payload text, \
    redrives int, version bigint) \
  WHERE o.order_id = ANY($15::uuid[]) AND o.order_id = u.order_id \
    AND o.xmin::text::bigint = u.version \
  RETURNING o.order_id, o.xmin::text::bigint AS version), \
kl AS MATERIALIZED (SELECT k.id AS order_id FROM unnest($18::uuid[]) AS k(id) \
  WHERE $9 AND k.id NOT IN (SELECT order_id FROM new) \
    AND pg_try_advisory_lock(hashtextextended('sas.outbox:' || k.id::text, 0))), \
xl AS MATERIALIZED (SELECT h.id AS order_id FROM unnest($20::uuid[]) AS h(id) \
  WHERE $9 AND (h.id NOT IN (SELECT order_id FROM new) OR h.id IN (SELECT order_id FROM n)) \
    AND pg_try_advisory_xact_lock(hashtextextended('sas.outbox:' || h.id::text, 0))), \
lk AS (SELECT order_id FROM n WHERE locked UNION ALL SELECT order_id FROM kl \
  UNION ALL SELECT order_id FROM xl), \
nw AS MATERIALIZED (SELECT x.order_id FROM \
    (SELECT DISTINCT order_id FROM jsonb_to_recordset($6) AS mo(order_id uuid)) x \
  WHERE $9 AND ((x.order_id IN (SELECT order_id FROM lk) \
      AND NOT EXISTS (SELECT 1 FROM outbox w WHERE w.order_id = x.order_id \
        AND (w.kind <> 'request' OR w.handed_to IS NULL) AND w.id <> ALL($21::bigint[]))) \
    OR ($10::text IS NOT NULL AND NOT EXISTS (SELECT 1 FROM jsonb_to_recordset($6) \
        AS ml(order_id uuid, kind text) WHERE ml.order_id = x.order_id AND ml.kind <> 'request')))), \
ad AS ( \
  DELETE FROM outbox x USING jsonb_to_recordset($19) AS r(order_id uuid, dispatch text) \
  WHERE x.order_id = r.order_id AND x.kind = 'request' AND x.correlation_id = r.dispatch), \
dp AS (DELETE FROM outbox WHERE id = ANY($21::bigint[])), \
s AS ( \
  UPDATE steps s SET state = u.state, dispatches = u.dispatches, dispatch_id = u.dispatch_id, \
    complete_by = u.complete_by, result = u.result::jsonb, error = u.error, \
    started_at = u.started_at, finished_at = u.finished_at, warned = u.warned, \
    in_doubt = u.in_doubt, undo_in_doubt = u.undo_in_doubt \
  FROM jsonb_to_recordset($4) AS u(order_id uuid, idx int, state text, dispatches int, \
    dispatch_id uuid, complete_by timestamptz, result text, error text, started_at timestamptz, \
    finished_at timestamptz, warned smallint, in_doubt boolean, undo_in_doubt boolean, was_state text, was_dispatch uuid) \
  WHERE s.order_id = ANY($15::uuid[]) AND s.order_id = u.order_id AND s.idx = u.idx \
    AND s.state = u.was_state \
    AND s.dispatch_id IS NOT DISTINCT FROM u.was_dispatch \
  RETURNING 1), \
e AS ( \
  INSERT INTO order_events (order_id, seq, event, from_state, to_state, step, attempt, actor, \
    reason, detail, at) \
  SELECT order_id, seq, event, from_state, to_state, step, attempt, actor, reason, detail::jsonb, $8 \
  FROM jsonb_to_recordset($5) AS u(order_id uuid, seq int, event text, from_state text, \
    to_state text, step text, attempt int, actor text, reason text, detail text) \
  WHERE u.order_id NOT IN (SELECT order_id FROM new) OR u.order_id IN (SELECT order_id FROM n) \
  RETURNING order_id), \
ev AS (SELECT pg_notify('{events_channel}', x.order_id::text) \
  FROM (SELECT DISTINCT order_id FROM e) x \
  WHERE EXISTS (SELECT 1 FROM event_watches w WHERE w.order_id = x.order_id)), \
m AS ( \
  INSERT INTO outbox (order_id, kind, routing_key, correlation_id, reply_to, traceparent, body, \
    handed_to) \
  SELECT u.order_id, u.kind, u.routing_key, u.correlation_id, u.reply_to, u.traceparent, b.body, \
    CASE WHEN u.order_id IN (SELECT order_id FROM nw) \
      AND (u.kind = 'request' OR u.order_id = ANY($20::uuid[])) THEN $10::text END \
  FROM ROWS FROM (jsonb_to_recordset($6) AS (order_id uuid, kind text, routing_key text, \
      correlation_id text, reply_to text, traceparent text)) \
    WITH ORDINALITY AS u(order_id, kind, routing_key, correlation_id, reply_to, traceparent, n) \
  JOIN unnest($7::bytea[]) WITH ORDINALITY AS b(body, n) ON b.n = u.n \
  WHERE u.order_id NOT IN (SELECT order_id FROM new) OR u.order_id IN (SELECT order_id FROM n) \
  ORDER BY u.n RETURNING id), \
fl AS ( \
  UPDATE agent_flow a SET in_flight = greatest(0, a.in_flight + d.delta), \
    tokens = CASE WHEN a.rate_per_sec IS NULL THEN a.tokens \
      ELSE {bucket} - d.dispatched END, \
    refilled_at = greatest(a.refilled_at, now()) \
  FROM jsonb_to_recordset($14) AS d(agent text, delta int, dispatched int) \
  WHERE a.agent = d.agent \
    AND (d.delta <= 0 OR a.max_in_flight IS NULL OR a.in_flight + d.delta <= a.max_in_flight) \
    AND (d.dispatched = 0 OR a.rate_per_sec IS NULL OR {bucket} >= d.dispatched) \
  RETURNING 1), \
w AS (SELECT pg_notify($11, '') WHERE $12 \
  AND (NOT EXISTS (SELECT 1 FROM new) OR EXISTS (SELECT 1 FROM n))) \
SELECT ARRAY(SELECT order_id FROM n) AS created, \
  ARRAY(SELECT id FROM m ORDER BY id) AS message_ids, \
  ARRAY(SELECT order_id FROM n WHERE locked UNION ALL SELECT order_id FROM kl) AS locked, \
  ARRAY(SELECT order_id FROM xl) AS handed, \
  ARRAY(SELECT order_id FROM nw) AS now_orders, \
  ARRAY(SELECT order_id FROM o ORDER BY order_id) AS updated_ids, \
  ARRAY(SELECT version FROM o ORDER BY order_id) AS updated_versions, \
  (SELECT count(*) FROM w) AS woken, \
  (SELECT count(*) FROM ev) AS watched, \
  {room} \
  CASE WHEN (SELECT count(*) FROM o) = jsonb_array_length($3) \
        AND (SELECT count(*) FROM s) = jsonb_array_length($4) \
        AND (SELECT count(*) FROM fl) = jsonb_array_length($14) \
    THEN (SELECT count(*) FROM (SELECT pg_advisory_unlock( \
           hashtextextended('sas.claim:' || id::text, 0)) FROM unnest($13::uuid[]) AS c(id)) x) >= 0 \
    ELSE sas_fail('a row changed since it was loaded') END AS guarded",
        bucket = super::flows::bucket("a"),
        events_channel = super::watches::EVENTS_CHANNEL,
        room = {
            let [now, gates, flows, held] = super::session::room_columns("$17");
            format!(
                "CASE WHEN $17::bigint IS NOT NULL THEN {now} END AS room_now, \
                 CASE WHEN $17::bigint IS NOT NULL THEN {gates} END AS room_gates, \
                 CASE WHEN $17::bigint IS NOT NULL THEN {flows} END AS room_flows, \
                 CASE WHEN $17::bigint IS NOT NULL THEN {held} END AS room_held,"
            )
        },
    )
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_write_back_takes_new_orders_outbox_locks_by_the_relays_key() {
        // A literal in the statement: it must stay the key the relay try-locks.
        assert!(FLUSH.contains(&super::super::outbox::lock_key("order_id")));
    }

    #[test]
    fn the_write_back_lets_go_of_claim_locks_by_the_claims_key() {
        assert!(FLUSH.contains(&super::super::orders::claim_key("id")));
    }
}

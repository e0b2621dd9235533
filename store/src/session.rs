//! One transition's connection to the store: it loads the orders (and
//! the definitions they run under) into a [`Unit`], and writes the unit
//! back. The load verbs and the write-back hold no rule: the engine
//! decides between them.

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use sqlx::types::Json;
use uuid::Uuid;

use super::bounded::Conn;
use super::orders::{self, Loaded};
use super::outbox::{Committed, Held, OutboxLocks};
use super::unit::Unit;
use super::{StateStore, StoreError};
use sas_core::rules::Order;
use sas_core::rules::breaker::Gate;
use sas_core::rules::flow::{Flow, FlowDelta};

/// A transition's connection: load, then [`write_back`](Self::write_back).
/// Dropped without writing back (a rule refused, an error), its connection
/// is closed, not pooled: it may hold claim or outbox locks, which the
/// server lets go with the session.
#[derive(Debug)]
pub struct Session {
    store: StateStore,
    conn: Conn,
    locks: OutboxLocks,
    /// The instance its hand-overs' step requests stay handed to.
    handed_to: Option<String>,
}

/// What a write-back wrote, and the messages it committed for the caller
/// to publish.
#[derive(Debug)]
pub struct Written {
    /// The new orders inserted (an id that existed is not).
    pub created: Vec<Uuid>,
    /// The messages, with the connection that holds their outbox locks.
    pub committed: Committed,
    /// The room as the write-back left it, when its unit asked
    /// ([`Unit::room`]).
    pub room: Option<Room>,
    /// The orders updated, with the row version each was left at: what a
    /// later transition of this process may keep instead of loading
    /// ([`Session::load_keeping`]).
    pub versions: Vec<(Uuid, i64)>,
}

/// The room new orders start in ([`Session::room`]): what the rules judge
/// a start by, and how many orders were held.
#[derive(Debug, Clone, PartialEq)]
pub struct Room {
    /// The database's clock when it was read.
    pub now: DateTime<Utc>,
    /// The agents' breakers that are not closed.
    pub gates: Vec<Gate>,
    /// The agents under flow control.
    pub flows: Vec<Flow>,
    /// Orders held (driven by an instance), counted up to the bound asked.
    pub held: i64,
}

/// The expressions of a [`Room`] (clock, breakers, flow control, held
/// count), with the bound of the held count in `bound`: read on their own
/// ([`Session::room`]) or by a write-back asked to ([`Unit::room`]).
pub(super) fn room_columns(bound: &str) -> [String; 4] {
    [
        "now()".to_owned(),
        format!("({})", super::breakers::GATES),
        format!("({})", *super::flows::FLOWS),
        format!(
            "(SELECT count(*) FROM (SELECT 1 FROM orders \
               WHERE locked_by IS NOT NULL LIMIT {bound}) h)"
        ),
    ]
}

impl StateStore {
    /// A session for one transition, whose write-back takes outbox locks
    /// as `locks` says, leaving the step requests it hands over handed to
    /// `handed_to` (`Unit::handed_to`).
    pub async fn session(
        &self,
        locks: OutboxLocks,
        handed_to: Option<&str>,
    ) -> Result<Session, StoreError> {
        let mut conn = self.conn().await?;
        // Until the write-back, the connection may hold claim or outbox
        // locks (a failed statement's too): dropped, it is closed.
        conn.discard();
        Ok(Session {
            conn,
            store: self.clone(),
            locks,
            handed_to: handed_to.map(str::to_owned),
        })
    }
}

impl Session {
    /// These orders, as they are now (`orders::load_many`).
    pub async fn load(&mut self, order_ids: &[Uuid]) -> Result<Unit, StoreError> {
        let loaded = self.conn.run(|c| orders::load_many(c, order_ids)).await?;
        self.unit(loaded, false).await
    }

    /// The orders `order_ids` as they are now, and beside them the orders
    /// `kept` as this process's last write-back of each left them (at the
    /// row version it returned; the write-back refuses one written since):
    /// at the clock, breakers and flow control of the load, or of `room`
    /// when there is nothing to load. With nothing to load and no `room`,
    /// load them all instead.
    pub async fn load_keeping(
        &mut self,
        order_ids: &[Uuid],
        kept: Vec<(Order, i64)>,
        room: Option<&Room>,
    ) -> Result<Unit, StoreError> {
        let mut unit = if !order_ids.is_empty() {
            self.load(order_ids).await?
        } else if let Some(room) = room {
            self.empty_in(room)
        } else {
            let all: Vec<Uuid> = kept.iter().map(|(o, _)| o.row.order_id).collect();
            return self.load(&all).await;
        };
        let missing: Vec<Uuid> = kept
            .iter()
            .filter_map(|(o, _)| o.row.definition)
            .filter(|id| !unit.definitions.iter().any(|(d, _)| d == id))
            .collect();
        if !missing.is_empty() {
            let found = self.store.definitions_on(&mut self.conn, missing).await?;
            unit.definitions.extend(found);
        }
        for (order, version) in kept {
            unit.keep(order, version);
        }
        Ok(unit)
    }

    /// Up to `limit` orders claimable now, their claim locks taken for
    /// `claimer`, who then holds at most `max_held` (`orders::claimable`).
    pub async fn load_claimable(
        &mut self,
        limit: i64,
        claimer: &str,
        max_held: i64,
    ) -> Result<Unit, StoreError> {
        let loaded = self
            .conn
            .run(|c| orders::claimable(c, limit, claimer, max_held))
            .await?;
        self.unit(loaded, true).await
    }

    /// Up to `limit` orders of `partitions` (out of `count`) past their
    /// deadline or hold (`orders::expired`).
    pub async fn load_expired(
        &mut self,
        limit: i64,
        partitions: &[i32],
        count: i32,
    ) -> Result<Unit, StoreError> {
        let loaded = self
            .conn
            .run(|c| orders::expired(c, limit, partitions, count))
            .await?;
        self.unit(loaded, false).await
    }

    /// Up to `limit` orders whose watched step passed a rung of `rungs`
    /// (`orders::warnable`).
    pub async fn load_warnable(&mut self, rungs: &[f64], limit: i64) -> Result<Unit, StoreError> {
        let loaded = self.conn.run(|c| orders::warnable(c, rungs, limit)).await?;
        self.unit(loaded, false).await
    }

    /// Up to `limit` orders with a step out by a message sent before
    /// `before` (`orders::unsent`).
    pub async fn load_unsent(&mut self, before: Uuid, limit: i64) -> Result<Unit, StoreError> {
        let loaded = self.conn.run(|c| orders::unsent(c, before, limit)).await?;
        self.unit(loaded, false).await
    }

    /// A unit with no orders, for new ones, at the client's clock.
    pub fn empty(&self) -> Unit {
        self.handing(Unit::empty(chrono::Utc::now(), self.locks))
    }

    /// `unit`, its hand-overs' requests handed to this session's instance.
    fn handing(&self, mut unit: Unit) -> Unit {
        unit.handed_to.clone_from(&self.handed_to);
        unit
    }

    /// The room for new orders to start in, as it is now: the database's
    /// clock, the agents' breakers that are not closed, the agents under
    /// flow control, and how many orders are held (driven by an instance),
    /// counted up to `bound`. One statement.
    pub async fn room(&mut self, bound: i64) -> Result<Room, StoreError> {
        static SQL: LazyLock<String> =
            LazyLock::new(|| format!("SELECT {}", room_columns("$1").join(", ")));
        type Read = (DateTime<Utc>, Json<Vec<Gate>>, Json<Vec<Flow>>, i64);
        let (now, gates, flows, held): Read = self
            .conn
            .run(|c| {
                sqlx::query_as(sqlx::AssertSqlSafe(SQL.as_str()))
                    .bind(bound)
                    .fetch_one(c)
            })
            .await?;
        Ok(Room {
            now,
            gates: gates.0,
            flows: flows.0,
            held,
        })
    }

    /// A unit with no orders, for new ones that may start at once in
    /// `room`: at its clock, with its breakers and flow control for the
    /// rules to judge whether their first steps may go.
    pub fn empty_in(&self, room: &Room) -> Unit {
        let mut unit = self.handing(Unit::empty(room.now, self.locks));
        unit.gates = room.gates.clone();
        unit.flows = room.flows.clone();
        unit
    }

    /// Writes `unit` back in one statement, moving the flow-control counts
    /// by `flows`, and hands its messages back, with the connection when it
    /// holds outbox locks (otherwise the connection goes back to the pool).
    pub async fn write_back(
        mut self,
        unit: Unit,
        flows: Vec<FlowDelta>,
    ) -> Result<Written, StoreError> {
        let definitions = unit.definitions.clone();
        let flushed = self.conn.run(|c| unit.flush(c, flows)).await?;
        self.conn.keep();
        // Stored (or read) with the orders: this process need not read
        // them back (they never change).
        for (id, definition) in definitions {
            self.store.definitions.put(id, Some(definition));
        }
        let bound = self.store.io_timeout();
        let Some(conn) = self.conn.into_pooled() else {
            return Err(StoreError::Silent(bound));
        };
        let held = flushed.holds_locks.then(|| Held::new(conn, bound));
        Ok(Written {
            room: flushed.room,
            versions: flushed.versions,
            created: flushed.created,
            committed: Committed {
                publish: flushed.publish,
                held,
                later: flushed.later,
                follow: flushed.follow,
            },
        })
    }

    /// Whether this session's loads and write-back take outbox locks.
    pub fn locks(&self) -> OutboxLocks {
        self.locks
    }

    /// The loaded orders with the definitions they run under, read on this
    /// connection unless this process has them (they never change).
    async fn unit(&mut self, loaded: Vec<Loaded>, claimed: bool) -> Result<Unit, StoreError> {
        let ids = loaded.iter().filter_map(|l| l.order.definition);
        let definitions = self.store.definitions_on(&mut self.conn, ids).await?;
        Ok(self.handing(Unit::load(loaded, claimed, definitions, self.locks)))
    }
}

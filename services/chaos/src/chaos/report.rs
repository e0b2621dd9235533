//! What a chaos run saw: the status events of its orders, deduplicated on
//! (`order_id`, `seq`) as the contract tells consumers to, and the verdict
//! drawn from them ([`Report`]): orders per terminal state, orders lost,
//! sequence gaps, orders with more than one terminal event, effects applied
//! twice; with hostile traffic, also what became of the hostile messages and
//! which good orders they harmed ([`Harms`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use sas::messages::EventKind;
use serde_json::{Value, json};
use uuid::Uuid;

use super::hostile::{self, Accounting, Counts, MARKER};

/// The terminal states, in the order the report lists them.
const TERMINAL_STATES: [&str; 4] = ["processed", "compensated", "failed", "rejected"];

/// The events of one order, by `seq`.
#[derive(Debug, Default)]
struct Story {
    events: BTreeMap<i64, EventKind>,
}

impl Story {
    /// The terminal events, in `seq` order.
    fn terminals(&self) -> impl Iterator<Item = EventKind> + '_ {
        self.events.values().copied().filter(|k| k.is_terminal())
    }

    /// The state the order ended in: its last terminal event.
    fn end(&self) -> Option<EventKind> {
        self.terminals().last()
    }

    /// Whether the numbered events (1, 2, 3 …; a `rejected` event is 0) skip one.
    fn has_gap(&self) -> bool {
        let numbered: Vec<i64> = self.events.keys().copied().filter(|s| *s > 0).collect();
        numbered
            .last()
            .is_some_and(|max| usize::try_from(*max).ok() != Some(numbered.len()))
    }
}

/// The fields of a status event (contract §2) the tally needs.
struct Event {
    /// Null or not a UUID in a `rejected` event for a message without a usable id.
    order_id: Option<Uuid>,
    seq: i64,
    state: EventKind,
    /// Carries a hostile message's marker: a stranger's content, not an
    /// event sas made for the order.
    marked: bool,
}

/// A status event's fields, or `None` for a body that is not one. Read
/// field by field rather than as the library's `StatusEvent`, so that only
/// what the contract promises matters.
fn decode(body: &[u8]) -> Option<Event> {
    let value: Value = serde_json::from_slice(body).ok()?;
    Some(Event {
        order_id: value["order_id"]
            .as_str()
            .and_then(|s| Uuid::parse_str(s).ok()),
        seq: value["seq"].as_i64()?,
        state: value["state"].as_str()?.parse().ok()?,
        marked: value["detail"].get(MARKER).is_some(),
    })
}

/// The status events of a run's orders, as they arrive.
#[derive(Debug)]
pub struct Tally {
    /// Every order id the run generated, confirmed or not.
    known: HashSet<Uuid>,
    /// Orders the broker confirmed: these must end.
    confirmed: HashSet<Uuid>,
    stories: HashMap<Uuid, Story>,
    /// Confirmed orders with at least one terminal event.
    ended: usize,
    /// Set once the submitter has nothing more to publish.
    submission_done: bool,
    /// Deliveries read, repeats included.
    deliveries: u64,
    /// Deliveries of an (`order_id`, `seq`) already seen with the same state.
    redelivered: u64,
    /// Deliveries of an (`order_id`, `seq`) already seen with another state.
    conflicts: u64,
    /// Bodies that are not status events.
    malformed: u64,
    /// Events of order ids this run did not submit.
    foreign: u64,
    /// When the last confirmed order ended.
    last_end: Option<Instant>,
    /// Good orders whose id hostile messages carry: a `rejected` event
    /// with that id is a forgery, not the order's end.
    targeted: HashSet<Uuid>,
    /// The made-up order ids of hostile messages.
    hostile_ids: HashSet<Uuid>,
    /// Hostile ids answered with `rejected`.
    hostile_rejected: HashSet<Uuid>,
    /// `rejected` events without a usable id (answers to hostile messages
    /// whose id is not echoed).
    anonymous_rejections: u64,
    /// Forged rejections of targeted good orders, by order: whether the
    /// first came before the order's own terminal event (an application
    /// would have taken it for the end).
    forged: HashMap<Uuid, bool>,
    /// Good orders that were sent an event carrying a hostile marker.
    marked: HashSet<Uuid>,
}

impl Tally {
    /// A tally for the orders `ids`.
    pub fn new(ids: &[Uuid]) -> Self {
        Self {
            known: ids.iter().copied().collect(),
            confirmed: HashSet::with_capacity(ids.len()),
            stories: HashMap::with_capacity(ids.len()),
            ended: 0,
            submission_done: false,
            deliveries: 0,
            redelivered: 0,
            conflicts: 0,
            malformed: 0,
            foreign: 0,
            last_end: None,
            targeted: HashSet::new(),
            hostile_ids: HashSet::new(),
            hostile_rejected: HashSet::new(),
            anonymous_rejections: 0,
            forged: HashMap::new(),
            marked: HashSet::new(),
        }
    }

    /// A hostile message is about to carry the id of the good order `id`.
    pub fn targeted(&mut self, id: Uuid) {
        self.targeted.insert(id);
    }

    /// A hostile message is about to carry the made-up order id `id`.
    pub fn hostile(&mut self, id: Uuid) {
        self.hostile_ids.insert(id);
    }

    /// The targeted good orders.
    pub fn targeted_ids(&self) -> &HashSet<Uuid> {
        &self.targeted
    }

    /// A good order for a hostile message to carry the id of: a random one
    /// of those running (received, not ended), else of those with any
    /// event; `None` while no good order has an event.
    pub fn pick_started(&self, rng: &mut fastrand::Rng) -> Option<Uuid> {
        let mut running = Vec::new();
        let mut started = Vec::new();
        for (id, story) in &self.stories {
            if !self.confirmed.contains(id) || story.events.is_empty() {
                continue;
            }
            if story.end().is_none() {
                running.push(*id);
            } else {
                started.push(*id);
            }
        }
        let mut from = if running.is_empty() { started } else { running };
        // Sorted, so that the seeded choice does not depend on hashing.
        from.sort_unstable();
        (!from.is_empty()).then(|| from[rng.usize(..from.len())])
    }

    /// The broker took this order: from now on it must end.
    pub fn confirmed(&mut self, id: Uuid) {
        if self.confirmed.insert(id) && self.stories.get(&id).is_some_and(|s| s.end().is_some()) {
            self.ended += 1;
        }
    }

    /// The submitter is done: no order will be confirmed any more.
    pub fn submission_done(&mut self) {
        self.submission_done = true;
    }

    /// How many orders the broker confirmed.
    pub fn confirmed_count(&self) -> usize {
        self.confirmed.len()
    }

    /// How many confirmed orders have ended.
    pub fn ended_count(&self) -> usize {
        self.ended
    }

    /// The confirmed orders.
    pub fn confirmed_ids(&self) -> &HashSet<Uuid> {
        &self.confirmed
    }

    /// Whether every order is submitted and every confirmed one has ended.
    pub fn complete(&self) -> bool {
        self.submission_done && self.ended == self.confirmed.len()
    }

    /// Records one delivery of the status queue.
    pub fn record(&mut self, body: &[u8]) {
        self.deliveries += 1;
        let Some(event) = decode(body) else {
            self.malformed += 1;
            return;
        };
        if event.state == EventKind::Rejected
            && let Some(id) = event.order_id.filter(|id| self.hostile_ids.contains(id))
        {
            self.hostile_rejected.insert(id);
            return;
        }
        if event.state == EventKind::Rejected && event.order_id.is_none() {
            self.anonymous_rejections += 1;
            return;
        }
        let Some(id) = event.order_id.filter(|id| self.known.contains(id)) else {
            self.foreign += 1;
            return;
        };
        if event.marked {
            // Not the order's story: a hostile message's content came back.
            self.marked.insert(id);
            return;
        }
        if event.state == EventKind::Rejected && event.seq == 0 && self.targeted.contains(&id) {
            // The order was stored (it had an event when it was targeted):
            // sas cannot reject it any more, so this answers a stranger.
            let ended = self.stories.get(&id).is_some_and(|s| s.end().is_some());
            self.forged.entry(id).or_insert(!ended);
            return;
        }
        let story = self.stories.entry(id).or_default();
        let ended_before = story.end().is_some();
        match story.events.get(&event.seq) {
            Some(kind) if *kind == event.state => self.redelivered += 1,
            Some(_) => self.conflicts += 1,
            None => {
                story.events.insert(event.seq, event.state);
            }
        }
        if !ended_before && story.end().is_some() && self.confirmed.contains(&id) {
            self.ended += 1;
            self.last_end = Some(Instant::now());
        }
    }

    /// The good orders that did not come through as a good order must:
    /// not ended, ended `rejected`, ended twice, ended other than
    /// `processed` when the run set no faults (with faults, `compensated`
    /// and `failed` are the fault mix's doing), took a forged rejection
    /// before their own end (what an application reading the first
    /// terminal event sees), were sent a hostile message's event, or hold
    /// a hostile payload (`foreign_payload`, from the state store).
    pub fn harms(&self, faults_set: bool, foreign_payload: &HashSet<Uuid>) -> Harms {
        let mut harms = Harms::default();
        for id in &self.confirmed {
            let story = self.stories.get(id);
            let end = story.and_then(Story::end);
            let reasons = [
                (end.is_none(), &mut harms.not_ended),
                (
                    end.is_some_and(|e| {
                        e == EventKind::Rejected || (!faults_set && e != EventKind::Processed)
                    }),
                    &mut harms.not_processed,
                ),
                (
                    story.is_some_and(|s| s.terminals().count() > 1),
                    &mut harms.ended_twice,
                ),
                (
                    self.forged.get(id).copied().unwrap_or(false),
                    &mut harms.forged_end,
                ),
                (self.marked.contains(id), &mut harms.foreign_event),
                (foreign_payload.contains(id), &mut harms.foreign_payload),
            ];
            let mut harmed = false;
            for (hit, count) in reasons {
                if hit {
                    *count += 1;
                    harmed = true;
                }
            }
            harms.orders += u64::from(harmed);
        }
        harms
    }

    /// The verdict, with what the run adds: kills, duplicates, times.
    pub fn report(&self, run: RunFacts) -> Report {
        let mut per_state = TERMINAL_STATES.map(|s| (s, 0u64));
        let (mut lost, mut gaps, mut multiple) = (0u64, 0u64, 0u64);
        for id in &self.confirmed {
            let story = self.stories.get(id);
            match story.and_then(Story::end) {
                Some(end) => {
                    if let Some((_, n)) = per_state.iter_mut().find(|(s, _)| *s == end.as_str()) {
                        *n += 1;
                    }
                }
                None => lost += 1,
            }
            if story.is_some_and(Story::has_gap) {
                gaps += 1;
            }
            if story.is_some_and(|s| s.terminals().count() > 1) {
                multiple += 1;
            }
        }
        let hostile = run.hostile.map(|h| {
            let mut seen = h.seen;
            seen.rejected.clone_from(&self.hostile_rejected);
            let faults_set = run.faults.is_some_and(|(t, p)| t > 0.0 || p > 0.0);
            HostileReport {
                share: h.share,
                seed: h.seed,
                accounting: hostile::account(&h.sent, &seen),
                unsent: h.unsent,
                rejections: self.hostile_rejected.len() as u64 + self.anonymous_rejections,
                harms: self.harms(faults_set, &seen.foreign_payload),
                forged: self.forged.len() as u64,
                payload_check_error: h.payload_check_error,
                connections_lost: h.connections_lost,
            }
        });
        // Ended other than processed, with an effect still applied at a
        // remote (contract §4c). Undos stay healthy in a run, so a `failed`
        // order (nothing could be undone) counts too.
        let half_done: Option<Vec<Uuid>> = run.effects.as_ref().map(|e| {
            let mut ids: Vec<Uuid> = self
                .confirmed
                .iter()
                .filter(|id| e.standing.contains(id))
                .filter(|id| {
                    self.stories
                        .get(id)
                        .and_then(Story::end)
                        .is_some_and(|end| end != EventKind::Processed)
                })
                .copied()
                .collect();
            ids.sort_unstable();
            ids
        });
        let ended = self.ended as u64;
        // Throughput counts up to the last order's end, not the settling after it.
        let busy = match self.last_end {
            Some(end) if lost == 0 => end.saturating_duration_since(run.started),
            _ => run.elapsed,
        };
        Report {
            workflow: run.workflow,
            orders: run.orders,
            submitted: self.confirmed.len() as u64,
            per_state,
            lost,
            gaps,
            multiple_terminal: multiple,
            conflicts: self.conflicts,
            duplicates: run.effects.as_ref().map(|e| e.duplicates),
            half_done: half_done.as_ref().map(|ids| ids.len() as u64),
            half_done_ids: half_done.unwrap_or_default().into_iter().take(10).collect(),
            kills: run.kills,
            kill_failures: run.kill_failures,
            unexpected_exits: run.unexpected_exits,
            deliveries: self.deliveries,
            redelivered: self.redelivered,
            malformed: self.malformed,
            foreign: self.foreign,
            elapsed: busy,
            orders_per_second: if busy.is_zero() {
                0.0
            } else {
                ended as f64 / busy.as_secs_f64()
            },
            faults: run.faults,
            kill_every: run.kill_every,
            interrupted: run.interrupted,
            logs: run.logs,
            queue: run.queue,
            hostile,
        }
    }
}

/// Good orders harmed, in all and by how (an order may count under several).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Harms {
    /// Good orders harmed in any way.
    pub orders: u64,
    pub not_ended: u64,
    /// Ended `rejected`, or other than `processed` in a run without faults.
    pub not_processed: u64,
    pub ended_twice: u64,
    /// A forged `rejected` came before their own terminal event.
    pub forged_end: u64,
    /// Sent an event that carries a hostile marker.
    pub foreign_event: u64,
    /// Stored with a hostile message's payload.
    pub foreign_payload: u64,
}

impl Harms {
    /// The non-zero reasons, for people.
    fn reasons(&self) -> Vec<String> {
        [
            (self.not_ended, "not ended"),
            (self.not_processed, "not processed"),
            (self.ended_twice, "ended twice"),
            (self.forged_end, "a forged rejection first"),
            (self.foreign_event, "a hostile event"),
            (self.foreign_payload, "a hostile payload"),
        ]
        .into_iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, what)| format!("{n} {what}"))
        .collect()
    }

    fn json(&self) -> Value {
        json!({
            "not_ended": self.not_ended,
            "not_processed": self.not_processed,
            "ended_twice": self.ended_twice,
            "forged_end": self.forged_end,
            "foreign_event": self.foreign_event,
            "foreign_payload": self.foreign_payload,
        })
    }
}

/// What the run knows of its hostile traffic, beside the events.
#[derive(Debug, Clone, Default)]
pub struct HostileFacts {
    /// `--hostile`.
    pub share: f64,
    /// `--seed`, given or drawn.
    pub seed: u64,
    /// The hostile messages the broker took.
    pub sent: Vec<hostile::Sent>,
    /// Hostile messages that could not be published.
    pub unsent: u64,
    /// What became of them (its `rejected` is the tally's, filled in by
    /// [`Tally::report`]).
    pub seen: hostile::Seen,
    /// Why the targeted orders' payloads could not be read, if they could not.
    pub payload_check_error: Option<String>,
    /// "lost RabbitMQ" lines in the spawned services' logs; `None` without `--spawn`.
    pub connections_lost: Option<u64>,
}

/// The hostile side of a run's outcome.
#[derive(Debug, Clone)]
pub struct HostileReport {
    pub share: f64,
    pub seed: u64,
    pub accounting: Accounting,
    pub unsent: u64,
    /// `rejected` events that answered hostile messages.
    pub rejections: u64,
    pub harms: Harms,
    /// Targeted good orders sent a forged `rejected` (first or not).
    pub forged: u64,
    pub payload_check_error: Option<String>,
    pub connections_lost: Option<u64>,
}

impl HostileReport {
    fn json(&self) -> Value {
        let counts = |c: &Counts| {
            json!({
                "sent": c.sent,
                "dead_lettered": c.dead_lettered,
                "rejected": c.rejected,
                "ignored": c.ignored,
                "unaccounted": c.unaccounted,
            })
        };
        let total = &self.accounting.total;
        let classes: serde_json::Map<String, Value> = self
            .accounting
            .classes
            .iter()
            .map(|(class, c)| (class.as_str().to_owned(), counts(c)))
            .collect();
        json!({
            "share": self.share,
            "seed": self.seed,
            "sent": total.sent,
            "unsent": self.unsent,
            "accounted": total.accounted(),
            "dead_lettered": total.dead_lettered,
            "rejected": total.rejected,
            "ignored": total.ignored,
            "unaccounted": total.unaccounted,
            "classes": classes,
            "rejections_seen": self.rejections,
            "forged_rejections": self.forged,
            "harm": self.harms.json(),
            "payload_check_error": self.payload_check_error,
            "connections_lost": self.connections_lost,
        })
    }

    /// The table's rows about hostile traffic.
    fn rows(&self, unexpected_exits: u64) -> Vec<(String, String)> {
        let total = &self.accounting.total;
        let mut sent = format!(
            "{} ({}% of the messages; seed {})",
            total.sent,
            round(self.share * 100.0, 3),
            self.seed
        );
        if self.unsent > 0 {
            let _ = write!(sent, "; {} could not be published", self.unsent);
        }
        let mut rows = vec![("hostile messages sent".to_owned(), sent)];
        for (class, c) in &self.accounting.classes {
            rows.push((format!("  {}", class.as_str()), outcomes(c)));
        }
        rows.push((
            "hostile accounted for".into(),
            format!(
                "{} of {} (must be all): {}",
                total.accounted(),
                total.sent,
                outcomes(total)
            ),
        ));
        rows.push((
            "rejected events seen".into(),
            format!("{} (answers to hostile messages)", self.rejections),
        ));
        let mut harmed = format!("{} (must be 0)", self.harms.orders);
        let reasons = self.harms.reasons();
        if !reasons.is_empty() {
            let _ = write!(harmed, ": {}", reasons.join(", "));
        }
        rows.push(("harmed good orders".into(), harmed));
        rows.push((
            "forged rejections seen".into(),
            format!(
                "{} ({} before the order's own end)",
                self.forged, self.harms.forged_end
            ),
        ));
        if let Some(e) = &self.payload_check_error {
            rows.push(("payloads checked".into(), format!("no: {e}")));
        }
        rows.push((
            "connections lost".into(),
            self.connections_lost
                .map_or_else(|| "n/a (no --spawn)".into(), |n| format!("{n} (must be 0)")),
        ));
        rows.push((
            "unexpected exits".into(),
            format!("{unexpected_exits} (must be 0)"),
        ));
        rows
    }

    fn failures(&self, unexpected_exits: u64) -> Vec<String> {
        let mut failures = Vec::new();
        if self.harms.orders > 0 {
            failures.push(format!(
                "{} good orders harmed by hostile traffic",
                self.harms.orders
            ));
        }
        let unaccounted = self.accounting.total.unaccounted;
        if unaccounted > 0 {
            failures.push(format!("{unaccounted} hostile messages not accounted for"));
        }
        if let Some(e) = &self.payload_check_error {
            failures.push(format!(
                "the targeted orders' payloads were not checked: {e}"
            ));
        }
        if let Some(n) = self.connections_lost.filter(|n| *n > 0) {
            failures.push(format!("{n} RabbitMQ connections lost by the services"));
        }
        if unexpected_exits > 0 {
            failures.push(format!("{unexpected_exits} services exited by themselves"));
        }
        failures
    }
}

/// A class's outcomes, for people: "5 dead-lettered, 1 unaccounted".
fn outcomes(c: &Counts) -> String {
    let parts: Vec<String> = [
        (c.dead_lettered, "dead-lettered"),
        (c.rejected, "rejected"),
        (c.ignored, "ignored as duplicates"),
        (c.unaccounted, "unaccounted"),
    ]
    .into_iter()
    .filter(|(n, _)| *n > 0)
    .map(|(n, what)| format!("{n} {what}"))
    .collect();
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(", ")
    }
}

/// What the run itself knows, beside the events.
#[derive(Debug, Clone)]
pub struct RunFacts {
    pub workflow: String,
    /// Orders asked for.
    pub orders: u64,
    /// What the sim's counts say of the run's orders (keys applied more
    /// than once, orders with effects standing); `None` without a sim.
    pub effects: Option<super::faults::Effects>,
    pub kills: u64,
    pub kill_failures: u64,
    /// Spawned services that exited without being killed (and were restarted).
    pub unexpected_exits: u64,
    /// `(transient, permanent)` rates set on the sim, if any.
    pub faults: Option<(f64, f64)>,
    pub kill_every: Option<Duration>,
    /// From the first publish.
    pub started: Instant,
    /// From the first publish to the end of reading.
    pub elapsed: Duration,
    /// Stopped by SIGINT/SIGTERM.
    pub interrupted: bool,
    /// Where the spawned services log.
    pub logs: Option<String>,
    /// The run's status queue.
    pub queue: String,
    /// With `--hostile`.
    pub hostile: Option<HostileFacts>,
}

/// The outcome of a chaos run.
#[derive(Debug, Clone)]
pub struct Report {
    pub workflow: String,
    pub orders: u64,
    pub submitted: u64,
    /// Confirmed orders by the terminal state they ended in.
    pub per_state: [(&'static str, u64); 4],
    /// Confirmed orders without a terminal event.
    pub lost: u64,
    /// Orders whose events skip a `seq`.
    pub gaps: u64,
    /// Orders with more than one terminal event.
    pub multiple_terminal: u64,
    /// Events that share an (`order_id`, `seq`) with a different state.
    pub conflicts: u64,
    pub duplicates: Option<u64>,
    /// Orders that ended other than `processed` with an effect still
    /// applied at a remote; `None` without a sim.
    pub half_done: Option<u64>,
    /// The first of them (up to 10), to look into.
    pub half_done_ids: Vec<Uuid>,
    pub kills: u64,
    pub kill_failures: u64,
    pub unexpected_exits: u64,
    pub deliveries: u64,
    pub redelivered: u64,
    pub malformed: u64,
    pub foreign: u64,
    pub elapsed: Duration,
    pub orders_per_second: f64,
    pub faults: Option<(f64, f64)>,
    pub kill_every: Option<Duration>,
    pub interrupted: bool,
    pub logs: Option<String>,
    pub queue: String,
    /// With `--hostile`.
    pub hostile: Option<HostileReport>,
}

impl Report {
    /// Why the run failed, if it did; empty for a pass.
    pub fn failures(&self) -> Vec<String> {
        let mut failures = Vec::new();
        if self.submitted < self.orders {
            failures.push(format!(
                "{} of {} orders not submitted",
                self.orders - self.submitted,
                self.orders
            ));
        }
        for (n, what) in [
            (self.lost, "lost"),
            (self.gaps, "with a gap in seq"),
            (self.multiple_terminal, "with more than one terminal event"),
        ] {
            if n > 0 {
                failures.push(format!("{n} orders {what}"));
            }
        }
        if self.conflicts > 0 {
            failures.push(format!(
                "{} events with the seq of another event",
                self.conflicts
            ));
        }
        if let Some(d) = self.duplicates.filter(|d| *d > 0) {
            failures.push(format!("{d} idempotency keys applied more than once"));
        }
        if let Some(n) = self.half_done.filter(|n| *n > 0) {
            let ids: Vec<String> = self.half_done_ids.iter().map(Uuid::to_string).collect();
            failures.push(format!(
                "{n} orders left half done (not processed, an effect still applied): {}",
                ids.join(", ")
            ));
        }
        if let Some(h) = &self.hostile {
            failures.extend(h.failures(self.unexpected_exits));
        }
        failures
    }

    /// The report as one JSON object.
    pub fn json(&self) -> Value {
        let state = |state: &str| {
            self.per_state
                .iter()
                .find(|(s, _)| *s == state)
                .map_or(0, |(_, n)| *n)
        };
        json!({
            "ok": self.failures().is_empty(),
            "workflow": self.workflow,
            "orders": self.orders,
            "submitted": self.submitted,
            "processed": state("processed"),
            "compensated": state("compensated"),
            "failed": state("failed"),
            "rejected": state("rejected"),
            "lost": self.lost,
            "gaps": self.gaps,
            "multiple_terminal": self.multiple_terminal,
            "conflicts": self.conflicts,
            "duplicates": self.duplicates,
            "half_done": self.half_done,
            "half_done_ids": self.half_done_ids,
            "kills": self.kills,
            "kill_failures": self.kill_failures,
            "unexpected_exits": self.unexpected_exits,
            "events": {
                "deliveries": self.deliveries,
                "redelivered": self.redelivered,
                "malformed": self.malformed,
                "foreign": self.foreign,
            },
            "transient_rate": self.faults.map(|f| f.0),
            "permanent_rate": self.faults.map(|f| f.1),
            "kill_every_s": self.kill_every.map(|d| d.as_secs_f64()),
            "elapsed_s": round(self.elapsed.as_secs_f64(), 1),
            "orders_per_s": round(self.orders_per_second, 1),
            "interrupted": self.interrupted,
            "logs": self.logs,
            "queue": self.queue,
            "hostile": self.hostile.as_ref().map(HostileReport::json),
            "harmed": self.hostile.as_ref().map(|h| h.harms.orders),
            "failures": self.failures(),
        })
    }

    /// The report as a table for people; the lines marked "must be 0" decide
    /// the exit code.
    pub fn table(&self) -> String {
        let mut rows: Vec<(String, String)> = vec![
            ("workflow".into(), self.workflow.clone()),
            ("fault mix".into(), self.fault_mix()),
            ("orders submitted".into(), self.submitted.to_string()),
        ];
        for (state, n) in &self.per_state {
            rows.push((format!("  {state}"), n.to_string()));
        }
        let must_be_zero = |n: u64| format!("{n} (must be 0)");
        rows.push(("lost".into(), must_be_zero(self.lost)));
        rows.push(("seq gaps".into(), must_be_zero(self.gaps)));
        rows.push((
            "multiple terminal events".into(),
            must_be_zero(self.multiple_terminal),
        ));
        if self.conflicts > 0 {
            rows.push(("conflicting events".into(), must_be_zero(self.conflicts)));
        }
        rows.push((
            "duplicates applied".into(),
            self.duplicates
                .map_or_else(|| "n/a (no --sim)".into(), must_be_zero),
        ));
        rows.push((
            "orders left half done".into(),
            self.half_done
                .map_or_else(|| "n/a (no --sim)".into(), must_be_zero),
        ));
        let mut kills = self.kills.to_string();
        if self.kill_failures > 0 {
            let _ = write!(kills, " ({} kill commands failed)", self.kill_failures);
        }
        rows.push(("kills".into(), kills));
        if let Some(h) = &self.hostile {
            rows.extend(h.rows(self.unexpected_exits));
        } else if self.unexpected_exits > 0 {
            rows.push((
                "unexpected exits".into(),
                format!("{} (restarted)", self.unexpected_exits),
            ));
        }
        rows.push((
            "status events read".into(),
            format!("{} ({} redelivered)", self.deliveries, self.redelivered),
        ));
        rows.push((
            "elapsed".into(),
            format!("{:.1}s", self.elapsed.as_secs_f64()),
        ));
        rows.push((
            "throughput".into(),
            format!("{:.1} orders/s", self.orders_per_second),
        ));
        let failures = self.failures();
        let result = match (failures.is_empty(), self.interrupted) {
            (true, _) => "PASS".to_owned(),
            (false, true) => format!("FAIL (interrupted): {}", failures.join("; ")),
            (false, false) => format!("FAIL: {}", failures.join("; ")),
        };
        rows.push(("result".into(), result));
        let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        let mut out = String::new();
        for (key, value) in rows {
            let _ = writeln!(out, "{key:<width$}  {value}");
        }
        out
    }

    fn fault_mix(&self) -> String {
        let faults = match self.faults {
            Some((t, p)) => format!(
                "{}% transient, {}% permanent",
                round(t * 100.0, 3),
                round(p * 100.0, 3)
            ),
            None => "no faults set (no --sim)".into(),
        };
        match self.kill_every {
            Some(every) => format!(
                "{faults}, a kill every {}",
                humantime::format_duration(every)
            ),
            None => format!("{faults}, no kills"),
        }
    }
}

/// `x` rounded to `digits` decimals, for display.
pub fn round(x: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (x * scale).round() / scale
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: Uuid, seq: i64, state: &str) -> Vec<u8> {
        json!({"order_id": id, "seq": seq, "state": state, "at": "2030-01-01T00:00:00Z"})
            .to_string()
            .into_bytes()
    }

    fn facts() -> RunFacts {
        RunFacts {
            workflow: "w".into(),
            orders: 3,
            effects: Some(super::super::faults::Effects::default()),
            kills: 2,
            kill_failures: 0,
            unexpected_exits: 0,
            faults: Some((0.05, 0.01)),
            kill_every: Some(Duration::from_secs(3)),
            started: Instant::now(),
            elapsed: Duration::from_secs(2),
            interrupted: false,
            logs: None,
            queue: "q".into(),
            hostile: None,
        }
    }

    fn run(tally: &mut Tally, id: Uuid, states: &[&str]) {
        for (i, s) in states.iter().enumerate() {
            tally.record(&event(id, i as i64 + 1, s));
        }
    }

    #[test]
    fn a_clean_run_passes_and_counts_per_terminal_state() {
        let ids: Vec<Uuid> = (0..3).map(|_| Uuid::new_v4()).collect();
        let mut tally = Tally::new(&ids);
        for id in &ids {
            tally.confirmed(*id);
        }
        run(&mut tally, ids[0], &["received", "processing", "processed"]);
        // Redelivered events count once.
        run(&mut tally, ids[0], &["received", "processing", "processed"]);
        run(
            &mut tally,
            ids[1],
            &["received", "processing", "compensating", "compensated"],
        );
        assert!(!tally.complete());
        run(&mut tally, ids[2], &["received", "processing", "failed"]);
        assert!(!tally.complete(), "the submitter is not done yet");
        tally.submission_done();
        assert!(tally.complete());
        let report = tally.report(facts());
        assert!(report.failures().is_empty(), "{:?}", report.failures());
        let j = report.json();
        assert_eq!(j["ok"], true);
        assert_eq!(j["processed"], 1);
        assert_eq!(j["compensated"], 1);
        assert_eq!(j["failed"], 1);
        assert_eq!(j["lost"], 0);
        assert_eq!(j["duplicates"], 0);
        assert_eq!(j["events"]["redelivered"], 3);
        let table = report.table();
        assert!(table.contains("result"), "{table}");
        assert!(table.contains("PASS"), "{table}");
        assert!(table.contains("5% transient, 1% permanent"), "{table}");
        let mut odd = facts();
        odd.faults = Some((0.07, 0.001));
        let table = Tally::new(&[]).report(odd).table();
        assert!(table.contains("7% transient, 0.1% permanent"), "{table}");
    }

    #[test]
    fn lost_orders_gaps_and_second_terminal_events_fail() {
        let ids: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
        let mut tally = Tally::new(&ids);
        for id in &ids {
            tally.confirmed(*id);
        }
        tally.submission_done();
        run(&mut tally, ids[0], &["received", "processing"]);
        tally.record(&event(ids[1], 1, "received"));
        tally.record(&event(ids[1], 3, "processed"));
        run(&mut tally, ids[2], &["received", "failed", "processed"]);
        run(&mut tally, ids[3], &["received", "processed"]);
        tally.record(&event(ids[3], 2, "failed"));
        tally.record(b"not json");
        tally.record(&event(Uuid::new_v4(), 1, "received"));
        assert_eq!(tally.ended_count(), 3);
        let mut facts = facts();
        facts.effects = Some(super::super::faults::Effects {
            duplicates: 2,
            standing: std::collections::HashSet::new(),
        });
        facts.orders = 5;
        let report = tally.report(facts);
        assert_eq!(report.lost, 1);
        assert_eq!(report.gaps, 1);
        assert_eq!(report.multiple_terminal, 1);
        assert_eq!(report.conflicts, 1);
        assert_eq!(report.malformed, 1);
        assert_eq!(report.foreign, 1);
        let failures = report.failures();
        assert_eq!(failures.len(), 6, "{failures:?}");
        assert_eq!(report.json()["ok"], false);
        assert!(report.table().contains("FAIL: 1 of 5 orders not submitted"));
    }

    #[test]
    fn an_order_that_ended_undone_with_an_effect_left_is_half_done() {
        let ids: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
        let mut tally = Tally::new(&ids);
        for id in &ids {
            tally.confirmed(*id);
        }
        tally.submission_done();
        run(
            &mut tally,
            ids[0],
            &["received", "compensating", "compensated"],
        );
        run(&mut tally, ids[1], &["received", "failed"]);
        run(&mut tally, ids[2], &["received", "processed"]);
        run(
            &mut tally,
            ids[3],
            &["received", "compensating", "compensated"],
        );
        let mut facts = facts();
        facts.orders = 4;
        facts.effects = Some(super::super::faults::Effects {
            duplicates: 0,
            // A processed order's effects stand, as they should.
            standing: ids[..3].iter().copied().collect(),
        });
        let report = tally.report(facts);
        assert_eq!(report.half_done, Some(2));
        assert_eq!(report.json()["half_done"], 2);
        assert!(
            report
                .failures()
                .iter()
                .any(|f| f.contains("2 orders left half done"))
        );
        assert!(report.table().contains("orders left half done"));
    }

    #[test]
    fn an_order_confirmed_after_it_ended_counts_as_ended() {
        let id = Uuid::new_v4();
        let mut tally = Tally::new(&[id]);
        run(&mut tally, id, &["received", "processed"]);
        assert_eq!(tally.ended_count(), 0);
        tally.confirmed(id);
        tally.confirmed(id);
        assert_eq!(tally.ended_count(), 1);
        tally.submission_done();
        assert!(tally.complete());
    }

    #[test]
    fn without_a_sim_duplicates_are_not_known() {
        let mut facts = facts();
        facts.effects = None;
        facts.faults = None;
        facts.orders = 0;
        let report = Tally::new(&[]).report(facts);
        assert!(report.failures().is_empty());
        assert_eq!(report.json()["duplicates"], Value::Null);
        assert_eq!(report.json()["half_done"], Value::Null);
        assert!(report.table().contains("n/a"));
    }

    fn rejected(id: Option<Uuid>) -> Vec<u8> {
        json!({"order_id": id, "seq": 0, "state": "rejected", "at": "2030-01-01T00:00:00Z"})
            .to_string()
            .into_bytes()
    }

    fn hostile_facts(sent: Vec<hostile::Sent>, seen: hostile::Seen) -> HostileFacts {
        HostileFacts {
            share: 0.2,
            seed: 38,
            sent,
            unsent: 0,
            seen,
            payload_check_error: None,
            connections_lost: Some(0),
        }
    }

    /// Four good orders, all confirmed, the submitter done.
    fn good_tally() -> (Vec<Uuid>, Tally) {
        let ids: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
        let mut tally = Tally::new(&ids);
        for id in &ids {
            tally.confirmed(*id);
        }
        tally.submission_done();
        (ids, tally)
    }

    #[test]
    fn a_forged_rejection_is_harm_only_when_it_comes_before_the_order_s_end() {
        let (ids, mut tally) = good_tally();
        for id in &ids[..2] {
            tally.targeted(*id);
        }
        // ids[0]: forged after its end; ids[1]: forged while it runs.
        run(&mut tally, ids[0], &["received", "processing", "processed"]);
        tally.record(&rejected(Some(ids[0])));
        tally.record(&event(ids[1], 1, "received"));
        tally.record(&rejected(Some(ids[1])));
        assert_eq!(tally.ended_count(), 1, "a forgery does not end an order");
        tally.record(&event(ids[1], 2, "processed"));
        run(&mut tally, ids[2], &["received", "processed"]);
        run(&mut tally, ids[3], &["received", "processed"]);
        assert!(tally.complete());
        let mut facts = facts();
        facts.orders = 4;
        facts.faults = None;
        facts.hostile = Some(hostile_facts(Vec::new(), hostile::Seen::default()));
        let report = tally.report(facts);
        // Forgeries are not a second terminal event of the order.
        assert_eq!(report.multiple_terminal, 0);
        let h = report.hostile.as_ref().unwrap();
        assert_eq!(h.forged, 2);
        assert_eq!(h.harms.forged_end, 1);
        assert_eq!(h.harms.orders, 1);
        assert_eq!(report.json()["harmed"], 1);
        let table = report.table();
        assert!(
            table.contains("forged rejections seen    2 (1 before the order's own end)"),
            "{table}"
        );
        assert!(
            table.contains("harmed good orders        1 (must be 0): 1 a forged rejection first"),
            "{table}"
        );
        assert!(
            report
                .failures()
                .iter()
                .any(|f| f.contains("1 good orders harmed"))
        );
    }

    #[test]
    fn harm_is_an_order_not_processed_doubled_or_given_a_stranger_s_content() {
        let (ids, mut tally) = good_tally();
        let fresh = Uuid::new_v4();
        tally.hostile(fresh);
        run(&mut tally, ids[0], &["received", "processing", "processed"]);
        // A hostile status event came back for ids[1].
        run(&mut tally, ids[1], &["received", "processed"]);
        tally.record(
            &json!({"order_id": ids[1], "seq": 1_000_007, "state": "failed", "detail": {MARKER: 7}})
                .to_string()
                .into_bytes(),
        );
        run(
            &mut tally,
            ids[2],
            &["received", "processing", "compensating", "compensated"],
        );
        // ids[3] never ends. The answers to hostile messages are counted apart.
        tally.record(&event(ids[3], 1, "received"));
        tally.record(&rejected(Some(fresh)));
        tally.record(&rejected(None));
        let foreign_payload = HashSet::from([ids[0]]);
        let harms = tally.harms(false, &foreign_payload);
        assert_eq!(
            harms,
            Harms {
                orders: 4,
                not_ended: 1,
                not_processed: 1,
                ended_twice: 0,
                forged_end: 0,
                foreign_event: 1,
                foreign_payload: 1,
            }
        );
        // With faults set, compensated is the fault mix's doing.
        assert_eq!(tally.harms(true, &foreign_payload).orders, 3);
        let mut facts = facts();
        facts.faults = Some((0.0, 0.0));
        facts.orders = 4;
        let seen = hostile::Seen {
            foreign_payload,
            payloads_checked: true,
            orders_drained: true,
            ..hostile::Seen::default()
        };
        let sent = vec![hostile::Sent {
            n: 0,
            class: hostile::Class::WrongType,
            hostile_id: Some(fresh),
            fate: hostile::Fate::DeadLetter("t.orders.dead".into()),
        }];
        facts.hostile = Some(hostile_facts(sent, seen));
        let report = tally.report(facts);
        let h = report.hostile.as_ref().unwrap();
        assert_eq!(h.rejections, 2);
        // Found nowhere, but answered with a rejection: accounted for.
        assert_eq!(h.accounting.total.rejected, 1);
        assert_eq!(h.accounting.total.unaccounted, 0);
        assert_eq!(report.foreign, 0);
        let table = report.table();
        assert!(
            table.contains("4 (must be 0): 1 not ended, 1 not processed, 1 a hostile event, 1 a hostile payload"),
            "{table}"
        );
        assert!(
            table.contains("  wrong_type              1 rejected"),
            "{table}"
        );
        assert!(
            table.contains("hostile accounted for     1 of 1 (must be all): 1 rejected"),
            "{table}"
        );
    }

    #[test]
    fn a_clean_hostile_run_passes_and_any_exit_or_lost_connection_fails_it() {
        let (ids, mut tally) = good_tally();
        for id in &ids {
            run(&mut tally, *id, &["received", "processed"]);
        }
        let target = ids[0];
        tally.targeted(target);
        let sent = vec![
            hostile::Sent {
                n: 0,
                class: hostile::Class::DuplicateId,
                hostile_id: None,
                fate: hostile::Fate::Duplicate { target },
            },
            hostile::Sent {
                n: 1,
                class: hostile::Class::GarbageReply,
                hostile_id: None,
                fate: hostile::Fate::DeadLetter("t.scheduler.replies.dead".into()),
            },
        ];
        let seen = hostile::Seen {
            dead_lettered: HashMap::from([(1, "t.scheduler.replies.dead".into())]),
            payloads_checked: true,
            orders_drained: true,
            ..hostile::Seen::default()
        };
        let mut facts = facts();
        facts.orders = 4;
        facts.faults = None;
        facts.hostile = Some(hostile_facts(sent, seen));
        let report = tally.report(facts.clone());
        assert!(report.failures().is_empty(), "{:?}", report.failures());
        let table = report.table();
        println!("{table}");
        for line in [
            "hostile messages sent     2 (20% of the messages; seed 38)",
            "  duplicate_id            1 ignored as duplicates",
            "  garbage_reply           1 dead-lettered",
            "hostile accounted for     2 of 2 (must be all): 1 dead-lettered, 1 ignored as duplicates",
            "harmed good orders        0 (must be 0)",
            "forged rejections seen    0 (0 before the order's own end)",
            "connections lost          0 (must be 0)",
            "unexpected exits          0 (must be 0)",
            "PASS",
        ] {
            assert!(table.contains(line), "{line:?} in\n{table}");
        }
        let j = report.json();
        assert_eq!(j["harmed"], 0);
        assert_eq!(j["hostile"]["sent"], 2);
        assert_eq!(j["hostile"]["accounted"], 2);
        assert_eq!(j["hostile"]["classes"]["garbage_reply"]["dead_lettered"], 1);

        facts.unexpected_exits = 1;
        let mut hostile = facts.hostile.take().unwrap();
        hostile.connections_lost = Some(2);
        hostile.seen.orders_drained = false;
        facts.hostile = Some(hostile);
        let failures = tally.report(facts).failures();
        assert_eq!(
            failures,
            [
                "1 hostile messages not accounted for",
                "2 RabbitMQ connections lost by the services",
                "1 services exited by themselves",
            ]
        );
    }
}

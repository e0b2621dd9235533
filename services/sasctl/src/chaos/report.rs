//! What a chaos run saw: the status events of its orders, deduplicated on
//! (`order_id`, `seq`) as the contract tells consumers to, and the verdict
//! drawn from them ([`Report`]): orders per terminal state, orders lost,
//! sequence gaps, orders with more than one terminal event, effects applied
//! twice.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use sas::messages::EventKind;
use serde_json::{Value, json};
use uuid::Uuid;

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
        }
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
        let Some(id) = event.order_id.filter(|id| self.known.contains(id)) else {
            self.foreign += 1;
            return;
        };
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
            duplicates: run.duplicates,
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
        }
    }
}

/// What the run itself knows, beside the events.
#[derive(Debug, Clone)]
pub struct RunFacts {
    pub workflow: String,
    /// Orders asked for.
    pub orders: u64,
    /// Idempotency keys of the run's orders the sim applied more than once;
    /// `None` without a sim.
    pub duplicates: Option<u64>,
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
        let mut kills = self.kills.to_string();
        if self.kill_failures > 0 {
            let _ = write!(kills, " ({} kill commands failed)", self.kill_failures);
        }
        rows.push(("kills".into(), kills));
        if self.unexpected_exits > 0 {
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
            duplicates: Some(0),
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
        facts.duplicates = Some(2);
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
        facts.duplicates = None;
        facts.faults = None;
        facts.orders = 0;
        let report = Tally::new(&[]).report(facts);
        assert!(report.failures().is_empty());
        assert_eq!(report.json()["duplicates"], Value::Null);
        assert!(report.table().contains("n/a"));
    }
}

//! Recurring orders (contract §4b): a schedule submits one order of its
//! workflow per tick of its cron expression, read on the wall clock of its
//! time zone (UTC unless `timezone` names an IANA zone).
//!
//! Invariants:
//! - One order per tick however many supervisors run: its id is
//!   [`order_id`], the UUIDv5 of the schedule's name and the tick in the
//!   deployment's secret namespace, and a second submission of an id is the
//!   same order (contract §1). No application can compute it, so none can
//!   submit a tick's order first (contract §1b).
//! - The state store keeps one mark per schedule: every tick at or before it
//!   has been dealt with (ordered or passed over). [`due`] returns the ticks
//!   after the mark and up to `now` that get an order, and the new mark.
//! - A schedule seen for the first time orders nothing for the past: its
//!   mark starts at the tick before `now`.
//! - A tick is *missed* when it is more than `late_after` old when a
//!   supervisor first sees it (nothing ran then). [`CatchUp`] says what
//!   missed ticks get; on-time ticks always get their order. At most
//!   [`MAX_CATCH_UP`] ticks are ordered in one pass, the newest; older ones
//!   are passed over.
//!
//! Pure: no clock reads (`now` is an argument, from the database), no I/O.

use std::time::Duration;

use chrono::{DateTime, SecondsFormat, SubsecRound as _, TimeDelta, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::errors::CronError;
use croner::parser::{CronParser, Seconds, Year};

use uuid::Uuid;

use crate::model::NewOrder;
pub use crate::spec::CatchUp;
use crate::spec::ScheduleSpec;

/// Most ticks ordered in one pass: with `catch_up = "all"`, an outage of a
/// year under a one-minute cron must not flood the workflow.
pub const MAX_CATCH_UP: usize = 100;

/// The UUIDv5 namespace of a deployment's scheduled orders' ids: a random
/// value the state store keeps (table `schedule_key`), which applications
/// never see (contract §1b).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleKey(pub Uuid);

/// Why a schedule cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error("schedule {0:?}: the name must be ASCII letters, digits, '-', '_' or '.'")]
    BadName(String),
    #[error("schedules.{schedule}.workflow {workflow:?} is not a configured workflow")]
    UnknownWorkflow { schedule: String, workflow: String },
    #[error(
        "schedules.{schedule}.cron {cron:?} is not a cron expression of 5 or 6 fields: {source}"
    )]
    BadCron {
        schedule: String,
        cron: String,
        source: CronError,
    },
    #[error("schedules.{schedule}.cron {cron:?} never fires")]
    NeverFires { schedule: String, cron: String },
    #[error(
        "schedules.{schedule}.timezone {zone:?} is not an IANA time zone (e.g. \"Europe/Paris\")"
    )]
    BadZone { schedule: String, zone: String },
    #[error("schedules.{schedule}.reply_to must not be empty")]
    EmptyReplyTo { schedule: String },
    /// The cron search failed on a time (the tick search's own bound).
    #[error("schedule {schedule:?}: cannot find its ticks: {source}")]
    Search { schedule: String, source: CronError },
}

/// A schedule ready to run.
#[derive(Debug, Clone)]
pub struct Schedule {
    pub name: String,
    pub workflow: String,
    /// The expression as configured (shown to operators).
    pub cron_text: String,
    pub cron: Cron,
    /// The zone whose wall clock the expression reads.
    pub zone: Tz,
    pub catch_up: CatchUp,
    /// Every order's payload.
    pub payload: serde_json::Map<String, serde_json::Value>,
    /// Every order's status queue.
    pub reply_to: Option<String>,
}

/// What a pass decides for one schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Due {
    /// The ticks to order now, oldest first.
    pub ticks: Vec<DateTime<Utc>>,
    /// Missed ticks passed over (at least this many: beyond
    /// [`MAX_CATCH_UP`] they are not counted).
    pub passed_over: usize,
    /// The new mark: every tick at or before it is dealt with.
    pub mark: DateTime<Utc>,
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 100
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// The cron parser: five fields (minute first), or six with seconds first
/// (an extension, mostly for tests); no year field.
fn parser() -> CronParser {
    CronParser::builder()
        .seconds(Seconds::Optional)
        .year(Year::Disallowed)
        .build()
}

impl Schedule {
    /// Checks a configured schedule: its name, cron expression (it must
    /// fire at least once from `now`), time zone and reply queue. Whether
    /// its workflow exists is the configuration's check.
    pub fn compile(
        name: &str,
        spec: &ScheduleSpec,
        now: DateTime<Utc>,
    ) -> Result<Self, ScheduleError> {
        if !valid_name(name) {
            return Err(ScheduleError::BadName(name.to_owned()));
        }
        let cron = parser()
            .parse(&spec.cron)
            .map_err(|source| ScheduleError::BadCron {
                schedule: name.to_owned(),
                cron: spec.cron.clone(),
                source,
            })?;
        let zone = match spec.timezone.as_deref() {
            None => Tz::UTC,
            Some(zone) => zone.parse().map_err(|_| ScheduleError::BadZone {
                schedule: name.to_owned(),
                zone: zone.to_owned(),
            })?,
        };
        if spec.reply_to.as_deref().is_some_and(str::is_empty) {
            return Err(ScheduleError::EmptyReplyTo {
                schedule: name.to_owned(),
            });
        }
        let schedule = Self {
            name: name.to_owned(),
            workflow: spec.workflow.clone(),
            cron_text: spec.cron.clone(),
            cron,
            zone,
            catch_up: spec.catch_up,
            payload: spec.payload.clone(),
            reply_to: spec.reply_to.clone(),
        };
        // E.g. "0 0 30 2 *": parses, but no 30th of February ever comes.
        if schedule.next_tick(now).is_err() {
            return Err(ScheduleError::NeverFires {
                schedule: name.to_owned(),
                cron: spec.cron.clone(),
            });
        }
        Ok(schedule)
    }

    /// The first tick after `t`.
    pub fn next_tick(&self, t: DateTime<Utc>) -> Result<DateTime<Utc>, ScheduleError> {
        self.cron
            .find_next_occurrence(&t.with_timezone(&self.zone), false)
            .map(|next| next.with_timezone(&Utc))
            .map_err(|source| self.search_error(source))
    }

    /// The last tick before `t` (`None` when there is none to find).
    fn previous_tick(&self, t: DateTime<Utc>) -> Result<Option<DateTime<Utc>>, ScheduleError> {
        match self
            .cron
            .find_previous_occurrence(&t.with_timezone(&self.zone), false)
        {
            Ok(previous) => Ok(Some(previous.with_timezone(&Utc))),
            Err(CronError::TimeSearchLimitExceeded) => Ok(None),
            Err(source) => Err(self.search_error(source)),
        }
    }

    /// Whether `t` is a tick as a forward walk meets it: where the clock
    /// goes back, a fixed-time expression ("30 2 * * *") matches twice on
    /// the wall clock but fires once, at the first pass.
    fn fires_at(&self, t: DateTime<Utc>) -> Result<bool, ScheduleError> {
        Ok(self.next_tick(t - TimeDelta::seconds(1))? == t)
    }

    /// The zone's name, `UTC` by default.
    pub fn zone_name(&self) -> &'static str {
        self.zone.name()
    }

    fn search_error(&self, source: CronError) -> ScheduleError {
        ScheduleError::Search {
            schedule: self.name.clone(),
            source,
        }
    }
}

/// The id of the order of `schedule`'s tick at `tick`: the UUIDv5, in the
/// deployment's namespace `key`, of `<schedule>@<tick>`, the tick in RFC
/// 3339, UTC, to the second (e.g. `nightly-report@2026-11-26T02:00:00Z`).
pub fn order_id(key: ScheduleKey, schedule: &str, tick: DateTime<Utc>) -> Uuid {
    let tick = tick.to_rfc3339_opts(SecondsFormat::Secs, true);
    Uuid::new_v5(&key.0, format!("{schedule}@{tick}").as_bytes())
}

/// The ticks of `schedule` to order now, given its stored mark (`None`:
/// first seen) and the database's `now`; a tick more than `late_after` old
/// is a missed one.
pub fn due(
    schedule: &Schedule,
    mark: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
    late_after: Duration,
) -> Result<Due, ScheduleError> {
    // Ticks fall on whole seconds; lateness counts from the exact `now`.
    let exact = now;
    let now = now.trunc_subsecs(0);
    let after = match mark {
        Some(mark) => mark,
        // First sight: the tick of this very second still counts.
        None => schedule
            .previous_tick(now)?
            .unwrap_or(now - TimeDelta::seconds(1)),
    };
    // Newest first, walking back: an outage of any length costs at most
    // MAX_CATCH_UP + 1 searches.
    let mut ticks = Vec::new();
    let mut cursor = now + TimeDelta::seconds(1);
    let mut more = false;
    while let Some(tick) = schedule.previous_tick(cursor)? {
        if tick <= after {
            break;
        }
        if ticks.len() == MAX_CATCH_UP {
            more = true;
            break;
        }
        if schedule.fires_at(tick)? {
            ticks.push(tick);
        }
        cursor = tick;
    }
    let late_after = TimeDelta::from_std(late_after).unwrap_or(TimeDelta::MAX);
    let on_time = ticks
        .iter()
        .take_while(|t| exact - **t <= late_after)
        .count();
    let missed = ticks.len() - on_time;
    let keep = on_time
        + match schedule.catch_up {
            CatchUp::None => 0,
            CatchUp::Last => missed.min(1),
            CatchUp::All => missed,
        };
    let passed_over = ticks.len() - keep + usize::from(more);
    let new_mark = ticks.first().copied().unwrap_or(after).max(after);
    ticks.truncate(keep);
    ticks.reverse();
    Ok(Due {
        ticks,
        passed_over,
        mark: new_mark,
    })
}

/// The order of `schedule`'s tick at `tick`: its id is
/// [`order_id`] in the deployment's namespace `key`, its trace
/// `trace` (the tick's span).
pub fn scheduled_order(
    key: ScheduleKey,
    schedule: &Schedule,
    tick: DateTime<Utc>,
    trace: &crate::trace::TraceContext,
) -> NewOrder {
    {
        NewOrder {
            reply_to: schedule.reply_to.clone(),
            trace_id: Some(trace.trace_id.clone()),
            trace_span: Some(trace.span_id.clone()),
            ..NewOrder::new(
                order_id(key, &schedule.name, tick),
                schedule.workflow.clone(),
                serde_json::Value::Object(schedule.payload.clone()),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone as _;

    use super::*;

    const LATE: Duration = Duration::from_secs(2);

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s)
            .expect("a test time")
            .with_timezone(&Utc)
    }

    fn schedule(cron: &str, zone: Option<&str>, catch_up: CatchUp) -> Schedule {
        let spec = ScheduleSpec {
            workflow: "report".into(),
            cron: cron.into(),
            timezone: zone.map(Into::into),
            payload: serde_json::Map::new(),
            reply_to: None,
            catch_up,
        };
        Schedule::compile("nightly", &spec, at("2026-01-01T00:00:00Z")).expect("compiles")
    }

    fn ticks(due: &Due) -> Vec<String> {
        due.ticks
            .iter()
            .map(|t| t.to_rfc3339_opts(SecondsFormat::Secs, true))
            .collect()
    }

    #[test]
    fn first_sight_orders_nothing_for_the_past_but_the_tick_of_this_second() {
        let s = schedule("0 2 * * *", None, CatchUp::All);
        let due = due(&s, None, at("2026-03-10T12:00:00.5Z"), LATE).unwrap();
        assert!(due.ticks.is_empty());
        assert_eq!(due.mark, at("2026-03-10T02:00:00Z"), "the tick before now");
        assert_eq!(due.passed_over, 0);
        let now = due_at(&s, None, "2026-03-10T02:00:00.3Z");
        assert_eq!(ticks(&now), ["2026-03-10T02:00:00Z"]);
        assert_eq!(now.mark, at("2026-03-10T02:00:00Z"));
    }

    fn due_at(s: &Schedule, mark: Option<&str>, now: &str) -> Due {
        due(s, mark.map(at), at(now), LATE).unwrap()
    }

    #[test]
    fn an_on_time_tick_is_ordered_once_then_nothing_until_the_next() {
        let s = schedule("*/2 * * * * *", None, CatchUp::None);
        let one = due_at(&s, Some("2026-03-10T12:00:00Z"), "2026-03-10T12:00:02.9Z");
        assert_eq!(ticks(&one), ["2026-03-10T12:00:02Z"]);
        let again = due_at(&s, Some("2026-03-10T12:00:02Z"), "2026-03-10T12:00:03.9Z");
        assert!(again.ticks.is_empty());
        assert_eq!(again.mark, at("2026-03-10T12:00:02Z"), "unchanged");
        // Two on-time ticks since the last pass (a slow pass): both.
        let both = due_at(&s, Some("2026-03-10T12:00:00Z"), "2026-03-10T12:00:04Z");
        assert_eq!(
            ticks(&both),
            ["2026-03-10T12:00:02Z", "2026-03-10T12:00:04Z"]
        );
    }

    #[test]
    fn missed_ticks_get_nothing_one_order_or_one_each_by_catch_up() {
        // Down from 12:00:00 to 12:00:11: ticks 02..10 missed (late after 0.5 s).
        let late = Duration::from_millis(500);
        let run = |catch_up, now| {
            let s = schedule("*/2 * * * * *", None, catch_up);
            due(&s, Some(at("2026-03-10T12:00:00Z")), at(now), late).unwrap()
        };
        let none = run(CatchUp::None, "2026-03-10T12:00:11Z");
        assert!(none.ticks.is_empty());
        assert_eq!(none.passed_over, 5);
        assert_eq!(none.mark, at("2026-03-10T12:00:10Z"), "passed over");
        let last = run(CatchUp::Last, "2026-03-10T12:00:11Z");
        assert_eq!(ticks(&last), ["2026-03-10T12:00:10Z"]);
        assert_eq!(last.passed_over, 4);
        let all = run(CatchUp::All, "2026-03-10T12:00:11Z");
        assert_eq!(all.ticks.len(), 5);
        assert_eq!(all.ticks[0], at("2026-03-10T12:00:02Z"), "oldest first");
        assert_eq!(all.passed_over, 0);
        // Back on a tick: it is on time, ordered beside the latest missed one.
        let back = run(CatchUp::Last, "2026-03-10T12:00:12.2Z");
        assert_eq!(
            ticks(&back),
            ["2026-03-10T12:00:10Z", "2026-03-10T12:00:12Z"]
        );
        let back = run(CatchUp::None, "2026-03-10T12:00:12.2Z");
        assert_eq!(ticks(&back), ["2026-03-10T12:00:12Z"]);
    }

    #[test]
    fn all_is_bounded_to_the_newest_hundred_ticks() {
        let s = schedule("* * * * *", None, CatchUp::All);
        // A week without a supervisor: 10 080 minutes.
        let due = due_at(&s, Some("2026-03-01T00:00:00Z"), "2026-03-08T00:00:30Z");
        assert_eq!(due.ticks.len(), MAX_CATCH_UP);
        assert_eq!(due.ticks.last(), Some(&at("2026-03-08T00:00:00Z")));
        assert_eq!(due.ticks[0], at("2026-03-07T22:21:00Z"));
        assert!(due.passed_over >= 1);
        assert_eq!(due.mark, at("2026-03-08T00:00:00Z"));
    }

    #[test]
    fn a_named_zone_reads_its_wall_clock_across_both_dst_changes() {
        let paris: Tz = "Europe/Paris".parse().unwrap();
        let s = schedule("30 2 * * *", Some("Europe/Paris"), CatchUp::All);
        assert_eq!(s.zone_name(), "Europe/Paris");
        // Winter: 02:30 CET is 01:30 UTC.
        let winter = due_at(&s, Some("2026-01-14T12:00:00Z"), "2026-01-15T01:30:00Z");
        assert_eq!(ticks(&winter), ["2026-01-15T01:30:00Z"]);
        // 29 March 2026: 02:00 becomes 03:00, 02:30 never happens; the
        // day's tick comes at the first instant after the gap.
        let spring = due_at(&s, Some("2026-03-28T12:00:00Z"), "2026-03-29T12:00:00Z");
        assert_eq!(ticks(&spring), ["2026-03-29T01:00:00Z"]);
        // 25 October 2026: 03:00 becomes 02:00, 02:30 happens twice; the
        // day has one tick, the first.
        let autumn = due_at(&s, Some("2026-10-24T12:00:00Z"), "2026-10-25T12:00:00Z");
        assert_eq!(ticks(&autumn), ["2026-10-25T00:30:00Z"]);
        assert_eq!(
            paris
                .with_ymd_and_hms(2026, 10, 25, 2, 30, 0)
                .earliest()
                .unwrap(),
            at("2026-10-25T00:30:00Z")
        );
        // A pass between the two 02:30s orders nothing at the second.
        let between = due_at(&s, Some("2026-10-25T00:30:00Z"), "2026-10-25T01:45:00Z");
        assert!(between.ticks.is_empty(), "{between:?}");
        assert_eq!(
            s.next_tick(at("2026-10-25T00:30:00Z")).unwrap(),
            at("2026-10-26T01:30:00Z")
        );
        // An hourly expression fires in both passes of the repeated hour.
        let hourly = schedule("0 * * * *", Some("Europe/Paris"), CatchUp::All);
        let repeated = due_at(
            &hourly,
            Some("2026-10-24T23:30:00Z"),
            "2026-10-25T02:30:00Z",
        );
        assert_eq!(
            ticks(&repeated),
            [
                "2026-10-25T00:00:00Z",
                "2026-10-25T01:00:00Z",
                "2026-10-25T02:00:00Z"
            ]
        );
    }

    #[test]
    fn the_order_id_is_the_uuidv5_of_name_and_tick_in_utc_in_the_deployments_namespace() {
        let key = ScheduleKey(uuid::uuid!("d4df6b62-5b46-57bb-a3a4-36403979677d"));
        let tick = at("2026-11-26T03:00:00+01:00");
        let id = order_id(key, "nightly-report", tick);
        assert_eq!(
            id,
            order_id(key, "nightly-report", at("2026-11-26T02:00:00Z"))
        );
        assert_eq!(id.get_version_num(), 5);
        // As any UUIDv5 library derives it.
        assert_eq!(id.to_string(), "691088b5-8102-50ab-bf44-f231b32209f0");
        assert_ne!(
            id,
            order_id(key, "nightly-report", at("2026-11-26T02:00:01Z"))
        );
        assert_ne!(id, order_id(key, "weekly-report", tick));
        // Another deployment's (secret) namespace: another id.
        let other = ScheduleKey(Uuid::new_v4());
        assert_ne!(id, order_id(other, "nightly-report", tick));
    }

    #[test]
    fn bad_expressions_zones_and_names_are_refused_with_the_key() {
        let spec = |cron: &str, zone: Option<&str>| ScheduleSpec {
            workflow: "report".into(),
            cron: cron.into(),
            timezone: zone.map(Into::into),
            payload: serde_json::Map::new(),
            reply_to: None,
            catch_up: CatchUp::Last,
        };
        let now = at("2026-01-01T00:00:00Z");
        for (name, cron, zone, says) in [
            ("n", "not a cron", None, "schedules.n.cron \"not a cron\""),
            ("n", "0 2 * * * * 2030", None, "5 or 6 fields"),
            ("n", "61 * * * *", None, "schedules.n.cron"),
            ("n", "0 0 30 2 *", None, "never fires"),
            (
                "n",
                "0 2 * * *",
                Some("Mars/Olympus"),
                "schedules.n.timezone \"Mars/Olympus\"",
            ),
            ("bad name", "0 2 * * *", None, "the name must be"),
        ] {
            let err = Schedule::compile(name, &spec(cron, zone), now)
                .expect_err(cron)
                .to_string();
            assert!(err.contains(says), "{cron}: {err}");
            assert_eq!(err.lines().count(), 1, "{err}");
        }
        let five = Schedule::compile("n", &spec("0 2 * * *", None), now).unwrap();
        assert_eq!(five.next_tick(now).unwrap(), at("2026-01-01T02:00:00Z"));
        let six = Schedule::compile("n", &spec("*/2 * * * * *", None), now).unwrap();
        assert_eq!(six.next_tick(now).unwrap(), at("2026-01-01T00:00:02Z"));
    }
}

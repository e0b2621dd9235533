//! What an operator declares: workflows with their steps and retries,
//! recurring orders, applications, and the supervisor's policy. Plain data, read from the
//! configuration by `sas::config` (in `sas-runtime`, which loads and validates it) and
//! read by the rules and the workflow plan, which so depend on no loading.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::expr::Expr;

/// `[supervisor]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct SupervisorSettings {
    /// Time between sweeps for expired complete-by times.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// The order gives up when `failure_count` reaches this.
    pub max_failures: u32,
    /// Wait before re-attempt n (the last entry repeats).
    #[serde(deserialize_with = "durations")]
    pub retry_schedule: Vec<Duration>,
    /// Expired orders handled per sweep transaction.
    pub batch: u32,
    /// The deadline ladder (contract §8): fractions of a running step's time
    /// at which its order's status queue is warned (`deadline_warning`),
    /// once per rung and dispatch; ascending, each in (0, 1).
    pub warn_at: Vec<f64>,
    /// Also raise an operator alert at the ladder's last rung.
    pub alert_at_warning: bool,
    /// The orders are split into this many partitions by id; each
    /// supervisor sweeps the partitions it holds (contract §8).
    pub partitions: u32,
}

impl Default for SupervisorSettings {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(1),
            max_failures: 5,
            retry_schedule: [1, 5, 10, 30, 60]
                .into_iter()
                .map(|m| Duration::from_secs(m * 60))
                .collect(),
            batch: 100,
            warn_at: vec![0.5, 0.8],
            alert_at_warning: false,
            partitions: 16,
        }
    }
}

impl SupervisorSettings {
    /// The wait before the re-attempt that follows failure number `failure_count` (1-based).
    pub fn retry_delay(&self, failure_count: u32) -> Duration {
        let i = (failure_count.max(1) - 1) as usize;
        self.retry_schedule
            .get(i)
            .or(self.retry_schedule.last())
            .copied()
            .unwrap_or_default()
    }
}

/// `[workflows.<name>]` as written in the configuration. Stored whole with
/// each order as its [`Definition`] (contract §4d), so its fields serialize
/// back to what they read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkflowSpec {
    /// An optional label of this definition, shown with its orders.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    pub steps: Vec<StepSpec>,
    /// Overrides `supervisor.max_failures` for this workflow's orders.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_failures: Option<u32>,
    /// Overrides `supervisor.retry_schedule` for this workflow's orders.
    #[serde(
        default,
        deserialize_with = "some_durations",
        serialize_with = "some_durations_out",
        skip_serializing_if = "Option::is_none"
    )]
    pub retry_schedule: Option<Vec<Duration>>,
}

impl WorkflowSpec {
    /// The supervisor's policy for orders of this workflow: `defaults`
    /// with the workflow's own `max_failures` and `retry_schedule` where it
    /// sets them (contract §4b).
    pub fn failure_policy<'s>(
        &self,
        defaults: &'s SupervisorSettings,
    ) -> std::borrow::Cow<'s, SupervisorSettings> {
        if self.max_failures.is_none() && self.retry_schedule.is_none() {
            return std::borrow::Cow::Borrowed(defaults);
        }
        let mut own = defaults.clone();
        own.max_failures = self.max_failures.unwrap_or(own.max_failures);
        if let Some(schedule) = &self.retry_schedule {
            own.retry_schedule = schedule.clone();
        }
        std::borrow::Cow::Owned(own)
    }

    /// The step named `step`, or, for an item of a `for_each` step
    /// (`<step>:<index>`), that step.
    pub fn step(&self, step: &str) -> Option<&StepSpec> {
        let name = item_of(step).map_or(step, |(base, _)| base);
        self.steps.iter().find(|s| s.name == name)
    }

    /// `retry` of step `step`, if it sets one.
    pub fn step_retry(&self, step: &str) -> Option<RetrySpec> {
        self.step(step)?.retry
    }
}

/// The whole definition an order runs under until it ends (contract §4d):
/// its workflow's name and spec as configured when it was submitted,
/// whatever the configuration says later. Stored once per content
/// ([`Self::id`]) and named by each order.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct Definition {
    pub workflow: String,
    pub spec: WorkflowSpec,
}

/// The namespace of [`Definition::id`]s.
const DEFINITIONS: uuid::Uuid = uuid::Uuid::from_u128(0x5a5d_ef00_0000_4000_8000_0000_0000_0d4d);

impl Definition {
    /// Its id: a UUIDv5 of its JSON, so the same definition has the same
    /// id in every process and a changed one a new id.
    pub fn id(&self) -> uuid::Uuid {
        let json = serde_json::to_vec(self).unwrap_or_default();
        uuid::Uuid::new_v5(&DEFINITIONS, &json)
    }

    /// What operators see as its version: its `version` label, or else
    /// the first eight hex digits of its id.
    pub fn label(&self) -> String {
        self.spec
            .version
            .clone()
            .unwrap_or_else(|| self.id().simple().to_string()[..8].to_owned())
    }
}

/// `retry` of a step (contract §4b): the agent's attempts within one
/// dispatch; unset keys are the agent's (`agent.backoff_initial`,
/// `agent.backoff_max`, attempts until complete-by).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RetrySpec {
    /// Calls per dispatch at most (the first included); after the last
    /// transient failure the agent stops, silent, and the supervisor
    /// re-attempts at complete-by.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// First wait between calls; doubles per retry, with full jitter.
    #[serde(
        with = "humantime_serde",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub backoff: Option<Duration>,
    /// Longest wait between calls.
    #[serde(
        with = "humantime_serde",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub backoff_max: Option<Duration>,
}

/// One step of a workflow as written in the configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StepSpec {
    pub name: String,
    /// The agent that runs the step; none for the steps sas runs itself
    /// (`wait`, `until`, `signal`, §4d).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// §4d: a step that does nothing for this long.
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub wait: Option<Duration>,
    /// §4d: a step that does nothing until this time, a CEL expression
    /// giving a timestamp (or an RFC 3339 string).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<Expr>,
    /// §4d: a step that waits for the application's signal of this name;
    /// its `data` is the step's result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    /// §4d: a step that runs this workflow as a child order and completes
    /// with its results; undoing the step compensates the child.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workflow: Option<String>,
    /// §4d: a CEL expression over `payload` giving a list: the step runs
    /// once per item.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub for_each: Option<Expr>,
    /// §4d: the items of a `for_each` out at once, at most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<u32>,
    /// The step's complete-by, counted from its dispatch.
    #[serde(with = "humantime_serde", default = "default_step_timeout")]
    pub timeout: Duration,
    /// The agent that undoes the step, if it can be undone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensate: Option<String>,
    /// The agent's attempts within one dispatch of this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetrySpec>,
    /// The steps that must have completed before this one starts (§4b);
    /// unset: the step listed before it (none for the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<Vec<String>>,
    /// How long a long-running remote operation may keep the step going
    /// from its first dispatch, however often it answers `202` (§4b).
    #[serde(with = "humantime_serde", default = "default_max_duration")]
    pub max_duration: Duration,
    /// A CEL condition over `payload` and `results` (§4d): false skips the
    /// step; unset, the step always runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when: Option<Expr>,
    /// The request's payload, one key per CEL expression (§4d); unset,
    /// the order's payload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<BTreeMap<String, Expr>>,
}

impl StepSpec {
    /// Whether an expression of the step may read the earlier steps'
    /// `results` (`when`, `input`, `until`; a `for_each` reads the payload
    /// only): else a dispatch need not gather them.
    pub fn reads_results(&self) -> bool {
        self.when.is_some() || self.input.is_some() || self.until.is_some()
    }
}

fn default_max_duration() -> Duration {
    Duration::from_secs(3600)
}

/// What the ticks missed while no supervisor ran get.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CatchUp {
    /// No order: only on-time ticks are ordered.
    None,
    /// One order, for the latest missed tick (the default: a missed nightly
    /// report runs once when the supervisors are back, not once per night).
    #[default]
    Last,
    /// One order per missed tick, the newest [`MAX_CATCH_UP`](crate::rules::schedule::MAX_CATCH_UP) at most.
    All,
}

impl CatchUp {
    /// The name in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Last => "last",
            Self::All => "all",
        }
    }
}

/// By name, refusing an unknown one with the names it could be (the
/// configuration's error then names the key).
impl<'de> Deserialize<'de> for CatchUp {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        [Self::None, Self::Last, Self::All]
            .into_iter()
            .find(|c| c.as_str() == name)
            .ok_or_else(|| {
                serde::de::Error::custom(format!("catch_up {name:?} is not none, last or all"))
            })
    }
}

/// `[schedules.<name>]` as written in the configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSpec {
    /// The workflow of every order.
    pub workflow: String,
    /// Five fields (`minute hour day-of-month month day-of-week`), or six
    /// with seconds first (an extension of sas).
    pub cron: String,
    /// The IANA zone whose wall clock `cron` reads (e.g. `Europe/Paris`);
    /// UTC when unset.
    #[serde(default)]
    pub timezone: Option<String>,
    /// Every order's payload.
    #[serde(default)]
    pub payload: serde_json::Map<String, serde_json::Value>,
    /// Every order's status queue.
    #[serde(default)]
    pub reply_to: Option<String>,
    /// What the ticks missed while no supervisor ran get.
    #[serde(default)]
    pub catch_up: CatchUp,
}

/// An optional list of human durations ([`durations`]).
/// The durations of [`some_durations`] as it reads them.
fn some_durations_out<S: serde::Serializer>(
    value: &Option<Vec<Duration>>,
    s: S,
) -> Result<S::Ok, S::Error> {
    let texts: Option<Vec<String>> = value.as_ref().map(|v| {
        v.iter()
            .map(|d| humantime::format_duration(*d).to_string())
            .collect()
    });
    texts.serialize(s)
}

fn some_durations<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<Duration>>, D::Error> {
    durations(d).map(Some)
}

/// A list of human durations, from TOML or from a comma-separated variable.
fn durations<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Duration>, D::Error> {
    let texts: Vec<String> = Vec::deserialize(d)?;
    texts
        .iter()
        .map(|t| {
            humantime::parse_duration(t.trim())
                .map_err(|e| serde::de::Error::custom(format!("{t:?}: {e}")))
        })
        .collect()
}

fn default_step_timeout() -> Duration {
    Duration::from_secs(30)
}

/// `[applications.<name>]` (contract §1b): who may submit, and where its
/// events may go.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplicationSpec {
    /// Its RabbitMQ user, checked through the AMQP `user_id` property
    /// (which RabbitMQ refuses when it is not the connection's user).
    #[serde(default)]
    pub user: Option<String>,
    /// Patterns of the queues it may name as `reply_to` (`*`: any run of
    /// characters).
    #[serde(default)]
    pub reply_to: Vec<String>,
    /// Bearer tokens of the submission's HTTP API (contract §9a), as
    /// `sha256:<hex>` of the token: a request bearing one is this
    /// application's.
    #[serde(default)]
    pub tokens: Vec<String>,
}

/// The step and item index of an item's name, `<step>:<index>` (a step's
/// own name has no ':'), for an item of a `for_each` step.
pub fn item_of(name: &str) -> Option<(&str, usize)> {
    let (base, index) = name.rsplit_once(':')?;
    Some((base, index.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> WorkflowSpec {
        serde_json::from_value(serde_json::json!({
            "version": "2026-11-27",
            "max_failures": 2,
            "retry_schedule": ["50ms", "1m 30s"],
            "steps": [
                { "name": "a", "agent": "x", "timeout": "2s", "compensate": "x-undo",
                  "retry": { "max_attempts": 3, "backoff": "10ms" } },
                { "name": "b", "agent": "y", "after": ["a"] },
            ],
        }))
        .expect("spec")
    }

    #[test]
    fn a_definition_reads_back_as_it_was_stored_under_the_same_id() {
        let definition = Definition {
            workflow: "w".into(),
            spec: spec(),
        };
        let stored = serde_json::to_value(&definition).expect("json");
        let read: Definition = serde_json::from_value(stored).expect("read back");
        assert_eq!(read, definition);
        assert_eq!(read.id(), definition.id());
        assert_eq!(read.label(), "2026-11-27");
    }

    #[test]
    fn any_change_makes_a_new_definition() {
        let base = Definition {
            workflow: "w".into(),
            spec: spec(),
        };
        let mut longer = base.clone();
        longer.spec.steps[1].timeout = Duration::from_secs(31);
        let mut renamed = base.clone();
        renamed.workflow = "v".into();
        let mut unlabelled = base.clone();
        unlabelled.spec.version = None;
        let ids = [&base, &longer, &renamed, &unlabelled].map(Definition::id);
        for (i, a) in ids.iter().enumerate() {
            assert!(!ids[i + 1..].contains(a), "{ids:?}");
        }
        // Without a label, operators see the id's first digits.
        assert_eq!(
            unlabelled.label(),
            unlabelled.id().simple().to_string()[..8]
        );
    }

    #[test]
    fn a_workflows_own_policy_overrides_the_supervisors() {
        let defaults = SupervisorSettings::default();
        let own = spec();
        let policy = own.failure_policy(&defaults);
        assert_eq!(policy.max_failures, 2);
        assert_eq!(
            policy.retry_schedule,
            [Duration::from_millis(50), Duration::from_secs(90)]
        );
        assert_eq!(policy.interval, defaults.interval);
        let plain = WorkflowSpec::default();
        assert!(matches!(
            plain.failure_policy(&defaults),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(own.step_retry("a").and_then(|r| r.max_attempts), Some(3));
        assert_eq!(own.step_retry("b"), None);
    }
}

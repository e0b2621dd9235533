//! `[schedules.<name>]`: recurring orders (contract §4b), each one order of
//! its workflow per tick of a cron expression, submitted by the leading
//! supervisor ([`crate::rules::schedule`]).

use super::{ConfigError, Settings};
use crate::rules::schedule::Schedule;
#[cfg(test)]
use crate::spec::CatchUp;

impl Settings {
    /// The compiled schedule of that name, its workflow checked, as of `now`
    /// (its expression must fire after it).
    pub fn schedule(
        &self,
        name: &str,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<Schedule, ConfigError> {
        let spec = self.schedules.get(name).ok_or_else(|| {
            ConfigError::Invalid(format!("schedules.{name} is not a configured schedule"))
        })?;
        let schedule = Schedule::compile(name, spec, now)?;
        if !self.workflows.contains_key(&spec.workflow) {
            return Err(crate::rules::schedule::ScheduleError::UnknownWorkflow {
                schedule: name.to_owned(),
                workflow: spec.workflow.clone(),
            }
            .into());
        }
        Ok(schedule)
    }

    /// Every configured schedule, compiled (see [`Settings::schedule`]).
    pub fn compiled_schedules(
        &self,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<Vec<Schedule>, ConfigError> {
        self.schedules
            .keys()
            .map(|name| self.schedule(name, now))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn load(schedule: &str, env: &[(&str, &str)]) -> Result<Settings, ConfigError> {
        let dir = std::env::temp_dir().join(format!("sas-config-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("sas.toml");
        std::fs::write(
            &path,
            format!(
                "[workflows.report]\nsteps = [ {{ name = \"a\", agent = \"a\" }} ]\n\n{schedule}"
            ),
        )
        .expect("write");
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let loaded = Settings::load_with(Some(&path), Some(env));
        std::fs::remove_dir_all(dir).ok();
        loaded
    }

    #[test]
    fn a_schedule_loads_from_the_file_and_the_environment_overrides_its_keys() {
        let s = load(
            "[schedules.nightly]\nworkflow = \"report\"\ncron = \"0 2 * * *\"\n\
             payload = { kind = \"nightly\" }\nreply_to = \"reports.status\"\n",
            &[("SAS__SCHEDULES__NIGHTLY__TIMEZONE", "Europe/Paris")],
        )
        .expect("loads");
        let nightly = s.schedule("nightly", chrono::Utc::now()).expect("compiles");
        assert_eq!(nightly.zone_name(), "Europe/Paris");
        assert_eq!(nightly.catch_up, CatchUp::Last, "the default");
        assert_eq!(nightly.payload["kind"], "nightly");
        assert_eq!(nightly.reply_to.as_deref(), Some("reports.status"));
    }

    #[test]
    fn an_unknown_workflow_or_catch_up_is_refused_naming_the_schedule() {
        let err = load(
            "[schedules.nightly]\nworkflow = \"nope\"\ncron = \"0 2 * * *\"\n",
            &[],
        )
        .expect_err("unknown workflow")
        .to_string();
        assert_eq!(
            err,
            "bad configuration: schedules.nightly.workflow \"nope\" is not a configured workflow"
        );
        let err = load(
            "[schedules.nightly]\nworkflow = \"report\"\ncron = \"0 2 * * *\"\ncatch_up = \"some\"\n",
            &[],
        )
        .expect_err("bad catch_up")
        .to_string();
        assert!(
            err.contains("\"some\" is not none, last or all")
                && err.contains("schedules.nightly.catch_up"),
            "{err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

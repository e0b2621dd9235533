//! The configuration file of a test or bench deployment. Every deployment
//! runs the same three workflows, so that tests and bench runs compare:
//! `one` runs agent `a`; `three` runs `a`, `b` and `c`, with `a` and `b`
//! undone by `a-undo` and `b-undo`; `diamond` runs `a`, then `b` and `c` at
//! once, then `d` (agent `a` again) after both: four steps whose longest
//! path is three; `fanout` runs `a` once per item of a list of ten, all at
//! once, then `b`: eleven calls whose longest path is two.

use std::fmt::Write as _;

/// The fan-out of `fanout`'s first step (contract §4d): ten items, all at
/// once; a constant list, so that any payload fans out.
const FAN_OUT: &str = r#", for_each = "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]", max_concurrency = 10"#;

/// The agents the workflows call.
pub const WORKFLOW_AGENTS: [&str; 5] = ["a", "b", "c", "a-undo", "b-undo"];

/// What differs between deployments; every key not written here has its
/// default.
#[derive(Debug, Clone)]
pub struct ConfigFile<'a> {
    pub database_url: &'a str,
    /// `database.max_connections`, when not the default.
    pub max_connections: Option<u32>,
    pub broker_url: &'a str,
    /// `broker.step_queues`: `classic` or `quorum`.
    pub step_queues: &'a str,
    /// `broker.prefix`: keeps the deployment's queues apart from others'.
    pub prefix: &'a str,
    /// Where the agents are called: agent `x` at `{agents_url}/x`.
    pub agents_url: &'a str,
    /// The agents configured (at least [`WORKFLOW_AGENTS`]).
    pub agents: &'a [&'a str],
    /// The complete-by of every step.
    pub step_timeout: &'a str,
    pub supervisor_interval: &'a str,
    pub max_failures: u32,
    /// `supervisor.retry_schedule`, as a TOML array.
    pub retry_schedule: &'a str,
    /// `supervisor.warn_at`, as a TOML array (the deadline ladder).
    pub warn_at: &'a str,
    /// Further TOML, appended as it is: sections the keys above do not
    /// write.
    pub extra: &'a str,
}

impl ConfigFile<'_> {
    /// The file's text.
    pub fn to_toml(&self) -> String {
        let step = |name: &str, undo: bool| self.step(name, name, undo, "");
        let max_connections = self
            .max_connections
            .map(|n| format!("max_connections = {n}\n"))
            .unwrap_or_default();
        let mut agents = String::new();
        for a in self.agents {
            // Writing to a String cannot fail.
            let _ = write!(
                agents,
                "[agents.{a}]\nurl = \"{}/{a}\"\n\n",
                self.agents_url
            );
        }
        format!(
            r#"# Written by sas-testkit; every key not here has its default.
[database]
url = "{database_url}"
{max_connections}
[broker]
url = "{broker_url}"
prefix = "{prefix}"
step_queues = "{step_queues}"

[supervisor]
interval = "{interval}"
max_failures = {max_failures}
retry_schedule = {retry_schedule}
warn_at = {warn_at}

[workflows.one]
steps = [ {solo} ]

[workflows.three]
steps = [ {a}, {b}, {c} ]

[workflows.diamond]
steps = [ {a}, {db}, {dc}, {dd} ]

[workflows.fanout]
steps = [ {fa}, {fb} ]

{agents}{extra}
"#,
            database_url = self.database_url,
            broker_url = self.broker_url,
            step_queues = self.step_queues,
            prefix = self.prefix,
            interval = self.supervisor_interval,
            max_failures = self.max_failures,
            retry_schedule = self.retry_schedule,
            warn_at = self.warn_at,
            solo = step("a", false),
            a = step("a", true),
            b = step("b", true),
            c = step("c", false),
            db = self.step("b", "b", true, r#", after = ["a"]"#),
            dc = self.step("c", "c", false, r#", after = ["a"]"#),
            dd = self.step("d", "a", false, r#", after = ["b", "c"]"#),
            fa = self.step("a", "a", true, FAN_OUT),
            fb = self.step("b", "b", false, ""),
            extra = self.extra,
        )
    }

    /// A step `name` calling `agent`, undone by `{agent}-undo` when `undo`,
    /// with `more` (TOML: `, key = value`) at its end.
    fn step(&self, name: &str, agent: &str, undo: bool, more: &str) -> String {
        let undo = if undo {
            format!(", compensate = \"{agent}-undo\"")
        } else {
            String::new()
        };
        format!(
            "{{ name = \"{name}\", agent = \"{agent}\", timeout = \"{}\"{undo}{more} }}",
            self.step_timeout
        )
    }

    /// Writes the file to `path`.
    pub fn write(&self, path: &std::path::Path) -> anyhow::Result<()> {
        use anyhow::Context as _;
        std::fs::write(path, self.to_toml()).with_context(|| format!("writing {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_loads_as_sas_settings_with_every_workflow() {
        let file = ConfigFile {
            database_url: "postgres://postgres@127.0.0.1:5432/x",
            max_connections: Some(8),
            broker_url: "amqp://guest:guest@127.0.0.1:5672/%2f",
            step_queues: "classic",
            prefix: "tx",
            agents_url: "http://127.0.0.1:1/svc",
            agents: &WORKFLOW_AGENTS,
            step_timeout: "5s",
            supervisor_interval: "200ms",
            max_failures: 3,
            retry_schedule: r#"["100ms"]"#,
            warn_at: "[0.5, 0.8]",
            extra: "[outbox]\nsweep_age = \"1s\"\n",
        };
        let dir = std::env::temp_dir().join(format!("sas-testkit-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("sas.toml");
        file.write(&path).unwrap();
        let settings = sas::config::Settings::load(Some(&path));
        std::fs::remove_dir_all(&dir).ok();
        let settings = settings.expect("the written file loads");
        assert_eq!(settings.database.max_connections, 8);
        assert_eq!(settings.broker.prefix, "tx");
        assert!(settings.workflow("one").is_ok());
        assert!(settings.workflow("three").is_ok());
        assert!(settings.workflow("diamond").is_ok());
        let fanout = settings.workflow("fanout").expect("fanout");
        assert_eq!(fanout.plan(&serde_json::json!({})).len(), 11);
    }
}

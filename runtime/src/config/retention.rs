//! `[retention]` (contract §10): how long ended orders are kept, and where
//! the deleted ones are archived. The leading supervisor applies it every
//! `interval`; `sasctl orders prune` applies it by hand
//! ([`crate::state_store::retention`]).

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use super::ConfigError;

/// The largest `retention.batch` accepted: a batch is one transaction, and
/// its archive lines are held in memory until they are written.
pub const MAX_BATCH: u32 = 100_000;

/// `[retention]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetentionSettings {
    /// Ended orders (`processed`, `compensated`) last changed longer ago
    /// than this are deleted with their steps, events and outbox rows.
    /// `None` (written `"off"`): the supervisor deletes nothing, and
    /// `sasctl orders prune` needs `--older-than`. Never zero.
    #[serde(deserialize_with = "ended_after")]
    pub ended_after: Option<Duration>,
    /// Orders deleted per transaction.
    pub batch: u32,
    /// Time between the leading supervisor's runs (each deletes batch after
    /// batch until nothing is left); the first runs as soon as it leads.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// A directory: each deleted order is first appended, with its steps and
    /// events, as one JSON line to `orders-<YYYY-MM-DD>.jsonl` in it (the
    /// state store's date, UTC), flushed to disk before its batch commits.
    /// It must exist. None: nothing is archived.
    pub archive: Option<PathBuf>,
}

impl Default for RetentionSettings {
    fn default() -> Self {
        Self {
            ended_after: Some(Duration::from_secs(30 * 24 * 3600)),
            batch: 1000,
            interval: Duration::from_secs(3600),
            archive: None,
        }
    }
}

impl RetentionSettings {
    /// Refuses values that cannot be meant: a zero age (which would delete
    /// every order the moment it ends; `"off"` disables retention), an empty
    /// or oversized batch, a zero interval, an empty archive path.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if self.ended_after.is_some_and(|d| d.is_zero()) {
            return invalid(
                "retention.ended_after must be more than 0 (\"off\" disables retention)".into(),
            );
        }
        if self.batch == 0 || self.batch > MAX_BATCH {
            return invalid(format!(
                "retention.batch must be between 1 and {MAX_BATCH}, got {}",
                self.batch
            ));
        }
        if self.interval.is_zero() {
            return invalid("retention.interval must be more than 0".into());
        }
        if self
            .archive
            .as_ref()
            .is_some_and(|p| p.as_os_str().is_empty())
        {
            return invalid("retention.archive is empty: name a directory, or leave it out".into());
        }
        Ok(())
    }
}

/// `retention.ended_after`: `"off"`, or a human duration such as `"30d"`.
fn ended_after<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let text = String::deserialize(d)?;
    parse_ended_after(&text).map_err(serde::de::Error::custom)
}

/// `"off"` (any case) is `None`; anything else must be a human duration.
pub fn parse_ended_after(text: &str) -> Result<Option<Duration>, String> {
    let text = text.trim();
    if text.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    humantime::parse_duration(text)
        .map(Some)
        .map_err(|e| format!("{text:?} is neither \"off\" nor a duration such as \"30d\": {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    fn load(pairs: &[(&str, &str)]) -> Result<Settings, ConfigError> {
        let env = pairs
            .iter()
            .map(|(k, v)| (format!("SAS__RETENTION__{k}"), (*v).to_owned()))
            .collect();
        Settings::load_with(None, Some(env))
    }

    #[test]
    fn retention_keeps_thirty_days_in_batches_of_a_thousand_hourly_without_archive() {
        let r = load(&[]).expect("defaults").retention;
        assert_eq!(r.ended_after, Some(Duration::from_secs(30 * 86_400)));
        assert_eq!(r.batch, 1000);
        assert_eq!(r.interval, Duration::from_secs(3600));
        assert_eq!(r.archive, None);
        assert_eq!(r, RetentionSettings::default());
    }

    #[test]
    fn retention_settings_are_read_from_the_environment() {
        let r = load(&[
            ("ENDED_AFTER", "7d"),
            ("BATCH", "50"),
            ("INTERVAL", "10m"),
            ("ARCHIVE", "/var/lib/sas/archive"),
        ])
        .expect("set")
        .retention;
        assert_eq!(r.ended_after, Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(r.batch, 50);
        assert_eq!(r.interval, Duration::from_secs(600));
        assert_eq!(r.archive, Some(PathBuf::from("/var/lib/sas/archive")));
    }

    #[test]
    fn off_disables_retention_and_zero_is_refused() {
        for off in ["off", "OFF", " off "] {
            let r = load(&[("ENDED_AFTER", off)]).expect(off).retention;
            assert_eq!(r.ended_after, None, "{off:?}");
        }
        for (pairs, says) in [
            (("ENDED_AFTER", "0s"), "\"off\" disables retention"),
            (("ENDED_AFTER", "never"), "neither \"off\" nor a duration"),
            (
                ("BATCH", "0"),
                "retention.batch must be between 1 and 100000",
            ),
            (("BATCH", "100001"), "retention.batch"),
            (("INTERVAL", "0s"), "retention.interval"),
            (("ARCHIVE", ""), "retention.archive is empty"),
        ] {
            let err = load(&[pairs]).expect_err(says).to_string();
            assert!(err.contains(says), "{pairs:?}: {err}");
            assert_eq!(err.lines().count(), 1, "{err}");
        }
    }

    #[test]
    fn a_file_sets_the_retention_section() {
        let dir = std::env::temp_dir().join(format!("sas-retention-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("sas.toml");
        std::fs::write(
            &path,
            "[retention]\nended_after = \"90d\"\nbatch = 500\narchive = \"/srv/archive\"\n",
        )
        .unwrap();
        let r = Settings::load(Some(&path)).expect("loads").retention;
        assert_eq!(r.ended_after, Some(Duration::from_secs(90 * 86_400)));
        assert_eq!(r.batch, 500);
        assert_eq!(r.interval, Duration::from_secs(3600));
        assert_eq!(r.archive, Some(PathBuf::from("/srv/archive")));
        std::fs::write(&path, "[retention]\nkeep = \"1d\"\n").unwrap();
        let err = Settings::load(Some(&path)).unwrap_err().to_string();
        assert!(err.contains("keep"), "{err}");
        std::fs::remove_dir_all(dir).ok();
    }
}

//! The standard process metrics (`process_cpu_seconds_total`,
//! `process_resident_memory_bytes`, `process_virtual_memory_bytes`,
//! `process_open_fds`, `process_start_time_seconds`), read from `/proc` at
//! each scrape. Where there is no `/proc` (not Linux) there are none.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// `/proc`'s clock ticks per second (`USER_HZ`, fixed at 100 by the ABI).
const TICKS_PER_SECOND: f64 = 100.0;

/// What one scrape read of this process.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub cpu_seconds: f64,
    pub resident_bytes: i64,
    pub virtual_bytes: i64,
    pub start_time_seconds: f64,
    pub open_fds: Option<i64>,
}

/// Reads `/proc/self/stat`, `/proc/self/status`, `/proc/stat` and
/// `/proc/self/fd`; `None` when they cannot be read or parsed.
pub fn sample() -> Option<Sample> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let system = std::fs::read_to_string("/proc/stat").ok()?;
    let open_fds = std::fs::read_dir("/proc/self/fd")
        .ok()
        .map(|d| i64::try_from(d.count()).unwrap_or(i64::MAX));
    parse(&stat, &status, &system, open_fds)
}

/// The sample from the text of those files.
pub fn parse(stat: &str, status: &str, system: &str, open_fds: Option<i64>) -> Option<Sample> {
    // The command name (field 2) is in parentheses and may hold spaces:
    // the fields that follow come after its last ')'.
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields 3.. of proc(5), so field n is fields[n - 3].
    let field = |n: usize| fields.get(n - 3)?.parse::<f64>().ok();
    let cpu_ticks = field(14)? + field(15)?;
    let started_ticks = field(22)?;
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))?
            .split_whitespace()
            .next()?
            .parse::<i64>()
            .ok()
            .map(|k| k.saturating_mul(1024))
    };
    let boot = system
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse::<f64>()
        .ok()?;
    Some(Sample {
        cpu_seconds: cpu_ticks / TICKS_PER_SECOND,
        resident_bytes: kib("VmRSS:")?,
        virtual_bytes: kib("VmSize:")?,
        start_time_seconds: boot + started_ticks / TICKS_PER_SECOND,
        open_fds,
    })
}

/// Encodes a fresh [`Sample`] at each scrape.
#[derive(Debug, Default)]
pub struct Process;

impl Collector for Process {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(s) = sample() else { return Ok(()) };
        let cpu = ConstCounter::new(s.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "User and system CPU time spent, in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let gauges = [
            (
                "process_resident_memory_bytes",
                "Resident memory size, in bytes",
                s.resident_bytes as f64,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size, in bytes",
                s.virtual_bytes as f64,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since the Unix epoch, in seconds",
                s.start_time_seconds,
            ),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        if let Some(fds) = s.open_fds {
            let gauge = ConstGauge::new(fds);
            gauge.encode(encoder.encode_descriptor(
                "process_open_fds",
                "Open file descriptors",
                None,
                gauge.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_name_with_spaces_and_parentheses_is_skipped_whole() {
        let stat = "4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 500 0 0 0 \
                    250 50 0 0 20 0 4 0 12345 10000000 2000 18446744073709551615";
        let status = "Name:\tx\nVmSize:\t  20480 kB\nVmRSS:\t   8192 kB\n";
        let system = "cpu  1 2 3\nbtime 1700000000\nprocesses 9\n";
        let s = parse(stat, status, system, Some(7)).expect("parsed");
        assert_eq!(s.cpu_seconds, 3.0);
        assert_eq!(s.resident_bytes, 8192 * 1024);
        assert_eq!(s.virtual_bytes, 20480 * 1024);
        assert_eq!(s.start_time_seconds, 1_700_000_000.0 + 123.45);
        assert_eq!(s.open_fds, Some(7));
        assert_eq!(parse("garbage", status, system, None), None);
        assert_eq!(parse(stat, "", system, None), None);
    }

    #[test]
    fn this_process_can_be_read_on_linux() {
        if std::path::Path::new("/proc/self/stat").exists() {
            let s = sample().expect("a sample of this process");
            assert!(s.resident_bytes > 0 && s.open_fds.is_some_and(|n| n > 0));
        }
    }
}

//! `sasctl alerts`: prints the operator alerts of `<prefix>.alerts` (contract
//! §5) as JSON lines, acknowledging each once printed.

use std::time::Duration;

use clap::value_parser;
use sas::config::Settings;
use sas::topology::QueueNames;

use crate::watch::{self, Filter, Missing, Reading};

/// How long `sasctl alerts` waits for another alert without `--follow`: the
/// queue counts as empty when nothing arrived for this long.
const DRAINED_AFTER: Duration = Duration::from_secs(1);

/// Options of `sasctl alerts`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Keep waiting for new alerts (until --timeout or Ctrl-C) instead of
    /// stopping once the queue is empty.
    #[arg(long)]
    follow: bool,
    /// Stop when no alert arrived for this long (e.g. "10m") [default: 1s,
    /// the queue is then empty; with --follow: wait until Ctrl-C].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    timeout: Option<Duration>,
    /// Stop after this many alerts.
    #[arg(long, value_name = "N", value_parser = value_parser!(u64).range(1..))]
    count: Option<u64>,
    /// Accepted for scripts that pass --json everywhere: the output is always JSON lines.
    #[arg(long)]
    json: bool,
}

impl Args {
    /// How long to wait for the next alert; `None`: for ever.
    fn idle(&self) -> Option<Duration> {
        match (self.timeout, self.follow) {
            (Some(t), _) => Some(t),
            (None, false) => Some(DRAINED_AFTER),
            (None, true) => None,
        }
    }
}

/// Runs `sasctl alerts`.
pub async fn run(args: Args, settings: &Settings) -> anyhow::Result<()> {
    let queues = QueueNames::new(&settings.broker.prefix);
    // The alert queue is a quorum queue the services declare: declaring it
    // here with other arguments would fail, and a missing one is news.
    let hint = format!(
        "the sas services declare it at start-up; is broker.prefix {:?} right?",
        queues.prefix()
    );
    watch::print_queue(
        settings,
        &Reading {
            queue: queues.alerts(),
            missing: Missing::Fail { hint },
            count: args.count,
            idle: args.idle(),
            filter: Filter::default(),
            until_terminal: false,
            noun: ("alert", "alerts"),
        },
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn without_follow_it_stops_once_the_queue_is_drained() {
        assert_eq!(parse(&[]).unwrap().idle(), Some(DRAINED_AFTER));
        assert_eq!(
            parse(&["--timeout", "5s"]).unwrap().idle(),
            Some(Duration::from_secs(5))
        );
    }

    #[test]
    fn with_follow_it_waits_until_the_timeout_or_for_ever() {
        assert_eq!(parse(&["--follow"]).unwrap().idle(), None);
        let args = parse(&["--follow", "--timeout", "1m", "--count", "2"]).unwrap();
        assert_eq!(args.idle(), Some(Duration::from_secs(60)));
        assert_eq!(args.count, Some(2));
        assert!(parse(&["--count", "0"]).is_err());
        assert!(parse(&["--timeout", "soon"]).is_err());
    }
}

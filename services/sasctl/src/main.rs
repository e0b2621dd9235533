//! `sasctl`: the operator's command line for a sas deployment. Submits orders
//! as an application would (also from a JSON-lines file), watches queues and
//! the alert queue, lists orders, shows one with its steps and event log,
//! retries, cancels, redrives and prunes orders, lists and overrides the agents'
//! shared breakers, lists the recurring orders' schedules, lists, replays
//! and purges the orders'
//! dead letters, asks for a replay of status events, shows statistics, applies the state store's migrations, and
//! runs soak tests (`chaos`). The data commands take `--json` for scripts.
//!
//! Exit codes: 0 success, 1 failure, 2 bad usage or configuration, 3 unknown
//! order, 4 action not allowed in the order's state ([`EXIT_CODES`]).
//! Command output goes to stdout, logs and summaries to stderr.

mod agents;
mod alerts;
mod chaos;
mod dead_letters;
mod events;
mod migrate;
mod orders;
mod schedules;
mod stats;
mod submit;
mod terminal;
mod watch;

use std::fmt;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use sas::config::{LogSettings, Settings};
use sas::service::CommonArgs;

/// The exit codes, as `--help` shows them.
const EXIT_CODES: &str = "\
Exit codes:
  0  ok
  1  failure (e.g. RabbitMQ or Postgres unreachable within its connect_timeout)
  2  bad usage or configuration (also: a --file that cannot be opened, a purge without --yes,
     a redrive's --patch that cannot be read or gives a payload no order may carry)
  3  unknown order
  4  action not allowed in the order's state (e.g. retrying an order that is not in error)";

/// The sas operator CLI. Configuration keys are the services' own
/// (`SAS__BROKER__PREFIX`, `SAS__DATABASE__URL`, ...).
#[derive(Debug, Parser)]
#[command(name = "sasctl", version, about, after_help = EXIT_CODES)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Publish orders to `<prefix>.orders`, as an application would, or the
    /// lines of a JSON-lines file (--file), with a progress bar and a summary.
    Submit(submit::Args),
    /// Print the messages of a queue as JSON lines, acknowledging each.
    ///
    /// With --order-id or --state, only the matching messages are printed:
    /// the others are consumed (acknowledged) all the same, so they are gone
    /// from the queue. Non-JSON messages match no filter.
    Watch(watch::Args),
    /// Print the operator alerts of `<prefix>.alerts` as JSON lines, acknowledging each.
    Alerts(alerts::Args),
    /// List, show, retry, cancel, redrive and prune orders in the state store (Postgres only).
    #[command(subcommand)]
    Orders(orders::Command),
    /// List the agents' shared breakers with their held orders, force one
    /// open or closed, release it, show their history (Postgres only).
    #[command(subcommand)]
    Agents(agents::Command),
    /// List the recurring orders' schedules with their next tick and last
    /// order (configuration and Postgres).
    #[command(subcommand)]
    Schedules(schedules::Command),
    /// List, replay or purge the messages of `<prefix>.orders.dead`, the orders
    /// the submission service could not accept (RabbitMQ only).
    #[command(subcommand)]
    DeadLetters(dead_letters::Command),
    /// Ask sas to publish stored status events again (`<prefix>.replay`,
    /// contract §9), e.g. for an application that lost its status queue
    /// (RabbitMQ only).
    #[command(subcommand)]
    Events(events::Command),
    /// Orders per state, orders received and ended per second, the oldest
    /// pending order, orders waiting for a re-attempt, the outbox backlog
    /// (Postgres only).
    Stats(stats::Args),
    /// Apply the state store's migrations (creating the database when missing).
    Migrate(migrate::Args),
    /// Soak run: submit orders under remote faults and service kills, then
    /// report orders per terminal state, lost orders and duplicate effects.
    Chaos(chaos::Args),
    /// Print a shell completion script, e.g.
    /// `sasctl completions bash > /etc/bash_completion.d/sasctl`.
    Completions {
        /// bash, elvish, fish, powershell or zsh.
        shell: clap_complete::Shell,
    },
    /// Print sasctl's manual page (roff), e.g. `sasctl man | man -l -`.
    Man,
}

/// A failure that has its own exit code.
#[derive(Debug)]
pub struct Exit {
    pub code: u8,
    pub message: String,
}

impl Exit {
    /// Exit code for bad usage, e.g. a purge without `--yes`.
    pub const USAGE: u8 = 2;
    /// Exit code for an order id the state store does not know.
    pub const NOT_FOUND: u8 = 3;
    /// Exit code for an action the order's state does not allow.
    pub const NOT_ALLOWED: u8 = 4;
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Exit {}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // Neither needs a configuration.
    match cli.command {
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "sasctl", &mut std::io::stdout());
            return ExitCode::SUCCESS;
        }
        Command::Man => return man(),
        _ => {}
    }
    if let Err((name, message)) = cli.command.check() {
        let mut command = Cli::command();
        command.build();
        let error = match command.find_subcommand_mut(name) {
            Some(sub) => sub.error(clap::error::ErrorKind::ArgumentConflict, message),
            None => command.error(clap::error::ErrorKind::ArgumentConflict, message),
        };
        error.exit();
    }
    // Before anything builds a TLS client (reqwest needs it).
    sas::tls::install_crypto_provider();
    let settings = match Settings::load(cli.common.config.as_deref()) {
        Ok(settings) => settings,
        Err(e) => {
            // No settings to know the secrets by: mask any URL's password.
            let error = sas::tls::redact(&e.to_string(), []);
            eprintln!("sasctl: {}", one_line(&error));
            return ExitCode::from(2);
        }
    };
    sas::telemetry::init(&quiet_libraries(&settings.log));
    // Printed errors must not show a password the configuration holds.
    let redactor = settings.clone();
    let outcome = match cli.command {
        Command::Submit(args) => submit::run(args, &settings).await,
        Command::Watch(args) => watch::run(args, &settings).await,
        Command::Alerts(args) => alerts::run(args, &settings).await,
        Command::Orders(command) => orders::run(command, &settings).await,
        Command::Agents(command) => agents::run(command, &settings).await,
        Command::Schedules(command) => schedules::run(command, &settings).await,
        Command::DeadLetters(command) => dead_letters::run(command, &settings).await,
        Command::Events(command) => events::run(command, &settings).await,
        Command::Stats(args) => stats::run(args, &settings).await,
        Command::Migrate(args) => migrate::run(args, &settings).await,
        Command::Chaos(args) => chaos::run(args, &settings, cli.common.config.as_deref()).await,
        Command::Completions { .. } | Command::Man => Ok(()),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let code = e.downcast_ref::<Exit>().map_or(1, |exit| exit.code);
            eprintln!("sasctl: {}", one_line(&redactor.redact(&chain(&e))));
            ExitCode::from(code)
        }
    }
}

/// Prints the manual page (with its subcommands' section).
fn man() -> ExitCode {
    let mut out = Vec::new();
    let rendered = clap_mangen::Man::new(Cli::command())
        .render(&mut out)
        .and_then(|()| std::io::Write::write_all(&mut std::io::stdout(), &out));
    if let Err(e) = rendered {
        eprintln!("sasctl: cannot print the manual page: {e}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

impl Command {
    /// Checks between arguments that clap cannot express; on failure the
    /// subcommand's name and the message.
    fn check(&self) -> Result<(), (&'static str, String)> {
        match self {
            Command::Submit(args) => args.check().map_err(|m| ("submit", m)),
            Command::Chaos(args) => args.check().map_err(|m| ("chaos", m)),
            _ => Ok(()),
        }
    }
}

/// The log settings with lapin's and sqlx's chatter turned down, unless the
/// filter names them: sasctl reports their errors itself (a returned message,
/// a closed channel), and a migration's notices are no news to an operator.
/// The same goes for the connection retries of the state store and the
/// broker: a dependency still unreachable after its `connect_timeout` is one
/// line, the error (`RUST_LOG=sas_store=debug,sas_broker=debug,sas_runtime=debug`
/// shows the attempts).
fn quiet_libraries(log: &LogSettings) -> LogSettings {
    let mut log = log.clone();
    for (target, level) in [
        ("lapin", "off"),
        ("sqlx", "warn"),
        ("sas_runtime::sessions", "error"),
        ("sas_broker", "error"),
        ("sas_store", "error"),
        ("sas_client", "error"),
    ] {
        if !names(&log.level, target) {
            log.level = format!("{},{target}={level}", log.level);
        }
    }
    log
}

/// Whether a filter has a directive for `target`, one of its modules or one
/// of its parents (`sas_runtime=debug` names `sas_runtime::sessions`).
fn names(filter: &str, target: &str) -> bool {
    filter
        .split(',')
        .filter_map(|directive| directive.split_once('=').map(|(t, _)| t.trim()))
        .any(|t| {
            t == target
                || target
                    .strip_prefix(t)
                    .is_some_and(|rest| rest.starts_with("::"))
                || t.strip_prefix(target)
                    .is_some_and(|rest| rest.starts_with("::"))
        })
}

/// An error with its causes, `: ` between them, skipping a cause whose text
/// is already part of what precedes it (errors that also print their source).
fn chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// An error message on one line, whatever its sources put in it.
fn one_line(text: &str) -> String {
    terminal::cell(&text.split_whitespace().collect::<Vec<_>>().join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("sasctl").chain(args.iter().copied()))
    }

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn global_config_and_commands_parse() {
        let cli = parse(&["--config", "sas.toml", "migrate"]).unwrap();
        assert_eq!(
            cli.common.config.as_deref(),
            Some(std::path::Path::new("sas.toml"))
        );
        assert!(matches!(cli.command, Command::Migrate(_)));
        let cli = parse(&["orders", "show", "67e55044-10b1-426f-9247-bb680e5fe0c8"]).unwrap();
        assert!(matches!(cli.command, Command::Orders(_)));
        assert!(parse(&[]).is_err());
        assert!(parse(&["frobnicate"]).is_err());
    }

    #[test]
    fn usage_errors_exit_with_2() {
        let e = parse(&["orders", "show", "not-a-uuid"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        let e = parse(&["submit", "--workflow", "w", "--payload", "{"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
    }

    #[test]
    fn an_order_id_needs_a_count_of_one() {
        let id = "67e55044-10b1-426f-9247-bb680e5fe0c8";
        let cli = parse(&[
            "submit",
            "--workflow",
            "w",
            "--order-id",
            id,
            "--count",
            "2",
        ])
        .unwrap();
        assert!(cli.command.check().is_err());
        let cli = parse(&["submit", "--workflow", "w", "--order-id", id]).unwrap();
        assert!(cli.command.check().is_ok());
    }

    #[test]
    fn library_chatter_is_turned_down_unless_asked_for() {
        let mut log = LogSettings::default();
        assert_eq!(
            quiet_libraries(&log).level,
            "info,lapin=off,sqlx=warn,sas_runtime::sessions=error,sas_broker=error,sas_store=error,\
             sas_client=error"
        );
        log.level = "debug,lapin=debug,sas=trace".into();
        assert_eq!(
            quiet_libraries(&log).level,
            "debug,lapin=debug,sas=trace,sqlx=warn,sas_runtime::sessions=error,sas_broker=error,\
             sas_store=error,sas_client=error"
        );
        log.level = "info,sas_runtime::sessions=debug,sas_store=info,sqlx::query=info".into();
        assert_eq!(
            quiet_libraries(&log).level,
            "info,sas_runtime::sessions=debug,sas_store=info,sqlx::query=info,lapin=off,sas_broker=error,\
             sas_client=error"
        );
    }

    #[test]
    fn the_operator_commands_parse() {
        let id = "67e55044-10b1-426f-9247-bb680e5fe0c8";
        for args in [
            &["orders", "list"][..],
            &[
                "orders",
                "list",
                "--state",
                "error",
                "--workflow",
                "w",
                "--limit",
                "5",
                "--json",
            ],
            &["orders", "retry", id],
            &["orders", "cancel", id, "--json"],
            &["orders", "redrive", id],
            &["orders", "redrive", id, "--patch", "fix.json", "--json"],
            &["orders", "redrive", id, "--patch", "-"],
            &["orders", "prune", "--older-than", "30days", "--json"],
            &["orders", "prune"],
            &[
                "orders",
                "prune",
                "--older-than",
                "12h",
                "--batch",
                "100",
                "--archive",
                "/srv/archive",
            ],
            &["alerts"],
            &[
                "alerts",
                "--follow",
                "--timeout",
                "10m",
                "--count",
                "3",
                "--json",
            ],
            &["dead-letters", "list", "--limit", "5", "--json"],
            &["dead-letters", "replay"],
            &["dead-letters", "replay", "--limit", "1", "--json"],
            &["dead-letters", "purge", "--yes", "--json"],
            &["stats"],
            &["stats", "--window", "1h", "--json"],
            &["schedules", "list"],
            &["schedules", "list", "--json"],
            &["migrate", "--json"],
            &[
                "submit",
                "--file",
                "orders.jsonl",
                "--reply-to",
                "q",
                "--json",
            ],
            &["submit", "--file", "-"],
            &["submit", "--workflow", "w", "--count", "3", "--json"],
            &[
                "watch",
                "q",
                "--order-id",
                id,
                "--order-id",
                "x",
                "--state",
                "processed",
                "--state",
                "failed",
                "--until-terminal",
                "--json",
            ],
        ] {
            assert!(parse(args).is_ok(), "{args:?}");
        }
        for (args, says) in [
            (
                &["orders", "list", "--state", "broken"][..],
                "valid states: pending, processing",
            ),
            (&["orders", "list", "--limit", "0"], "--limit"),
            (&["orders", "retry", "not-a-uuid"], "ID"),
            (&["orders", "cancel"], "ID"),
            (&["orders", "redrive", "--patch", "f.json"], "ID"),
            (&["orders", "prune", "--batch", "0"], "--batch"),
            (&["orders", "prune", "--batch", "100001"], "--batch"),
            (
                &["orders", "prune", "--older-than", "a while"],
                "--older-than",
            ),
            (
                &["submit", "--file", "f", "--workflow", "w"][..],
                "--workflow",
            ),
            (&["submit", "--file", "f", "--count", "2"], "--count"),
            (&["submit", "--file", "f", "--raw", "x"], "--raw"),
            (&["watch", "q", "--until-terminal"], "--order-id"),
            (
                &["watch", "q", "--state", "done"],
                "valid states: received, rejected, processing",
            ),
            (&["dead-letters"], "Usage"),
            (&["stats", "--window", "10ms"], "at least 1s"),
        ] {
            let e = parse(args).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{args:?}");
            assert!(e.to_string().contains(says), "{args:?}: {e}");
        }
    }

    #[test]
    fn the_help_documents_the_exit_codes() {
        let help = Cli::command().render_long_help().to_string();
        for line in [
            "0  ok",
            "1  failure",
            "2  bad usage or configuration",
            "3  unknown order",
            "4  action not allowed in the order's state",
        ] {
            assert!(help.contains(line), "{help}");
        }
        assert_eq!(Exit::NOT_FOUND, 3);
        assert_eq!(Exit::NOT_ALLOWED, 4);
    }

    #[test]
    fn causes_already_in_the_message_are_not_repeated() {
        #[derive(Debug)]
        struct Inner;
        impl fmt::Display for Inner {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("refused")
            }
        }
        impl std::error::Error for Inner {}
        #[derive(Debug)]
        struct Outer(Inner);
        impl fmt::Display for Outer {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "broker error: {}", self.0)
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = anyhow::Error::new(Outer(Inner)).context("connecting");
        assert_eq!(chain(&e), "connecting: broker error: refused");
        let e = anyhow::anyhow!("no order").context("showing");
        assert_eq!(chain(&e), "showing: no order");
    }

    #[test]
    fn errors_are_reported_on_one_line() {
        assert_eq!(one_line("a:\n  b\tc "), "a: b c");
    }
}

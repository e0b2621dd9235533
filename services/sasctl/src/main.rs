//! `sasctl`: the operator's command line for a sas deployment. Submits orders
//! as an application would (also from a JSON-lines file), watches queues and
//! the alert queue, lists orders, shows one with its steps and event log,
//! retries, cancels, redrives and prunes orders, lists and overrides the agents'
//! shared breakers, lists the recurring orders' schedules, lists, replays
//! and purges the orders'
//! dead letters, asks for a replay of status events, shows statistics and
//! applies the state store's migrations.
//! The soak run is a binary of its own, `sas-chaos`. The data commands take
//! `--json` for scripts.
//!
//! Exit codes: 0 success, 1 failure, 2 bad usage or configuration, 3 unknown
//! order, 4 action not allowed in the order's state ([`EXIT_CODES`]).
//! Command output goes to stdout, logs and summaries to stderr.

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use sas::service::CommonArgs;
use sasctl::{
    agents, alerts, dead_letters, events, migrate, orders, run_command, schedules, stats, submit,
    watch,
};

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
    /// Print a shell completion script, e.g.
    /// `sasctl completions bash > /etc/bash_completion.d/sasctl`.
    Completions {
        /// bash, elvish, fish, powershell or zsh.
        shell: clap_complete::Shell,
    },
    /// Print sasctl's manual page (roff), e.g. `sasctl man | man -l -`.
    Man,
}

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
    let config = cli.common.config;
    run_command("sasctl", config.as_deref(), async |settings| {
        match cli.command {
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
            Command::Completions { .. } | Command::Man => Ok(()),
        }
    })
    .await
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
            _ => Ok(()),
        }
    }
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
        assert_eq!(sasctl::Exit::NOT_FOUND, 3);
        assert_eq!(sasctl::Exit::NOT_ALLOWED, 4);
    }
}

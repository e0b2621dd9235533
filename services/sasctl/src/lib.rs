//! The operator's commands for a sas deployment, behind two binaries:
//! `sasctl` (submit, watch, alerts, orders, agents, schedules, dead letters,
//! events, stats, migrate) and `sas-chaos`, the soak run, which submits and
//! reads with these commands' code ([`submit`], [`watch`]). Each command is a
//! module with its `Args` and a `run` over the deployment's [`Settings`];
//! [`run_command`] is what both binaries do around one.
//!
//! Modules beside the commands named above: [`dead_letters`] (`sasctl
//! dead-letters`), [`terminal`] (text from strangers made safe to print).

pub mod agents;
pub mod alerts;
pub mod dead_letters;
pub mod events;
pub mod migrate;
pub mod orders;
pub mod schedules;
pub mod stats;
pub mod submit;
pub mod terminal;
pub mod watch;

use std::fmt;
use std::future::Future;
use std::path::Path;
use std::process::ExitCode;

use sas::config::{LogSettings, Settings};

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

/// Runs one command as the binary `name`: loads the configuration (from
/// `config` and `SAS__*`; a bad one exits with 2), starts logging with the
/// libraries' chatter turned down, runs `command` and turns its outcome into
/// an exit code ([`Exit`]'s own, else 1), its error printed on one line
/// with no password the configuration holds.
pub async fn run_command<F, Fut>(name: &str, config: Option<&Path>, command: F) -> ExitCode
where
    F: FnOnce(Settings) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    // Before anything builds a TLS client (reqwest needs it).
    sas::tls::install_crypto_provider();
    let settings = match Settings::load(config) {
        Ok(settings) => settings,
        Err(e) => {
            // No settings to know the secrets by: mask any URL's password.
            let error = sas::tls::redact(&e.to_string(), []);
            eprintln!("{name}: {}", one_line(&error));
            return ExitCode::from(2);
        }
    };
    sas::telemetry::init(&quiet_libraries(&settings.log));
    // Printed errors must not show a password the configuration holds.
    let redactor = settings.clone();
    match command(settings).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let code = e.downcast_ref::<Exit>().map_or(1, |exit| exit.code);
            eprintln!("{name}: {}", one_line(&redactor.redact(&chain(&e))));
            ExitCode::from(code)
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
pub fn quiet_libraries(log: &LogSettings) -> LogSettings {
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
pub fn chain(e: &anyhow::Error) -> String {
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
pub fn one_line(text: &str) -> String {
    terminal::cell(&text.split_whitespace().collect::<Vec<_>>().join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

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

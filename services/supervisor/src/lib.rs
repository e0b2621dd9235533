//! `supervisor`: sweeps the state store for expired complete-by times and
//! asks for a re-attempt or gives the order up; the leader also submits
//! the orders of the recurring schedules and deletes old ended orders.
//!
//! Modules: `supervisor` (the sweep, partitions and the lease),
//! `schedules` (the recurring orders), `retention` (deleting old ended
//! orders) and `stuck_gauge` (the stuck orders, counted).

mod retention;
mod schedules;
mod stuck_gauge;
mod supervisor;

use sas::config::Settings;
use sas::service::{App, Spec, StoreUse};
use sas::state_store::Plans;

/// How a supervisor starts.
pub const SPEC: Spec = Spec {
    name: "supervisor",
    default_port: 9104,
    store: StoreUse::Required(Plans::Generic),
};

/// Starts a supervisor with `settings` (the binary with the configuration's;
/// tests in-process, on `http.port = 0`).
pub async fn build(settings: Settings) -> anyhow::Result<App> {
    App::start(SPEC, settings, supervisor::run).await
}

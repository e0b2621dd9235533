//! The wire types of [sas], the Scheduler Agent Supervisor suite: what an
//! application sends and reads ([contract] §1, §2, §9), and nothing of the
//! server. The services, `sasctl` and the clients all use these types, so
//! there is one definition of each message.
//!
//! - [`Order`]: the body published to `<prefix>.orders` (or `POST /v1/orders`).
//! - [`StatusEvent`]: what arrives on the application's status queue. Its
//!   [`State`] reads a state this version does not know as
//!   [`State::Other`], so an older reader never fails on a newer server.
//! - [`ReplayRequest`]: the body published to `<prefix>.replay`.
//! - [`Alert`]: what operators read on `<prefix>.alerts`.
//!
//! With the `schemars` feature every type implements
//! `schemars::JsonSchema`; the repository keeps the generated schemas in
//! [`docs/schemas/`] and a test fails when they drift.
//!
//! ```
//! use sas_protocol::{Order, StatusEvent, EventKind};
//!
//! let order = Order::from_payload("checkout", &serde_json::json!({"sku": "A1"})).unwrap();
//! let body = serde_json::to_vec(&order).unwrap();
//! assert!(body.starts_with(b"{\"workflow\":\"checkout\""));
//!
//! let event: StatusEvent = serde_json::from_str(
//!     r#"{"order_id":"0192a0c0-0000-7000-8000-000000000001","seq":3,
//!         "state":"processed","at":"2026-11-27T10:00:00Z","detail":{}}"#,
//! ).unwrap();
//! assert_eq!(event.state.kind(), Some(EventKind::Processed));
//! assert!(event.state.is_terminal());
//! ```
//!
//! [sas]: https://github.com/sas-rs/sas
//! [contract]: https://github.com/sas-rs/sas/blob/main/docs/contract.md
//! [`docs/schemas/`]: https://github.com/sas-rs/sas/tree/main/docs/schemas
//!
//! Modules beside the order and the status event: `alert` (operator
//! alerts), `http` (the HTTP API's bodies), `limits` (what sas accepts in an
//! order, as pure checks) and `rfc3339` (times on the wire).

mod alert;
mod event;
pub mod http;
pub mod limits;
mod order;
mod replay;
pub mod rfc3339;

pub use alert::Alert;
pub use event::{EventKind, State, StatusEvent};
pub use order::{Events, Order, Priority};
pub use replay::ReplayRequest;

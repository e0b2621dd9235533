//! The end-to-end tests, one binary (linked once): each module is one
//! area of the behaviour, run against the real binaries, Postgres and
//! RabbitMQ through `sas_tests::TestApp`. Tests that restart a server live in
//! `restarts` (and `cluster`, which starts RabbitMQ nodes of its own) and run alone, after the rest (`scripts/test.sh`).

mod applications;
mod attacks;
mod chaos;
mod claims;
mod client;
mod clocks;
mod cluster;
mod core;
mod costs;
mod dashboard;
mod dashboard_hardening;
mod dashboard_search;
mod docs;
mod failover;
mod faults;
mod fencing;
mod hostile;
mod http_api;
mod http_attacks;
mod in_doubt;
mod in_process;
mod metrics;
mod nodes;
mod outages;
mod packaging;
mod parallel;
mod partition;
mod permissions;
mod predicates;
mod python;
mod redrive;
mod remote_origin;
mod replay;
mod resilience;
mod restarts;
mod retention;
mod sasctl;
mod sasctl_more;
mod schedules;
mod schemas;
mod services;
mod streams;
mod tls;
mod tracing;
mod workflows;

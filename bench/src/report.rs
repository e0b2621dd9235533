//! The report: one table on the terminal (and as Markdown), everything as JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::limits::{HttpLimit, WorkflowLimit};
use crate::load::LoadResult;
use crate::peers::PeerResult;

/// The load name of a full-load run submitted over HTTP.
pub const HTTP_FULL: &str = "full, over HTTP";

/// One sas run.
#[derive(Debug, Clone, Serialize)]
pub struct SasRun {
    /// E.g. `1 scheduler, 1 agent`.
    pub deployment: String,
    /// `full`, `low` (a set rate, `plan::low_rate`), `recovery`.
    pub load: String,
    pub result: LoadResult,
    /// A comparison with another row of the run, for the notes (the
    /// cluster's throughput against the single node's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compared: Option<String>,
}

impl SasRun {
    /// The deployment, and the orders' `events` when not every event.
    pub fn label(&self) -> String {
        match self.result.status_events {
            "all" => self.deployment.clone(),
            events => format!("{}; events {events}", self.deployment),
        }
    }
}

/// The machine's limit.
#[derive(Debug, Clone, Serialize)]
pub struct Limits {
    pub workflows: Vec<WorkflowLimit>,
    pub http: HttpLimit,
}

/// A target from the issue and how far sas is.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    pub what: String,
    pub target: String,
    pub measured: String,
    pub met: bool,
    /// The measured ratio, for a target that is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
}

impl Target {
    /// A target stated as a ratio of two figures measured in this run;
    /// `measured` says it with the figures.
    fn ratio(what: String, target: String, ratio: f64, met: bool, measured: String) -> Self {
        Self {
            what,
            target,
            measured,
            met,
            ratio: Some(ratio),
        }
    }

    /// The target "`x` at most `factor` times `y`", both measured in this
    /// run; `figures` says them.
    fn at_most(what: String, factor: f64, (x, y): (f64, f64), figures: String) -> Self {
        Self::ratio(
            what,
            format!("≤ {factor}×"),
            x / y,
            x <= factor * y,
            format!("{:.2}×: {figures}", x / y),
        )
    }
}

/// Everything one bench run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub started_at: String,
    pub finished_at: String,
    pub command: String,
    pub git: String,
    pub machine: BTreeMap<String, String>,
    /// 1-minute load average before and after the run.
    pub load_before: f64,
    pub load_after: f64,
    pub postgres: String,
    /// The server's `autovacuum` setting.
    pub autovacuum: String,
    /// The harness's autovacuum stand-in: `VACUUM (ANALYZE)` every this many seconds.
    pub vacuum_every_s: Option<f64>,
    pub rabbitmq: String,
    pub peer_versions: Option<String>,
    pub sas: Vec<SasRun>,
    /// Peak RSS (`VmHWM`) per service binary over the full-load runs, MiB.
    pub memory_mib: BTreeMap<String, f64>,
    pub limits: Option<Limits>,
    /// The floor of sas's own chain (hops timed one after another).
    pub floor: Option<crate::floor::Floor>,
    /// Where an order's milliseconds go at low load, from the spans.
    pub hops: Vec<crate::hops::Hops>,
    pub peers: Vec<PeerResult>,
    /// Peer runs that could not run at all, with why.
    pub peer_errors: Vec<String>,
    pub targets: Vec<Target>,
}

fn f0(x: f64) -> String {
    if !x.is_finite() {
        return "—".into();
    }
    format!("{x:.0}")
}

fn ms(x: f64) -> String {
    if !x.is_finite() || x == 0.0 {
        return "—".into();
    }
    if x < 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.0}")
    }
}

/// One row of the table.
struct Row {
    system: String,
    workflow: String,
    load: String,
    orders: String,
    rate: String,
    p50: String,
    p99: String,
    p999: String,
    note: String,
}

impl Report {
    fn rows(&self) -> Vec<Row> {
        let mut rows = Vec::new();
        for r in &self.sas {
            let res = &r.result;
            let mut note = Vec::new();
            if res.missing > 0 || res.other_terminal > 0 {
                note.push(format!(
                    "{} processed, {} other, {} missing",
                    res.processed, res.other_terminal, res.missing
                ));
            }
            if let Some(n) = res
                .event_states
                .get("retry_scheduled")
                .filter(|_| r.load != "recovery")
            {
                note.push(format!("{n} re-attempts (complete-by passed)"));
            }
            if let Some(rate) = res.offered_rate {
                note.push(format!("offered {rate:.0}/s"));
            }
            let steps = res.calls_per_order as u64;
            // Undo calls add effects, so compare only when every order was processed.
            if let Some(applied) = res.remote_applied
                && res.other_terminal == 0
                && applied != res.processed as u64 * steps
            {
                note.push(format!(
                    "remote effects {applied}, expected {}",
                    res.processed as u64 * steps
                ));
            }
            if let Some(rec) = &res.recovery {
                note.push(format!(
                    "{} killed after {} orders: in-flight orders terminal {:.2} s after the kill, all {:.2} s; {} re-attempts (`retry_scheduled`)",
                    rec.killed,
                    rec.before_kill,
                    rec.in_flight_recovered_s,
                    rec.all_terminal_s,
                    res.event_states.get("retry_scheduled").copied().unwrap_or(0)
                ));
            }
            if let Some(c) = &r.compared {
                note.push(c.clone());
            }
            if r.load == "full" {
                note.push(format!(
                    "CPU busy {:.0}%",
                    res.cpu.machine_busy_share * 100.0
                ));
            }
            rows.push(Row {
                system: format!("sas ({})", r.label()),
                workflow: res.workflow.clone(),
                load: r.load.clone(),
                orders: res.orders.to_string(),
                rate: f0(res.throughput),
                p50: ms(res.latency_ms.p50),
                p99: ms(res.latency_ms.p99),
                p999: ms(res.latency_ms.p999),
                note: note.join("; "),
            });
        }
        if let Some(l) = &self.limits {
            for w in &l.workflows {
                let sas = self.sas_full(&w.workflow);
                let mut share = sas.map_or(String::new(), |s| {
                    format!("; sas reaches {:.0}%", 100.0 * s / w.orders_per_s)
                });
                if w.other_share > 0.05 {
                    share.push_str(&format!(
                        "; **other processes used {:.0}% of the CPU**",
                        w.other_share * 100.0
                    ));
                }
                rows.push(Row {
                    system: "machine limit".into(),
                    workflow: w.workflow.clone(),
                    load: "—".into(),
                    orders: w.pg.orders.to_string(),
                    rate: f0(w.orders_per_s),
                    p50: "—".into(),
                    p99: "—".into(),
                    p999: "—".into(),
                    note: format!(
                        "per order: Postgres {:.2} ms ({:.1} tx, {:.0} tx/s), RabbitMQ {:.2} ms ({}+{} msgs); with HTTP {:.0}/s{share}",
                        w.pg_ms,
                        w.pg.tx_per_order,
                        w.pg.tx_per_s,
                        w.mq_ms,
                        w.messages_per_order.0,
                        w.messages_per_order.1,
                        w.orders_per_s_with_http
                    ),
                });
            }
        }
        if let Some(f) = &self.floor {
            let h = &f.hops;
            for c in &f.chains {
                rows.push(Row {
                    system: "floor of the chain".into(),
                    workflow: c.workflow.clone(),
                    load: "one order".into(),
                    orders: "—".into(),
                    rate: "—".into(),
                    p50: ms(c.ms),
                    p99: "—".into(),
                    p999: "—".into(),
                    note: format!(
                        "{} commits × {:.2} ms, deliveries: order {:.2} ms, {} step messages × {:.2} ms, status {:.2} ms; {} calls × {:.2} ms",
                        c.commits,
                        h.commit_ms,
                        h.order_delivery_ms,
                        2 * c.steps,
                        h.step_delivery_ms,
                        h.status_delivery_ms,
                        c.calls,
                        h.call_ms
                    ),
                });
            }
        }
        for p in &self.peers {
            let mut note = Vec::new();
            if let Some(e) = &p.error {
                note.push(format!("ERROR: {e}"));
            }
            if p.completed < p.orders {
                note.push(format!("{} of {} completed", p.completed, p.orders));
            }
            if let Some(rate) = p.offered_rate {
                note.push(format!("offered {rate:.0}/s"));
            } else if let Some(c) = &p.cpu {
                note.push(format!("CPU busy {:.0}%", c.machine_busy_share * 100.0));
            }
            if let Some(c) = p.cpu.as_ref().filter(|c| c.other_share() > 0.05) {
                note.push(format!(
                    "**other processes used {:.0}% of the CPU**",
                    c.other_share() * 100.0
                ));
            }
            rows.push(Row {
                system: p.system.clone(),
                workflow: p.workflow.clone(),
                load: if p.offered_rate.is_some() {
                    "low"
                } else {
                    "full"
                }
                .into(),
                orders: p.orders.to_string(),
                rate: p.throughput.map_or("—".into(), f0),
                p50: ms(p.latency_ms.p50),
                p99: ms(p.latency_ms.p99),
                p999: ms(p.latency_ms.p999),
                note: note.join("; "),
            });
        }
        for e in &self.peer_errors {
            rows.push(Row {
                system: "peer".into(),
                workflow: "—".into(),
                load: "—".into(),
                orders: "—".into(),
                rate: "—".into(),
                p50: "—".into(),
                p99: "—".into(),
                p999: "—".into(),
                note: format!("ERROR: {e}"),
            });
        }
        rows
    }

    /// sas's full-load throughput of the default deployment for a workflow.
    pub fn sas_full(&self, workflow: &str) -> Option<f64> {
        self.sas
            .iter()
            .find(|r| {
                r.load == "full" && r.result.workflow == workflow && r.result.status_events == "all"
            })
            .map(|r| r.result.throughput)
    }

    /// The table, as Markdown (readable on a terminal too).
    pub fn table(&self) -> String {
        let mut out = String::new();
        out.push_str(
            "| system | workflow | load | orders | orders/s | p50 ms | p99 ms | p99.9 ms | notes |\n",
        );
        out.push_str("|---|---|---|--:|--:|--:|--:|--:|---|\n");
        for r in self.rows() {
            writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.system, r.workflow, r.load, r.orders, r.rate, r.p50, r.p99, r.p999, r.note
            )
            .ok();
        }
        out
    }

    /// The targets, as Markdown.
    pub fn targets_table(&self) -> String {
        let mut out = String::from("| target | wanted | measured | met |\n|---|---|---|---|\n");
        for t in &self.targets {
            writeln!(
                out,
                "| {} | {} | {} | {} |",
                t.what,
                t.target,
                t.measured,
                if t.met { "yes" } else { "**no**" }
            )
            .ok();
        }
        out
    }

    /// The details: limits, stages, CPU and memory, as Markdown.
    pub fn details(&self) -> String {
        let mut out = String::new();
        if let Some(l) = &self.limits {
            out.push_str(
                "#### Machine limit: Postgres transactions (library calls, no broker)\n\n",
            );
            out.push_str("| workflow | phase | transactions | orders | s | tx/s |\n|---|---|--:|--:|--:|--:|\n");
            for w in &l.workflows {
                for p in &w.pg.phases {
                    writeln!(
                        out,
                        "| {} | {} | {} | {} | {:.2} | {:.0} |",
                        w.workflow, p.name, p.transactions, p.orders, p.seconds, p.tx_per_s
                    )
                    .ok();
                }
            }
            for w in &l.workflows {
                let pg: Vec<String> = w.pg_runs_ms.iter().map(|m| format!("{m:.2}")).collect();
                let mq: Vec<String> = w
                    .mq_runs
                    .iter()
                    .map(|(q, c)| format!("{q:.0}/{c:.0}"))
                    .collect();
                writeln!(
                    out,
                    "\n{}: each measured 3 times, the median counts: Postgres machine ms per order {}; RabbitMQ msgs/s of machine time quorum/classic {}.",
                    w.workflow,
                    pg.join(", "),
                    mq.join(", ")
                )
                .ok();
            }
            writeln!(
                out,
                "\n#### Machine limit: RabbitMQ (4 queues at once; confirms and prefetch as the services, {} in flight; manual acks) and HTTP\n",
                sas::config::BrokerSettings::default().prefetch
            )
            .ok();
            out.push_str(
                "| workflow | queue | messages | mean bytes | msgs/s | msgs/s of machine time |\n|---|---|--:|--:|--:|--:|\n",
            );
            for w in &l.workflows {
                for m in [&w.mq_quorum, &w.mq_classic] {
                    writeln!(
                        out,
                        "| {} | {} | {} | {:.0} | {:.0} | {:.0} |",
                        w.workflow,
                        m.queue_type,
                        m.messages,
                        m.mean_bytes,
                        m.msg_per_s,
                        m.machine_msg_per_s
                    )
                    .ok();
                }
            }
            writeln!(
                out,
                "\nremote-sim: {:.0} POSTs/s ({} concurrent keep-alive connections).\n",
                l.http.calls_per_s, l.http.concurrency
            )
            .ok();
        }
        out.push_str("#### sas: where an order's time goes (median ms between its events)\n\n");
        out.push_str(
            "| deployment | workflow | load | stages (p50 ms) | messages per order, by path (outbox; agent replies) |\n|---|---|---|---|---|\n",
        );
        for r in &self.sas {
            let stages: Vec<String> = r
                .result
                .stages_ms
                .iter()
                .map(|(n, p)| format!("{n} {}", ms(p.p50)))
                .collect();
            writeln!(
                out,
                "| {} | {} | {} | {} | {} |",
                r.label(),
                r.result.workflow,
                r.load,
                stages.join(", "),
                r.result.outbox_paths_text()
            )
            .ok();
        }
        out.push_str(&self.hops_table());
        out.push_str("\n#### CPU per order (ms of CPU time, all cores), by process\n\n");
        out.push_str("| run | workflow | load | CPU busy | per order |\n|---|---|---|--:|---|\n");
        for r in &self.sas {
            writeln!(
                out,
                "| sas ({}) | {} | {} | {:.0}% | {} |",
                r.label(),
                r.result.workflow,
                r.load,
                r.result.cpu.machine_busy_share * 100.0,
                cpu_list(&r.result.cpu_ms_per_order)
            )
            .ok();
        }
        for p in &self.peers {
            if let Some(c) = &p.cpu {
                writeln!(
                    out,
                    "| {} | {} | {} | {:.0}% | {} |",
                    p.system,
                    p.workflow,
                    if p.offered_rate.is_some() {
                        "low"
                    } else {
                        "full"
                    },
                    c.machine_busy_share * 100.0,
                    cpu_list(&p.cpu_ms_per_order)
                )
                .ok();
            }
        }
        out.push_str("\n#### Postgres work per order (from `pg_stat_database`, approximate; WAL is server-wide)\n\n");
        out.push_str("| run | workflow | load | commits | rolled back | rows inserted | rows updated | rows deleted | WAL KiB |\n|---|---|---|--:|--:|--:|--:|--:|--:|\n");
        for r in &self.sas {
            if let Some(p) = &r.result.pg_per_order {
                writeln!(
                    out,
                    "| sas ({}) | {} | {} | {:.1} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} |",
                    r.label(),
                    r.result.workflow,
                    r.load,
                    p.commits,
                    p.rollbacks,
                    p.inserted,
                    p.updated,
                    p.deleted,
                    p.wal_bytes / 1024.0
                )
                .ok();
            }
        }
        out.push_str(
            "\n#### What Postgres was doing (sampled from `pg_stat_activity` every 20 ms)\n\n",
        );
        for r in self.sas.iter().filter(|r| r.result.pg_profile.samples > 0) {
            let p = &r.result.pg_profile;
            writeln!(
                out,
                "sas ({}), {}, {} load: {:.1} busy backends on average over {} samples.\n",
                r.label(),
                r.result.workflow,
                r.load,
                p.mean_busy_backends,
                p.samples
            )
            .ok();
            out.push_str("| share | backends | waiting on | statement |\n|--:|--:|---|---|\n");
            for a in &p.top {
                writeln!(
                    out,
                    "| {:.0}% | {:.2} | {} | `{}` |",
                    a.share * 100.0,
                    a.mean_backends,
                    a.waiting_on,
                    a.what.replace('|', "\\|")
                )
                .ok();
            }
            out.push('\n');
        }
        out.push_str("\n#### Memory: peak RSS (VmHWM) per process\n\n");
        let mem: Vec<String> = self
            .memory_mib
            .iter()
            .map(|(k, v)| format!("{k} {v:.1} MiB"))
            .collect();
        if !mem.is_empty() {
            writeln!(out, "sas: {}.", mem.join(", ")).ok();
        }
        let peers: Vec<String> = self
            .peers
            .iter()
            .filter(|p| p.offered_rate.is_none())
            .map(|p| {
                let parts: Vec<String> = p
                    .peak_mib
                    .iter()
                    .map(|(k, v)| format!("{k} {v:.0}"))
                    .collect();
                let parts = if parts.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", parts.join(", "))
                };
                format!(
                    "{} {} {:.0} MiB{parts}",
                    p.system, p.workflow, p.worker_peak_mib
                )
            })
            .collect();
        if !peers.is_empty() {
            writeln!(
                out,
                "Peer workers (all processes of a worker; Restate: its server and its service): {}.",
                peers.join(", ")
            )
            .ok();
        }
        let mut seen = std::collections::BTreeSet::new();
        let setups: Vec<String> = self
            .peers
            .iter()
            .filter(|p| seen.insert(p.system.clone()))
            .map(|p| format!("- {}: {}", p.system, p.setup))
            .collect();
        if !setups.is_empty() {
            out.push_str("\n#### How the peers ran\n\n");
            out.push_str(&setups.join("\n"));
            out.push('\n');
        }
        out
    }

    /// The whole report as Markdown.
    /// The hops of an order at low load, from the spans, one column per
    /// workflow (empty without hop runs).
    fn hops_table(&self) -> String {
        let mut out = String::new();
        let Some(first) = self.hops.first() else {
            return out;
        };
        out.push_str(
            "\n#### sas: each hop of an order at low load, from the spans (1 scheduler, 1 agent, spans exported; median ms)\n\n| hop |",
        );
        for h in &self.hops {
            write!(
                out,
                " {} at {:.0}/s ({} orders) |",
                h.workflow,
                h.offered_rate.unwrap_or_default(),
                h.orders
            )
            .ok();
        }
        out.push_str("\n|---|");
        out.push_str(&"--:|".repeat(self.hops.len()));
        out.push('\n');
        for (i, (hop, _)) in first.hops.iter().enumerate() {
            write!(out, "| {hop} |").ok();
            for h in &self.hops {
                let p50 = h.hops.get(i).map_or(f64::NAN, |(_, p)| p.p50);
                write!(out, " {p50:.2} |").ok();
            }
            out.push('\n');
        }
        out.push_str("| p50, submit → terminal event received |");
        for h in &self.hops {
            write!(out, " {} |", ms(h.latency_p50_ms)).ok();
        }
        out.push('\n');
        out
    }

    pub fn markdown(&self) -> String {
        let mut out = String::new();
        writeln!(
            out,
            "Run {} → {} on {} ({} cores, {}), load average {:.2} before, {:.2} after. {}; {}. git {}.\n",
            self.started_at,
            self.finished_at,
            self.machine.get("cpu").map_or("?", String::as_str),
            self.machine.get("cores").map_or("?", String::as_str),
            self.machine.get("memory").map_or("?", String::as_str),
            self.load_before,
            self.load_after,
            self.postgres,
            self.rabbitmq,
            self.git
        )
        .ok();
        if let Some(v) = &self.peer_versions {
            writeln!(out, "Peers: {v}.\n").ok();
        }
        match self.vacuum_every_s {
            Some(s) => writeln!(
                out,
                "Postgres runs with `autovacuum = {}`; the harness ran `VACUUM (ANALYZE)` on sas's tables every {s} s while sas ran, standing in for it.\n",
                self.autovacuum
            ),
            None => writeln!(
                out,
                "Postgres runs with `autovacuum = {}`; the harness did no vacuuming of its own.\n",
                self.autovacuum
            ),
        }
        .ok();
        writeln!(out, "Command: `{}`\n", self.command).ok();
        out.push_str(&self.table());
        out.push_str("\n#### Targets\n\n");
        out.push_str(&self.targets_table());
        out.push('\n');
        out.push_str(&self.details());
        out
    }
}

fn cpu_list(m: &BTreeMap<String, f64>) -> String {
    let mut v: Vec<(&String, &f64)> = m.iter().filter(|(_, v)| **v >= 0.005).collect();
    v.sort_by(|a, b| b.1.total_cmp(a.1));
    v.iter()
        .map(|(k, x)| format!("{k} {x:.2}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Works out the targets of issue #6 from a report.
/// CPU milliseconds per order of a run: sas's processes, Postgres, RabbitMQ
/// and the remote; not `other` (whatever else the machine ran).
fn cpu_of(r: &LoadResult) -> f64 {
    r.cpu_ms_per_order
        .iter()
        .filter(|(k, _)| *k != "other")
        .map(|(_, v)| v)
        .sum()
}

pub fn targets(r: &Report, recovery_bound_s: f64) -> Vec<Target> {
    let mut t = Vec::new();
    // sas's best full-load run of a workflow with these events, over the
    // deployments (each uses the whole machine, as each peer does).
    let best = |wf: &str, events: &str| {
        r.sas
            .iter()
            .filter(|s| {
                s.load == "full" && s.result.workflow == wf && s.result.status_events == events
            })
            .max_by(|a, b| a.result.throughput.total_cmp(&b.result.throughput))
    };
    let low = |wf: &str, events: &str| {
        r.sas.iter().find(|s| {
            s.load == "low" && s.result.workflow == wf && s.result.status_events == events
        })
    };
    let peer = |system: &str, wf: &str, full: bool| {
        r.peers.iter().find(|p| {
            p.system == system
                && p.workflow == wf
                && p.offered_rate.is_none() == full
                && p.error.is_none()
                && p.completed == p.orders
        })
    };
    for (wf, name) in [("one", "1-step"), ("three", "3-step")] {
        // Throughput against each peer, as ratios measured in this run.
        for (events, system, factor) in [
            ("terminal", "restate", 1.0),
            ("all", "restate", 0.8),
            ("all", "dbos", 3.0),
            ("all", "celery (rpc results)", 3.0),
        ] {
            let (Some(ours), Some(theirs)) = (best(wf, events), peer(system, wf, true)) else {
                continue;
            };
            let x = ours.result.throughput;
            let y = theirs.throughput.unwrap_or(0.0);
            t.push(Target::ratio(
                format!("{name} throughput, events {events}, vs {system}"),
                format!("≥ {factor}×"),
                x / y,
                x / y >= factor,
                format!("{:.2}×: {x:.0} vs {y:.0}/s; {}", x / y, ours.deployment),
            ));
        }
        // Low load: the same offered rate for sas and the peers.
        if let Some(ours) = low(wf, "terminal") {
            let x = ours.result.latency_ms.p50;
            if let Some(floor) = r.floor.as_ref().and_then(|f| f.of(wf)) {
                t.push(Target::at_most(
                    format!("{name} p50 at low load, events terminal, vs the floor of its chain"),
                    1.5,
                    (x, floor),
                    format!("{x:.1} vs {floor:.1} ms"),
                ));
            }
            if let Some(theirs) = peer("restate", wf, false) {
                let y = theirs.latency_ms.p50;
                let rate = ours.result.offered_rate.unwrap_or_default();
                t.push(Target::at_most(
                    format!("{name} p50 at low load, events terminal, vs restate"),
                    2.0,
                    (x, y),
                    format!("{x:.1} vs {y:.1} ms at {rate:.0}/s"),
                ));
            }
            if let Some(full) = best(wf, "terminal") {
                let (x, y) = (cpu_of(&ours.result), cpu_of(&full.result));
                t.push(Target::at_most(
                    format!("{name} CPU per order at low load vs at full load, events terminal"),
                    2.0,
                    (x, y),
                    format!("{x:.2} vs {y:.2} ms"),
                ));
            }
        }
        // The share of sas's own machine limit, with its full work.
        let limit = r
            .limits
            .as_ref()
            .and_then(|l| l.workflows.iter().find(|w| w.workflow == wf));
        if let (Some(ours), Some(l)) = (best(wf, "all"), limit) {
            let want = if wf == "one" { 0.9 } else { 0.8 };
            let share = ours.result.throughput / l.orders_per_s;
            t.push(Target::ratio(
                format!("{name} throughput, events all, share of the machine limit"),
                format!("≥ {:.0}%", want * 100.0),
                share,
                share >= want,
                format!(
                    "{:.1}%: {:.0} of {:.0}/s",
                    share * 100.0,
                    ours.result.throughput,
                    l.orders_per_s
                ),
            ));
        }
    }
    // Submitting over HTTP against the queue, the same deployment and orders.
    let http = r.sas.iter().find(|s| s.load == HTTP_FULL);
    let queue = http.and_then(|h| {
        r.sas.iter().find(|s| {
            s.load == "full"
                && s.deployment == h.deployment
                && s.result.workflow == h.result.workflow
                && s.result.status_events == h.result.status_events
        })
    });
    if let (Some(h), Some(q)) = (http, queue) {
        let (x, y) = (h.result.throughput, q.result.throughput);
        t.push(Target::ratio(
            "1-step throughput submitted over HTTP, vs over the queue".into(),
            "≥ 0.8×".into(),
            x / y,
            x / y >= 0.8,
            format!("{:.2}×: {x:.0} vs {y:.0}/s; {}", x / y, h.deployment),
        ));
    }
    for s in r.sas.iter().filter(|s| s.load == "recovery") {
        if let Some(rec) = &s.result.recovery {
            t.push(Target {
                what: format!("recovery after {} SIGKILL", rec.killed),
                target: format!("≤ {recovery_bound_s:.1} s (complete-by + 2 supervisor intervals + 1 s)"),
                measured: format!(
                    "{:.2} s until every order in flight at the kill was terminal ({} processed, {} missing)",
                    rec.in_flight_recovered_s, s.result.processed, s.result.missing
                ),
                met: rec.in_flight_recovered_s <= recovery_bound_s && s.result.missing == 0,
                ratio: None,
            });
        }
    }
    if !r.memory_mib.is_empty() {
        let worst = r
            .memory_mib
            .iter()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(k, v)| (k.clone(), *v))
            .unwrap_or_default();
        t.push(Target {
            what: "memory per service at full load".into(),
            target: "< 50 MB RSS each".into(),
            measured: format!("largest: {} {:.1} MiB", worst.0, worst.1),
            met: worst.1 * 1.048_576 < 50.0,
            ratio: None,
        });
    }
    t
}

#[cfg(test)]
mod tests {
    use super::Target;

    #[test]
    fn an_at_most_target_is_met_up_to_its_factor_and_says_its_ratio() {
        let met = Target::at_most("p50".into(), 1.5, (3.0, 2.0), "3 vs 2 ms".into());
        assert!(met.met);
        assert_eq!(met.target, "≤ 1.5×");
        assert_eq!(met.measured, "1.50×: 3 vs 2 ms");
        assert_eq!(met.ratio, Some(1.5));
        let missed = Target::at_most("cpu".into(), 2.0, (4.1, 2.0), String::new());
        assert!(!missed.met);
        assert_eq!(missed.target, "≤ 2×");
    }
}

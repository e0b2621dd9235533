//! What the processes on this machine cost: CPU time per group of processes
//! (from `/proc/<pid>/stat`) and memory (`VmHWM`, `VmRSS` from
//! `/proc/<pid>/status`). Linux only, like the machine it measures.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use serde::Serialize;

/// Clock ticks per second of `utime`/`stime` (`CLK_TCK`); 100 on Linux.
const TICKS: f64 = 100.0;

/// A group of processes to account for: the named roots and all their descendants.
#[derive(Debug, Clone)]
pub struct Group {
    pub name: String,
    pub roots: Vec<u32>,
}

/// CPU seconds used so far, per group, and by the whole machine.
#[derive(Debug, Clone)]
pub struct CpuSnapshot {
    at: Instant,
    groups: BTreeMap<String, f64>,
    /// Busy CPU seconds of the whole machine (all cores), from `/proc/stat`.
    machine_busy: f64,
    /// Of which interrupts and softirqs (on this machine mostly loopback
    /// networking between the processes), which no process is charged for.
    machine_irq: f64,
}

/// CPU used between two snapshots.
#[derive(Debug, Clone, Serialize)]
pub struct CpuUse {
    pub wall_s: f64,
    /// Cores on the machine.
    pub cores: usize,
    /// Busy share of all cores over the interval, 0–1.
    pub machine_busy_share: f64,
    /// CPU seconds per group; `postgres` and `rabbitmq` are every process of
    /// those servers, `irq` the interrupts and softirqs (loopback networking),
    /// `other` the rest of the machine.
    pub cpu_s: BTreeMap<String, f64>,
}

impl CpuUse {
    /// The share of all cores that processes outside the measured system used
    /// (other people's work, say), 0–1: a measurement with much of it is suspect.
    pub fn other_share(&self) -> f64 {
        let other = self.cpu_s.get("other").copied().unwrap_or(0.0);
        if self.wall_s > 0.0 {
            other / (self.wall_s * self.cores as f64)
        } else {
            0.0
        }
    }

    /// CPU milliseconds per order, per group.
    pub fn per_order_ms(&self, orders: usize) -> BTreeMap<String, f64> {
        let n = orders.max(1) as f64;
        self.cpu_s
            .iter()
            .map(|(k, v)| (k.clone(), v * 1000.0 / n))
            .collect()
    }
}

struct ProcInfo {
    ppid: u32,
    comm: String,
    cpu_s: f64,
}

fn read_procs() -> HashMap<u32, ProcInfo> {
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some(info) = read_stat(pid) {
            out.insert(pid, info);
        }
    }
    out
}

fn read_stat(pid: u32) -> Option<ProcInfo> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid …`: comm may hold spaces and parentheses.
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text[open + 1..close].to_owned();
    let rest: Vec<&str> = text[close + 2..].split_whitespace().collect();
    // rest[0] is field 3 (state): utime is field 14, stime field 15.
    let ppid = rest.get(1)?.parse().ok()?;
    let utime: f64 = rest.get(11)?.parse().ok()?;
    let stime: f64 = rest.get(12)?.parse().ok()?;
    // Postgres backends come and go with their connections; once one exits,
    // the postmaster that reaped it carries its time (cutime, cstime).
    let children: f64 = if comm == "postgres" {
        rest.get(13)?.parse::<f64>().ok()? + rest.get(14)?.parse::<f64>().ok()?
    } else {
        0.0
    };
    Some(ProcInfo {
        ppid,
        comm,
        cpu_s: (utime + stime + children) / TICKS,
    })
}

/// `(busy, irq + softirq)` CPU seconds of the machine so far.
fn machine_busy() -> (f64, f64) {
    let Ok(text) = std::fs::read_to_string("/proc/stat") else {
        return (0.0, 0.0);
    };
    let Some(line) = text.lines().find(|l| l.starts_with("cpu ")) else {
        return (0.0, 0.0);
    };
    let v: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal …: busy = all − idle − iowait.
    let total: f64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0.0) + v.get(4).copied().unwrap_or(0.0);
    let irq = v.get(5).copied().unwrap_or(0.0) + v.get(6).copied().unwrap_or(0.0);
    ((total - idle) / TICKS, irq / TICKS)
}

/// The number of cores.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Takes a snapshot: each group's processes (roots and descendants), every
/// `postgres` and `beam.smp` process, and the rest as `other`.
pub fn snapshot(groups: &[Group]) -> CpuSnapshot {
    let procs = read_procs();
    let mut owner: HashMap<u32, String> = HashMap::new();
    for g in groups {
        for root in &g.roots {
            owner.insert(*root, g.name.clone());
        }
    }
    // Descendants inherit their ancestor's group.
    let group_of = |pid: u32| -> Option<String> {
        let mut p = pid;
        for _ in 0..64 {
            if let Some(g) = owner.get(&p) {
                return Some(g.clone());
            }
            p = procs.get(&p)?.ppid;
            if p <= 1 {
                return None;
            }
        }
        None
    };
    let mut totals: BTreeMap<String, f64> = BTreeMap::new();
    for g in groups {
        totals.entry(g.name.clone()).or_default();
    }
    for (pid, info) in &procs {
        let name = match group_of(*pid) {
            Some(g) => g,
            None if info.comm == "postgres" => "postgres".into(),
            None if info.comm == "beam.smp" || info.comm.starts_with("erl_child") => {
                "rabbitmq".into()
            }
            None => "other".into(),
        };
        *totals.entry(name).or_default() += info.cpu_s;
    }
    let (machine_busy, machine_irq) = machine_busy();
    CpuSnapshot {
        at: Instant::now(),
        groups: totals,
        machine_busy,
        machine_irq,
    }
}

impl CpuSnapshot {
    /// What was used since `earlier`. `other` is the machine's busy time
    /// minus every named group (so processes that came and went are in it).
    pub fn since(&self, earlier: &CpuSnapshot) -> CpuUse {
        let wall = self.at.duration_since(earlier.at).as_secs_f64();
        let busy = (self.machine_busy - earlier.machine_busy).max(0.0);
        let mut cpu: BTreeMap<String, f64> = BTreeMap::new();
        for (k, v) in &self.groups {
            if k == "other" {
                continue;
            }
            let before = earlier.groups.get(k).copied().unwrap_or(0.0);
            // A group whose processes are new has no "before"; one whose processes died lost its time.
            cpu.insert(k.clone(), (v - before).max(0.0));
        }
        let irq = (self.machine_irq - earlier.machine_irq).max(0.0);
        cpu.insert("irq".into(), irq);
        let named: f64 = cpu.values().sum();
        cpu.insert("other".into(), (busy - named).max(0.0));
        let cores = cores();
        CpuUse {
            wall_s: wall,
            cores,
            machine_busy_share: if wall > 0.0 {
                busy / (wall * cores as f64)
            } else {
                0.0
            },
            cpu_s: cpu,
        }
    }
}

/// Memory of one process, in MiB: peak (`VmHWM`) and now (`VmRSS`).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Memory {
    pub peak_mib: f64,
    pub now_mib: f64,
}

/// The memory of a process, if it runs.
pub fn memory(pid: u32) -> Option<Memory> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<f64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb / 1024.0)
    };
    Some(Memory {
        peak_mib: field("VmHWM:")?,
        now_mib: field("VmRSS:")?,
    })
}

/// The 1-minute load average.
pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// A short description of the machine: CPU model, cores, memory, kernel.
pub fn machine() -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    if let Ok(cpu) = std::fs::read_to_string("/proc/cpuinfo")
        && let Some(model) = cpu
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split(':').nth(1))
    {
        m.insert("cpu".into(), model.trim().to_owned());
    }
    m.insert("cores".into(), cores().to_string());
    if let Ok(mem) = std::fs::read_to_string("/proc/meminfo")
        && let Some(kb) = mem
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|k| k.parse::<f64>().ok())
    {
        m.insert("memory".into(), format!("{:.1} GiB", kb / 1024.0 / 1024.0));
    }
    if let Ok(k) = std::fs::read_to_string("/proc/sys/kernel/osrelease") {
        m.insert("kernel".into(), k.trim().to_owned());
    }
    m
}

/// A process and all its descendants.
pub fn tree(root: u32) -> Vec<u32> {
    let procs = read_procs();
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let parent = out[i];
        out.extend(
            procs
                .iter()
                .filter(|(_, p)| p.ppid == parent)
                .map(|(pid, _)| *pid),
        );
        i += 1;
    }
    out
}

/// The peak memory of a process tree: the sum of each process's `VmHWM`, MiB.
pub fn tree_peak_mib(root: u32) -> f64 {
    tree(root)
        .into_iter()
        .filter_map(memory)
        .map(|m| m.peak_mib)
        .sum()
}

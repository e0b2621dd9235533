//! The fault mix of a chaos run, set on a remote-sim through its control API
//! (`PUT /_sim/knobs/<path>`, `DELETE /stats`, `GET /stats`), and the count
//! of effects it applied twice.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::Context;
use sas::config::Settings;
use serde_json::{Value, json};
use uuid::Uuid;

/// An endpoint of the simulator that a workflow's agent calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The agent (the first one, when several share the path).
    pub agent: String,
    /// The path on the simulator, e.g. `/payments/charge`.
    pub path: String,
    /// A forward step (gets the faults), not only a compensation (kept healthy).
    pub forward: bool,
}

/// The simulator endpoints of `workflow`'s agents: each agent whose
/// configured URL lies on `base`. Compensations stay healthy: the run
/// measures how the suite copes with failing steps, and an undo that fails
/// permanently ends its order `failed` for an operator, which says nothing
/// about lost orders or duplicates. Agents elsewhere are reported in
/// `skipped`.
pub fn plan(
    settings: &Settings,
    workflow: &str,
    base: &str,
) -> anyhow::Result<(Vec<Endpoint>, Vec<String>)> {
    let spec = settings
        .workflows
        .get(workflow)
        .with_context(|| format!("no workflow {workflow:?} in the configuration"))?;
    let mut agents: Vec<(&str, bool)> = Vec::new();
    for step in &spec.steps {
        if let Some(agent) = &step.agent {
            agents.push((agent, true));
        }
        if let Some(undo) = &step.compensate {
            agents.push((undo, false));
        }
    }
    let base = base.trim_end_matches('/');
    let mut endpoints: Vec<Endpoint> = Vec::new();
    let mut skipped = Vec::new();
    for (agent, forward) in agents {
        let path = settings
            .agents
            .get(agent)
            .and_then(|spec| path_on(base, &spec.url));
        let Some(path) = path else {
            if !skipped.iter().any(|s| s == agent) {
                skipped.push(agent.to_owned());
            }
            continue;
        };
        match endpoints.iter_mut().find(|e| e.path == path) {
            // A forward use wins: the endpoint gets the faults.
            Some(known) => known.forward |= forward,
            None => endpoints.push(Endpoint {
                agent: agent.to_owned(),
                path,
                forward,
            }),
        }
    }
    Ok((endpoints, skipped))
}

/// The path of `url` when it lies on the simulator at `base` (no trailing
/// slash): `http://sim:8081/pay/charge?x=1` on `http://sim:8081` is `/pay/charge`.
fn path_on(base: &str, url: &str) -> Option<String> {
    let rest = url.strip_prefix(base)?;
    if !(rest.is_empty() || rest.starts_with('/')) {
        // `http://sim:80810/...` is not on `http://sim:8081`.
        return None;
    }
    // The simulator keys knobs on the path alone.
    let path = rest.split(['?', '#']).next().unwrap_or_default();
    Some(if path.is_empty() {
        "/".to_owned()
    } else {
        path.to_owned()
    })
}

/// A remote-sim's control API.
pub struct Sim {
    base: String,
    client: reqwest::Client,
    /// Paths whose knobs this run set, to put back afterwards.
    set: Vec<String>,
}

impl Sim {
    /// The simulator at `base`, e.g. `http://127.0.0.1:8081`.
    pub fn new(base: &str) -> anyhow::Result<Self> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .connect_timeout(Duration::from_secs(5))
            .build()
            .context("building the HTTP client")?;
        Ok(Self {
            base: base.trim_end_matches('/').to_owned(),
            client,
            set: Vec::new(),
        })
    }

    /// Resets the simulator's counters and deduplication store, then sets
    /// the knobs: `transient` and `permanent` rates on forward endpoints,
    /// the defaults on compensations.
    pub async fn prepare(
        &mut self,
        endpoints: &[Endpoint],
        transient: f64,
        permanent: f64,
    ) -> anyhow::Result<()> {
        let url = format!("{}/stats", self.base);
        self.client
            .delete(&url)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .with_context(|| format!("resetting the simulator's stats (DELETE {url})"))?;
        for endpoint in endpoints {
            let knobs = if endpoint.forward {
                json!({ "transient_rate": transient, "permanent_rate": permanent })
            } else {
                json!({})
            };
            let url = format!("{}/_sim/knobs{}", self.base, endpoint.path);
            let response = self
                .client
                .put(&url)
                .json(&knobs)
                .send()
                .await
                .with_context(|| format!("setting knobs (PUT {url})"))?;
            let status = response.status();
            if !status.is_success() {
                let body = response.text().await.unwrap_or_default();
                anyhow::bail!("setting knobs (PUT {url} {knobs}): {status} {body}");
            }
            self.set.push(endpoint.path.clone());
        }
        Ok(())
    }

    /// What the simulator's counts say of `orders`, from `GET /stats`: the
    /// idempotency keys (`<order_id>:<step>[:compensate]`) it applied more
    /// than once, and the orders with an effect of one of the `undoable`
    /// steps that stands (applied and not undone; a step with no undo
    /// cannot be taken back).
    pub async fn effects(
        &self,
        orders: &HashSet<Uuid>,
        undoable: &[String],
    ) -> anyhow::Result<Effects> {
        let url = format!("{}/stats", self.base);
        let stats: Value = self
            .client
            .get(&url)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .with_context(|| format!("reading the simulator's stats (GET {url})"))?
            .json()
            .await
            .with_context(|| format!("decoding the simulator's stats (GET {url})"))?;
        let keys = stats["keys"]
            .as_object()
            .with_context(|| format!("GET {url}: no \"keys\" object"))?;
        let standing = stats["standing"]
            .as_object()
            .with_context(|| format!("GET {url}: no \"standing\" object (an older remote-sim?)"))?;
        Ok(Effects {
            duplicates: duplicate_keys(keys, orders),
            standing: standing_orders(standing, orders, undoable),
        })
    }

    /// Puts the knobs this run set back to the defaults; failures are reported, not fatal.
    pub async fn restore(&self) {
        for path in &self.set {
            let url = format!("{}/_sim/knobs{path}", self.base);
            let outcome = self
                .client
                .delete(&url)
                .send()
                .await
                .and_then(reqwest::Response::error_for_status);
            if let Err(e) = outcome {
                eprintln!("chaos: could not reset the knobs of {path} (DELETE {url}): {e}");
            }
        }
    }
}

/// What the simulator's counts say of a run's orders.
#[derive(Debug, Clone, Default)]
pub struct Effects {
    /// Idempotency keys applied more than once.
    pub duplicates: u64,
    /// Orders with an effect that stands (applied, not undone).
    pub standing: HashSet<Uuid>,
}

/// The orders among `orders` with a standing forward key
/// (`<order_id>:<step>[:r<N>]`) of one of the `undoable` steps, from the
/// simulator's `standing` (order id → keys).
fn standing_orders(
    standing: &serde_json::Map<String, Value>,
    orders: &HashSet<Uuid>,
    undoable: &[String],
) -> HashSet<Uuid> {
    standing
        .iter()
        .filter(|(_, keys)| {
            keys.as_array().is_some_and(|keys| {
                keys.iter().filter_map(Value::as_str).any(|key| {
                    key.split(':')
                        .nth(1)
                        .is_some_and(|step| undoable.iter().any(|u| u == step))
                })
            })
        })
        .filter_map(|(id, _)| Uuid::parse_str(id).ok())
        .filter(|id| orders.contains(id))
        .collect()
}

/// Counts the keys of `orders` with `applied` above 1.
fn duplicate_keys(keys: &serde_json::Map<String, Value>, orders: &HashSet<Uuid>) -> u64 {
    keys.iter()
        .filter(|(key, _)| {
            key.split(':')
                .next()
                .and_then(|id| Uuid::parse_str(id).ok())
                .is_some_and(|id| orders.contains(&id))
        })
        .filter(|(_, stats)| stats["applied"].as_u64().unwrap_or(0) > 1)
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(toml: &str) -> Settings {
        let dir = std::env::temp_dir().join(format!("sasctl-chaos-{}", Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("sas.toml");
        std::fs::write(&file, toml).unwrap();
        let settings = Settings::load(Some(&file)).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        settings
    }

    #[test]
    fn endpoints_come_from_the_workflow_agents_on_the_sim() {
        let settings = settings(
            r#"
[workflows.order]
steps = [
  { name = "reserve", agent = "inventory", compensate = "inventory-release" },
  { name = "charge", agent = "payments" },
  { name = "ship", agent = "shipping" },
]
[workflows.other]
steps = [ { name = "x", agent = "elsewhere" } ]
[agents.inventory]
url = "http://127.0.0.1:8081/inventory/reserve"
[agents.inventory-release]
url = "http://127.0.0.1:8081/inventory/release?fast=1"
[agents.payments]
url = "http://127.0.0.1:80811/payments/charge"
[agents.shipping]
url = "http://payments.example/ship"
[agents.elsewhere]
url = "http://127.0.0.1:8081/elsewhere"
"#,
        );
        let (endpoints, skipped) = plan(&settings, "order", "http://127.0.0.1:8081/").unwrap();
        assert_eq!(
            endpoints,
            vec![
                Endpoint {
                    agent: "inventory".into(),
                    path: "/inventory/reserve".into(),
                    forward: true
                },
                Endpoint {
                    agent: "inventory-release".into(),
                    path: "/inventory/release".into(),
                    forward: false
                },
            ]
        );
        assert_eq!(skipped, vec!["payments", "shipping"]);
        assert!(plan(&settings, "nope", "http://127.0.0.1:8081").is_err());
    }

    #[test]
    fn paths_are_taken_on_the_base_only() {
        let base = "http://sim:8081";
        assert_eq!(
            path_on(base, "http://sim:8081/a/b").as_deref(),
            Some("/a/b")
        );
        assert_eq!(path_on(base, "http://sim:8081").as_deref(), Some("/"));
        assert_eq!(path_on(base, "http://sim:8081/a#x").as_deref(), Some("/a"));
        assert_eq!(path_on(base, "http://sim:80810/a"), None);
        assert_eq!(path_on(base, "http://other:8081/a"), None);
    }

    #[test]
    fn an_order_stands_half_done_only_by_the_effect_of_a_step_with_an_undo() {
        let (mine, done, other) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let standing = json!({
            mine.to_string(): [format!("{mine}:charge:r1")],
            done.to_string(): [format!("{done}:notify")],
            other.to_string(): [format!("{other}:charge")],
        });
        let orders: HashSet<Uuid> = [mine, done].into_iter().collect();
        let undoable = ["reserve".to_owned(), "charge".to_owned()];
        let found = standing_orders(standing.as_object().unwrap(), &orders, &undoable);
        assert_eq!(found, [mine].into_iter().collect());
    }

    #[test]
    fn duplicates_count_the_run_s_keys_applied_twice() {
        let mine = Uuid::new_v4();
        let other = Uuid::new_v4();
        let stats = json!({
            format!("{mine}:a"): { "applied": 1 },
            format!("{mine}:b"): { "applied": 2 },
            format!("{mine}:a:compensate"): { "applied": 3 },
            format!("{other}:a"): { "applied": 2 },
            "not-an-order": { "applied": 5 },
        });
        let orders = HashSet::from([mine]);
        assert_eq!(duplicate_keys(stats.as_object().unwrap(), &orders), 2);
    }
}

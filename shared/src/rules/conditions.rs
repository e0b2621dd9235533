//! A forward step that is ready, as its order's definition says (contract
//! §4d): its `when` decides whether it runs or is skipped, its `input`
//! builds the request's payload. An expression that fails at run time
//! fails the step for good with its reason. Pure.

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use super::order::{Deciding, Event, RuleError};
use crate::expr::{Vars, build_input};
use crate::messages::EventKind;
use crate::spec::StepSpec;
use crate::state::StepState;
use crate::workflow::StepKind;

/// How a ready forward step goes out.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Launch {
    /// The request's payload (`None`: the order's).
    pub payload: Option<Value>,
    /// For an `until` step, the time it waits for.
    pub until: Option<DateTime<Utc>>,
}

/// What a ready forward step does now.
#[derive(Debug, Clone, PartialEq)]
pub enum Ready<'s> {
    /// It runs.
    Run(Launch),
    /// Its condition (quoted) is false: it is passed over.
    Skip(&'s str),
    /// An expression of it failed: why.
    Broken(String),
}

/// What step `spec` (none: a step of no known definition, which always
/// runs with the order's payload) does over `vars`.
pub fn ready<'s>(spec: Option<&'s StepSpec>, vars: Vars<'_>) -> Ready<'s> {
    let Some(spec) = spec else {
        return Ready::Run(Launch::default());
    };
    if let Some(when) = &spec.when {
        match when.holds(vars) {
            Ok(true) => {}
            Ok(false) => return Ready::Skip(when.source()),
            Err(why) => return Ready::Broken(format!("when: {why}")),
        }
    }
    let payload = match &spec.input {
        None => None,
        Some(input) => match build_input(input, vars) {
            Ok(payload) => Some(payload),
            Err(why) => return Ready::Broken(why),
        },
    };
    let until = match &spec.until {
        None => None,
        Some(until) => match until.eval(vars).map(|v| timestamp(&v)) {
            Ok(Some(at)) => Some(at),
            Ok(None) => {
                return Ready::Broken(format!(
                    "until: {:?} is not a timestamp (RFC 3339)",
                    until.source()
                ));
            }
            Err(why) => return Ready::Broken(format!("until: {why}")),
        },
    };
    Ready::Run(Launch { payload, until })
}

/// `v` as a time: CEL's timestamps come out as RFC 3339 strings, and a
/// payload's own times are such strings too.
fn timestamp(v: &Value) -> Option<DateTime<Utc>> {
    let s = v.as_str()?;
    DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// What a decision does with the forward steps ready to go.
pub(super) enum Prepared {
    /// Each step (index) with how it goes out.
    Go(Vec<(i32, Launch)>),
    /// Some were skipped: what is ready is to be worked out again.
    Skipped,
    /// A step's expression failed: the step failed for good, with why.
    Broken(String),
}

impl Deciding<'_> {
    /// Weighs the forward steps `steps` (by index), ready to go, against their
    /// definition: skips those whose `when` is false (each with its
    /// `step_skipped` event), or fails the first whose expression breaks.
    pub(super) fn prepare_forward(&mut self, steps: &[i32]) -> Result<Prepared, RuleError> {
        let definition = self.ctx.definition(self.row());
        let results = self.order.results();
        let mut go = Vec::with_capacity(steps.len());
        let mut skipped = Vec::new();
        for &idx in steps {
            let pos = self.step_pos(idx)?;
            let step = &self.order.steps[pos];
            let name = &step.name;
            let spec = definition.and_then(|d| d.spec.steps.iter().find(|s| s.name == *name));
            let vars = Vars {
                payload: &self.order.row.payload,
                results: &results,
            };
            let verdict = match (spec, step.kind()) {
                // An `until` needs its expression: a definition this build
                // cannot read leaves nothing to wait for.
                (None, StepKind::Wait { until: true }) => {
                    Ready::Broken("until: the step's definition cannot be read".into())
                }
                _ => ready(spec, vars),
            };
            match verdict {
                Ready::Run(launch) => go.push((idx, launch)),
                Ready::Skip(when) => skipped.push((pos, when.to_owned())),
                Ready::Broken(why) => {
                    let reason = format!("step {name} failed permanently: {why}");
                    let now = self.ctx.now;
                    let step = &mut self.order.steps[pos];
                    step.state = StepState::Failed;
                    step.error = Some(why);
                    step.finished_at = Some(now);
                    return Ok(Prepared::Broken(reason));
                }
            }
        }
        if skipped.is_empty() {
            return Ok(Prepared::Go(go));
        }
        for (pos, when) in skipped {
            let now = self.ctx.now;
            let step = &mut self.order.steps[pos];
            step.state = StepState::Skipped;
            step.finished_at = Some(now);
            let name = step.name.clone();
            let (state, attempt) = (self.row().process_state, self.row().attempt());
            self.log(Event {
                kind: EventKind::StepSkipped,
                from: Some(state),
                to: state,
                step: Some(&name),
                attempt,
                reason: None,
                detail: json!({ "step": name, "when": when }),
            });
        }
        Ok(Prepared::Skipped)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;
    use uuid::Uuid;

    use super::super::order::fixture::{ctx, pending};
    use super::super::order::{Context, Decision, Order};
    use super::super::scheduler::{Replied, apply_reply, claim};
    use crate::messages::{StepOutcome, StepReply, StepRequest};
    use crate::spec::{Definition, WorkflowSpec};
    use crate::state::{ProcessState, StepState};

    /// An order of three steps s0 → s1 → s2 (s0 and s1 with undos) whose
    /// definition gives the steps these extra keys, with `payload`.
    fn order_under(
        extra: [serde_json::Value; 3],
        payload: serde_json::Value,
    ) -> (Order, Vec<(Uuid, Arc<Definition>)>) {
        let steps: Vec<_> = extra
            .into_iter()
            .enumerate()
            .map(|(i, mut e)| {
                e["name"] = json!(format!("s{i}"));
                e["agent"] = json!(format!("a{i}"));
                e
            })
            .collect();
        let spec: WorkflowSpec = serde_json::from_value(json!({ "steps": steps })).expect("spec");
        let definition = Arc::new(Definition {
            workflow: "w".into(),
            spec,
        });
        let mut order = pending(3, |i| i < 2);
        order.row.payload = payload;
        order.row.definition = Some(definition.id());
        (order, vec![(definition.id(), definition)])
    }

    fn requests(d: &Decision) -> Vec<StepRequest> {
        d.requests().map(|(_, r)| r.clone()).collect()
    }

    fn kinds(d: &Decision) -> Vec<&'static str> {
        d.events().map(|e| e.kind.as_str()).collect()
    }

    fn answer(
        d: &Decision,
        known: &[(Uuid, Arc<Definition>)],
        result: serde_json::Value,
    ) -> Decision {
        let sent = requests(d).pop().expect("a request");
        let reply = StepReply::to(&sent, StepOutcome::Succeeded { result });
        match apply_reply(
            &d.order,
            &reply,
            Context {
                definitions: known,
                ..ctx("s1")
            },
        )
        .expect("reply")
        {
            Replied::Applied(d) => *d,
            Replied::Stale(why) => panic!("stale: {why}"),
        }
    }

    #[test]
    fn a_false_condition_skips_its_step_and_the_next_one_goes() {
        let (order, known) = order_under(
            [json!({}), json!({ "when": "payload.total > 0" }), json!({})],
            json!({ "total": 0 }),
        );
        let cx = Context {
            definitions: &known,
            ..ctx("s1")
        };
        let d = claim(&order, cx).expect("claim");
        let d = answer(&d, &known, json!({ "r": 0 }));
        // s1 skipped, s2 sent in the same decision.
        assert_eq!(d.order.steps[1].state, StepState::Skipped);
        assert_eq!(d.order.steps[1].result, None);
        assert_eq!(kinds(&d), ["step_succeeded", "step_skipped"]);
        let skipped = d.events().nth(1).expect("event");
        assert_eq!(skipped.step.as_deref(), Some("s1"));
        assert_eq!(skipped.detail["when"], json!("payload.total > 0"));
        assert_eq!(requests(&d)[0].step, "s2");
        // The order ends processed with the results of what ran.
        let d = answer(&d, &known, json!({ "r": 2 }));
        assert_eq!(d.order.row.process_state, ProcessState::Processed);
        let results = d.order.results();
        assert!(results.contains_key("s0") && results.contains_key("s2"));
        assert!(!results.contains_key("s1"));
    }

    #[test]
    fn a_true_condition_runs_its_step_and_conditions_see_earlier_results() {
        let (order, known) = order_under(
            [
                json!({}),
                json!({ "when": "payload.total > 0 && results.s0.ok" }),
                json!({ "when": "has(results.s1)" }),
            ],
            json!({ "total": 5 }),
        );
        let cx = Context {
            definitions: &known,
            ..ctx("s1")
        };
        let d = claim(&order, cx).expect("claim");
        let d = answer(&d, &known, json!({ "ok": true }));
        assert_eq!(requests(&d)[0].step, "s1");
        assert_eq!(kinds(&d), ["step_succeeded"]);
        let d = answer(&d, &known, json!({}));
        assert_eq!(requests(&d)[0].step, "s2");
    }

    #[test]
    fn skipped_steps_in_a_row_and_a_skipped_last_step_end_the_order() {
        let (order, known) = order_under(
            [
                json!({}),
                json!({ "when": "false" }),
                json!({ "when": "1 == 2" }),
            ],
            json!({}),
        );
        let cx = Context {
            definitions: &known,
            ..ctx("s1")
        };
        let d = claim(&order, cx).expect("claim");
        let d = answer(&d, &known, json!({}));
        assert_eq!(
            kinds(&d),
            [
                "step_succeeded",
                "step_skipped",
                "step_skipped",
                "processed"
            ]
        );
        assert!(requests(&d).is_empty());
        // A first step skipped at the claim: the next goes at once.
        let (order, known) = order_under(
            [json!({ "when": "false" }), json!({}), json!({})],
            json!({}),
        );
        let d = claim(
            &order,
            Context {
                definitions: &known,
                ..ctx("s1")
            },
        )
        .expect("claim");
        assert_eq!(kinds(&d), ["processing", "step_skipped"]);
        assert_eq!(requests(&d)[0].step, "s1");
    }

    #[test]
    fn a_condition_that_fails_at_run_time_fails_its_step_and_undoes_what_ran() {
        for broken in ["payload.nothing > 1", "payload.total"] {
            let (order, known) = order_under(
                [json!({}), json!({ "when": broken }), json!({})],
                json!({ "total": 3 }),
            );
            let cx = Context {
                definitions: &known,
                ..ctx("s1")
            };
            let d = claim(&order, cx).expect("claim");
            let d = answer(&d, &known, json!({}));
            assert_eq!(d.order.steps[1].state, StepState::Failed);
            let error = d.order.steps[1].error.clone().unwrap_or_default();
            assert!(error.starts_with("when: "), "{error}");
            assert_eq!(d.order.row.process_state, ProcessState::Compensating);
            // The step that ran is undone; the broken one never went out.
            let sent = requests(&d);
            assert_eq!(sent.len(), 1);
            assert_eq!(
                (sent[0].step.as_str(), sent[0].direction),
                ("s0", crate::messages::Direction::Compensate)
            );
        }
    }

    #[test]
    fn an_input_builds_the_requests_payload_from_the_payload_and_results() {
        let (order, known) = order_under(
            [
                json!({ "input": { "amount": "payload.total * 100" } }),
                json!({ "input": { "ids": "results.s0.ids", "currency": "'EUR'" } }),
                json!({ "input": { "oops": "results.s9.x" } }),
            ],
            json!({ "total": 12, "secret": "not for the remote" }),
        );
        let cx = Context {
            definitions: &known,
            ..ctx("s1")
        };
        let d = claim(&order, cx).expect("claim");
        assert_eq!(requests(&d)[0].payload, json!({ "amount": 1200 }));
        let d = answer(&d, &known, json!({ "ids": [4, 5] }));
        assert_eq!(
            requests(&d)[0].payload,
            json!({ "ids": [4, 5], "currency": "EUR" })
        );
        // The order's own payload is unchanged.
        assert_eq!(d.order.row.payload["secret"], json!("not for the remote"));
        // An input that cannot be built fails its step for good.
        let d = answer(&d, &known, json!({}));
        assert_eq!(d.order.steps[2].state, StepState::Failed);
        assert!(
            d.order.steps[2]
                .error
                .as_deref()
                .unwrap_or_default()
                .starts_with("input \"oops\"")
        );
        assert_eq!(d.order.row.process_state, ProcessState::Compensating);
    }

    #[test]
    fn an_order_of_no_known_definition_runs_every_step_with_its_payload() {
        let (mut order, known) = order_under(
            [json!({ "when": "false" }), json!({}), json!({})],
            json!({ "a": 1 }),
        );
        order.row.definition = None;
        let d = claim(
            &order,
            Context {
                definitions: &known,
                ..ctx("s1")
            },
        )
        .expect("claim");
        assert_eq!(requests(&d)[0].step, "s0");
        assert_eq!(requests(&d)[0].payload, json!({ "a": 1 }));
    }

    #[test]
    fn a_skipped_step_is_never_undone() {
        let (order, known) = order_under(
            [json!({}), json!({ "when": "false" }), json!({})],
            json!({}),
        );
        let cx = Context {
            definitions: &known,
            ..ctx("s1")
        };
        let d = claim(&order, cx).expect("claim");
        let d = answer(&d, &known, json!({}));
        // s2 fails for good: s0 is undone, s1 (skipped, with an undo) not.
        let sent = requests(&d).pop().expect("s2");
        let reply = StepReply::to(&sent, StepOutcome::Failed { error: "no".into() });
        let Replied::Applied(d) = apply_reply(
            &d.order,
            &reply,
            Context {
                definitions: &known,
                ..ctx("s1")
            },
        )
        .expect("reply") else {
            panic!("stale")
        };
        let undo = requests(&d);
        assert_eq!(undo.len(), 1);
        assert_eq!(undo[0].step, "s0");
        let done = StepReply::to(&undo[0], StepOutcome::Succeeded { result: json!({}) });
        let Replied::Applied(d) = apply_reply(
            &d.order,
            &done,
            Context {
                definitions: &known,
                ..ctx("s1")
            },
        )
        .expect("reply") else {
            panic!("stale")
        };
        assert_eq!(d.order.row.process_state, ProcessState::Compensated);
        assert_eq!(d.order.steps[1].state, StepState::Skipped);
    }
}

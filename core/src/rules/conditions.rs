//! A forward step that is ready, as its order's definition says (contract
//! §4d): its `when` decides whether it runs or is skipped, its `input`
//! builds the request's payload. An expression that fails at run time
//! fails the step for good with its reason. Pure.

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use super::order::{Deciding, Event, RuleError};
use crate::expr::{Vars, build_input};
use crate::messages::EventKind;
use crate::spec::{Definition, StepSpec};
use crate::state::StepState;
use crate::workflow::StepKind;

/// How a ready forward step goes out.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Launch {
    /// The request's payload (`None`: the order's).
    pub payload: Option<Value>,
    /// For an `until` step, the time it waits for.
    pub until: Option<DateTime<Utc>>,
    /// For an item of a `for_each` step, its index and the item.
    pub item: Option<(u32, Value)>,
}

/// What a ready forward step does now.
#[derive(Debug, Clone, PartialEq)]
pub enum Ready {
    /// It runs.
    Run(Launch),
    /// It is passed over (its condition is false, or its list empty):
    /// what its `step_skipped` event says why with.
    Skip(Value),
    /// An expression of it failed: why.
    Broken(String),
}

/// What the stored step `name` of step `spec` (none: a step of no known
/// definition, which always runs with the order's payload) does over `vars`.
pub fn ready(spec: Option<&StepSpec>, name: &str, vars: Vars<'_>) -> Ready {
    let Some(spec) = spec else {
        return Ready::Run(Launch::default());
    };
    if let Some(when) = &spec.when {
        match when.holds(vars) {
            Ok(true) => {}
            Ok(false) => return Ready::Skip(json!({ "when": when.source() })),
            Err(why) => return Ready::Broken(format!("when: {why}")),
        }
    }
    let item = match &spec.for_each {
        None => None,
        Some(each) => match item(each, name, vars) {
            Ok(item) => Some(item),
            Err(not_run) => return not_run,
        },
    };
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
    Ready::Run(Launch {
        payload,
        until,
        item,
    })
}

/// The item the stored step `name` of a `for_each` step runs: its list is
/// read again (the order's payload gives the same list as when the order
/// was stored, which planned one step per item). A step left whole by the
/// plan is skipped for an empty list, else broken with why.
fn item(each: &crate::expr::Expr, name: &str, vars: Vars<'_>) -> Result<(u32, Value), Ready> {
    let broken = |why: String| Ready::Broken(format!("for_each: {why}"));
    let list = match each.eval(vars) {
        Ok(Value::Array(list)) => list,
        Ok(_) => return Err(broken(format!("{:?} does not give a list", each.source()))),
        Err(why) => return Err(broken(why)),
    };
    match crate::workflow::item_of(name) {
        Some((_, index)) => match (list.get(index), u32::try_from(index)) {
            (Some(item), Ok(at)) => Ok((at, item.clone())),
            _ => Err(broken(format!(
                "the list has no item {index} (the payload changed since the order was stored)"
            ))),
        },
        None if list.is_empty() => Err(Ready::Skip(
            json!({ "for_each": each.source(), "items": 0 }),
        )),
        None => match crate::workflow::fan_out_refusal(list.len(), vars.payload) {
            Some(why) => Err(broken(why)),
            None => Err(broken(
                "the list changed since the order was stored".to_owned(),
            )),
        },
    }
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
        let steps = self.within_concurrency(steps, definition);
        // Gathered once, and only for a step whose expressions read them.
        let mut results = None;
        let unread = serde_json::Map::new();
        let mut go = Vec::with_capacity(steps.len());
        let mut skipped = Vec::new();
        for idx in steps {
            let pos = self.step_pos(idx)?;
            let step = &self.order.steps[pos];
            let name = &step.name;
            let spec = definition.and_then(|d| d.spec.step(name));
            let vars = Vars {
                payload: &self.order.row.payload,
                results: match spec {
                    Some(spec) if spec.reads_results() => {
                        results.get_or_insert_with(|| self.order.results())
                    }
                    _ => &unread,
                },
            };
            let verdict = match (spec, step.kind()) {
                // An `until` needs its expression: a definition this build
                // cannot read leaves nothing to wait for.
                (None, StepKind::Wait { until: true }) => {
                    Ready::Broken("until: the step's definition cannot be read".into())
                }
                _ => ready(spec, name, vars),
            };
            match verdict {
                Ready::Run(launch) => go.push((idx, launch)),
                Ready::Skip(why) => skipped.push((pos, why)),
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
        for (pos, mut why) in skipped {
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
                detail: {
                    why["step"] = json!(name);
                    why
                },
            });
        }
        Ok(Prepared::Skipped)
    }

    /// The steps of `steps` that may go now: of the items of a `for_each`
    /// step, no more than its `max_concurrency` out at once, the first
    /// items first; the others wait for the next item to finish.
    fn within_concurrency(&self, steps: &[i32], definition: Option<&Definition>) -> Vec<i32> {
        let Some(definition) = definition else {
            return steps.to_vec();
        };
        let group = |name: &str| crate::workflow::item_of(name).map(|(base, _)| base.to_owned());
        // Per `for_each` step: its items out, counted up as more go.
        let mut out: Vec<(String, u32)> = Vec::new();
        let mut going = Vec::with_capacity(steps.len());
        for step in steps
            .iter()
            .filter_map(|&idx| self.order.steps.iter().find(|s| s.idx == idx))
        {
            let limit = definition
                .spec
                .step(&step.name)
                .and_then(|spec| spec.max_concurrency);
            let (Some(limit), Some(base)) = (limit, group(&step.name)) else {
                going.push(step.idx);
                continue;
            };
            let at = match out.iter().position(|(b, _)| *b == base) {
                Some(at) => at,
                None => {
                    let running = self
                        .order
                        .steps
                        .iter()
                        .filter(|s| s.state == StepState::Running)
                        .filter(|s| group(&s.name).as_deref() == Some(base.as_str()))
                        .count();
                    out.push((base, u32::try_from(running).unwrap_or(u32::MAX)));
                    out.len() - 1
                }
            };
            if out[at].1 < limit {
                out[at].1 += 1;
                going.push(step.idx);
            }
        }
        going
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;
    use uuid::Uuid;

    use super::super::order::fixture::{ctx, pending};
    use super::super::order::{Decision, Given, Order};
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
            Given {
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
        let cx = Given {
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
        let cx = Given {
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
        let cx = Given {
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
            Given {
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
            let cx = Given {
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
        let cx = Given {
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
            Given {
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
        let cx = Given {
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
            Given {
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
            Given {
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

#[cfg(test)]
mod for_each_tests {
    use serde_json::json;

    use super::super::order::fixture::{Known, ctx, order_of};
    use super::super::order::{Decision, Given};
    use super::super::scheduler::{Replied, apply_reply, claim};
    use crate::messages::{Direction, StepOutcome, StepReply, StepRequest};
    use crate::state::{ProcessState, StepState};

    fn cx(known: &Known) -> Given<'_> {
        Given {
            definitions: known,
            ..ctx("s1")
        }
    }

    fn sent(d: &Decision) -> Vec<StepRequest> {
        d.requests().map(|(_, r)| r.clone()).collect()
    }

    fn reply(d: &Decision, known: &Known, to: &StepRequest, outcome: StepOutcome) -> Decision {
        // Each answer a second after the one before: undo goes by time.
        let latest = d.order.steps.iter().filter_map(|s| s.finished_at).max();
        let now =
            latest.unwrap_or_else(super::super::order::fixture::now) + chrono::Duration::seconds(1);
        let at = Given { now, ..cx(known) };
        match apply_reply(&d.order, &StepReply::to(to, outcome), at).expect("reply") {
            Replied::Applied(d) => *d,
            Replied::Stale(why) => panic!("stale: {why}"),
        }
    }

    fn fan_out(items: usize, max: u32) -> (super::super::order::Order, Known) {
        let items: Vec<_> = (0..items)
            .map(|i| json!({ "sku": format!("k{i}") }))
            .collect();
        order_of(
            json!([
                { "name": "reserve", "agent": "inv", "compensate": "inv-undo",
                  "for_each": "payload.items", "max_concurrency": max },
                { "name": "ship", "agent": "ship", "input": { "reserved": "results.reserve" } },
            ]),
            json!({ "items": items }),
        )
    }

    #[test]
    fn each_item_goes_as_its_own_step_and_never_more_than_max_concurrency_at_once() {
        let (order, known) = fan_out(10, 3);
        let names: Vec<_> = order.steps.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names.len(), 11);
        assert_eq!(
            (names[0], names[9], names[10]),
            ("reserve:0", "reserve:9", "ship")
        );
        assert_eq!(
            order.steps[10].after(),
            (0..10).collect::<Vec<i32>>(),
            "ship waits for every item"
        );
        let mut d = claim(&order, cx(&known)).expect("claim");
        let mut out = sent(&d);
        assert_eq!(
            out.iter().map(|r| r.step.as_str()).collect::<Vec<_>>(),
            ["reserve:0", "reserve:1", "reserve:2"]
        );
        assert_eq!(
            (out[1].index, out[1].item.clone()),
            (Some(1), Some(json!({ "sku": "k1" })))
        );
        let mut finished = 0;
        // Answer the oldest out each time: the next item goes, at most three out.
        while let Some(first) = out.first().cloned() {
            if first.step == "ship" {
                break;
            }
            d = reply(
                &d,
                &known,
                &first,
                StepOutcome::Succeeded {
                    result: json!({ "n": first.index }),
                },
            );
            finished += 1;
            let running = d
                .order
                .steps
                .iter()
                .filter(|s| s.state == StepState::Running)
                .count();
            assert!(running <= 3, "{running} out after {finished}");
            out.remove(0);
            out.extend(sent(&d));
        }
        assert_eq!(finished, 10);
        let ship = &out[0];
        let reserved: Vec<_> = (0..10).map(|i| json!({ "n": i })).collect();
        assert_eq!(
            ship.payload,
            json!({ "reserved": reserved }),
            "the results as a list, in the items' order"
        );
        assert_eq!(ship.item, None);
    }

    #[test]
    fn a_failed_item_undoes_each_completed_item_on_its_own_newest_first() {
        let (order, known) = fan_out(3, 3);
        let d = claim(&order, cx(&known)).expect("claim");
        let out = sent(&d);
        let d = reply(
            &d,
            &known,
            &out[2],
            StepOutcome::Succeeded { result: json!(2) },
        );
        let d = reply(
            &d,
            &known,
            &out[0],
            StepOutcome::Succeeded { result: json!(0) },
        );
        let d = reply(
            &d,
            &known,
            &out[1],
            StepOutcome::Failed {
                error: "no stock".into(),
            },
        );
        assert_eq!(d.order.row.process_state, ProcessState::Compensating);
        let undo = sent(&d);
        assert_eq!(
            (undo[0].step.as_str(), undo[0].direction),
            ("reserve:0", Direction::Compensate),
            "newest first"
        );
        let d = reply(
            &d,
            &known,
            &undo[0],
            StepOutcome::Succeeded { result: json!({}) },
        );
        let undo = sent(&d);
        assert_eq!(undo[0].step, "reserve:2");
        let d = reply(
            &d,
            &known,
            &undo[0],
            StepOutcome::Succeeded { result: json!({}) },
        );
        assert_eq!(d.order.row.process_state, ProcessState::Compensated);
    }

    #[test]
    fn an_empty_list_skips_the_step_and_a_list_that_cannot_be_read_fails_it() {
        let steps = json!([
            { "name": "reserve", "agent": "inv", "for_each": "payload.items" },
            { "name": "ship", "agent": "ship" },
        ]);
        let (order, known) = order_of(steps.clone(), json!({ "items": [] }));
        assert_eq!(order.steps.len(), 2, "left whole");
        let d = claim(&order, cx(&known)).expect("claim");
        assert_eq!(d.order.steps[0].state, StepState::Skipped);
        assert_eq!(sent(&d)[0].step, "ship");
        let skipped = d
            .events()
            .find(|e| e.kind.as_str() == "step_skipped")
            .expect("skipped");
        assert_eq!(skipped.detail["items"], 0);
        // 200 items of a payload of 670 KB would flood the broker.
        let big = "x".repeat(crate::workflow::MAX_FAN_OUT_BYTES / 100);
        for payload in [
            json!({ "items": "many" }),
            json!({}),
            json!({ "items": vec![1; crate::workflow::MAX_ITEMS + 1] }),
            json!({ "items": vec![1; 200], "pad": big }),
        ] {
            let (order, known) = order_of(steps.clone(), payload.clone());
            let d = claim(&order, cx(&known)).expect("claim");
            assert_eq!(d.order.steps[0].state, StepState::Failed, "{payload:.80}");
            assert!(
                d.order.steps[0]
                    .error
                    .as_deref()
                    .unwrap_or_default()
                    .starts_with("for_each: ")
            );
            assert_eq!(d.order.row.process_state, ProcessState::Error);
        }
    }

    #[test]
    fn start_up_refuses_a_for_each_that_cannot_work() {
        let refused = |step: serde_json::Value| {
            let spec: crate::spec::WorkflowSpec =
                serde_json::from_value(json!({ "steps": [step] })).expect("spec");
            crate::workflow::Workflow::compile("w", &spec).is_err()
        };
        assert!(refused(
            json!({ "name": "a", "agent": "x", "for_each": "results.s.list" })
        ));
        assert!(
            refused(json!({ "name": "a", "agent": "x", "for_each": "42" })),
            "no list"
        );
        assert!(refused(
            json!({ "name": "a", "signal": "x", "for_each": "payload.l" })
        ));
        assert!(refused(
            json!({ "name": "a", "agent": "x", "for_each": "payload.l", "max_concurrency": 0 })
        ));
        assert!(refused(
            json!({ "name": "a", "agent": "x", "max_concurrency": 2 })
        ));
        assert!(!refused(
            json!({ "name": "a", "agent": "x", "for_each": "payload.l.filter(i, i > 1)" })
        ));
        assert!(!refused(
            json!({ "name": "a", "agent": "x", "for_each": "[1, 2]" })
        ));
    }
}

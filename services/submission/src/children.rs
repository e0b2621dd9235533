//! sas's own agent of child workflows (contract §4d). A `workflow` step's
//! requests come on `<prefix>.children.requests`: forward, it starts the
//! child order (id `UUIDv5(order_id, step)`, so a repeated request starts
//! nothing new) with its end announced on `<prefix>.children.ended`; undo,
//! it cancels the child, which undoes a processed child's steps too. Each
//! request is remembered as the newest of its child (an older one, which
//! a newer dispatch or undo superseded, is refused), and the child's end
//! answers that newest request on the schedulers' reply queue, fenced as
//! an agent's answer is: `processed` completes the step with the child's
//! results, `compensated` or `failed` fails it; an undo is answered once
//! the child is `compensated`.

use std::sync::Arc;

use sas::broker::{self, BrokerError, Outgoing, Publisher, Received, Verdict};
use sas::engine::{Actor, Operated, Submitted};
use sas::messages::{Direction, StatusEvent, StepOutcome, StepReply, StepRequest};
use sas::service::Context;
use sas::state::ProcessState;
use sas::state_store::{StateStore, StoreError};
use sas::workflow::StepKind;
use serde_json::{Value, json};
use tracing::Instrument;
use uuid::Uuid;

use crate::submission::{Accepted, Intake};

/// The agent of child workflows.
pub struct Children {
    pub intake: Arc<Intake>,
    pub store: StateStore,
    pub ctx: Arc<Context>,
    /// Who starts and undoes children, in their event logs.
    pub actor: Actor,
}

/// The id of the child order of `request`'s step: `UUIDv5(order_id,
/// step)`, or, in the order's redrive N (contract §9), of `<step>:r<N>`,
/// as its idempotency key is: a redriven step runs a new child.
pub fn child_id(request: &StepRequest) -> Uuid {
    let name = match request.redrive {
        0 => request.step.clone(),
        n => format!("{}:r{n}", request.step),
    };
    Uuid::new_v5(&request.order_id, name.as_bytes())
}

impl Children {
    /// Handles one request of a child workflow step; an error means the
    /// broker is gone.
    pub async fn request(
        &self,
        publisher: &Publisher,
        delivery: Received,
    ) -> Result<(), BrokerError> {
        let Ok(request) = serde_json::from_slice::<StepRequest>(delivery.body()) else {
            tracing::warn!("an unreadable child workflow request; dead-lettered");
            return broker::dead_letter_with(&delivery, "not a step request").await;
        };
        let child = child_id(&request);
        let span = tracing::info_span!("child", order_id = %request.order_id, step = %request.step, %child);
        async {
            // Only the step's current dispatch may start, undo or be
            // remembered: a stranger's request (any fencing token, any
            // order's id) or a superseded one touches no child.
            let workflow = match self.store.current_dispatch(&request).await {
                Ok(Some(agent)) => match StepKind::of(&agent) {
                    StepKind::Child(name) => name.to_owned(),
                    _ => {
                        return broker::dead_letter_with(&delivery, "not a child workflow step")
                            .await;
                    }
                },
                Ok(None) => {
                    tracing::warn!("not a current dispatch of a step; dead-lettered");
                    return broker::dead_letter_with(
                        &delivery,
                        "not the current dispatch of a child workflow step",
                    )
                    .await;
                }
                Err(e) => return self.failed(&delivery, &e).await,
            };
            match self.store.remember_child_request(child, &request).await {
                Ok(true) => {}
                Ok(false) => {
                    let error = "a newer dispatch or undo of the step superseded this request";
                    return self
                        .answer(publisher, &delivery, &request, failed(error))
                        .await;
                }
                Err(e) => return self.failed(&delivery, &e).await,
            }
            match request.direction {
                Direction::Forward => {
                    self.start(publisher, &delivery, &request, child, workflow)
                        .await
                }
                Direction::Compensate => self.undo(publisher, &delivery, &request, child).await,
            }
        }
        .instrument(span)
        .await
    }

    /// Starts the child (once: its id is the step's), or, when it has
    /// ended already, answers at once.
    async fn start(
        &self,
        publisher: &Publisher,
        delivery: &Received,
        request: &StepRequest,
        child: Uuid,
        workflow: String,
    ) -> Result<(), BrokerError> {
        let Some(compiled) = self.intake.workflow(&workflow) else {
            let error = format!("child workflow {workflow:?} is not configured");
            return self
                .answer(publisher, delivery, request, failed(&error))
                .await;
        };
        let payload = match &request.payload {
            Value::Object(map) => map.clone(),
            other => json!({ "payload": other })
                .as_object()
                .cloned()
                .unwrap_or_default(),
        };
        let mut order = sas::messages::Submission::new(workflow, payload);
        order.order_id = Some(child);
        order.reply_to = Some(self.ctx.queues.children_ended().to_owned());
        order.events = sas::messages::Events::Terminal;
        let accepted = Accepted {
            order,
            workflow: compiled,
            given: child,
            sender: None,
            sent: None,
        };
        match self.intake.submit(accepted).await.0 {
            Ok(Submitted::Created { .. }) => {
                tracing::info!("child order started");
                broker::ack(delivery).await
            }
            // Started before: if it has ended, its end answered an older
            // request; this one is answered now.
            Ok(Submitted::Duplicate) => match self.ended(child, Direction::Forward).await {
                Ok(Some(outcome)) => self.answer(publisher, delivery, request, outcome).await,
                Ok(None) => broker::ack(delivery).await,
                Err(e) => self.failed(delivery, &e).await,
            },
            Err(e) => self.failed(delivery, &e).await,
        }
    }

    /// Undoes the child: answered now when there is nothing to undo, else
    /// by its end.
    async fn undo(
        &self,
        publisher: &Publisher,
        delivery: &Received,
        request: &StepRequest,
        child: Uuid,
    ) -> Result<(), BrokerError> {
        let done = || StepOutcome::Succeeded { result: json!({}) };
        // Through the intake's pipeline: the undoing is published at once.
        match self.intake.pipeline().undo_child(&self.actor, child).await {
            // Never started (its start is refused from now on, as older),
            // or nothing of it to undo.
            Ok(Operated::NotFound | Operated::Done(ProcessState::Compensated))
            | Ok(Operated::NotAllowed(ProcessState::Compensated, _)) => {
                self.answer(publisher, delivery, request, done()).await
            }
            Ok(Operated::Done(_) | Operated::NotAllowed(ProcessState::Compensating, _)) => {
                tracing::info!("child order being undone");
                broker::ack(delivery).await
            }
            Ok(Operated::NotAllowed(state, why)) => {
                let error = format!("the child order {child} is {state}: {why}");
                self.answer(publisher, delivery, request, failed(&error))
                    .await
            }
            Ok(Operated::PayloadRefused(why)) => {
                self.answer(publisher, delivery, request, failed(&why.to_string()))
                    .await
            }
            Err(e) => self.failed(delivery, &e).await,
        }
    }

    /// What a started child's end, as stored, answers a request in
    /// `direction` with, if it has ended so.
    async fn ended(
        &self,
        child: Uuid,
        direction: Direction,
    ) -> Result<Option<StepOutcome>, StoreError> {
        let store = &self.store;
        let Some((order, steps, _)) = store.order_details(child).await? else {
            return Ok(None);
        };
        let results = sas::rules::Order {
            row: order.clone(),
            steps,
        }
        .results();
        Ok(outcome(
            direction,
            order.process_state,
            &Value::Object(results),
            order.last_error.as_deref(),
            child,
        ))
    }

    /// Handles one event of `<prefix>.children.ended`.
    pub async fn event(
        &self,
        publisher: &Publisher,
        delivery: Received,
    ) -> Result<(), BrokerError> {
        let Ok(event) = serde_json::from_slice::<StatusEvent>(delivery.body()) else {
            return broker::dead_letter_with(&delivery, "not a status event").await;
        };
        let Some(child) = event
            .order_id
            .as_str()
            .and_then(|s| Uuid::parse_str(s).ok())
        else {
            return broker::dead_letter_with(&delivery, "no order id").await;
        };
        let store = &self.store;
        let request = match store.child_request(child).await {
            Ok(Some(request)) => request,
            Ok(None) => {
                tracing::warn!(%child, "a child's end with no parent step remembered; dropped");
                return broker::ack(&delivery).await;
            }
            Err(e) => return self.failed(&delivery, &e).await,
        };
        // The event only says which child to look at: its end, results and
        // error are read from the state store, so that an event a stranger
        // sends (any state, any results) answers nothing the child did not.
        match self.ended(child, request.direction).await {
            Ok(Some(outcome)) => self.answer(publisher, &delivery, &request, outcome).await,
            // Still running, or a processed child whose undo is on its
            // way: its end answers.
            Ok(None) => broker::ack(&delivery).await,
            Err(e) => self.failed(&delivery, &e).await,
        }
    }

    /// Publishes the answer to `request`, as its agent would, then acks.
    async fn answer(
        &self,
        publisher: &Publisher,
        delivery: &Received,
        request: &StepRequest,
        outcome: StepOutcome,
    ) -> Result<(), BrokerError> {
        let reply = StepReply::to(request, outcome);
        let body = serde_json::to_vec(&reply).unwrap_or_default();
        let correlation = request.dispatch_id.to_string();
        let sent = publisher
            .publish(&Outgoing {
                routing_key: self.ctx.queues.replies(),
                body: &body,
                correlation_id: Some(&correlation),
                mandatory: true,
                ..Outgoing::default()
            })
            .await;
        if let Err(e) = sent {
            tracing::warn!(error = %e, "could not answer a child workflow step");
            return Verdict::failed(true, || e.to_string())
                .settle(delivery)
                .await;
        }
        broker::ack(delivery).await
    }

    /// The state store failed: a transient failure hands the message back
    /// after a pause; any other is retried a bounded number of times.
    async fn failed(&self, delivery: &Received, e: &StoreError) -> Result<(), BrokerError> {
        tracing::warn!(error = %e, transient = e.is_transient(), "child workflow step not handled");
        Verdict::failed(e.is_transient(), || e.to_string())
            .settle(delivery)
            .await
    }
}

fn failed(error: &str) -> StepOutcome {
    StepOutcome::Failed {
        error: error.to_owned(),
    }
}

/// The answer to a request in `direction` of a child that ended in
/// `state`: `None` when that end answers nothing (a processed child whose
/// undo is asked for; or one still running).
fn outcome(
    direction: Direction,
    state: ProcessState,
    results: &Value,
    error: Option<&str>,
    child: Uuid,
) -> Option<StepOutcome> {
    let why = |state: &str| {
        format!(
            "the child order {child} ended {state}: {}",
            error.unwrap_or("no reason given")
        )
    };
    match (direction, state) {
        (Direction::Forward, ProcessState::Processed) => Some(StepOutcome::Succeeded {
            result: results.clone(),
        }),
        (Direction::Forward, ProcessState::Compensated) => Some(failed(&why("compensated"))),
        (_, ProcessState::Error) => Some(failed(&why("failed"))),
        (Direction::Compensate, ProcessState::Compensated) => {
            Some(StepOutcome::Succeeded { result: json!({}) })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_childs_end_answers_a_forward_request_and_only_its_compensation_answers_an_undo() {
        let child = Uuid::now_v7();
        let results = json!({ "pack": { "ok": true } });
        let forward = |state| outcome(Direction::Forward, state, &results, Some("no stock"), child);
        let undo = |state| outcome(Direction::Compensate, state, &results, None, child);
        assert_eq!(
            forward(ProcessState::Processed),
            Some(StepOutcome::Succeeded {
                result: results.clone()
            })
        );
        for state in [ProcessState::Compensated, ProcessState::Error] {
            let Some(StepOutcome::Failed { error }) = forward(state) else {
                panic!("{state}: the step fails");
            };
            assert!(
                error.contains(&child.to_string()) && error.contains("no stock"),
                "{error}"
            );
        }
        assert_eq!(
            undo(ProcessState::Processed),
            None,
            "its undo is on its way"
        );
        assert_eq!(
            undo(ProcessState::Compensated),
            Some(StepOutcome::Succeeded { result: json!({}) })
        );
        assert!(matches!(
            undo(ProcessState::Error),
            Some(StepOutcome::Failed { .. })
        ));
        assert_eq!(forward(ProcessState::Processing), None, "not ended");
    }

    #[test]
    fn a_redriven_step_runs_a_child_of_its_own() {
        let request: StepRequest = serde_json::from_value(json!({
            "order_id": Uuid::now_v7(), "workflow": "p", "step": "ship", "step_index": 1,
            "direction": "forward", "attempt": 1, "dispatch_id": Uuid::now_v7(),
            "locked_by": "s", "complete_by": "2026-11-27T10:00:00Z", "payload": {}, "results": {},
        }))
        .expect("a request");
        let first = child_id(&request);
        assert_eq!(
            first,
            Uuid::new_v5(&request.order_id, b"ship"),
            "UUIDv5(order_id, step)"
        );
        let redriven = StepRequest {
            redrive: 1,
            ..request.clone()
        };
        assert_ne!(child_id(&redriven), first);
        assert_eq!(child_id(&request), first, "the same step, the same child");
    }
}

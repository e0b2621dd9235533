//! Where an order's milliseconds go, hop by hop, from the spans the services
//! export (`submit`, `transition`, `step`, `remote_call`, `reply`; see
//! `sas::telemetry`): a deployment whose services export to a small OTLP/HTTP
//! receiver in the harness runs at low load, and each processed order's
//! spans, with the harness's own publish and receipt times, give the time
//! between consecutive hops. Exporting costs CPU, so these runs are apart
//! from the measured ones. Every process runs on this machine: one clock.

use std::collections::HashMap;

use sas_testkit::otlp::Span;
use serde::Serialize;
use uuid::Uuid;

use crate::load::{Percentiles, Timeline};

/// The span's `order_id` field, when it has one.
fn order_of(s: &Span) -> Option<Uuid> {
    s.attribute("order_id")
        .and_then(|t| Uuid::parse_str(t).ok())
}

/// One low-load run's hops.
#[derive(Debug, Clone, Serialize)]
pub struct Hops {
    pub workflow: String,
    pub status_events: &'static str,
    pub offered_rate: Option<f64>,
    /// Processed orders whose every span came (a step tried again is left out).
    pub orders: usize,
    /// Submit → `processed` received, for the whole run (spans exported).
    pub latency_p50_ms: f64,
    /// Each hop's milliseconds over those orders, in the order's sequence;
    /// the steps' hops pooled over the steps.
    pub hops: Vec<(String, Percentiles)>,
}

/// The hops, in sequence: each waits for the one before. `per step` ones
/// repeat for each step. The agent's confirm of its reply and its ack of
/// the request come after the scheduler has the reply: off the chain.
const HOPS: [&str; 9] = [
    "publish → submission takes the order (broker)",
    "submission: order decided (batch)",
    "decided → claim decided (write-back, NOTIFY, the claim's load)",
    "per step: decided → agent takes the request (write-back, relay, broker)",
    "per step: agent, before the call",
    "per step: the remote call (HTTP)",
    "per step: call answered → scheduler takes the reply (agent's publish, broker)",
    "per step: scheduler, reply decided (batch, load)",
    "last step decided → terminal event received (write-back, relay, broker)",
];

/// The hops of `timeline`'s processed orders with `steps` steps each,
/// from `spans`; returns how many orders had every span, and each hop's
/// percentiles (ms).
pub fn breakdown(
    spans: &[Span],
    timeline: &[Timeline],
    steps: usize,
) -> (usize, Vec<(String, Percentiles)>) {
    let mut of_order: HashMap<Uuid, Vec<&Span>> = HashMap::new();
    let mut calls: HashMap<&str, &Span> = HashMap::new();
    for s in spans {
        if let Some(id) = order_of(s) {
            of_order.entry(id).or_default().push(s);
        }
        if s.name == "remote_call" {
            calls.insert(&s.parent, s);
        }
    }
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); HOPS.len()];
    let mut complete = 0;
    for t in timeline {
        let Some(delivered) = t.delivered_us else {
            continue;
        };
        let Some(spans) = of_order.get(&t.order_id) else {
            continue;
        };
        let Some(order) = OrderSpans::of(spans, &calls, steps) else {
            continue;
        };
        complete += 1;
        let ms = |a: f64, b: f64| (b - a) / 1000.0;
        samples[0].push(ms(t.submitted_us, order.submit.start_us));
        samples[1].push(ms(order.submit.start_us, order.received));
        samples[2].push(ms(order.received, order.dispatched[0]));
        for k in 0..steps {
            let (step, call, reply) = (order.steps[k], order.calls[k], order.replies[k]);
            samples[3].push(ms(order.dispatched[k], step.start_us));
            samples[4].push(ms(step.start_us, call.start_us));
            samples[5].push(ms(call.start_us, call.end_us));
            samples[6].push(ms(call.end_us, reply.start_us));
            samples[7].push(ms(reply.start_us, order.decided[k]));
        }
        samples[8].push(ms(order.decided[steps - 1], delivered));
    }
    let hops = HOPS
        .iter()
        .zip(samples)
        .map(|(name, s)| ((*name).to_owned(), Percentiles::of(s)))
        .collect();
    (complete, hops)
}

/// One order's spans, lined up: `received` is the submission's transition
/// (the submit span goes on past the write-back, to the order's ack: off
/// the chain), `dispatched[k]` the transition that sent step k,
/// `decided[k]` the one that applied its reply.
struct OrderSpans<'a> {
    submit: &'a Span,
    received: f64,
    steps: Vec<&'a Span>,
    calls: Vec<&'a Span>,
    replies: Vec<&'a Span>,
    dispatched: Vec<f64>,
    decided: Vec<f64>,
}

impl<'a> OrderSpans<'a> {
    /// `None` unless the order has one submit and exactly `steps` steps,
    /// calls and replies, each reply deciding a transition.
    fn of(spans: &[&'a Span], calls: &HashMap<&str, &'a Span>, steps: usize) -> Option<Self> {
        let named = |name: &str| {
            let mut v: Vec<&'a Span> = spans.iter().copied().filter(|s| s.name == name).collect();
            v.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
            v
        };
        let submits = named("submit");
        let transitions = named("transition");
        let step_spans = named("step");
        let replies = named("reply");
        if submits.len() != 1 || step_spans.len() != steps || replies.len() != steps || steps == 0 {
            return None;
        }
        let step_calls: Vec<&'a Span> = step_spans
            .iter()
            .map(|s| calls.get(s.span_id.as_str()).copied())
            .collect::<Option<_>>()?;
        let within = |outer: &Span| {
            transitions
                .iter()
                .find(|t| t.start_us >= outer.start_us && t.start_us <= outer.end_us)
                .map(|t| t.start_us)
        };
        let received = within(submits[0])?;
        // The last transition before the agent took the step sent it.
        let dispatched: Vec<f64> = step_spans
            .iter()
            .map(|s| {
                transitions
                    .iter()
                    .rev()
                    .find(|t| t.start_us <= s.start_us)
                    .map(|t| t.start_us)
            })
            .collect::<Option<_>>()?;
        // The transition within the reply's span applied it.
        let decided: Vec<f64> = replies.iter().map(|r| within(r)).collect::<Option<_>>()?;
        Some(Self {
            submit: submits[0],
            received,
            steps: step_spans,
            calls: step_calls,
            replies,
            dispatched,
            decided,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(name: &str, id: u8, parent: u8, order: Option<Uuid>, start: f64, end: f64) -> Span {
        Span {
            service: "test".into(),
            name: name.into(),
            trace_id: "t".into(),
            span_id: format!("{id:02x}"),
            parent: if parent == 0 {
                String::new()
            } else {
                format!("{parent:02x}")
            },
            attributes: order
                .map(|o| ("order_id".to_owned(), o.to_string()))
                .into_iter()
                .collect(),
            start_us: start * 1000.0,
            end_us: end * 1000.0,
        }
    }

    /// A one-step order's spans (ids 1 to 7; 5 is its remote call), and
    /// its timeline: published at 0, terminal event at 16 ms.
    fn one_step_order() -> (Vec<Span>, [Timeline; 1]) {
        let id = Uuid::new_v4();
        let o = Some(id);
        let spans = vec![
            span("submit", 1, 0, o, 1.0, 3.0),
            span("transition", 2, 1, o, 2.0, 2.0),
            span("transition", 3, 1, o, 4.0, 4.0),
            // The agent's span ends after the scheduler has the reply.
            span("step", 4, 3, o, 6.0, 12.0),
            span("remote_call", 5, 4, None, 7.0, 9.0),
            span("reply", 6, 4, o, 11.0, 14.0),
            span("transition", 7, 1, o, 13.0, 13.0),
        ];
        let timeline = [Timeline {
            order_id: id,
            submitted_us: 0.0,
            delivered_us: Some(16_000.0),
        }];
        (spans, timeline)
    }

    #[test]
    fn a_one_step_order_s_hops_are_the_gaps_between_its_spans() {
        let (mut spans, timeline) = one_step_order();
        // Another order's spans change nothing.
        spans.push(span("submit", 8, 0, Some(Uuid::new_v4()), 0.0, 50.0));
        let (n, hops) = breakdown(&spans, &timeline, 1);
        assert_eq!(n, 1);
        let p50: Vec<f64> = hops.iter().map(|(_, p)| p.p50).collect();
        assert_eq!(
            p50,
            [1.0, 1.0, 2.0, 2.0, 1.0, 2.0, 2.0, 2.0, 3.0],
            "{hops:?}"
        );
        assert_eq!(
            p50.iter().sum::<f64>(),
            16.0,
            "the hops add up to the latency"
        );
    }

    #[test]
    fn an_order_with_a_span_missing_or_a_step_tried_twice_is_left_out() {
        let (all, timeline) = one_step_order();
        let without = |id: u8| -> Vec<Span> {
            all.iter()
                .filter(|s| s.span_id != format!("{id:02x}"))
                .cloned()
                .collect()
        };
        assert_eq!(breakdown(&all, &timeline, 1).0, 1);
        assert_eq!(breakdown(&without(5), &timeline, 1).0, 0, "no remote_call");
        let mut twice = all.clone();
        twice.push(span("step", 9, 3, Some(timeline[0].order_id), 20.0, 21.0));
        assert_eq!(breakdown(&twice, &timeline, 1).0, 0, "two tries");
        let undelivered = [Timeline {
            delivered_us: None,
            ..timeline[0].clone()
        }];
        assert_eq!(breakdown(&all, &undelivered, 1).0, 0);
        let no_received = without(2);
        assert_eq!(
            breakdown(&no_received, &timeline, 1).0,
            0,
            "no submission's decision"
        );
    }
}

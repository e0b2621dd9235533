//! Hostile traffic of a chaos run (`--hostile SHARE`): messages a stranger
//! could send to sas's queues, generated from a seed and sent among the
//! good orders, and the account of what became of each.
//!
//! Every class of the catalogue ([`Class`]) has one fate that sas must give
//! it ([`Fate`]): dead-lettered into a known queue with its reason (or by
//! the broker, for a body over the limit), or ignored as the repeat of an
//! order that exists. Each message carries the AMQP `message_id`
//! `chaos-<run>-h<n>`, which a dead-letter copy keeps, so that the run finds
//! its own messages in the dead-letter queues, counts them and takes them
//! out ([`account`] turns what was found into the report's numbers).
//!
//! Generation is pure and seed-stable: the same seed, order count and share
//! give the same plan, and the same plan entry, aim and target give the
//! same message. Only the good order a message aims at is picked at send
//! time, among those running then.

use std::collections::{BTreeMap, HashMap, HashSet};

use sas::topology::QueueNames;
use serde_json::{Value, json};
use uuid::Uuid;

/// What hostile traffic aims at, beside the good orders.
#[derive(Debug, Clone)]
pub struct Aim {
    pub queues: QueueNames,
    /// The run's workflow: hostile orders look like its orders.
    pub workflow: String,
    /// An agent of the workflow, whose request queue gets garbage.
    pub agent: String,
    /// The run's status queue: hostile messages name it as their reply
    /// queue, so that whatever sas answers them is seen by the run.
    pub status_queue: String,
    /// `submission.max_body_bytes`: an oversize body is just over it.
    pub max_body_bytes: usize,
    /// Names the run's messages (`chaos-<run>-h<n>`).
    pub run_id: String,
}

/// The classes of hostile messages, each with a fate sas must give it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// An order whose body is not JSON (or not UTF-8, or empty).
    NotJson,
    /// JSON that is not an object.
    NotObject,
    /// An object with a field of the wrong type, or a required one missing.
    WrongType,
    /// A workflow that is not configured.
    UnknownWorkflow,
    /// A NUL character, which Postgres cannot store.
    Nul,
    /// JSON nested deeper than sas (64) or the parser (128) takes.
    DeepNesting,
    /// Numbers beyond what sas stores, or than an f64 holds.
    HugeNumber,
    /// A `not_before` that is no time.
    ImpossibleTime,
    /// A body just over `submission.max_body_bytes`.
    Oversize,
    /// A body `reply_to` naming a queue of sas or of the broker.
    ReservedReplyTo,
    /// The AMQP `reply_to` property naming a queue of sas or of the broker.
    ReservedReplyToProperty,
    /// A good running order's id with another payload: a repeat, ignored.
    DuplicateId,
    /// A bad body carrying a good running order's id, answered to the run's
    /// status queue: the rejection must not read as the good order's.
    BadBodyWithGoodId,
    /// A status event of a good order posted to `<prefix>.replay`.
    StatusEventToReplay,
    /// Garbage on `<prefix>.scheduler.replies`.
    GarbageReply,
    /// Garbage on an agent's request queue.
    GarbageAgentRequest,
    /// A bad order with about 20 KB of AMQP headers.
    LargeHeaders,
}

impl Class {
    /// Every class, in the order the report lists them.
    pub const ALL: [Class; 17] = [
        Class::NotJson,
        Class::NotObject,
        Class::WrongType,
        Class::UnknownWorkflow,
        Class::Nul,
        Class::DeepNesting,
        Class::HugeNumber,
        Class::ImpossibleTime,
        Class::Oversize,
        Class::ReservedReplyTo,
        Class::ReservedReplyToProperty,
        Class::DuplicateId,
        Class::BadBodyWithGoodId,
        Class::StatusEventToReplay,
        Class::GarbageReply,
        Class::GarbageAgentRequest,
        Class::LargeHeaders,
    ];

    /// The name the report gives the class.
    pub fn as_str(self) -> &'static str {
        match self {
            Class::NotJson => "not_json",
            Class::NotObject => "not_object",
            Class::WrongType => "wrong_type",
            Class::UnknownWorkflow => "unknown_workflow",
            Class::Nul => "nul",
            Class::DeepNesting => "deep_nesting",
            Class::HugeNumber => "huge_number",
            Class::ImpossibleTime => "impossible_time",
            Class::Oversize => "oversize",
            Class::ReservedReplyTo => "reserved_reply_to",
            Class::ReservedReplyToProperty => "reserved_reply_to_property",
            Class::DuplicateId => "duplicate_id",
            Class::BadBodyWithGoodId => "bad_body_with_good_id",
            Class::StatusEventToReplay => "status_event_to_replay",
            Class::GarbageReply => "garbage_reply",
            Class::GarbageAgentRequest => "garbage_agent_request",
            Class::LargeHeaders => "large_headers",
        }
    }

    /// Whether a message of the class carries a good order's id, picked
    /// when it is sent.
    pub fn needs_target(self) -> bool {
        matches!(
            self,
            Class::DuplicateId | Class::BadBodyWithGoodId | Class::StatusEventToReplay
        )
    }
}

/// What sas must do with a hostile message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// Dead-letter it into this queue.
    DeadLetter(String),
    /// Ignore it: the same id as the good order `target`, which keeps its
    /// own payload.
    Duplicate { target: Uuid },
}

/// The key of the JSON marker that hostile payloads and forged events
/// carry: a good order or event showing it got a stranger's content.
pub const MARKER: &str = "chaos_hostile";

/// How many hostile messages make `share` of all the messages sent beside
/// `orders` good ones (`share` below 1).
pub fn hostile_count(orders: u32, share: f64) -> u32 {
    if share <= 0.0 || share >= 1.0 {
        return 0;
    }
    let n = (f64::from(orders) * share / (1.0 - share)).round();
    // `orders` ≤ u32::MAX and the share is bounded in practice by the CLI.
    if n >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        n as u32
    }
}

/// One hostile message of the plan, before it is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    /// Its number in the run, from 0.
    pub n: u32,
    pub class: Class,
    /// Sent once this many good orders have been confirmed.
    pub after: u32,
    /// Seeds the variant and the random content of the message.
    seed: u64,
}

/// The hostile messages of a run, in sending order: [`hostile_count`] of
/// them, the classes taken in turn from a shuffled catalogue (so that every
/// class comes once there are as many messages as classes), each placed
/// after a random number of good orders.
pub fn plan(seed: u64, orders: u32, share: f64) -> Vec<Planned> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let count = hostile_count(orders, share);
    let mut classes = Class::ALL;
    let mut planned = Vec::with_capacity(count as usize);
    for n in 0..count {
        let turn = n as usize % classes.len();
        if turn == 0 {
            rng.shuffle(&mut classes);
        }
        planned.push(Planned {
            n,
            class: classes[turn],
            after: rng.u32(0..=orders),
            seed: rng.u64(..),
        });
    }
    // Stable: messages placed at the same point keep their numbering order.
    planned.sort_by_key(|p| p.after);
    planned
}

/// A hostile message, ready to publish.
#[derive(Debug, Clone)]
pub struct Message {
    pub n: u32,
    pub class: Class,
    /// Empty for the default exchange.
    pub exchange: String,
    pub routing_key: String,
    pub body: Vec<u8>,
    /// The AMQP `reply_to` property.
    pub reply_to: Option<String>,
    /// `chaos-<run>-h<n>`: how the run finds it again.
    pub message_id: String,
    pub headers: Vec<(String, String)>,
    /// The id of the order the body claims, when it is no good order's:
    /// a `rejected` event with it answers this message.
    pub hostile_id: Option<Uuid>,
    pub fate: Fate,
}

impl Message {
    /// What the accounting keeps of the message once sent.
    pub fn sent(&self) -> Sent {
        Sent {
            n: self.n,
            class: self.class,
            hostile_id: self.hostile_id,
            fate: self.fate.clone(),
        }
    }
}

/// The `message_id` of the run's hostile message `n`.
pub fn message_id(run_id: &str, n: u32) -> String {
    format!("chaos-{run_id}-h{n}")
}

/// The number of the run's hostile message named by `message_id`, if it is one.
pub fn message_number(run_id: &str, message_id: &str) -> Option<u32> {
    message_id
        .strip_prefix("chaos-")?
        .strip_prefix(run_id)?
        .strip_prefix("-h")?
        .parse()
        .ok()
}

/// Header bytes a large-headers message carries: about 20 KB, less when
/// the publishing connection's frames are smaller (the broker refuses a
/// content header over its `frame_max`).
fn header_bytes(frame_max: u32) -> usize {
    (20 * 1024).min((frame_max as usize).saturating_sub(4096))
}

/// One header value's length: sas's publisher cuts values at 1 KiB.
const HEADER_VALUE: usize = 1000;

impl Planned {
    /// The message, aimed at `aim`. `target` is a good order's id, for the
    /// classes that [`Class::needs_target`] (a fresh id stands in without
    /// one, so the message is still made). `frame_max` is the publishing
    /// connection's.
    pub fn make(&self, aim: &Aim, target: Option<Uuid>, frame_max: u32) -> Message {
        let mut rng = fastrand::Rng::with_seed(self.seed);
        let hostile_id = Uuid::from_u64_pair(rng.u64(..), rng.u64(..));
        let target = target.unwrap_or(hostile_id);
        let q = &aim.queues;
        let wf = aim.workflow.as_str();
        let status = Some(aim.status_queue.clone());
        let mut m = Message {
            n: self.n,
            class: self.class,
            exchange: q.submit_exchange().to_owned(),
            routing_key: q.orders().to_owned(),
            body: Vec::new(),
            reply_to: None,
            message_id: message_id(&aim.run_id, self.n),
            headers: Vec::new(),
            hostile_id: Some(hostile_id),
            fate: Fate::DeadLetter(q.orders_dead().to_owned()),
        };
        // An order of the workflow under the hostile id, to spoil.
        let order = |extra: Value| {
            let mut o = json!({ "order_id": hostile_id, "workflow": wf, "payload": {} });
            if let (Some(o), Value::Object(extra)) = (o.as_object_mut(), extra) {
                o.extend(extra);
            }
            o
        };
        let bytes = |v: Value| v.to_string().into_bytes();
        match self.class {
            Class::NotJson => {
                m.hostile_id = None;
                m.reply_to = status;
                m.body = pick(
                    &mut rng,
                    vec![
                        b"not json".to_vec(),
                        format!(r#"{{"workflow": "{wf}", "payload": "#).into_bytes(),
                        vec![0xff, 0xfe, b'{', b'}'],
                        Vec::new(),
                        format!("{{'workflow': '{wf}', 'payload': {{}}}}").into_bytes(),
                    ],
                );
            }
            Class::NotObject => {
                m.hostile_id = None;
                m.reply_to = status;
                m.body = pick(
                    &mut rng,
                    vec![
                        b"[]".to_vec(),
                        b"\"order\"".to_vec(),
                        b"42".to_vec(),
                        b"null".to_vec(),
                        b"true".to_vec(),
                        bytes(json!([order(json!({}))])),
                    ],
                );
            }
            Class::WrongType => {
                m.reply_to = status;
                let mut o = pick(
                    &mut rng,
                    vec![
                        order(json!({ "workflow": 42 })),
                        order(json!({ "payload": "x" })),
                        order(json!({ "payload": [1, 2] })),
                        order(json!({ "priority": "high" })),
                        order(json!({ "priority": 10 })),
                        order(json!({ "priority": -1 })),
                        order(json!({ "reply_to": 7 })),
                        order(json!({ "events": "some" })),
                        order(json!({ "not_before": true })),
                        order(json!({ "order_id": { "id": hostile_id } })),
                    ],
                );
                if rng.bool()
                    && let Some(o) = o.as_object_mut()
                {
                    // A required field missing as well.
                    o.remove(if rng.bool() { "workflow" } else { "payload" });
                }
                m.body = bytes(o);
            }
            Class::UnknownWorkflow => {
                m.reply_to = status;
                let name = pick(
                    &mut rng,
                    vec![
                        format!("chaos-no-such-workflow-{}", self.n),
                        format!("{wf} "),
                        wf.to_uppercase() + "-X",
                        String::new(),
                    ],
                );
                m.body = bytes(order(json!({ "workflow": name })));
            }
            Class::Nul => {
                m.reply_to = status;
                m.body = pick(
                    &mut rng,
                    vec![
                        bytes(order(json!({ "payload": { "note": "a\u{0}b" } }))),
                        bytes(order(json!({ "payload": { "\u{0}": 1 } }))),
                        bytes(order(json!({ "payload": { "list": ["x", ["\u{0}"]] } }))),
                        format!(
                            "{{\"order_id\":\"{hostile_id}\",\"workflow\":\"{wf}\",\"payload\":{{\"raw\":\"a\0b\"}}}}"
                        )
                        .into_bytes(),
                    ],
                );
            }
            Class::DeepNesting => {
                m.reply_to = status;
                // Deeper than sas takes (64), than the parser takes (128),
                // or as deep as the body limit allows.
                let deepest = (aim.max_body_bytes.saturating_sub(200) / 2).clamp(200, 100_000);
                let depths = vec![
                    rng.usize(65..=127),
                    rng.usize(129..=5_000),
                    rng.usize(deepest / 2..=deepest),
                ];
                let depth = pick(&mut rng, depths);
                let nested = format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
                m.body = format!(
                    "{{\"order_id\":\"{hostile_id}\",\"workflow\":\"{wf}\",\"payload\":{{\"deep\":{nested}}}}}"
                )
                .into_bytes();
            }
            Class::HugeNumber => {
                m.reply_to = status;
                let number = pick(
                    &mut rng,
                    vec![
                        r#""payload":{"n":1e301}"#,
                        r#""payload":{"n":-1.7976931348623157e308}"#,
                        r#""payload":{"n":1e400}"#,
                        r#""payload":{},"priority":1e20"#,
                        r#""payload":{},"priority":18446744073709551616"#,
                    ],
                );
                m.body = format!(r#"{{"order_id":"{hostile_id}","workflow":"{wf}",{number}}}"#)
                    .into_bytes();
            }
            Class::ImpossibleTime => {
                m.reply_to = status;
                let time = pick(
                    &mut rng,
                    vec![
                        json!("2026-02-30T00:00:00Z"),
                        json!("2026-13-01T00:00:00Z"),
                        json!("2026-01-01T25:61:00Z"),
                        json!("99999-01-01T00:00:00Z"),
                        json!("-0001-01-01T00:00:00Z"),
                        json!("tomorrow"),
                        json!(""),
                        json!(1e30),
                    ],
                );
                m.body = bytes(order(json!({ "not_before": time })));
            }
            Class::Oversize => {
                m.reply_to = status;
                let skeleton = bytes(order(json!({ "payload": { "pad": "" } })));
                let size = aim.max_body_bytes + 1 + rng.usize(0..64);
                let pad = "x".repeat(size.saturating_sub(skeleton.len()));
                m.body = bytes(order(json!({ "payload": { "pad": pad } })));
            }
            Class::ReservedReplyTo | Class::ReservedReplyToProperty => {
                let agent_requests = q.agent_requests(&aim.agent);
                let reserved = pick(
                    &mut rng,
                    vec![
                        q.replay(),
                        q.alerts(),
                        q.orders_dead(),
                        agent_requests.as_str(),
                        q.replies(),
                        q.orders(),
                        "amq.gen-x",
                    ],
                )
                .to_owned();
                if self.class == Class::ReservedReplyTo {
                    m.body = bytes(order(json!({ "reply_to": reserved })));
                } else {
                    m.reply_to = Some(reserved);
                    m.body = bytes(order(json!({})));
                }
            }
            Class::DuplicateId => {
                m.hostile_id = None;
                let mut o = json!({
                    "order_id": target,
                    "workflow": wf,
                    "payload": { MARKER: self.n },
                });
                if rng.bool() {
                    o["priority"] = json!(9);
                }
                if rng.bool() {
                    m.reply_to = status;
                } else {
                    o["reply_to"] = json!(aim.status_queue);
                }
                m.body = bytes(o);
                m.fate = Fate::Duplicate { target };
            }
            Class::BadBodyWithGoodId => {
                m.hostile_id = None;
                let spoiled = pick(
                    &mut rng,
                    vec![
                        json!({ "workflow": 42 }),
                        json!({ "workflow": format!("chaos-no-such-workflow-{}", self.n) }),
                        json!({ "payload": "x" }),
                        json!({ "not_before": "2026-02-30T00:00:00Z" }),
                    ],
                );
                let mut o = json!({
                    "order_id": target,
                    "workflow": wf,
                    "payload": { MARKER: self.n },
                    "reply_to": aim.status_queue,
                });
                if let (Some(o), Value::Object(spoiled)) = (o.as_object_mut(), spoiled) {
                    o.extend(spoiled);
                }
                m.body = bytes(o);
            }
            Class::StatusEventToReplay => {
                m.hostile_id = None;
                m.exchange = String::new();
                m.routing_key = q.replay().to_owned();
                if rng.bool() {
                    m.reply_to = status;
                }
                let state = pick(
                    &mut rng,
                    vec!["failed", "rejected", "processed", "compensated"],
                );
                m.body = bytes(json!({
                    "order_id": target,
                    "seq": 1_000_000 + u64::from(self.n),
                    "state": state,
                    "at": "2030-01-01T00:00:00Z",
                    "detail": { MARKER: self.n },
                }));
                m.fate = Fate::DeadLetter(q.replay_dead().to_owned());
            }
            Class::GarbageReply | Class::GarbageAgentRequest => {
                m.hostile_id = None;
                m.exchange = String::new();
                let (queue, dead) = if self.class == Class::GarbageReply {
                    (q.replies().to_owned(), q.replies_dead().to_owned())
                } else {
                    (
                        q.agent_requests(&aim.agent),
                        q.agent_requests_dead(&aim.agent),
                    )
                };
                m.routing_key = queue;
                m.body = pick(
                    &mut rng,
                    vec![
                        b"not json".to_vec(),
                        bytes(json!({ "garbage": self.n })),
                        b"[1]".to_vec(),
                        b"[]".to_vec(),
                        b"\"x\"".to_vec(),
                        vec![0xff, 0x00, 0x7b],
                    ],
                );
                m.fate = Fate::DeadLetter(dead);
            }
            Class::LargeHeaders => {
                m.reply_to = status;
                m.body = bytes(order(json!({
                    "workflow": format!("chaos-no-such-workflow-{}", self.n)
                })));
                let total = header_bytes(frame_max);
                let value = "h".repeat(HEADER_VALUE);
                m.headers = (0..total / HEADER_VALUE)
                    .map(|i| (format!("x-chaos-{i}"), value.clone()))
                    .collect();
            }
        }
        m
    }
}

/// One of `options`, at random.
fn pick<T>(rng: &mut fastrand::Rng, mut options: Vec<T>) -> T {
    let i = rng.usize(..options.len());
    options.swap_remove(i)
}

/// What the accounting keeps of a hostile message that the broker took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    pub n: u32,
    pub class: Class,
    pub hostile_id: Option<Uuid>,
    pub fate: Fate,
}

/// What the run saw of its hostile messages, beside what it sent.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    /// Hostile messages found in a dead-letter queue: number → queue.
    pub dead_lettered: HashMap<u32, String>,
    /// Hostile ids answered with a `rejected` event.
    pub rejected: HashSet<Uuid>,
    /// Good orders whose stored payload is not their own (a hostile copy's).
    pub foreign_payload: HashSet<Uuid>,
    /// Whether the payloads of the duplicates' targets were checked.
    pub payloads_checked: bool,
    /// Whether `<prefix>.orders` was empty at the end: every order sent was read.
    pub orders_drained: bool,
}

/// What became of one hostile message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    DeadLettered,
    /// Answered with `rejected` but not found dead-lettered.
    Rejected,
    /// A repeat the submission read and ignored.
    Ignored,
    Unaccounted,
}

/// Hostile messages of one class, by outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub sent: u64,
    pub dead_lettered: u64,
    pub rejected: u64,
    pub ignored: u64,
    pub unaccounted: u64,
}

impl Counts {
    fn add(&mut self, outcome: Outcome) {
        self.sent += 1;
        match outcome {
            Outcome::DeadLettered => self.dead_lettered += 1,
            Outcome::Rejected => self.rejected += 1,
            Outcome::Ignored => self.ignored += 1,
            Outcome::Unaccounted => self.unaccounted += 1,
        }
    }

    /// Those dead-lettered, rejected or ignored.
    pub fn accounted(&self) -> u64 {
        self.sent - self.unaccounted
    }
}

/// The outcome of one sent message. Found in any dead-letter queue counts:
/// where it went is sas's choice, that it is refused and kept is the rule.
/// A duplicate is ignored when it is found nowhere, the orders queue was
/// read to the end and its target kept its own payload.
pub fn outcome(sent: &Sent, seen: &Seen) -> Outcome {
    if seen.dead_lettered.contains_key(&sent.n) {
        return Outcome::DeadLettered;
    }
    if sent
        .hostile_id
        .is_some_and(|id| seen.rejected.contains(&id))
    {
        return Outcome::Rejected;
    }
    match sent.fate {
        Fate::Duplicate { target }
            if seen.orders_drained
                && seen.payloads_checked
                && !seen.foreign_payload.contains(&target) =>
        {
            Outcome::Ignored
        }
        _ => Outcome::Unaccounted,
    }
}

/// The hostile messages of a run, by class and in all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Accounting {
    pub classes: BTreeMap<Class, Counts>,
    pub total: Counts,
}

/// Counts what became of the messages `sent`.
pub fn account(sent: &[Sent], seen: &Seen) -> Accounting {
    let mut accounting = Accounting::default();
    for s in sent {
        let o = outcome(s, seen);
        accounting.classes.entry(s.class).or_default().add(o);
        accounting.total.add(o);
    }
    accounting
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aim() -> Aim {
        Aim {
            queues: QueueNames::new("t1"),
            workflow: "order".into(),
            agent: "payments".into(),
            status_queue: "t1-chaos.abc".into(),
            max_body_bytes: 4096,
            run_id: "abc".into(),
        }
    }

    fn make_all(seed: u64, orders: u32, share: f64) -> Vec<Message> {
        let target = Uuid::from_u128(7);
        plan(seed, orders, share)
            .iter()
            .map(|p| p.make(&aim(), Some(target), 131_072))
            .collect()
    }

    #[test]
    fn shares_are_of_all_the_messages_sent() {
        assert_eq!(hostile_count(300, 0.0), 0);
        assert_eq!(hostile_count(300, 0.2), 75);
        assert_eq!(hostile_count(100, 0.5), 100);
        assert_eq!(hostile_count(1, 0.01), 0);
        assert_eq!(hostile_count(10, 1.0), 0);
        for (orders, share) in [(300, 0.2), (1000, 0.05), (40, 0.9)] {
            let planned = plan(1, orders, share);
            let all = planned.len() as f64 + f64::from(orders);
            let got = planned.len() as f64 / all;
            assert!((got - share).abs() < 0.01, "{orders} {share}: {got}");
            assert!(planned.iter().all(|p| p.after <= orders));
            assert!(planned.windows(2).all(|w| w[0].after <= w[1].after));
        }
    }

    #[test]
    fn every_class_comes_once_there_are_as_many_messages() {
        // 17 hostile among 68 good: 20%.
        let planned = plan(9, 68, 0.2);
        assert_eq!(planned.len(), Class::ALL.len());
        let classes: HashSet<Class> = planned.iter().map(|p| p.class).collect();
        assert_eq!(classes.len(), Class::ALL.len());
        // And evenly in a long run.
        let planned = plan(3, 10_000, 0.2);
        for class in Class::ALL {
            let n = planned.iter().filter(|p| p.class == class).count();
            assert!(
                n.abs_diff(planned.len() / Class::ALL.len()) <= 1,
                "{class:?}: {n}"
            );
        }
    }

    #[test]
    fn the_same_seed_makes_the_same_messages() {
        let a = make_all(42, 300, 0.2);
        let b = make_all(42, 300, 0.2);
        let c = make_all(43, 300, 0.2);
        let key = |m: &Message| {
            (
                m.n,
                m.class,
                m.routing_key.clone(),
                m.body.clone(),
                m.reply_to.clone(),
            )
        };
        assert_eq!(
            a.iter().map(key).collect::<Vec<_>>(),
            b.iter().map(key).collect::<Vec<_>>()
        );
        assert_ne!(
            a.iter().map(key).collect::<Vec<_>>(),
            c.iter().map(key).collect::<Vec<_>>()
        );
    }

    #[test]
    fn each_class_is_what_it_says_and_has_its_fate() {
        let aim = aim();
        let q = &aim.queues;
        let target = Uuid::from_u128(7);
        let sas_accepts = |m: &Message| {
            sas::messages::decode_submission(&m.body, m.reply_to.as_deref(), aim.max_body_bytes, q)
                .is_ok()
        };
        let messages = make_all(5, 2_000, 0.3);
        for class in Class::ALL {
            let of: Vec<&Message> = messages.iter().filter(|m| m.class == class).collect();
            assert!(of.len() > 20, "{class:?}");
            for m in of {
                assert_eq!(message_number("abc", &m.message_id), Some(m.n));
                let orders = m.routing_key == q.orders();
                if orders {
                    assert_eq!(m.exchange, q.submit_exchange(), "{class:?}");
                }
                match class {
                    Class::DuplicateId => {
                        // A good order's id with another payload: the body
                        // itself is acceptable; its id makes it a repeat.
                        assert!(sas_accepts(m), "{class:?}: {:?}", m.body);
                        let body: Value = serde_json::from_slice(&m.body).unwrap();
                        assert_eq!(body["order_id"], json!(target));
                        assert!(body["payload"].get(MARKER).is_some());
                        assert_eq!(m.fate, Fate::Duplicate { target });
                    }
                    Class::StatusEventToReplay => {
                        assert_eq!(m.routing_key, q.replay());
                        assert_eq!(m.exchange, "");
                        let body: Value = serde_json::from_slice(&m.body).unwrap();
                        assert_eq!(body["order_id"], json!(target));
                        assert!(
                            sas::messages::decode_replay(&m.body, 1 << 20, q).is_err(),
                            "{body}"
                        );
                        assert_eq!(m.fate, Fate::DeadLetter(q.replay_dead().into()));
                    }
                    Class::GarbageReply => {
                        assert_eq!(m.routing_key, q.replies());
                        // Unreadable, or a pack of unreadable replies.
                        if let Ok(read) = sas::messages::decode_replies(&m.body) {
                            assert!(read.iter().all(Result::is_err), "{:?}", m.body);
                        }
                        assert_eq!(m.fate, Fate::DeadLetter(q.replies_dead().into()));
                    }
                    Class::GarbageAgentRequest => {
                        assert_eq!(m.routing_key, q.agent_requests("payments"));
                        assert!(
                            serde_json::from_slice::<sas::messages::StepRequest>(&m.body).is_err()
                        );
                        assert_eq!(m.fate, Fate::DeadLetter(q.agent_requests_dead("payments")));
                    }
                    _ => {
                        assert!(orders, "{class:?}");
                        // Refused by sas's own validation (an unknown
                        // workflow passes it: the service knows the
                        // configured ones).
                        let unknown_wf =
                            matches!(class, Class::UnknownWorkflow | Class::LargeHeaders)
                                || (class == Class::BadBodyWithGoodId
                                    && String::from_utf8_lossy(&m.body)
                                        .contains("no-such-workflow"));
                        assert!(
                            unknown_wf || !sas_accepts(m),
                            "{class:?}: {}",
                            String::from_utf8_lossy(&m.body)
                        );
                        assert_eq!(m.fate, Fate::DeadLetter(q.orders_dead().into()));
                    }
                }
                match class {
                    Class::Oversize => {
                        assert!(m.body.len() > aim.max_body_bytes);
                        assert!(m.body.len() <= aim.max_body_bytes + 64);
                    }
                    Class::LargeHeaders => {
                        let bytes: usize = m.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
                        assert!((19_000..=21_000).contains(&bytes), "{bytes}");
                    }
                    Class::ReservedReplyTo | Class::ReservedReplyToProperty => {
                        let named = if class == Class::ReservedReplyTo {
                            let body: Value = serde_json::from_slice(&m.body).unwrap();
                            body["reply_to"].as_str().unwrap().to_owned()
                        } else {
                            m.reply_to.clone().unwrap()
                        };
                        assert!(q.is_reserved(&named), "{named}");
                    }
                    Class::BadBodyWithGoodId => {
                        let body: Value = serde_json::from_slice(&m.body).unwrap();
                        assert_eq!(body["order_id"], json!(target));
                        assert_eq!(body["reply_to"], json!(aim.status_queue));
                    }
                    Class::UnknownWorkflow => {
                        let body: Value = serde_json::from_slice(&m.body).unwrap();
                        assert_ne!(body["workflow"], json!("order"));
                    }
                    _ => {}
                }
                if !class.needs_target() {
                    assert!(!String::from_utf8_lossy(&m.body).contains(&target.to_string()));
                }
            }
        }
    }

    #[test]
    fn large_headers_fit_the_connections_frames() {
        let p = plan(1, 2_000, 0.3)
            .into_iter()
            .find(|p| p.class == Class::LargeHeaders)
            .unwrap();
        let m = p.make(&aim(), None, 16_384);
        let bytes: usize = m.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert!(bytes < 16_384 - 2048, "{bytes}");
        assert!(m.headers.iter().all(|(_, v)| v.len() <= 1024));
    }

    #[test]
    fn message_ids_name_the_run_and_the_number() {
        assert_eq!(message_number("abc", &message_id("abc", 17)), Some(17));
        assert_eq!(message_number("abd", &message_id("abc", 17)), None);
        assert_eq!(message_number("abc", "chaos-abc-hx"), None);
        assert_eq!(message_number("abc", "7"), None);
    }

    #[test]
    fn the_account_counts_each_message_once_by_its_best_evidence() {
        let target = Uuid::from_u128(1);
        let other = Uuid::from_u128(2);
        let id = |n: u32| Some(Uuid::from_u128(100 + u128::from(n)));
        let dead = Fate::DeadLetter("t1.orders.dead".into());
        let sent = vec![
            Sent {
                n: 0,
                class: Class::NotJson,
                hostile_id: None,
                fate: dead.clone(),
            },
            Sent {
                n: 1,
                class: Class::WrongType,
                hostile_id: id(1),
                fate: dead.clone(),
            },
            Sent {
                n: 2,
                class: Class::WrongType,
                hostile_id: id(2),
                fate: dead.clone(),
            },
            Sent {
                n: 3,
                class: Class::WrongType,
                hostile_id: id(3),
                fate: dead.clone(),
            },
            Sent {
                n: 4,
                class: Class::DuplicateId,
                hostile_id: None,
                fate: Fate::Duplicate { target },
            },
            Sent {
                n: 5,
                class: Class::DuplicateId,
                hostile_id: None,
                fate: Fate::Duplicate { target: other },
            },
        ];
        let mut seen = Seen {
            dead_lettered: HashMap::from([
                (0, "t1.orders.dead".into()),
                (1, "t1.replay.dead".into()),
            ]),
            rejected: HashSet::from([id(1).unwrap(), id(2).unwrap()]),
            foreign_payload: HashSet::from([other]),
            payloads_checked: true,
            orders_drained: true,
        };
        let a = account(&sent, &seen);
        assert_eq!(
            a.total,
            Counts {
                sent: 6,
                dead_lettered: 2,
                rejected: 1,
                ignored: 1,
                unaccounted: 2
            }
        );
        assert_eq!(a.classes[&Class::WrongType].sent, 3);
        assert_eq!(a.classes[&Class::WrongType].accounted(), 2);
        assert_eq!(a.classes[&Class::DuplicateId].ignored, 1);
        // A duplicate is not known ignored while the orders queue holds
        // messages, or without the payload check.
        seen.orders_drained = false;
        assert_eq!(outcome(&sent[4], &seen), Outcome::Unaccounted);
        seen.orders_drained = true;
        seen.payloads_checked = false;
        assert_eq!(outcome(&sent[4], &seen), Outcome::Unaccounted);
        assert_eq!(account(&[], &seen), Accounting::default());
    }
}

//! The attack suite (issue 38, contract §1b): thousands of generated hostile
//! AMQP messages, whole messages (every basic property, header tables of
//! every field type, size and depth, bodies of every shape, sas's own queue
//! names, other orders' ids), written frame by frame by
//! [`RawPublisher`] and sent to every queue sas consumes, among good
//! orders, against the real services.
//!
//! What each case checks: every good order processed; every hostile
//! message accounted for (a valid order processed, anything else
//! dead-lettered with a bounded reason, told where a usable reply queue is
//! known); nothing written into a queue or an order the sender does not
//! own (no event into sas's own queues, none about an order the test did
//! not submit, no forged reply moving an order); no service restarted and
//! no connection lost. A message the broker itself refuses (a property it
//! validates, a field type it does not read) is counted apart, not as a
//! delivered hostile message.
//!
//! The draws come from fixed seeds: a failure replays.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use remote_sim::Knobs;
use sas::messages::{ReplayRequest, StepRequest, decode_replies, is_queue_name};
use sas_tests::TestApp;
use sas_tests::hostile::{assert_unharmed, draw, ends, seeded};
use sas_tests::raw_amqp::{Basic, Field, RawPublisher, table};
use serde_json::{Value, json};
use uuid::Uuid;

/// Messages sent before their confirms are awaited.
const WINDOW: usize = 200;

/// The names a generated message may point at.
#[derive(Debug, Clone)]
struct Names {
    /// Queues of sas and of the broker (reserved).
    reserved: Vec<String>,
    /// Queues of the test's applications (they exist).
    own: Vec<String>,
    /// A queue of an application's that is not the one the test reads
    /// (in one test, one that does not exist).
    elsewhere: String,
    /// Orders that exist (ended or live): their ids are what an attacker
    /// would squat or forge.
    taken: Vec<Uuid>,
}

impl Names {
    fn of(app: &TestApp, own: &[&str], elsewhere: &str, taken: &[Uuid]) -> Self {
        let q = &app.queues;
        Self {
            reserved: vec![
                q.orders().to_owned(),
                q.orders_dead().to_owned(),
                q.replay().to_owned(),
                q.replay_dead().to_owned(),
                q.replies().to_owned(),
                q.alerts().to_owned(),
                q.agent_requests("a"),
                q.agent_requests_dead("a"),
                app.prefix.clone(),
                format!("{}.nothing-yet", app.prefix),
                "amq.gen-forged".to_owned(),
                "amq.direct".to_owned(),
            ],
            own: own.iter().map(|s| (*s).to_owned()).collect(),
            elsewhere: elsewhere.to_owned(),
            taken: taken.to_vec(),
        }
    }
}

/// A short string of hostile text: valid UTF-8 (invalid UTF-8 in a short
/// string is its own test, below), up to 255 bytes.
fn short_text() -> impl Strategy<Value = Vec<u8>> + Clone {
    prop_oneof![
        Just(Vec::new()),
        Just(b"application/json".to_vec()),
        "[ -~]{1,40}".prop_map(String::into_bytes),
        (1usize..=255).prop_map(|n| vec![b'z'; n]),
        Just(b"\x00\x01\x1b[2J\x07\n\r\t".to_vec()),
        (0usize..=127).prop_map(|n| "é".repeat(n).into_bytes()),
        Just(Uuid::new_v4().to_string().into_bytes()),
    ]
}

/// Where a message's AMQP `reply_to` points: absent, a queue of the test's
/// applications, one of sas's or the broker's, none that exists, or no
/// queue name at all.
fn reply_to(names: &Names) -> impl Strategy<Value = Option<Vec<u8>>> + use<> {
    let own = names.own.clone();
    let reserved = names.reserved.clone();
    prop_oneof![
        24 => Just(None),
        32 => proptest::sample::select(own).prop_map(|q| Some(q.into_bytes())),
        24 => proptest::sample::select(reserved).prop_map(|q| Some(q.into_bytes())),
        8 => Just(Some(names.elsewhere.clone().into_bytes())),
        // Refused by the broker without a consumer of its own.
        1 => Just(Some(b"amq.rabbitmq.reply-to".to_vec())),
        8 => prop_oneof![
            Just(Vec::new()),
            Just(b"q\nq".to_vec()),
            Just(b"\x00".to_vec()),
        ]
        .prop_map(Some),
    ]
}

/// A header value of any field type the broker forwards, nested a few
/// levels at most.
fn scalar() -> impl Strategy<Value = Field> + Clone {
    prop_oneof![
        any::<bool>().prop_map(Field::Bool),
        any::<i8>().prop_map(Field::I8),
        any::<u8>().prop_map(Field::U8),
        any::<i16>().prop_map(Field::I16),
        any::<u16>().prop_map(Field::U16),
        any::<i32>().prop_map(Field::I32),
        any::<u32>().prop_map(Field::U32),
        any::<i64>().prop_map(Field::I64),
        proptest::num::f32::NORMAL.prop_map(Field::F32),
        proptest::num::f64::NORMAL.prop_map(Field::F64),
        (any::<u8>(), any::<u32>()).prop_map(|(s, v)| Field::Decimal(s, v)),
        proptest::collection::vec(any::<u8>(), 0..300).prop_map(Field::LongString),
        proptest::collection::vec(any::<u8>(), 0..64).prop_map(Field::Bytes),
        any::<u64>().prop_map(Field::Timestamp),
        Just(Field::Void),
        // RabbitMQ's reading of the spec's unsigned long long.
        any::<[u8; 8]>().prop_map(|b| Field::Raw(b'L', b.to_vec())),
    ]
}

fn value() -> impl Strategy<Value = Field> {
    scalar().prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Field::Array),
            proptest::collection::vec((header_key(), inner), 0..6).prop_map(Field::Table),
        ]
    })
}

/// Header names: sas's own, the trace's, names that repeat, odd ones.
fn header_key() -> impl Strategy<Value = Vec<u8>> + Clone {
    prop_oneof![
        Just(b"x-sas-reason".to_vec()),
        Just(b"x-sas-tries".to_vec()),
        Just(b"x-sas-headers-dropped".to_vec()),
        Just(b"traceparent".to_vec()),
        Just(b"tracestate".to_vec()),
        Just(b"k".to_vec()),
        Just(Vec::new()),
        "[a-z-]{1,12}".prop_map(String::into_bytes),
        Just(vec![b'K'; 255]),
        Just("ключ\u{7}".as_bytes().to_vec()),
    ]
}

/// Hostile values of the headers sas reads or writes itself.
fn sas_header() -> impl Strategy<Value = (Vec<u8>, Field)> {
    prop_oneof![
        prop_oneof![
            Just(Field::U32(u32::MAX)),
            Just(Field::I32(-1)),
            Just(Field::I64(i64::MIN)),
            Just(Field::LongString(b"lots".to_vec())),
            Just(Field::Void),
            Just(Field::Array(vec![Field::U8(1)])),
        ]
        .prop_map(|v| (b"x-sas-tries".to_vec(), v)),
        prop_oneof![
            (0usize..20_000).prop_map(|n| Field::LongString(vec![b'r'; n])),
            Just(Field::I8(0)),
        ]
        .prop_map(|v| (b"x-sas-reason".to_vec(), v)),
        prop_oneof![
            Just(Field::LongString(b"00-zz-zz-zz".to_vec())),
            Just(Field::LongString(
                b"00-00000000000000000000000000000000-0000000000000000-01".to_vec()
            )),
            Just(Field::LongString(
                b"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_vec()
            )),
            Just(Field::LongString(
                format!(
                    "00-{}-b7ad6b7169203331-01",
                    "0af7651916cd43dd8448eb211c80319c".repeat(300)
                )
                .into_bytes()
            )),
            Just(Field::LongString(vec![0xff, 0xfe, b'-'])),
            Just(Field::Raw(b'x', vec![0, 0, 0, 2, b'0', b'0'])),
            Just(Field::I64(7)),
        ]
        .prop_map(|v| (b"traceparent".to_vec(), v)),
    ]
}

/// Header tables and arrays nested around sas's bound (63 arrays in the
/// table are 64 levels: refused), rarely thousands deep.
fn deep() -> impl Strategy<Value = Field> {
    let levels = prop_oneof![
        100 => prop_oneof![Just(1usize), Just(30), Just(61), Just(62), Just(63), Just(64), Just(65), Just(100)],
        1 => prop_oneof![Just(2_000usize), Just(3_000)],
    ];
    (levels, any::<bool>()).prop_map(|(levels, tables)| Field::Deep { levels, tables })
}

/// A header table: none, a few entries of any type (duplicate names
/// included), sas's own headers with hostile values, nesting around the
/// bound, or one entry filling most of a frame of `frame_max`.
fn headers(frame_max: usize) -> impl Strategy<Value = Option<Vec<(Vec<u8>, Field)>>> {
    let entries = proptest::collection::vec(
        prop_oneof![
            6 => (header_key(), value()),
            3 => sas_header(),
            2 => (Just(b"d".to_vec()), deep()),
        ],
        1..6,
    );
    let pad = (16 * 1024..frame_max - 8 * 1024)
        .prop_map(|n| vec![(b"x-pad".to_vec(), Field::LongString(vec![b'p'; n]))]);
    prop_oneof![
        4 => Just(None),
        10 => entries.prop_map(Some),
        1 => pad.prop_map(Some),
    ]
}

/// Every basic property, absent or hostile but well encoded; the broker
/// refuses some (a `delivery_mode` or `expiration` it cannot read, a
/// `user_id` that is not the connection's, the direct reply-to without a
/// consumer): those go one at a time.
fn properties(names: &Names, frame_max: usize) -> impl Strategy<Value = Basic> {
    let taken = names.taken.clone();
    let message_id = prop_oneof![
        3 => Just(None),
        1 => short_text().prop_map(Some),
        1 => proptest::sample::select(taken).prop_map(|id| Some(id.to_string().into_bytes())),
        1 => Just(()).prop_map(|_| Some(Uuid::new_v4().to_string().into_bytes())),
    ];
    let expiration = prop_oneof![
        60 => Just(None),
        16 => prop_oneof![Just("3600000"), Just("4294967295"), Just("4294967296"), Just("0")]
            .prop_map(|e| Some(e.as_bytes().to_vec())),
        1 => prop_oneof![Just("abc"), Just("-1"), Just(""), Just("99999999999999999999"), Just("1e3")]
            .prop_map(|e| Some(e.as_bytes().to_vec())),
    ];
    let first = (
        proptest::option::of(short_text()),
        proptest::option::of(short_text()),
        headers(frame_max),
        prop_oneof![
            32 => Just(Some(2u8)),
            24 => Just(None),
            16 => Just(Some(1u8)),
            1 => any::<u8>().prop_map(Some),
        ],
        proptest::option::of(any::<u8>()),
        proptest::option::of(short_text()),
        reply_to(names),
    );
    let second = (
        expiration,
        message_id,
        proptest::option::of(prop_oneof![Just(0u64), Just(u64::MAX), any::<u64>()]),
        proptest::option::of(short_text()),
        prop_oneof![
            60 => Just(None),
            16 => Just(Some(b"guest".to_vec())),
            1 => Just(Some(b"admin".to_vec())),
        ],
        proptest::option::of(short_text()),
        proptest::option::of(short_text()),
    );
    (first, second).prop_map(
        |(
            (
                content_type,
                content_encoding,
                headers,
                delivery_mode,
                priority,
                correlation_id,
                reply_to,
            ),
            (expiration, message_id, timestamp, kind, user_id, app_id, cluster_id),
        )| Basic {
            content_type,
            content_encoding,
            headers: headers.map(|h| table(&h)),
            delivery_mode,
            priority,
            correlation_id,
            reply_to,
            expiration,
            message_id,
            timestamp,
            kind,
            user_id,
            app_id,
            cluster_id,
        },
    )
}

/// One generated message: its properties (and header entries, kept to
/// predict what sas does), its body.
#[derive(Debug, Clone)]
struct Message {
    basic: Basic,
    body: Vec<u8>,
    /// How deep the headers nest, as sas counts (the table is 1).
    depth: usize,
}

impl Message {
    fn new(basic: Basic, body: Vec<u8>) -> Self {
        let depth = basic.headers.as_ref().map_or(0, |h| 1 + header_depth(h));
        Self { basic, body, depth }
    }

    /// Whether sas refuses the message unread for its headers.
    fn too_deep(&self) -> bool {
        self.depth >= 64
    }

    /// Whether the broker may refuse it (a property it validates): sent
    /// alone, so that its refusal costs no other message.
    fn broker_may_refuse(&self) -> bool {
        let b = &self.basic;
        !matches!(b.delivery_mode, None | Some(1 | 2))
            || b.user_id.as_deref().is_some_and(|u| u != b"guest")
            || b.expiration
                .as_deref()
                .is_some_and(|e| e.is_empty() || e.len() > 10 || !e.iter().all(u8::is_ascii_digit))
            || b.reply_to.as_deref() == Some(b"amq.rabbitmq.reply-to")
    }

    /// The `reply_to` property as sas reads it: a queue name, or nothing.
    fn reply_to(&self) -> Option<&str> {
        let q = std::str::from_utf8(self.basic.reply_to.as_deref()?).ok()?;
        is_queue_name(q).then_some(q)
    }

    /// Whether the broker may expire it before sas reads it.
    fn may_expire(&self) -> bool {
        self.basic.expiration.as_deref() == Some(b"0")
    }
}

/// How deep the encoded header table `content` nests below itself, read
/// back from the bytes as the consumer reads them: of entries with the same
/// name, the last one stands.
fn header_depth(content: &[u8]) -> usize {
    nested(content, true, 100)
}

/// How deep the values of a table's or an array's content nest; past
/// `levels` more levels, far deeper than sas reads (a large number).
fn nested(mut rest: &[u8], is_table: bool, levels: usize) -> usize {
    if levels == 0 {
        return 1000;
    }
    let mut depths = BTreeMap::<&[u8], usize>::new();
    let mut deepest = 0;
    while !rest.is_empty() {
        let mut key: &[u8] = &[];
        if is_table {
            let n = rest[0] as usize;
            key = &rest[1..1 + n];
            rest = &rest[1 + n..];
        }
        let letter = rest[0];
        rest = &rest[1..];
        let (len, depth) = match letter {
            b't' | b'b' | b'B' => (1, 0),
            b's' | b'u' => (2, 0),
            b'I' | b'i' | b'f' => (4, 0),
            b'l' | b'L' | b'd' | b'T' => (8, 0),
            b'D' => (5, 0),
            b'V' => (0, 0),
            b'S' | b'x' | b'A' | b'F' => {
                let n = u32::from_be_bytes(rest[..4].try_into().expect("a length")) as usize;
                let depth = match letter {
                    b'A' => 1 + nested(&rest[4..4 + n], false, levels - 1),
                    b'F' => 1 + nested(&rest[4..4 + n], true, levels - 1),
                    _ => 0,
                };
                (4 + n, depth)
            }
            other => panic!("the generator wrote type {other}"),
        };
        rest = &rest[len..];
        if is_table {
            depths.insert(key, depth);
        } else {
            deepest = deepest.max(depth);
        }
    }
    depths.into_values().fold(deepest, usize::max)
}

/// What the broker did with the messages sent.
#[derive(Debug, Default)]
struct Sent {
    /// Indexes of the messages the broker took.
    taken: Vec<usize>,
    /// The broker's refusals: index and why.
    refused: Vec<(usize, String)>,
}

/// Sends `messages` to their queues: those the broker takes for sure a
/// window at a time, the others alone (reconnecting after a refusal).
impl Sent {
    /// How many refusals of each kind.
    fn summary(&self) -> String {
        let mut kinds = BTreeMap::<String, usize>::new();
        for (_, why) in &self.refused {
            let kind: String = why.chars().take(70).collect();
            *kinds.entry(kind).or_default() += 1;
        }
        format!("{} refused by the broker: {kinds:?}", self.refused.len())
    }
}

async fn send_all(raw: &mut RawPublisher, messages: &[(String, Message)]) -> Sent {
    let mut sent = Sent::default();
    let mut window = Vec::new();
    for (i, (queue, m)) in messages.iter().enumerate() {
        if m.broker_may_refuse() {
            flush(raw, &mut window, &mut sent).await;
            match raw.publish(queue, &m.basic.encode(), &m.body).await {
                Ok(()) => sent.taken.push(i),
                Err(e) => {
                    sent.refused.push((i, format!("{e:?}")));
                    *raw = RawPublisher::connect().await.expect("reconnect");
                }
            }
            continue;
        }
        raw.send(queue, &m.basic.encode(), &m.body)
            .await
            .unwrap_or_else(|e| panic!("message {i} not sent: {e:?}: {m:?}"));
        window.push(i);
        if window.len() >= WINDOW {
            flush(raw, &mut window, &mut sent).await;
        }
    }
    flush(raw, &mut window, &mut sent).await;
    sent
}

async fn flush(raw: &mut RawPublisher, window: &mut Vec<usize>, sent: &mut Sent) {
    let nacked = raw
        .wait_confirms()
        .await
        .unwrap_or_else(|e| panic!("the broker refused a message it takes: {e:?} in {window:?}"));
    assert!(nacked.is_empty(), "nacked: {nacked:?}");
    sent.taken.append(window);
}

/// A payload an order may carry, however odd.
fn payload() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!({})),
        Just(json!({ "k": "\u{1b}[31m\u{7} control characters are data" })),
        Just(json!({ "deep": [[[[[[[[[[1]]]]]]]]]] })),
        Just(json!({ "n": -9_223_372_036_854_775_807i64, "m": 1e300 })),
        (0usize..3000).prop_map(|n| json!({ "text": "ж".repeat(n) })),
    ]
}

/// What an order body is, for the prediction.
#[derive(Debug, Clone, PartialEq)]
enum Order {
    /// A valid order with its id; its events go to `to` (the body's
    /// `reply_to`, else the property's).
    Valid { id: Uuid, body_to: Option<String> },
    /// A valid order without an id: its id is the (fresh UUID) message_id.
    ByMessageId { body_to: Option<String> },
    /// A valid order with the id of one that exists: nothing happens.
    Existing,
    /// A valid order whose body `reply_to` names a queue of sas.
    ReservedBody,
    /// Not an order, but a JSON object.
    BadObject,
    /// Not a JSON object at all.
    NotAnObject,
    /// Over the submission's body limit.
    TooLarge,
}

/// Bodies that are not orders, objects or not: broken JSON, other
/// messages' shapes (a status event, a replay request, a step reply about
/// a live order), wrong fields.
fn bad_body(names: &Names) -> impl Strategy<Value = (Vec<u8>, Order)> {
    let taken = proptest::sample::select(names.taken.clone());
    let objects = prop_oneof![
        Just(json!({ "payload": {} })),
        Just(json!({ "workflow": "one" })),
        Just(json!({ "workflow": "one", "payload": [] })),
        Just(json!({ "workflow": "none", "payload": {} })),
        Just(json!({ "workflow": "w".repeat(300), "payload": {} })),
        Just(json!({ "workflow": "one", "payload": {}, "priority": 10 })),
        Just(json!({ "workflow": "one", "payload": {}, "priority": "9" })),
        Just(json!({ "workflow": "one", "payload": {}, "not_before": "+10000-01-01T00:00:00Z" })),
        Just(json!({ "workflow": "one", "payload": {}, "reply_to": "q".repeat(300) })),
        Just(json!({ "workflow": "one", "payload": {}, "reply_to": "a\nb" })),
        Just(json!({ "workflow": "one", "payload": {}, "order_id": "not-a-uuid" })),
        Just(json!({ "workflow": "one", "payload": {}, "order_id": 7 })),
        Just(json!({ "workflow": "one", "payload": { "k": "\u{0}" } })),
        Just(json!({ "workflow": "one", "payload": {}, "events": "some" })),
        taken.clone().prop_map(|id| json!({
            "order_id": id, "seq": 1, "state": "processed", "step": null,
            "attempt": 1, "at": "2026-01-01T00:00:00Z", "detail": {}
        })),
        taken
            .clone()
            .prop_map(|id| json!({ "order_id": id, "from_seq": 1 })),
        taken.clone().prop_map(|id| json!({
            "order_id": id, "step": "a", "step_index": 0, "direction": "forward",
            "attempt": 1, "dispatch_id": Uuid::new_v4(), "locked_by": "me",
            "outcome": "succeeded", "result": { "forged": true }
        })),
    ]
    .prop_map(|v| (v.to_string().into_bytes(), Order::BadObject));
    let others = prop_oneof![
        Just(Vec::new()),
        Just(b"null".to_vec()),
        Just(b"[1,2,3]".to_vec()),
        Just(b"\"order\"".to_vec()),
        Just(vec![0xff, 0xfe, b'{', b'}']),
        Just(format!("{}{}", "[".repeat(3000), "]".repeat(3000)).into_bytes()),
        proptest::collection::vec(any::<u8>(), 1..200).prop_map(|mut b| {
            b.insert(0, b'{');
            b
        }),
    ]
    .prop_map(|b| (b, Order::NotAnObject));
    prop_oneof![3 => objects, 2 => others]
}

/// A body for the orders queue: a valid order (with or without an id, an
/// existing order's id, unknown fields), a bad one, or one over the limit.
fn order_body(names: &Names) -> impl Strategy<Value = (Vec<u8>, Order)> {
    let body_to = prop_oneof![
        Just(None),
        proptest::sample::select(names.own.clone()).prop_map(Some),
        Just(Some(names.elsewhere.clone())),
    ];
    let reserved = proptest::sample::select(names.reserved.clone());
    let taken = proptest::sample::select(names.taken.clone());
    prop_oneof![
        4 => (payload(), body_to.clone(), any::<bool>()).prop_map(|(payload, to, extra)| {
            let id = Uuid::new_v4();
            let mut body = json!({ "order_id": id, "workflow": "one", "payload": payload });
            if let Some(q) = &to {
                body["reply_to"] = json!(q);
            }
            if extra {
                body["unknown"] = json!({ "ignored": [1, 2] });
                body["seq"] = json!(-1);
            }
            (body.to_string().into_bytes(), Order::Valid { id, body_to: to })
        }),
        1 => body_to.prop_map(|to| {
            let mut body = json!({ "workflow": "one", "payload": {} });
            if let Some(q) = &to {
                body["reply_to"] = json!(q);
            }
            (body.to_string().into_bytes(), Order::ByMessageId { body_to: to })
        }),
        1 => taken.prop_map(|id| {
            let body = json!({ "order_id": id, "workflow": "one", "payload": { "squat": true } });
            (body.to_string().into_bytes(), Order::Existing)
        }),
        1 => reserved.prop_map(|q| {
            let body = json!({ "order_id": Uuid::new_v4(), "workflow": "one", "payload": {}, "reply_to": q });
            (body.to_string().into_bytes(), Order::ReservedBody)
        }),
        6 => bad_body(names),
    ]
}

/// What sas must do with one message at the orders queue.
#[derive(Debug, Clone, PartialEq)]
enum Fate {
    /// Stored and processed, its events to `to`.
    Processed { id: Uuid, to: Option<String> },
    /// Processed (its events to `to`), or expired by the broker before
    /// (dead-lettered without a reason).
    ProcessedOrExpired { id: Uuid, to: Option<String> },
    /// Nothing (a repeat of an existing order).
    Nothing,
    /// Dead-lettered with a reason saying `says` (any reason when empty),
    /// a `rejected` event sent to `tell`.
    Dead {
        says: &'static str,
        tell: Option<String>,
    },
    /// Dead-lettered by the broker (no reason), `rejected` told to `tell`.
    DeadByBroker { tell: Option<String> },
}

const NESTED: &str = "nested 64 levels";
const RESERVED: &str = "a queue of sas";

/// The fate of an order message `m` whose body is `order`.
fn fate(app: &TestApp, m: &Message, order: &Order) -> Fate {
    if m.too_deep() {
        return Fate::Dead {
            says: NESTED,
            tell: None,
        };
    }
    let prop = m.reply_to();
    let prop_reserved = prop.is_some_and(|q| app.queues.is_reserved(q));
    let prop_to = prop
        .filter(|q| !app.queues.is_reserved(q))
        .map(str::to_owned);
    let body_to = match order {
        Order::Valid { body_to, .. } | Order::ByMessageId { body_to } => body_to.clone(),
        _ => None,
    };
    let tell = body_to.clone().or(prop_to.clone());
    match order {
        Order::TooLarge => Fate::DeadByBroker { tell: prop_to },
        Order::NotAnObject => Fate::Dead {
            says: "",
            tell: prop_to,
        },
        _ if prop_reserved => Fate::Dead {
            says: RESERVED,
            tell,
        },
        Order::BadObject => Fate::Dead { says: "", tell },
        Order::ReservedBody => Fate::Dead {
            says: RESERVED,
            tell,
        },
        Order::Existing => Fate::Nothing,
        Order::Valid { id, .. } if m.may_expire() => Fate::ProcessedOrExpired { id: *id, to: tell },
        Order::Valid { id, .. } => Fate::Processed { id: *id, to: tell },
        Order::ByMessageId { .. } => {
            let id = m
                .basic
                .message_id
                .as_deref()
                .and_then(|b| Uuid::parse_str(std::str::from_utf8(b).ok()?).ok())
                .expect("a message id");
            if m.may_expire() {
                Fate::ProcessedOrExpired { id, to: tell }
            } else {
                Fate::Processed { id, to: tell }
            }
        }
    }
}

/// A good order as an application sends it.
fn good_order(id: Uuid, status: &str) -> Message {
    let body = json!({ "order_id": id, "workflow": "one", "payload": { "good": true } });
    Message::new(
        Basic {
            content_type: Some(b"application/json".to_vec()),
            delivery_mode: Some(2),
            reply_to: Some(status.as_bytes().to_vec()),
            ..Basic::default()
        },
        body.to_string().into_bytes(),
    )
}

/// Takes every dead letter of `queue`, waiting until at least `at_least`
/// are there, and checks each reason is bounded.
async fn dead_letters(
    app: &TestApp,
    queue: &str,
    at_least: usize,
    timeout: Duration,
) -> Vec<(Vec<u8>, Option<String>)> {
    app.eventually(
        &format!("{at_least} dead letters in {queue}"),
        timeout,
        || async { app.ready(queue).await as usize >= at_least },
    )
    .await;
    let dead = app.drain(queue).await;
    for (_, why) in &dead {
        if let Some(why) = why {
            assert!(
                !why.is_empty() && why.len() <= 512,
                "{queue}: a reason of {} bytes",
                why.len()
            );
        }
    }
    dead
}

/// Matches dead letters to the messages expected there, by body and what
/// the reason must say (`None`: no reason, the broker's dead-lettering);
/// panics on a dead letter no message explains or a message not found.
fn match_dead(
    queue: &str,
    dead: Vec<(Vec<u8>, Option<String>)>,
    mut expected: Vec<(Vec<u8>, Option<&'static str>)>,
) {
    // The most particular expectations first.
    expected.sort_by_key(|(_, says)| match says {
        None => 0,
        Some("") => 2,
        Some(_) => 1,
    });
    let mut left: Vec<Option<(Vec<u8>, Option<String>)>> = dead.into_iter().map(Some).collect();
    for (body, says) in &expected {
        let found = left.iter_mut().find(|d| {
            d.as_ref().is_some_and(|(b, why)| {
                b == body
                    && match (says, why) {
                        (None, None) => true,
                        // Dead-lettered by the broker (over the size limit).
                        (None, Some(w)) => w.starts_with("dead-lettered by the broker"),
                        (Some(s), Some(w)) => w.contains(s),
                        _ => false,
                    }
            })
        });
        match found {
            Some(d) => *d = None,
            None => panic!(
                "{queue}: no dead letter for {} (reason saying {says:?})",
                String::from_utf8_lossy(&body[..body.len().min(300)])
            ),
        }
    }
    let unexplained: Vec<_> = left
        .into_iter()
        .flatten()
        .map(|(b, why)| {
            (
                String::from_utf8_lossy(&b[..b.len().min(200)]).into_owned(),
                why,
            )
        })
        .collect();
    assert!(
        unexplained.is_empty(),
        "{queue}: unexplained dead letters {unexplained:?}"
    );
}

/// Nothing went into sas's own queues that an application pointed at: no
/// alert, nothing left in the replay queue, no stray message dead-lettered
/// at the queues not attacked.
async fn assert_nothing_in(app: &TestApp, queues: &[&str]) {
    for queue in queues {
        assert_eq!(app.ready(queue).await, 0, "something went into {queue}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_generated_hostile_amqp_messages_at_the_orders_queue_harm_no_good_order() {
    attack_the_orders_queue(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_hostile_orders_naming_a_reply_queue_that_does_not_exist_cost_no_connection() {
    attack_the_orders_queue(false).await;
}

/// Thousands of generated hostile messages at the orders queue among good
/// orders; their other reply queue exists when `other_exists`.
async fn attack_the_orders_queue(other_exists: bool) {
    const HOSTILE: usize = 3250;
    let started = Instant::now();
    let app = TestApp::spawn().await;
    let status = app.status_queue("status").await;
    let q = &app.queues;
    // Orders that exist before the attack: their ids are squatted.
    let first = app.submit_many("one", 20, Some(&status)).await;
    let story_before = app
        .collect(&status, Duration::from_secs(30), |got| {
            ends(got).len() >= first.len()
        })
        .await;
    let other = if other_exists {
        app.status_queue("elsewhere").await
    } else {
        format!("{}-app.elsewhere", app.prefix)
    };
    let names = Names::of(&app, &[&status], &other, &first);
    let mut raw = RawPublisher::connect().await.expect("raw connection");
    let frame_max = raw.frame_max() as usize;

    let mut runner = seeded(38);
    let mut messages = Vec::new();
    let mut fates = Vec::new();
    let mut good = BTreeSet::new();
    for i in 0..HOSTILE {
        if i % 5 == 0 {
            let id = Uuid::new_v4();
            good.insert(id);
            messages.push((q.orders().to_owned(), good_order(id, &status)));
            fates.push(Fate::Processed {
                id,
                to: Some(status.clone()),
            });
        }
        let (body, order) = if i % 1000 == 999 {
            // A few over the body limit.
            (vec![b' '; 1024 * 1024 + 1], Order::TooLarge)
        } else {
            draw(&mut runner, order_body(&names))
        };
        let mut basic = draw(&mut runner, properties(&names, frame_max));
        if matches!(order, Order::ByMessageId { .. }) {
            basic.message_id = Some(Uuid::new_v4().to_string().into_bytes());
        }
        let mut m = Message::new(basic, body);
        let mut f = fate(&app, &m, &order);
        // Only an order that would be processed may expire unread: any
        // other message's fate is its dead letter's reason.
        if m.may_expire() && !matches!(f, Fate::ProcessedOrExpired { .. }) {
            m.basic.expiration = Some(b"3600000".to_vec());
            f = fate(&app, &m, &order);
        }
        fates.push(f);
        messages.push((q.orders().to_owned(), m));
    }
    let sent = send_all(&mut raw, &messages).await;
    raw.close().await;
    let delivered = sent.taken.len() - good.len();
    eprintln!(
        "orders: {delivered} hostile messages delivered, {}, {} good orders; sent in {:?}",
        sent.summary(),
        good.len(),
        started.elapsed()
    );
    assert!(delivered >= 3000, "{}", sent.summary());

    // What must happen, of the messages the broker took.
    let taken: Vec<(&Message, &Fate)> = sent
        .taken
        .iter()
        .map(|&i| (&messages[i].1, &fates[i]))
        .collect();
    let told = |f: &Fate| match f {
        Fate::Dead { tell, .. } | Fate::DeadByBroker { tell } => tell.as_deref() == Some(&status),
        _ => false,
    };
    let rejections = taken.iter().filter(|(_, f)| told(f)).count();
    let on_status: BTreeSet<String> = taken
        .iter()
        .filter_map(|(_, f)| match f {
            Fate::Processed { id, to } if to.as_deref() == Some(&status) => Some(id.to_string()),
            _ => None,
        })
        .collect();
    // Those that may have expired before the submission read them.
    let may_expire: BTreeSet<String> = taken
        .iter()
        .filter_map(|(_, f)| match f {
            Fate::ProcessedOrExpired { id, to } if to.as_deref() == Some(&status) => {
                Some(id.to_string())
            }
            _ => None,
        })
        .collect();
    // Every order that must be processed is, whatever its queue.
    let must: Vec<Uuid> = taken
        .iter()
        .filter_map(|(_, f)| match f {
            Fate::Processed { id, .. } => Some(*id),
            _ => None,
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let done: Vec<Uuid> = sqlx::query_scalar(
            "SELECT order_id FROM orders WHERE order_id = ANY($1) AND process_state = 'processed'",
        )
        .bind(&must)
        .fetch_all(&app.db)
        .await
        .expect("processed orders");
        if done.len() == must.len() {
            break;
        }
        if Instant::now() > deadline {
            let done: BTreeSet<Uuid> = done.into_iter().collect();
            for (m, f) in &taken {
                if let Fate::Processed { id, .. } = f
                    && !done.contains(id)
                {
                    eprintln!("NOT PROCESSED {id} ({:?}): {m:?}", app.order(*id).await);
                }
            }
            panic!("{} orders not processed", must.len() - done.len());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut events = app
        .collect(&status, Duration::from_secs(60), |got| {
            let ended = ends(got);
            on_status.iter().all(|id| ended.contains_key(id))
                && got.iter().filter(|e| e["state"] == "rejected").count() >= rejections
        })
        .await;
    // Orders whose events went elsewhere: processed all the same.
    let elsewhere: Vec<Uuid> = taken
        .iter()
        .filter_map(|(_, f)| match f {
            Fate::Processed { id, to } if to.as_deref() != Some(&status) => Some(*id),
            _ => None,
        })
        .collect();
    app.eventually(
        "the valid hostile orders processed",
        Duration::from_secs(60),
        || async {
            let processed: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM orders WHERE order_id = ANY($1) AND process_state = 'processed'",
            )
            .bind(&elsewhere)
            .fetch_one(&app.db)
            .await
            .expect("count");
            processed as usize == elsewhere.len()
        },
    )
    .await;
    // Late events (the maybe-expired orders' and any extra) as well.
    app.eventually(
        "the orders queue drained",
        Duration::from_secs(30),
        || async { app.ready(q.orders()).await == 0 },
    )
    .await;
    for (body, _) in app.drain(&status).await {
        events.push(serde_json::from_slice(&body).expect("a status event"));
    }
    let ended = ends(&events);
    for id in &on_status {
        assert_eq!(ended[id], "processed", "order {id}");
    }
    for id in &may_expire {
        if let Some(end) = ended.get(id) {
            assert_eq!(end, "processed", "order {id}");
        }
    }
    // The rejections: as many as predicted, none echoing an existing order.
    let rejected: Vec<&Value> = events.iter().filter(|e| e["state"] == "rejected").collect();
    assert_eq!(rejected.len(), rejections);
    for r in &rejected {
        let error = r["detail"]["error"].as_str().unwrap_or_default();
        assert!(!error.is_empty() && error.len() <= 512, "{r}");
        if let Some(id) = r["order_id"].as_str().and_then(|s| Uuid::parse_str(s).ok()) {
            assert!(
                app.order(id).await.is_none(),
                "a rejection echoes order {id}: {r}"
            );
        }
    }
    // No event about an order the test did not send here.
    let first_ids: BTreeSet<String> = first.iter().map(Uuid::to_string).collect();
    for e in &events {
        let id = e["order_id"].as_str().unwrap_or_default();
        assert!(
            e["state"] == "rejected" || on_status.contains(id) || may_expire.contains(id),
            "an event about an order not sent to this queue: {e}"
        );
        assert!(
            !first_ids.contains(id),
            "a squatted order had an event: {e}"
        );
    }
    // Events that went to the other queue: none about a good or squatted order.
    let elsewhere_events = if other_exists {
        app.drain(&other).await
    } else {
        Vec::new()
    };
    for (body, _) in elsewhere_events {
        let e: Value = serde_json::from_slice(&body).expect("a status event");
        let id = e["order_id"].as_str().and_then(|s| Uuid::parse_str(s).ok());
        assert!(
            id.is_none_or(|id| !good.contains(&id) && !first.contains(&id)),
            "an event about another order on the other queue: {e}"
        );
    }
    // The squatted orders: still their own payload, one terminal event.
    let payloads: Vec<Value> =
        sqlx::query_scalar("SELECT payload FROM orders WHERE order_id = ANY($1)")
            .bind(&first)
            .fetch_all(&app.db)
            .await
            .expect("payloads");
    assert!(payloads.iter().all(|p| p == &json!({})), "{payloads:?}");
    assert_eq!(ends(&story_before).len(), first.len());

    // The dead letters: each explained by a message, with its reason.
    let mut expected = Vec::new();
    let mut maybe = Vec::new();
    for (m, f) in &taken {
        match f {
            Fate::Dead { says, .. } => expected.push((m.body.clone(), Some(*says))),
            Fate::DeadByBroker { .. } => expected.push((m.body.clone(), None)),
            Fate::ProcessedOrExpired { id, .. } => maybe.push((*id, m.body.clone())),
            _ => {}
        }
    }
    for (id, body) in maybe {
        if app.order(id).await.is_none() {
            expected.push((body, None));
        }
    }
    let dead = dead_letters(
        &app,
        q.orders_dead(),
        expected.len(),
        Duration::from_secs(60),
    )
    .await;
    eprintln!(
        "orders: {} dead letters, {} rejections told, {} hostile orders processed",
        dead.len(),
        rejections,
        on_status.len() + elsewhere.len() - good.len()
    );
    match_dead(q.orders_dead(), dead, expected);
    assert_eq!(app.ready(q.orders()).await, 0);
    assert_nothing_in(
        &app,
        &[
            q.alerts(),
            q.replay(),
            q.replay_dead(),
            q.replies_dead(),
            &q.agent_requests_dead("a"),
        ],
    )
    .await;
    assert_unharmed(&app).await;
    eprintln!("orders: done in {:?}", started.elapsed());
}

/// A body for the replay queue: requests of either form (for existing
/// orders, unknown ones, sas's queues), requests with fields of the wrong
/// kind or too many, other messages' shapes, broken bytes.
fn replay_body(names: &Names) -> impl Strategy<Value = Vec<u8>> {
    let id = prop_oneof![
        4 => proptest::sample::select(names.taken.clone()).prop_map(|id| json!(id)),
        1 => Just(()).prop_map(|_| json!(Uuid::new_v4())),
        1 => prop_oneof![Just(json!("not-a-uuid")), Just(json!(7)), Just(json!(null))],
    ];
    let seq = prop_oneof![
        6 => (0i64..8).prop_map(|n| json!(n)),
        1 => prop_oneof![
            Just(json!(-1)),
            Just(json!(2_147_483_648i64)),
            Just(json!("1")),
            Just(json!(1.5)),
            Just(json!(null)),
        ],
    ];
    let mut queues = names.own.clone();
    queues.extend(names.reserved.iter().cloned());
    queues.extend([names.elsewhere.clone(), "a\nb".to_owned(), "q".repeat(300)]);
    let queue = proptest::sample::select(queues);
    let since = prop_oneof![
        Just(json!("2000-01-01T00:00:00Z")),
        Just(json!("2999-01-01T00:00:00Z")),
        Just(json!("yesterday")),
        Just(json!(0)),
    ];
    let taken = proptest::sample::select(names.taken.clone());
    prop_oneof![
        8 => (id.clone(), seq).prop_map(|(id, seq)| json!({ "order_id": id, "from_seq": seq }).to_string().into_bytes()),
        1 => id.clone().prop_map(|id| json!({ "order_id": id }).to_string().into_bytes()),
        1 => (id.clone(), queue.clone()).prop_map(|(id, q)| json!({ "order_id": id, "reply_to": q }).to_string().into_bytes()),
        2 => (queue, since).prop_map(|(q, since)| json!({ "reply_to": q, "since": since }).to_string().into_bytes()),
        1 => (id, "[a-z_]{1,10}").prop_map(|(id, k)| {
            let mut body = json!({ "order_id": id, "from_seq": 1 });
            body[k] = json!(true);
            body.to_string().into_bytes()
        }),
        1 => taken.clone().prop_map(|id| json!({
            "order_id": id, "seq": 1, "state": "received", "attempt": 1,
            "at": "2026-01-01T00:00:00Z", "detail": {}
        }).to_string().into_bytes()),
        1 => taken.prop_map(|id| json!({ "order_id": id, "workflow": "one", "payload": {} }).to_string().into_bytes()),
        2 => prop_oneof![
            Just(Vec::new()),
            Just(b"[]".to_vec()),
            Just(b"null".to_vec()),
            Just(vec![0xff, b'{', b'}']),
            Just(format!("{}{}", "{\"a\":".repeat(200), "}".repeat(200)).into_bytes()),
            proptest::collection::vec(any::<u8>(), 1..100),
        ],
    ]
}

/// A forged step reply about `order`: right shape, a dispatch that is
/// not the step's (no sender but a scheduler's own agent knows it).
fn forged_reply(order: Uuid) -> impl Strategy<Value = Value> {
    let outcome = prop_oneof![
        Just(json!({ "outcome": "succeeded", "result": { "forged": true } })),
        Just(json!({ "outcome": "failed", "error": "forged: a permanent failure" })),
        Just(json!({ "outcome": "held" })),
        Just(json!({
            "outcome": "accepted", "complete_by": "2999-01-01T00:00:00Z",
            "location": "http://127.0.0.1:9/forged"
        })),
    ];
    (
        outcome,
        prop_oneof![Just("forward"), Just("compensate")],
        0i32..3,
        prop_oneof![Just("forged".to_owned()), "[a-z0-9-]{1,40}"],
    )
        .prop_map(move |(outcome, direction, attempt, locked_by)| {
            let mut reply = json!({
                "order_id": order, "step": "a", "step_index": 0, "direction": direction,
                "attempt": attempt, "dispatch_id": Uuid::new_v4(), "locked_by": locked_by,
            });
            for (k, v) in outcome.as_object().expect("an object") {
                reply[k] = v.clone();
            }
            reply
        })
}

/// A body for the reply queue: forged replies about live orders, alone or
/// packed (with unreadable ones, more than a pack holds, larger than a
/// pack), other shapes, broken bytes.
fn reply_body(names: &Names) -> impl Strategy<Value = Vec<u8>> {
    let forged = proptest::sample::select(names.taken.clone()).prop_flat_map(forged_reply);
    prop_oneof![
        4 => forged.clone().prop_map(|r| r.to_string().into_bytes()),
        2 => (proptest::collection::vec(forged.clone(), 1..5), any::<bool>()).prop_map(|(replies, broken)| {
            let mut items: Vec<String> = replies.iter().map(Value::to_string).collect();
            if broken {
                items.push(r#"{"order_id":"x"}"#.to_owned());
            }
            format!("[{}]", items.join(",")).into_bytes()
        }),
        1 => forged.clone().prop_map(|r| {
            let mut r = r;
            r.as_object_mut().expect("an object").remove("dispatch_id");
            r.to_string().into_bytes()
        }),
        1 => prop_oneof![
            Just(format!("[{}]", vec!["{}"; 1100].join(",")).into_bytes()),
            forged.prop_map(|r| format!("[{}]", vec![r.to_string(); 700].join(",")).into_bytes()),
        ],
        2 => prop_oneof![
            Just(Vec::new()),
            Just(b"[]".to_vec()),
            Just(b"null".to_vec()),
            Just(vec![0xff, 0xfe]),
            Just(br#"{"workflow":"one","payload":{}}"#.to_vec()),
            proptest::collection::vec(any::<u8>(), 1..100),
        ],
    ]
}

/// A body for an agent's request queue: requests of the right shape for
/// orders that do not exist (mostly past their complete-by), requests
/// missing a field or with one of the wrong kind, other shapes.
fn request_body() -> impl Strategy<Value = Vec<u8>> {
    let request = (
        prop_oneof![9 => Just("2001-01-01T00:00:00Z"), 1 => Just("2999-01-01T00:00:00Z")],
        proptest::sample::select(vec![
            "",
            "order_id",
            "workflow",
            "step",
            "step_index",
            "direction",
            "attempt",
            "dispatch_id",
            "locked_by",
            "complete_by",
            "payload",
            "results",
        ]),
        prop_oneof![
            Just(json!(null)),
            Just(json!("x")),
            Just(json!(-1)),
            Just(json!({ "k": [1] })),
            Just(json!(1e300)),
        ],
    )
        .prop_map(|(complete_by, field, value)| {
            let mut r = json!({
                "order_id": Uuid::new_v4(), "workflow": "one", "step": "a", "step_index": 0,
                "direction": "forward", "attempt": 1, "dispatch_id": Uuid::new_v4(),
                "locked_by": "forged", "complete_by": complete_by,
                "payload": { "forged": true }, "results": {}
            });
            if !field.is_empty() {
                r[field] = value;
            }
            r.to_string().into_bytes()
        });
    prop_oneof![
        6 => request,
        1 => prop_oneof![
            Just(Vec::new()),
            Just(b"[]".to_vec()),
            Just(vec![0xff, 0xfe]),
            Just(br#"{"workflow":"one","payload":{}}"#.to_vec()),
            proptest::collection::vec(any::<u8>(), 1..100),
        ],
    ]
}

/// Where a message at the replay queue must go.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Replay {
    /// Refused: dead-lettered with a reason saying this.
    Refused(&'static str),
    /// Served, or refused because its queue does not exist (when there
    /// were events to send).
    Either,
    /// Served.
    Served,
}

/// What sas must do with a replay request `m`, `taken` being the orders
/// that exist (each with `own` as its status queue).
fn replay_fate(app: &TestApp, m: &Message, taken: &[Uuid], own: &str) -> Replay {
    if m.too_deep() {
        return Replay::Refused(NESTED);
    }
    // The strict reading is the contract's (§9, §1b); its unit tests pin it.
    let Ok(request) = sas::messages::decode_replay(&m.body, 1 << 20, &app.queues) else {
        return Replay::Refused("");
    };
    let to = match &request {
        ReplayRequest::Order { order_id, .. } => {
            if !taken.contains(order_id) {
                return Replay::Refused("unknown order");
            }
            m.reply_to().unwrap_or(own).to_owned()
        }
        ReplayRequest::Queue { reply_to, .. } => m.reply_to().unwrap_or(reply_to).to_owned(),
    };
    if app.queues.is_reserved(&to) {
        Replay::Refused(RESERVED)
    } else if !to.starts_with(&format!("{}-app.", app.prefix)) {
        Replay::Either
    } else {
        Replay::Served
    }
}

/// The sum of a counter's series in a service's metrics.
async fn counted(app: &TestApp, service: &str, metric: &str) -> u64 {
    app.metrics(service)
        .await
        .lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")) || l.starts_with(&format!("{metric} ")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_generated_hostile_messages_at_the_replay_reply_and_agent_queues_write_nothing_the_sender_does_not_own()
 {
    const PER_QUEUE: usize = 720;
    let started = Instant::now();
    let app = TestApp::spawn().await;
    let victim = app.status_queue("victim").await;
    let attacker = app.status_queue("attacker").await;
    let q = &app.queues;
    // Each step takes a while: orders are live while the attack goes on.
    app.knobs(
        "a",
        Knobs {
            latency_ms: 700,
            ..Knobs::default()
        },
    );
    let mut victims = app.submit_many("one", 40, Some(&victim)).await;
    app.wait_for_state("processing", 1, Duration::from_secs(20))
        .await;
    let elsewhere = app.status_queue("elsewhere").await;
    let names = Names::of(&app, &[&victim, &attacker], &elsewhere, &victims);
    let mut raw = RawPublisher::connect().await.expect("raw connection");
    let frame_max = raw.frame_max() as usize;
    let agent_queue = q.agent_requests("a");

    let mut runner = seeded(83);
    let mut messages = Vec::new();
    for i in 0..3 * PER_QUEUE {
        let mut basic = draw(&mut runner, properties(&names, frame_max));
        // (A message that may expire unread is the orders test's.)
        if basic.expiration.as_deref() == Some(b"0") {
            basic.expiration = Some(b"3600000".to_vec());
        }
        let (queue, body) = match i % 3 {
            0 => (
                q.replay().to_owned(),
                draw(&mut runner, replay_body(&names)),
            ),
            1 => (
                q.replies().to_owned(),
                draw(&mut runner, reply_body(&names)),
            ),
            _ => {
                let body = draw(&mut runner, request_body());
                if serde_json::from_slice::<StepRequest>(&body).is_ok() {
                    // A request the agent serves answers its reply_to:
                    // the schedulers' queue, the sender's own, or none.
                    let to = draw(
                        &mut runner,
                        proptest::sample::select(vec![
                            None,
                            Some(q.replies().to_owned()),
                            Some(attacker.clone()),
                        ]),
                    );
                    basic.reply_to = to.map(String::into_bytes);
                }
                (agent_queue.clone(), body)
            }
        };
        messages.push((queue, Message::new(basic, body)));
    }
    // In three rounds, with more orders submitted between them.
    let mut sent = Sent::default();
    for (round, chunk) in messages.chunks(PER_QUEUE).enumerate() {
        let part = send_all(&mut raw, chunk).await;
        let base = round * PER_QUEUE;
        sent.taken.extend(part.taken.iter().map(|i| i + base));
        sent.refused
            .extend(part.refused.into_iter().map(|(i, why)| (i + base, why)));
        victims.extend(app.submit_many("one", 20, Some(&victim)).await);
    }
    raw.close().await;
    eprintln!(
        "replay, replies, requests: {} hostile messages delivered, {}; sent in {:?}",
        sent.taken.len(),
        sent.summary(),
        started.elapsed()
    );
    assert!(sent.taken.len() >= 2000, "{}", sent.summary());

    // Every victim order is processed, by its own step's answer.
    let stories = app
        .stories(&victim, &victims, Duration::from_secs(90))
        .await;
    let victim_ids: BTreeSet<String> = victims.iter().map(Uuid::to_string).collect();
    for id in &victims {
        let story = &stories[id];
        assert_eq!(
            story.last().map(|e| e["state"].clone()),
            Some(json!("processed")),
            "order {id}: {story:?}"
        );
        assert!(
            story.iter().any(|e| e.to_string().contains("effect_id")),
            "order {id} has no result of its remote: {story:?}"
        );
        assert!(
            !story.iter().any(|e| e.to_string().contains("forged")),
            "order {id} took a forged reply: {story:?}"
        );
        assert_eq!(
            app.order(*id).await.map(|o| o.0).as_deref(),
            Some("processed")
        );
    }

    // The prediction, of what the broker took.
    let taken: Vec<&(String, Message)> = sent.taken.iter().map(|&i| &messages[i]).collect();
    let mut replay_dead = Vec::new();
    let mut replay_either = Vec::new();
    let mut replays = 0;
    let mut replies_dead = Vec::new();
    let mut requests_dead = Vec::new();
    for (queue, m) in &taken {
        if queue == q.replay() {
            if !m.too_deep() {
                replays += 1;
            }
            match replay_fate(&app, m, &names.taken, &victim) {
                Replay::Refused(says) => replay_dead.push((m.body.clone(), Some(says))),
                Replay::Either => replay_either.push(m.body.clone()),
                Replay::Served => {}
            }
        } else if queue == q.replies() {
            let readable = decode_replies(&m.body).is_ok_and(|r| r.iter().all(Result::is_ok));
            if m.too_deep() {
                replies_dead.push((m.body.clone(), Some(NESTED)));
            } else if !readable {
                replies_dead.push((m.body.clone(), Some("unreadable reply")));
            }
        } else if m.too_deep() {
            requests_dead.push((m.body.clone(), Some(NESTED)));
        } else if serde_json::from_slice::<StepRequest>(&m.body).is_err() {
            requests_dead.push((m.body.clone(), Some("unreadable request")));
        }
    }
    // Every replay request was read once and answered once (none fed
    // the replay queue again): the count is exact.
    app.eventually(
        "every replay request answered",
        Duration::from_secs(60),
        || async { counted(&app, "submission", "sas_replays_total").await >= replays },
    )
    .await;
    for queue in [q.replay(), q.replies(), agent_queue.as_str()] {
        app.eventually(
            &format!("{queue} drained"),
            Duration::from_secs(60),
            || async { app.ready(queue).await == 0 },
        )
        .await;
    }
    assert_eq!(
        counted(&app, "submission", "sas_replays_total").await,
        replays
    );

    // Dead letters: each explained, each with its reason.
    let dead = dead_letters(
        &app,
        q.replay_dead(),
        replay_dead.len(),
        Duration::from_secs(30),
    )
    .await;
    let late = dead.len() - replay_dead.len();
    assert!(
        late <= replay_either.len(),
        "{late} replays refused unexplained"
    );
    // A request to a queue that does not exist is refused only when it
    // had events to send: match those that were.
    let mut expected = replay_dead.clone();
    for body in &replay_either {
        if dead.iter().filter(|(b, _)| b == body).count()
            > expected.iter().filter(|(b, _)| b == body).count()
        {
            expected.push((body.clone(), Some("no queue")));
        }
    }
    match_dead(q.replay_dead(), dead, expected);
    let dead = dead_letters(
        &app,
        q.replies_dead(),
        replies_dead.len(),
        Duration::from_secs(30),
    )
    .await;
    match_dead(q.replies_dead(), dead, replies_dead.clone());
    let requests_dead_queue = q.agent_requests_dead("a");
    let dead = dead_letters(
        &app,
        &requests_dead_queue,
        requests_dead.len(),
        Duration::from_secs(30),
    )
    .await;
    match_dead(&requests_dead_queue, dead, requests_dead.clone());

    // The victim's queue holds its orders' events only, each (order, seq)
    // the same however often replayed; the attacker's, copies of those
    // (replays it asked for, as §9 allows without applications) and the
    // agent's answers to its own forged requests, about no victim.
    let late = app.drain(&victim).await;
    let mut seen: BTreeMap<(String, i64), Value> = BTreeMap::new();
    for e in stories.values().flatten() {
        seen.insert(
            (
                e["order_id"].as_str().unwrap_or_default().to_owned(),
                e["seq"].as_i64().unwrap_or(-1),
            ),
            e["state"].clone(),
        );
    }
    for (body, _) in &late {
        let e: Value = serde_json::from_slice(body).expect("a status event");
        let id = e["order_id"].as_str().unwrap_or_default();
        assert!(
            victim_ids.contains(id),
            "an event about another order on the victim's queue: {e}"
        );
        let key = (id.to_owned(), e["seq"].as_i64().unwrap_or(-1));
        assert_eq!(
            seen.get(&key),
            Some(&e["state"]),
            "a replayed event differs: {e}"
        );
    }
    let mut copies = app.drain(&attacker).await;
    copies.extend(app.drain(&elsewhere).await);
    for (body, _) in &copies {
        let e: Value = serde_json::from_slice(body).expect("JSON");
        let id = e["order_id"].as_str().unwrap_or_default();
        if e.get("seq").is_some() {
            let key = (id.to_owned(), e["seq"].as_i64().unwrap_or(-1));
            assert_eq!(
                seen.get(&key),
                Some(&e["state"]),
                "not a copy of an event: {e}"
            );
        } else {
            assert!(!victim_ids.contains(id), "a reply about a victim: {e}");
        }
    }
    eprintln!(
        "replay, replies, requests: {replays} replay requests ({} refused), {} replies and {} requests dead-lettered, {} events replayed to the victim, {} messages to the attacker",
        replay_dead.len(),
        replies_dead.len(),
        requests_dead.len(),
        late.len(),
        copies.len()
    );
    assert_nothing_in(&app, &[q.alerts(), q.orders(), q.orders_dead()]).await;
    assert_unharmed(&app).await;
    eprintln!("replay, replies, requests: done in {:?}", started.elapsed());
}

/// Good orders, each followed by the hostile `message`, then the checks
/// that no service lost its connection and every good order was processed.
async fn among_good_orders(app: &TestApp, status: &str, hostile: &[Message]) {
    let mut messages = Vec::new();
    let mut good = Vec::new();
    for m in hostile {
        let id = Uuid::new_v4();
        good.push(id);
        messages.push((app.queues.orders().to_owned(), good_order(id, status)));
        messages.push((app.queues.orders().to_owned(), m.clone()));
    }
    let mut raw = RawPublisher::connect().await.expect("raw connection");
    let sent = send_all(&mut raw, &messages).await;
    raw.close().await;
    assert!(sent.refused.is_empty(), "{}", sent.summary());
    let stories = app.stories(status, &good, Duration::from_secs(60)).await;
    assert!(sas_tests::all_end_in(&stories, "processed"));
    assert_unharmed(app).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_string_of_invalid_utf8_in_any_property_or_header_name_costs_no_connection() {
    let app = TestApp::spawn().await;
    let status = app.status_queue("status").await;
    let body = |id: Uuid| {
        json!({ "order_id": id, "workflow": "one", "payload": {} })
            .to_string()
            .into_bytes()
    };
    let bad = vec![0xff, 0xfe, b'q'];
    let hostile: Vec<Message> = [
        Basic {
            reply_to: Some(bad.clone()),
            ..Basic::default()
        },
        Basic {
            message_id: Some(bad.clone()),
            ..Basic::default()
        },
        Basic {
            content_type: Some(bad.clone()),
            ..Basic::default()
        },
        Basic {
            headers: Some(table(&[(bad.clone(), Field::Bool(true))])),
            ..Basic::default()
        },
    ]
    .into_iter()
    .map(|basic| Message::new(basic, body(Uuid::new_v4())))
    .collect();
    among_good_orders(&app, &status, &hostile).await;
}

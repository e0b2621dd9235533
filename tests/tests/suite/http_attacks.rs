//! The HTTP attack suite (issue 56), as `attacks` is the AMQP one:
//! thousands of generated hostile requests, written byte by byte over TCP,
//! at the submission's HTTP API (docs/http-api.md) and at the dashboard
//! (docs/operations.md, docs/dashboard-hardening.md), in a deployment of
//! two applications with tokens: a victim and an attacker.
//!
//! What is generated: request lines (every route of both surfaces and
//! unknown ones; the victim's order ids, the attacker's, others and
//! malformed ones, in every form a UUID parses from, percent-encoded,
//! behind `..`, in absolute-form targets; any method; other versions),
//! headers (`Host`; `Authorization` in every shape: the attacker's token,
//! the victim's mangled, the dashboard's, other schemes, none, several;
//! `Content-Type` with charsets, `Content-Encoding` claims,
//! `Idempotency-Key`, `Last-Event-ID`, forwarding and tracing headers,
//! control bytes, folding, floods), bodies (orders and signal data of
//! every JSON shape: deep, wide, huge numbers, NUL and lone surrogates in
//! strings and keys, wrong types, unknown fields, the victim's ids taken
//! as the attacker's own; not JSON, not UTF-8; big, up to and over the
//! limit) and framings (`Content-Length` right, short, long, doubled or
//! unreadable; chunked, well and badly; both; a client that goes away; a
//! request for a victim's order pipelined behind).
//!
//! What runs around it: the victim submits orders over HTTP all along
//! and follows every third on its event stream; it has orders waiting
//! for a signal (their streams open all along), orders pending until
//! 2999 and ended ones; an operator, logged in, watches the dashboard.
//!
//! What each case checks: no answer is a 5xx; no caller but the victim
//! reads, cancels, signals or streams the victim's orders (the
//! attacker's token, forged tokens and none get a 4xx other than 409 for
//! them, and no answer carries the victim's data); nobody without a
//! dashboard token gets past the dashboard's login or opens a session,
//! and a viewer acts on nothing. Once all are sent: every good order is
//! processed and streamed whole, and the dashboard answered the operator
//! each time; the victim's other orders are as they were (then its own
//! signal and cancel still work on them), each event of theirs by the
//! victim or sas; no order in the victim's name that the victim did not
//! submit; no service restarted or panicked; and the database committed
//! at most [`MAX_COMMITS_PER_REQUEST`] transactions per hostile request
//! beyond what the same deployment commits without them.
//!
//! The draws come from fixed seeds, and so do the ids of the orders they
//! name: a failure replays.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use remote_sim::Knobs;
use sas::applications::Application;
use sas_tests::TestApp;
use sas_tests::dashboard::{OPERATOR_TOKEN, VIEWER_TOKEN, token_auth};
use sas_tests::hostile::{assert_unharmed, draw, seeded};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use uuid::Uuid;

/// Hostile requests at the submission's API, and at the dashboard.
const API_REQUESTS: usize = 8_000;
const DASHBOARD_REQUESTS: usize = 2_000;

/// Hostile requests in flight at once.
const CONCURRENCY: usize = 8;

/// How long a hostile request may wait for its answer: the server bounds
/// reading a request's headers (10 s) and answering it (30 s, a 503);
/// these requests are small, and the machine is shared.
const ANSWER_WITHIN: Duration = Duration::from_secs(20);

/// The most of an answer kept to look into.
const KEPT: usize = 64 * 1024;

/// The applications' tokens and their `sha256:` hashes
/// (`printf %s "$TOKEN" | sha256sum`).
const VICTIM_TOKEN: &str = "victim-app-token-0b9e41";
const VICTIM_HASH: &str = "sha256:6039e75f1c53f6e8843d233ca0400a2de2f21104d6e2e00f8ab4e86170845b21";
const ATTACKER_TOKEN: &str = "attacker-app-token-7c2f58";
const ATTACKER_HASH: &str =
    "sha256:0e5444d4b50fe9987dca11c7ba526fc0b8a5841cac138c500db0cbc5e3b50a29";

/// Commits per hostile request beyond the deployment's own rate (its
/// orders, streams and polls, measured with the same traffic just before
/// the attack). A request sas refuses before the store (most of them)
/// costs none; one that reads an order costs a few (a statement outside a
/// transaction commits on its own); an order the attacker gets stored
/// costs some ten as it runs. The mean measured is 0.2 to 0.35: one per
/// request leaves three times that for a slow machine's noise, and still
/// fails once every refused request costs a commit, or a request a stream
/// of them (a loop, a retry storm, an event stream that polls without its
/// pause or outlives its client).
const MAX_COMMITS_PER_REQUEST: f64 = 1.0;

/// Order ids the victim will submit while the attack runs (as many as it
/// gets to), fixed in advance so that the attack can name them.
const VICTIM_LIVE: usize = 400;

/// The victim's orders of each kind made before the attack.
const EACH: usize = 5;

/// The attacker's orders waiting for a signal: each takes one signal, so
/// that signals with hostile data are applied, not only refused.
const ATTACKER_WAITING: usize = 40;

/// Ids the attacker's hostile orders may take (as `order_id` or
/// `Idempotency-Key`), which the attack also names.
const ATTACKER_FRESH: usize = 300;

/// Whose credentials a request carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    /// None at all.
    Nobody,
    /// The attacker application's own token (to the API).
    Attacker,
    /// A token no one holds: another's mangled, another scheme, another
    /// service's, a forged session.
    Forged,
    /// The dashboard's viewer token: may read, may not act.
    Viewer,
}

/// Whose order a request names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// One of the victim's (pending, waiting for a signal, or live).
    Victim,
    /// An ended order of the victim's, whose id the attacker may also use
    /// for an order of its own (each application's ids are its own): a
    /// 2xx for it is the attacker's order or a leak.
    Squatted(Uuid),
    /// The attacker's own, none, or none that parses.
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Surface {
    Api,
    Dashboard,
}

/// What the attack may name: the deployment's ports, queues and orders.
struct World {
    api_port: u16,
    dashboard_port: u16,
    /// The applications' `reply_to` prefix.
    run: String,
    prefix: String,
    /// The victim's public ids that nothing but the victim may touch.
    victim: Vec<Uuid>,
    /// The victim's ended orders (public ids): the attacker may squat them.
    victim_ended: Vec<Uuid>,
    /// The stored ids of the victim's orders (the dashboard's ids).
    victim_stored: Vec<Uuid>,
    /// The attacker's public ids, and their stored ids.
    attacker: Vec<Uuid>,
    attacker_stored: Vec<Uuid>,
    /// Ids the attacker's hostile orders may take (as `order_id` or
    /// `Idempotency-Key`).
    attacker_fresh: Vec<Uuid>,
    /// The deployment's dead-letter queues.
    dead_queues: Vec<String>,
}

/// One hostile request.
#[derive(Debug, Clone)]
struct Case {
    surface: Surface,
    who: Who,
    target: Target,
    /// Served without credentials: the OpenAPI document and the probes;
    /// the dashboard's login page and assets.
    public: bool,
    /// On the dashboard's API, with a method that may change something.
    acts: bool,
    /// Malformed at the HTTP level, or large: the server may close the
    /// connection without an answer (or before reading all of it).
    may_close: bool,
    /// Sent with the write side shut afterwards: a body shorter than it
    /// says (else the server would wait for the rest).
    half_close: bool,
    /// Closed as soon as written, never read: a client that goes away.
    abandon: bool,
    /// A HEAD request: no body in the answer.
    head: bool,
    /// Followed on the same connection by a request for a victim's order
    /// with the same credentials, whose answer is read too.
    pipelined: bool,
    /// What was chosen, for the report.
    what: String,
    bytes: Vec<u8>,
}

/// A request being drawn.
#[derive(Debug, Default)]
struct Draft {
    method: Vec<u8>,
    target: Vec<u8>,
    headers: Vec<Vec<u8>>,
    body: Vec<u8>,
    what: Vec<String>,
    may_close: bool,
    /// A second request to send after this one on the same connection.
    second: Option<Vec<u8>>,
}

impl Draft {
    fn header(&mut self, line: impl AsRef<[u8]>) {
        self.headers.push(line.as_ref().to_vec());
    }
}

/// A number below `n`.
fn below(r: &mut TestRunner, n: usize) -> usize {
    draw(r, 0..n)
}

fn pick<'a, T>(r: &mut TestRunner, items: &'a [T]) -> &'a T {
    &items[below(r, items.len())]
}

/// One of `choices`, each as likely as its weight.
fn weighted<T: Copy>(r: &mut TestRunner, choices: &[(u32, T)]) -> T {
    let total: u32 = choices.iter().map(|c| c.0).sum();
    let mut n = draw(r, 0..total);
    for &(weight, choice) in choices {
        if n < weight {
            return choice;
        }
        n -= weight;
    }
    unreachable!("a draw below the total")
}

fn chance(r: &mut TestRunner, percent: u32) -> bool {
    draw(r, 0u32..100) < percent
}

/// An id drawn from the runner (so that it replays).
fn drawn_id(r: &mut TestRunner) -> Uuid {
    Uuid::from_u128(draw(r, any::<u128>()))
}

/// Every byte as `%XX`.
fn percent_all(text: &str) -> String {
    text.bytes().map(|b| format!("%{b:02X}")).collect()
}

fn base64(input: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in input.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// An id as a path segment: in every form `Uuid::parse_str` reads (so
/// that it names the same order), percent-encoded, or with a tail.
fn id_form(r: &mut TestRunner, id: Uuid) -> String {
    match weighted(
        r,
        &[
            (70, "plain"),
            (6, "upper"),
            (6, "simple"),
            (4, "braced"),
            (4, "urn"),
            (5, "encoded"),
            (5, "tail"),
        ],
    ) {
        "plain" => id.to_string(),
        "upper" => id.to_string().to_uppercase(),
        "simple" => id.simple().to_string(),
        "braced" => pick(r, &["{}", "%7B{}%7D"]).replace("{}", &id.to_string()),
        "urn" => id.urn().to_string(),
        "encoded" => percent_all(&id.to_string()),
        _ => format!(
            "{id}{}",
            pick(
                r,
                &["%00", ".json", ";x", "%20", "%0a", "/", "x", "%2F..%2F"]
            )
        ),
    }
}

/// Ids that are none: empty, odd, long, traversal, bad escapes.
fn malformed_id(r: &mut TestRunner) -> String {
    let long = "a".repeat(8_000);
    pick(
        r,
        &[
            "x",
            "..",
            ".",
            "%00",
            "%2e%2e",
            "00000000-0000-0000-0000-000000000000",
            "ffffffff-ffff-ffff-ffff-ffffffffffff",
            "-1",
            "null",
            "%ff%fe",
            "%C3%A9",
            "..%2f..%2fetc%2fpasswd",
            "%u0000",
            "0x1",
            "1e9",
            "%E2%80%AE",
            long.as_str(),
        ],
    )
    .to_string()
}

/// An order id for a path of the API, and whose it is.
fn api_id(r: &mut TestRunner, w: &World) -> (String, Target) {
    match weighted(
        r,
        &[
            (30, "victim"),
            (8, "squat"),
            (26, "attacker"),
            (8, "fresh"),
            (5, "stored"),
            (6, "random"),
            (12, "malformed"),
        ],
    ) {
        "victim" => {
            let id = *pick(r, &w.victim);
            (id_form(r, id), Target::Victim)
        }
        "squat" => {
            let id = *pick(r, &w.victim_ended);
            (id_form(r, id), Target::Squatted(id))
        }
        "attacker" => {
            let id = *pick(r, &w.attacker);
            (id_form(r, id), Target::Other)
        }
        "fresh" => {
            let id = *pick(r, &w.attacker_fresh);
            (id_form(r, id), Target::Other)
        }
        // The victim's stored ids are no public id of anyone's: the
        // attacker may take them for its own.
        "stored" => {
            let id = *pick(r, &w.victim_stored);
            (id.to_string(), Target::Other)
        }
        "random" => (drawn_id(r).to_string(), Target::Other),
        _ => (malformed_id(r), Target::Other),
    }
}

/// A signal's name as a path segment: mostly the one the attacker's
/// orders wait for, so that signals are applied, not only refused.
fn signal_name(r: &mut TestRunner) -> String {
    let long = "s".repeat(300);
    pick(
        r,
        &[
            "approval",
            "approval",
            "approval",
            "approval",
            "approval",
            "approval",
            "approval",
            "refund",
            "APPROVAL",
            "%61pproval",
            "%C3%A9",
            "%00",
            "approval%00",
            "%0A",
            "%1B%5B2J",
            "%7F",
            "%09approval",
            "%ff",
            "a%2Fb",
            "..",
            "%2e%2e",
            "%20approval",
            "%E2%80%AE",
            long.as_str(),
        ],
    )
    .to_string()
}

/// A query of the event stream.
fn from_seq(r: &mut TestRunner) -> String {
    if chance(r, 45) {
        return String::new();
    }
    let long = format!("?a={}", "b".repeat(20_000));
    pick(
        r,
        &[
            "?from_seq=0",
            "?from_seq=1",
            "?from_seq=3",
            "?from_seq=-1",
            "?from_seq=2147483647",
            "?from_seq=2147483648",
            "?from_seq=1e3",
            "?from_seq=",
            "?from_seq=x",
            "?from_seq=%00",
            "?from_seq=1&from_seq=2",
            "?from_seq[]=1",
            "?from_seq=%2B1",
            "?from_seq=%201",
            "?",
            "?&&&=",
            "?x=1",
            long.as_str(),
        ],
    )
    .to_string()
}

/// One JSON scalar, as text, hostile or not.
fn scalar(r: &mut TestRunner) -> String {
    if chance(r, 8) {
        return format!("\"{}\"", "s".repeat(below(r, 3_000)));
    }
    pick(
        r,
        &[
            "0",
            "-0",
            "1",
            "-1",
            "1.5",
            "1e400",
            "-1e400",
            "1E-400",
            "123456789012345678901234567890",
            "-9223372036854775809",
            "18446744073709551616",
            "0.30000000000000004",
            "true",
            "false",
            "null",
            "\"\"",
            "\"a\"",
            "\"\\u0000\"",
            "\"a\\u0000b\"",
            "\"\\ud800\"",
            "\"\\udfff\\ud800\"",
            "\"\\u001b[2J\\u0007\"",
            "\"\\\\\"",
            "\"é\"",
            "\"\\u202e\"",
            "\"<script>alert(1)</script>\"",
            "\"' OR 1=1 --\"",
        ],
    )
    .to_string()
}

/// An object key, as text.
fn key(r: &mut TestRunner) -> String {
    if chance(r, 3) {
        return format!("\"{}\"", "k".repeat(below(r, 2_000)));
    }
    pick(
        r,
        &[
            "\"k\"",
            "\"\"",
            "\"\\u0000\"",
            "\"a\\u0000b\"",
            "\"workflow\"",
            "\"payload\"",
            "\"order_id\"",
            "\"__proto__\"",
            "\"é\"",
            "\"\\ud800\"",
            "\"x.y\"",
            "\"$where\"",
        ],
    )
    .to_string()
}

/// A JSON value, as text: scalars, arrays and objects a few levels deep.
fn json_value(r: &mut TestRunner, depth: u32) -> String {
    let kind = if depth >= 4 { 0 } else { draw(r, 0u32..10) };
    match kind {
        0..=5 => scalar(r),
        6..=7 => {
            let items: Vec<String> = (0..below(r, 5)).map(|_| json_value(r, depth + 1)).collect();
            format!("[{}]", items.join(","))
        }
        _ => json_object(r, depth),
    }
}

fn json_object(r: &mut TestRunner, depth: u32) -> String {
    let fields: Vec<String> = (0..below(r, 5))
        .map(|_| format!("{}:{}", key(r), json_value(r, depth + 1)))
        .collect();
    format!("{{{}}}", fields.join(","))
}

/// `levels` of arrays or objects around one value.
fn deep(r: &mut TestRunner, levels: usize) -> String {
    if chance(r, 50) {
        format!("{}1{}", "[".repeat(levels), "]".repeat(levels))
    } else {
        format!("{}1{}", "{\"a\":".repeat(levels), "}".repeat(levels))
    }
}

fn wide(n: usize) -> String {
    let fields: Vec<String> = (0..n).map(|i| format!("\"k{i}\":{i}")).collect();
    format!("{{{}}}", fields.join(","))
}

/// A body that is not JSON, or not only.
fn not_json(r: &mut TestRunner) -> Vec<u8> {
    let order = br#"{"workflow":"one","payload":{}}"#;
    match below(r, 15) {
        0 => Vec::new(),
        1 => b" \r\n\t".to_vec(),
        2 => b"{oops".to_vec(),
        3 => b"\xff\xfe{}".to_vec(),
        // A byte-order mark, then an order.
        4 => [b"\xef\xbb\xbf".as_slice(), order].concat(),
        // The order in UTF-16.
        5 => String::from_utf8_lossy(order)
            .encode_utf16()
            .flat_map(u16::to_le_bytes)
            .collect(),
        // A gzip header and no gzip behind it.
        6 => [
            b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03".as_slice(),
            order,
        ]
        .concat(),
        7 => b"workflow=one&payload=%7B%7D".to_vec(),
        8 => (0..below(r, 300)).map(|_| draw(r, any::<u8>())).collect(),
        9 => b"\0\0\0\0".to_vec(),
        10 => [order.as_slice(), b"xyz"].concat(),
        11 => [order.as_slice(), order].concat(),
        12 => [order.as_slice(), b"\0"].concat(),
        13 => b"--x\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n1\r\n--x--".to_vec(),
        _ => b"<?xml version=\"1.0\"?><order/>".to_vec(),
    }
}

/// The body of a `POST /v1/orders`.
fn order_body(r: &mut TestRunner, w: &World) -> (Vec<u8>, String) {
    match weighted(
        r,
        &[
            (50, "order"),
            (20, "other JSON"),
            (20, "not JSON"),
            (2, "big"),
            (2, "over the limit"),
            (6, "deep"),
        ],
    ) {
        "order" => (order(r, w).into_bytes(), "an order".into()),
        "other JSON" => (json_value(r, 0).into_bytes(), "other JSON".into()),
        "not JSON" => (not_json(r), "not JSON".into()),
        "big" => {
            // Under the 1 MiB limit; its workflow most likely unknown.
            let workflow = pick(r, &["nope", "nope", "one"]);
            let n = draw(r, 100_000usize..1_000_000);
            let body = format!(
                r#"{{"workflow":"{workflow}","payload":{{"pad":"{}"}}}}"#,
                "p".repeat(n)
            );
            (body.into_bytes(), format!("big ({n} bytes of padding)"))
        }
        "over the limit" => {
            let mut body = br#"{"workflow":"one","payload":{"pad":""#.to_vec();
            body.resize(1024 * 1024 + 1 + below(r, 1_000), b'p');
            body.extend_from_slice(br#""}}"#);
            (body, "over the limit".into())
        }
        _ => {
            let levels = *pick(r, &[60usize, 63, 64, 65, 127, 128, 129, 1_000, 20_000]);
            let payload = deep(r, levels);
            (
                format!(r#"{{"workflow":"one","payload":{{"d":{payload}}}}}"#).into_bytes(),
                format!("{levels} levels deep"),
            )
        }
    }
}

/// An order's JSON text with hostile fields.
fn order(r: &mut TestRunner, w: &World) -> String {
    let mut fields = Vec::new();
    let workflow = pick(
        r,
        &[
            "\"one\"",
            "\"one\"",
            "\"one\"",
            "\"three\"",
            "\"approved\"",
            "\"approved\"",
            "\"nope\"",
            "\"\"",
            "123",
            "null",
            "\"one\\u0000\"",
            "[\"one\"]",
        ],
    );
    if chance(r, 97) {
        fields.push(format!("\"workflow\":{workflow}"));
    }
    let payload = match weighted(
        r,
        &[
            (70, "object"),
            (10, "other"),
            (5, "wide"),
            (5, "absent"),
            (10, "nul"),
        ],
    ) {
        "object" => Some(json_object(r, 0)),
        "other" => Some(json_value(r, 2)),
        "wide" => Some(wide(draw(r, 100usize..3_000))),
        "nul" => Some(pick(r, &["{\"a\":\"\\u0000\"}", "{\"\\u0000\":1}"]).to_string()),
        _ => None,
    };
    if let Some(p) = payload {
        fields.push(format!("\"payload\":{p}"));
    }
    if chance(r, 40) {
        // The victim's ended orders' ids are the attacker's to take too.
        let id = match below(r, 11) {
            0 | 1 => pick(r, &w.victim_ended).to_string(),
            2 => pick(r, &w.victim_ended).to_string().to_uppercase(),
            3 => pick(r, &w.victim_ended).urn().to_string(),
            4 => pick(r, &w.attacker).to_string(),
            5 | 6 => pick(r, &w.attacker_fresh).to_string(),
            7 => pick(r, &w.victim_stored).to_string(),
            8 => drawn_id(r).to_string(),
            9 => "x".into(),
            _ => String::new(),
        };
        let value = pick(r, &["\"{}\"", "\"{}\"", "42", "null"]).replace("{}", &id);
        fields.push(format!("\"order_id\":{value}"));
    }
    if chance(r, 20) {
        let queue = pick(
            r,
            &[
                "\"{run}-attacker.status\"",
                "\"{run}-victim.status\"",
                "\"{prefix}.orders\"",
                "\"{prefix}.replies\"",
                "\"amq.gen-x\"",
                "\"\"",
                "\"\\u0000\"",
                "42",
            ],
        )
        .replace("{run}", &w.run)
        .replace("{prefix}", &w.prefix);
        fields.push(format!("\"reply_to\":{queue}"));
    }
    if chance(r, 15) {
        let p = pick(
            r,
            &["-1", "0", "9", "10", "255", "1e400", "\"5\"", "null", "1.5"],
        );
        fields.push(format!("\"priority\":{p}"));
    }
    if chance(r, 15) {
        let t = pick(
            r,
            &[
                "\"2999-01-01T00:00:00Z\"",
                "\"1970-01-01T00:00:00Z\"",
                "\"x\"",
                "0",
                "\"+275760-09-13T00:00:00Z\"",
                "\"2024-02-30T00:00:00Z\"",
                "\"\\u0000\"",
            ],
        );
        fields.push(format!("\"not_before\":{t}"));
    }
    if chance(r, 10) {
        let e = pick(r, &["true", "\"all\"", "[1]", "{}", "null"]);
        fields.push(format!("\"events\":{e}"));
    }
    if chance(r, 10) {
        fields.push(format!("{}:{}", key(r), json_value(r, 1)));
    }
    if chance(r, 5) {
        fields.push("\"workflow\":\"nope\"".into());
    }
    format!("{{{}}}", fields.join(","))
}

/// The body of a signal: any JSON (its data), none, or not JSON.
fn signal_body(r: &mut TestRunner) -> (Vec<u8>, String) {
    match weighted(
        r,
        &[
            (20, "none"),
            (50, "JSON"),
            (8, "deep"),
            (10, "not JSON"),
            (2, "big"),
            (2, "over the limit"),
            (3, "wide"),
            (5, "nul"),
        ],
    ) {
        "none" => (Vec::new(), "no data".into()),
        "JSON" => (json_value(r, 0).into_bytes(), "JSON".into()),
        "deep" => {
            let levels = *pick(r, &[60usize, 127, 128, 129, 5_000]);
            (
                deep(r, levels).into_bytes(),
                format!("{levels} levels deep"),
            )
        }
        "not JSON" => (not_json(r), "not JSON".into()),
        "big" => {
            let n = draw(r, 100_000usize..1_000_000);
            (
                format!(r#"{{"pad":"{}"}}"#, "p".repeat(n)).into_bytes(),
                "big".into(),
            )
        }
        "over the limit" => (vec![b' '; 1024 * 1024 + 1], "over the limit".into()),
        "wide" => (wide(draw(r, 100usize..3_000)).into_bytes(), "wide".into()),
        _ => (
            pick(
                r,
                &["{\"by\":\"\\u0000\"}", "{\"\\u0000\":1}", "\"\\u0000\""],
            )
            .as_bytes()
            .to_vec(),
            "a NUL".into(),
        ),
    }
}

/// The `Authorization` (or other) headers of a request to the API, and
/// whose they are. The victim's token is never sent whole and usable: only
/// mangled (shorter, longer, in another case or scheme, split), so that
/// whatever it answers is an answer to someone else.
fn api_auth(r: &mut TestRunner) -> (Who, Vec<Vec<u8>>) {
    let a = ATTACKER_TOKEN;
    match weighted(
        r,
        &[(10, Who::Nobody), (60, Who::Attacker), (30, Who::Forged)],
    ) {
        Who::Attacker => {
            let value = pick(
                r,
                &[
                    "Bearer {a}",
                    "Bearer {a}",
                    "Bearer {a}",
                    "bearer {a}",
                    "BEARER {a}",
                    "Bearer   {a}  ",
                    "Bearer {a}\t",
                ],
            )
            .replace("{a}", a);
            let mut headers = vec![format!("Authorization: {value}").into_bytes()];
            // The first one counts: a second, forged, changes nothing.
            if chance(r, 10) {
                headers.push([b"Authorization: ".as_slice(), &forged_api(r)].concat());
            }
            (Who::Attacker, headers)
        }
        Who::Forged => {
            let mut headers = Vec::new();
            match below(r, 10) {
                // The victim's token where no token is read.
                0 => headers.push(
                    pick(
                        r,
                        &[
                            "X-Api-Key: {v}",
                            "Cookie: token={v}",
                            "Proxy-Authorization: Bearer {v}",
                            "X-Authorization: Bearer {v}",
                        ],
                    )
                    .replace("{v}", VICTIM_TOKEN)
                    .into_bytes(),
                ),
                // A forged one first, then the attacker's.
                1 => {
                    headers.push([b"Authorization: ".as_slice(), &forged_api(r)].concat());
                    headers.push(format!("Authorization: Bearer {a}").into_bytes());
                }
                _ => headers.push([b"Authorization: ".as_slice(), &forged_api(r)].concat()),
            }
            (Who::Forged, headers)
        }
        _ => (Who::Nobody, Vec::new()),
    }
}

/// A token nobody holds, as an `Authorization` value.
fn forged_api(r: &mut TestRunner) -> Vec<u8> {
    let v = VICTIM_TOKEN;
    let a = ATTACKER_TOKEN;
    let (head, tail) = v.split_at(7);
    match below(r, 24) {
        0 => format!("Bearer {}", &v[..v.len() - 1]).into_bytes(),
        1 => format!("Bearer {}", &v[1..]).into_bytes(),
        2 => format!("Bearer {v}x").into_bytes(),
        3 => format!("Bearer {}", v.to_uppercase()).into_bytes(),
        4 => format!("Bearer {head} {tail}").into_bytes(),
        5 => format!("Bearer {head}\0{tail}").into_bytes(),
        6 => format!("Bearer {head}\x7f{tail}").into_bytes(),
        7 => format!("Bearer {VICTIM_HASH}").into_bytes(),
        8 => format!("Basic {}", base64(format!("victim:{v}").as_bytes())).into_bytes(),
        9 => format!("Basic {}", base64(v.as_bytes())).into_bytes(),
        10 => format!("Token {v}").into_bytes(),
        11 => format!("Bearer{v}").into_bytes(),
        12 => format!("Bearer:{v}").into_bytes(),
        13 => format!("Bearer\t{v}").into_bytes(),
        14 => b"Bearer".to_vec(),
        15 => b"Bearer ".to_vec(),
        16 => Vec::new(),
        17 => format!("Bearer {}", &a[..a.len() - 1]).into_bytes(),
        18 => format!("Bearer {OPERATOR_TOKEN}").into_bytes(),
        19 => format!("Bearer {}", "x".repeat(5_000)).into_bytes(),
        20 => [b"Bearer \xff\xfe".as_slice(), v.as_bytes()].concat(),
        21 => b"Bearer eyJhbGciOiJub25lIn0.eyJzdWIiOiJ2aWN0aW0ifQ.".to_vec(),
        22 => format!("Bearer {v},Bearer {a}").into_bytes(),
        _ => format!("Bearer {}", drawn_id(r).simple()).into_bytes(),
    }
}

/// The credentials of a request to the dashboard: none, forged, or the
/// viewer's token.
fn dashboard_auth(r: &mut TestRunner) -> (Who, Vec<Vec<u8>>) {
    match weighted(
        r,
        &[(35, Who::Nobody), (35, Who::Forged), (30, Who::Viewer)],
    ) {
        Who::Viewer => {
            let value = pick(
                r,
                &["Bearer {t}", "Bearer {t}", "bearer {t}", "Bearer  {t} "],
            )
            .replace("{t}", VIEWER_TOKEN);
            (
                Who::Viewer,
                vec![format!("Authorization: {value}").into_bytes()],
            )
        }
        Who::Forged => {
            let o = OPERATOR_TOKEN;
            let line = match below(r, 16) {
                0 => format!("Authorization: Bearer {}", &o[..o.len() - 1]).into_bytes(),
                1 => format!("Authorization: Bearer {o}0").into_bytes(),
                2 => format!("Authorization: Bearer {}", o.to_uppercase()).into_bytes(),
                3 => format!("Authorization: Bearer {VIEWER_TOKEN}x").into_bytes(),
                4 => format!("Authorization: Bearer {VICTIM_TOKEN}").into_bytes(),
                5 => format!("Authorization: Bearer {ATTACKER_TOKEN}").into_bytes(),
                6 => format!(
                    "Authorization: Basic {}",
                    base64(format!("alice:{o}").as_bytes())
                )
                .into_bytes(),
                7 => format!("Authorization: Token {o}").into_bytes(),
                8 => format!(
                    "Cookie: sas_session={:032x}{:032x}",
                    draw(r, any::<u128>()),
                    draw(r, any::<u128>())
                )
                .into_bytes(),
                9 => b"Cookie: sas_session=".to_vec(),
                10 => format!("Cookie: sas_session={o}").into_bytes(),
                11 => format!("Cookie: sas_session={}", "s".repeat(5_000)).into_bytes(),
                12 => b"X-Forwarded-User: alice\r\nX-Forwarded-Role: operator".to_vec(),
                13 => [b"Authorization: Bearer \xff".as_slice(), o.as_bytes()].concat(),
                14 => format!("Authorization: Bearer {}", "x".repeat(5_000)).into_bytes(),
                _ => b"Authorization: Bearer".to_vec(),
            };
            (Who::Forged, vec![line])
        }
        _ => (Who::Nobody, Vec::new()),
    }
}

/// `Host` headers: mostly the right one.
fn host(r: &mut TestRunner, d: &mut Draft, port: u16) {
    let right = format!("Host: 127.0.0.1:{port}");
    if chance(r, 88) {
        d.header(&right);
        return;
    }
    d.what.push("odd Host".into());
    match below(r, 10) {
        0 => {}
        1 => {
            d.header(&right);
            d.header(&right);
        }
        2 => {
            d.header(&right);
            d.header("Host: evil.example");
        }
        3 => d.header("Host: evil.example"),
        4 => d.header(format!("Host: 127.0.0.1:{port}, evil.example")),
        5 => d.header(format!("Host: user@127.0.0.1:{port}")),
        6 => d.header(format!("Host: [::1]:{port}")),
        7 => d.header("Host: 127.0.0.1:99x"),
        8 => d.header("Host: "),
        _ => d.header(format!("Host: {}", "h".repeat(5_000))),
    }
}

/// Other headers, hostile ones among them.
fn extras(r: &mut TestRunner, d: &mut Draft, w: &World, port: u16) {
    match weighted(
        r,
        &[
            (76, "close"),
            (10, "none"),
            (5, "keep-alive"),
            (5, "websocket"),
            (4, "h2c"),
        ],
    ) {
        "close" => d.header("Connection: close"),
        "keep-alive" => d.header("Connection: keep-alive"),
        "websocket" => {
            d.header("Connection: Upgrade");
            d.header("Upgrade: websocket");
            d.header("Sec-WebSocket-Version: 13");
            d.header("Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==");
        }
        "h2c" => {
            d.header("Connection: Upgrade, HTTP2-Settings");
            d.header("Upgrade: h2c");
            d.header("HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA");
        }
        _ => {}
    }
    for _ in 0..below(r, 4) {
        let squat = pick(r, &w.victim_ended).to_string();
        let own = if chance(r, 50) {
            pick(r, &w.attacker).to_string()
        } else {
            pick(r, &w.attacker_fresh).to_string()
        };
        let line: Vec<u8> = match below(r, 40) {
            0 => b"Origin: http://evil.example".to_vec(),
            1 => b"Origin: null".to_vec(),
            2 => format!("Origin: http://127.0.0.1:{port}").into_bytes(),
            3 => b"X-Forwarded-For: 127.0.0.1".to_vec(),
            4 => b"X-Forwarded-For: 10.0.0.1, 127.0.0.1".to_vec(),
            5 => b"X-Forwarded-Proto: https".to_vec(),
            6 => b"X-Forwarded-Host: evil.example".to_vec(),
            7 => b"X-Forwarded-User: alice".to_vec(),
            8 => b"X-Real-IP: 127.0.0.1".to_vec(),
            9 => format!("Idempotency-Key: {squat}").into_bytes(),
            10 => format!("Idempotency-Key: {own}").into_bytes(),
            11 => format!("Idempotency-Key: {}", drawn_id(r)).into_bytes(),
            12 => b"Idempotency-Key: ../../x".to_vec(),
            13 => b"Idempotency-Key: ".to_vec(),
            14 => format!("Idempotency-Key: {squat}\r\nIdempotency-Key: {own}").into_bytes(),
            15 => format!(
                "Last-Event-ID: {}",
                pick(
                    r,
                    &["0", "3", "-1", "x", "2147483647", "99999999999999", " 2 "]
                )
            )
            .into_bytes(),
            16 => format!("Last-Event-ID: {}", "9".repeat(5_000)).into_bytes(),
            17 => b"traceparent: 00-zz-zz-zz".to_vec(),
            18 => b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_vec(),
            19 => format!(
                "traceparent: 00-{}-b7ad6b7169203331-01",
                "0af7".repeat(2_500)
            )
            .into_bytes(),
            20 => format!("tracestate: {}", "k=v,".repeat(2_000)).into_bytes(),
            21 => b"Expect: 100-continue".to_vec(),
            22 => b"Expect: 200-ok".to_vec(),
            23 => b"Range: bytes=0-1".to_vec(),
            24 => b"If-None-Match: *".to_vec(),
            25 => b"Accept: text/event-stream".to_vec(),
            26 => b"Accept: */*;q=0".to_vec(),
            27 => b"Accept-Encoding: gzip, deflate, br".to_vec(),
            28 => b"Accept-Charset: utf-16".to_vec(),
            29 => format!(
                "Content-Encoding: {}",
                pick(
                    r,
                    &[
                        "gzip",
                        "br",
                        "deflate",
                        "identity",
                        "gzip, gzip",
                        "x-evil",
                        ""
                    ]
                )
            )
            .into_bytes(),
            30 => b"X-Bin: \xff\xfe\xfd".to_vec(),
            31 => b"Cookie: sas_session=forged; theme=dark".to_vec(),
            32 => b"Content-Type: text/plain".to_vec(),
            33 => b"X-Long: "
                .iter()
                .copied()
                .chain(std::iter::repeat_n(b'v', 60_000))
                .collect(),
            // Refused by the HTTP parser: the server may close.
            34 => {
                d.may_close = true;
                pick(
                    r,
                    &[
                        b"X-Nul: a\0b".as_slice(),
                        b"X-Ctl: \x1b[2J",
                        b"X-Fold: a\r\n folded",
                        b"Bad Name: x",
                        b"NoColon",
                        b": empty",
                        b"X-CR: a\rb",
                    ],
                )
                .to_vec()
            }
            _ => format!("X-Extra-{}: {}", below(r, 1000), below(r, 1000)).into_bytes(),
        };
        d.headers.push(line);
    }
    // A header flood, or one header past the server's buffer.
    if chance(r, 3) {
        d.may_close = true;
        let n = draw(r, 50usize..160);
        d.what.push(format!("{n} more headers"));
        for i in 0..n {
            d.header(format!("X-H{i}: v"));
        }
    }
    if chance(r, 1) {
        d.may_close = true;
        let n = draw(r, 100_000usize..600_000);
        d.what.push(format!("a header of {n} bytes"));
        d.header(format!("X-Huge: {}", "a".repeat(n)));
    }
}

/// `Content-Type` of a request with a body.
fn content_type(r: &mut TestRunner, d: &mut Draft, json_likely: u32) {
    if chance(r, json_likely) {
        d.header("Content-Type: application/json");
        return;
    }
    let ct: &[u8] = pick::<&[u8]>(
        r,
        &[
            b"".as_slice(),
            b"Content-Type: text/plain",
            b"Content-Type: application/json; charset=utf-8",
            b"Content-Type: application/json; charset=utf-16",
            b"Content-Type: application/json;charset=\"iso-8859-1\"",
            b"Content-Type: APPLICATION/JSON",
            b"Content-Type: application/jsonx",
            b"Content-Type: application/json, text/html",
            b"Content-Type:  application/json ",
            b"Content-Type: multipart/form-data; boundary=x",
            b"Content-Type: application/x-www-form-urlencoded",
            b"Content-Type: */*",
            b"Content-Type: application/json; charset=utf-8; charset=latin1",
            b"Content-Type: application/json\xff",
            b"Content-Type: application/json\r\nContent-Type: text/plain",
        ],
    );
    if !ct.is_empty() {
        d.what.push(String::from_utf8_lossy(ct).into_owned());
        d.headers.push(ct.to_vec());
    }
}

/// A method: mostly the route's own.
fn method(r: &mut TestRunner, d: &mut Draft, natural: &str) {
    let long = "X".repeat(300);
    let m: &str = match weighted(r, &[(80, 0), (15, 1), (5, 2)]) {
        0 => natural,
        1 => pick::<&str>(
            r,
            &[
                "GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "CONNECT",
            ],
        ),
        _ => {
            d.may_close = true;
            pick::<&str>(
                r,
                &[
                    "get",
                    "post",
                    "PROPFIND",
                    "FOO",
                    "G\0T",
                    long.as_str(),
                    "GET\x7f",
                    "",
                    "P OST",
                ],
            )
        }
    };
    if m == "CONNECT" {
        d.may_close = true;
    }
    d.method = m.as_bytes().to_vec();
}

/// The request line's method and path of a request to the API, and whose
/// order it names.
fn api_path(r: &mut TestRunner, w: &World, d: &mut Draft) -> Target {
    let (id, mut target) = api_id(r, w);
    let (natural, path) = match weighted(
        r,
        &[
            (22, "submit"),
            (18, "order"),
            (14, "events"),
            (13, "cancel"),
            (18, "signal"),
            (2, "openapi"),
            (3, "probe"),
            (10, "odd"),
        ],
    ) {
        "submit" => {
            target = Target::Other;
            ("POST", "/v1/orders".to_owned())
        }
        "order" => ("GET", format!("/v1/orders/{id}")),
        "events" => ("GET", format!("/v1/orders/{id}/events{}", from_seq(r))),
        "cancel" => ("POST", format!("/v1/orders/{id}/cancel")),
        "signal" => {
            let name = signal_name(r);
            ("POST", format!("/v1/orders/{id}/signals/{name}"))
        }
        "openapi" => {
            target = Target::Other;
            ("GET", "/v1/openapi.json".to_owned())
        }
        "probe" => {
            target = Target::Other;
            (
                "GET",
                pick(r, &["/healthz", "/readyz", "/metrics"]).to_string(),
            )
        }
        _ => ("GET", odd_api_path(r, d, &id)),
    };
    method(r, d, natural);
    d.target = mutate_path(r, d, path, w.api_port).into_bytes();
    if chance(r, 2) {
        // Bytes a URI never holds unescaped.
        d.may_close = true;
        d.what.push("raw bytes in the path".into());
        let raw: &[u8] = pick::<&[u8]>(
            r,
            &[
                b"\xff\xfe".as_slice(),
                "é".as_bytes(),
                b"\x80",
                b"%",
                b"\x7f",
            ],
        );
        d.target.extend_from_slice(raw);
    }
    target
}

/// Paths off the API's routes, most of them naming an order.
fn odd_api_path(r: &mut TestRunner, d: &mut Draft, id: &str) -> String {
    let choice = below(r, 25);
    if choice >= 21 {
        d.may_close = true;
    }
    let path = match choice {
        0 => "/",
        1 => "/v1",
        2 => "/v1/",
        3 => "/v2/orders",
        4 => "/v1/orders/{id}/other",
        5 => "/v1/orders/{id}/signals",
        6 => "/v1/orders/{id}/signals/a/b",
        7 => "/v1/orders/{id}/events/x",
        8 => "/v1/orders/{id}/../../v1/openapi.json",
        9 => "/v1/orders/%2e%2e/{id}",
        10 => "/v1/orders/..%2f{id}",
        11 => "/v1/./orders/{id}",
        12 => "//v1/orders/{id}",
        13 => "/v1/orders/{id}/",
        14 => "/V1/ORDERS/{id}",
        15 => "/v1/orders/{id}%2fcancel",
        16 => "/v1/orders/{id}/cancel/",
        17 => "/v1/orders/{id};cancel",
        18 => "/metrics/../v1/orders/{id}",
        19 => "http://evil.example/v1/orders/{id}",
        20 => "*",
        21 => "\\v1\\orders\\{id}",
        22 => "/v1/orders/{id}\0",
        23 => return format!("/{}", "x".repeat(70_000)),
        _ => return format!("/v1/orders/{}", "a/".repeat(2_000)),
    };
    path.replace("{id}", id)
}

/// Now and then, the same path written otherwise.
fn mutate_path(r: &mut TestRunner, d: &mut Draft, path: String, port: u16) -> String {
    if !chance(r, 10) {
        return path;
    }
    d.what.push("path rewritten".into());
    match below(r, 7) {
        0 => format!("http://127.0.0.1:{port}{path}"),
        1 => format!("http://evil.example{path}"),
        2 => format!("{path}?x=%00&x=%ff&access_token={VICTIM_TOKEN}"),
        3 => format!("{path}#frag"),
        4 => format!("{path}/"),
        5 => path.replacen('/', "//", 2),
        _ => format!("{path}?{}", "q=1&".repeat(below(r, 3_000))),
    }
}

/// The body of a request to the API.
fn api_body(r: &mut TestRunner, w: &World, d: &mut Draft) {
    let path = String::from_utf8_lossy(&d.target).into_owned();
    let post_like = d.method != b"GET" && d.method != b"HEAD";
    let (body, label) = if path.ends_with("/v1/orders") && post_like {
        order_body(r, w)
    } else if path.contains("/signals/") && post_like {
        // A NUL in the data among them: a 500 before #56, now a 400.
        signal_body(r)
    } else if chance(r, if post_like { 15 } else { 6 }) {
        (not_json(r), "a body where none is read".into())
    } else {
        (Vec::new(), String::new())
    };
    if !body.is_empty() || post_like {
        content_type(r, d, if post_like { 70 } else { 20 });
    }
    if !label.is_empty() {
        d.what.push(label);
    }
    d.body = body;
}

fn api_case(r: &mut TestRunner, w: &World) -> Case {
    let mut d = Draft::default();
    let target = api_path(r, w, &mut d);
    let (who, auth) = api_auth(r);
    if chance(r, 5) {
        let id = pick(r, &w.victim);
        let mut second = format!(
            "GET /v1/orders/{id}{} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n",
            pick(r, &["", "/events"]),
            w.api_port
        )
        .into_bytes();
        for h in &auth {
            second.extend_from_slice(h);
            second.extend_from_slice(b"\r\n");
        }
        second.extend_from_slice(b"Connection: close\r\n\r\n");
        d.second = Some(second);
    }
    host(r, &mut d, w.api_port);
    d.headers.extend(auth);
    extras(r, &mut d, w, w.api_port);
    api_body(r, w, &mut d);
    let public = public_path(
        &d.target,
        &["/v1/openapi.json", "/healthz", "/readyz", "/metrics"],
    );
    finish(r, d, Surface::Api, who, target, public, false)
}

/// The dashboard's files, served to anyone.
const DASHBOARD_PUBLIC: &[&str] = &[
    "/login",
    "/logout",
    "/healthz",
    "/readyz",
    "/metrics",
    "/assets/style.css",
    "/assets/common.js",
    "/assets/overview.js",
    "/assets/order.js",
    "/assets/find.js",
];

/// A query of the dashboard's order search.
fn search_query(r: &mut TestRunner, w: &World) -> String {
    let long_workflow = "w".repeat(300);
    let long_field = "f.".repeat(500);
    let long_value = "v".repeat(10_000);
    let long_cursor = "c".repeat(500);
    let mut params = Vec::new();
    for _ in 0..below(r, 5) {
        let p = match below(r, 10) {
            0 => {
                let id = pick(r, &w.victim_stored).to_string();
                format!("id={}", pick(r, &[id.as_str(), "x", "%00"]))
            }
            1 => format!(
                "state={}",
                pick(r, &["processed", "pending", "nope", "%00", "PROCESSED"])
            ),
            2 => format!(
                "workflow={}",
                pick(
                    r,
                    &[
                        "one",
                        "approved",
                        "%00",
                        "%C3%A9",
                        "a%27--",
                        long_workflow.as_str()
                    ]
                )
            ),
            3 | 4 => {
                let bound = pick(r, &["from", "to"]);
                let time = pick(
                    r,
                    &[
                        "2024-01-01T00:00:00Z",
                        "x",
                        "%00",
                        "%2B275760-09-13T00:00:00Z",
                        "1970-01-01T00:00:00Z",
                        "2999-12-31T23:59:59.999999999Z",
                    ],
                );
                format!("{bound}={time}")
            }
            5 => format!(
                "field={}",
                pick(
                    r,
                    &[
                        "n",
                        "customer.id",
                        "a..b",
                        "%00",
                        "$.a",
                        "a[0]",
                        long_field.as_str()
                    ]
                )
            ),
            6 => format!(
                "value={}",
                pick(
                    r,
                    &[
                        "1",
                        "42",
                        "%00",
                        "%22x%22",
                        "null",
                        "%7B%7D",
                        long_value.as_str()
                    ]
                )
            ),
            7 => format!(
                "after={}",
                pick(r, &["x", "%00", "MTIz", "eyJ9", long_cursor.as_str()])
            ),
            8 => format!(
                "limit={}",
                pick(r, &["0", "1", "200", "201", "-1", "x", "99999999999"])
            ),
            _ => pick(r, &["zzz=1", "%00=1", "=", "&&", "state"]).to_string(),
        };
        params.push(p);
    }
    if params.is_empty() {
        String::new()
    } else {
        format!("?{}", params.join("&"))
    }
}

/// The path of a request to the dashboard, with its route's method.
fn dashboard_path(r: &mut TestRunner, w: &World, d: &mut Draft) {
    let id = match below(r, 10) {
        0..=3 => pick(r, &w.victim_stored).to_string(),
        4 => pick(r, &w.victim).to_string(),
        5 => pick(r, &w.attacker_stored).to_string(),
        6 => drawn_id(r).to_string(),
        7 => pick(r, &w.victim_stored).to_string().to_uppercase(),
        _ => malformed_id(r),
    };
    let queue = match below(r, 6) {
        0..=2 => pick(r, &w.dead_queues).clone(),
        3 => format!("{}.orders", w.prefix),
        4 => "amq.direct".into(),
        _ => pick(r, &["..%2f..", "%00", "", "x"]).to_string(),
    };
    let (natural, path) = match weighted(
        r,
        &[
            (6, "/"),
            (4, "page"),
            (5, "login"),
            (2, "logout"),
            (4, "asset"),
            (6, "me"),
            (6, "overview"),
            (3, "schedules"),
            (12, "search"),
            (10, "order"),
            (8, "retry"),
            (8, "cancel"),
            (6, "redrive"),
            (6, "signal"),
            (3, "dead-letters"),
            (4, "dead-letter list"),
            (4, "dead-letter action"),
            (3, "probe"),
            (4, "odd"),
        ],
    ) {
        "/" => ("GET", "/".to_owned()),
        "page" => ("GET", format!("/orders/{id}")),
        "login" => (*pick(r, &["GET", "POST", "POST"]), "/login".to_owned()),
        "logout" => (*pick(r, &["GET", "POST"]), "/logout".to_owned()),
        "asset" => (
            "GET",
            pick(
                r,
                &[
                    "/assets/common.js",
                    "/assets/style.css",
                    "/assets/../api/overview",
                    "/assets/%2e%2e/api/me",
                    "/assets/nope.js",
                    "/assets/common.js%00",
                ],
            )
            .to_string(),
        ),
        "me" => ("GET", "/api/me".to_owned()),
        "overview" => ("GET", "/api/overview".to_owned()),
        "schedules" => ("GET", "/api/schedules".to_owned()),
        "search" => ("GET", format!("/api/orders{}", search_query(r, w))),
        "order" => ("GET", format!("/api/orders/{id}")),
        "retry" => ("POST", format!("/api/orders/{id}/retry")),
        "cancel" => ("POST", format!("/api/orders/{id}/cancel")),
        "redrive" => ("POST", format!("/api/orders/{id}/redrive")),
        "signal" => {
            let name = signal_name(r);
            ("POST", format!("/api/orders/{id}/signals/{name}"))
        }
        "dead-letters" => ("GET", "/api/dead-letters".to_owned()),
        "dead-letter list" => (
            "GET",
            format!(
                "/api/dead-letters/{queue}{}",
                pick(
                    r,
                    &[
                        "",
                        "?limit=1",
                        "?limit=1000",
                        "?limit=0",
                        "?limit=x",
                        "?x=1"
                    ]
                )
            ),
        ),
        "dead-letter action" => (
            "POST",
            format!(
                "/api/dead-letters/{queue}/{}",
                pick(r, &["replay", "purge", "purge", "nope", "replay?limit=1"])
            ),
        ),
        "probe" => (
            "GET",
            pick(r, &["/healthz", "/readyz", "/metrics"]).to_string(),
        ),
        _ => (
            "GET",
            pick(
                r,
                &[
                    "/api",
                    "/api/",
                    "/api/orders/",
                    "/API/ME",
                    "//api/me",
                    "/api/me/../overview",
                    "/login/../api/me",
                    "/nothing",
                    "http://evil.example/api/me",
                ],
            )
            .to_string(),
        ),
    };
    method(r, d, natural);
    d.target = mutate_path(r, d, path, w.dashboard_port).into_bytes();
}

/// The body of a request to the dashboard.
fn dashboard_body(r: &mut TestRunner, d: &mut Draft) {
    let path = String::from_utf8_lossy(&d.target).into_owned();
    let post_like = d.method != b"GET" && d.method != b"HEAD";
    if !post_like && !chance(r, 5) {
        return;
    }
    if path.contains("/login") {
        // A login form: a token nobody holds.
        let longer = format!("{OPERATOR_TOKEN}x");
        let long = "t".repeat(10_000);
        let token = pick(
            r,
            &[
                &OPERATOR_TOKEN[1..],
                "x",
                "",
                VICTIM_TOKEN,
                longer.as_str(),
                long.as_str(),
            ],
        )
        .to_string();
        d.header("Content-Type: application/x-www-form-urlencoded");
        d.body = match below(r, 4) {
            0 => b"token=%00".to_vec(),
            1 => b"token=a&token=b".to_vec(),
            _ => format!("token={token}").into_bytes(),
        };
        d.what.push("a login form".into());
        return;
    }
    content_type(r, d, 70);
    let (body, label) = match below(r, 8) {
        0 => (b"{}".to_vec(), "{}"),
        1 | 2 => (
            format!("{{\"data\":{}}}", json_value(r, 0)).into_bytes(),
            "data",
        ),
        3 => (
            format!("{{\"patch\":{}}}", json_value(r, 0)).into_bytes(),
            "a patch",
        ),
        4 => (json_value(r, 0).into_bytes(), "JSON"),
        5 => (not_json(r), "not JSON"),
        6 => (vec![b' '; 70_000], "over the limit"),
        _ => (deep(r, 200).into_bytes(), "deep"),
    };
    d.what.push(label.into());
    d.body = body;
}

fn dashboard_case(r: &mut TestRunner, w: &World) -> Case {
    let mut d = Draft::default();
    dashboard_path(r, w, &mut d);
    let (who, auth) = dashboard_auth(r);
    host(r, &mut d, w.dashboard_port);
    d.headers.extend(auth);
    extras(r, &mut d, w, w.dashboard_port);
    dashboard_body(r, &mut d);
    let public = public_path(&d.target, DASHBOARD_PUBLIC);
    let path = String::from_utf8_lossy(&d.target).into_owned();
    let acts = !matches!(d.method.as_slice(), b"GET" | b"HEAD" | b"OPTIONS")
        && request_path(&path).starts_with("/api/");
    finish(r, d, Surface::Dashboard, who, Target::Other, public, acts)
}

/// The path of a request target (origin or absolute form), without its
/// query.
fn request_path(target: &str) -> &str {
    let rest = target
        .strip_prefix("http://")
        .or_else(|| target.strip_prefix("https://"))
        .map_or(target, |rest| rest.find('/').map_or("", |i| &rest[i..]));
    rest.split(['?', '#']).next().unwrap_or_default()
}

/// Whether the path of `target` is one of `public`.
fn public_path(target: &[u8], public: &[&str]) -> bool {
    public.contains(&request_path(&String::from_utf8_lossy(target)))
}

/// The request's framing and version, then its bytes.
fn finish(
    r: &mut TestRunner,
    mut d: Draft,
    surface: Surface,
    who: Who,
    target: Target,
    public: bool,
    acts: bool,
) -> Case {
    let mut half_close = false;
    let body = std::mem::take(&mut d.body);
    let len = body.len();
    let mut framed = body.clone();
    let framing = weighted(
        r,
        &[
            (84, "length"),
            (5, "chunked"),
            (2, "bad chunks"),
            (2, "long"),
            (2, "short"),
            (2, "bad length"),
            (1, "doubled"),
            (1, "both"),
            (1, "other coding"),
        ],
    );
    match framing {
        "length" => {
            if len > 0 || d.method != b"GET" || chance(r, 50) {
                d.header(format!("Content-Length: {len}"));
            }
        }
        "chunked" => {
            d.header("Transfer-Encoding: chunked");
            framed = chunked(r, &body);
            if chance(r, 20) {
                // Trailers after the last chunk.
                framed.truncate(framed.len() - 2);
                framed.extend_from_slice(b"X-Trailer: 1\r\n\r\n");
            }
        }
        "bad chunks" => {
            d.header("Transfer-Encoding: chunked");
            half_close = true;
            let size: &[u8] = pick::<&[u8]>(
                r,
                &[
                    b"zz".as_slice(),
                    b"ffffffffffffffffffff",
                    b"-1",
                    b"",
                    b"5;",
                    b"1\n",
                ],
            );
            framed = [size, b"\r\n".as_slice(), &body].concat();
        }
        "long" => {
            half_close = true;
            d.header(format!("Content-Length: {}", len + 1 + below(r, 1_000)));
        }
        "short" => d.header(format!("Content-Length: {}", len / 2)),
        "bad length" => {
            // Some read as a length after all (" 5"): then the body may
            // be shorter than it says.
            half_close = true;
            d.header(format!(
                "Content-Length: {}",
                pick(
                    r,
                    &[
                        "-1",
                        "abc",
                        " 5",
                        "+5",
                        "0x10",
                        "1,2",
                        "99999999999999999999999",
                        "5 5",
                        ""
                    ]
                )
            ));
        }
        "doubled" => {
            d.header(format!("Content-Length: {len}"));
            d.header(format!("Content-Length: {}", len + below(r, 2)));
        }
        "both" => {
            half_close = true;
            d.header(format!("Content-Length: {len}"));
            d.header("Transfer-Encoding: chunked");
            framed = chunked(r, &body);
        }
        _ => {
            half_close = true;
            let coding = pick(
                r,
                &[
                    "gzip",
                    "gzip, chunked",
                    "chunked, gzip",
                    "identity",
                    "chunked, chunked",
                    "xchunked",
                ],
            );
            d.header(format!("Transfer-Encoding: {coding}"));
            if coding.ends_with("chunked") {
                framed = chunked(r, &body);
            }
        }
    }
    if framing != "length" {
        d.may_close = true;
        d.what.push(framing.to_owned());
    }
    // Large requests may be refused before they are read: then the
    // server closes with the rest unread, and the answer may be lost.
    let size: usize = framed.len() + d.headers.iter().map(Vec::len).sum::<usize>();
    if size > 16 * 1024 || d.target.len() > 8 * 1024 {
        d.may_close = true;
    }
    let version: &[u8] = match weighted(r, &[(94, 0), (3, 1), (3, 2)]) {
        0 => b" HTTP/1.1",
        1 => b" HTTP/1.0",
        _ => {
            d.may_close = true;
            d.what.push("another version".into());
            pick::<&[u8]>(
                r,
                &[
                    b" HTTP/2.0".as_slice(),
                    b" HTTP/1.2",
                    b" HTTP/0.9",
                    b" http/1.1",
                    b" HTTP/1.1 junk",
                    b" HTTP/11",
                    b"",
                    b" HTTP/1.1\0",
                    b" HTTP/3",
                ],
            )
        }
    };
    // A pipelined second request: this one keeps the connection open.
    let pipelined = d.second.is_some();
    if pipelined {
        d.headers.retain(|h| h.as_slice() != b"Connection: close");
        d.what.push("then a request for a victim's order".into());
    }
    let mut line_end: &[u8] = b"\r\n";
    let mut bytes = Vec::new();
    match weighted(r, &[(97, 0), (1, 1), (1, 2), (1, 3)]) {
        // A blank line first, as a client after a POST may send.
        1 => bytes.extend_from_slice(b"\r\n"),
        2 => line_end = b"\n",
        3 => {
            d.may_close = true;
            d.what.push("two spaces".into());
            d.method.push(b' ');
        }
        _ => {}
    }
    bytes.extend_from_slice(&d.method);
    bytes.push(b' ');
    bytes.extend_from_slice(&d.target);
    bytes.extend_from_slice(version);
    bytes.extend_from_slice(line_end);
    for h in &d.headers {
        bytes.extend_from_slice(h);
        bytes.extend_from_slice(line_end);
    }
    bytes.extend_from_slice(line_end);
    bytes.extend_from_slice(&framed);
    if let Some(second) = &d.second {
        bytes.extend_from_slice(second);
    }
    let abandon = chance(r, 2);
    let method = String::from_utf8_lossy(&d.method).into_owned();
    let mut path = String::from_utf8_lossy(&d.target).into_owned();
    if path.len() > 160 {
        path = format!(
            "{}… ({} bytes)",
            &path[..path.floor_char_boundary(160)],
            d.target.len()
        );
    }
    let mut what = format!("{method} {path}");
    for w in &d.what {
        what.push_str(&format!("; {w}"));
    }
    Case {
        surface,
        who,
        target,
        public,
        acts,
        may_close: d.may_close || half_close,
        half_close,
        abandon,
        head: d.method == b"HEAD",
        pipelined,
        what,
        bytes,
    }
}

/// `body` in one to four chunks (a chunk extension now and then), then
/// the last chunk.
fn chunked(r: &mut TestRunner, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = body;
    let pieces = 1 + below(r, 4);
    for i in 0..pieces {
        let n = if i + 1 == pieces {
            rest.len()
        } else {
            below(r, rest.len() + 1)
        };
        if n == 0 {
            continue;
        }
        let (chunk, tail) = rest.split_at(n);
        let ext = if chance(r, 10) { ";a=b" } else { "" };
        out.extend_from_slice(format!("{n:x}{ext}\r\n").as_bytes());
        out.extend_from_slice(chunk);
        out.extend_from_slice(b"\r\n");
        rest = tail;
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

/// An answer as read off the socket.
#[derive(Debug, Default)]
struct Answer {
    /// `None` when the connection closed before a status line.
    status: Option<u16>,
    head: String,
    body: Vec<u8>,
    /// An event stream, read for what came at once.
    streaming: bool,
    timed_out: bool,
    /// The status of the answer to a pipelined second request, if any
    /// came (its head and body are appended to `body`).
    second: Option<u16>,
}

impl Answer {
    /// Whether it sets a session cookie (not the one that removes it).
    fn opens_session(&self) -> bool {
        self.head.lines().any(|l| {
            let l = l.to_ascii_lowercase();
            l.starts_with("set-cookie:")
                && l.contains("sas_session=")
                && !l.contains("sas_session=;")
        })
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Reads more into `buf`; false at the end (or past 128 times [`KEPT`]).
async fn read_some(stream: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 16 * 1024];
    match stream.read(&mut chunk).await {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            buf.len() < 128 * KEPT
        }
    }
}

/// A chunked body decoded, once its last chunk is in, and the bytes it
/// took.
fn dechunk(data: &[u8]) -> Option<(Vec<u8>, usize)> {
    let mut out = Vec::new();
    let mut at = 0;
    loop {
        let end = at + find(&data[at..], b"\r\n")?;
        let size = std::str::from_utf8(&data[at..end]).ok()?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        at = end + 2;
        if size == 0 {
            // No trailers, or trailers up to a blank line.
            return if data[at..].starts_with(b"\r\n") {
                Some((out, at + 2))
            } else {
                find(&data[at..], b"\r\n\r\n").map(|i| (out, at + i + 4))
            };
        }
        if data.len() < at + size + 2 {
            return None;
        }
        out.extend_from_slice(&data[at..at + size]);
        at += size + 2;
    }
}

/// Reads one answer from `stream`, `buf` holding what was read past the
/// previous one: its head, then its body as its framing says (what is
/// read past it stays in `buf`); an event stream for what comes at once.
async fn read_answer(stream: &mut TcpStream, buf: &mut Vec<u8>, head_only: bool) -> Answer {
    loop {
        let Some(end) = find(buf, b"\r\n\r\n") else {
            if read_some(stream, buf).await {
                continue;
            }
            let head = String::from_utf8_lossy(buf).into_owned();
            buf.clear();
            return Answer {
                status: head
                    .strip_prefix("HTTP/1.")
                    .and_then(|h| h.split_whitespace().nth(1))
                    .and_then(|s| s.parse().ok()),
                head,
                ..Answer::default()
            };
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        buf.drain(..end + 4);
        let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok());
        if status.is_some_and(|s: u16| (100..200).contains(&s) && s != 101) {
            continue;
        }
        let lower = head.to_ascii_lowercase();
        let mut streaming = false;
        let body = if head_only || matches!(status, Some(101 | 204 | 304)) {
            Vec::new()
        } else if lower.contains("content-type: text/event-stream") {
            streaming = true;
            let _ = tokio::time::timeout(Duration::from_millis(300), async {
                while read_some(stream, buf).await {}
            })
            .await;
            std::mem::take(buf)
        } else if lower.contains("transfer-encoding: chunked") {
            loop {
                if let Some((body, used)) = dechunk(buf) {
                    buf.drain(..used);
                    break body;
                }
                if !read_some(stream, buf).await {
                    break std::mem::take(buf);
                }
            }
        } else if let Some(n) = lower
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|n| n.trim().parse::<usize>().ok())
        {
            while buf.len() < n && read_some(stream, buf).await {}
            let rest = buf.split_off(n.min(buf.len()));
            std::mem::replace(buf, rest)
        } else {
            while read_some(stream, buf).await {}
            std::mem::take(buf)
        };
        return Answer {
            status,
            head,
            body,
            streaming,
            ..Answer::default()
        };
    }
}

/// Sends a case on a connection of its own and reads its answer (and the
/// pipelined second one's).
async fn exchange(port: u16, case: &Case) -> Answer {
    let mut stream = tokio::time::timeout(
        Duration::from_secs(10),
        TcpStream::connect(("127.0.0.1", port)),
    )
    .await
    .expect("connect within 10 s")
    .expect("connect");
    // The server may refuse before it has read it all.
    let _ = stream.write_all(&case.bytes).await;
    if case.abandon {
        return Answer::default();
    }
    if case.half_close {
        let _ = stream.shutdown().await;
    }
    let read = async {
        let mut buf = Vec::new();
        let mut answer = read_answer(&mut stream, &mut buf, case.head).await;
        answer.body.truncate(KEPT);
        if case.pipelined && !answer.streaming && answer.status.is_some() {
            let second = read_answer(&mut stream, &mut buf, false).await;
            answer.second = second.status;
            answer
                .body
                .extend_from_slice(b"\n--- the second answer ---\n");
            answer.body.extend_from_slice(second.head.as_bytes());
            answer
                .body
                .extend_from_slice(&second.body[..second.body.len().min(KEPT)]);
        }
        answer
    };
    match tokio::time::timeout(ANSWER_WITHIN, read).await {
        Ok(answer) => answer,
        Err(_) => Answer {
            timed_out: true,
            ..Answer::default()
        },
    }
}

/// What is wrong with the answer to a case, if anything, as far as it
/// can be told from the answer alone.
fn judge(case: &Case, answer: &Answer) -> Option<String> {
    if case.abandon {
        return None;
    }
    if answer.timed_out {
        return Some(format!("no answer within {ANSWER_WITHIN:?}"));
    }
    let Some(status) = answer.status else {
        return (!case.may_close).then(|| "closed without an answer".to_owned());
    };
    if status >= 500 {
        return Some(format!("answered {status}"));
    }
    // The second request of a pipelined pair names a victim's order.
    if let Some(second) = answer.second
        && (!(400..500).contains(&second) || second == 409)
    {
        return Some(format!(
            "a pipelined request for a victim's order answered {second} to {:?}",
            case.who
        ));
    }
    let success = (200..300).contains(&status);
    let unknown = matches!(case.who, Who::Nobody | Who::Forged);
    match case.surface {
        Surface::Api => {
            // A 4xx any id gets alike (a body or a query refused before
            // the order is looked up) tells nothing; a 409 tells the
            // order's state.
            if case.target == Target::Victim && (!(400..500).contains(&status) || status == 409) {
                return Some(format!(
                    "a victim's order answered {status} to {:?}",
                    case.who
                ));
            }
            if unknown && success && !case.public {
                return Some(format!("answered {status} without a valid token"));
            }
        }
        Surface::Dashboard => {
            if unknown && success && !case.public {
                return Some(format!("answered {status} without a dashboard token"));
            }
            if unknown && answer.opens_session() {
                return Some("opened a session".to_owned());
            }
            if case.who == Who::Viewer && case.acts && success {
                return Some(format!("a viewer's action answered {status}"));
            }
        }
    }
    None
}

/// Printable bytes: escapes for the rest, cut at `max`.
fn shown(bytes: &[u8], max: usize) -> String {
    let cut = &bytes[..bytes.len().min(max)];
    let mut text: String = cut.escape_ascii().to_string();
    if bytes.len() > max {
        text.push_str(&format!("… ({} bytes)", bytes.len()));
    }
    text
}

/// The applications, the workflow with a signal step, and the dashboard
/// with tokens. The dashboard's login throttle is set out of the way, so
/// that forged tokens are judged, not refused unread (its own tests are
/// `dashboard_hardening`'s).
fn config(run: &str) -> String {
    format!(
        "[applications.victim]\nreply_to = [\"{run}-victim.*\"]\ntokens = [\"{VICTIM_HASH}\"]\n\n\
         [applications.attacker]\nreply_to = [\"{run}-attacker.*\"]\ntokens = [\"{ATTACKER_HASH}\"]\n\n\
         [workflows.approved]\nsteps = [\n  {{ name = \"reserve\", agent = \"a\" }},\n  \
         {{ name = \"approve\", signal = \"approval\", timeout = \"600s\" }},\n]\n\
         {}login_failures_per_client = 1000000\nlogin_failures_total = 1000000\n",
        token_auth()
    )
}

/// A well-behaved client of the API, with an application's token.
#[derive(Clone)]
struct Good {
    base: String,
    http: reqwest::Client,
}

impl Good {
    fn new(port: u16) -> Self {
        sas::tls::install_crypto_provider();
        Self {
            base: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::builder()
                // Streams stay open until their order ends.
                .timeout(Duration::from_secs(240))
                .build()
                .expect("HTTP client"),
        }
    }

    async fn send(&self, request: reqwest::RequestBuilder, token: &str) -> (u16, Value) {
        match request.bearer_auth(token).send().await {
            Ok(response) => {
                let status = response.status().as_u16();
                let bytes = response.bytes().await.unwrap_or_default();
                (
                    status,
                    serde_json::from_slice(&bytes).unwrap_or(Value::Null),
                )
            }
            Err(e) => (0, Value::String(e.to_string())),
        }
    }

    async fn submit(&self, token: &str, body: &Value, key: Option<Uuid>) -> (u16, Value) {
        let mut request = self
            .http
            .post(format!("{}/v1/orders", self.base))
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(key) = key {
            request = request.header("idempotency-key", key.to_string());
        }
        self.send(request, token).await
    }

    async fn get(&self, token: &str, path: &str) -> (u16, Value) {
        self.send(self.http.get(format!("{}{path}", self.base)), token)
            .await
    }

    async fn post(&self, token: &str, path: &str, body: &str) -> (u16, Value) {
        let request = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_owned());
        self.send(request, token).await
    }

    /// An order's event stream read to its end: its events, or what went
    /// wrong.
    async fn stream(&self, token: &str, id: Uuid) -> Result<Vec<Value>, String> {
        let response = self
            .http
            .get(format!("{}/v1/orders/{id}/events", self.base))
            .bearer_auth(token)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let text = response.text().await.map_err(|e| e.to_string())?;
        if status != 200 {
            return Err(format!("{status}: {text}"));
        }
        Ok(text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| serde_json::from_str(d.trim()).unwrap_or(Value::Null))
            .collect())
    }

    /// Submits an order by the id `id` (drawn, so that the attack's
    /// draws replay with the same ids); returns it.
    async fn order(&self, token: &str, body: Value, id: Uuid) -> Uuid {
        let (status, answer) = self.submit(token, &body, Some(id)).await;
        assert_eq!(status, 202, "{answer}");
        id
    }
}

/// What is wrong with a stream of order `id`'s events: they must be its
/// own, numbered from 1 without a gap, ending with `last`.
fn stream_problem(id: Uuid, events: &[Value], last: &str) -> Option<String> {
    let seqs: Vec<i64> = events.iter().filter_map(|e| e["seq"].as_i64()).collect();
    let own = events.iter().all(|e| e["order_id"] == id.to_string());
    let ends = events.last().map(|e| e["state"].clone());
    (!own || seqs != (1..=events.len() as i64).collect::<Vec<_>>() || ends != Some(json!(last)))
        .then(|| format!("the stream of {id}: {events:?}"))
}

/// The victim's traffic while the attack runs: an order of `three` every
/// 50 ms (ids from `ids`, in order) until `stop`, every third followed on
/// its event stream, the others read back. Returns the orders submitted
/// and what went wrong.
async fn victim_traffic(
    api: Good,
    ids: Vec<Uuid>,
    stop: Arc<AtomicBool>,
) -> (Vec<Uuid>, Vec<String>) {
    let mut problems = Vec::new();
    let mut submitted = Vec::new();
    let mut streams = Vec::new();
    for (i, id) in ids.into_iter().enumerate() {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let body = json!({ "workflow": "three", "payload": { "n": i } });
        let (status, answer) = api.submit(VICTIM_TOKEN, &body, Some(id)).await;
        if status != 202 {
            problems.push(format!("the victim's order {id}: {status} {answer}"));
        }
        submitted.push(id);
        if i % 3 == 0 {
            let api = api.clone();
            streams.push(tokio::spawn(async move {
                (id, api.stream(VICTIM_TOKEN, id).await)
            }));
        } else {
            let (status, view) = api.get(VICTIM_TOKEN, &format!("/v1/orders/{id}")).await;
            if status != 200 || view["order_id"] != id.to_string() {
                problems.push(format!("the victim's view of {id}: {status} {view}"));
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for stream in streams {
        let (id, events) = stream.await.expect("the stream's task");
        match events {
            Ok(events) => problems.extend(stream_problem(id, &events, "processed")),
            Err(e) => problems.push(format!("the stream of {id}: {e}")),
        }
    }
    (submitted, problems)
}

/// The operator's session on the dashboard (its cookie), by the login form.
async fn operator_session(http: &reqwest::Client, base: &str) -> String {
    let response = http
        .post(format!("{base}/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .header("origin", base)
        .body(format!("token={OPERATOR_TOKEN}"))
        .send()
        .await
        .expect("the dashboard answers");
    assert_eq!(response.status().as_u16(), 303);
    let cookie = response.headers()["set-cookie"].to_str().expect("text");
    cookie.split(';').next().expect("a cookie").to_owned()
}

/// The operator's dashboard while the attack runs: the overview and one of
/// the victim's orders, every 250 ms until `stop`. Returns the pages read
/// and what went wrong.
async fn operator_traffic(port: u16, order: Uuid, stop: Arc<AtomicBool>) -> (usize, Vec<String>) {
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .build()
        .expect("HTTP client");
    let base = format!("http://127.0.0.1:{port}");
    let cookie = operator_session(&http, &base).await;
    let mut problems = Vec::new();
    let mut read = 0;
    while !stop.load(Ordering::Relaxed) {
        for path in ["/api/overview".to_owned(), format!("/api/orders/{order}")] {
            let answer = http
                .get(format!("{base}{path}"))
                .header("cookie", &cookie)
                .send()
                .await;
            match answer {
                Ok(a) if a.status().as_u16() == 200 => read += 1,
                Ok(a) => problems.push(format!("the operator's {path}: {}", a.status())),
                Err(e) => problems.push(format!("the operator's {path}: {e}")),
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    (read, problems)
}

/// `(public id, stored id)` of an application's orders.
async fn orders_of(app: &TestApp, application: &str) -> Vec<(Uuid, Uuid)> {
    sqlx::query_as(
        "SELECT app_order_id, order_id FROM orders WHERE application = $1 ORDER BY app_order_id",
    )
    .bind(application)
    .fetch_all(&app.db)
    .await
    .expect("orders")
}

/// `(state, last_seq)` of each of the victim's orders, by public id.
async fn victim_states(app: &TestApp) -> BTreeMap<Uuid, (String, i32)> {
    let rows: Vec<(Uuid, String, i32)> = sqlx::query_as(
        "SELECT app_order_id, process_state, last_seq FROM orders WHERE application = 'victim'",
    )
    .fetch_all(&app.db)
    .await
    .expect("orders");
    rows.into_iter()
        .map(|(id, s, seq)| (id, (s, seq)))
        .collect()
}

/// Orders of `token`'s application, by ids from `ids`: `EACH` pending
/// until 2999, `waits` waiting for a signal and `EACH` processed.
async fn orders_made(
    app: &TestApp,
    api: &Good,
    token: &str,
    waits: usize,
    ids: &mut TestRunner,
) -> (Vec<Uuid>, Vec<Uuid>, Vec<Uuid>) {
    let mut pending = Vec::new();
    let mut waiting = Vec::new();
    let mut ended = Vec::new();
    for i in 0..waits {
        let approved = json!({ "workflow": "approved", "payload": { "i": i } });
        waiting.push(api.order(token, approved, drawn_id(ids)).await);
    }
    for i in 0..EACH {
        let later = json!({ "workflow": "one", "payload": { "i": i }, "not_before": "2999-01-01T00:00:00Z" });
        pending.push(api.order(token, later, drawn_id(ids)).await);
        let now = json!({ "workflow": "one", "payload": { "i": i } });
        ended.push(api.order(token, now, drawn_id(ids)).await);
    }
    for id in &ended {
        app.eventually(
            &format!("order {id} processed"),
            Duration::from_secs(30),
            || async {
                api.get(token, &format!("/v1/orders/{id}")).await.1["state"] == "processed"
            },
        )
        .await;
    }
    for id in &waiting {
        app.eventually(
            &format!("order {id} waits"),
            Duration::from_secs(30),
            || async {
                api.get(token, &format!("/v1/orders/{id}")).await.1["steps"][1]["state"]
                    == "running"
            },
        )
        .await;
    }
    (pending, waiting, ended)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_generated_hostile_http_requests_read_or_change_nothing_of_another_application()
 {
    let started = Instant::now();
    let run = format!("h{}", &Uuid::new_v4().simple().to_string()[..10]);
    let app = TestApp::builder().extra_config(config(&run)).build().await;
    // Each order of `three` takes a while: the victim's are live while the
    // attack goes on.
    app.knobs(
        "b",
        Knobs {
            latency_ms: 800,
            ..Knobs::default()
        },
    );
    app.start_all().await;
    app.start("dashboard", "dashboard", &[]).await;
    let api = Good::new(app.port("submission"));

    let mut ids = seeded(56);
    let (v_pending, v_waiting, v_ended) =
        orders_made(&app, &api, VICTIM_TOKEN, EACH, &mut ids).await;
    let (a_pending, a_waiting, a_ended) =
        orders_made(&app, &api, ATTACKER_TOKEN, ATTACKER_WAITING, &mut ids).await;
    // A dead letter the dashboard's viewer must not purge.
    app.publish_raw(b"{oops", None, None).await;
    let dead = app.queues.orders_dead().to_owned();
    app.eventually("the dead letter", Duration::from_secs(10), || async {
        app.ready(&dead).await == 1
    })
    .await;
    let live: Vec<Uuid> = (0..VICTIM_LIVE).map(|_| drawn_id(&mut ids)).collect();
    let fresh: Vec<Uuid> = (0..ATTACKER_FRESH).map(|_| drawn_id(&mut ids)).collect();
    let victim_app = Application::new("victim", &[format!("{run}-victim.*")]);
    let mut victim_stored: Vec<Uuid> = orders_of(&app, "victim")
        .await
        .iter()
        .map(|o| o.1)
        .collect();
    victim_stored.extend(live.iter().map(|id| victim_app.order_id(*id)));
    let attacker_orders = orders_of(&app, "attacker").await;
    let world = World {
        api_port: app.port("submission"),
        dashboard_port: app.port("dashboard"),
        run: run.clone(),
        prefix: app.prefix.clone(),
        victim: [v_pending.clone(), v_waiting.clone(), live.clone()].concat(),
        victim_ended: v_ended.clone(),
        victim_stored,
        attacker: [a_pending, a_waiting, a_ended].concat(),
        attacker_stored: attacker_orders.iter().map(|o| o.1).collect(),
        attacker_fresh: fresh,
        dead_queues: vec![
            dead.clone(),
            app.queues.replies_dead().to_owned(),
            app.queues.agent_requests_dead("a"),
        ],
    };
    let before = victim_states(&app).await;

    // The cases, drawn before anything is sent.
    let mut r = seeded(57);
    let cases: Vec<Case> = (0..API_REQUESTS + DASHBOARD_REQUESTS)
        .map(|i| {
            if i % 5 == 4 {
                dashboard_case(&mut r, &world)
            } else {
                api_case(&mut r, &world)
            }
        })
        .collect();

    // Around it: the victim's streams of its waiting orders, open all
    // along; its new orders; the operator's dashboard.
    let long_streams: Vec<_> = v_waiting
        .iter()
        .map(|&id| {
            let api = api.clone();
            tokio::spawn(async move { (id, api.stream(VICTIM_TOKEN, id).await) })
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let victim = tokio::spawn(victim_traffic(api.clone(), live.clone(), stop.clone()));
    let operator = tokio::spawn(operator_traffic(
        world.dashboard_port,
        victim_app.order_id(v_pending[0]),
        stop.clone(),
    ));
    // The deployment's own rate of commits, with all that running.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let quiet_from = (Instant::now(), sas_tests::pg_commits(&app.db_name).await);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let quiet_to = (Instant::now(), sas_tests::pg_commits(&app.db_name).await);
    let rate = (quiet_to.1 - quiet_from.1) as f64 / (quiet_to.0 - quiet_from.0).as_secs_f64();

    let attack_from = (Instant::now(), sas_tests::pg_commits(&app.db_name).await);
    let ports = (world.api_port, world.dashboard_port);
    let answers: Vec<(usize, Answer)> = futures_util::stream::iter(cases.iter().enumerate())
        .map(|(i, case)| async move {
            let port = match case.surface {
                Surface::Api => ports.0,
                Surface::Dashboard => ports.1,
            };
            (i, exchange(port, case).await)
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let attack_to = (Instant::now(), sas_tests::pg_commits(&app.db_name).await);
    stop.store(true, Ordering::Relaxed);
    let attack_time = attack_to.0 - attack_from.0;
    let mut answers: Vec<Option<Answer>> = {
        let mut by_case: Vec<Option<Answer>> = (0..cases.len()).map(|_| None).collect();
        for (i, a) in answers {
            by_case[i] = Some(a);
        }
        by_case
    };

    // Each answer on its own.
    let mut problems = Vec::new();
    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    for (case, answer) in cases.iter().zip(&answers) {
        let answer = answer.as_ref().expect("every case answered");
        // What each caller got where: to see that the cases reach past
        // the door (the attacker's own orders answered 2xx and 409).
        let surface = match case.surface {
            Surface::Api => "api",
            Surface::Dashboard => "dashboard",
        };
        let class = match (case.abandon, answer.status) {
            (true, _) => "abandoned".to_owned(),
            (_, Some(s)) => format!("{surface} {:?} {s}", case.who),
            (_, None) => format!("{surface} closed"),
        };
        *statuses.entry(class).or_default() += 1;
        if let Some(problem) = judge(case, answer) {
            problems.push(format!(
                "{problem}: {} ({:?}, {:?})\n  request: {}\n  answer: {} {}",
                case.what,
                case.who,
                case.target,
                shown(&case.bytes, 600),
                shown(answer.head.as_bytes(), 400),
                shown(&answer.body, 300)
            ));
        }
    }
    eprintln!(
        "{} hostile requests sent in {attack_time:?} : {statuses:?}",
        cases.len()
    );

    // The traffic around it.
    let (submitted, victim_problems) = victim.await.expect("the victim's task");
    problems.extend(victim_problems);
    let (pages, operator_problems) = operator.await.expect("the operator's task");
    problems.extend(operator_problems);
    assert!(pages > 0, "the operator read nothing");
    assert!(
        problems.is_empty(),
        "{} problems, the first ones:\n{}",
        problems.len(),
        problems[..problems.len().min(20)].join("\n")
    );
    assert!(cases.len() >= 5_000, "only {} requests sent", cases.len());

    // Every good order processed.
    app.eventually(
        "the victim's orders processed",
        Duration::from_secs(90),
        || async {
            let done: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM orders WHERE application = 'victim' \
                 AND app_order_id = ANY($1) AND process_state = 'processed'",
            )
            .bind(&submitted)
            .fetch_one(&app.db)
            .await
            .expect("count");
            done == submitted.len() as i64
        },
    )
    .await;

    // The victim's other orders as they were, and nothing in its name it
    // did not submit.
    let after = victim_states(&app).await;
    for id in v_pending.iter().chain(&v_waiting).chain(&v_ended) {
        assert_eq!(
            after.get(id),
            before.get(id),
            "the victim's order {id} changed"
        );
    }
    let named: BTreeSet<Uuid> = after.keys().copied().collect();
    let own: BTreeSet<Uuid> = [
        v_pending.clone(),
        v_waiting.clone(),
        v_ended.clone(),
        submitted.clone(),
    ]
    .concat()
    .into_iter()
    .collect();
    assert_eq!(named, own, "orders in the victim's name it did not submit");
    let foreign: Vec<(Uuid, i32, String)> = sqlx::query_as(
        "SELECT o.app_order_id, e.seq, e.actor FROM order_events e JOIN orders o USING (order_id) \
         WHERE o.application = 'victim' \
         AND (e.actor LIKE '%attacker%' OR e.actor LIKE 'operator:%' OR e.actor = 'http')",
    )
    .fetch_all(&app.db)
    .await
    .expect("events");
    assert!(
        foreign.is_empty(),
        "events of the victim's orders by others: {foreign:?}"
    );

    // No answer to anyone else carried the victim's data: its stored ids
    // and its steps' results (each remote call's effect id is its own).
    let mut secrets: Vec<String> = sqlx::query_scalar(
        "SELECT s.result->>'effect_id' FROM steps s JOIN orders o USING (order_id) \
         WHERE o.application = 'victim' AND s.result ? 'effect_id'",
    )
    .fetch_all(&app.db)
    .await
    .expect("results");
    secrets.extend(
        orders_of(&app, "victim")
            .await
            .iter()
            .map(|o| o.1.to_string()),
    );
    assert!(secrets.len() > submitted.len(), "{} secrets", secrets.len());
    let attacker_owns: BTreeSet<Uuid> = orders_of(&app, "attacker")
        .await
        .iter()
        .map(|o| o.0)
        .collect();
    for (case, answer) in cases.iter().zip(&mut answers) {
        let answer = answer.take().expect("an answer");
        if case.who == Who::Viewer {
            continue;
        }
        // Ids in any case (a path may hold one upper-case).
        let sent = String::from_utf8_lossy(&case.bytes).to_ascii_lowercase();
        let got = format!("{}{}", answer.head, String::from_utf8_lossy(&answer.body));
        let lower = got.to_ascii_lowercase();
        for secret in &secrets {
            assert!(
                !lower.contains(secret.as_str()) || sent.contains(secret.as_str()),
                "an answer carried the victim's {secret}: {} ({:?})\n  request: {}\n  answer: {}",
                case.what,
                case.who,
                shown(&case.bytes, 600),
                shown(got.as_bytes(), 600)
            );
        }
        // The attacker may have an order by a squatted id of its own:
        // then, and only then, is it answered.
        if let (Target::Squatted(id), Some(200..=299)) = (case.target, answer.status) {
            assert!(
                attacker_owns.contains(&id),
                "the victim's order {id} answered {:?} to {:?}: {}",
                answer.status,
                case.who,
                case.what
            );
        }
    }

    // The victim's waiting and pending orders still answer their owner:
    // signalled, they end; cancelled, they end.
    for id in &v_waiting {
        let (status, body) = api
            .post(
                VICTIM_TOKEN,
                &format!("/v1/orders/{id}/signals/approval"),
                r#"{"by": "victim"}"#,
            )
            .await;
        assert_eq!(
            (status, body["state"].clone()),
            (202, json!("processed")),
            "{body}"
        );
    }
    for id in &v_pending {
        let (status, body) = api
            .post(VICTIM_TOKEN, &format!("/v1/orders/{id}/cancel"), "")
            .await;
        assert_eq!(status, 202, "{body}");
    }
    for stream in long_streams {
        let (id, events) = stream.await.expect("the stream's task");
        let events = events.expect("the stream of a waiting order");
        assert_eq!(stream_problem(id, &events, "processed"), None);
    }
    // The dead letter is still there: no viewer purged it.
    assert_eq!(app.ready(&dead).await, 1, "the dead letter is gone");

    // What the attack cost the database, beyond the deployment's own rate.
    let spent = (attack_to.1 - attack_from.1) as f64;
    let own = rate * attack_time.as_secs_f64();
    let per_request = (spent - own) / cases.len() as f64;
    eprintln!(
        "commits: {rate:.0}/s without the attack, {spent:.0} in the attack's {attack_time:?} \
         ({own:.0} at that rate): {per_request:.2} more per hostile request"
    );
    assert!(
        per_request < MAX_COMMITS_PER_REQUEST,
        "{per_request:.2} commits per hostile request"
    );

    // No service restarted, none panicked.
    assert_unharmed(&app).await;
    app.assert_running(&["dashboard"]);
    for name in [
        "submission",
        "scheduler",
        "agent",
        "supervisor",
        "dashboard",
    ] {
        assert!(
            !app.log(name).contains("panicked"),
            "{name} panicked:\n{}",
            app.log(name)
        );
    }
    eprintln!("done in {:?}", started.elapsed());
}

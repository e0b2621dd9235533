//! CEL expressions of workflow definitions (contract §4d: a step's `when`
//! and `input`), compiled once when a definition is read, so that a
//! configuration with an expression that does not compile is refused at
//! start-up and a stored definition is compiled once per process.
//!
//! An expression sees `payload` (the order's payload) and `results` (each
//! completed step's result by name). Evaluation is pure; an expression
//! that fails at run time (a missing key, a type mismatch) gives its
//! reason, which fails the step for good.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

/// The longest expression source accepted (configuration, not input; a
/// bound all the same, as the parser recurses).
pub const MAX_SOURCE_BYTES: usize = 4096;

/// A compiled CEL expression, kept with its source: it serializes as the
/// source and compares by it.
#[derive(Clone)]
pub struct Expr {
    source: String,
    program: Arc<cel::Program>,
}

/// What an expression is evaluated over.
#[derive(Debug, Clone, Copy)]
pub struct Vars<'a> {
    /// The order's payload.
    pub payload: &'a Value,
    /// Each completed step's result, by the step's name.
    pub results: &'a Map<String, Value>,
}

impl Expr {
    /// Compiles `source`, or says why it cannot be used.
    pub fn compile(source: &str) -> Result<Self, String> {
        if source.len() > MAX_SOURCE_BYTES {
            return Err(format!(
                "the expression is longer than {MAX_SOURCE_BYTES} bytes"
            ));
        }
        if source.trim().is_empty() {
            return Err("the expression is empty".into());
        }
        let program = cel::Program::compile(source)
            .map_err(|e| format!("{source:?} does not compile: {}", one_line(&e.to_string())))?;
        Ok(Self {
            source: source.to_owned(),
            program: Arc::new(program),
        })
    }

    /// The variables it reads (`payload`, `results`, …), sorted.
    pub fn references(&self) -> Vec<String> {
        let refs = self.program.references();
        let mut names: Vec<String> = refs.variables().into_iter().map(str::to_owned).collect();
        names.sort();
        names.dedup();
        names
    }

    /// The expression as written.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Its value over `vars`, as JSON, or why it has none.
    pub fn eval(&self, vars: Vars<'_>) -> Result<Value, String> {
        let mut ctx = cel::Context::default();
        ctx.add_variable_from_value("payload", to_cel(vars.payload));
        ctx.add_variable_from_value(
            "results",
            to_cel_map(vars.results.iter().map(|(k, v)| (k.as_str(), v))),
        );
        // The interpreter is young: a panic on some input must cost this
        // step, not the transition of every order in the batch.
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.program
                .execute(&ctx)
                .map(|v| v.json().map_err(|e| e.to_string()))
        }));
        match run {
            Ok(Ok(Ok(value))) => Ok(value),
            Ok(Ok(Err(unrepresentable))) => Err(format!(
                "{:?} gives a value JSON cannot hold: {unrepresentable}",
                self.source
            )),
            Ok(Err(e)) => Err(format!("{:?} failed: {e}", self.source)),
            Err(_) => Err(format!("{:?} could not be evaluated", self.source)),
        }
    }

    /// Its value over `vars` as a condition: `true` or `false`, anything
    /// else is an error (CEL has no truthiness).
    pub fn holds(&self, vars: Vars<'_>) -> Result<bool, String> {
        match self.eval(vars)? {
            Value::Bool(b) => Ok(b),
            other => Err(format!(
                "{:?} is not true or false but {}",
                self.source,
                kind(&other)
            )),
        }
    }
}

/// `v` as CEL sees it: a JSON number that is a whole number in `i64` is an
/// `int` (so `payload.count * 2` works as a JSON user expects, where the
/// generic serializer would make it a `uint`), a larger one a `uint`, any
/// other a `double`.
fn to_cel(v: &Value) -> cel::Value {
    match v {
        Value::Null => cel::Value::Null,
        Value::Bool(b) => cel::Value::Bool(*b),
        Value::Number(n) => n
            .as_i64()
            .map(cel::Value::Int)
            .or_else(|| n.as_u64().map(cel::Value::UInt))
            .unwrap_or_else(|| cel::Value::Float(n.as_f64().unwrap_or(f64::NAN))),
        Value::String(s) => cel::Value::String(Arc::new(s.clone())),
        Value::Array(items) => cel::Value::List(Arc::new(items.iter().map(to_cel).collect())),
        Value::Object(map) => to_cel_map(map.iter().map(|(k, v)| (k.as_str(), v))),
    }
}

fn to_cel_map<'v>(entries: impl Iterator<Item = (&'v str, &'v Value)>) -> cel::Value {
    let map: std::collections::HashMap<cel::objects::Key, cel::Value> = entries
        .map(|(k, v)| (cel::objects::Key::String(Arc::new(k.to_owned())), to_cel(v)))
        .collect();
    cel::Value::Map(map.into())
}

/// The JSON type of `v`, for messages.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a map",
    }
}

/// The parser's message on one line (start-up refusals are one line).
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

impl fmt::Debug for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Expr").field(&self.source).finish()
    }
}

impl PartialEq for Expr {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}

impl Eq for Expr {}

impl Serialize for Expr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.source)
    }
}

impl<'de> Deserialize<'de> for Expr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let source = String::deserialize(d)?;
        Self::compile(&source).map_err(serde::de::Error::custom)
    }
}

/// A step's `input` (contract §4d): the request's payload, one key per
/// expression, in the order written.
pub fn build_input(
    input: &std::collections::BTreeMap<String, Expr>,
    vars: Vars<'_>,
) -> Result<Value, String> {
    input
        .iter()
        .map(|(key, expr)| {
            expr.eval(vars)
                .map(|v| (key.clone(), v))
                .map_err(|e| format!("input {key:?}: {e}"))
        })
        .collect::<Result<Map<_, _>, _>>()
        .map(Value::Object)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vars<'a>(payload: &'a Value, results: &'a Map<String, Value>) -> Vars<'a> {
        Vars { payload, results }
    }

    const fn assert_send_sync<T: Send + Sync>() {}
    const _: () = assert_send_sync::<Expr>();

    #[test]
    fn a_condition_reads_the_payload_and_the_results() {
        let payload =
            json!({"total": 12.5, "count": 3, "tags": ["a", "b"], "who": {"tier": "gold"}});
        let mut results = Map::new();
        results.insert("reserve".into(), json!({"ok": true, "ids": [1, 2]}));
        let v = vars(&payload, &results);
        for (src, want) in [
            ("payload.total > 0.0", true),
            ("payload.total > 0", true),
            ("payload.count * 2 == 6", true),
            ("payload.count > 2", true),
            ("payload.count == 3 && 'a' in payload.tags", true),
            ("payload.who.tier == 'silver'", false),
            ("results.reserve.ok", true),
            ("size(results.reserve.ids) == 2", true),
            ("has(payload.missing)", false),
            ("has(results.charge)", false),
        ] {
            assert_eq!(Expr::compile(src).unwrap().holds(v), Ok(want), "{src}");
        }
    }

    #[test]
    fn what_cannot_compile_or_evaluate_says_why() {
        for bad in [
            "",
            "   ",
            "payload.",
            "(((",
            "a ? b",
            &"x".repeat(MAX_SOURCE_BYTES + 1),
        ] {
            let err = Expr::compile(bad).unwrap_err();
            assert!(!err.contains('\n'), "one line: {err}");
        }
        let payload = json!({"total": "ten"});
        let results = Map::new();
        let v = vars(&payload, &results);
        let missing = Expr::compile("payload.nothing > 1").unwrap().holds(v);
        assert!(missing.is_err(), "{missing:?}");
        let not_bool = Expr::compile("payload.total").unwrap().holds(v);
        assert!(
            not_bool
                .unwrap_err()
                .contains("not true or false but a string")
        );
        let mismatch = Expr::compile("payload.total > 1").unwrap().holds(v);
        assert!(mismatch.is_err(), "{mismatch:?}");
    }

    #[test]
    fn an_input_builds_one_key_per_expression() {
        let payload = json!({"total": 30, "items": [{"sku": "a"}, {"sku": "b"}]});
        let mut results = Map::new();
        results.insert("reserve".into(), json!({"ids": [7]}));
        let input: std::collections::BTreeMap<String, Expr> = serde_json::from_value(json!({
            "amount": "payload.total * 2",
            "reservations": "results.reserve.ids",
            "skus": "payload.items.map(i, i.sku)",
            "fixed": "'EUR'",
        }))
        .unwrap();
        assert_eq!(
            build_input(&input, vars(&payload, &results)),
            Ok(json!({"amount": 60, "reservations": [7], "skus": ["a", "b"], "fixed": "EUR"}))
        );
        let broken: std::collections::BTreeMap<String, Expr> =
            serde_json::from_value(json!({"x": "results.nope"})).unwrap();
        let err = build_input(&broken, vars(&payload, &results)).unwrap_err();
        assert!(err.starts_with("input \"x\""), "{err}");
    }

    #[test]
    fn an_expression_serializes_as_its_source_and_a_bad_one_is_refused_on_reading() {
        let e = Expr::compile("payload.a == 1").unwrap();
        assert_eq!(serde_json::to_value(&e).unwrap(), json!("payload.a == 1"));
        let back: Expr = serde_json::from_value(json!("payload.a == 1")).unwrap();
        assert_eq!(back, e);
        assert!(serde_json::from_value::<Expr>(json!("payload.")).is_err());
    }

    #[test]
    fn hostile_payloads_give_errors_not_panics() {
        let results = Map::new();
        let deep = (0..120).fold(json!(1), |acc, _| json!([acc]));
        let big = json!({"s": "x".repeat(100_000), "n": u64::MAX, "f": 1e308, "neg": i64::MIN});
        for payload in [deep, big, json!(null), json!("str"), json!([1, 2])] {
            for src in [
                "payload.s + payload.s == ''",
                "payload.n + 1 > 0",
                "payload.neg - 1 < 0",
                "payload.f * 10.0 > 0.0",
                "size(payload) > 0",
                "payload[0] == 1",
                "int(payload.s) == 1",
            ] {
                let _ = Expr::compile(src).unwrap().eval(vars(&payload, &results));
            }
        }
    }
}

//! The published descriptions of sas's messages stay true: the JSON Schemas
//! in `docs/schemas/` are what `sas-protocol` generates (a drift fails; run
//! with `SAS_BLESS=1` to write them again), and every example of the
//! AsyncAPI document (`docs/asyncapi.json`) is read by the server the way it
//! says.

use std::path::{Path, PathBuf};

use sas::messages::{StepReply, StepRequest, decode_replay, decode_submission};
use sas::topology::QueueNames;
use sas_protocol::{Alert, Order, ReplayRequest, StatusEvent};
use serde_json::Value;

fn docs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs")
}

/// Each schema file and what generates it.
fn schemas() -> Vec<(&'static str, Value)> {
    let json = |s: schemars::Schema| s.to_value();
    vec![
        ("order.schema.json", json(schemars::schema_for!(Order))),
        (
            "status-event.schema.json",
            json(schemars::schema_for!(StatusEvent)),
        ),
        (
            "replay-request.schema.json",
            json(schemars::schema_for!(ReplayRequest)),
        ),
        ("alert.schema.json", json(schemars::schema_for!(Alert))),
        (
            "step-request.schema.json",
            json(schemars::schema_for!(StepRequest)),
        ),
        (
            "step-reply.schema.json",
            json(schemars::schema_for!(StepReply)),
        ),
    ]
}

#[test]
fn the_json_schemas_in_docs_are_what_the_wire_types_generate() {
    let bless = std::env::var_os("SAS_BLESS").is_some();
    let mut drift = Vec::new();
    for (file, schema) in schemas() {
        let path = docs().join("schemas").join(file);
        let want = serde_json::to_string_pretty(&schema).expect("a schema is JSON") + "\n";
        if bless {
            std::fs::write(&path, &want).expect("write the schema");
        } else if std::fs::read_to_string(&path).ok().as_deref() != Some(want.as_str()) {
            drift.push(file);
        }
    }
    assert!(
        drift.is_empty(),
        "docs/schemas drifted from sas-protocol: {drift:?}; run \
         `SAS_BLESS=1 cargo nextest run -p sas-tests -E 'test(/^schemas::/)'` and commit"
    );
}

fn asyncapi() -> Value {
    let text = std::fs::read_to_string(docs().join("asyncapi.json")).expect("docs/asyncapi.json");
    serde_json::from_str(&text).expect("docs/asyncapi.json is JSON")
}

/// The examples of the AsyncAPI message `name`, as JSON values.
fn examples(doc: &Value, name: &str) -> Vec<Value> {
    let examples = doc["components"]["messages"][name]["examples"]
        .as_array()
        .unwrap_or_else(|| panic!("message {name} has examples"));
    assert!(!examples.is_empty(), "{name}");
    examples.iter().map(|e| e["payload"].clone()).collect()
}

#[test]
fn the_asyncapi_document_names_every_queue_of_a_deployment_and_its_schemas() {
    let doc = asyncapi();
    assert_eq!(doc["asyncapi"], "3.0.0");
    let names = QueueNames::new("{prefix}");
    let addresses: Vec<&str> = doc["channels"]
        .as_object()
        .expect("channels")
        .values()
        .filter_map(|c| c["address"].as_str())
        .collect();
    // Every queue a deployment declares, and the submission exchange.
    for queue in names.all(["{agent}"]) {
        let name = queue.name.as_str();
        assert!(addresses.contains(&name), "{name} not in {addresses:?}");
    }
    assert!(
        addresses.contains(&names.submit_exchange()),
        "{addresses:?}"
    );
    assert!(addresses.contains(&"{reply_to}"), "{addresses:?}");
    // Every payload it points at is a schema file of docs/schemas, and
    // each message sas defines points at its own.
    let messages = doc["components"]["messages"].as_object().expect("messages");
    for (name, message) in messages {
        if let Some(target) = message["payload"]["$ref"].as_str() {
            let file = target.strip_prefix("./schemas/").unwrap_or_default();
            assert!(
                schemas().iter().any(|(f, _)| *f == file),
                "message {name} refers to {target:?}, not a schema of docs/schemas"
            );
        }
    }
    for (name, file) in [
        ("Order", "order"),
        ("StatusEvent", "status-event"),
        ("ReplayRequest", "replay-request"),
        ("Alert", "alert"),
        ("StepRequest", "step-request"),
        ("StepReply", "step-reply"),
    ] {
        assert_eq!(
            messages[name]["payload"]["$ref"],
            format!("./schemas/{file}.schema.json"),
            "{name}"
        );
    }
}

#[test]
fn every_example_of_the_asyncapi_document_is_read_as_it_says() {
    let doc = asyncapi();
    let names = QueueNames::new("sas");
    for order in examples(&doc, "Order") {
        let body = serde_json::to_vec(&order).expect("json");
        let decoded = decode_submission(&body, None, 1 << 20, &names)
            .unwrap_or_else(|(r, _)| panic!("the server refuses {order}: {r}"));
        let wire: Order = serde_json::from_value(order).expect("the wire type reads it");
        assert_eq!(wire, decoded);
    }
    for event in examples(&doc, "StatusEvent") {
        let read: StatusEvent = serde_json::from_value(event.clone()).expect("a status event");
        assert!(
            read.state.kind().is_some(),
            "an example names a known state: {event}"
        );
        assert_eq!(
            serde_json::to_value(&read).expect("json")["state"],
            event["state"]
        );
    }
    for request in examples(&doc, "ReplayRequest") {
        let body = serde_json::to_vec(&request).expect("json");
        let decoded = decode_replay(&body, 1 << 20, &names)
            .unwrap_or_else(|r| panic!("the server refuses {request}: {r}"));
        let wire: ReplayRequest = serde_json::from_value(request).expect("the wire type reads it");
        assert_eq!(wire, decoded);
    }
    for signal in examples(&doc, "Signal") {
        let body = serde_json::to_vec(&signal).expect("json");
        let decoded = sas::messages::decode_signal(&body, 1 << 20)
            .unwrap_or_else(|r| panic!("the server refuses {signal}: {r}"));
        assert_eq!(decoded.data, signal["data"]);
    }
    for alert in examples(&doc, "Alert") {
        let _: Alert = serde_json::from_value(alert).expect("an alert");
    }
    for request in examples(&doc, "StepRequest") {
        let _: StepRequest = serde_json::from_value(request).expect("a step request");
    }
    // Replies travel alone or packed: the scheduler reads both.
    let replies = examples(&doc, "StepReply");
    for reply in &replies {
        let body = serde_json::to_vec(reply).expect("json");
        let read = sas::messages::decode_replies(&body).expect("a reply");
        assert!(read.iter().all(Result::is_ok), "{reply}");
    }
    let pack = serde_json::to_vec(&replies).expect("json");
    let read = sas::messages::decode_replies(&pack).expect("a pack");
    assert_eq!(read.len(), replies.len());
}

//! The OpenAPI 3.1 document of the API, served at `/v1/openapi.json` and
//! kept in the repository as `docs/openapi.json` (a test fails when the two
//! drift). Generated: its paths from [`Endpoint::ALL`], which also builds
//! the router, and its schemas from the types the handlers read and write
//! (JSON Schema 2020-12, which OpenAPI 3.1 takes as it is).

use schemars::generate::SchemaSettings;
use serde_json::{Map, Value, json};

use sas_protocol::http::{OrderAccepted, OrderView, Problem};

use super::Endpoint;

/// References to the document's schemas.
struct Refs {
    order: Value,
    accepted: Value,
    view: Value,
    event: Value,
    error: Value,
}

/// The document.
pub fn document() -> Value {
    let mut settings = SchemaSettings::draft2020_12();
    settings.definitions_path = "/components/schemas".into();
    settings.meta_schema = None;
    let mut generator = settings.into_generator();
    let refs = Refs {
        order: generator.subschema_for::<sas_protocol::Order>().to_value(),
        accepted: generator.subschema_for::<OrderAccepted>().to_value(),
        view: generator.subschema_for::<OrderView>().to_value(),
        event: generator
            .subschema_for::<sas_protocol::StatusEvent>()
            .to_value(),
        error: generator.subschema_for::<Problem>().to_value(),
    };
    let schemas = generator.take_definitions(true);
    let mut paths = Map::new();
    for endpoint in Endpoint::ALL {
        let item = paths
            .entry(endpoint.path())
            .or_insert_with(|| Value::Object(Map::new()));
        item[endpoint.method().as_str().to_ascii_lowercase()] = operation(endpoint, &refs);
    }
    json!({
        "openapi": "3.1.0",
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "info": {
            "title": "sas HTTP API",
            "version": "1",
            "summary": "Submit orders to sas and follow them (contract §9a).",
            "description": "Served by the submission service on its port (`http.port`, 9101 by default). \
                An order submitted here is the same order as one sent to `<prefix>.orders` with the same id. \
                Without `[applications]`, callers on loopback need no token (`http.api_loopback_open`); \
                with them, every request needs an application's bearer token, and an application sees only its own orders. \
                See docs/http-api.md.",
            "license": { "name": "MIT OR Apache-2.0", "identifier": "MIT OR Apache-2.0" },
        },
        "security": [{ "bearer": [] }, {}],
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A token whose SHA-256 is in `applications.<name>.tokens` (as `sha256:<hex>`).",
                },
            },
        },
    })
}

/// A response with an error body.
fn refusal(refs: &Refs, description: &str) -> Value {
    json!({
        "description": description,
        "content": { "application/json": { "schema": refs.error } },
    })
}

/// The `{id}` parameter.
fn id_parameter() -> Value {
    json!({
        "name": "id",
        "in": "path",
        "required": true,
        "description": "The order's id, as its application gave it.",
        "schema": { "type": "string", "format": "uuid" },
    })
}

/// The answers every order route may give besides its own.
fn common(refs: &Refs, responses: &mut Value) {
    responses["400"] = refusal(refs, "Not an order id (a UUID), or a malformed request.");
    responses["401"] = refusal(refs, "No valid bearer token (see the security schemes).");
    responses["404"] = refusal(refs, "No such order, or another application's.");
    responses["503"] = refusal(
        refs,
        "The state store is unavailable; try again (Retry-After).",
    );
}

/// The operation of `endpoint`.
fn operation(endpoint: Endpoint, refs: &Refs) -> Value {
    let accepted = |description: &str| {
        json!({
            "description": description,
            "headers": {
                "Location": {
                    "description": "`/v1/orders/<order_id>`",
                    "schema": { "type": "string" },
                },
            },
            "content": { "application/json": { "schema": refs.accepted } },
        })
    };
    let mut op = match endpoint {
        Endpoint::Submit => json!({
            "operationId": "submitOrder",
            "summary": "Submit an order (contract §1).",
            "description": "Stored once; the same id again (body `order_id` or `Idempotency-Key`) is the same order, and the first body stands.",
            "parameters": [
                {
                    "name": "Idempotency-Key",
                    "in": "header",
                    "required": false,
                    "description": "The order's `order_id`; must equal the body's when both are given.",
                    "schema": { "type": "string", "format": "uuid" },
                },
                {
                    "name": "traceparent",
                    "in": "header",
                    "required": false,
                    "description": "W3C trace context: the order's spans continue this trace.",
                    "schema": { "type": "string" },
                },
            ],
            "requestBody": {
                "required": true,
                "content": { "application/json": { "schema": refs.order } },
            },
            "responses": {
                "202": accepted("Stored: the order runs."),
                "200": accepted("An order of this id exists already: nothing changed."),
                "400": refusal(refs, "A bad body (malformed JSON, a missing field, a wrong type, an unknown workflow, a reserved or foreign `reply_to`), a bad `Idempotency-Key`, or one that differs from the body's `order_id`."),
                "401": refusal(refs, "No valid bearer token (see the security schemes)."),
                "413": refusal(refs, "A body over `submission.max_body_bytes`."),
                "415": refusal(refs, "Not `Content-Type: application/json`."),
                "503": refusal(refs, "The state store is unavailable; try again (Retry-After)."),
            },
        }),
        Endpoint::Order => json!({
            "operationId": "getOrder",
            "summary": "An order, its steps and its status events.",
            "parameters": [id_parameter()],
            "responses": {
                "200": {
                    "description": "The order.",
                    "content": { "application/json": { "schema": refs.view } },
                },
            },
        }),
        Endpoint::Events => json!({
            "operationId": "streamOrderEvents",
            "summary": "The order's status events as server-sent events.",
            "description": "One `data:` line per event (a status event, as on the order's queue), `id:` its `seq`. Ends after the order's terminal event (or at once when the order has ended and nothing is at or after `from_seq`). Resume with `Last-Event-ID`.",
            "parameters": [
                id_parameter(),
                {
                    "name": "from_seq",
                    "in": "query",
                    "required": false,
                    "description": "The first `seq` wanted (default 1).",
                    "schema": { "type": "integer", "minimum": 0, "maximum": i32::MAX },
                },
                {
                    "name": "Last-Event-ID",
                    "in": "header",
                    "required": false,
                    "description": "The `seq` of the last event received: the stream goes on after it (wins over `from_seq`).",
                    "schema": { "type": "string" },
                },
            ],
            "responses": {
                "200": {
                    "description": "The stream; each event's data is a StatusEvent.",
                    "content": {
                        "text/event-stream": {
                            "schema": { "type": "string" },
                            "x-sas-event-data": refs.event,
                        },
                    },
                },
            },
        }),
        Endpoint::Cancel => json!({
            "operationId": "cancelOrder",
            "summary": "Cancel an order that has not ended (contract §4c): its effects are undone.",
            "parameters": [id_parameter()],
            "responses": {
                "202": {
                    "description": "Cancelled: `{\"order_id\", \"state\"}`, the state it is in now (`compensating` or `compensated`).",
                    "content": { "application/json": { "schema": {
                        "type": "object",
                        "properties": {
                            "order_id": { "type": "string", "format": "uuid" },
                            "state": { "type": "string" },
                        },
                        "required": ["order_id", "state"],
                    } } },
                },
                "409": refusal(refs, "Not allowed in the order's state (`state` says which)."),
            },
        }),
        Endpoint::Signal => json!({
            "operationId": "signalOrder",
            "summary": "Send a signal to an order's step that waits for it (contract §4d).",
            "description": "The step of the order that waits for this signal completes with the signal's data (the body; none: `{}`) as its result, and the order goes on. A signal that no step of the order waits for now is refused with 409 and not kept.",
            "parameters": [
                id_parameter(),
                {
                    "name": "name",
                    "in": "path",
                    "required": true,
                    "description": "The signal's name.",
                    "schema": { "type": "string" },
                },
            ],
            "requestBody": {
                "required": false,
                "description": "The signal's data (JSON).",
                "content": { "application/json": { "schema": {} } },
            },
            "responses": {
                "202": {
                    "description": "Applied: `{\"order_id\", \"signal\", \"state\"}`, the state the order is in now.",
                    "content": { "application/json": { "schema": {
                        "type": "object",
                        "properties": {
                            "order_id": { "type": "string", "format": "uuid" },
                            "signal": { "type": "string" },
                            "state": { "type": "string" },
                        },
                        "required": ["order_id", "signal", "state"],
                    } } },
                },
                "409": refusal(refs, "No step of this order waits for this signal now (`state` says the order's)."),
                "413": refusal(refs, "A body over `submission.max_body_bytes`."),
            },
        }),
        Endpoint::OpenApi => json!({
            "operationId": "getOpenApi",
            "summary": "This document.",
            "security": [{}],
            "responses": {
                "200": {
                    "description": "The OpenAPI document.",
                    "content": { "application/json": { "schema": { "type": "object" } } },
                },
            },
        }),
    };
    if !matches!(endpoint, Endpoint::Submit | Endpoint::OpenApi) {
        let responses = &mut op["responses"];
        let own = responses.clone();
        common(refs, responses);
        // An operation's own description of a status wins.
        if let (Some(all), Value::Object(own)) = (responses.as_object_mut(), own) {
            all.extend(own);
        }
    }
    op
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_has_every_endpoint_and_resolvable_schema_refs() {
        let doc = document();
        assert_eq!(doc["openapi"], "3.1.0");
        let paths = doc["paths"].as_object().unwrap();
        let mut operations = 0;
        for (path, item) in paths {
            for method in item.as_object().unwrap().keys() {
                assert!(
                    Endpoint::ALL
                        .iter()
                        .any(|e| e.path() == path
                            && e.method().as_str().eq_ignore_ascii_case(method)),
                    "{method} {path} is documented but not routed"
                );
                operations += 1;
            }
        }
        assert_eq!(operations, Endpoint::ALL.len());
        // Every $ref points into components.schemas, at a schema that is there.
        let text = doc.to_string();
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        for piece in text.split("\"$ref\":\"").skip(1) {
            let target = piece.split('"').next().unwrap();
            let name = target
                .strip_prefix("#/components/schemas/")
                .unwrap_or_else(|| panic!("{target} is not a component"));
            assert!(schemas.contains_key(name), "{target}");
        }
        for name in [
            "Order",
            "StatusEvent",
            "OrderView",
            "OrderAccepted",
            "Error",
        ] {
            assert!(schemas.contains_key(name), "{name}");
        }
    }
}

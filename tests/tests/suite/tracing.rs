//! Tracing across services: one order's W3C trace id appears in the log
//! lines of every service it passes through and in the HTTP call to the remote.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sas::broker::Outgoing;
use sas_tests::TestApp;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use uuid::Uuid;

/// A remote service that records the `traceparent` of each call and answers 200.
async fn recording_remote() -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/svc/a", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let record = record.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                // Headers, then the body by content-length.
                loop {
                    let n = stream.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).to_string();
                    if let Some((head, body)) = text.split_once("\r\n\r\n") {
                        let length = head
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().to_owned())
                            })
                            .and_then(|v| v.parse::<usize>().ok())
                            .unwrap_or(0);
                        if body.len() >= length {
                            if let Some(tp) = head.lines().find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("traceparent:")
                                    .map(|v| v.trim().to_owned())
                            }) {
                                record.lock().unwrap().push(tp);
                            }
                            break;
                        }
                    }
                }
                let reply = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\nconnection: close\r\n\r\n{\"ok\":true}";
                stream.write_all(reply.as_bytes()).await.ok();
            });
        }
    });
    (url, seen)
}

/// The trace ids on the log lines of `log` that mention `order_id`.
fn trace_ids(log: &str, order_id: &str) -> BTreeSet<String> {
    log.lines()
        .filter(|l| l.contains(order_id))
        .filter_map(|l| {
            let at = l.find("\"trace_id\":\"")? + "\"trace_id\":\"".len();
            l.get(at..at + 32).map(str::to_owned)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_orders_trace_id_matches_across_every_service_and_reaches_the_remote() {
    let app = TestApp::new().await;
    let (url, seen) = recording_remote().await;
    let json_logs = [
        ("SAS__LOG__FORMAT", "json"),
        (
            "RUST_LOG",
            "info,submission=debug,scheduler=debug,agent=debug",
        ),
        ("SAS__AGENTS__A__URL", url.as_str()),
    ];
    for name in ["submission", "scheduler", "agent", "supervisor"] {
        app.start_with_env(name, name, &[], &json_logs).await;
    }
    // The application starts the trace.
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let traceparent = format!("00-{trace}-00f067aa0ba902b7-01");
    let given = Uuid::new_v4();
    let body =
        serde_json::json!({ "order_id": given, "workflow": "one", "payload": {} }).to_string();
    app.publisher()
        .publish(&Outgoing {
            routing_key: app.queues.orders(),
            body: body.as_bytes(),
            headers: &[("traceparent", &traceparent)],
            mandatory: true,
            ..Outgoing::default()
        })
        .await
        .unwrap();
    // And one order without a trace: sas starts one.
    let fresh = app.submit("one", None).await;
    app.wait_for_state("processed", 2, Duration::from_secs(30))
        .await;

    for name in ["submission", "scheduler", "agent"] {
        let ids = trace_ids(&app.log(name), &given.to_string());
        assert_eq!(
            ids,
            BTreeSet::from([trace.to_owned()]),
            "{name}: {}",
            app.log(name)
        );
    }
    let mut fresh_ids = BTreeSet::new();
    for name in ["submission", "scheduler", "agent"] {
        let ids = trace_ids(&app.log(name), &fresh.to_string());
        assert_eq!(ids.len(), 1, "{name} logs one trace id for the order");
        fresh_ids.extend(ids);
    }
    assert_eq!(fresh_ids.len(), 1, "one trace id across services");
    assert_ne!(fresh_ids.first().unwrap(), trace);
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.iter()
            .any(|tp| tp.starts_with(&format!("00-{trace}-")) && !tp.contains("00f067aa0ba902b7")),
        "the remote call continues the trace with a span of its own: {seen:?}"
    );
    assert!(
        seen.iter()
            .any(|tp| tp.contains(fresh_ids.first().unwrap()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_orders_spans_are_exported_over_otlp_as_one_nested_trace() {
    let otlp = sas_tests::otlp::Otlp::start()
        .await
        .expect("an OTLP receiver");
    let app = TestApp::builder().build().await;
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.endpoint.as_str()),
        // Export within a tenth of a second rather than five.
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    for name in ["submission", "scheduler", "agent", "supervisor"] {
        app.start_with_env(name, name, &[], &env).await;
    }
    let (id, events) = app.run_one("three").await;
    assert_eq!(
        events.last().map(|e| e["state"].clone()),
        Some("processed".into())
    );
    let trace_id: String = sqlx::query_scalar("SELECT trace_id FROM orders WHERE order_id = $1")
        .bind(id)
        .fetch_one(&app.db)
        .await
        .expect("the order's trace");
    let of_order = || {
        otlp.spans()
            .into_iter()
            .filter(|s| s.trace_id == trace_id)
            .collect::<Vec<_>>()
    };
    // Three steps: three remote calls and three replies; a transition that
    // stores and starts the order, and one per reply (the last ends it).
    app.eventually(
        "the order's spans are exported",
        Duration::from_secs(15),
        || async {
            let spans = of_order();
            let count = |name: &str| spans.iter().filter(|s| s.name == name).count();
            count("submit") == 1
                && count("remote_call") >= 3
                && count("step") >= 3
                && count("reply") >= 3
                && count("transition") >= 4
        },
    )
    .await;
    let spans = of_order();
    let services: BTreeSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
    for service in ["submission", "scheduler", "agent"] {
        assert!(services.contains(service), "{services:?}");
    }
    let by_id = |id: &str| spans.iter().find(|s| s.span_id == id);
    let parent_of = |s: &sas_tests::otlp::Span| by_id(&s.parent).map(|p| p.name.as_str());
    // One root, the submission's; every other span nests under a span of the trace.
    let roots: Vec<&str> = spans
        .iter()
        .filter(|s| by_id(&s.parent).is_none())
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(roots, ["submit"], "{spans:#?}");
    for s in &spans {
        let expected: &[&str] = match s.name.as_str() {
            "remote_call" => &["step"],
            "step" => &["transition"],
            "reply" => &["step"],
            "transition" => &["submit"],
            _ => continue,
        };
        let parent = parent_of(s);
        assert!(
            parent.is_some_and(|p| expected.contains(&p)),
            "{} under {parent:?}: {spans:#?}",
            s.name
        );
    }
    assert!(
        spans
            .iter()
            .filter(|s| s.name == "step")
            .all(|s| s.attribute("order_id") == Some(id.to_string().as_str())),
        "{spans:#?}"
    );
}

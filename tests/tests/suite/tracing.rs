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

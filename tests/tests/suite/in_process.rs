//! Each service is a value (`<service>::build(settings)`): started in the
//! test's own process, each on a port of its own (`http.port = 0`, no port
//! picked ahead and raced for), orders run through them over the queue and
//! over HTTP, and each stops when asked, cleanly and within its grace.

use std::collections::BTreeSet;
use std::time::Duration;

use sas::service::App;
use sas_tests::{TestApp, http_get, is_terminal};
use serde_json::{Value, json};
use uuid::Uuid;

/// Bound on every wait of these tests.
const WAIT: Duration = Duration::from_secs(30);

/// The four services of an order's path and the dashboard, started in
/// this process from `app`'s configuration.
async fn start_all(app: &TestApp) -> Vec<App> {
    let settings = app.settings();
    vec![
        submission::build(settings.clone())
            .await
            .expect("submission starts"),
        scheduler::build(settings.clone())
            .await
            .expect("scheduler starts"),
        agent::build(settings.clone(), Vec::new())
            .await
            .expect("agent starts"),
        supervisor::build(settings.clone())
            .await
            .expect("supervisor starts"),
        ::dashboard::build(settings)
            .await
            .expect("dashboard starts"),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_services_run_in_the_tests_process_each_on_a_port_of_its_own_and_stop_when_asked() {
    let app = TestApp::new().await;
    let apps = start_all(&app).await;

    let ports: BTreeSet<u16> = apps.iter().map(|a| a.addr().port()).collect();
    assert_eq!(ports.len(), apps.len(), "one port each: {ports:?}");
    assert!(!ports.contains(&0), "{ports:?}");
    for service in &apps {
        let url = format!("http://{}/readyz", service.addr());
        app.eventually(&format!("{} ready", service.name()), WAIT, || async {
            http_get(&url).await.is_some_and(|(code, _)| code == 200)
        })
        .await;
    }

    // Over the orders queue, with every status event...
    let (id, events) = app.run_one("three").await;
    let last = events.last().expect("events");
    assert!(is_terminal(last), "{events:?}");
    assert_eq!(last["state"], "processed", "{id}: {events:?}");
    // ...and over the submission's HTTP API on the port it was given.
    let submission = &apps[0];
    assert_eq!(submission.name(), "submission");
    sas::tls::install_crypto_provider();
    let http = reqwest::Client::builder()
        .timeout(WAIT)
        .build()
        .expect("HTTP client");
    let base = format!("http://{}", submission.addr());
    let posted: Value = http
        .post(format!("{base}/v1/orders"))
        .json(&json!({ "workflow": "one", "payload": { "n": 1 } }))
        .send()
        .await
        .expect("the API answers")
        .json()
        .await
        .expect("a JSON answer");
    let posted: Uuid = serde_json::from_value(posted["order_id"].clone()).expect("an order_id");
    app.eventually(&format!("order {posted} processed"), WAIT, || async {
        app.order(posted)
            .await
            .is_some_and(|(state, _)| state == "processed")
    })
    .await;

    // Asked to stop, each stops cleanly, and its port with it.
    for service in &apps {
        service.stop();
    }
    for service in apps {
        let (name, addr) = (service.name(), service.addr());
        tokio::time::timeout(WAIT, service.stopped())
            .await
            .unwrap_or_else(|_| panic!("{name} did not stop within {WAIT:?}"))
            .unwrap_or_else(|e| panic!("{name} stopped with an error: {e:#}"));
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "{name} still listens on {addr} after it stopped"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_whose_port_is_taken_does_not_start_and_says_why() {
    let app = TestApp::new().await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("address").port();
    let mut settings = app.settings();
    settings.http.host = "127.0.0.1".into();
    settings.http.port = Some(port);
    for started in [
        scheduler::build(settings.clone()).await,
        supervisor::build(settings.clone()).await,
        agent::build(settings, Vec::new()).await,
    ] {
        let error = match started {
            Ok(service) => panic!("{} started on a taken port", service.name()),
            Err(e) => format!("{e:#}"),
        };
        assert!(
            error.contains(&format!("cannot listen on 127.0.0.1:{port}")),
            "{error}"
        );
    }
    // A service beside them on a port of its own is unharmed.
    let service = scheduler::build(app.settings()).await.expect("starts");
    service.stop();
    tokio::time::timeout(WAIT, service.stopped())
        .await
        .expect("stops in time")
        .expect("stops cleanly");
}

//! What every service promises (contract §7): `--help`, a one-line error and a
//! non-zero exit on bad configuration or an unreachable dependency, the
//! health endpoints, and work noticed without waiting for a poll.

use std::process::Command;
use std::time::{Duration, Instant};

use sas_tests::{TestApp, bin, http_get};

const SERVICES: [&str; 4] = ["submission", "scheduler", "agent", "supervisor"];

#[test]
fn every_binary_answers_help() {
    for name in SERVICES
        .iter()
        .chain(&["sasctl", "sas-chaos", "remote-sim"])
    {
        let out = Command::new(bin(name))
            .arg("--help")
            .output()
            .expect("run --help");
        assert!(out.status.success(), "{name} --help failed");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("Usage"), "{name}: {text}");
    }
}

#[test]
fn bad_configuration_is_one_clear_line_and_exit_code_2() {
    let cases: [(&str, &str, &str); 4] = [
        ("SAS__SUPERVISOR__INTERVAL", "soon", "bad configuration"),
        ("SAS__BROKER__PREFETCH", "lots", "bad configuration"),
        ("SAS__SUPERVISOR__MAX_FAILURES", "0", "max_failures"),
        ("SAS__BROKER__PREFIX", "no spaces", "broker.prefix"),
    ];
    for name in SERVICES {
        for (key, value, says) in cases {
            let out = Command::new(bin(name))
                .env(key, value)
                .output()
                .expect("run");
            assert_eq!(out.status.code(), Some(2), "{name} with {key}={value}");
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(err.trim().lines().count(), 1, "{name}: {err}");
            assert!(
                err.starts_with(&format!("{name}: ")) && err.contains(says),
                "{name}: {err}"
            );
        }
    }
    let out = Command::new(bin("scheduler"))
        .args(["--config", "/nonexistent/sas.toml"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));
}

#[test]
fn a_workflow_with_a_bad_step_is_bad_configuration() {
    let dir = std::env::temp_dir().join(format!("sas-badwf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("sas.toml");
    std::fs::write(&file, "[workflows.w]\nsteps = []\n").unwrap();
    let out = Command::new(bin("submission"))
        .args(["--config"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("workflow \"w\" has no steps"));
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn an_unreachable_dependency_fails_start_up_after_bounded_retries() {
    // The supervisor reaches Postgres before the broker: the test's own
    // database, so that nothing touches the default one (`sas`).
    let app = TestApp::new().await;
    for (name, key, url) in [
        (
            "scheduler",
            "SAS__DATABASE__URL",
            "postgres://postgres@127.0.0.1:1/nope",
        ),
        (
            "supervisor",
            "SAS__BROKER__URL",
            "amqp://guest:guest@127.0.0.1:1/%2f",
        ),
    ] {
        let started = Instant::now();
        let out = Command::new(bin(name))
            .env("SAS__DATABASE__URL", &app.db_url)
            .env(key, url)
            .env("SAS__DATABASE__CONNECT_TIMEOUT", "1s")
            .env("SAS__BROKER__CONNECT_TIMEOUT", "1s")
            .env("SAS__HTTP__PORT", "0")
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(1), "{name}");
        assert!(started.elapsed() < Duration::from_secs(20));
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.trim().lines().last().unwrap_or_default().to_owned();
        assert!(
            last.starts_with(&format!("{name}: ")) && last.contains("could not reach"),
            "{err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_serves_health_readiness_and_metrics() {
    let app = TestApp::spawn().await;
    for name in SERVICES {
        let base = format!("http://127.0.0.1:{}", app.port(name));
        assert_eq!(http_get(&format!("{base}/healthz")).await.unwrap().0, 200);
        let (code, body) = http_get(&format!("{base}/readyz")).await.unwrap();
        assert_eq!(code, 200, "{name}: {body}");
        assert!(body.contains(r#""rabbitmq":true"#), "{name}: {body}");
        let (code, metrics) = http_get(&format!("{base}/metrics")).await.unwrap();
        assert_eq!(code, 200);
        assert!(
            metrics.contains("# TYPE sas_orders_received counter"),
            "{name}: {metrics}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_orders_are_noticed_without_waiting_for_the_poll() {
    let app = TestApp::builder().scheduler_poll("1h").spawn().await;
    // A first order, processed, shows the scheduler past its start-up claim
    // and waiting: the next one cannot ride on that claim.
    let first = app.submit("one", None).await;
    sas_tests::cli::wait_state(&app, first, "processed", Duration::from_secs(20)).await;
    let id = app.submit("three", None).await;
    // The poll is an hour away: only a wake-up can get it done in time.
    app.eventually(
        "the order is processed",
        Duration::from_secs(20),
        || async { app.order(id).await.is_some_and(|(s, _)| s == "processed") },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orders_queue_declared_by_the_application_with_other_arguments_is_used_as_it_is() {
    let app = TestApp::new().await;
    // The application declared the orders queue first, as a plain quorum queue.
    let broker = sas::broker::Broker::connect(
        &sas::config::BrokerSettings {
            url: sas_tests::amqp().into(),
            ..Default::default()
        },
        "test-application",
    )
    .await
    .unwrap();
    broker
        .delete_queues(&[app.queues.orders().to_owned()])
        .await
        .unwrap();
    broker
        .declare_queue(app.queues.orders(), sas::config::QueueType::Quorum, None, 0)
        .await
        .unwrap();
    broker.close().await;
    app.start_all().await;
    let (id, events) = app.run_one("one").await;
    assert_eq!(events.last().unwrap()["state"], "processed", "order {id}");
    assert!(app.log("submission").contains("using it as it is"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_services_declare_classic_step_queues_and_a_quorum_orders_queue_by_default() {
    use sas::config::{BrokerSettings, QueueType};
    let app = TestApp::spawn().await;
    let settings = BrokerSettings {
        url: sas_tests::amqp().into(),
        ..Default::default()
    };
    let broker = sas::broker::Broker::connect(&settings, "test-application")
        .await
        .unwrap();
    // Declaring an existing queue again succeeds only with its own arguments.
    let declared_as = |queue: String, dead: String, kind: QueueType| {
        let broker = &broker;
        let limit = settings.delivery_limit;
        async move {
            broker
                .declare_queue(&queue, kind, Some(&dead), limit)
                .await
                .is_ok()
        }
    };
    let q = &app.queues;
    let requests = (q.agent_requests("a"), q.agent_requests_dead("a"));
    let replies = (q.replies().to_owned(), q.replies_dead().to_owned());
    let orders = (q.orders().to_owned(), q.orders_dead().to_owned());
    for (queue, dead) in [requests, replies] {
        assert!(
            !declared_as(queue.clone(), dead.clone(), QueueType::Quorum).await,
            "{queue}"
        );
        assert!(
            declared_as(queue.clone(), dead, QueueType::Classic).await,
            "{queue}"
        );
    }
    assert!(!declared_as(orders.0.clone(), orders.1.clone(), QueueType::Classic).await);
    assert!(declared_as(orders.0, orders.1, QueueType::Quorum).await);
    broker.close().await;
}

/// Reads from `stream` until the server closes it; how long that took.
async fn until_closed(stream: &mut tokio::net::TcpStream, bound: Duration) -> Duration {
    use tokio::io::AsyncReadExt as _;
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at((started + bound).into(), stream.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return started.elapsed(),
            Ok(Ok(_)) => continue,
            Err(_) => panic!("the connection is still open after {bound:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_sends_headers_slowly_or_idles_is_disconnected() {
    use tokio::io::AsyncWriteExt as _;
    let app = TestApp::new().await;
    app.start("supervisor", "supervisor", &[]).await;
    let addr = format!("127.0.0.1:{}", app.port("supervisor"));
    // Half a request line, then nothing (slowloris).
    let mut slow = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    slow.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("write");
    let took = until_closed(&mut slow, Duration::from_secs(20)).await;
    assert!(took >= Duration::from_secs(9), "closed after {took:?}");
    // A kept-alive connection that idles after its answer.
    let mut idle = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    until_closed(&mut idle, Duration::from_secs(20)).await;
    // Meanwhile the port still serves.
    let url = format!("http://{addr}/healthz");
    assert_eq!(http_get(&url).await.map(|(code, _)| code), Some(200));
}

#[tokio::test]
async fn a_broker_connection_takes_the_servers_frame_max_unless_its_url_says_otherwise() {
    // Any content header a publisher may send then fits one of sas's
    // frames (contract §1b); `frame_max` in rabbitmq.conf bounds both.
    use sas::config::BrokerSettings;
    let raw = sas_tests::raw_amqp::RawPublisher::connect()
        .await
        .expect("raw connection");
    let servers = raw.frame_max();
    raw.close().await;
    for (url, frame_max) in [
        (sas_tests::amqp().to_owned(), servers),
        (format!("{}?frame_max=65536", sas_tests::amqp()), 65536),
    ] {
        let settings = BrokerSettings {
            url,
            ..Default::default()
        };
        let broker = sas::broker::Broker::connect(&settings, "test-frames")
            .await
            .expect("connect");
        assert_eq!(broker.frame_max(), frame_max);
        broker.close().await;
    }
    // Below AMQP's smallest frame: a clear error, before any connection.
    let settings = BrokerSettings {
        url: format!("{}?frame_max=100", sas_tests::amqp()),
        ..Default::default()
    };
    let refused = sas::broker::Broker::connect(&settings, "test-frames").await;
    let Err(e) = refused else {
        panic!("frame_max=100 was accepted")
    };
    assert!(e.to_string().contains("frame_max=100"), "{e}");
    assert!(!e.to_string().contains("guest:guest"), "no password: {e}");
}

/// `broker.step_messages = "persistent"` for a service, as an environment override.
const PERSISTENT: [(&str, &str); 1] = [("SAS__BROKER__STEP_MESSAGES", "persistent")];

/// Waits for a message on `queue` and takes it: whether it was sent
/// persistent. It is put back, for the service that reads it.
async fn persistent_in(app: &TestApp, queue: &str) -> bool {
    app.eventually(queue, Duration::from_secs(20), || async {
        app.ready(queue).await > 0
    })
    .await;
    let taken = app.take(queue).await.expect("a message");
    let persistent = taken.delivery.persistent();
    taken.release().await.expect("put back");
    persistent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_messages_are_transient_by_default_and_persistent_when_told_while_status_events_stay_persistent()
 {
    for (env, steps) in [(&[][..], false), (&PERSISTENT[..], true)] {
        let app = TestApp::new().await;
        for name in ["submission", "scheduler", "supervisor"] {
            app.start_with_env(name, name, &[], env).await;
        }
        let status = app.status_queue("durability").await;
        let id = app.submit("one", Some(&status)).await;
        // The scheduler's request, before any agent runs.
        let requests = app.queues.agent_requests("a");
        assert_eq!(
            persistent_in(&app, &requests).await,
            steps,
            "request, {env:?}"
        );
        // The agent's reply, before any scheduler reads it.
        app.kill("scheduler");
        app.start_with_env("agent", "agent", &[], env).await;
        let replies = app.queues.replies().to_owned();
        assert_eq!(persistent_in(&app, &replies).await, steps, "reply, {env:?}");
        app.start_with_env("scheduler", "scheduler", &[], env).await;
        // Every status event goes persistent: the application's queue.
        let mut states = Vec::new();
        while states.last().is_none_or(|s| s != "processed") {
            app.eventually("a status event", Duration::from_secs(20), || async {
                app.ready(&status).await > 0
            })
            .await;
            let taken = app.take(&status).await.expect("event");
            assert!(taken.delivery.persistent(), "status event, {env:?}");
            let event: serde_json::Value =
                serde_json::from_slice(taken.delivery.body()).expect("event");
            assert_eq!(event["order_id"], id.to_string());
            states.push(event["state"].as_str().unwrap_or_default().to_owned());
            taken.ack().await.expect("ack");
        }
        assert_eq!(app.stats().keys[&format!("{id}:a")].applied, 1, "{env:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_order_starts_in_the_write_back_that_stores_it_unless_told_to_wait_for_a_scheduler() {
    let wait = [("SAS__SUBMISSION__START_ORDERS", "false")];
    for (env, starts) in [(&[][..], true), (&wait[..], false)] {
        let app = TestApp::new().await;
        // No scheduler yet: only the submission can have sent the request.
        app.start_with_env("submission", "submission", &[], env)
            .await;
        let status = app.status_queue("started").await;
        let id = app.submit("one", Some(&status)).await;
        let stored = async || app.order(id).await.map(|(state, _)| state);
        app.eventually("stored", Duration::from_secs(20), || async {
            stored().await.is_some()
        })
        .await;
        let requests = app.queues.agent_requests("a");
        if starts {
            assert_eq!(
                stored().await.as_deref(),
                Some("processing"),
                "one statement"
            );
            app.eventually("its first request", Duration::from_secs(20), || async {
                app.ready(&requests).await == 1
            })
            .await;
        } else {
            assert_eq!(stored().await.as_deref(), Some("pending"), "{env:?}");
            assert_eq!(app.ready(&requests).await, 0, "{env:?}");
        }
        for name in ["scheduler", "agent"] {
            app.start_with_env(name, name, &[], env).await;
        }
        let story = &app.stories(&status, &[id], Duration::from_secs(30)).await[&id];
        let states: Vec<&str> = story.iter().filter_map(|e| e["state"].as_str()).collect();
        assert_eq!(
            states,
            ["received", "processing", "step_succeeded", "processed"],
            "{env:?}"
        );
        assert_eq!(app.stats().keys[&format!("{id}:a")].applied, 1, "{env:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_load_new_orders_wait_for_the_schedulers_claims_by_priority() {
    // Room for two orders held at once, deployment-wide.
    let bound = [("SAS__SCHEDULER__MAX_IN_FLIGHT", "2")];
    let app = TestApp::new().await;
    app.start_with_env("submission", "submission", &[], &bound)
        .await;
    let ids = app.submit_many("one", 5, None).await;
    app.eventually("stored", Duration::from_secs(20), || async {
        app.count_in("processing").await + app.count_in("pending").await == 5
    })
    .await;
    assert_eq!(
        app.count_in("processing").await,
        2,
        "{:?}",
        app.states().await
    );
    assert_eq!(app.count_in("pending").await, 3);
    for name in ["scheduler", "agent"] {
        app.start_with_env(name, name, &[], &bound).await;
    }
    app.wait_for_state("processed", 5, Duration::from_secs(30))
        .await;
    for id in ids {
        assert_eq!(app.stats().keys[&format!("{id}:a")].applied, 1);
    }
}

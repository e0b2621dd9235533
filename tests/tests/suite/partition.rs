//! A silent partition (contract §6a, issue #26): every service loses
//! Postgres and RabbitMQ for 20 s without a socket being closed, through
//! proxies that drop the bytes ([`sas_tests::proxy`]); the connections open
//! then stay silent after the network is back. Run alone, after the rest.

use std::time::{Duration, Instant};

use sas_tests::proxy::Proxy;
use sas_tests::{TestApp, amqp, amqp_address, pg_address};

const ALL: [&str; 4] = ["submission", "scheduler", "agent", "supervisor"];

/// `url` with its host and port replaced by the proxy's, 127.0.0.1:`port`.
fn through(url: &str, port: u16) -> String {
    let mut url = reqwest::Url::parse(url).expect("a URL");
    url.set_host(Some("127.0.0.1")).expect("a host");
    url.set_port(Some(port)).expect("a port");
    url.to_string()
}

/// A deployment whose services reach Postgres and RabbitMQ through a proxy
/// each (the test's own connections go straight to them).
async fn behind_proxies() -> (TestApp, Proxy, Proxy) {
    let app = TestApp::builder().build().await;
    let postgres = Proxy::start(pg_address()).await;
    let rabbitmq = Proxy::start(amqp_address()).await;
    let db_url = through(&app.db_url, postgres.port());
    assert_ne!(
        db_url, app.db_url,
        "the database URL goes through the proxy"
    );
    let amqp_url = through(amqp(), rabbitmq.port());
    assert_ne!(amqp_url, amqp(), "the broker URL goes through the proxy");
    let env = [
        ("SAS__DATABASE__URL", db_url.as_str()),
        ("SAS__BROKER__URL", amqp_url.as_str()),
    ];
    for name in ALL {
        app.start_with_env(name, name, &[], &env).await;
    }
    (app, postgres, rabbitmq)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_partition_of_twenty_seconds_leaves_no_order_behind() {
    let (app, postgres, rabbitmq) = behind_proxies().await;
    let status = app.status_queue("status").await;
    let every = Duration::from_millis(100);

    let mut ids = app.submit_steadily("three", 50, every, Some(&status)).await;
    postgres.partition();
    rabbitmq.partition();
    // The partition lasts as long as these orders take to arrive, 20 s;
    // the test's own connections are not partitioned.
    let started = Instant::now();
    ids.extend(
        app.submit_steadily("three", 200, every, Some(&status))
            .await,
    );
    let left = Duration::from_secs(20).saturating_sub(started.elapsed());
    tokio::time::sleep(left).await;
    postgres.heal();
    rabbitmq.heal();
    let healed = Instant::now();
    ids.extend(app.submit_steadily("three", 30, every, Some(&status)).await);

    // Every order has ended within a minute of the network's return (the
    // rest of the invariants are checked after).
    let within = Duration::from_secs(60).saturating_sub(healed.elapsed());
    let stories = app.assert_invariants(&status, &ids, &[], within).await;
    let recovered = healed.elapsed();
    assert!(
        sas_tests::all_end_in(&stories, "processed"),
        "every order ends processed"
    );
    app.assert_running(&ALL);
    eprintln!(
        "{} orders, every one processed {recovered:?} after the network came back",
        ids.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_pass_through_the_proxies() {
    let (app, _postgres, _rabbitmq) = behind_proxies().await;
    let (_, events) = app.run_one("three").await;
    assert_eq!(sas_tests::states(&events).last(), Some(&"processed"));
}

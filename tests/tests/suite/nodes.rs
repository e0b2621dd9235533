//! More than one broker node (contract §6a): `broker.url` may list the
//! nodes of a cluster, and every connection asks for a heartbeat short
//! enough that a silent one is given up within half a minute.

use std::time::Duration;

use sas_tests::{TestApp, amqp};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_url_of_several_nodes_reaches_the_one_that_answers() {
    let app = TestApp::builder().build().await;
    // Nothing listens on port 1: the services find the node that answers,
    // whichever order they try them in.
    let nodes = format!("amqp://guest:guest@127.0.0.1:1/%2f,{}", amqp());
    let env = [("SAS__BROKER__URL", nodes.as_str())];
    for name in ["submission", "scheduler", "agent", "supervisor"] {
        app.start_with_env(name, name, &[], &env).await;
    }
    let (_, events) = app.run_one("three").await;
    assert_eq!(sas_tests::states(&events).last(), Some(&"processed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_or_empty_node_list_is_refused_at_start_up() {
    for (url, says) in [
        (
            format!("{},amqps://guest:guest@127.0.0.1:5671/%2f", amqp()),
            "mixes amqp:// and amqps://",
        ),
        (" , ".to_owned(), "broker.url is empty"),
        (
            format!("{},http://x", amqp()),
            "must be an amqp:// or amqps:// URL",
        ),
    ] {
        sas_tests::assert_refused_at_start_up(
            "scheduler",
            &format!("[broker]\nurl = \"{url}\"\n"),
            says,
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_asks_for_the_configured_heartbeat() {
    let app = TestApp::builder().build().await;
    // 7 s: no other test asks for it, so the connections are this test's.
    let env = [("SAS__BROKER__HEARTBEAT", "7s")];
    for name in ["submission", "scheduler", "agent", "supervisor"] {
        app.start_with_env(name, name, &[], &env).await;
    }
    app.eventually(
        "four connections with a 7 s heartbeat",
        Duration::from_secs(20),
        || async {
            let out = sas_tests::rabbitmq_cli("rabbitmqctl")
                .args(["list_connections", "timeout", "--formatter", "json", "-q"])
                .output()
                .expect("rabbitmqctl");
            let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            let sevens = listed
                .as_array()
                .map_or(0, |all| all.iter().filter(|c| c["timeout"] == 7).count());
            sevens >= 4
        },
    )
    .await;
}

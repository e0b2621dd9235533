//! Least privilege on the broker (contract §1a): an application's RabbitMQ
//! user, with the permissions docs/security.md gives, submits orders through
//! `<prefix>.submit` and reads its own status queue, while the broker
//! refuses its forged step requests, replies and alerts.

use std::time::Duration;

use sas::broker::{Broker, Outgoing, PublishError, Publisher};
use sas::config::BrokerSettings;
use sas_tests::TestApp;
use sas_tests::broker_users::BrokerUser;
use serde_json::json;
use uuid::Uuid;

/// The recipe in docs/security.md for an application's user: configure and
/// read its own queues (`<prefix>-app.…`, outside sas's own names), write
/// only to the submission exchange.
fn app_user(prefix: &str) -> BrokerUser {
    let own = format!("^{prefix}-app\\..*");
    let submit = format!("^{prefix}\\.submit$");
    BrokerUser::create(&format!("{prefix}-app"), &own, &submit, &own)
}

/// Publishes as the application: `Ok` when the broker took the message.
async fn publish(
    publisher: &Publisher,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
) -> Result<(), PublishError> {
    publisher
        .publish(&Outgoing {
            exchange,
            routing_key,
            body,
            mandatory: true,
            ..Outgoing::default()
        })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_user_submits_and_reads_its_status_but_cannot_forge_a_step_request() {
    let app = TestApp::spawn().await;
    let user = app_user(&app.prefix);
    let settings = BrokerSettings {
        url: user.url(),
        prefix: app.prefix.clone(),
        connect_timeout: Duration::from_secs(5),
        ..BrokerSettings::default()
    };
    let broker = Broker::connect(&settings, "application")
        .await
        .expect("the application user connects");
    let status = format!("{}-app.status", app.prefix);
    broker
        .declare_status_queue(&status)
        .await
        .expect("the application declares its own status queue");
    // The same queue, registered for the test's clean-up.
    assert_eq!(app.status_queue("status").await, status);

    // A real order, through the submission exchange.
    let id = Uuid::new_v4();
    let order = json!({ "order_id": id, "workflow": "three", "payload": {}, "reply_to": status });
    let publisher = broker.publisher().await.expect("publisher");
    publish(
        &publisher,
        app.queues.submit_exchange(),
        "",
        order.to_string().as_bytes(),
    )
    .await
    .expect("an order is accepted");

    // Forgeries straight into sas's own queues are refused by the broker
    // (each refusal closes the channel: a new one each time).
    let request = json!({
        "order_id": Uuid::new_v4(), "workflow": "three", "step": "a", "step_index": 0,
        "direction": "forward", "attempt": 1, "dispatch_id": Uuid::new_v4(),
        "locked_by": "forger", "complete_by": "2100-01-01T00:00:00Z", "payload": {}, "results": {},
    });
    let requests = app.queues.agent_requests("a");
    for queue in [
        requests.as_str(),
        app.queues.replies(),
        app.queues.alerts(),
        app.queues.orders(),
    ] {
        let publisher = broker.publisher().await.expect("publisher");
        let refused = publish(&publisher, "", queue, request.to_string().as_bytes()).await;
        assert!(
            matches!(&refused, Err(PublishError::Amqp(e)) if format!("{e}").contains("ACCESS_REFUSED")),
            "publishing to {queue} on the default exchange: {refused:?}"
        );
    }
    // Nor can it read another queue of sas's.
    assert!(
        broker.consume(&requests, 1, "forger").await.is_err(),
        "the application read the agent's requests"
    );

    // The real order ends, and the application reads its own events.
    let events = app
        .collect(&status, Duration::from_secs(30), |got| {
            got.iter().any(|e| e["state"] == "processed")
        })
        .await;
    assert!(events.iter().all(|e| e["order_id"] == id.to_string()));
    let stats = app.stats();
    assert_eq!(stats.total_applied, 3, "only the real order's steps ran");
    assert!(stats.keys.keys().all(|k| k.starts_with(&id.to_string())));
    broker.close().await;
}

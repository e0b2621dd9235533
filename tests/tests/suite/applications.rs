//! Application identities (contract §1b), against the real services and a
//! RabbitMQ user per application: RabbitMQ checks the `user_id` property
//! against the connection's user, sas tells applications apart by it.
//! Each refusal of the contract, and the same order id from two
//! applications being two orders, each application seeing only its own.

use std::time::Duration;

use sas_tests::TestApp;
use sas_tests::broker_users::BrokerUser;
use sas_tests::hostile::ends;
use sas_tests::raw_amqp::{Properties, RawError, RawPublisher, flag, short_string};
use serde_json::{Value, json};
use uuid::Uuid;

/// An application's connection: it publishes with its `user_id`.
struct AppClient {
    user: BrokerUser,
    raw: RawPublisher,
}

impl AppClient {
    async fn connect(user: BrokerUser) -> Self {
        let raw = RawPublisher::connect_to(sas_tests::amqp_address(), &user.name, &user.password)
            .await
            .expect("the application's user connects");
        Self { user, raw }
    }

    /// Publishes `body` to `queue` as this application (or claiming to be
    /// `claimed`), with `reply_to` as the AMQP property.
    async fn send_as(
        &mut self,
        claimed: Option<&str>,
        queue: &str,
        reply_to: Option<&str>,
        body: &Value,
    ) -> Result<(), RawError> {
        let mut props = Properties::new(reply_to, None);
        if let Some(user) = claimed {
            props.flags |= flag::USER_ID;
            short_string(&mut props.list, user);
        }
        self.raw
            .publish(queue, &props, body.to_string().as_bytes())
            .await
    }

    async fn send(&mut self, queue: &str, reply_to: Option<&str>, body: &Value) {
        let user = self.user.name.clone();
        self.send_as(Some(&user), queue, reply_to, body)
            .await
            .expect("the broker takes it");
    }
}

/// Empties the orders' dead-letter queue; each of `reasons` must be among
/// its letters' `x-sas-reason`s.
async fn dead_lettered_for(app: &TestApp, reasons: &[&str]) {
    let dead = app.drain(app.queues.orders_dead()).await;
    let given: Vec<String> = dead.into_iter().filter_map(|(_, why)| why).collect();
    for reason in reasons {
        assert!(
            given.iter().any(|w| w.contains(reason)),
            "{reason}: {given:?}"
        );
    }
}

/// Two applications of this test's run, `shop` and `billing`, each with a
/// RabbitMQ user of its own and its queues `<run>-<name>.*`: the users and
/// their `[applications]` configuration.
fn shop_and_billing(run: &str) -> ([BrokerUser; 2], String) {
    let users = ["shop", "billing"]
        .map(|name| BrokerUser::create(&format!("{run}-{name}"), ".*", ".*", ".*"));
    let config = format!(
        "[applications.shop]\nuser = \"{}\"\nreply_to = [\"{run}-shop.*\"]\n\n\
         [applications.billing]\nuser = \"{}\"\nreply_to = [\"{run}-billing.*\"]\n",
        users[0].name, users[1].name
    );
    (users, config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_applications_own_their_ids_queues_and_replays_and_a_stranger_is_refused() {
    // Users and queues of this test's own (a random part in each name).
    let run = format!("a{}", &Uuid::new_v4().simple().to_string()[..10]);
    let ([shop_user, billing_user], config) = shop_and_billing(&run);
    let app = TestApp::builder().extra_config(config).build().await;
    app.start_all().await;
    let (shop_q, billing_q) = (
        format!("{run}-shop.status"),
        format!("{run}-billing.status"),
    );
    for queue in [&shop_q, &billing_q] {
        app.declare_queue(queue, None).await;
    }
    let q = app.queues.clone();
    let mut shop = AppClient::connect(shop_user).await;
    let mut billing = AppClient::connect(billing_user).await;

    // The same id from both: two orders, each told on its own queue.
    let id = Uuid::new_v4();
    let order = |queue: &str, who: &str| json!({ "order_id": id, "workflow": "one", "payload": { "who": who }, "reply_to": queue });
    shop.send(q.orders(), None, &order(&shop_q, "shop")).await;
    billing
        .send(q.orders(), None, &order(&billing_q, "billing"))
        .await;

    // Refused: no user_id (a stranger, or the deployment's own user);
    // another application's queue; a forged user_id (RabbitMQ's refusal).
    let stranger = Uuid::new_v4();
    let mut guest = RawPublisher::connect().await.expect("guest");
    guest
        .publish(
            q.orders(),
            &Properties::new(Some(&shop_q), None),
            json!({ "order_id": stranger, "workflow": "one", "payload": {} })
                .to_string()
                .as_bytes(),
        )
        .await
        .expect("the broker takes it");
    let poacher = Uuid::new_v4();
    shop.send(
        q.orders(),
        None,
        &json!({ "order_id": poacher, "workflow": "one", "payload": {}, "reply_to": billing_q }),
    )
    .await;
    let billing_name = billing.user.name.clone();
    let forged = shop
        .send_as(
            Some(&billing_name),
            q.orders(),
            Some(&shop_q),
            &order(&shop_q, "forged"),
        )
        .await;
    assert!(
        matches!(&forged, Err(RawError::Closed(406, text)) if text.contains("user_id")),
        "RabbitMQ takes a forged user_id: {forged:?}"
    );
    // (That closed the channel: a new connection.)
    let mut shop = AppClient::connect(shop.user).await;
    // A bad message of shop's carrying its live order's id (once stored):
    // no echo.
    app.eventually("both orders stored", Duration::from_secs(20), || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders WHERE app_order_id = $1")
            .bind(id)
            .fetch_one(&app.db)
            .await
            .unwrap_or(0)
            == 2
    })
    .await;
    shop.send(
        q.orders(),
        None,
        &json!({ "order_id": id, "workflow": "one", "reply_to": shop_q }),
    )
    .await;

    let shop_events = app
        .collect(&shop_q, Duration::from_secs(60), |got| {
            ends(got).contains_key(&id.to_string()) && got.iter().any(|e| e["state"] == "rejected")
        })
        .await;
    let billing_events = app
        .collect(&billing_q, Duration::from_secs(60), |got| {
            ends(got).contains_key(&id.to_string())
        })
        .await;
    for events in [&shop_events, &billing_events] {
        assert_eq!(ends(events)[&id.to_string()], "processed");
        let received = events.iter().filter(|e| e["state"] == "received").count();
        assert_eq!(received, 1, "one order per application: {events:?}");
        assert!(
            events
                .iter()
                .all(|e| e["order_id"] == id.to_string() || e["order_id"].is_null()),
            "an event of another order: {events:?}"
        );
    }
    let rejected: Vec<&Value> = shop_events
        .iter()
        .filter(|e| e["state"] == "rejected")
        .collect();
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert!(
        rejected[0]["order_id"].is_null(),
        "the live id echoed: {rejected:?}"
    );
    // Two orders of one id, one per application, each with its payload.
    let stored: Vec<(String, Value)> = sqlx::query_as(
        "SELECT application, payload FROM orders WHERE app_order_id = $1 ORDER BY application",
    )
    .bind(id)
    .fetch_all(&app.db)
    .await
    .expect("orders");
    assert_eq!(
        stored,
        vec![
            ("billing".to_owned(), json!({ "who": "billing" })),
            ("shop".to_owned(), json!({ "who": "shop" })),
        ]
    );
    // Neither the stranger's nor the poacher's order exists; both are
    // dead-lettered with their reasons.
    dead_lettered_for(&app, &["no user_id", "not among application"]).await;
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&app.db)
        .await
        .expect("count");
    assert_eq!(count, 2);

    // Replays: billing gets its own order's events by the id it gave; it
    // cannot have shop's queue replayed, nor send its events to shop's.
    billing
        .send(q.replay(), None, &json!({ "order_id": id, "from_seq": 1 }))
        .await;
    let replayed = app
        .collect(&billing_q, Duration::from_secs(30), |got| {
            got.iter().any(|e| e["state"] == "processed")
        })
        .await;
    assert!(replayed.iter().all(|e| e["order_id"] == id.to_string()));
    billing
        .send(
            q.replay(),
            None,
            &json!({ "reply_to": shop_q, "since": "2000-01-01T00:00:00Z" }),
        )
        .await;
    billing
        .send(q.replay(), Some(&shop_q), &json!({ "order_id": id }))
        .await;
    app.eventually("two replays refused", Duration::from_secs(20), || async {
        app.ready(q.replay_dead()).await == 2
    })
    .await;
    let refused = app.drain(q.replay_dead()).await;
    assert!(
        refused.iter().all(|(_, why)| why
            .as_deref()
            .is_some_and(|w| w.contains("not among application"))),
        "{refused:?}"
    );
    assert_eq!(
        app.ready(&shop_q).await,
        0,
        "shop's queue got billing's replay"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_message_sent_with_its_users_user_id_is_dead_lettered_without_costing_sas_its_channel()
 {
    // No applications configured: any application may set its user_id.
    let app = TestApp::spawn().await;
    let run = format!("u{}", &Uuid::new_v4().simple().to_string()[..10]);
    let mut client =
        AppClient::connect(BrokerUser::create(&format!("{run}-app"), ".*", ".*", ".*")).await;
    let status = app.status_queue("status").await;
    let q = app.queues.clone();
    let mut good = Vec::new();
    for body in [
        json!("not an order"),
        json!({ "workflow": "one" }),
        json!({ "workflow": "none", "payload": {} }),
    ] {
        good.push(app.submit("one", Some(&status)).await);
        client.send(q.orders(), Some(&status), &body).await;
        client.send(q.replay(), None, &body).await;
    }
    good.push(app.submit("one", Some(&status)).await);
    let events = app
        .collect(&status, Duration::from_secs(60), |got| {
            let ended = ends(got);
            good.iter().all(|id| ended.contains_key(&id.to_string()))
        })
        .await;
    let ended = ends(&events);
    assert!(good.iter().all(|id| ended[&id.to_string()] == "processed"));
    app.eventually("all six dead-lettered", Duration::from_secs(20), || async {
        app.ready(q.orders_dead()).await == 3 && app.ready(q.replay_dead()).await == 3
    })
    .await;
    for name in ["submission", "scheduler"] {
        let log = app.log(name);
        assert!(
            !log.contains("lost RabbitMQ"),
            "{name} lost its channel:\n{log}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_on_the_rust_client_is_known_by_its_user_without_a_word_of_code() {
    use sas_client::{Client, Options};

    let run = format!("c{}", &Uuid::new_v4().simple().to_string()[..10]);
    let user = BrokerUser::create(&format!("{run}-shop"), ".*", ".*", ".*");
    let config = format!(
        "[applications.shop]\nuser = \"{}\"\nreply_to = [\"{run}-shop.*\"]\n",
        user.name
    );
    let app = TestApp::builder().extra_config(config).build().await;
    app.start_all().await;
    let queue = format!("{run}-shop.status");
    app.declare_queue(&queue, None).await;
    let client = Client::connect_with(Options::new(user.url(), &app.prefix).status_queue(&queue))
        .await
        .expect("connect");
    let id = client
        .submit("one", &serde_json::Map::new())
        .await
        .expect("submit")
        .id();
    let terminal = client
        .wait(id, Duration::from_secs(30))
        .await
        .expect("terminal");
    assert!(terminal.succeeded(), "{terminal:?}");
    assert_eq!(terminal.event.order_id, json!(id.to_string()));
    let application: Option<String> =
        sqlx::query_scalar("SELECT application FROM orders WHERE app_order_id = $1")
            .bind(id)
            .fetch_one(&app.db)
            .await
            .expect("the order");
    assert_eq!(application.as_deref(), Some("shop"));
    client.close().await;
}

/// Makes the submission's store fail, with an error neither transient nor
/// a refusal of the order's values (so the message is retried, counted),
/// on an order whose payload's `case` is `retry` (its first insert only)
/// or is listed in `test_failing` (until the row goes).
async fn inject_store_failures(app: &TestApp) {
    for statement in [
        "CREATE SEQUENCE test_retry",
        "CREATE TABLE test_failing (case_ text PRIMARY KEY)",
        "CREATE FUNCTION test_fail() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF (NEW.payload->>'case' = 'retry' AND nextval('test_retry') = 1) \
              OR EXISTS (SELECT 1 FROM test_failing WHERE case_ = NEW.payload->>'case') THEN \
             RAISE EXCEPTION 'injected store failure' USING ERRCODE = 'P0001'; \
           END IF; \
           RETURN NEW; \
         END $$",
        "CREATE TRIGGER test_fail BEFORE INSERT ON orders FOR EACH ROW EXECUTE FUNCTION test_fail()",
    ] {
        sqlx::query(statement)
            .execute(&app.db)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_retried_or_replayed_by_sas_stays_its_senders_and_no_other_user_can_pose_as_one()
{
    let run = format!("r{}", &Uuid::new_v4().simple().to_string()[..10]);
    let ([shop_user, billing_user], config) = shop_and_billing(&run);
    let app = TestApp::builder().extra_config(config).build().await;
    inject_store_failures(&app).await;
    sqlx::query("INSERT INTO test_failing VALUES ('dead')")
        .execute(&app.db)
        .await
        .expect("failing case");
    app.start_all().await;
    let shop_q = format!("{run}-shop.status");
    app.declare_queue(&shop_q, None).await;
    let q = app.queues.clone();
    let mut shop = AppClient::connect(shop_user).await;
    let mut billing = AppClient::connect(billing_user).await;
    let order = |id: Uuid, case: &str| json!({ "order_id": id, "workflow": "one", "payload": { "case": case }, "reply_to": shop_q });

    // Retried after a store failure: sas's copy is still the shop's.
    let retried = Uuid::new_v4();
    shop.send(q.orders(), None, &order(retried, "retry")).await;
    // Failing on every try, then dead-lettered; replayed by sasctl once the
    // store takes it again: still the shop's.
    let replayed = Uuid::new_v4();
    shop.send(q.orders(), None, &order(replayed, "dead")).await;
    app.eventually(
        "the failing order dead-lettered",
        Duration::from_secs(60),
        || async { app.ready(q.orders_dead()).await == 1 },
    )
    .await;
    sqlx::query("DELETE FROM test_failing")
        .execute(&app.db)
        .await
        .expect("store mended");
    let out = sas_tests::cli::output_with(
        {
            let mut cmd = sas_tests::cli::sasctl(&app);
            cmd.args(["dead-letters", "replay", "--json"]);
            cmd
        },
        Vec::new(),
    )
    .await;
    assert_eq!(out.code, Some(0), "{out:#?}");

    let events = app
        .collect(&shop_q, Duration::from_secs(60), |got| {
            let ends = ends(got);
            [retried, replayed]
                .iter()
                .all(|id| ends.contains_key(&id.to_string()))
        })
        .await;
    let ends = ends(&events);
    for id in [retried, replayed] {
        assert_eq!(ends[&id.to_string()], "processed", "{events:#?}");
    }
    let stored: Vec<(String, Uuid)> = sqlx::query_as(
        "SELECT application, app_order_id FROM orders WHERE app_order_id = ANY($1) ORDER BY application",
    )
    .bind([retried, replayed].to_vec())
    .fetch_all(&app.db)
    .await
    .expect("orders");
    assert_eq!(stored.len(), 2, "{stored:?}");
    assert!(stored.iter().all(|(who, _)| who == "shop"), "{stored:?}");
    let retries: i64 = sqlx::query_scalar("SELECT last_value FROM test_retry")
        .fetch_one(&app.db)
        .await
        .expect("sequence");
    assert!(retries >= 2, "the retry case failed once, then was retried");

    // A forged sender header is believed from no other user: billing's
    // order claiming to be the shop's is billing's (and may not name the
    // shop's queue), and one without a user_id is nobody's.
    let header = sas_tests::raw_amqp::table(&[(
        b"x-sas-user-id".to_vec(),
        sas_tests::raw_amqp::Field::LongString(shop.user.name.clone().into_bytes()),
    )]);
    let posing = Uuid::new_v4();
    let mut props = Properties::new(None, Some(&header));
    props.flags |= flag::USER_ID;
    short_string(&mut props.list, &billing.user.name.clone());
    billing
        .raw
        .publish(
            q.orders(),
            &props,
            order(posing, "posing").to_string().as_bytes(),
        )
        .await
        .expect("the broker takes it");
    let nobody = Uuid::new_v4();
    let mut guest = RawPublisher::connect().await.expect("guest");
    guest
        .publish(
            q.orders(),
            &Properties::new(None, Some(&header)),
            order(nobody, "nobody").to_string().as_bytes(),
        )
        .await
        .expect("the broker takes it");
    app.eventually(
        "both forged orders dead-lettered",
        Duration::from_secs(30),
        || async { app.ready(q.orders_dead()).await == 2 },
    )
    .await;
    dead_lettered_for(&app, &["no user_id", "not among application"]).await;
    let posed: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE app_order_id = ANY($1)")
        .bind([posing, nobody].to_vec())
        .fetch_one(&app.db)
        .await
        .expect("count");
    assert_eq!(posed, 0, "no order stored for a forged sender");
}

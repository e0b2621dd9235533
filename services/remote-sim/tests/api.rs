//! In-process tests of the HTTP API: the router runs on 127.0.0.1:0 and is
//! called with reqwest.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use remote_sim::{Knobs, RemoteSim, Stats};
use serde_json::{Value, json};
use tokio::net::TcpListener;

struct Sim {
    base: String,
    client: reqwest::Client,
    state: Arc<RemoteSim>,
}

async fn start(initial: HashMap<String, Knobs>) -> Sim {
    let state = Arc::new(RemoteSim::new(initial).unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(remote_sim::serve_with(
        listener,
        Arc::clone(&state),
        std::future::pending(),
    ));
    Sim {
        base: format!("http://{addr}"),
        client: {
            remote_sim::install_crypto_provider();
            reqwest::Client::new()
        },
        state,
    }
}

fn knobs(path: &str, knobs: Knobs) -> HashMap<String, Knobs> {
    HashMap::from([(path.to_owned(), knobs)])
}

impl Sim {
    /// Calls `path` the way a sas agent does.
    async fn call(&self, path: &str, key: Option<&str>) -> reqwest::Response {
        let mut request = self
            .client
            .post(format!("{}{path}", self.base))
            .header("X-Complete-By", "2100-01-01T00:00:00Z")
            .json(&json!({
                "order_id": "o-1",
                "step": "charge",
                "attempt": 1,
                "payload": {"amount": 42},
                "results": {},
            }));
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        request.send().await.unwrap()
    }

    async fn stats(&self) -> Stats {
        let response = self
            .client
            .get(format!("{}/stats", self.base))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        response.json().await.unwrap()
    }

    async fn put_knobs(&self, path: &str, body: &str) -> reqwest::Response {
        self.client
            .put(format!("{}/_sim/knobs{path}", self.base))
            .body(body.to_owned())
            .send()
            .await
            .unwrap()
    }
}

#[tokio::test]
async fn applied_call_answers_result_json() {
    let sim = start(HashMap::new()).await;
    let response = sim.call("/payments/charge", Some("o-1:charge")).await;
    assert_eq!(response.status(), 200);
    assert!(response.headers().get("idempotent-replayed").is_none());
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["ok"], true);
    assert_eq!(body["endpoint"], "/payments/charge");
    assert_eq!(body["idempotency_key"], "o-1:charge");
    assert_eq!(body["order_id"], "o-1");
    assert_eq!(body["step"], "charge");
    assert!(uuid::Uuid::parse_str(body["effect_id"].as_str().unwrap()).is_ok());
}

#[tokio::test]
async fn same_key_is_applied_once_and_replayed() {
    let sim = start(HashMap::new()).await;
    let first = sim.call("/inventory/reserve", Some("o-1:reserve")).await;
    assert_eq!(first.status(), 200);
    let first: Value = first.json().await.unwrap();
    let second = sim.call("/inventory/reserve", Some("o-1:reserve")).await;
    assert_eq!(second.status(), 200);
    assert_eq!(second.headers()["idempotent-replayed"], "true");
    let second: Value = second.json().await.unwrap();
    assert_eq!(first, second);

    let stats = sim.stats().await;
    assert_eq!(stats.total_calls, 2);
    assert_eq!(stats.total_applied, 1);
    assert_eq!(stats.keys["o-1:reserve"].calls, 2);
    assert_eq!(stats.keys["o-1:reserve"].applied, 1);
    assert_eq!(stats.keys["o-1:reserve"].endpoint, "/inventory/reserve");
    assert_eq!(stats.endpoints["/inventory/reserve"].replayed, 1);
    assert_eq!(stats.endpoints["/inventory/reserve"].applied, 1);
}

#[tokio::test]
async fn concurrent_calls_on_one_key_apply_once() {
    let latency = Knobs {
        latency_ms: 50,
        ..Knobs::default()
    };
    let sim = Arc::new(start(knobs("/shipping/ship", latency)).await);
    let calls: Vec<_> = (0..10)
        .map(|_| {
            let sim = Arc::clone(&sim);
            tokio::spawn(async move {
                let response = sim.call("/shipping/ship", Some("o-1:ship")).await;
                assert_eq!(response.status(), 200);
                response.json::<Value>().await.unwrap()
            })
        })
        .collect();
    let mut effects = Vec::new();
    for call in calls {
        effects.push(call.await.unwrap()["effect_id"].clone());
    }
    assert!(effects.iter().all(|effect| *effect == effects[0]));

    let stats = sim.stats().await;
    assert_eq!(stats.total_calls, 10);
    assert_eq!(stats.total_applied, 1);
    assert_eq!(stats.keys["o-1:ship"].applied, 1);
    assert_eq!(stats.endpoints["/shipping/ship"].replayed, 9);
}

#[tokio::test]
async fn fail_first_fails_per_key_then_succeeds() {
    let failing = Knobs {
        fail_first: 2,
        retry_after: Some(1),
        ..Knobs::default()
    };
    let sim = start(knobs("/payments/charge", failing)).await;
    for _ in 0..2 {
        let response = sim.call("/payments/charge", Some("o-1:charge")).await;
        assert_eq!(response.status(), 503);
        assert_eq!(response.headers()["retry-after"], "1");
    }
    let response = sim.call("/payments/charge", Some("o-1:charge")).await;
    assert_eq!(response.status(), 200);
    // Another key starts counting from zero.
    let response = sim.call("/payments/charge", Some("o-2:charge")).await;
    assert_eq!(response.status(), 503);

    let stats = sim.stats().await;
    assert_eq!(stats.endpoints["/payments/charge"].transient, 3);
    assert_eq!(stats.endpoints["/payments/charge"].applied, 1);
    assert_eq!(stats.keys["o-1:charge"].calls, 3);
    assert_eq!(stats.keys["o-1:charge"].applied, 1);
    assert_eq!(stats.keys["o-2:charge"].applied, 0);
}

#[tokio::test]
async fn permanent_answers_422_and_applies_nothing() {
    let permanent = Knobs {
        permanent: true,
        ..Knobs::default()
    };
    let sim = start(knobs("/payments/charge", permanent)).await;
    let response = sim.call("/payments/charge", Some("o-1:charge")).await;
    assert_eq!(response.status(), 422);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["ok"], false);
    assert!(body["error"].is_string());

    let stats = sim.stats().await;
    assert_eq!(stats.total_applied, 0);
    assert_eq!(stats.endpoints["/payments/charge"].permanent, 1);
}

#[tokio::test]
async fn forced_status_and_retry_after() {
    let throttled = Knobs {
        status: Some(429),
        retry_after: Some(7),
        ..Knobs::default()
    };
    let timeout = Knobs {
        status: Some(408),
        retry_after: Some(7),
        ..Knobs::default()
    };
    let mut initial = knobs("/throttled", throttled);
    initial.insert("/timeout".into(), timeout);
    let sim = start(initial).await;

    let response = sim.call("/throttled", Some("k1")).await;
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["retry-after"], "7");
    let response = sim.call("/timeout", Some("k2")).await;
    assert_eq!(response.status(), 408);
    assert!(response.headers().get("retry-after").is_none());

    let stats = sim.stats().await;
    assert_eq!(stats.total_applied, 0);
    assert_eq!(stats.endpoints["/throttled"].transient, 1);
    assert_eq!(stats.endpoints["/timeout"].transient, 1);
}

#[tokio::test]
async fn malformed_calls_answer_400() {
    let sim = start(HashMap::new()).await;
    let response = sim.call("/payments/charge", None).await;
    assert_eq!(response.status(), 400);

    let response = sim
        .client
        .post(format!("{}/payments/charge", sim.base))
        .header("Idempotency-Key", "o-1:charge")
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);

    let stats = sim.stats().await;
    assert_eq!(stats.total_calls, 2);
    assert_eq!(stats.total_applied, 0);
    assert_eq!(stats.endpoints["/payments/charge"].permanent, 2);
}

#[tokio::test]
async fn key_reused_on_other_endpoint_answers_422() {
    let sim = start(HashMap::new()).await;
    assert_eq!(sim.call("/a", Some("k")).await.status(), 200);
    assert_eq!(sim.call("/b", Some("k")).await.status(), 422);
    assert_eq!(sim.stats().await.total_applied, 1);
}

#[tokio::test]
async fn stats_reset_clears_counters_and_dedup_store() {
    let sim = start(HashMap::new()).await;
    let first: Value = sim.call("/x", Some("k")).await.json().await.unwrap();
    assert_eq!(sim.stats().await.total_applied, 1);

    let response = sim
        .client
        .delete(format!("{}/stats", sim.base))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);
    assert_eq!(sim.stats().await, Stats::default());

    // The dedup store is gone too: the same key applies again.
    let response = sim.call("/x", Some("k")).await;
    assert!(response.headers().get("idempotent-replayed").is_none());
    let second: Value = response.json().await.unwrap();
    assert_ne!(first["effect_id"], second["effect_id"]);
    assert_eq!(sim.stats().await.keys["k"].applied, 1);
}

#[tokio::test]
async fn non_idempotent_endpoint_applies_every_call() {
    let double = Knobs {
        idempotent: false,
        ..Knobs::default()
    };
    let sim = start(knobs("/payments/charge", double)).await;
    let first: Value = sim
        .call("/payments/charge", Some("o-1:charge"))
        .await
        .json()
        .await
        .unwrap();
    let second = sim.call("/payments/charge", Some("o-1:charge")).await;
    assert!(second.headers().get("idempotent-replayed").is_none());
    let second: Value = second.json().await.unwrap();
    assert_ne!(first["effect_id"], second["effect_id"]);

    let stats = sim.stats().await;
    assert_eq!(stats.total_applied, 2);
    assert_eq!(stats.keys["o-1:charge"].applied, 2);
}

#[tokio::test]
async fn knobs_put_get_delete() {
    let sim = start(HashMap::new()).await;
    let response = sim
        .put_knobs("/payments/charge", r#"{"fail_first":1,"retry_after":2}"#)
        .await;
    assert_eq!(response.status(), 204);

    let all: HashMap<String, Knobs> = sim
        .client
        .get(format!("{}/_sim/knobs", sim.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all["/payments/charge"].fail_first, 1);
    assert_eq!(all["/payments/charge"].retry_after, Some(2));
    assert!(all["/payments/charge"].idempotent);

    let one: Knobs = sim
        .client
        .get(format!("{}/_sim/knobs/payments/charge", sim.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(one, all["/payments/charge"]);

    // The knobs take effect.
    let response = sim.call("/payments/charge", Some("o-1:charge")).await;
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["retry-after"], "2");
    assert_eq!(
        sim.call("/payments/charge", Some("o-1:charge"))
            .await
            .status(),
        200
    );

    // Invalid knobs are refused.
    assert_eq!(
        sim.put_knobs("/x", r#"{"fail_frist":1}"#).await.status(),
        400
    );
    assert_eq!(
        sim.put_knobs("/x", r#"{"transient_rate":2}"#)
            .await
            .status(),
        400
    );
    assert_eq!(sim.put_knobs("/x", "nope").await.status(), 400);

    let response = sim
        .client
        .delete(format!("{}/_sim/knobs", sim.base))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);
    assert!(sim.state.all_knobs().is_empty());
}

#[tokio::test]
async fn hang_first_hangs_then_applies() {
    let hanging = Knobs {
        hang_first: 1,
        hang_ms: 50,
        ..Knobs::default()
    };
    let sim = start(knobs("/shipping/ship", hanging)).await;
    let started = Instant::now();
    let response = sim.call("/shipping/ship", Some("o-1:ship")).await;
    assert_eq!(response.status(), 504);
    assert!(started.elapsed() >= Duration::from_millis(50));
    assert_eq!(
        sim.call("/shipping/ship", Some("o-1:ship")).await.status(),
        200
    );

    let stats = sim.stats().await;
    assert_eq!(stats.endpoints["/shipping/ship"].hung, 1);
    assert_eq!(stats.keys["o-1:ship"].applied, 1);
}

#[tokio::test]
async fn client_timeout_on_hang_applies_nothing() {
    let hanging = Knobs {
        hang_first: 1,
        ..Knobs::default()
    };
    let sim = start(knobs("/shipping/ship", hanging)).await;
    let result = sim
        .client
        .post(format!("{}/shipping/ship", sim.base))
        .header("Idempotency-Key", "o-1:ship")
        .json(&json!({}))
        .timeout(Duration::from_millis(100))
        .send()
        .await;
    assert!(result.unwrap_err().is_timeout());
    let stats = sim.stats().await;
    assert_eq!(stats.total_applied, 0);
    assert_eq!(stats.endpoints["/shipping/ship"].hung, 1);

    // The retry is not blocked by the abandoned hanging call.
    assert_eq!(
        sim.call("/shipping/ship", Some("o-1:ship")).await.status(),
        200
    );
    assert_eq!(sim.stats().await.keys["o-1:ship"].applied, 1);
}

#[tokio::test]
async fn shutdown_wakes_hanging_calls() {
    let hanging = Knobs {
        hang: true,
        ..Knobs::default()
    };
    let state = Arc::new(RemoteSim::new(knobs("/slow", hanging)).unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(remote_sim::serve_with(listener, state, async move {
        let _ = stopped.await;
    }));

    remote_sim::install_crypto_provider();
    let call = tokio::spawn(async move {
        reqwest::Client::new()
            .post(format!("http://{addr}/slow"))
            .header("Idempotency-Key", "k")
            .json(&json!({}))
            .send()
            .await
            .unwrap()
            .status()
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.send(()).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("hanging call woken")
        .unwrap();
    assert_eq!(status, 503);
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("server stopped")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn transient_rate_one_always_fails() {
    let flaky = Knobs {
        transient_rate: 1.0,
        ..Knobs::default()
    };
    let sim = start(knobs("/flaky", flaky)).await;
    for _ in 0..3 {
        assert_eq!(sim.call("/flaky", Some("k")).await.status(), 503);
    }
    assert_eq!(sim.stats().await.endpoints["/flaky"].transient, 3);
}

#[tokio::test]
async fn permanent_rate_fails_calls_but_never_an_applied_key() {
    let sim = start(HashMap::new()).await;
    // Applied while healthy ...
    assert_eq!(sim.call("/p", Some("applied")).await.status(), 200);
    let always = r#"{"permanent_rate":1}"#;
    assert_eq!(sim.put_knobs("/p", always).await.status(), 204);
    // ... it replays its answer; a new key fails permanently, every call.
    let replay = sim.call("/p", Some("applied")).await;
    assert_eq!(replay.status(), 200);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    for _ in 0..3 {
        let response = sim.call("/p", Some("new")).await;
        assert_eq!(response.status(), 422);
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["ok"], false);
    }
    let stats = sim.stats().await;
    assert_eq!(stats.endpoints["/p"].permanent, 3);
    assert_eq!(stats.keys["new"].applied, 0);
    assert_eq!(stats.keys["applied"].applied, 1);

    // A rate in between is drawn per call.
    assert_eq!(
        sim.put_knobs("/p", r#"{"permanent_rate":0.5}"#)
            .await
            .status(),
        204
    );
    let mut failed = 0;
    for i in 0..200 {
        if sim.call("/p", Some(&format!("k{i}"))).await.status() == 422 {
            failed += 1;
        }
    }
    assert!((40..=160).contains(&failed), "{failed} of 200 failed");
    assert_eq!(
        sim.put_knobs("/p", r#"{"permanent_rate":1.5}"#)
            .await
            .status(),
        400
    );
}

#[tokio::test]
async fn control_paths_and_limits() {
    let sim = start(HashMap::new()).await;
    let health = sim
        .client
        .get(format!("{}/healthz", sim.base))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    assert_eq!(health.text().await.unwrap(), "ok");

    let get = sim
        .client
        .get(format!("{}/payments/charge", sim.base))
        .send()
        .await
        .unwrap();
    assert_eq!(get.status(), 405);
    assert_eq!(sim.call("/_sim/other", Some("k")).await.status(), 404);

    let too_big = sim
        .client
        .post(format!("{}/payments/charge", sim.base))
        .header("Idempotency-Key", "k")
        .body(vec![b' '; remote_sim::BODY_LIMIT + 1])
        .send()
        .await
        .unwrap();
    assert_eq!(too_big.status(), 413);
    assert_eq!(sim.stats().await.total_calls, 0);
}

#[tokio::test]
async fn a_long_operation_is_accepted_with_a_location_that_answers_once_it_is_done() {
    let sim = start(knobs(
        "/report",
        Knobs {
            long_ms: 300,
            retry_after: Some(1),
            ..Knobs::default()
        },
    ))
    .await;
    let accepted = sim.call("/report", Some("k-long")).await;
    assert_eq!(accepted.status(), 202);
    assert_eq!(accepted.headers()["retry-after"], "1");
    let location = accepted.headers()["location"].to_str().unwrap().to_owned();
    let poll = || async {
        sim.client
            .get(format!("{}{location}", sim.base))
            .header("Idempotency-Key", "k-long")
            .send()
            .await
            .unwrap()
    };
    assert_eq!(poll().await.status(), 202, "still running");
    let deadline = Instant::now() + Duration::from_secs(5);
    let done = loop {
        let answer = poll().await;
        if answer.status() != 202 || Instant::now() > deadline {
            break answer;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(done.status(), 200);
    let result: Value = done.json().await.unwrap();
    assert_eq!(result["idempotency_key"], "k-long");
    let stats = sim.stats().await;
    assert_eq!(stats.keys["k-long"].applied, 1);
    assert!(stats.endpoints["/report"].polls >= 2);
    let unknown = sim
        .client
        .get(format!("{}/report/jobs/nope", sim.base))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
}

#[tokio::test]
async fn outcome_header_is_recorded_and_the_undo_clears_the_effect() {
    let sim = start(HashMap::new()).await;
    assert_eq!(
        sim.call("/payments/charge", Some("o-1:charge"))
            .await
            .status(),
        200
    );
    let send = |outcome: reqwest::header::HeaderValue| {
        sim.client
            .post(format!("{}/payments/refund", sim.base))
            .header("Idempotency-Key", "o-1:charge:compensate")
            .header(remote_sim::SAS_OUTCOME, outcome)
            .json(&json!({"order_id": "o-1", "step": "charge"}))
            .send()
    };
    let odd = [
        reqwest::header::HeaderValue::from_static("unknown"),
        reqwest::header::HeaderValue::from_bytes(b"caf\xe9").unwrap(),
        reqwest::header::HeaderValue::from_str(&"z".repeat(100)).unwrap(),
    ];
    for outcome in odd {
        assert_eq!(send(outcome).await.unwrap().status(), 200);
    }
    let stats = sim.stats().await;
    let undo = &stats.keys["o-1:charge:compensate"];
    assert_eq!(undo.outcomes[0], "unknown");
    assert_eq!(undo.outcomes[1], "caf\u{fffd}");
    assert_eq!(undo.outcomes[2], "z".repeat(remote_sim::OUTCOME_LIMIT));
    assert!(stats.keys["o-1:charge"].undone && !stats.keys["o-1:charge"].standing);
    assert!(stats.standing.is_empty());
}

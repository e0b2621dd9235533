//! Verified TLS to Postgres, RabbitMQ and HTTPS remotes (contract §1a), on
//! real servers of each test's own: a Postgres instance with `ssl = on`,
//! stunnel in front of the machine's RabbitMQ, remote-sim over HTTPS, each
//! with a certificate of a test CA made at test time. Each test also checks
//! that a password in a connection URL never shows in what a failure prints.
//!
//! Every server here has its own port and directory, so these tests run
//! beside the others.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sas::broker::Broker;
use sas::config::{BrokerSettings, DatabaseSettings};
use sas::state_store::StateStore;
use sas_tests::TestApp;
use sas_tests::cli::{bare_sasctl, output};
use sas_tests::tls::{Stunnel, TestCa, TlsPostgres};

fn database(url: String, ca_file: Option<&Path>) -> DatabaseSettings {
    DatabaseSettings {
        url,
        ca_file: ca_file.map(Path::to_path_buf),
        // Long, so that a failure within a few seconds shows there was no retry.
        connect_timeout: Duration::from_secs(20),
        ..Default::default()
    }
}

/// Runs service `name` with `env` (and the machine's Postgres and RabbitMQ
/// otherwise), expects it to fail start-up within 10 s with exit code 1,
/// and returns its last line on stderr, checked to be `<name>: …`.
async fn service_failure(name: &str, env: &[(&str, &str)]) -> String {
    let mut cmd = std::process::Command::new(sas_tests::bin(name));
    cmd.env_remove("SAS_CONFIG")
        .env("SAS__HTTP__PORT", "0")
        .env("SAS__DATABASE__CONNECT_TIMEOUT", "20s")
        .env("SAS__BROKER__CONNECT_TIMEOUT", "20s")
        .envs(env.iter().copied());
    let started = Instant::now();
    let out = output(cmd).await.expect_code(1);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "retried: {out:#?}"
    );
    let last = out
        .stderr
        .trim()
        .lines()
        .last()
        .unwrap_or_default()
        .to_owned();
    assert!(last.starts_with(&format!("{name}: ")), "{out:#?}");
    last
}

/// Whether the store's connections are encrypted, as Postgres sees them.
async fn encrypted(store: &StateStore) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(store.pool())
        .await
        .expect("pg_stat_ssl")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_is_reached_over_verified_tls_and_never_in_plaintext_when_verify_full_is_asked() {
    let ca = TestCa::new("pg");
    let other = TestCa::new("pg-other");
    let pg = tokio::task::block_in_place(|| TlsPostgres::start(&ca));
    let verify = |root: &Path| format!("sslmode=verify-full&sslrootcert={}", root.display());

    // The URL's own parameters: the database is created and migrated over TLS.
    let store = StateStore::connect(&database(pg.url("sas_tls", &verify(&ca.ca)), None), "tls")
        .await
        .expect("verify-full with the right CA connects");
    assert!(encrypted(&store).await, "the connection is not encrypted");
    store.close().await;

    // database.ca_file with a URL that names no sslmode: verify-full.
    let store = StateStore::connect(&database(pg.url("sas_tls", ""), Some(&ca.ca)), "tls")
        .await
        .expect("database.ca_file connects");
    assert!(encrypted(&store).await, "the connection is not encrypted");
    store.close().await;

    // A CA that did not sign the server's certificate: refused at once.
    for settings in [
        database(pg.url("sas_tls", &verify(&other.ca)), None),
        database(pg.url("sas_tls", ""), Some(&other.ca)),
    ] {
        let started = Instant::now();
        let err = StateStore::connect(&settings, "tls")
            .await
            .expect_err("a wrong CA must not connect")
            .to_string();
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "retried: {err}"
        );
        assert!(err.contains("TLS to Postgres failed"), "{err}");
        assert!(!err.contains('\n'), "{err}");
        assert!(!err.contains(&pg.password), "{err}");
    }

    // The same from a binary: one line, exit 1, and never the password,
    // neither for a wrong CA nor for a wrong password.
    let wrong_password = format!("wrong-{}", uuid::Uuid::new_v4().simple());
    let right = pg.url("sas_tls", &verify(&ca.ca));
    for (url, expect) in [
        (
            pg.url("sas_tls", &verify(&other.ca)),
            "TLS to Postgres failed",
        ),
        (
            right.replace(&pg.password, &wrong_password),
            "password authentication failed",
        ),
    ] {
        let mut cmd = bare_sasctl(&["migrate"]);
        cmd.env("SAS__DATABASE__URL", &url);
        let out = output(cmd).await.expect_code(1);
        assert_eq!(out.stderr.lines().count(), 1, "{out:#?}");
        assert!(
            out.stderr.starts_with("sasctl: ") && out.stderr.contains(expect),
            "{out:#?}"
        );
        for secret in [&pg.password, &wrong_password] {
            assert!(
                !out.stderr.contains(secret.as_str()),
                "password shown: {out:#?}"
            );
        }
    }
    let mut cmd = bare_sasctl(&["migrate"]);
    cmd.env("SAS__DATABASE__URL", &right);
    output(cmd).await.expect_code(0);
    // A service (the supervisor reaches Postgres first) fails the same way.
    let line = service_failure(
        "supervisor",
        &[("SAS__DATABASE__URL", &pg.url("sas_tls", &verify(&other.ca)))],
    )
    .await;
    assert!(line.contains("TLS to Postgres failed"), "{line}");
    assert!(!line.contains(&pg.password), "{line}");

    // A ca_file with a URL that asks for less than verification is refused.
    let mut cmd = bare_sasctl(&["migrate"]);
    cmd.env("SAS__DATABASE__URL", pg.url("sas_tls", "sslmode=prefer"))
        .env("SAS__DATABASE__CA_FILE", &ca.ca);
    let out = output(cmd).await.expect_code(2);
    assert!(out.stderr.contains("sslmode=prefer"), "{out:#?}");
    assert!(!out.stderr.contains(&pg.password), "{out:#?}");

    // A server without TLS: verify-full never falls back to plaintext,
    // although the same server takes a plaintext connection.
    pg.disable_tls();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pg.tls_on() {
        assert!(Instant::now() < deadline, "ssl = off not applied");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for settings in [
        database(pg.url("sas_tls", &verify(&ca.ca)), None),
        database(pg.url("sas_tls", ""), Some(&ca.ca)),
    ] {
        let err = StateStore::connect(&settings, "tls")
            .await
            .expect_err("verify-full must not connect in plaintext")
            .to_string();
        assert!(err.contains("does not support TLS"), "{err}");
    }
    let plain = StateStore::connect(&database(pg.url("sas_tls", "sslmode=disable"), None), "tls")
        .await
        .expect("the server takes plaintext");
    assert!(!encrypted(&plain).await);
    plain.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_go_through_amqps_with_a_client_certificate_and_a_wrong_ca_fails_at_once() {
    let ca = TestCa::new("amqp");
    let other = TestCa::new("amqp-other");
    // stunnel asks for a client certificate signed by the same test CA.
    let tunnel = tokio::task::block_in_place(|| Stunnel::start(&ca, Some(&ca.ca)));
    let url = format!("amqps://guest:guest@localhost:{}/%2f", tunnel.port);
    let path = |p: &PathBuf| p.display().to_string();
    let (ca_file, cert, key) = (path(&ca.ca), path(&ca.cert), path(&ca.key));
    let env = [
        ("SAS__BROKER__URL", url.as_str()),
        ("SAS__BROKER__CA_FILE", ca_file.as_str()),
        ("SAS__BROKER__CLIENT_CERT", cert.as_str()),
        ("SAS__BROKER__CLIENT_KEY", key.as_str()),
    ];

    // Every service on amqps://: an order goes through end to end.
    let app = TestApp::new().await;
    for name in ["submission", "scheduler", "agent", "supervisor"] {
        app.start_with_env(name, name, &[], &env).await;
    }
    let (_, events) = app.run_one("one").await;
    assert_eq!(
        events.last().expect("events")["state"],
        "processed",
        "{events:?}\n{}",
        tunnel.log()
    );

    // A CA that did not sign the broker's certificate: refused at once.
    let settings = BrokerSettings {
        url: url.clone(),
        prefix: app.prefix.clone(),
        ca_file: Some(other.ca.clone()),
        client_cert: Some(ca.cert.clone()),
        client_key: Some(ca.key.clone()),
        connect_timeout: Duration::from_secs(20),
        ..Default::default()
    };
    let started = Instant::now();
    let err = Broker::connect(&settings, "tls")
        .await
        .err()
        .expect("a wrong CA must not connect")
        .to_string();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "retried: {err}"
    );
    assert!(err.contains("TLS to RabbitMQ failed"), "{err}");

    // From a binary: one line, exit 1; a wrong password is never shown.
    let secret = format!("wrong-{}", uuid::Uuid::new_v4().simple());
    let bad_password = url.replace("guest:guest", &format!("guest:{secret}"));
    for (broker_url, ca_file, expect) in [
        (url.as_str(), path(&other.ca), "TLS to RabbitMQ failed"),
        (
            bad_password.as_str(),
            path(&ca.ca),
            "could not reach RabbitMQ",
        ),
    ] {
        let mut cmd = bare_sasctl(&["submit", "--workflow", "one"]);
        cmd.env("SAS__BROKER__URL", broker_url)
            .env("SAS__BROKER__CA_FILE", ca_file)
            .env("SAS__BROKER__CLIENT_CERT", &cert)
            .env("SAS__BROKER__CLIENT_KEY", &key);
        let out = output(cmd).await.expect_code(1);
        assert_eq!(out.stderr.lines().count(), 1, "{out:#?}");
        assert!(out.stderr.contains(expect), "{out:#?}");
        assert!(!out.stderr.contains(&secret), "password shown: {out:#?}");
    }

    // A service fails the same way.
    let other_ca = path(&other.ca);
    let line = service_failure(
        "supervisor",
        &[
            // The test's own database: nothing touches the default one.
            ("SAS__DATABASE__URL", app.db_url.as_str()),
            ("SAS__BROKER__URL", bad_password.as_str()),
            ("SAS__BROKER__CA_FILE", other_ca.as_str()),
        ],
    )
    .await;
    assert!(line.contains("TLS to RabbitMQ failed"), "{line}");
    assert!(!line.contains(&secret), "{line}");

    // TLS files with a plaintext URL: refused by the configuration.
    let mut cmd = bare_sasctl(&["submit", "--workflow", "one"]);
    cmd.env("SAS__BROKER__URL", sas_tests::amqp())
        .env("SAS__BROKER__CA_FILE", &ca_file);
    let out = output(cmd).await.expect_code(2);
    assert!(out.stderr.contains("plaintext"), "{out:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_completes_a_step_on_an_https_remote_it_trusts_and_not_on_one_it_does_not() {
    let ca = TestCa::new("https");
    let other = TestCa::new("https-other");
    let app = TestApp::new().await;
    // The test's remote-sim, served over HTTPS as well.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("address").port();
    let tls = remote_sim::tls_config(&ca.cert, &ca.key).expect("server TLS");
    tokio::spawn(remote_sim::serve_tls_with(
        listener,
        tls,
        app.sim.clone(),
        std::future::pending(),
    ));
    let https = format!("https://localhost:{port}/svc/a");
    for name in ["submission", "scheduler", "supervisor"] {
        app.start(name, name, &[]).await;
    }
    let agent = |ca_file: &Path| {
        [
            ("SAS__AGENTS__A__URL".to_owned(), https.clone()),
            (
                "SAS__AGENT__CA_FILE".to_owned(),
                ca_file.display().to_string(),
            ),
        ]
    };
    let env = agent(&ca.ca);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    app.start_with_env("agent", "agent", &[], &env).await;
    let (_, events) = app.run_one("one").await;
    assert_eq!(
        events.last().expect("events")["state"],
        "processed",
        "{events:?}\n{}",
        app.logs_tail()
    );

    // The same remote with a CA that did not sign its certificate: every
    // call fails (transient, a connection failure) and nothing is applied.
    app.kill("agent");
    let before = app.log("agent").len();
    let env = agent(&other.ca);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    app.start_with_env("agent", "agent", &[], &env).await;
    let status = app.status_queue("wrong-ca").await;
    let id = app.submit("one", Some(&status)).await;
    app.eventually(
        "the agent reports the untrusted certificate",
        Duration::from_secs(20),
        || async {
            let log = app.log("agent");
            let new = &log[before.min(log.len())..];
            new.contains("request failed") && new.contains("certificate")
        },
    )
    .await;
    let state = app.order(id).await.map(|(s, _)| s);
    assert_ne!(state.as_deref(), Some("processed"));
    let id = id.to_string();
    assert!(
        !app.stats().keys.keys().any(|k| k.starts_with(&id)),
        "a call reached the remote: {:?}",
        app.stats().keys
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_remote_sim_binary_serves_https_with_the_certificate_it_is_given() {
    use std::io::BufRead;
    let ca = TestCa::new("sim");
    let mut child = std::process::Command::new(sas_tests::bin("remote-sim"))
        .args(["--port", "0", "--tls-cert"])
        .arg(&ca.cert)
        .arg("--tls-key")
        .arg(&ca.key)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start remote-sim (run `cargo build --workspace` first)");
    let stdout = child.stdout.take().expect("stdout");
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .map(|_| line)
    })
    .await
    .expect("join")
    .expect("first line");
    let addr: std::net::SocketAddr = line
        .trim()
        .strip_prefix("remote-sim listening on ")
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    sas::tls::install_crypto_provider();
    let pem = std::fs::read(&ca.ca).expect("CA file");
    let client = reqwest::Client::builder()
        .tls_certs_merge(reqwest::Certificate::from_pem_bundle(&pem).expect("CA"))
        .build()
        .expect("client");
    let url = format!("https://localhost:{}/healthz", addr.port());
    let answer = client.get(&url).send().await;
    // A client that does not trust the test CA is refused.
    let untrusted = reqwest::Client::new().get(&url).send().await;
    child.kill().ok();
    child.wait().ok();
    let answer = answer.expect("HTTPS with the right CA");
    assert_eq!(answer.status(), 200);
    assert!(untrusted.is_err(), "{untrusted:?}");
}

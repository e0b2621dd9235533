//! What a stranger sends the dashboard, and what a service prints of its
//! configuration when it cannot start, against the real binaries: one
//! `Host` per request, login throttling per client and in all, `Secure`
//! cookies over HTTPS, and no secret in a start-up error whatever the
//! shape of the URL that holds it.

use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sas_tests::TestApp;
use sas_tests::dashboard::{OPERATOR_TOKEN, token_auth};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An HTTP client that shows redirects instead of following them, its
/// connections made from `local` (another loopback address is another
/// client to the dashboard).
fn client_from(local: &str) -> reqwest::Client {
    sas::tls::install_crypto_provider();
    let local: IpAddr = local.parse().expect("address");
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .local_address(local)
        .build()
        .expect("HTTP client")
}

/// A deployment whose dashboard runs in token mode with `[dashboard]` lines
/// `extra`; returns the app and the dashboard's base URL.
async fn dashboard(extra: &str) -> (TestApp, String) {
    let app = TestApp::builder()
        .extra_config(format!("{}{extra}\n", token_auth()))
        .build()
        .await;
    app.start("dashboard", "dashboard", &[]).await;
    let base = format!("http://127.0.0.1:{}", app.port("dashboard"));
    (app, base)
}

/// The login form posted with `token` from `http`, as a browser on `origin`
/// posts it.
async fn login(http: &reqwest::Client, base: &str, token: &str) -> reqwest::Response {
    http.post(format!("{base}/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .header("origin", base)
        .body(format!("token={token}"))
        .send()
        .await
        .expect("the dashboard answers")
}

/// `request` written as is to the dashboard's port; returns what came back
/// until the server closed the connection (or 5 s passed).
async fn raw(port: u16, request: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the dashboard");
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    let mut answer = Vec::new();
    // Bounded: a server that keeps the connection open still has answered.
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_two_host_headers_or_a_host_that_does_not_parse_is_answered_400_and_nothing_else_happens()
 {
    let (app, _) = dashboard("").await;
    let port = app.port("dashboard");
    let host = format!("127.0.0.1:{port}");
    let form = format!("token={OPERATOR_TOKEN}");
    let login = |hosts: &[&str]| {
        let mut request = String::from("POST /login HTTP/1.1\r\n");
        for h in hosts {
            request.push_str(&format!("Host: {h}\r\n"));
        }
        request.push_str(&format!(
            "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{form}",
            form.len()
        ));
        request
    };
    // The same request with one Host logs in: what the refused ones would do.
    let once = raw(port, &login(&[&host])).await;
    assert!(once.starts_with("HTTP/1.1 303"), "{once}");
    assert!(
        once.to_ascii_lowercase()
            .contains("set-cookie: sas_session="),
        "{once}"
    );
    for hosts in [
        vec![host.as_str(), host.as_str()],
        vec![host.as_str(), "evil.example"],
        vec!["evil.example", host.as_str()],
        vec!["127.0.0.1:9105, evil.example"],
        vec!["user@127.0.0.1"],
        vec![],
    ] {
        let answer = raw(port, &login(&hosts)).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{hosts:?}: {answer}");
        assert!(
            !answer.to_ascii_lowercase().contains("set-cookie"),
            "{hosts:?}: a session was opened: {answer}"
        );
    }
    for path in ["/", "/api/me", "/assets/common.js", "/no-such-page"] {
        let answer = raw(
            port,
            &format!(
                "GET {path} HTTP/1.1\r\nHost: {host}\r\nHost: {host}\r\nConnection: close\r\n\r\n"
            ),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{path}: {answer}");
    }
    // A target in absolute form names the host it is for: it must be `Host`.
    let answer = raw(
        port,
        &format!(
            "GET http://evil.example/api/me HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        ),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    let log = app.log("dashboard");
    assert_eq!(
        log.matches("dashboard: logged in").count(),
        1,
        "only the one good request logged in:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_logins_past_the_limit_are_answered_429_for_that_client_until_the_window_lets_it_in()
{
    let (_app, base) = dashboard(
        "login_failures_per_client = 3\nlogin_failures_total = 1000\nlogin_failure_window = \"6s\"",
    )
    .await;
    let eve = client_from("127.0.0.1");
    for i in 0..3 {
        let response = login(&eve, &base, "not-the-token-not-the-token").await;
        assert_eq!(response.status().as_u16(), 401, "failure {i}");
    }
    let throttled = login(&eve, &base, "not-the-token-not-the-token").await;
    assert_eq!(throttled.status().as_u16(), 429);
    let retry_after: u64 = throttled.headers()["retry-after"]
        .to_str()
        .expect("text")
        .parse()
        .expect("seconds");
    // One attempt more every 6 s / 3.
    assert!((1..=2).contains(&retry_after), "{retry_after}");
    // Right or wrong, the throttled client's secret is not looked at: a
    // bearer token on the API is refused the same way.
    let right = login(&eve, &base, OPERATOR_TOKEN).await;
    assert_eq!(
        right.status().as_u16(),
        429,
        "a right token while throttled"
    );
    assert!(right.headers().get("set-cookie").is_none());
    let api = eve
        .get(format!("{base}/api/me"))
        .bearer_auth(OPERATOR_TOKEN)
        .send()
        .await
        .expect("answer");
    assert_eq!(api.status().as_u16(), 429);
    assert!(api.headers().contains_key("retry-after"));

    // Another client is not refused for eve's failures.
    let alice = client_from("127.0.0.2");
    let response = login(&alice, &base, OPERATOR_TOKEN).await;
    assert_eq!(response.status().as_u16(), 303, "another client logs in");

    // Once the window has let one more attempt through, the right token works.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let response = login(&eve, &base, OPERATOR_TOKEN).await;
        match response.status().as_u16() {
            303 => break,
            429 => assert!(
                Instant::now() < deadline,
                "still throttled 15 s after a 6 s window"
            ),
            other => panic!("unexpected {other}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A burst sent all at once gets no more verdicts than the limit allows.
    let burst = futures_util::future::join_all(
        (0..50).map(|_| login(&eve, &base, "not-the-token-not-the-token")),
    )
    .await;
    let judged = burst.iter().filter(|r| r.status().as_u16() == 401).count();
    let refused = burst.iter().filter(|r| r.status().as_u16() == 429).count();
    assert!(judged <= 3, "{judged} wrong tokens judged in one burst");
    assert_eq!(judged + refused, 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_total_limit_bounds_failures_from_every_client_together() {
    let (_app, base) = dashboard(
        "login_failures_per_client = 100\nlogin_failures_total = 4\nlogin_failure_window = \"1m\"",
    )
    .await;
    for (i, from) in ["127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6"]
        .iter()
        .enumerate()
    {
        let response = login(&client_from(from), &base, "not-the-token-not-the-token").await;
        assert_eq!(response.status().as_u16(), 401, "failure {i}");
    }
    let response = login(&client_from("127.0.0.7"), &base, OPERATOR_TOKEN).await;
    assert_eq!(response.status().as_u16(), 429, "past the total limit");
    assert!(response.headers().contains_key("retry-after"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_cookie_is_secure_when_the_login_came_over_https() {
    let (_app, base) = dashboard("trusted_proxies = [\"127.0.0.1\"]").await;
    let http = client_from("127.0.0.1");
    let cookie = |response: &reqwest::Response| {
        response.headers()["set-cookie"]
            .to_str()
            .expect("text")
            .to_owned()
    };
    let form = format!("token={OPERATOR_TOKEN}");
    let post = |origin: Option<String>, proto: Option<&str>| {
        let mut request = http
            .post(format!("{base}/login"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form.clone());
        if let Some(origin) = origin {
            request = request.header("origin", origin);
        }
        if let Some(proto) = proto {
            request = request.header("x-forwarded-proto", proto);
        }
        request.send()
    };
    // A browser on https:// (through a TLS-terminating proxy that passes
    // Host through) says so in Origin.
    let https_origin = base.replacen("http://", "https://", 1);
    let response = post(Some(https_origin), None).await.expect("answer");
    assert_eq!(response.status().as_u16(), 303);
    let secure = cookie(&response);
    assert!(
        secure.contains("HttpOnly") && secure.contains("SameSite=Strict"),
        "{secure}"
    );
    assert!(secure.ends_with("; Secure"), "{secure}");
    // A trusted proxy says so in X-Forwarded-Proto.
    let response = post(None, Some("https")).await.expect("answer");
    assert!(
        cookie(&response).ends_with("; Secure"),
        "{}",
        cookie(&response)
    );
    // Plain HTTP: not Secure, or the browser would never send it back.
    let response = post(Some(base.clone()), None).await.expect("answer");
    assert!(
        !cookie(&response).contains("Secure"),
        "{}",
        cookie(&response)
    );
}

/// Runs `binary` with the deployment's configuration and `env`; returns
/// its exit status and everything it wrote to stderr, within 25 s.
fn start_up_failure(app: &TestApp, binary: &str, env: &[(&str, &str)]) -> (bool, String) {
    let mut child = Command::new(sas_tests::bin(binary))
        .env("SAS_CONFIG", &app.config)
        .env("SAS__HTTP__PORT", "0")
        .env("RUST_LOG", "info")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the binary");
    let deadline = Instant::now() + Duration::from_secs(25);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            child.kill().ok();
            panic!("{binary} with {env:?} did not exit within 25 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        std::io::Read::read_to_string(&mut pipe, &mut stderr).expect("read stderr");
    }
    (status.success(), stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_that_cannot_start_never_prints_a_secret_whatever_the_urls_shape() {
    let app = TestApp::new().await;
    // Every secret below contains `cr3t`.
    let broker = [
        "amqp:user:s3cr3t@127.0.0.1:1",
        "amqp:s3cr3t@127.0.0.1:1",
        "amqp://user:s3cr3t@127.0.0.1:1,amqp:user:s3cr3t@127.0.0.1:2",
        "amqp://user:s3/cr3t@127.0.0.1:1",
        "amqp://user:s3#cr3t@127.0.0.1:1",
    ];
    let database = [
        "postgres://u:s3/cr3t@127.0.0.1:5432/db",
        "host=127.0.0.1 password=s3cr3t dbname=db",
        "postgresql://u:s3cr3t@127.0.0.1:5432,,127.0.0.1:1/db",
    ];
    let cases = broker
        .iter()
        .map(|url| ("scheduler", "SAS__BROKER__URL", *url))
        .chain(
            database
                .iter()
                .map(|url| ("dashboard", "SAS__DATABASE__URL", *url)),
        );
    for (binary, key, url) in cases {
        let (ok, stderr) =
            tokio::task::block_in_place(|| start_up_failure(&app, binary, &[(key, url)]));
        assert!(!ok, "{binary} started with {key}={url}");
        assert!(!stderr.trim().is_empty(), "{binary}: nothing said");
        assert!(
            !stderr.contains("cr3t"),
            "{binary} with {key}={url} printed the secret:\n{stderr}"
        );
    }
}

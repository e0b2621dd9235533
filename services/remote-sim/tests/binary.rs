//! Runs the `remote-sim` binary: port announcement on stdout, `--knobs`,
//! and graceful exit on SIGTERM.
#![cfg(unix)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Minimal HTTP/1.1 GET; returns the whole answer (status line, headers, body).
fn http_get(addr: &str, path: &str) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer
}

#[test]
fn announces_port_serves_knobs_and_exits_on_sigterm() {
    let knobs_file =
        std::env::temp_dir().join(format!("remote-sim-knobs-{}.json", std::process::id()));
    std::fs::write(&knobs_file, r#"{"/payments/charge":{"fail_first":3}}"#).unwrap();

    let mut child = Command::new(env!("CARGO_BIN_EXE_remote-sim"))
        .args(["--port", "0", "--host", "127.0.0.1", "--knobs"])
        .arg(&knobs_file)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let addr = line
        .trim_end()
        .strip_prefix("remote-sim listening on ")
        .unwrap_or_else(|| panic!("unexpected announcement {line:?}"))
        .to_owned();

    let health = http_get(&addr, "/healthz");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(health.ends_with("ok"), "{health}");
    let knobs = http_get(&addr, "/_sim/knobs");
    assert!(knobs.contains(r#""fail_first":3"#), "{knobs}");

    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = child.wait().unwrap();
    assert!(exit.success(), "exit status {exit:?}");
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    assert_eq!(rest, "", "only one line on stdout");
    let _ = std::fs::remove_file(knobs_file);
}

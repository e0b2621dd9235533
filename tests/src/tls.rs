//! Servers for the TLS tests, each on its own port and in its own directory,
//! removed when dropped: a test certificate authority made with the
//! `openssl` command, a Postgres instance of its own with `ssl = on`, and
//! `stunnel` in front of the tests' RabbitMQ ([`crate::amqp`]). Keys are made at test time
//! and never leave the test's temporary directory.

use std::path::{Path, PathBuf};

use crate::postgres::must;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use uuid::Uuid;

/// A fresh directory under the system's temporary directory.
pub fn temp_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sas-{what}-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    dir
}

/// A test certificate authority and a certificate it signed for
/// `localhost` and `127.0.0.1` (server and client use), as PEM files.
pub struct TestCa {
    pub dir: PathBuf,
    /// The CA's certificate: what a client trusts.
    pub ca: PathBuf,
    /// The signed certificate and its key.
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    /// Makes a CA and one certificate with `openssl` in a directory of its own.
    pub fn new(name: &str) -> Self {
        let dir = temp_dir(&format!("ca-{name}"));
        let file = |f: &str| dir.join(f);
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
        ];
        must(
            Command::new("openssl")
                .args(["req", "-x509", "-days", "2"])
                .args(ec)
                .args(["-subj", &format!("/CN=sas test CA {name}")])
                .args(["-addext", "basicConstraints=critical,CA:TRUE"])
                .args(["-addext", "keyUsage=critical,keyCertSign,cRLSign"])
                .arg("-keyout")
                .arg(file("ca.key"))
                .arg("-out")
                .arg(file("ca.pem")),
        );
        must(
            Command::new("openssl")
                .args(["req"])
                .args(ec)
                .args(["-subj", "/CN=localhost"])
                .arg("-keyout")
                .arg(file("cert.key"))
                .arg("-out")
                .arg(file("cert.csr")),
        );
        std::fs::write(
            file("ext.cnf"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature,keyEncipherment\n\
             extendedKeyUsage=serverAuth,clientAuth\n",
        )
        .expect("write ext.cnf");
        must(
            Command::new("openssl")
                .args(["x509", "-req", "-days", "2", "-set_serial", "2"])
                .arg("-in")
                .arg(file("cert.csr"))
                .arg("-CA")
                .arg(file("ca.pem"))
                .arg("-CAkey")
                .arg(file("ca.key"))
                .arg("-extfile")
                .arg(file("ext.cnf"))
                .arg("-out")
                .arg(file("cert.pem")),
        );
        Self {
            ca: file("ca.pem"),
            cert: file("cert.pem"),
            key: file("cert.key"),
            dir,
        }
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// A Postgres instance of the test's own with TLS on (the certificate of
/// a [`TestCa`]) and password authentication over TCP.
pub type TlsPostgres = crate::postgres::OwnPostgres;

/// `stunnel` listening with TLS on a free port of 127.0.0.1 and forwarding
/// to the tests' RabbitMQ ([`crate::amqp`]), presenting `ca`'s certificate; with
/// `client_ca`, it asks for a client certificate signed by it (`verify = 2`).
pub struct Stunnel {
    child: Child,
    dir: PathBuf,
    pub port: u16,
}

impl Stunnel {
    /// Starts stunnel and waits until its port accepts connections.
    pub fn start(ca: &TestCa, client_ca: Option<&Path>) -> Self {
        let dir = temp_dir("stunnel");
        let port = crate::free_port();
        let verify = client_ca.map_or(String::new(), |ca| {
            format!("CAfile = {}\nverify = 2\n", ca.display())
        });
        let conf = format!(
            "foreground = yes\npid =\noutput = {log}\n\n[amqps]\naccept = 127.0.0.1:{port}\n\
             connect = {upstream}\ncert = {cert}\nkey = {key}\n{verify}",
            log = dir.join("stunnel.log").display(),
            upstream = crate::amqp_address(),
            cert = ca.cert.display(),
            key = ca.key.display(),
        );
        std::fs::write(dir.join("stunnel.conf"), conf).expect("stunnel.conf");
        let child = Command::new("stunnel")
            .arg(dir.join("stunnel.conf"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start stunnel (apt-get install stunnel4)");
        let tunnel = Self { child, dir, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "stunnel not listening within 10s: {}",
                tunnel.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        tunnel
    }

    /// stunnel's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("stunnel.log")).unwrap_or_default()
    }
}

impl Drop for Stunnel {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

//! Servers for the TLS tests, each on its own port and in its own directory,
//! removed when dropped: a test certificate authority made with the
//! `openssl` command, a Postgres instance of its own with `ssl = on`, and
//! `stunnel` in front of the tests' RabbitMQ ([`crate::amqp`]). Keys are made at test time
//! and never leave the test's temporary directory.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use uuid::Uuid;

/// Postgres's server programs: `SAS_TEST_PG_BIN` (`scripts/servers.sh env`
/// sets it), else the newest of Debian's `/usr/lib/postgresql/<version>/bin`.
fn pg_bin() -> &'static Path {
    static BIN: std::sync::LazyLock<PathBuf> = std::sync::LazyLock::new(|| {
        if let Some(bin) = std::env::var_os("SAS_TEST_PG_BIN").filter(|b| !b.is_empty()) {
            return PathBuf::from(bin);
        }
        std::fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let version: u32 = e.file_name().to_str()?.parse().ok()?;
                Some((version, e.path().join("bin")))
            })
            .filter(|(_, bin)| bin.join("initdb").exists())
            .max()
            .map(|(_, bin)| bin)
            .expect("Postgres's server programs in /usr/lib/postgresql/<version>/bin (apt-get install postgresql), or SAS_TEST_PG_BIN")
    });
    &BIN
}

/// Runs a command and panics with its output when it fails.
fn must(cmd: &mut Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

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

/// A Postgres instance of the test's own, on a free port, with TLS on
/// (the certificate of `ca`) and password (SCRAM) authentication over TCP.
/// Stopped and deleted when dropped.
pub struct TlsPostgres {
    dir: PathBuf,
    data: PathBuf,
    pub port: u16,
    /// The password of user `postgres`.
    pub password: String,
}

impl TlsPostgres {
    /// `initdb`, configure, start, as user `postgres` (Postgres refuses root).
    pub fn start(ca: &TestCa) -> Self {
        let dir = temp_dir("tls-pg");
        let data = dir.join("data");
        let password = format!("pw-{}", Uuid::new_v4().simple());
        std::fs::write(dir.join("pwfile"), &password).expect("pwfile");
        must(
            Command::new("chown")
                .arg("-R")
                .arg("postgres:postgres")
                .arg(&dir),
        );
        must(
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(pg_bin().join("initdb"))
                .args([
                    "-A",
                    "scram-sha-256",
                    "--auth-local=trust",
                    "-U",
                    "postgres",
                ])
                .arg(format!("--pwfile={}", dir.join("pwfile").display()))
                .arg("-D")
                .arg(&data),
        );
        for (from, to) in [(&ca.cert, "server.pem"), (&ca.key, "server.key")] {
            std::fs::copy(from, data.join(to)).expect("copy certificate");
        }
        must(
            Command::new("chown")
                .arg("postgres:postgres")
                .arg(data.join("server.pem"))
                .arg(data.join("server.key")),
        );
        must(
            Command::new("chmod")
                .arg("600")
                .arg(data.join("server.key")),
        );
        let port = crate::free_port();
        let conf = format!(
            "\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
             ssl = on\nssl_cert_file = 'server.pem'\nssl_key_file = 'server.key'\n\
             max_connections = 40\nshared_buffers = 16MB\nfsync = off\n",
            dir.display()
        );
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .expect("postgresql.conf");
        std::io::Write::write_all(&mut file, conf.as_bytes()).expect("write postgresql.conf");
        let pg = Self {
            dir,
            data,
            port,
            password,
        };
        pg.pg_ctl(&["-w", "-t", "30", "start"]);
        pg
    }

    fn pg_ctl(&self, args: &[&str]) {
        must(
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(pg_bin().join("pg_ctl"))
                .arg("-D")
                .arg(&self.data)
                .arg("-l")
                .arg(self.dir.join("server.log"))
                .args(args)
                .stdout(Stdio::null()),
        );
    }

    /// A URL for `database` with the right password and `query` (if any).
    pub fn url(&self, database: &str, query: &str) -> String {
        let query = if query.is_empty() {
            String::new()
        } else {
            format!("?{query}")
        };
        format!(
            "postgres://postgres:{}@localhost:{}/{database}{query}",
            self.password, self.port
        )
    }

    /// Turns TLS off (a reload is enough since Postgres 10), so that the
    /// server answers `N` to a client's TLS request.
    pub fn disable_tls(&self) {
        let conf = self.data.join("postgresql.auto.conf");
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(conf)
            .expect("postgresql.auto.conf");
        std::io::Write::write_all(&mut file, b"ssl = off\n").expect("write");
        self.pg_ctl(&["reload"]);
    }

    /// Whether the server accepts TLS now (`SHOW ssl`, over the socket).
    pub fn tls_on(&self) -> bool {
        let out = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(pg_bin().join("psql"))
            .args(["-Atq", "-h"])
            .arg(&self.dir)
            .args(["-p", &self.port.to_string(), "-c", "SHOW ssl", "postgres"])
            .output()
            .expect("psql");
        String::from_utf8_lossy(&out.stdout).trim() == "on"
    }
}

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(pg_bin().join("pg_ctl"))
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .ok();
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

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

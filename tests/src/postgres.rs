//! A Postgres server of a test's own, on its own port and in its own
//! directory, removed when dropped: for a test that needs settings of its
//! own (TLS, [`crate::tls`]) or a server no other test writes to (counts
//! that Postgres keeps for the whole server).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use uuid::Uuid;

use crate::tls::{TestCa, temp_dir};

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
pub(crate) fn must(cmd: &mut Command) {
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

/// A Postgres instance of the test's own, on a free port, with password
/// (SCRAM) authentication over TCP, and TLS on when started with a
/// certificate authority. Stopped and deleted when dropped.
pub struct OwnPostgres {
    dir: PathBuf,
    data: PathBuf,
    pub port: u16,
    /// The password of user `postgres`.
    pub password: String,
}

impl OwnPostgres {
    /// With TLS on (the certificate of `ca`), its disk writes not synced
    /// (`fsync = off`: a test's server loses nothing it needs).
    pub fn start(ca: &TestCa) -> Self {
        Self::start_with(Some(ca), "fsync = off\n")
    }

    /// `initdb`, configure (TLS with `ca`, then `settings`, lines of
    /// `postgresql.conf`), start, as user `postgres` (Postgres refuses root).
    pub fn start_with(ca: Option<&TestCa>, settings: &str) -> Self {
        let dir = temp_dir("own-pg");
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
        if let Some(ca) = ca {
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
        }
        let port = crate::free_port();
        let tls = if ca.is_some() {
            "ssl = on\nssl_cert_file = 'server.pem'\nssl_key_file = 'server.key'\n"
        } else {
            ""
        };
        let conf = format!(
            "\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
             {tls}max_connections = 40\nshared_buffers = 16MB\n{settings}",
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

impl Drop for OwnPostgres {
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

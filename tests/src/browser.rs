//! A real headless Chromium for the dashboard's tests, driven through
//! `chromedriver` with [`fantoccini`] (a maintained W3C WebDriver client).
//!
//! [`Browser::start`] starts `chromedriver` (Debian's `chromium-driver`) on a
//! free port with a fresh profile directory and opens a session; a
//! [`Browser`] is a [`fantoccini::Client`] (it dereferences to one), so tests
//! use fantoccini's API (`goto`, `find(Locator::Css(…))`, `execute`,
//! `screenshot`, …) plus [`Browser::text_of`]. Dropping it kills the driver's
//! process group (the browser with it) and deletes the profile. A missing
//! `chromedriver` is an error, never a skip: the dashboard tests must run in
//! CI (`scripts/test.sh` installs it).
//!
//! fantoccini is built without TLS (`default-features = false`): it talks
//! plain HTTP to a chromedriver on 127.0.0.1, so no OpenSSL, aws-lc or
//! second rustls provider comes in.

use std::ops::Deref;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use fantoccini::error::CmdError;
use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Value, json};

/// Where Debian's packages put them; `CHROMEDRIVER` and `CHROMIUM` override.
const DEFAULT_CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const DEFAULT_CHROMIUM: &str = "/usr/bin/chromium";

/// A headless Chromium session.
pub struct Browser {
    client: Client,
    driver: Child,
    /// The fresh profile (and driver log) directory, deleted on drop.
    dir: PathBuf,
}

impl Deref for Browser {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

impl Browser {
    /// Starts chromedriver and a headless Chromium session with a
    /// 1400 × 1500 window.
    pub async fn start() -> anyhow::Result<Self> {
        let driver_path =
            std::env::var("CHROMEDRIVER").unwrap_or_else(|_| DEFAULT_CHROMEDRIVER.into());
        let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| DEFAULT_CHROMIUM.into());
        for (what, path) in [("chromedriver", &driver_path), ("chromium", &chromium)] {
            if !std::path::Path::new(path).exists() {
                bail!(
                    "{what} not found at {path}: install Debian's `chromium` and `chromium-driver` \
                     (scripts/test.sh does), or set {}",
                    what.to_uppercase()
                );
            }
        }
        let dir =
            std::env::temp_dir().join(format!("sas-browser-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(dir.join("profile")).context("browser profile directory")?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .context("free port for chromedriver")?;
        let log =
            std::fs::File::create(dir.join("chromedriver.log")).context("chromedriver log")?;
        let mut driver = {
            use std::os::unix::process::CommandExt;
            Command::new(&driver_path)
                .arg(format!("--port={port}"))
                .stdout(Stdio::null())
                .stderr(log)
                // Its own process group, so the browser it starts dies with it.
                .process_group(0)
                .spawn()
                .with_context(|| format!("starting {driver_path}"))?
        };
        let profile = dir.join("profile");
        let options = json!({
            "binary": chromium,
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage",
                format!("--user-data-dir={}", profile.display()),
                "--window-size=1400,1500",
            ],
        });
        let mut capabilities = serde_json::Map::new();
        capabilities.insert("browserName".into(), json!("chrome"));
        capabilities.insert("goog:chromeOptions".into(), options);
        let url = format!("http://127.0.0.1:{port}");
        // chromedriver takes a moment to listen: retry the session until it does.
        let deadline = Instant::now() + Duration::from_secs(20);
        let client = loop {
            let attempt = ClientBuilder::new(HttpConnector::new())
                .capabilities(capabilities.clone())
                .connect(&url)
                .await;
            match attempt {
                Ok(client) => break client,
                Err(e) => {
                    let log =
                        std::fs::read_to_string(dir.join("chromedriver.log")).unwrap_or_default();
                    if let Ok(Some(status)) = driver.try_wait() {
                        std::fs::remove_dir_all(&dir).ok();
                        bail!("chromedriver exited with {status}; log:\n{log}");
                    }
                    if Instant::now() > deadline {
                        kill_group(&mut driver);
                        std::fs::remove_dir_all(&dir).ok();
                        bail!("no Chromium session within 20s: {e}; chromedriver's log:\n{log}");
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        Ok(Self {
            client,
            driver,
            dir,
        })
    }

    /// chromedriver's log so far.
    pub fn driver_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("chromedriver.log")).unwrap_or_default()
    }

    /// The rendered text of the first element matching `css`; `None` when
    /// there is none, or it was replaced while being read (the pages redraw
    /// their tables every refresh).
    pub async fn text_of(&self, css: &str) -> Result<Option<String>, CmdError> {
        let element = match self.client.find(Locator::Css(css)).await {
            Ok(element) => element,
            Err(e) if e.is_no_such_element() => return Ok(None),
            Err(e) => return Err(e),
        };
        match element.text().await {
            Ok(text) => Ok(Some(text)),
            Err(e) if e.is_stale_element_reference() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Logs in on the dashboard's login page (open already): types `token`,
    /// submits it and waits (up to 10 s) until the answer's page has replaced
    /// the form, so that the session cookie is set before the test opens
    /// another page (a `goto` racing the form's POST lands on the login page).
    pub async fn log_in(&self, token: &str) -> Result<(), CmdError> {
        let field = self.client.find(Locator::Css("#login-token")).await?;
        field.send_keys(token).await?;
        let submit = self.client.find(Locator::Css("#login-submit")).await?;
        submit.click().await?;
        let deadline = Instant::now() + Duration::from_secs(10);
        // The old form's field goes stale once the next page has loaded.
        while field.attr("id").await.is_ok() {
            if Instant::now() > deadline {
                return Err(CmdError::WaitTimeout);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Runs a script in the page without arguments (`return …;` gives its value).
    pub async fn run(&self, script: &str) -> Result<Value, CmdError> {
        self.client.execute(script, Vec::new()).await
    }

    /// Ends the session (the browser quits); drop stops chromedriver.
    pub async fn quit(self) {
        self.client.clone().close().await.ok();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // The whole group: chromedriver and any browser process left behind
        // (a session not closed by `quit` ends with them).
        kill_group(&mut self.driver);
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// Kills chromedriver's process group and reaps it.
fn kill_group(driver: &mut Child) {
    Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", driver.id())])
        .stderr(Stdio::null())
        .status()
        .ok();
    driver.wait().ok();
}

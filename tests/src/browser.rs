//! A tiny WebDriver client: drives a real headless Chromium through
//! `chromedriver`'s W3C HTTP API, enough for the dashboard's test: open a
//! page, find elements by CSS selector, click, type, read text and
//! attributes, run a script, take a screenshot.
//!
//! [`Browser::start`] starts `chromedriver` (Debian's `chromium-driver`) on a
//! free port with a fresh profile directory; dropping the browser ends the
//! session and kills the driver's process group. A missing `chromedriver` is
//! an error, never a skip: the dashboard test must run in CI.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// The key under which W3C WebDriver names an element.
const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";

/// Where Debian's packages put them; `CHROMEDRIVER` and `CHROMIUM` override.
const DEFAULT_CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const DEFAULT_CHROMIUM: &str = "/usr/bin/chromium";

/// An error the driver answered with (W3C error code and message).
#[derive(Debug, thiserror::Error)]
#[error("WebDriver {status}: {error}: {message}")]
pub struct DriverError {
    pub status: u16,
    /// E.g. `no such element`, `stale element reference`.
    pub error: String,
    pub message: String,
}

/// An element of the current page.
#[derive(Debug, Clone)]
pub struct Element(String);

/// A headless Chromium session.
pub struct Browser {
    http: reqwest::Client,
    /// `http://127.0.0.1:<port>` of chromedriver.
    base: String,
    session: Option<String>,
    driver: Child,
    /// The fresh profile (and driver log) directory, deleted on drop.
    dir: PathBuf,
}

impl Browser {
    /// Starts chromedriver and a headless Chromium session with a
    /// 1400 × 1000 window.
    pub async fn start() -> anyhow::Result<Self> {
        let driver_path =
            std::env::var("CHROMEDRIVER").unwrap_or_else(|_| DEFAULT_CHROMEDRIVER.into());
        let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| DEFAULT_CHROMIUM.into());
        for (what, path) in [("chromedriver", &driver_path), ("chromium", &chromium)] {
            if !std::path::Path::new(path).exists() {
                bail!(
                    "{what} not found at {path}: install Debian's `chromium` and `chromium-driver` \
                     (.ci/run does), or set {}",
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
        let driver = {
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
        sas::tls::install_crypto_provider();
        let mut browser = Self {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()
                .context("HTTP client")?,
            base: format!("http://127.0.0.1:{port}"),
            session: None,
            driver,
            dir,
        };
        browser.wait_driver_ready().await?;
        let profile = browser.dir.join("profile");
        let capabilities = json!({
            "capabilities": { "alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {
                    "binary": chromium,
                    "args": [
                        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                        "--no-first-run", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync",
                        "--disable-dev-shm-usage",
                        format!("--user-data-dir={}", profile.display()),
                        "--window-size=1400,1500",
                    ],
                },
            }},
        });
        let created = browser
            .call(reqwest::Method::POST, "/session", Some(capabilities))
            .await
            .context("creating a Chromium session")?;
        let session = created["sessionId"]
            .as_str()
            .with_context(|| format!("no session id in {created}"))?;
        browser.session = Some(session.to_owned());
        Ok(browser)
    }

    async fn wait_driver_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(response) = self.http.get(format!("{}/status", self.base)).send().await
                && let Ok(body) = response.json::<Value>().await
                && body["value"]["ready"] == true
            {
                return Ok(());
            }
            if let Ok(Some(status)) = self.driver.try_wait() {
                bail!(
                    "chromedriver exited with {status}; log:\n{}",
                    self.driver_log()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "chromedriver not ready within 20s; log:\n{}",
                    self.driver_log()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// chromedriver's log so far.
    pub fn driver_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("chromedriver.log")).unwrap_or_default()
    }

    /// One W3C command; the answer's `value`.
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let mut request = self.http.request(method, format!("{}{path}", self.base));
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("WebDriver {path}"))?;
        let status = response.status();
        let body: Value = response
            .json()
            .await
            .with_context(|| format!("WebDriver {path}: answer"))?;
        let value = body.get("value").cloned().unwrap_or(Value::Null);
        if !status.is_success() {
            return Err(DriverError {
                status: status.as_u16(),
                error: value["error"]
                    .as_str()
                    .unwrap_or("unknown error")
                    .to_owned(),
                message: value["message"].as_str().unwrap_or_default().to_owned(),
            }
            .into());
        }
        Ok(value)
    }

    async fn session_call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let session = self.session.as_deref().context("no session")?;
        self.call(method, &format!("/session/{session}{path}"), body)
            .await
    }

    /// Opens `url` and waits for it to load.
    pub async fn goto(&self, url: &str) -> anyhow::Result<()> {
        self.session_call(reqwest::Method::POST, "/url", Some(json!({ "url": url })))
            .await?;
        Ok(())
    }

    /// The first element matching `css`, if any.
    pub async fn find(&self, css: &str) -> anyhow::Result<Option<Element>> {
        let found = self
            .session_call(
                reqwest::Method::POST,
                "/element",
                Some(json!({ "using": "css selector", "value": css })),
            )
            .await;
        match found {
            Ok(value) => Ok(Some(element(&value)?)),
            Err(e) if is_driver_error(&e, "no such element") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every element matching `css`.
    pub async fn find_all(&self, css: &str) -> anyhow::Result<Vec<Element>> {
        let found = self
            .session_call(
                reqwest::Method::POST,
                "/elements",
                Some(json!({ "using": "css selector", "value": css })),
            )
            .await?;
        found
            .as_array()
            .context("elements: not an array")?
            .iter()
            .map(element)
            .collect()
    }

    /// Clicks the element.
    pub async fn click(&self, el: &Element) -> anyhow::Result<()> {
        self.session_call(
            reqwest::Method::POST,
            &format!("/element/{}/click", el.0),
            Some(json!({})),
        )
        .await?;
        Ok(())
    }

    /// Types `text` into the element (an input), as a user would.
    pub async fn type_text(&self, el: &Element, text: &str) -> anyhow::Result<()> {
        self.session_call(
            reqwest::Method::POST,
            &format!("/element/{}/value", el.0),
            Some(json!({ "text": text })),
        )
        .await?;
        Ok(())
    }

    /// The element's rendered text.
    pub async fn text(&self, el: &Element) -> anyhow::Result<String> {
        let value = self
            .session_call(
                reqwest::Method::GET,
                &format!("/element/{}/text", el.0),
                None,
            )
            .await?;
        Ok(value.as_str().unwrap_or_default().to_owned())
    }

    /// An attribute of the element (`None` when it has none).
    pub async fn attribute(&self, el: &Element, name: &str) -> anyhow::Result<Option<String>> {
        let value = self
            .session_call(
                reqwest::Method::GET,
                &format!("/element/{}/attribute/{name}", el.0),
                None,
            )
            .await?;
        Ok(value.as_str().map(str::to_owned))
    }

    /// The text of the first element matching `css`, `None` when there is none
    /// (or it was replaced while being read).
    pub async fn text_of(&self, css: &str) -> anyhow::Result<Option<String>> {
        let Some(el) = self.find(css).await? else {
            return Ok(None);
        };
        match self.text(&el).await {
            Ok(text) => Ok(Some(text)),
            Err(e) if is_driver_error(&e, "stale element reference") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Runs a script in the page (`return …;` gives its value).
    pub async fn execute(&self, script: &str) -> anyhow::Result<Value> {
        self.session_call(
            reqwest::Method::POST,
            "/execute/sync",
            Some(json!({ "script": script, "args": [] })),
        )
        .await
    }

    /// A PNG of the window.
    pub async fn screenshot(&self) -> anyhow::Result<Vec<u8>> {
        let value = self
            .session_call(reqwest::Method::GET, "/screenshot", None)
            .await?;
        base64_decode(value.as_str().context("screenshot: not a string")?)
    }

    /// Ends the session (the browser quits) and stops chromedriver.
    pub async fn quit(mut self) {
        if let Some(session) = self.session.take() {
            self.call(
                reqwest::Method::DELETE,
                &format!("/session/{session}"),
                None,
            )
            .await
            .ok();
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if let Some(session) = self.session.take() {
            // Drop cannot await: end the session from a thread with its own runtime.
            let (http, url) = (
                self.http.clone(),
                format!("{}/session/{session}", self.base),
            );
            std::thread::spawn(move || {
                if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    rt.block_on(async {
                        tokio::time::timeout(Duration::from_secs(10), http.delete(url).send())
                            .await
                            .ok();
                    });
                }
            })
            .join()
            .ok();
        }
        // The whole group: chromedriver and any browser process left behind.
        Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.driver.id())])
            .stderr(Stdio::null())
            .status()
            .ok();
        self.driver.wait().ok();
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

fn element(value: &Value) -> anyhow::Result<Element> {
    value[ELEMENT_KEY]
        .as_str()
        .map(|id| Element(id.to_owned()))
        .with_context(|| format!("not an element: {value}"))
}

/// Whether `e` is the driver's error `code` (e.g. `no such element`).
pub fn is_driver_error(e: &anyhow::Error, code: &str) -> bool {
    e.downcast_ref::<DriverError>()
        .is_some_and(|d| d.error == code)
}

/// Standard base64 (with padding), as WebDriver sends screenshots.
fn base64_decode(text: &str) -> anyhow::Result<Vec<u8>> {
    fn sextet(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let clean: Vec<u8> = text
        .bytes()
        .filter(|c| !c.is_ascii_whitespace() && *c != b'=')
        .collect();
    let mut out = Vec::with_capacity(clean.len() * 3 / 4);
    for chunk in clean.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= sextet(c).with_context(|| format!("bad base64 byte {c:#x}"))? << (18 - 6 * i);
        }
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::base64_decode;

    #[test]
    fn base64_decodes_with_and_without_padding() {
        assert_eq!(base64_decode("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVsbG8h").unwrap(), b"hello!");
        assert_eq!(base64_decode("aGk=").unwrap(), b"hi");
        assert!(base64_decode("a$==").is_err());
    }
}

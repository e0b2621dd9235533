//! The HTTP API of the submission service (contract §9a), for what the
//! broker does not carry: an order's state, its cancel, its signals.

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::{Error, OrderId};
use sas_protocol::http::{Cancelled, OrderView, Problem};

/// Where the HTTP API is, and the application's token (left out of its
/// `Debug`).
#[derive(Clone)]
pub struct HttpOptions {
    /// The submission service's base URL, e.g. `http://sas.internal:9101`.
    pub base_url: String,
    /// The application's bearer token (contract §1b), if sas has
    /// `[applications]`.
    pub token: Option<String>,
}

impl std::fmt::Debug for HttpOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpOptions")
            .field(
                "base_url",
                &crate::connect::without_password(&self.base_url),
            )
            .field("token", &self.token.as_ref().map(|_| "***"))
            .finish()
    }
}

/// A client of the HTTP API.
pub(crate) struct Api {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Api {
    pub(crate) fn new(options: &HttpOptions) -> Result<Self, Error> {
        // reqwest is built without a TLS provider of its own: ring, as
        // lapin uses (an error means one is installed already).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(30))
            .build()
            .map_err(Error::Http)?;
        Ok(Self {
            base: options.base_url.trim_end_matches('/').to_owned(),
            token: options.token.clone(),
            http,
        })
    }

    pub(crate) async fn order(&self, id: OrderId) -> Result<OrderView, Error> {
        self.call(self.http.get(format!("{}/v1/orders/{id}", self.base)))
            .await
    }

    pub(crate) async fn cancel(&self, id: OrderId) -> Result<Cancelled, Error> {
        self.call(
            self.http
                .post(format!("{}/v1/orders/{id}/cancel", self.base)),
        )
        .await
    }

    pub(crate) async fn signal<T: Serialize + ?Sized>(
        &self,
        id: OrderId,
        name: &str,
        data: &T,
    ) -> Result<Value, Error> {
        let name: String = url_segment(name);
        let request = self
            .http
            .post(format!("{}/v1/orders/{id}/signals/{name}", self.base))
            .json(data);
        self.call(request).await
    }

    /// Sends `request` with the token; the answer's body, or the API's
    /// refusal.
    async fn call<R: DeserializeOwned>(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<R, Error> {
        let request = match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        };
        let response = request.send().await.map_err(Error::Http)?;
        let status = response.status();
        let body = response.bytes().await.map_err(Error::Http)?;
        if status.is_success() {
            return serde_json::from_slice(&body).map_err(|e| Error::Unexpected(e.to_string()));
        }
        let problem = serde_json::from_slice::<Problem>(&body).unwrap_or_else(|_| Problem {
            error: "http_error".into(),
            reason: String::from_utf8_lossy(&body).chars().take(200).collect(),
            state: None,
        });
        Err(Error::Refused {
            status: status.as_u16(),
            problem,
        })
    }
}

/// `text` as one path segment: everything but unreserved characters
/// percent-encoded.
fn url_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_signal_name_is_one_path_segment() {
        assert_eq!(super::url_segment("approve"), "approve");
        assert_eq!(super::url_segment("a/b c"), "a%2Fb%20c");
        assert_eq!(super::url_segment("é"), "%C3%A9");
    }
}

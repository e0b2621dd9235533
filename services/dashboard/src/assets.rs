//! The pages, embedded in the binary: plain HTML, CSS and JavaScript from
//! `assets/`, nothing fetched from elsewhere at run time. The pages need a
//! logged-in caller; their CSS and JavaScript (the same for everyone, no data
//! in them) and the login page do not.

use std::sync::Arc;

use axum::Router;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use sas::service::Context;

const INDEX_HTML: &str = include_str!("../assets/index.html");
const ORDER_HTML: &str = include_str!("../assets/order.html");
const LOGIN_HTML: &str = include_str!("../assets/login.html");
const STYLE_CSS: &str = include_str!("../assets/style.css");
const COMMON_JS: &str = include_str!("../assets/common.js");
const OVERVIEW_JS: &str = include_str!("../assets/overview.js");
const ORDER_JS: &str = include_str!("../assets/order.js");
const FIND_JS: &str = include_str!("../assets/find.js");

/// The page routes: `/` and `/orders/{id}` (the page reads the id from its URL).
pub fn pages() -> Router<Arc<Context>> {
    Router::new()
        .route("/", get(|| async { html(INDEX_HTML) }))
        .route("/orders/{id}", get(|| async { html(ORDER_HTML) }))
}

/// The pages' files: `/assets/…`.
pub fn files() -> Router {
    Router::new()
        .route(
            "/assets/style.css",
            get(|| async { asset("text/css", STYLE_CSS) }),
        )
        .route("/assets/common.js", get(|| async { script(COMMON_JS) }))
        .route("/assets/overview.js", get(|| async { script(OVERVIEW_JS) }))
        .route("/assets/order.js", get(|| async { script(ORDER_JS) }))
        .route("/assets/find.js", get(|| async { script(FIND_JS) }))
}

/// What the login page says above its form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoginNotice {
    /// Nothing: the first visit.
    None,
    /// The last token was not valid.
    Invalid,
    /// Too many failed logins: try again in this many seconds.
    Throttled(u64),
}

/// The login page, with `notice` above its form.
pub fn login_page(notice: LoginNotice) -> Response {
    let message = match notice {
        LoginNotice::None => None,
        LoginNotice::Invalid => Some("That token is not valid.".to_owned()),
        LoginNotice::Throttled(secs) => {
            Some(format!("Too many failed logins: try again in {secs} s."))
        }
    };
    let body = match message {
        // The message is ours (no caller's text in it): nothing to escape.
        Some(message) => LOGIN_HTML.replace(
            "<!--error-->",
            &format!(r#"<p id="login-error" class="message" data-kind="error">{message}</p>"#),
        ),
        None => LOGIN_HTML.to_owned(),
    };
    let mut response = asset_owned("text/html; charset=utf-8", body);
    // Its one form posts here; nothing else runs, nothing frames it.
    secure_page(
        &mut response,
        "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    );
    response
}

fn html(body: &'static str) -> Response {
    let mut response = asset("text/html; charset=utf-8", body);
    // Only our own files run, and no other site may frame the action buttons.
    secure_page(
        &mut response,
        "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'none'",
    );
    response
}

fn secure_page(response: &mut Response, policy: &'static str) {
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(policy),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
}

fn script(body: &'static str) -> Response {
    asset("text/javascript; charset=utf-8", body)
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    asset_owned(content_type, body)
}

fn asset_owned(content_type: &'static str, body: impl IntoResponse) -> Response {
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            // A new binary may bring new pages: always revalidate.
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
        ],
        body,
    )
        .into_response()
}

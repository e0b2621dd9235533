//! The pages, embedded in the binary: plain HTML, CSS and JavaScript from
//! `assets/`, nothing fetched from elsewhere at run time.

use std::sync::Arc;

use axum::Router;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use sas::service::Context;

const INDEX_HTML: &str = include_str!("../assets/index.html");
const ORDER_HTML: &str = include_str!("../assets/order.html");
const STYLE_CSS: &str = include_str!("../assets/style.css");
const COMMON_JS: &str = include_str!("../assets/common.js");
const OVERVIEW_JS: &str = include_str!("../assets/overview.js");
const ORDER_JS: &str = include_str!("../assets/order.js");

/// The page routes: `/`, `/orders/{id}` (the page reads the id from its URL)
/// and `/assets/…`.
pub fn routes() -> Router<Arc<Context>> {
    Router::new()
        .route("/", get(|| async { html(INDEX_HTML) }))
        .route("/orders/{id}", get(|| async { html(ORDER_HTML) }))
        .route(
            "/assets/style.css",
            get(|| async { asset("text/css", STYLE_CSS) }),
        )
        .route("/assets/common.js", get(|| async { script(COMMON_JS) }))
        .route("/assets/overview.js", get(|| async { script(OVERVIEW_JS) }))
        .route("/assets/order.js", get(|| async { script(ORDER_JS) }))
}

fn html(body: &'static str) -> Response {
    let mut response = asset("text/html; charset=utf-8", body);
    let headers = response.headers_mut();
    // Only our own files run, and no other site may frame the action buttons.
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'none'",
        ),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    response
}

fn script(body: &'static str) -> Response {
    asset("text/javascript; charset=utf-8", body)
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
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

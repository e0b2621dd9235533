//! `token` mode's login and logout: `GET /login` shows a form, `POST /login`
//! trades a valid token (form field `token`) for a session cookie and goes to
//! the overview, `GET|POST /logout` ends the session. In the other modes
//! these go to the overview: the browser or the proxy does the logging in.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Extension;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use sas::config::DashboardAuth;

use crate::assets::login_page;
use crate::auth::{Auth, session_id};

/// Longest login form read: a token field and some room.
const MAX_FORM_BYTES: usize = 8 * 1024;

/// The login and logout routes.
pub fn routes(auth: Arc<Auth>) -> Router {
    Router::new()
        .route("/login", get(page).post(login))
        .route("/logout", get(logout).post(logout))
        .layer(DefaultBodyLimit::max(MAX_FORM_BYTES))
        .with_state(auth)
}

async fn page(State(auth): State<Arc<Auth>>) -> Response {
    if auth.mode() != DashboardAuth::Token {
        return Redirect::to("/").into_response();
    }
    login_page(false)
}

async fn login(
    State(auth): State<Arc<Auth>>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    body: Bytes,
) -> Response {
    if auth.mode() != DashboardAuth::Token {
        return Redirect::to("/").into_response();
    }
    let token = form_urlencoded::parse(&body)
        .find(|(key, _)| key == "token")
        .map(|(_, value)| value.trim().to_owned())
        .unwrap_or_default();
    let Some(identity) = auth.token_identity(&token) else {
        tracing::warn!(peer = ?peer.map(|p| p.0.0), "dashboard: login with a token that is not valid");
        let mut response = login_page(true);
        *response.status_mut() = StatusCode::UNAUTHORIZED;
        return response;
    };
    tracing::info!(user = %identity.name, role = identity.role.as_str(), "dashboard: logged in");
    let id = auth.sessions.open(identity);
    with_cookie(Redirect::to("/"), &auth.session_cookie(&id))
}

async fn logout(State(auth): State<Arc<Auth>>, headers: HeaderMap) -> Response {
    if let Some(id) = session_id(&headers) {
        auth.sessions.close(id);
    }
    let to = if auth.mode() == DashboardAuth::Token {
        "/login"
    } else {
        "/"
    };
    with_cookie(Redirect::to(to), &auth.expired_cookie())
}

fn with_cookie(redirect: Redirect, cookie: &str) -> Response {
    let mut response = redirect.into_response();
    if let Ok(value) = HeaderValue::from_str(cookie) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

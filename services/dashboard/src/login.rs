//! `token` mode's login and logout: `GET /login` shows a form, `POST /login`
//! trades a valid token (form field `token`) for a session cookie and goes to
//! the overview, `GET|POST /logout` ends the session. In the other modes
//! these go to the overview: the browser or the proxy does the logging in.
//! Failed logins are throttled per client and in all ([`crate::throttle`]):
//! past the limits `POST /login` answers 429 with `Retry-After`, right
//! token or not. The session cookie is `Secure` whenever the login came
//! over HTTPS ([`Auth::secure`]).

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

use crate::assets::{LoginNotice, login_page};
use crate::auth::{Auth, session_id};
use crate::throttle::{Attempt, retry_after_secs};

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
    login_page(LoginNotice::None)
}

async fn login(
    State(auth): State<Arc<Auth>>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if auth.mode() != DashboardAuth::Token {
        return Redirect::to("/").into_response();
    }
    let peer = peer.map(|p| p.0.0.ip());
    let token = form_urlencoded::parse(&body)
        .find(|(key, _)| key == "token")
        .map(|(_, value)| value.trim().to_owned())
        .unwrap_or_default();
    let identity = match auth.login(peer, &headers, &token) {
        Attempt::Checked(identity) => identity,
        Attempt::Throttled(wait) => {
            let client = auth.client(peer, &headers);
            tracing::warn!(?peer, %client, "dashboard: too many failed logins; login refused unread");
            let secs = retry_after_secs(wait);
            let mut response = login_page(LoginNotice::Throttled(secs));
            *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
            return response;
        }
    };
    let Some(identity) = identity else {
        tracing::warn!(?peer, "dashboard: login with a token that is not valid");
        let mut response = login_page(LoginNotice::Invalid);
        *response.status_mut() = StatusCode::UNAUTHORIZED;
        return response;
    };
    tracing::info!(user = %identity.name, role = identity.role.as_str(), "dashboard: logged in");
    let id = auth.sessions.open(identity);
    let secure = auth.secure(peer, &headers);
    with_cookie(Redirect::to("/"), &auth.session_cookie(&id, secure))
}

async fn logout(
    State(auth): State<Arc<Auth>>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    headers: HeaderMap,
) -> Response {
    if let Some(id) = session_id(&headers) {
        auth.sessions.close(id);
    }
    let to = if auth.mode() == DashboardAuth::Token {
        "/login"
    } else {
        "/"
    };
    let secure = auth.secure(peer.map(|p| p.0.0.ip()), &headers);
    with_cookie(Redirect::to(to), &auth.expired_cookie(secure))
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

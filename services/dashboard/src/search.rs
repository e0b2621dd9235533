//! `GET /api/orders`: the order search (see [`sas::state_store::OrderSearch`]).
//!
//! Parameters, all optional, empty ones ignored: `id` (an order id), `state`,
//! `workflow`, `from` and `to` (RFC 3339 times: created at or after `from`,
//! before `to`), `field` and `value` (a dotted payload path and the value it
//! holds, e.g. `field=customer.id&value=42`), `after` (the `next` of the
//! previous page) and `limit` (1 to 200, 50 by default). The answer is
//! `{"orders": [...], "next": cursor or null}`, newest first. A parameter
//! that does not parse, or one this search does not know, is a 400 naming
//! it; a search that runs longer than 5 s in Postgres is a 422 asking to
//! narrow it.

use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use sas::service::Context;
use sas::state::ProcessState;
use sas::state_store::{
    Cursor, MAX_SEARCH_PAGE, OrderSearch, PayloadField, SearchError, SearchFailed, SearchPage,
    StoreError,
};
use serde_json::json;
use uuid::Uuid;

/// Orders on a page unless `limit` says otherwise.
const DEFAULT_PAGE: u32 = 50;

/// Longest query string read, in bytes: far above any real search (a path
/// and a value of their maximum lengths), far below the server's limits.
const MAX_QUERY_BYTES: usize = 16 * 1024;

/// A search the caller got wrong, or one that failed.
#[derive(Debug)]
enum Refused {
    BadRequest(String),
    TooSlow(String),
    Internal(StoreError),
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        let (status, message) = match self {
            Self::BadRequest(m) => (StatusCode::BAD_REQUEST, m),
            Self::TooSlow(m) => (StatusCode::UNPROCESSABLE_ENTITY, m),
            Self::Internal(e) => {
                tracing::error!(error = format!("{e:#}"), "dashboard search failed");
                (StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}"))
            }
        };
        (status, axum::Json(json!({ "error": message }))).into_response()
    }
}

impl From<SearchError> for Refused {
    fn from(e: SearchError) -> Self {
        Self::BadRequest(e.to_string())
    }
}

/// The search's parameters, parsed.
#[derive(Debug, PartialEq)]
struct Params {
    search: OrderSearch,
    limit: u32,
}

/// Parses the query string; the first bad parameter is the error.
fn params(query: &str) -> Result<Params, Refused> {
    if query.len() > MAX_QUERY_BYTES {
        return Err(Refused::BadRequest(format!(
            "the query is longer than {MAX_QUERY_BYTES} bytes"
        )));
    }
    let mut search = OrderSearch::default();
    let mut limit = DEFAULT_PAGE;
    let (mut field, mut value) = (None, None);
    for (key, raw) in form_urlencoded::parse(query.as_bytes()) {
        let text = raw.trim();
        if text.is_empty() {
            continue;
        }
        let bad = |what: &str| {
            Refused::BadRequest(format!(
                "{key}: {:?} is not {what}",
                sas::messages::truncate_bytes(text, 80)
            ))
        };
        match key.as_ref() {
            "id" => search.order_id = Some(Uuid::parse_str(text).map_err(|_| bad("an order id"))?),
            "state" => {
                search.state = Some(
                    text.parse::<ProcessState>()
                        .map_err(|_| bad("an order state"))?,
                );
            }
            "workflow" => search.workflow = Some(text.to_owned()),
            "from" => search.from = Some(time(text).ok_or_else(|| bad("an RFC 3339 time"))?),
            "to" => search.to = Some(time(text).ok_or_else(|| bad("an RFC 3339 time"))?),
            // The value is compared as it is: spaces may matter.
            "field" => field = Some(text.to_owned()),
            "value" => value = Some(raw.to_string()),
            "after" => search.after = Some(Cursor::parse(text)?),
            "limit" => {
                limit = text
                    .parse::<u32>()
                    .ok()
                    .filter(|n| (1..=MAX_SEARCH_PAGE).contains(n))
                    .ok_or_else(|| bad("a page size from 1 to 200"))?;
            }
            other => {
                return Err(Refused::BadRequest(format!(
                    "unknown parameter {:?} (id, state, workflow, from, to, field, value, after, limit)",
                    sas::messages::truncate_bytes(other, 80)
                )));
            }
        }
    }
    search.field = match (field, value) {
        (Some(path), Some(value)) => Some(PayloadField::parse(&path, &value)?),
        (None, None) => None,
        _ => return Err(SearchError::FieldWithoutValue.into()),
    };
    search.validate()?;
    Ok(Params { search, limit })
}

fn time(text: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(text)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// `GET /api/orders`.
pub async fn search(
    State(ctx): State<Arc<Context>>,
    RawQuery(query): RawQuery,
) -> Result<axum::Json<SearchPage>, Response> {
    let Params { search, limit } =
        params(query.as_deref().unwrap_or("")).map_err(IntoResponse::into_response)?;
    let store = ctx.store().map_err(|e| {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            axum::Json(json!({ "error": format!("{e:#}") })),
        )
            .into_response()
    })?;
    match sas::state_store::ReadModels::new(store.clone())
        .search_orders(&search, limit)
        .await
    {
        Ok(page) => Ok(axum::Json(page)),
        Err(e @ SearchFailed::TooSlow) => Err(Refused::TooSlow(e.to_string()).into_response()),
        Err(SearchFailed::Store(e)) => Err(Refused::Internal(e).into_response()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(query: &str) -> String {
        match params(query) {
            Err(Refused::BadRequest(m)) => m,
            other => panic!("{query}: {other:?}"),
        }
    }

    #[test]
    fn every_filter_parses_and_empty_ones_are_ignored() {
        let id = Uuid::new_v4();
        let p = params(&format!(
            "id={id}&state=error&workflow=order&from=2026-11-25T07:00:00Z&to=2026-11-25T08:00:00%2B01:00\
             &field=customer.id&value=42&limit=10&after="
        ))
        .unwrap();
        assert_eq!(p.limit, 10);
        assert_eq!(p.search.order_id, Some(id));
        assert_eq!(p.search.state, Some(ProcessState::Error));
        assert_eq!(p.search.workflow.as_deref(), Some("order"));
        assert_eq!(
            p.search.to.map(|t| t.to_rfc3339()),
            Some("2026-11-25T07:00:00+00:00".into())
        );
        assert_eq!(
            p.search.field.as_ref().map(PayloadField::path),
            Some(&["customer".to_owned(), "id".to_owned()][..])
        );
        assert_eq!(p.search.after, None);
        assert_eq!(params("").unwrap().limit, DEFAULT_PAGE);
        assert_eq!(
            params("state=&workflow=").unwrap().search,
            OrderSearch::default()
        );
    }

    #[test]
    fn bad_parameters_are_named() {
        assert!(refused("id=42").starts_with("id: \"42\" is not an order id"));
        assert!(refused("state=lost").contains("not an order state"));
        assert!(refused("from=yesterday").contains("RFC 3339"));
        assert!(refused("limit=0").contains("page size"));
        assert!(refused("limit=201").contains("page size"));
        assert!(refused("field=a").contains("needs a value"));
        assert!(refused("value=1").contains("needs a value"));
        assert!(refused("after=xyz").contains("cursor"));
        assert!(refused("sort=id").contains("unknown parameter \"sort\""));
        assert!(refused("field=a&value=%00").contains("control character"));
        assert!(refused(&format!("workflow={}", "w".repeat(300))).contains("longer than"));
        assert!(refused(&"a".repeat(MAX_QUERY_BYTES + 1)).contains("longer than"));
    }
}

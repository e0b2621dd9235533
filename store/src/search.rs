//! The dashboard's order search: by id, state, workflow, creation time and
//! one payload field, newest first, a page at a time.
//!
//! Every value the caller gives is a bound parameter; the SQL text holds
//! only the fixed fragments of the filters present. The payload field is a
//! path of keys given to `#>>` as a `text[]` parameter and compared as text
//! (`customer.id = 42` matches the number 42 and the string "42").
//!
//! Paging is by keyset on `(created_at, order_id)`, which the index
//! `orders_created` serves: a page starts strictly after the last row of the
//! previous one, so rows are neither repeated nor skipped however many
//! orders arrive meanwhile (new ones are newer than any cursor). A search
//! is bounded in time ([`SEARCH_TIMEOUT`]): a payload filter over the whole
//! table is a scan, and the dashboard must not hold Postgres for it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use super::StoreError;
use sas_core::state::ProcessState;

/// Most orders on one page.
pub const MAX_PAGE: u32 = 200;

/// Most keys in a payload path.
pub const MAX_PATH_KEYS: usize = 16;

/// Longest key of a payload path, and longest workflow name, in bytes
/// (what sas accepts in an order: names of at most 255 bytes).
pub const MAX_NAME_BYTES: usize = 255;

/// Longest payload value searched for, in bytes.
pub const MAX_VALUE_BYTES: usize = 1024;

/// How long one search may run in Postgres.
pub const SEARCH_TIMEOUT: Duration = Duration::from_secs(5);

/// A search the caller cannot make: answered as a client's mistake.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SearchError {
    #[error("{what} is longer than {max} bytes")]
    TooLong { what: &'static str, max: usize },
    #[error("{0} holds a control character")]
    ControlCharacter(&'static str),
    #[error("the payload path {0:?} has an empty key (write keys separated by dots: customer.id)")]
    EmptyKey(String),
    #[error("the payload path has more than {} keys", MAX_PATH_KEYS)]
    TooDeep,
    #[error("a payload value needs a payload path (field), and a path needs a value")]
    FieldWithoutValue,
    #[error("{0:?} is not a cursor of this search (use the `next` of the previous page)")]
    BadCursor(String),
    #[error("the time range ends ({to}) before it starts ({from})")]
    EmptyRange {
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    },
}

/// Checks a text the caller sends: not too long and no control character
/// (Postgres cannot hold NUL in text, and no name sas stores has one).
fn checked(what: &'static str, text: &str, max: usize) -> Result<(), SearchError> {
    if text.len() > max {
        return Err(SearchError::TooLong { what, max });
    }
    if text.chars().any(char::is_control) {
        return Err(SearchError::ControlCharacter(what));
    }
    Ok(())
}

/// A payload field and the value it must hold, e.g. `customer.id` = `42`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayloadField {
    /// The keys from the payload's root (an array index is a key too: `items.0.sku`).
    path: Vec<String>,
    /// Compared with the field as text (`#>>`).
    value: String,
}

impl PayloadField {
    /// A field from a dotted path and a value.
    pub fn parse(path: &str, value: &str) -> Result<Self, SearchError> {
        checked(
            "the payload path",
            path,
            MAX_PATH_KEYS * (MAX_NAME_BYTES + 1),
        )?;
        checked("the payload value", value, MAX_VALUE_BYTES)?;
        let keys: Vec<String> = path.trim().split('.').map(str::to_owned).collect();
        if keys.len() > MAX_PATH_KEYS {
            return Err(SearchError::TooDeep);
        }
        for key in &keys {
            if key.is_empty() {
                return Err(SearchError::EmptyKey(path.to_owned()));
            }
            checked("a key of the payload path", key, MAX_NAME_BYTES)?;
        }
        Ok(Self {
            path: keys,
            value: value.to_owned(),
        })
    }

    /// The keys of the path.
    pub fn path(&self) -> &[String] {
        &self.path
    }
}

/// Where a page starts: strictly after this row, in the search's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    created_at: DateTime<Utc>,
    order_id: Uuid,
}

impl Cursor {
    /// The cursor as text: `<created_at in µs since the epoch>.<order id>`
    /// (Postgres keeps microseconds, so the text is exact).
    pub fn encode(&self) -> String {
        format!("{}.{}", self.created_at.timestamp_micros(), self.order_id)
    }

    /// A cursor from [`Cursor::encode`]'s text.
    pub fn parse(text: &str) -> Result<Self, SearchError> {
        let bad =
            || SearchError::BadCursor(sas_core::messages::truncate_bytes(text, 80).to_owned());
        let (micros, id) = text.split_once('.').ok_or_else(bad)?;
        let micros: i64 = micros.parse().map_err(|_| bad())?;
        let created_at = DateTime::from_timestamp_micros(micros).ok_or_else(bad)?;
        // Only times an order can have (sas stores years 1 to 9999): Postgres
        // refuses others, which would be an error rather than no match.
        if !(1..=9999).contains(&chrono::Datelike::year(&created_at)) {
            return Err(bad());
        }
        Ok(Self {
            created_at,
            order_id: Uuid::parse_str(id).map_err(|_| bad())?,
        })
    }
}

/// What to look for; every filter given must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OrderSearch {
    pub order_id: Option<Uuid>,
    pub state: Option<ProcessState>,
    pub workflow: Option<String>,
    /// Created at or after.
    pub from: Option<DateTime<Utc>>,
    /// Created before.
    pub to: Option<DateTime<Utc>>,
    pub field: Option<PayloadField>,
    /// The page after this row; the first page without.
    pub after: Option<Cursor>,
}

impl OrderSearch {
    /// Checks what [`PayloadField::parse`] and [`Cursor::parse`] cannot:
    /// the workflow name and the time range.
    pub fn validate(&self) -> Result<(), SearchError> {
        if let Some(workflow) = &self.workflow {
            checked("the workflow", workflow, MAX_NAME_BYTES)?;
        }
        if let (Some(from), Some(to)) = (self.from, self.to)
            && to < from
        {
            return Err(SearchError::EmptyRange { from, to });
        }
        Ok(())
    }
}

/// An order as the search lists it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct FoundOrder {
    pub order_id: Uuid,
    pub workflow: String,
    #[sqlx(try_from = "String")]
    pub process_state: ProcessState,
    pub failure_count: i32,
    pub last_error: Option<String>,
    /// Why it is held, if it is.
    pub held_reason: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// One page of a search.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SearchPage {
    /// Newest first.
    pub orders: Vec<FoundOrder>,
    /// The cursor of the next page; `None` on the last one.
    pub next: Option<String>,
}

/// Why a search failed.
#[derive(Debug, thiserror::Error)]
pub enum SearchFailed {
    /// Postgres gave up after `SEARCH_TIMEOUT`: the filters match too
    /// much of the table to be read in time.
    #[error(
        "the search ran longer than {:?}: narrow it (a time range, a state or a workflow)",
        SEARCH_TIMEOUT
    )]
    TooSlow,
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<sqlx::Error> for SearchFailed {
    fn from(e: sqlx::Error) -> Self {
        // 57014: query_canceled, which is what statement_timeout raises.
        match &e {
            sqlx::Error::Database(db) if db.code().as_deref() == Some("57014") => Self::TooSlow,
            _ => Self::Store(e.into()),
        }
    }
}

impl crate::ReadModels {
    /// One page of at most `limit` orders (at most [`MAX_PAGE`]) matching
    /// `search`, newest first.
    pub async fn search_orders(
        &self,
        search: &OrderSearch,
        limit: u32,
    ) -> Result<SearchPage, SearchFailed> {
        let limit = limit.clamp(1, MAX_PAGE);
        let mut q = sqlx::QueryBuilder::<sqlx::Postgres>::new(
            "SELECT order_id, workflow, process_state, failure_count, last_error, held_reason, \
               created_at, updated_at \
             FROM orders WHERE true",
        );
        if let Some(id) = search.order_id {
            q.push(" AND order_id = ").push_bind(id);
        }
        if let Some(state) = search.state {
            q.push(" AND process_state = ").push_bind(state.as_str());
        }
        if let Some(workflow) = &search.workflow {
            q.push(" AND workflow = ").push_bind(workflow.clone());
        }
        if let Some(from) = search.from {
            q.push(" AND created_at >= ").push_bind(from);
        }
        if let Some(to) = search.to {
            q.push(" AND created_at < ").push_bind(to);
        }
        if let Some(field) = &search.field {
            q.push(" AND payload #>> ")
                .push_bind(field.path.clone())
                .push("::text[] = ")
                .push_bind(field.value.clone());
        }
        if let Some(after) = search.after {
            q.push(" AND (created_at, order_id) < (")
                .push_bind(after.created_at)
                .push(", ")
                .push_bind(after.order_id)
                .push(")");
        }
        // One more than the page: whether there is a next page.
        q.push(" ORDER BY created_at DESC, order_id DESC LIMIT ")
            .push_bind(i64::from(limit) + 1);

        let mut conn = self.store.conn().await?;
        let mut orders: Vec<FoundOrder> = conn
            .run(|c| async move {
                let mut tx = sqlx::Connection::begin(c).await?;
                sqlx::query("SELECT set_config('statement_timeout', $1, true)")
                    .bind(format!("{}ms", SEARCH_TIMEOUT.as_millis()))
                    .execute(&mut *tx)
                    .await?;
                let orders = q.build_query_as().fetch_all(&mut *tx).await?;
                tx.commit().await?;
                Ok::<_, sqlx::Error>(orders)
            })
            .await?;
        drop(conn);
        let next = if orders.len() > limit as usize {
            orders.truncate(limit as usize);
            orders.last().map(|o| {
                Cursor {
                    created_at: o.created_at,
                    order_id: o.order_id,
                }
                .encode()
            })
        } else {
            None
        };
        Ok(SearchPage { orders, next })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_path_is_keys_separated_by_dots() {
        let f = PayloadField::parse("customer.id", "42").unwrap();
        assert_eq!(f.path(), ["customer", "id"]);
        assert_eq!(f.value, "42");
        assert_eq!(
            PayloadField::parse("items.0.sku", "x").unwrap().path(),
            ["items", "0", "sku"]
        );
        // Quotes and SQL are just text of a key or a value.
        let sql = PayloadField::parse("a'b\".c", "1' OR '1'='1").unwrap();
        assert_eq!(sql.path(), ["a'b\"", "c"]);
    }

    #[test]
    fn bad_payload_paths_and_values_are_refused() {
        assert_eq!(
            PayloadField::parse("a..b", "1"),
            Err(SearchError::EmptyKey("a..b".into()))
        );
        assert!(matches!(
            PayloadField::parse("", "1"),
            Err(SearchError::EmptyKey(_))
        ));
        assert_eq!(
            PayloadField::parse(&vec!["k"; 17].join("."), "1"),
            Err(SearchError::TooDeep)
        );
        assert!(matches!(
            PayloadField::parse(&"k".repeat(256), "1"),
            Err(SearchError::TooLong { .. })
        ));
        assert!(matches!(
            PayloadField::parse(&"k".repeat(100_000), "1"),
            Err(SearchError::TooLong { .. })
        ));
        assert!(matches!(
            PayloadField::parse("a", &"v".repeat(1025)),
            Err(SearchError::TooLong { .. })
        ));
        assert!(matches!(
            PayloadField::parse("a\u{0}", "1"),
            Err(SearchError::ControlCharacter(_))
        ));
        assert!(matches!(
            PayloadField::parse("a", "1\u{0}"),
            Err(SearchError::ControlCharacter(_))
        ));
    }

    #[test]
    fn a_cursor_survives_its_text_to_the_microsecond() {
        let at = DateTime::from_timestamp_micros(1_764_000_000_123_456).unwrap();
        let c = Cursor {
            created_at: at,
            order_id: Uuid::new_v4(),
        };
        assert_eq!(Cursor::parse(&c.encode()), Ok(c));
        for bad in [
            "",
            "x",
            "1.2",
            "abc.0191f3a0-0000-7000-8000-000000000000",
            "1",
        ] {
            assert!(Cursor::parse(bad).is_err(), "{bad}");
        }
        for micros in [i64::MAX, i64::MIN, -3_155_760_000_000_000_000] {
            assert!(matches!(
                Cursor::parse(&format!("{micros}.{}", Uuid::nil())),
                Err(SearchError::BadCursor(_))
            ));
        }
    }

    #[test]
    fn a_range_that_ends_before_it_starts_is_refused() {
        let t = Utc::now();
        let s = OrderSearch {
            from: Some(t),
            to: Some(t - chrono::Duration::seconds(1)),
            ..OrderSearch::default()
        };
        assert!(matches!(s.validate(), Err(SearchError::EmptyRange { .. })));
        let w = OrderSearch {
            workflow: Some("w\u{1b}[2J".into()),
            ..OrderSearch::default()
        };
        assert_eq!(
            w.validate(),
            Err(SearchError::ControlCharacter("the workflow"))
        );
    }
}

//! Reading columns into `sas-core`'s types where sqlx has no decoding of
//! its own: what the row mappings of orders and steps share.

use sqlx::Row as _;
use sqlx::postgres::PgRow;

/// A text column read as `T` (a state, the events asked for).
pub(super) fn text_as<T>(row: &PgRow, column: &str) -> Result<T, sqlx::Error>
where
    T: TryFrom<String>,
    T::Error: Into<sqlx::error::BoxDynError>,
{
    let text: String = row.try_get(column)?;
    T::try_from(text).map_err(|e| sqlx::Error::ColumnDecode {
        index: column.to_owned(),
        source: e.into(),
    })
}

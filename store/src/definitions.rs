//! The `definitions` table (contract §4d): each workflow definition that
//! orders run under, stored once per content with the first orders that
//! name it (by the submit's write-back, [`super::unit`]), so that an order
//! keeps the definition it was submitted under whatever the configuration
//! says later.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use uuid::Uuid;

use super::bounded::Conn;
use super::{StateStore, StoreError};
use sas_core::spec::Definition;

/// The definitions a process has read, by id, and the ids it found none
/// for. Never stale: a definition's id is its content's, and a definition
/// commits with the first order that names it, so one not found is never
/// stored later.
#[derive(Debug, Clone, Default)]
pub(super) struct Cache(Arc<Mutex<HashMap<Uuid, Option<Arc<Definition>>>>>);

impl Cache {
    /// `None`: never looked up; `Some(None)`: not stored.
    fn get(&self, id: Uuid) -> Option<Option<Arc<Definition>>> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
    }

    pub(super) fn put(&self, id: Uuid, definition: Option<Arc<Definition>>) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, definition);
    }
}

/// Definitions by id, as the rules take them ([`sas_core::rules::Given::definitions`]).
pub type Definitions = Vec<(Uuid, Arc<Definition>)>;

impl StateStore {
    /// The stored definitions among `ids`; read from Postgres only for
    /// those this process has not looked up yet (one statement).
    pub async fn definitions(
        &self,
        ids: impl IntoIterator<Item = Uuid>,
    ) -> Result<Definitions, StoreError> {
        let mut conn = self.conn().await?;
        self.definitions_on(&mut conn, ids).await
    }

    /// The version `order` runs under, as operators see it
    /// ([`Definition::label`]); `None` for an order without a stored
    /// definition (or when Postgres cannot say).
    pub async fn version_of(&self, order: &sas_core::model::OrderRow) -> Option<String> {
        let found = self.definitions(order.definition).await.ok()?;
        found.first().map(|(_, d)| d.label())
    }

    /// [`Self::definitions`] on `conn`.
    pub(super) async fn definitions_on(
        &self,
        conn: &mut Conn,
        ids: impl IntoIterator<Item = Uuid>,
    ) -> Result<Definitions, StoreError> {
        let mut found = Vec::new();
        let mut missing = Vec::new();
        for id in ids {
            if found.iter().any(|(d, _)| *d == id) || missing.contains(&id) {
                continue;
            }
            match self.definitions.get(id) {
                Some(Some(d)) => found.push((id, d)),
                Some(None) => {}
                None => missing.push(id),
            }
        }
        if missing.is_empty() {
            return Ok(found);
        }
        let rows: Vec<(Uuid, String, serde_json::Value)> = conn
            .run(|c| {
                sqlx::query_as("SELECT id, workflow, spec FROM definitions WHERE id = ANY($1)")
                    .bind(&missing)
                    .fetch_all(c)
            })
            .await?;
        for (id, workflow, spec) in rows {
            // One this build cannot read (written by a newer sas, during a
            // rolling upgrade) is as none: its orders follow this process's
            // configuration rather than fail every transition.
            let spec = match serde_json::from_value(spec) {
                Ok(spec) => spec,
                Err(e) => {
                    tracing::warn!(definition = %id, %workflow, error = %e, "a stored definition this build cannot read; its orders follow the configuration here");
                    continue;
                }
            };
            let definition = Arc::new(Definition { workflow, spec });
            self.definitions.put(id, Some(definition.clone()));
            found.push((id, definition));
        }
        for id in missing {
            if !found.iter().any(|(d, _)| *d == id) {
                self.definitions.put(id, None);
            }
        }
        Ok(found)
    }
}

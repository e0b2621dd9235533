//! A database per deployment on one Postgres server, so that deployments
//! never see each other's orders.

use anyhow::Context as _;
use sqlx::Connection as _;

/// A Postgres server, reached through its `postgres` database.
#[derive(Debug, Clone)]
pub struct Postgres {
    /// `postgres://…/postgres`: where databases are created and dropped.
    pub admin_url: String,
}

impl Postgres {
    pub fn new(admin_url: impl Into<String>) -> Self {
        Self {
            admin_url: admin_url.into(),
        }
    }

    /// The URL of database `name` on this server.
    pub fn url_of(&self, name: &str) -> String {
        match self.admin_url.rsplit_once('/') {
            Some((base, _)) => format!("{base}/{name}"),
            None => format!("{}/{name}", self.admin_url),
        }
    }

    /// Creates an empty database `name` (dropping a leftover of that name);
    /// its URL.
    pub async fn create(&self, name: &str) -> anyhow::Result<String> {
        let mut admin = self.admin().await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop_statement(name)))
            .execute(&mut admin)
            .await
            .with_context(|| format!("dropping a leftover database {name}"))?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut admin)
            .await
            .with_context(|| format!("creating database {name}"))?;
        admin.close().await.ok();
        Ok(self.url_of(name))
    }

    /// Creates database `name` like [`Postgres::create`], with sas's tables:
    /// migrated once here, so that services starting together do not race
    /// on an empty database.
    pub async fn create_migrated(&self, name: &str) -> anyhow::Result<String> {
        let url = self.create(name).await?;
        let store = sas::state_store::StateStore::connect(
            &sas::config::DatabaseSettings {
                url: url.clone(),
                max_connections: 2,
                ..Default::default()
            },
            "sas-testkit",
        )
        .await
        .with_context(|| format!("migrating database {name}"))?;
        store.close().await;
        Ok(url)
    }

    /// Drops database `name`, disconnecting whoever is still on it.
    pub async fn drop(&self, name: &str) -> anyhow::Result<()> {
        let mut admin = self.admin().await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop_statement(name)))
            .execute(&mut admin)
            .await
            .with_context(|| format!("dropping database {name}"))?;
        admin.close().await.ok();
        Ok(())
    }

    async fn admin(&self) -> anyhow::Result<sqlx::PgConnection> {
        sqlx::PgConnection::connect(&self.admin_url)
            .await
            .with_context(|| format!("connecting to Postgres at {}", self.admin_url))
    }
}

fn drop_statement(name: &str) -> String {
    format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")
}

//! The shared breaker's transitions ([`breaker`]): the store loads an
//! agent's breaker row and writes it back guarded; the rule decides.

use sas_store::{StateStore, StoreError};

use crate::rules::breaker::{self, Breaker, State};

/// The breaker's transitions, over the state store.
#[allow(async_fn_in_trait)]
pub trait Breakers {
    /// A transient failure of a call to `agent`'s remote, seen by `instance`
    /// ([`breaker::failed`]).
    async fn breaker_failed(
        &self,
        agent: &str,
        instance: &str,
    ) -> Result<Option<Breaker>, StoreError>;
    /// An answer from `agent`'s remote that shows it works
    /// ([`breaker::succeeded`]).
    async fn breaker_succeeded(
        &self,
        agent: &str,
        instance: &str,
    ) -> Result<Option<Breaker>, StoreError>;
    /// `agent`'s breaker, after starting a probe with its oldest held order
    /// if one is due ([`breaker::probe`]).
    async fn sync_breaker(
        &self,
        agent: &str,
        instance: &str,
    ) -> Result<Option<Breaker>, StoreError>;
    /// An operator forces `agent`'s breaker open or closed, or (`None`)
    /// lets it decide again ([`breaker::force`]); logged under `operator`.
    /// Creates the breaker if the agent has none yet.
    async fn force_breaker(
        &self,
        agent: &str,
        to: Option<State>,
        operator: &str,
    ) -> Result<Breaker, StoreError>;
}

impl Breakers for StateStore {
    /// A transient failure of a call to `agent`'s remote, seen by `instance`
    /// ([`breaker::failed`]).
    async fn breaker_failed(
        &self,
        agent: &str,
        instance: &str,
    ) -> Result<Option<Breaker>, StoreError> {
        self.change_breaker(
            agent,
            instance,
            "consecutive transient failures",
            |b, _, now| Some(breaker::failed(b, now)),
        )
        .await
    }

    /// An answer from `agent`'s remote that shows it works
    /// ([`breaker::succeeded`]).
    async fn breaker_succeeded(
        &self,
        agent: &str,
        instance: &str,
    ) -> Result<Option<Breaker>, StoreError> {
        self.change_breaker(agent, instance, "the remote answered", |b, _, _| {
            breaker::succeeded(b)
        })
        .await
    }

    /// `agent`'s breaker, after starting a probe with its oldest held order
    /// if one is due ([`breaker::probe`]).
    async fn sync_breaker(
        &self,
        agent: &str,
        instance: &str,
    ) -> Result<Option<Breaker>, StoreError> {
        self.change_breaker(agent, instance, "cool-down over: probing", breaker::probe)
            .await
    }

    /// An operator forces `agent`'s breaker open or closed, or (`None`)
    /// lets it decide again ([`breaker::force`]); logged under `operator`.
    /// Creates the breaker if the agent has none yet.
    async fn force_breaker(
        &self,
        agent: &str,
        to: Option<State>,
        operator: &str,
    ) -> Result<Breaker, StoreError> {
        self.ensure_breaker(agent).await?;
        let reason = match to {
            Some(State::Open) => "forced open by an operator",
            Some(_) => "forced closed by an operator",
            None => "released by an operator",
        };
        let forced = self
            .change_breaker(agent, operator, reason, |b, _, now| {
                Some(breaker::force(b, to, now))
            })
            .await?;
        forced.ok_or_else(|| StoreError::WriteBackRefused(format!("breaker {agent} vanished")))
    }
}

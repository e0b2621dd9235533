//! Signals (contract §4d): `<prefix>.signals` → the order's step waiting
//! for the signal completes with its `data` ([`Transitions::signal`]) →
//! ack. A signal that cannot be applied (malformed, an unknown order, or
//! one no step waits for now) is copied to `<prefix>.signals.dead` with
//! the reason in `x-sas-reason`, counted, and acknowledged: it is never
//! kept to be applied later by surprise.

use std::sync::Arc;

use sas::broker::{self, BrokerError, Received, Verdict};
use sas::engine::{Actor, Operated};
use sas::messages::{Quoted, RejectReason, decode_signal};
use sas::metrics::labels;
use sas::pipeline::Pipeline;
use sas::service::Context;
use sas::state_store::StoreError;
use tracing::Instrument;

/// Serves signals.
pub struct Signaller {
    /// The intake's: what the order does next is published at once.
    pub pipeline: Pipeline,
    pub ctx: Arc<Context>,
    /// Who signals, in the event log: the submission instance.
    pub actor: Actor,
}

impl Signaller {
    /// Handles one signal; an error means the broker is gone (the signal
    /// comes again; once applied, again is refused: nothing waits for it).
    pub async fn handle(&self, delivery: Received) -> Result<(), BrokerError> {
        // With applications configured (contract §1b), only an
        // application's, and only to its own orders: its ids map into its
        // own namespace, where no other application's order is.
        let sender = match self
            .ctx
            .applications
            .identify_sender(delivery.user_id(), delivery.carried_sender().as_deref())
        {
            Ok(sender) => sender,
            Err(unknown) => {
                return self
                    .reject(&delivery, &RejectReason::UnknownApplication(unknown))
                    .await;
            }
        };
        let max = self.ctx.settings.submission.max_body_bytes;
        let signal = match decode_signal(delivery.body(), max) {
            Ok(signal) => signal,
            Err(reason) => return self.reject(&delivery, &reason).await,
        };
        let given = signal.order_id;
        let order_id = sender.map_or(given, |app| app.order_id(given));
        let span = tracing::info_span!("signal", %order_id, signal = %signal.signal);
        async {
            let outcome = self
                .pipeline
                .signal(&self.actor, order_id, &signal.signal, &signal.data)
                .await;
            self.settle(&delivery, given, outcome).await
        }
        .instrument(span)
        .await
    }

    /// Acknowledges a signal applied, or refuses it with why.
    async fn settle(
        &self,
        delivery: &Received,
        given: uuid::Uuid,
        outcome: Result<Operated, StoreError>,
    ) -> Result<(), BrokerError> {
        match outcome {
            Ok(Operated::Done(state)) => {
                tracing::info!(%state, "signal applied");
                self.count("applied");
                broker::ack(delivery).await
            }
            Ok(Operated::NotAllowed(state, why)) => {
                let reason = RejectReason::NotWaiting {
                    order_id: given,
                    state: state.as_str(),
                    why,
                };
                self.reject(delivery, &reason).await
            }
            Ok(Operated::NotFound) => {
                self.reject(delivery, &RejectReason::UnknownOrder(given))
                    .await
            }
            Ok(Operated::PayloadRefused(why)) => self.reject(delivery, &why).await,
            // A value the store cannot take is refused with its reason, not retried.
            Err(e) if e.is_refusal_of_input() => {
                let text = format!("the state store refused the signal: {e}");
                self.reject(delivery, &RejectReason::Internal(Quoted::new(&text)))
                    .await
            }
            Err(e) => self.store_failed(delivery, &e).await,
        }
    }

    /// Dead-letters the signal with its reason, and counts it.
    async fn reject(&self, delivery: &Received, reason: &RejectReason) -> Result<(), BrokerError> {
        tracing::warn!(reason = %reason, "signal refused; dead-lettered");
        self.count(reason.label());
        crate::refusal::refuse(delivery, reason).await
    }

    /// The state store failed: a transient failure hands the signal back
    /// after a pause; any other is retried a bounded number of times.
    async fn store_failed(&self, delivery: &Received, e: &StoreError) -> Result<(), BrokerError> {
        tracing::warn!(error = %e, transient = e.is_transient(), "could not apply a signal");
        Verdict::failed(e.is_transient(), || {
            format!("could not apply the signal: {e}")
        })
        .settle(delivery)
        .await
    }

    fn count(&self, outcome: &str) {
        self.ctx
            .metrics
            .signals
            .get_or_create(&labels(&[("outcome", outcome)]))
            .inc();
    }
}

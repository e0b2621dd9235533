//! Recurring orders (contract §4b): at each of its passes the leading
//! supervisor submits the due ticks' orders of every schedule
//! ([`sas::rules::schedule::due`]) through the ordinary submission, then
//! moves the schedule's mark on. The ids are the ticks' UUIDv5 in the
//! deployment's secret namespace, so a pass run twice (a leader's
//! hand-over) makes each order once, and no application can make it first.

use std::time::Duration;

use anyhow::Context as _;
use sas::config::Settings;
use sas::engine::Submitted;
use sas::pipeline::Pipeline;
use sas::rules::schedule::scheduled_order;
use sas::rules::schedule::{self, Schedule, ScheduleKey};
use sas::workflow::Workflow;
use tracing::Instrument as _;

/// The configured schedules with their workflows, compiled once.
pub struct Schedules {
    each: Vec<(Schedule, Workflow)>,
    /// A tick older than this when a pass first sees it was missed:
    /// two supervisor intervals, one for the pass and one for a leader's
    /// hand-over.
    late_after: Duration,
    /// The deployment's namespace of the ticks' ids, read once.
    key: tokio::sync::OnceCell<ScheduleKey>,
}

impl Schedules {
    /// Compiles the configured schedules (checked at start-up already).
    pub fn compile(settings: &Settings) -> anyhow::Result<Self> {
        let each = settings
            .compiled_schedules(chrono::Utc::now())?
            .into_iter()
            .map(|s| {
                let workflow = settings.workflow(&s.workflow)?;
                Ok((s, workflow))
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            each,
            late_after: settings.supervisor.interval * 2,
            key: tokio::sync::OnceCell::new(),
        })
    }

    /// One pass over every schedule; a failure of one is logged and the
    /// next pass tries it again.
    pub async fn pass(&self, pipeline: &Pipeline) {
        for (schedule, workflow) in &self.each {
            let span = tracing::info_span!("schedule", schedule = %schedule.name);
            if let Err(e) = self
                .pass_one(schedule, workflow, pipeline)
                .instrument(span)
                .await
            {
                tracing::warn!(schedule = %schedule.name, error = format!("{e:#}"), "schedule pass failed; will retry");
            }
        }
    }

    async fn pass_one(
        &self,
        schedule: &Schedule,
        workflow: &Workflow,
        pipeline: &Pipeline,
    ) -> anyhow::Result<()> {
        let store = pipeline.store();
        let key = *self
            .key
            .get_or_try_init(|| store.schedule_key())
            .await
            .context("reading the schedules' key")?;
        let (mark, now) = store.schedule_mark(&schedule.name).await?;
        let due = schedule::due(schedule, mark, now, self.late_after)?;
        let mut last_order = None;
        for &tick in &due.ticks {
            let order_id = schedule::order_id(key, &schedule.name, tick);
            let span = tracing::info_span!("tick", %order_id, %tick);
            // The tick's span is the order's root, as a submission's is.
            let order = scheduled_order(key, schedule, tick, &sas::telemetry::hop(&span, None));
            let submitted = pipeline
                .submit(&order, workflow)
                .instrument(span.clone())
                .await
                .context("submitting the tick's order")?;
            span.in_scope(|| match submitted {
                Submitted::Created { .. } => tracing::info!("scheduled order submitted"),
                Submitted::Duplicate => tracing::debug!("scheduled order exists already"),
            });
            last_order = Some(order.order_id);
        }
        if due.passed_over > 0 {
            tracing::info!(
                passed_over = due.passed_over,
                catch_up = schedule.catch_up.as_str(),
                "missed ticks passed over"
            );
        }
        if mark != Some(due.mark)
            && !store
                .move_schedule_mark(&schedule.name, mark, due.mark, last_order)
                .await?
        {
            tracing::debug!("another pass moved the mark first");
        }
        Ok(())
    }
}

//! Logging through `tracing`: pretty or JSON lines on stderr, filtered by
//! `log.level` unless `RUST_LOG` is set. Spans carry `order_id`, `step` and `attempt`.
//!
//! With an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT` or
//! `telemetry.endpoint`) the spans are also exported over OTLP/HTTP:
//! `submit` (submission), `transition` (every decision on an order, in
//! whichever process takes it), `step` and `remote_call` (agent) and
//! `reply` (scheduler), each a child of the hop that sent its message
//! (`traceparent`), so that one order is one trace. Off, no span is
//! created for export and nothing changes in what sas sends.

mod escape;

use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

use crate::config::{LogFormat, LogSettings, TelemetrySettings};
use crate::trace::TraceContext;

/// Whether spans are exported: only then do the services make the spans
/// that exist for export alone.
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// The exporter, flushed and stopped by [`Telemetry::shutdown`].
#[must_use = "shut it down at exit, or the last spans are lost"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Exports what is left and stops the exporter.
    pub fn shutdown(self) {
        if let Some(provider) = self.provider
            && let Err(e) = provider.shutdown()
        {
            tracing::warn!(error = %e, "the last spans could not be exported");
        }
    }
}

/// Installs the global subscriber, logging only; a second call does nothing.
pub fn init(settings: &LogSettings) {
    let _ = install(settings, None);
}

/// Installs the global subscriber, and exports `service`'s spans when an
/// endpoint is configured (the `OTEL_*` variables win over `telemetry`).
pub fn init_with_export(
    settings: &LogSettings,
    telemetry: &TelemetrySettings,
    service: &str,
) -> Telemetry {
    let provider = match exporter(telemetry, service) {
        Ok(provider) => provider,
        Err(e) => {
            eprintln!("{service}: OpenTelemetry export is off: {e}");
            None
        }
    };
    let tracer = provider.as_ref().map(|p| p.tracer("sas"));
    if install(settings, tracer) && provider.is_some() {
        EXPORTING.store(true, Ordering::Relaxed);
    }
    Telemetry { provider }
}

/// The span exporter, if an endpoint is set.
fn exporter(
    telemetry: &TelemetrySettings,
    service: &str,
) -> Result<Option<SdkTracerProvider>, opentelemetry_otlp::ExporterBuildError> {
    let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
    let from_env = set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    let mut builder = opentelemetry_otlp::SpanExporter::builder().with_http();
    if !from_env {
        let Some(base) = telemetry
            .endpoint
            .as_deref()
            .filter(|e| !e.trim().is_empty())
        else {
            return Ok(None);
        };
        // As the variable's base URL: the signal's path is appended.
        builder = builder.with_endpoint(format!("{}/v1/traces", base.trim_end_matches('/')));
    }
    let exporter = builder.build()?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if !set("OTEL_SERVICE_NAME") {
        resource = resource.with_service_name(
            telemetry
                .service_name
                .clone()
                .unwrap_or_else(|| service.to_owned()),
        );
    }
    Ok(Some(
        SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build())
            .build(),
    ))
}

/// Installs the subscriber: the log lines, and the export when `tracer`.
/// `false` when one was installed already.
fn install(settings: &LogSettings, tracer: Option<opentelemetry_sdk::trace::SdkTracer>) -> bool {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&settings.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let lines = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(false);
    let lines = match settings.format {
        LogFormat::Json => lines
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_filter(filter)
            .boxed(),
        // JSON escapes every field; the pretty format's own writer does not.
        LogFormat::Pretty => lines
            .compact()
            .fmt_fields(escape::fields())
            .with_filter(filter)
            .boxed(),
    };
    // The spans are exported whatever level the log lines are kept at.
    let export = tracer.map(|t| {
        tracing_opentelemetry::layer()
            .with_tracer(t)
            .with_filter(tracing_subscriber::filter::LevelFilter::INFO)
    });
    tracing_subscriber::registry()
        .with(lines)
        .with(export)
        .try_init()
        .is_ok()
}

/// Whether spans are exported.
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// Makes `span` a child of the remote span `parent` (the hop that sent the
/// message it handles), so that its export nests under it.
pub fn continue_trace(span: &tracing::Span, parent: &TraceContext) {
    if !exporting() {
        return;
    }
    let (Ok(trace_id), Ok(span_id)) = (
        TraceId::from_hex(&parent.trace_id),
        SpanId::from_hex(&parent.span_id),
    ) else {
        return;
    };
    let remote = SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    );
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
}

/// The `traceparent` of a transition of order `order_id`, now in `state`,
/// when spans are exported: a `transition` span, a child of the order's
/// root span (`trace_id` and `root_span`, its submission's), that the
/// messages the transition sends continue. `None` when nothing is exported.
pub fn transition(
    order_id: uuid::Uuid,
    state: &str,
    trace_id: Option<&str>,
    root_span: Option<&str>,
) -> Option<String> {
    if !exporting() {
        return None;
    }
    let span = tracing::info_span!("transition", %order_id, state);
    if let (Some(trace_id), Some(span_id)) = (trace_id, root_span) {
        let root = TraceContext {
            trace_id: trace_id.to_owned(),
            span_id: span_id.to_owned(),
        };
        continue_trace(&span, &root);
    }
    Some(hop(&span, trace_id).to_string())
}

/// The `traceparent` that `span` sends to the next hop: its own span in the
/// exported trace; when nothing is exported, a new span id of `trace_id`
/// (a new trace when there is none).
pub fn hop(span: &tracing::Span, trace_id: Option<&str>) -> TraceContext {
    if exporting() {
        let cx = span.context();
        let own = cx.span().span_context().clone();
        if own.is_valid() {
            return TraceContext {
                trace_id: own.trace_id().to_string(),
                span_id: own.span_id().to_string(),
            };
        }
    }
    trace_id
        .and_then(TraceContext::child_of)
        .unwrap_or_else(TraceContext::new_root)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_an_endpoint_nothing_is_exported() {
        let off = TelemetrySettings::default();
        if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_none()
            && std::env::var_os("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_none()
        {
            assert!(matches!(exporter(&off, "t"), Ok(None)));
        }
        // And the hops go on as without OpenTelemetry: same trace, new span.
        let trace = TraceContext::new_root();
        let next = hop(&tracing::Span::none(), Some(&trace.trace_id));
        assert_eq!(next.trace_id, trace.trace_id);
        assert_ne!(next.span_id, trace.span_id);
    }
}

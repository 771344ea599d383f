//! Traces over OTLP/HTTP (`[telemetry] otlp_endpoint`). The spans are the `tracing` spans the
//! request path has already: `request` (one a request: method, redacted path, upstream, class,
//! action, key source, tool, outcome, status) and `attempt` (one an attempt of a write: action,
//! attempt number, upstream, tool, outcome), exported by `tracing-opentelemetry`. A caller's
//! W3C `traceparent` makes its span their parent. No credential, header value or body is ever
//! a span field.
//!
//! Off unless configured: then no layer is installed, the spans stay at debug level and cost
//! what a disabled `tracing` callsite costs.

use http::HeaderMap;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::FilterFn;
use tracing_subscriber::Layer;

use crate::config::TelemetryConfig;

/// The exporter's provider, kept to flush what is left at shutdown.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

/// The layer that exports oncegate's spans to `endpoint`, and its [`Telemetry`] handle. Must be
/// called within the tokio runtime the exporter is to run on.
pub fn layer<S>(
    config: &TelemetryConfig,
    endpoint: &str,
) -> Result<(impl Layer<S>, Telemetry), String>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(format!("{endpoint}/v1/traces"))
        .build()
        .map_err(|e| format!("telemetry.otlp_endpoint: {e}"))?;
    let processor =
        opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
            exporter,
            opentelemetry_sdk::runtime::Tokio,
        )
        .build();
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(config.service_name.clone())
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("oncegate");
    // oncegate's own spans only (never a dependency's, never an event: the log lines stay logs).
    let ours = FilterFn::new(|meta| meta.is_span() && meta.target().starts_with("oncegate"));
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(ours);
    Ok((layer, Telemetry { provider }))
}

impl Telemetry {
    /// Exports the spans still held, then stops the exporter.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "telemetry: spans left unexported at shutdown");
        }
    }
}

/// The W3C trace context headers of a request, read as the propagator asks.
struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Makes the caller's span (a `traceparent` header) the parent of `span`. Without telemetry the
/// span is disabled and this returns at once.
pub fn continue_trace(span: &tracing::Span, headers: &HeaderMap) {
    if span.is_disabled() || !headers.contains_key("traceparent") {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&Headers(headers));
    let _ = span.set_parent(cx);
}

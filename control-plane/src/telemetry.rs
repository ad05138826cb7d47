//! Logging and tracing: plain `tracing` logs to stderr, plus OpenTelemetry spans exported over
//! OTLP/gRPC when an endpoint is configured.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Flushes and stops the exporter when dropped.
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take()
            && let Err(e) = p.shutdown()
        {
            eprintln!("flushing traces failed: {e}");
        }
    }
}

/// Sets up the global subscriber. `default_filter` applies when `RUST_LOG` is unset.
pub fn init(
    service: &str,
    default_filter: &str,
    otlp_endpoint: Option<&str>,
) -> anyhow::Result<TelemetryGuard> {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(false);
    let Some(endpoint) = otlp_endpoint else {
        tracing_subscriber::registry()
            .with(filter)
            .with(fmt)
            .try_init()?;
        return Ok(TelemetryGuard { provider: None });
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            Resource::builder()
                .with_service_name(service.to_owned())
                .build(),
        )
        .build();
    let tracer = provider.tracer("gpu-control-plane");
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(tracing_opentelemetry::layer().with_tracer(tracer))
        .try_init()?;
    Ok(TelemetryGuard {
        provider: Some(provider),
    })
}

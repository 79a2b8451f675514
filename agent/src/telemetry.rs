//! The agent's own telemetry: the counters and gauges of [`Metrics`], as Prometheus text on the
//! admin endpoint (`/metrics`), over OTLP through the OpenTelemetry metrics SDK, both, or neither,
//! as `OTEL_METRICS_EXPORTER` says, the way the Collector reports on itself.
//!
//! Over OTLP each counter is an observable counter (its `_total` suffix dropped: OTLP marks sums
//! as monotonic, and a Prometheus exporter downstream adds the suffix back), each gauge an
//! observable gauge, read when the SDK's periodic reader collects (`OTEL_METRIC_EXPORT_INTERVAL`).
//! The exporter is `opentelemetry-otlp`'s, given the agent's own connections: the same rustls
//! configuration as span export (`OTEL_EXPORTER_OTLP_METRICS_*` variables, else the general ones),
//! over a hyper client for OTLP/HTTP and a tonic channel for gRPC, both running on the agent's
//! runtime. The SDK's reader runs on a thread of its own and only waits on them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry::KeyValue;
use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _, WithTonicConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::data::ResourceMetrics;
use opentelemetry_sdk::metrics::exporter::PushMetricExporter;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider, Temporality};

use crate::config_error::ConfigError;
use crate::export::settings::{self, Compression, Endpoint, ExportSettings, Protocol, Signal};
use crate::export::{RateLimitedLog, tls};
use crate::metrics::{self, DESCRIPTORS, MetricKind, Metrics};

/// `OTEL_METRICS_EXPORTER` and `OTEL_METRIC_EXPORT_INTERVAL`, with the OTLP settings of metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetrySettings {
    /// `/metrics` serves the Prometheus text.
    pub prometheus: bool,
    /// Metrics go over OTLP with these settings.
    pub otlp: Option<ExportSettings>,
    /// Time between OTLP exports.
    pub interval: Duration,
}

/// Parses the telemetry variables.
pub fn parse(get: &dyn Fn(&str) -> Option<String>) -> Result<TelemetrySettings, ConfigError> {
    let read = |var: &'static str| get(var).filter(|v| !v.trim().is_empty());
    let exporters = read("OTEL_METRICS_EXPORTER").unwrap_or_else(|| "prometheus".to_owned());
    let (mut prometheus, mut otlp) = (false, false);
    let names: Vec<&str> = exporters.split(',').map(str::trim).collect();
    for name in &names {
        match *name {
            "prometheus" => prometheus = true,
            "otlp" => otlp = true,
            "none" if names.len() == 1 => {}
            _ => {
                return Err(ConfigError::new(
                    "OTEL_METRICS_EXPORTER",
                    &exporters,
                    "prometheus, otlp, both separated by a comma, or none",
                ));
            }
        }
    }
    let interval = match read("OTEL_METRIC_EXPORT_INTERVAL") {
        None => Duration::from_mins(1),
        Some(v) => match v.trim().parse::<u64>() {
            Ok(ms) if ms > 0 => Duration::from_millis(ms),
            _ => {
                return Err(ConfigError::new(
                    "OTEL_METRIC_EXPORT_INTERVAL",
                    &v,
                    "a positive whole number of milliseconds",
                ));
            }
        },
    };
    let otlp = if otlp { Some(settings::parse(Signal::Metrics, get)?) } else { None };
    Ok(TelemetrySettings { prometheus, otlp, interval })
}

/// The OTLP side, checked at start: endpoint resolved and TLS files read.
pub struct Prepared {
    endpoint: Endpoint,
    settings: ExportSettings,
    tls_config: rustls::ClientConfig,
    interval: Duration,
}

impl Prepared {
    /// `None` unless metrics go over OTLP. A TLS file that cannot be used is an error here.
    pub fn new(telemetry: &TelemetrySettings) -> Result<Option<Self>, ConfigError> {
        let Some(settings) = &telemetry.otlp else { return Ok(None) };
        // No endpoint anywhere: the OTLP default, on this host.
        let endpoint = settings.endpoint.clone().unwrap_or_else(|| match settings.protocol {
            Protocol::HttpProtobuf => Endpoint {
                var: "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                tls: false,
                authority: "localhost:4318".into(),
                path: "/v1/metrics".into(),
            },
            Protocol::Grpc => Endpoint {
                var: "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                tls: false,
                authority: "localhost:4317".into(),
                path: "/".into(),
            },
        });
        let tls_config = if endpoint.tls { tls::client_config(&settings.tls)? } else { tls::plaintext_config() };
        Ok(Some(Self { endpoint, settings: settings.clone(), tls_config, interval: telemetry.interval }))
    }

    /// What the startup log says.
    #[must_use]
    pub fn describe(&self) -> String {
        self.endpoint.to_string()
    }

    /// Starts exporting `metrics` every interval; connections run on `runtime`.
    pub fn start(
        self,
        runtime: &tokio::runtime::Handle,
        resource: Vec<(String, String)>,
        metrics: &Arc<Metrics>,
    ) -> anyhow::Result<OwnTelemetry> {
        let exporter = match self.settings.protocol {
            Protocol::HttpProtobuf => {
                let client = RuntimeHttpClient::new(self.tls_config, runtime.clone(), self.settings.timeout);
                let mut builder = opentelemetry_otlp::MetricExporter::builder()
                    .with_http()
                    .with_http_client(client)
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .with_endpoint(self.endpoint.to_string())
                    .with_timeout(self.settings.timeout)
                    .with_headers(self.settings.headers.iter().cloned().collect::<HashMap<_, _>>());
                if self.settings.compression == Compression::Gzip {
                    builder = builder.with_compression(opentelemetry_otlp::Compression::Gzip);
                }
                builder.build()
            }
            Protocol::Grpc => {
                let connector = tls::http2_connector(self.tls_config);
                // The channel's worker runs on the agent's runtime.
                let _entered = runtime.enter();
                let channel = tonic::transport::Endpoint::from(self.endpoint.uri())
                    .timeout(self.settings.timeout)
                    .connect_with_connector_lazy(connector);
                let headers = self.settings.header_map();
                let mut builder = opentelemetry_otlp::MetricExporter::builder()
                    .with_tonic()
                    .with_channel(channel)
                    .with_timeout(self.settings.timeout)
                    .with_metadata(tonic::metadata::MetadataMap::from_headers(headers));
                if self.settings.compression == Compression::Gzip {
                    builder = builder.with_compression(opentelemetry_otlp::Compression::Gzip);
                }
                builder.build()
            }
        }
        .context("building the OTLP metrics exporter")?;
        let exporter = CountingExporter {
            inner: exporter,
            metrics: Arc::clone(metrics),
            endpoint: self.endpoint.to_string(),
            log: std::sync::Mutex::default(),
        };
        let reader = PeriodicReader::builder(exporter).with_interval(self.interval).build();
        let resource =
            Resource::builder_empty().with_attributes(resource.into_iter().map(|(k, v)| KeyValue::new(k, v))).build();
        let provider = SdkMeterProvider::builder().with_resource(resource).with_reader(reader).build();
        register(&provider, metrics);
        Ok(OwnTelemetry { provider })
    }
}

/// Observable instruments for every counter and gauge, and the tail decisions by policy.
fn register(provider: &SdkMeterProvider, metrics: &Arc<Metrics>) {
    let meter = provider.meter("tracetap");
    for descriptor in DESCRIPTORS {
        let m = Arc::clone(metrics);
        let read = descriptor.read;
        if descriptor.kind == MetricKind::Counter {
            let name = descriptor.name.strip_suffix("_total").unwrap_or(descriptor.name);
            meter
                .u64_observable_counter(name)
                .with_description(descriptor.help)
                .with_callback(move |o| o.observe(read(&m), &[]))
                .build();
        } else {
            meter
                .u64_observable_gauge(descriptor.name)
                .with_description(descriptor.help)
                .with_callback(move |o| o.observe(read(&m), &[]))
                .build();
        }
    }
    let m = Arc::clone(metrics);
    meter
        .u64_observable_counter("tracetap_tail_decisions")
        .with_description("Tail sampling decisions by deciding policy and outcome")
        .with_callback(move |o| {
            for (key, n) in m.tail_decisions() {
                let policy = key.policy_label().to_owned();
                o.observe(n, &[KeyValue::new("policy", policy), KeyValue::new("outcome", key.outcome_label())]);
            }
        })
        .build();
}

/// The running SDK; [`OwnTelemetry::shutdown`] exports one last time.
pub struct OwnTelemetry {
    provider: SdkMeterProvider,
}

impl OwnTelemetry {
    /// Flushes and stops. Blocks: call it off the runtime the exporter's connections use (the
    /// reader waits on them).
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "the last export of the agent's own metrics failed");
        }
    }
}

/// The OTLP exporter, with its failures counted and logged: the SDK's own error reports are not
/// compiled in (its `internal-logs` feature would route every SDK message through `tracing`).
struct CountingExporter {
    inner: opentelemetry_otlp::MetricExporter,
    metrics: Arc<Metrics>,
    endpoint: String,
    log: std::sync::Mutex<RateLimitedLog>,
}

impl PushMetricExporter for CountingExporter {
    async fn export(&self, resource_metrics: &ResourceMetrics) -> OTelSdkResult {
        let result = self.inner.export(resource_metrics).await;
        if let Err(e) = &result {
            metrics::add(&self.metrics.metrics_export_failures, 1);
            if let Ok(mut log) = self.log.lock() {
                log.warn(&format!("export of the agent's own metrics to {} failed: {e}", self.endpoint));
            }
        }
        result
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn temporality(&self) -> Temporality {
        self.inner.temporality()
    }
}

/// `opentelemetry-otlp`'s HTTP client, made of the agent's: the SDK's reader thread hands each
/// request to the agent's runtime and waits for the answer.
#[derive(Debug)]
struct RuntimeHttpClient {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    runtime: tokio::runtime::Handle,
    timeout: Duration,
}

impl RuntimeHttpClient {
    fn new(tls_config: rustls::ClientConfig, runtime: tokio::runtime::Handle, timeout: Duration) -> Self {
        Self { client: Client::builder(TokioExecutor::new()).build(tls::http1_connector(tls_config)), runtime, timeout }
    }
}

/// Bytes of a collector's answer read at most.
const MAX_RESPONSE_BYTES: usize = 64 * 1024;

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for RuntimeHttpClient {
    async fn send_bytes(
        &self,
        request: hyper::Request<Bytes>,
    ) -> Result<hyper::Response<Bytes>, opentelemetry_http::HttpError> {
        let (client, timeout) = (self.client.clone(), self.timeout);
        let exchange = async move {
            let response = client.request(request.map(Full::new)).await?;
            let (parts, body) = response.into_parts();
            let body = Limited::new(body, MAX_RESPONSE_BYTES).collect().await?.to_bytes();
            Ok::<_, opentelemetry_http::HttpError>(hyper::Response::from_parts(parts, body))
        };
        // The whole exchange, body included, within the timeout: a collector that stalls after
        // its headers must not hold the SDK's reader thread.
        let answer = self.runtime.spawn(async move {
            tokio::time::timeout(timeout, exchange).await.map_err(|_| format!("no answer within {timeout:?}"))?
        });
        answer.await?
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn parse_map(pairs: &[(&str, &str)]) -> Result<TelemetrySettings, ConfigError> {
        let map: BTreeMap<String, String> = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        parse(&|k| map.get(k).cloned())
    }

    #[test]
    fn prometheus_by_default_and_otlp_when_asked() {
        let t = parse_map(&[]).unwrap();
        assert!(t.prometheus && t.otlp.is_none());
        assert_eq!(t.interval, Duration::from_mins(1));
        let t = parse_map(&[
            ("OTEL_METRICS_EXPORTER", "otlp, prometheus"),
            ("OTEL_METRIC_EXPORT_INTERVAL", "500"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "grpc"),
        ])
        .unwrap();
        assert!(t.prometheus);
        assert_eq!(t.interval, Duration::from_millis(500));
        let otlp = t.otlp.unwrap();
        assert_eq!(otlp.protocol, Protocol::Grpc);
        assert_eq!(otlp.endpoint.unwrap().to_string(), "http://c:4318/");
        let t = parse_map(&[("OTEL_METRICS_EXPORTER", "otlp"), ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c")]).unwrap();
        assert!(!t.prometheus);
        assert_eq!(t.otlp.unwrap().endpoint.unwrap().to_string(), "http://c:80/v1/metrics");
        let t = parse_map(&[("OTEL_METRICS_EXPORTER", "none")]).unwrap();
        assert!(!t.prometheus && t.otlp.is_none());
    }

    #[test]
    fn bad_values_name_their_variable() {
        for (pairs, var) in [
            (vec![("OTEL_METRICS_EXPORTER", "statsd")], "OTEL_METRICS_EXPORTER"),
            (vec![("OTEL_METRICS_EXPORTER", "none,otlp")], "OTEL_METRICS_EXPORTER"),
            (vec![("OTEL_METRIC_EXPORT_INTERVAL", "0")], "OTEL_METRIC_EXPORT_INTERVAL"),
            (vec![("OTEL_METRIC_EXPORT_INTERVAL", "1m")], "OTEL_METRIC_EXPORT_INTERVAL"),
            (
                vec![("OTEL_METRICS_EXPORTER", "otlp"), ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "never")],
                "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT",
            ),
        ] {
            assert_eq!(parse_map(&pairs).unwrap_err().var, var, "{pairs:?}");
        }
    }
}

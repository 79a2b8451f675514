//! Export: a bounded queue of encoded batches between the capture thread (which batches and
//! encodes, see `batch`) and an async exporter that sends them over OTLP (HTTP or gRPC, TLS for
//! `https` endpoints), or prints their spans as JSON lines when no endpoint is configured.
//!
//! Nothing is lost silently: a full queue drops the batch and counts its spans; an export that
//! fails for good counts its spans as dropped; retries (see `retry`) and spans a collector
//! rejected (OTLP partial success) are counted too. A failed TLS handshake is retried until its
//! cause is fixed (a certificate renewed, a CA trusted), holding its batch while later ones wait
//! in the bounded queue: it is counted by cause and logged once per cause every 10 s at most, with
//! what to change (`tls_failure`), and `/readyz` says exports are failing and why.
//!
//! Nothing blocks the runtime, which also serves `/healthz`: gzip and the stdout sink's writes run
//! on the blocking pool, and the exporter sends one request at a time, so a slow destination backs
//! up into the queue, whose overflow is counted.

pub mod settings;
pub mod tls;
pub mod tls_failure;

mod grpc;
mod handshake_watch;
mod http;
mod retry;
mod rpc;
mod verifier;

use std::io::Write as _;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message as _;
use tokio::sync::mpsc;

use crate::config_error::ConfigError;
use crate::metrics::{self, Metrics};
use crate::pipeline::EncodedBatch;
use retry::Attempt;
use settings::{Compression, Endpoint, ExportSettings, Protocol};

/// The capture thread's end of the queue.
#[derive(Debug, Clone)]
pub struct BatchQueue {
    tx: mpsc::Sender<EncodedBatch>,
    metrics: Arc<Metrics>,
}

impl BatchQueue {
    /// Queues a batch without blocking; a full queue drops it and counts its spans.
    pub fn push(&self, batch: EncodedBatch) {
        let spans = batch.spans;
        if self.tx.try_send(batch).is_err() {
            metrics::add(&self.metrics.spans_dropped_queue_full, spans);
        }
    }

    /// Queues a batch, waiting for room (for the tail thread, never the capture thread). Fails
    /// only when the exporter is gone.
    pub fn push_waiting(&self, batch: EncodedBatch) -> Result<(), EncodedBatch> {
        self.tx.blocking_send(batch).map_err(|e| e.0)
    }
}

/// Creates the queue, sized so that at most `max_queue_spans` spans wait in full batches of
/// `batch_spans`; the receiver goes to [`run`].
#[must_use]
pub fn queue(
    max_queue_spans: usize,
    batch_spans: usize,
    metrics: Arc<Metrics>,
) -> (BatchQueue, mpsc::Receiver<EncodedBatch>) {
    let (tx, rx) = mpsc::channel((max_queue_spans / batch_spans.max(1)).max(1));
    (BatchQueue { tx, metrics }, rx)
}

/// Logs at most once per interval, counting what it held back.
#[derive(Debug, Default)]
pub struct RateLimitedLog {
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimitedLog {
    const INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

    pub fn warn(&mut self, msg: &str) {
        let now = Instant::now();
        if self.last.is_some_and(|t| now.duration_since(t) < Self::INTERVAL) {
            self.suppressed += 1;
            return;
        }
        tracing::warn!(suppressed = self.suppressed, "{msg}");
        self.last = Some(now);
        self.suppressed = 0;
    }
}

/// How requests reach the collector.
#[derive(Clone)]
enum Transport {
    Http(http::HttpTransport),
    Grpc(grpc::GrpcTransport),
}

impl Transport {
    /// One attempt, on its own task: a panic in a client library (tonic panics on some malformed
    /// answers) fails this export, not the exporter.
    async fn send(&self, body: Bytes) -> Attempt {
        let transport = self.clone();
        let attempt = tokio::spawn(async move {
            match &transport {
                Self::Http(t) => t.send(body).await,
                Self::Grpc(t) => t.send(body).await,
            }
        });
        attempt.await.unwrap_or_else(|e| Attempt::Permanent { reason: format!("the client failed: {e}") })
    }
}

/// Where batches go, ready to use: the settings checked and the TLS files read.
pub struct Destination(Inner);

enum Inner {
    Stdout,
    /// `gzip_body`: the exporter gzips the body (OTLP/HTTP; tonic compresses gRPC messages itself).
    Otlp {
        transport: Box<Transport>,
        endpoint: Endpoint,
        gzip_body: bool,
        hints: Box<tls_failure::Hints>,
    },
}

impl Destination {
    /// Prepares the destination the settings name. Reads the TLS files of an `https` endpoint, so
    /// a file that is missing or not what its variable should name is an error here, at start.
    pub fn new(settings: &ExportSettings) -> Result<Self, ConfigError> {
        let Some(endpoint) = &settings.endpoint else { return Ok(Self(Inner::Stdout)) };
        // The connector wants one even for an `http` endpoint, where it is never used.
        let tls_config = if endpoint.tls { tls::client_config(&settings.tls)? } else { tls::plaintext_config() };
        let transport = match settings.protocol {
            Protocol::HttpProtobuf => Transport::Http(http::HttpTransport::new(endpoint, settings, tls_config)),
            Protocol::Grpc => Transport::Grpc(grpc::GrpcTransport::new(endpoint, settings, tls_config)),
        };
        let gzip_body = settings.compression == Compression::Gzip && settings.protocol == Protocol::HttpProtobuf;
        let hints = tls_failure::Hints { endpoint_var: endpoint.var, files: settings.tls.clone() };
        Ok(Self(Inner::Otlp {
            transport: Box::new(transport),
            endpoint: endpoint.clone(),
            gzip_body,
            hints: Box::new(hints),
        }))
    }

    /// What the startup log says.
    #[must_use]
    pub fn describe(&self) -> String {
        match &self.0 {
            Inner::Stdout => "stdout".to_owned(),
            Inner::Otlp { endpoint, .. } => endpoint.to_string(),
        }
    }
}

/// Runs the exporter until the queue's senders are gone and everything queued was exported.
/// Once `stopping` is set (the agent shuts down), a failed TLS handshake is no longer retried:
/// its batch is dropped and counted, so that the queue drains and nothing waits on it.
pub async fn run(
    destination: Destination,
    mut rx: mpsc::Receiver<EncodedBatch>,
    metrics: Arc<Metrics>,
    stopping: Arc<std::sync::atomic::AtomicBool>,
) {
    let mut failures = RateLimitedLog::default();
    let mut rejections = RateLimitedLog::default();
    let mut tls_report = None;
    while let Some(mut batch) = rx.recv().await {
        let delivered = batch.delivered.take();
        match &destination.0 {
            Inner::Stdout => {
                let metrics = Arc::clone(&metrics);
                // A slow log pipe blocks a pool thread, never the runtime.
                let _ = tokio::task::spawn_blocking(move || print_json(&batch, &metrics)).await;
            }
            Inner::Otlp { transport, endpoint, gzip_body, hints } => {
                let report = tls_report.get_or_insert_with(|| TlsReport::new(endpoint, hints));
                let spans = batch.spans;
                let body = if *gzip_body {
                    let raw = batch.body;
                    tokio::task::spawn_blocking(move || gzip(&raw)).await.expect("gzip does not panic")
                } else {
                    batch.body
                };
                match send_with_retries(transport, body, &metrics, report, &stopping).await {
                    Ok((rejected, message)) => {
                        metrics.set_export_failing(None);
                        metrics::add(&metrics.spans_exported, spans.saturating_sub(rejected));
                        if rejected > 0 {
                            metrics::add(&metrics.spans_rejected, rejected);
                            rejections.warn(&format!("{endpoint} rejected {rejected} of {spans} spans: {message}"));
                        } else if !message.is_empty() {
                            // A partial success with nothing rejected carries a warning.
                            rejections.warn(&format!("{endpoint} accepted {spans} spans with a warning: {message}"));
                        }
                    }
                    Err(reason) => {
                        metrics::add(&metrics.export_failures, 1);
                        metrics::add(&metrics.spans_dropped_export_failed, spans);
                        failures.warn(&format!("export of {spans} spans to {endpoint} failed: {reason}"));
                        metrics.set_export_failing(Some(reason));
                    }
                }
            }
        }
        if let Some(delivered) = delivered {
            delivered.done();
        }
    }
}

/// How often a TLS retry's wait looks whether the agent is stopping.
const STOP_CHECK: std::time::Duration = std::time::Duration::from_millis(100);

/// What the exporter says about failed TLS handshakes: each cause counted, logged at most every
/// 10 s with its message, and shown on `/readyz` until an export succeeds.
struct TlsReport {
    endpoint: String,
    hints: tls_failure::Hints,
    logs: std::collections::BTreeMap<&'static str, RateLimitedLog>,
    failing: bool,
}

impl TlsReport {
    fn new(endpoint: &Endpoint, hints: &tls_failure::Hints) -> Self {
        Self {
            endpoint: endpoint.to_string(),
            hints: hints.clone(),
            logs: std::collections::BTreeMap::new(),
            failing: false,
        }
    }

    fn failed(&mut self, failure: &tls_failure::TlsFailure, metrics: &Metrics) {
        let reason = failure.reason();
        metrics.count_export_tls_failure(reason);
        let message = failure.message(&self.hints);
        self.logs.entry(reason).or_default().warn(&format!(
            "export to {} failed: {message} (retrying; spans wait in the export queue, and what overflows it is counted in tracetap_spans_dropped_queue_full_total)",
            self.endpoint
        ));
        metrics.set_export_failing(Some(message));
        self.failing = true;
    }

    fn succeeded(&mut self) {
        if std::mem::take(&mut self.failing) {
            tracing::info!(endpoint = %self.endpoint, "the TLS handshake with the collector succeeds again");
        }
    }
}

/// Sends one request, retrying as the specification says, and a failed TLS handshake until it
/// succeeds; the partial success on success.
async fn send_with_retries(
    transport: &Transport,
    body: Bytes,
    metrics: &Metrics,
    tls: &mut TlsReport,
    stopping: &std::sync::atomic::AtomicBool,
) -> Result<(u64, String), String> {
    let mut attempt = 1;
    let mut tls_attempt = 0;
    loop {
        match transport.send(body.clone()).await {
            Attempt::Accepted { rejected, message } => {
                tls.succeeded();
                return Ok((rejected, message));
            }
            Attempt::Tls(failure) => {
                tls.failed(&failure, metrics);
                if stopping.load(std::sync::atomic::Ordering::Relaxed) {
                    return Err(format!("{} (not retried: the agent is stopping)", failure.message(&tls.hints)));
                }
                metrics::add(&metrics.export_retries, 1);
                tls_attempt += 1;
                // In short steps, so that a shutdown does not wait out a long backoff.
                let until = tokio::time::Instant::now() + retry::wait_before_next(tls_attempt, None);
                while tokio::time::Instant::now() < until && !stopping.load(std::sync::atomic::Ordering::Relaxed) {
                    tokio::time::sleep_until(until.min(tokio::time::Instant::now() + STOP_CHECK)).await;
                }
            }
            Attempt::Retryable { reason, after } if attempt < retry::MAX_ATTEMPTS => {
                tracing::debug!(attempt, %reason, "export failed, retrying");
                metrics::add(&metrics.export_retries, 1);
                tokio::time::sleep(retry::wait_before_next(attempt, after)).await;
                attempt += 1;
            }
            Attempt::Retryable { reason, .. } => {
                return Err(format!("{reason} (gave up after {} attempts)", retry::MAX_ATTEMPTS));
            }
            Attempt::Permanent { reason } => return Err(reason),
        }
    }
}

/// The stdout sink: one JSON object per span (`{"resource": ..., "span": ...}`), in the OTLP JSON
/// mapping. For laptops and demos, so it decodes the batch back rather than having a path of its own.
fn print_json(batch: &EncodedBatch, metrics: &Metrics) {
    let Ok(request) = ExportTraceServiceRequest::decode(&batch.body[..]) else {
        metrics::add(&metrics.spans_dropped_export_failed, batch.spans);
        return;
    };
    let mut out = std::io::stdout().lock();
    for rs in request.resource_spans {
        for ss in rs.scope_spans {
            for span in ss.spans {
                let line = serde_json::json!({ "resource": rs.resource, "span": span });
                if writeln!(out, "{line}").is_ok() {
                    metrics::add(&metrics.spans_exported, 1);
                } else {
                    metrics::add(&metrics.spans_dropped_export_failed, 1);
                }
            }
        }
    }
    let _ = out.flush();
}

fn gzip(raw: &[u8]) -> Bytes {
    let mut gz = flate2::write::GzEncoder::new(Vec::with_capacity(raw.len() / 2), flate2::Compression::fast());
    gz.write_all(raw).expect("writing to a Vec cannot fail");
    Bytes::from(gz.finish().expect("writing to a Vec cannot fail"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gzip_body_round_trips() {
        use std::io::Read as _;
        let raw = ExportTraceServiceRequest::default().encode_to_vec();
        let body = gzip(&raw);
        let mut back = Vec::new();
        flate2::read::GzDecoder::new(&body[..]).read_to_end(&mut back).unwrap();
        assert_eq!(back, raw);
    }
}

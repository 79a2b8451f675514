//! Export: a bounded queue of encoded batches between the capture thread (which batches and
//! encodes, see `batch`) and an async exporter that sends them as OTLP/HTTP protobuf, or prints
//! their spans as JSON lines when no endpoint is configured.
//!
//! Nothing is lost silently: a full queue drops the batch and counts its spans; an export that
//! fails for good counts its spans as dropped; retries (OTLP spec: 429, 502, 503, 504 and
//! connection errors, with exponential backoff) are counted too.

use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message as _;
use tokio::sync::mpsc;

use crate::config::{Compression, Config, Endpoint, Sink};
use crate::metrics::{self, Metrics};
use crate::tail::engine::Delivery;

/// Most attempts for one export request.
const MAX_ATTEMPTS: u32 = 5;
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// An encoded `ExportTraceServiceRequest` and how many spans it holds.
#[derive(Debug)]
pub struct EncodedBatch {
    pub body: Bytes,
    pub spans: u64,
    /// Traces (exchanges) it holds, for counting what a full queue sheds.
    pub traces: u64,
    /// Told when the exporter is done with the batch (tail sampling's outbox).
    pub delivered: Option<Delivered>,
}

impl EncodedBatch {
    /// A batch nobody waits on.
    #[must_use]
    pub fn new(body: Bytes, spans: u64, traces: u64) -> Self {
        Self { body, spans, traces, delivered: None }
    }
}

/// Reports back to the tail thread that the exporter is done with a batch of kept traces: sent,
/// or failed for good (and counted as such). A batch dropped unreported stays in the outbox and
/// is exported again after a restart.
#[derive(Debug)]
pub struct Delivered {
    deliveries: Vec<Delivery>,
    tx: std::sync::mpsc::Sender<Vec<Delivery>>,
}

impl Delivered {
    #[must_use]
    pub fn new(deliveries: Vec<Delivery>, tx: std::sync::mpsc::Sender<Vec<Delivery>>) -> Self {
        Self { deliveries, tx }
    }

    fn done(self) {
        // The tail thread may be gone at shutdown; the outbox then re-exports at the next start.
        let _ = self.tx.send(self.deliveries);
    }
}

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

/// Resource attributes shared by every traced process (`service.name` first); `process.pid` is
/// added per process by the encoder.
#[must_use]
pub fn resource_attributes(config: &Config) -> Vec<(String, String)> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default();
    let mut attributes: Vec<(String, String)> =
        config.resource_attributes.iter().filter(|(k, _)| k != "service.name").cloned().collect();
    attributes.insert(0, ("service.name".to_owned(), config.service_name.clone()));
    if !host.is_empty() && !attributes.iter().any(|(k, _)| k == "host.name") {
        attributes.push(("host.name".to_owned(), host));
    }
    if let Some(node) = &config.node_name
        && !attributes.iter().any(|(k, _)| k == "k8s.node.name")
    {
        attributes.push(("k8s.node.name".to_owned(), node.clone()));
    }
    attributes
}

/// Logs at most once per interval, counting what it held back.
#[derive(Debug)]
struct RateLimitedLog {
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimitedLog {
    const INTERVAL: Duration = Duration::from_secs(10);

    fn warn(&mut self, msg: &str) {
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

enum Destination {
    Stdout,
    Otlp { client: Box<Client<HttpConnector, Full<Bytes>>>, uri: hyper::Uri, endpoint: Endpoint },
}

/// Runs the exporter until the queue's senders are gone and everything queued was exported.
pub async fn run(config: Config, mut rx: mpsc::Receiver<EncodedBatch>, metrics: Arc<Metrics>) {
    let destination = match &config.sink {
        Sink::Stdout => Destination::Stdout,
        Sink::OtlpHttp(endpoint) => {
            let uri: hyper::Uri = endpoint.to_string().parse().expect("validated by config");
            let client = Box::new(Client::builder(TokioExecutor::new()).build_http());
            Destination::Otlp { client, uri, endpoint: endpoint.clone() }
        }
    };
    let mut log = RateLimitedLog { last: None, suppressed: 0 };
    while let Some(batch) = rx.recv().await {
        export(&destination, &config, batch, &metrics, &mut log).await;
    }
}

async fn export(
    destination: &Destination,
    config: &Config,
    mut batch: EncodedBatch,
    metrics: &Metrics,
    log: &mut RateLimitedLog,
) {
    let delivered = batch.delivered.take();
    match destination {
        Destination::Stdout => print_json(&batch, metrics),
        Destination::Otlp { client, uri, endpoint } => {
            let body = match config.compression {
                Compression::None => batch.body,
                Compression::Gzip => gzip(&batch.body),
            };
            match send_with_retries(client, uri, config, body, metrics).await {
                Ok(()) => metrics::add(&metrics.spans_exported, batch.spans),
                Err(reason) => {
                    metrics::add(&metrics.export_failures, 1);
                    metrics::add(&metrics.spans_dropped_export_failed, batch.spans);
                    log.warn(&format!("export of {} spans to {endpoint} failed: {reason}", batch.spans));
                }
            }
        }
    }
    if let Some(delivered) = delivered {
        delivered.done();
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

async fn send_with_retries(
    client: &Client<HttpConnector, Full<Bytes>>,
    uri: &hyper::Uri,
    config: &Config,
    body: Bytes,
    metrics: &Metrics,
) -> Result<(), String> {
    let mut backoff = FIRST_BACKOFF;
    let mut attempt = 1;
    loop {
        let mut req = hyper::Request::post(uri.clone()).header("content-type", "application/x-protobuf");
        if config.compression == Compression::Gzip {
            req = req.header("content-encoding", "gzip");
        }
        for (k, v) in &config.export_headers {
            req = req.header(k.as_str(), v.as_str());
        }
        let req = req.body(Full::new(body.clone())).map_err(|e| format!("bad request: {e}"))?;
        let outcome = match tokio::time::timeout(config.export_timeout, client.request(req)).await {
            Err(_) => Err((true, format!("no answer within {:?}", config.export_timeout))),
            Ok(Err(e)) => Err((true, format!("connection error: {e}"))),
            Ok(Ok(resp)) => {
                let status = resp.status();
                let retry_after = resp
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<u64>().ok())
                    .map(Duration::from_secs);
                // Drain the body so the connection can be reused.
                let _ = resp.into_body().collect().await;
                if status.is_success() {
                    Ok(())
                } else {
                    let retryable = matches!(status.as_u16(), 429 | 502 | 503 | 504);
                    if let Some(after) = retry_after {
                        backoff = backoff.max(after.min(Duration::from_secs(30)));
                    }
                    Err((retryable, format!("HTTP {status}")))
                }
            }
        };
        match outcome {
            Ok(()) => return Ok(()),
            Err((true, reason)) if attempt < MAX_ATTEMPTS => {
                tracing::debug!(attempt, %reason, "export failed, retrying");
                metrics::add(&metrics.export_retries, 1);
                tokio::time::sleep(backoff).await;
                backoff *= 2;
                attempt += 1;
            }
            Err((_, reason)) => return Err(reason),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn resource_has_the_service_name_first() {
        let vars = BTreeMap::from([
            ("OTEL_SERVICE_NAME".to_owned(), "edge".to_owned()),
            ("OTEL_RESOURCE_ATTRIBUTES".to_owned(), "service.name=ignored,env=prod".to_owned()),
            ("NODE_NAME".to_owned(), "node-7".to_owned()),
        ]);
        let attrs = resource_attributes(&Config::from_map(&vars).unwrap());
        assert_eq!(attrs[0], ("service.name".to_owned(), "edge".to_owned()));
        assert!(attrs.contains(&("env".to_owned(), "prod".to_owned())));
        assert!(attrs.iter().any(|(k, _)| k == "host.name"));
        assert!(attrs.contains(&("k8s.node.name".to_owned(), "node-7".to_owned())));
    }

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

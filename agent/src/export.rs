//! Export: a bounded span queue between the capture thread and an async exporter that batches
//! spans (`OTEL_BSP_*`) and sends them as OTLP/HTTP protobuf, or prints them as JSON lines when no
//! endpoint is configured.
//!
//! Nothing is lost silently: a full queue drops the span and counts it; an export that fails for
//! good counts its spans as dropped; retries (OTLP spec: 429, 502, 503, 504 and connection errors,
//! with exponential backoff) are counted too.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::InstrumentationScope;
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};
use prost::Message as _;
use tokio::sync::mpsc;

use crate::config::{Compression, Config, Endpoint, Sink};
use crate::metrics::{self, Metrics};
use crate::spans::{SpanRecord, kv_int, kv_str};

/// Most attempts for one export request.
const MAX_ATTEMPTS: u32 = 5;
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// The capture thread's end of the queue.
#[derive(Debug, Clone)]
pub struct SpanQueue {
    tx: mpsc::Sender<SpanRecord>,
    metrics: Arc<Metrics>,
}

impl SpanQueue {
    /// Queues a span without blocking; a full queue drops it and counts the drop.
    pub fn push(&self, record: SpanRecord) {
        if self.tx.try_send(record).is_err() {
            metrics::add(&self.metrics.spans_dropped_queue_full, 1);
        }
    }
}

/// Creates the queue; the receiver goes to [`run`].
#[must_use]
pub fn queue(capacity: usize, metrics: Arc<Metrics>) -> (SpanQueue, mpsc::Receiver<SpanRecord>) {
    let (tx, rx) = mpsc::channel(capacity);
    (SpanQueue { tx, metrics }, rx)
}

/// Resource attributes shared by every traced process; `process.pid` is added per process.
#[derive(Debug, Clone)]
pub struct ResourceTemplate {
    attributes: Vec<(String, String)>,
}

impl ResourceTemplate {
    #[must_use]
    pub fn from_config(config: &Config) -> Self {
        let host =
            std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default();
        let mut attributes: Vec<(String, String)> =
            config.resource_attributes.iter().filter(|(k, _)| k != "service.name").cloned().collect();
        attributes.insert(0, ("service.name".to_owned(), config.service_name.clone()));
        if !host.is_empty() && !attributes.iter().any(|(k, _)| k == "host.name") {
            attributes.push(("host.name".to_owned(), host));
        }
        Self { attributes }
    }

    fn resource(&self, pid: u32) -> Resource {
        let mut attributes: Vec<_> = self.attributes.iter().map(|(k, v)| kv_str(k, v)).collect();
        attributes.push(kv_int("process.pid", i64::from(pid)));
        Resource { attributes, ..Resource::default() }
    }
}

/// Groups spans into one `ResourceSpans` per process.
#[must_use]
pub fn to_request(template: &ResourceTemplate, batch: Vec<SpanRecord>) -> ExportTraceServiceRequest {
    let mut by_pid: BTreeMap<u32, Vec<Span>> = BTreeMap::new();
    for record in batch {
        by_pid.entry(record.tgid).or_default().push(record.span);
    }
    ExportTraceServiceRequest {
        resource_spans: by_pid
            .into_iter()
            .map(|(pid, spans)| ResourceSpans {
                resource: Some(template.resource(pid)),
                scope_spans: vec![ScopeSpans {
                    scope: Some(InstrumentationScope {
                        name: "tracetap".to_owned(),
                        version: env!("CARGO_PKG_VERSION").to_owned(),
                        ..InstrumentationScope::default()
                    }),
                    spans,
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            })
            .collect(),
    }
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
pub async fn run(
    config: Config,
    template: ResourceTemplate,
    mut rx: mpsc::Receiver<SpanRecord>,
    metrics: Arc<Metrics>,
) {
    let destination = match &config.sink {
        Sink::Stdout => Destination::Stdout,
        Sink::OtlpHttp(endpoint) => {
            let uri: hyper::Uri = endpoint.to_string().parse().expect("validated by config");
            let client = Box::new(Client::builder(TokioExecutor::new()).build_http());
            Destination::Otlp { client, uri, endpoint: endpoint.clone() }
        }
    };
    let mut log = RateLimitedLog { last: None, suppressed: 0 };
    let mut batch = Vec::with_capacity(config.max_export_batch_size);
    let mut deadline = tokio::time::Instant::now() + config.schedule_delay;
    loop {
        let flush = tokio::select! {
            item = rx.recv() => if let Some(record) = item {
                batch.push(record);
                batch.len() >= config.max_export_batch_size
            } else {
                if !batch.is_empty() {
                    export(&destination, &config, &template, std::mem::take(&mut batch), &metrics, &mut log).await;
                }
                return;
            },
            () = tokio::time::sleep_until(deadline) => true,
        };
        if flush {
            if !batch.is_empty() {
                export(&destination, &config, &template, std::mem::take(&mut batch), &metrics, &mut log).await;
            }
            deadline = tokio::time::Instant::now() + config.schedule_delay;
        }
    }
}

async fn export(
    destination: &Destination,
    config: &Config,
    template: &ResourceTemplate,
    batch: Vec<SpanRecord>,
    metrics: &Metrics,
    log: &mut RateLimitedLog,
) {
    let count = batch.len() as u64;
    match destination {
        Destination::Stdout => {
            let mut out = std::io::stdout().lock();
            for record in batch {
                let line = serde_json::json!({
                    "resource": template.resource(record.tgid),
                    "span": record.span,
                });
                if writeln!(out, "{line}").is_err() {
                    metrics::add(&metrics.spans_dropped_export_failed, 1);
                    continue;
                }
                metrics::add(&metrics.spans_exported, 1);
            }
            let _ = out.flush();
        }
        Destination::Otlp { client, uri, endpoint } => {
            let body = encode_body(&to_request(template, batch), config.compression);
            match send_with_retries(client, uri, config, body, metrics).await {
                Ok(()) => metrics::add(&metrics.spans_exported, count),
                Err(reason) => {
                    metrics::add(&metrics.export_failures, 1);
                    metrics::add(&metrics.spans_dropped_export_failed, count);
                    log.warn(&format!("export of {count} spans to {endpoint} failed: {reason}"));
                }
            }
        }
    }
}

fn encode_body(request: &ExportTraceServiceRequest, compression: Compression) -> Bytes {
    let raw = request.encode_to_vec();
    match compression {
        Compression::None => Bytes::from(raw),
        Compression::Gzip => {
            let mut gz = flate2::write::GzEncoder::new(Vec::with_capacity(raw.len() / 2), flate2::Compression::fast());
            gz.write_all(&raw).expect("writing to a Vec cannot fail");
            Bytes::from(gz.finish().expect("writing to a Vec cannot fail"))
        }
    }
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
    use super::*;

    #[test]
    fn one_resource_per_process() {
        let config = Config::from_map(&BTreeMap::from([("OTEL_SERVICE_NAME".to_owned(), "edge".to_owned())])).unwrap();
        let template = ResourceTemplate::from_config(&config);
        let span = |tgid| SpanRecord { tgid, span: Span { name: "GET".into(), ..Span::default() } };
        let req = to_request(&template, vec![span(1), span(2), span(1)]);
        assert_eq!(req.resource_spans.len(), 2);
        assert_eq!(req.resource_spans[0].scope_spans[0].spans.len(), 2);
        let attrs = &req.resource_spans[1].resource.as_ref().unwrap().attributes;
        assert!(attrs.iter().any(|kv| kv.key == "service.name" && format!("{:?}", kv.value).contains("edge")));
        assert!(attrs.iter().any(|kv| kv.key == "process.pid" && format!("{:?}", kv.value).contains('2')));
    }

    #[test]
    fn gzip_body_round_trips() {
        use std::io::Read as _;
        let req = ExportTraceServiceRequest::default();
        let body = encode_body(&req, Compression::Gzip);
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(&body[..]).read_to_end(&mut raw).unwrap();
        assert_eq!(raw, req.encode_to_vec());
    }
}

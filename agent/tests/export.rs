//! The exporter against a local HTTP server that answers what the test says: retries on the
//! statuses the OTLP spec calls retryable, gives up (and counts) on the others, flushes on close.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};
use prost::Message as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tracetap::config::Config;
use tracetap::export::{self, Destination};
use tracetap::metrics::Metrics;
use tracetap::pipeline::EncodedBatch;

/// Serves one canned status per request, in order (the last one repeats), and keeps the bodies.
/// Its 200 answers carry `ok_body`.
async fn server_answering(statuses: Vec<u16>, ok_body: Vec<u8>) -> (String, Arc<Mutex<Vec<Vec<u8>>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&bodies);
    tokio::spawn(async move {
        let mut n = 0;
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            // Read head and body (Content-Length) of one request, answer, close.
            loop {
                let mut chunk = [0u8; 4096];
                let k = stream.read(&mut chunk).await.unwrap();
                if k == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..k]);
                let text = String::from_utf8_lossy(&buf);
                if let Some(head_end) = text.find("\r\n\r\n") {
                    let len: usize = text[..head_end]
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap())
                        })
                        .unwrap_or(0);
                    if buf.len() >= head_end + 4 + len {
                        seen.lock().unwrap().push(buf[head_end + 4..head_end + 4 + len].to_vec());
                        break;
                    }
                }
            }
            let status = statuses[n.min(statuses.len() - 1)];
            n += 1;
            let body: &[u8] = if status == 200 { &ok_body } else { &[] };
            let resp = format!(
                "HTTP/1.1 {status} X\r\nContent-Type: application/x-protobuf\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(resp.as_bytes()).await;
            let _ = stream.write_all(body).await;
        }
    });
    (url, bodies)
}

fn config(url: &str) -> Config {
    let vars = BTreeMap::from([
        ("OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(), url.to_owned()),
        ("OTEL_BSP_SCHEDULE_DELAY".to_owned(), "50".to_owned()),
        ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE".to_owned(), "2".to_owned()),
        ("OTEL_BSP_MAX_QUEUE_SIZE".to_owned(), "4".to_owned()),
    ]);
    Config::from_map(&vars).unwrap()
}

/// A batch of two spans named `{name}a` and `{name}b`.
fn batch(name: &str) -> EncodedBatch {
    let spans = ["a", "b"].map(|s| Span {
        name: format!("{name}{s}"),
        trace_id: vec![1; 16],
        span_id: vec![2; 8],
        ..Span::default()
    });
    let request = ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            scope_spans: vec![ScopeSpans { spans: spans.to_vec(), ..ScopeSpans::default() }],
            ..ResourceSpans::default()
        }],
    };
    EncodedBatch::new(request.encode_to_vec().into(), 2, 1)
}

async fn export_batches(statuses: Vec<u16>, batches: usize) -> (Arc<Metrics>, Vec<Vec<u8>>) {
    export_batches_answered(statuses, Vec::new(), batches).await
}

async fn export_batches_answered(statuses: Vec<u16>, ok_body: Vec<u8>, batches: usize) -> (Arc<Metrics>, Vec<Vec<u8>>) {
    let (url, bodies) = server_answering(statuses, ok_body).await;
    let config = config(&url);
    let metrics = Arc::new(Metrics::default());
    let (queue, rx) = export::queue(config.max_queue_size, config.max_export_batch_size, Arc::clone(&metrics));
    let exporter =
        tokio::spawn(export::run(Destination::new(&config.export).unwrap(), rx, Arc::clone(&metrics), Arc::default()));
    for i in 0..batches {
        queue.push(batch(&format!("s{i}")));
    }
    drop(queue);
    exporter.await.unwrap();
    let bodies = bodies.lock().unwrap().clone();
    (metrics, bodies)
}

#[tokio::test]
async fn retryable_statuses_are_retried_until_accepted() {
    let (metrics, bodies) = export_batches(vec![503, 429, 200], 1).await;
    assert_eq!(metrics.export_retries.load(Relaxed), 2);
    assert_eq!(metrics.spans_exported.load(Relaxed), 2);
    assert_eq!(metrics.export_failures.load(Relaxed), 0);
    let last = ExportTraceServiceRequest::decode(&bodies[2][..]).unwrap();
    let names: Vec<_> = last.resource_spans[0].scope_spans[0].spans.iter().map(|s| s.name.clone()).collect();
    assert_eq!(names, ["s0a", "s0b"]);
}

#[tokio::test]
async fn permanent_errors_drop_and_count() {
    let (metrics, bodies) = export_batches(vec![400], 1).await;
    assert_eq!(bodies.len(), 1, "a 400 is not retried");
    assert_eq!(metrics.export_failures.load(Relaxed), 1);
    assert_eq!(metrics.spans_dropped_export_failed.load(Relaxed), 2);
    assert_eq!(metrics.spans_exported.load(Relaxed), 0);
}

#[tokio::test]
async fn full_queue_drops_and_counts_and_close_flushes_the_rest() {
    // Room for 4 spans in batches of 2: the exporter is not polled while we push 5 batches
    // (current-thread runtime), so 3 batches are dropped.
    let (metrics, bodies) = export_batches(vec![200], 5).await;
    assert_eq!(metrics.spans_dropped_queue_full.load(Relaxed), 6);
    assert_eq!(metrics.spans_exported.load(Relaxed), 4);
    let exported: usize = bodies
        .iter()
        .map(|b| ExportTraceServiceRequest::decode(&b[..]).unwrap().resource_spans[0].scope_spans[0].spans.len())
        .sum();
    assert_eq!(exported, 4);
}

#[tokio::test]
async fn a_partial_success_counts_the_rejected_spans() {
    use opentelemetry_proto::tonic::collector::trace::v1::{ExportTracePartialSuccess, ExportTraceServiceResponse};
    let answer = ExportTraceServiceResponse {
        partial_success: Some(ExportTracePartialSuccess { rejected_spans: 1, error_message: "span too old".into() }),
    };
    let (metrics, bodies) = export_batches_answered(vec![200], answer.encode_to_vec(), 1).await;
    assert_eq!(bodies.len(), 1, "a partial success is not retried");
    assert_eq!(metrics.spans_rejected.load(Relaxed), 1);
    assert_eq!(metrics.spans_exported.load(Relaxed), 1);
    assert_eq!(metrics.export_failures.load(Relaxed), 0);
}

//! An OTLP/HTTP receiver that decodes `ExportTraceServiceRequest` with the official protobuf
//! definitions (`opentelemetry-proto`) and keeps every span it received.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value::Value};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;

/// A received span with the `process.pid` and `service.name` of its resource.
#[derive(Debug, Clone)]
pub struct Received {
    pub pid: i64,
    pub service: String,
    pub span: Span,
    /// Every attribute of the span's resource.
    pub resource: Vec<KeyValue>,
}

impl Received {
    /// A string attribute of the span's resource.
    #[must_use]
    pub fn resource_str(&self, key: &str) -> Option<&str> {
        match attr(&self.resource, key)? {
            Value::StringValue(s) => Some(s),
            _ => None,
        }
    }

    #[must_use]
    pub fn str_attr(&self, key: &str) -> Option<&str> {
        match attr(&self.span.attributes, key)? {
            Value::StringValue(s) => Some(s),
            _ => None,
        }
    }

    #[must_use]
    pub fn int_attr(&self, key: &str) -> Option<i64> {
        match attr(&self.span.attributes, key)? {
            Value::IntValue(i) => Some(*i),
            _ => None,
        }
    }

    #[must_use]
    pub fn is_server(&self) -> bool {
        self.span.kind == opentelemetry_proto::tonic::trace::v1::span::SpanKind::Server as i32
    }

    #[must_use]
    pub fn is_client(&self) -> bool {
        self.span.kind == opentelemetry_proto::tonic::trace::v1::span::SpanKind::Client as i32
    }

    #[must_use]
    pub fn is_error(&self) -> bool {
        self.span.status.as_ref().is_some_and(|s| s.code == 2)
    }
}

fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a Value> {
    attrs.iter().find(|kv| kv.key == key)?.value.as_ref()?.value.as_ref()
}

/// The receiver; spans accumulate until the receiver is dropped.
#[derive(Debug, Clone)]
pub struct Receiver {
    pub addr: SocketAddr,
    spans: Arc<Mutex<Vec<Received>>>,
    requests: Arc<Mutex<u64>>,
    /// When set, two requests in three are answered 503 (and not recorded): a collector that
    /// keeps exports in flight through the agent's retries.
    flaky: Arc<std::sync::atomic::AtomicBool>,
    arrivals: Arc<std::sync::atomic::AtomicU64>,
}

impl Receiver {
    /// Starts listening on a loopback port, on `rt`.
    #[must_use]
    pub fn start(rt: &tokio::runtime::Runtime) -> Self {
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind receiver");
        let addr = listener.local_addr().expect("addr");
        let receiver = Self {
            addr,
            spans: Arc::default(),
            requests: Arc::default(),
            flaky: Arc::default(),
            arrivals: Arc::default(),
        };
        let r = receiver.clone();
        rt.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let r = r.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let r = r.clone();
                        async move { Ok::<_, Infallible>(r.handle(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        receiver
    }

    /// From now on, answers two requests in three with 503 Service Unavailable without recording
    /// them (the agent retries 503 with backoff, so every export takes at most three attempts).
    pub fn refuse_two_in_three(&self) {
        self.flaky.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The base URL for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    #[must_use]
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn handle(&self, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
        let bad = |msg: String| {
            Response::builder().status(StatusCode::BAD_REQUEST).body(Full::new(Bytes::from(msg))).expect("response")
        };
        if req.uri().path() != "/v1/traces" {
            return bad(format!("unexpected path {}", req.uri().path()));
        }
        if req.headers().get("content-type").and_then(|v| v.to_str().ok()) != Some("application/x-protobuf") {
            return bad("content-type must be application/x-protobuf".into());
        }
        let Ok(body) = req.into_body().collect().await else { return bad("body".into()) };
        let arrival = self.arrivals.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.flaky.load(std::sync::atomic::Ordering::Relaxed) && arrival % 3 != 2 {
            return Response::builder()
                .status(StatusCode::SERVICE_UNAVAILABLE)
                .body(Full::new(Bytes::new()))
                .expect("response");
        }
        let decoded = match ExportTraceServiceRequest::decode(body.to_bytes()) {
            Ok(d) => d,
            Err(e) => return bad(format!("decode: {e}")),
        };
        let mut spans = self.spans.lock().expect("lock");
        for rs in decoded.resource_spans {
            let attrs = rs.resource.map(|r| r.attributes).unwrap_or_default();
            let pid = match attr(&attrs, "process.pid") {
                Some(Value::IntValue(p)) => *p,
                _ => -1,
            };
            let service = match attr(&attrs, "service.name") {
                Some(Value::StringValue(s)) => s.clone(),
                _ => String::new(),
            };
            for ss in rs.scope_spans {
                for span in ss.spans {
                    spans.push(Received { pid, service: service.clone(), span, resource: attrs.clone() });
                }
            }
        }
        *self.requests.lock().expect("lock") += 1;
        Response::new(Full::new(Bytes::from(ExportTraceServiceResponse::default().encode_to_vec())))
    }

    /// Every span received so far.
    #[must_use]
    pub fn spans(&self) -> Vec<Received> {
        self.spans.lock().expect("lock").clone()
    }

    /// Waits until at least `n` spans arrived (at most 20 s) and returns them all.
    #[must_use]
    pub fn wait_for_spans(&self, n: usize) -> Vec<Received> {
        let _ = crate::wait_for(std::time::Duration::from_secs(20), || {
            (self.spans.lock().expect("lock").len() >= n).then_some(())
        });
        self.spans()
    }
}

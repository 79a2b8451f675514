//! A backend instrumented with the OpenTelemetry SDK: it continues the trace context of every
//! request it receives, as a service behind `HAProxy` does, and records what it did.
//!
//! Each request's headers go through the SDK's W3C propagator (`TraceContextPropagator`), and a
//! SERVER span is started under the extracted context by an SDK tracer with the default
//! `ParentBased(AlwaysOn)` sampler, so the span is sampled exactly when a valid forwarded
//! `traceparent` says so (or when none came). The backend answers 200 with a fixed body and no
//! header that depends on the request, so that identical requests get byte-identical responses.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use opentelemetry::propagation::TextMapPropagator as _;
use opentelemetry::trace::{Span as _, SpanKind, TraceContextExt as _, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;

/// What the backend did with one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Continuation {
    /// The `traceparent` header it received, as received.
    pub received: Option<String>,
    /// The `tracestate` it received.
    pub tracestate: Option<String>,
    /// Its span's trace id.
    pub trace_id: [u8; 16],
    /// Its span's id.
    pub span_id: [u8; 8],
    /// The span id of the extracted remote parent (all zero when there was no valid one).
    pub parent_span_id: [u8; 8],
    /// The SDK sampled its span (it follows the forwarded sampled flag).
    pub sampled: bool,
}

#[derive(Clone)]
pub struct ContinuingBackend {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<Continuation>>>,
}

impl ContinuingBackend {
    #[must_use]
    pub fn start(rt: &tokio::runtime::Runtime) -> Self {
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind backend");
        let addr = listener.local_addr().expect("backend address");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let provider = SdkTracerProvider::builder().build();
        let tracer = Arc::new(provider.tracer("tracetap-tests-backend"));
        let record = Arc::clone(&seen);
        rt.spawn(async move {
            // Keeps the provider alive as long as the backend serves.
            let _provider = provider;
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let (record, tracer) = (Arc::clone(&record), Arc::clone(&tracer));
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                        let continuation = continue_trace(&*tracer, &req);
                        record.lock().expect("continuations").push(continuation);
                        async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"continued\n")))) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self { addr, seen }
    }

    /// Everything recorded so far, in arrival order.
    #[must_use]
    pub fn continuations(&self) -> Vec<Continuation> {
        self.seen.lock().expect("continuations").clone()
    }
}

fn continue_trace<T: opentelemetry::trace::Tracer>(tracer: &T, req: &Request<hyper::body::Incoming>) -> Continuation {
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let carrier: HashMap<String, String> = ["traceparent", "tracestate"]
        .into_iter()
        .filter_map(|name| header(name).map(|v| (name.to_owned(), v)))
        .collect();
    let parent = TraceContextPropagator::new().extract(&carrier);
    let parent_span = parent.span().span_context().clone();
    let span = tracer.span_builder("backend").with_kind(SpanKind::Server).start_with_context(tracer, &parent);
    let own = span.span_context().clone();
    Continuation {
        received: header("traceparent"),
        tracestate: header("tracestate"),
        trace_id: own.trace_id().to_bytes(),
        span_id: own.span_id().to_bytes(),
        parent_span_id: if parent_span.is_valid() { parent_span.span_id().to_bytes() } else { [0; 8] },
        sampled: own.is_sampled(),
    }
}

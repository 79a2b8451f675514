//! Encoding cost per span, three span shapes x three paths (`cargo bench -p tracetap --bench encode`):
//!
//! - (a) arena: span views in a per-batch bumpalo arena, encoded with prost's primitives;
//! - (b) prost: the foundation's path, prost `Span` structs (a `String` per key and value), then
//!   `encode_to_vec`;
//! - (c) sdk: what a user would pick instead, `opentelemetry_sdk` spans with a batch span
//!   processor, converted and encoded as `opentelemetry-otlp` does (opentelemetry-proto's
//!   `group_spans_by_resource_and_scope`, then prost).
//!
//! Shapes: minimal (no attributes), nominal (a SERVER span and its CLIENT span with the attributes
//! the agent emits), attrs10 (10 attributes with 20-character keys and values). Before criterion
//! runs, a counting allocator measures allocations and encoded bytes per span for each pair.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use bumpalo::Bump;
use bumpalo::collections::Vec as BumpVec;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use opentelemetry::trace::{Span as _, Tracer as _, TracerProvider as _};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans};
use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use prost::Message as _;
use tracetap::encode::{Attr, BatchEncoder, SpanView, Value};
use tracetap::sampling::Sampler;
use tracetap::spans::SpanBuilder;
use tracetap_proxy::head::{parse_request, parse_response};
use tracetap_proxy::{ClientExchange, Outcome, ServerExchange};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const BATCH: usize = 512;
const KEYS: [&str; 10] = [
    "attribute.key.number0",
    "attribute.key.number1",
    "attribute.key.number2",
    "attribute.key.number3",
    "attribute.key.number4",
    "attribute.key.number5",
    "attribute.key.number6",
    "attribute.key.number7",
    "attribute.key.number8",
    "attribute.key.number9",
];
const VALUE: &str = "value-of-twenty-char";

#[derive(Clone, Copy, Debug)]
enum Shape {
    Minimal,
    Nominal,
    Attrs10,
}

fn exchange() -> ServerExchange {
    let request = parse_request(
        b"GET /api/v1/items/42?sort=asc HTTP/1.1\r\nHost: shop.example.com:8443\r\nUser-Agent: Mozilla/5.0 (X11; Linux x86_64)\r\n\r\n",
    )
    .unwrap();
    let response = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n").unwrap();
    ServerExchange {
        tgid: 4242,
        clients: vec![ClientExchange {
            request: request.clone(),
            response: Some(response),
            server: Some("10.0.3.17:8080".parse().unwrap()),
            start_ns: 1_100,
            end_ns: 1_900,
            connect_ns: None,
            free_since_ns: None,
            response_start_ns: None,
            response_head_ns: None,
            server_closed: false,
            outcome: Outcome::Complete,
            tls: None,
        }],
        request: Some(request),
        response: Some(response),
        peer: Some("192.168.10.23:51234".parse().unwrap()),
        local: Some("10.0.0.1:443".parse().unwrap()),
        client: None,
        start_ns: 1_000,
        end_ns: 2_000,
        head_end_ns: None,
        rejected: None,
        client_closed: false,
        outcome: Outcome::Complete,
        tls: None,
    }
}

fn synthetic<'a>(attrs: &'a [Attr<'a>]) -> SpanView<'a> {
    SpanView {
        trace_id: [3; 16],
        span_id: [4; 8],
        parent_span_id: [0; 8],
        trace_state: "",
        flags: 0x103,
        name: "GET",
        kind: 2,
        start_unix_ns: 1_700_000_000_000_000_000,
        end_unix_ns: 1_700_000_000_001_000_000,
        attributes: attrs,
        events: &[],
        error: false,
    }
}

fn attrs10() -> Vec<Attr<'static>> {
    KEYS.iter().map(|k| Attr { key: k, value: Value::Str(VALUE) }).collect()
}

/// Spans per batch of the shape (nominal batches hold 256 exchanges of two spans).
fn spans_per_batch(_: Shape) -> usize {
    BATCH
}

struct Arena {
    bump: Bump,
    encoder: BatchEncoder,
    builder: SpanBuilder,
    exchanges: Vec<ServerExchange>,
    decisions: Vec<tracetap::spans::Decision>,
    attrs10: Vec<Attr<'static>>,
}

impl Arena {
    fn new() -> Self {
        let mut builder = SpanBuilder::with_seed(Sampler::default(), 0, 1);
        let exchanges: Vec<_> = (0..BATCH / 2).map(|_| exchange()).collect();
        let decisions = exchanges.iter().map(|e| builder.decide(e).unwrap()).collect();
        Self {
            bump: Bump::with_capacity(1 << 20),
            encoder: BatchEncoder::new(vec![("service.name".into(), "haproxy".into())]),
            builder,
            exchanges,
            decisions,
            attrs10: attrs10(),
        }
    }

    /// One batch; returns the encoded size.
    fn batch(&mut self, shape: Shape) -> usize {
        self.bump.reset();
        let bump = &self.bump;
        let mut views = BumpVec::with_capacity_in(BATCH, bump);
        match shape {
            Shape::Minimal => views.extend((0..BATCH).map(|_| synthetic(&[]))),
            Shape::Attrs10 => views.extend((0..BATCH).map(|_| synthetic(&self.attrs10))),
            Shape::Nominal => {
                for (e, d) in self.exchanges.iter().zip(&self.decisions) {
                    self.builder.views(e, d, None, bump, &mut views);
                }
            }
        }
        self.encoder.encode([(4242, &views[..])]).len()
    }
}

struct Prost {
    builder: SpanBuilder,
    exchanges: Vec<ServerExchange>,
    attrs10: Vec<Attr<'static>>,
}

impl Prost {
    fn new() -> Self {
        Self {
            builder: SpanBuilder::with_seed(Sampler::default(), 0, 1),
            exchanges: (0..BATCH / 2).map(|_| exchange()).collect(),
            attrs10: attrs10(),
        }
    }

    fn batch(&mut self, shape: Shape) -> usize {
        let spans = match shape {
            Shape::Minimal => (0..BATCH).map(|_| synthetic(&[]).to_prost()).collect(),
            Shape::Attrs10 => (0..BATCH).map(|_| synthetic(&self.attrs10).to_prost()).collect(),
            Shape::Nominal => {
                let mut out = Vec::with_capacity(BATCH);
                for e in &self.exchanges {
                    self.builder.build(e, None, &mut out);
                }
                out.into_iter().map(|r| r.span).collect()
            }
        };
        let request = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                scope_spans: vec![ScopeSpans { spans, ..ScopeSpans::default() }],
                ..ResourceSpans::default()
            }],
        };
        request.encode_to_vec().len()
    }
}

/// An SDK exporter that does what opentelemetry-otlp does before sending: convert and encode.
#[derive(Debug)]
struct EncodingExporter {
    resource: ResourceAttributesWithSchema,
    bytes: std::sync::Arc<AtomicU64>,
}

impl SpanExporter for EncodingExporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let request =
            ExportTraceServiceRequest { resource_spans: group_spans_by_resource_and_scope(batch, &self.resource) };
        self.bytes.fetch_add(request.encode_to_vec().len() as u64, Relaxed);
        Ok(())
    }
}

struct Sdk {
    provider: SdkTracerProvider,
    tracer: opentelemetry_sdk::trace::SdkTracer,
    bytes: std::sync::Arc<AtomicU64>,
}

impl Sdk {
    fn new() -> Self {
        let bytes = std::sync::Arc::new(AtomicU64::new(0));
        let resource = opentelemetry_sdk::Resource::builder_empty().with_service_name("haproxy").build();
        let exporter = EncodingExporter { resource: (&resource).into(), bytes: std::sync::Arc::clone(&bytes) };
        let provider = SdkTracerProvider::builder().with_resource(resource).with_batch_exporter(exporter).build();
        let tracer = provider.tracer("tracetap-bench");
        Self { provider, tracer, bytes }
    }

    /// A started span with string attributes, `server.port`, `network.peer.port` and a 200 status.
    fn span<'a>(
        &self,
        name: &'static str,
        strings: impl Iterator<Item = &'a (&'static str, &'static str)>,
        [port, peer_port]: [i64; 2],
    ) -> opentelemetry_sdk::trace::Span {
        use opentelemetry::KeyValue;
        let mut span = self.tracer.start(name);
        for (k, v) in strings {
            span.set_attribute(KeyValue::new(*k, (*v).to_owned()));
        }
        span.set_attribute(KeyValue::new("server.port", port));
        span.set_attribute(KeyValue::new("network.peer.port", peer_port));
        span.set_attribute(KeyValue::new("http.response.status_code", 200));
        span
    }

    fn batch(&mut self, shape: Shape) -> usize {
        use opentelemetry::KeyValue;
        let before = self.bytes.load(Relaxed);
        match shape {
            Shape::Minimal => {
                for _ in 0..BATCH {
                    self.tracer.start("GET").end();
                }
            }
            Shape::Attrs10 => {
                for _ in 0..BATCH {
                    let mut span = self.tracer.start("GET");
                    for k in KEYS {
                        span.set_attribute(KeyValue::new(k, VALUE.to_owned()));
                    }
                    span.end();
                }
            }
            Shape::Nominal => {
                // The attributes the agent emits, from strings a parser would hand over.
                let request = [
                    ("http.request.method", "GET"),
                    ("url.path", "/api/v1/items/42"),
                    ("url.query", "sort=asc"),
                    ("url.scheme", "http"),
                    ("network.protocol.version", "1.1"),
                ];
                let server_only = [
                    ("server.address", "shop.example.com"),
                    ("user_agent.original", "Mozilla/5.0 (X11; Linux x86_64)"),
                    ("client.address", "192.168.10.23"),
                    ("network.peer.address", "192.168.10.23"),
                ];
                let client_only = [
                    ("server.address", "10.0.3.17"),
                    ("url.full", "http://10.0.3.17:8080/api/v1/items/42?sort=asc"),
                    ("network.peer.address", "10.0.3.17"),
                ];
                for _ in 0..BATCH / 2 {
                    let mut server = self.span("GET fe_main", request.iter().chain(&server_only), [8443, 51234]);
                    self.span("GET be_app", request.iter().chain(&client_only), [8080, 8080]).end();
                    server.end();
                }
            }
        }
        self.provider.force_flush().expect("flush");
        (self.bytes.load(Relaxed) - before) as usize
    }
}

/// Allocations and encoded bytes per span, printed before the timings.
fn report_allocations() {
    let (mut arena, mut prost, mut sdk) = (Arena::new(), Prost::new(), Sdk::new());
    println!("\nper span, {BATCH}-span batches, steady state (10 batches after 3 warm-up batches):");
    println!("| shape | path | allocations/span | bytes/span |");
    println!("|---|---|---|---|");
    for shape in [Shape::Minimal, Shape::Nominal, Shape::Attrs10] {
        let run = |name: &str, f: &mut dyn FnMut(Shape) -> usize| {
            for _ in 0..3 {
                f(shape);
            }
            let before = ALLOCS.load(Relaxed);
            let mut bytes = 0;
            for _ in 0..10 {
                bytes += f(shape);
            }
            let spans = (10 * spans_per_batch(shape)) as f64;
            println!(
                "| {shape:?} | {name} | {:.3} | {:.1} |",
                (ALLOCS.load(Relaxed) - before) as f64 / spans,
                bytes as f64 / spans
            );
        };
        run("(a) arena", &mut |s| arena.batch(s));
        run("(b) prost", &mut |s| prost.batch(s));
        run("(c) sdk", &mut |s| sdk.batch(s));
    }
    println!();
}

fn bench(c: &mut Criterion) {
    report_allocations();
    let (mut arena, mut prost, mut sdk) = (Arena::new(), Prost::new(), Sdk::new());
    for shape in [Shape::Minimal, Shape::Nominal, Shape::Attrs10] {
        let mut group = c.benchmark_group(format!("{shape:?}"));
        group.throughput(Throughput::Elements(spans_per_batch(shape) as u64));
        group.bench_function("a_arena", |b| b.iter(|| black_box(arena.batch(shape))));
        group.bench_function("b_prost", |b| b.iter(|| black_box(prost.batch(shape))));
        group.bench_function("c_sdk", |b| b.iter(|| black_box(sdk.batch(shape))));
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);

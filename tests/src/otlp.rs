//! An OTLP receiver that decodes `ExportTraceServiceRequest` with the official protobuf
//! definitions (`opentelemetry-proto`) and keeps every span it received: OTLP/HTTP by default;
//! OTLP/gRPC through the generated tonic service, TLS and mutual TLS, and a collector that asks
//! for retries, as [`Options`] say.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{ExportMetricsServiceRequest, ExportMetricsServiceResponse};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value::Value};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use tonic::codec::CompressionEncoding;

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
    pub fn double_attr(&self, key: &str) -> Option<f64> {
        match attr(&self.span.attributes, key)? {
            Value::DoubleValue(d) => Some(*d),
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

/// How a [`Receiver`] listens and answers.
#[derive(Clone, Default)]
pub struct Options {
    /// OTLP/gRPC (the trace service's `Export`, gzip accepted) instead of OTLP/HTTP.
    pub grpc: bool,
    /// TLS with this certificate; with `client_ca`, mutual TLS (a client certificate is required).
    pub tls: Option<ServerTls>,
    /// With TLS, [`Receiver::endpoint`] names `127.0.0.1` (an IP literal) instead of `localhost`.
    pub by_ip: bool,
    /// OTLP/HTTP: the first requests are answered 429 with these `Retry-After` values, in order,
    /// before any is accepted.
    pub too_many: Vec<RetryAfter>,
}

/// When a request arrived, and for a refused one the earliest time its `Retry-After` allowed a retry.
pub type Arrival = (SystemTime, Option<SystemTime>);

/// A `Retry-After` answer.
#[derive(Clone, Copy, Debug)]
pub enum RetryAfter {
    /// Delay-seconds.
    Seconds(u64),
    /// An HTTP date this far after the refusal (written in whole seconds, as HTTP dates are).
    DateIn(Duration),
}

/// The receiver's side of TLS, as PEM.
#[derive(Clone)]
pub struct ServerTls {
    pub cert_pem: String,
    pub key_pem: String,
    pub client_ca_pem: Option<String>,
}

/// What a receiver saw besides spans.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Export requests accepted.
    pub accepted: u64,
    /// Accepted requests whose body was gzipped (`Content-Encoding` or `grpc-encoding`).
    pub gzipped: u64,
    /// Requests answered 429.
    pub refused: u64,
    /// TLS handshakes that failed (an untrusted certificate on the client's side, a missing client
    /// certificate on ours).
    pub handshake_failures: u64,
    /// Metrics export requests accepted (`/v1/metrics` or the gRPC metrics service).
    pub metric_requests: u64,
}

/// The receiver; spans accumulate until the receiver is dropped.
#[derive(Clone)]
pub struct Receiver {
    pub addr: SocketAddr,
    spans: Arc<Mutex<Vec<Received>>>,
    /// The last value of each integer metric point received, by name (and attributes, `name{k=v}`),
    /// and the `service.name` of its resource.
    metrics: Arc<Mutex<std::collections::BTreeMap<String, (i64, String)>>>,
    stats: Arc<Mutex<Stats>>,
    /// When each request arrived, and for a refused one, the earliest time the refusal allowed a retry.
    arrivals_log: Arc<Mutex<Vec<Arrival>>>,
    options: Arc<Options>,
    /// When set, two requests in three are answered 503 (and not recorded): a collector that
    /// keeps exports in flight through the agent's retries.
    flaky: Arc<std::sync::atomic::AtomicBool>,
    arrivals: Arc<std::sync::atomic::AtomicU64>,
}

impl Receiver {
    /// Starts an OTLP/HTTP receiver on a loopback port, on `rt`.
    #[must_use]
    pub fn start(rt: &tokio::runtime::Runtime) -> Self {
        Self::start_with(rt, Options::default())
    }

    /// Starts a receiver as `options` say.
    #[must_use]
    pub fn start_with(rt: &tokio::runtime::Runtime, options: Options) -> Self {
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind receiver");
        let addr = listener.local_addr().expect("addr");
        let acceptor = options.tls.as_ref().map(|tls| tls_acceptor(tls, options.grpc));
        let receiver = Self {
            addr,
            spans: Arc::default(),
            metrics: Arc::default(),
            stats: Arc::default(),
            arrivals_log: Arc::default(),
            options: Arc::new(options),
            flaky: Arc::default(),
            arrivals: Arc::default(),
        };
        let r = receiver.clone();
        rt.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let (r, acceptor) = (r.clone(), acceptor.clone());
                tokio::spawn(async move {
                    match acceptor {
                        None => r.serve(TokioIo::new(stream)).await,
                        Some(acceptor) => match acceptor.accept(stream).await {
                            Ok(tls) => r.serve(TokioIo::new(tls)).await,
                            Err(_) => r.stats.lock().expect("lock").handshake_failures += 1,
                        },
                    }
                });
            }
        });
        receiver
    }

    async fn serve<I>(self, io: I)
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        if self.options.grpc {
            let traces = TraceServiceServer::new(self.clone()).accept_compressed(CompressionEncoding::Gzip);
            let metrics = MetricsServiceServer::new(self).accept_compressed(CompressionEncoding::Gzip);
            // Routed by the method's path, as tonic's router (not built in: it needs axum) would.
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let (mut traces, mut metrics) = (traces.clone(), metrics.clone());
                async move {
                    if req.uri().path().starts_with("/opentelemetry.proto.collector.metrics.") {
                        tower_service::Service::call(&mut metrics, req).await
                    } else {
                        tower_service::Service::call(&mut traces, req).await
                    }
                }
            });
            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new()).serve_connection(io, service).await;
        } else {
            let service = hyper::service::service_fn(move |req| {
                let r = self.clone();
                async move { Ok::<_, Infallible>(r.handle(req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
        }
    }

    /// From now on, answers two requests in three with 503 Service Unavailable without recording
    /// them (the agent retries 503 with backoff, so every export takes at most three attempts).
    pub fn refuse_two_in_three(&self) {
        self.flaky.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The base URL for `OTEL_EXPORTER_OTLP_ENDPOINT` (`https://localhost:PORT` with TLS, so that
    /// the name the certificate carries is the one dialled).
    #[must_use]
    pub fn endpoint(&self) -> String {
        if self.options.tls.is_some() && self.options.by_ip {
            format!("https://{}", self.addr)
        } else if self.options.tls.is_some() {
            format!("https://localhost:{}", self.addr.port())
        } else {
            format!("http://{}", self.addr)
        }
    }

    /// What the receiver saw besides spans.
    #[must_use]
    pub fn stats(&self) -> Stats {
        self.stats.lock().expect("lock").clone()
    }

    /// When each request arrived, and for a refused one (429) the earliest time its `Retry-After`
    /// allowed a retry, in order.
    #[must_use]
    pub fn arrivals(&self) -> Vec<Arrival> {
        self.arrivals_log.lock().expect("lock").clone()
    }

    async fn handle(&self, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
        let bad = |msg: String| {
            Response::builder().status(StatusCode::BAD_REQUEST).body(Full::new(Bytes::from(msg))).expect("response")
        };
        let is_metrics = match req.uri().path() {
            "/v1/traces" => false,
            "/v1/metrics" => true,
            other => return bad(format!("unexpected path {other}")),
        };
        if req.headers().get("content-type").and_then(|v| v.to_str().ok()) != Some("application/x-protobuf") {
            return bad("content-type must be application/x-protobuf".into());
        }
        let gzipped = match req.headers().get("content-encoding").map(hyper::header::HeaderValue::as_bytes) {
            None => false,
            Some(b"gzip") => true,
            Some(other) => return bad(format!("unexpected content-encoding {}", String::from_utf8_lossy(other))),
        };
        let Ok(body) = req.into_body().collect().await else { return bad("body".into()) };
        let refused = self.stats.lock().expect("lock").refused as usize;
        if let Some(retry_after) = self.options.too_many.get(refused) {
            self.stats.lock().expect("lock").refused += 1;
            let now = SystemTime::now();
            let (value, not_before) = match *retry_after {
                RetryAfter::Seconds(s) => (s.to_string(), now + Duration::from_secs(s)),
                RetryAfter::DateIn(after) => {
                    let date = now + after;
                    let whole = date.duration_since(SystemTime::UNIX_EPOCH).expect("after 1970").as_secs();
                    (httpdate::fmt_http_date(date), SystemTime::UNIX_EPOCH + Duration::from_secs(whole))
                }
            };
            self.arrivals_log.lock().expect("lock").push((now, Some(not_before)));
            return Response::builder()
                .status(StatusCode::TOO_MANY_REQUESTS)
                .header("retry-after", value)
                .body(Full::new(Bytes::new()))
                .expect("response");
        }
        let arrival = self.arrivals.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.flaky.load(std::sync::atomic::Ordering::Relaxed) && arrival % 3 != 2 {
            return Response::builder()
                .status(StatusCode::SERVICE_UNAVAILABLE)
                .body(Full::new(Bytes::new()))
                .expect("response");
        }
        let mut bytes = body.to_bytes().to_vec();
        if gzipped {
            let mut plain = Vec::new();
            if let Err(e) = std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&bytes[..]), &mut plain) {
                return bad(format!("gunzip: {e}"));
            }
            bytes = plain;
        }
        if is_metrics {
            return match ExportMetricsServiceRequest::decode(&bytes[..]) {
                Ok(decoded) => {
                    self.record_metrics(decoded);
                    Response::new(Full::new(Bytes::from(ExportMetricsServiceResponse::default().encode_to_vec())))
                }
                Err(e) => bad(format!("decode: {e}")),
            };
        }
        let decoded = match ExportTraceServiceRequest::decode(&bytes[..]) {
            Ok(d) => d,
            Err(e) => return bad(format!("decode: {e}")),
        };
        self.record(decoded, gzipped);
        Response::new(Full::new(Bytes::from(ExportTraceServiceResponse::default().encode_to_vec())))
    }

    /// The last value of an integer metric point named `name` (attributes written `name{k=v,...}`),
    /// and the `service.name` of its resource.
    #[must_use]
    pub fn metric(&self, name: &str) -> Option<(i64, String)> {
        self.metrics.lock().expect("lock").get(name).cloned()
    }

    fn record_metrics(&self, decoded: ExportMetricsServiceRequest) {
        use opentelemetry_proto::tonic::metrics::v1::{metric::Data, number_data_point};
        let mut latest = self.metrics.lock().expect("lock");
        for rm in decoded.resource_metrics {
            let attrs = rm.resource.map(|r| r.attributes).unwrap_or_default();
            let service = match attr(&attrs, "service.name") {
                Some(Value::StringValue(s)) => s.clone(),
                _ => String::new(),
            };
            for sm in rm.scope_metrics {
                for metric in sm.metrics {
                    let points = match metric.data {
                        Some(Data::Sum(sum)) => sum.data_points,
                        Some(Data::Gauge(gauge)) => gauge.data_points,
                        _ => continue,
                    };
                    for point in points {
                        let Some(number_data_point::Value::AsInt(value)) = point.value else { continue };
                        let mut key = metric.name.clone();
                        if !point.attributes.is_empty() {
                            let labels: Vec<String> = point
                                .attributes
                                .iter()
                                .map(|kv| match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                                    Some(Value::StringValue(s)) => format!("{}={s}", kv.key),
                                    _ => kv.key.clone(),
                                })
                                .collect();
                            key = format!("{key}{{{}}}", labels.join(","));
                        }
                        latest.insert(key, (value, service.clone()));
                    }
                }
            }
        }
        self.stats.lock().expect("lock").metric_requests += 1;
    }

    fn record(&self, decoded: ExportTraceServiceRequest, gzipped: bool) {
        self.arrivals_log.lock().expect("lock").push((SystemTime::now(), None));
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
        let mut stats = self.stats.lock().expect("lock");
        stats.accepted += 1;
        stats.gzipped += u64::from(gzipped);
    }

    /// Every span received so far.
    #[must_use]
    pub fn spans(&self) -> Vec<Received> {
        self.spans.lock().expect("lock").clone()
    }

    /// Waits until at least `n` spans arrived (at most 20 s) and returns them all.
    #[must_use]
    pub fn wait_for_spans(&self, n: usize) -> Vec<Received> {
        let _ =
            crate::wait_for(Duration::from_secs(20), || (self.spans.lock().expect("lock").len() >= n).then_some(()));
        self.spans()
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let gzipped = request.metadata().get("grpc-encoding").is_some_and(|v| v == "gzip");
        self.record(request.into_inner(), gzipped);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tonic::async_trait]
impl MetricsService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        self.record_metrics(request.into_inner());
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

/// The receiver's TLS: its certificate, and with a client CA, mandatory client certificates.
pub(crate) fn tls_acceptor(tls: &ServerTls, grpc: bool) -> tokio_rustls::TlsAcceptor {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(tls.cert_pem.as_bytes()).collect::<Result<_, _>>().expect("server chain");
    let key = PrivateKeyDer::from_pem_slice(tls.key_pem.as_bytes()).expect("server key");
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .expect("versions");
    let builder = match &tls.client_ca_pem {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(ca.as_bytes()) {
                roots.add(cert.expect("client CA")).expect("client CA");
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .expect("client verifier");
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key).expect("server certificate");
    config.alpn_protocols = if grpc { vec![b"h2".to_vec()] } else { vec![b"http/1.1".to_vec()] };
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

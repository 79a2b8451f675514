//! OTLP/gRPC: the `Export` method of the trace service, through tonic's client over the same
//! hyper client and rustls configuration as OTLP/HTTP (HTTP/2 only). The request is the encoder's
//! bytes as they are: a codec writes them into the gRPC frame without decoding them again, and
//! tonic gzips the frame when configured.
//!
//! Status codes follow the OTLP specification: `CANCELLED`, `DEADLINE_EXCEEDED`, `ABORTED`,
//! `OUT_OF_RANGE`, `UNAVAILABLE` and `DATA_LOSS` are retried, `RESOURCE_EXHAUSTED` only when the
//! server sent a `RetryInfo` (whose delay is then honoured), everything else fails for good.

use std::time::Duration;

use bytes::{BufMut as _, Bytes};
use hyper::header::HeaderMap;
use hyper::http::uri::PathAndQuery;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse;
use prost::Message as _;
use tonic::codec::{Codec, CompressionEncoding, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::metadata::MetadataMap;
use tonic::{Code, Status};

use super::handshake_watch::{LastTlsFailure, Watched};
use super::retry::Attempt;
use super::rpc;
use super::settings::{Compression, Endpoint, ExportSettings, Signal};
use super::{tls, tls_failure};

/// Bytes of a collector's answer decoded at most (it is a small protobuf message).
const MAX_RESPONSE_BYTES: usize = 64 * 1024;

type HyperClient = Client<Watched<HttpsConnector<HttpConnector>>, tonic::body::Body>;

#[derive(Clone)]
pub struct GrpcTransport {
    grpc: tonic::client::Grpc<HyperClient>,
    path: PathAndQuery,
    headers: HeaderMap,
    timeout: Duration,
    /// Why a connection's TLS failed after its handshake looked done (see `handshake_watch`).
    last_tls_failure: LastTlsFailure,
}

impl GrpcTransport {
    #[must_use]
    pub fn new(endpoint: &Endpoint, settings: &ExportSettings, tls_config: rustls::ClientConfig) -> Self {
        let last_tls_failure = LastTlsFailure::default();
        let connector = Watched::new(tls::http2_connector(tls_config), last_tls_failure.clone());
        let client: HyperClient = Client::builder(TokioExecutor::new()).http2_only(true).build(connector);
        let mut grpc =
            tonic::client::Grpc::with_origin(client, endpoint.uri()).max_decoding_message_size(MAX_RESPONSE_BYTES);
        if settings.compression == Compression::Gzip {
            grpc = grpc.send_compressed(CompressionEncoding::Gzip);
        }
        let headers = settings.header_map();
        let path = PathAndQuery::from_static(Signal::Traces.grpc_path());
        Self { grpc, path, headers, timeout: settings.timeout, last_tls_failure }
    }

    /// One attempt.
    pub async fn send(&self, body: Bytes) -> Attempt {
        let attempt = self.attempt(body).await;
        if matches!(attempt, Attempt::Accepted { .. }) {
            self.last_tls_failure.clear();
        }
        attempt
    }

    async fn attempt(&self, body: Bytes) -> Attempt {
        let mut grpc = self.grpc.clone();
        if let Err(e) = grpc.ready().await {
            return Attempt::Retryable { reason: format!("connection error: {e}"), after: None };
        }
        let mut request = tonic::Request::new(body);
        *request.metadata_mut() = MetadataMap::from_headers(self.headers.clone());
        request.set_timeout(self.timeout);
        match tokio::time::timeout(self.timeout, grpc.unary(request, self.path.clone(), PassThrough)).await {
            Err(_) => Attempt::Retryable { reason: format!("no answer within {:?}", self.timeout), after: None },
            Ok(Ok(response)) => {
                let (rejected, message) = response
                    .into_inner()
                    .partial_success
                    .map(|p| (p.rejected_spans.max(0) as u64, p.error_message))
                    .unwrap_or_default();
                Attempt::Accepted { rejected, message }
            }
            Ok(Err(status)) => self.explain(&status),
        }
    }
}

impl GrpcTransport {
    /// What a failed call comes to, with its connection's TLS failure when the client cancelled it
    /// without a cause. A status the server sent (no source error) or a failed connect says its own
    /// cause, and shows that an older TLS failure is no longer what happens.
    fn explain(&self, status: &Status) -> Attempt {
        if std::error::Error::source(status).is_none() {
            // Sent by the server: TLS works.
            self.last_tls_failure.clear();
            return classify(status);
        }
        let connect_failed = sources(status).any(|e| is_connect_error(e) && tls_failure::classify(e).is_none());
        match self.last_tls_failure.explain(connect_failed) {
            Some(failure) if matches!(status.code(), Code::Cancelled | Code::Unknown) => Attempt::Tls(failure),
            _ => classify(status),
        }
    }
}

/// The errors behind a status, outermost first.
fn sources(status: &Status) -> impl Iterator<Item = &(dyn std::error::Error + 'static)> {
    std::iter::successors(std::error::Error::source(status), |e| e.source())
}

/// The hyper client could not make the connection (refused, unreachable, no answer).
fn is_connect_error(e: &(dyn std::error::Error + 'static)) -> bool {
    e.downcast_ref::<hyper_util::client::legacy::Error>().is_some_and(hyper_util::client::legacy::Error::is_connect)
}

/// What a failed call comes to.
fn classify(status: &Status) -> Attempt {
    if let Some(failure) = std::error::Error::source(status).and_then(tls_failure::classify) {
        return Attempt::Tls(failure);
    }
    let reason = format!("gRPC {:?}: {}", status.code(), status.message());
    let after = retry_delay(status.details());
    match status.code() {
        Code::Cancelled
        | Code::DeadlineExceeded
        | Code::Aborted
        | Code::OutOfRange
        | Code::Unavailable
        | Code::DataLoss => Attempt::Retryable { reason, after },
        Code::ResourceExhausted if after.is_some() => Attempt::Retryable { reason, after },
        // The hyper client reports a refused or reset connection as `Unknown` with the cause
        // attached: that is the connection error HTTP retries too.
        Code::Unknown if connection_failed(status) => Attempt::Retryable { reason, after: None },
        _ => Attempt::Permanent { reason },
    }
}

fn connection_failed(status: &Status) -> bool {
    sources(status).any(|e| {
        is_connect_error(e)
            || e.downcast_ref::<std::io::Error>().is_some()
            || e.downcast_ref::<hyper::Error>().is_some()
    })
}

/// The delay of a `RetryInfo` in a status's details (`grpc-status-details-bin`), if any.
fn retry_delay(details: &[u8]) -> Option<Duration> {
    let status = rpc::Status::decode(details).ok()?;
    let info = status.details.iter().find(|any| any.type_url == rpc::RETRY_INFO_TYPE)?;
    let delay = rpc::RetryInfo::decode(&info.value[..]).ok()?.retry_delay?;
    let seconds = u64::try_from(delay.seconds).ok()?;
    let nanos = u32::try_from(delay.nanos).ok().filter(|n| *n < 1_000_000_000)?;
    Some(Duration::new(seconds, nanos))
}

/// Writes already-encoded request bytes into the frame as they are; decodes the answer.
struct PassThrough;

impl Codec for PassThrough {
    type Encode = Bytes;
    type Decode = ExportTraceServiceResponse;
    type Encoder = PassThrough;
    type Decoder = ResponseDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        PassThrough
    }

    fn decoder(&mut self) -> Self::Decoder {
        ResponseDecoder
    }
}

impl Encoder for PassThrough {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.reserve(item.len());
        dst.put_slice(&item);
        Ok(())
    }
}

struct ResponseDecoder;

impl Decoder for ResponseDecoder {
    type Item = ExportTraceServiceResponse;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
        ExportTraceServiceResponse::decode(src).map(Some).map_err(|e| Status::internal(format!("bad answer: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn details(type_url: &str, seconds: i64, nanos: i32) -> Vec<u8> {
        let info = rpc::RetryInfo { retry_delay: Some(rpc::Duration { seconds, nanos }) };
        rpc::Status {
            details: vec![rpc::Any { type_url: type_url.into(), value: info.encode_to_vec() }],
            ..Default::default()
        }
        .encode_to_vec()
    }

    #[test]
    fn retry_info_gives_the_delay() {
        assert_eq!(retry_delay(&details(rpc::RETRY_INFO_TYPE, 2, 500_000_000)), Some(Duration::from_millis(2500)));
        assert_eq!(retry_delay(&details("type.googleapis.com/other", 2, 0)), None);
        assert_eq!(retry_delay(&details(rpc::RETRY_INFO_TYPE, -1, 0)), None);
        assert_eq!(retry_delay(b"\xff\xff garbage"), None);
        assert_eq!(retry_delay(&[]), None);
    }

    #[test]
    fn codes_are_classified_as_the_specification_says() {
        let retryable = |status: Status| matches!(classify(&status), Attempt::Retryable { .. });
        for code in [
            Code::Cancelled,
            Code::DeadlineExceeded,
            Code::Aborted,
            Code::OutOfRange,
            Code::Unavailable,
            Code::DataLoss,
        ] {
            assert!(retryable(Status::new(code, "x")), "{code:?}");
        }
        for code in [
            Code::InvalidArgument,
            Code::Unauthenticated,
            Code::PermissionDenied,
            Code::Unimplemented,
            Code::Internal,
            Code::Unknown,
        ] {
            assert!(!retryable(Status::new(code, "x")), "{code:?}");
        }
        assert!(!retryable(Status::new(Code::ResourceExhausted, "x")));
        let with_info = Status::with_details(Code::ResourceExhausted, "x", details(rpc::RETRY_INFO_TYPE, 3, 0).into());
        assert_eq!(
            classify(&with_info),
            Attempt::Retryable { reason: "gRPC ResourceExhausted: x".into(), after: Some(Duration::from_secs(3)) }
        );
    }
}

//! OTLP/HTTP: one protobuf POST per export request, over TLS for `https` endpoints. The body is
//! the encoder's bytes as they are (gzipped when configured, by the caller, off the runtime).

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::header::{CONTENT_ENCODING, CONTENT_TYPE, HeaderMap, HeaderValue, RETRY_AFTER};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse;
use prost::Message as _;

use super::handshake_watch::{LastTlsFailure, Watched};
use super::retry::{self, Attempt};
use super::rpc;
use super::settings::{Compression, Endpoint, ExportSettings};
use super::{tls, tls_failure};

/// Bytes of a collector's answer read at most (it is a small protobuf message).
const MAX_RESPONSE_BYTES: usize = 64 * 1024;

#[derive(Clone)]
pub struct HttpTransport {
    client: Client<Watched<HttpsConnector<HttpConnector>>, Full<Bytes>>,
    uri: hyper::Uri,
    headers: HeaderMap,
    timeout: Duration,
    /// Why a connection's TLS failed after its handshake looked done (see `handshake_watch`).
    last_tls_failure: LastTlsFailure,
}

impl HttpTransport {
    #[must_use]
    pub fn new(endpoint: &Endpoint, settings: &ExportSettings, tls_config: rustls::ClientConfig) -> Self {
        let last_tls_failure = LastTlsFailure::default();
        let connector = Watched::new(tls::http1_connector(tls_config), last_tls_failure.clone());
        let client = Client::builder(TokioExecutor::new()).build(connector);
        let mut headers = settings.header_map();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/x-protobuf"));
        if settings.compression == Compression::Gzip {
            headers.insert(CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        }
        Self { client, uri: endpoint.uri(), headers, timeout: settings.timeout, last_tls_failure }
    }

    /// One attempt.
    pub async fn send(&self, body: Bytes) -> Attempt {
        let mut request = hyper::Request::post(self.uri.clone()).body(Full::new(body)).expect("valid parts");
        *request.headers_mut() = self.headers.clone();
        let response = match tokio::time::timeout(self.timeout, self.client.request(request)).await {
            Err(_) => {
                return Attempt::Retryable { reason: format!("no answer within {:?}", self.timeout), after: None };
            }
            Ok(Err(e)) => {
                // A write the collector hung up on (a large body) can fail before its TLS alert
                // is read: the alert its connection met then says why. A failed connect says its
                // own cause.
                let failure = tls_failure::classify(&e).or_else(|| self.last_tls_failure.explain(e.is_connect()));
                return match failure {
                    Some(failure) => Attempt::Tls(failure),
                    None => Attempt::Retryable { reason: format!("connection error: {e:#}"), after: None },
                };
            }
            Ok(Ok(response)) => {
                // An answer: TLS works on this endpoint now.
                self.last_tls_failure.clear();
                response
            }
        };
        let status = response.status();
        let after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| retry::parse_retry_after(v, SystemTime::now()));
        // Read (and so release) the body, within a bound: the connection can then be reused.
        let body = tokio::time::timeout(self.timeout, Limited::new(response.into_body(), MAX_RESPONSE_BYTES).collect())
            .await
            .ok()
            .and_then(Result::ok)
            .map(http_body_util::Collected::to_bytes);
        if status.is_success() {
            let answer = body.and_then(|b| ExportTraceServiceResponse::decode(b).ok()).unwrap_or_default();
            let (rejected, message) =
                answer.partial_success.map(|p| (p.rejected_spans.max(0) as u64, p.error_message)).unwrap_or_default();
            Attempt::Accepted { rejected, message }
        } else {
            let reason = match body.as_deref().and_then(rpc::error_message) {
                Some(message) => format!("HTTP {status}: {message}"),
                None => format!("HTTP {status}"),
            };
            if retry::http_status_retryable(status.as_u16()) {
                Attempt::Retryable { reason, after }
            } else {
                Attempt::Permanent { reason }
            }
        }
    }
}

//! From finished exchanges to OTLP spans: trace context, the head sampling decision, and the
//! attributes of the stable HTTP semantic conventions.
//!
//! The sampling decision is taken first, from the request head alone; a dropped request builds
//! nothing.

use std::net::SocketAddr;

use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::{Span, Status, span, status};
use tracetap_proxy::haproxy_config::ProxyNames;
use tracetap_proxy::{ClientExchange, RequestHead, ServerExchange, TraceparentField};

use crate::sampling::Sampler;
use tracetap_proxy::trace_context::{FLAG_RANDOM, parse_traceparent};

/// Span flags: the W3C sampled flag, plus "has `is_remote`" (bit 8) and "`is_remote`" (bit 9) of the
/// OTLP `SpanFlags` for the parent.
const SAMPLED: u32 = 0x01;
const HAS_IS_REMOTE: u32 = 0x100;
const IS_REMOTE: u32 = 0x200;

/// A span and the traced process it belongs to (one OTLP resource per process).
#[derive(Debug, Clone)]
pub struct SpanRecord {
    pub tgid: u32,
    pub span: Span,
}

/// Builds spans. Owned by the capture thread.
#[derive(Debug)]
pub struct SpanBuilder {
    sampler: Sampler,
    rng: fastrand::Rng,
    /// Added to monotonic ns to get Unix ns.
    mono_to_unix_ns: i128,
}

/// What [`SpanBuilder::build`] did with an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Built {
    Sampled { spans: usize },
    Dropped,
}

impl SpanBuilder {
    #[must_use]
    pub fn new(sampler: Sampler, mono_to_unix_ns: i128) -> Self {
        Self { sampler, rng: fastrand::Rng::new(), mono_to_unix_ns }
    }

    fn unix_ns(&self, mono: u64) -> u64 {
        (i128::from(mono) + self.mono_to_unix_ns).max(0) as u64
    }

    /// Builds the SERVER span of `ex` and a CLIENT span per backend exchange into `out`, named after
    /// HAProxy's frontend and backends when `names` knows them.
    pub fn build(&mut self, ex: &ServerExchange, names: Option<&ProxyNames>, out: &mut Vec<SpanRecord>) -> Built {
        let parent = ex.request.as_ref().and_then(|r| match &r.traceparent {
            TraceparentField::One(v) => parse_traceparent(v),
            TraceparentField::Absent | TraceparentField::Repeated => None,
        });
        let trace_id = parent.map_or_else(|| new_trace_id(&mut self.rng), |p| p.trace_id);
        let incoming_state = ex.request.as_ref().and_then(|r| r.tracestate.as_deref());
        let Some(trace_state) = self.sampler.decide(parent.as_ref(), incoming_state, &trace_id) else {
            return Built::Dropped;
        };
        let span_id = new_span_id(&mut self.rng);
        let flags = match parent {
            Some(p) => SAMPLED | u32::from(p.flags & FLAG_RANDOM) | HAS_IS_REMOTE | IS_REMOTE,
            None => SAMPLED | u32::from(FLAG_RANDOM) | HAS_IS_REMOTE,
        };
        let request = ex.request.as_ref();
        let method = request.map_or("_OTHER", |r| known_method(&r.method));
        let status_code = ex.response.map(|r| r.status);
        let mut attributes = Vec::with_capacity(12);
        push_request_attributes(&mut attributes, request);
        if let Some(r) = request {
            if let Some(host) = &r.host {
                let (address, port) = split_host(host);
                attributes.push(kv_str("server.address", address));
                if let Some(port) = port {
                    attributes.push(kv_int("server.port", i64::from(port)));
                }
            }
            if let Some(ua) = &r.user_agent {
                attributes.push(kv_str("user_agent.original", ua));
            }
        }
        if let Some(peer) = ex.peer {
            attributes.push(kv_str("client.address", &peer.ip().to_string()));
            push_peer(&mut attributes, peer);
        }
        if let Some(code) = status_code {
            attributes.push(kv_int("http.response.status_code", i64::from(code)));
        }
        let frontend = names.zip(ex.local).and_then(|(n, local)| n.frontend(local));
        if let Some(fe) = frontend {
            attributes.push(kv_str("haproxy.frontend", fe));
        }
        // SERVER spans: 5xx and aborted exchanges are errors, 4xx are the client's business.
        let error_type = ex
            .outcome
            .error_type()
            .map(str::to_owned)
            .or_else(|| status_code.filter(|c| *c >= 500).map(|c| c.to_string()));
        let server_span_index = out.len();
        out.push(SpanRecord {
            tgid: ex.tgid,
            span: Span {
                trace_id: trace_id.to_vec(),
                span_id: span_id.to_vec(),
                trace_state: trace_state.clone(),
                parent_span_id: parent.map(|p| p.parent_id.to_vec()).unwrap_or_default(),
                flags,
                name: span_name(method, frontend),
                kind: span::SpanKind::Server as i32,
                start_time_unix_nano: self.unix_ns(ex.start_ns),
                end_time_unix_nano: self.unix_ns(ex.end_ns.max(ex.start_ns)),
                status: Some(status_for(error_type.is_some())),
                attributes: with_error(attributes, error_type),
                ..Span::default()
            },
        });
        for client in &ex.clients {
            let mut span = self.client_span(client, names, &trace_id, Some(&span_id), SAMPLED | HAS_IS_REMOTE);
            span.trace_state.clone_from(&trace_state);
            out.push(SpanRecord { tgid: ex.tgid, span });
        }
        Built::Sampled { spans: out.len() - server_span_index }
    }

    fn client_span(
        &mut self,
        ex: &ClientExchange,
        names: Option<&ProxyNames>,
        trace_id: &[u8; 16],
        parent: Option<&[u8; 8]>,
        flags: u32,
    ) -> Span {
        let mut attributes = Vec::with_capacity(10);
        push_request_attributes(&mut attributes, Some(&ex.request));
        if let Some(server) = ex.server {
            attributes.push(kv_str("server.address", &server.ip().to_string()));
            attributes.push(kv_int("server.port", i64::from(server.port())));
            attributes.push(kv_str("url.full", &format!("http://{server}{}", ex.request.target)));
            push_peer(&mut attributes, server);
        }
        let status_code = ex.response.map(|r| r.status);
        if let Some(code) = status_code {
            attributes.push(kv_int("http.response.status_code", i64::from(code)));
        }
        let backend = names.zip(ex.server).and_then(|(n, server)| n.server(server));
        if let Some((be, srv)) = backend {
            attributes.push(kv_str("haproxy.backend", be));
            attributes.push(kv_str("haproxy.server", srv));
        }
        // CLIENT spans: any status from 400 up is an error, per the HTTP conventions.
        let error_type = ex
            .outcome
            .error_type()
            .map(str::to_owned)
            .or_else(|| status_code.filter(|c| *c >= 400).map(|c| c.to_string()));
        Span {
            trace_id: trace_id.to_vec(),
            span_id: new_span_id(&mut self.rng).to_vec(),
            parent_span_id: parent.map(|p| p.to_vec()).unwrap_or_default(),
            flags,
            name: span_name(known_method(&ex.request.method), backend.map(|(be, _)| be)),
            kind: span::SpanKind::Client as i32,
            start_time_unix_nano: self.unix_ns(ex.start_ns),
            end_time_unix_nano: self.unix_ns(ex.end_ns.max(ex.start_ns)),
            status: Some(status_for(error_type.is_some())),
            attributes: with_error(attributes, error_type),
            ..Span::default()
        }
    }
}

/// A new random trace id (non-zero; the W3C random flag may be set on spans that carry it).
#[must_use]
fn new_trace_id(rng: &mut fastrand::Rng) -> [u8; 16] {
    loop {
        let id = rng.u128(..).to_be_bytes();
        if id != [0; 16] {
            return id;
        }
    }
}

/// A new random span id (non-zero).
#[must_use]
fn new_span_id(rng: &mut fastrand::Rng) -> [u8; 8] {
    loop {
        let id = rng.u64(..).to_be_bytes();
        if id != [0; 8] {
            return id;
        }
    }
}

/// `{method} {proxy}` when HAProxy's name for the frontend or backend is known, else `{method}`.
fn span_name(method: &str, proxy: Option<&str>) -> String {
    match proxy {
        Some(p) => format!("{method} {p}"),
        None => method.to_owned(),
    }
}

/// Methods of RFC 9110 and PATCH keep their name; anything else is `_OTHER`, per the conventions.
fn known_method(method: &str) -> &str {
    match method {
        "GET" | "HEAD" | "POST" | "PUT" | "DELETE" | "CONNECT" | "OPTIONS" | "TRACE" | "PATCH" => method,
        _ => "_OTHER",
    }
}

fn push_request_attributes(attributes: &mut Vec<KeyValue>, request: Option<&RequestHead>) {
    let Some(r) = request else {
        attributes.push(kv_str("http.request.method", "_OTHER"));
        return;
    };
    if r.truncated {
        // Headers past the capture window (a traceparent among them) were not seen.
        attributes.push(kv_bool("tracetap.head_truncated", true));
    }
    let method = known_method(&r.method);
    attributes.push(kv_str("http.request.method", method));
    if method != r.method {
        attributes.push(kv_str("http.request.method_original", &r.method));
    }
    attributes.push(kv_str("url.path", r.path()));
    if let Some(q) = r.query() {
        attributes.push(kv_str("url.query", q));
    }
    attributes.push(kv_str("url.scheme", "http"));
    attributes.push(kv_str("network.protocol.version", if r.version_minor == 0 { "1.0" } else { "1.1" }));
}

fn push_peer(attributes: &mut Vec<KeyValue>, peer: SocketAddr) {
    attributes.push(kv_str("network.peer.address", &peer.ip().to_string()));
    attributes.push(kv_int("network.peer.port", i64::from(peer.port())));
}

fn with_error(mut attributes: Vec<KeyValue>, error_type: Option<String>) -> Vec<KeyValue> {
    if let Some(e) = error_type {
        attributes.push(kv_str("error.type", &e));
    }
    attributes
}

fn status_for(error: bool) -> Status {
    if error { Status { code: status::StatusCode::Error as i32, message: String::new() } } else { Status::default() }
}

/// Splits a Host header into name and port (`[::1]:80`, `example.com:8080`, `example.com`).
fn split_host(host: &str) -> (&str, Option<u16>) {
    if let Some(rest) = host.strip_prefix('[')
        && let Some((addr, after)) = rest.split_once(']')
    {
        return (addr, after.strip_prefix(':').and_then(|p| p.parse().ok()));
    }
    match host.rsplit_once(':') {
        Some((name, port)) if !name.contains(':') => match port.parse() {
            Ok(p) => (name, Some(p)),
            Err(_) => (host, None),
        },
        _ => (host, None),
    }
}

pub(crate) fn kv_str(key: &str, value: &str) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue { value: Some(any_value::Value::StringValue(value.to_owned())) }),
        ..KeyValue::default()
    }
}

pub(crate) fn kv_bool(key: &str, value: bool) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue { value: Some(any_value::Value::BoolValue(value)) }),
        ..KeyValue::default()
    }
}

pub(crate) fn kv_int(key: &str, value: i64) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue { value: Some(any_value::Value::IntValue(value)) }),
        ..KeyValue::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracetap_proxy::Outcome;
    use tracetap_proxy::head::{parse_request, parse_response};

    fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a any_value::Value> {
        span.attributes.iter().find(|kv| kv.key == key).and_then(|kv| kv.value.as_ref()?.value.as_ref())
    }

    fn exchange(request: &[u8], status: &[u8], outcome: Outcome) -> ServerExchange {
        let req = parse_request(request).unwrap();
        ServerExchange {
            tgid: 42,
            clients: vec![ClientExchange {
                request: req.clone(),
                response: Some(parse_response(status).unwrap()),
                server: Some("127.0.0.1:8080".parse().unwrap()),
                start_ns: 20,
                end_ns: 30,
                outcome,
            }],
            request: Some(req),
            response: Some(parse_response(status).unwrap()),
            peer: Some("10.1.2.3:5555".parse().unwrap()),
            local: None,
            start_ns: 10,
            end_ns: 40,
            outcome,
        }
    }

    #[test]
    fn incoming_traceparent_is_continued() {
        let ex = exchange(
            b"GET /x?y=1 HTTP/1.1\r\nHost: shop:8443\r\ntraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\ntracestate: a=b\r\n\r\n",
            b"HTTP/1.1 200 OK\r\n\r\n",
            Outcome::Complete,
        );
        let mut b = SpanBuilder::new(Sampler::default(), 1000);
        let mut out = Vec::new();
        assert_eq!(b.build(&ex, None, &mut out), Built::Sampled { spans: 2 });
        let (server, client) = (&out[0].span, &out[1].span);
        assert_eq!(hex(&server.trace_id), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(hex(&server.parent_span_id), "b7ad6b7169203331");
        assert_eq!(server.trace_state, "a=b", "parent-based: the upstream tracestate is kept");
        assert_eq!(client.trace_state, "a=b");
        assert_eq!(client.trace_id, server.trace_id);
        assert_eq!(client.parent_span_id, server.span_id);
        assert_eq!(server.start_time_unix_nano, 1010);
        assert_eq!(server.kind, span::SpanKind::Server as i32);
        assert_eq!(attr(server, "url.path"), Some(&any_value::Value::StringValue("/x".into())));
        assert_eq!(attr(server, "server.port"), Some(&any_value::Value::IntValue(8443)));
        assert_eq!(attr(server, "client.address"), Some(&any_value::Value::StringValue("10.1.2.3".into())));
        assert_eq!(attr(client, "server.port"), Some(&any_value::Value::IntValue(8080)));
        assert_eq!(server.status.as_ref().unwrap().code, 0);
    }

    #[test]
    fn sampled_out_parent_builds_nothing() {
        let ex = exchange(
            b"GET / HTTP/1.1\r\ntraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00\r\n\r\n",
            b"HTTP/1.1 200 OK\r\n\r\n",
            Outcome::Complete,
        );
        let mut out = Vec::new();
        assert_eq!(SpanBuilder::new(Sampler::default(), 0).build(&ex, None, &mut out), Built::Dropped);
        assert!(out.is_empty());
    }

    #[test]
    fn errors_are_marked() {
        let ex = exchange(b"GET / HTTP/1.1\r\n\r\n", b"HTTP/1.1 503 Service Unavailable\r\n\r\n", Outcome::Complete);
        let mut out = Vec::new();
        SpanBuilder::new(Sampler::default(), 0).build(&ex, None, &mut out);
        assert_eq!(out[0].span.status.as_ref().unwrap().code, status::StatusCode::Error as i32);
        assert_eq!(attr(&out[0].span, "error.type"), Some(&any_value::Value::StringValue("503".into())));
        let ex = exchange(b"GET / HTTP/1.1\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n", Outcome::ClosedBeforeResponse);
        out.clear();
        SpanBuilder::new(Sampler::default(), 0).build(&ex, None, &mut out);
        assert_eq!(
            attr(&out[0].span, "error.type"),
            Some(&any_value::Value::StringValue("connection_closed_before_response".into()))
        );
    }

    #[test]
    fn names_from_the_config() {
        let mut ex = exchange(b"GET / HTTP/1.1\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n", Outcome::Complete);
        ex.local = Some("127.0.0.1:80".parse().unwrap());
        let names = tracetap_proxy::haproxy_config::parse(
            "frontend fe_main\n bind 127.0.0.1:80\nbackend be_app\n server app1 127.0.0.1:8080\n",
        );
        let mut out = Vec::new();
        SpanBuilder::new(Sampler::default(), 0).build(&ex, Some(&names), &mut out);
        assert_eq!(out[0].span.name, "GET fe_main");
        assert_eq!(attr(&out[0].span, "haproxy.frontend"), Some(&any_value::Value::StringValue("fe_main".into())));
        assert_eq!(out[1].span.name, "GET be_app");
        assert_eq!(attr(&out[1].span, "haproxy.server"), Some(&any_value::Value::StringValue("app1".into())));
    }

    #[test]
    fn new_ids_are_not_zero() {
        let mut rng = fastrand::Rng::with_seed(7);
        assert_ne!(new_trace_id(&mut rng), [0; 16]);
        assert_ne!(new_span_id(&mut rng), [0; 8]);
    }

    #[test]
    fn host_splitting() {
        assert_eq!(split_host("a:1"), ("a", Some(1)));
        assert_eq!(split_host("a"), ("a", None));
        assert_eq!(split_host("[::1]:8080"), ("::1", Some(8080)));
        assert_eq!(split_host("::1"), ("::1", None));
    }

    fn hex(b: &[u8]) -> String {
        b.iter().fold(String::new(), |mut s, x| {
            let _ = std::fmt::Write::write_fmt(&mut s, format_args!("{x:02x}"));
            s
        })
    }
}

//! OTLP protobuf encoding straight from borrowed span views, without building prost structs.
//!
//! A [`SpanView`] borrows its strings from the finished exchange (method, path, host, user agent:
//! the captured bytes) or from a `bumpalo` arena (formatted addresses, span names); keys
//! are `'static`. [`BatchEncoder`] writes an `ExportTraceServiceRequest` with prost's encoding
//! primitives: one `ResourceSpans` per traced process, resource and scope encoded once per
//! resource, into an output buffer it reuses across batches. Nested messages are length-prefixed,
//! so every message's size is computed before it is written (`*_len` functions mirror `write_*`).
//!
//! Invariant: the bytes decode with `opentelemetry-proto` to exactly what [`SpanView::to_prost`]
//! builds (tested below and in `tests/encode.rs`).

use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::{Span, Status, span, status};
use prost::encoding::{WireType, encode_varint, encoded_len_varint, key_len};

/// An attribute value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value<'a> {
    Str(&'a str),
    Int(i64),
    Bool(bool),
    Double(f64),
}

/// An attribute.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Attr<'a> {
    pub key: &'a str,
    pub value: Value<'a>,
}

/// A span as borrowed views; see the module note.
#[derive(Clone, Copy, Debug)]
pub struct SpanView<'a> {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    /// All zero for a root span.
    pub parent_span_id: [u8; 8],
    pub trace_state: &'a str,
    pub flags: u32,
    pub name: &'a str,
    /// OTLP `SpanKind` value.
    pub kind: i32,
    pub start_unix_ns: u64,
    pub end_unix_ns: u64,
    pub attributes: &'a [Attr<'a>],
    /// Moments on the span's timeline (no attributes of their own).
    pub events: &'a [EventView<'a>],
    pub error: bool,
}

/// A span event: a name at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventView<'a> {
    pub time_unix_ns: u64,
    pub name: &'a str,
}

impl SpanView<'_> {
    /// The same span as a prost message (the reference path, for tests and benchmarks).
    #[must_use]
    pub fn to_prost(&self) -> Span {
        Span {
            trace_id: self.trace_id.to_vec(),
            span_id: self.span_id.to_vec(),
            trace_state: self.trace_state.to_owned(),
            parent_span_id: if self.parent_span_id == [0; 8] { Vec::new() } else { self.parent_span_id.to_vec() },
            flags: self.flags,
            name: self.name.to_owned(),
            kind: self.kind,
            start_time_unix_nano: self.start_unix_ns,
            end_time_unix_nano: self.end_unix_ns,
            attributes: self.attributes.iter().map(Attr::to_prost).collect(),
            events: self
                .events
                .iter()
                .map(|e| span::Event {
                    time_unix_nano: e.time_unix_ns,
                    name: e.name.to_owned(),
                    ..span::Event::default()
                })
                .collect(),
            status: Some(if self.error {
                Status { code: status::StatusCode::Error as i32, message: String::new() }
            } else {
                Status::default()
            }),
            ..Span::default()
        }
    }
}

impl Attr<'_> {
    #[must_use]
    pub fn to_prost(&self) -> KeyValue {
        let value = match self.value {
            Value::Str(s) => any_value::Value::StringValue(s.to_owned()),
            Value::Int(i) => any_value::Value::IntValue(i),
            Value::Bool(b) => any_value::Value::BoolValue(b),
            Value::Double(d) => any_value::Value::DoubleValue(d),
        };
        KeyValue { key: self.key.to_owned(), value: Some(AnyValue { value: Some(value) }), ..KeyValue::default() }
    }
}

// Field numbers of the OTLP messages written here (opentelemetry-proto, trace/v1, common/v1).
mod field {
    pub const REQUEST_RESOURCE_SPANS: u32 = 1;
    pub const RESOURCE_SPANS_RESOURCE: u32 = 1;
    pub const RESOURCE_SPANS_SCOPE_SPANS: u32 = 2;
    pub const RESOURCE_ATTRIBUTES: u32 = 1;
    pub const SCOPE_SPANS_SCOPE: u32 = 1;
    pub const SCOPE_SPANS_SPANS: u32 = 2;
    pub const SCOPE_NAME: u32 = 1;
    pub const SCOPE_VERSION: u32 = 2;
    pub const SPAN_TRACE_ID: u32 = 1;
    pub const SPAN_SPAN_ID: u32 = 2;
    pub const SPAN_TRACE_STATE: u32 = 3;
    pub const SPAN_PARENT_SPAN_ID: u32 = 4;
    pub const SPAN_NAME: u32 = 5;
    pub const SPAN_KIND: u32 = 6;
    pub const SPAN_START: u32 = 7;
    pub const SPAN_END: u32 = 8;
    pub const SPAN_ATTRIBUTES: u32 = 9;
    pub const SPAN_EVENTS: u32 = 11;
    pub const EVENT_TIME: u32 = 1;
    pub const EVENT_NAME: u32 = 2;
    pub const SPAN_STATUS: u32 = 15;
    pub const SPAN_FLAGS: u32 = 16;
    pub const STATUS_CODE: u32 = 3;
    pub const KV_KEY: u32 = 1;
    pub const KV_VALUE: u32 = 2;
    pub const ANY_STRING: u32 = 1;
    pub const ANY_BOOL: u32 = 2;
    pub const ANY_INT: u32 = 3;
    pub const ANY_DOUBLE: u32 = 4;
}

const STATUS_ERROR: u64 = 2;

/// The instrumentation scope of every span tracetap writes.
const SCOPE_NAME: &str = "tracetap";
const SCOPE_VERSION: &str = env!("CARGO_PKG_VERSION");

/// prost's `encode_varint`, with the one-byte case pushed straight onto the buffer: field keys,
/// most lengths and small integers, nearly every varint a span holds. prost's loop goes through
/// `BufMut` a byte at a time and is not inlined; this is a tenth of the encoding's time.
#[inline]
fn put_varint(buf: &mut Vec<u8>, value: u64) {
    if value < 0x80 {
        buf.push(value as u8);
    } else {
        encode_varint(value, buf);
    }
}

/// prost's `encode_key`, through [`put_varint`].
#[inline]
fn put_key(buf: &mut Vec<u8>, field: u32, wire_type: WireType) {
    put_varint(buf, (u64::from(field) << 3) | wire_type as u64);
}

fn len_delimited_len(field: u32, len: usize) -> usize {
    key_len(field) + encoded_len_varint(len as u64) + len
}

fn write_len_delimited(buf: &mut Vec<u8>, field: u32, len: usize) {
    put_key(buf, field, WireType::LengthDelimited);
    put_varint(buf, len as u64);
}

fn bytes_len(field: u32, bytes: &[u8]) -> usize {
    if bytes.is_empty() { 0 } else { len_delimited_len(field, bytes.len()) }
}

fn write_bytes(buf: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    if !bytes.is_empty() {
        write_len_delimited(buf, field, bytes.len());
        buf.extend_from_slice(bytes);
    }
}

fn any_value_len(value: Value<'_>) -> usize {
    match value {
        // A oneof member is written even when it holds the default value.
        Value::Str(s) => len_delimited_len(field::ANY_STRING, s.len()),
        Value::Int(i) => key_len(field::ANY_INT) + encoded_len_varint(i as u64),
        Value::Bool(_) => key_len(field::ANY_BOOL) + 1,
        Value::Double(_) => key_len(field::ANY_DOUBLE) + 8,
    }
}

fn write_any_value(buf: &mut Vec<u8>, value: Value<'_>) {
    match value {
        Value::Str(s) => {
            write_len_delimited(buf, field::ANY_STRING, s.len());
            buf.extend_from_slice(s.as_bytes());
        }
        Value::Int(i) => {
            put_key(buf, field::ANY_INT, WireType::Varint);
            put_varint(buf, i as u64);
        }
        Value::Bool(b) => {
            put_key(buf, field::ANY_BOOL, WireType::Varint);
            put_varint(buf, u64::from(b));
        }
        Value::Double(d) => {
            put_key(buf, field::ANY_DOUBLE, WireType::SixtyFourBit);
            buf.extend_from_slice(&d.to_le_bytes());
        }
    }
}

fn key_value_len(attr: &Attr<'_>) -> usize {
    key_value_len_with(attr, any_value_len(attr.value))
}

/// [`key_value_len`] for a value whose [`any_value_len`] is known.
fn key_value_len_with(attr: &Attr<'_>, value_len: usize) -> usize {
    bytes_len(field::KV_KEY, attr.key.as_bytes()) + len_delimited_len(field::KV_VALUE, value_len)
}

fn write_key_value(buf: &mut Vec<u8>, field: u32, attr: &Attr<'_>) {
    let value_len = any_value_len(attr.value);
    write_len_delimited(buf, field, key_value_len_with(attr, value_len));
    write_bytes(buf, field::KV_KEY, attr.key.as_bytes());
    write_len_delimited(buf, field::KV_VALUE, value_len);
    write_any_value(buf, attr.value);
}

fn event_len(event: &EventView<'_>) -> usize {
    (if event.time_unix_ns == 0 { 0 } else { key_len(field::EVENT_TIME) + 8 })
        + bytes_len(field::EVENT_NAME, event.name.as_bytes())
}

fn write_event(buf: &mut Vec<u8>, event: &EventView<'_>) {
    write_len_delimited(buf, field::SPAN_EVENTS, event_len(event));
    if event.time_unix_ns != 0 {
        put_key(buf, field::EVENT_TIME, WireType::SixtyFourBit);
        buf.extend_from_slice(&event.time_unix_ns.to_le_bytes());
    }
    write_bytes(buf, field::EVENT_NAME, event.name.as_bytes());
}

fn status_len(error: bool) -> usize {
    if error { key_len(field::STATUS_CODE) + encoded_len_varint(STATUS_ERROR) } else { 0 }
}

fn span_len(span: &SpanView<'_>) -> usize {
    let parent: &[u8] = if span.parent_span_id == [0; 8] { &[] } else { &span.parent_span_id };
    bytes_len(field::SPAN_TRACE_ID, &span.trace_id)
        + bytes_len(field::SPAN_SPAN_ID, &span.span_id)
        + bytes_len(field::SPAN_TRACE_STATE, span.trace_state.as_bytes())
        + bytes_len(field::SPAN_PARENT_SPAN_ID, parent)
        + bytes_len(field::SPAN_NAME, span.name.as_bytes())
        + if span.kind == 0 { 0 } else { key_len(field::SPAN_KIND) + encoded_len_varint(span.kind as u64) }
        + if span.start_unix_ns == 0 { 0 } else { key_len(field::SPAN_START) + 8 }
        + if span.end_unix_ns == 0 { 0 } else { key_len(field::SPAN_END) + 8 }
        + span.attributes.iter().map(|a| len_delimited_len(field::SPAN_ATTRIBUTES, key_value_len(a))).sum::<usize>()
        + span.events.iter().map(|e| len_delimited_len(field::SPAN_EVENTS, event_len(e))).sum::<usize>()
        // `status` is always present (possibly empty), as the prost path sets it.
        + len_delimited_len(field::SPAN_STATUS, status_len(span.error))
        + if span.flags == 0 { 0 } else { key_len(field::SPAN_FLAGS) + 4 }
}

/// Writes `span`, whose [`span_len`] is `len` (computed once: the scope's length needs it too).
fn write_span(buf: &mut Vec<u8>, span: &SpanView<'_>, len: usize) {
    let parent: &[u8] = if span.parent_span_id == [0; 8] { &[] } else { &span.parent_span_id };
    write_len_delimited(buf, field::SCOPE_SPANS_SPANS, len);
    write_bytes(buf, field::SPAN_TRACE_ID, &span.trace_id);
    write_bytes(buf, field::SPAN_SPAN_ID, &span.span_id);
    write_bytes(buf, field::SPAN_TRACE_STATE, span.trace_state.as_bytes());
    write_bytes(buf, field::SPAN_PARENT_SPAN_ID, parent);
    write_bytes(buf, field::SPAN_NAME, span.name.as_bytes());
    if span.kind != 0 {
        put_key(buf, field::SPAN_KIND, WireType::Varint);
        put_varint(buf, span.kind as u64);
    }
    if span.start_unix_ns != 0 {
        put_key(buf, field::SPAN_START, WireType::SixtyFourBit);
        buf.extend_from_slice(&span.start_unix_ns.to_le_bytes());
    }
    if span.end_unix_ns != 0 {
        put_key(buf, field::SPAN_END, WireType::SixtyFourBit);
        buf.extend_from_slice(&span.end_unix_ns.to_le_bytes());
    }
    for attr in span.attributes {
        write_key_value(buf, field::SPAN_ATTRIBUTES, attr);
    }
    for event in span.events {
        write_event(buf, event);
    }
    write_len_delimited(buf, field::SPAN_STATUS, status_len(span.error));
    if span.error {
        put_key(buf, field::STATUS_CODE, WireType::Varint);
        put_varint(buf, STATUS_ERROR);
    }
    if span.flags != 0 {
        put_key(buf, field::SPAN_FLAGS, WireType::ThirtyTwoBit);
        buf.extend_from_slice(&span.flags.to_le_bytes());
    }
}

/// Encodes batches; owns the output buffer and the resource attributes shared by all processes.
#[derive(Debug)]
pub struct BatchEncoder {
    buf: Vec<u8>,
    /// `service.name`, `host.name`, `OTEL_RESOURCE_ATTRIBUTES`; `process.pid` is added per process.
    resource: Vec<(String, String)>,
    /// Attributes of one process's resource (its container and pod), after the shared ones.
    processes: rustc_hash::FxHashMap<u32, Vec<(String, String)>>,
    scope_name: &'static str,
    scope_version: &'static str,
    /// One group's spans, encoded before their `ResourceSpans` (see [`Self::encode`]).
    spans_buf: Vec<u8>,
}

impl BatchEncoder {
    #[must_use]
    pub fn new(resource: Vec<(String, String)>) -> Self {
        Self {
            buf: Vec::with_capacity(64 * 1024),
            resource,
            processes: rustc_hash::FxHashMap::default(),
            scope_name: SCOPE_NAME,
            scope_version: SCOPE_VERSION,
            spans_buf: Vec::new(),
        }
    }

    /// Sets the attributes only `pid`'s resource carries (`container.id`, `k8s.pod.uid`, ...).
    pub fn set_process_attributes(&mut self, pid: u32, attributes: Vec<(String, String)>) {
        if attributes.is_empty() {
            self.processes.remove(&pid);
        } else {
            self.processes.insert(pid, attributes);
        }
    }

    /// Forgets a process that exited.
    pub fn forget_process(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }

    /// The shared attributes (those a process sets itself, such as a pod's `service.name`, give
    /// way), the process's own, then `process.pid`.
    fn resource_attrs(&self, pid: u32) -> impl Iterator<Item = Attr<'_>> + Clone {
        let own = self.processes.get(&pid).map_or(&[][..], Vec::as_slice);
        self.resource
            .iter()
            .filter(move |(k, _)| !own.iter().any(|(own_key, _)| own_key == k))
            .chain(own)
            .map(|(k, v)| Attr { key: k, value: Value::Str(v) })
            .chain(std::iter::once(Attr { key: "process.pid", value: Value::Int(i64::from(pid)) }))
    }

    /// Encodes an `ExportTraceServiceRequest` with one `ResourceSpans` per `(pid, spans)` group and
    /// returns the bytes (valid until the next call).
    pub fn encode<'s>(&mut self, groups: impl IntoIterator<Item = (u32, &'s [SpanView<'s>])>) -> &[u8] {
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        let mut spans_buf = std::mem::take(&mut self.spans_buf);
        for (pid, spans) in groups {
            spans_buf.clear();
            write_spans(&mut spans_buf, spans);
            self.write_resource_spans(&mut buf, pid, &spans_buf);
        }
        self.spans_buf = spans_buf;
        self.buf = buf;
        &self.buf
    }

    /// [`Self::encode`] for spans already encoded, each group's by [`write_spans`] (the batcher
    /// encodes an exchange's spans as it takes it), with the bytes handed over in a buffer of their
    /// own rather than copied out (a batch's bytes go to another thread); the next batch is written
    /// into a new buffer of the same size.
    pub fn encode_written_owned<'s>(&mut self, groups: impl IntoIterator<Item = (u32, &'s [u8])>) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        for (pid, spans) in groups {
            self.write_resource_spans(&mut buf, pid, spans);
        }
        let next = Vec::with_capacity(buf.len());
        self.buf = next;
        buf
    }

    /// Appends one `ResourceSpans` field: process `pid`'s resource, the scope, and `spans` (as
    /// [`write_spans`] writes them).
    fn write_resource_spans(&self, buf: &mut Vec<u8>, pid: u32, spans: &[u8]) {
        let attrs = self.resource_attrs(pid);
        let resource_len: usize =
            attrs.clone().map(|a| len_delimited_len(field::RESOURCE_ATTRIBUTES, key_value_len(&a))).sum();
        let scope_len = bytes_len(field::SCOPE_NAME, self.scope_name.as_bytes())
            + bytes_len(field::SCOPE_VERSION, self.scope_version.as_bytes());
        let scope_spans_len = len_delimited_len(field::SCOPE_SPANS_SCOPE, scope_len) + spans.len();
        let resource_spans_len = len_delimited_len(field::RESOURCE_SPANS_RESOURCE, resource_len)
            + len_delimited_len(field::RESOURCE_SPANS_SCOPE_SPANS, scope_spans_len);
        // The group's size is known: one reservation, no growth while it is written.
        buf.reserve(len_delimited_len(field::REQUEST_RESOURCE_SPANS, resource_spans_len));
        write_len_delimited(buf, field::REQUEST_RESOURCE_SPANS, resource_spans_len);
        write_len_delimited(buf, field::RESOURCE_SPANS_RESOURCE, resource_len);
        for attr in attrs {
            write_key_value(buf, field::RESOURCE_ATTRIBUTES, &attr);
        }
        write_len_delimited(buf, field::RESOURCE_SPANS_SCOPE_SPANS, scope_spans_len);
        write_len_delimited(buf, field::SCOPE_SPANS_SCOPE, scope_len);
        write_bytes(buf, field::SCOPE_NAME, self.scope_name.as_bytes());
        write_bytes(buf, field::SCOPE_VERSION, self.scope_version.as_bytes());
        buf.extend_from_slice(spans);
    }
}

/// Appends `spans` as `ScopeSpans.spans` fields: the spans of one process, as
/// [`BatchEncoder::encode_written_owned`] takes them.
pub fn write_spans(buf: &mut Vec<u8>, spans: &[SpanView<'_>]) {
    for span in spans {
        let len = span_len(span);
        // The span's size is known: one reservation, no growth while it is written.
        buf.reserve(len_delimited_len(field::SCOPE_SPANS_SPANS, len));
        write_span(buf, span, len);
    }
}

/// Appends an encoded `Span` message as a `ScopeSpans.spans` field, for [`write_request`].
pub fn push_span(buf: &mut Vec<u8>, span: &[u8]) {
    write_len_delimited(buf, field::SCOPE_SPANS_SPANS, span.len());
    buf.extend_from_slice(span);
}

/// Appends a `Span` message given as its fields other than `trace_state` (in order) and a new
/// `trace_state`, written last (protobuf reads fields in any order), as a `ScopeSpans.spans` field.
pub fn push_span_with_trace_state(buf: &mut Vec<u8>, rest: &[&[u8]], trace_state: &str) {
    let len = rest.iter().map(|r| r.len()).sum::<usize>() + bytes_len(field::SPAN_TRACE_STATE, trace_state.as_bytes());
    write_len_delimited(buf, field::SCOPE_SPANS_SPANS, len);
    for r in rest {
        buf.extend_from_slice(r);
    }
    write_bytes(buf, field::SPAN_TRACE_STATE, trace_state.as_bytes());
}

/// An encoded `Resource` message with these attributes.
#[must_use]
pub fn resource<'a>(attrs: impl IntoIterator<Item = Attr<'a>>) -> Vec<u8> {
    let mut buf = Vec::new();
    for attr in attrs {
        write_key_value(&mut buf, field::RESOURCE_ATTRIBUTES, &attr);
    }
    buf
}

/// Writes an `ExportTraceServiceRequest` into `buf` from parts already encoded: per group, a
/// `Resource` message and its spans as [`push_span`] framed them, under tracetap's scope. Tail
/// sampling assembles its exports this way from the bytes it buffered, never decoding a span.
pub fn write_request<'a>(buf: &mut Vec<u8>, groups: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) {
    let (name, version) = (SCOPE_NAME.as_bytes(), SCOPE_VERSION.as_bytes());
    let scope_len = bytes_len(field::SCOPE_NAME, name) + bytes_len(field::SCOPE_VERSION, version);
    for (resource, spans) in groups {
        let scope_spans_len = len_delimited_len(field::SCOPE_SPANS_SCOPE, scope_len) + spans.len();
        let resource_spans_len = len_delimited_len(field::RESOURCE_SPANS_RESOURCE, resource.len())
            + len_delimited_len(field::RESOURCE_SPANS_SCOPE_SPANS, scope_spans_len);
        write_len_delimited(buf, field::REQUEST_RESOURCE_SPANS, resource_spans_len);
        write_len_delimited(buf, field::RESOURCE_SPANS_RESOURCE, resource.len());
        buf.extend_from_slice(resource);
        write_len_delimited(buf, field::RESOURCE_SPANS_SCOPE_SPANS, scope_spans_len);
        write_len_delimited(buf, field::SCOPE_SPANS_SCOPE, scope_len);
        write_bytes(buf, field::SCOPE_NAME, name);
        write_bytes(buf, field::SCOPE_VERSION, version);
        buf.extend_from_slice(spans);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use prost::Message as _;

    fn view<'a>(attrs: &'a [Attr<'a>], name: &'a str, trace_state: &'a str) -> SpanView<'a> {
        SpanView {
            trace_id: [7; 16],
            span_id: [8; 8],
            parent_span_id: [0; 8],
            trace_state,
            flags: 0x101,
            name,
            kind: 2,
            start_unix_ns: 1_700_000_000_000_000_000,
            end_unix_ns: 1_700_000_000_000_500_000,
            attributes: attrs,
            events: &[],
            error: false,
        }
    }

    fn decode(bytes: &[u8]) -> ExportTraceServiceRequest {
        ExportTraceServiceRequest::decode(bytes).expect("decodes with opentelemetry-proto")
    }

    #[test]
    fn decodes_to_the_prost_path() {
        let attrs = [
            Attr { key: "http.request.method", value: Value::Str("GET") },
            Attr { key: "http.response.status_code", value: Value::Int(200) },
            Attr { key: "neg", value: Value::Int(-5) },
            Attr { key: "zero", value: Value::Int(0) },
            Attr { key: "empty", value: Value::Str("") },
            Attr { key: "t", value: Value::Bool(true) },
            Attr { key: "f", value: Value::Bool(false) },
            Attr { key: "ms", value: Value::Double(119.999) },
            Attr { key: "zero_ms", value: Value::Double(0.0) },
        ];
        let events = [
            EventView { time_unix_ns: 1_700_000_000_000_100_000, name: "haproxy.request.head_received" },
            EventView { time_unix_ns: 0, name: "" },
        ];
        let mut spans = [view(&attrs, "GET fe", "ot=th:0"), view(&attrs, "", "")];
        spans[0].events = &events;
        spans[1].parent_span_id = [9; 8];
        spans[1].error = true;
        spans[1].kind = 3;
        let mut enc = BatchEncoder::new(vec![("service.name".into(), "haproxy".into())]);
        let decoded = decode(enc.encode([(42, &spans[..]), (43, &spans[..1])]));
        assert_eq!(decoded.resource_spans.len(), 2);
        let got: Vec<Span> = decoded.resource_spans[0].scope_spans[0].spans.clone();
        let want: Vec<Span> = spans.iter().map(SpanView::to_prost).collect();
        assert_eq!(got, want);
        let resource = decoded.resource_spans[1].resource.as_ref().unwrap();
        assert_eq!(resource.attributes[1].key, "process.pid");
        enc.set_process_attributes(
            43,
            vec![("container.id".into(), "abc".into()), ("service.name".into(), "edge".into())],
        );
        let decoded = decode(enc.encode([(42, &spans[..1]), (43, &spans[..1])]));
        let keys = |i: usize| -> Vec<String> {
            decoded.resource_spans[i].resource.as_ref().unwrap().attributes.iter().map(|a| a.key.clone()).collect()
        };
        assert_eq!(keys(0), ["service.name", "process.pid"]);
        assert_eq!(
            keys(1),
            ["container.id", "service.name", "process.pid"],
            "the pod's service.name replaces the default"
        );
        assert_eq!(decoded.resource_spans[0].scope_spans[0].scope.as_ref().unwrap().name, "tracetap");
    }

    #[test]
    fn request_from_parts_decodes_to_its_resources_scope_and_spans() {
        use opentelemetry_proto::tonic::resource::v1::Resource;
        let attrs = [Attr { key: "service.name", value: Value::Str("haproxy") }];
        let resource_bytes = resource(attrs);
        let spans: Vec<Span> = (0..3).map(|i| view(&attrs, &"n".repeat(i * 100), "").to_prost()).collect();
        let mut framed = Vec::new();
        for span in &spans {
            push_span(&mut framed, &span.encode_to_vec());
        }
        let mut buf = Vec::new();
        write_request(&mut buf, [(resource_bytes.as_slice(), framed.as_slice()), (&[][..], &[][..])]);
        let request = decode(&buf);
        assert_eq!(request.resource_spans.len(), 2);
        let first = &request.resource_spans[0];
        assert_eq!(
            first.resource,
            Some(Resource { attributes: attrs.iter().map(Attr::to_prost).collect(), ..Resource::default() })
        );
        let scope = &first.scope_spans[0];
        assert_eq!(
            scope.scope.as_ref().map(|s| (s.name.as_str(), s.version.as_str())),
            Some((SCOPE_NAME, SCOPE_VERSION))
        );
        assert_eq!(scope.spans, spans);
        assert!(request.resource_spans[1].scope_spans[0].spans.is_empty());
    }

    #[test]
    fn length_prefixes_at_varint_boundaries() {
        let mut enc = BatchEncoder::new(Vec::new());
        for len in [0, 1, 126, 127, 128, 129, 16_382, 16_383, 16_384, 16_385, 70_000] {
            let value = "v".repeat(len);
            let attrs = [Attr { key: "long", value: Value::Str(&value) }];
            let spans = [view(&attrs, &value, &value)];
            let decoded = decode(enc.encode([(1, &spans[..])]));
            assert_eq!(decoded.resource_spans[0].scope_spans[0].spans[0], spans[0].to_prost(), "length {len}");
        }
    }

    #[test]
    fn spans_written_beforehand_encode_as_views_do_and_leave_room_for_the_next() {
        let mut enc = BatchEncoder::new(Vec::new());
        let attrs = [Attr { key: "k", value: Value::Str("v") }];
        let spans = [view(&attrs, "n", ""), view(&[], "second", "x")];
        let borrowed = enc.encode([(1, &spans[..]), (2, &spans[..1])]).to_vec();
        let (mut first, mut second) = (Vec::new(), Vec::new());
        write_spans(&mut first, &spans[..1]);
        write_spans(&mut first, &spans[1..]);
        write_spans(&mut second, &spans[..1]);
        let owned = enc.encode_written_owned([(1, &first[..]), (2, &second[..])]);
        assert_eq!(owned, borrowed);
        assert!(enc.buf.capacity() >= owned.len());
        assert_eq!(enc.encode_written_owned([(1, &first[..]), (2, &second[..])]), borrowed);
    }

    #[test]
    fn output_buffer_is_reused() {
        let mut enc = BatchEncoder::new(Vec::new());
        let attrs = [Attr { key: "k", value: Value::Str("v") }];
        let spans = [view(&attrs, "n", "")];
        let first = enc.encode([(1, &spans[..])]).as_ptr();
        let second = enc.encode([(1, &spans[..])]).as_ptr();
        assert_eq!(first, second);
    }
}

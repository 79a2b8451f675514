//! Reading the few fields the tail stage needs straight from OTLP protobuf bytes, without building
//! prost messages: the tail thread sees every kept span twice (when it is stored and when its trace
//! is decided), and decoding whole `Span`s (a `String` per attribute) cost more than the store.
//!
//! The input comes from the agent's own encoder or from the store on disk; both are treated as
//! hostile: malformed bytes are an error, never a panic (property-tested below against prost).

use std::ops::Range;

use prost::bytes::Buf as _;
use prost::encoding::{WireType, decode_key, decode_varint};

/// Bytes that are not the OTLP message they should be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed OTLP protobuf")]
pub struct WireError;

/// One field of a message.
enum Field<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
    Other,
}

/// Calls `f` for every field of the message in `buf`, in order.
fn for_each_field<'a>(
    buf: &'a [u8],
    mut f: impl FnMut(u32, Field<'a>) -> Result<(), WireError>,
) -> Result<(), WireError> {
    for_each_field_at(buf, |tag, field, _| f(tag, field))
}

/// [`for_each_field`], also giving where each field (key included) lies in `buf`.
fn for_each_field_at<'a>(
    whole: &'a [u8],
    mut f: impl FnMut(u32, Field<'a>, Range<usize>) -> Result<(), WireError>,
) -> Result<(), WireError> {
    let mut buf = whole;
    while !buf.is_empty() {
        let start = whole.len() - buf.len();
        let (tag, wire_type) = decode_key(&mut buf).map_err(|_| WireError)?;
        let field = match wire_type {
            WireType::Varint => Field::Varint(decode_varint(&mut buf).map_err(|_| WireError)?),
            WireType::SixtyFourBit => {
                let bytes: [u8; 8] = buf.get(..8).ok_or(WireError)?.try_into().expect("8 bytes");
                buf.advance(8);
                Field::Fixed64(u64::from_le_bytes(bytes))
            }
            WireType::ThirtyTwoBit => {
                buf.get(..4).ok_or(WireError)?;
                buf.advance(4);
                Field::Other
            }
            WireType::LengthDelimited => {
                let len = usize::try_from(decode_varint(&mut buf).map_err(|_| WireError)?).map_err(|_| WireError)?;
                let bytes = buf.get(..len).ok_or(WireError)?;
                buf.advance(len);
                Field::Bytes(bytes)
            }
            WireType::StartGroup | WireType::EndGroup => return Err(WireError),
        };
        f(tag, field, start..whole.len() - buf.len())?;
    }
    Ok(())
}

/// What the tail stage reads of a span.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpanFields<'a> {
    /// The whole encoded `Span` message.
    pub bytes: &'a [u8],
    pub trace_id: &'a [u8],
    pub trace_state: &'a str,
    pub kind: i32,
    pub start_unix_ns: u64,
    pub end_unix_ns: u64,
    /// `Status.code` (0 unset, 1 ok, 2 error).
    pub status: i32,
}

/// Reads a `Span` message.
pub fn span(bytes: &[u8]) -> Result<SpanFields<'_>, WireError> {
    let mut out = SpanFields { bytes, ..SpanFields::default() };
    for_each_field(bytes, |tag, field| {
        match (tag, field) {
            (1, Field::Bytes(b)) => out.trace_id = b,
            (3, Field::Bytes(b)) => out.trace_state = std::str::from_utf8(b).map_err(|_| WireError)?,
            (6, Field::Varint(v)) => out.kind = v as i32,
            (7, Field::Fixed64(v)) => out.start_unix_ns = v,
            (8, Field::Fixed64(v)) => out.end_unix_ns = v,
            (15, Field::Bytes(status)) => {
                for_each_field(status, |tag, field| {
                    if let (3, Field::Varint(code)) = (tag, field) {
                        out.status = code as i32;
                    }
                    Ok(())
                })?;
            }
            _ => {}
        }
        Ok(())
    })?;
    Ok(out)
}

/// A span attribute's value, as the policies compare it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttrValue<'a> {
    Str(&'a str),
    Int(i64),
    /// Any other kind (bool, double, bytes, array, map) or none.
    Other,
}

/// The value of the first attribute named `key` of a `Span` message (the one a lookup over the
/// decoded list would find), without decoding the others' values.
pub fn attribute<'a>(span: &'a [u8], key: &str) -> Result<Option<AttrValue<'a>>, WireError> {
    let mut found = None;
    for_each_field(span, |tag, field| {
        let (9, Field::Bytes(key_value), None) = (tag, field, found) else { return Ok(()) };
        let (mut k, mut any) = (&[][..], None);
        for_each_field(key_value, |tag, field| {
            match (tag, field) {
                (1, Field::Bytes(b)) => k = b,
                (2, Field::Bytes(b)) => any = Some(b),
                _ => {}
            }
            Ok(())
        })?;
        if k != key.as_bytes() {
            return Ok(());
        }
        let mut value = AttrValue::Other;
        for_each_field(any.unwrap_or_default(), |tag, field| {
            // A oneof: the last member on the wire wins, as prost reads it.
            value = match (tag, field) {
                (1, Field::Bytes(b)) => AttrValue::Str(std::str::from_utf8(b).map_err(|_| WireError)?),
                (3, Field::Varint(v)) => AttrValue::Int(v as i64),
                _ => AttrValue::Other,
            };
            Ok(())
        })?;
        found = Some(value);
        Ok(())
    })?;
    Ok(found)
}

/// A `Span` message taken apart around its `trace_state`: the bytes of every other field, in
/// order, and the `trace_state` a decoder would read (the last one on the wire; empty if none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WithoutTraceState<'a> {
    pub rest: Vec<&'a [u8]>,
    pub trace_state: &'a str,
}

/// Splits a `Span` message around its `trace_state` field(s), reading its top level only.
pub fn without_trace_state(span: &[u8]) -> Result<WithoutTraceState<'_>, WireError> {
    let mut out = WithoutTraceState { rest: Vec::with_capacity(2), trace_state: "" };
    let mut kept_from = 0;
    for_each_field_at(span, |tag, field, at| {
        if let (3, Field::Bytes(b)) = (tag, field) {
            out.trace_state = std::str::from_utf8(b).map_err(|_| WireError)?;
            if at.start > kept_from {
                out.rest.push(&span[kept_from..at.start]);
            }
            kept_from = at.end;
        }
        Ok(())
    })?;
    if kept_from < span.len() {
        out.rest.push(&span[kept_from..]);
    }
    Ok(out)
}

/// Where spans come from: the `process.pid` of their resource (0 when absent) and the encoded
/// `Resource` message itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Origin<'a> {
    pub pid: u32,
    pub resource: &'a [u8],
}

/// Calls `f(origin, span)` for every span of an `ExportTraceServiceRequest`.
pub fn request_spans<'a>(request: &'a [u8], mut f: impl FnMut(Origin<'a>, SpanFields<'a>)) -> Result<(), WireError> {
    for_each_field(request, |tag, field| {
        let (1, Field::Bytes(resource_spans)) = (tag, field) else { return Ok(()) };
        let mut origin = Origin::default();
        let mut scopes: Vec<&'a [u8]> = Vec::new();
        for_each_field(resource_spans, |tag, field| {
            match (tag, field) {
                (1, Field::Bytes(resource)) => origin = Origin { pid: process_pid(resource)?, resource },
                (2, Field::Bytes(scope_spans)) => scopes.push(scope_spans),
                _ => {}
            }
            Ok(())
        })?;
        for scope_spans in scopes {
            for_each_field(scope_spans, |tag, field| {
                if let (2, Field::Bytes(bytes)) = (tag, field) {
                    f(origin, span(bytes)?);
                }
                Ok(())
            })?;
        }
        Ok(())
    })
}

/// The `process.pid` attribute of a `Resource` (an int value), or 0.
fn process_pid(resource: &[u8]) -> Result<u32, WireError> {
    let mut pid = 0;
    for_each_field(resource, |tag, field| {
        let (1, Field::Bytes(key_value)) = (tag, field) else { return Ok(()) };
        let (mut key, mut value) = (&[][..], None);
        for_each_field(key_value, |tag, field| {
            match (tag, field) {
                (1, Field::Bytes(k)) => key = k,
                (2, Field::Bytes(any)) => {
                    for_each_field(any, |tag, field| {
                        if let (3, Field::Varint(v)) = (tag, field) {
                            value = Some(v);
                        }
                        Ok(())
                    })?;
                }
                _ => {}
            }
            Ok(())
        })?;
        if key == b"process.pid" {
            pid = value.and_then(|v| u32::try_from(v).ok()).unwrap_or(0);
        }
        Ok(())
    })?;
    Ok(pid)
}

#[cfg(test)]
mod tests {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
    use opentelemetry_proto::tonic::resource::v1::Resource;
    use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span, Status};
    use proptest::prelude::*;
    use prost::Message as _;

    use super::*;

    fn arb_span() -> impl Strategy<Value = Span> {
        (
            any::<[u8; 16]>(),
            "[a-z=:;,]{0,20}",
            0..6i32,
            any::<u64>(),
            any::<u64>(),
            0..3i32,
            proptest::collection::vec(
                (
                    "[a-c.]{1,3}",
                    prop_oneof![
                        "[ -~]{0,20}".prop_map(any_value::Value::StringValue),
                        any::<i64>().prop_map(any_value::Value::IntValue),
                        any::<bool>().prop_map(any_value::Value::BoolValue),
                    ],
                ),
                0..5,
            ),
        )
            .prop_map(|(trace, trace_state, kind, start, end, code, attrs)| Span {
                trace_id: trace.to_vec(),
                span_id: vec![1; 8],
                trace_state,
                kind,
                start_time_unix_nano: start,
                end_time_unix_nano: end,
                status: Some(Status { code, message: String::new() }),
                attributes: attrs
                    .into_iter()
                    .map(|(k, v)| KeyValue { key: k, value: Some(AnyValue { value: Some(v) }), ..KeyValue::default() })
                    .collect(),
                ..Span::default()
            })
    }

    fn request(pid: i64, spans: Vec<Span>) -> ExportTraceServiceRequest {
        let pid_attr = KeyValue {
            key: "process.pid".into(),
            value: Some(AnyValue { value: Some(any_value::Value::IntValue(pid)) }),
            ..KeyValue::default()
        };
        let other = KeyValue {
            key: "service.name".into(),
            value: Some(AnyValue { value: Some(any_value::Value::StringValue("x".into())) }),
            ..KeyValue::default()
        };
        ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(Resource { attributes: vec![other, pid_attr], ..Resource::default() }),
                scope_spans: vec![ScopeSpans { spans, ..ScopeSpans::default() }],
                ..ResourceSpans::default()
            }],
        }
    }

    proptest! {
        #[test]
        fn reads_what_prost_writes(spans in proptest::collection::vec(arb_span(), 0..5), pid in 0..100_000i64) {
            let bytes = request(pid, spans.clone()).encode_to_vec();
            let mut seen = Vec::new();
            request_spans(&bytes, |o, s| seen.push((o.pid, s))).unwrap();
            prop_assert_eq!(seen.len(), spans.len());
            for ((p, got), want) in seen.iter().zip(&spans) {
                prop_assert_eq!(i64::from(*p), pid);
                prop_assert_eq!(got.trace_id, &want.trace_id[..]);
                prop_assert_eq!(got.trace_state, want.trace_state.as_str());
                prop_assert_eq!(got.kind, want.kind);
                prop_assert_eq!((got.start_unix_ns, got.end_unix_ns), (want.start_time_unix_nano, want.end_time_unix_nano));
                prop_assert_eq!(got.status, want.status.as_ref().unwrap().code);
                prop_assert_eq!(&Span::decode(got.bytes).unwrap(), want, "the raw bytes are the span");
            }
        }

        #[test]
        fn attribute_is_the_first_of_its_key(span in arb_span(), pick in 0..6usize) {
            let bytes = span.encode_to_vec();
            let key = span.attributes.get(pick).map_or("absent.key", |kv| kv.key.as_str());
            let want = span.attributes.iter().find(|kv| kv.key == key).map(|kv| {
                match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                    Some(any_value::Value::StringValue(s)) => AttrValue::Str(s),
                    Some(any_value::Value::IntValue(i)) => AttrValue::Int(*i),
                    _ => AttrValue::Other,
                }
            });
            prop_assert_eq!(attribute(&bytes, key).unwrap(), want);
        }

        #[test]
        fn trace_state_replaced_at_the_byte_level_leaves_the_rest(span in arb_span(), state in "[a-z=:;,]{0,30}") {
            let bytes = span.encode_to_vec();
            let parts = without_trace_state(&bytes).unwrap();
            prop_assert_eq!(parts.trace_state, span.trace_state.as_str());
            let mut framed = Vec::new();
            crate::encode::push_span_with_trace_state(&mut framed, &parts.rest, &state);
            let scope = ScopeSpans::decode(framed.as_slice()).unwrap();
            prop_assert_eq!(&scope.spans[..], &[Span { trace_state: state, ..span }][..]);
        }

        #[test]
        fn any_bytes_read_or_err(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = request_spans(&bytes, |_, _| {});
            let _ = span(&bytes);
            let _ = attribute(&bytes, "k");
            let _ = without_trace_state(&bytes);
        }
    }
}

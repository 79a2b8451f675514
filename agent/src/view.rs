//! `tracetap view [FILE]`: the stdout sink's output as waterfalls in the terminal, for an operator
//! with no trace UI at hand.
//!
//! Input: JSON lines, each `{"resource": ..., "span": ...}` in the OTLP JSON mapping, as the agent
//! prints them without an endpoint (`export::print_json`), read with the official definitions
//! (`opentelemetry-proto`'s serde). A line that is not such an object is counted and skipped,
//! never fatal: the file may be a log with other lines in it.
//!
//! Output: one block per trace, traces in the order they started; in each, its spans as a tree
//! (a span under its parent when the parent is in the file, else at the top), children in the
//! order they started. A line per span: a time bar over the trace's span of time, the kind, the
//! name, the HTTP status or the error, the duration, and the HAProxy timers and termination state
//! when the span has them (`haproxy.timer.*`, `haproxy.termination_state`).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::io::{BufRead, Read as _};

use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;

/// Characters of the time bar.
const BAR_WIDTH: usize = 32;
/// Deepest indentation shown: a longer chain of parents is drawn at this depth.
const MAX_DEPTH: usize = 16;
/// Longest input line read; a longer one is skipped (a span is a few hundred bytes).
const MAX_LINE_BYTES: usize = 1 << 20;

/// What [`render`] read.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Read {
    pub spans: usize,
    pub traces: usize,
    /// Lines that were not a span object (blank lines aside).
    pub skipped: usize,
}

#[derive(serde::Deserialize)]
struct Line {
    span: Span,
}

/// Reads JSON lines from `input` and returns the waterfalls as text.
///
/// # Errors
/// When `input` cannot be read.
pub fn render(mut input: impl BufRead) -> std::io::Result<(String, Read)> {
    let mut read = Read::default();
    let mut traces: HashMap<Vec<u8>, Vec<Span>> = HashMap::new();
    let mut line = Vec::new();
    loop {
        line.clear();
        // At most MAX_LINE_BYTES held: the rest of a longer line is read past, not kept.
        if (&mut input).take(MAX_LINE_BYTES as u64 + 1).read_until(b'\n', &mut line)? == 0 {
            break;
        }
        if line.len() > MAX_LINE_BYTES {
            if line.last() != Some(&b'\n') {
                skip_line(&mut input)?;
            }
            read.skipped += 1;
            continue;
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match serde_json::from_slice::<Line>(&line) {
            Ok(Line { span }) if !span.span_id.is_empty() => {
                read.spans += 1;
                traces.entry(span.trace_id.clone()).or_default().push(span);
            }
            _ => read.skipped += 1,
        }
    }
    read.traces = traces.len();
    let mut ordered: Vec<(u64, Vec<u8>, Vec<Span>)> = traces
        .into_iter()
        .map(|(id, spans)| (spans.iter().map(|s| s.start_time_unix_nano).min().unwrap_or(0), id, spans))
        .collect();
    ordered.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    let mut out = String::new();
    for (_, id, spans) in &ordered {
        trace(&mut out, id, spans);
    }
    Ok((out, read))
}

/// Reads past the rest of a line, keeping nothing.
fn skip_line(input: &mut impl BufRead) -> std::io::Result<()> {
    loop {
        let buf = input.fill_buf()?;
        if buf.is_empty() {
            return Ok(());
        }
        if let Some(at) = buf.iter().position(|&b| b == b'\n') {
            input.consume(at + 1);
            return Ok(());
        }
        let n = buf.len();
        input.consume(n);
    }
}

fn trace(out: &mut String, id: &[u8], spans: &[Span]) {
    let start = spans.iter().map(|s| s.start_time_unix_nano).min().unwrap_or(0);
    let end = spans.iter().map(|s| s.end_time_unix_nano.max(s.start_time_unix_nano)).max().unwrap_or(start);
    let _ = writeln!(out, "trace {}  {} span{}  {}", hex(id), spans.len(), plural(spans.len()), millis(end - start));
    let ids: HashMap<&[u8], usize> = spans.iter().enumerate().map(|(i, s)| (&s.span_id[..], i)).collect();
    let mut children: BTreeMap<Option<usize>, Vec<usize>> = BTreeMap::new();
    for (i, s) in spans.iter().enumerate() {
        let parent = ids.get(&s.parent_span_id[..]).copied().filter(|&p| p != i);
        children.entry(parent).or_default().push(i);
    }
    for list in children.values_mut() {
        list.sort_by_key(|&i| (spans[i].start_time_unix_nano, i));
    }
    // Depth first from the roots; a span is printed once even if ids repeat or loop.
    let mut printed = vec![false; spans.len()];
    let mut stack: Vec<(usize, usize)> = children.get(&None).into_iter().flatten().rev().map(|&i| (i, 0)).collect();
    while let Some((i, depth)) = stack.pop() {
        if std::mem::replace(&mut printed[i], true) {
            continue;
        }
        line(out, &spans[i], depth, (start, end));
        stack.extend(children.get(&Some(i)).into_iter().flatten().rev().map(|&c| (c, depth + 1)));
    }
    // Spans only reachable through a loop of parents: shown at the top rather than lost.
    for i in (0..spans.len()).filter(|&i| !printed[i]) {
        line(out, &spans[i], 0, (start, end));
    }
    out.push('\n');
}

fn line(out: &mut String, span: &Span, depth: usize, (start, end): (u64, u64)) {
    let whole = (end - start).max(1);
    // At most BAR_WIDTH: the cast back cannot truncate.
    let at = |t: u64| (u128::from(t.clamp(start, end) - start) * BAR_WIDTH as u128 / u128::from(whole)) as usize;
    let (from, to) = (at(span.start_time_unix_nano), at(span.end_time_unix_nano.max(span.start_time_unix_nano)));
    let to = to.max(from + 1).min(BAR_WIDTH);
    let from = from.min(to - 1);
    let bar: String = (0..BAR_WIDTH).map(|c| if (from..to).contains(&c) { '=' } else { ' ' }).collect();
    let kind = match SpanKind::try_from(span.kind) {
        Ok(SpanKind::Server) => "SERVER",
        Ok(SpanKind::Client) => "CLIENT",
        Ok(SpanKind::Internal) => "INTERNAL",
        Ok(SpanKind::Producer) => "PRODUCER",
        Ok(SpanKind::Consumer) => "CONSUMER",
        _ => "SPAN",
    };
    let name = format!("{}{kind} {}", "  ".repeat(depth.min(MAX_DEPTH)), printable(&span.name));
    let status = match attribute(span, "http.response.status_code") {
        Some(code) => code,
        None if is_error(span) => "ERROR".to_owned(),
        None => "-".to_owned(),
    };
    let duration = millis(span.end_time_unix_nano.saturating_sub(span.start_time_unix_nano));
    let _ = write!(out, "  |{bar}| {name:<40} {status:>5} {duration:>10}");
    if is_error(span)
        && let Some(kind) = attribute(span, "error.type")
    {
        let _ = write!(out, "  error.type={kind}");
    }
    if let Some(state) = attribute(span, "haproxy.termination_state") {
        let _ = write!(out, "  {state}");
    }
    for a in span.attributes.iter().filter(|a| a.key.starts_with("haproxy.timer.")) {
        if let Some(value) = a.value.as_ref().and_then(|v| v.value.as_ref()) {
            let _ = write!(out, "  {}={}", printable(&a.key["haproxy.timer.".len()..]), value_text(value));
        }
    }
    out.push('\n');
}

fn is_error(span: &Span) -> bool {
    span.status.as_ref().is_some_and(|s| s.code == StatusCode::Error as i32)
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    let value = span.attributes.iter().find(|a| a.key == key)?.value.as_ref()?.value.as_ref()?;
    Some(value_text(value))
}

fn value_text(value: &Value) -> String {
    match value {
        Value::StringValue(s) => printable(s),
        Value::IntValue(i) => i.to_string(),
        Value::DoubleValue(d) => d.to_string(),
        Value::BoolValue(b) => b.to_string(),
        _ => "?".to_owned(),
    }
}

/// Text from the file, with control characters (a terminal's escape sequences) shown escaped.
fn printable(text: &str) -> String {
    text.chars().flat_map(|c| if c.is_control() { c.escape_default().collect() } else { vec![c] }).collect()
}

fn millis(ns: u64) -> String {
    format!("{:.3} ms", ns as f64 / 1e6)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::with_capacity(2 * bytes.len()), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

#[cfg(test)]
mod tests {
    use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
    use opentelemetry_proto::tonic::trace::v1::Status;

    use super::*;

    const MS: u64 = 1_000_000;
    const T0: u64 = 1_700_000_000_000_000_000;

    fn attr(key: &str, value: Value) -> KeyValue {
        KeyValue { key: key.into(), value: Some(AnyValue { value: Some(value) }), ..KeyValue::default() }
    }

    fn span(trace: u8, id: u8, parent: u8, kind: SpanKind, name: &str, (from, to): (u64, u64)) -> Span {
        Span {
            trace_id: vec![trace; 16],
            span_id: vec![id; 8],
            parent_span_id: if parent == 0 { Vec::new() } else { vec![parent; 8] },
            kind: kind as i32,
            name: name.into(),
            start_time_unix_nano: T0 + from * MS,
            end_time_unix_nano: T0 + to * MS,
            ..Span::default()
        }
    }

    /// As the stdout sink writes a span.
    fn json_line(span: &Span) -> String {
        serde_json::json!({ "resource": { "attributes": [] }, "span": span }).to_string()
    }

    #[test]
    fn traces_render_as_trees_with_bars_statuses_and_timers() {
        let mut server = span(1, 1, 0, SpanKind::Server, "GET fe_main", (0, 40));
        server.attributes = vec![
            attr("http.response.status_code", Value::IntValue(200)),
            attr("haproxy.termination_state", Value::StringValue("--".into())),
            attr("haproxy.timer.response", Value::DoubleValue(0.25)),
        ];
        let mut client = span(1, 2, 1, SpanKind::Client, "GET be_app", (10, 30));
        client.attributes = vec![attr("http.response.status_code", Value::IntValue(200))];
        let mut failed = span(2, 3, 9, SpanKind::Server, "GET fe_edge", (50, 58));
        failed.status = Some(Status { code: StatusCode::Error as i32, message: String::new() });
        failed.attributes = vec![attr("error.type", Value::StringValue("tracetap.capture_gap\x1b[2J".into()))];
        // Out of order in the file, and a line that is not a span.
        let input =
            [json_line(&failed), json_line(&client), "not json".into(), String::new(), json_line(&server)].join("\n");
        let (text, read) = render(input.as_bytes()).unwrap();
        assert_eq!(read, Read { spans: 3, traces: 2, skipped: 1 });
        let expected = "\
trace 01010101010101010101010101010101  2 spans  40.000 ms
  |================================| SERVER GET fe_main                         200  40.000 ms  --  response=0.25
  |        ================        |   CLIENT GET be_app                        200  20.000 ms

trace 02020202020202020202020202020202  1 span  8.000 ms
  |================================| SERVER GET fe_edge                       ERROR   8.000 ms  error.type=tracetap.capture_gap\\u{1b}[2J

";
        assert_eq!(text, expected, "\n{text}");
    }

    proptest::proptest! {
        /// Whatever the ids (repeated, self-parented, in loops) and times (reversed, equal), every
        /// span is printed exactly once, with a bar of the same width.
        #[test]
        fn every_span_is_printed_once(spans in proptest::collection::vec((0u8..3, 1u8..6, 0u8..6, 0u64..50, 0u64..50), 0..24)) {
            let input: Vec<String> = spans
                .iter()
                .map(|&(trace, id, parent, from, to)| json_line(&span(trace, id, parent, SpanKind::Client, "s", (from, to))))
                .collect();
            let (text, read) = render(input.join("\n").as_bytes()).unwrap();
            proptest::prop_assert_eq!(read.spans, spans.len());
            let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("  |")).collect();
            proptest::prop_assert_eq!(lines.len(), spans.len());
            proptest::prop_assert!(lines.iter().all(|l| l.as_bytes()[3 + BAR_WIDTH] == b'|'));
        }
    }

    #[test]
    fn hostile_input_is_skipped_or_shown_harmless() {
        // A span that is its own parent, two that are each other's, zero and negative durations.
        let own = span(3, 1, 1, SpanKind::Server, "own", (5, 5));
        let a = span(3, 2, 3, SpanKind::Client, "a", (9, 2));
        let b = span(3, 3, 2, SpanKind::Client, "b", (1, 3));
        let input = [json_line(&own), json_line(&a), json_line(&b), "{\"span\": 3}".into(), "x".repeat(10)].join("\n");
        let (text, read) = render(input.as_bytes()).unwrap();
        assert_eq!(read, Read { spans: 3, traces: 1, skipped: 2 });
        assert_eq!(text.lines().filter(|l| l.starts_with("  |")).count(), 3, "each span once:\n{text}");
        // A line longer than the limit is skipped without being held; the next line counts.
        let long = format!("{}\n{}", "x".repeat(MAX_LINE_BYTES + 10), json_line(&own));
        let (_, read) = render(long.as_bytes()).unwrap();
        assert_eq!(read, Read { spans: 1, traces: 1, skipped: 1 });
        let (empty, read) = render(&b""[..]).unwrap();
        assert_eq!((empty.as_str(), read), ("", Read::default()));
    }
}

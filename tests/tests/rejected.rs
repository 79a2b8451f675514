//! Requests `HAProxy` rejects as malformed get a SERVER span each (issue 35, item 3): random bytes,
//! a 70 KB URL, bad request lines, bad versions, control characters. Each span carries the status
//! `HAProxy` answered, `error.type`, the client and the frontend, and a bounded, escaped prefix of
//! what the client sent; a flood past the rate limit is counted, not exported.
#![cfg(target_os = "linux")]

use std::io::Read as _;
use std::net::SocketAddr;
use std::time::Duration;

use tracetap_tests::client::Conn;
use tracetap_tests::haproxy::{self, Version};
use tracetap_tests::{Stack, otlp, require_root, wait_for};

/// The malformed requests: five kinds, four of each.
fn malformed() -> Vec<(&'static str, Vec<u8>)> {
    let mut rng = fastrand::Rng::with_seed(35);
    let mut out = Vec::new();
    for _ in 0..4 {
        // Random bytes, never a valid method token (the first byte is a control character).
        let mut bytes: Vec<u8> = (0..200).map(|_| rng.u8(..)).collect();
        bytes[0] = 0x01;
        bytes.extend_from_slice(b"\r\n\r\n");
        out.push(("random bytes", bytes));
    }
    for n in 0..4 {
        out.push(("70 KB URL", format!("GET /{}{n} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(70_000)).into_bytes()));
    }
    for line in ["GET\r\n\r\n", "GET /a b HTTP/1.1\r\n\r\n", "/ HTTP/1.1\r\n\r\n", "G(ET / HTTP/1.1\r\n\r\n"] {
        out.push(("bad request line", line.as_bytes().to_vec()));
    }
    for line in
        ["GET / HTTP/1.1 x\r\n\r\n", "GET / HTTX/1.1\r\n\r\n", "GET / HTTP/1.x\r\n\r\n", "GET / HTTP/11\r\n\r\n"]
    {
        out.push(("bad version", line.as_bytes().to_vec()));
    }
    for line in [
        &b"GET /a\x01b HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        b"GET / HTTP/1.1\r\n\x01: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
        b"GET /\x7f HTTP/1.1\r\nHost: x\r\n\r\n",
    ] {
        out.push(("control character or bad header", line.to_vec()));
    }
    out
}

/// Sends `bytes` on a connection of its own; returns its port and the status `HAProxy` answered.
fn send(front: SocketAddr, bytes: &[u8]) -> (u16, u16) {
    let mut conn = Conn::connect(front).expect("connect");
    let port = conn.local_port().expect("port");
    // A write may fail once HAProxy answered and closed (the 70 KB URL): the answer is still read.
    let _ = conn.send_raw(bytes);
    let mut answer = Vec::new();
    let mut stream = conn.into_stream();
    stream.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
    let _ = stream.read_to_end(&mut answer);
    let status = std::str::from_utf8(answer.get(9..12).unwrap_or_default()).ok().and_then(|s| s.parse().ok());
    (
        port,
        status.unwrap_or_else(|| {
            panic!("no HTTP answer to {:?}: {:?}", &bytes[..bytes.len().min(40)], String::from_utf8_lossy(&answer))
        }),
    )
}

/// The escaped request line of what was sent on `port` (printable ASCII as it is, `\\` and
/// `\xNN` for the rest), as the span's prefix should start.
fn sent_line(kind: &str, port: u16, requests: &[(u16, Vec<u8>)]) -> String {
    let bytes = &requests.iter().find(|(p, _)| *p == port).unwrap_or_else(|| panic!("{kind}: sent")).1;
    let end = bytes.iter().position(|b| *b == b'\r' || *b == b'\n').unwrap_or(bytes.len());
    bytes[..end]
        .iter()
        .map(|b| match b {
            b'\\' => "\\\\".to_owned(),
            0x20..=0x7e => char::from(*b).to_string(),
            _ => format!("\\x{b:02x}"),
        })
        .collect()
}

#[test]
fn every_rejected_request_has_a_span_with_its_status_and_error_type() {
    if !require_root() {
        return;
    }
    for version in haproxy::versions() {
        every_rejected_request_on(version);
    }
}

fn every_rejected_request_on(version: Version) {
    // A limit no test run reaches: every rejected request must have its span.
    let stack = Stack::start_on(version, "", &[("TRACETAP_REJECTED_SPANS_PER_SECOND", "1000".into())]);
    let mut sent = Vec::new();
    let mut requests = Vec::new();
    for (kind, bytes) in malformed() {
        let (port, status) = send(stack.front, &bytes);
        requests.push((port, bytes.clone()));
        assert!((400..500).contains(&status), "{version:?} {kind}: HAProxy answered {status}");
        sent.push((kind, port, status));
    }
    let server_of = |spans: &[otlp::Received], port: u16| {
        spans.iter().find(|s| s.is_server() && s.int_attr("network.peer.port") == Some(i64::from(port))).cloned()
    };
    let spans = wait_for(Duration::from_secs(20), || {
        let spans = stack.receiver.spans();
        sent.iter().all(|(_, port, _)| server_of(&spans, *port).is_some()).then_some(spans)
    })
    .unwrap_or_else(|| stack.receiver.spans());
    let mut wrong = Vec::new();
    for (kind, port, status) in &sent {
        let Some(span) = server_of(&spans, *port) else {
            wrong.push(format!("{kind} (port {port}, {status}): no SERVER span"));
            continue;
        };
        let prefix = span.str_attr("tracetap.request.rejected_prefix");
        // The start of the request line as sent, escaped; never a header line.
        let line = sent_line(kind, *port, &requests);
        let prefix_is_the_line = prefix.is_some_and(|p| !p.is_empty() && line.starts_with(p) && !p.contains("Host"));
        let ok = span.int_attr("http.response.status_code") == Some(i64::from(*status))
            && span.str_attr("error.type") == Some(status.to_string().as_str())
            && span.is_error()
            && span.str_attr("client.address") == Some("127.0.0.1")
            && span.str_attr("haproxy.frontend") == Some("fe_main")
            && prefix_is_the_line
            && prefix.is_some_and(|p| p.chars().count() <= 128 && p.chars().all(|c| !c.is_control()));
        if !ok {
            wrong.push(format!("{kind} (port {port}, {status}): {:?} {:?}", span.span.name, span.span.attributes));
        }
    }
    assert!(
        wrong.is_empty(),
        "{version:?}: rejected requests without the span they should have:\n{}\nagent log:\n{}",
        wrong.join("\n"),
        stack.agent.log()
    );
}

#[test]
fn a_flood_of_garbage_is_limited_and_what_the_limit_drops_is_counted() {
    const FLOOD: usize = 60;
    if !require_root() {
        return;
    }
    let stack = Stack::start("", &[("TRACETAP_REJECTED_SPANS_PER_SECOND", "5".into())]);
    let ports: Vec<u16> = (0..FLOOD).map(|_| send(stack.front, b"G(ET / HTTP/1.1\r\n\r\n").0).collect();
    let rejected_spans = |spans: &[otlp::Received]| {
        spans
            .iter()
            .filter(|s| s.is_server() && ports.iter().any(|p| s.int_attr("network.peer.port") == Some(i64::from(*p))))
            .count()
    };
    // Every request is accounted for: a span, or a count of the limit.
    let accounted = wait_for(Duration::from_secs(20), || {
        let spans = rejected_spans(&stack.receiver.spans());
        let dropped = stack.agent.metric("tracetap_rejected_request_spans_dropped_total");
        (spans + usize::try_from(dropped).unwrap() == FLOOD).then_some((spans, dropped))
    });
    let (spans, dropped) = accounted.unwrap_or_else(|| {
        panic!(
            "{} spans and {} counted for {FLOOD} rejected requests",
            rejected_spans(&stack.receiver.spans()),
            stack.agent.metric("tracetap_rejected_request_spans_dropped_total")
        )
    });
    assert!(spans >= 5, "the burst is exported: {spans}");
    assert!(dropped > 0, "a flood faster than 5 a second is limited: {spans} spans");
}

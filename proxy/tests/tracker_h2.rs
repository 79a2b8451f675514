//! The tracker on HTTP/2 and TLS connections, driven by scripted syscalls as `HAProxy` issues them.

use std::net::SocketAddr;

use tracetap_proxy::h2::PREFACE;
use tracetap_proxy::sampled_out::SampledOutRule;
use tracetap_proxy::{
    Chunk, HttpVersion, Limits, Op, OpaqueMark, Outcome, ServerExchange, SyscallEvent, TlsInfo, Tracker, TrackerStats,
};

const PID: u32 = 100;

#[derive(Clone, Debug)]
enum OwnedOp {
    Accept,
    Connect,
    Tls(u16),
    Read(Vec<u8>),
    Write(Vec<u8>),
    Close,
}

/// Runs `(tid, fd, op)` steps 1 µs apart, numbering each connection's records from its
/// accept/connect; the steps whose index is in `lost` are numbered but not handled (lost records,
/// which the tracker is told of before the next record, as the probes' loss epoch does).
fn run_with(tracker: &mut Tracker, steps: &[(u32, i32, OwnedOp)], lost: &[usize]) -> Vec<ServerExchange> {
    let mut seqs = std::collections::HashMap::new();
    let mut loss_unseen = false;
    for (i, (tid, fd, op)) in steps.iter().enumerate() {
        let seq = seqs.entry(*fd).or_insert(0u32);
        *seq = if matches!(op, OwnedOp::Accept | OwnedOp::Connect) { 1 } else { *seq + 1 };
        let op = match op {
            OwnedOp::Accept => Op::Accept { peer: Some(client()), local: None },
            OwnedOp::Connect => Op::Connect { server: Some(server()) },
            OwnedOp::Tls(version) => Op::Tls { version: *version },
            OwnedOp::Read(b) => Op::Read(Chunk::complete(b)),
            OwnedOp::Write(b) => Op::Write(Chunk::complete(b)),
            OwnedOp::Close => Op::Close,
        };
        if lost.contains(&i) {
            loss_unseen = true;
        } else {
            let ts_ns = (i as u64 + 1) * 1000;
            if std::mem::take(&mut loss_unseen) {
                tracker.records_lost(ts_ns);
            }
            tracker.handle(&SyscallEvent { ts_ns, tgid: PID, tid: *tid, fd: *fd, seq: *seq, op });
        }
    }
    tracker.drain().collect()
}

fn run(tracker: &mut Tracker, steps: &[(u32, i32, OwnedOp)]) -> Vec<ServerExchange> {
    run_with(tracker, steps, &[])
}

/// An unnumbered record on thread 1.
fn at(ts_ns: u64, fd: i32, op: Op<'_>) -> SyscallEvent<'_> {
    SyscallEvent { ts_ns, tgid: PID, tid: 1, fd, seq: 0, op }
}

fn client() -> SocketAddr {
    "10.0.0.1:40000".parse().unwrap()
}
fn server() -> SocketAddr {
    "10.0.0.2:8080".parse().unwrap()
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.push(kind);
    f.push(flags);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

const END_STREAM: u8 = 0x1;

/// One side's HPACK encoder (each direction of a connection has its own).
struct Side(loona_hpack::Encoder<'static>);

impl Side {
    fn new() -> Self {
        Self(loona_hpack::Encoder::new())
    }

    fn headers(&mut self, stream: u32, fields: &[(&str, &str)], end_stream: bool) -> Vec<u8> {
        let block = self.0.encode(fields.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())));
        frame(0x1, 0x4 | if end_stream { END_STREAM } else { 0 }, stream, &block)
    }

    fn get(&mut self, stream: u32, path: &str) -> Vec<u8> {
        self.headers(
            stream,
            &[(":method", "GET"), (":scheme", "https"), (":authority", "h"), (":path", path), ("user-agent", "load/1")],
            true,
        )
    }
}

fn settings() -> Vec<u8> {
    frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100])
}

fn data(stream: u32, body: &[u8], end_stream: bool) -> Vec<u8> {
    frame(0x0, if end_stream { END_STREAM } else { 0 }, stream, body)
}

fn rst(stream: u32, code: u32) -> Vec<u8> {
    frame(0x3, 0, stream, &code.to_be_bytes())
}

fn goaway(last_stream: u32, code: u32) -> Vec<u8> {
    let mut payload = last_stream.to_be_bytes().to_vec();
    payload.extend(code.to_be_bytes());
    frame(0x7, 0, 0, &payload)
}

fn cat(parts: &[Vec<u8>]) -> Vec<u8> {
    parts.concat()
}

/// The client's first bytes: the preface and its SETTINGS.
fn client_start() -> Vec<u8> {
    cat(&[PREFACE.to_vec(), settings()])
}

fn h1_request(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nhost: h\r\nuser-agent: load/1\r\nx-forwarded-for: 10.0.0.1\r\n\r\n").into_bytes()
}

fn h1_response(status: u16, etag: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status} OK\r\ncontent-type: text/plain\r\netag: \"{etag}\"\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
        body.len()
    )
    .into_bytes()
}

/// The h2 response `HAProxy` relays for `h1_response(status, etag, _)`.
fn h2_response(side: &mut Side, stream: u32, status: u16, etag: &str, body: &str) -> Vec<u8> {
    let status = status.to_string();
    let etag = format!("\"{etag}\"");
    cat(&[
        side.headers(stream, &[(":status", &status), ("content-type", "text/plain"), ("etag", &etag)], false),
        data(stream, body.as_bytes(), true),
    ])
}

fn by_start(mut out: Vec<ServerExchange>) -> Vec<ServerExchange> {
    out.sort_by_key(|e| e.start_ns);
    out
}

fn by_target(mut out: Vec<ServerExchange>) -> Vec<ServerExchange> {
    out.sort_by(|a, b| a.request.as_ref().unwrap().target.cmp(&b.request.as_ref().unwrap().target));
    out
}

#[test]
fn identical_h2_streams_link_to_their_own_http1_backend_requests_by_the_relayed_response() {
    let (mut client_side, mut proxy_side) = (Side::new(), Side::new());
    // HAProxy writes stream 3's backend request first (fd 20),
    // reads both responses, and relays them in reverse order of the streams.
    let steps = vec![
        (1, 10, OwnedOp::Accept),
        (1, 10, OwnedOp::Read(cat(&[client_start(), client_side.get(1, "/same")]))),
        (1, 10, OwnedOp::Read(client_side.get(3, "/same"))),
        (1, 10, OwnedOp::Write(cat(&[settings(), frame(0x4, 0x1, 0, &[])]))),
        (1, 20, OwnedOp::Connect),
        (1, 21, OwnedOp::Connect),
        (1, 20, OwnedOp::Write(h1_request("/same"))),
        (1, 21, OwnedOp::Write(h1_request("/same"))),
        (1, 20, OwnedOp::Read(h1_response(200, "for-3", "three"))),
        (1, 21, OwnedOp::Read(h1_response(200, "for-1", "one"))),
        // One write, the frames of the two streams interleaved, stream 3's head first.
        (
            1,
            10,
            OwnedOp::Write(cat(&[
                proxy_side.headers(
                    3,
                    &[(":status", "200"), ("content-type", "text/plain"), ("etag", "\"for-3\"")],
                    false,
                ),
                proxy_side.headers(
                    1,
                    &[(":status", "200"), ("content-type", "text/plain"), ("etag", "\"for-1\"")],
                    false,
                ),
                data(1, b"one", true),
                data(3, b"three", true),
            ])),
        ),
    ];
    let mut t = Tracker::default();
    let out = by_start(run(&mut t, &steps));
    assert_eq!(out.len(), 2, "{:?}", t.stats());
    for ex in &out {
        let request = ex.request.as_ref().unwrap();
        assert_eq!(
            (request.version, request.path(), request.host.as_deref()),
            (HttpVersion::Http2, "/same", Some("h"))
        );
        assert_eq!(ex.outcome, Outcome::Complete);
        assert_eq!(ex.clients.len(), 1);
        let (relayed, read) = (ex.response.unwrap(), ex.clients[0].response.unwrap());
        assert_eq!(relayed.version, HttpVersion::Http2);
        assert_eq!(relayed.header_digest, read.header_digest, "each stream has the backend response it relayed");
        assert_eq!(ex.clients[0].request.version, HttpVersion::Http11);
    }
    // Stream 1 started first; its backend request went out second, on fd 21.
    assert!(out[0].clients[0].start_ns > out[1].clients[0].start_ns);
    let stats = t.stats();
    assert_eq!((stats.h2_connections, stats.h2_streams, stats.frontend_requests, stats.backend_requests), (1, 2, 2, 2));
    assert_eq!(stats.relinked_backend_exchanges, 1);
    assert_eq!(stats.unlinked_backend_requests, 0);
    assert_eq!(t.open_exchanges(), 0);
}

#[test]
fn a_client_reset_ends_its_stream_only() {
    let (mut cs, mut ps) = (Side::new(), Side::new());
    let steps = vec![
        (1, 10, OwnedOp::Accept),
        (1, 10, OwnedOp::Read(cat(&[client_start(), cs.get(1, "/slow"), cs.get(3, "/fast")]))),
        (1, 20, OwnedOp::Connect),
        (1, 20, OwnedOp::Write(h1_request("/slow"))),
        (1, 21, OwnedOp::Connect),
        (1, 21, OwnedOp::Write(h1_request("/fast"))),
        (1, 10, OwnedOp::Read(rst(1, 0x8))),
        (1, 20, OwnedOp::Close), // HAProxy aborts the backend request of the cancelled stream
        (1, 21, OwnedOp::Read(h1_response(200, "f", "fast"))),
        (1, 10, OwnedOp::Write(h2_response(&mut ps, 3, 200, "f", "fast"))),
    ];
    let mut t = Tracker::default();
    let out = run(&mut t, &steps);
    assert_eq!(out.len(), 2);
    let slow = out.iter().find(|e| e.request.as_ref().unwrap().path() == "/slow").unwrap();
    let fast = out.iter().find(|e| e.request.as_ref().unwrap().path() == "/fast").unwrap();
    assert_eq!(slow.outcome, Outcome::StreamReset(8));
    assert_eq!(slow.outcome.error_type(), Some("http2.rst_stream.CANCEL"));
    assert_eq!(slow.clients.len(), 1);
    assert_eq!(slow.clients[0].outcome, Outcome::ClosedBeforeResponse);
    assert_eq!((fast.outcome, fast.clients.len()), (Outcome::Complete, 1));
    assert_eq!(t.stats().h2_resets, 1);
}

#[test]
fn a_goaway_written_to_the_client_ends_the_streams_above_its_last_stream() {
    let (mut cs, mut ps) = (Side::new(), Side::new());
    let steps = vec![
        (1, 10, OwnedOp::Accept),
        (1, 10, OwnedOp::Read(cat(&[client_start(), cs.get(1, "/a"), cs.get(3, "/b"), cs.get(5, "/c")]))),
        // A GOAWAY from the client concerns streams HAProxy would open: none.
        (1, 10, OwnedOp::Read(goaway(0, 0))),
        (1, 10, OwnedOp::Write(cat(&[settings(), goaway(1, 0)]))),
        (1, 10, OwnedOp::Write(h2_response(&mut ps, 1, 200, "a", "a"))),
        (1, 10, OwnedOp::Close),
    ];
    let mut t = Tracker::default();
    let out = by_target(run(&mut t, &steps));
    let outcomes: Vec<_> = out.iter().map(|e| e.outcome).collect();
    assert_eq!(outcomes, [Outcome::Complete, Outcome::GoAway(0), Outcome::GoAway(0)]);
    assert_eq!(out[1].outcome.error_type(), Some("http2.goaway.NO_ERROR"));
    assert_eq!(t.stats().h2_goaways, 2);
}

#[test]
fn open_streams_on_a_close_end_as_on_http1() {
    let (mut cs, mut ps) = (Side::new(), Side::new());
    let headers_only = ps.headers(1, &[(":status", "200")], false);
    let steps = vec![
        (1, 10, OwnedOp::Accept),
        (1, 10, OwnedOp::Read(cat(&[client_start(), cs.get(1, "/a"), cs.get(3, "/b")]))),
        (1, 10, OwnedOp::Write(headers_only)),
        (1, 10, OwnedOp::Close),
    ];
    let mut t = Tracker::default();
    let out = by_target(run(&mut t, &steps));
    let outcomes: Vec<_> = out.iter().map(|e| e.outcome).collect();
    assert_eq!(outcomes, [Outcome::ClosedDuringResponse, Outcome::ClosedBeforeResponse]);
    assert_eq!(t.connections(), 0);
    assert_eq!(t.open_exchanges(), 0);
}

#[test]
fn a_capture_gap_on_an_h2_connection_ends_its_streams_and_makes_it_opaque() {
    let (mut cs, mut ps) = (Side::new(), Side::new());
    let steps = vec![
        (1, 10, OwnedOp::Accept),
        (1, 10, OwnedOp::Read(cat(&[client_start(), cs.get(1, "/a")]))),
        (1, 10, OwnedOp::Read(cs.get(3, "/b"))), // lost: the HPACK state is gone
        (1, 10, OwnedOp::Write(h2_response(&mut ps, 1, 200, "a", "a"))),
        (1, 10, OwnedOp::Read(cs.get(5, "/c"))),
    ];
    let mut t = Tracker::default();
    let out = run_with(&mut t, &steps, &[2]);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].outcome, Outcome::CaptureGap);
    let stats = t.stats();
    assert_eq!((stats.capture_gaps, stats.h2_desyncs, stats.gap_exchanges), (1, 1, 1));
    assert_eq!(stats.frontend_requests, 1, "nothing is decoded after the gap");
    let marks: Vec<OpaqueMark> = t.take_opaque_marks().collect();
    assert_eq!(marks, [OpaqueMark { tgid: PID, fd: 10, opened_ns: 1000 }]);
    assert_eq!(t.open_exchanges(), 0);
}

#[test]
fn a_header_block_cut_by_the_capture_window_desyncs_the_connection() {
    let mut cs = Side::new();
    let mut t = Tracker::default();
    t.handle(&at(1, 10, Op::Accept { peer: None, local: None }));
    t.handle(&at(2, 10, Op::Read(Chunk::complete(&cat(&[client_start(), cs.get(1, "/a")])))));
    let long = cs.headers(3, &[(":method", "GET"), (":path", "/b"), ("x-pad", &"p".repeat(300))], true);
    t.handle(&at(
        3,
        10,
        Op::Read(Chunk { known: &long[..64], total: long.len() as u64, tail: &long[long.len() - 16..] }),
    ));
    let out: Vec<_> = t.drain().collect();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].outcome, Outcome::CaptureGap);
    assert_eq!(t.stats().h2_desyncs, 1);
}

#[test]
fn an_h2_backend_carries_client_exchanges() {
    let (mut proxy_side, mut server_side) = (Side::new(), Side::new());
    let backend_request = proxy_side.headers(
        1,
        &[(":method", "GET"), (":scheme", "http"), (":authority", "h"), (":path", "/a"), ("user-agent", "load/1")],
        true,
    );
    let backend_response = cat(&[
        settings(),
        server_side.headers(1, &[(":status", "200"), ("content-type", "text/plain"), ("etag", "\"x\"")], false),
        data(1, b"body", false),
        data(1, b"", true),
    ]);
    let steps = vec![
        (1, 10, OwnedOp::Accept),
        (1, 10, OwnedOp::Read(h1_request("/a"))),
        (1, 20, OwnedOp::Connect),
        (1, 20, OwnedOp::Write(cat(&[client_start(), backend_request]))),
        (1, 20, OwnedOp::Read(backend_response)),
        (1, 10, OwnedOp::Write(h1_response(200, "x", "body"))),
    ];
    let mut t = Tracker::default();
    let out = run(&mut t, &steps);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].request.as_ref().unwrap().version, HttpVersion::Http11);
    assert_eq!(out[0].clients.len(), 1);
    let back = &out[0].clients[0];
    assert_eq!((back.request.version, back.outcome), (HttpVersion::Http2, Outcome::Complete));
    assert_eq!(back.response.unwrap().header_digest, out[0].response.unwrap().header_digest);
    assert_eq!((t.stats().h2_connections, t.stats().backend_requests), (1, 1));
}

/// Status, path and outcome of each exchange, and its clients', in start order.
fn summary(out: &[ServerExchange]) -> Vec<(u16, String, Outcome, usize)> {
    let mut v: Vec<_> = out
        .iter()
        .map(|e| {
            (
                e.response.map_or(0, |r| r.status),
                e.request.as_ref().map(|r| r.target.clone()).unwrap_or_default(),
                e.outcome,
                e.clients.len(),
            )
        })
        .collect();
    v.sort_by(|a, b| a.1.cmp(&b.1));
    v
}

#[test]
fn h2_split_at_every_byte_gives_the_same_exchanges() {
    let (mut cs, mut ps) = (Side::new(), Side::new());
    let long_value = "v".repeat(40);
    let ingress = cat(&[
        client_start(),
        cs.get(1, "/a"),
        cs.headers(3, &[(":method", "POST"), (":path", "/b"), (":authority", "h"), ("x-long", &long_value)], false),
        data(3, b"request body", true),
        rst(7, 0x8),
    ]);
    let egress = cat(&[
        settings(),
        h2_response(&mut ps, 3, 201, "b", "created"),
        ps.headers(1, &[(":status", "103")], false),
        h2_response(&mut ps, 1, 200, "a", "body of a"),
    ]);
    let whole = |t: &mut Tracker, ingress: &[&[u8]], egress: &[&[u8]]| {
        let mut steps = vec![(1, 10, OwnedOp::Accept)];
        steps.extend(ingress.iter().map(|b| (1, 10, OwnedOp::Read(b.to_vec()))));
        steps.extend(egress.iter().map(|b| (1, 10, OwnedOp::Write(b.to_vec()))));
        summary(&run(t, &steps))
    };
    let expected = whole(&mut Tracker::default(), &[&ingress], &[&egress]);
    assert_eq!(
        expected,
        [(200, "/a".to_string(), Outcome::Complete, 0), (201, "/b".to_string(), Outcome::Complete, 0)]
    );
    for cut in 1..ingress.len() {
        let (first, second) = ingress.split_at(cut);
        let mut t = Tracker::default();
        assert_eq!(whole(&mut t, &[first, second], &[&egress]), expected, "request bytes cut at {cut}");
        assert_eq!(t.stats().h2_desyncs, 0);
    }
    for cut in 1..egress.len() {
        let (first, second) = egress.split_at(cut);
        assert_eq!(whole(&mut Tracker::default(), &[&ingress], &[first, second]), expected, "cut at {cut}");
    }
}

#[test]
fn an_http1_request_cut_after_its_first_byte_is_not_taken_for_http2() {
    let steps = vec![
        (1, 10, OwnedOp::Accept),
        (1, 10, OwnedOp::Read(b"P".to_vec())),
        (1, 10, OwnedOp::Read(b"OST /p HTTP/1.1\r\nhost: h\r\ncontent-length: 0\r\n\r\n".to_vec())),
        (1, 10, OwnedOp::Write(h1_response(200, "p", "ok"))),
    ];
    let mut t = Tracker::default();
    let out = run(&mut t, &steps);
    assert_eq!(summary(&out), [(200, "/p".to_string(), Outcome::Complete, 0)]);
    assert_eq!(out[0].request.as_ref().unwrap().method, "POST");
    assert_eq!(t.stats().h2_connections, 0);
}

#[test]
fn a_server_preface_before_the_client_preface_is_fine() {
    let (mut cs, mut ps) = (Side::new(), Side::new());
    let steps = vec![
        (1, 10, OwnedOp::Accept),
        (1, 10, OwnedOp::Write(settings())),
        (1, 10, OwnedOp::Read(cat(&[client_start(), cs.get(1, "/a")]))),
        (1, 10, OwnedOp::Write(h2_response(&mut ps, 1, 200, "a", "a"))),
    ];
    let mut t = Tracker::default();
    let out = run(&mut t, &steps);
    assert_eq!(summary(&out), [(200, "/a".to_string(), Outcome::Complete, 0)]);
}

#[test]
fn h2_frames_on_a_connection_seen_mid_way_are_opaque_and_counted() {
    let mut cs = Side::new();
    let mut t = Tracker::default();
    // Never seen opened: the HPACK state of its earlier blocks is unknown.
    let frames = cat(&[cs.get(1, "/a"), cs.get(3, "/a")]);
    t.handle(&at(1, 30, Op::Read(Chunk::complete(&frames))));
    t.handle(&at(1, 30, Op::Read(Chunk::complete(&cs.get(5, "/a")))));
    // Seen opened, but its start was not the preface: a request HAProxy rejects, until its answer
    // shows it is not HTTP/1 either (a GOAWAY frame).
    t.handle(&at(1, 31, Op::Accept { peer: None, local: None }));
    t.handle(&at(1, 31, Op::Read(Chunk::complete(&frames))));
    let goaway = [0, 0, 8, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    t.handle(&at(1, 31, Op::Write(Chunk::complete(&goaway))));
    assert_eq!(t.drain().count(), 0);
    let stats = t.stats();
    assert_eq!((stats.unknown_descriptors, stats.opaque_connections), (1, 1));
    assert_eq!((stats.frontend_requests, stats.h2_connections, stats.parse_errors), (0, 0, 1));
}

#[test]
fn tls_connections_carry_their_version_on_both_sides() {
    let steps = vec![
        (1, 10, OwnedOp::Accept),
        (1, 10, OwnedOp::Tls(0x0304)),
        (1, 10, OwnedOp::Read(h1_request("/a"))),
        (1, 20, OwnedOp::Connect),
        (1, 20, OwnedOp::Tls(0x0303)),
        (1, 20, OwnedOp::Write(h1_request("/a"))),
        (1, 20, OwnedOp::Read(h1_response(200, "a", "a"))),
        (1, 10, OwnedOp::Write(h1_response(200, "a", "a"))),
        // Plain HTTP on another connection.
        (1, 11, OwnedOp::Accept),
        (1, 11, OwnedOp::Read(h1_request("/plain"))),
        (1, 11, OwnedOp::Write(h1_response(404, "p", ""))),
    ];
    let mut t = Tracker::default();
    let out = by_start(run(&mut t, &steps));
    assert_eq!(out.len(), 2);
    assert_eq!(out[0].tls, Some(TlsInfo { version: Some("1.3") }));
    assert_eq!(out[0].clients[0].tls, Some(TlsInfo { version: Some("1.2") }));
    assert_eq!(out[1].tls, None);
    assert_eq!(t.stats().capture_gaps, 0, "the TLS record is numbered like the others");
}

#[test]
fn tls_on_an_unknown_connection_creates_it_and_h2_in_tls_is_decoded() {
    let (mut cs, mut ps) = (Side::new(), Side::new());
    let mut t = Tracker::default();
    t.handle(&at(1, 12, Op::Tls { version: 0 }));
    t.handle(&at(2, 12, Op::Read(Chunk::complete(&cat(&[client_start(), cs.get(1, "/a")])))));
    t.handle(&at(3, 12, Op::Write(Chunk::complete(&h2_response(&mut ps, 1, 200, "a", "a")))));
    let out: Vec<_> = t.drain().collect();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].tls, Some(TlsInfo { version: None }));
    assert_eq!(out[0].request.as_ref().unwrap().version, HttpVersion::Http2);
    assert_eq!(out[0].outcome, Outcome::Complete);
    assert_eq!(
        t.stats(),
        TrackerStats { frontend_requests: 1, h2_connections: 1, h2_streams: 1, ..TrackerStats::default() }
    );
}

/// A step of the multiplexed scenario, its h2 bytes encoded once the order is known (each side's
/// HPACK state depends on it).
#[derive(Clone, Copy, Debug)]
enum MuxStep {
    FrontRead(u32),
    Connect(u32),
    BackWrite(u32),
    BackRead(u32),
    FrontWrite(u32),
}

fn mux_path(stream: u32, status: u16) -> String {
    format!("/s{status}/{stream}")
}

proptest::proptest! {
    /// Streams of one h2 frontend connection, each proxied to its own HTTP/1 backend connection,
    /// in any order, with records lost at random: every exchange handed out pairs each request
    /// with its own response, and every CLIENT exchange sits under the SERVER exchange of its own
    /// stream. Requests carry their expected status in their path.
    #[test]
    fn lost_records_on_h2_never_mispair(
        lost_at in proptest::collection::vec(0usize..40, 0..4),
        order in proptest::collection::vec(0usize..4, 0..40),
        same_status in proptest::prelude::any::<bool>(),
    ) {
        const STREAMS: u32 = 4;
        let status = |s: u32| if same_status { 200 } else { 200 + s as u16 };
        let mut queues: Vec<Vec<MuxStep>> = (0..STREAMS)
            .map(|i| {
                let s = 2 * i + 1;
                let mut q = vec![MuxStep::FrontRead(s), MuxStep::Connect(s), MuxStep::BackWrite(s), MuxStep::BackRead(s), MuxStep::FrontWrite(s)];
                q.reverse();
                q
            })
            .collect();
        let mut mux = Vec::new();
        let mut pick = order.into_iter().cycle();
        while queues.iter().any(|q| !q.is_empty()) {
            let mut i = pick.next().unwrap_or(0) % STREAMS as usize;
            while queues[i].is_empty() {
                i = (i + 1) % STREAMS as usize;
            }
            mux.push(queues[i].pop().unwrap());
        }
        let (mut cs, mut ps) = (Side::new(), Side::new());
        let mut steps = vec![(1, 10, OwnedOp::Accept), (1, 10, OwnedOp::Read(client_start()))];
        for step in mux {
            let backend = |s: u32| 20 + s as i32;
            steps.push(match step {
                MuxStep::FrontRead(s) => (1, 10, OwnedOp::Read(cs.get(s, &mux_path(s, status(s))))),
                MuxStep::Connect(s) => (1, backend(s), OwnedOp::Connect),
                MuxStep::BackWrite(s) => (1, backend(s), OwnedOp::Write(h1_request(&mux_path(s, status(s))))),
                MuxStep::BackRead(s) => (1, backend(s), OwnedOp::Read(h1_response(status(s), &s.to_string(), "b"))),
                MuxStep::FrontWrite(s) => (1, 10, OwnedOp::Write(h2_response(&mut ps, s, status(s), &s.to_string(), "b"))),
            });
        }
        steps.push((1, 10, OwnedOp::Close));
        let lost: Vec<usize> = lost_at.into_iter().filter(|i| *i < steps.len()).collect();
        let mut t = Tracker::default();
        let mut out = run_with(&mut t, &steps, &lost);
        t.expire(u64::MAX / 2);
        out.extend(t.drain());
        for ex in &out {
            let Some(request) = &ex.request else { continue };
            let want: u16 = request.path()[2..5].parse().unwrap();
            if let Some(r) = ex.response {
                proptest::prop_assert_eq!(r.status, want);
            }
            for c in &ex.clients {
                proptest::prop_assert_eq!(c.request.path(), request.path(), "CLIENT under its own SERVER");
                if let (Some(r), Some(relayed)) = (c.response, ex.response) {
                    proptest::prop_assert_eq!(r.header_digest, relayed.header_digest);
                }
            }
        }
        if lost.is_empty() {
            let whole = out.iter().filter(|e| e.outcome == Outcome::Complete && e.clients.len() == 1).count();
            proptest::prop_assert_eq!(whole, STREAMS as usize);
        }
    }
}

/// A TLS handshake that ran before the TLS probes reached the process (a worker hooked just after
/// it started): its ciphertext made the connection opaque, and the `Tls` record that comes when
/// the connection is bound later starts it over, as plaintext, HTTP/1.1 and HTTP/2 alike.
#[test]
fn ciphertext_before_a_late_tls_binding_is_forgotten() {
    let client_hello = [0x16, 0x03, 0x01, 0x00, 0x05, 0x01, 0x00, 0x00, 0x01, 0x00];
    let server_hello = [0x16, 0x03, 0x03, 0x00, 0x02, 0x02, 0x00];
    let steps = vec![
        (1, 10, OwnedOp::Accept),
        (1, 10, OwnedOp::Read(client_hello.to_vec())),
        (1, 10, OwnedOp::Write(server_hello.to_vec())),
        (1, 10, OwnedOp::Tls(0x0304)),
        (1, 10, OwnedOp::Read(h1_request("/late"))),
        (1, 20, OwnedOp::Connect),
        (1, 20, OwnedOp::Write(h1_request("/late"))),
        (1, 20, OwnedOp::Read(h1_response(200, "a", "a"))),
        (1, 10, OwnedOp::Write(h1_response(200, "a", "a"))),
    ];
    let mut t = Tracker::default();
    let out = run(&mut t, &steps);
    assert_eq!(out.len(), 1, "{out:?} {:?}", t.stats());
    assert_eq!(out[0].tls, Some(TlsInfo { version: Some("1.3") }));
    assert_eq!(out[0].outcome, Outcome::Complete);
    assert_eq!(out[0].clients.len(), 1);

    let (mut cs, mut ps) = (Side::new(), Side::new());
    let mut t = Tracker::default();
    t.handle(&at(1, 12, Op::Accept { peer: None, local: None }));
    t.handle(&at(2, 12, Op::Read(Chunk::complete(&client_hello))));
    t.handle(&at(3, 12, Op::Tls { version: 0x0304 }));
    t.handle(&at(4, 12, Op::Read(Chunk::complete(&cat(&[client_start(), cs.get(1, "/a")])))));
    t.handle(&at(5, 12, Op::Write(Chunk::complete(&h2_response(&mut ps, 1, 200, "a", "a")))));
    let out: Vec<_> = t.drain().collect();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].request.as_ref().unwrap().version, HttpVersion::Http2);
}

/// A connection HAProxy relays in `mode tcp` (the agent's `Ignore`) stays opaque when TLS is
/// declared on it, and is marked opaque again (the probes dropped its mark when they bound it):
/// only a connection made opaque by its first bytes starts over.
#[test]
fn an_ignored_connection_stays_opaque_under_tls() {
    fn numbered(ts: u64, op: Op<'_>) -> SyscallEvent<'_> {
        SyscallEvent { seq: ts as u32, ..at(ts, 12, op) }
    }
    let mut t = Tracker::default();
    t.handle(&numbered(1, Op::Accept { peer: None, local: None }));
    t.handle(&numbered(2, Op::Ignore));
    assert_eq!(t.take_opaque_marks().len(), 1, "marked when ignored");
    t.handle(&numbered(3, Op::Tls { version: 0x0304 }));
    assert_eq!(t.take_opaque_marks().len(), 1, "marked again when bound");
    let (request, response) = (h1_request("/tcp"), h1_response(200, "a", "a"));
    t.handle(&numbered(4, Op::Read(Chunk::complete(&request))));
    t.handle(&numbered(5, Op::Write(Chunk::complete(&response))));
    assert_eq!(t.drain().count(), 0);
}

#[test]
fn an_h2_backend_stream_of_a_request_sampled_out_is_only_paired_and_the_kept_stream_beside_it_keeps_its_answer() {
    let unsampled = "00-0af7651916cd43dd8448eb211c80319b-00f067aa0ba902b7-00";
    let sampled = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01";
    let front = |path: &str, tp: &str| {
        format!("GET {path} HTTP/1.1\r\nhost: h\r\nuser-agent: load/1\r\ntraceparent: {tp}\r\n\r\n").into_bytes()
    };
    let (mut proxy_side, mut server_side) = (Side::new(), Side::new());
    let mut backend_request = |stream, path, tp| {
        proxy_side.headers(
            stream,
            &[(":method", "GET"), (":scheme", "http"), (":authority", "h"), (":path", path), ("traceparent", tp)],
            true,
        )
    };
    let (dropped_stream, kept_stream) = (backend_request(1, "/b", unsampled), backend_request(3, "/c", sampled));
    // Both answered alike, the dropped one first: only its stream tells them apart.
    let backend_responses = cat(&[
        settings(),
        h2_response(&mut server_side, 1, 200, "x", "body"),
        h2_response(&mut server_side, 3, 200, "x", "body"),
    ]);
    let steps = vec![
        (1, 10, OwnedOp::Accept),
        (1, 11, OwnedOp::Accept),
        (1, 10, OwnedOp::Read(front("/b", unsampled))),
        (1, 11, OwnedOp::Read(front("/c", sampled))),
        (1, 20, OwnedOp::Connect),
        (1, 20, OwnedOp::Write(cat(&[client_start(), dropped_stream, kept_stream]))),
        (1, 20, OwnedOp::Read(backend_responses)),
        (1, 10, OwnedOp::Write(h1_response(200, "x", "body"))),
        (1, 11, OwnedOp::Write(h1_response(200, "x", "body"))),
    ];
    let mut t = Tracker::new(Limits { sampled_out: SampledOutRule::UnsampledParent, ..Limits::default() });
    let out = run(&mut t, &steps);
    assert_eq!(summary(&out), [(200, "/c".to_owned(), Outcome::Complete, 1)]);
    assert_eq!(out[0].clients[0].request.target, "/c");
    let stats = t.stats();
    assert_eq!((stats.sampled_out_requests, stats.sampled_out_backend_requests), (1, 1));
    assert_eq!((stats.unlinked_backend_requests, stats.unpaired_responses), (0, 0));
}

#[test]
fn an_h2_stream_dropped_at_its_head_between_two_kept_ones_leaves_both_answered_right() {
    // Three streams for the same path with the same backend answer but for its etag, the dropped
    // one in the middle; HAProxy relays the responses in reverse order of the streams.
    let tp = |last: char, flags: &str| format!("00-0af7651916cd43dd8448eb211c80319{last}-00f067aa0ba902b7-{flags}");
    let (kept_1, dropped, kept_5) = (tp('a', "01"), tp('b', "00"), tp('c', "01"));
    let (mut client_side, mut proxy_side) = (Side::new(), Side::new());
    let mut get = |stream, traceparent: &str| {
        client_side.headers(
            stream,
            &[
                (":method", "GET"),
                (":scheme", "https"),
                (":authority", "h"),
                (":path", "/same"),
                ("traceparent", traceparent),
            ],
            true,
        )
    };
    let requests = cat(&[client_start(), get(1, &kept_1), get(3, &dropped), get(5, &kept_5)]);
    let backend_request =
        |traceparent: &str| format!("GET /same HTTP/1.1\r\nhost: h\r\ntraceparent: {traceparent}\r\n\r\n").into_bytes();
    let mut relayed = |stream, etag: &str, body: &str| {
        let etag = format!("\"{etag}\"");
        cat(&[
            proxy_side.headers(stream, &[(":status", "200"), ("content-type", "text/plain"), ("etag", &etag)], false),
            data(stream, body.as_bytes(), true),
        ])
    };
    let responses = cat(&[relayed(5, "five", "5"), relayed(3, "three", "3"), relayed(1, "one", "1")]);
    let steps = vec![
        (1, 10, OwnedOp::Accept),
        (1, 10, OwnedOp::Read(requests)),
        (1, 10, OwnedOp::Write(cat(&[settings(), frame(0x4, 0x1, 0, &[])]))),
        (1, 20, OwnedOp::Connect),
        (1, 21, OwnedOp::Connect),
        (1, 22, OwnedOp::Connect),
        (1, 20, OwnedOp::Write(backend_request(&kept_1))),
        (1, 21, OwnedOp::Write(backend_request(&dropped))),
        (1, 22, OwnedOp::Write(backend_request(&kept_5))),
        (1, 22, OwnedOp::Read(h1_response(200, "five", "5"))),
        (1, 21, OwnedOp::Read(h1_response(200, "three", "3"))),
        (1, 20, OwnedOp::Read(h1_response(200, "one", "1"))),
        (1, 10, OwnedOp::Write(responses)),
        // Then a request without context whose backend request carries the dropped trace again
        // under a parent id HAProxy made, unsampled: that trace no longer waits, so it is linked.
        (1, 10, OwnedOp::Read(client_side.get(7, "/same"))),
        (1, 20, OwnedOp::Write(backend_request(&dropped.replace("00f067aa0ba902b7", "53995c3f42cd8ad8")))),
        (1, 20, OwnedOp::Read(h1_response(200, "seven", "7"))),
        (1, 10, OwnedOp::Write(relayed(7, "seven", "7"))),
    ];
    let mut t = Tracker::new(Limits { sampled_out: SampledOutRule::UnsampledParent, ..Limits::default() });
    let mut out = run(&mut t, &steps);
    out.sort_by_key(|ex| ex.request.as_ref().and_then(|r| r.parsed_traceparent).map(|p| p.trace_id));
    let after = out.remove(0);
    assert_eq!((after.request.as_ref().unwrap().parsed_traceparent, after.clients.len()), (None, 1));
    assert_eq!(out.len(), 2, "{:?}", t.stats());
    for (ex, trace_end) in out.iter().zip([0x9a, 0x9c]) {
        assert_eq!(ex.request.as_ref().unwrap().parsed_traceparent.map(|p| p.trace_id[15]), Some(trace_end));
        assert_eq!(ex.clients.len(), 1);
        assert_eq!(ex.clients[0].request.parsed_traceparent.map(|p| p.trace_id[15]), Some(trace_end));
        assert_eq!(ex.response.unwrap().header_digest, ex.clients[0].response.unwrap().header_digest);
    }
    let stats = t.stats();
    assert_eq!((stats.sampled_out_requests, stats.sampled_out_backend_requests), (1, 1));
    assert_eq!((stats.unlinked_backend_requests, stats.unpaired_responses, stats.frontend_requests), (0, 0, 4));
    assert_eq!(t.open_exchanges(), 0);
}

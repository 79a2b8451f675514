//! The tracker driven by scripted syscalls, as `HAProxy` issues them: accept, read the request,
//! connect, write it to the backend, read the response, write it to the client, close.

use std::net::SocketAddr;

use proptest::prelude::*;
use tracetap_ebpf_common::head_drop::HeadScan;
use tracetap_proxy::sampled_out::SampledOutRule;
use tracetap_proxy::trace_context::parse_traceparent;
use tracetap_proxy::{Chunk, Limits, Op, OpaqueMark, Outcome, ServerExchange, SyscallEvent, TraceparentField, Tracker};

const PID: u32 = 100;

/// Builds events with increasing timestamps.
#[derive(Default)]
struct Script {
    ts: u64,
    events: Vec<(u32, i32, OwnedOp)>,
}

#[derive(Clone, Debug)]
enum OwnedOp {
    Accept(SocketAddr),
    Connect(SocketAddr),
    Read(Vec<u8>),
    Write(Vec<u8>),
    /// A frontend read the probes dropped at its head (the common crate's scan, parent-based):
    /// the tracker gets its length and context, not its bytes.
    Dropped(Vec<u8>),
    Eof,
    Close,
}

impl OwnedOp {
    fn op(&self) -> Op<'_> {
        match self {
            Self::Accept(a) => Op::Accept { peer: Some(*a), local: None },
            Self::Connect(a) => Op::Connect { server: Some(*a) },
            Self::Read(b) => Op::Read(Chunk::complete(b)),
            Self::Write(b) => Op::Write(Chunk::complete(b)),
            Self::Dropped(b) => {
                let (rule, threshold) = SampledOutRule::UnsampledParent.in_probes();
                let context = HeadScan::scan(b, rule, threshold).expect("a head the probes drop").into();
                Op::DroppedRequest { len: b.len() as u64, context }
            }
            Self::Eof => Op::Read(Chunk { known: &[], total: 0, tail: &[] }),
            Self::Close => Op::Close,
        }
    }
}

impl Script {
    fn push(&mut self, tid: u32, fd: i32, op: OwnedOp) -> &mut Self {
        self.events.push((tid, fd, op));
        self
    }

    fn run(&mut self, tracker: &mut Tracker) -> Vec<ServerExchange> {
        for (tid, fd, op) in &self.events {
            self.ts += 1000;
            let op = op.op();
            tracker.handle(&SyscallEvent { ts_ns: self.ts, tgid: PID, tid: *tid, fd: *fd, seq: 0, op });
        }
        self.events.clear();
        tracker.drain().collect()
    }
}

fn client() -> SocketAddr {
    "10.0.0.1:40000".parse().unwrap()
}
fn server() -> SocketAddr {
    "10.0.0.2:8080".parse().unwrap()
}

fn req(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: h\r\n\r\n").into_bytes()
}
fn resp(status: u16, body: &str) -> Vec<u8> {
    format!("HTTP/1.1 {status} X\r\nContent-Length: {}\r\n\r\n{body}", body.len()).into_bytes()
}

#[test]
fn proxied_request_links_client_to_server() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req("/a")))
        .push(1, 11, OwnedOp::Connect(server()))
        .push(1, 11, OwnedOp::Write(req("/a")))
        .push(1, 11, OwnedOp::Read(resp(200, "hello")))
        .push(1, 10, OwnedOp::Write(resp(200, "hello")));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 1);
    let ex = &out[0];
    assert_eq!(ex.request.as_ref().unwrap().path(), "/a");
    assert_eq!(ex.response.unwrap().status, 200);
    assert_eq!(ex.peer, Some(client()));
    assert_eq!(ex.outcome, Outcome::Complete);
    assert_eq!(ex.clients.len(), 1);
    assert_eq!(ex.clients[0].server, Some(server()));
    assert!(ex.start_ns < ex.clients[0].start_ns && ex.clients[0].end_ns < ex.end_ns);
    assert_eq!(t.open_exchanges(), 0);
}

#[test]
fn the_moments_of_haproxys_timers_come_from_the_syscalls_that_make_them() {
    // Times are 1000 ns apart in script order: accept 1000, ...
    let mut tracker = Tracker::default();
    let mut script = Script::default();
    let head = req("/a");
    let (first, rest) = head.split_at(5);
    let back_response = resp(200, "hello");
    let (response_start, response_rest) = back_response.split_at(7);
    script
        .push(1, 10, OwnedOp::Accept(client())) // 1000
        .push(1, 10, OwnedOp::Read(first.to_vec())) // 2000: the request's first byte
        .push(1, 10, OwnedOp::Read(rest.to_vec())) // 3000: its head complete
        .push(1, 11, OwnedOp::Connect(server())) // 4000
        .push(1, 11, OwnedOp::Write(req("/a"))) // 5000
        .push(1, 11, OwnedOp::Read(response_start.to_vec())) // 6000: the response's first byte
        .push(1, 11, OwnedOp::Read(response_rest.to_vec())) // 7000
        .push(1, 10, OwnedOp::Write(back_response.clone())) // 8000
        // A second request on both connections: the backend one is reused.
        .push(1, 10, OwnedOp::Read(req("/b"))) // 9000
        .push(1, 11, OwnedOp::Write(req("/b"))) // 10000
        .push(1, 11, OwnedOp::Read(back_response.clone())) // 11000
        .push(1, 10, OwnedOp::Write(back_response)); // 12000
    let out = script.run(&mut tracker);
    assert_eq!(out.len(), 2);
    let (first_ex, second_ex) = (&out[0], &out[1]);
    assert_eq!((first_ex.start_ns, first_ex.head_end_ns, first_ex.end_ns), (2000, Some(3000), 8000));
    let c = &first_ex.clients[0];
    assert_eq!((c.connect_ns, c.start_ns, c.response_start_ns), (Some(4000), 5000, Some(6000)));
    assert_eq!((second_ex.start_ns, second_ex.head_end_ns), (9000, Some(9000)));
    let c = &second_ex.clients[0];
    assert_eq!((c.connect_ns, c.start_ns, c.response_start_ns), (None, 10000, Some(11000)));
    assert_eq!(c.free_since_ns, Some(7000), "free since the first response was read whole");
    assert_eq!(first_ex.clients[0].free_since_ns, None);
}

#[test]
fn a_request_haproxy_rejects_is_an_exchange_with_what_the_client_sent() {
    let answer = b"HTTP/1.1 400 Bad request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec();
    for (label, bytes) in [
        ("garbage", b"\x01\x02 not http\r\n\r\n".to_vec()),
        ("bad version", b"GET / HTTX/1.1\r\nHost: h\r\n\r\n".to_vec()),
        ("a start line longer than the window", format!("GET /{} HTTP/1.1", "a".repeat(300)).into_bytes()),
    ] {
        let mut tracker = Tracker::default();
        let mut script = Script::default();
        script
            .push(1, 10, OwnedOp::Accept(client())) // 1000
            .push(1, 10, OwnedOp::Read(bytes.clone())) // 2000
            .push(1, 10, OwnedOp::Write(answer.clone())) // 3000
            .push(1, 10, OwnedOp::Close);
        let out = script.run(&mut tracker);
        assert_eq!(out.len(), 1, "{label}");
        let ex = &out[0];
        assert!(ex.request.is_none(), "{label}");
        assert_eq!(ex.response.map(|r| r.status), Some(400), "{label}");
        assert_eq!(ex.start_ns, 2000, "{label}: from the request's first byte");
        let prefix = ex.rejected.as_ref().map_or_else(|| panic!("{label}: no prefix"), |r| &*r.prefix);
        assert!(prefix.len() <= 128 && prefix.bytes().all(|b| (0x20..=0x7e).contains(&b)), "{label}: {prefix}");
        assert!(!prefix.is_empty(), "{label}");
    }
}

#[test]
fn a_request_haproxy_served_is_not_called_rejected_when_only_the_tracker_could_not_parse_it() {
    let mut tracker = Tracker::default();
    let mut script = Script::default();
    script
        .push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(b"\x01 odd but served\r\n\r\n".to_vec()))
        .push(1, 10, OwnedOp::Write(resp(200, "ok")))
        .push(1, 10, OwnedOp::Close);
    let out = script.run(&mut tracker);
    assert_eq!(out.len(), 1);
    assert!(out[0].rejected.is_none(), "HAProxy answered 200: no rejection to report");
}

#[test]
fn a_client_whose_bytes_haproxy_never_answers_turns_opaque() {
    let mut tracker = Tracker::default();
    let mut script = Script::default();
    script.push(1, 10, OwnedOp::Accept(client()));
    for _ in 0..6 {
        script.push(1, 10, OwnedOp::Read(b"\x00\x01 a stream of something else".to_vec()));
    }
    script.run(&mut tracker);
    // Opaque (the probes are told when the connection is numbered), one parse error, no more.
    assert_eq!((tracker.stats().opaque_connections, tracker.stats().parse_errors), (1, 1));
}

#[test]
fn bytes_like_a_tls_handshake_on_a_cleartext_connection_stay_opaque_not_rejected() {
    let mut tracker = Tracker::default();
    let mut script = Script::default();
    script
        .push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(vec![0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00]))
        .push(1, 10, OwnedOp::Write(vec![0x16, 0x03, 0x03, 0x00, 0x7a, 0x02]))
        .push(1, 10, OwnedOp::Close);
    assert!(script.run(&mut tracker).is_empty());
    assert_eq!(tracker.stats().opaque_connections, 1);
}

#[test]
fn a_server_that_closes_before_answering_ends_its_exchange_then_not_at_haproxys_close() {
    let mut tracker = Tracker::default();
    let mut script = Script::default();
    script
        .push(1, 10, OwnedOp::Accept(client())) // 1000
        .push(1, 10, OwnedOp::Read(req("/a"))) // 2000
        .push(1, 11, OwnedOp::Connect(server())) // 3000
        .push(1, 11, OwnedOp::Write(req("/a"))) // 4000
        .push(1, 11, OwnedOp::Eof) // 5000: the server hung up
        .push(1, 10, OwnedOp::Write(resp(502, "bad gateway"))) // 6000
        .push(1, 11, OwnedOp::Close); // 7000
    let out = script.run(&mut tracker);
    assert_eq!(out.len(), 1);
    let back = &out[0].clients[0];
    assert_eq!((back.end_ns, back.outcome, back.server_closed), (5000, Outcome::ClosedBeforeResponse, true));
    assert!(back.end_ns < out[0].end_ns, "inside its parent");
    assert_eq!(tracetap_proxy::termination::termination_state(&out[0]), Some("SH"));
}

#[test]
fn a_client_that_half_closes_after_its_request_still_ends_normally() {
    let mut tracker = Tracker::default();
    let mut script = Script::default();
    script
        .push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req("/a")))
        .push(1, 10, OwnedOp::Eof) // shutdown(SHUT_WR): it still reads the answer
        .push(1, 11, OwnedOp::Connect(server()))
        .push(1, 11, OwnedOp::Write(req("/a")))
        .push(1, 11, OwnedOp::Read(resp(200, "hello")))
        .push(1, 10, OwnedOp::Write(resp(200, "hello")));
    let out = script.run(&mut tracker);
    assert_eq!(out.len(), 1);
    assert!(!out[0].client_closed, "a clean end of stream before the response is no abort");
    assert_eq!(tracetap_proxy::termination::termination_state(&out[0]), Some("--"));
}

#[test]
fn traceparent_link_wins_over_order() {
    let mut t = Tracker::default();
    let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let with_tp = format!("GET /same HTTP/1.1\r\ntraceparent: {tp}\r\n\r\n").into_bytes();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req("/same")))
        .push(1, 12, OwnedOp::Accept(client()))
        .push(1, 12, OwnedOp::Read(with_tp.clone()))
        .push(1, 11, OwnedOp::Connect(server()))
        // The request with the traceparent goes out first.
        .push(1, 11, OwnedOp::Write(with_tp))
        .push(1, 11, OwnedOp::Read(resp(201, "")))
        .push(1, 12, OwnedOp::Write(resp(201, "")))
        .push(1, 11, OwnedOp::Write(req("/same")))
        .push(1, 11, OwnedOp::Read(resp(202, "")))
        .push(1, 10, OwnedOp::Write(resp(202, "")));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 2);
    for ex in &out {
        let status = ex.response.unwrap().status;
        assert_eq!(ex.clients.len(), 1);
        assert_eq!(ex.clients[0].response.unwrap().status, status, "each CLIENT exchange under its own request");
        let has_tp = matches!(ex.request.as_ref().unwrap().traceparent, TraceparentField::One(_));
        assert_eq!(has_tp, status == 201);
    }
}

#[test]
fn pipelined_requests_pair_in_order() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    let mut both = req("/1");
    both.extend(req("/2"));
    let mut answers = resp(200, "a");
    answers.extend(resp(404, "bb"));
    s.push(1, 10, OwnedOp::Accept(client())).push(1, 10, OwnedOp::Read(both)).push(1, 10, OwnedOp::Write(answers));
    let out = s.run(&mut t);
    let got: Vec<_> =
        out.iter().map(|e| (e.request.as_ref().unwrap().path().to_owned(), e.response.unwrap().status)).collect();
    assert_eq!(got, vec![("/1".to_owned(), 200), ("/2".to_owned(), 404)]);
}

#[test]
fn interim_100_continue_is_skipped() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(b"POST /u HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n".to_vec()))
        .push(1, 10, OwnedOp::Write(b"HTTP/1.1 100 Continue\r\n\r\n".to_vec()))
        .push(1, 10, OwnedOp::Read(b"abc".to_vec()))
        .push(1, 10, OwnedOp::Write(resp(201, "")));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].response.unwrap().status, 201);
}

#[test]
fn close_before_response_is_an_error_and_frees_state() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req("/slow")))
        .push(1, 11, OwnedOp::Connect(server()))
        .push(1, 11, OwnedOp::Write(req("/slow")))
        .push(1, 10, OwnedOp::Eof)
        .push(1, 10, OwnedOp::Close)
        .push(1, 11, OwnedOp::Close);
    let out = s.run(&mut t);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].outcome, Outcome::ClosedBeforeResponse);
    assert_eq!(out[0].clients.len(), 1, "the open backend exchange still lands under its SERVER span");
    assert_eq!(out[0].clients[0].outcome, Outcome::ClosedBeforeResponse);
    assert_eq!(t.open_exchanges(), 0);
    assert_eq!(t.connections(), 0);
}

#[test]
fn haproxy_answering_itself_gives_a_server_exchange_without_client() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req("/")))
        .push(1, 10, OwnedOp::Write(resp(503, "<html>no server</html>")))
        .push(1, 10, OwnedOp::Close);
    let out = s.run(&mut t);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].response.unwrap().status, 503);
    assert!(out[0].clients.is_empty());
}

#[test]
fn answer_to_a_connection_that_sent_nothing_is_not_an_exchange() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client())).push(1, 10, OwnedOp::Eof).push(1, 10, OwnedOp::Write(resp(400, "bad")));
    s.push(1, 10, OwnedOp::Close);
    assert!(s.run(&mut t).is_empty());
    assert_eq!(t.stats().unpaired_responses, 1);
    // A half-sent head answered with 408 is an exchange.
    s.push(1, 11, OwnedOp::Accept(client()))
        .push(1, 11, OwnedOp::Read(b"GET /slow HTTP/1.1\r\nHost: a\r\n".to_vec()))
        .push(1, 11, OwnedOp::Write(resp(408, "")));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].response.unwrap().status, 408);
}

#[test]
fn reused_fd_is_a_new_connection() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req("/first")))
        .push(1, 10, OwnedOp::Close)
        .push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req("/second")))
        .push(1, 10, OwnedOp::Write(resp(200, "")));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 2);
    assert_eq!(out[0].outcome, Outcome::ClosedBeforeResponse);
    assert_eq!(out[1].request.as_ref().unwrap().path(), "/second");
    assert_eq!(out[1].outcome, Outcome::Complete);
}

#[test]
fn garbage_connection_becomes_opaque_once() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()));
    for _ in 0..100 {
        s.push(1, 10, OwnedOp::Read(vec![0x16, 0x03, 0x01, 0xff, 0x00]));
    }
    assert!(s.run(&mut t).is_empty());
    assert_eq!(t.stats().opaque_connections, 1);
    assert!(t.stats().parse_errors <= 1, "no parse-error flood");
}

#[test]
fn connection_opened_before_the_agent_is_classified_by_its_bytes() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Read(req("/old"))).push(1, 10, OwnedOp::Write(resp(200, "x")));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].peer, None);
}

#[test]
fn websocket_upgrade_ends_at_101_and_tunnel_bytes_are_ignored() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n".to_vec()))
        .push(1, 10, OwnedOp::Write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n".to_vec()))
        .push(1, 10, OwnedOp::Read(vec![0x81, 0x85, 1, 2, 3, 4, 5]))
        .push(1, 10, OwnedOp::Write(vec![0x81, 0x05, b'h', b'e', b'l', b'l', b'o']));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].outcome, Outcome::Upgraded);
    assert_eq!(t.stats().parse_errors, 0);
}

/// A numbered event (as the probes send for connections they saw open).
fn numbered(ts_ns: u64, fd: i32, seq: u32, op: Op<'_>) -> SyscallEvent<'_> {
    SyscallEvent { ts_ns, tgid: PID, tid: 1, fd, seq, op }
}

#[test]
fn connections_that_stop_speaking_http_are_marked_once_by_their_opening_time() {
    let mut t = Tracker::default();
    let tls = b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03";
    // TLS on an HTTP port: opaque at its first bytes, marked once.
    t.handle(&numbered(100, 10, 1, Op::Accept { peer: Some(client()), local: None }));
    t.handle(&numbered(200, 10, 2, Op::Read(Chunk::complete(tls))));
    t.handle(&numbered(300, 10, 3, Op::Read(Chunk::complete(tls))));
    // A `mode tcp` connection: ignored from its connect.
    t.handle(&numbered(400, 11, 1, Op::Connect { server: Some(server()) }));
    t.handle(&numbered(400, 11, 1, Op::Ignore));
    // Opened before the probes (not numbered): they have no name for it, so no mark.
    t.handle(&numbered(500, 12, 0, Op::Accept { peer: Some(client()), local: None }));
    t.handle(&numbered(600, 12, 0, Op::Read(Chunk::complete(tls))));
    let marks: Vec<OpaqueMark> = t.take_opaque_marks().collect();
    assert_eq!(
        marks,
        [OpaqueMark { tgid: PID, fd: 10, opened_ns: 100 }, OpaqueMark { tgid: PID, fd: 11, opened_ns: 400 }]
    );
    assert_eq!(t.take_opaque_marks().count(), 0);
}

#[test]
fn both_sides_of_an_upgrade_are_marked_after_the_101_and_bytes_without_payload_are_fine() {
    let mut t = Tracker::default();
    let upgrade = b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n";
    let switching = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n";
    t.handle(&numbered(100, 10, 1, Op::Accept { peer: Some(client()), local: None }));
    t.handle(&numbered(110, 10, 2, Op::Read(Chunk::complete(upgrade))));
    t.handle(&numbered(120, 11, 1, Op::Connect { server: Some(server()) }));
    t.handle(&numbered(130, 11, 2, Op::Write(Chunk::complete(upgrade))));
    assert_eq!(t.take_opaque_marks().count(), 0, "nothing is opaque before the 101");
    t.handle(&numbered(140, 11, 3, Op::Read(Chunk::complete(switching))));
    t.handle(&numbered(150, 10, 3, Op::Write(Chunk::complete(switching))));
    let marks: Vec<OpaqueMark> = t.take_opaque_marks().collect();
    assert_eq!(
        marks,
        [OpaqueMark { tgid: PID, fd: 11, opened_ns: 120 }, OpaqueMark { tgid: PID, fd: 10, opened_ns: 100 }]
    );
    // From then on the probes send sizes only.
    let blind = Chunk { known: &[], total: 4096, tail: &[] };
    for (i, fd) in [10, 11, 11, 10].into_iter().enumerate() {
        let seq = 4 + u32::from(i >= 2);
        t.handle(&numbered(200 + i as u64, fd, seq, if i % 2 == 0 { Op::Read(blind) } else { Op::Write(blind) }));
    }
    t.handle(&numbered(300, 10, 6, Op::Close));
    t.handle(&numbered(310, 11, 6, Op::Close));
    let out: Vec<ServerExchange> = t.drain().collect();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].outcome, Outcome::Upgraded);
    let stats = t.stats();
    assert_eq!((stats.parse_errors, stats.capture_gaps), (0, 0));
}

#[test]
fn retried_request_gets_one_client_exchange_per_attempt() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client())).push(1, 10, OwnedOp::Read(req("/flaky")));
    for attempt in 0..3 {
        let fd = 11 + attempt;
        s.push(1, fd, OwnedOp::Connect(server()))
            .push(1, fd, OwnedOp::Write(req("/flaky")))
            .push(1, fd, OwnedOp::Read(resp(503, "")))
            .push(1, fd, OwnedOp::Close);
    }
    s.push(1, 10, OwnedOp::Write(resp(503, "")));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].clients.len(), 3, "one CLIENT exchange per attempt");
    assert_eq!(t.stats().unlinked_backend_requests, 0);
}

#[test]
fn head_cut_by_the_capture_window_is_traced_and_counted() {
    let mut t = Tracker::default();
    let head = b"GET /big HTTP/1.1\r\nHost: h\r\nCookie: ";
    t.handle(&SyscallEvent { ts_ns: 1, tgid: PID, tid: 1, fd: 10, seq: 0, op: Op::Accept { peer: None, local: None } });
    let chunk = Chunk { known: head, total: 6000, tail: b"" };
    t.handle(&SyscallEvent { ts_ns: 2, tgid: PID, tid: 1, fd: 10, seq: 0, op: Op::Read(chunk) });
    let response = resp(200, "ok");
    t.handle(&SyscallEvent { ts_ns: 3, tgid: PID, tid: 1, fd: 10, seq: 0, op: Op::Write(Chunk::complete(&response)) });
    let out: Vec<_> = t.drain().collect();
    assert_eq!(out.len(), 1);
    let request = out[0].request.as_ref().unwrap();
    assert!(request.truncated);
    assert_eq!(request.path(), "/big");
    assert_eq!(t.stats().truncated_heads, 1);
}

#[test]
fn ignored_connections_produce_nothing() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()));
    s.run(&mut t);
    t.handle(&SyscallEvent { ts_ns: 5, tgid: PID, tid: 1, fd: 10, seq: 0, op: Op::Ignore });
    s.push(1, 10, OwnedOp::Read(req("/tcp-mode"))).push(1, 10, OwnedOp::Write(resp(200, "")));
    assert!(s.run(&mut t).is_empty());
    assert_eq!(t.stats().frontend_requests, 0);
}

#[test]
fn expiry_gives_up_on_idle_exchanges() {
    let mut t = Tracker::new(Limits { exchange_timeout_ns: 10_000, linger_ns: 1_000, ..Limits::default() });
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client())).push(1, 10, OwnedOp::Read(req("/hang")));
    assert!(s.run(&mut t).is_empty());
    t.expire(1_000_000);
    let out = t.drain().collect::<Vec<_>>();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].outcome, Outcome::Expired);
    assert_eq!(t.stats().expired_exchanges, 1);
}

/// The bytes of one proxied exchange: (frontend bytes in, backend bytes out, backend bytes in,
/// frontend bytes out).
type Recorded = (Vec<u8>, Vec<u8>, Vec<u8>, Vec<u8>);

/// Recorded exchanges of one connection pair.
fn recorded(conn: usize, requests: usize) -> Vec<Recorded> {
    (0..requests)
        .map(|r| {
            let path = format!("/c{conn}/r{r}");
            let body = "x".repeat((conn * 7 + r * 13) % 50);
            let chunked =
                format!("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
            let response = if r % 2 == 0 { resp(200, &body) } else { chunked.into_bytes() };
            (req(&path), req(&path), response.clone(), response)
        })
        .collect()
}

/// Splits `bytes` at the given cut points (taken modulo the length).
fn split(bytes: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    points.push(0);
    points.push(bytes.len());
    points.sort_unstable();
    points.dedup();
    points.windows(2).map(|w| bytes[w[0]..w[1]].to_vec()).filter(|c| !c.is_empty()).collect()
}

fn summary(out: Vec<ServerExchange>) -> Vec<(String, u16, usize, String)> {
    let mut v: Vec<_> = out
        .into_iter()
        .map(|e| {
            let path = e.request.as_ref().unwrap().path().to_owned();
            let client_path = e.clients.first().map(|c| c.request.path().to_owned()).unwrap_or_default();
            (path, e.response.map_or(0, |r| r.status), e.clients.len(), client_path)
        })
        .collect();
    v.sort();
    v
}

proptest! {
    /// Any split of the byte streams into syscall-sized chunks, and any interleaving of the
    /// connections, gives the same exchanges.
    #[test]
    fn chunking_and_interleaving_do_not_change_exchanges(
        cuts in proptest::collection::vec(0usize..400, 0..12),
        order in proptest::collection::vec(0usize..3, 0..64),
    ) {
        const CONNS: usize = 3;
        // Each connection pair is a sequence of steps that must stay in order; steps of different
        // pairs interleave as `order` says.
        let mut queues: Vec<Vec<(u32, i32, OwnedOp)>> = (0..CONNS)
            .map(|c| {
                let (front, back) = (10 + 2 * c as i32, 11 + 2 * c as i32);
                let tid = c as u32 + 1;
                let mut steps = vec![(tid, front, OwnedOp::Accept(client())), (tid, back, OwnedOp::Connect(server()))];
                for (fin, bout, bin, fout) in recorded(c, 3) {
                    for (fd, bytes, read) in [(front, fin, true), (back, bout, false), (back, bin, true), (front, fout, false)] {
                        for piece in split(&bytes, &cuts) {
                            steps.push((tid, fd, if read { OwnedOp::Read(piece) } else { OwnedOp::Write(piece) }));
                        }
                    }
                }
                steps.reverse();
                steps
            })
            .collect();
        let mut script = Script::default();
        let mut pick = order.into_iter().cycle();
        while queues.iter().any(|q| !q.is_empty()) {
            let mut c = pick.next().unwrap_or(0) % CONNS;
            while queues[c].is_empty() {
                c = (c + 1) % CONNS;
            }
            let (tid, fd, op) = queues[c].pop().unwrap();
            script.push(tid, fd, op);
        }
        let mut tracker = Tracker::default();
        let got = summary(script.run(&mut tracker));

        let mut reference = Script::default();
        for c in 0..CONNS {
            let (front, back) = (10 + 2 * c as i32, 11 + 2 * c as i32);
            let tid = c as u32 + 1;
            reference.push(tid, front, OwnedOp::Accept(client())).push(tid, back, OwnedOp::Connect(server()));
            for (fin, bout, bin, fout) in recorded(c, 3) {
                reference.push(tid, front, OwnedOp::Read(fin)).push(tid, back, OwnedOp::Write(bout))
                    .push(tid, back, OwnedOp::Read(bin)).push(tid, front, OwnedOp::Write(fout));
            }
        }
        let want = summary(reference.run(&mut Tracker::default()));
        prop_assert_eq!(want.len(), CONNS * 3);
        prop_assert!(want.iter().all(|(p, s, n, cp)| *s == 200 && *n == 1 && p == cp));
        prop_assert_eq!(got, want);
        prop_assert_eq!(tracker.stats().parse_errors, 0);
    }
}

fn req_with(path: &str, headers: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: h\r\nUser-Agent: load/1\r\nAccept: */*\r\n{headers}\r\n").into_bytes()
}

/// Status of the SERVER exchange and of each of its CLIENT exchanges, sorted by SERVER status.
fn statuses(out: &[ServerExchange]) -> Vec<(u16, Vec<u16>)> {
    let mut v: Vec<_> = out
        .iter()
        .map(|e| {
            (e.response.map_or(0, |r| r.status), e.clients.iter().map(|c| c.response.map_or(0, |r| r.status)).collect())
        })
        .collect();
    v.sort();
    v
}

/// Every CLIENT exchange lies inside its SERVER exchange in time.
fn nested_in_time(out: &[ServerExchange]) -> bool {
    out.iter().all(|e| e.clients.iter().all(|c| e.start_ns <= c.start_ns && c.end_ns <= e.end_ns))
}

#[test]
fn identical_requests_written_out_of_order_link_by_the_relayed_response() {
    // Two identical requests on one thread. The first must connect (EINPROGRESS, written later);
    // the second reuses an idle connection and is written first.
    for (first_status, second_status) in [(201, 202), (200, 200)] {
        let mut t = Tracker::default();
        let mut s = Script::default();
        s.push(1, 20, OwnedOp::Connect(server())).push(1, 20, OwnedOp::Write(req_with("/same", ""))).push(
            1,
            20,
            OwnedOp::Read(resp(299, "")),
        );
        s.run(&mut t); // leaves an idle backend connection (its exchange is unlinked: no client)
        s.push(1, 10, OwnedOp::Accept(client()))
            .push(1, 11, OwnedOp::Accept(client()))
            .push(1, 10, OwnedOp::Read(req_with("/same", "")))
            .push(1, 11, OwnedOp::Read(req_with("/same", "")))
            .push(1, 21, OwnedOp::Connect(server()))
            .push(1, 20, OwnedOp::Write(req_with("/same", "")))
            .push(1, 21, OwnedOp::Write(req_with("/same", "")))
            .push(1, 20, OwnedOp::Read(resp(second_status, "b")))
            .push(1, 11, OwnedOp::Write(resp(second_status, "b")))
            .push(1, 21, OwnedOp::Read(resp(first_status, "a")))
            .push(1, 10, OwnedOp::Write(resp(first_status, "a")));
        let out = s.run(&mut t);
        assert_eq!(out.len(), 2);
        assert_eq!(
            statuses(&out),
            vec![
                (first_status.min(second_status), vec![first_status.min(second_status)]),
                (first_status.max(second_status), vec![first_status.max(second_status)])
            ]
        );
        assert!(nested_in_time(&out), "each CLIENT exchange inside its own SERVER exchange");
        let by_fd: Vec<_> = out.iter().map(|e| e.clients[0].start_ns).collect();
        assert_eq!(by_fd.len(), 2);
        assert_eq!(t.open_exchanges(), 0);
    }
}

#[test]
fn queued_requests_answered_out_of_order_keep_their_own_backend_exchange() {
    // Three identical requests; the backend answers the third first (a server queue, or a slow
    // request): statuses show which is which.
    let mut t = Tracker::default();
    let mut s = Script::default();
    for fd in [10, 11, 12] {
        s.push(1, fd, OwnedOp::Accept(client())).push(1, fd, OwnedOp::Read(req_with("/q", "")));
    }
    for fd in [20, 21, 22] {
        s.push(1, fd, OwnedOp::Connect(server()));
    }
    // HAProxy writes them in the order 12, 10, 11 (fds 20, 21, 22).
    for fd in [20, 21, 22] {
        s.push(1, fd, OwnedOp::Write(req_with("/q", "")));
    }
    s.push(1, 22, OwnedOp::Read(resp(211, "")))
        .push(1, 11, OwnedOp::Write(resp(211, "")))
        .push(1, 20, OwnedOp::Read(resp(212, "")))
        .push(1, 21, OwnedOp::Read(resp(210, "")))
        .push(1, 12, OwnedOp::Write(resp(212, "")))
        .push(1, 10, OwnedOp::Write(resp(210, "")));
    let out = s.run(&mut t);
    assert_eq!(statuses(&out), vec![(210, vec![210]), (211, vec![211]), (212, vec![212])]);
    assert!(nested_in_time(&out));
    assert!(t.stats().relinked_backend_exchanges >= 1);
}

#[test]
fn rewritten_paths_and_headers_still_link() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 11, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req_with("/a?x=1", "X-Id: 1\r\n")))
        .push(1, 11, OwnedOp::Read(req_with("/b", "X-Id: 2\r\nX-Drop: me\r\n")))
        .push(1, 20, OwnedOp::Connect(server()))
        .push(1, 21, OwnedOp::Connect(server()))
        // set-path /v2%[path], set-query, a header added and one removed.
        .push(1, 20, OwnedOp::Write(req_with("/v2/a?y=2", "X-Id: 1\r\nX-Added: 1\r\nX-Forwarded-For: 10.0.0.1\r\n")))
        .push(1, 21, OwnedOp::Write(req_with("/v2/b", "X-Id: 2\r\n")))
        .push(1, 20, OwnedOp::Read(resp(201, "")))
        .push(1, 10, OwnedOp::Write(resp(201, "")))
        .push(1, 21, OwnedOp::Read(resp(202, "")))
        .push(1, 11, OwnedOp::Write(resp(202, "")));
    let out = s.run(&mut t);
    assert_eq!(statuses(&out), vec![(201, vec![201]), (202, vec![202])]);
    for ex in &out {
        let front = ex.request.as_ref().unwrap().path().to_owned();
        assert_eq!(ex.clients[0].request.path(), format!("/v2{front}"));
    }
    assert_eq!(t.stats().unlinked_backend_requests, 0);
}

#[test]
fn health_checks_are_not_linked_to_client_requests() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req_with("/", "X-Id: 1\r\n")))
        .push(1, 30, OwnedOp::Connect(server()))
        .push(1, 30, OwnedOp::Write(b"OPTIONS / HTTP/1.0\r\n\r\n".to_vec()))
        .push(1, 30, OwnedOp::Read(resp(200, "")))
        .push(1, 30, OwnedOp::Close)
        .push(1, 20, OwnedOp::Connect(server()))
        .push(1, 20, OwnedOp::Write(req_with("/", "X-Id: 1\r\n")))
        .push(1, 20, OwnedOp::Read(resp(200, "x")))
        .push(1, 10, OwnedOp::Write(resp(200, "x")));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].clients.len(), 1);
    assert_eq!(out[0].clients[0].request.method, "GET");
    assert_eq!(t.stats().unlinked_backend_requests, 1, "the check is counted, not traced");
}

/// Runs `(tid, fd, op)` steps numbering each connection's records as the probes do (from 1 at
/// accept/connect), leaving out the steps whose index is in `lost`.
fn run_numbered(tracker: &mut Tracker, steps: &[(u32, i32, OwnedOp)], lost: &[bool]) -> Vec<ServerExchange> {
    run_numbered_with(tracker, steps, lost, true)
}

/// [`run_numbered`], telling the tracker of each loss (as the probes' loss epoch does) only when
/// `tell_losses`; per-connection gaps are seen either way.
fn run_numbered_with(
    tracker: &mut Tracker,
    steps: &[(u32, i32, OwnedOp)],
    lost: &[bool],
    tell_losses: bool,
) -> Vec<ServerExchange> {
    let mut loss_unseen = false;
    let mut seqs: std::collections::HashMap<i32, u32> = std::collections::HashMap::new();
    let mut out = Vec::new();
    for (i, (tid, fd, op)) in steps.iter().enumerate() {
        let seq = match op {
            OwnedOp::Accept(_) | OwnedOp::Connect(_) => {
                seqs.insert(*fd, 1);
                1
            }
            _ => {
                let s = seqs.entry(*fd).or_insert(0);
                *s += 1;
                *s
            }
        };
        if matches!(op, OwnedOp::Close) {
            seqs.remove(fd);
        }
        if lost.get(i).copied().unwrap_or(false) {
            loss_unseen = true;
            continue;
        }
        // 10 ms apart: far enough that a response unclaimed for a few steps is stale.
        let ts = (i as u64 + 1) * 10_000_000;
        if std::mem::take(&mut loss_unseen) && tell_losses {
            // The probes' loss epoch changed: the agent says so before the record that shows it.
            tracker.records_lost(ts);
        }
        let op = op.op();
        tracker.handle(&SyscallEvent { ts_ns: ts, tgid: PID, tid: *tid, fd: *fd, seq, op });
        out.extend(tracker.drain());
    }
    tracker.expire(u64::MAX / 2);
    out.extend(tracker.drain());
    out
}

#[test]
fn a_lost_response_ends_its_exchange_and_the_next_pairs_right() {
    let mut steps = vec![(1, 10, OwnedOp::Accept(client())), (1, 20, OwnedOp::Connect(server()))];
    for status in [201, 202, 203] {
        let path = format!("/s{status}");
        steps.push((1, 10, OwnedOp::Read(req(&path))));
        steps.push((1, 20, OwnedOp::Write(req(&path))));
        steps.push((1, 20, OwnedOp::Read(resp(status, "body"))));
        steps.push((1, 10, OwnedOp::Write(resp(status, "body"))));
    }
    // The backend's response to the first request is lost (index 4).
    let mut lost = vec![false; steps.len()];
    lost[4] = true;
    let mut t = Tracker::default();
    // Per-connection gaps only (the loss epoch's quarantine would keep the later CLIENT spans).
    let out = run_numbered_with(&mut t, &steps, &lost, false);
    for ex in &out {
        let Some(request) = &ex.request else { continue };
        let want: u16 = request.path()[2..].parse().unwrap();
        if let Some(r) = ex.response {
            assert_eq!(r.status, want, "SERVER exchange paired with its own response");
        }
        for c in &ex.clients {
            if let Some(r) = c.response {
                assert_eq!(r.status, want, "CLIENT exchange paired with its own response");
            }
        }
    }
    let gap = out.iter().flat_map(|e| &e.clients).filter(|c| c.outcome == Outcome::CaptureGap).count();
    assert_eq!(gap, 1, "the exchange that lost its response ends as a capture gap");
    let whole = out
        .iter()
        .filter(|e| e.outcome == Outcome::Complete && e.clients.len() == 1 && e.clients[0].outcome == Outcome::Complete)
        .count();
    assert_eq!(whole, 2, "the later requests are traced whole");
    assert_eq!(t.stats().capture_gaps, 1);
}

proptest! {
    /// Records lost at random, on any connection, at any point: every exchange handed out pairs
    /// each request with its own response, and every CLIENT exchange sits under the SERVER
    /// exchange of its own request. Requests carry their expected status in their path.
    #[test]
    fn lost_records_never_mispair(
        lost_at in proptest::collection::vec(0usize..200, 0..6),
        order in proptest::collection::vec(0usize..3, 0..80),
        same_thread in any::<bool>(),
        same_status in any::<bool>(),
    ) {
        const PAIRS: usize = 3;
        let mut queues: Vec<Vec<(u32, i32, OwnedOp)>> = (0..PAIRS)
            .map(|c| {
                let (front, back) = (10 + 2 * c as i32, 11 + 2 * c as i32);
                let tid = if same_thread { 1 } else { c as u32 + 1 };
                let mut steps = vec![(tid, front, OwnedOp::Accept(client())), (tid, back, OwnedOp::Connect(server()))];
                for r in 0..4 {
                    let status = if same_status { 200 } else { 200 + (c * 10 + r) as u16 };
                    let path = format!("/s{status}/{c}/{r}");
                    let body = "y".repeat(r * 3);
                    steps.push((tid, front, OwnedOp::Read(req(&path))));
                    steps.push((tid, back, OwnedOp::Write(req(&path))));
                    steps.push((tid, back, OwnedOp::Read(resp(status, &body))));
                    steps.push((tid, front, OwnedOp::Write(resp(status, &body))));
                }
                steps.push((tid, front, OwnedOp::Close));
                steps.reverse();
                steps
            })
            .collect();
        let mut steps = Vec::new();
        let mut pick = order.into_iter().cycle();
        while queues.iter().any(|q| !q.is_empty()) {
            let mut c = pick.next().unwrap_or(0) % PAIRS;
            while queues[c].is_empty() {
                c = (c + 1) % PAIRS;
            }
            steps.push(queues[c].pop().unwrap());
        }
        let mut lost = vec![false; steps.len()];
        for i in lost_at {
            if i < lost.len() {
                lost[i] = true;
            }
        }
        let mut t = Tracker::default();
        let out = run_numbered(&mut t, &steps, &lost);
        for ex in &out {
            let Some(request) = &ex.request else {
                prop_assert!(ex.clients.is_empty());
                continue;
            };
            let want: u16 = request.path()[2..5].parse().unwrap();
            if let Some(r) = ex.response {
                prop_assert_eq!(r.status, want);
            }
            for c in &ex.clients {
                prop_assert_eq!(c.request.path(), request.path(), "CLIENT under its own SERVER");
                if let Some(r) = c.response {
                    prop_assert_eq!(r.status, want);
                }
            }
        }
        if !lost.iter().any(|l| *l) {
            prop_assert_eq!(out.iter().filter(|e| e.outcome == Outcome::Complete && e.clients.len() == 1).count(), PAIRS * 4);
        }
    }
}

#[test]
fn proxy_protocol_headers_name_the_client_and_are_not_request_bytes() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    let mut v2 = b"\r\n\r\n\0\r\nQUIT\n\x21\x11\x00\x0c".to_vec();
    v2.extend_from_slice(&[198, 51, 100, 9, 127, 0, 0, 1]);
    v2.extend_from_slice(&40000u16.to_be_bytes());
    v2.extend_from_slice(&80u16.to_be_bytes());
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(b"PROXY TCP4 192.0.2.7 10.0.0.1 51234 80\r\n".to_vec()))
        .push(1, 10, OwnedOp::Read(req("/v1")))
        .push(1, 11, OwnedOp::Accept(client()))
        .push(1, 11, OwnedOp::Read([v2.as_slice(), req("/v2").as_slice()].concat()))
        .push(1, 20, OwnedOp::Connect(server()))
        // send-proxy: HAProxy's own header before its first request to the server.
        .push(1, 20, OwnedOp::Write([b"PROXY TCP4 192.0.2.7 10.0.0.2 51234 8080\r\n".as_slice(), &req("/v1")].concat()))
        .push(1, 20, OwnedOp::Read(resp(201, "")))
        .push(1, 10, OwnedOp::Write(resp(201, "")))
        .push(1, 20, OwnedOp::Write(req("/v2")))
        .push(1, 20, OwnedOp::Read(resp(202, "")))
        .push(1, 11, OwnedOp::Write(resp(202, "")));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 2);
    for ex in &out {
        let want = if ex.request.as_ref().unwrap().path() == "/v1" { "192.0.2.7:51234" } else { "198.51.100.9:40000" };
        assert_eq!(ex.client, Some(want.parse().unwrap()));
        assert_eq!(ex.peer, Some(client()), "the socket's peer is kept apart");
        assert_eq!(ex.clients.len(), 1);
    }
    assert_eq!(t.stats().parse_errors, 0);
}

#[test]
fn a_body_streaming_longer_than_the_expiry_is_not_expired() {
    let mut t = Tracker::new(Limits { exchange_timeout_ns: 10_000, linger_ns: 1_000, ..Limits::default() });
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req("/stream")))
        .push(1, 20, OwnedOp::Connect(server()))
        .push(1, 20, OwnedOp::Write(req("/stream")))
        .push(1, 20, OwnedOp::Read(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n".to_vec()))
        .push(1, 10, OwnedOp::Write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n".to_vec()));
    assert!(s.run(&mut t).is_empty());
    // 10 pieces of body, each 5 µs apart: 50 µs in all, five times the idle limit.
    for _ in 0..10 {
        s.push(1, 20, OwnedOp::Read(vec![b'x'; 10])).push(1, 10, OwnedOp::Write(vec![b'x'; 10]));
        let out = s.run(&mut t);
        t.expire(s.ts + 1_000);
        let expired: Vec<_> = t.drain().chain(out).collect();
        if let Some(ex) = expired.first() {
            assert_eq!(ex.outcome, Outcome::Complete, "expired mid-stream");
        }
    }
    assert_eq!(t.stats().expired_exchanges, 0);
}

#[test]
fn tls_and_dns_on_backend_sockets_are_opaque_not_parse_errors() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 20, OwnedOp::Connect(server()))
        .push(1, 20, OwnedOp::Write(vec![0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03]))
        .push(1, 20, OwnedOp::Read(vec![0x16, 0x03, 0x03, 0x00, 0x7a, 0x02]))
        .push(1, 21, OwnedOp::Connect(server()))
        .push(1, 21, OwnedOp::Write(vec![0x12, 0x34, 0x01, 0x00, 0x00, 0x01, 0, 0, 0, 0, 0, 0, 3, b'w', b'w', b'w']))
        .push(1, 22, OwnedOp::Connect(server()))
        // A server that speaks first (a banner).
        .push(1, 22, OwnedOp::Read(b"\x00\x00\x00\x0a5.7.0\x00".to_vec()));
    assert!(s.run(&mut t).is_empty());
    assert_eq!(t.stats().parse_errors, 0);
    assert_eq!(t.stats().opaque_connections, 3);
}

#[test]
fn pipes_and_files_never_seen_opened_are_counted_apart_from_opaque_connections() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    // HAProxy's wake-up pipe (write end 9, read end 8) and a config file read on fd 4.
    s.push(1, 9, OwnedOp::Write(b"c".to_vec()))
        .push(2, 8, OwnedOp::Read(b"c".to_vec()))
        .push(1, 4, OwnedOp::Read(b"global\n    maxconn 10\n".to_vec()))
        .push(1, 4, OwnedOp::Close);
    assert!(s.run(&mut t).is_empty());
    assert_eq!(t.stats().unknown_descriptors, 3);
    assert_eq!(t.stats().opaque_connections, 0);
    assert_eq!(t.stats().parse_errors, 0);
}

#[test]
fn a_lost_frontend_read_does_not_give_its_backend_exchange_to_an_identical_request() {
    // Two identical requests on one thread; A's frontend read is lost, so when A's backend request
    // is written, B is the only waiting request with that target.
    let with_status = |status: u16| format!("GET /same HTTP/1.1\r\nHost: h\r\nX-Want: {status}\r\n\r\n").into_bytes();
    let steps = vec![
        (1, 10, OwnedOp::Accept(client())),
        (1, 11, OwnedOp::Accept(client())),
        (1, 20, OwnedOp::Connect(server())),
        (1, 21, OwnedOp::Connect(server())),
        (1, 10, OwnedOp::Read(with_status(201))), // lost
        (1, 11, OwnedOp::Read(with_status(202))),
        (1, 20, OwnedOp::Write(with_status(201))),
        (1, 21, OwnedOp::Write(with_status(202))),
        (1, 20, OwnedOp::Read(resp(201, "a"))),
        (1, 10, OwnedOp::Write(resp(201, "a"))),
        (1, 21, OwnedOp::Read(resp(202, "b"))),
        (1, 11, OwnedOp::Write(resp(202, "b"))),
    ];
    let mut lost = vec![false; steps.len()];
    lost[4] = true;
    let mut t = Tracker::default();
    let out = run_numbered(&mut t, &steps, &lost);
    for ex in &out {
        let status = ex.response.map(|r| r.status);
        for c in &ex.clients {
            assert_eq!(c.response.map(|r| r.status), status, "a CLIENT exchange under another request");
        }
    }
    assert!(out.iter().any(|e| e.response.is_some_and(|r| r.status == 202)), "B's SERVER exchange is still traced");
    assert!(t.stats().quarantined_backend_exchanges >= 1, "what could not be trusted is counted");
}

#[test]
fn same_status_responses_relayed_out_of_order_are_told_apart_by_their_headers() {
    // Two identical requests, both answered 200. HAProxy reads the backend responses "a" (fd 20,
    // written first, so tentatively the first request's) then "b" (fd 21), and writes "b" to the
    // first client and "a" to the second: the earliest response read is not the first relayed.
    let ok = |etag: &str| format!("HTTP/1.1 200 OK\r\nETag: \"{etag}\"\r\nContent-Length: 1\r\n\r\nx").into_bytes();
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 11, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req_with("/same", "")))
        .push(1, 11, OwnedOp::Read(req_with("/same", "")))
        .push(1, 20, OwnedOp::Connect(server()))
        .push(1, 21, OwnedOp::Connect(server()))
        .push(1, 20, OwnedOp::Write(req_with("/same", "")))
        .push(1, 21, OwnedOp::Write(req_with("/same", "")))
        .push(1, 20, OwnedOp::Read(ok("a")))
        .push(1, 21, OwnedOp::Read(ok("b")))
        .push(1, 10, OwnedOp::Write(ok("b")))
        .push(1, 11, OwnedOp::Write(ok("a")));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 2);
    let first = out.iter().min_by_key(|e| e.start_ns).unwrap();
    let second = out.iter().max_by_key(|e| e.start_ns).unwrap();
    assert_eq!((first.clients.len(), second.clients.len()), (1, 1));
    assert!(
        first.clients[0].start_ns > second.clients[0].start_ns,
        "the first request's CLIENT exchange is the one on fd 21, written second"
    );
    assert_eq!(t.stats().relinked_backend_exchanges, 1);
}

#[test]
fn a_client_sending_only_host_still_links_when_haproxy_adds_headers() {
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(b"GET /w HTTP/1.1\r\nHost: h\r\n\r\n".to_vec()))
        .push(1, 20, OwnedOp::Connect(server()))
        .push(
            1,
            20,
            OwnedOp::Write(b"GET /w HTTP/1.1\r\nhost: other\r\nx-request-id: 1\r\nx-a: 1\r\nx-b: 2\r\n\r\n".to_vec()),
        )
        .push(1, 20, OwnedOp::Read(resp(200, "")))
        .push(1, 10, OwnedOp::Write(resp(200, "")));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].clients.len(), 1, "same target: linked whatever the headers");
    assert_eq!(t.stats().unlinked_backend_requests, 0);
}

#[test]
fn requests_told_apart_by_a_header_link_to_their_own_even_when_written_out_of_order() {
    let w = |st: u16| {
        format!("GET /same HTTP/1.1\r\nHost: h\r\nUser-Agent: u\r\nx-want-status: {st}\r\nx-delay-ms: 3\r\n\r\n")
            .into_bytes()
    };
    let mut t = Tracker::default();
    let mut s = Script::default();
    for (fd, st) in [(10, 201u16), (11, 202), (12, 203)] {
        s.push(1, fd, OwnedOp::Accept(client())).push(1, fd, OwnedOp::Read(w(st)));
    }
    for (fd, st) in [(22, 203u16), (20, 201), (21, 202)] {
        s.push(1, fd, OwnedOp::Connect(server())).push(1, fd, OwnedOp::Write(w(st)));
    }
    for (bfd, ffd, st) in [(22, 12, 203u16), (20, 10, 201), (21, 11, 202)] {
        s.push(1, bfd, OwnedOp::Read(resp(st, ""))).push(1, ffd, OwnedOp::Write(resp(st, "")));
    }
    let out = s.run(&mut t);
    assert_eq!(statuses(&out), vec![(201, vec![201]), (202, vec![202]), (203, vec![203])]);
    assert_eq!(t.stats().relinked_backend_exchanges, 0, "linked right at once, by the header: {:?}", t.stats());
}

#[test]
fn a_connection_that_stops_being_numbered_is_counted() {
    let mut t = Tracker::default();
    let ev = |seq, op| SyscallEvent { ts_ns: 1, tgid: PID, tid: 1, fd: 10, seq, op };
    t.handle(&ev(1, Op::Accept { peer: None, local: None }));
    t.handle(&ev(2, Op::Read(Chunk::complete(b"GET / HTTP/1.1\r\n\r\n"))));
    t.handle(&ev(0, Op::Write(Chunk::complete(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"))));
    t.handle(&ev(0, Op::Read(Chunk::complete(b"GET / HTTP/1.1\r\n\r\n"))));
    assert_eq!(t.stats().unnumbered_connections, 1);
    assert_eq!(t.stats().capture_gaps, 0);
}

/// A guessed link whose relay never came is let go; once no relay can claim it (past the relay
/// window after its response) it is counted at the next expiry, not only after the linger: a
/// burst of them (the streams a client's abrupt close leaves) must not stay in the relay queue
/// that every claim scans.
#[test]
fn a_let_go_backend_exchange_is_counted_once_no_relay_can_claim_it() {
    let mut t =
        Tracker::new(Limits { exchange_timeout_ns: 600_000_000_000, linger_ns: 60_000_000_000, ..Limits::default() });
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req_with("/x", "X-A: 1\r\n")))
        .push(1, 11, OwnedOp::Accept(client()))
        .push(1, 11, OwnedOp::Read(req_with("/x", "X-B: 1\r\n")))
        .push(1, 20, OwnedOp::Connect(server()))
        // Rewritten target: linked by its headers only, a guess.
        .push(1, 20, OwnedOp::Write(req_with("/rewritten", "X-A: 1\r\n")))
        .push(1, 20, OwnedOp::Read(resp(404, "")))
        // HAProxy answers the first client by itself: the 404 is not relayed to it.
        .push(1, 10, OwnedOp::Write(resp(200, "")));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 1, "the first request is done");
    assert!(out[0].clients.is_empty(), "an unconfirmed guess is not exported");
    assert_eq!(t.stats().unlinked_backend_requests, 0, "the response may still be claimed");
    t.expire(s.ts + 50_000_000);
    assert_eq!(t.stats().unlinked_backend_requests, 0, "within the relay window it still may");
    t.expire(s.ts + 100_000_001);
    assert_eq!(t.stats().unlinked_backend_requests, 1, "past it, counted, without waiting for the linger");
}

/// The trace id of the CLIENT exchange's request of each SERVER exchange, with the SERVER
/// exchange's own (from its request, or else from its response's `traceparent`).
fn trace_pairs(out: &[ServerExchange]) -> Vec<([u8; 16], [u8; 16])> {
    let trace = |tp: &TraceparentField| match tp {
        TraceparentField::One(v) => parse_traceparent(v).unwrap().trace_id,
        _ => [0; 16],
    };
    out.iter()
        .map(|e| {
            let own = match &e.request.as_ref().unwrap().traceparent {
                TraceparentField::One(v) => parse_traceparent(v).unwrap().trace_id,
                _ => e.response.unwrap().traceparent.unwrap().trace_id,
            };
            assert_eq!(e.clients.len(), 1);
            (own, trace(&e.clients[0].request.traceparent))
        })
        .collect()
}

#[test]
fn requests_haproxy_forwards_in_their_trace_under_a_new_parent_link_by_trace_id() {
    // `tracetap haproxy-snippet` lines: each backend request carries the client's trace id with a
    // new parent id. Byte-identical responses are relayed in the other order than they were read,
    // which no header tells apart: only the trace id can keep each with its own request.
    let incoming = |t: char| format!("traceparent: 00-{}-b7ad6b7169203331-01\r\n", t.to_string().repeat(32));
    let forwarded =
        |t: char, p: char| format!("traceparent: 00-{}-{}-01\r\n", t.to_string().repeat(32), p.to_string().repeat(16));
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 11, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req_with("/same", &incoming('a'))))
        .push(1, 11, OwnedOp::Read(req_with("/same", &incoming('b'))))
        .push(1, 20, OwnedOp::Connect(server()))
        .push(1, 21, OwnedOp::Connect(server()))
        .push(1, 20, OwnedOp::Write(req_with("/same", &forwarded('a', '1'))))
        .push(1, 21, OwnedOp::Write(req_with("/same", &forwarded('b', '2'))))
        .push(1, 20, OwnedOp::Read(resp(200, "x")))
        .push(1, 21, OwnedOp::Read(resp(200, "x")))
        .push(1, 11, OwnedOp::Write(resp(200, "x")))
        .push(1, 10, OwnedOp::Write(resp(200, "x")));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 2);
    for (own, forwarded) in trace_pairs(&out) {
        assert_eq!(own, forwarded, "each backend request under the request of its trace");
    }
    assert_eq!(t.stats().relinked_backend_exchanges, 0);
}

#[test]
fn a_response_carrying_the_forwarded_traceparent_claims_exactly_that_backend_exchange() {
    // No incoming traceparent: HAProxy generates one per request, forwards it and (with
    // `--response`) gives it to the client. Identical requests and byte-identical backend
    // responses, relayed in the other order than read: only the response's traceparent tells.
    let tp = |t: char| format!("traceparent: 00-{}-{}-03\r\n", t.to_string().repeat(32), "1".repeat(16));
    let relayed = |t: char| format!("HTTP/1.1 200 X\r\nContent-Length: 1\r\n{}\r\nx", tp(t)).into_bytes();
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 11, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req_with("/same", "")))
        .push(1, 11, OwnedOp::Read(req_with("/same", "")))
        .push(1, 20, OwnedOp::Connect(server()))
        .push(1, 21, OwnedOp::Connect(server()))
        .push(1, 20, OwnedOp::Write(req_with("/same", &tp('a'))))
        .push(1, 21, OwnedOp::Write(req_with("/same", &tp('b'))))
        .push(1, 20, OwnedOp::Read(resp(200, "x")))
        .push(1, 21, OwnedOp::Read(resp(200, "x")))
        .push(1, 11, OwnedOp::Write(relayed('b')))
        .push(1, 10, OwnedOp::Write(relayed('a')));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 2);
    for (own, forwarded) in trace_pairs(&out) {
        assert_eq!(own, forwarded, "each response's traceparent is its own backend request's");
    }
}

#[test]
fn a_retry_haproxy_resends_with_its_own_traceparent_stays_with_its_request() {
    // Two identical requests without context. HAProxy forwards the first with the traceparent its
    // lines made (X), the server closes without answering, and HAProxy resends it (same X) before
    // it writes the second request (Y). The retry is no new request: it belongs to the first.
    let tp = |p: char| format!("traceparent: 00-{}-{}-03\r\n", p.to_string().repeat(32), "1".repeat(16));
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(1, 11, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req_with("/same", "")))
        .push(1, 11, OwnedOp::Read(req_with("/same", "")))
        .push(1, 20, OwnedOp::Connect(server()))
        .push(1, 20, OwnedOp::Write(req_with("/same", &tp('a'))))
        .push(1, 20, OwnedOp::Eof)
        .push(1, 20, OwnedOp::Close)
        .push(1, 22, OwnedOp::Connect(server()))
        .push(1, 22, OwnedOp::Write(req_with("/same", &tp('a'))))
        .push(1, 21, OwnedOp::Connect(server()))
        .push(1, 21, OwnedOp::Write(req_with("/same", &tp('b'))))
        .push(1, 22, OwnedOp::Read(resp(200, "x")))
        .push(1, 10, OwnedOp::Write(resp(200, "x")))
        .push(1, 21, OwnedOp::Read(resp(200, "x")))
        .push(1, 11, OwnedOp::Write(resp(200, "x")));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 2);
    let trace_of = |c: &tracetap_proxy::ClientExchange| match &c.request.traceparent {
        TraceparentField::One(v) => v[3..4].to_owned(),
        _ => String::new(),
    };
    let mut got: Vec<Vec<String>> = out.iter().map(|e| e.clients.iter().map(trace_of).collect()).collect();
    got.sort();
    assert_eq!(
        got,
        vec![vec!["a".to_owned(), "a".to_owned()], vec!["b".to_owned()]],
        "both attempts under the first request"
    );
    // Linked right when written: no relay had to move it (one that cannot, after a loss or an
    // abort, would have left it with the second request).
    assert_eq!(t.stats().relinked_backend_exchanges, 0);
}

#[test]
fn a_relay_prefers_a_backend_exchange_in_its_own_trace_to_an_earlier_identical_response() {
    // Found in the connected-traces scenario (two HAProxy threads): two clients send one shared
    // traceparent at once while two others send none; HAProxy forwards the shared trace id under
    // new parent ids and gives the others new traces. The responses are byte-identical and read
    // in another order than relayed, and the earliest unclaimed one read belongs to a request
    // without context. A request of the shared trace must still get a backend exchange of its
    // trace: the trace id is evidence the headers and the read order are not.
    let shared = "traceparent: 00-eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee-b7ad6b7169203331-01\r\n";
    let forwarded =
        |t: char, p: char| format!("traceparent: 00-{}-{}-01\r\n", t.to_string().repeat(32), p.to_string().repeat(16));
    let mut t = Tracker::default();
    let mut s = Script::default();
    for fd in 10..=13 {
        s.push(1, fd, OwnedOp::Accept(client()));
    }
    s.push(1, 12, OwnedOp::Read(req_with("/same", "")))
        .push(1, 13, OwnedOp::Read(req_with("/same", "")))
        .push(1, 10, OwnedOp::Read(req_with("/same", shared)))
        .push(1, 11, OwnedOp::Read(req_with("/same", shared)));
    for fd in 20..=23 {
        s.push(1, fd, OwnedOp::Connect(server()));
    }
    s.push(1, 20, OwnedOp::Write(req_with("/same", &forwarded('a', '1'))))
        .push(1, 21, OwnedOp::Write(req_with("/same", &forwarded('e', '2'))))
        .push(1, 22, OwnedOp::Write(req_with("/same", &forwarded('e', '3'))))
        .push(1, 23, OwnedOp::Write(req_with("/same", &forwarded('b', '4'))));
    for fd in [22, 20, 21, 23] {
        s.push(1, fd, OwnedOp::Read(resp(200, "x")));
    }
    for fd in [10, 11, 12, 13] {
        s.push(1, fd, OwnedOp::Write(resp(200, "x")));
    }
    let out = s.run(&mut t);
    assert_eq!(out.len(), 4);
    let trace = |tp: &TraceparentField| match tp {
        TraceparentField::One(v) => parse_traceparent(v).map(|p| p.trace_id),
        _ => None,
    };
    for e in &out {
        assert_eq!(e.clients.len(), 1, "{e:?}");
        let own = trace(&e.request.as_ref().unwrap().traceparent);
        let backend = trace(&e.clients[0].request.traceparent).unwrap();
        match own {
            Some(own) => assert_eq!(backend, own, "a request of the shared trace gets a backend exchange of it"),
            None => assert_ne!(backend, [0xee; 16], "a request without context gets a new trace"),
        }
    }
}

#[test]
fn a_backend_request_in_a_shared_trace_goes_to_the_request_its_thread_read() {
    // Found in the connected-traces scenario: two connections send one traceparent at once and
    // HAProxy reads them on two threads; each thread writes its own backend request in that trace
    // (new parent ids). The second thread writes first: its backend request is the second
    // client request's, not the earliest one's, and each relay then finds its own.
    let shared = "traceparent: 00-eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee-b7ad6b7169203331-01\r\n";
    let forwarded = |p: char| format!("traceparent: 00-{}-{}-01\r\n", "e".repeat(32), p.to_string().repeat(16));
    let mut t = Tracker::default();
    let mut s = Script::default();
    s.push(1, 10, OwnedOp::Accept(client()))
        .push(2, 11, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req_with("/same", shared)))
        .push(2, 11, OwnedOp::Read(req_with("/same", shared)))
        .push(2, 21, OwnedOp::Connect(server()))
        .push(2, 21, OwnedOp::Write(req_with("/same", &forwarded('2'))))
        .push(1, 20, OwnedOp::Connect(server()))
        .push(1, 20, OwnedOp::Write(req_with("/same", &forwarded('1'))))
        .push(2, 21, OwnedOp::Read(resp(200, "x")))
        .push(2, 11, OwnedOp::Write(resp(200, "x")))
        .push(1, 20, OwnedOp::Read(resp(200, "x")))
        .push(1, 10, OwnedOp::Write(resp(200, "x")));
    let out = s.run(&mut t);
    assert_eq!(out.len(), 2);
    for e in &out {
        assert_eq!(e.clients.len(), 1, "each request has its own backend exchange: {e:?}");
    }
    let parent = |e: &ServerExchange| match &e.clients[0].request.traceparent {
        TraceparentField::One(v) => parse_traceparent(v).unwrap().parent_id,
        _ => panic!("a traceparent"),
    };
    let mut by_start: Vec<(u64, [u8; 8])> = out.iter().map(|e| (e.start_ns, parent(e))).collect();
    by_start.sort_unstable();
    assert_eq!(
        by_start.iter().map(|(_, p)| *p).collect::<Vec<_>>(),
        [[0x11; 8], [0x22; 8]],
        "thread 1's request (read first) under thread 1's backend request"
    );
    assert_eq!(t.stats().relinked_backend_exchanges, 0, "linked right when written");
}

/// A request head carrying `traceparent` with this trace id (32 hex digits) and flags.
fn traced_req(path: &str, trace: &str, flags: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: h\r\ntraceparent: 00-{trace}-00f067aa0ba902b7-{flags}\r\n\r\n").into_bytes()
}

const TRACE_A: &str = "0af7651916cd43dd8448eb211c80319a";
const TRACE_B: &str = "0af7651916cd43dd8448eb211c80319b";
const TRACE_C: &str = "0af7651916cd43dd8448eb211c80319c";

fn sampling_parent_based() -> Tracker {
    Tracker::new(Limits { sampled_out: SampledOutRule::UnsampledParent, ..Limits::default() })
}

/// What the exchanges handed out say: each SERVER exchange's path and status, and its CLIENT
/// exchanges' statuses.
fn answers(out: &[ServerExchange]) -> Vec<(String, u16, Vec<u16>)> {
    out.iter()
        .map(|ex| {
            let clients = ex.clients.iter().map(|c| c.response.map_or(0, |r| r.status)).collect();
            (ex.request.as_ref().unwrap().path().to_owned(), ex.response.map_or(0, |r| r.status), clients)
        })
        .collect()
}

#[test]
fn a_request_its_own_context_drops_is_only_paired_and_the_kept_ones_around_it_keep_their_answers() {
    // One keep-alive connection each side; the client pipelines the dropped request and the next
    // kept one in one read, and every response has a body of another length.
    let mut tracker = sampling_parent_based();
    let mut script = Script::default();
    let (a, b, c) = (traced_req("/a", TRACE_A, "01"), traced_req("/b", TRACE_B, "00"), traced_req("/c", TRACE_C, "01"));
    let pipelined = [b.clone(), c.clone()].concat();
    script
        .push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(a.clone()))
        .push(1, 11, OwnedOp::Connect(server()))
        .push(1, 11, OwnedOp::Write(a))
        .push(1, 11, OwnedOp::Read(resp(200, "a")))
        .push(1, 10, OwnedOp::Write(resp(200, "a")))
        .push(1, 10, OwnedOp::Read(pipelined))
        .push(1, 11, OwnedOp::Write(b))
        .push(1, 11, OwnedOp::Read(resp(201, "bb")))
        .push(1, 10, OwnedOp::Write(resp(201, "bb")))
        .push(1, 11, OwnedOp::Write(c))
        .push(1, 11, OwnedOp::Read(resp(202, "ccc")))
        .push(1, 10, OwnedOp::Write(resp(202, "ccc")));
    let out = script.run(&mut tracker);
    assert_eq!(answers(&out), [("/a".to_owned(), 200, vec![200]), ("/c".to_owned(), 202, vec![202])]);
    let stats = tracker.stats();
    assert_eq!((stats.sampled_out_requests, stats.sampled_out_backend_requests), (1, 1));
    assert_eq!((stats.frontend_requests, stats.backend_requests), (3, 3));
    assert_eq!((stats.unlinked_backend_requests, stats.unpaired_responses, stats.parse_errors), (0, 0, 0));
    assert_eq!(tracker.open_exchanges(), 0);
}

#[test]
fn an_interim_response_does_not_end_a_request_sampled_out() {
    let mut tracker = sampling_parent_based();
    let mut script = Script::default();
    let (b, c) = (traced_req("/b", TRACE_B, "00"), traced_req("/c", TRACE_C, "01"));
    let continued = [b"HTTP/1.1 100 Continue\r\n\r\n".to_vec(), resp(201, "bb")].concat();
    script
        .push(1, 10, OwnedOp::Accept(client()))
        .push(1, 11, OwnedOp::Connect(server()))
        .push(1, 10, OwnedOp::Read(b.clone()))
        .push(1, 11, OwnedOp::Write(b))
        .push(1, 11, OwnedOp::Read(b"HTTP/1.1 100 Continue\r\n\r\n".to_vec()))
        .push(1, 10, OwnedOp::Write(b"HTTP/1.1 100 Continue\r\n\r\n".to_vec()))
        .push(1, 11, OwnedOp::Read(resp(201, "bb")))
        .push(1, 10, OwnedOp::Write(continued[25..].to_vec()))
        .push(1, 10, OwnedOp::Read(c.clone()))
        .push(1, 11, OwnedOp::Write(c))
        .push(1, 11, OwnedOp::Read(resp(202, "ccc")))
        .push(1, 10, OwnedOp::Write(resp(202, "ccc")));
    let out = script.run(&mut tracker);
    assert_eq!(answers(&out), [("/c".to_owned(), 202, vec![202])]);
    assert_eq!(tracker.stats().unpaired_responses, 0);
}

#[test]
fn a_backend_request_of_a_trace_no_dropped_request_carries_is_linked_as_always() {
    // The client sent no context; HAProxy's lines forwarded one of their own, unsampled. The
    // exchange stays whole, for the agent to follow that flag.
    let mut tracker = sampling_parent_based();
    let mut script = Script::default();
    script
        .push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(req("/a")))
        .push(1, 11, OwnedOp::Connect(server()))
        .push(1, 11, OwnedOp::Write(traced_req("/a", TRACE_A, "00")))
        .push(1, 11, OwnedOp::Read(resp(200, "a")))
        .push(1, 10, OwnedOp::Write(resp(200, "a")));
    let out = script.run(&mut tracker);
    assert_eq!(answers(&out), [("/a".to_owned(), 200, vec![200])]);
    assert_eq!(tracker.stats().sampled_out_backend_requests, 0);
}

#[test]
fn a_dropped_trace_is_forgotten_once_its_request_is_answered() {
    // A later request without context, whose backend request carries that trace again, unsampled
    // (as lines of HAProxy's making could): it is linked, not left out.
    let mut tracker = sampling_parent_based();
    let mut script = Script::default();
    let b = traced_req("/b", TRACE_B, "00");
    script
        .push(1, 10, OwnedOp::Accept(client()))
        .push(1, 11, OwnedOp::Connect(server()))
        .push(1, 10, OwnedOp::Read(b.clone()))
        .push(1, 11, OwnedOp::Write(b))
        .push(1, 11, OwnedOp::Read(resp(201, "bb")))
        .push(1, 10, OwnedOp::Write(resp(201, "bb")))
        .push(1, 10, OwnedOp::Read(req("/d")))
        .push(1, 11, OwnedOp::Write(traced_req("/d", TRACE_B, "00")))
        .push(1, 11, OwnedOp::Read(resp(204, "")))
        .push(1, 10, OwnedOp::Write(resp(204, "")));
    let out = script.run(&mut tracker);
    assert_eq!(answers(&out), [("/d".to_owned(), 204, vec![204])]);
    assert_eq!((tracker.stats().sampled_out_requests, tracker.stats().sampled_out_backend_requests), (1, 1));
}

#[test]
fn a_sampled_flag_forwarded_for_a_request_dropped_at_its_head_is_counted_and_links_to_no_other() {
    // Lines made for another sampler forward "sampled" in the trace of a request whose own
    // parent dropped it. A request without context for the same target waits on the same thread:
    // the backend request must not become its CLIENT exchange (it would put it in that trace).
    let mut tracker = sampling_parent_based();
    let mut script = Script::default();
    let dropped = traced_req("/a", TRACE_B, "00");
    script
        .push(1, 10, OwnedOp::Accept(client()))
        .push(1, 12, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(dropped))
        .push(1, 12, OwnedOp::Read(req("/a")))
        .push(1, 11, OwnedOp::Connect(server()))
        .push(1, 11, OwnedOp::Write(forwarded_req("/a", TRACE_B, "01")))
        .push(1, 11, OwnedOp::Read(resp(200, "b")))
        .push(1, 10, OwnedOp::Write(resp(200, "b")))
        .push(1, 13, OwnedOp::Connect(server()))
        .push(1, 13, OwnedOp::Write(traced_req("/a", TRACE_C, "01")))
        .push(1, 13, OwnedOp::Read(resp(201, "kk")))
        .push(1, 12, OwnedOp::Write(resp(201, "kk")));
    let out = script.run(&mut tracker);
    assert_eq!(answers(&out), [("/a".to_owned(), 201, vec![201])]);
    assert_eq!(out[0].clients[0].request.parsed_traceparent.map(|p| p.trace_id[15]), Some(0x9c));
    let stats = tracker.stats();
    assert_eq!(
        (stats.head_disagreements, stats.sampled_out_backend_requests, stats.unlinked_backend_requests),
        (1, 0, 0)
    );
}

#[test]
fn a_dropped_trace_is_forgotten_when_its_connection_closes_unanswered() {
    let mut tracker = sampling_parent_based();
    let mut script = Script::default();
    script
        .push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(traced_req("/b", TRACE_B, "00")))
        .push(1, 10, OwnedOp::Close)
        .push(1, 12, OwnedOp::Accept(client()))
        .push(1, 12, OwnedOp::Read(req("/d")))
        .push(1, 11, OwnedOp::Connect(server()))
        .push(1, 11, OwnedOp::Write(traced_req("/d", TRACE_B, "00")))
        .push(1, 11, OwnedOp::Read(resp(204, "")))
        .push(1, 12, OwnedOp::Write(resp(204, "")));
    let out = script.run(&mut tracker);
    assert_eq!(answers(&out), [("/d".to_owned(), 204, vec![204])]);
    assert_eq!((tracker.stats().sampled_out_requests, tracker.stats().sampled_out_backend_requests), (1, 0));
}

/// A request head carrying the `traceparent` `HAProxy`'s lines make: the trace id kept, a parent
/// id of their own.
fn forwarded_req(path: &str, trace: &str, flags: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: h\r\ntraceparent: 00-{trace}-53995c3f42cd8ad8-{flags}\r\n\r\n").into_bytes()
}

#[test]
fn a_sampled_backend_request_in_a_trace_a_kept_request_shares_goes_to_that_request() {
    // The client sent one trace id on two requests, unsampled and sampled; the lines forward the
    // sampled one's flag under a parent id of their own: it is that request's.
    let mut tracker = sampling_parent_based();
    let mut script = Script::default();
    script
        .push(1, 10, OwnedOp::Accept(client()))
        .push(1, 12, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(traced_req("/a", TRACE_B, "00")))
        .push(1, 12, OwnedOp::Read(traced_req("/a", TRACE_B, "01")))
        .push(1, 11, OwnedOp::Connect(server()))
        .push(1, 11, OwnedOp::Write(forwarded_req("/a", TRACE_B, "00")))
        .push(1, 11, OwnedOp::Read(resp(200, "b")))
        .push(1, 10, OwnedOp::Write(resp(200, "b")))
        .push(1, 13, OwnedOp::Connect(server()))
        .push(1, 13, OwnedOp::Write(forwarded_req("/a", TRACE_B, "01")))
        .push(1, 13, OwnedOp::Read(resp(201, "kk")))
        .push(1, 12, OwnedOp::Write(resp(201, "kk")));
    let out = script.run(&mut tracker);
    assert_eq!(answers(&out), [("/a".to_owned(), 201, vec![201])]);
    let stats = tracker.stats();
    assert_eq!(
        (stats.head_disagreements, stats.sampled_out_backend_requests, stats.unlinked_backend_requests),
        (0, 1, 0)
    );
}

#[test]
fn under_a_ratio_a_context_forwarded_unchanged_is_dropped_like_its_request_and_one_haproxy_made_follows_its_flag() {
    // Ratio 0.5 drops TRACE_B by its trace id (its lowest 56 bits are below 2^55), whatever its
    // flag says.
    let mut tracker =
        Tracker::new(Limits { sampled_out: SampledOutRule::RandomnessBelow(1 << 55), ..Limits::default() });
    let mut script = Script::default();
    let dropped = traced_req("/b", TRACE_B, "01");
    script
        .push(1, 10, OwnedOp::Accept(client()))
        .push(1, 11, OwnedOp::Connect(server()))
        .push(1, 10, OwnedOp::Read(dropped.clone()))
        .push(1, 11, OwnedOp::Write(dropped))
        .push(1, 11, OwnedOp::Read(resp(201, "bb")))
        .push(1, 10, OwnedOp::Write(resp(201, "bb")))
        .push(1, 10, OwnedOp::Read(traced_req("/b", TRACE_B, "01")))
        .push(1, 11, OwnedOp::Write(forwarded_req("/b", TRACE_B, "01")))
        .push(1, 11, OwnedOp::Read(resp(202, "bb")))
        .push(1, 10, OwnedOp::Write(resp(202, "bb")));
    let out = script.run(&mut tracker);
    assert!(out.is_empty(), "both dropped at their head: {:?}", answers(&out));
    let stats = tracker.stats();
    assert_eq!((stats.sampled_out_requests, stats.sampled_out_backend_requests, stats.head_disagreements), (2, 1, 1));
}

#[test]
fn a_request_the_probes_dropped_is_paired_like_one_dropped_here_between_two_kept_ones() {
    let mut tracker = sampling_parent_based();
    let mut script = Script::default();
    let (a, b, c) = (traced_req("/a", TRACE_A, "01"), traced_req("/b", TRACE_B, "00"), traced_req("/c", TRACE_C, "01"));
    script
        .push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(a.clone()))
        .push(1, 11, OwnedOp::Connect(server()))
        .push(1, 11, OwnedOp::Write(a))
        .push(1, 11, OwnedOp::Read(resp(200, "a")))
        .push(1, 10, OwnedOp::Write(resp(200, "a")))
        .push(1, 10, OwnedOp::Dropped(b.clone()))
        .push(1, 11, OwnedOp::Write(b))
        .push(1, 11, OwnedOp::Read(resp(201, "bb")))
        .push(1, 10, OwnedOp::Write(resp(201, "bb")))
        .push(1, 10, OwnedOp::Read(c.clone()))
        .push(1, 11, OwnedOp::Write(c))
        .push(1, 11, OwnedOp::Read(resp(202, "ccc")))
        .push(1, 10, OwnedOp::Write(resp(202, "ccc")));
    let out = script.run(&mut tracker);
    assert_eq!(answers(&out), [("/a".to_owned(), 200, vec![200]), ("/c".to_owned(), 202, vec![202])]);
    let stats = tracker.stats();
    // Its backend request is left out by the context the probes handed over.
    assert_eq!(
        (stats.requests_dropped_in_probe, stats.sampled_out_requests, stats.sampled_out_backend_requests),
        (1, 1, 1)
    );
    assert_eq!((stats.unlinked_backend_requests, stats.unpaired_responses, stats.parse_errors), (0, 0, 0));
    assert_eq!(tracker.open_exchanges(), 0);
}

#[test]
fn a_dropped_read_inside_a_body_is_that_bodys_bytes() {
    // A client posts a body whose bytes are a request head the probes drop: the agent, which
    // knows the body's length, counts them into it instead.
    let mut tracker = sampling_parent_based();
    let mut script = Script::default();
    let inner = traced_req("/inner", TRACE_B, "00");
    let post = format!("POST /p HTTP/1.1\r\nContent-Length: {}\r\n\r\n", inner.len()).into_bytes();
    script
        .push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(post.clone()))
        .push(1, 10, OwnedOp::Dropped(inner.clone()))
        .push(1, 11, OwnedOp::Connect(server()))
        .push(1, 11, OwnedOp::Write([post, inner].concat()))
        .push(1, 11, OwnedOp::Read(resp(200, "p")))
        .push(1, 10, OwnedOp::Write(resp(200, "p")))
        .push(1, 10, OwnedOp::Read(req("/next")))
        .push(1, 11, OwnedOp::Write(req("/next")))
        .push(1, 11, OwnedOp::Read(resp(201, "n")))
        .push(1, 10, OwnedOp::Write(resp(201, "n")));
    let out = script.run(&mut tracker);
    assert_eq!(answers(&out), [("/p".to_owned(), 200, vec![200]), ("/next".to_owned(), 201, vec![201])]);
    let stats = tracker.stats();
    assert_eq!((stats.requests_dropped_in_probe, stats.sampled_out_requests, stats.parse_errors), (0, 0, 0));
}

#[test]
fn a_dropped_read_that_ends_a_body_and_starts_a_head_is_a_capture_gap() {
    // A body's last bytes and a pipelined head in one read, which the probes took for one head
    // (`ABCGET`): where the head starts is not known, so the tracker counts a gap rather than
    // guess, and frames the next request again.
    let mut tracker = sampling_parent_based();
    let mut script = Script::default();
    let post = b"POST /p HTTP/1.1\r\nContent-Length: 3\r\n\r\n".to_vec();
    let pipelined = [b"ABC".to_vec(), traced_req("/x", TRACE_B, "00")].concat();
    script
        .push(1, 10, OwnedOp::Accept(client()))
        .push(1, 10, OwnedOp::Read(post))
        .push(1, 10, OwnedOp::Dropped(pipelined))
        .push(1, 10, OwnedOp::Read(req("/next")));
    script.run(&mut tracker);
    let stats = tracker.stats();
    assert_eq!((stats.capture_gaps, stats.requests_dropped_in_probe, stats.sampled_out_requests), (1, 0, 0));
    assert_eq!(stats.frontend_requests, 2, "the POST and the request after the gap");
}

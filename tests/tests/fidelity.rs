//! What real HAProxy traffic looks like, end to end: each test drives one HAProxy behaviour and
//! checks the spans an operator would read. All need root (see `require_root`).

use std::net::SocketAddr;
use std::time::Duration;

use tracetap_tests::client::Conn;
use tracetap_tests::otlp::Received;
use tracetap_tests::{Stack, free_port, haproxy, require_root, wait_for};

fn status(span: &Received) -> Option<i64> {
    span.int_attr("http.response.status_code")
}

#[test]
fn pipelined_requests_each_get_their_spans() {
    if !require_root() {
        return;
    }
    let s = Stack::start("", &[]);
    let mut conn = Conn::connect(s.front).unwrap();
    conn.send_raw(
        b"GET /p1 HTTP/1.1\r\nHost: t\r\n\r\nGET /p2 HTTP/1.1\r\nHost: t\r\n\r\nGET /p3 HTTP/1.1\r\nHost: t\r\n\r\n",
    )
    .unwrap();
    for _ in 0..3 {
        assert_eq!(conn.read_response().unwrap().status, 200);
    }
    let spans = s.spans_for(&["/p1", "/p2", "/p3"]);
    for path in ["/p1", "/p2", "/p3"] {
        let (server, clients) = Stack::trace_of(&spans, path);
        assert_eq!(status(server), Some(200));
        assert_eq!(clients.len(), 1, "{path}");
        assert_eq!(clients[0].str_attr("url.path"), Some(path));
    }
}

#[test]
fn http10_expect_continue_chunked_upload_and_split_head() {
    if !require_root() {
        return;
    }
    let s = Stack::start("", &[]);
    // HTTP/1.0, connection closes after the response.
    let mut old = Conn::connect(s.front).unwrap();
    old.send_raw(b"GET /h10 HTTP/1.0\r\nHost: t\r\n\r\n").unwrap();
    assert_eq!(old.read_response().unwrap().status, 200);
    // Expect: 100-continue, then the body.
    let mut conn = Conn::connect(s.front).unwrap();
    conn.send_raw(b"POST /continue HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n").unwrap();
    let first = conn.read_response().unwrap();
    if first.status == 100 {
        conn.send_raw(b"hello").unwrap();
        assert_eq!(conn.read_response().unwrap().status, 200);
    } else {
        assert_eq!(first.status, 200);
    }
    // A chunked request body on the same connection.
    conn.send_raw(b"POST /chunked-upload HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        .unwrap();
    assert_eq!(conn.read_response().unwrap().status, 200);
    // A head written in three pieces.
    for piece in [&b"GET /split HT"[..], b"TP/1.1\r\nHost: t\r\n", b"\r\n"] {
        conn.send_raw(piece).unwrap();
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(conn.read_response().unwrap().status, 200);

    let spans = s.spans_for(&["/h10", "/continue", "/chunked-upload", "/split"]);
    let (h10, clients) = Stack::trace_of(&spans, "/h10");
    assert_eq!(h10.str_attr("network.protocol.version"), Some("1.0"));
    assert_eq!(clients.len(), 1);
    for path in ["/continue", "/chunked-upload"] {
        let (server, clients) = Stack::trace_of(&spans, path);
        assert_eq!(server.str_attr("http.request.method"), Some("POST"));
        assert_eq!(status(server), Some(200), "{path}: the final status, not 100");
        assert_eq!(clients.len(), 1, "{path}");
    }
    let (split, clients) = Stack::trace_of(&spans, "/split");
    assert_eq!(clients.len(), 1);
    assert!(
        split.span.end_time_unix_nano - split.span.start_time_unix_nano >= 100_000_000,
        "starts at the first piece"
    );
    assert_eq!(s.agent.metric("tracetap_parse_errors_total"), 0);
}

#[test]
fn bodies_larger_than_the_capture_window_keep_the_stream_in_step() {
    if !require_root() {
        return;
    }
    for splice in [false, true] {
        let extra = if splice { "    option splice-response\n    option splice-request\n" } else { "" };
        let s = Stack::with_config(
            |port, backend| {
                haproxy::config(port, &[backend], "")
                    .replace("\nbackend be_app\n", &format!("\nbackend be_app\n{extra}"))
            },
            &[],
        );
        let mut conn = Conn::connect(s.front).unwrap();
        assert_eq!(conn.get("/big/300000", &[]).unwrap().body.len(), 300_000);
        assert_eq!(conn.get("/chunked/300000", &[]).unwrap().body.len(), 300_000);
        assert_eq!(conn.get("/after", &[]).unwrap().status, 200);
        let spans = s.spans_for(&["/big/300000", "/chunked/300000", "/after"]);
        for path in ["/big/300000", "/chunked/300000", "/after"] {
            let (server, clients) = Stack::trace_of(&spans, path);
            assert_eq!(status(server), Some(200), "{path} (splice: {splice})");
            assert!(!server.is_error(), "{path} (splice: {splice})");
            assert_eq!(clients.len(), 1, "{path} (splice: {splice})");
            assert!(clients[0].span.end_time_unix_nano <= server.span.end_time_unix_nano);
        }
        assert_eq!(s.agent.metric("tracetap_parse_errors_total"), 0, "splice: {splice}");
    }
}

#[test]
fn traceparent_beyond_the_capture_window_is_counted() {
    if !require_root() {
        return;
    }
    let s = Stack::start("", &[("TRACETAP_CAPTURE_BYTES", "256".to_owned())]);
    let mut conn = Conn::connect(s.front).unwrap();
    let pad = "x".repeat(1000);
    let tp = "00-11111111111111111111111111111111-2222222222222222-01";
    assert_eq!(conn.get("/far", &[("x-pad", &pad), ("traceparent", tp)]).unwrap().status, 200);
    assert_eq!(conn.get("/near", &[("traceparent", tp)]).unwrap().status, 200);
    let spans = s.spans_for(&["/far", "/near"]);
    let (far, clients) = Stack::trace_of(&spans, "/far");
    assert_eq!(far.span.attributes.iter().find(|kv| kv.key == "tracetap.head_truncated").map(|_| true), Some(true));
    assert_ne!(far.span.trace_id, vec![0x11; 16], "the traceparent was not seen: a new trace starts");
    assert_eq!(clients.len(), 1, "still linked to its backend request");
    let (near, _) = Stack::trace_of(&spans, "/near");
    assert_eq!(near.span.trace_id, vec![0x11; 16]);
    assert!(s.agent.metric("tracetap_request_heads_truncated_total") >= 1);
}

#[test]
fn haproxy_answering_by_itself() {
    if !require_root() {
        return;
    }
    // Port 1: below the ephemeral range the tests' servers bind in, so no other test can take it
    // meanwhile (a port from `free_port` was once taken by a parallel test's OTLP receiver).
    let dead = SocketAddr::from(([127, 0, 0, 1], 1));
    assert!(std::net::TcpStream::connect(dead).is_err(), "nothing listens on {dead}");
    let s = Stack::with_config(
        |port, backend| {
            format!(
                "global\n    maxconn 100\ndefaults\n    mode http\n    timeout connect 1s\n    timeout client 5s\n    timeout server 500ms\n    timeout http-request 500ms\n\
                 frontend fe_main\n    bind 127.0.0.1:{port}\n\
                 \x20   http-request deny if {{ path_beg /deny }}\n\
                 \x20   http-request return status 200 content-type text/plain string ok if {{ path_beg /return }}\n\
                 \x20   http-request redirect location /elsewhere if {{ path_beg /redirect }}\n\
                 \x20   use_backend be_dead if {{ path_beg /dead }}\n\
                 \x20   default_backend be_app\n\
                 backend be_app\n    server s0 {backend}\n\
                 backend be_dead\n    server gone {dead}\n"
            )
        },
        &[],
    );
    let mut conn = Conn::connect(s.front).unwrap();
    for (path, want) in [("/deny", 403), ("/return", 200), ("/redirect", 302)] {
        assert_eq!(conn.get(path, &[]).unwrap().status, want, "{path}");
    }
    assert_eq!(Conn::connect(s.front).unwrap().get("/dead", &[]).unwrap().status, 503);
    assert_eq!(Conn::connect(s.front).unwrap().get("/slow/2000", &[]).unwrap().status, 504);
    // A client that starts a request and stops: HAProxy answers 408.
    let mut idle = Conn::connect(s.front).unwrap();
    idle.send_raw(b"GET /never-finished HTTP/1.1\r\nHost: t\r\n").unwrap();
    assert_eq!(idle.read_response().unwrap().status, 408);

    let spans = s.spans_for(&["/deny", "/return", "/redirect", "/dead", "/slow/2000"]);
    for (path, want) in [("/deny", 403), ("/return", 200), ("/redirect", 302), ("/dead", 503)] {
        let (server, clients) = Stack::trace_of(&spans, path);
        assert_eq!(status(server), Some(want), "{path}");
        assert!(clients.is_empty(), "{path}: no backend exchange");
        assert_eq!(server.is_error(), want >= 500, "{path}");
    }
    let (timeout, clients) = Stack::trace_of(&spans, "/slow/2000");
    assert_eq!(status(timeout), Some(504));
    assert!(timeout.is_error());
    assert_eq!(clients.len(), 1, "the backend was tried");
    assert!(clients[0].is_error(), "the backend exchange ended without a response");
    let got_408 = wait_for(Duration::from_secs(10), || {
        s.receiver.spans().into_iter().find(|x| x.is_server() && status(x) == Some(408))
    })
    .expect("a SERVER span for the 408");
    assert_eq!(got_408.str_attr("http.request.method"), Some("_OTHER"), "the request head never completed");
}

#[test]
fn retries_give_one_client_span_per_attempt() {
    if !require_root() {
        return;
    }
    let s = Stack::with_config(
        |port, backend| {
            haproxy::config(port, &[backend, backend], "").replace(
                "\nbackend be_app\n",
                "\nbackend be_app\n    retries 2\n    retry-on 503\n    option redispatch\n",
            )
        },
        &[],
    );
    let mut conn = Conn::connect(s.front).unwrap();
    assert_eq!(conn.get("/status/503", &[]).unwrap().status, 503);
    let spans = s.spans_for(&["/status/503"]);
    let (server, clients) = Stack::trace_of(&spans, "/status/503");
    assert_eq!(status(server), Some(503));
    assert_eq!(clients.len(), 3, "the first attempt and two retries");
    assert!(clients.iter().all(|c| status(c) == Some(503)));
    assert_eq!(s.agent.metric("tracetap_backend_requests_unlinked_total"), 0);
}

#[test]
fn websocket_upgrade_is_one_exchange_and_the_tunnel_is_not_parsed() {
    if !require_root() {
        return;
    }
    let s = Stack::start("", &[]);
    let mut conn = Conn::connect(s.front).unwrap();
    conn.send_raw(
        b"GET /ws HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
          Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    )
    .unwrap();
    assert_eq!(conn.read_response().unwrap().status, 101);
    // Bytes that would look like HTTP to a parser that kept going, echoed back through the tunnel.
    let frame = b"\x81\x05hello\r\nGET /not-a-request HTTP/1.1\r\n\r\n";
    for _ in 0..20 {
        conn.send_raw(frame).unwrap();
        assert_eq!(conn.read_exact_bytes(frame.len()).unwrap(), frame);
    }
    drop(conn);
    let spans = s.spans_for(&["/ws"]);
    let (server, clients) = Stack::trace_of(&spans, "/ws");
    assert_eq!(status(server), Some(101));
    assert_eq!(clients.len(), 1);
    assert_eq!(status(clients[0]), Some(101));
    assert!(!server.is_error());
    assert_eq!(s.agent.metric("tracetap_parse_errors_total"), 0);
    assert_eq!(spans.len(), 2);
}

/// The standard stack plus a `mode tcp` frontend and backend to the same test backend; returns
/// the stack and the tcp frontend's port.
fn stack_with_a_tcp_mode_proxy() -> (Stack, u16) {
    let tcp_port = free_port();
    let s = Stack::with_config(
        |port, backend| {
            haproxy::config(port, &[backend], "")
                + &format!(
                    "\nfrontend fe_tcp\n    mode tcp\n    bind 127.0.0.1:{tcp_port}\n    default_backend be_tcp\n\nbackend be_tcp\n    mode tcp\n    server raw {backend}\n"
                )
        },
        &[],
    );
    (s, tcp_port)
}

#[test]
fn tcp_mode_and_garbage_produce_no_spans() {
    if !require_root() {
        return;
    }
    let (s, tcp_port) = stack_with_a_tcp_mode_proxy();
    // HTTP carried by a tcp-mode proxy is not HAProxy handling HTTP: no spans.
    let mut tcp = Conn::connect(SocketAddr::from(([127, 0, 0, 1], tcp_port))).unwrap();
    assert_eq!(tcp.get("/through-tcp-mode", &[]).unwrap().status, 200);
    // Garbage on the HTTP port: HAProxy answers 400 and closes.
    for _ in 0..5 {
        let mut junk = Conn::connect(s.front).unwrap();
        junk.send_raw(&[0x16, 0x03, 0x01, 0x00, 0xa5, 0x01, 0x00, 0x00, 0xa1, 0x03, 0x03, 0x00, 0xff, 0xfe]).unwrap();
        let _ = junk.read_response();
    }
    // A real request as a marker that everything before it was processed.
    assert_eq!(Conn::connect(s.front).unwrap().get("/marker", &[]).unwrap().status, 200);
    let spans = s.spans_for(&["/marker"]);
    std::thread::sleep(Duration::from_millis(300));
    let spans = if s.receiver.spans().len() > spans.len() { s.receiver.spans() } else { spans };
    let paths: Vec<_> = spans.iter().filter_map(|x| x.str_attr("url.path")).collect();
    assert_eq!(paths, ["/marker", "/marker"], "only the marker's SERVER and CLIENT spans");
    assert!(s.agent.metric("tracetap_opaque_connections_total") >= 5);
    let mut agent = s.agent;
    assert!(agent.is_running());
}

/// Once the agent knows a connection does not speak HTTP/1 (`mode tcp` at its accept and
/// connect, a tunnel after `101 Switching Protocols`), the probes stop copying its bytes: what
/// flows afterwards adds (almost) nothing to the payload the probes copied. A connection that
/// reuses the closed one's fd number is traced in full.
#[test]
fn opaque_connections_are_no_longer_copied_once_known() {
    if !require_root() {
        return;
    }
    let (s, tcp_port) = stack_with_a_tcp_mode_proxy();
    let upgrade = b"GET /ws HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
          Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n";
    // 2 MiB each way, through a tunnel: every syscall would copy up to TRACETAP_CAPTURE_BYTES.
    let frame = vec![b'x'; 32 * 1024];
    for (front, marks) in [(SocketAddr::from(([127, 0, 0, 1], tcp_port)), 2), (s.front, 4)] {
        let mut conn = Conn::connect(front).unwrap();
        conn.send_raw(upgrade).unwrap();
        assert_eq!(conn.read_response().unwrap().status, 101);
        // The client and server connections of this proxy are marked (cumulative over the loop).
        let skipped = "tracetap_opaque_marks_total";
        assert!(
            wait_for(Duration::from_secs(10), || (s.agent.metric(skipped) >= marks).then_some(())).is_some(),
            "{front}: {} connections marked, expected {marks}",
            s.agent.metric(skipped)
        );
        let before = s.agent.metric("tracetap_payload_bytes_captured_total");
        let events_before = s.agent.metric("tracetap_events_captured_total");
        for _ in 0..64 {
            conn.send_raw(&frame).unwrap();
            assert_eq!(conn.read_exact_bytes(frame.len()).unwrap(), frame);
        }
        // Every syscall is still reported (sizes, sequence numbers), without its bytes.
        let events_after = wait_for(Duration::from_secs(10), || {
            let n = s.agent.metric("tracetap_events_captured_total");
            (n >= events_before + 4 * 64).then_some(n)
        });
        assert!(events_after.is_some(), "{front}: the tunnel's reads and writes are still reported");
        let copied = s.agent.metric("tracetap_payload_bytes_captured_total") - before;
        assert!(copied < 64 * 1024, "{front}: {copied} payload bytes copied for 4 MiB through a marked tunnel");
    }
    assert_eq!(s.agent.metric("tracetap_opaque_marks_refused_total"), 0);
    // Closed: the next connections may get the same fd numbers, and are traced whole.
    let paths: Vec<String> = (0..5).map(|i| format!("/after-the-tunnel/{i}")).collect();
    for path in &paths {
        assert_eq!(Conn::connect(s.front).unwrap().get(path, &[]).unwrap().status, 200);
    }
    let wanted: Vec<&str> = paths.iter().map(String::as_str).collect();
    let spans = s.spans_for(&wanted);
    for path in &wanted {
        let (server, clients) = Stack::trace_of(&spans, path);
        assert_eq!(status(server), Some(200), "{path}");
        assert_eq!(clients.len(), 1, "{path}");
    }
}

#[test]
fn proxy_protocol_v1_and_v2_name_the_client_on_every_version() {
    if !require_root() {
        return;
    }
    for version in haproxy::versions() {
        let s = Stack::with_config_on(
            version,
            |port, backend| {
                haproxy::config(port, &[backend], "").replace(&format!(":{port}\n"), &format!(":{port} accept-proxy\n"))
            },
            &[],
        );
        let local_port = s.front.port();
        // v1: a text line naming 192.0.2.7:51234.
        let mut v1 = Conn::connect(s.front).unwrap();
        v1.send_raw(format!("PROXY TCP4 192.0.2.7 127.0.0.1 51234 {local_port}\r\n").as_bytes()).unwrap();
        assert_eq!(v1.get("/pp-v1", &[]).unwrap().status, 200, "{version}");
        assert_eq!(v1.get("/pp-v1-again", &[]).unwrap().status, 200, "{version}");
        // v2: the binary header naming [2001:db8::9]:40000.
        let mut header = b"\r\n\r\n\0\r\nQUIT\n\x21\x21\x00\x24".to_vec();
        header.extend_from_slice(&"2001:db8::9".parse::<std::net::Ipv6Addr>().unwrap().octets());
        header.extend_from_slice(&std::net::Ipv6Addr::LOCALHOST.octets());
        header.extend_from_slice(&40000u16.to_be_bytes());
        header.extend_from_slice(&local_port.to_be_bytes());
        let mut v2 = Conn::connect(s.front).unwrap();
        v2.send_raw(&header).unwrap();
        assert_eq!(v2.get("/pp-v2", &[]).unwrap().status, 200, "{version}");
        let spans = s.spans_for(&["/pp-v1", "/pp-v1-again", "/pp-v2"]);
        for (path, address, port) in
            [("/pp-v1", "192.0.2.7", 51234), ("/pp-v1-again", "192.0.2.7", 51234), ("/pp-v2", "2001:db8::9", 40000)]
        {
            let (server, clients) = Stack::trace_of(&spans, path);
            assert_eq!(server.str_attr("client.address"), Some(address), "{version}: {path}");
            assert_eq!(server.int_attr("client.port"), Some(port), "{version}: {path}");
            assert_eq!(
                server.str_attr("network.peer.address"),
                Some("127.0.0.1"),
                "{version}: {path}: the socket's peer"
            );
            assert_eq!(clients.len(), 1, "{version}: {path}");
        }
        assert_eq!(s.agent.metric("tracetap_parse_errors_total"), 0, "{version}");
    }
}

#[test]
fn send_proxy_headers_to_servers_are_not_requests_on_every_version() {
    if !require_root() {
        return;
    }
    for version in haproxy::versions() {
        // The server side: another HAProxy (not traced: a command name of its own) that expects
        // a PROXY header on every connection, in front of the test backend.
        let mut inner = None;
        let s = Stack::with_config_on(
            version,
            |port, backend| {
                let inner_port = free_port();
                let inner_config = format!(
                    "global\n    maxconn 100\ndefaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n\
                     frontend fe_in\n    bind 127.0.0.1:{inner_port} accept-proxy\n    default_backend be_in\n\
                     backend be_in\n    server b {backend}\n"
                );
                inner = Some(haproxy::Haproxy::start(&haproxy::unique_comm(), &inner_config, inner_port));
                format!(
                    "global\n    maxconn 100\ndefaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n\
                     frontend fe_main\n    bind 127.0.0.1:{port}\n    use_backend be_v2 if {{ path_beg /sp-v2 }}\n    default_backend be_v1\n\
                     backend be_v1\n    server s1 127.0.0.1:{inner_port} send-proxy\n\
                     backend be_v2\n    server s2 127.0.0.1:{inner_port} send-proxy-v2\n"
                )
            },
            &[],
        );
        let mut conn = Conn::connect(s.front).unwrap();
        let paths = ["/sp-v1/a", "/sp-v1/b", "/sp-v2/a", "/sp-v2/b"];
        for path in paths {
            assert_eq!(conn.get(path, &[]).unwrap().status, 200, "{version}: {path}");
        }
        let spans = s.spans_for(&paths);
        for path in paths {
            let (server, clients) = Stack::trace_of(&spans, path);
            assert_eq!(status(server), Some(200), "{version}: {path}");
            assert_eq!(clients.len(), 1, "{version}: {path}: the header is not a request");
            assert_eq!(clients[0].str_attr("url.path"), Some(path), "{version}");
            assert_eq!(status(clients[0]), Some(200), "{version}: {path}");
        }
        assert_eq!(s.agent.metric("tracetap_parse_errors_total"), 0, "{version}");
        assert_eq!(s.agent.metric("tracetap_opaque_connections_total"), 0, "{version}");
        drop(inner);
    }
}

/// Reads and writes of up to 512 bytes go into ring records reserved in place, larger ones
/// through the staging buffer (ebpf/probes, `SMALL_PAYLOAD`): heads of every size around that
/// bound, each read by HAProxy in one call, come out whole on both sides.
#[test]
fn heads_on_both_sides_of_the_in_place_record_size_are_captured_whole() {
    if !require_root() {
        return;
    }
    let s = Stack::start("", &[]);
    let sizes = 505..=520usize;
    let paths: Vec<String> = sizes.clone().map(|n| format!("/size/{n}")).collect();
    for (n, path) in sizes.zip(&paths) {
        let start = format!("GET {path} HTTP/1.1\r\nHost: t\r\nX-Pad: ");
        let pad = n - start.len() - "\r\n\r\n".len();
        let head = format!("{start}{}\r\n\r\n", "p".repeat(pad));
        assert_eq!(head.len(), n);
        let mut conn = Conn::connect(s.front).unwrap();
        conn.send_raw(head.as_bytes()).unwrap();
        assert_eq!(conn.read_response().unwrap().status, 200, "{path}");
    }
    let wanted: Vec<&str> = paths.iter().map(String::as_str).collect();
    let spans = s.spans_for(&wanted);
    for path in &wanted {
        let (server, clients) = Stack::trace_of(&spans, path);
        assert_eq!(status(server), Some(200), "{path}");
        assert_eq!(clients.len(), 1, "{path}: one CLIENT span");
        assert_eq!(clients[0].str_attr("url.path"), Some(*path));
    }
}

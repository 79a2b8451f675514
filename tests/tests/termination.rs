//! `haproxy.termination_state` on SERVER spans, checked against the state in `HAProxy`'s own
//! `httplog` line for the same connection (read from a UDP socket), on 2.6 and 3.0: a normal end
//! (`--`), a server timeout (`sH`), a server that hangs up or resets before answering (`SH`) or
//! hangs up in the middle of its body (`SD`), a client that stops sending its head (`cR`), a malformed request (`PR`) and
//! a client that goes away during a large response (`CD`). Where the server hung up, the CLIENT
//! span ends when `HAProxy` read the hang-up, inside its SERVER span.
#![cfg(target_os = "linux")]

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use tracetap_tests::client::Conn;
use tracetap_tests::haproxy::{self, Version};
use tracetap_tests::syslog::Syslog;
use tracetap_tests::{Stack, otlp, require_root, wait_for};

/// A server that reads a request and then does `answer` with the connection.
fn raw_server(answer: fn(&mut std::net::TcpStream)) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                let _ = stream.read(&mut buf);
                answer(&mut stream);
            });
        }
    });
    addr
}

/// Closes `stream` with a reset (`SO_LINGER` 0) instead of an end of stream.
fn reset(stream: &mut std::net::TcpStream) {
    use std::os::fd::AsRawFd as _;
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: a valid socket and a `linger` of the size given.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_LINGER");
}

/// The raw servers behind `HAProxy`.
struct Servers {
    hang_up: SocketAddr,
    reset: SocketAddr,
    cut: SocketAddr,
}

fn config(port: u16, backend: SocketAddr, log: SocketAddr, servers: &Servers) -> String {
    let Servers { hang_up, reset, cut } = servers;
    format!(
        "global\n    maxconn 4096\n    log {log} local0\n\n\
         defaults\n    mode http\n    log global\n    option httplog\n    timeout connect 2s\n    timeout client 10s\n    \
         timeout server 300ms\n    timeout http-request 300ms\n\n\
         frontend fe_main\n    bind 127.0.0.1:{port}\n    use_backend be_hang_up if {{ path /hang-up }}\n    \
         use_backend be_reset if {{ path /reset }}\n    \
         use_backend be_cut if {{ path /cut }}\n    default_backend be_app\n\n\
         backend be_app\n    server s0 {backend}\n\n\
         backend be_hang_up\n    server s0 {hang_up}\n\n\
         backend be_reset\n    server s0 {reset}\n\n\
         backend be_cut\n    server s0 {cut}\n"
    )
}

/// `... haproxy[1]: 127.0.0.1:PORT [date] fe be/srv TR/Tw/Tc/Tr/Ta STATUS BYTES - - sH-- ...`.
fn parse_httplog(line: &str) -> Option<(u16, String)> {
    let fields: Vec<&str> = line.split(' ').filter(|f| !f.is_empty()).collect();
    let port = fields.iter().find_map(|f| f.strip_prefix("127.0.0.1:")?.parse().ok())?;
    let timers = fields.iter().position(|f| {
        f.split('/').count() == 5 && f.split('/').all(|p| p.trim_start_matches(['+', '-']).parse::<u64>().is_ok())
    })?;
    let state = fields.get(timers + 5)?;
    Some((port, state.get(..2)?.to_owned()))
}

/// Sends `bytes` on a connection of its own and reads the answer to the end; returns the port.
fn exchange(front: SocketAddr, bytes: &[u8]) -> u16 {
    let mut conn = Conn::connect(front).expect("connect");
    let port = conn.local_port().expect("port");
    let _ = conn.send_raw(bytes);
    let mut stream = conn.into_stream();
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    port
}

/// Asks for a large response, reads a little of it, and goes away.
fn leave_during_the_response(front: SocketAddr) -> u16 {
    let mut conn = Conn::connect(front).expect("connect");
    let port = conn.local_port().expect("port");
    conn.send_raw(b"GET /big/50000000 HTTP/1.1\r\nHost: x\r\n\r\n").expect("send");
    let mut stream = conn.into_stream();
    let mut some = [0u8; 4096];
    stream.read_exact(&mut some).expect("the response starts");
    drop(stream);
    port
}

fn check_version(version: Version) {
    let log = Syslog::bind();
    let servers = Servers {
        hang_up: raw_server(|_| {}),
        reset: raw_server(reset),
        // Part of the body, then (once HAProxy has read it) the end of stream.
        cut: raw_server(|s| {
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789");
            std::thread::sleep(Duration::from_millis(50));
        }),
    };
    let stack = Stack::with_config_on(version, |port, backend| config(port, backend, log.addr, &servers), &[]);
    let front = stack.front;
    let cases = [
        ("--", exchange(front, b"GET /term/normal HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")),
        ("sH", exchange(front, b"GET /term/slow HTTP/1.1\r\nHost: x\r\nx-delay-ms: 600\r\n\r\n")),
        ("SH", exchange(front, b"GET /hang-up HTTP/1.1\r\nHost: x\r\n\r\n")),
        ("SH", exchange(front, b"GET /reset HTTP/1.1\r\nHost: x\r\n\r\n")),
        ("SD", exchange(front, b"GET /cut HTTP/1.1\r\nHost: x\r\n\r\n")),
        ("cR", exchange(front, b"GET /term/half HTTP/1.1\r\nHost")),
        ("PR", exchange(front, b"G(ET / HTTP/1.1\r\n\r\n")),
        ("CD", leave_during_the_response(front)),
    ];
    let ports: Vec<u16> = cases.iter().map(|(_, port)| *port).collect();
    let logged = log.collect(&ports, parse_httplog);
    let server_of = |spans: &[otlp::Received], port: u16| {
        spans.iter().find(|s| s.is_server() && s.int_attr("network.peer.port") == Some(i64::from(port))).cloned()
    };
    let spans = wait_for(Duration::from_secs(20), || {
        let spans = stack.receiver.spans();
        ports.iter().all(|p| server_of(&spans, *p).is_some()).then_some(spans)
    })
    .unwrap_or_else(|| stack.receiver.spans());
    let mut wrong = Vec::new();
    for (expected, port) in cases {
        let theirs = logged.get(&port).map(String::as_str);
        let span = server_of(&spans, port);
        let ours = span.as_ref().and_then(|s| s.str_attr("haproxy.termination_state"));
        if theirs != Some(expected) || ours != Some(expected) {
            wrong.push(format!("{expected}: haproxy {theirs:?}, tracetap {ours:?}"));
        }
        if let (Some(span), "SH" | "SD") = (&span, expected) {
            // The CLIENT span ends where HAProxy saw the hang-up, inside its parent.
            let client = spans.iter().find(|c| c.is_client() && c.span.parent_span_id == span.span.span_id);
            let inside = client.is_some_and(|c| c.span.end_time_unix_nano <= span.span.end_time_unix_nano);
            if !inside {
                wrong.push(format!("{expected}: CLIENT span {client:?} not inside {:?}", span.span));
            }
        }
    }
    assert!(wrong.is_empty(), "{version:?}: termination states differ from HAProxy's log:\n{}", wrong.join("\n"));
}

#[test]
fn termination_states_match_haproxys_log_on_2_6_and_3_0() {
    if !require_root() {
        return;
    }
    for version in haproxy::versions() {
        check_version(version);
    }
}

#[test]
fn httplog_lines_parse() {
    let line = "<134>Dec  6 12:00:00 haproxy[42]: 127.0.0.1:5000 [06/Dec/2026:12:00:00.123] fe_main be_app/s0 0/0/0/-1/302 504 198 - - sH-- 1/1/0/0/0 0/0 \"GET /t HTTP/1.1\"";
    assert_eq!(parse_httplog(line), Some((5000, "sH".to_owned())));
    let bad = "<134>x haproxy[1]: 127.0.0.1:6 [d] fe_main fe_main/<NOSRV> -1/-1/-1/-1/0 400 0 - - PR-- 1/1/0/0/0 0/0 \"<BADREQ>\"";
    assert_eq!(parse_httplog(bad), Some((6, "PR".to_owned())));
}

//! The edge as deployed: TLS-terminating and HTTP/2 frontends, and TLS towards servers, against a
//! real `HAProxy` (both versions where the case allows), with real clients (`h2load` for
//! concurrent streams, `curl`, a raw HTTP/2 client for resets). The requests of a run are
//! identical (same method and target); the backend gives concurrent ones different statuses
//! (`x-want-status: cycle`), so a CLIENT span put under the wrong SERVER span shows (see
//! `tracetap_tests::linking::accuracy`).

use std::net::SocketAddr;
use std::time::Duration;

use tracetap_tests::agent::Agent;
use tracetap_tests::h2client::{CANCEL, H2Conn};
use tracetap_tests::haproxy::Haproxy;
use tracetap_tests::haproxy::{self, Version};
use tracetap_tests::linking::{self, Accuracy};
use tracetap_tests::otlp::Received;
use tracetap_tests::{KillOnDrop, Rig, Stack, free_port, h2load, require_root, tls, wait_for};

/// `error.type` of a stream the client reset with CANCEL.
const RESET_CANCEL: &str = "http2.rst_stream.CANCEL";

/// The backend picks each response's status and delay (see `tracetap_tests::backend`).
const CYCLE: [&str; 4] = ["-H", "x-want-status: cycle", "-H", "x-delay-ms: random"];

fn config(frontend_bind: &str, global: &str, frontend_lines: &str, backend: SocketAddr) -> String {
    config_with_backend(frontend_bind, global, frontend_lines, "", "", backend)
}

/// [`config`] with lines for `backend be_app` and options for its server line.
fn config_with_backend(
    frontend_bind: &str,
    global: &str,
    frontend_lines: &str,
    backend_lines: &str,
    server_options: &str,
    backend: SocketAddr,
) -> String {
    format!(
        "global\n    maxconn 4096\n{global}\ndefaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n\n\
         frontend fe_main\n    bind {frontend_bind}\n{frontend_lines}    default_backend be_app\n\n\
         backend be_app\n{backend_lines}    server s0 {backend} {server_options}\n"
    )
}

/// Waits until `n` SERVER spans with `path` arrived (60 s at most, for liveness), then half a
/// second for stragglers.
fn spans_after(stack: &Stack, path: &str, n: usize) -> Vec<Received> {
    let count =
        |spans: &[Received]| spans.iter().filter(|s| s.is_server() && s.str_attr("url.path") == Some(path)).count();
    let _ = wait_for(Duration::from_mins(1), || (count(&stack.receiver.spans()) >= n).then_some(()));
    std::thread::sleep(Duration::from_millis(500));
    stack.receiver.spans()
}

/// Sends `n` identical requests (`GET /same`, the backend choosing statuses) through `stack` with
/// `h2load` (`options`, then `-n`), asserts every one was answered, and returns the spans once
/// `hops` SERVER spans per request arrived.
fn load_identical(label: &str, stack: &Stack, scheme: &str, options: &[&str], n: usize, hops: usize) -> Vec<Received> {
    let url = format!("{scheme}://127.0.0.1:{}/same", stack.front.port());
    let count = n.to_string();
    let out = h2load::run(&[options, &["-n", count.as_str()], &CYCLE, &[url.as_str()]].concat());
    assert_eq!((out.answered(), out.errored), (n, 0), "[{label}] every request answered: {out:?}");
    spans_after(stack, "/same", hops * n)
}

/// Every request traced, every CLIENT span linked right.
fn assert_all_linked(label: &str, acc: &Accuracy, answered: usize, stack: &Stack) {
    println!("[{label}] answered {answered}, {acc:?}");
    let log = || stack.agent.log();
    assert_eq!(acc.server, answered, "[{label}] one SERVER span per request\n{}", log());
    assert_eq!(acc.client, answered, "[{label}] one CLIENT span per backend request\n{}", log());
    assert_eq!(acc.linked_right, answered, "[{label}] every CLIENT span under its own SERVER span: {acc:?}");
    assert_eq!(
        stack.agent.metric("tracetap_events_lost_tls_unbound_total"),
        0,
        "[{label}] no TLS plaintext left unbound"
    );
}

fn assert_server_attrs(label: &str, spans: &[Received], path: &str, scheme: &str, protocol: &str) {
    for s in spans.iter().filter(|s| s.is_server() && s.str_attr("url.path") == Some(path)) {
        assert_eq!(s.str_attr("url.scheme"), Some(scheme), "[{label}] url.scheme");
        assert_eq!(s.str_attr("network.protocol.version"), Some(protocol), "[{label}] network.protocol.version");
    }
}

/// The TLS version is read where the library's layout allows it: OpenSSL 3.0 (Debian 12) does,
/// 3.5 (Debian 13) does not (see docs/traces.md).
fn assert_tls_version(label: &str, version: Version, spans: &[Received], path: &str) {
    for s in spans.iter().filter(|s| s.is_server() && s.str_attr("url.path") == Some(path)) {
        let got = s.str_attr("tls.protocol.version");
        match version {
            Version::Debian12 => assert_eq!(got, Some("1.3"), "[{label}] tls.protocol.version"),
            Version::Debian13 => assert!(got.is_none() || got == Some("1.3"), "[{label}] tls.protocol.version {got:?}"),
        }
    }
}

/// `TRACETAP_TLS_PROBES=auto` (probes on the internal call where the library is recognised, as
/// both Debian builds are) and `entry` (at the functions' entries and returns: what any other
/// build gets), on both versions.
#[test]
fn tls_frontend_with_http1_keep_alive() {
    if !require_root() {
        return;
    }
    for version in haproxy::versions() {
        for probes in ["auto", "entry"] {
            let label = format!("tls http/1.1, {version}, TRACETAP_TLS_PROBES={probes}");
            let pem = tls::certificate(version);
            let mut env = linking::agent_env();
            env.push(("TRACETAP_TLS_PROBES", probes.to_owned()));
            let stack = Stack::with_config_on(
                version,
                |port, backend| config(&format!("127.0.0.1:{port} ssl crt {pem}"), "", "", backend),
                &env,
            );
            let spans = load_identical(&label, &stack, "https", &["--h1", "-c", "4"], 200, 1);
            assert_all_linked(&label, &linking::accuracy(&spans, "/same"), 200, &stack);
            assert_server_attrs(&label, &spans, "/same", "https", "1.1");
            assert_tls_version(&label, version, &spans, "/same");
            assert!(stack.agent.metric("tracetap_tls_processes") >= 1, "[{label}] TLS probes attached");
            // Both functions on their internal call (both Debian builds are recognised), or none.
            let expected = if probes == "auto" { "call_sites=2" } else { "call_sites=0" };
            let log = stack.agent.log();
            // Not a terminal: plain text, without colour sequences around the fields.
            assert!(!log.contains('\u{1b}'), "[{label}] colour sequences in a log written to a file:\n{log}");
            assert!(log.contains(expected), "[{label}] where the probes went, {expected} expected:\n{log}");
        }
    }
}

/// With the TLS probes off, TLS connections are counted as opaque and nothing is traced from them.
#[test]
fn tls_probes_off() {
    if !require_root() {
        return;
    }
    let version = Version::from_env();
    let pem = tls::certificate(version);
    let stack = Stack::with_config_on(
        version,
        |port, backend| config(&format!("127.0.0.1:{port} ssl crt {pem}"), "", "", backend),
        &[("TRACETAP_TLS_PROBES", "off".to_owned())],
    );
    let url = format!("https://127.0.0.1:{}/same", stack.front.port());
    let out = h2load::run(&["--h1", "-n", "50", "-c", "2", url.as_str()]);
    assert_eq!(out.answered(), 50, "{out:?}");
    let opaque = wait_for(Duration::from_secs(10), || {
        (stack.agent.metric("tracetap_opaque_connections_total") >= 2).then_some(())
    });
    assert!(opaque.is_some(), "the TLS connections are counted as opaque\n{}", stack.agent.log());
    std::thread::sleep(Duration::from_secs(1));
    assert!(stack.receiver.spans().iter().all(|s| s.str_attr("url.path") != Some("/same")), "no span from TLS bytes");
    assert_eq!(stack.agent.metric("tracetap_tls_processes"), 0);
}

#[test]
fn h2_over_tls_with_concurrent_streams_and_a_rewrite() {
    if !require_root() {
        return;
    }
    for version in haproxy::versions() {
        let label = format!("h2 over TLS (ALPN), nbthread 4, set-path, {version}");
        let pem = tls::certificate(version);
        let stack = Stack::with_config_on(
            version,
            |port, backend| {
                config(
                    &format!("127.0.0.1:{port} ssl crt {pem} alpn h2,http/1.1"),
                    "    nbthread 4\n",
                    "    http-request set-path /rewritten\n",
                    backend,
                )
            },
            &linking::agent_env(),
        );
        let spans = load_identical(&label, &stack, "https", &["-c", "4", "-m", "10"], 1000, 1);
        assert_all_linked(&label, &linking::accuracy(&spans, "/same"), 1000, &stack);
        assert_server_attrs(&label, &spans, "/same", "https", "2");
        assert_tls_version(&label, version, &spans, "/same");
        let rewritten = spans.iter().filter(|s| s.is_client() && s.str_attr("url.path") == Some("/rewritten")).count();
        assert_eq!(rewritten, 1000, "[{label}] CLIENT spans show the rewritten path");
        // And one request from curl, as a browser-like client would send it.
        let curl = std::process::Command::new("curl")
            .args(["-sk", "--http2", "-o", "/dev/null", "-w", "%{http_version}"])
            .arg(format!("https://127.0.0.1:{}/from-curl?x=1", stack.front.port()))
            .output()
            .expect("curl (make setup installs it)");
        assert_eq!(String::from_utf8_lossy(&curl.stdout), "2", "[{label}] curl spoke HTTP/2");
        let spans = stack.spans_for(&["/from-curl"]);
        let (server, clients) = Stack::trace_of(&spans, "/from-curl");
        assert_eq!(server.str_attr("url.query"), Some("x=1"), "[{label}]");
        assert_eq!(server.str_attr("network.protocol.version"), Some("2"), "[{label}]");
        assert_eq!(server.str_attr("user_agent.original").map(|u| u.starts_with("curl/")), Some(true), "[{label}]");
        assert_eq!(clients.len(), 1, "[{label}] curl's request has its CLIENT span");
    }
}

#[test]
fn h2c_prior_knowledge() {
    if !require_root() {
        return;
    }
    for version in haproxy::versions() {
        let label = format!("h2c, {version}");
        let stack = Stack::with_config_on(
            version,
            |port, backend| config(&format!("127.0.0.1:{port} proto h2"), "", "", backend),
            &linking::agent_env(),
        );
        let spans = load_identical(&label, &stack, "http", &["-c", "4", "-m", "10"], 1000, 1);
        assert_all_linked(&label, &linking::accuracy(&spans, "/same"), 1000, &stack);
        assert_server_attrs(&label, &spans, "/same", "http", "2");
    }
}

/// The linking scenarios of the fidelity work, over HTTP/2: identical concurrent streams while
/// server connections are never reused, always reused, or requests wait in a server queue, with
/// 1 or 4 threads. Each CLIENT span must be under the stream that caused it.
#[test]
fn h2_linking_scenarios() {
    if !require_root() {
        return;
    }
    let scenarios: [(&str, &str, &str, &str); 4] = [
        ("http-reuse never, nbthread 4", "    nbthread 4\n", "    http-reuse never\n", ""),
        ("http-reuse always, nbthread 4", "    nbthread 4\n", "    http-reuse always\n", ""),
        ("server maxconn 3 (a queue), nbthread 1", "    nbthread 1\n", "", "maxconn 3"),
        ("http-reuse safe, nbthread 1", "    nbthread 1\n", "    http-reuse safe\n", ""),
    ];
    for (name, global, backend_lines, server_options) in scenarios {
        let label = format!("h2c, {name}");
        let stack = Stack::with_config_on(
            Version::from_env(),
            |port, backend| {
                config_with_backend(
                    &format!("127.0.0.1:{port} proto h2"),
                    global,
                    "",
                    backend_lines,
                    server_options,
                    backend,
                )
            },
            &linking::agent_env(),
        );
        let spans = load_identical(&label, &stack, "http", &["-c", "4", "-m", "10"], 1000, 1);
        assert_all_linked(&label, &linking::accuracy(&spans, "/same"), 1000, &stack);
    }
}

#[test]
fn tls_towards_the_server() {
    if !require_root() {
        return;
    }
    tls_hop("tls towards the server", "", "");
}

/// As [`tls_towards_the_server`], with a PROXY protocol (v1) header before each TLS handshake:
/// `send-proxy` on the server line, `accept-proxy` on the TLS bind. The header is plaintext that
/// begins with upper-case letters, read and written outside any `SSL_*` call, so the probes must
/// not take those connections for cleartext HTTP (`CONN_CLEARTEXT`): they would stop binding them
/// to their TLS calls, and report their ciphertext as plain bytes.
#[test]
fn tls_towards_the_server_after_a_proxy_protocol_header() {
    if !require_root() {
        return;
    }
    tls_hop("tls after a proxy header", "send-proxy", "accept-proxy");
}

/// `fe_main` (cleartext) -> `be_app` -> `server ... ssl <server_options>` -> `listen tls_in` (TLS,
/// `<bind_options>`) -> the backend: identical requests, and every hop's spans, linked right.
fn tls_hop(label: &str, server_options: &str, bind_options: &str) {
    let version = Version::from_env();
    let pem = tls::certificate(version);
    let inner = free_port();
    let stack = Stack::with_config_on(
        version,
        |port, backend| {
            format!(
                "global\n    maxconn 4096\n\ndefaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n\n\
                 frontend fe_main\n    bind 127.0.0.1:{port}\n    default_backend be_app\n\n\
                 backend be_app\n    server tls_hop 127.0.0.1:{inner} ssl verify none {server_options}\n\n\
                 listen tls_in\n    bind 127.0.0.1:{inner} ssl crt {pem} {bind_options}\n    server s0 {backend}\n"
            )
        },
        &linking::agent_env(),
    );
    let n = 200;
    // Two SERVER spans per request (fe_main, tls_in), each with its CLIENT span.
    let spans = load_identical(label, &stack, "http", &["--h1", "-c", "4"], n, 2);
    let acc = linking::accuracy(&spans, "/same");
    println!("[{label}] answered {n}, {acc:?}");
    assert_eq!(acc.server, 2 * n, "[{label}] two SERVER spans per request\n{}", stack.agent.log());
    assert_eq!(acc.client, 2 * n, "[{label}] two CLIENT spans per request");
    assert_eq!(acc.linked_right, acc.client, "[{label}] {acc:?}");
    let tls_clients: Vec<_> =
        spans.iter().filter(|s| s.is_client() && s.int_attr("server.port") == Some(i64::from(inner))).collect();
    assert_eq!(tls_clients.len(), n, "[{label}] CLIENT spans towards the TLS server");
    for c in &tls_clients {
        assert!(c.str_attr("url.full").is_some_and(|u| u.starts_with("https://")), "[{label}] url.full of {c:?}");
    }
    let tls_servers = spans.iter().filter(|s| s.is_server() && s.str_attr("url.scheme") == Some("https")).count();
    assert_eq!(tls_servers, n, "[{label}] the TLS listener's SERVER spans say https");
}

/// `proto h2` on a server line: HAProxy speaks HTTP/2 to the server (here a second section of the
/// same HAProxy, with an HTTP/2 `bind`), so both the CLIENT span of that hop and the SERVER span
/// of the section that receives it come from HTTP/2 streams. The client speaks h2c too: an
/// HTTP/1 client would get the status line without reason phrase HAProxy relays from HTTP/2,
/// which `h2load --h1` counts as a failure.
#[test]
fn h2_towards_the_server() {
    if !require_root() {
        return;
    }
    let inner = free_port();
    let stack = Stack::with_config_on(
        Version::from_env(),
        |port, backend| {
            format!(
                "global\n    maxconn 4096\n\ndefaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n\n\
                 frontend fe_main\n    bind 127.0.0.1:{port} proto h2\n    default_backend be_app\n\n\
                 backend be_app\n    server h2_hop 127.0.0.1:{inner} proto h2\n\n\
                 listen h2_in\n    bind 127.0.0.1:{inner} proto h2\n    server s0 {backend}\n"
            )
        },
        &linking::agent_env(),
    );
    let n = 400;
    let spans = load_identical("h2 towards the server", &stack, "http", &["-c", "4", "-m", "10"], n, 2);
    let acc = linking::accuracy(&spans, "/same");
    println!("[h2 towards the server] answered {n}, {acc:?}");
    assert_eq!(acc.server, 2 * n, "two SERVER spans per request\n{}", stack.agent.log());
    assert_eq!(acc.client, 2 * n, "two CLIENT spans per request");
    assert_eq!(acc.linked_right, acc.client, "{acc:?}");
    let h2_clients = spans
        .iter()
        .filter(|s| s.is_client() && s.int_attr("server.port") == Some(i64::from(inner)))
        .filter(|s| s.str_attr("network.protocol.version") == Some("2"))
        .count();
    assert_eq!(h2_clients, n, "the CLIENT spans of the HTTP/2 hop say version 2");
    let h2_servers =
        spans.iter().filter(|s| s.is_server() && s.str_attr("network.protocol.version") == Some("2")).count();
    assert_eq!(h2_servers, 2 * n, "every SERVER span says version 2");
}

#[test]
fn a_client_that_resets_streams() {
    if !require_root() {
        return;
    }
    let stack = Stack::with_config_on(
        Version::from_env(),
        |port, backend| config(&format!("127.0.0.1:{port} proto h2"), "", "", backend),
        &[],
    );
    let mut conn = H2Conn::connect(stack.front).expect("connect");
    let authority = format!("127.0.0.1:{}", stack.front.port());
    // Stream 1 asks for a slow answer and gives up on it; stream 3 is answered; 5 is reset too.
    conn.request(1, "GET", "/slow/1500", &authority).expect("request 1");
    std::thread::sleep(Duration::from_millis(200));
    conn.reset(1, CANCEL).expect("reset 1");
    conn.request(3, "GET", "/answered", &authority).expect("request 3");
    conn.read_until_end(3).expect("response 3");
    conn.request(5, "GET", "/slow/1000", &authority).expect("request 5");
    std::thread::sleep(Duration::from_millis(200));
    conn.reset(5, CANCEL).expect("reset 5");
    conn.go_away(5, 0).expect("goaway");
    drop(conn);
    let spans = stack.spans_for(&["/slow/1500", "/answered", "/slow/1000"]);
    let server = |path: &str| {
        spans.iter().find(|s| s.is_server() && s.str_attr("url.path") == Some(path)).expect("SERVER span").clone()
    };
    for path in ["/slow/1500", "/slow/1000"] {
        let span = server(path);
        assert!(span.is_error(), "{path}: a reset stream is an error");
        assert_eq!(span.str_attr("error.type"), Some(RESET_CANCEL), "{path}");
        assert_eq!(span.str_attr("network.protocol.version"), Some("2"));
    }
    let answered = server("/answered");
    assert!(!answered.is_error(), "the stream between them is answered: {answered:?}");
    assert_eq!(answered.int_attr("http.response.status_code"), Some(200));
    assert!(stack.agent.metric("tracetap_h2_resets_total") >= 2, "the client's two resets");
    assert!(stack.agent.metric("tracetap_h2_goaways_total") >= 1, "the client's GOAWAY is seen");
}

/// An HTTP/2 connection opened before the agent started: its HPACK state (built from header
/// blocks the agent never saw) is unknown, so its later streams must not be decoded at all,
/// while a connection opened afterwards is traced.
#[test]
fn an_h2_connection_older_than_the_agent_is_never_decoded() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let port = free_port();
    let front = SocketAddr::from(([127, 0, 0, 1], port));
    let _haproxy =
        Haproxy::start(&rig.comm, &config(&format!("127.0.0.1:{port} proto h2"), "", "", rig.backend.addr), port);
    let authority = format!("127.0.0.1:{port}");
    let mut old = H2Conn::connect(front).expect("connect");
    // Fills both sides' dynamic tables: later blocks refer to these entries by index.
    old.request(1, "GET", "/before-the-agent", &authority).expect("request");
    old.read_until_end(1).expect("response");
    let agent = Agent::start(&rig.agent_env());
    for stream in [3, 5, 7] {
        old.request(stream, "GET", "/old-connection", &authority).expect("request");
        old.read_until_end(stream).expect("response");
    }
    let mut new = H2Conn::connect(front).expect("connect");
    new.request(1, "GET", "/new-connection", &authority).expect("request");
    new.read_until_end(1).expect("response");
    let arrived = wait_for(Duration::from_secs(20), || {
        let spans = rig.receiver.spans();
        spans.iter().any(|s| s.is_server() && s.str_attr("url.path") == Some("/new-connection")).then_some(spans)
    });
    let spans = arrived.unwrap_or_else(|| panic!("the new connection is traced\n{}", agent.log()));
    std::thread::sleep(Duration::from_millis(500));
    let spans: Vec<_> = rig.receiver.spans().into_iter().chain(spans).collect();
    let paths: Vec<_> = spans.iter().filter(|s| s.is_server()).filter_map(|s| s.str_attr("url.path")).collect();
    assert!(paths.iter().all(|p| *p == "/new-connection"), "only the new connection's stream is traced: {paths:?}");
    assert!(agent.metric("tracetap_unknown_descriptors_total") >= 1, "the old connection is counted");
    assert_eq!(agent.metric("tracetap_h2_connections_total"), 1, "one HTTP/2 connection decoded");
}

/// A TLS connection opened before the agent started: the probes never saw it open, so they have
/// no identity to bind its plaintext to. Its requests are counted (plaintext unbound, ciphertext
/// an unknown descriptor), never traced from guesses; a connection opened afterwards is traced.
#[test]
fn a_tls_connection_older_than_the_agent_is_counted_not_guessed() {
    use std::io::{Read as _, Write as _};
    if !require_root() {
        return;
    }
    let version = Version::from_env();
    let rig = Rig::new();
    let port = free_port();
    let pem = tls::certificate(version);
    let _haproxy = Haproxy::start_on(
        version,
        &rig.comm,
        &config(&format!("127.0.0.1:{port} ssl crt {pem}"), "", "", rig.backend.addr),
        port,
    );
    let mut client = KillOnDrop(
        std::process::Command::new("openssl")
            .args(["s_client", "-quiet", "-connect"])
            .arg(format!("127.0.0.1:{port}"))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("openssl s_client (make setup installs openssl)"),
    );
    let exchange = |client: &mut KillOnDrop, path: &str| {
        let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n");
        client.0.stdin.as_mut().expect("stdin").write_all(request.as_bytes()).expect("write");
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !got.windows(6).any(|w| w == b"\r\n\r\nok") {
            let n = client.0.stdout.as_mut().expect("stdout").read(&mut buf).expect("read");
            assert!(n > 0, "s_client closed");
            got.extend_from_slice(&buf[..n]);
        }
    };
    exchange(&mut client, "/before-the-agent");
    let agent = Agent::start(&rig.agent_env());
    for _ in 0..3 {
        exchange(&mut client, "/old-connection");
    }
    let curl = std::process::Command::new("curl")
        .args(["-sk", "-o", "/dev/null"])
        .arg(format!("https://127.0.0.1:{port}/new-connection"))
        .status()
        .expect("curl");
    assert!(curl.success());
    let arrived = wait_for(Duration::from_secs(20), || {
        let spans = rig.receiver.spans();
        spans.iter().any(|s| s.is_server() && s.str_attr("url.path") == Some("/new-connection")).then_some(())
    });
    assert!(arrived.is_some(), "the new connection is traced\n{}", agent.log());
    std::thread::sleep(Duration::from_millis(500));
    let spans = rig.receiver.spans();
    let paths: Vec<_> = spans.iter().filter(|s| s.is_server()).filter_map(|s| s.str_attr("url.path")).collect();
    assert_eq!(paths, ["/new-connection"], "only the new connection is traced");
    assert!(agent.metric("tracetap_events_lost_tls_unbound_total") >= 3, "the old connection's plaintext is counted");
    assert!(agent.metric("tracetap_unknown_descriptors_total") >= 1, "its ciphertext too");
}

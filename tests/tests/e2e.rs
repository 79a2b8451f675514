//! End-to-end: real `HAProxy`, real backend, real `tracetap` (eBPF), OTLP receiver.
//! Every test here needs root (see `require_root`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use tracetap_tests::agent::Agent;
use tracetap_tests::client::Conn;
use tracetap_tests::haproxy::{self, Haproxy};
use tracetap_tests::otlp::Received;
use tracetap_tests::{Rig, Stack, free_port, require_root, wait_for};

fn setup(extra: &str) -> Stack {
    Stack::start(extra, &[])
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = std::fmt::Write::write_fmt(&mut s, format_args!("{b:02x}"));
        s
    })
}

fn traceparent(i: u32) -> (String, String, String) {
    let trace = format!("{:032x}", 0x4bf9_2f35_77b3_4da6_a3ce_0000_0000_0000_u128 + u128::from(i) + 1);
    let parent = format!("{:016x}", 0x00f0_67aa_0ba9_0000_u64 + u64::from(i) + 1);
    (format!("00-{trace}-{parent}-01"), trace, parent)
}

fn print_figures(name: &str, sent: usize, spans: &[Received], agent: &Agent) {
    println!(
        "[{name}] requests sent: {sent}, spans received: {} ({} SERVER, {} CLIENT), events captured: {}, events lost (ring full): {}, parse errors: {}",
        spans.len(),
        spans.iter().filter(|s| s.is_server()).count(),
        spans.iter().filter(|s| s.is_client()).count(),
        agent.metric("tracetap_events_captured_total"),
        agent.metric("tracetap_events_lost_ring_full_total"),
        agent.metric("tracetap_parse_errors_total"),
    );
}

/// Pairs each SERVER span with its CLIENT spans.
fn children(spans: &[Received]) -> HashMap<Vec<u8>, Vec<&Received>> {
    let mut map: HashMap<Vec<u8>, Vec<&Received>> = HashMap::new();
    for s in spans.iter().filter(|s| s.is_client()) {
        map.entry(s.span.parent_span_id.clone()).or_default().push(s);
    }
    map
}

#[test]
fn keep_alive_requests_become_server_and_client_spans() {
    if !require_root() {
        return;
    }
    let s = setup("");
    let mut expected_parents = HashMap::new();
    for c in 0..10u32 {
        let mut conn = Conn::connect(s.front).expect("connect");
        for r in 0..20u32 {
            let i = c * 20 + r;
            let path = format!("/item/{i}?q={i}");
            let resp = if i % 2 == 0 {
                let (tp, trace, parent) = traceparent(i);
                expected_parents.insert(format!("/item/{i}"), (trace, parent));
                conn.get(&path, &[("traceparent", &tp)])
            } else {
                conn.get(&path, &[])
            }
            .expect("request");
            assert_eq!(resp.status, 200);
        }
    }
    let spans = s.receiver.wait_for_spans(400);
    print_figures("keep-alive", 200, &spans, &s.agent);
    let servers: Vec<_> = spans.iter().filter(|s| s.is_server()).collect();
    let clients: Vec<_> = spans.iter().filter(|s| s.is_client()).collect();
    assert_eq!(servers.len(), 200, "one SERVER span per request");
    assert_eq!(clients.len(), 200, "one CLIENT span per backend request");
    assert_eq!(s.agent.metric("tracetap_events_lost_ring_full_total"), 0);

    let by_parent = children(&spans);
    for server in &servers {
        let path = server.str_attr("url.path").expect("url.path");
        assert_eq!(server.str_attr("http.request.method"), Some("GET"));
        assert_eq!(server.span.name, "GET fe_main", "named after HAProxy's frontend");
        assert_eq!(server.str_attr("haproxy.frontend"), Some("fe_main"));
        assert_eq!(server.int_attr("http.response.status_code"), Some(200));
        assert_eq!(server.str_attr("url.query"), Some(&path["/item/".len()..]).map(|n| format!("q={n}")).as_deref());
        assert_eq!(server.str_attr("server.address"), Some("tracetap.test"));
        assert_eq!(server.str_attr("client.address"), Some("127.0.0.1"));
        assert_eq!(server.str_attr("user_agent.original"), Some("tracetap-e2e"));
        assert_eq!(server.service, "haproxy");
        assert_eq!(server.pid, i64::from(s.haproxy.pid()));
        assert!(!server.is_error());
        match expected_parents.get(path) {
            Some((trace, parent)) => {
                assert_eq!(&hex(&server.span.trace_id), trace, "trace id preserved for {path}");
                assert_eq!(&hex(&server.span.parent_span_id), parent, "parent id preserved for {path}");
            }
            None => assert!(server.span.parent_span_id.is_empty(), "a request without traceparent starts a trace"),
        }
        let kids = by_parent.get(&server.span.span_id).unwrap_or_else(|| panic!("no CLIENT span under {path}"));
        assert_eq!(kids.len(), 1);
        let client = kids[0];
        assert_eq!(client.span.trace_id, server.span.trace_id);
        assert_eq!(client.str_attr("url.path"), Some(path));
        assert_eq!(client.int_attr("server.port"), Some(i64::from(s.backend.addr.port())));
        assert_eq!(client.int_attr("http.response.status_code"), Some(200));
        assert_eq!(client.span.name, "GET be_app", "named after HAProxy's backend");
        assert_eq!(client.str_attr("haproxy.backend"), Some("be_app"));
        assert_eq!(client.str_attr("haproxy.server"), Some("s0"));
        let (ss, se) = (server.span.start_time_unix_nano, server.span.end_time_unix_nano);
        let (cs, ce) = (client.span.start_time_unix_nano, client.span.end_time_unix_nano);
        assert!(ss <= cs && cs <= ce && ce <= se, "CLIENT [{cs},{ce}] inside SERVER [{ss},{se}] for {path}");
        assert!(se - ss < 5_000_000_000, "SERVER duration plausible");
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        assert!(ss < now && now - ss < 120_000_000_000, "start time is wall-clock time");
    }
}

#[test]
fn concurrent_connections_link_each_client_span_to_its_request() {
    if !require_root() {
        return;
    }
    let s = setup("");
    let front = s.front;
    let workers: Vec<_> = (0..16)
        .map(|c| {
            std::thread::spawn(move || {
                let mut conn = Conn::connect(front).expect("connect");
                for r in 0..50 {
                    let resp = conn.get(&format!("/c{c}/r{r}"), &[]).expect("request");
                    assert_eq!(resp.status, 200);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker");
    }
    let spans = s.receiver.wait_for_spans(1600);
    print_figures("concurrent", 800, &spans, &s.agent);
    let servers: Vec<_> = spans.iter().filter(|s| s.is_server()).collect();
    assert_eq!(servers.len(), 800);
    let by_parent = children(&spans);
    for server in servers {
        let kids = by_parent.get(&server.span.span_id).expect("CLIENT span under every SERVER span");
        assert_eq!(kids.len(), 1);
        assert_eq!(
            kids[0].str_attr("url.path"),
            server.str_attr("url.path"),
            "CLIENT span under the SERVER span of the same request"
        );
    }
}

#[test]
fn errors_are_visible_in_spans() {
    if !require_root() {
        return;
    }
    // Port 1: below the ephemeral range the tests' servers bind in, so no other test can take it
    // meanwhile (a port from `free_port` was once taken by a parallel test's OTLP receiver).
    let dead = SocketAddr::from(([127, 0, 0, 1], 1));
    assert!(std::net::TcpStream::connect(dead).is_err(), "nothing listens on {dead}");
    let s = setup(&format!(
        "\nbackend be_dead\n    server dead {dead}\n\nfrontend fe_dead\n    bind 127.0.0.1:{}\n    default_backend be_dead\n",
        free_port()
    ));
    // Backend answers 503.
    let mut conn = Conn::connect(s.front).expect("connect");
    assert_eq!(conn.get("/status/503", &[]).unwrap().status, 503);
    // The client gives up in the middle of its request: 10 of 1000 body bytes, then close.
    let mut aborting = Conn::connect(s.front).expect("connect");
    aborting
        .send_raw(b"POST /upload HTTP/1.1\r\nHost: tracetap.test\r\nContent-Length: 1000\r\n\r\n0123456789")
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    drop(aborting);
    // HAProxy answers 503 itself: no server up.
    let dead_front = frontend_port(&s, "fe_dead");
    let mut conn2 = Conn::connect(dead_front).expect("connect");
    assert_eq!(conn2.get("/nobody-home", &[]).unwrap().status, 503);

    let wanted = ["/status/503", "/upload", "/nobody-home"];
    let spans = wait_for(Duration::from_secs(20), || {
        let all = s.receiver.spans();
        wanted.iter().all(|p| all.iter().any(|x| x.is_server() && x.str_attr("url.path") == Some(p))).then_some(all)
    })
    .unwrap_or_else(|| s.receiver.spans());
    print_figures("errors", 3, &spans, &s.agent);
    let server = |path: &str| {
        spans
            .iter()
            .find(|x| x.is_server() && x.str_attr("url.path") == Some(path))
            .unwrap_or_else(|| panic!("SERVER span for {path}"))
    };
    let s503 = server("/status/503");
    assert_eq!(s503.int_attr("http.response.status_code"), Some(503));
    assert!(s503.is_error());
    assert_eq!(s503.str_attr("error.type"), Some("503"));
    let c503 = spans
        .iter()
        .find(|x| x.is_client() && x.span.parent_span_id == s503.span.span_id)
        .expect("CLIENT span of the 503");
    assert!(c503.is_error());

    let aborted = server("/upload");
    assert!(aborted.is_error(), "an aborted exchange is an error: {aborted:?}");
    assert!(
        aborted.str_attr("error.type").is_some_and(|e| e.starts_with("connection_closed")),
        "{:?}",
        aborted.str_attr("error.type")
    );

    let nobody = server("/nobody-home");
    assert_eq!(nobody.int_attr("http.response.status_code"), Some(503));
    assert!(nobody.is_error());

    // The agent is alive and holds no state for finished connections.
    let mut agent = s.agent;
    assert!(agent.is_running());
    drop((conn, conn2));
    let settled = wait_for(Duration::from_secs(15), || (agent.metric("tracetap_open_exchanges") == 0).then_some(()));
    assert!(settled.is_some(), "open exchanges drain to 0, got {}", agent.metric("tracetap_open_exchanges"));
    assert!(agent.stop().success(), "agent exits cleanly on SIGTERM");
}

/// The port of a `bind 127.0.0.1:PORT` line that follows `frontend NAME` in the config.
fn frontend_port(stack: &Stack, frontend: &str) -> SocketAddr {
    let cfg = stack.haproxy.config_text();
    let after = cfg.split(&format!("frontend {frontend}\n")).nth(1).expect("frontend in config");
    let port: u16 = after
        .split("bind 127.0.0.1:")
        .nth(1)
        .and_then(|r| r.lines().next())
        .and_then(|p| p.trim().parse().ok())
        .expect("port");
    SocketAddr::from(([127, 0, 0, 1], port))
}

#[test]
fn haproxy_started_after_the_agent_and_reloaded_is_traced() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let (receiver, backend, comm) = (&rig.receiver, rig.backend, rig.comm.clone());
    let mut agent = Agent::start_without_targets(&rig.agent_env());
    // Not ready: nothing to trace yet.
    assert_eq!(agent.get("/readyz").map(|r| r.0), Some(503), "not ready without a target");

    let port = free_port();
    let mut haproxy = Haproxy::start(&comm, &haproxy::config(port, &[backend.addr], ""), port);
    let ready = wait_for(Duration::from_secs(5), || (agent.get("/readyz").map(|r| r.0) == Some(200)).then_some(()));
    assert!(ready.is_some(), "ready once HAProxy runs");
    let front = SocketAddr::from(([127, 0, 0, 1], port));
    let first_pid = haproxy.pid();
    for i in 0..5 {
        Conn::connect(front).unwrap().get(&format!("/before/{i}"), &[]).unwrap();
    }
    haproxy.reload(port);
    let second_pid = haproxy.pid();
    // The new worker is traced within a second of starting.
    std::thread::sleep(Duration::from_secs(1));
    for i in 0..5 {
        let resp = Conn::connect(front).unwrap().get(&format!("/after/{i}"), &[]).unwrap();
        assert_eq!(resp.status, 200);
    }
    let spans = receiver.wait_for_spans(20);
    print_figures("reload", 10, &spans, &agent);
    let servers: Vec<_> = spans.iter().filter(|s| s.is_server()).collect();
    let before = servers.iter().filter(|s| s.str_attr("url.path").is_some_and(|p| p.starts_with("/before/"))).count();
    let after: Vec<_> =
        servers.iter().filter(|s| s.str_attr("url.path").is_some_and(|p| p.starts_with("/after/"))).collect();
    assert_eq!(before, 5);
    assert_eq!(after.len(), 5);
    assert_eq!(servers.len(), 10, "the port checks of the harness (connect, close) are not requests");
    assert!(
        after.iter().all(|s| s.pid == i64::from(second_pid)),
        "requests after the reload are served by the new process"
    );
    assert_ne!(first_pid, second_pid);
    assert!(agent.is_running());
}

#[test]
fn ratio_sampling_is_consistent_and_carries_the_threshold() {
    if !require_root() {
        return;
    }
    let s = Stack::start(
        "",
        &[("OTEL_TRACES_SAMPLER", "traceidratio".to_owned()), ("OTEL_TRACES_SAMPLER_ARG", "0.5".to_owned())],
    );
    let mut conn = Conn::connect(s.front).expect("connect");
    // The lowest 56 bits of the trace id decide: at ratio 0.5, kept when bit 55 is set.
    let kept_ids: Vec<String> =
        (0..10).map(|i| format!("{:016x}{:016x}", 0xabcd_u64 + i, 0x00f0_0000_0000_0000_u64 + i)).collect();
    let dropped_ids: Vec<String> =
        (0..10).map(|i| format!("{:016x}{:016x}", 0xabcd_u64 + i, 0x0010_0000_0000_0000_u64 + i)).collect();
    for (n, id) in kept_ids.iter().chain(&dropped_ids).enumerate() {
        let tp = format!("00-{id}-00f067aa0ba902b7-01");
        assert_eq!(
            conn.get(&format!("/sampled/{n}"), &[("traceparent", &tp), ("tracestate", "vendor=1")]).unwrap().status,
            200
        );
    }
    let settled = wait_for(Duration::from_secs(20), || {
        (s.agent.metric("tracetap_requests_sampled_total") + s.agent.metric("tracetap_requests_sampled_out_total")
            >= 20)
            .then_some(())
    });
    assert!(settled.is_some());
    let spans = s.receiver.wait_for_spans(20);
    let servers: Vec<_> = spans.iter().filter(|x| x.is_server()).collect();
    let got: std::collections::BTreeSet<String> = servers.iter().map(|x| hex(&x.span.trace_id)).collect();
    assert_eq!(got, kept_ids.iter().cloned().collect(), "exactly the traces whose randomness reaches the threshold");
    for span in &spans {
        assert_eq!(span.span.trace_state, "ot=th:8,vendor=1", "the threshold for ratio 0.5, other vendors kept");
    }
    assert_eq!(s.agent.metric("tracetap_requests_sampled_out_total"), 10);
}

/// BPF programs the process holds a descriptor of (`prog_type:` in its fdinfo).
fn bpf_programs_held(pid: u32) -> usize {
    let dir = std::fs::read_dir(format!("/proc/{pid}/fdinfo")).expect("the agent's fdinfo");
    dir.filter_map(Result::ok)
        .filter(|e| std::fs::read_to_string(e.path()).is_ok_and(|info| info.contains("prog_type:")))
        .count()
}

/// A sampler that keeps no request whatever its context (`always_off`, `traceidratio` at 0) loads
/// no probe at all (issue 32: a sampled-out request then costs HAProxy nothing): the agent holds no
/// BPF program, is ready at once, says why, and requests, sampled parents among them, leave no
/// record and no span. A parent-based sampler keeping nothing of its own still loads them, to
/// follow a sampled parent.
#[test]
fn a_sampler_that_keeps_nothing_loads_no_probe() {
    if !require_root() {
        return;
    }
    let sampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    for sampler in [
        vec![("OTEL_TRACES_SAMPLER", "always_off".to_owned())],
        vec![("OTEL_TRACES_SAMPLER", "traceidratio".to_owned()), ("OTEL_TRACES_SAMPLER_ARG", "0".to_owned())],
    ] {
        let s = Stack::start("", &sampler);
        let mut conn = Conn::connect(s.front).expect("connect");
        for n in 0..5 {
            assert_eq!(conn.get(&format!("/nothing/{n}"), &[("traceparent", sampled)]).unwrap().status, 200);
        }
        let log = s.agent.log();
        assert_eq!(bpf_programs_held(s.agent.pid()), 0, "{sampler:?}: no probe loaded; log:\n{log}");
        assert!(log.contains("keeps no trace: the probes are not loaded"), "{sampler:?}: said why; log:\n{log}");
        assert_eq!(s.agent.metric("tracetap_events_captured_total"), 0, "{sampler:?}");
        assert_eq!(s.agent.metric("tracetap_requests_sampled_out_total"), 0, "{sampler:?}: nothing parsed");
        assert!(s.agent.get("/readyz").is_some_and(|(status, body)| status == 200 && body.contains("keeps no trace")));
        assert!(s.receiver.spans().is_empty(), "{sampler:?}");
    }
    let s = Stack::start("", &[("OTEL_TRACES_SAMPLER", "parentbased_always_off".to_owned())]);
    assert!(bpf_programs_held(s.agent.pid()) > 0, "parentbased_always_off loads the probes");
    let mut conn = Conn::connect(s.front).expect("connect");
    assert_eq!(conn.get("/followed", &[("traceparent", sampled)]).unwrap().status, 200);
    let spans = s.spans_for(&["/followed"]);
    assert!(spans.iter().all(|x| hex(&x.span.trace_id) == "0af7651916cd43dd8448eb211c80319c"));
}

/// The three requests of [`a_dropped_exchange_between_two_kept_ones_leaves_both_paired_right`]:
/// the same path, a sampled, an unsampled and a sampled parent, each asking for its own status.
const BETWEEN: [(&str, &str); 3] = [
    ("201", "00-a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1-00f067aa0ba902b7-01"),
    ("202", "00-b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2-00f067aa0ba902b7-00"),
    ("203", "00-c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3-00f067aa0ba902b7-01"),
];

/// On one keep-alive connection, a request the sampler drops (an unsampled parent) between two it
/// keeps (issue 32): the two kept ones are exported, each SERVER span and its CLIENT span with the
/// status its own request asked for, and the dropped one is not. Over HTTP/1.1 one after another
/// and pipelined in one write, and over HTTP/2 one stream after another and all three at once.
#[test]
fn a_dropped_exchange_between_two_kept_ones_leaves_both_paired_right() {
    if !require_root() {
        return;
    }
    for (h2, all_at_once) in [(false, false), (false, true), (true, false), (true, true)] {
        let bind = if h2 { " proto h2" } else { "" };
        let stack = Stack::with_config(
            |port, backend| {
                format!(
                    "global\n    maxconn 256\n\ndefaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n\n\
                     frontend fe_main\n    bind 127.0.0.1:{port}{bind}\n    default_backend be_app\n\nbackend be_app\n    server s0 {backend}\n"
                )
            },
            &[],
        );
        let case = format!(
            "{} {}",
            if h2 { "HTTP/2" } else { "HTTP/1.1" },
            if all_at_once { "all at once" } else { "in turn" }
        );
        let statuses =
            if h2 { send_between_h2(stack.front, all_at_once) } else { send_between_h1(stack.front, all_at_once) };
        assert_eq!(statuses, [201, 202, 203], "{case}: each request answered with its own status");
        let spans = stack.spans_for(&["/between"]);
        let settled = wait_for(Duration::from_secs(20), || {
            (stack.agent.metric("tracetap_requests_sampled_out_total") >= 1).then_some(())
        });
        assert!(settled.is_some(), "{case}: the unsampled request was seen and dropped");
        // The request is dropped as its head is read, and its backend request with it.
        let at_head = (
            stack.agent.metric("tracetap_requests_sampled_out_at_head_total"),
            stack.agent.metric("tracetap_backend_requests_sampled_out_at_head_total"),
        );
        assert_eq!(at_head, (1, 1), "{case}: dropped at the head");
        // In the probes when it came in a read of its own: an HTTP/1.1 request sent in turn.
        let in_probe = stack.agent.metric("tracetap_requests_sampled_out_in_probe_total");
        assert_eq!(in_probe, u64::from(!h2 && !all_at_once), "{case}: dropped in the probes");
        let spans: Vec<_> = wait_for(Duration::from_secs(20), || {
            let all = stack.receiver.spans();
            (all.iter().filter(|x| x.is_server()).count() >= 2 && all.iter().filter(|x| !x.is_server()).count() >= 2)
                .then_some(all)
        })
        .unwrap_or(spans);
        let mut wrong = Vec::new();
        for (status, traceparent) in BETWEEN {
            let trace = &traceparent[3..35];
            let of_trace: Vec<_> = spans.iter().filter(|x| hex(&x.span.trace_id) == trace).collect();
            let statuses: Vec<_> =
                of_trace.iter().map(|x| (x.is_server(), x.int_attr("http.response.status_code"))).collect();
            let want = if traceparent.ends_with("-01") {
                let code = status.parse().ok();
                vec![(true, code), (false, code)]
            } else {
                Vec::new()
            };
            let mut got = statuses.clone();
            got.sort_by_key(|(server, _)| !server);
            if got != want {
                wrong.push(format!("trace {trace} (asked {status}): spans {statuses:?}, want {want:?}"));
            }
        }
        assert!(wrong.is_empty(), "{case}:\n{}\nagent log:\n{}", wrong.join("\n"), stack.agent.log());
    }
}

/// The [`BETWEEN`] requests on one HTTP/1.1 connection; the statuses answered, in order. They
/// carry a browser's long user agent and a cookie: the probes' head scan takes such values over
/// several words a round, and must still drop the unsampled one.
fn send_between_h1(front: SocketAddr, pipelined: bool) -> Vec<u16> {
    let mut conn = Conn::connect(front).expect("connect");
    let request = |status: &str, traceparent: &str| {
        format!(
            "GET /between HTTP/1.1\r\nHost: tracetap.test\r\n\
             User-Agent: Mozilla/5.0 (X11; Linux x86_64; rv:128.0) Gecko/20100101 Firefox/128.0\r\n\
             Cookie: session=abcdef0123456789abcdef0123456789; theme=dark\r\n\
             x-want-status: {status}\r\ntraceparent: {traceparent}\r\n\r\n"
        )
    };
    if pipelined {
        let all: String = BETWEEN.iter().map(|(s, t)| request(s, t)).collect();
        conn.send_raw(all.as_bytes()).expect("send");
        BETWEEN.iter().map(|_| conn.read_response().expect("response").status).collect()
    } else {
        BETWEEN
            .iter()
            .map(|(s, t)| {
                conn.send_raw(request(s, t).as_bytes()).expect("send");
                conn.read_response().expect("response").status
            })
            .collect()
    }
}

/// The [`BETWEEN`] requests as streams 1, 3 and 5 of one HTTP/2 connection; the statuses answered.
fn send_between_h2(front: SocketAddr, concurrent: bool) -> Vec<u16> {
    let mut conn = tracetap_tests::h2client::H2Conn::connect(front).expect("connect");
    let authority = front.to_string();
    let mut statuses = Vec::new();
    let streams = [1, 3, 5];
    for (stream, (status, traceparent)) in streams.into_iter().zip(BETWEEN) {
        let headers = [("x-want-status", status), ("traceparent", traceparent)];
        conn.request_with(stream, "GET", "/between", &authority, &headers).expect("request");
        if !concurrent {
            statuses.push(h2_status(&mut conn, stream));
        }
    }
    if concurrent {
        let frames = conn.read_until_all_end(&streams).expect("responses");
        statuses = frames.iter().map(|f| status_of(f)).collect();
    }
    statuses
}

/// The `:status` of `stream`'s response.
fn h2_status(conn: &mut tracetap_tests::h2client::H2Conn, stream: u32) -> u16 {
    status_of(&conn.read_until_end(stream).expect("response"))
}

/// The `:status` in a response's HEADERS frame: a block of its own, as HAProxy's encoder writes
/// only static-table references and literals (no dynamic table to carry between blocks).
fn status_of(frames: &[tracetap_tests::h2client::Frame]) -> u16 {
    let mut decoder = loona_hpack::Decoder::new();
    frames
        .iter()
        .filter(|f| f.kind == 1)
        .find_map(|f| {
            let fields = decoder.decode(&f.payload).ok()?;
            fields
                .into_iter()
                .find(|(n, _)| n == b":status")
                .and_then(|(_, v)| std::str::from_utf8(&v).ok()?.parse().ok())
        })
        .expect("a :status")
}

/// Binds and servers given by environment variables (`"${VAR}"`, as container images write them):
/// the agent reads HAProxy's own environment and names the spans as HAProxy does.
#[test]
fn binds_and_servers_given_by_environment_variables_are_named() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let port = free_port();
    let app = rig.backend.addr;
    let config = "global\n    maxconn 256\n\ndefaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n\n\
         frontend fe_env\n    bind \"127.0.0.1:${FE_PORT}\"\n    default_backend be_env\n\n\
         backend be_env\n    server \"${APP_NAME-app1}\" \"${APP_HOST}:$APP_PORT\"\n";
    let env = [("FE_PORT", port.to_string()), ("APP_HOST", app.ip().to_string()), ("APP_PORT", app.port().to_string())];
    let haproxy = Haproxy::start_with_env(&rig.comm, config, port, &env);
    let agent = Agent::start(&rig.agent_env());
    let front = SocketAddr::from(([127, 0, 0, 1], port));
    let mut conn = Conn::connect(front).expect("connect");
    for i in 0..10 {
        assert_eq!(conn.get(&format!("/env/{i}"), &[]).expect("request").status, 200);
    }
    let spans = rig.receiver.wait_for_spans(20);
    let (servers, clients): (Vec<&Received>, Vec<&Received>) = spans.iter().partition(|s| s.is_server());
    assert_eq!((servers.len(), clients.len()), (10, 10), "log:\n{}", agent.log());
    for s in &servers {
        assert_eq!(s.str_attr("haproxy.frontend"), Some("fe_env"), "every SERVER span names its frontend");
    }
    for c in &clients {
        assert_eq!(c.str_attr("haproxy.backend"), Some("be_env"));
        assert_eq!(c.str_attr("haproxy.server"), Some("app1"), "the server's name from its default");
    }
    drop(haproxy);
}

/// Two backends that share one server address, chosen by path (`use_backend be_api if { path_beg
/// /api }`, `default_backend be_web`): a CLIENT span has the names HAProxy used or none, never the
/// other backend's, and the counter agrees. A frontend that reaches only one of them names it.
#[test]
fn backends_sharing_a_server_address_get_the_right_names_or_none() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let (port, web_port) = (free_port(), free_port());
    let app = rig.backend.addr;
    let config = format!(
        "global\n    maxconn 256\n\ndefaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n\n\
         frontend fe_main\n    bind 127.0.0.1:{port}\n    use_backend be_api if {{ path_beg /api }}\n    default_backend be_web\n\n\
         frontend fe_web_only\n    bind 127.0.0.1:{web_port}\n    default_backend be_web\n\n\
         backend be_web\n    server web1 \"127.0.0.1:${{APP_PORT}}\"\n\n\
         backend be_api\n    server api1 {app}\n"
    );
    let haproxy = Haproxy::start_with_env(&rig.comm, &config, port, &[("APP_PORT", app.port().to_string())]);
    let agent = Agent::start(&rig.agent_env());
    let mut main = Conn::connect(SocketAddr::from(([127, 0, 0, 1], port))).expect("connect");
    let mut web_only = Conn::connect(SocketAddr::from(([127, 0, 0, 1], web_port))).expect("connect");
    for i in 0..30 {
        assert_eq!(main.get(&format!("/api/{i}"), &[]).expect("request").status, 200);
        assert_eq!(main.get(&format!("/web/{i}"), &[]).expect("request").status, 200);
        assert_eq!(web_only.get(&format!("/only/{i}"), &[]).expect("request").status, 200);
    }
    let spans = rig.receiver.wait_for_spans(180);
    let clients: Vec<&Received> = spans.iter().filter(|s| !s.is_server()).collect();
    assert_eq!(clients.len(), 90, "log:\n{}", agent.log());
    let (mut unnamed, mut wrong) = (0, Vec::new());
    for c in &clients {
        let path = c.str_attr("url.path").unwrap_or("");
        let want = if path.starts_with("/api") { ("be_api", "api1") } else { ("be_web", "web1") };
        match (c.str_attr("haproxy.backend"), c.str_attr("haproxy.server")) {
            (None, None) => unnamed += 1,
            (Some(be), Some(srv)) if (be, srv) == want => {}
            other => wrong.push((path.to_owned(), other)),
        }
    }
    println!(
        "[names] 90 CLIENT spans through two backends sharing an address: {unnamed} left unnamed, {} wrong",
        wrong.len()
    );
    assert!(wrong.is_empty(), "wrong names: {wrong:?}");
    assert_eq!(agent.metric("tracetap_server_names_ambiguous_total"), unnamed, "the counter agrees");
    let only_named = clients
        .iter()
        .filter(|c| c.str_attr("url.path").is_some_and(|p| p.starts_with("/only")))
        .all(|c| c.str_attr("haproxy.backend") == Some("be_web") && c.str_attr("haproxy.server") == Some("web1"));
    assert!(only_named, "a frontend that reaches one of them names it");
    assert_eq!(unnamed, 60, "fe_main reaches both: its 60 are left unnamed");
    drop(haproxy);
}

//! Names as `HAProxy` has them at run time: servers from its runtime API (`show servers state` on
//! its `stats socket`), hostnames from its root's `/etc/hosts`, `fd@` binds; through
//! a real `HAProxy` (Debian 12's 2.6, and Debian 13's 3.0 in its own root and namespaces). Needs
//! root.
//!
//! The hard case is the one ingress controllers make: `server-template` slots that the
//! configuration gives a placeholder address, filled through the runtime API, and moved to another
//! slot (a pod restart) while traffic flows. A CLIENT span must carry the server `HAProxy` used
//! or no name (counted as ambiguous), never another's.

use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use tracetap_tests::agent::Agent;
use tracetap_tests::client::Conn;
use tracetap_tests::haproxy::{self, Haproxy};
use tracetap_tests::otlp::Received;
use tracetap_tests::{Rig, free_port, require_root, wait_for};

/// One runtime API command, as an operator or a controller sends it; returns the answer.
fn cli(socket: &Path, command: &str) -> String {
    let mut s = UnixStream::connect(socket).unwrap_or_else(|e| panic!("connect {}: {e}", socket.display()));
    s.write_all(format!("{command}\n").as_bytes()).expect("send command");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("read answer");
    answer
}

/// Points a template slot at `addr` and lets traffic in, as the HAProxy Kubernetes Ingress
/// Controller does.
fn fill_slot(socket: &Path, slot: &str, addr: std::net::SocketAddr) {
    let set = cli(socket, &format!("set server default_echo_8080/{slot} addr {} port {}", addr.ip(), addr.port()));
    assert!(!set.contains("No such") && !set.contains("Require"), "set server addr: {set}");
    let ready = cli(socket, &format!("set server default_echo_8080/{slot} state ready"));
    assert!(ready.trim().is_empty(), "set server state ready: {ready}");
}

/// Requests through `front`, one at a time on a keep-alive connection, while the address `app`
/// moves from slot `SRV_2` to `SRV_3`; for each request, the phase before it was sent and after it
/// was answered: 0 while `SRV_2` serves, 2 once the address moved to `SRV_3`, 1 while the commands
/// run.
fn traffic_through_a_move(
    socket: &Path,
    front: std::net::SocketAddr,
    app: std::net::SocketAddr,
    agent: &Agent,
) -> Vec<(u32, u32)> {
    let phase = AtomicU32::new(0);
    let done = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let client = scope.spawn(|| {
            let mut conn = Conn::connect(front).expect("connect");
            let mut phases = Vec::new();
            while !stop.load(SeqCst) {
                let before = phase.load(SeqCst);
                let i = phases.len();
                assert_eq!(conn.get(&format!("/ing/{i}"), &[]).expect("request").status, 200);
                phases.push((before, phase.load(SeqCst)));
                done.fetch_add(1, SeqCst);
                std::thread::sleep(Duration::from_millis(5));
            }
            phases
        });
        let served = |n: usize| wait_for(Duration::from_secs(30), || (done.load(SeqCst) >= n).then_some(()));
        served(80).expect("traffic through SRV_2");
        // Until two tables were read since the fill, so that later requests post-date one.
        let reads = || agent.metric("tracetap_haproxy_runtime_api_reads_total");
        let read_twice = |from: u64| wait_for(Duration::from_secs(30), || (reads() >= from + 2).then_some(()));
        read_twice(reads()).expect("runtime API reads while traffic flows");
        // The pod restarts and comes back in another slot, at the same address.
        phase.store(1, SeqCst);
        fill_slot(socket, "SRV_3", app);
        let maint = cli(socket, "set server default_echo_8080/SRV_2 state maint");
        assert!(maint.trim().is_empty(), "set server state maint: {maint}");
        phase.store(2, SeqCst);
        let moved = done.load(SeqCst);
        served(moved + 80).expect("traffic through SRV_3");
        read_twice(reads()).expect("runtime API reads after the move");
        stop.store(true, SeqCst);
        client.join().expect("client thread")
    })
}

const GLOBAL_AND_DEFAULTS: &str =
    "defaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n\n";

#[test]
fn ingress_slots_filled_and_moved_through_the_runtime_api_are_named() {
    if !require_root() {
        return;
    }
    for version in haproxy::versions() {
        let rig = Rig::new();
        let port = free_port();
        let (inside, host) = haproxy::instance_paths(version, &rig.comm);
        let config = format!(
            "global\n    maxconn 256\n    stats socket {}/admin.sock mode 600 level admin\n\n{GLOBAL_AND_DEFAULTS}\
             frontend fe_ingress\n    bind 127.0.0.1:{port}\n    default_backend default_echo_8080\n\n\
             backend default_echo_8080\n    balance roundrobin\n    server-template SRV_ 4 127.0.0.1:1 disabled\n",
            inside.display()
        );
        let haproxy = Haproxy::start_on(version, &rig.comm, &config, port);
        let socket = host.join("admin.sock");
        // With the DaemonSet's four capabilities: the socket is root's (HAProxy made it), and the
        // agent is uid 0.
        let agent = Agent::start_with_daemonset_capabilities(&rig.agent_env());
        let app = rig.backend.addr;
        fill_slot(&socket, "SRV_2", app);

        let phases = traffic_through_a_move(&socket, std::net::SocketAddr::from(([127, 0, 0, 1], port)), app, &agent);
        let sent = phases.len();
        let spans = rig.receiver.wait_for_spans(2 * sent);
        let clients: Vec<&Received> = spans.iter().filter(|s| s.is_client()).collect();
        assert_eq!(clients.len(), sent, "{version}: one CLIENT span per request\n{}", agent.log());
        let servers = spans.iter().filter(|s| s.is_server());
        assert!(servers.clone().count() == sent, "{version}: one SERVER span per request");
        assert!(
            servers.clone().all(|s| s.str_attr("haproxy.frontend") == Some("fe_ingress")),
            "{version}: every SERVER span names its frontend"
        );
        let (mut unnamed, mut wrong, mut by_phase, mut unnamed_by_phase) = (0u64, Vec::new(), [0usize; 3], [0usize; 3]);
        for c in &clients {
            let path = c.str_attr("url.path").expect("url.path");
            let i: usize = path.trim_start_matches("/ing/").parse().expect("request number");
            let truth = match phases[i] {
                (0, 0) => vec!["SRV_2"],
                (2, 2) => vec!["SRV_3"],
                _ => vec!["SRV_2", "SRV_3"],
            };
            by_phase[phases[i].1 as usize] += 1;
            match (c.str_attr("haproxy.backend"), c.str_attr("haproxy.server")) {
                (None, None) => {
                    unnamed += 1;
                    unnamed_by_phase[phases[i].1 as usize] += 1;
                }
                (Some("default_echo_8080"), Some(server)) if truth.contains(&server) => {}
                other => wrong.push((path.to_owned(), phases[i], other)),
            }
        }
        println!(
            "[{version}] ingress slots: {sent} CLIENT spans ({} before the move, {} after), {unnamed} unnamed \
             ({unnamed_by_phase:?} by phase), {} wrong; \
             runtime API reads {}, errors {}, ambiguous {}, waited past the limit {}",
            by_phase[0],
            by_phase[2],
            wrong.len(),
            agent.metric("tracetap_haproxy_runtime_api_reads_total"),
            agent.metric("tracetap_haproxy_runtime_api_errors_total"),
            agent.metric("tracetap_server_names_ambiguous_total"),
            agent.metric("tracetap_server_names_unsettled_total"),
        );
        assert!(wrong.is_empty(), "{version}: wrong names: {wrong:?}");
        assert_eq!(
            agent.metric("tracetap_server_names_ambiguous_total"),
            unnamed,
            "{version}: every span left unnamed is counted as ambiguous"
        );
        let named = |p: usize| by_phase[p] - unnamed_by_phase[p];
        assert!(named(0) > 0 && named(2) > 0, "{version}: both slots are named in their time");
        assert_eq!(agent.metric("tracetap_haproxy_runtime_api_errors_total"), 0, "{version}");
        assert_eq!(
            agent.metric("tracetap_server_names_unsettled_total"),
            0,
            "{version}: no span waited past the limit"
        );
        drop(haproxy);
    }
}

/// The socket belongs to another user and only it may write it: the agent, uid 0 without
/// `CAP_DAC_OVERRIDE`, is refused. One log line says why and what to change, the metric counts
/// it, and the configuration names the servers meanwhile.
#[test]
fn a_stats_socket_the_agent_may_not_open_falls_back_to_the_configuration() {
    if !require_root() {
        return;
    }
    let version = haproxy::Version::Debian12;
    let rig = Rig::new();
    let port = free_port();
    let (inside, _) = haproxy::instance_paths(version, &rig.comm);
    let config = format!(
        "global\n    maxconn 256\n    stats socket {}/admin.sock mode 600 uid 65534 level admin\n\n{GLOBAL_AND_DEFAULTS}\
         frontend fe_main\n    bind 127.0.0.1:{port}\n    default_backend be_app\n\n\
         backend be_app\n    server app1 {}\n",
        inside.display(),
        rig.backend.addr
    );
    let haproxy = Haproxy::start_on(version, &rig.comm, &config, port);
    let agent = Agent::start_with_daemonset_capabilities(&rig.agent_env());
    let mut conn = Conn::connect(std::net::SocketAddr::from(([127, 0, 0, 1], port))).expect("connect");
    for i in 0..10 {
        assert_eq!(conn.get(&format!("/cfg/{i}"), &[]).expect("request").status, 200);
    }
    let spans = rig.receiver.wait_for_spans(20);
    let clients: Vec<&Received> = spans.iter().filter(|s| s.is_client()).collect();
    assert_eq!(clients.len(), 10, "log:\n{}", agent.log());
    for c in &clients {
        assert_eq!((c.str_attr("haproxy.backend"), c.str_attr("haproxy.server")), (Some("be_app"), Some("app1")));
    }
    assert!(spans.iter().filter(|s| s.is_server()).all(|s| s.str_attr("haproxy.frontend") == Some("fe_main")));
    let counted = wait_for(Duration::from_secs(10), || {
        (agent.metric("tracetap_haproxy_runtime_api_errors_total") >= 1).then_some(())
    });
    assert!(counted.is_some(), "the refusal is counted; log:\n{}", agent.log());
    assert_eq!(agent.metric("tracetap_haproxy_runtime_api_reads_total"), 0);
    let log = agent.log();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("cannot read the server table")).collect();
    assert_eq!(lines.len(), 1, "logged once:\n{log}");
    assert!(
        lines[0].contains("permission_denied") && lines[0].contains("mode 666") && lines[0].contains("admin.sock"),
        "the line names the socket, the reason and the fix: {}",
        lines[0]
    );
    drop(haproxy);
}

/// A `server` line with a hostname, for HAProxy 3.0 in its own root: the agent resolves it from
/// that root's `/etc/hosts` (as HAProxy's libc did at start), not from the host's, which does
/// not know the name.
#[test]
fn a_server_hostname_resolves_from_the_process_roots_etc_hosts() {
    if !require_root() {
        return;
    }
    let version = haproxy::Version::Debian13;
    let rig = Rig::new();
    let port = free_port();
    let host = format!("app-{}.tracetap.test", rig.comm);
    let hosts_file = haproxy::trixie_root().join("etc/hosts");
    let original = std::fs::read_to_string(&hosts_file).unwrap_or_default();
    assert!(!std::fs::read_to_string("/etc/hosts").unwrap_or_default().contains(&host), "the host does not know it");
    std::fs::write(&hosts_file, format!("{original}\n{} {host}\n", rig.backend.addr.ip()))
        .expect("the root's /etc/hosts");
    let config = format!(
        "global\n    maxconn 256\n\n{GLOBAL_AND_DEFAULTS}\
         frontend fe_main\n    bind 127.0.0.1:{port}\n    default_backend be_app\n\n\
         backend be_app\n    server app1 {host}:{}\n",
        rig.backend.addr.port()
    );
    let haproxy = Haproxy::start_on(version, &rig.comm, &config, port);
    let agent = Agent::start_with_daemonset_capabilities(&rig.agent_env());
    let mut conn = Conn::connect(std::net::SocketAddr::from(([127, 0, 0, 1], port))).expect("connect");
    for i in 0..10 {
        assert_eq!(conn.get(&format!("/host/{i}"), &[]).expect("request").status, 200);
    }
    let spans = rig.receiver.wait_for_spans(20);
    std::fs::write(&hosts_file, original).expect("restore the root's /etc/hosts");
    let clients: Vec<&Received> = spans.iter().filter(|s| s.is_client()).collect();
    assert_eq!(clients.len(), 10, "log:\n{}", agent.log());
    for c in &clients {
        assert_eq!(
            (c.str_attr("haproxy.backend"), c.str_attr("haproxy.server")),
            (Some("be_app"), Some("app1")),
            "named through the root's /etc/hosts"
        );
    }
    assert!(spans.iter().filter(|s| s.is_server()).all(|s| s.str_attr("haproxy.frontend") == Some("fe_main")));
    drop(haproxy);
}

/// `bind fd@7`: HAProxy is given its listening socket as descriptor 7 (as systemd socket
/// activation or a supervisor does); the agent asks that descriptor for its address, and every
/// SERVER span names the frontend.
#[test]
fn a_bind_on_a_descriptor_haproxy_was_given_is_named() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let port = free_port();
    let dir = tempfile::tempdir().expect("temp dir");
    let bin = dir.path().join(&rig.comm);
    std::os::unix::fs::symlink(haproxy::haproxy_binary(), &bin).expect("symlink haproxy");
    let config = dir.path().join("haproxy.cfg");
    std::fs::write(
        &config,
        format!(
            "global\n    maxconn 256\n\n{GLOBAL_AND_DEFAULTS}\
             frontend fe_fd\n    bind fd@7\n    default_backend be_app\n\n\
             backend be_app\n    server app1 {}\n",
            rig.backend.addr
        ),
    )
    .expect("config");
    // A supervisor: makes the listening socket, puts it at descriptor 7, and becomes HAProxy.
    let supervisor = "import os, socket, sys\n\
        s = socket.socket()\n\
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
        s.bind(('127.0.0.1', int(sys.argv[1])))\n\
        s.listen(128)\n\
        os.dup2(s.fileno(), 7)\n\
        os.execv(sys.argv[2], sys.argv[2:])\n";
    let child = std::process::Command::new("python3")
        .args(["-c", supervisor, &port.to_string()])
        .arg(&bin)
        .args(["-db", "-f"])
        .arg(&config)
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start HAProxy on descriptor 7");
    let _haproxy = tracetap_tests::KillOnDrop(child);
    let front = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    wait_for(Duration::from_secs(10), || std::net::TcpStream::connect(front).ok()).expect("HAProxy listens");
    let agent = Agent::start_with_daemonset_capabilities(&rig.agent_env());
    let mut conn = Conn::connect(front).expect("connect");
    for i in 0..10 {
        assert_eq!(conn.get(&format!("/fd/{i}"), &[]).expect("request").status, 200);
    }
    let spans = rig.receiver.wait_for_spans(20);
    let servers: Vec<&Received> = spans.iter().filter(|s| s.is_server()).collect();
    assert_eq!(servers.len(), 10, "log:\n{}", agent.log());
    for s in &servers {
        assert_eq!(s.str_attr("haproxy.frontend"), Some("fe_fd"), "the frontend of the descriptor's bind");
    }
}

/// Master-worker mode, reloaded with a configuration that renames the server: each span carries
/// the names of the worker that served it (the old worker's, then the new one's, which the agent
/// reads when it finds the new worker), never the other's; once the new worker is named, every
/// span is.
#[test]
fn names_follow_a_master_worker_reload() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let port = free_port();
    // With the runtime API in use: after the reload the socket path leads to the new worker,
    // whose table the old worker's spans must not take.
    let (inside, _) = haproxy::instance_paths(haproxy::Version::from_env(), &rig.comm);
    let config = |server: &str| {
        format!(
            "global\n    maxconn 256\n    stats socket {}/admin.sock mode 600 level admin\n\n{GLOBAL_AND_DEFAULTS}\
             frontend fe_main\n    bind 127.0.0.1:{port}\n    default_backend be_app\n\n\
             backend be_app\n    server {server} {}\n",
            inside.display(),
            rig.backend.addr
        )
    };
    let haproxy = Haproxy::start_master_worker(&rig.comm, &config("before_reload"), port);
    let agent = Agent::start_with_daemonset_capabilities(&rig.agent_env());
    let front = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let get = |path: String| {
        // A new connection each time: the old worker keeps its open connections.
        assert_eq!(Conn::connect(front).expect("connect").get(&path, &[]).expect("request").status, 200);
    };
    // Requests flow until the first worker is named (its configuration read: the agent is ready
    // once any process's is, here perhaps the master's).
    let mut sent = 0;
    let named = wait_for(Duration::from_secs(20), || {
        get(format!("/a/{sent}"));
        sent += 1;
        std::thread::sleep(Duration::from_millis(20));
        rig.receiver
            .spans()
            .iter()
            .any(|s| s.is_client() && s.str_attr("haproxy.server") == Some("before_reload"))
            .then_some(())
    });
    assert!(named.is_some(), "the first worker's names; log:\n{}", agent.log());
    haproxy.rewrite_config(&config("after_reload"));
    haproxy.reload_master();
    // Requests flow until one is served by a new worker and named after the new configuration.
    let renamed = wait_for(Duration::from_secs(20), || {
        get(format!("/b/{sent}"));
        sent += 1;
        std::thread::sleep(Duration::from_millis(20));
        rig.receiver
            .spans()
            .iter()
            .any(|s| s.is_client() && s.str_attr("haproxy.server") == Some("after_reload"))
            .then_some(())
    });
    assert!(renamed.is_some(), "the new worker's names; log:\n{}", agent.log());
    for i in 0..10 {
        get(format!("/c/{i}"));
    }
    sent += 10;
    let spans = rig.receiver.wait_for_spans(2 * sent);
    let clients: Vec<&Received> = spans.iter().filter(|s| s.is_client()).collect();
    assert_eq!(clients.len(), sent, "log:\n{}", agent.log());
    // Every span of one worker has the names of that worker's configuration, or none.
    let mut names_by_pid: std::collections::BTreeMap<i64, std::collections::BTreeSet<Option<&str>>> =
        std::collections::BTreeMap::new();
    for c in &clients {
        names_by_pid.entry(c.pid).or_default().insert(c.str_attr("haproxy.server"));
    }
    println!(
        "[reload] {sent} requests; server names by worker: {names_by_pid:?}; runtime API reads {}, errors {}, ambiguous {}, unsettled {}",
        agent.metric("tracetap_haproxy_runtime_api_reads_total"),
        agent.metric("tracetap_haproxy_runtime_api_errors_total"),
        agent.metric("tracetap_server_names_ambiguous_total"),
        agent.metric("tracetap_server_names_unsettled_total"),
    );
    assert!(names_by_pid.len() >= 2, "served by the old and the new worker");
    for names in names_by_pid.values() {
        let named: Vec<_> = names.iter().flatten().collect();
        assert!(named.len() <= 1, "one worker, one configuration: {names:?}");
    }
    let first_worker = clients.iter().find(|c| c.str_attr("url.path") == Some("/a/0")).expect("first").pid;
    assert!(!names_by_pid[&first_worker].contains(&Some("after_reload")), "the old worker never gets the new name");
    for c in clients.iter().filter(|c| c.str_attr("url.path").is_some_and(|p| p.starts_with("/c/"))) {
        assert_eq!(c.str_attr("haproxy.server"), Some("after_reload"), "named once the new worker is");
    }
    assert_eq!(
        agent.metric("tracetap_haproxy_runtime_api_errors_total"),
        0,
        "a reload is no failure:\n{}",
        agent.log()
    );
    drop(haproxy);
}

/// HAProxy's `chroot` directive (Debian's packaged configuration has `chroot /var/lib/haproxy`):
/// the process reads its configuration and makes its stats socket in the root it started in,
/// then moves into the jail, so `/proc/PID/root` is the jail. Names, and the runtime API through
/// the socket, come from the root it started in: on the host (2.6) and in its container (3.0).
#[test]
fn a_haproxy_that_chroots_itself_is_named_from_the_root_it_started_in() {
    if !require_root() {
        return;
    }
    for version in haproxy::versions() {
        let rig = Rig::new();
        let port = free_port();
        let (inner, _) = haproxy::instance_paths(version, &rig.comm);
        let config = format!(
            "global\n    maxconn 256\n    chroot /var/lib/haproxy\n    stats socket {}/admin.sock mode 600 level admin\n\n\
             {GLOBAL_AND_DEFAULTS}\
             frontend fe_jailed\n    bind 127.0.0.1:{port}\n    default_backend be_jailed\n\n\
             backend be_jailed\n    server app_jailed {}\n",
            inner.display(),
            rig.backend.addr
        );
        let haproxy = Haproxy::start_on(version, &rig.comm, &config, port);
        let root = std::fs::read_link(format!("/proc/{}/root", haproxy.pid())).expect("root");
        assert!(root.ends_with("var/lib/haproxy"), "{version}: HAProxy is in its jail: {}", root.display());
        let agent = Agent::start_with_daemonset_capabilities(&rig.agent_env());
        let mut conn = Conn::connect(std::net::SocketAddr::from(([127, 0, 0, 1], port))).expect("connect");
        for i in 0..10 {
            assert_eq!(conn.get(&format!("/jailed/{i}"), &[]).expect("request").status, 200);
        }
        let spans = rig.receiver.wait_for_spans(20);
        let log = agent.log();
        assert_eq!(spans.len(), 20, "{version}: log:\n{log}");
        for s in spans.iter().filter(|s| s.is_server()) {
            assert_eq!(s.str_attr("haproxy.frontend"), Some("fe_jailed"), "{version}: log:\n{log}");
        }
        for c in spans.iter().filter(|s| s.is_client()) {
            assert_eq!(
                (c.str_attr("haproxy.backend"), c.str_attr("haproxy.server")),
                (Some("be_jailed"), Some("app_jailed")),
                "{version}: log:\n{log}"
            );
        }
        let reads = agent.metric("tracetap_haproxy_runtime_api_reads_total");
        assert!(reads >= 1, "{version}: the runtime API is read through the socket in the starting root\n{log}");
        assert_eq!(agent.metric("tracetap_haproxy_runtime_api_errors_total"), 0, "{version}: log:\n{log}");
        println!("[runtime names] {version} chrooted to /var/lib/haproxy: every span named, {reads} runtime API reads");
        drop(haproxy);
    }
}

/// The TLS library of a HAProxy that `chroot`ed itself inside its container: mapped from the root
/// it started in, which neither `/proc/PID/root` (the jail) nor the agent's root holds; found
/// above the jail (the agent as root: the uprobes need `CAP_SYS_ADMIN`, docs/deploy.md, Requirements).
#[test]
fn a_haproxy_that_chroots_itself_in_its_container_has_its_tls_traced() {
    if !require_root() {
        return;
    }
    let version = haproxy::Version::Debian13;
    let rig = Rig::new();
    let port = free_port();
    let pem = tracetap_tests::tls::certificate(version);
    let config = format!(
        "global\n    maxconn 256\n    chroot /var/lib/haproxy\n\n{GLOBAL_AND_DEFAULTS}\
         frontend fe_jailed\n    bind 127.0.0.1:{port} ssl crt {pem}\n    default_backend be_jailed\n\n\
         backend be_jailed\n    server app_jailed {}\n",
        rig.backend.addr
    );
    let _haproxy = Haproxy::start_on(version, &rig.comm, &config, port);
    let agent = Agent::start(&rig.agent_env());
    let hooked = wait_for(Duration::from_secs(10), || (agent.metric("tracetap_tls_processes") == 1).then_some(()));
    assert!(hooked.is_some(), "the TLS probes attach to the library above the jail\n{}", agent.log());
    for i in 0..5 {
        let out = std::process::Command::new("curl")
            .args(["-sk", "--http1.1", "-o", "/dev/null", "-w", "%{http_code}"])
            .arg(format!("https://127.0.0.1:{port}/jailed-tls/{i}"))
            .output()
            .expect("curl");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
    }
    let spans = rig.receiver.wait_for_spans(10);
    let servers: Vec<&Received> = spans.iter().filter(|s| s.is_server()).collect();
    assert_eq!(servers.len(), 5, "log:\n{}", agent.log());
    assert!(servers.iter().all(|s| s.str_attr("url.scheme") == Some("https")));
    assert!(servers.iter().all(|s| s.str_attr("haproxy.frontend") == Some("fe_jailed")));
    println!("[runtime names] {version} chrooted in its container: 5 TLS requests traced and named");
}

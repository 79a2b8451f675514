//! Without the privileges to load eBPF, the agent exits with status 1 and says what to grant;
//! with the four capabilities its `DaemonSet` grants, it does everything. Runs as root (like CI)
//! and drops privileges for the agent.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use tracetap_tests::agent::Agent;
use tracetap_tests::client::Conn;
use tracetap_tests::haproxy::{self, Haproxy, Version};
use tracetap_tests::{Rig, Stack, free_port, require_root, tls, wait_for};

/// Capability numbers (linux/capability.h).
const CAP_DAC_READ_SEARCH: u32 = 2;
const CAP_SYS_PTRACE: u32 = 19;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// Loading the probes, following HAProxy, and naming its frontend and backend (which reads its
/// configuration through /proc and asks its listening socket for its address through
/// `pidfd_getfd`) all work with only the four capabilities.
#[test]
fn the_daemonsets_four_capabilities_are_enough_to_trace_and_name() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let port = free_port();
    let _haproxy = Haproxy::start(&rig.comm, &haproxy::config(port, &[rig.backend.addr], ""), port);
    let agent = Agent::start_with_daemonset_capabilities(&rig.agent_env());
    let four = [CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE, CAP_PERFMON, CAP_BPF].iter().fold(0u64, |set, cap| set | 1 << cap);
    assert_eq!(agent.effective_capabilities(), four, "the agent runs with exactly the four capabilities");
    let front = SocketAddr::from(([127, 0, 0, 1], port));
    assert_eq!(Conn::connect(front).unwrap().get("/four-capabilities", &[]).unwrap().status, 200);
    let spans = rig.receiver.wait_for_spans(2);
    let server = spans.iter().find(|s| s.is_server()).expect("a SERVER span");
    let client = spans.iter().find(|s| !s.is_server()).expect("a CLIENT span");
    assert_eq!(server.str_attr("url.path"), Some("/four-capabilities"));
    assert_eq!(server.str_attr("haproxy.frontend"), Some("fe_main"), "{}", agent.log());
    assert_eq!(client.str_attr("haproxy.backend"), Some("be_app"));
    assert!(!agent.log().contains("cannot duplicate"), "no fallback to /proc/PID/net/tcp: {}", agent.log());
}

#[test]
fn unprivileged_agent_says_what_is_missing() {
    if !require_root() {
        return;
    }
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--"])
        .arg(tracetap_tests::agent::binary())
        .env_clear()
        .env("TRACETAP_ADMIN_ADDR", format!("127.0.0.1:{}", free_port()))
        .output()
        .expect("run setpriv (util-linux)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("root") && stderr.contains("CAP_"), "the message says how to grant access: {stderr}");
}

/// TLS under exactly the four capabilities, HTTP/1.1 and HTTP/2, on both HAProxy versions, by
/// each route that does not need `CAP_SYS_ADMIN` (see the agent's `capture/uprobes.rs`):
/// `auto` (which picks uprobe-multi links on this kernel), and tracefs uprobe events, the route
/// of kernels before 6.6. Every request has its SERVER span and its CLIENT span under it.
#[test]
fn tls_under_the_daemonsets_four_capabilities() {
    if !require_root() {
        return;
    }
    tracetap_tests::ensure_tracefs();
    for version in haproxy::versions() {
        for (route, expected) in [("auto", "uprobe-multi links"), ("tracefs", "tracefs uprobe events")] {
            let mut env = tracetap_tests::linking::agent_env();
            env.push(("TRACETAP_TLS_ROUTE", route.to_owned()));
            let stack =
                Stack::with_agent(version, tls::frontend(version), &env, Agent::start_with_daemonset_capabilities);
            let (_, ready) = stack.agent.get("/readyz").expect("/readyz answers");
            assert!(
                ready.contains(&format!("tls: {expected}")),
                "[{version}, {route}] /readyz names the route: {ready}"
            );
            for (protocol, options, n) in
                [("1.1", &["--h1", "-c", "4"][..], 200), ("2", &["-c", "4", "-m", "10"][..], 400)]
            {
                let label = format!("{version}, TRACETAP_TLS_ROUTE={route}, HTTP/{protocol} over TLS");
                let path = format!("/same-h{protocol}");
                let spans = stack.identical_requests("https", &path, options, n);
                let acc = tracetap_tests::linking::accuracy(&spans, &path);
                println!("[{label}] {acc:?}");
                let log = || stack.agent.log();
                assert_eq!(acc.server, n, "[{label}] one SERVER span per request\n{}", log());
                assert_eq!(acc.linked_right, n, "[{label}] each CLIENT span under its own SERVER span: {acc:?}");
                let protocols: Vec<_> = spans
                    .iter()
                    .filter(|s| s.is_server() && s.str_attr("url.path") == Some(path.as_str()))
                    .filter_map(|s| s.str_attr("network.protocol.version"))
                    .collect();
                assert_eq!(protocols.len(), n, "[{label}] network.protocol.version on every SERVER span");
                assert!(protocols.iter().all(|p| *p == protocol), "[{label}] {protocols:?}");
            }
            assert_eq!(stack.agent.metric("tracetap_tls_hook_failures_total"), 0);
            assert_eq!(stack.agent.metric("tracetap_events_lost_tls_unbound_total"), 0);
            if route == "tracefs" {
                tracefs_events_are_removed(stack, &env);
            }
        }
    }
}

/// The tracefs route's events are host-wide: an agent that exits removes its own, and one killed
/// with SIGKILL leaves them to the next agent, which removes them at start.
fn tracefs_events_are_removed(stack: Stack, env: &[(&str, String)]) {
    let Stack { agent, haproxy, receiver, backend, rt, .. } = stack;
    let group = |pid: u32| format!("tracetap_{pid}/");
    let first = agent.pid();
    assert!(tracefs_events().contains(&group(first)), "the agent's events are in tracefs while it runs");
    let _ = agent.stop();
    assert!(!tracefs_events().contains(&group(first)), "and removed when it exits");
    let mut vars = env.to_vec();
    vars.push(("TRACETAP_TARGET_COMM", haproxy.comm.clone()));
    let mut killed = Agent::start_with_daemonset_capabilities(&vars);
    let hooked = wait_for(Duration::from_secs(10), || (killed.metric("tracetap_tls_processes") == 1).then_some(()));
    assert!(hooked.is_some(), "{}", killed.log());
    let second = killed.pid();
    killed.kill();
    assert!(tracefs_events().contains(&group(second)), "SIGKILL leaves the events behind");
    let next = Agent::start_with_daemonset_capabilities(&vars);
    assert!(!tracefs_events().contains(&group(second)), "the next agent removed them at start\n{}", next.log());
    let third = next.pid();
    let _ = next.stop();
    assert!(!tracefs_events().contains(&group(third)));
    drop((haproxy, receiver, backend, rt));
}

fn tracefs_events() -> String {
    std::fs::read_to_string("/sys/kernel/tracing/uprobe_events").expect("tracefs at /sys/kernel/tracing")
}

/// When no route attaches (here: perf uprobes forced, which need `CAP_SYS_ADMIN`), the agent says
/// so once, with the kernel, what refused each route and the fix; `/readyz` says it too; each
/// process is counted; cleartext is traced as usual.
#[test]
fn tls_without_a_route_is_refused_once_and_loudly() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let tls_port = free_port();
    let plain_port = free_port();
    let pem = tls::certificate(Version::Debian12);
    let config = haproxy::config(plain_port, &[rig.backend.addr], "")
        + &format!("\nfrontend fe_tls\n    bind 127.0.0.1:{tls_port} ssl crt {pem}\n    default_backend be_app\n");
    let mut env = rig.agent_env();
    env.push(("TRACETAP_TLS_ROUTE", "perf".to_owned()));
    // HAProxy after the agent: reported at its start, then selected by discovery.
    let agent = Agent::start_with_daemonset_capabilities_without_targets(&env);
    let _haproxy = Haproxy::start_master_worker_on(Version::Debian12, &rig.comm, &config, plain_port);
    agent.wait_ready();
    // The master and its worker, both mapping the TLS library.
    let counted =
        wait_for(Duration::from_secs(10), || (agent.metric("tracetap_tls_hook_failures_total") >= 2).then_some(()));
    assert!(counted.is_some(), "each process is counted\n{}", agent.log());
    let log = agent.log();
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let message = log.lines().find(|l| l.contains("TLS connections cannot be traced on this node")).expect(&log);
    for part in
        [release.trim(), "perf uprobes:", "CAP_SYS_ADMIN", "ba677dbe77af", "Cleartext connections are traced as usual"]
    {
        assert!(message.contains(part), "the message has {part:?}: {message}");
    }
    assert_eq!(log.matches("TLS connections cannot be traced on this node").count(), 1, "said once\n{log}");
    let (_, ready) = agent.get("/readyz").unwrap();
    assert!(ready.contains("tls: none: TLS connections cannot be traced"), "{ready}");
    assert_eq!(agent.metric("tracetap_tls_processes"), 0);
    let front = SocketAddr::from(([127, 0, 0, 1], plain_port));
    assert_eq!(Conn::connect(front).unwrap().get("/cleartext", &[]).unwrap().status, 200);
    let spans = rig.receiver.wait_for_spans(2);
    assert!(spans.iter().any(|s| s.is_server() && s.str_attr("url.path") == Some("/cleartext")));
    // Reported at its start (master and worker, when the version forks one) and selected by
    // discovery since: each process counted once.
    assert_eq!(agent.metric("tracetap_tls_hook_failures_total"), 2, "each counted once\n{}", agent.log());
}

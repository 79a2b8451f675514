//! HAProxy processes coming and going: several instances on one host, master-worker mode and a
//! reload while traffic flows. Needs root.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tracetap_tests::agent::Agent;
use tracetap_tests::client::Conn;
use tracetap_tests::haproxy::{self, Haproxy};
use tracetap_tests::{KillOnDrop, Rig, free_port, require_root, wait_for};

#[test]
fn several_instances_are_traced_as_separate_processes() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let (receiver, backend, comm) = (&rig.receiver, rig.backend, rig.comm.clone());
    let (p1, p2) = (free_port(), free_port());
    let h1 = Haproxy::start(&comm, &haproxy::config(p1, &[backend.addr], ""), p1);
    // Same command name, own directory: a second instance.
    let h2 = Haproxy::start_in(&comm, "second", &haproxy::config(p2, &[backend.addr], ""), p2);
    let agent = Agent::start(&[("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()), ("TRACETAP_TARGET_COMM", comm)]);
    for (port, path) in [(p1, "/one"), (p2, "/two")] {
        assert_eq!(
            Conn::connect(SocketAddr::from(([127, 0, 0, 1], port))).unwrap().get(path, &[]).unwrap().status,
            200
        );
    }
    let spans = receiver.wait_for_spans(4);
    let pid_of =
        |path: &str| spans.iter().find(|s| s.is_server() && s.str_attr("url.path") == Some(path)).map(|s| s.pid);
    assert_eq!(pid_of("/one"), Some(i64::from(h1.pid())));
    assert_eq!(pid_of("/two"), Some(i64::from(h2.pid())));
    assert_eq!(agent.metric("tracetap_targets"), 2);
}

/// The probes keep up to 8 traced processes in a fast-path array (`TARGET_SET`); past that they
/// fall back to the pid map. Ten instances named by pid (no command filter, where a process not in
/// a complete set is ruled out at once) must all be traced.
#[test]
fn more_instances_than_the_probes_fast_path_holds_are_all_traced() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let (receiver, backend, comm) = (&rig.receiver, rig.backend, rig.comm.clone());
    let instances: Vec<(u16, Haproxy)> = (0..10)
        .map(|i| {
            let port = free_port();
            (port, Haproxy::start_in(&comm, &format!("i{i}"), &haproxy::config(port, &[backend.addr], ""), port))
        })
        .collect();
    let pids: Vec<String> = instances.iter().map(|(_, h)| h.pid().to_string()).collect();
    let agent =
        Agent::start(&[("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()), ("TRACETAP_TARGET_PIDS", pids.join(","))]);
    assert!(wait_for(Duration::from_secs(10), || (agent.metric("tracetap_targets") == 10).then_some(())).is_some());
    for (i, (port, _)) in instances.iter().enumerate() {
        let front = SocketAddr::from(([127, 0, 0, 1], *port));
        assert_eq!(Conn::connect(front).unwrap().get(&format!("/instance/{i}"), &[]).unwrap().status, 200);
    }
    let spans = receiver.wait_for_spans(20);
    for (i, (_, h)) in instances.iter().enumerate() {
        let path = format!("/instance/{i}");
        let server = spans.iter().find(|s| s.is_server() && s.str_attr("url.path") == Some(&path));
        assert_eq!(server.map(|s| s.pid), Some(i64::from(h.pid())), "{path} traced, in its own process");
    }
}

/// Under a command filter the probes judge a process by its name once and cache the verdict; the
/// exec of a new program must redo it. A shell that reads (judged: not HAProxy) and then execs
/// HAProxy is traced from its first request, sent at once, long before discovery (every 500 ms)
/// could have added it.
#[test]
fn a_process_that_execs_haproxy_is_traced_from_its_first_request() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let (receiver, backend, comm) = (&rig.receiver, rig.backend, rig.comm.clone());
    let mut agent = Agent::start_without_targets(&rig.agent_env());
    let port = free_port();
    let dir = std::env::temp_dir().join(format!("tracetap-e2e-exec-{comm}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::os::unix::fs::symlink(haproxy::haproxy_binary(), dir.join(&comm)).unwrap();
    std::fs::write(dir.join("haproxy.cfg"), haproxy::config(port, &[backend.addr], "")).unwrap();
    let script =
        format!("read x </dev/null; exec {} -db -f {}", dir.join(&comm).display(), dir.join("haproxy.cfg").display());
    let child = KillOnDrop(std::process::Command::new("sh").args(["-c", &script]).spawn().unwrap());
    let front = SocketAddr::from(([127, 0, 0, 1], port));
    let mut conn = wait_for(Duration::from_secs(5), || Conn::connect(front).ok()).expect("HAProxy listens");
    assert_eq!(conn.get("/first", &[]).unwrap().status, 200);
    let spans = receiver.wait_for_spans(2);
    let server = spans.iter().find(|s| s.is_server() && s.str_attr("url.path") == Some("/first"));
    assert_eq!(server.map(|s| s.pid), Some(i64::from(child.0.id())), "the exec'd HAProxy keeps the shell's pid");
    assert!(agent.is_running());
    drop(child);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn master_worker_reload_under_traffic_loses_no_request() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let (receiver, backend, comm) = (&rig.receiver, rig.backend, rig.comm.clone());
    let port = free_port();
    let haproxy = Haproxy::start_master_worker(&comm, &haproxy::config(port, &[backend.addr], ""), port);
    let agent = Agent::start(&[("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()), ("TRACETAP_TARGET_COMM", comm)]);
    let front = SocketAddr::from(([127, 0, 0, 1], port));

    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut answered = BTreeSet::new();
            let mut i = 0u32;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let path = format!("/during/{i}");
                if let Ok(resp) = Conn::connect(front).and_then(|mut c| c.get(&path, &[]))
                    && resp.status == 200
                {
                    answered.insert(path);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            (i, answered)
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    haproxy.reload_master();
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::Relaxed);
    let (tried, answered) = traffic.join().unwrap();

    let servers = wait_for(Duration::from_secs(20), || {
        let got: BTreeSet<String> = receiver
            .spans()
            .iter()
            .filter(|s| s.is_server() && s.int_attr("http.response.status_code") == Some(200))
            .filter_map(|s| s.str_attr("url.path").map(str::to_owned))
            .collect();
        answered.is_subset(&got).then_some(got)
    });
    let pids: BTreeSet<i64> = receiver.spans().iter().map(|s| s.pid).collect();
    println!(
        "[reload] tried {tried}, answered {}, traced {}, worker pids seen {pids:?}, ring losses {}",
        answered.len(),
        servers.as_ref().map_or(0, BTreeSet::len),
        agent.metric("tracetap_events_lost_ring_full_total")
    );
    assert!(servers.is_some(), "every answered request has a SERVER span with its status");
    assert!(pids.len() >= 2, "traffic before and after the reload came from two workers");
    assert!(answered.len() > 50);
}

/// Master-worker reloads under new-connection TLS load, as the `DaemonSet` runs the agent: every
/// new worker must have its TLS probes before it accepts its first connection, so that every
/// answered request has its SERVER span. Four clients, each a `curl` per request (a new TLS
/// connection each time, with a unique path), while the master reloads six times in nine seconds.
#[test]
fn master_worker_reloads_under_tls_load_lose_no_request() {
    if !require_root() {
        return;
    }
    for version in haproxy::versions() {
        let rig = Rig::new();
        let port = free_port();
        let pem = tracetap_tests::tls::certificate(version);
        let config = haproxy::config(port, &[rig.backend.addr], "")
            .replace(&format!("bind 127.0.0.1:{port}"), &format!("bind 127.0.0.1:{port} ssl crt {pem}"));
        let haproxy = Haproxy::start_master_worker_on(version, &rig.comm, &config, port);
        let agent = Agent::start_with_daemonset_capabilities(&rig.agent_env());
        let stop = Arc::new(AtomicBool::new(false));
        let clients: Vec<_> = (0..4)
            .map(|client| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut answered = Vec::new();
                    for i in 0.. {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let path = format!("/reload/{client}-{i}");
                        let out = std::process::Command::new("curl")
                            .args(["-sk", "-o", "/dev/null", "-w", "%{http_code}"])
                            .arg(format!("https://127.0.0.1:{port}{path}"))
                            .output()
                            .expect("curl (make setup installs it)");
                        if out.stdout == b"200" {
                            answered.push(path);
                        }
                    }
                    answered
                })
            })
            .collect();
        for _ in 0..6 {
            std::thread::sleep(Duration::from_millis(1500));
            haproxy.reload_master();
        }
        std::thread::sleep(Duration::from_secs(1));
        stop.store(true, Ordering::Relaxed);
        let answered: BTreeSet<String> = clients.into_iter().flat_map(|c| c.join().expect("a client")).collect();
        let traced = |receiver: &tracetap_tests::otlp::Receiver| -> BTreeSet<String> {
            receiver
                .spans()
                .iter()
                .filter(|s| s.is_server())
                .filter_map(|s| s.str_attr("url.path").map(str::to_owned))
                .filter(|p| answered.contains(p))
                .collect()
        };
        let _ = wait_for(Duration::from_secs(20), || (traced(&rig.receiver).len() == answered.len()).then_some(()));
        let got = traced(&rig.receiver);
        let missing = answered.len() - got.len();
        let pids: BTreeSet<i64> = rig.receiver.spans().iter().map(|s| s.pid).collect();
        let untraced: Vec<&String> = answered.difference(&got).collect();
        println!("[tls reload, {version}] untraced requests (client-number): {untraced:?}");
        for warning in agent.log().lines().filter(|l| l.contains("WARN")) {
            println!("[tls reload, {version}] agent: {warning}");
        }
        println!(
            "[tls reload, {version}] answered {}, traced {}, missing {missing}, workers {}, unbound TLS records {}, hook failures {}, ring losses {}",
            answered.len(),
            got.len(),
            pids.len(),
            agent.metric("tracetap_events_lost_tls_unbound_total"),
            agent.metric("tracetap_tls_hook_failures_total"),
            agent.metric("tracetap_events_lost_ring_full_total"),
        );
        assert!(answered.len() > 800, "[{version}] enough traffic: {}", answered.len());
        assert!(pids.len() >= 6, "[{version}] traffic came from the workers of six reloads: {pids:?}");
        assert!(
            missing * 1000 <= answered.len(),
            "[{version}] at least 99.9% traced: {missing} of {} missing\n{}",
            answered.len(),
            agent.log()
        );
    }
}

/// A traced HAProxy that ends leaves nothing behind in the agent: its connections (idle
/// keep-alive ones here, whose close the probes never see: the kernel closes them at exit) and
/// its TLS probes go as soon as the probes report its end.
#[test]
fn an_ended_process_leaves_no_connection_or_probe_behind() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let port = free_port();
    let pem = tracetap_tests::tls::certificate(haproxy::Version::Debian12);
    let config = haproxy::config(port, &[rig.backend.addr], "").replace(
        &format!("bind 127.0.0.1:{port}"),
        &format!("bind 127.0.0.1:{port}\n    bind 127.0.0.1:{} ssl crt {pem}", free_port()),
    );
    let haproxy = Haproxy::start(&rig.comm, &config, port);
    let agent = Agent::start_with_daemonset_capabilities(&rig.agent_env());
    let front = SocketAddr::from(([127, 0, 0, 1], port));
    let conns: Vec<Conn> = (0..20)
        .map(|i| {
            let mut conn = Conn::connect(front).expect("connect");
            assert_eq!(conn.get(&format!("/idle/{i}"), &[]).expect("request").status, 200);
            conn
        })
        .collect();
    let _ = rig.receiver.wait_for_spans(40);
    assert!(agent.metric("tracetap_connections") >= 20, "the idle connections are tracked");
    assert_eq!(agent.metric("tracetap_tls_processes"), 1, "the TLS probes are attached");
    drop(haproxy);
    // Its TLS probes are let go at once and detached off the capture thread (`tls-detach`): gone
    // when no link waits any more.
    let freed = wait_for(Duration::from_secs(10), || {
        (agent.metric("tracetap_connections") == 0
            && agent.metric("tracetap_tls_processes") == 0
            && agent.metric("tracetap_tls_links_detaching") == 0)
            .then_some(())
    });
    assert!(
        freed.is_some(),
        "connections {}, TLS processes {}, links waiting to be detached {} after HAProxy ended\n{}",
        agent.metric("tracetap_connections"),
        agent.metric("tracetap_tls_processes"),
        agent.metric("tracetap_tls_links_detaching"),
        agent.log()
    );
    drop(conns);
}

//! One scenario against every `HAProxy` version the tests know (`haproxy::versions()`): Debian 12's
//! 2.6 run directly, and Debian 13's 3.0 chrooted in namespaces of its own, as in a container
//! (`make setup` debootstraps it). Needs root.

use tracetap_tests::client::Conn;
use tracetap_tests::{Stack, haproxy, require_root};

const CONNECTIONS: u32 = 4;
const REQUESTS_PER_CONNECTION: u32 = 10;

#[test]
fn keep_alive_requests_are_traced_on_every_version() {
    if !require_root() {
        return;
    }
    for version in haproxy::versions() {
        let s = Stack::start_on(version, "", &[]);
        let mut paths = Vec::new();
        for c in 0..CONNECTIONS {
            let mut conn = Conn::connect(s.front).expect("connect");
            for r in 0..REQUESTS_PER_CONNECTION {
                let path = format!("/v/{c}/{r}");
                assert_eq!(conn.get(&path, &[]).expect("request").status, 200, "{version}: {path}");
                paths.push(path);
            }
        }
        let wanted: Vec<&str> = paths.iter().map(String::as_str).collect();
        let spans = s.spans_for(&wanted);
        for path in &wanted {
            let (server, clients) = Stack::trace_of(&spans, path);
            assert_eq!(server.int_attr("http.response.status_code"), Some(200), "{version}: {path}");
            assert_eq!(server.pid, i64::from(s.haproxy.pid()), "{version}: {path}: the host pid of HAProxy");
            assert_eq!(clients.len(), 1, "{version}: {path}: one CLIENT span under the SERVER span");
            assert_eq!(clients[0].str_attr("url.path"), Some(*path), "{version}");
        }
        let opaque = s.agent.metric("tracetap_opaque_connections_total");
        println!(
            "[{version}] requests: {}, SERVER spans: {}, CLIENT spans: {}, parse errors: {}, opaque connections: {opaque}",
            wanted.len(),
            spans.iter().filter(|x| x.is_server()).count(),
            spans.iter().filter(|x| x.is_client()).count(),
            s.agent.metric("tracetap_parse_errors_total"),
        );
        // Every connection HAProxy accepted or opened here speaks HTTP. Its thread wake-up pipes
        // (one thread `write(wr_fd, "c", 1)`, another `read(rd_fd, ..)`) and the files it reads
        // from exec on (3.0: 22 — shared libraries, its config, resolv.conf, /proc/cpuinfo; 2.6:
        // 170, 146 of them CA certificates) are descriptors never seen opened, counted apart.
        assert_eq!(opaque, 0, "{version}: no accepted or connected socket is opaque");
        println!("[{version}] unknown descriptors: {}", s.agent.metric("tracetap_unknown_descriptors_total"));
        assert_eq!(s.agent.metric("tracetap_parse_errors_total"), 0, "{version}");
    }
}

//! Export as an operator configures it, end to end: the real agent tracing a real HAProxy, exporting
//! to a receiver that decodes with the official definitions. Over OTLP/HTTP and OTLP/gRPC with
//! TLS, the certificates people make (a private CA's leaf, a self-signed leaf, `openssl req
//! -x509`'s self-signed CA, an IP-only name, mutual TLS), and each refusal with its counted cause
//! and message (an expired certificate, another name, an unknown issuer, a CA certificate not
//! named, no client certificate; files that cannot be read stop the agent at start:
//! `config_errors.rs`); OTLP/gRPC plain and with gzip, and a collector that answers 429 with
//! `Retry-After`. Every test here needs root (see `require_root`).

use std::time::Duration;

use tracetap_tests::agent::Agent;
use tracetap_tests::client::Conn;
use tracetap_tests::haproxy::{self, Haproxy};
use tracetap_tests::otlp::{Options, Receiver, RetryAfter, ServerTls};
use tracetap_tests::pki::{Leaf, Pki};
use tracetap_tests::{Rig, free_port, require_root, wait_for};

/// HAProxy in front of the rig's backend, a receiver as `options` say, and an agent exporting to it
/// with `env` on top.
struct Traced {
    rig: Rig,
    receiver: Receiver,
    _haproxy: Haproxy,
    agent: Agent,
    front: std::net::SocketAddr,
}

impl Traced {
    fn start(options: Options, env: &[(&'static str, String)]) -> Self {
        let rig = Rig::new();
        let receiver = Receiver::start_with(&rig.rt, options);
        let port = free_port();
        let haproxy = Haproxy::start(&rig.comm, &haproxy::config(port, &[rig.backend.addr], ""), port);
        let mut vars =
            vec![("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()), ("TRACETAP_TARGET_COMM", rig.comm.clone())];
        vars.extend(env.iter().cloned());
        let agent = Agent::start(&vars);
        Self { rig, receiver, _haproxy: haproxy, agent, front: std::net::SocketAddr::from(([127, 0, 0, 1], port)) }
    }

    /// `n` requests with identical heads on one connection.
    fn send(&self, n: usize) {
        let mut conn = Conn::connect(self.front).expect("connect");
        for _ in 0..n {
            assert_eq!(conn.get("/export", &[]).expect("request").status, 200);
        }
    }

    /// Waits until the receiver holds `n` spans (or 20 s) and checks it holds exactly that many:
    /// one SERVER and one CLIENT span per request.
    fn expect_spans(&self, n: usize) {
        let spans = self.receiver.wait_for_spans(n);
        assert_eq!(spans.len(), n, "spans received; agent log:\n{}", self.agent.log());
        assert_eq!(spans.iter().filter(|s| s.is_server()).count(), n / 2);
        assert!(spans.iter().all(|s| s.span.trace_id.len() == 16));
    }

    fn metric(&self, name: &str) -> u64 {
        self.agent.metric(name)
    }
}

fn server_tls(pki: &Pki, mutual: bool) -> ServerTls {
    ServerTls {
        cert_pem: pki.server_cert_pem.clone(),
        key_pem: pki.server_key_pem.clone(),
        client_ca_pem: mutual.then(|| pki.ca_pem.clone()),
    }
}

fn path(p: &std::path::Path) -> String {
    p.display().to_string()
}

/// A collector's TLS as one case sets it up: the certificate the receiver serves, and what the
/// agent is told to trust and to present.
struct Collector {
    tls: ServerTls,
    /// `OTEL_EXPORTER_OTLP_CERTIFICATE`, if set.
    trust: Option<std::path::PathBuf>,
    /// `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE` and `_KEY`, if set.
    client: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// The endpoint names `127.0.0.1` instead of `localhost`.
    by_ip: bool,
}

impl Collector {
    fn serving((cert_pem, key_pem): (String, String), trust: Option<std::path::PathBuf>) -> Self {
        Self { tls: ServerTls { cert_pem, key_pem, client_ca_pem: None }, trust, client: None, by_ip: false }
    }

    fn start(&self, grpc: bool, extra: &[(&'static str, String)]) -> Traced {
        let mut env = vec![("OTEL_EXPORTER_OTLP_PROTOCOL", if grpc { "grpc" } else { "http/protobuf" }.to_owned())];
        env.extend(self.trust.iter().map(|f| ("OTEL_EXPORTER_OTLP_CERTIFICATE", path(f))));
        if let Some((cert, key)) = &self.client {
            env.extend([
                ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", path(cert)),
                ("OTEL_EXPORTER_OTLP_CLIENT_KEY", path(key)),
            ]);
        }
        env.extend(extra.iter().cloned());
        Traced::start(Options { grpc, tls: Some(self.tls.clone()), by_ip: self.by_ip, ..Options::default() }, &env)
    }

    /// Over OTLP/HTTP and OTLP/gRPC: 20 requests give their 40 spans, and no handshake fails.
    fn delivers(&self) {
        for grpc in [false, true] {
            let t = self.start(grpc, &[]);
            t.send(20);
            t.expect_spans(40);
            assert_eq!(t.receiver.stats().handshake_failures, 0, "[grpc {grpc}]");
            assert_eq!(t.metric("tracetap_export_failures_total"), 0);
            assert!(!metrics_text(&t).contains("tracetap_export_tls_failures_total{"), "[grpc {grpc}]");
        }
    }

    /// Over OTLP/HTTP and OTLP/gRPC: the handshake fails for `reason`, counted under that label,
    /// retried with the spans held (none dropped as failed), logged with a message that has
    /// `says`, and `/readyz` says so; the agent keeps running.
    fn is_refused(&self, reason: &str, says: &[&str]) {
        for grpc in [false, true] {
            let mut t = self.start(grpc, &[]);
            t.send(10);
            let counted = wait_for(Duration::from_secs(20), || (tls_failures(&t, reason) >= 4).then_some(()));
            assert!(
                counted.is_some(),
                "[grpc {grpc}] {reason} counted and retried:\n{}\n{}",
                metrics_text(&t),
                t.agent.log()
            );
            let log = t.agent.log();
            let lines: Vec<_> =
                log.lines().filter(|l| l.contains("failed: ") && says.iter().all(|p| l.contains(p))).collect();
            assert!(!lines.is_empty(), "[grpc {grpc}] the message says {says:?}:\n{log}");
            assert!(lines.len() < tls_failures(&t, reason) as usize, "[grpc {grpc}] rate-limited per cause:\n{log}");
            let (_, ready) = t.agent.get("/readyz").expect("/readyz");
            assert!(ready.contains("export: failing: ") && says.iter().all(|p| ready.contains(p)), "{ready}");
            assert_eq!(t.metric("tracetap_spans_dropped_export_failed_total"), 0, "held, not dropped");
            assert_eq!(t.metric("tracetap_spans_exported_total"), 0);
            assert!(t.receiver.spans().is_empty());
            assert!(t.agent.is_running());
        }
    }
}

fn metrics_text(t: &Traced) -> String {
    t.agent.get("/metrics").expect("/metrics").1
}

fn tls_failures(t: &Traced, reason: &str) -> u64 {
    let name = format!("tracetap_export_tls_failures_total{{reason=\"{reason}\"}} ");
    metrics_text(t).lines().find_map(|l| l.strip_prefix(&name)?.parse().ok()).unwrap_or(0)
}

#[test]
fn a_private_ca_and_its_leaf() {
    if !require_root() {
        return;
    }
    let pki = Pki::new("tracetap-test-ca");
    Collector::serving(pki.leaf(Leaf::DEFAULT), Some(pki.ca_file())).delivers();
}

#[test]
fn a_self_signed_leaf_named_as_the_certificate_to_trust() {
    if !require_root() {
        return;
    }
    let pki = Pki::new("unused");
    let (cert, key) = Leaf::DEFAULT.self_signed();
    let trust = pki.write("self-signed.pem", &cert);
    Collector::serving((cert, key), Some(trust)).delivers();
}

/// The certificate `openssl req -x509` makes, marked `CA:TRUE`, given to the collector as its own
/// and to the agent as the one to trust: what the Collector and the Go and Python SDKs accept.
#[test]
fn a_self_signed_ca_certificate_as_openssl_req_makes_it() {
    if !require_root() {
        return;
    }
    let pki = Pki::new("unused");
    let (cert, key) = (pki.dir().join("collector.pem"), pki.dir().join("collector.key"));
    let status = std::process::Command::new("openssl")
        .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost"])
        .args(["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stderr(std::process::Stdio::null())
        .status()
        .expect("openssl (make setup installs it)");
    assert!(status.success());
    let read = |p: &std::path::Path| std::fs::read_to_string(p).expect("PEM");
    assert!(
        String::from_utf8_lossy(
            &std::process::Command::new("openssl")
                .args(["x509", "-noout", "-text", "-in"])
                .arg(&cert)
                .output()
                .unwrap()
                .stdout
        )
        .contains("CA:TRUE"),
        "the case under test: a CA certificate"
    );
    let mut collector = Collector::serving((read(&cert), read(&key)), Some(cert.clone()));
    collector.delivers();
    // By IP as well: the IP name is checked.
    collector.by_ip = true;
    collector.delivers();
    // Name checks stay on: the same certificate for another name than the endpoint's.
    let (other_cert, other_key) = Leaf { names: &["collector.example"], ca: true, ..Leaf::DEFAULT }.self_signed();
    let trust = pki.write("other.pem", &other_cert);
    Collector::serving((other_cert, other_key), Some(trust))
        .is_refused("name_mismatch", &["not valid for localhost", "OTEL_EXPORTER_OTLP_ENDPOINT"]);
}

#[test]
fn a_certificate_with_an_ip_address_only() {
    if !require_root() {
        return;
    }
    let pki = Pki::new("tracetap-ip-ca");
    let mut collector =
        Collector::serving(pki.leaf(Leaf { names: &["127.0.0.1"], ..Leaf::DEFAULT }), Some(pki.ca_file()));
    collector.by_ip = true;
    collector.delivers();
}

#[test]
fn an_expired_certificate_is_refused_as_expired() {
    if !require_root() {
        return;
    }
    let pki = Pki::new("tracetap-expired-ca");
    Collector::serving(pki.leaf(Leaf { years: (2020, 2021), ..Leaf::DEFAULT }), Some(pki.ca_file()))
        .is_refused("expired", &["certificate has expired", "renew it on the collector"]);
}

#[test]
fn a_certificate_for_another_name_is_refused_naming_the_endpoint_variable() {
    if !require_root() {
        return;
    }
    let pki = Pki::new("tracetap-name-ca");
    Collector::serving(pki.leaf(Leaf { names: &["collector.example"], ..Leaf::DEFAULT }), Some(pki.ca_file()))
        .is_refused(
            "name_mismatch",
            &["not valid for localhost (it names collector.example)", "OTEL_EXPORTER_OTLP_ENDPOINT"],
        );
}

/// No `OTEL_EXPORTER_OTLP_CERTIFICATE`: the system's CAs do not know the private CA. The spans
/// wait, up to the queue's bound, and what overflows it is counted.
#[test]
fn an_unknown_issuer_is_refused_and_spans_wait_up_to_the_queue_bound() {
    if !require_root() {
        return;
    }
    let pki = Pki::new("tracetap-untrusted-ca");
    let collector = Collector::serving(pki.leaf(Leaf::DEFAULT), None);
    collector.is_refused("unknown_issuer", &["not signed by a certificate in OTEL_EXPORTER_OTLP_CERTIFICATE (unset"]);
    let t = collector.start(
        false,
        &[
            ("OTEL_BSP_MAX_QUEUE_SIZE", "4".into()),
            ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2".into()),
            ("OTEL_BSP_SCHEDULE_DELAY", "50".into()),
        ],
    );
    t.send(20);
    let overflowed =
        wait_for(Duration::from_secs(20), || (t.metric("tracetap_spans_dropped_queue_full_total") > 0).then_some(()));
    assert!(overflowed.is_some(), "the queue's overflow is counted:\n{}", metrics_text(&t));
    assert_eq!(t.metric("tracetap_spans_dropped_export_failed_total"), 0);
    assert!(tls_failures(&t, "unknown_issuer") >= 1);
}

/// The export queue full behind a TLS failure, and the tail thread waiting for room in it: a
/// SIGTERM still ends the agent, the spans it could not send counted.
#[test]
fn the_agent_stops_while_the_collector_s_tls_keeps_failing() {
    if !require_root() {
        return;
    }
    let pki = Pki::new("tracetap-stop-ca");
    let state = tempfile::tempdir().expect("state directory");
    let mut t = Collector::serving(pki.leaf(Leaf::DEFAULT), None).start(
        false,
        &[
            ("TRACETAP_TAIL_ENABLED", "true".into()),
            ("TRACETAP_STATE_DIR", path(state.path())),
            ("TRACETAP_TAIL_GRACE", "100ms".into()),
            ("TRACETAP_TAIL_DECISION_WAIT", "1s".into()),
            ("TRACETAP_TAIL_RATIO", "1.0".into()),
            ("OTEL_BSP_MAX_QUEUE_SIZE", "4".into()),
            ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2".into()),
        ],
    );
    t.send(40);
    let failing = wait_for(Duration::from_secs(20), || (tls_failures(&t, "unknown_issuer") >= 3).then_some(()));
    assert!(failing.is_some(), "{}", t.agent.log());
    let pid = t.agent.pid().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let exited = t.agent.wait_exit(Duration::from_mins(1));
    assert!(exited.is_some(), "the agent exits on SIGTERM:\n{}", t.agent.log());
    assert!(t.agent.log().contains("not retried: the agent is stopping"), "{}", t.agent.log());
}

/// A certificate marked as a CA that the server presents as its own, signed by the CA the agent
/// trusts but not itself named: refused, saying how to trust it.
#[test]
fn a_ca_certificate_not_named_is_refused_as_such() {
    if !require_root() {
        return;
    }
    let pki = Pki::new("tracetap-ca-leaf-ca");
    Collector::serving(pki.leaf(Leaf { ca: true, ..Leaf::DEFAULT }), Some(pki.ca_file()))
        .is_refused("ca_used_as_end_entity", &["CA:TRUE", "OTEL_EXPORTER_OTLP_CERTIFICATE"]);
}

#[test]
fn mutual_tls_sends_the_client_certificate() {
    if !require_root() {
        return;
    }
    let pki = Pki::new("tracetap-mtls-ca");
    let mut collector =
        Collector { tls: server_tls(&pki, true), trust: Some(pki.ca_file()), client: None, by_ip: false };
    // Without the client certificate the receiver refuses the handshake.
    collector.is_refused("handshake_refused", &["refused the TLS handshake", "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"]);
    collector.client = Some(pki.client_files());
    collector.delivers();
}

#[test]
fn grpc_plain_with_gzip() {
    if !require_root() {
        return;
    }
    let t = Traced::start(
        Options { grpc: true, ..Options::default() },
        &[("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc".into()), ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip".into())],
    );
    assert!(t.receiver.endpoint().starts_with("http://"));
    t.send(30);
    t.expect_spans(60);
    let stats = t.receiver.stats();
    assert!(stats.accepted > 0);
    assert_eq!(stats.gzipped, stats.accepted, "every request gzipped");
}

#[test]
fn grpc_over_mutual_tls_with_gzip() {
    if !require_root() {
        return;
    }
    let pki = Pki::new("tracetap-grpc-ca");
    let (cert, key) = pki.client_files();
    // Dialled by IP literal: the certificate's IP SAN is checked (no SNI is sent).
    let t = Traced::start(
        Options { grpc: true, tls: Some(server_tls(&pki, true)), by_ip: true, ..Options::default() },
        &[
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc".into()),
            ("OTEL_METRICS_EXPORTER", "prometheus,otlp".into()),
            ("OTEL_METRIC_EXPORT_INTERVAL", "300".into()),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip".into()),
            ("OTEL_EXPORTER_OTLP_CERTIFICATE", path(&pki.ca_file())),
            ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", path(&cert)),
            ("OTEL_EXPORTER_OTLP_CLIENT_KEY", path(&key)),
        ],
    );
    assert!(t.receiver.endpoint().starts_with("https://127.0.0.1:"));
    t.send(30);
    t.expect_spans(60);
    let stats = t.receiver.stats();
    assert_eq!(stats.handshake_failures, 0);
    assert_eq!(stats.gzipped, stats.accepted);
    // The agent's own metrics take the same mutual TLS.
    wait_for_metric(&t, "tracetap_requests", 30);
}

#[test]
fn a_collector_asking_to_wait_gets_its_wait_and_nothing_is_lost() {
    if !require_root() {
        return;
    }
    // The first answer asks for a date about 3 s ahead, the second for 1 s; then 200.
    // The date is written when the request is refused, in whole seconds: 3 s on, less a fraction.
    let t = Traced::start(
        Options {
            too_many: vec![RetryAfter::DateIn(Duration::from_secs(3)), RetryAfter::Seconds(1)],
            ..Options::default()
        },
        &[],
    );
    t.send(10);
    t.expect_spans(20);
    let arrivals = t.receiver.arrivals();
    assert!(arrivals.len() >= 3, "{arrivals:?}");
    let (Some(date), Some(second)) = (arrivals[0].1, arrivals[1].1) else {
        panic!("two refusals first: {arrivals:?}");
    };
    assert!(arrivals[2].1.is_none(), "then an acceptance: {arrivals:?}");
    assert!(date > arrivals[0].0 + Duration::from_secs(2), "the date lies ahead: the wait is real");
    assert!(arrivals[1].0 >= date, "retried before the date it was given: {arrivals:?}");
    assert!(arrivals[2].0 >= second, "retried before the 1 s it was given: {arrivals:?}");
    assert_eq!(t.metric("tracetap_export_retries_total"), 2);
    assert_eq!(t.metric("tracetap_spans_dropped_export_failed_total"), 0);
    assert_eq!(t.metric("tracetap_export_failures_total"), 0);
    let _ = &t.rig;
}

/// Waits until the receiver's last value of `name` is `value` (the periodic reader catches up).
fn wait_for_metric(t: &Traced, name: &str, value: i64) -> String {
    let found = wait_for(Duration::from_secs(20), || t.receiver.metric(name).filter(|(v, _)| *v == value));
    let (_, service) = found.unwrap_or_else(|| {
        panic!(
            "{name} never reached {value} over OTLP (last {:?}); agent log:\n{}",
            t.receiver.metric(name),
            t.agent.log()
        )
    });
    service
}

#[test]
fn the_agents_own_metrics_arrive_over_otlp_http_beside_prometheus() {
    if !require_root() {
        return;
    }
    let t = Traced::start(
        Options::default(),
        &[("OTEL_METRICS_EXPORTER", "prometheus,otlp".into()), ("OTEL_METRIC_EXPORT_INTERVAL", "300".into())],
    );
    t.send(25);
    t.expect_spans(50);
    // The same counters as /metrics: once traffic stops, the OTLP values reach the text's.
    assert_eq!(t.metric("tracetap_requests_total"), 25);
    let service = wait_for_metric(&t, "tracetap_requests", 25);
    assert_eq!(service, "haproxy", "the agent's resource");
    let exported = i64::try_from(t.metric("tracetap_spans_exported_total")).unwrap();
    wait_for_metric(&t, "tracetap_spans_exported", exported);
    wait_for_metric(&t, "tracetap_ready", 1);
    assert!(t.receiver.stats().metric_requests >= 2);
}

#[test]
fn the_agents_own_metrics_over_grpc_with_the_prometheus_text_off() {
    if !require_root() {
        return;
    }
    let t = Traced::start(
        Options { grpc: true, ..Options::default() },
        &[
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc".into()),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip".into()),
            ("OTEL_METRICS_EXPORTER", "otlp".into()),
            ("OTEL_METRIC_EXPORT_INTERVAL", "300".into()),
        ],
    );
    t.send(25);
    t.expect_spans(50);
    wait_for_metric(&t, "tracetap_requests", 25);
    wait_for_metric(&t, "tracetap_spans_exported", 50);
    assert_eq!(t.agent.get("/metrics").map(|(s, _)| s), Some(404), "OTEL_METRICS_EXPORTER=otlp: no Prometheus text");
}

#[test]
fn a_stuck_stdout_does_not_stop_the_admin_endpoint() {
    if !require_root() {
        return;
    }
    // No endpoint: spans go to stdout as JSON lines, into a pipe nobody reads.
    let rig = Rig::new();
    let port = free_port();
    let _haproxy = Haproxy::start(&rig.comm, &haproxy::config(port, &[rig.backend.addr], ""), port);
    let agent = Agent::start_with_stdout_unread(&[
        ("TRACETAP_TARGET_COMM", rig.comm.clone()),
        ("OTEL_BSP_MAX_QUEUE_SIZE", "64".into()),
        ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "16".into()),
    ]);
    let front = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    // Far more JSON than a pipe holds (64 KiB): the sink blocks, the queue fills and sheds.
    let mut conn = Conn::connect(front).expect("connect");
    let long = format!("/stuck/{}", "x".repeat(2000));
    let shed = wait_for(Duration::from_mins(1), || {
        for _ in 0..50 {
            assert_eq!(conn.get(&long, &[]).expect("request").status, 200);
        }
        (agent.metric("tracetap_spans_dropped_queue_full_total") > 0).then_some(())
    });
    assert!(shed.is_some(), "the blocked sink must back up into the queue, whose overflow is counted");
    // The liveness probe is answered all along.
    for _ in 0..5 {
        assert_eq!(agent.get("/healthz").map(|(s, _)| s), Some(200), "log:\n{}", agent.log());
    }
    // Shedding can start while the last requests of the round are still in the agent's pipeline:
    // wait for them to be counted rather than read the counter once.
    let counted = wait_for(Duration::from_secs(30), || (agent.metric("tracetap_requests_total") >= 50).then_some(()));
    assert!(counted.is_some(), "requests counted: {}; log:\n{}", agent.metric("tracetap_requests_total"), agent.log());
}

#[test]
fn a_failed_export_of_the_agents_own_metrics_is_counted_and_logged() {
    if !require_root() {
        return;
    }
    // Nothing listens there.
    let nowhere = format!("http://127.0.0.1:{}/v1/metrics", free_port());
    let t = Traced::start(
        Options::default(),
        &[
            ("OTEL_METRICS_EXPORTER", "prometheus,otlp".into()),
            ("OTEL_METRIC_EXPORT_INTERVAL", "200".into()),
            ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", nowhere.clone()),
        ],
    );
    let failed =
        wait_for(Duration::from_secs(20), || (t.metric("tracetap_metrics_export_failures_total") >= 2).then_some(()));
    assert!(failed.is_some(), "log:\n{}", t.agent.log());
    let log = t.agent.log();
    assert!(log.contains("export of the agent's own metrics") && log.contains(&nowhere), "{log}");
    // Spans are not affected.
    t.send(5);
    t.expect_spans(10);
}

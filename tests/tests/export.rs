//! Export as an operator configures it, end to end: the real agent tracing a real HAProxy, exporting
//! to a receiver that decodes with the official definitions. OTLP/HTTP over TLS with a private CA
//! (trusted, then untrusted), mutual TLS, OTLP/gRPC plain and over TLS with gzip, and a collector
//! that answers 429 with `Retry-After`. Every test here needs root (see `require_root`).

use std::time::Duration;

use tracetap_tests::agent::Agent;
use tracetap_tests::client::Conn;
use tracetap_tests::haproxy::{self, Haproxy};
use tracetap_tests::otlp::{Options, Receiver, RetryAfter, ServerTls};
use tracetap_tests::pki::Pki;
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

#[test]
fn https_with_a_private_ca_named_by_the_certificate_variable() {
    if !require_root() {
        return;
    }
    let pki = Pki::new("tracetap-test-ca");
    let t = Traced::start(
        Options { tls: Some(server_tls(&pki, false)), ..Options::default() },
        &[("OTEL_EXPORTER_OTLP_CERTIFICATE", path(&pki.ca_file()))],
    );
    t.send(20);
    t.expect_spans(40);
    assert_eq!(t.receiver.stats().handshake_failures, 0);
    assert_eq!(t.metric("tracetap_export_failures_total"), 0);
}

#[test]
fn an_untrusted_certificate_is_a_counted_failure_and_the_agent_keeps_running() {
    untrusted_certificate(false);
}

#[test]
fn an_untrusted_certificate_over_grpc_is_a_counted_failure_too() {
    untrusted_certificate(true);
}

fn untrusted_certificate(grpc: bool) {
    if !require_root() {
        return;
    }
    let pki = Pki::new("tracetap-untrusted-ca");
    // No OTEL_EXPORTER_OTLP_CERTIFICATE: the system's roots do not know this CA.
    let protocol = if grpc { "grpc" } else { "http/protobuf" };
    let mut t = Traced::start(
        Options { grpc, tls: Some(server_tls(&pki, false)), ..Options::default() },
        &[("OTEL_EXPORTER_OTLP_PROTOCOL", protocol.into())],
    );
    t.send(10);
    let failed = wait_for(Duration::from_secs(20), || {
        (t.metric("tracetap_spans_dropped_export_failed_total") >= 20).then_some(())
    });
    assert!(failed.is_some(), "the failed exports must be counted; log:\n{}", t.agent.log());
    assert!(t.metric("tracetap_export_failures_total") >= 1);
    // A certificate that does not verify is not retried: the next attempt would meet it again.
    assert_eq!(t.metric("tracetap_export_retries_total"), 0, "log:\n{}", t.agent.log());
    assert_eq!(t.metric("tracetap_spans_exported_total"), 0);
    assert!(t.receiver.spans().is_empty());
    // The receiver notes the failed handshake when its accept returns, which can be after the
    // agent counted the failure: waited for, not raced.
    let refused = wait_for(Duration::from_secs(20), || (t.receiver.stats().handshake_failures >= 1).then_some(()));
    assert!(refused.is_some(), "the receiver saw the handshake fail");
    let log = t.agent.log();
    let lines: Vec<_> = log.lines().filter(|l| l.contains("certificate did not verify")).collect();
    assert_eq!(lines.len(), 1, "one clear line (then rate-limited): {log}");
    assert!(lines[0].contains("OTEL_EXPORTER_OTLP_CERTIFICATE"), "it says what to set: {}", lines[0]);
    assert!(t.agent.is_running());
    assert_eq!(t.agent.get("/healthz").map(|(s, _)| s), Some(200));
    // More traffic, more counted failures, still running.
    t.send(5);
    let more = wait_for(Duration::from_secs(20), || {
        (t.metric("tracetap_spans_dropped_export_failed_total") >= 30).then_some(())
    });
    assert!(more.is_some());
    assert!(t.agent.is_running());
}

#[test]
fn mutual_tls_sends_the_client_certificate() {
    if !require_root() {
        return;
    }
    let pki = Pki::new("tracetap-mtls-ca");
    let (cert, key) = pki.client_files();
    let options = Options { tls: Some(server_tls(&pki, true)), ..Options::default() };
    // Without the client certificate the receiver refuses the handshake: counted, nothing lost silently.
    let without = Traced::start(options.clone(), &[("OTEL_EXPORTER_OTLP_CERTIFICATE", path(&pki.ca_file()))]);
    without.send(5);
    let failed = wait_for(Duration::from_secs(20), || {
        (without.metric("tracetap_spans_dropped_export_failed_total") >= 10).then_some(())
    });
    assert!(failed.is_some(), "log:\n{}", without.agent.log());
    assert!(without.receiver.spans().is_empty());
    drop(without);

    let with = Traced::start(
        options,
        &[
            ("OTEL_EXPORTER_OTLP_CERTIFICATE", path(&pki.ca_file())),
            ("OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE", path(&cert)),
            ("OTEL_EXPORTER_OTLP_CLIENT_KEY", path(&key)),
        ],
    );
    with.send(20);
    with.expect_spans(40);
    assert_eq!(with.metric("tracetap_export_failures_total"), 0);
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
    assert!(agent.metric("tracetap_requests_total") >= 50);
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

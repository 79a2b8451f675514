//! Tests of the configuration parse: each passes a map of variables, never the process environment.

use super::*;
use crate::export::settings::{Compression, Protocol};

/// The configuration, or its first bad value.
fn parse(pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
    let map = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    Config::from_map(&map).map_err(|e| e.first().expect("an error").clone())
}

#[test]
fn defaults() {
    let c = parse(&[]).unwrap();
    assert_eq!(c.export.endpoint, None);
    assert_eq!(c.service_name, "haproxy");
    assert_eq!(c.capture_bytes, 4096);
    assert_eq!(c.targets, Targets::Comm("haproxy".into()));
    assert_eq!(c.admin_addr.to_string(), "127.0.0.1:9464");
    assert_eq!(c.max_export_batch_size, 512);
    assert_eq!(c.sampler, Sampler::default());
}

fn endpoint(c: &Config) -> String {
    c.export.endpoint.as_ref().unwrap().to_string()
}

#[test]
fn endpoint_gets_traces_path() {
    let c = parse(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")]).unwrap();
    assert_eq!(endpoint(&c), "http://collector:4318/v1/traces");
    let c =
        parse(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"), ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://t:1/x")])
            .unwrap();
    assert_eq!(endpoint(&c), "http://t:1/x");
    let c = parse(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c")]).unwrap();
    assert_eq!(endpoint(&c), "http://c:80/v1/traces");
    let c = parse(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c.example/otlp")]).unwrap();
    assert_eq!(endpoint(&c), "https://c.example:443/otlp/v1/traces");
    assert!(c.export.endpoint.unwrap().tls);
}

#[test]
fn grpc_takes_the_url_as_given_and_port_4317_by_default() {
    let c = parse(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")]).unwrap();
    assert_eq!(c.export.protocol, Protocol::Grpc);
    assert_eq!(endpoint(&c), "http://c:4317/");
    let c = parse(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:9999/"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"),
    ])
    .unwrap();
    assert_eq!((c.export.protocol, endpoint(&c)), (Protocol::Grpc, "https://c:9999/".to_owned()));
    let c = parse(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")]).unwrap();
    assert_eq!(endpoint(&c), "https://c:443/", "TLS without a port: 443, as every client reads it");
}

#[test]
fn signal_variables_win_over_general_ones() {
    let c = parse(&[
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "5"),
        ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "7"),
        ("OTEL_EXPORTER_OTLP_COMPRESSION", "none"),
        ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip"),
        ("OTEL_EXPORTER_OTLP_HEADERS", "a=1"),
        ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "b=2"),
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/general.pem"),
        ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "/traces.pem"),
        ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "/client.pem"),
        ("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "/client.key"),
    ])
    .unwrap();
    let e = &c.export;
    assert_eq!(e.timeout, Duration::from_millis(7));
    assert_eq!(e.compression, Compression::Gzip);
    assert_eq!(e.headers, vec![("b".to_owned(), "2".to_owned())]);
    let ca = e.tls.certificate.as_ref().unwrap();
    assert_eq!((ca.var, ca.path.to_str().unwrap()), ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "/traces.pem"));
    assert_eq!(e.tls.client_certificate.as_ref().unwrap().var, "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE");
    assert_eq!(e.tls.client_key.as_ref().unwrap().var, "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY");
}

#[test]
fn bad_values_name_the_variable() {
    for (var, value) in [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "ftp://x"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://user:pw@x:4318"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://x:/"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpcs"),
        ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0"),
        ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "zstd"),
        ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "a b=c"),
        ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "/client.pem"),
        ("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "/client.key"),
        ("OTEL_EXPORTER_OTLP_HEADERS", "novalue"),
        // Not an HTTP header name, and a value with a control character (percent-decoded):
        // both used to pass here and fail every export.
        ("OTEL_EXPORTER_OTLP_HEADERS", "api key=secret"),
        ("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=a%0Ab"),
        // Valid headers the exporter sets itself: a second value would fail every export.
        ("OTEL_EXPORTER_OTLP_HEADERS", "Content-Type=text/plain"),
        ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=1,content-length=5"),
        ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "grpc-timeout=1S"),
        // A space in the path used to pass here and make the exporter task panic.
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/v1 traces"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/a b"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:99999"),
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "soon"),
        ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd"),
        ("OTEL_TRACES_SAMPLER", "sometimes"),
        ("OTEL_BSP_MAX_QUEUE_SIZE", "0"),
        ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "5000"),
        ("TRACETAP_ADMIN_ADDR", "nowhere"),
        ("TRACETAP_CAPTURE_BYTES", "100000"),
        ("TRACETAP_CAPTURE_BYTES", "12"),
        ("TRACETAP_PROBE_MODE", "empty"),
        ("TRACETAP_TLS_PROBES", "uprobe"),
        ("TRACETAP_TLS_ROUTE", "kprobe"),
        ("TRACETAP_TARGET_COMM", "a-very-long-command-name"),
        ("TRACETAP_TARGET_PIDS", "12,abc"),
        ("TRACETAP_RING_BYTES", "100000"),
        ("TRACETAP_PROBE_STATS", "yes"),
        ("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "-1"),
        ("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "lots"),
        ("TRACETAP_EXCHANGE_IDLE_TIMEOUT", "0s"),
        ("TRACETAP_EXCHANGE_IDLE_TIMEOUT", "300"),
        ("TRACETAP_EXCHANGE_IDLE_TIMEOUT", "18446744073709551615ms"),
    ] {
        let e = parse(&[(var, value)]).unwrap_err();
        assert_eq!(e.var, var, "{value}");
        assert!(e.to_string().contains(var));
    }
}

#[test]
fn pairs_are_decoded() {
    let c = parse(&[
        ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=a%20b, x = y"),
        ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod"),
    ])
    .unwrap();
    assert_eq!(c.export.headers, vec![("api-key".into(), "a b".into()), ("x".into(), "y".into())]);
    assert_eq!(c.resource_attributes, vec![("deployment.environment".into(), "prod".into())]);
}

#[test]
fn empty_values_mean_unset() {
    let c = parse(&[("OTEL_EXPORTER_OTLP_ENDPOINT", ""), ("TRACETAP_CAPTURE_BYTES", " ")]).unwrap();
    assert_eq!(c.export.endpoint, None);
    assert_eq!(c.capture_bytes, 4096);
}

#[test]
fn tail_is_off_by_default_and_built_from_variables() {
    assert_eq!(parse(&[("TRACETAP_TAIL_LATENCY_MS", "5")]).unwrap().tail, None);
    let c = parse(&[
        ("TRACETAP_TAIL_ENABLED", "true"),
        ("TRACETAP_TAIL_LATENCY_MS", "200"),
        ("TRACETAP_TAIL_RATIO", "0.5"),
        ("TRACETAP_TAIL_GRACE", "500ms"),
        ("TRACETAP_STATE_DIR", "/tmp/tt"),
    ])
    .unwrap();
    let tail = c.tail.unwrap();
    assert_eq!(tail.grace, Duration::from_millis(500));
    assert_eq!(tail.decision_wait, Duration::from_secs(30));
    assert_eq!(tail.state_dir, std::path::PathBuf::from("/tmp/tt"));
    let PolicySource::Env(policies) = tail.policies else { panic!("env policies") };
    let names: Vec<&str> = policies.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["keep_errors", "latency", "probabilistic"]);
    assert_eq!(policies[2].policy, Policy::Probabilistic { threshold: 1 << 55 });
    assert_eq!(tail.journal, Some(Sync::Data), "journaled and synced by default");
    let journal =
        |v| parse(&[("TRACETAP_TAIL_ENABLED", "true"), ("TRACETAP_TAIL_JOURNAL", v)]).unwrap().tail.unwrap().journal;
    assert_eq!((journal("nosync"), journal("off")), (Some(Sync::None), None));
}

#[test]
fn bad_tail_values_name_their_variable() {
    let on = ("TRACETAP_TAIL_ENABLED", "true");
    let cases: [(&[(&str, &str)], &str); 8] = [
        (&[("TRACETAP_TAIL_ENABLED", "yes")], "TRACETAP_TAIL_ENABLED"),
        (&[on, ("TRACETAP_TAIL_GRACE", "2")], "TRACETAP_TAIL_GRACE"),
        (&[on, ("TRACETAP_TAIL_DECISION_WAIT", "400ms")], "TRACETAP_TAIL_DECISION_WAIT"),
        (&[on, ("TRACETAP_TAIL_RATIO", "2")], "TRACETAP_TAIL_RATIO"),
        (&[on, ("TRACETAP_TAIL_KEEP_ERRORS", "false")], "TRACETAP_TAIL_KEEP_ERRORS"),
        (&[on, ("TRACETAP_TAIL_POLICY_FILE", "/p.yaml"), ("TRACETAP_TAIL_RATIO", "0.1")], "TRACETAP_TAIL_POLICY_FILE"),
        (&[on, ("TRACETAP_TAIL_MAX_DISK_BYTES", "10")], "TRACETAP_TAIL_MAX_DISK_BYTES"),
        (&[on, ("TRACETAP_TAIL_JOURNAL", "fsync")], "TRACETAP_TAIL_JOURNAL"),
    ];
    for (vars, var) in cases {
        assert_eq!(parse(vars).unwrap_err().var, var, "{vars:?}");
    }
}

#[test]
fn pod_selector_is_parsed_and_errors_name_the_variable() {
    assert!(parse(&[("TRACETAP_K8S_POD_SELECTOR", "app=haproxy,tier in (edge)")]).unwrap().pod_selector.is_some());
    let e = parse(&[("TRACETAP_K8S_POD_SELECTOR", "tier in edge")]).unwrap_err();
    assert_eq!(e.var, "TRACETAP_K8S_POD_SELECTOR");
}

#[test]
fn readme_table_matches_the_code() {
    let readme = include_str!("../../../docs/configuration.md");
    for (var, default, _) in VARIABLES {
        let row = readme
            .lines()
            .find(|l| l.starts_with(&format!("| `{var}` |")))
            .unwrap_or_else(|| panic!("docs/configuration.md's table lacks {var}"));
        assert!(row.contains(default), "docs/configuration.md's row of {var} must show the default {default}: {row}");
    }
    for row in readme.lines().filter(|l| l.starts_with("| `OTEL_") || l.starts_with("| `TRACETAP_")) {
        assert!(
            VARIABLES.iter().any(|(var, _, _)| row.starts_with(&format!("| `{var}` |"))),
            "docs/configuration.md documents a variable the code does not read: {row}"
        );
    }
}

#[test]
fn documented_defaults_are_the_parsed_defaults() {
    let c = parse(&[]).unwrap();
    let doc = |var: &str| VARIABLES.iter().find(|(v, _, _)| *v == var).unwrap().1;
    assert_eq!(doc("OTEL_EXPORTER_OTLP_TIMEOUT"), c.export.timeout.as_millis().to_string());
    assert_eq!(doc("OTEL_BSP_SCHEDULE_DELAY"), c.schedule_delay.as_millis().to_string());
    assert_eq!(doc("OTEL_BSP_MAX_QUEUE_SIZE"), c.max_queue_size.to_string());
    assert_eq!(doc("OTEL_BSP_MAX_EXPORT_BATCH_SIZE"), c.max_export_batch_size.to_string());
    assert_eq!(doc("TRACETAP_ADMIN_ADDR"), c.admin_addr.to_string());
    assert_eq!(doc("TRACETAP_CAPTURE_BYTES"), c.capture_bytes.to_string());
    assert_eq!(doc("TRACETAP_REJECTED_SPANS_PER_SECOND"), c.rejected_spans_per_second.to_string());
    // The span builder's own default (a builder made without a configuration) is the table's.
    assert_eq!(doc("TRACETAP_REJECTED_SPANS_PER_SECOND"), crate::spans::DEFAULT_REJECTED_SPANS_PER_SECOND.to_string());
    assert_eq!(doc("TRACETAP_RING_BYTES"), c.ring_bytes.to_string());
    assert_eq!(doc("OTEL_SERVICE_NAME"), c.service_name);
    assert_eq!(doc("TRACETAP_EXCHANGE_IDLE_TIMEOUT"), format!("{}s", c.exchange_idle_timeout.as_secs()));
    assert!(doc("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT").contains("no limit"));
    assert_eq!(c.attribute_value_length_limit, None);
}

/// Every default the help table (and so `--help` and docs/configuration.md) writes as a value is
/// the parser's own: setting the variable to it changes nothing. Tail variables are compared with
/// tail sampling on, where they are read. A default written as a description, `(unset)` and the
/// like, is not a value.
#[test]
fn every_written_default_parses_to_what_unset_gives() {
    let tail_on = ("TRACETAP_TAIL_ENABLED", "true");
    let mut compared = 0;
    for &(var, default, _) in VARIABLES {
        if default.starts_with('(') {
            continue;
        }
        let base: &[(&str, &str)] = if var == "TRACETAP_TAIL_ENABLED" { &[] } else { &[tail_on] };
        let with_default: Vec<(&str, &str)> = base.iter().copied().chain([(var, default)]).collect();
        let unset = parse(base).expect("the base configuration parses");
        assert_eq!(
            parse(&with_default),
            Ok(unset),
            "{var}={default}, the written default, must parse as the variable unset does"
        );
        compared += 1;
    }
    assert!(compared >= 34, "every written default was compared: {compared}");
}

/// The parser reads a default from the table; a default the table writes as a description is no
/// value to read, and a variable missing from the table has none: both are defects found here.
#[test]
#[should_panic(expected = "a description, not a value")]
fn a_default_written_as_a_description_is_not_read_as_a_value() {
    let _ = written_default("TRACETAP_TAIL_LATENCY_MS");
}

#[test]
#[should_panic(expected = "is not in VARIABLES")]
fn a_variable_missing_from_the_table_has_no_default() {
    let _ = written_default("TRACETAP_NOT_A_VARIABLE");
}

#[test]
fn span_value_length_limit_wins_over_the_general_one() {
    assert_eq!(parse(&[]).unwrap().attribute_value_length_limit, None, "no limit by default");
    let limit = |pairs: &[(&str, &str)]| parse(pairs).unwrap().attribute_value_length_limit;
    assert_eq!(limit(&[("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "128")]), Some(128));
    assert_eq!(limit(&[("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", " 64 ")]), Some(64));
    assert_eq!(
        limit(&[("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "128"), ("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "64")]),
        Some(64)
    );
    assert_eq!(
        limit(&[("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "128"), ("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "")]),
        Some(128),
        "an empty value is unset"
    );
    assert_eq!(limit(&[("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "0")]), Some(0));
    let e = parse(&[("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "1k"), ("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "64")])
        .unwrap_err();
    assert_eq!(e.var, "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "a bad value is an error even when overridden");
    assert!(e.to_string().contains("whole number of characters"), "{e}");
}

#[test]
fn exchange_idle_timeout_takes_a_duration() {
    assert_eq!(parse(&[]).unwrap().exchange_idle_timeout, Duration::from_mins(5));
    let c = parse(&[("TRACETAP_EXCHANGE_IDLE_TIMEOUT", "90s")]).unwrap();
    assert_eq!(c.exchange_idle_timeout, Duration::from_secs(90));
    let c = parse(&[("TRACETAP_EXCHANGE_IDLE_TIMEOUT", "1500ms")]).unwrap();
    assert_eq!(c.exchange_idle_timeout.as_nanos(), 1_500_000_000);
    let e = parse(&[("TRACETAP_EXCHANGE_IDLE_TIMEOUT", "-5s")]).unwrap_err();
    assert_eq!(e.var, "TRACETAP_EXCHANGE_IDLE_TIMEOUT");
    assert!(e.to_string().contains("positive duration"), "{e}");
}

#[test]
fn pids_select_pid_targets() {
    let c = parse(&[("TRACETAP_TARGET_PIDS", "10, 20")]).unwrap();
    assert_eq!(c.targets, Targets::Pids(vec![10, 20]));
}

/// The variables `Config::from_map` reports as bad, in order.
fn bad_vars(pairs: &[(&str, &str)]) -> Vec<&'static str> {
    let map = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    Config::from_map(&map).unwrap_err().0.iter().map(|e| e.var).collect()
}

#[test]
fn every_bad_variable_is_reported_at_once() {
    let pairs = [
        ("OTEL_BSP_MAX_QUEUE_SIZE", "many"),
        ("TRACETAP_RING_BYTES", "1000"),
        ("TRACETAP_TLS_ROUTE", "kprobe"),
        ("TRACETAP_TAIL_ENABLED", "true"),
        ("TRACETAP_TAIL_GRACE", "soon"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
    ];
    assert_eq!(
        bad_vars(&pairs),
        [
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "OTEL_BSP_MAX_QUEUE_SIZE",
            "TRACETAP_RING_BYTES",
            "TRACETAP_TLS_ROUTE",
            "TRACETAP_TAIL_GRACE"
        ]
    );
    let map = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    assert_eq!(Config::from_map(&map).unwrap_err().to_string().lines().count(), 5);
    // A batch size is checked against a queue size only when that one is good.
    assert_eq!(
        bad_vars(&[("OTEL_BSP_MAX_QUEUE_SIZE", "x"), ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4096")]),
        ["OTEL_BSP_MAX_QUEUE_SIZE"]
    );
    // Read by the spans' and the metrics' exporters alike: said once.
    assert_eq!(
        bad_vars(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"), ("OTEL_METRICS_EXPORTER", "otlp")]),
        ["OTEL_EXPORTER_OTLP_PROTOCOL"]
    );
}

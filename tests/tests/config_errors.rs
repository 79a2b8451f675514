//! The binary refuses bad configuration with exit status 2 and names the variable. Needs no root:
//! configuration is checked before anything touches the kernel.

use std::process::Command;

fn run_with(var: &str, value: &str) -> (Option<i32>, String) {
    let out = Command::new(tracetap_tests::agent::binary()).env_clear().env(var, value).output().expect("run tracetap");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn bad_values_exit_2_and_name_the_variable() {
    for (var, value) in [
        ("OTEL_TRACES_SAMPLER", "sometimes"),
        ("OTEL_TRACES_SAMPLER_ARG", "1.5"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "ftp://collector"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/v1 traces"),
        ("OTEL_EXPORTER_OTLP_HEADERS", "api key=secret"),
        ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "lots"),
        ("TRACETAP_CAPTURE_BYTES", "99999"),
        ("TRACETAP_ADMIN_ADDR", "localhost"),
        ("TRACETAP_TARGET_PIDS", "x"),
    ] {
        let env_var = if var == "OTEL_TRACES_SAMPLER_ARG" { "OTEL_TRACES_SAMPLER_ARG" } else { var };
        let mut cmd = Command::new(tracetap_tests::agent::binary());
        cmd.env_clear().env(env_var, value);
        if var == "OTEL_TRACES_SAMPLER_ARG" {
            cmd.env("OTEL_TRACES_SAMPLER", "traceidratio");
        }
        let out = cmd.output().expect("run tracetap");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}={value}: {stderr}");
        assert!(stderr.contains(var), "{var}={value}: message must name the variable: {stderr}");
    }
}

/// Every bad variable is named in one run, each on a line of its own, so an operator fixes them
/// all before the next restart.
#[test]
fn every_bad_variable_is_named_at_once() {
    let out = Command::new(tracetap_tests::agent::binary())
        .env_clear()
        .env("OTEL_TRACES_SAMPLER", "sometimes")
        .env("TRACETAP_CAPTURE_BYTES", "99999")
        .env("TRACETAP_ADMIN_ADDR", "localhost")
        .output()
        .expect("run tracetap");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| l.starts_with("tracetap: configuration error: ")).collect();
    assert_eq!(lines.len(), 3, "{stderr}");
    for (line, var) in lines.iter().zip(["OTEL_TRACES_SAMPLER", "TRACETAP_ADMIN_ADDR", "TRACETAP_CAPTURE_BYTES"]) {
        assert!(line.contains(var), "{line}");
    }
}

#[test]
fn help_lists_every_variable() {
    let out = Command::new(tracetap_tests::agent::binary()).arg("--help").output().expect("run tracetap");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for var in ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER", "TRACETAP_CAPTURE_BYTES", "TRACETAP_ADMIN_ADDR"] {
        assert!(text.contains(var), "{var} missing from --help");
    }
    let (code, _) = run_with("TRACETAP_RING_BYTES", "3");
    assert_eq!(code, Some(2));
}

#[test]
fn a_bad_tail_policy_file_exits_2_and_names_the_policy_and_field() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("policies.yaml");
    std::fs::write(
        &file,
        "policies:\n  - name: slow\n    type: latency\n    latency: { threshold_ms: 500, upper_threshold_ms: 100 }\n",
    )
    .expect("write policy file");
    let out = Command::new(tracetap_tests::agent::binary())
        .env_clear()
        .env("TRACETAP_TAIL_ENABLED", "true")
        .env("TRACETAP_TAIL_POLICY_FILE", &file)
        .env("TRACETAP_STATE_DIR", dir.path())
        .output()
        .expect("run tracetap");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for part in ["TRACETAP_TAIL_POLICY_FILE", "\"slow\"", "latency.upper_threshold_ms"] {
        assert!(stderr.contains(part), "the message names {part}: {stderr}");
    }
    let missing = Command::new(tracetap_tests::agent::binary())
        .env_clear()
        .env("TRACETAP_TAIL_ENABLED", "true")
        .env("TRACETAP_TAIL_POLICY_FILE", dir.path().join("absent.yaml"))
        .output()
        .expect("run tracetap");
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("cannot read"));
}

#[test]
fn the_command_line_names_its_commands_and_refuses_anything_else() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let out = Command::new(tracetap_tests::agent::binary())
            .env_clear()
            .envs(env.iter().copied())
            .args(args)
            .output()
            .expect("run tracetap");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stdout, _) = run(&["--version"], &[]);
    assert_eq!((code, stdout.trim()), (Some(0), format!("tracetap {}", env!("CARGO_PKG_VERSION")).as_str()));
    let (code, stdout, _) = run(&["--help"], &[]);
    assert_eq!(code, Some(0));
    assert!(stdout.contains("haproxy-snippet") && stdout.contains("TRACETAP_TARGET_COMM"), "{stdout}");
    // Unknown arguments used to be ignored and the agent started; now: exit 2 with the usage,
    // before any configuration is read (a bad variable is not what is reported).
    for args in [&["--verbose"][..], &["run"], &["--help", "x"], &["haproxy-snippet", "--respons"]] {
        let (code, stdout, stderr) = run(args, &[("OTEL_TRACES_SAMPLER", "sometimes")]);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stdout.is_empty() && stderr.contains("usage: tracetap"), "{args:?}: {stderr}");
        assert!(stderr.contains(args.last().unwrap().trim_start_matches('-')), "{args:?} named: {stderr}");
    }
    let (code, stdout, _) = run(&["haproxy-snippet", "--help"], &[]);
    assert_eq!(code, Some(0));
    assert!(stdout.contains("--response"), "{stdout}");
}

#[test]
fn the_snippet_exits_2_naming_what_it_cannot_express() {
    for (env, var) in [
        (&[("TRACETAP_TAIL_ENABLED", "true")][..], "TRACETAP_TAIL_ENABLED"),
        (&[("OTEL_TRACES_SAMPLER", "jaeger_remote")], "OTEL_TRACES_SAMPLER"),
        (&[("OTEL_TRACES_SAMPLER", "traceidratio"), ("OTEL_TRACES_SAMPLER_ARG", "-1")], "OTEL_TRACES_SAMPLER_ARG"),
    ] {
        let out = Command::new(tracetap_tests::agent::binary())
            .env_clear()
            .envs(env.iter().copied())
            .arg("haproxy-snippet")
            .output()
            .expect("run tracetap");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{env:?}: {stderr}");
        assert!(stderr.contains(var) && out.stdout.is_empty(), "{env:?}: {stderr}");
    }
}

/// Every export variable added for TLS and gRPC: a bad value (or a file that is missing or not
/// what the variable names) exits 2 at start, naming the variable that was read.
#[test]
#[expect(clippy::too_many_lines, reason = "a table of cases, one variable each")]
fn bad_export_tls_and_grpc_values_exit_2_and_name_the_variable() {
    let pki = tracetap_tests::pki::Pki::new("config-errors-ca");
    let dir = pki.dir();
    let (client_cert, client_key) = pki.client_files();
    let not_pem = dir.join("not.pem");
    std::fs::write(&not_pem, "this is not PEM\n").expect("write");
    let other_key = dir.join("other.key");
    std::fs::write(&other_key, tracetap_tests::pki::Pki::new("other").client_key_pem).expect("write");
    let missing = dir.join("missing.pem").display().to_string();
    let (ca, cert, key) =
        (pki.ca_file().display().to_string(), client_cert.display().to_string(), client_key.display().to_string());
    let https = ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://localhost:4318".to_owned());
    let cases: Vec<(&str, Vec<(&str, String)>)> = vec![
        ("OTEL_EXPORTER_OTLP_PROTOCOL", vec![("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json".into())]),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", vec![("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpcs".into())]),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            vec![
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc".into()),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317/otlp".into()),
            ],
        ),
        ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", vec![("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0".into())]),
        ("OTEL_METRICS_EXPORTER", vec![("OTEL_METRICS_EXPORTER", "statsd".into())]),
        (
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            vec![("OTEL_METRICS_EXPORTER", "otlp".into()), ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "ftp://c".into())],
        ),
        (
            "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
            vec![("OTEL_METRICS_EXPORTER", "otlp".into()), ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "a b=c".into())],
        ),
        (
            "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION",
            vec![("OTEL_METRICS_EXPORTER", "otlp".into()), ("OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", "zstd".into())],
        ),
        (
            "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT",
            vec![("OTEL_METRICS_EXPORTER", "otlp".into()), ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "-5".into())],
        ),
        (
            "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE",
            vec![
                ("OTEL_METRICS_EXPORTER", "otlp".into()),
                ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "https://localhost:4318/v1/metrics".into()),
                ("OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE", not_pem.display().to_string()),
                ("OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY", key.clone()),
            ],
        ),
        (
            "OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY",
            vec![
                ("OTEL_METRICS_EXPORTER", "otlp".into()),
                ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "https://localhost:4318/v1/metrics".into()),
                ("OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE", cert.clone()),
                ("OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY", missing.clone()),
            ],
        ),
        (
            "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
            vec![
                https.clone(),
                ("OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE", missing.clone()),
                ("OTEL_EXPORTER_OTLP_CLIENT_KEY", key.clone()),
            ],
        ),
        (
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            vec![("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:0/v1/traces".into())],
        ),
        ("OTEL_EXPORTER_OTLP_HEADERS", vec![("OTEL_EXPORTER_OTLP_HEADERS", "content-type=text/plain".into())]),
        ("OTEL_METRIC_EXPORT_INTERVAL", vec![("OTEL_METRIC_EXPORT_INTERVAL", "soon".into())]),
        (
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
            vec![("OTEL_METRICS_EXPORTER", "otlp".into()), ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "udp".into())],
        ),
        (
            "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE",
            vec![
                ("OTEL_METRICS_EXPORTER", "otlp".into()),
                ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "https://localhost:4318/v1/metrics".into()),
                ("OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE", missing.clone()),
            ],
        ),
        ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", vec![("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "br".into())]),
        ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", vec![("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "a b=c".into())]),
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", vec![https.clone(), ("OTEL_EXPORTER_OTLP_CERTIFICATE", missing.clone())]),
        (
            "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
            vec![https.clone(), ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", not_pem.display().to_string())],
        ),
        (
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
            vec![https.clone(), ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", cert.clone())],
        ),
        (
            "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY",
            vec![https.clone(), ("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", key.clone())],
        ),
        (
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
            vec![
                https.clone(),
                ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", not_pem.display().to_string()),
                ("OTEL_EXPORTER_OTLP_CLIENT_KEY", key.clone()),
            ],
        ),
        (
            "OTEL_EXPORTER_OTLP_CLIENT_KEY",
            vec![
                https.clone(),
                ("OTEL_EXPORTER_OTLP_CERTIFICATE", ca.clone()),
                ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", cert.clone()),
                ("OTEL_EXPORTER_OTLP_CLIENT_KEY", other_key.display().to_string()),
            ],
        ),
        (
            "OTEL_EXPORTER_OTLP_CLIENT_KEY",
            vec![
                https.clone(),
                ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", cert.clone()),
                ("OTEL_EXPORTER_OTLP_CLIENT_KEY", missing.clone()),
            ],
        ),
    ];
    for (var, env) in cases {
        let out = Command::new(tracetap_tests::agent::binary())
            .env_clear()
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .expect("run tracetap");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{env:?}: {stderr}");
        assert!(stderr.contains(&format!("{var}=")), "{env:?}: the message must name {var}: {stderr}");
    }
}

//! `make demo` (scripts/demo.sh), run as an operator runs it, with this run's agent: an edge
//! HAProxy with a TLS frontend, an HTTP/2 client, a slow request, a failing one, one the server
//! never answers in time and one HAProxy rejects, each printed as a waterfall by `tracetap view`
//! with HAProxy's timers and termination states.
#![cfg(target_os = "linux")]

use std::path::Path;
use std::process::Command;

use tracetap_tests::{agent, require_root};

/// The value of a timer on a waterfall line (`response=300.987`), 0 without it.
fn timer(line: &str, name: &str) -> f64 {
    line.split_whitespace().find_map(|word| word.strip_prefix(name)?.strip_prefix('=')?.parse().ok()).unwrap_or(0.0)
}

#[test]
fn the_demo_prints_a_waterfall_for_each_kind_of_request() {
    if !require_root() {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("repository root");
    // Bounded: a stuck demo must fail the test, not hang it.
    let out = Command::new("timeout")
        .arg("120")
        .arg(root.join("scripts/demo.sh"))
        .current_dir(root)
        .env("TRACETAP_BIN", agent::binary())
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .output()
        .expect("run scripts/demo.sh");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "demo failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let servers: Vec<&str> = text.lines().filter(|l| l.contains("| SERVER ")).collect();
    let has = |pattern: &str| servers.iter().any(|l| l.contains(pattern));
    let wanted = [
        ("seven requests, seven traces", servers.len() == 7),
        ("a normal end with timers", has("  --  request_head=")),
        (
            "a slow request's server response time, 300 ms or more",
            servers.iter().any(|l| timer(l, "response") >= 300.0),
        ),
        ("the failing request", has("error.type=500")),
        ("the server timeout", has("error.type=504  sH")),
        ("the rejected request", has("error.type=400  PR")),
        ("CLIENT spans under SERVER spans", text.lines().any(|l| l.contains("|   CLIENT GET be_app"))),
        ("the trace the client's traceparent continued", text.contains("trace 4bf92f3577b34da6a3ce929d0e0e4736")),
    ];
    let missing: Vec<&str> = wanted.iter().filter(|(_, ok)| !ok).map(|(what, _)| *what).collect();
    assert!(missing.is_empty(), "the demo's output lacks {missing:?}:\n{text}");
}

//! `make demo` (scripts/demo.sh), run as an operator runs it, with this run's agent: an edge
//! HAProxy with a TLS frontend, an HTTP/2 client, a slow request, a failing one, one the server
//! never answers in time and one HAProxy rejects, each printed as a waterfall by `tracetap view`
//! with HAProxy's timers and termination states.
#![cfg(target_os = "linux")]

use std::path::Path;
use std::process::Command;

use tracetap_tests::{agent, require_root};

#[test]
fn the_demo_prints_a_waterfall_for_each_kind_of_request() {
    if !require_root() {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("repository root");
    let out = Command::new(root.join("scripts/demo.sh"))
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
            "a slow request's server response time",
            servers.iter().any(|l| l.contains("response=3") && l.contains("200")),
        ),
        ("the failing request", has("error.type=500")),
        ("the server timeout", has("error.type=504  sH")),
        ("the rejected request", has("error.type=400  PR")),
        ("CLIENT spans under SERVER spans", text.lines().any(|l| l.contains("|   CLIENT GET be_app"))),
    ];
    let missing: Vec<&str> = wanted.iter().filter(|(_, ok)| !ok).map(|(what, _)| *what).collect();
    assert!(missing.is_empty(), "the demo's output lacks {missing:?}:\n{text}");
}

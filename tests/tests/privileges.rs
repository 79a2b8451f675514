//! Without the privileges to load eBPF, the agent exits with status 1 and says what to grant.
//! Runs as root (like CI) and drops to `nobody` with no capabilities for the agent.

use std::process::Command;

use tracetap_tests::{free_port, require_root};

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

//! Support for tracetap's end-to-end tests: a real `HAProxy` (Debian's package) on loopback ports,
//! a backend HTTP server, an OTLP/HTTP receiver that decodes with `opentelemetry-proto`, a small
//! blocking HTTP/1.1 client, and the real `tracetap` binary.
//!
//! Tests that load eBPF need root: [`require_root`] fails the test without it, unless the caller
//! opts out explicitly with `TRACETAP_TESTS_SKIP_PRIVILEGED=1`.
#![forbid(unsafe_code)]

pub mod agent;
pub mod backend;
pub mod client;
pub mod haproxy;
pub mod otlp;

use std::net::TcpListener;
use std::time::{Duration, Instant};

/// Fails the test when not root, because the agent cannot load its probes. Returns false (and the
/// test must return at once) only when `TRACETAP_TESTS_SKIP_PRIVILEGED=1` is set.
#[must_use]
pub fn require_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let euid_is_root = status
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .and_then(|l| l.split_whitespace().nth(2))
        .is_some_and(|euid| euid == "0");
    if euid_is_root {
        return true;
    }
    if std::env::var("TRACETAP_TESTS_SKIP_PRIVILEGED").as_deref() == Ok("1") {
        eprintln!("SKIPPED: not root and TRACETAP_TESTS_SKIP_PRIVILEGED=1");
        return false;
    }
    panic!(
        "this end-to-end test loads eBPF probes and must run as root (CI does); set TRACETAP_TESTS_SKIP_PRIVILEGED=1 to skip it knowingly"
    );
}

/// A free loopback TCP port (bound and released; good enough for tests on one machine).
#[must_use]
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0").local_addr().expect("local addr").port()
}

/// Polls `check` every 50 ms until it returns `Some` or `timeout` passes.
pub fn wait_for<T>(timeout: Duration, mut check: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A runtime shared by the servers of one test.
#[must_use]
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime")
}

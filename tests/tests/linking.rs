//! Linking accuracy end to end, one test per scenario, each run on every HAProxy version
//! (`haproxy::versions()`): 24 concurrent keep-alive clients send identical `GET /same` requests
//! through a real HAProxy, each asking the backend for its own status and a 0-15 ms delay. A
//! CLIENT span is linked right when its SERVER span has the same status and contains it in time;
//! at least 99.9% must be, and every request must have exactly one SERVER span. Scenarios:
//! keep-alive clients at 1 and 4 threads; connection churn (clients reconnecting every 3 requests)
//! with each `http-reuse` mode and with a server queue, at 1 and 4 threads; rewrites (path, URI,
//! query, headers) at 4 threads; and a few of them again with requests identical byte for byte
//! (the backend picks the statuses). The driver and the accuracy computation live in
//! `tracetap_tests::linking`. Each test prints a `scenario=... pct=...` line per version (see
//! `--nocapture`). Needs root.

use tracetap_tests::linking::{Scenario, run_on};
use tracetap_tests::{haproxy, require_root};

/// Runs `scenario` on every `HAProxy` version, prints its figures, and fails with every problem
/// found (after all versions ran, so the figures of each are shown).
fn check(scenario: &Scenario) {
    if !require_root() {
        return;
    }
    let mut failures = Vec::new();
    for version in haproxy::versions() {
        let report = run_on(version, scenario);
        eprintln!("{}", report.summary());
        failures.extend(report.failures());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn identical_requests_nbthread_1() {
    check(&Scenario::new("identical_nbthread_1").nbthread(1));
}

#[test]
fn identical_requests_nbthread_4() {
    check(&Scenario::new("identical_nbthread_4").nbthread(4));
}

/// Connection churn: every client opens a new connection after 3 requests, so `HAProxy` keeps
/// making server connections (or reusing idle ones of other sessions, as the mode allows).
const CHURN: usize = 3;

fn churn(name: &'static str, nbthread: u32, backend_line: &str) -> Scenario {
    Scenario::new(name).nbthread(nbthread).reconnect_every(CHURN).backend(backend_line)
}

#[test]
fn http_reuse_never_nbthread_1() {
    check(&churn("http_reuse_never_nbthread_1", 1, "http-reuse never"));
}

#[test]
fn http_reuse_never_nbthread_4() {
    check(&churn("http_reuse_never_nbthread_4", 4, "http-reuse never"));
}

#[test]
fn http_reuse_safe_nbthread_1() {
    check(&churn("http_reuse_safe_nbthread_1", 1, "http-reuse safe"));
}

#[test]
fn http_reuse_safe_nbthread_4() {
    check(&churn("http_reuse_safe_nbthread_4", 4, "http-reuse safe"));
}

#[test]
fn http_reuse_always_nbthread_1() {
    check(&churn("http_reuse_always_nbthread_1", 1, "http-reuse always"));
}

#[test]
fn http_reuse_always_nbthread_4() {
    check(&churn("http_reuse_always_nbthread_4", 4, "http-reuse always"));
}

/// Server `maxconn 3` for 24 clients: requests wait in the server's queue, with churn as above.
fn queue(name: &'static str, nbthread: u32) -> Scenario {
    churn(name, nbthread, "timeout queue 30s").server_options("maxconn 3")
}

#[test]
fn server_maxconn_queue_nbthread_1() {
    check(&queue("server_maxconn_queue_nbthread_1", 1));
}

#[test]
fn server_maxconn_queue_nbthread_4() {
    check(&queue("server_maxconn_queue_nbthread_4", 4));
}

#[test]
fn set_path() {
    check(&Scenario::new("set_path").backend("http-request set-path /v2%[path]").backend_target("/v2/same"));
}

#[test]
fn replace_path() {
    check(
        &Scenario::new("replace_path")
            .backend(r"http-request replace-path /same(.*) /renamed\1")
            .backend_target("/renamed"),
    );
}

#[test]
fn set_uri() {
    check(
        &Scenario::new("set_uri")
            .backend("http-request set-uri /moved%[path]?from=uri")
            .backend_target("/moved/same?from=uri"),
    );
}

#[test]
fn set_query() {
    check(&Scenario::new("set_query").backend("http-request set-query q=1").backend_target("/same?q=1"));
}

#[test]
fn headers_added_and_removed() {
    check(
        &Scenario::new("headers_added_and_removed")
            .backend("http-request set-header X-Added 1")
            .backend("http-request del-header User-Agent")
            .backend_headers(&["x-added"], &["user-agent"]),
    );
}

// The same scenarios with requests identical byte for byte: the backend picks each status (in
// turn) and delay itself, so no request header (which a linker could fingerprint) tells two
// requests apart; only the statuses of their responses do.

#[test]
fn identical_requests_same_bytes_nbthread_1() {
    check(&Scenario::new("identical_same_bytes_nbthread_1").nbthread(1).same_bytes());
}

#[test]
fn http_reuse_safe_same_bytes_nbthread_1() {
    check(&churn("http_reuse_safe_same_bytes_nbthread_1", 1, "http-reuse safe").same_bytes());
}

#[test]
fn server_maxconn_queue_same_bytes_nbthread_1() {
    check(&queue("server_maxconn_queue_same_bytes_nbthread_1", 1).same_bytes());
}

#[test]
fn set_path_same_bytes() {
    check(
        &Scenario::new("set_path_same_bytes")
            .backend("http-request set-path /v2%[path]")
            .backend_target("/v2/same")
            .same_bytes(),
    );
}

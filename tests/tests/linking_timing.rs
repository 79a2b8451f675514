//! Linking accuracy judged by timing, not by status: 24 concurrent keep-alive clients send
//! requests identical byte for byte (`GET /same`, `x-token-echo: 1`, `x-delay-ms: random`) through
//! a real HAProxy; the backend answers every one 200 after 0-15 ms with a token of its own and
//! records when it served that token. A CLIENT span is right when the backend exchange of its
//! SERVER span's request (tied by client port and order) lies inside it in time, and it lies
//! inside its SERVER span; at least 99.9% must be, and every request must have exactly one SERVER
//! span. See `tracetap_tests::linking::timing`. Each scenario runs on every HAProxy version and
//! prints a `timing scenario=... pct=...` line per version (see `--nocapture`), with the status
//! judge's count on the same spans (`status_judge_right`, which all-200 traffic cannot fail).
//! The `control_` tests run two of the scenarios with statuses cycled by the backend (concurrent
//! requests get different ones, as in `linking.rs`): the tracker has statuses to go by there, and
//! both judges must agree. Needs root.

use tracetap_tests::linking::Scenario;
use tracetap_tests::linking::timing::{Statuses, run_on};
use tracetap_tests::{haproxy, require_root};

/// Runs `scenario` on every `HAProxy` version, every response 200, prints its figures, and fails
/// with every problem found (after all versions ran, so the figures of each are shown).
fn check(scenario: &Scenario) {
    check_with(scenario, Statuses::AllOk);
}

fn check_with(scenario: &Scenario, statuses: Statuses) {
    if !require_root() {
        return;
    }
    let mut failures = Vec::new();
    for version in haproxy::versions() {
        let report = run_on(version, scenario, statuses);
        eprintln!("{}", report.summary());
        failures.extend(report.failures());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn timing_identical_nbthread_1() {
    check(&Scenario::new("timing_identical_nbthread_1").nbthread(1));
}

#[test]
fn timing_identical_nbthread_4() {
    check(&Scenario::new("timing_identical_nbthread_4").nbthread(4));
}

/// Clients reconnect every 3 requests and `HAProxy` may reuse idle server connections of other
/// sessions: it then writes backend requests in another order than it read the frontend ones.
#[test]
fn timing_http_reuse_safe_nbthread_1() {
    check(
        &Scenario::new("timing_http_reuse_safe_nbthread_1").nbthread(1).reconnect_every(3).backend("http-reuse safe"),
    );
}

/// Server `maxconn 3` for 24 clients (reconnecting every 3 requests): requests wait in the
/// server's queue.
#[test]
fn timing_server_maxconn_queue_nbthread_1() {
    check(
        &Scenario::new("timing_server_maxconn_queue_nbthread_1")
            .nbthread(1)
            .reconnect_every(3)
            .backend("timeout queue 30s")
            .server_options("maxconn 3"),
    );
}

#[test]
fn timing_set_path() {
    check(&Scenario::new("timing_set_path").backend("http-request set-path /v2%[path]").backend_target("/v2/same"));
}

// Controls: the same traffic with statuses the backend cycles through, where the tracker can
// confirm links by status; the timing judge must find them right too.

#[test]
fn control_http_reuse_safe_cycled_statuses_nbthread_1() {
    check_with(
        &Scenario::new("control_http_reuse_safe_cycled_statuses_nbthread_1")
            .nbthread(1)
            .reconnect_every(3)
            .backend("http-reuse safe"),
        Statuses::Cycled,
    );
}

#[test]
fn control_identical_cycled_statuses_nbthread_4() {
    check_with(&Scenario::new("control_identical_cycled_statuses_nbthread_4").nbthread(4), Statuses::Cycled);
}

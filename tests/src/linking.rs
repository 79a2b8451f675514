//! Linking accuracy scenarios: many concurrent keep-alive clients send *identical* requests
//! (same method and target) through a real `HAProxy`; each request asks the backend, by headers,
//! for its own status and its own delay (see [`crate::backend`]). A CLIENT span is linked right
//! when its parent SERVER span has the same status and contains it in time. Requests in flight at
//! the same moment always ask for different statuses (every client has its own statuses, used in
//! turn), so a CLIENT span put under a concurrent request's SERVER span shows as a status mismatch.
//! With [`Scenario::same_bytes`] the requests carry no per-request header at all: the backend picks
//! each status in turn from [`statuses`] (so concurrent requests still get different ones) and
//! each delay, and the client learns its status from the response.
//!
//! [`run`] drives one [`Scenario`] and returns a [`Report`]; [`accuracy`] is the computation alone.
//!
//! These scenarios judge links by status, which the tracker itself confirms links with; [`timing`]
//! judges them independently of statuses, on traffic where every response is 200.

pub mod timing;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use crate::client::Conn;
use crate::otlp::Received;
use crate::{Stack, haproxy, wait_for};

/// Statuses a backend can answer with that `HAProxy` relays unchanged and that carry an ordinary
/// body: 2xx except 204/205 (no body), and 4xx except those with connection or authentication
/// semantics (401/407 make a server connection private for `http-reuse`, 408 closes, 413/414/417,
/// 421, 425, 426 and 429 have meanings proxies may act on). No 1xx, 3xx-without-`Location` games
/// or 5xx (which retry and error policies treat specially).
#[must_use]
pub fn statuses() -> Vec<u16> {
    let twos = (200..300).filter(|s| *s != 204 && *s != 205);
    let fours = [400, 402, 403, 404, 405, 406, 409, 410, 411, 412, 415, 416, 418, 422, 423, 424, 428, 431, 451];
    twos.chain(fours).collect()
}

/// One linking scenario: `clients` keep-alive connections, each sending `per_client` requests
/// `GET {path}` one after the other, through `HAProxy` with `nbthread` threads and the test
/// backend as its only server.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: &'static str,
    pub nbthread: u32,
    /// Lines added to `backend be_app` (indented, each ending with a newline).
    pub backend_lines: String,
    /// Options appended to the `server` line (`maxconn 3`).
    pub server_options: String,
    pub clients: usize,
    pub per_client: usize,
    /// When not 0, each client opens a new connection after this many requests (churn on the
    /// client side: new sessions, new server connections unless `HAProxy` reuses idle ones).
    pub reconnect_every: usize,
    /// The request target every client sends.
    pub path: &'static str,
    /// Each request asks for a delay drawn uniformly from `0..=max_delay_ms`.
    pub max_delay_ms: u64,
    /// The request target the backend must see after `HAProxy`'s rewrites (default: `path`).
    pub backend_target: String,
    /// Requests identical byte for byte (`x-want-status: cycle`, `x-delay-ms: random`): the backend
    /// picks each status and delay, so no request header tells one request from another.
    pub same_bytes: bool,
    /// Header names (lowercase) the backend must see, and must not see.
    pub backend_has: Vec<&'static str>,
    pub backend_lacks: Vec<&'static str>,
}

impl Scenario {
    /// 24 clients x 84 requests of `GET /same`, `nbthread 4`, delays of 0-15 ms, no rewrite.
    #[must_use]
    pub fn new(name: &'static str) -> Self {
        Self {
            name,
            nbthread: 4,
            backend_lines: String::new(),
            server_options: String::new(),
            clients: 24,
            per_client: 84,
            reconnect_every: 0,
            same_bytes: false,
            path: "/same",
            max_delay_ms: 15,
            backend_target: "/same".to_owned(),
            backend_has: Vec::new(),
            backend_lacks: Vec::new(),
        }
    }

    #[must_use]
    pub fn nbthread(mut self, n: u32) -> Self {
        self.nbthread = n;
        self
    }

    /// Adds `line` (without indentation or newline) to `backend be_app`.
    #[must_use]
    pub fn backend(mut self, line: &str) -> Self {
        self.backend_lines.push_str("    ");
        self.backend_lines.push_str(line);
        self.backend_lines.push('\n');
        self
    }

    /// Requests identical byte for byte: the backend picks statuses and delays.
    #[must_use]
    pub fn same_bytes(mut self) -> Self {
        self.same_bytes = true;
        self
    }

    /// Each client reconnects after `n` requests.
    #[must_use]
    pub fn reconnect_every(mut self, n: usize) -> Self {
        self.reconnect_every = n;
        self
    }

    #[must_use]
    pub fn server_options(mut self, options: &str) -> Self {
        options.clone_into(&mut self.server_options);
        self
    }

    /// What the backend must receive as request target.
    #[must_use]
    pub fn backend_target(mut self, target: &str) -> Self {
        target.clone_into(&mut self.backend_target);
        self
    }

    #[must_use]
    pub fn backend_headers(mut self, has: &[&'static str], lacks: &[&'static str]) -> Self {
        self.backend_has = has.to_vec();
        self.backend_lacks = lacks.to_vec();
        self
    }

    /// `HAProxy`'s configuration: [`haproxy::config`] with `nbthread`, the server options and the
    /// backend lines.
    #[must_use]
    pub fn config(&self, front_port: u16, backend: SocketAddr) -> String {
        let plain = haproxy::config(front_port, &[backend], &self.backend_lines);
        let server_line = format!("    server s0 {backend}\n");
        assert!(plain.contains(&server_line) && plain.contains("global\n"), "unexpected base configuration:\n{plain}");
        plain.replacen("global\n", &format!("global\n    nbthread {}\n", self.nbthread), 1).replacen(
            &server_line,
            &format!("    server s0 {backend} {}\n", self.server_options),
            1,
        )
    }

    /// The statuses client `client` uses in turn: a slice of [`statuses`] no other client uses.
    #[must_use]
    pub fn statuses_of(&self, client: usize) -> Vec<u16> {
        let all = statuses();
        let each = all.len() / self.clients;
        assert!(
            each >= 2,
            "{} clients need at least {} statuses, there are {}",
            self.clients,
            2 * self.clients,
            all.len()
        );
        all[client * each..(client + 1) * each].to_vec()
    }
}

/// What the clients did.
#[derive(Debug, Clone, Default)]
pub struct Sent {
    /// Requests written.
    pub requests: usize,
    /// Requests that got no response (I/O error; the client reconnected).
    pub failed: usize,
    /// Responses, by status (what the SERVER spans must show).
    pub by_status: BTreeMap<u16, usize>,
    /// Responses whose status is not the one asked for, or whose backend did not see the
    /// expected target or headers: the scenario's premise failed (first few described).
    pub premise_broken: usize,
    pub premise_examples: Vec<String>,
}

/// The linking figures of a set of spans.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Accuracy {
    /// SERVER spans with the scenario's `url.path`.
    pub server: usize,
    /// SERVER spans with another `url.path` (none expected).
    pub other_server: usize,
    /// SERVER spans by status.
    pub server_by_status: BTreeMap<i64, usize>,
    pub client: usize,
    /// CLIENT spans under a SERVER span with the same status, inside it in time.
    pub linked_right: usize,
    /// CLIENT spans whose parent is none of the SERVER spans (or in another trace).
    pub orphan: usize,
    /// CLIENT spans under a SERVER span with another status.
    pub status_mismatch: usize,
    /// CLIENT spans under a SERVER span with their status, but not inside it in time.
    pub outside: usize,
}

fn status(span: &Received) -> Option<i64> {
    span.int_attr("http.response.status_code")
}

/// Sorts every CLIENT span in `spans` into right, orphan, status mismatch or outside, against the
/// SERVER spans whose `url.path` is `server_path` (identified by their span id, found by the CLIENT
/// span's `parent_span_id`).
#[must_use]
pub fn accuracy(spans: &[Received], server_path: &str) -> Accuracy {
    let mut acc = Accuracy::default();
    let mut servers = std::collections::HashMap::new();
    for s in spans.iter().filter(|s| s.is_server()) {
        if s.str_attr("url.path") == Some(server_path) {
            acc.server += 1;
            *acc.server_by_status.entry(status(s).unwrap_or(-1)).or_default() += 1;
            servers.insert(&s.span.span_id[..], s);
        } else {
            acc.other_server += 1;
        }
    }
    for c in spans.iter().filter(|s| s.is_client()) {
        acc.client += 1;
        let Some(parent) = servers.get(&c.span.parent_span_id[..]).filter(|p| p.span.trace_id == c.span.trace_id)
        else {
            acc.orphan += 1;
            continue;
        };
        if status(c).is_none() || status(c) != status(parent) {
            acc.status_mismatch += 1;
        } else if c.span.start_time_unix_nano < parent.span.start_time_unix_nano
            || c.span.end_time_unix_nano > parent.span.end_time_unix_nano
        {
            acc.outside += 1;
        } else {
            acc.linked_right += 1;
        }
    }
    acc
}

/// One scenario's outcome on one `HAProxy`.
#[derive(Debug, Clone)]
pub struct Report {
    pub scenario: String,
    /// Which `HAProxy` ran it.
    pub haproxy: String,
    pub sent: Sent,
    pub accuracy: Accuracy,
    /// `tracetap_backend_requests_unlinked_total`.
    pub unlinked: u64,
    /// Counted losses that would explain missing spans: ring full, queue and export drops,
    /// expired exchanges.
    pub losses: u64,
    /// CLIENT spans whose `url.path`/`url.query` differ from the target the backend saw
    /// (informational: linking is judged on status and time).
    pub client_target_wrong: usize,
}

impl Report {
    /// Requests answered: each must have exactly one SERVER span and one CLIENT span.
    #[must_use]
    pub fn answered(&self) -> usize {
        self.sent.requests - self.sent.failed
    }

    /// Share of CLIENT spans linked right, in percent of the CLIENT spans expected (one per
    /// answered request) or received, whichever is more.
    #[must_use]
    pub fn pct(&self) -> f64 {
        let base = self.answered().max(self.accuracy.client).max(1);
        100.0 * self.accuracy.linked_right as f64 / base as f64
    }

    /// The one-line summary the tests print.
    #[must_use]
    pub fn summary(&self) -> String {
        let a = &self.accuracy;
        format!(
            "scenario={} haproxy={} requests={} failed={} server={} client={} linked_right={} pct={:.2} unlinked={} \
             orphan={} status_mismatch={} outside={} other_server={} client_target_wrong={} losses={} premise_broken={}",
            self.scenario,
            self.haproxy,
            self.sent.requests,
            self.sent.failed,
            a.server,
            a.client,
            a.linked_right,
            self.pct(),
            self.unlinked,
            a.orphan,
            a.status_mismatch,
            a.outside,
            a.other_server,
            self.client_target_wrong,
            self.losses,
            self.sent.premise_broken,
        )
    }

    /// Every way the scenario fails, empty when it passed: requests unanswered or answered with
    /// another status than asked, a request without exactly one SERVER span (by count and by
    /// status), fewer than 99.9% of CLIENT spans linked right.
    #[must_use]
    pub fn failures(&self) -> Vec<String> {
        let mut out = Vec::new();
        let a = &self.accuracy;
        let tag = format!("{} on {}", self.scenario, self.haproxy);
        if self.sent.failed > 0 {
            out.push(format!("{tag}: {} requests got no response", self.sent.failed));
        }
        if self.sent.premise_broken > 0 {
            out.push(format!(
                "{tag}: {} responses were not what the backend was asked for or saw another request than expected, e.g. {:?}",
                self.sent.premise_broken, self.sent.premise_examples
            ));
        }
        if a.server == self.answered() {
            let want: BTreeMap<i64, usize> = self.sent.by_status.iter().map(|(s, n)| (i64::from(*s), *n)).collect();
            if want != a.server_by_status {
                let diff: Vec<_> = want
                    .keys()
                    .chain(a.server_by_status.keys())
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .filter_map(|s| {
                        let (w, g) =
                            (want.get(s).copied().unwrap_or(0), a.server_by_status.get(s).copied().unwrap_or(0));
                        (w != g).then(|| format!("{s}: want {w} got {g}"))
                    })
                    .collect();
                out.push(format!("{tag}: SERVER spans by status differ from the responses: {diff:?}"));
            }
        } else {
            out.push(format!("{tag}: {} SERVER spans for {} requests", a.server, self.answered()));
        }
        let base = self.answered().max(a.client);
        if a.linked_right * 1000 < base * 999 {
            out.push(format!(
                "{tag}: {} of {base} CLIENT spans linked right ({:.2}%, want >= 99.9%): {} received, {} orphan, {} status mismatch, {} outside their SERVER span",
                a.linked_right,
                self.pct(),
                a.client,
                a.orphan,
                a.status_mismatch,
                a.outside
            ));
        }
        out
    }
}

/// A small deterministic generator (splitmix64) for the delays.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n
    }
}

/// Sends the scenario's traffic to `front` and returns what happened.
#[must_use]
pub fn drive(scenario: &Scenario, front: SocketAddr) -> Sent {
    let sent = Arc::new(Mutex::new(Sent::default()));
    let start = Arc::new(Barrier::new(scenario.clients));
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..scenario.clients)
        .map(|client| {
            let (sent, start, stop) = (Arc::clone(&sent), Arc::clone(&start), Arc::clone(&stop));
            let own = scenario.statuses_of(client);
            let scenario = scenario.clone();
            std::thread::spawn(move || {
                let mut rng = Rng(0x5eed_0000 + client as u64);
                let mut conn = Conn::connect(front).expect("connect to HAProxy");
                let mut mine = Sent::default();
                start.wait();
                for r in 0..scenario.per_client {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    if scenario.reconnect_every > 0 && r > 0 && r % scenario.reconnect_every == 0 {
                        conn = Conn::connect(front).expect("reconnect to HAProxy");
                    }
                    let want = own[r % own.len()];
                    let delay = rng.below(scenario.max_delay_ms + 1);
                    mine.requests += 1;
                    let headers = if scenario.same_bytes {
                        [("x-want-status", "cycle".to_owned()), ("x-delay-ms", "random".to_owned())]
                    } else {
                        [("x-want-status", want.to_string()), ("x-delay-ms", delay.to_string())]
                    };
                    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
                    match conn.get(scenario.path, &headers) {
                        Ok(resp) => {
                            *mine.by_status.entry(resp.status).or_default() += 1;
                            if let Some(problem) = premise_problem(&scenario, want, &resp) {
                                mine.premise_broken += 1;
                                if mine.premise_examples.len() < 3 {
                                    mine.premise_examples.push(problem);
                                }
                            }
                        }
                        Err(e) => {
                            mine.failed += 1;
                            if mine.premise_examples.len() < 3 {
                                mine.premise_examples.push(format!("no response: {e}"));
                            }
                            match Conn::connect(front) {
                                Ok(c) => conn = c,
                                Err(_) => stop.store(true, Ordering::Relaxed),
                            }
                        }
                    }
                }
                let mut all = sent.lock().expect("lock");
                all.requests += mine.requests;
                all.failed += mine.failed;
                all.premise_broken += mine.premise_broken;
                for (s, n) in mine.by_status {
                    *all.by_status.entry(s).or_default() += n;
                }
                let room = 5usize.saturating_sub(all.premise_examples.len());
                all.premise_examples.extend(mine.premise_examples.into_iter().take(room));
            })
        })
        .collect();
    for w in workers {
        w.join().expect("client thread");
    }
    Arc::try_unwrap(sent).expect("threads joined").into_inner().expect("lock")
}

/// Why a response breaks the scenario's premise: not the status asked for, or the backend saw
/// another target or headers than the configuration implies.
fn premise_problem(scenario: &Scenario, want: u16, resp: &crate::client::Response) -> Option<String> {
    let asked = if scenario.same_bytes { resp.body.strip_prefix(b"status ") } else { None };
    let want = asked.and_then(|b| std::str::from_utf8(b).ok()?.trim().parse().ok()).unwrap_or(want);
    if resp.status != want {
        return Some(format!("asked for {want}, got {} (body {:?})", resp.status, String::from_utf8_lossy(&resp.body)));
    }
    let target = resp.header("x-seen-target").unwrap_or("(none)");
    if target != scenario.backend_target {
        return Some(format!("backend saw target {target:?}, expected {:?}", scenario.backend_target));
    }
    let seen = resp.header("x-seen-headers").unwrap_or_default();
    let names: Vec<&str> = seen.split(',').collect();
    for h in &scenario.backend_has {
        if !names.contains(h) {
            return Some(format!("backend did not see header {h}: {seen}"));
        }
    }
    for h in &scenario.backend_lacks {
        if names.contains(h) {
            return Some(format!("backend saw header {h}: {seen}"));
        }
    }
    None
}

/// The agent's settings for these scenarios: room for the whole burst in the ring and the export
/// queue, so that nothing is dropped for lack of room on a busy machine.
#[must_use]
pub fn agent_env() -> Vec<(&'static str, String)> {
    vec![
        ("OTEL_BSP_MAX_QUEUE_SIZE", "65536".to_owned()),
        ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2048".to_owned()),
        ("TRACETAP_RING_BYTES", (64 << 20).to_string()),
    ]
}

/// Runs `scenario` through `stack` (already started with [`Scenario::config`]): drives the traffic,
/// waits (at most 60 s, for liveness only) until a SERVER span per answered request arrived, then
/// half a second more for stragglers, and computes the figures.
#[must_use]
pub fn measure(scenario: &Scenario, stack: &Stack, haproxy_label: &str) -> Report {
    let sent = drive(scenario, stack.front);
    let answered = sent.requests - sent.failed;
    let count = |spans: &[Received]| {
        spans.iter().filter(|s| s.is_server() && s.str_attr("url.path") == Some(scenario.path)).count()
    };
    let _ = wait_for(Duration::from_mins(1), || (count(&stack.receiver.spans()) >= answered).then_some(()));
    std::thread::sleep(Duration::from_millis(500));
    let spans = stack.receiver.spans();
    let (want_path, want_query) = match scenario.backend_target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (scenario.backend_target.as_str(), None),
    };
    let client_target_wrong = spans
        .iter()
        .filter(|s| s.is_client())
        .filter(|s| s.str_attr("url.path") != Some(want_path) || s.str_attr("url.query") != want_query)
        .count();
    let metric = |name: &str| stack.agent.metric(name);
    let losses = metric("tracetap_events_lost_ring_full_total")
        + metric("tracetap_spans_dropped_queue_full_total")
        + metric("tracetap_spans_dropped_export_failed_total")
        + metric("tracetap_exchanges_expired_total");
    Report {
        scenario: scenario.name.to_owned(),
        haproxy: haproxy_label.to_owned(),
        accuracy: accuracy(&spans, scenario.path),
        sent,
        unlinked: metric("tracetap_backend_requests_unlinked_total"),
        losses,
        client_target_wrong,
    }
}

/// Starts a traced stack with `HAProxy` `version` for `scenario` and measures it.
#[must_use]
pub fn run_on(version: haproxy::Version, scenario: &Scenario) -> Report {
    let stack = Stack::with_config_on(version, |port, backend| scenario.config(port, backend), &agent_env());
    measure(scenario, &stack, &format!("{version:?}").to_lowercase())
}

/// [`run_on`] the version tests run when they do not choose ([`haproxy::Version::from_env`]).
#[must_use]
pub fn run(scenario: &Scenario) -> Report {
    run_on(haproxy::Version::from_env(), scenario)
}

#[cfg(test)]
mod tests {
    use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value::Value};
    use opentelemetry_proto::tonic::trace::v1::Span;
    use opentelemetry_proto::tonic::trace::v1::span::SpanKind;

    use super::*;

    fn span(kind: SpanKind, id: u8, parent: u8, status: i64, start: u64, end: u64) -> Received {
        let attr = |key: &str, value: Value| KeyValue {
            key: key.into(),
            value: Some(AnyValue { value: Some(value) }),
            ..KeyValue::default()
        };
        let mut attributes = vec![attr("http.response.status_code", Value::IntValue(status))];
        if kind == SpanKind::Server {
            attributes.push(attr("url.path", Value::StringValue("/same".into())));
        }
        Received {
            pid: 1,
            service: "haproxy".into(),
            resource: Vec::new(),
            span: Span {
                trace_id: vec![7; 16],
                span_id: vec![id; 8],
                parent_span_id: if parent == 0 { Vec::new() } else { vec![parent; 8] },
                kind: kind as i32,
                start_time_unix_nano: start,
                end_time_unix_nano: end,
                attributes,
                ..Span::default()
            },
        }
    }

    /// Two overlapping identical requests, A (status 201) and B (status 202).
    fn servers() -> Vec<Received> {
        vec![span(SpanKind::Server, 1, 0, 201, 100, 200), span(SpanKind::Server, 2, 0, 202, 110, 210)]
    }

    #[test]
    fn right_links_count_as_right() {
        let mut spans = servers();
        spans.push(span(SpanKind::Client, 11, 1, 201, 120, 190));
        spans.push(span(SpanKind::Client, 12, 2, 202, 130, 200));
        let acc = accuracy(&spans, "/same");
        assert_eq!((acc.server, acc.client, acc.linked_right), (2, 2, 2));
        assert_eq!(acc.server_by_status, BTreeMap::from([(201, 1), (202, 1)]));
    }

    #[test]
    fn a_swapped_pair_counts_as_wrong() {
        let mut spans = servers();
        // Both CLIENT spans lie inside both SERVER spans in time: only the statuses show the swap.
        spans.push(span(SpanKind::Client, 11, 2, 201, 120, 190));
        spans.push(span(SpanKind::Client, 12, 1, 202, 130, 195));
        let acc = accuracy(&spans, "/same");
        assert_eq!(acc.linked_right, 0);
        assert_eq!(acc.status_mismatch, 2);
    }

    #[test]
    fn a_link_outside_its_server_span_or_to_nothing_counts_as_wrong() {
        let mut spans = servers();
        spans.push(span(SpanKind::Client, 11, 1, 201, 90, 150));
        spans.push(span(SpanKind::Client, 12, 2, 202, 130, 250));
        spans.push(span(SpanKind::Client, 13, 9, 201, 130, 150));
        let mut other_trace = span(SpanKind::Client, 14, 1, 201, 130, 150);
        other_trace.span.trace_id = vec![8; 16];
        spans.push(other_trace);
        let acc = accuracy(&spans, "/same");
        assert_eq!((acc.client, acc.linked_right, acc.outside, acc.orphan), (4, 0, 2, 2));
    }

    #[test]
    fn report_fails_below_999_per_mille_and_on_missing_server_spans() {
        let sent = Sent { requests: 2, by_status: BTreeMap::from([(201, 1), (202, 1)]), ..Sent::default() };
        let mut spans = servers();
        spans.push(span(SpanKind::Client, 11, 1, 201, 120, 190));
        spans.push(span(SpanKind::Client, 12, 2, 202, 130, 200));
        let report = |spans: &[Received]| Report {
            scenario: "unit".into(),
            haproxy: "none".into(),
            sent: sent.clone(),
            accuracy: accuracy(spans, "/same"),
            unlinked: 0,
            losses: 0,
            client_target_wrong: 0,
        };
        assert!(report(&spans).failures().is_empty(), "{:?}", report(&spans).failures());
        // A swap.
        spans[2].span.parent_span_id = vec![2; 8];
        spans[3].span.parent_span_id = vec![1; 8];
        assert_eq!(report(&spans).failures().len(), 1);
        // No CLIENT spans at all: 0 of the 2 expected.
        assert_eq!(report(&spans[..2]).failures().len(), 1);
        // A SERVER span missing.
        assert!(!report(&spans[1..]).failures().is_empty());
    }

    #[test]
    fn every_client_has_its_own_statuses() {
        let s = Scenario::new("unit");
        let mut seen = std::collections::HashSet::new();
        for c in 0..s.clients {
            let own = s.statuses_of(c);
            assert!(own.len() >= 2);
            assert!(own.iter().all(|st| seen.insert(*st)), "client {c} shares a status");
        }
    }
}

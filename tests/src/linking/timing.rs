//! A linking judge that does not use statuses: every response is 200 and every request is
//! identical byte for byte (`GET /same` with `x-token-echo: 1` and `x-delay-ms: random`), as on
//! real traffic, where the status the tracker confirms links with tells nothing apart.
//!
//! The backend ([`crate::backend`]) answers each request with a token of its own (`x-token: N`),
//! which `HAProxy` relays unchanged, and records when it received that request and when it sent
//! the response ([`TokenExchange`], same clock as span timestamps). The clients record, per
//! keep-alive connection (by its local port) and request index, the token they got back: which
//! backend exchange served that request.
//!
//! A SERVER span is tied to a client request by its `network.peer.port` (the client connection's
//! local port) and its rank by start time among the SERVER spans of that port (requests on one
//! connection are sequential). The CLIENT span under it is judged right when the backend exchange
//! of that request's token lies inside it in time (CLIENT start <= received, sent <= CLIENT end,
//! with a tolerance for the time between a syscall delivering its bytes and the probe stamping its
//! return: [`TOLERANCE_NS`], the largest overshoot seen is reported) and the CLIENT span lies inside
//! its SERVER span.
//!
//! Containment alone is weak with 24 concurrent requests: a 15 ms CLIENT span contains the
//! exchanges of most short concurrent requests. So the judge also works out, from timing alone,
//! which exchange each CLIENT span *is* ([`identify`]: every CLIENT span is exactly one backend
//! exchange, and a CLIENT span that only one exchange fits is that one, then the next, ...). A
//! CLIENT span identified as another request's exchange is wrong even when its own request's
//! exchange fits in it. Right CLIENT spans that timing could not identify (several exchanges fit
//! them equally) are right by containment alone; [`Verdicts::identified`] says how many were
//! identified, i.e. how much the verdicts rest on.
//!
//! [`run_on`] drives a [`Scenario`] (its `same_bytes`, `max_delay_ms` and status settings do not
//! apply: the backend picks delays of 0-15 ms and every status is 200) and returns a [`Report`];
//! [`judge`] is the computation alone. With [`Statuses::Cycled`] the requests also carry
//! `x-want-status: cycle` (concurrent requests get different statuses, as in the status-judged
//! scenarios): a control run, where the tracker has statuses to go by, to compare both judges on
//! the same traffic. Every report also gives the status judge's figure ([`super::accuracy`]).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use super::{Accuracy, Scenario, accuracy, agent_env, premise_problem};
use crate::backend::TokenExchange;
use crate::client::{Conn, Response};
use crate::otlp::Received;
use crate::{Stack, haproxy, wait_for};

/// How far a backend exchange may stick out of its CLIENT span and still count as inside it: the
/// probes stamp a syscall at its return, so the backend can read a request before `HAProxy`'s
/// write is stamped (by however long that thread waits to be scheduled again).
pub const TOLERANCE_NS: u64 = 1_000_000;

/// What the backend answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Statuses {
    /// 200 to every request: the requests are identical byte for byte.
    AllOk,
    /// The next of [`super::statuses`] in turn (`x-want-status: cycle`): a control.
    Cycled,
}

/// One client connection: its local port (the SERVER spans' `network.peer.port`), when it was
/// opened, and, per request in order, the token of the backend exchange that answered it (`None`:
/// no token came back).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnLog {
    pub port: u16,
    /// Rank among the connections of a run by the moment they were opened. A port is reused only
    /// once its previous connection closed (Linux reuses loopback ports in `TIME_WAIT`,
    /// `net.ipv4.tcp_tw_reuse`), so the requests of the connections of one port follow each other
    /// in this order.
    pub opened: u64,
    pub tokens: Vec<Option<u64>>,
}

/// What the clients did.
#[derive(Debug, Clone, Default)]
pub struct Sent {
    pub requests: usize,
    /// Requests that got no response (the client reconnected).
    pub failed: usize,
    /// Responses that were not a 200 with a token, or whose backend saw another target or headers
    /// than the scenario implies (first few described).
    pub premise_broken: usize,
    pub premise_examples: Vec<String>,
    pub conns: Vec<ConnLog>,
}

/// The timing judge's figures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdicts {
    /// SERVER spans with the scenario's `url.path`.
    pub server: usize,
    /// SERVER spans with another `url.path` (none expected).
    pub other_server: usize,
    /// SERVER spans (of the path) whose status is not 200.
    pub server_not_200: usize,
    /// Client ports whose SERVER spans are not as many as the requests sent on them: their
    /// requests cannot be told apart, their CLIENT spans are counted [`Verdicts::unjudgeable`].
    pub unaligned_ports: usize,
    pub client: usize,
    /// CLIENT spans that contain their request's backend exchange, lie inside their SERVER span,
    /// and that timing does not identify as another exchange.
    pub right: usize,
    /// Of the right ones: timing identifies the CLIENT span as that very exchange (see
    /// [`identify`]); the others are right by containment alone, another exchange fitting as well.
    pub identified: usize,
    /// CLIENT spans whose parent is none of the SERVER spans (or in another trace).
    pub orphan: usize,
    /// CLIENT spans whose SERVER span is tied to no request, or to one without a recorded token.
    pub unjudgeable: usize,
    /// CLIENT spans not inside their SERVER span.
    pub outside: usize,
    /// CLIENT spans that do not contain their request's backend exchange: linked to another one.
    pub wrong_exchange: usize,
    /// CLIENT spans that contain their request's backend exchange, but that timing identifies as
    /// another request's exchange: linked to that one's SERVER span's place.
    pub identified_other: usize,
    /// CLIENT spans that no backend exchange fits in: a tolerance too small for the skew (or a
    /// CLIENT span of no token request). Nonzero makes [`identify`] unreliable.
    pub fits_none: usize,
    /// Among identified right CLIENT spans, the largest time a backend exchange started before
    /// its CLIENT span, and ended after it (within the tolerance by construction).
    pub max_start_skew_ns: u64,
    pub max_end_skew_ns: u64,
    /// CLIENT spans judged wrong (outside, wrong exchange, identified as another) whose SERVER span
    /// started in the first 100 ms after the first SERVER span (the burst of 24 clients starting
    /// at once, on a cold `HAProxy`).
    pub wrong_early: usize,
    /// A few of the CLIENT spans judged wrong, described (times in µs from the first SERVER span).
    pub examples: Vec<String>,
}

fn peer_port(span: &Received) -> Option<u16> {
    span.int_attr("network.peer.port").and_then(|p| u16::try_from(p).ok())
}

/// Which backend exchange each CLIENT span is, where timing alone decides it. `spans` are the
/// CLIENT spans' `(start, end)`, `exchanges` the backend's `(received, sent, token)` sorted by
/// received time. An exchange *fits* a CLIENT span when it lies inside it (within `tolerance_ns`);
/// every CLIENT span is one backend exchange, which fits it. Peeling: a CLIENT span that only one
/// unassigned exchange fits is that exchange; and, when `every_exchange_has_a_span`, an exchange
/// that fits only one unassigned CLIENT span is that span's. Both are removed and the rest looked
/// at again. What remains (several candidates each) is `None`.
#[must_use]
pub fn identify(
    spans: &[(u64, u64)],
    exchanges: &[(u64, u64, u64)],
    tolerance_ns: u64,
    every_exchange_has_a_span: bool,
) -> Vec<Option<u64>> {
    let fits = |(start, end): (u64, u64), (received, sent): (u64, u64)| {
        received + tolerance_ns >= start && sent <= end + tolerance_ns
    };
    let mut of_span: Vec<Vec<usize>> = Vec::with_capacity(spans.len());
    let mut of_exchange: Vec<Vec<usize>> = vec![Vec::new(); exchanges.len()];
    for (i, &(start, end)) in spans.iter().enumerate() {
        let from = exchanges.partition_point(|e| e.0 + tolerance_ns < start);
        let to = exchanges.partition_point(|e| e.0 <= end + tolerance_ns);
        let mine: Vec<usize> = (from..to).filter(|&j| fits((start, end), (exchanges[j].0, exchanges[j].1))).collect();
        for &j in &mine {
            of_exchange[j].push(i);
        }
        of_span.push(mine);
    }
    let mut span_degree: Vec<usize> = of_span.iter().map(Vec::len).collect();
    let mut exchange_degree: Vec<usize> = of_exchange.iter().map(Vec::len).collect();
    let (mut span_done, mut exchange_done) = (vec![false; spans.len()], vec![false; exchanges.len()]);
    let mut out = vec![None; spans.len()];
    // Work list: (is a span, index), for nodes that had one candidate when pushed.
    let mut work: Vec<(bool, usize)> = (0..spans.len()).filter(|&i| span_degree[i] == 1).map(|i| (true, i)).collect();
    if every_exchange_has_a_span {
        work.extend((0..exchanges.len()).filter(|&j| exchange_degree[j] == 1).map(|j| (false, j)));
    }
    while let Some((is_span, k)) = work.pop() {
        let (i, j) = if is_span {
            if span_done[k] || span_degree[k] != 1 {
                continue;
            }
            (k, *of_span[k].iter().find(|&&j| !exchange_done[j]).expect("one candidate left"))
        } else {
            if exchange_done[k] || exchange_degree[k] != 1 {
                continue;
            }
            (*of_exchange[k].iter().find(|&&i| !span_done[i]).expect("one candidate left"), k)
        };
        out[i] = Some(exchanges[j].2);
        span_done[i] = true;
        exchange_done[j] = true;
        for &other in &of_span[i] {
            if !exchange_done[other] {
                exchange_degree[other] -= 1;
                if exchange_degree[other] == 1 && every_exchange_has_a_span {
                    work.push((false, other));
                }
            }
        }
        for &other in &of_exchange[j] {
            if !span_done[other] {
                span_degree[other] -= 1;
                if span_degree[other] == 1 {
                    work.push((true, other));
                }
            }
        }
    }
    out
}

/// The request a token answered: client port, index on that connection, SERVER span.
type RequestOf<'a> = HashMap<u64, (u16, usize, &'a Received)>;

/// Ties the SERVER spans (`by_port`: by client port) to the requests in `conns`, by port and rank
/// in start time (the requests of a port's connections in the order they were opened): the token
/// of each SERVER span's request, by span id, and the request of each token. Counts unaligned
/// ports in `v`.
fn tie<'a>(
    mut by_port: HashMap<u16, Vec<&'a Received>>,
    conns: &[ConnLog],
    v: &mut Verdicts,
) -> (HashMap<&'a [u8], u64>, RequestOf<'a>) {
    let mut logs: HashMap<u16, Vec<&ConnLog>> = HashMap::new();
    for c in conns {
        logs.entry(c.port).or_default().push(c);
    }
    let mut requests: HashMap<u16, Vec<Option<u64>>> = HashMap::new();
    for (port, mut of_port) in logs {
        of_port.sort_by_key(|c| c.opened);
        requests.insert(port, of_port.into_iter().flat_map(|c| c.tokens.iter().copied()).collect());
    }
    let mut token_of = HashMap::new();
    let mut request_of = HashMap::new();
    let ports: std::collections::BTreeSet<u16> = by_port.keys().chain(requests.keys()).copied().collect();
    for port in ports {
        let mut on_port = by_port.remove(&port).unwrap_or_default();
        let tokens = match requests.get(&port) {
            Some(tokens) if tokens.len() == on_port.len() => tokens,
            _ => {
                v.unaligned_ports += 1;
                continue;
            }
        };
        on_port.sort_by_key(|s| (s.span.start_time_unix_nano, s.span.end_time_unix_nano));
        for (index, (s, token)) in on_port.into_iter().zip(tokens).enumerate() {
            if let Some(t) = token {
                token_of.insert(&s.span.span_id[..], *t);
                request_of.insert(*t, (port, index, s));
            }
        }
    }
    (token_of, request_of)
}

/// Judges every CLIENT span in `spans` against the requests in `conns` and the backend's records
/// in `exchanges` (see the module documentation). SERVER spans are those whose `url.path` is
/// `server_path`.
#[must_use]
pub fn judge(
    spans: &[Received],
    server_path: &str,
    conns: &[ConnLog],
    exchanges: &BTreeMap<u64, TokenExchange>,
    tolerance_ns: u64,
) -> Verdicts {
    let mut v = Verdicts::default();
    let mut by_port: HashMap<u16, Vec<&Received>> = HashMap::new();
    let mut servers = HashMap::new();
    for s in spans.iter().filter(|s| s.is_server()) {
        if s.str_attr("url.path") != Some(server_path) {
            v.other_server += 1;
            continue;
        }
        v.server += 1;
        if s.int_attr("http.response.status_code") != Some(200) {
            v.server_not_200 += 1;
        }
        servers.insert(&s.span.span_id[..], s);
        if let Some(port) = peer_port(s) {
            by_port.entry(port).or_default().push(s);
        }
    }
    let origin = servers.values().map(|s| s.span.start_time_unix_nano).min().unwrap_or(0);
    let (token_of, request_of) = tie(by_port, conns, &mut v);
    let mut by_received: Vec<(u64, u64, u64)> = exchanges.iter().map(|(t, e)| (e.received_ns, e.sent_ns, *t)).collect();
    by_received.sort_unstable();
    let clients: Vec<&Received> = spans.iter().filter(|s| s.is_client()).collect();
    let times: Vec<(u64, u64)> =
        clients.iter().map(|c| (c.span.start_time_unix_nano, c.span.end_time_unix_nano)).collect();
    let identities = identify(&times, &by_received, tolerance_ns, clients.len() == exchanges.len());
    let us = |t: u64| (t as f64 - origin as f64) / 1e3;
    let describe = |token: u64| match (request_of.get(&token), exchanges.get(&token)) {
        (Some((port, index, s)), Some(e)) => format!(
            "token {token} (port {port} request {index} on it, SERVER {:.0}..{:.0}, backend {:.0}..{:.0})",
            us(s.span.start_time_unix_nano),
            us(s.span.end_time_unix_nano),
            us(e.received_ns),
            us(e.sent_ns)
        ),
        _ => format!("token {token}"),
    };
    for (c, identity) in clients.iter().zip(identities) {
        v.client += 1;
        let (start, end) = (c.span.start_time_unix_nano, c.span.end_time_unix_nano);
        let fits = |e: &TokenExchange| e.received_ns + tolerance_ns >= start && e.sent_ns <= end + tolerance_ns;
        if !exchanges.values().any(fits) {
            v.fits_none += 1;
        }
        let Some(parent) = servers.get(&c.span.parent_span_id[..]).filter(|p| p.span.trace_id == c.span.trace_id)
        else {
            v.orphan += 1;
            continue;
        };
        let Some((token, exchange)) =
            token_of.get(&parent.span.span_id[..]).and_then(|t| Some((*t, exchanges.get(t)?)))
        else {
            v.unjudgeable += 1;
            continue;
        };
        let wrong = |v: &mut Verdicts, what: &str| {
            if parent.span.start_time_unix_nano < origin + 100_000_000 {
                v.wrong_early += 1;
            }
            if v.examples.len() < 6 {
                v.examples.push(format!(
                    "{what}: CLIENT {:.0}..{:.0} under the SERVER span of {}, timing says it is {}",
                    us(start),
                    us(end),
                    describe(token),
                    identity.map_or_else(|| "undecided".to_owned(), describe)
                ));
            }
        };
        if start < parent.span.start_time_unix_nano || end > parent.span.end_time_unix_nano {
            v.outside += 1;
            wrong(&mut v, "outside its SERVER span");
        } else if !fits(exchange) {
            v.wrong_exchange += 1;
            wrong(&mut v, "another exchange");
        } else if identity.is_some_and(|i| i != token) {
            v.identified_other += 1;
            wrong(&mut v, "identified as another exchange");
        } else {
            v.right += 1;
            if identity == Some(token) {
                v.identified += 1;
                v.max_start_skew_ns = v.max_start_skew_ns.max(start.saturating_sub(exchange.received_ns));
                v.max_end_skew_ns = v.max_end_skew_ns.max(exchange.sent_ns.saturating_sub(end));
            }
        }
    }
    v
}

/// One scenario's outcome on one `HAProxy`.
#[derive(Debug, Clone)]
pub struct Report {
    pub scenario: String,
    pub haproxy: String,
    pub sent: Sent,
    pub verdicts: Verdicts,
    /// Backend exchanges the backend recorded (one per token drawn and answered).
    pub exchanges: usize,
    /// `tracetap_backend_requests_unlinked_total`.
    pub unlinked: u64,
    /// `tracetap_backend_exchanges_relinked_total`.
    pub relinked: u64,
    /// Counted losses: ring full, queue and export drops, expired exchanges.
    pub losses: u64,
    pub statuses: Statuses,
    /// The status judge's figures on the same spans.
    pub by_status: Accuracy,
}

impl Report {
    #[must_use]
    pub fn answered(&self) -> usize {
        self.sent.requests - self.sent.failed
    }

    /// CLIENT spans judged right, in percent of those expected (one per answered request) or
    /// received, whichever is more.
    #[must_use]
    pub fn pct(&self) -> f64 {
        let base = self.answered().max(self.verdicts.client).max(1);
        100.0 * self.verdicts.right as f64 / base as f64
    }

    #[must_use]
    pub fn summary(&self) -> String {
        let v = &self.verdicts;
        format!(
            "timing scenario={} haproxy={} requests={} failed={} server={} client={} right={} pct={:.2} identified={} \
             max_start_skew_us={:.1} max_end_skew_us={:.1} wrong_exchange={} identified_other={} outside={} \
             wrong_in_first_100ms={} orphan={} unjudgeable={} fits_none={} unaligned_ports={} server_not_200={} other_server={} backend_exchanges={} \
             unlinked={} relinked={} losses={} premise_broken={} statuses={:?} status_judge_right={}{}",
            self.scenario,
            self.haproxy,
            self.sent.requests,
            self.sent.failed,
            v.server,
            v.client,
            v.right,
            self.pct(),
            v.identified,
            v.max_start_skew_ns as f64 / 1e3,
            v.max_end_skew_ns as f64 / 1e3,
            v.wrong_exchange,
            v.identified_other,
            v.outside,
            v.wrong_early,
            v.orphan,
            v.unjudgeable,
            v.fits_none,
            v.unaligned_ports,
            v.server_not_200,
            v.other_server,
            self.exchanges,
            self.unlinked,
            self.relinked,
            self.losses,
            self.sent.premise_broken,
            self.statuses,
            self.by_status.linked_right,
            v.examples.iter().fold(String::new(), |all, e| all + "\n  " + e),
        )
    }

    /// Every way the scenario fails, empty when it passed: requests unanswered or not answered
    /// with a 200 and a token, a request without exactly one SERVER span, a SERVER span not 200,
    /// fewer than 99.9% of CLIENT spans judged right.
    #[must_use]
    pub fn failures(&self) -> Vec<String> {
        let mut out = Vec::new();
        let v = &self.verdicts;
        let tag = format!("{} on {}", self.scenario, self.haproxy);
        if self.sent.failed > 0 {
            out.push(format!("{tag}: {} requests got no response", self.sent.failed));
        }
        if self.sent.premise_broken > 0 {
            out.push(format!(
                "{tag}: {} responses were not a 200 with a token from the expected request, e.g. {:?}",
                self.sent.premise_broken, self.sent.premise_examples
            ));
        }
        if v.server != self.answered() {
            out.push(format!("{tag}: {} SERVER spans for {} requests", v.server, self.answered()));
        }
        if self.statuses == Statuses::AllOk && v.server_not_200 > 0 {
            out.push(format!("{tag}: {} SERVER spans without status 200", v.server_not_200));
        }
        let base = self.answered().max(v.client);
        if v.right * 1000 < base * 999 {
            out.push(format!(
                "{tag}: {} of {base} CLIENT spans judged right by timing ({:.2}%, want >= 99.9%): {} received, {} under \
                 another request's exchange ({} of them identified by timing alone), {} outside their SERVER span, {} \
                 orphan, {} unjudgeable ({} client ports unaligned)",
                v.right,
                self.pct(),
                v.client,
                v.wrong_exchange + v.identified_other,
                v.identified_other,
                v.outside,
                v.orphan,
                v.unjudgeable,
                v.unaligned_ports
            ));
        }
        out
    }
}

/// A keep-alive client connection and its local port (the SERVER spans' peer port).
struct TokenConn {
    conn: Conn,
    port: u16,
}

impl TokenConn {
    fn connect(front: SocketAddr) -> std::io::Result<Self> {
        let conn = Conn::connect(front)?;
        let port = conn.local_port()?;
        Ok(Self { conn, port })
    }

    /// Writes `request` and reads one response.
    fn exchange(&mut self, request: &[u8]) -> std::io::Result<Response> {
        self.conn.send_raw(request)?;
        self.conn.read_response()
    }
}

/// The one request every client sends, byte for byte.
fn request(scenario: &Scenario, statuses: Statuses) -> Vec<u8> {
    let cycle = if statuses == Statuses::Cycled { "x-want-status: cycle\r\n" } else { "" };
    format!(
        "GET {} HTTP/1.1\r\nHost: tracetap.test\r\nUser-Agent: tracetap-e2e\r\nx-token-echo: 1\r\nx-delay-ms: random\r\n{cycle}\r\n",
        scenario.path
    )
    .into_bytes()
}

/// Sends the scenario's traffic (`clients` connections, `per_client` identical requests each,
/// reconnecting every `reconnect_every`) to `front` and returns what happened.
#[must_use]
pub fn drive(scenario: &Scenario, front: SocketAddr, statuses: Statuses) -> Sent {
    let sent = Arc::new(Mutex::new(Sent::default()));
    let start = Arc::new(Barrier::new(scenario.clients));
    let stop = Arc::new(AtomicBool::new(false));
    let request = request(scenario, statuses);
    let opened = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let workers: Vec<_> = (0..scenario.clients)
        .map(|_| {
            let (sent, start, stop) = (Arc::clone(&sent), Arc::clone(&start), Arc::clone(&stop));
            let (scenario, request, opened) = (scenario.clone(), request.clone(), Arc::clone(&opened));
            let log_of = move |conn: &TokenConn| ConnLog {
                port: conn.port,
                opened: opened.fetch_add(1, Ordering::SeqCst),
                tokens: Vec::new(),
            };
            std::thread::spawn(move || {
                let mut conn = TokenConn::connect(front).expect("connect to HAProxy");
                let mut mine = Sent::default();
                let mut log = log_of(&conn);
                start.wait();
                for r in 0..scenario.per_client {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    if scenario.reconnect_every > 0 && r > 0 && r % scenario.reconnect_every == 0 {
                        conn = TokenConn::connect(front).expect("reconnect to HAProxy");
                        mine.conns.push(std::mem::replace(&mut log, log_of(&conn)));
                    }
                    mine.requests += 1;
                    match conn.exchange(&request) {
                        Ok(resp) => {
                            let token = resp.header("x-token").and_then(|t| t.trim().parse().ok());
                            log.tokens.push(token);
                            let want = if statuses == Statuses::AllOk { 200 } else { resp.status };
                            let problem = premise_problem(&scenario, want, &resp)
                                .or_else(|| token.is_none().then(|| "no x-token in the response".to_owned()));
                            if let Some(problem) = problem {
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
                            // The failed request may or may not have a SERVER span: this
                            // connection's log ends here (its port will not align if it has).
                            match TokenConn::connect(front) {
                                Ok(c) => {
                                    mine.conns.push(std::mem::replace(&mut log, log_of(&c)));
                                    conn = c;
                                }
                                Err(_) => stop.store(true, Ordering::Relaxed),
                            }
                        }
                    }
                }
                mine.conns.push(log);
                let mut all = sent.lock().expect("lock");
                all.requests += mine.requests;
                all.failed += mine.failed;
                all.premise_broken += mine.premise_broken;
                all.conns.extend(mine.conns);
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

/// Runs `scenario` through `stack` (started with [`Scenario::config`]): drives the traffic, waits
/// (at most 60 s, for liveness only) until a SERVER span per answered request arrived, then half a
/// second more for stragglers, and judges.
#[must_use]
pub fn measure(scenario: &Scenario, stack: &Stack, haproxy_label: &str, statuses: Statuses) -> Report {
    let sent = drive(scenario, stack.front, statuses);
    let answered = sent.requests - sent.failed;
    let count = |spans: &[Received]| {
        spans.iter().filter(|s| s.is_server() && s.str_attr("url.path") == Some(scenario.path)).count()
    };
    let _ = wait_for(Duration::from_mins(1), || (count(&stack.receiver.spans()) >= answered).then_some(()));
    std::thread::sleep(Duration::from_millis(500));
    let spans = stack.receiver.spans();
    let exchanges = stack.backend.token_exchanges();
    let metric = |name: &str| stack.agent.metric(name);
    let losses = metric("tracetap_events_lost_ring_full_total")
        + metric("tracetap_spans_dropped_queue_full_total")
        + metric("tracetap_spans_dropped_export_failed_total")
        + metric("tracetap_exchanges_expired_total");
    Report {
        scenario: scenario.name.to_owned(),
        haproxy: haproxy_label.to_owned(),
        verdicts: judge(&spans, scenario.path, &sent.conns, &exchanges, TOLERANCE_NS),
        sent,
        exchanges: exchanges.len(),
        unlinked: metric("tracetap_backend_requests_unlinked_total"),
        relinked: metric("tracetap_backend_exchanges_relinked_total"),
        losses,
        statuses,
        by_status: accuracy(&spans, scenario.path),
    }
}

/// Starts a traced stack with `HAProxy` `version` for `scenario` and measures it.
#[must_use]
pub fn run_on(version: haproxy::Version, scenario: &Scenario, statuses: Statuses) -> Report {
    let stack = Stack::with_config_on(version, |port, backend| scenario.config(port, backend), &agent_env());
    measure(scenario, &stack, &format!("{version:?}").to_lowercase(), statuses)
}

#[cfg(test)]
mod tests {
    use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value::Value};
    use opentelemetry_proto::tonic::trace::v1::Span;
    use opentelemetry_proto::tonic::trace::v1::span::SpanKind;

    use super::*;

    /// A span in trace 7; SERVER spans carry `url.path` `/same` and their client's `port`.
    fn span(kind: SpanKind, id: u8, parent: u8, port: u16, start: u64, end: u64) -> Received {
        let attr = |key: &str, value: Value| KeyValue {
            key: key.into(),
            value: Some(AnyValue { value: Some(value) }),
            ..KeyValue::default()
        };
        let mut attributes = vec![attr("http.response.status_code", Value::IntValue(200))];
        if kind == SpanKind::Server {
            attributes.push(attr("url.path", Value::StringValue("/same".into())));
            attributes.push(attr("network.peer.port", Value::IntValue(i64::from(port))));
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

    fn ex(received_ns: u64, sent_ns: u64) -> TokenExchange {
        TokenExchange { received_ns, sent_ns }
    }

    /// Two overlapping requests on two connections: A (port 1000, token 1) and B (port 2000,
    /// token 2), whose backend exchanges do not nest.
    fn world() -> (Vec<Received>, Vec<ConnLog>, BTreeMap<u64, TokenExchange>) {
        let spans = vec![span(SpanKind::Server, 1, 0, 1000, 100, 300), span(SpanKind::Server, 2, 0, 2000, 110, 310)];
        let conns = vec![
            ConnLog { port: 1000, opened: 0, tokens: vec![Some(1)] },
            ConnLog { port: 2000, opened: 1, tokens: vec![Some(2)] },
        ];
        let exchanges = BTreeMap::from([(1, ex(125, 145)), (2, ex(165, 185))]);
        (spans, conns, exchanges)
    }

    #[test]
    fn right_links_are_judged_right() {
        let (mut spans, conns, exchanges) = world();
        spans.push(span(SpanKind::Client, 11, 1, 0, 120, 150));
        spans.push(span(SpanKind::Client, 12, 2, 0, 160, 190));
        let v = judge(&spans, "/same", &conns, &exchanges, 0);
        assert_eq!((v.server, v.client, v.right, v.identified), (2, 2, 2, 2), "{v:?}");
    }

    #[test]
    fn a_swapped_pair_is_judged_wrong() {
        let (mut spans, conns, exchanges) = world();
        // Both CLIENT spans lie inside both SERVER spans and every status is 200: only the
        // timing of the backend exchanges shows the swap.
        spans.push(span(SpanKind::Client, 11, 2, 0, 120, 150));
        spans.push(span(SpanKind::Client, 12, 1, 0, 160, 190));
        let v = judge(&spans, "/same", &conns, &exchanges, 0);
        assert_eq!((v.client, v.right, v.wrong_exchange), (2, 0, 2), "{v:?}");
    }

    #[test]
    fn requests_on_one_connection_are_told_apart_by_start_time() {
        // One connection, two requests in turn (spans listed out of order), tokens 1 then 2.
        let mut spans =
            vec![span(SpanKind::Server, 2, 0, 1000, 200, 300), span(SpanKind::Server, 1, 0, 1000, 100, 190)];
        let conns = vec![ConnLog { port: 1000, opened: 0, tokens: vec![Some(1), Some(2)] }];
        let exchanges = BTreeMap::from([(1, ex(125, 145)), (2, ex(225, 245))]);
        spans.push(span(SpanKind::Client, 11, 1, 0, 120, 150));
        spans.push(span(SpanKind::Client, 12, 2, 0, 220, 250));
        assert_eq!(judge(&spans, "/same", &conns, &exchanges, 0).right, 2);
        // The same CLIENT spans under each other's SERVER span.
        spans[2].span.parent_span_id = vec![2; 8];
        spans[3].span.parent_span_id = vec![1; 8];
        let v = judge(&spans, "/same", &conns, &exchanges, 0);
        assert_eq!((v.right, v.outside), (0, 2), "{v:?}");
        // A missing SERVER span makes the port's requests impossible to tell apart: not right.
        spans[2].span.parent_span_id = vec![1; 8];
        spans[3].span.parent_span_id = vec![2; 8];
        let v = judge(&spans[1..], "/same", &conns, &exchanges, 0);
        assert_eq!((v.unaligned_ports, v.right, v.unjudgeable), (1, 0, 1), "{v:?}");
    }

    #[test]
    fn skew_within_the_tolerance_is_reported_and_beyond_it_is_wrong() {
        let (mut spans, conns, mut exchanges) = world();
        spans.push(span(SpanKind::Client, 11, 1, 0, 120, 150));
        spans.push(span(SpanKind::Client, 12, 2, 0, 160, 190));
        // Token 1 received 3 ns before its CLIENT span starts; token 2 sent 2 ns after it ends.
        exchanges.insert(1, ex(117, 145));
        exchanges.insert(2, ex(165, 192));
        let v = judge(&spans, "/same", &conns, &exchanges, 3);
        assert_eq!((v.right, v.max_start_skew_ns, v.max_end_skew_ns), (2, 3, 2), "{v:?}");
        let v = judge(&spans, "/same", &conns, &exchanges, 2);
        assert_eq!((v.right, v.wrong_exchange), (1, 1), "{v:?}");
    }

    #[test]
    fn a_swap_of_nested_exchanges_is_caught_by_identification() {
        let (mut spans, conns, mut exchanges) = world();
        // B's exchange lies inside A's CLIENT span, and so inside both CLIENT spans.
        exchanges.insert(2, ex(130, 140));
        spans.push(span(SpanKind::Client, 11, 1, 0, 120, 150));
        spans.push(span(SpanKind::Client, 12, 2, 0, 128, 142));
        let v = judge(&spans, "/same", &conns, &exchanges, 0);
        assert_eq!((v.right, v.identified), (2, 2), "{v:?}");
        // Swapped: A's CLIENT span contains B's exchange, but only A's exchange fits A's CLIENT
        // span once B's CLIENT span (which only B's exchange fits) is accounted for.
        spans[2].span.parent_span_id = vec![2; 8];
        spans[3].span.parent_span_id = vec![1; 8];
        let v = judge(&spans, "/same", &conns, &exchanges, 0);
        assert_eq!((v.right, v.identified_other, v.wrong_exchange), (0, 1, 1), "{v:?}");
    }

    #[test]
    fn a_swap_timing_cannot_tell_passes_unidentified() {
        // Two exchanges at the same moments: nothing in time tells them apart, so a swap passes,
        // and the figures say that no link was identified.
        let (mut spans, conns, mut exchanges) = world();
        exchanges.insert(1, ex(125, 145));
        exchanges.insert(2, ex(126, 144));
        spans.push(span(SpanKind::Client, 11, 2, 0, 120, 150));
        spans.push(span(SpanKind::Client, 12, 1, 0, 121, 149));
        let v = judge(&spans, "/same", &conns, &exchanges, 0);
        assert_eq!((v.right, v.identified), (2, 0), "{v:?}");
    }

    #[test]
    fn identification_peels_one_candidate_at_a_time() {
        // Span 0 fits exchanges a, b, c; span 1 fits b, c; span 2 fits c: c, then b, then a.
        let spans = [(0, 100), (10, 90), (20, 80)];
        let exchanges = [(5, 95, 1), (15, 85, 2), (25, 75, 3)];
        assert_eq!(identify(&spans, &exchanges, 0, false), vec![Some(1), Some(2), Some(3)]);
        // Two spans that both exchanges fit: undecided.
        let spans = [(0, 100), (1, 99)];
        let exchanges = [(5, 95, 1), (6, 94, 2)];
        assert_eq!(identify(&spans, &exchanges, 0, true), vec![None, None]);
        // Exchange 1 fits only span 0, which the others fit too: span 0 is exchange 1 only when
        // every exchange is known to have a span.
        let spans = [(0, 100), (10, 90), (11, 89)];
        let exchanges = [(5, 95, 1), (20, 80, 2), (21, 79, 3)];
        assert_eq!(identify(&spans, &exchanges, 0, true), vec![Some(1), None, None]);
        assert_eq!(identify(&spans, &exchanges, 0, false), vec![None, None, None]);
    }

    #[test]
    fn orphans_unknown_tokens_and_unaligned_ports_are_not_right() {
        let (mut spans, mut conns, exchanges) = world();
        spans.push(span(SpanKind::Client, 11, 9, 0, 120, 150));
        conns[1].tokens = vec![Some(77)];
        spans.push(span(SpanKind::Client, 12, 2, 0, 160, 190));
        let v = judge(&spans, "/same", &conns, &exchanges, 0);
        assert_eq!((v.client, v.right, v.orphan, v.unjudgeable), (2, 0, 1, 1), "{v:?}");
        // A second connection on port 1000 whose request has no SERVER span: port 1000's one
        // SERVER span could be either request's.
        let (mut spans, mut conns, exchanges) = world();
        spans.push(span(SpanKind::Client, 11, 1, 0, 120, 150));
        conns.push(ConnLog { port: 1000, opened: 2, tokens: vec![Some(1)] });
        let v = judge(&spans, "/same", &conns, &exchanges, 0);
        assert_eq!((v.right, v.unaligned_ports), (0, 1), "{v:?}");
    }

    #[test]
    fn a_port_reused_by_a_later_connection_follows_in_opening_order() {
        // Port 1000 carries token 1 on a first connection, then token 2 on a later one (logged
        // first): the earlier SERVER span is token 1's.
        let mut spans =
            vec![span(SpanKind::Server, 1, 0, 1000, 100, 190), span(SpanKind::Server, 2, 0, 1000, 200, 300)];
        let conns = vec![
            ConnLog { port: 1000, opened: 5, tokens: vec![Some(2)] },
            ConnLog { port: 1000, opened: 3, tokens: vec![Some(1)] },
        ];
        let exchanges = BTreeMap::from([(1, ex(125, 145)), (2, ex(225, 245))]);
        spans.push(span(SpanKind::Client, 11, 1, 0, 120, 150));
        spans.push(span(SpanKind::Client, 12, 2, 0, 220, 250));
        let v = judge(&spans, "/same", &conns, &exchanges, 0);
        assert_eq!((v.right, v.unaligned_ports), (2, 0), "{v:?}");
    }

    #[test]
    fn report_fails_below_999_per_mille() {
        let (mut spans, conns, exchanges) = world();
        spans.push(span(SpanKind::Client, 11, 1, 0, 120, 150));
        spans.push(span(SpanKind::Client, 12, 2, 0, 160, 190));
        let report = |spans: &[Received]| Report {
            scenario: "unit".into(),
            haproxy: "none".into(),
            sent: Sent { requests: 2, conns: conns.clone(), ..Sent::default() },
            verdicts: judge(spans, "/same", &conns, &exchanges, 0),
            exchanges: 2,
            unlinked: 0,
            relinked: 0,
            losses: 0,
            statuses: Statuses::AllOk,
            by_status: Accuracy::default(),
        };
        assert!(report(&spans).failures().is_empty(), "{:?}", report(&spans).failures());
        spans[2].span.parent_span_id = vec![2; 8];
        spans[3].span.parent_span_id = vec![1; 8];
        assert_eq!(report(&spans).failures().len(), 1);
        assert_eq!(report(&spans[..2]).failures().len(), 1, "no CLIENT spans at all");
        assert!(!report(&spans[1..]).failures().is_empty(), "a SERVER span missing");
    }
}

//! One run of the kernel matrix (`tests/tests/kernels.rs`), shared by the guest half
//! (`src/bin/kernel-guest.rs`, inside a booted kernel) and the host, which makes the same run on its
//! own kernel as the reference the guests' spans are compared with.
//!
//! A run: `HAProxy` with a TLS frontend and a cleartext one, the agent started by the caller's
//! function (the `DaemonSet`'s four capabilities, or root) with `TRACETAP_TLS_ROUTE=auto`, then
//! `h2load`'s identical requests over HTTP/1.1 and HTTP/2 to each frontend. It asserts nothing: it
//! hands what it sees, as it sees it, to the caller as facts, `(KEY, VALUE)`, `LABEL` being the
//! caller's:
//!
//! ```text
//! route LABEL: tls: ...                  (the agent's /readyz line for TLS)
//! placement LABEL: ...                   (where the TLS probes went, from the agent's log)
//! check LABEL WHAT: server=S linked=L of=N
//! shape LABEL WHAT: ...                  (see `span_shape`)
//! metric LABEL NAME: VALUE
//! ```
//!
//! TLS requests are only sent when the agent names a route: with none, they would be answered and
//! left untraced, which the route line has said already.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use crate::agent::Agent;
use crate::haproxy::Version;
use crate::otlp::Received;
use crate::{Stack, free_port, linking, tls};

/// The protocols each frontend is driven with: name, `h2load` options, requests.
pub const LOADS: [(&str, &[&str], usize); 2] =
    [("h1", &["--h1", "-c", "4"], 100), ("h2", &["-c", "4", "-m", "10"], 200)];

/// Makes one run (see the module notes), handing each fact to `say` as soon as it is known (a
/// run that panics half-way has said what it saw before).
///
/// # Panics
/// When `HAProxy`, the agent or `h2load` cannot be run, or a request is not answered.
pub fn run(label: &str, version: Version, start: fn(&[(&str, String)]) -> Agent, say: &mut dyn FnMut(String, String)) {
    let clear_port = free_port();
    let config = move |port, backend: SocketAddr| {
        tls::frontend(version)(port, backend)
            + &format!("\nfrontend fe_clear\n    bind 127.0.0.1:{clear_port}\n    default_backend be_app\n")
    };
    let mut env = linking::agent_env();
    env.push(("TRACETAP_TLS_ROUTE", "auto".to_owned()));
    let stack = Stack::with_agent(version, config, &env, start);
    let (_, ready) = stack.agent.get("/readyz").expect("/readyz answers");
    let route = ready.lines().find(|l| l.starts_with("tls: ")).unwrap_or("tls: (no line on /readyz)").to_owned();
    say(format!("route {label}"), route.clone());
    let clear = SocketAddr::from(([127, 0, 0, 1], clear_port));
    let mut fronts = vec![("clear", clear, "http")];
    if !route.starts_with("tls: none") {
        fronts.push(("tls", stack.front, "https"));
    }
    for (front_name, front, scheme) in fronts {
        for (protocol, options, n) in LOADS {
            let what = format!("{front_name}-{protocol}");
            let path = format!("/{what}");
            let spans = stack.identical_requests_to(front, scheme, &path, options, n);
            let acc = linking::accuracy(&spans, &path);
            say(format!("check {label} {what}"), format!("server={} linked={} of={n}", acc.server, acc.linked_right));
            say(format!("shape {label} {what}"), span_shape(&spans, &path));
        }
    }
    for name in ["tracetap_tls_hook_failures_total", "tracetap_tls_processes", "tracetap_events_lost_tls_unbound_total"]
    {
        say(format!("metric {label} {name}"), stack.agent.metric(name).to_string());
    }
    let log = stack.agent.log();
    if let Some(line) = log.lines().find(|l| l.contains("TLS probes attached")) {
        let placement = line.split_once("placement=").map_or("(none)", |(_, p)| p);
        say(format!("placement {label}"), placement.to_owned());
    }
    if route.starts_with("tls: none") {
        let messages = log.lines().filter(|l| l.contains("TLS connections cannot be traced on this node")).count();
        say(format!("metric {label} refusal_messages"), messages.to_string());
    }
}

/// Attributes whose values do not depend on the run: their values are part of a span's shape.
/// Ports, times and ids do; so do status codes (the backend's `cycle` goes through its statuses
/// from wherever it stands, and a SERVER span's status is checked against its CLIENT's by
/// `linking::accuracy` instead) and HAProxy's termination state (timers decide it on a slow
/// emulated machine).
const STABLE_VALUES: [&str; 10] = [
    "client.address",
    "haproxy.backend",
    "haproxy.frontend",
    "haproxy.server",
    "http.request.method",
    "network.protocol.version",
    "server.address",
    "tls.protocol.name",
    "tls.protocol.version",
    "url.scheme",
];

/// What the spans of the requests to `path` are made of: the names, attribute keys and the
/// values of [`STABLE_VALUES`] of their SERVER spans, and the same of the CLIENT spans under them,
/// names and values with how many spans carry them. Two agents that trace the same requests alike
/// give the same shape.
#[must_use]
pub fn span_shape(spans: &[Received], path: &str) -> String {
    let servers: Vec<&Received> =
        spans.iter().filter(|s| s.is_server() && s.str_attr("url.path") == Some(path)).collect();
    let ids: BTreeSet<&[u8]> = servers.iter().map(|s| &s.span.span_id[..]).collect();
    let clients: Vec<&Received> =
        spans.iter().filter(|s| s.is_client() && ids.contains(&s.span.parent_span_id[..])).collect();
    let shape = |of: &[&Received]| {
        // Names and stable values with how many spans carry them; other keys, whether any does
        // (how many spans have `error.type` depends on where the statuses' cycle stood).
        let mut counted: BTreeMap<String, usize> = BTreeMap::new();
        let mut keys: BTreeSet<&str> = BTreeSet::new();
        for span in of {
            *counted.entry(format!("name={}", span.span.name)).or_default() += 1;
            for attribute in &span.span.attributes {
                let key = attribute.key.as_str();
                if STABLE_VALUES.contains(&key) {
                    let value = attribute.value.as_ref().and_then(|v| v.value.as_ref());
                    let value = value.map_or_else(String::new, |v| format!("{v:?}"));
                    *counted.entry(format!("{key}={value}")).or_default() += 1;
                } else {
                    keys.insert(key);
                }
            }
        }
        let counted = counted.iter().map(|(what, n)| format!("{what} x{n}"));
        counted.chain(keys.iter().map(|k| (*k).to_owned())).collect::<Vec<_>>().join(", ")
    };
    format!("server[{}] client[{}]", shape(&servers), shape(&clients))
}

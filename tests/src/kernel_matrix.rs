//! One run of the kernel matrix (`tests/tests/kernels.rs`), shared by the guest half
//! (`src/bin/kernel-guest.rs`, inside a booted kernel) and the host, which makes the same run on its
//! own kernel as the reference the guests' spans are compared with.
//!
//! A run: `HAProxy` with a TLS frontend and a cleartext one, the agent started by the caller's
//! function (the `DaemonSet`'s four capabilities, or root) with `TRACETAP_TLS_ROUTE=auto`, then
//! `h2load`'s identical requests over HTTP/1.1 and HTTP/2 to each frontend. It asserts nothing: it
//! returns what it saw as facts, `(KEY, VALUE)`, `LABEL` being the caller's:
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

use std::collections::BTreeSet;
use std::net::SocketAddr;

use crate::agent::Agent;
use crate::haproxy::Version;
use crate::otlp::Received;
use crate::{Stack, free_port, linking, tls};

/// The protocols each frontend is driven with: name, `h2load` options, requests.
pub const LOADS: [(&str, &[&str], usize); 2] =
    [("h1", &["--h1", "-c", "4"], 100), ("h2", &["-c", "4", "-m", "10"], 200)];

/// What a run saw, in the order it saw it.
pub type Facts = Vec<(String, String)>;

/// Makes one run (see the module notes) and returns its facts.
///
/// # Panics
/// When `HAProxy`, the agent or `h2load` cannot be run, or a request is not answered.
#[must_use]
pub fn run(label: &str, version: Version, start: fn(&[(&str, String)]) -> Agent) -> Facts {
    let mut facts = Facts::new();
    let mut say = |key: String, value: String| facts.push((key, value));
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
        let line = without_colours(line);
        let placement = line.split_once("placement=").map_or("(none)", |(_, p)| p);
        say(format!("placement {label}"), placement.to_owned());
    }
    if route.starts_with("tls: none") {
        let messages = log.lines().filter(|l| l.contains("TLS connections cannot be traced on this node")).count();
        say(format!("metric {label} refusal_messages"), messages.to_string());
    }
    facts
}

/// What the spans of the requests to `path` are made of, whatever their values: the names and
/// attribute keys of their SERVER spans, and those of the CLIENT spans under them, each a sorted
/// union over the requests (`h2load`'s requests cycle through statuses, so error attributes are
/// in it too). Two agents that trace alike give the same shape.
#[must_use]
pub fn span_shape(spans: &[Received], path: &str) -> String {
    let servers: Vec<&Received> =
        spans.iter().filter(|s| s.is_server() && s.str_attr("url.path") == Some(path)).collect();
    let ids: BTreeSet<&[u8]> = servers.iter().map(|s| &s.span.span_id[..]).collect();
    let clients: Vec<&Received> =
        spans.iter().filter(|s| s.is_client() && ids.contains(&s.span.parent_span_id[..])).collect();
    let shape = |of: &[&Received]| {
        let names: BTreeSet<&str> = of.iter().map(|s| s.span.name.as_str()).collect();
        let keys: BTreeSet<&str> = of.iter().flat_map(|s| s.span.attributes.iter().map(|a| a.key.as_str())).collect();
        format!(
            "names={} keys={}",
            names.into_iter().collect::<Vec<_>>().join("|"),
            keys.into_iter().collect::<Vec<_>>().join(",")
        )
    };
    format!("server[{}] client[{}]", shape(&servers), shape(&clients))
}

/// `line` without its terminal colour sequences (`ESC [ ... m`), which the agent's log has around
/// field names.
fn without_colours(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some((before, after)) = rest.split_once('\u{1b}') {
        out.push_str(before);
        rest = after.split_once('m').map_or("", |(_, tail)| tail);
    }
    out.push_str(rest);
    out
}

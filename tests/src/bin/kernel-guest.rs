//! The guest half of the kernel matrix (`tests/tests/kernels.rs`): the program a VM booted from a
//! Debian kernel runs, which prints what it saw as `tracetap-guest:` lines on the console for the
//! host half to check. It asserts nothing itself: what each kernel must give is said on the host.
//!
//! For each `kernel.perf_event_paranoid` value in `TRACETAP_GUEST_PARANOID` (comma-separated; the
//! kernel hands its command line's `NAME=value` words to init as environment) and each `HAProxy`
//! version (`TRACETAP_GUEST_HAPROXY`, see [`versions`]): `HAProxy` with a TLS frontend and a cleartext one, the agent with exactly the
//! `DaemonSet`'s four capabilities and `TRACETAP_TLS_ROUTE=auto`, then `h2load`'s identical
//! requests over HTTP/1.1 and HTTP/2 to each frontend. Lines (`LABEL` is `paranoid=P haproxy=V`):
//!
//! ```text
//! tracetap-guest: kernel: RELEASE
//! tracetap-guest: machine: MACHINE                 (`uname -m`)
//! tracetap-guest: route LABEL: tls: ...            (the agent's /readyz line for TLS)
//! tracetap-guest: placement LABEL: ...            (where the TLS probes went, from the agent's log)
//! tracetap-guest: check LABEL WHAT: server=S linked=L of=N
//! tracetap-guest: metric LABEL NAME: VALUE
//! tracetap-guest: done
//! ```
//!
//! TLS requests are only sent when the agent names a route: with none, they would be answered
//! and left untraced, which the route line has said already.

use std::net::SocketAddr;

use tracetap_tests::agent::Agent;
use tracetap_tests::haproxy::{self, Version};
use tracetap_tests::{Stack, free_port, linking, tls};

/// The protocols each frontend is driven with: name, `h2load` options, requests.
const LOADS: [(&str, &[&str], usize); 2] = [("h1", &["--h1", "-c", "4"], 100), ("h2", &["-c", "4", "-m", "10"], 200)];

fn main() {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    say(&format!("kernel: {}", release.trim()));
    let machine = std::process::Command::new("uname").arg("-m").output().map(|o| o.stdout).unwrap_or_default();
    say(&format!("machine: {}", String::from_utf8_lossy(&machine).trim()));
    let phases = std::env::var("TRACETAP_GUEST_PARANOID").unwrap_or_default();
    for paranoid in phases.split(',').filter(|p| !p.is_empty()) {
        std::fs::write("/proc/sys/kernel/perf_event_paranoid", paranoid).expect("set kernel.perf_event_paranoid");
        for version in versions() {
            run(&format!("paranoid={paranoid} haproxy={}", version.number()), version);
        }
    }
    say("done");
}

/// The `HAProxy` versions to run: those named in `TRACETAP_GUEST_HAPROXY` (comma-separated,
/// `2.6` or `3.0`; the arm64 guest has no Debian 13 tree), else both.
fn versions() -> Vec<Version> {
    match std::env::var("TRACETAP_GUEST_HAPROXY") {
        Ok(names) if !names.is_empty() => {
            haproxy::versions().into_iter().filter(|v| names.split(',').any(|n| n == v.number())).collect()
        }
        _ => haproxy::versions().to_vec(),
    }
}

fn run(label: &str, version: Version) {
    let clear_port = free_port();
    let config = move |port, backend: SocketAddr| {
        tls::frontend(version)(port, backend)
            + &format!("\nfrontend fe_clear\n    bind 127.0.0.1:{clear_port}\n    default_backend be_app\n")
    };
    let mut env = linking::agent_env();
    env.push(("TRACETAP_TLS_ROUTE", "auto".to_owned()));
    let stack = Stack::with_agent(version, config, &env, Agent::start_with_daemonset_capabilities);
    let (_, ready) = stack.agent.get("/readyz").expect("/readyz answers");
    let route = ready.lines().find(|l| l.starts_with("tls: ")).unwrap_or("tls: (no line on /readyz)");
    say(&format!("route {label}: {route}"));
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
            say(&format!("check {label} {what}: server={} linked={} of={n}", acc.server, acc.linked_right));
        }
    }
    for name in ["tracetap_tls_hook_failures_total", "tracetap_tls_processes", "tracetap_events_lost_tls_unbound_total"]
    {
        say(&format!("metric {label} {name}: {}", stack.agent.metric(name)));
    }
    let log = stack.agent.log();
    if let Some(line) = log.lines().find(|l| l.contains("TLS probes attached")) {
        let line = without_colours(line);
        let placement = line.split_once("placement=").map_or("(none)", |(_, p)| p);
        say(&format!("placement {label}: {placement}"));
    }
    if route.starts_with("tls: none") {
        let messages = log.lines().filter(|l| l.contains("TLS connections cannot be traced on this node")).count();
        say(&format!("metric {label} refusal_messages: {messages}"));
    }
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

fn say(line: &str) {
    println!("tracetap-guest: {line}");
}

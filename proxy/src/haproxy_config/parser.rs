//! The parser: lines of HAProxy's configuration, as HAProxy splits them
//! ([`crate::haproxy_words`]), read section by section into the name model of the parent module
//! ([`ProxyNames`]). It never fails on what it does not understand: an unknown line is skipped, a
//! `bind` or `server` it cannot read is kept (shortened) among the skipped lines, and what it keeps
//! is charged against [`super::MAX_NAMES_BYTES`] and [`MAX_BINDS`] as it goes.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::{Bind, BindAddr, FdBind, HostServer, MAX_BINDS, MAX_STATS_SOCKETS, ProxyNames, ServerIndex, ServerLine};
use crate::haproxy_words::{self, Environment};

/// A `bind` line's addresses (`ADDR:PORT` forms, and `fd@N` for later), within the names budget;
/// a line with any unreadable address is counted as skipped, one over the budget as over limit.
fn add_bind_line(names: &mut ProxyNames, frontend: &str, spec: &str, tcp: bool, line: &str) {
    let (mut unreadable, mut over_limit) = (false, false);
    for part in spec.split(',') {
        if let Some(fd) = part.strip_prefix("fd@") {
            match fd.parse::<i32>() {
                Ok(fd)
                    if fd >= 0
                        && names.fd_binds.len() < MAX_BINDS
                        && names.take(size_of::<FdBind>() + frontend.len()) =>
                {
                    names.fd_binds.push(FdBind { fd, frontend: frontend.to_owned(), tcp });
                }
                Ok(fd) if fd >= 0 => over_limit = true,
                _ => unreadable = true,
            }
            continue;
        }
        let Some(addr) = parse_bind(part) else {
            unreadable = true;
            continue;
        };
        // Checked before the name is cloned: the clone is what a hostile line multiplies.
        if names.frontends.len() >= MAX_BINDS || !names.take(size_of::<Bind>() + frontend.len()) {
            over_limit = true;
            continue;
        }
        names.frontends.push(Bind { addr, frontend: frontend.to_owned(), tcp });
    }
    if unreadable {
        names.skip(line);
    }
    names.over_limit_lines += usize::from(over_limit);
}

/// A `server` line's entry, within the names budget.
fn add_server(names: &mut ProxyNames, backend: &str, server: &str, (ip, port): (IpAddr, Option<u16>), tcp: bool) {
    // The cost of `server_cost`, checked before anything is cloned.
    if names.take(size_of::<ServerLine>() + backend.len() + server.len()) {
        names.servers.push(ServerLine { backend: backend.to_owned(), server: server.to_owned(), tcp, ip, port });
    } else {
        names.over_limit_lines += 1;
    }
}

/// A `server` line with a hostname, within the names budget.
fn add_host_server(names: &mut ProxyNames, backend: &str, server: &str, host: &str, port: Option<u16>, tcp: bool) {
    if names.take(size_of::<HostServer>() + backend.len() + server.len() + host.len()) {
        let line = ServerLine {
            backend: backend.to_owned(),
            server: server.to_owned(),
            tcp,
            ip: IpAddr::from([0, 0, 0, 0]),
            port,
        };
        names.host_servers.push(HostServer { line, host: host.to_ascii_lowercase() });
    } else {
        names.over_limit_lines += 1;
    }
}

/// `HOST[:PORT]` where `HOST` is a hostname (letters, digits, `-`, `.`, `_`; at most 253 bytes).
fn host_port(spec: &str) -> Option<(&str, Option<u16>)> {
    let (host, port) = match spec.rsplit_once(':') {
        Some((host, port)) => (host, if port.is_empty() { None } else { Some(port.parse().ok()?) }),
        None => (spec, None),
    };
    let valid = !host.is_empty()
        && host.len() <= 253
        && host.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
        && host.bytes().any(|b| b.is_ascii_alphabetic());
    valid.then_some((host, port))
}

/// A `stats socket` line's unix socket path, within the names budget.
fn add_stats_socket(names: &mut ProxyNames, spec: &str) {
    if let Some(path) = unix_socket_path(spec)
        && names.stats_sockets.len() < MAX_STATS_SOCKETS
        && names.take(path.len())
    {
        names.stats_sockets.push(path.to_owned());
    }
}

/// A `stats socket` address that is a unix socket path (`/run/haproxy/admin.sock`,
/// `unix@/path`); TCP, abstract and inherited sockets are not read.
fn unix_socket_path(spec: &str) -> Option<&str> {
    let path = spec.strip_prefix("unix@").unwrap_or(spec);
    (path.starts_with('/') && !path.contains('@')).then_some(path)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Section {
    Other,
    Global,
    Frontend,
    Backend,
    Listen,
}

/// Parses one configuration file's text (see [`ConfigParser`] for several).
#[must_use]
pub fn parse(text: &str) -> ProxyNames {
    let mut parser = ConfigParser::new();
    parser.add_file(text);
    parser.finish()
}

/// Reads the files of one configuration in the order HAProxy loads them. The mode of the last
/// `defaults` section carries over to the files after it, as in HAProxy (a `conf.d` whose
/// `00-defaults.cfg` says `mode http`); a section ends with its file. The limits
/// ([`super::MAX_NAMES_BYTES`], [`MAX_BINDS`]) are for all the files together.
#[derive(Debug)]
pub struct ConfigParser {
    names: ProxyNames,
    /// The process's environment, for `"${VAR}"` ([`haproxy_words`]).
    env: Environment,
    /// `mode` of the last `defaults` section, inherited by the proxies after it; `tcp` is the
    /// fallback HAProxy itself uses.
    default_tcp: bool,
}

impl Default for ConfigParser {
    fn default() -> Self {
        Self::new()
    }
}

impl ConfigParser {
    #[must_use]
    pub fn new() -> Self {
        Self::with_environment(Environment::default())
    }

    /// A parser that expands `"${VAR}"` from `env` (the traced process's environment).
    #[must_use]
    pub fn with_environment(env: Environment) -> Self {
        Self { names: ProxyNames::default(), env, default_tcp: true }
    }

    /// Parses the next file's text.
    pub fn add_file(&mut self, text: &str) {
        let names = &mut self.names;
        let mut section = Section::Other;
        let mut name = String::new();
        let mut in_defaults = false;
        let mut tcp = self.default_tcp;
        // bind/server lines of the current section, which learn its mode when the section ends.
        let mut from = section_start(names);
        for raw in text.lines() {
            let line = raw.trim();
            let split = haproxy_words::split(line, &self.env);
            let mut words = split.iter().map(String::as_str);
            let Some(keyword) = words.next() else { continue };
            match keyword {
                "frontend" | "backend" | "listen" => {
                    finish_section(names, from, tcp);
                    from = section_start(names);
                    in_defaults = false;
                    tcp = self.default_tcp;
                    section = match keyword {
                        "frontend" => Section::Frontend,
                        "backend" => Section::Backend,
                        _ => Section::Listen,
                    };
                    words.next().unwrap_or("").clone_into(&mut name);
                    if name.is_empty() {
                        section = Section::Other;
                    } else if section == Section::Listen && names.take(2 * name.len()) {
                        // A `listen` section sends to its own servers.
                        names.routes.entry(name.clone()).or_default().backends.push(name.clone());
                    }
                }
                "global" | "defaults" | "resolvers" | "peers" | "userlist" | "cache" | "program" | "http-errors"
                | "ring" | "mailers" | "fcgi-app" | "crt-store" | "traces" | "log-forward" => {
                    finish_section(names, from, tcp);
                    from = section_start(names);
                    in_defaults = keyword == "defaults";
                    section = if keyword == "global" { Section::Global } else { Section::Other };
                }
                "mode" => {
                    let is_tcp = words.next() == Some("tcp");
                    if in_defaults {
                        self.default_tcp = is_tcp;
                    } else {
                        tcp = is_tcp;
                    }
                }
                "bind" if matches!(section, Section::Frontend | Section::Listen) => {
                    add_bind_line(names, &name, words.next().unwrap_or(""), tcp, line);
                }
                "chroot" if section == Section::Global => {
                    names.chroot =
                        words.next().filter(|dir| dir.starts_with('/') && dir.len() <= 4096).map(str::to_owned);
                }
                "stats" if section == Section::Global => {
                    if let (Some("socket"), Some(path)) = (words.next(), words.next()) {
                        add_stats_socket(names, path);
                    }
                }
                "default_backend" | "use_backend" if matches!(section, Section::Frontend | Section::Listen) => {
                    add_route(names, &name, words.next().unwrap_or(""));
                }
                "server" if matches!(section, Section::Backend | Section::Listen) => {
                    let server = words.next().unwrap_or("");
                    let spec = words.next().unwrap_or("");
                    match (parse_server_addr(spec), host_port(spec)) {
                        (Some(addr), _) if !server.is_empty() => add_server(names, &name, server, addr, tcp),
                        (None, Some((host, port))) if !server.is_empty() => {
                            add_host_server(names, &name, server, host, port, tcp);
                        }
                        _ => names.skip(line),
                    }
                }
                "server-template" if matches!(section, Section::Backend | Section::Listen) => {
                    let (prefix, slots) = (words.next().unwrap_or(""), words.next().and_then(template_slots));
                    match (slots, words.next().and_then(parse_server_addr)) {
                        (Some(slots), Some((ip, port))) if !prefix.is_empty() => {
                            add_template(names, &name, prefix, slots, (ip, port), tcp);
                        }
                        _ => names.skip(line),
                    }
                }
                _ => {}
            }
        }
        finish_section(names, from, tcp);
        names.server_index = ServerIndex::default();
    }

    /// The names of every file given, with the server index built (here, rather than on the
    /// first connection the capture thread looks up).
    #[must_use]
    pub fn finish(self) -> ProxyNames {
        let names = self.names;
        names.index();
        names
    }
}

/// The slot numbers of a `server-template`: `N` (1 to N) or `A-B`.
fn template_slots(spec: &str) -> Option<std::ops::RangeInclusive<u32>> {
    let (first, last) = match spec.split_once('-') {
        Some((a, b)) => (a.parse().ok()?, b.parse().ok()?),
        None => (1, spec.parse().ok()?),
    };
    (first <= last).then_some(first..=last)
}

/// The servers of a `server-template` line, `PREFIX1`, `PREFIX2`, ..., all at the line's address
/// (the runtime API or DNS move them later; here they share it, so a connection to it is named
/// only if one slot remains). Stops at the names budget, however many slots the line asks for.
fn add_template(
    names: &mut ProxyNames,
    backend: &str,
    prefix: &str,
    slots: std::ops::RangeInclusive<u32>,
    (ip, port): (IpAddr, Option<u16>),
    tcp: bool,
) {
    for slot in slots {
        let server = format!("{prefix}{slot}");
        if !names.take(size_of::<ServerLine>() + backend.len() + server.len()) {
            names.over_limit_lines += 1;
            return;
        }
        names.servers.push(ServerLine { backend: backend.to_owned(), server, tcp, ip, port });
    }
}

/// Records that `frontend` can send requests to `target` (a `default_backend` or `use_backend`).
fn add_route(names: &mut ProxyNames, frontend: &str, target: &str) {
    if target.is_empty() {
        return;
    }
    if names.take(target.len() + frontend.len()) {
        let routes = names.routes.entry(frontend.to_owned()).or_default();
        if target.contains('%') {
            routes.dynamic = true;
        } else if !routes.backends.iter().any(|b| b == target) {
            routes.backends.push(target.to_owned());
        }
    } else {
        // Over the budget: this frontend's routes are unknown, so nothing is narrowed.
        names.routes.entry(frontend.to_owned()).or_default().dynamic = true;
        names.over_limit_lines += 1;
    }
}

/// `mode` may come after `bind`/`server` in a section: apply the section's final mode.
fn finish_section(
    names: &mut ProxyNames,
    (binds_from, servers_from, hosts_from, fds_from): (usize, usize, usize, usize),
    tcp: bool,
) {
    for f in &mut names.fd_binds[fds_from..] {
        f.tcp = tcp;
    }
    for b in &mut names.frontends[binds_from..] {
        b.tcp = tcp;
    }
    for s in &mut names.servers[servers_from..] {
        s.tcp = tcp;
    }
    for h in &mut names.host_servers[hosts_from..] {
        h.line.tcp = tcp;
    }
}

/// Where the current section's entries start in each list.
fn section_start(names: &ProxyNames) -> (usize, usize, usize, usize) {
    (names.frontends.len(), names.servers.len(), names.host_servers.len(), names.fd_binds.len())
}

/// `ADDR:PORT`, `:PORT`, `*:PORT`, `[V6]:PORT`, `ipv4@...`, `ipv6@...`, port ranges `A-B`.
fn parse_bind(spec: &str) -> Option<BindAddr> {
    let spec = spec.strip_prefix("ipv4@").or_else(|| spec.strip_prefix("ipv6@")).unwrap_or(spec);
    let (host, ports) = split_host_port(spec)?;
    let ports = if let Some((a, b)) = ports.split_once('-') {
        (a.parse().ok()?, b.parse().ok()?)
    } else {
        let p = ports.parse().ok()?;
        (p, p)
    };
    let ip = match host {
        "" | "*" | "0.0.0.0" | "::" => None,
        h => Some(h.parse().ok()?),
    };
    Some(BindAddr { ip, ports })
}

/// `IP[:PORT]` or `[V6][:PORT]`, with `localhost` as 127.0.0.1. Hostnames are not resolved.
fn parse_server_addr(spec: &str) -> Option<(IpAddr, Option<u16>)> {
    let spec = spec.strip_prefix("ipv4@").or_else(|| spec.strip_prefix("ipv6@")).unwrap_or(spec);
    let ip_of = |h: &str| -> Option<IpAddr> {
        match h {
            "localhost" => Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            "ip6-localhost" => Some(IpAddr::V6(Ipv6Addr::LOCALHOST)),
            h => h.parse().ok(),
        }
    };
    if let Ok(ip) = spec.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
        return Some((ip, None));
    }
    let (host, port) = split_host_port(spec)?;
    Some((ip_of(host)?, if port.is_empty() { None } else { Some(port.parse().ok()?) }))
}

fn split_host_port(spec: &str) -> Option<(&str, &str)> {
    if let Some(rest) = spec.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        return Some((host, after.strip_prefix(':').unwrap_or("")));
    }
    spec.rsplit_once(':')
}

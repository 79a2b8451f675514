//! Just enough of HAProxy's configuration language to name what the tracker sees: which
//! `frontend`/`listen` section a bind address belongs to, and which `backend`/`listen` section and
//! `server` line a server address belongs to.
//!
//! The input is hostile (any file a traced process was started with): the parser never fails on
//! what it does not understand. It skips unknown lines, keeps what it could read, and reports what
//! it skipped, so the agent can degrade to addresses with one warning.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// A `bind` address: an IP (or any) and a port range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindAddr {
    /// `None` for a wildcard (`*`, empty, `0.0.0.0`, `::`).
    pub ip: Option<IpAddr>,
    pub ports: (u16, u16),
}

impl BindAddr {
    fn matches(&self, addr: SocketAddr) -> bool {
        let port_ok = (self.ports.0..=self.ports.1).contains(&addr.port());
        port_ok && self.ip.is_none_or(|ip| ip == addr.ip() || mapped(ip) == mapped(addr.ip()))
    }
}

fn mapped(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        IpAddr::V4(_) => ip,
    }
}

/// A `bind` line's address in a `frontend` or `listen` section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bind {
    pub addr: BindAddr,
    pub frontend: String,
    /// The section runs `mode tcp`: its connections carry no HTTP to trace.
    pub tcp: bool,
}

/// A `server` line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerLine {
    pub backend: String,
    pub server: String,
    /// The section runs `mode tcp`.
    pub tcp: bool,
    pub ip: IpAddr,
    /// `None` when the line gives no port (HAProxy then uses the client's destination port).
    pub port: Option<u16>,
}

/// Names found in a configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProxyNames {
    pub frontends: Vec<Bind>,
    pub servers: Vec<ServerLine>,
    /// Lines with a `bind` or `server` the parser could not read (hostnames, unix sockets,
    /// environment variables): their sections degrade to addresses.
    pub skipped: Vec<String>,
}

impl ProxyNames {
    /// The frontend a client connected to, by the local address of the accepted socket. Exact
    /// addresses win over wildcards.
    #[must_use]
    pub fn frontend(&self, local: SocketAddr) -> Option<&str> {
        self.bind(local).map(|b| b.frontend.as_str())
    }

    /// The `bind` line a client connected through. Exact addresses win over wildcards.
    #[must_use]
    pub fn bind(&self, local: SocketAddr) -> Option<&Bind> {
        let exact = self.frontends.iter().find(|b| b.addr.ip.is_some() && b.addr.matches(local));
        exact.or_else(|| self.frontends.iter().find(|b| b.addr.ip.is_none() && b.addr.matches(local)))
    }

    /// The backend and server HAProxy connected to. When several lines share an address, the
    /// first one wins.
    #[must_use]
    pub fn server(&self, addr: SocketAddr) -> Option<(&str, &str)> {
        self.server_line(addr).map(|s| (s.backend.as_str(), s.server.as_str()))
    }

    /// The `server` line HAProxy connected to.
    #[must_use]
    pub fn server_line(&self, addr: SocketAddr) -> Option<&ServerLine> {
        let hit = |with_port: bool| {
            self.servers.iter().find(|s| {
                mapped(s.ip) == mapped(addr.ip())
                    && if with_port { s.port == Some(addr.port()) } else { s.port.is_none() }
            })
        };
        hit(true).or_else(|| hit(false))
    }

    /// Adds the names of another file of the same configuration (`-f` may be given many times).
    pub fn extend(&mut self, other: Self) {
        self.frontends.extend(other.frontends);
        self.servers.extend(other.servers);
        self.skipped.extend(other.skipped);
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Section {
    Other,
    Frontend,
    Backend,
    Listen,
}

/// Parses one configuration file's text.
#[must_use]
pub fn parse(text: &str) -> ProxyNames {
    let mut names = ProxyNames::default();
    let mut section = Section::Other;
    let mut name = String::new();
    // `mode` of the last `defaults` section, inherited by the proxies after it; `tcp` is the
    // fallback HAProxy itself uses.
    let mut default_tcp = true;
    let mut in_defaults = false;
    let mut tcp = default_tcp;
    // bind/server lines of the current section, which learn its mode when the section ends.
    let (mut binds_from, mut servers_from) = (0, 0);
    for raw in text.lines() {
        let line = raw.split('#').next().unwrap_or("").trim();
        let mut words = line.split_whitespace();
        let Some(keyword) = words.next() else { continue };
        match keyword {
            "frontend" | "backend" | "listen" => {
                finish_section(&mut names, binds_from, servers_from, tcp);
                (binds_from, servers_from) = (names.frontends.len(), names.servers.len());
                in_defaults = false;
                tcp = default_tcp;
                section = match keyword {
                    "frontend" => Section::Frontend,
                    "backend" => Section::Backend,
                    _ => Section::Listen,
                };
                words.next().unwrap_or("").clone_into(&mut name);
                if name.is_empty() {
                    section = Section::Other;
                }
            }
            "global" | "defaults" | "resolvers" | "peers" | "userlist" | "cache" | "program" | "http-errors"
            | "ring" | "mailers" | "fcgi-app" | "crt-store" | "traces" | "log-forward" => {
                finish_section(&mut names, binds_from, servers_from, tcp);
                (binds_from, servers_from) = (names.frontends.len(), names.servers.len());
                in_defaults = keyword == "defaults";
                section = Section::Other;
            }
            "mode" => {
                let is_tcp = words.next() == Some("tcp");
                if in_defaults {
                    default_tcp = is_tcp;
                } else {
                    tcp = is_tcp;
                }
            }
            "bind" if matches!(section, Section::Frontend | Section::Listen) => {
                let spec = words.next().unwrap_or("");
                for part in spec.split(',') {
                    match parse_bind(part) {
                        Some(addr) => names.frontends.push(Bind { addr, frontend: name.clone(), tcp }),
                        None => names.skipped.push(line.to_owned()),
                    }
                }
            }
            "server" if matches!(section, Section::Backend | Section::Listen) => {
                let server = words.next().unwrap_or("");
                match words.next().and_then(parse_server_addr) {
                    Some((ip, port)) if !server.is_empty() => {
                        names.servers.push(ServerLine {
                            backend: name.clone(),
                            server: server.to_owned(),
                            tcp,
                            ip,
                            port,
                        });
                    }
                    _ => names.skipped.push(line.to_owned()),
                }
            }
            _ => {}
        }
    }
    finish_section(&mut names, binds_from, servers_from, tcp);
    names
}

/// `mode` may come after `bind`/`server` in a section: apply the section's final mode.
fn finish_section(names: &mut ProxyNames, binds_from: usize, servers_from: usize, tcp: bool) {
    for b in &mut names.frontends[binds_from..] {
        b.tcp = tcp;
    }
    for s in &mut names.servers[servers_from..] {
        s.tcp = tcp;
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    const CFG: &str = "
global
    daemon
defaults
    mode http
frontend fe_main   # the edge
    bind 127.0.0.1:8080
    bind :8443,[::1]:9443
    default_backend be_app
listen stats
    bind *:8000-8010
    server local localhost:9000
backend be_app
    server app1 10.0.0.1:80 check
    server app2 10.0.0.2
    server dyn app.internal:80
";

    #[test]
    fn names_from_a_config() {
        let n = parse(CFG);
        assert_eq!(n.frontend("127.0.0.1:8080".parse().unwrap()), Some("fe_main"));
        assert_eq!(n.frontend("10.9.9.9:8443".parse().unwrap()), Some("fe_main"));
        assert_eq!(n.frontend("[::1]:9443".parse().unwrap()), Some("fe_main"));
        assert_eq!(n.frontend("127.0.0.1:8005".parse().unwrap()), Some("stats"));
        assert_eq!(n.frontend("127.0.0.1:7000".parse().unwrap()), None);
        assert_eq!(n.server("10.0.0.1:80".parse().unwrap()), Some(("be_app", "app1")));
        assert_eq!(n.server("10.0.0.2:8080".parse().unwrap()), Some(("be_app", "app2")));
        assert_eq!(n.server("127.0.0.1:9000".parse().unwrap()), Some(("stats", "local")));
        assert_eq!(n.server("10.0.0.3:80".parse().unwrap()), None);
        assert_eq!(n.skipped, vec!["server dyn app.internal:80".to_owned()]);
    }

    #[test]
    fn modes_follow_sections_and_defaults() {
        let n = parse(
            "frontend before\n bind :1\ndefaults\n mode http\nfrontend web\n bind :2\nfrontend db\n bind :3\n mode tcp\nbackend be_db\n mode tcp\n server s 10.0.0.1:5432\nbackend be_web\n server w 10.0.0.2:80\n",
        );
        let tcp = |port: u16| n.bind(SocketAddr::from(([127, 0, 0, 1], port))).unwrap().tcp;
        assert!(tcp(1), "HAProxy's own default mode is tcp");
        assert!(!tcp(2));
        assert!(tcp(3), "mode after bind applies to the whole section");
        assert!(n.server_line("10.0.0.1:5432".parse().unwrap()).unwrap().tcp);
        assert!(!n.server_line("10.0.0.2:80".parse().unwrap()).unwrap().tcp);
    }

    #[test]
    fn exact_bind_wins_over_wildcard() {
        let n = parse("frontend any\n bind :80\nfrontend lo\n bind 127.0.0.1:80\n");
        assert_eq!(n.frontend("127.0.0.1:80".parse().unwrap()), Some("lo"));
        assert_eq!(n.frontend("10.0.0.1:80".parse().unwrap()), Some("any"));
    }

    #[test]
    fn garbage_never_panics() {
        for text in
            ["", "frontend", "bind", "backend b\nserver", "backend b\n server s [::1", "frontend f\n bind [::1]:x"]
        {
            let _ = parse(text);
        }
    }
}

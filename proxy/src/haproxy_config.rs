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

/// A `server` line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerLine {
    pub backend: String,
    pub server: String,
    pub ip: IpAddr,
    /// `None` when the line gives no port (HAProxy then uses the client's destination port).
    pub port: Option<u16>,
}

/// Names found in a configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProxyNames {
    pub frontends: Vec<(BindAddr, String)>,
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
        let exact = self.frontends.iter().find(|(b, _)| b.ip.is_some() && b.matches(local));
        exact
            .or_else(|| self.frontends.iter().find(|(b, _)| b.ip.is_none() && b.matches(local)))
            .map(|(_, n)| n.as_str())
    }

    /// The backend and server HAProxy connected to. When several lines share an address, the
    /// first one wins.
    #[must_use]
    pub fn server(&self, addr: SocketAddr) -> Option<(&str, &str)> {
        let hit = |with_port: bool| {
            self.servers.iter().find(|s| {
                mapped(s.ip) == mapped(addr.ip())
                    && if with_port { s.port == Some(addr.port()) } else { s.port.is_none() }
            })
        };
        hit(true).or_else(|| hit(false)).map(|s| (s.backend.as_str(), s.server.as_str()))
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
    for raw in text.lines() {
        let line = raw.split('#').next().unwrap_or("").trim();
        let mut words = line.split_whitespace();
        let Some(keyword) = words.next() else { continue };
        match keyword {
            "frontend" | "backend" | "listen" => {
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
            | "ring" | "mailers" | "fcgi-app" | "crt-store" | "traces" | "log-forward" => section = Section::Other,
            "bind" if matches!(section, Section::Frontend | Section::Listen) => {
                let spec = words.next().unwrap_or("");
                for part in spec.split(',') {
                    match parse_bind(part) {
                        Some(b) => names.frontends.push((b, name.clone())),
                        None => names.skipped.push(line.to_owned()),
                    }
                }
            }
            "server" if matches!(section, Section::Backend | Section::Listen) => {
                let server = words.next().unwrap_or("");
                match words.next().and_then(parse_server_addr) {
                    Some((ip, port)) if !server.is_empty() => {
                        names.servers.push(ServerLine { backend: name.clone(), server: server.to_owned(), ip, port });
                    }
                    _ => names.skipped.push(line.to_owned()),
                }
            }
            _ => {}
        }
    }
    names
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

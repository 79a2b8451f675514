//! Just enough of HAProxy's configuration language to name what the tracker sees: which
//! `frontend`/`listen` section a bind address belongs to, and which `backend`/`listen` section and
//! `server` line a server address belongs to.
//!
//! The input is hostile (any file a traced process was started with): the parser never fails on
//! what it does not understand. It skips unknown lines, keeps what it could read, and reports what
//! it skipped, so the agent can degrade to addresses with one warning. It also bounds what a file
//! can cost: the names it yields take at most [`MAX_NAMES_BYTES`] whatever the text (a long
//! section name repeated by `bind :1,:2,...` costs its length per address, so the bound is on what
//! is kept, not on the text), at most [`MAX_BINDS`] bind addresses (scanned on every accepted
//! connection), a few short skipped lines, and a server is found by a hash lookup (on every
//! connection HAProxy opens), with std's randomly keyed hasher so that chosen addresses cannot
//! make it slow.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::OnceLock;

use crate::haproxy_runtime::ServersState;

mod parser;

pub use parser::{ConfigParser, parse};

/// Most bytes the names of one configuration (every file of it) may take, entries and strings,
/// roughly. The reader hands the parser at most 4 MiB of text; a legitimate configuration that
/// large (tens of thousands of `server` lines) yields about as many bytes of names, and a hostile
/// one cannot make the agent hold more than this per process.
pub const MAX_NAMES_BYTES: usize = 4 << 20;
/// Most `bind` addresses kept: they are matched by a scan on every accepted connection, and real
/// configurations have a few dozen at most.
pub const MAX_BINDS: usize = 1024;
/// Most `stats socket` paths kept (the first one that answers is read).
pub const MAX_STATS_SOCKETS: usize = 4;
/// Skipped lines kept for the warning (all are counted in [`ProxyNames::skipped_lines`]).
pub const MAX_SKIPPED_KEPT: usize = 16;
/// Bytes kept of each skipped line.
pub const MAX_SKIPPED_LINE_BYTES: usize = 160;

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

/// A `bind fd@N` line's entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FdBind {
    pub fd: i32,
    pub frontend: String,
    pub tcp: bool,
}

/// A `server` line whose address is a hostname.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostServer {
    pub line: ServerLine,
    pub host: String,
}

/// Names found in a configuration.
///
/// The server lookup uses an index built from `servers` on the first lookup (by
/// [`ConfigParser::finish`] already, off the capture thread): change the lists before looking
/// anything up, not after.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProxyNames {
    pub frontends: Vec<Bind>,
    pub servers: Vec<ServerLine>,
    /// The first [`MAX_SKIPPED_KEPT`] lines (cut to [`MAX_SKIPPED_LINE_BYTES`]) with a `bind` or
    /// `server` the parser could not read (hostnames, unix sockets, environment variables): their
    /// sections degrade to addresses.
    pub skipped: Vec<String>,
    /// How many such lines there were in all.
    pub skipped_lines: usize,
    /// Lines whose `bind`/`server` entries were dropped because the names reached
    /// [`MAX_NAMES_BYTES`] or [`MAX_BINDS`].
    pub over_limit_lines: usize,
    /// The backends each `frontend`/`listen` section can send a request to (`default_backend`,
    /// `use_backend`, and a `listen` section's own servers), for telling apart `server` lines that
    /// share an address.
    pub routes: HashMap<String, Routes>,
    /// The unix socket paths of the `global` section's `stats socket` lines (at most
    /// [`MAX_STATS_SOCKETS`]), as the process sees them: the runtime API, where the live server
    /// table can be read.
    pub stats_sockets: Vec<String>,
    /// The `global` section's `chroot` directory: the process moves there after reading its
    /// configuration, so its `/proc/PID/root` is this directory of the root it started in.
    pub chroot: Option<String>,
    /// `server` lines that give a hostname (`server app1 app.svc:8080`): named once the process's
    /// own `/etc/hosts` resolves them ([`ProxyNames::resolve_hosts`]), as HAProxy would have at
    /// start (DNS names are the runtime API's to tell).
    pub host_servers: Vec<HostServer>,
    /// `bind fd@N` lines: a socket the process was given as descriptor N. Named once its address
    /// is known ([`ProxyNames::resolve_fd_binds`]).
    pub fd_binds: Vec<FdBind>,
    /// For names from the runtime API: per server address (as the index keys it), the monotonic
    /// time (ns) from which its names are known to hold, the start of the first table read that
    /// showed them. A request sent before that may have gone to the names before a change:
    /// [`ProxyNames::server_for_sent`] gives it none. Empty for names from the configuration.
    pub server_since: HashMap<(IpAddr, Option<u16>), u64>,
    /// What the entries take, as counted against [`MAX_NAMES_BYTES`].
    bytes: usize,
    server_index: ServerIndex,
}

/// Where one frontend's requests can go.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Routes {
    pub backends: Vec<String>,
    /// A `use_backend` names its backend at run time (`%[...]`): any backend may be reached.
    pub dynamic: bool,
}

/// What a backend connection's address names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerMatch<'a> {
    /// One (backend, server) pair, after narrowing by the frontend's routes if needed.
    Named { backend: &'a str, server: &'a str },
    /// Several pairs share the address and the frontend's routes do not single one out: the
    /// names are left off rather than guessed.
    Ambiguous,
    /// No `server` line has this address.
    Unknown,
}

/// The `servers` indexes per (IP, port), in file order.
type ServerMap = HashMap<(IpAddr, Option<u16>), Vec<usize>>;

#[derive(Clone, Debug, Default)]
struct ServerIndex(OnceLock<ServerMap>);

impl PartialEq for ServerIndex {
    /// Derived from the lists, which the enclosing comparison compares.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for ServerIndex {}

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

    /// The `server` line HAProxy connected to: the first with this address and port, else the
    /// first with this address and no port.
    #[must_use]
    pub fn server_line(&self, addr: SocketAddr) -> Option<&ServerLine> {
        self.candidates(addr).first().and_then(|i| self.servers.get(*i))
    }

    /// The lines with this address and port, else those with this address and no port.
    fn candidates(&self, addr: SocketAddr) -> &[usize] {
        self.index_key(addr).and_then(|k| self.index().get(&k)).map_or(&[], Vec::as_slice)
    }

    fn index(&self) -> &ServerMap {
        self.server_index.0.get_or_init(|| index_servers(&self.servers))
    }

    /// The index key `addr` is found under: with its port, else without.
    fn index_key(&self, addr: SocketAddr) -> Option<(IpAddr, Option<u16>)> {
        let index = self.index();
        let ip = mapped(addr.ip());
        [(ip, Some(addr.port())), (ip, None)].into_iter().find(|k| index.contains_key(k))
    }

    /// [`ProxyNames::server_for`] for a request sent at `sent_ns` (monotonic): ambiguous when the
    /// names at the address are only known to hold since after that (see `server_since`).
    #[must_use]
    pub fn server_for_sent(&self, addr: SocketAddr, frontend: Option<&str>, sent_ns: u64) -> ServerMatch<'_> {
        if !self.server_since.is_empty()
            && let Some(key) = self.index_key(addr)
            && self.server_since.get(&key).is_some_and(|since| *since > sent_ns)
        {
            return ServerMatch::Ambiguous;
        }
        self.server_for(addr, frontend)
    }

    /// The (backend, server) pairs at each indexed address, sorted: what names an address.
    fn pairs_at(&self, key: (IpAddr, Option<u16>)) -> Vec<(&str, &str)> {
        let mut pairs: Vec<(&str, &str)> = self
            .index()
            .get(&key)
            .into_iter()
            .flatten()
            .filter_map(|i| self.servers.get(*i))
            .map(|s| (s.backend.as_str(), s.server.as_str()))
            .collect();
        pairs.sort_unstable();
        pairs.dedup();
        pairs
    }

    /// Sets `server_since` for names from a table whose read started at `read_ns`: an address
    /// named as in `previous` (the names in use before this table) keeps the time `previous` had
    /// for it (0 when `previous` is the configuration's); one `previous` did not have gets 0 too
    /// (HAProxy cannot have sent a request to an address it did not know: a request that went
    /// there went after it appeared, under these names); one whose names changed gets `read_ns`.
    pub fn set_server_since(&mut self, previous: &ProxyNames, read_ns: u64) {
        let keys: Vec<(IpAddr, Option<u16>)> = self.index().keys().copied().collect();
        let since: HashMap<_, _> = keys
            .into_iter()
            .map(|key| {
                let before = previous.pairs_at(key);
                let t = if before.is_empty() {
                    0
                } else if before == self.pairs_at(key) {
                    previous.server_since.get(&key).copied().unwrap_or(0)
                } else {
                    read_ns
                };
                (key, t)
            })
            .collect();
        self.server_since = since;
    }

    /// These names without any server: for spans whose server names cannot be known (see
    /// `Names` in the agent). Frontends and routes stay.
    #[must_use]
    pub fn without_servers(&self) -> Self {
        let mut names = self.with_runtime_servers(&ServersState::default());
        names.server_since.clear();
        names
    }

    /// The backend and server a connection to `addr` went to, never a guess: when several
    /// (backend, server) pairs share the address, only those reachable from `frontend` (the
    /// frontend of the request it carried) count, and if more than one remains there is no name.
    #[must_use]
    pub fn server_for(&self, addr: SocketAddr, frontend: Option<&str>) -> ServerMatch<'_> {
        let candidates = self.candidates(addr);
        if let [one] = candidates
            && let Some(line) = self.servers.get(*one)
        {
            // The usual case, on every backend connection: no route lookup.
            return ServerMatch::Named { backend: &line.backend, server: &line.server };
        }
        let reach = frontend.and_then(|f| self.routes.get(f)).filter(|r| !r.dynamic);
        let mut found: Option<&ServerLine> = None;
        let mut several = false;
        for line in candidates.iter().filter_map(|i| self.servers.get(*i)) {
            if reach.is_some_and(|r| !r.backends.contains(&line.backend)) {
                continue;
            }
            match found {
                None => found = Some(line),
                Some(f) if f.backend == line.backend && f.server == line.server => {}
                Some(_) => several = true,
            }
        }
        match found {
            None if candidates.is_empty() => ServerMatch::Unknown,
            // Lines share the address but none is reachable from this frontend: not ours to name.
            None => ServerMatch::Ambiguous,
            Some(_) if several => ServerMatch::Ambiguous,
            Some(line) => ServerMatch::Named { backend: &line.backend, server: &line.server },
        }
    }

    fn skip(&mut self, line: &str) {
        self.skipped_lines += 1;
        if self.skipped.len() < MAX_SKIPPED_KEPT {
            let mut end = line.len().min(MAX_SKIPPED_LINE_BYTES);
            while !line.is_char_boundary(end) {
                end -= 1;
            }
            self.skipped.push(line[..end].to_owned());
        }
    }

    /// Counts `cost` against [`MAX_NAMES_BYTES`]; false (and nothing counted) when it does not fit.
    fn take(&mut self, cost: usize) -> bool {
        let fits = self.bytes + cost <= MAX_NAMES_BYTES;
        if fits {
            self.bytes += cost;
        }
        fits
    }
}

impl ProxyNames {
    /// Names the `bind fd@N` lines with `lookup` (the address of the process's descriptor N);
    /// those it cannot tell stay unnamed, counted as skipped lines.
    pub fn resolve_fd_binds(&mut self, lookup: impl Fn(i32) -> Option<SocketAddr>) {
        for b in std::mem::take(&mut self.fd_binds) {
            match lookup(b.fd) {
                Some(_) if self.frontends.len() >= MAX_BINDS => self.over_limit_lines += 1,
                Some(addr) => {
                    let ip = (!addr.ip().is_unspecified()).then(|| addr.ip());
                    let addr = BindAddr { ip, ports: (addr.port(), addr.port()) };
                    self.frontends.push(Bind { addr, frontend: b.frontend, tcp: b.tcp });
                }
                None => self.skip(&format!("bind fd@{}", b.fd)),
            }
        }
    }

    /// Names the `server` lines that gave a hostname, with `lookup` (the process's `/etc/hosts`);
    /// those it does not resolve stay unnamed, counted as skipped lines.
    pub fn resolve_hosts(&mut self, lookup: impl Fn(&str) -> Option<IpAddr>) {
        for h in std::mem::take(&mut self.host_servers) {
            match lookup(&h.host) {
                Some(ip) => self.servers.push(ServerLine { ip, ..h.line }),
                None => self.skip(&format!("server {} {}", h.line.server, h.host)),
            }
        }
        self.server_index = ServerIndex::default();
        // Built here, off the capture thread.
        self.index();
    }

    /// These names with the servers of the runtime API's table instead of the configuration's
    /// `server` lines: the table is the truth at run time (filled template slots, added servers,
    /// resolved addresses). A server in maintenance is left out where an active one shares its
    /// address (a slot emptied for another). Backends keep the mode their configuration gives
    /// them (HTTP where it gives none); the names budget applies as for the configuration.
    #[must_use]
    pub fn with_runtime_servers(&self, state: &ServersState) -> Self {
        let tcp_backends: HashSet<&str> = self.servers.iter().filter(|s| s.tcp).map(|s| s.backend.as_str()).collect();
        let active: HashSet<(IpAddr, Option<u16>)> =
            state.servers.iter().filter(|s| !s.maintenance).map(|s| (mapped(s.ip), s.port)).collect();
        let mut names = Self {
            frontends: self.frontends.clone(),
            servers: Vec::with_capacity(state.servers.len()),
            skipped: self.skipped.clone(),
            skipped_lines: self.skipped_lines,
            over_limit_lines: self.over_limit_lines,
            routes: self.routes.clone(),
            stats_sockets: self.stats_sockets.clone(),
            chroot: self.chroot.clone(),
            host_servers: Vec::new(),
            fd_binds: Vec::new(),
            server_since: HashMap::new(),
            bytes: self.bytes - self.servers.iter().map(server_cost).sum::<usize>(),
            server_index: ServerIndex::default(),
        };
        for s in &state.servers {
            if s.maintenance && active.contains(&(mapped(s.ip), s.port)) {
                continue;
            }
            let line = ServerLine {
                backend: s.backend.clone(),
                server: s.server.clone(),
                tcp: tcp_backends.contains(s.backend.as_str()),
                ip: s.ip,
                port: s.port,
            };
            if names.take(server_cost(&line)) {
                names.servers.push(line);
            } else {
                names.over_limit_lines += 1;
            }
        }
        // Built here, off the capture thread.
        names.index();
        names
    }
}

/// What a server entry counts against [`MAX_NAMES_BYTES`].
fn server_cost(s: &ServerLine) -> usize {
    size_of::<ServerLine>() + s.backend.len() + s.server.len()
}

fn index_servers(servers: &[ServerLine]) -> ServerMap {
    let mut index = ServerMap::with_capacity(servers.len());
    for (i, s) in servers.iter().enumerate() {
        index.entry((mapped(s.ip), s.port)).or_default().push(i);
    }
    index
}

#[cfg(test)]
mod tests {
    use std::fmt::Write as _;

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
        assert!(n.skipped.is_empty());
        assert_eq!(n.host_servers.len(), 1, "the hostname waits for the process's /etc/hosts");
        let mut resolved = n.clone();
        resolved.resolve_hosts(|h| (h == "app.internal").then(|| "10.0.0.3".parse().unwrap()));
        assert_eq!(resolved.server("10.0.0.3:80".parse().unwrap()), Some(("be_app", "dyn")));
        let mut unresolved = n;
        unresolved.resolve_hosts(|_| None);
        assert_eq!(unresolved.skipped, vec!["server dyn app.internal".to_owned()]);
        assert!(unresolved.host_servers.is_empty());
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
    fn defaults_carry_over_to_later_files_and_sections_end_with_their_file() {
        let mut parser = ConfigParser::new();
        parser.add_file("global\n daemon\ndefaults\n mode http\n");
        parser.add_file("frontend fe\n bind :80\nbackend be\n server s 10.0.0.1:80\n");
        parser.add_file(" bind :81\n server t 10.0.0.2:80\n");
        let n = parser.finish();
        assert!(!n.bind("127.0.0.1:80".parse().unwrap()).unwrap().tcp, "mode http from 00-defaults.cfg");
        assert!(!n.server_line("10.0.0.1:80".parse().unwrap()).unwrap().tcp);
        assert_eq!(n.frontend("127.0.0.1:81".parse().unwrap()), None, "a bind before any section of its file");
        assert_eq!(n.server("10.0.0.2:80".parse().unwrap()), None);
        assert!(parse("frontend fe\n bind :80\n").frontends[0].tcp, "alone, HAProxy's default mode is tcp");
    }

    #[test]
    fn skipped_lines_are_counted_once_and_kept_short_and_few() {
        let long = format!("frontend f\n bind {}\n", vec!["unix@/x"; 10_000].join(","));
        let n = parse(&long);
        assert_eq!(n.skipped_lines, 1, "one line, however many addresses it lists");
        assert!(n.skipped[0].len() <= MAX_SKIPPED_LINE_BYTES);
        let many = format!("backend b\n{}", " server s /run/app.sock é\n".repeat(100));
        let n = parse(&many);
        assert_eq!((n.skipped_lines, n.skipped.len()), (100, MAX_SKIPPED_KEPT));
        let cut = parse(&format!("backend b\n server s {}\n", "é".repeat(200)));
        assert!(cut.skipped[0].len() <= MAX_SKIPPED_LINE_BYTES, "cut on a character boundary");
    }

    #[test]
    fn servers_sharing_an_address_are_named_only_when_the_frontend_singles_one_out() {
        let n = parse(
            "frontend fe_main\n bind :80\n use_backend be_api if { path_beg /api }\n default_backend be_web\n\
             frontend fe_web\n bind :81\n default_backend be_web\n\
             frontend fe_dyn\n bind :82\n use_backend be_%[req.hdr(host)]\n\
             backend be_web\n server web1 10.0.0.1:80\n\
             backend be_api\n server api1 10.0.0.1:80\n\
             backend be_other\n server o1 10.0.0.2:80\n server o1 10.0.0.2:80\n\
             listen li\n bind :83\n server l1 10.0.0.3:80\n\
             backend be_dup\n server d1 10.0.0.3:80\n",
        );
        let shared = "10.0.0.1:80".parse().unwrap();
        assert_eq!(n.server_for(shared, Some("fe_main")), ServerMatch::Ambiguous, "both reachable: no name");
        assert_eq!(n.server_for(shared, Some("fe_web")), ServerMatch::Named { backend: "be_web", server: "web1" });
        assert_eq!(n.server_for(shared, Some("fe_dyn")), ServerMatch::Ambiguous, "dynamic routes narrow nothing");
        assert_eq!(n.server_for(shared, None), ServerMatch::Ambiguous);
        let same_twice = "10.0.0.2:80".parse().unwrap();
        assert_eq!(n.server_for(same_twice, None), ServerMatch::Named { backend: "be_other", server: "o1" });
        let listen = "10.0.0.3:80".parse().unwrap();
        assert_eq!(n.server_for(listen, Some("li")), ServerMatch::Named { backend: "li", server: "l1" });
        assert_eq!(n.server_for(shared, Some("li")), ServerMatch::Ambiguous, "not reachable from li: not ours to name");
        assert_eq!(n.server_for("10.9.9.9:80".parse().unwrap(), Some("fe_main")), ServerMatch::Unknown);
    }

    #[test]
    fn server_templates_name_their_slots_and_stay_within_the_budget() {
        let n = parse(
            "backend be_t\n server-template SRV_ 3 10.0.0.9:80 disabled\n server-template r 5-6 10.0.0.8:81\n\
             server-template bad 0-x 10.0.0.7:80\n server-template dns 2 app.svc:80\n",
        );
        let names: Vec<&str> = n.servers.iter().map(|s| s.server.as_str()).collect();
        assert_eq!(names, ["SRV_1", "SRV_2", "SRV_3", "r5", "r6"]);
        assert_eq!(
            n.server_for("10.0.0.8:81".parse().unwrap(), None),
            ServerMatch::Ambiguous,
            "two slots, one address"
        );
        assert_eq!(n.skipped_lines, 2, "a bad range and a hostname are skipped, not guessed");
        let huge = parse("backend b\n server-template s 4000000000 10.0.0.1:80\n");
        assert!(huge.bytes <= MAX_NAMES_BYTES && huge.over_limit_lines == 1);
    }

    #[test]
    fn a_long_name_times_many_addresses_stays_within_the_budget() {
        // 1 MiB of name, then 1 MiB of `:1,:1,...`: cloned naively, 350 000 copies of the name.
        let name = "n".repeat(1 << 20);
        let text = format!(
            "frontend {name}\n bind {}\nbackend {name}\n{}",
            vec![":1"; 350_000].join(","),
            " server s 10.0.0.1:1\n".repeat(10)
        );
        let n = parse(&text);
        assert!(n.bytes <= MAX_NAMES_BYTES);
        assert!(n.frontends.len() < 4, "a few copies of a 1 MiB name fit, no more");
        assert!(n.over_limit_lines >= 1);
        let binds = parse(&format!("frontend f\n{}", " bind :1\n".repeat(MAX_BINDS + 10)));
        assert_eq!((binds.frontends.len(), binds.over_limit_lines), (MAX_BINDS, 10));
    }

    proptest::proptest! {
        /// The server index finds what the first-match scan it replaced found.
        #[test]
        fn server_index_agrees_with_a_scan(
            lines in proptest::collection::vec((0u8..4, 0u8..3, proptest::option::of(0u16..3)), 0..40),
            ip in 0u8..4,
            port in 0u16..3,
        ) {
            let mut text = String::new();
            for (i, (backend, host, p)) in lines.iter().enumerate() {
                let host = if *host == 0 { format!("::ffff:10.0.0.{ip}") } else { format!("10.0.0.{host}") };
                let host = if host.contains(':') { format!("[{host}]") } else { host };
                let p = p.map_or(String::new(), |p| format!(":{p}"));
                let _ = write!(text, "backend b{backend}\n server s{i} {host}{p}\n");
            }
            let n = parse(&text);
            let addr = SocketAddr::from(([10, 0, 0, ip], port));
            let scan = |with_port: bool| {
                n.servers.iter().find(|s| {
                    mapped(s.ip) == mapped(addr.ip())
                        && if with_port { s.port == Some(addr.port()) } else { s.port.is_none() }
                })
            };
            proptest::prop_assert_eq!(n.server_line(addr), scan(true).or_else(|| scan(false)));
        }

        /// Any text parses, within the limits.
        #[test]
        fn any_text_parses_within_limits(text in "\\PC{0,400}") {
            let n = parse(&text);
            proptest::prop_assert!(n.bytes <= MAX_NAMES_BYTES && n.frontends.len() <= MAX_BINDS);
            proptest::prop_assert!(n.skipped.len() <= MAX_SKIPPED_KEPT);
        }
    }

    #[test]
    fn garbage_never_panics() {
        for text in
            ["", "frontend", "bind", "backend b\nserver", "backend b\n server s [::1", "frontend f\n bind [::1]:x"]
        {
            let _ = parse(text);
        }
    }

    #[test]
    fn default_server_lines_give_no_address_and_change_no_name() {
        // `default-server` sets server options (checks, weights, the check `port`/`addr`), never
        // the address traffic goes to: names come from the `server` lines alone.
        let names = parse(
            "defaults\n    mode http\n    default-server inter 2s port 9999 addr 10.9.9.9\n\
             backend be\n    default-server check maxconn 10\n    server s1 10.0.0.1:8080\n",
        );
        assert_eq!(names.server("10.0.0.1:8080".parse().unwrap()), Some(("be", "s1")));
        assert_eq!(names.server("10.9.9.9:9999".parse().unwrap()), None);
        assert_eq!(names.servers.len(), 1);
        assert_eq!(names.skipped_lines, 0);
    }

    #[test]
    fn fd_binds_are_named_by_the_descriptor_address() {
        let mut names =
            parse("frontend fe_fd\n    mode tcp\n    bind fd@7,fd@x,127.0.0.1:81\nfrontend other\n    bind fd@9\n");
        assert_eq!(names.fd_binds.len(), 2);
        assert_eq!(names.skipped_lines, 1, "fd@x does not read");
        names.resolve_fd_binds(|fd| (fd == 7).then(|| "127.0.0.1:8443".parse().unwrap()));
        let bind = names.bind("127.0.0.1:8443".parse().unwrap()).expect("named");
        assert_eq!((bind.frontend.as_str(), bind.tcp), ("fe_fd", true), "with its section's mode");
        assert_eq!(names.frontend("127.0.0.1:81".parse().unwrap()), Some("fe_fd"));
        assert!(names.skipped.iter().any(|l| l == "bind fd@9"), "one it cannot tell is skipped");
    }

    #[test]
    fn chroot_is_read_from_global_only_and_absolute_only() {
        let names = parse("global\n    chroot /var/lib/haproxy\nfrontend f\n    chroot /elsewhere\n    bind :80\n");
        assert_eq!(names.chroot.as_deref(), Some("/var/lib/haproxy"));
        assert_eq!(parse("global\n    chroot relative/dir\n").chroot, None);
        assert_eq!(parse("frontend f\n    bind :80\n").chroot, None);
    }

    #[test]
    fn stats_sockets_are_read_from_global_only_and_unix_only() {
        let names = parse(
            "global\n    stats socket /run/haproxy/admin.sock mode 660 level admin\n    stats socket ipv4@127.0.0.1:9999 level user\n    stats socket unix@/tmp/b.sock\n    stats timeout 30s\n\
             frontend f\n    stats socket /not/here.sock\n    bind :80\n",
        );
        assert_eq!(names.stats_sockets, ["/run/haproxy/admin.sock", "/tmp/b.sock"]);
    }

    #[test]
    fn runtime_servers_replace_the_configured_ones_and_keep_the_rest() {
        use crate::haproxy_runtime::parse_servers_state;
        let config = parse(
            "frontend f\n    bind :80\n    default_backend echo\n\
             backend echo\n    server-template SRV_ 3 127.0.0.1:1 disabled\n\
             backend raw\n    mode tcp\n    server r1 10.0.0.9:5432\n",
        );
        let state = parse_servers_state(
            "1\n# be_name srv_name srv_addr srv_port srv_admin_state\n\
             echo SRV_1 127.0.0.1 9000 1\necho SRV_2 127.0.0.1 9000 0\necho SRV_3 127.0.0.1 1 4\nraw r1 10.0.0.9 5432 0\n",
        )
        .unwrap();
        let names = config.with_runtime_servers(&state);
        let at = |a: &str| names.server_for(a.parse().unwrap(), Some("f"));
        // SRV_1 was emptied (maintenance) and SRV_2 took its address: only SRV_2 names it.
        assert_eq!(at("127.0.0.1:9000"), ServerMatch::Named { backend: "echo", server: "SRV_2" });
        assert_eq!(at("127.0.0.1:1"), ServerMatch::Named { backend: "echo", server: "SRV_3" });
        assert_eq!(names.server_line("10.0.0.9:5432".parse().unwrap()).map(|s| s.tcp), Some(true));
        assert_eq!(names.frontend("127.0.0.1:80".parse().unwrap()), Some("f"));
        // The budget is the configuration's, with its server lines given back.
        // Three entries of the same lengths where the configuration had four: one entry's cost less.
        assert_eq!(names.bytes, config.bytes - size_of::<ServerLine>() - "echoSRV_1".len());
    }
}

//! The bind address of a listening socket, found once per (process, fd). Used to name the
//! frontend an accepted connection came through, and to know a `mode tcp` one; and for a `bind
//! fd@N` line, the address of the socket `HAProxy` was given as descriptor N ([`socket_addr`]).
//!
//! This runs on the capture thread, at the first `accept` of each listener, so it must be cheap
//! whatever the host: it asks the socket itself, through a duplicate of the process's descriptor
//! (`pidfd_getfd`, allowed by `CAP_SYS_PTRACE`) and `getsockname`, a few syscalls. Only where that
//! is refused (a security module denying ptrace) does it fall back to `/proc/PID/fd/FD` (the
//! socket inode) and `/proc/PID/net/tcp{,6}` (the inode's local address), which the kernel prints
//! for every socket of the network namespace: on a busy node, megabytes, read while the ring
//! waits.

use std::collections::HashMap;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};

/// Cache of listening socket addresses.
#[derive(Debug)]
pub struct ListenAddrs {
    proc_root: PathBuf,
    cache: HashMap<(u32, i32), Option<SocketAddr>>,
}

impl ListenAddrs {
    #[must_use]
    pub fn new(proc_root: &Path) -> Self {
        Self { proc_root: proc_root.to_owned(), cache: HashMap::new() }
    }

    /// The local address of listening socket `fd` of process `tgid`.
    pub fn local_addr(&mut self, tgid: u32, fd: i32) -> Option<SocketAddr> {
        if let Some(known) = self.cache.get(&(tgid, fd)) {
            return *known;
        }
        // A transient failure (out of descriptors) is not remembered: the next accept asks again.
        match resolve(&self.proc_root, tgid, fd) {
            Resolved::Known(answer) => {
                self.cache.insert((tgid, fd), answer);
                answer
            }
            Resolved::Retry => None,
        }
    }

    /// Drops what is known of an exited process.
    pub fn forget_process(&mut self, tgid: u32) {
        self.cache.retain(|(t, _), _| *t != tgid);
    }
}

/// The local address of socket `fd` of process `tgid`, asked once (`None`: not an IP socket,
/// gone, or the question failed).
#[must_use]
pub fn socket_addr(proc_root: &Path, tgid: u32, fd: i32) -> Option<SocketAddr> {
    match resolve(proc_root, tgid, fd) {
        Resolved::Known(addr) => addr,
        Resolved::Retry => None,
    }
}

/// What asking for a listener's address gave.
#[derive(Debug, PartialEq, Eq)]
enum Resolved {
    /// An answer to remember (`None`: not an IP socket, or gone).
    Known(Option<SocketAddr>),
    /// A failure worth another try at the next accept.
    Retry,
}

fn resolve(proc_root: &Path, tgid: u32, fd: i32) -> Resolved {
    use rustix::io::Errno;
    match ask_socket(tgid, fd) {
        Ok(addr) => Resolved::Known(addr),
        // The process or the listener is gone (a reload): nothing to name.
        Err(e) if e == Errno::SRCH || e == Errno::BADF => Resolved::Known(None),
        // Refused: a security module denies ptrace, or no CAP_SYS_PTRACE; or an old kernel.
        Err(e) if e == Errno::PERM || e == Errno::ACCESS || e == Errno::NOSYS => {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    pid = tgid,
                    error = %std::io::Error::from(e),
                    "cannot duplicate HAProxy's listening socket (pidfd_getfd needs CAP_SYS_PTRACE, Linux 5.6+, and a security module that allows ptrace); reading /proc/PID/net/tcp instead, which is slow on hosts with many connections"
                );
            });
            Resolved::Known(from_tables(proc_root, tgid, fd))
        }
        Err(e) => {
            tracing::debug!(pid = tgid, fd, error = %std::io::Error::from(e), "cannot ask a listening socket for its address; will retry");
            Resolved::Retry
        }
    }
}

/// The socket's own address, through a duplicate of the descriptor. `Ok(None)`: not an IP socket.
fn ask_socket(tgid: u32, fd: i32) -> Result<Option<SocketAddr>, rustix::io::Errno> {
    use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags, pidfd_getfd, pidfd_open};
    let pid = i32::try_from(tgid).ok().and_then(Pid::from_raw).ok_or(rustix::io::Errno::SRCH)?;
    let pidfd = pidfd_open(pid, PidfdFlags::empty())?;
    let socket = pidfd_getfd(&pidfd, fd, PidfdGetfdFlags::empty())?;
    match rustix::net::getsockname(&socket) {
        Ok(addr) => Ok(SocketAddr::try_from(addr).ok().map(unmap)),
        Err(rustix::io::Errno::NOTSOCK) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `::ffff:a.b.c.d` as the IPv4 address it is, as HAProxy's configuration names it.
fn unmap(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) => v6.ip().to_ipv4_mapped().map_or(addr, |v4| SocketAddr::new(v4.into(), v6.port())),
        SocketAddr::V4(_) => addr,
    }
}

fn from_tables(proc_root: &Path, tgid: u32, fd: i32) -> Option<SocketAddr> {
    let pid_dir = proc_root.join(tgid.to_string());
    let link = std::fs::read_link(pid_dir.join("fd").join(fd.to_string())).ok()?;
    let inode: u64 = link.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()?;
    ["tcp", "tcp6"].iter().find_map(|table| {
        let text = std::fs::read_to_string(pid_dir.join("net").join(table)).ok()?;
        parse_tcp_table(&text).into_iter().find(|(_, i)| *i == inode).map(|(addr, _)| addr)
    })
}

/// Parses `/proc/net/tcp` or `/proc/net/tcp6`: (local address, inode) per socket.
#[must_use]
pub fn parse_tcp_table(text: &str) -> Vec<(SocketAddr, u64)> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local = parse_hex_addr(fields.get(1)?)?;
            let inode = fields.get(9)?.parse().ok()?;
            Some((local, inode))
        })
        .collect()
}

/// `0100007F:1F90` (IPv4) or 32 hex digits `:PORT` (IPv6): the kernel prints each 32-bit word of
/// the address in host byte order.
fn parse_hex_addr(field: &str) -> Option<SocketAddr> {
    let (ip, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let words: Option<Vec<u32>> =
        (0..ip.len() / 8).map(|i| u32::from_str_radix(ip.get(8 * i..8 * i + 8)?, 16).ok()).collect();
    let words = words?;
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    match bytes.len() {
        4 => Some(SocketAddr::new(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3]).into(), port)),
        16 => {
            let octets: [u8; 16] = bytes.try_into().ok()?;
            Some(unmap(SocketAddr::new(Ipv6Addr::from(octets).into(), port)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tcp_tables() {
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 100 0 0 10 0\n";
        assert_eq!(parse_tcp_table(v4), vec![("127.0.0.1:8080".parse().unwrap(), 12345)]);
        let v6 = "header\n   0: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 777 1\n";
        assert_eq!(parse_tcp_table(v6), vec![("[::1]:8080".parse().unwrap(), 777)]);
        assert!(parse_tcp_table("header\ngarbage line\n").is_empty());
    }

    #[test]
    fn resolves_a_real_listener() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
        let mut addrs = ListenAddrs::new(Path::new("/proc"));
        assert_eq!(addrs.local_addr(std::process::id(), fd), Some(addr));
        // Both ways agree, the fallback included.
        assert_eq!(ask_socket(std::process::id(), fd).unwrap(), Some(addr));
        assert_eq!(from_tables(Path::new("/proc"), std::process::id(), fd), Some(addr));
        // A closed descriptor, a gone process: nothing to name, and nothing to retry.
        assert_eq!(resolve(Path::new("/proc"), std::process::id(), 999_999), Resolved::Known(None));
        assert_eq!(resolve(Path::new("/proc"), u32::MAX, 3), Resolved::Known(None));
    }

    #[test]
    fn an_ipv6_listener_and_a_file_are_told_apart() {
        let listener = std::net::TcpListener::bind("[::1]:0").unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
        assert_eq!(ask_socket(std::process::id(), fd).unwrap(), Some(listener.local_addr().unwrap()));
        let file = std::fs::File::open("/proc/self/status").unwrap();
        assert_eq!(ask_socket(std::process::id(), std::os::fd::AsRawFd::as_raw_fd(&file)).unwrap(), None);
    }

    #[test]
    fn a_v4_mapped_address_is_named_as_ipv4() {
        assert_eq!(unmap("[::ffff:127.0.0.1]:80".parse().unwrap()), "127.0.0.1:80".parse().unwrap());
        assert_eq!(unmap("[::1]:80".parse().unwrap()), "[::1]:80".parse().unwrap());
    }
}

//! `HAProxy`'s log lines as a test receives them: a UDP socket that a `log` line in `HAProxy`'s
//! configuration points at.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

pub struct Syslog {
    socket: UdpSocket,
    /// Where `HAProxy` sends its lines (`log ADDR local0`).
    pub addr: SocketAddr,
}

impl Syslog {
    /// A socket on a free loopback port.
    ///
    /// # Panics
    /// When the socket cannot be bound.
    #[must_use]
    pub fn bind() -> Self {
        let socket = UdpSocket::bind("127.0.0.1:0").expect("bind log socket");
        socket.set_read_timeout(Some(Duration::from_millis(200))).expect("timeout");
        let addr = socket.local_addr().expect("log addr");
        Self { socket, addr }
    }

    /// Parses each line received with `parse`, until every key in `wanted` has a value or 20 s
    /// passed; returns what was found.
    pub fn collect<K: Eq + Hash, V>(&self, wanted: &[K], parse: impl Fn(&str) -> Option<(K, V)>) -> HashMap<K, V> {
        let mut found = HashMap::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut buf = vec![0u8; 65_536];
        while wanted.iter().any(|k| !found.contains_key(k)) && Instant::now() < deadline {
            let Ok(n) = self.socket.recv(&mut buf) else { continue };
            if let Some((key, value)) = parse(&String::from_utf8_lossy(&buf[..n])) {
                found.insert(key, value);
            }
        }
        found
    }
}

//! The admin endpoint against clients that hold on: connections that send nothing are closed
//! after the header timeout, and past the connection limit new clients wait for a slot instead of
//! taking the endpoint away from the liveness probe.

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use tracetap::admin::{self, Limits};
use tracetap::metrics::Metrics;

/// Serves the admin endpoint on a runtime thread of its own; returns its address.
fn start(limits: Limits) -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            admin::serve(listener, Arc::new(Metrics::default()), limits, true).await;
        });
    });
    addr
}

fn healthz(addr: std::net::SocketAddr, wait: Duration) -> Option<String> {
    let mut conn = TcpStream::connect(addr).ok()?;
    conn.set_read_timeout(Some(wait)).unwrap();
    conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer).ok()?;
    (!answer.is_empty()).then_some(answer)
}

#[test]
fn a_connection_that_sends_nothing_is_closed_after_the_header_timeout() {
    let addr = start(Limits { header_timeout: Duration::from_millis(300), ..Limits::default() });
    let mut idle = TcpStream::connect(addr).unwrap();
    // Half a head, then nothing.
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost:").unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = Vec::new();
    // The server closes it (an answer, if any, is a 408); a read error would be the 20 s timeout.
    idle.read_to_end(&mut buf).expect("closed by the server, not left open");
    assert!(buf.is_empty() || String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 408"), "{buf:?}");
    assert!(healthz(addr, Duration::from_secs(20)).unwrap().starts_with("HTTP/1.1 200"));
}

#[test]
fn past_the_connection_limit_clients_wait_for_a_slot() {
    let addr = start(Limits {
        header_timeout: Duration::from_mins(2),
        connection_timeout: Duration::from_mins(2),
        max_connections: 2,
    });
    let held: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // Give the server time to take both (it accepts only while it has a slot).
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(healthz(addr, Duration::from_secs(1)), None, "a third connection is not served while two are held");
    drop(held);
    let answer = healthz(addr, Duration::from_secs(20)).expect("served once a slot is free");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

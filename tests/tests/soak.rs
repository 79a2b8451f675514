//! Soak: mixed traffic (keep-alive requests, garbage, connections aborted mid-request, slow
//! exchanges) for `SOAK_SECONDS` (default 300). The agent's RSS at the end must be within 10% of
//! its RSS after the first minute (or after a fifth of the run, if shorter). Run by `make soak`;
//! ignored by the normal test run because of its length. Needs root.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tracetap_tests::client::Conn;
use tracetap_tests::{Stack, require_root};

fn mixed_traffic(front: SocketAddr, worker: u64, stop: &AtomicBool, sent: &AtomicU64) {
    let mut rng = fastrand::Rng::with_seed(worker);
    let mut conn = Conn::connect(front).ok();
    while !stop.load(Ordering::Relaxed) {
        match rng.u8(..20) {
            0 => {
                let mut junk = Conn::connect(front).expect("connect");
                let bytes: Vec<u8> = (0..rng.usize(1..200)).map(|_| rng.u8(..)).collect();
                let _ = junk.send_raw(&bytes);
            }
            1 => {
                let mut aborted = Conn::connect(front).expect("connect");
                let _ = aborted.send_raw(b"POST /upload HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\npartial");
            }
            2 => {
                let _ = Conn::connect(front).and_then(|mut c| c.get("/slow/50", &[]));
            }
            _ => {
                let path = format!("/soak/{}", rng.u32(..100_000));
                let ok = conn.as_mut().is_some_and(|c| c.get(&path, &[]).is_ok());
                if !ok {
                    conn = Conn::connect(front).ok();
                }
            }
        }
        sent.fetch_add(1, Ordering::Relaxed);
    }
}

#[test]
#[ignore = "5-minute soak: run with `make soak`"]
fn memory_stays_flat_under_mixed_traffic() {
    if !require_root() {
        return;
    }
    let total = Duration::from_secs(std::env::var("SOAK_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(300));
    let baseline_at = Duration::from_mins(1).min(total / 5);
    let s = Stack::start("", &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let (stop, sent, front) = (Arc::clone(&stop), Arc::clone(&sent), s.front);
            std::thread::spawn(move || mixed_traffic(front, w, &stop, &sent))
        })
        .collect();
    let start = Instant::now();
    std::thread::sleep(baseline_at);
    let baseline = s.agent.rss_kib();
    let mut samples = vec![(baseline_at.as_secs(), baseline)];
    while start.elapsed() < total {
        std::thread::sleep(Duration::from_secs(10).min(total.saturating_sub(start.elapsed())));
        samples.push((start.elapsed().as_secs(), s.agent.rss_kib()));
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().expect("worker");
    }
    let end = s.agent.rss_kib();
    println!(
        "[soak] {}s, {} operations, {} requests traced, RSS after {}s: {baseline} KiB, at the end: {end} KiB ({:+.1}%), \
         ring losses {}, parse errors {}, opaque connections {}, open exchanges {}; samples (s, KiB): {samples:?}",
        total.as_secs(),
        sent.load(Ordering::Relaxed),
        s.agent.metric("tracetap_requests_total"),
        baseline_at.as_secs(),
        100.0 * (end as f64 - baseline as f64) / baseline as f64,
        s.agent.metric("tracetap_events_lost_ring_full_total"),
        s.agent.metric("tracetap_parse_errors_total"),
        s.agent.metric("tracetap_opaque_connections_total"),
        s.agent.metric("tracetap_open_exchanges"),
    );
    assert!(end * 10 <= baseline * 11, "RSS grew more than 10%: {baseline} KiB -> {end} KiB");
}

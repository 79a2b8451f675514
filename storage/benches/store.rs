//! Tail store benchmark: fills the sled store and the in-memory baseline with the same spans, each
//! in a fresh child process (so RSS and CPU are the store's alone), and reports spans per second per
//! core (CPU time of every thread of the process, sled's flusher included), bytes on disk per span,
//! RSS at the end, and the CPU ratio sled / memory measured in the same run.
//!
//! `cargo bench -p tracetap-storage --bench store` (`TRACETAP_BENCH_SPANS`, default 1 000 000;
//! `TRACETAP_BENCH_ROUNDS`, default 2). The workload is the agent's: traces of a SERVER and a
//! CLIENT span (360 bytes each, about what the agent encodes) appended 256 at a time (one batch of
//! the capture thread), arriving at 50 000 per simulated second, one partition per second.

#[path = "support/proc_stats.rs"]
mod proc_stats;

use proc_stats::{cpu_seconds, dir_bytes, status_kib};
use std::process::Command;

use tracetap_storage::{Fragment, MemoryStore, SledOptions, SledStore, TailStore};

const SPAN_BYTES: usize = 360;
const TRACES_PER_PARTITION: u64 = 50_000;
const CHILD_VAR: &str = "TRACETAP_BENCH_CHILD";
/// Traces per append: what one batch from the agent's capture thread holds (512 spans).
const TRACES_PER_APPEND: usize = 256;

fn main() {
    if let Ok(spec) = std::env::var(CHILD_VAR) {
        let (store, spans) = spec.split_once(':').expect("store:spans");
        child(store, spans.parse().expect("span count"));
        return;
    }
    let spans: u64 = env_or("TRACETAP_BENCH_SPANS", 1_000_000);
    let rounds: u64 = env_or("TRACETAP_BENCH_ROUNDS", 2);
    println!("tail store: {spans} spans of {SPAN_BYTES} bytes, 2 spans per trace, {rounds} rounds");
    println!(
        "{:<7} {:>9} {:>15} {:>9} {:>9} {:>12}",
        "store", "cpu s", "spans/s/core", "rss MiB", "hwm MiB", "disk B/span"
    );
    let mut cpu = [0.0f64; 2];
    for _ in 0..rounds {
        for (i, store) in ["memory", "sled"].into_iter().enumerate() {
            let out = Command::new(std::env::current_exe().expect("own path"))
                .env(CHILD_VAR, format!("{store}:{spans}"))
                .output()
                .expect("running the bench child");
            assert!(out.status.success(), "child failed: {}", String::from_utf8_lossy(&out.stderr));
            let line = String::from_utf8(out.stdout).expect("utf-8");
            print!("{line}");
            cpu[i] += line.split_whitespace().nth(1).and_then(|c| c.parse::<f64>().ok()).expect("cpu column");
        }
    }
    println!("CPU ratio sled / memory: {:.2}", cpu[1] / cpu[0]);
}

fn env_or(var: &str, default: u64) -> u64 {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn child(store: &str, spans: u64) {
    let dir = tempfile::tempdir_in(std::env::var_os("TMPDIR").unwrap_or_else(|| "/var/tmp".into())).expect("temp dir");
    let (cpu, disk) = match store {
        "memory" => fill(&mut MemoryStore::new(), spans),
        "sled" => fill(&mut SledStore::open(dir.path(), SledOptions::default()).expect("open"), spans),
        other => panic!("unknown store {other}"),
    };
    let disk = if store == "sled" { dir_bytes(dir.path()) } else { disk };
    println!(
        "{store:<7} {cpu:>9.2} {:>15.0} {:>9.0} {:>9.0} {:>12.0}",
        spans as f64 / cpu,
        status_kib("VmRSS:") as f64 / 1024.0,
        status_kib("VmHWM:") as f64 / 1024.0,
        disk as f64 / spans as f64
    );
}

/// Fills the store; returns CPU seconds spent and the store's own size figure.
fn fill(store: &mut impl TailStore, spans: u64) -> (f64, u64) {
    let mut span = vec![0u8; SPAN_BYTES];
    for (i, b) in span.iter_mut().enumerate() {
        *b = (i * 31 % 251) as u8;
    }
    let span_refs: [&[u8]; 2] = [&span, &span];
    let cpu_before = cpu_seconds();
    let mut batch: Vec<Fragment<'_>> = Vec::with_capacity(TRACES_PER_APPEND);
    let mut batch_partition = 0;
    for t in 0..spans / 2 {
        let mut trace = [0u8; 16];
        trace[..8].copy_from_slice(&t.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
        trace[8..].copy_from_slice(&t.to_be_bytes());
        let partition = t / TRACES_PER_PARTITION;
        if partition != batch_partition && !batch.is_empty() {
            store.append(batch_partition, &batch).expect("append");
            batch.clear();
        }
        batch_partition = partition;
        let now = 1_700_000_000_000_000_000 + t * 20_000;
        batch.push(Fragment { trace, first_seen_unix_ns: now, root_ended_unix_ns: Some(now), spans: &span_refs });
        if batch.len() == TRACES_PER_APPEND {
            store.append(partition, &batch).expect("append");
            batch.clear();
        }
    }
    if !batch.is_empty() {
        store.append(batch_partition, &batch).expect("append");
    }
    store.flush().expect("flush");
    (cpu_seconds() - cpu_before, store.disk_bytes())
}

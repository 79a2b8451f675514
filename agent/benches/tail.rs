//! Tail engine benchmark (`cargo bench -p tracetap --bench tail`): the agent's tail stage as the tail
//! thread runs it (decode a batch from the capture thread, hold or append its traces, decide,
//! re-encode the kept ones), each in a fresh child process: `memory` (every trace in the in-memory
//! store), `sled` (every trace written to the sled store: `TRACETAP_TAIL_MAX_MEMORY_BYTES=0`) and
//! `first` (memory first, the sled store for what must wait) and `journal` (`first` with the
//! journal, the agent's default).
//!
//! - `cpu`: `TRACETAP_BENCH_SPANS` (default 1 000 000) spans in batches of 256 SERVER+CLIENT
//!   exchanges, encoded beforehand by the agent's own encoder, arriving at 100 000 exchanges per
//!   simulated second, with a tick (decisions, partition drops) every simulated 100 ms as the tail
//!   thread does; every trace is decided (keep errors + 1%, none are errors). Reports CPU per span of the whole process (sled's threads
//!   included), and the ratio sled / memory.
//!   At 100 000 exchanges per second a trace waits its grace (`TRACETAP_BENCH_GRACE_MS`, default
//!   500 as in the agent) in memory: 50 000 traces, which the default 64 MiB holds; a longer grace
//!   (2000: 200 000 traces) makes most traces spill in `first`.
//! - `rss`: `TRACETAP_BENCH_RSS_SPANS` (default 5 000 000) spans buffered and not yet decided
//!   (arriving at 100 000 exchanges per simulated second, grace and decision wait an hour), in
//!   `sled` and in `first` (64 MiB of them in memory, the rest in the store); reports the process RSS and the bytes on disk (the sled store only, its cache
//!   `TRACETAP_BENCH_SLED_CACHE_BYTES`, default the agent's), then the RSS after `malloc_trim` split
//!   into the engine's share and the store's.

#[path = "../../storage/benches/support/proc_stats.rs"]
mod proc_stats;

use std::path::Path;

use proc_stats::{cpu_seconds, dir_bytes, status_kib};
use std::process::Command;

use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use tracetap::encode::{Attr, BatchEncoder, SpanView, Value};
use tracetap::sampling::threshold_for;
use tracetap::tail::engine::{Engine, Limits};
use tracetap::tail::journal::{self, Journal};
use tracetap::tail::policy::{NamedPolicy, Policy, PolicySet};
use tracetap_storage::{MemoryStore, SledOptions, SledStore, TailStore};

const EXCHANGES_PER_BATCH: u64 = 256;
const CHILD_VAR: &str = "TRACETAP_BENCH_CHILD";
const S: u64 = 1_000_000_000;
const T0: u64 = 1_800_000_000 * S;
const TICK_NS: u64 = 100_000_000;

fn main() {
    if let Ok(spec) = std::env::var(CHILD_VAR) {
        let mut parts = spec.split(':');
        let (mode, store, spans) = (parts.next().unwrap(), parts.next().unwrap(), parts.next().unwrap());
        child(mode, store, spans.parse().expect("span count"));
        return;
    }
    let spans = env_or("TRACETAP_BENCH_SPANS", 1_000_000);
    let rss_spans = env_or("TRACETAP_BENCH_RSS_SPANS", 5_000_000);
    let rounds = env_or("TRACETAP_BENCH_ROUNDS", 3);
    println!("tail engine, cpu: {spans} spans (SERVER+CLIENT exchanges), {rounds} rounds, alternating");
    let mut cpu = [0.0f64; 4];
    for _ in 0..rounds {
        for (i, store) in ["memory", "sled", "first", "journal"].into_iter().enumerate() {
            let line = run_child(&format!("cpu:{store}:{spans}"));
            print!("{line}");
            cpu[i] += line.split_whitespace().nth(2).and_then(|c| c.parse::<f64>().ok()).expect("cpu column");
        }
    }
    println!("CPU ratio sled / memory: {:.2}", cpu[1] / cpu[0]);
    println!("CPU ratio first (memory first, sled for what waits) / memory: {:.2}", cpu[2] / cpu[0]);
    println!("CPU ratio journal (first, journaled: the agent's default) / first: {:.2}", cpu[3] / cpu[2]);
    println!("tail engine, rss: {rss_spans} spans buffered");
    print!("{}", run_child(&format!("rss:sled:{rss_spans}")));
    print!("{}", run_child(&format!("rss:first:{rss_spans}")));
    print!("{}", run_child(&format!("rss:journal:{rss_spans}")));
}

fn run_child(spec: &str) -> String {
    let out = Command::new(std::env::current_exe().expect("own path"))
        .env(CHILD_VAR, spec)
        .output()
        .expect("running the bench child");
    assert!(out.status.success(), "child {spec} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8")
}

fn env_or(var: &str, default: u64) -> u64 {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// One batch as the capture thread encodes it: `EXCHANGES_PER_BATCH` SERVER+CLIENT pairs with the
/// attributes the agent emits, trace ids numbered from `first`.
fn encoded_batch(encoder: &mut BatchEncoder, first: u64) -> Vec<u8> {
    let server_attrs = [
        Attr { key: "http.request.method", value: Value::Str("GET") },
        Attr { key: "url.path", value: Value::Str("/api/v1/items/42") },
        Attr { key: "url.query", value: Value::Str("sort=asc") },
        Attr { key: "url.scheme", value: Value::Str("http") },
        Attr { key: "server.address", value: Value::Str("shop.example.com") },
        Attr { key: "server.port", value: Value::Int(8443) },
        Attr { key: "client.address", value: Value::Str("192.168.10.23") },
        Attr { key: "network.peer.address", value: Value::Str("192.168.10.23") },
        Attr { key: "network.peer.port", value: Value::Int(51234) },
        Attr { key: "user_agent.original", value: Value::Str("Mozilla/5.0 (X11; Linux x86_64)") },
        Attr { key: "http.response.status_code", value: Value::Int(200) },
        Attr { key: "haproxy.frontend", value: Value::Str("fe_main") },
    ];
    let client_attrs = [
        Attr { key: "http.request.method", value: Value::Str("GET") },
        Attr { key: "url.full", value: Value::Str("http://10.0.3.17:8080/api/v1/items/42?sort=asc") },
        Attr { key: "server.address", value: Value::Str("10.0.3.17") },
        Attr { key: "server.port", value: Value::Int(8080) },
        Attr { key: "http.response.status_code", value: Value::Int(200) },
        Attr { key: "haproxy.backend", value: Value::Str("be_app") },
        Attr { key: "haproxy.server", value: Value::Str("app1") },
    ];
    let mut views = Vec::with_capacity(2 * EXCHANGES_PER_BATCH as usize);
    for n in first..first + EXCHANGES_PER_BATCH {
        let mut trace_id = [0u8; 16];
        trace_id[..8].copy_from_slice(&n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
        trace_id[8..].copy_from_slice(&n.wrapping_mul(0xff51_afd7_ed55_8ccd).to_be_bytes());
        let end = T0 + n * 10_000;
        let server = SpanView {
            trace_id,
            span_id: [1; 8],
            parent_span_id: [0; 8],
            trace_state: "ot=th:0",
            flags: 0x101,
            name: "GET fe_main",
            kind: 2,
            start_unix_ns: end - 2_000_000,
            end_unix_ns: end,
            attributes: &server_attrs,
            events: &[],
            error: false,
        };
        let client = SpanView {
            span_id: [2; 8],
            parent_span_id: [1; 8],
            name: "GET be_app",
            kind: 3,
            attributes: &client_attrs,
            events: &[],
            ..server
        };
        views.push(server);
        views.push(client);
    }
    encoder.encode([(4242, &views[..])]).to_vec()
}

fn policies() -> PolicySet {
    PolicySet::new(vec![
        NamedPolicy { name: "keep_errors".into(), policy: Policy::StatusCode { codes: vec![StatusCode::Error] } },
        NamedPolicy { name: "probabilistic".into(), policy: Policy::Probabilistic { threshold: threshold_for(0.01) } },
    ])
}

/// `TRACETAP_BENCH_GRACE_MS` (default 500, the agent's default grace).
fn limits() -> Limits {
    Limits {
        grace_ns: env_or("TRACETAP_BENCH_GRACE_MS", 500) * 1_000_000,
        decision_wait_ns: 30 * S,
        max_disk_bytes: u64::MAX,
        decision_cache: 100_000,
        export_batch_spans: 512,
        spill_after_ns: 0,
        max_memory_bytes: 1 << 30,
    }
}

fn child(mode: &str, store: &str, spans: u64) {
    let dir = tempfile::tempdir_in(std::env::var_os("TMPDIR").unwrap_or_else(|| "/var/tmp".into())).expect("temp dir");
    match store {
        "memory" => run(mode, store, MemoryStore::new(), limits(), spans, None),
        "sled" => run(
            mode,
            store,
            SledStore::open(
                dir.path(),
                SledOptions {
                    cache_bytes: env_or("TRACETAP_BENCH_SLED_CACHE_BYTES", SledOptions::default().cache_bytes),
                    ..SledOptions::default()
                },
            )
            .expect("open"),
            limits(),
            spans,
            Some(dir.path()),
        ),
        "first" | "journal" => run(
            mode,
            store,
            SledStore::open(dir.path(), SledOptions::default()).expect("open"),
            Limits { spill_after_ns: 5 * S, max_memory_bytes: 64 << 20, ..limits() },
            spans,
            Some(dir.path()),
        ),
        other => panic!("unknown store {other}"),
    }
}

fn run<S: TailStore>(mode: &str, name: &str, store: S, limits: Limits, spans: u64, dir: Option<&Path>) {
    let mut encoder = BatchEncoder::new(vec![("service.name".into(), "haproxy".into())]);
    // rss: long decision waits, so that everything stays buffered.
    let limits =
        if mode == "rss" { Limits { grace_ns: 3600 * S, decision_wait_ns: 3600 * S, ..limits } } else { limits };
    // `journal`: as the agent runs by default, each group commit written and fdatasynced.
    let journal = (name == "journal").then(|| {
        let dir = dir.expect("a directory").join("journal");
        let sync =
            if env_or("TRACETAP_BENCH_JOURNAL_SYNC", 1) == 1 { journal::Sync::Data } else { journal::Sync::None };
        Journal::open(&dir, sync, T0).expect("journal")
    });
    let mut engine = Engine::open_journaled(store, journal, policies(), limits, Vec::new(), T0).expect("engine");
    let batches = spans / (2 * EXCHANGES_PER_BATCH);
    match mode {
        "cpu" => {
            let prepared: Vec<Vec<u8>> =
                (0..batches).map(|b| encoded_batch(&mut encoder, b * EXCHANGES_PER_BATCH)).collect();
            let before = cpu_seconds();
            let mut exported = 0;
            let mut last_tick = T0;
            for (b, bytes) in prepared.iter().enumerate() {
                let now = T0 + b as u64 * EXCHANGES_PER_BATCH * 10_000;
                engine.ingest(bytes, now).expect("parses");
                // The tail thread ticks every 100 ms (of simulated time here: 100 000 exchanges/s).
                if now - last_tick < TICK_NS {
                    continue;
                }
                last_tick = now;
                engine.tick(now);
                while let Some(out) = engine.take_export() {
                    exported += out.spans;
                    std::hint::black_box(&out.request);
                    engine.delivered(&out.deliveries);
                }
            }
            engine.tick(T0 + 3600 * S);
            while let Some(out) = engine.take_export() {
                exported += out.spans;
                std::hint::black_box(&out.request);
                engine.delivered(&out.deliveries);
            }
            engine.close();
            let cpu = cpu_seconds() - before;
            let total = batches * 2 * EXCHANGES_PER_BATCH;
            let (in_memory, spilled) = engine.memory_counts();
            println!(
                "cpu {name:<7} {cpu:>7.2} s  {:>7.0} ns/span  {:>9.0} spans/s/core  exported {exported}  decided in memory {in_memory}, spilled {spilled}",
                cpu * 1e9 / total as f64,
                total as f64 / cpu
            );
        }
        "rss" => {
            let mut last_tick = T0;
            for b in 0..batches {
                let bytes = encoded_batch(&mut encoder, b * EXCHANGES_PER_BATCH);
                // 100 000 exchanges per simulated second, ticking as the tail thread does; with
                // hour-long waits nothing comes due, everything stays buffered.
                let now = T0 + b * EXCHANGES_PER_BATCH * 10_000;
                engine.ingest(&bytes, now).expect("parses");
                if now - last_tick >= TICK_NS {
                    last_tick = now;
                    engine.tick(now);
                }
            }
            engine.close();
            let total = batches * 2 * EXCHANGES_PER_BATCH;
            let disk = dir.map_or(0, dir_bytes);
            println!(
                "rss {name:<7} {total} spans buffered ({} traces pending): RSS {:.0} MiB (peak {:.0} MiB), {:.0} bytes on disk per span",
                engine.pending_traces(),
                status_kib("VmRSS:") as f64 / 1024.0,
                status_kib("VmHWM:") as f64 / 1024.0,
                disk as f64 / total as f64
            );
            // Where the memory is: freed heap handed back first (glibc keeps it otherwise), then
            // without the engine's own state, then without the store.
            let rss_trimmed = || {
                // SAFETY: malloc_trim has no preconditions; it only returns free heap to the system.
                unsafe { libc::malloc_trim(0) };
                status_kib("VmRSS:") as f64 / 1024.0
            };
            let trimmed = rss_trimmed();
            let store = engine.into_store();
            let store_only = rss_trimmed();
            drop(store);
            let neither = rss_trimmed();
            println!(
                "rss {name:<7} after malloc_trim {trimmed:.0} MiB: engine {:.0} MiB, store {:.0} MiB, the rest {neither:.0} MiB",
                trimmed - store_only,
                store_only - neither
            );
        }
        other => panic!("unknown mode {other}"),
    }
}

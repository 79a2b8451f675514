//! The agent's per-record path, from ring buffer bytes to an encoded OTLP batch, per proxied
//! request (`cargo bench -p tracetap --bench record_path`): the guard against the agent's CPU per
//! request creeping up again (issue 32).
//!
//! Records are made as the probes write them (an `EventHeader`, then the payload) for keep-alive
//! traffic through one frontend and one backend connection: per request, the frontend read of the
//! request, the backend write of it, the backend read of the response and the frontend write of
//! it. Each iteration takes them through what the capture thread does with them: decode
//! (`capture::decode`), `Tracker::handle`, drain, head sampling (`SpanBuilder::decide`), batching
//! and encoding (`Batcher`), and the exchanges' recycling. Not included: the ring buffer itself,
//! names (configuration lookups) and opaque marks, which a keep-alive request does not touch.
//!
//! Two cases: ratio 1.0 (every request becomes two spans), and requests carrying an unsampled
//! `traceparent` under `parentbased_always_on` (none does: the probes drop each at its head, so the
//! frontend read comes as a `DroppedRequest` record without payload, and the rest is paired
//! only). The second is what a sampled-out request costs wherever the
//! sampler can keep some; `always_off` and `traceidratio` 0 load no probe at all, so they never
//! reach this path. After criterion, the figures are compared with
//! `benches/record_path_budget.txt`: a figure over its budget is said plainly (`make bench` shows
//! it); the budget is the target per request for the whole agent, of which this path is
//! most.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group};
use tracetap::batch::Batcher;
use tracetap::capture::decode;
use tracetap::sampling::Sampler;
use tracetap::spans::SpanBuilder;
use tracetap_ebpf_common::head_drop::HeadScan;
use tracetap_ebpf_common::{EventHeader, EventKind};
use tracetap_proxy::sampled_out::SampledOutRule;
use tracetap_proxy::{Limits, Tracker};

/// Where `EventHeader::addr` lies in a record.
const ADDR_OFFSET: usize = std::mem::offset_of!(EventHeader, addr);

/// Requests per iteration.
const REQUESTS: usize = 512;

const REQUEST: &[u8] = b"GET /api/items?id=42&page=3 HTTP/1.1\r\nHost: shop.example.com\r\nUser-Agent: Mozilla/5.0 (X11; Linux x86_64)\r\nAccept: application/json\r\nAccept-Encoding: gzip\r\nX-Request-Id: 0f4c2a\r\n\r\n";
/// [`REQUEST`] with a valid parent whose sampled flag is off (the same one on every request: the
/// bench's one connection pair never has two in flight at once).
const UNSAMPLED_REQUEST: &[u8] = b"GET /api/items?id=42&page=3 HTTP/1.1\r\nHost: shop.example.com\r\nUser-Agent: Mozilla/5.0 (X11; Linux x86_64)\r\nAccept: application/json\r\nAccept-Encoding: gzip\r\nX-Request-Id: 0f4c2a\r\ntraceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00\r\n\r\n";
const RESPONSE: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 27\r\nCache-Control: no-store\r\n\r\n{\"items\":[1,2,3],\"page\":3}\n";

/// One record as the probes write it.
fn record(kind: EventKind, fd: i32, seq: u32, ts_ns: u64, ret: i64, addr: Option<[u8; 16]>, payload: &[u8]) -> Vec<u8> {
    // SAFETY: EventHeader is plain old data (`#[repr(C)]`, no padding the agent reads as a value);
    // zeroed is one of its valid values.
    let mut header: EventHeader = unsafe { std::mem::zeroed() };
    header.ts_ns = ts_ns;
    header.ret = ret;
    header.tgid = 4242;
    header.tid = 4242;
    header.fd = fd;
    header.kind = kind as u32;
    header.captured = u32::try_from(payload.len()).expect("small payload");
    header.seq = seq;
    if let Some(addr) = addr {
        header.addr[..16].copy_from_slice(&addr);
        header.addr_len = 16;
    }
    // SAFETY: reads the header's own bytes, within its size.
    let bytes = unsafe { std::slice::from_raw_parts((&raw const header).cast::<u8>(), EventHeader::SIZE) };
    let mut out = bytes.to_vec();
    out.extend_from_slice(payload);
    out
}

/// `struct sockaddr_in` for 127.0.0.1:`port`.
fn sockaddr(port: u16) -> [u8; 16] {
    let mut raw = [0u8; 16];
    raw[..2].copy_from_slice(&2u16.to_ne_bytes());
    raw[2..4].copy_from_slice(&port.to_be_bytes());
    raw[4..8].copy_from_slice(&[127, 0, 0, 1]);
    raw
}

/// The records of `REQUESTS` keep-alive requests of `request`'s bytes, starting at `t0` (monotonic
/// ns); returns them and the time after the last. The frontend read is a `DroppedRequest` when the
/// probes drop the request at its head under `rule`, as they would.
fn traffic(request: &[u8], t0: u64, connections: i32, rule: SampledOutRule) -> (Vec<Vec<u8>>, u64) {
    let (kind, threshold) = rule.in_probes();
    let dropped = HeadScan::scan(request, kind, threshold);
    let (front, back) = (100 + 2 * connections, 101 + 2 * connections);
    let mut ts = t0;
    let mut next = |step: u64| {
        ts += step;
        ts
    };
    let mut records = vec![
        record(EventKind::Accept, front, 1, next(1_000), 5, Some(sockaddr(40_000 + connections as u16)), &[]),
        record(EventKind::Connect, back, 1, next(1_000), 0, Some(sockaddr(9000)), &[]),
    ];
    let (mut front_seq, mut back_seq) = (1, 1);
    for _ in 0..REQUESTS {
        front_seq += 1;
        let len = request.len() as i64;
        records.push(match dropped {
            Some(context) => {
                let mut r = record(EventKind::DroppedRequest, front, front_seq, next(10_000), len, None, &[]);
                let addr = context.to_addr();
                r[ADDR_OFFSET..ADDR_OFFSET + addr.len()].copy_from_slice(&addr);
                r
            }
            None => record(EventKind::Read, front, front_seq, next(10_000), len, None, request),
        });
        back_seq += 1;
        records.push(record(EventKind::Write, back, back_seq, next(5_000), request.len() as i64, None, request));
        back_seq += 1;
        records.push(record(EventKind::Read, back, back_seq, next(200_000), RESPONSE.len() as i64, None, RESPONSE));
        front_seq += 1;
        records.push(record(EventKind::Write, front, front_seq, next(5_000), RESPONSE.len() as i64, None, RESPONSE));
    }
    front_seq += 1;
    records.push(record(EventKind::Close, front, front_seq, next(1_000), 0, None, &[]));
    back_seq += 1;
    records.push(record(EventKind::Close, back, back_seq, next(1_000), 0, None, &[]));
    (records, ts)
}

/// What the capture thread keeps across records.
struct Path {
    tracker: Tracker,
    builder: SpanBuilder,
    batcher: Batcher,
    spans: u64,
}

impl Path {
    fn new(sampler: Sampler) -> Self {
        Self {
            tracker: Tracker::new(Limits { sampled_out: sampler.sampled_out_rule(), ..Limits::default() }),
            builder: SpanBuilder::with_seed(sampler, 0, 1),
            batcher: Batcher::new(512, Duration::from_secs(5), vec![("service.name".into(), "haproxy".into())]),
            spans: 0,
        }
    }

    /// Every record, through to encoded batches; every 64 records the finished exchanges are handed
    /// out, as the capture loop does.
    fn run(&mut self, records: &[Vec<u8>]) {
        for (i, r) in records.iter().enumerate() {
            let header = decode::header(r).expect("a header");
            let event = decode::event(&header, r).expect("an event");
            self.tracker.handle(&event);
            if i % 64 == 63 {
                self.hand_out();
            }
        }
        self.hand_out();
        self.flush();
    }

    fn hand_out(&mut self) {
        let finished: Vec<_> = self.tracker.drain().collect();
        for ex in finished {
            match self.builder.decide(&ex) {
                None => self.tracker.recycle(ex),
                Some(decision) => {
                    self.batcher.add(&ex, &decision, None, &mut self.builder);
                    self.tracker.recycle(ex);
                    if self.batcher.is_full() {
                        self.flush();
                    }
                }
            }
        }
    }

    fn flush(&mut self) {
        if let Some(batch) = self.batcher.flush() {
            self.spans += black_box(batch).spans;
        }
    }
}

/// The cases: a name (as in the budget file), the sampler, and the request every exchange sends.
fn samplers() -> [(&'static str, Sampler, &'static [u8]); 2] {
    [
        ("ratio 1.0", Sampler::from_vars(Some("traceidratio"), Some("1.0")).expect("sampler"), REQUEST),
        (
            "unsampled parent",
            Sampler::from_vars(Some("parentbased_always_on"), None).expect("sampler"),
            UNSAMPLED_REQUEST,
        ),
    ]
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("record_path");
    group.throughput(Throughput::Elements(REQUESTS as u64));
    for (name, sampler, request) in samplers() {
        let rule = sampler.sampled_out_rule();
        let mut path = Path::new(sampler);
        let mut t0 = 1_000_000_000;
        let mut n = 0;
        group.bench_function(name, |b| {
            b.iter_batched(
                || {
                    n += 1;
                    let (records, end) = traffic(request, t0, n, rule);
                    t0 = end;
                    records
                },
                |records| path.run(&records),
                criterion::BatchSize::LargeInput,
            );
        });
    }
    group.finish();
}

/// ns per request of each sampler, measured apart from criterion (a plain median of 15 runs), and
/// compared with the budget file.
fn check_budget() {
    let budget = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/benches/record_path_budget.txt"))
        .expect("benches/record_path_budget.txt");
    for (name, sampler, request) in samplers() {
        let limit: f64 = budget
            .lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| l.strip_prefix(name)?.trim().strip_suffix("ns")?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no budget for {name:?} in record_path_budget.txt"));
        let rule = sampler.sampled_out_rule();
        let mut path = Path::new(sampler);
        let mut t0 = 1_000_000_000;
        let mut runs = Vec::new();
        for n in 0..15 {
            let (records, end) = traffic(request, t0, 1000 + n, rule);
            t0 = end;
            let started = Instant::now();
            path.run(&records);
            runs.push(started.elapsed().as_nanos() as f64 / REQUESTS as f64);
        }
        runs.sort_by(f64::total_cmp);
        let median = runs[runs.len() / 2];
        let verdict = if median > limit { "OVER BUDGET" } else { "within budget" };
        println!("record_path {name}: {median:.0} ns per request (budget {limit:.0} ns): {verdict}");
    }
}

criterion_group!(benches, bench);

/// Runs of one case under `RECORD_PATH_CASE`.
const COUNTED_RUNS: usize = 20;

/// `RECORD_PATH_CASE=<case>`: only that case, [`COUNTED_RUNS`] times, for
/// `scripts/record_path_instructions.py` to count its instructions under callgrind (no criterion,
/// no clock); prints how many runs and requests that was.
fn run_case_alone(name: &str) {
    let Some((_, sampler, request)) = samplers().into_iter().find(|(n, _, _)| *n == name) else {
        panic!("RECORD_PATH_CASE={name:?} names no case of record_path");
    };
    let rule = sampler.sampled_out_rule();
    let mut path = Path::new(sampler);
    let mut t0 = 1_000_000_000;
    for n in 0..COUNTED_RUNS {
        let (records, end) = traffic(request, t0, 2000 + n as i32, rule);
        t0 = end;
        path.run(&records);
    }
    println!("runs={COUNTED_RUNS} requests={REQUESTS}");
}

fn main() {
    if let Ok(case) = std::env::var("RECORD_PATH_CASE") {
        run_case_alone(&case);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
    check_budget();
}

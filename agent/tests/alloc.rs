//! Heap allocations on the per-request path, counted by a global allocator that counts per
//! thread: a dropped request allocates nothing in steady state, and kept spans cost at most 0.05
//! allocations each through the arena encoder.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Duration;

use tracetap::batch::Batcher;
use tracetap::sampling::Sampler;
use tracetap::spans::SpanBuilder;
use tracetap_proxy::{Chunk, Op, SyscallEvent, Tracker};

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

struct Counting;

// SAFETY: forwards to the system allocator; only counts, in a const-initialised thread local that
// never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

const REQUEST: &[u8] = b"GET /api/items?id=7 HTTP/1.1\r\nHost: shop.example.com\r\nUser-Agent: curl/8.0\r\n\
    traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n\r\n";
const RESPONSE: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";

/// One proxied request on keep-alive connections: client fd 10 (thread 1), server fd 11.
fn request(tracker: &mut Tracker, ts: &mut u64) {
    let mut ev = |fd: i32, op: Op<'_>| {
        *ts += 1000;
        tracker.handle(&SyscallEvent { ts_ns: *ts, tgid: 7, tid: 1, fd, seq: 0, op });
    };
    ev(10, Op::Read(Chunk::complete(REQUEST)));
    ev(11, Op::Write(Chunk::complete(REQUEST)));
    ev(11, Op::Read(Chunk::complete(RESPONSE)));
    ev(10, Op::Write(Chunk::complete(RESPONSE)));
}

fn open(tracker: &mut Tracker) {
    tracker.handle(&SyscallEvent {
        ts_ns: 1,
        tgid: 7,
        tid: 1,
        fd: 10,
        seq: 0,
        op: Op::Accept { peer: None, local: None },
    });
    tracker.handle(&SyscallEvent { ts_ns: 2, tgid: 7, tid: 1, fd: 11, seq: 0, op: Op::Connect { server: None } });
}

#[test]
fn a_dropped_request_allocates_nothing() {
    let mut tracker = Tracker::default();
    let mut builder = SpanBuilder::new(Sampler::from_vars(Some("always_off"), None).unwrap(), 0);
    let mut scratch = Vec::with_capacity(16);
    let mut ts = 10;
    open(&mut tracker);
    let mut run = |n: usize, tracker: &mut Tracker| {
        for _ in 0..n {
            request(tracker, &mut ts);
            scratch.extend(tracker.drain());
            for ex in scratch.drain(..) {
                // What the capture loop does with an exchange the sampler drops.
                assert!(builder.decide(&ex).is_none());
                tracker.recycle(ex);
            }
        }
    };
    run(1_000, &mut tracker);
    let before = allocations();
    run(10_000, &mut tracker);
    assert_eq!(allocations() - before, 0, "allocations for 10 000 dropped requests");
}

#[test]
fn kept_spans_cost_at_most_five_hundredths_of_an_allocation() {
    let mut tracker = Tracker::default();
    let mut builder = SpanBuilder::new(Sampler::default(), 0);
    let mut batcher = Batcher::new(512, Duration::from_hours(1), vec![("service.name".into(), "haproxy".into())]);
    let mut scratch = Vec::with_capacity(16);
    let mut ts = 10;
    let mut spans = 0u64;
    open(&mut tracker);
    let mut run = |n: usize, tracker: &mut Tracker, spans: &mut u64| {
        for _ in 0..n {
            request(tracker, &mut ts);
            scratch.extend(tracker.drain());
            for ex in scratch.drain(..) {
                let decision = builder.decide(&ex).expect("kept");
                *spans += batcher.add(&ex, &decision, None, &mut builder) as u64;
                tracker.recycle(ex);
                if batcher.is_full() {
                    let batch = batcher.flush().expect("batch");
                    drop(batch);
                }
            }
        }
    };
    run(2_000, &mut tracker, &mut spans);
    let (before, spans_before) = (allocations(), spans);
    run(20_000, &mut tracker, &mut spans);
    let per_span = (allocations() - before) as f64 / (spans - spans_before) as f64;
    println!("allocations per kept span: {per_span:.4}");
    assert!(per_span <= 0.05, "{per_span} allocations per span");
}

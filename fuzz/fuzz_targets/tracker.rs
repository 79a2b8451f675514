//! The stream parser (framing, heads, pairing, linking) fed with arbitrary syscalls on a few
//! connections: it must never panic, and its state must stay bounded by the connections open.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tracetap_proxy::{Chunk, Op, SyscallEvent, Tracker};

#[derive(Arbitrary, Debug)]
enum FuzzOp {
    Accept,
    Connect,
    Read { bytes: Vec<u8>, uncaptured: u16, tail: Vec<u8> },
    Write { bytes: Vec<u8>, uncaptured: u16, tail: Vec<u8> },
    Eof,
    Close,
    Ignore,
    Expire,
}

#[derive(Arbitrary, Debug)]
struct Call {
    fd: u8,
    tid: u8,
    /// Per-connection record number as the probes give it (0: not numbered); arbitrary values
    /// exercise capture gaps.
    seq: u8,
    op: FuzzOp,
}

fuzz_target!(|calls: Vec<Call>| {
    let mut tracker = Tracker::default();
    for (i, call) in calls.iter().enumerate() {
        let ts = (i as u64 + 1) * 1_000;
        let chunk = |bytes: &'_ [u8], uncaptured: u16, tail: &'_ [u8]| -> (u64, usize) {
            (bytes.len() as u64 + u64::from(uncaptured), tail.len().min(16))
        };
        let op = match &call.op {
            FuzzOp::Accept => Op::Accept { peer: None, local: None },
            FuzzOp::Connect => Op::Connect { server: None },
            FuzzOp::Read { bytes, uncaptured, tail } => {
                let (total, t) = chunk(bytes, *uncaptured, tail);
                Op::Read(Chunk { known: bytes, total: total.max(1), tail: &tail[..t] })
            }
            FuzzOp::Write { bytes, uncaptured, tail } => {
                let (total, t) = chunk(bytes, *uncaptured, tail);
                Op::Write(Chunk { known: bytes, total, tail: &tail[..t] })
            }
            FuzzOp::Eof => Op::Read(Chunk { known: &[], total: 0, tail: &[] }),
            FuzzOp::Close => Op::Close,
            FuzzOp::Ignore => Op::Ignore,
            FuzzOp::Expire => {
                tracker.expire(ts * 1_000_000);
                continue;
            }
        };
        tracker.handle(&SyscallEvent { ts_ns: ts, tgid: 1, tid: u32::from(call.tid % 4), fd: i32::from(call.fd % 8), seq: u32::from(call.seq), op });
        for ex in tracker.drain() {
            assert!(ex.end_ns >= ex.start_ns || ex.request.is_none());
        }
    }
    assert!(tracker.connections() <= 8);
});

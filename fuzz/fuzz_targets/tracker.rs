//! The stream parser (framing, heads, pairing, linking) fed with arbitrary syscalls on a few
//! connections (HTTP/1, HTTP/2 after its preface, TLS plaintext): it must never panic, and its state must stay bounded by the connections open.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tracetap_proxy::trace_context::TraceParent;
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
    /// The connection's later records are TLS plaintext.
    Tls { version: u16 },
    /// A read whose bytes start with the HTTP/2 preface, so that HTTP/2 decoding is reached.
    H2Read { bytes: Vec<u8> },
    /// A read or write that failed because the peer was gone.
    PeerGone,
    /// A frontend read the probes dropped at its head: its size and context only.
    DroppedRequest { len: u16, trace_id: [u8; 16], parent_id: [u8; 8], flags: u8 },
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
        let mut preface_first = Vec::new();
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
            FuzzOp::PeerGone => Op::PeerGone,
            FuzzOp::DroppedRequest { len, trace_id, parent_id, flags } => Op::DroppedRequest {
                len: u64::from(*len).max(1),
                context: TraceParent { trace_id: *trace_id, parent_id: *parent_id, flags: *flags },
            },
            FuzzOp::Ignore => Op::Ignore,
            FuzzOp::Tls { version } => Op::Tls { version: *version },
            FuzzOp::H2Read { bytes } => {
                preface_first.extend_from_slice(tracetap_proxy::h2::PREFACE);
                preface_first.extend_from_slice(bytes);
                Op::Read(Chunk::complete(&preface_first))
            }
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

//! Frontend requests dropped at their head, in the probe (the decision is the common crate's
//! `head_drop`): a small plain read on an accepted HTTP/1 connection is staged, looked over for a
//! line that may hold a `traceparent` (most requests have none, and skip the rest), scanned in
//! rounds (a run of bytes or a whole token each), and sent either as a `DroppedRequest` record
//! (the same sequence number, no payload, the context in `addr`) or as the `Read` it is. Only reads the agent would drop at their head
//! are left out, so the agent still sees every other byte and every record's place in its
//! connection's sequence.

use core::ffi::c_void;

use aya_ebpf::helpers::generated::bpf_loop;
use tracetap_ebpf_common::{
    EventKind,
    head_drop::{DROPPED_CONTEXT_BYTES, DroppedContext, HeadScan, LineStarts, MAX_SCANNED_BYTES, RULE_NONE, ReadBytes},
};

use crate::conns::{CONN_ACCEPTED, CONN_H2};
use crate::payload::copy_segment;
use crate::ring::{STAGING, Staging, emit, stage};
use crate::{DROP_RULE, DROP_THRESHOLD};

/// The rule the agent set (`head_drop::RULE_*`).
#[inline(always)]
fn rule() -> u32 {
    // SAFETY: the agent writes this global before load.
    unsafe { core::ptr::read_volatile(&raw const DROP_RULE) }
}

/// The rule's threshold the agent set.
#[inline(always)]
fn threshold() -> u64 {
    // SAFETY: the agent writes this global before load.
    unsafe { core::ptr::read_volatile(&raw const DROP_THRESHOLD) }
}

/// Whether a plain read of `ret` bytes, copied up to `window`, on a connection with these
/// `CONN_*` flags is scanned: a frontend's HTTP/1 read small enough, with a rule set.
#[inline(always)]
pub(crate) fn scans(flags: u32, ret: i64, window: u64) -> bool {
    flags & CONN_ACCEPTED != 0
        && flags & CONN_H2 == 0
        && ret > 0
        && ret <= i64::from(MAX_SCANNED_BYTES)
        && ret as u64 <= window
        && rule() != RULE_NONE
}

/// Emits a frontend read of `ret` bytes at `buf` (see [`scans`]): dropped, or as it is.
#[inline(always)]
pub(crate) fn emit_request_read(fd: i32, ret: i64, seq: u32, buf: u64) {
    let Some(staging) = stage(EventKind::Read, fd, ret) else { return };
    staging.header.seq = seq;
    let copied = copy_segment(staging, 0, buf, ret as u64);
    // The scan's loop reaches the staging buffer by its own lookup: no reference to it is held
    // across the loop.
    let dropped =
        if copied == ret as u64 && may_hold_traceparent(staging, copied) { scan_staged(copied) } else { None };
    let Some(staging) = STAGING.get_ptr_mut(0) else { return };
    // SAFETY: per-CPU buffer, exclusively ours for the duration of this program run.
    let staging = unsafe { &mut *staging };
    if let Some(context) = dropped {
        staging.header.kind = EventKind::DroppedRequest as u32;
        staging.header.addr = context.to_addr();
        staging.header.addr_len = DROPPED_CONTEXT_BYTES;
        emit(staging, 0);
    } else {
        staging.header.captured = copied as u32;
        emit(staging, copied);
    }
}

/// Whether a line of the first `len` staged bytes may start with a `traceparent` (see
/// [`LineStarts`]): a plain loop over their words, which costs far less than the scan's, so
/// that reads without one (most requests, under the default sampler) skip the scan.
#[inline(always)]
fn may_hold_traceparent(staging: &Staging, len: u64) -> bool {
    let mut starts = LineStarts::default();
    #[expect(clippy::cast_ptr_alignment, reason = "aligned loads: see the assertion on the data's offset")]
    let words = staging.data.as_ptr().cast::<u64>();
    for i in 0..(MAX_SCANNED_BYTES / 8) as usize {
        if (i * 8) as u64 >= len {
            break;
        }
        // SAFETY: word `i` lies in the first `MAX_SCANNED_BYTES` of the staging buffer, which is
        // ours for this program run; the data starts 8-aligned (see the assertion below).
        starts.feed_word(unsafe { core::ptr::read(words.add(i)) });
    }
    starts.maybe()
}

/// Scans the first `len` staged bytes; the context of a head the rule drops.
#[inline(always)]
fn scan_staged(len: u64) -> Option<DroppedContext> {
    let staging = STAGING.get_ptr_mut(0)?;
    // SAFETY: per-CPU buffer, ours for this program run; written through the pointer, no
    // reference kept.
    unsafe { (*staging).scan = HeadScan::default() };
    let mut len = len;
    // A loop helper, as for the iovecs: the verifier checks a round once. Every round reads at
    // least one byte, so `len` rounds are enough; the callback stops the loop sooner.
    // SAFETY: the callback only reads `len` through the pointer given here.
    unsafe {
        bpf_loop(len as u32, scan_round as *mut c_void, (&raw mut len).cast(), 0);
    }
    // SAFETY: as above.
    unsafe { (*staging).scan.dropped(rule(), threshold()) }
}

// Aligned loads of the staged bytes: they start 8-aligned in a map value.
const _: () = assert!(core::mem::offset_of!(Staging, data) % 8 == 0);
// `Staged::word` reads the aligned words `at / 8` and `at / 8 + 1` of an offset masked below
// twice the scanned bytes: at most byte `2 * MAX_SCANNED_BYTES + 7` of the buffer.
const _: () = assert!(2 * MAX_SCANNED_BYTES as usize + 8 <= tracetap_ebpf_common::STAGING_BYTES);

/// The staged bytes of a read, as the scan reads them.
struct Staged<'a> {
    data: &'a [u8; tracetap_ebpf_common::STAGING_BYTES],
    len: u32,
}

impl ReadBytes for Staged<'_> {
    fn read_len(&self) -> u32 {
        self.len
    }

    #[inline(always)]
    fn word(&self, at: u32) -> u64 {
        // Offsets stay below twice the scanned bytes (masked), so both aligned words lie in the
        // buffer; the 8 bytes from `at` are joined from them (no unaligned load).
        let at = u64::from(at) & u64::from(2 * MAX_SCANNED_BYTES - 1);
        let shift = 8 * (at & 7);
        #[expect(clippy::cast_ptr_alignment, reason = "aligned loads: see the assertion on the data's offset")]
        let words = self.data.as_ptr().cast::<u64>();
        // SAFETY: word `at / 8` and the next lie in the staging buffer (see the assertions), which is
        // ours for this program run; both are 8-aligned.
        let (first, second) = unsafe {
            let first = words.add((at / 8) as usize);
            (core::ptr::read(first), core::ptr::read(first.add(1)))
        };
        // `second << (64 - shift)` in two steps: no shift by 64 when `shift` is 0.
        (first >> shift) | ((second << (63 - shift)) << 1)
    }
}

/// One round of the scan (in the staging buffer) of the `len` staged bytes. Returns 1 to stop:
/// the bytes are read, or are no head the probe drops.
extern "C" fn scan_round(_: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the length on the caller's stack, alive for the whole loop.
    let len = unsafe { *ctx.cast::<u64>() } as u32;
    let Some(staging) = STAGING.get_ptr_mut(0) else { return 1 };
    // SAFETY: per-CPU buffer, exclusively ours for the duration of this program run.
    let Staging { scan, data, .. } = unsafe { &mut *staging };
    scan.feed(&Staged { data, len });
    i64::from(scan.failed() || scan.read() >= len)
}

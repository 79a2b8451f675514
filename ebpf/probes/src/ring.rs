//! The ring buffer to the agent and how records get into it: staged in a per-CPU buffer and sent
//! with one `bpf_ringbuf_output` sized to what was copied, or (small plain payloads) copied
//! straight into a reserved record. Every record that cannot be delivered is counted in `LOSSES`
//! and moves the loss epoch on, which the next record carries (see `EventHeader::loss_epoch`).
//! Wake-ups are batched (see [`wakeup_flags`]).

use aya_ebpf::{
    helpers::{
        bpf_get_current_pid_tgid, bpf_ktime_get_ns,
        generated::{bpf_probe_read_user as raw_probe_read_user, bpf_ringbuf_output},
    },
    macros::map,
    maps::{PerCpuArray, RingBuf},
};
use tracetap_ebpf_common::{EventHeader, EventKind, LOSS_SLOTS, Loss, STAGING_BYTES, head_drop::HeadScan};

use crate::WAKEUP_BYTES;

/// Default ring size; the agent resizes it from `TRACETAP_RING_BYTES` before loading.
pub(crate) const DEFAULT_RING_BYTES: u32 = 8 * 1024 * 1024;

#[map]
pub(crate) static EVENTS: RingBuf = RingBuf::with_byte_size(DEFAULT_RING_BYTES, 0);

#[map]
pub(crate) static LOSSES: PerCpuArray<u64> = PerCpuArray::with_max_entries(LOSS_SLOTS, 0);

/// A record being built: header, then payload; and the scan of a staged request head (see the
/// `head` module), which lives here rather than on the stack so that the verifier does not follow
/// its every value through the scan's loop.
#[repr(C)]
pub(crate) struct Staging {
    pub(crate) header: EventHeader,
    pub(crate) data: [u8; STAGING_BYTES],
    pub(crate) scan: HeadScan,
}

// A per-CPU map value may not exceed 32 KiB.
const _: () = assert!(size_of::<Staging>() <= 32 * 1024);

#[map]
pub(crate) static STAGING: PerCpuArray<Staging> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
pub(crate) fn count_loss(loss: Loss) {
    if let Some(slot) = LOSSES.get_ptr_mut(loss as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU while the program runs.
        unsafe { *slot += 1 };
    }
}

/// Emits a record of `kind` for the current process, without payload, and wakes the agent.
#[inline(always)]
pub(crate) fn emit_at_once(kind: EventKind) {
    if let Some(staging) = stage(kind, -1, 0) {
        send_at_once(staging);
    }
}

/// Sends the header of `staging`, waking the agent.
#[inline(always)]
pub(crate) fn send_at_once(staging: &mut Staging) {
    // SAFETY: a plain load of a global, as in `emit`.
    staging.header.loss_epoch = unsafe { core::ptr::read_volatile(&raw const LOSS_EPOCH) };
    // SAFETY: the header lies at the start of `Staging`, which `staging` points to.
    let ret = unsafe {
        bpf_ringbuf_output(
            (&raw const EVENTS).cast_mut().cast(),
            core::ptr::from_ref(staging).cast_mut().cast(),
            EventHeader::SIZE as u64,
            BPF_RB_FORCE_WAKEUP,
        )
    };
    if ret < 0 {
        ring_full();
    }
}

/// Fills the common header fields in the staging buffer and returns it.
#[inline(always)]
pub(crate) fn stage(kind: EventKind, fd: i32, ret: i64) -> Option<&'static mut Staging> {
    let staging = STAGING.get_ptr_mut(0)?;
    // SAFETY: per-CPU buffer, exclusively ours for the duration of this program run.
    let staging = unsafe { &mut *staging };
    fill_header(&mut staging.header, kind, fd, ret);
    Some(staging)
}

/// Sets every header field: the common ones from the call, the rest to "none".
#[inline(always)]
pub(crate) fn fill_header(header: &mut EventHeader, kind: EventKind, fd: i32, ret: i64) {
    let pid_tgid = bpf_get_current_pid_tgid();
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    header.ts_ns = unsafe { bpf_ktime_get_ns() };
    header.ret = ret;
    header.tgid = (pid_tgid >> 32) as u32;
    header.tid = pid_tgid as u32;
    header.fd = fd;
    header.kind = kind as u32;
    header.captured = 0;
    header.addr_len = 0;
    header.tail_len = 0;
    header.seq = 0;
    header.loss_epoch = 0;
}

/// Clamps a length to the staging buffer in a way the verifier sees: the comparison with a
/// constant happens on the register that is then passed to the helper.
#[inline(always)]
pub(crate) fn bounded(len: u64) -> u64 {
    let len = core::hint::black_box(len);
    if len > STAGING_BYTES as u64 { STAGING_BYTES as u64 } else { len }
}

/// `bpf_ringbuf_query` flag: bytes waiting to be consumed.
pub(crate) const BPF_RB_AVAIL_DATA: u64 = 0;
/// `bpf_ringbuf_output` flags.
pub(crate) const BPF_RB_NO_WAKEUP: u64 = 1;
pub(crate) const BPF_RB_FORCE_WAKEUP: u64 = 2;

/// Bumped for every record the ring had no room for (see `EventHeader::loss_epoch`). Two CPUs
/// losing at once may bump it once: it only has to change. A global (direct access, no lookup
/// branch) keeps the verifier's work per record path small.
#[unsafe(no_mangle)]
pub(crate) static mut LOSS_EPOCH: u32 = 0;

/// Emits a staged record (see [`wakeup_flags`] for when it wakes the agent).
#[inline(always)]
pub(crate) fn emit(staging: &mut Staging, payload: u64) {
    // SAFETY: a plain load of a global; a racing update only delays when the agent notices.
    staging.header.loss_epoch = unsafe { core::ptr::read_volatile(&raw const LOSS_EPOCH) };
    let size = (EventHeader::SIZE as u64) + bounded(payload);
    let waiting = EVENTS.query(BPF_RB_AVAIL_DATA);
    let flags = wakeup_flags(waiting, waiting + size);
    // SAFETY: `size` is at most the size of `Staging`, which `staging` points to.
    let ret = unsafe {
        bpf_ringbuf_output(
            (&raw const EVENTS).cast_mut().cast(),
            core::ptr::from_ref(staging).cast_mut().cast(),
            size,
            flags,
        )
    };
    if ret < 0 {
        ring_full();
    }
}

/// Wake-ups are batched: waking the agent costs the traced thread an inter-processor interrupt,
/// so the agent polls on a short timer instead, and a record wakes it only when it takes the
/// bytes waiting (from `before` to `after`) across `WAKEUP_BYTES`: once per crossing, not for
/// every record while the agent is behind (it is awake then, and drains the ring empty before it
/// sleeps again, so the next crossing wakes it).
#[inline(always)]
pub(crate) fn wakeup_flags(before: u64, after: u64) -> u64 {
    // SAFETY: the agent writes this global before load.
    let threshold = u64::from(unsafe { core::ptr::read_volatile(&raw const WAKEUP_BYTES) });
    if before < threshold && after >= threshold { BPF_RB_FORCE_WAKEUP } else { BPF_RB_NO_WAKEUP }
}

/// Counts a record the ring had no room for, and moves the loss epoch on.
#[inline(always)]
pub(crate) fn ring_full() {
    count_loss(Loss::RingFull);
    // SAFETY: a plain store to a global; see LOSS_EPOCH for why a lost update does not matter.
    unsafe {
        let epoch = core::ptr::read_volatile(&raw const LOSS_EPOCH);
        core::ptr::write_volatile(&raw mut LOSS_EPOCH, epoch.wrapping_add(1));
    }
}

/// Payloads up to this many bytes (most HTTP heads and small bodies) are copied straight into a
/// ring record reserved at the fixed size of a [`SmallRecord`]: no staging, no second copy. A
/// record then takes this much ring space whatever it holds, so larger payloads keep the
/// staging path, where a record is sized to its payload.
pub(crate) const SMALL_PAYLOAD: usize = 512;

/// A ring record reserved in place (see [`SMALL_PAYLOAD`]); the agent reads `captured` bytes.
#[repr(C)]
pub(crate) struct SmallRecord {
    header: EventHeader,
    data: [u8; SMALL_PAYLOAD],
}

/// Emits a plain read or write of `len` bytes (`0 < len <= SMALL_PAYLOAD`, and within the
/// capture window) at `buf`, copied straight into the ring.
#[inline(always)]
pub(crate) fn emit_small(kind: EventKind, fd: i32, ret: i64, seq: u32, buf: u64, len: u64) {
    let Some(mut entry) = EVENTS.reserve::<SmallRecord>(0) else {
        ring_full();
        return;
    };
    // SAFETY: the reservation is ours until submitted; every header field is written below.
    let record = unsafe { &mut *entry.as_mut_ptr() };
    fill_header(&mut record.header, kind, fd, ret);
    record.header.seq = seq;
    // SAFETY: a plain load of a global; a racing update only delays when the agent notices.
    record.header.loss_epoch = unsafe { core::ptr::read_volatile(&raw const LOSS_EPOCH) };
    let len = core::hint::black_box(len);
    let len = if len > SMALL_PAYLOAD as u64 { SMALL_PAYLOAD as u64 } else { len };
    // SAFETY: `len` is at most the size of `data`; the helper faults safely on bad user addresses.
    let rc =
        unsafe { raw_probe_read_user(record.data.as_mut_ptr().cast(), len as u32, buf as *const core::ffi::c_void) };
    if rc == 0 {
        record.header.captured = len as u32;
    } else {
        count_loss(Loss::ReadFailed);
    }
    // The reservation already counts as waiting.
    let waiting = EVENTS.query(BPF_RB_AVAIL_DATA);
    entry.submit(wakeup_flags(waiting.saturating_sub(size_of::<SmallRecord>() as u64), waiting));
}

/// Emits a read or write without payload (a connection the agent marked opaque).
#[inline(always)]
pub(crate) fn emit_header_only(kind: EventKind, fd: i32, ret: i64, seq: u32) {
    let Some(staging) = stage(kind, fd, ret) else { return };
    staging.header.seq = seq;
    emit(staging, 0);
}

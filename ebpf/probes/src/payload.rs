//! Copying what a read or write moved: a plain buffer, or the `iovec`s of a vectored call (walked
//! with `bpf_loop`), up to the capture window, plus the call's last `TAIL_BYTES` when the window
//! cut them. Payload lengths are clamped right before each copy (see [`crate::ring::bounded`]), so
//! the verifier can prove every access stays inside the staging buffer.

use core::ffi::c_void;

use aya_ebpf::helpers::{
    bpf_probe_read_user,
    generated::{bpf_loop, bpf_probe_read_user as raw_probe_read_user},
};
use tracetap_ebpf_common::{EventKind, Loss, SOCKADDR_BYTES, STAGING_BYTES, TAIL_BYTES};

use crate::ring::{SMALL_PAYLOAD, STAGING, Staging, bounded, count_loss, emit, emit_small, stage};

#[inline(always)]
pub(crate) fn read_addr(staging: &mut Staging, user_addr: u64) {
    if user_addr == 0 {
        return;
    }
    // SAFETY: reading user memory through the helper, which faults safely.
    match unsafe { bpf_probe_read_user(user_addr as *const [u8; SOCKADDR_BYTES]) } {
        Ok(addr) => {
            staging.header.addr = addr;
            staging.header.addr_len = SOCKADDR_BYTES as u32;
        }
        Err(_) => count_loss(Loss::ReadFailed),
    }
}

#[inline(always)]
pub(crate) fn iovec_at(iov: u64, ret: u64) -> Option<(u64, u64)> {
    // struct iovec { void *iov_base; size_t iov_len; }
    // SAFETY: helper reads of user memory.
    let base = unsafe { bpf_probe_read_user(iov as *const u64) }.ok()?;
    let len = unsafe { bpf_probe_read_user((iov + 8) as *const u64) }.ok()?;
    Some((base, if len < ret { len } else { ret }))
}

/// How the user buffer of a data syscall is described.
#[derive(Copy, Clone, PartialEq, Eq)]
pub(crate) enum BufShape {
    /// `buf` points at the bytes (read, write, recvfrom, sendto).
    Plain,
    /// `buf` points at a `struct iovec` array (readv, writev).
    Iovec,
    /// `buf` points at a `struct msghdr` (recvmsg, sendmsg).
    Msghdr,
}

/// Most `iovec`s of one vectored call that are walked (copied from, or searched for the end).
pub(crate) const MAX_IOVECS: u64 = 8;
/// Later segments of a vectored call are copied only while fewer bytes than this were taken, and
/// at most this many each: offset and length then each stay below it, which the verifier can see,
/// so every copy stays inside the staging buffer (`2 * SEGMENT_BYTES == STAGING_BYTES`).
pub(crate) const SEGMENT_BYTES: u64 = STAGING_BYTES as u64 / 2;

/// Where the buffers of a data call are: `(array of struct iovec, count)`, or one plain buffer.
#[inline(always)]
pub(crate) fn iovecs(shape: BufShape, buf: u64, count: u64) -> Option<(u64, u64)> {
    match shape {
        BufShape::Plain => None,
        BufShape::Iovec => Some((buf, count)),
        BufShape::Msghdr => {
            // struct msghdr { void *msg_name; int msg_namelen; struct iovec *msg_iov; size_t msg_iovlen; ... }
            // SAFETY: helper reads of user memory.
            let iov = unsafe { bpf_probe_read_user((buf + 16) as *const u64) }.ok()?;
            let len = unsafe { bpf_probe_read_user((buf + 24) as *const u64) }.ok()?;
            Some((iov, len))
        }
    }
}

/// Emits a read or write of `ret` bytes with up to `window` of them: small plain ones straight
/// into the ring, the rest through the staging buffer.
#[inline(always)]
#[expect(clippy::too_many_arguments, reason = "the parts of one syscall, kept in registers")]
pub(crate) fn emit_data(
    kind: EventKind,
    fd: i32,
    ret: i64,
    seq: u32,
    shape: BufShape,
    buf: u64,
    count: u64,
    window: u64,
) {
    if shape == BufShape::Plain && ret > 0 && ret as u64 <= SMALL_PAYLOAD as u64 && ret as u64 <= window {
        emit_small(kind, fd, ret, seq, buf, ret as u64);
        return;
    }
    let Some(staging) = stage(kind, fd, ret) else { return };
    staging.header.seq = seq;
    let copied = if ret > 0 { copy_payload(staging, shape, buf, count, ret as u64, window) } else { 0 };
    staging.header.captured = copied as u32;
    emit(staging, copied);
}

/// Copies the first `window` bytes of the call's bytes (across the `iovec`s of a vectored call,
/// see [`SEGMENT_BYTES`]), and the last `TAIL_BYTES` of the whole call when the window cut them.
/// Returns how many bytes follow the header.
#[inline(always)]
pub(crate) fn copy_payload(staging: &mut Staging, shape: BufShape, buf: u64, count: u64, ret: u64, window: u64) -> u64 {
    let Some((iov, count)) = iovecs(shape, buf, count) else {
        let copied = copy_segment(staging, 0, buf, if ret < window { ret } else { window });
        if ret > copied && ret >= TAIL_BYTES as u64 {
            copy_tail(staging, buf + ret - TAIL_BYTES as u64);
        }
        return copied;
    };
    let mut walk = IovecWalk { iov, count, ret, window, copied: 0, seen: 0 };
    // A loop helper rather than an unrolled loop: the verifier checks the body once instead of
    // once per iteration and per path into it, which keeps the program far below its limit.
    // SAFETY: the callback only touches `walk` through the pointer given here.
    unsafe {
        bpf_loop(MAX_IOVECS as u32, walk_iovec as *mut c_void, (&raw mut walk).cast(), 0);
    }
    walk.copied
}

/// The state of a walk over the `iovec`s of one vectored call (see [`walk_iovec`]).
#[repr(C)]
pub(crate) struct IovecWalk {
    iov: u64,
    count: u64,
    ret: u64,
    window: u64,
    copied: u64,
    seen: u64,
}

/// One `iovec` of a vectored call: the first is copied up to the window; later ones while the
/// copy is contiguous (see [`SEGMENT_BYTES`]); the call's last bytes go to the tail when the
/// window cut them. Returns 1 to stop the loop.
extern "C" fn walk_iovec(i: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the `IovecWalk` on the caller's stack, alive for the whole loop.
    let walk = unsafe { &mut *ctx.cast::<IovecWalk>() };
    if i >= walk.count || walk.seen >= walk.ret {
        return 1;
    }
    let Some(staging) = STAGING.get_ptr_mut(0) else { return 1 };
    // SAFETY: per-CPU buffer, exclusively ours for the duration of this program run.
    let staging = unsafe { &mut *staging };
    let Some((base, len)) = iovec_at(walk.iov + i * 16, walk.ret - walk.seen) else { return 1 };
    if i == 0 {
        walk.copied = copy_segment(staging, 0, base, if len < walk.window { len } else { walk.window });
    } else if walk.copied < SEGMENT_BYTES && walk.copied < walk.window && walk.copied == walk.seen {
        let room = walk.window - walk.copied;
        let want = if len < room { len } else { room };
        walk.copied +=
            copy_segment(staging, walk.copied, base, if want < SEGMENT_BYTES { want } else { SEGMENT_BYTES });
    }
    walk.seen += len;
    if walk.seen >= walk.ret && walk.ret > walk.copied && len >= TAIL_BYTES as u64 {
        copy_tail(staging, base + len - TAIL_BYTES as u64);
    }
    0
}

/// Copies `len` user bytes from `from` to the payload at `offset`; returns the bytes copied.
/// `offset == 0` allows up to the whole staging buffer; otherwise both stay below
/// [`SEGMENT_BYTES`] (masked so that the verifier sees it).
#[inline(always)]
pub(crate) fn copy_segment(staging: &mut Staging, offset: u64, from: u64, len: u64) -> u64 {
    let (offset, len) = if offset == 0 {
        (0, bounded(len))
    } else {
        (offset & (SEGMENT_BYTES - 1), if len > SEGMENT_BYTES { SEGMENT_BYTES } else { len })
    };
    if len == 0 {
        return 0;
    }
    // SAFETY: offset + len stays inside `staging.data` (see above); the helper faults safely on
    // bad user addresses.
    let rc = unsafe {
        raw_probe_read_user(staging.data.as_mut_ptr().add(offset as usize).cast(), len as u32, from as *const c_void)
    };
    if rc == 0 {
        len
    } else {
        count_loss(Loss::ReadFailed);
        0
    }
}

#[inline(always)]
pub(crate) fn copy_tail(staging: &mut Staging, from: u64) {
    // SAFETY: helper read of user memory into a fixed-size field.
    if let Ok(tail) = unsafe { bpf_probe_read_user(from as *const [u8; TAIL_BYTES]) } {
        staging.header.tail = tail;
        staging.header.tail_len = TAIL_BYTES as u32;
    }
}

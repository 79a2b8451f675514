//! tracetap's kernel side: syscall tracepoints that copy what a target process reads from and writes
//! to its sockets into one BPF ring buffer.
//!
//! How a call flows:
//! - `sys_enter_*` runs for every process on the host. It first asks [`is_target`] (one hash lookup,
//!   plus a 16-byte compare of the command name when a command filter is set); non-targets stop
//!   there. For a target it remembers the arguments it needs in `INFLIGHT`, keyed by thread.
//! - `sys_exit_*` looks the thread up in `INFLIGHT` (a miss means "not a target" and costs one
//!   lookup), takes the entry out, and on success emits a record: an `EventHeader` followed by the
//!   first `CAPTURE_BYTES` bytes the syscall moved.
//! - Records are staged in a per-CPU buffer and copied into the ring buffer with one
//!   `bpf_ringbuf_output`, sized to what was captured, so a 100-byte read costs 100 bytes of ring.
//!
//! Invariants:
//! - Nothing here blocks or writes to user memory: the probes only read.
//! - Every record that cannot be delivered is counted in `LOSSES` (per CPU), by reason.
//! - Payload lengths are clamped to `STAGING_BYTES` right before each copy (see [`bounded`]), so the
//!   verifier can prove every access stays inside the staging buffer; the logical bound
//!   (`CAPTURE_BYTES`) is applied first.
#![no_std]
#![no_main]

use aya_ebpf::{
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user,
        generated::{bpf_probe_read_user as raw_probe_read_user, bpf_ringbuf_output},
    },
    macros::{map, tracepoint},
    maps::{HashMap, PerCpuArray, RingBuf},
    programs::TracePointContext,
};
use tracetap_ebpf_common::{
    COMM_BYTES, EventHeader, EventKind, LOSS_SLOTS, Loss, SOCKADDR_BYTES, STAGING_BYTES, TAIL_BYTES,
};

/// Payload bytes copied per syscall. Set by the agent at load time.
#[unsafe(no_mangle)]
static CAPTURE_BYTES: u32 = 4096;

/// Command name to trace (NUL padded); all zero means only `TARGET_PIDS` are traced.
#[unsafe(no_mangle)]
static TARGET_COMM: [u8; COMM_BYTES] = [0; COMM_BYTES];

/// Default ring size; the agent resizes it from `TRACETAP_RING_BYTES` before loading.
const DEFAULT_RING_BYTES: u32 = 8 * 1024 * 1024;

#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(DEFAULT_RING_BYTES, 0);

#[map]
static LOSSES: PerCpuArray<u64> = PerCpuArray::with_max_entries(LOSS_SLOTS, 0);

/// Processes (tgid) to trace, kept current by the agent's discovery loop.
#[map]
static TARGET_PIDS: HashMap<u32, u8> = HashMap::with_max_entries(4096, 0);

/// How the user buffer of an in-flight call is described.
#[repr(u32)]
#[derive(Copy, Clone, PartialEq, Eq)]
enum BufShape {
    /// `buf` points at the bytes (read, write, recvfrom, sendto).
    Plain = 0,
    /// `buf` points at a `struct iovec` array (readv, writev).
    Iovec = 1,
    /// `buf` points at a `struct msghdr` (recvmsg, sendmsg).
    Msghdr = 2,
    /// `buf` points at a `struct sockaddr` to fill in (accept, accept4).
    AcceptAddr = 3,
    /// splice: `fd` is the input fd and `buf` the output fd; no bytes pass through user memory.
    Splice = 4,
}

/// Arguments of a syscall between its enter and exit tracepoints.
#[repr(C)]
#[derive(Copy, Clone)]
struct Inflight {
    buf: u64,
    fd: i32,
    shape: BufShape,
    kind: EventKind,
    _pad: u32,
}

#[map]
static INFLIGHT: HashMap<u64, Inflight> = HashMap::with_max_entries(16384, 0);

#[repr(C)]
struct Staging {
    header: EventHeader,
    data: [u8; STAGING_BYTES],
}

#[map]
static STAGING: PerCpuArray<Staging> = PerCpuArray::with_max_entries(1, 0);

/// Offset of the first syscall argument in a `syscalls/sys_enter_*` record; arguments are 8 bytes.
const ARG0: usize = 16;
/// Offset of `ret` in a `syscalls/sys_exit_*` record.
const RET: usize = 16;

#[inline(always)]
fn count_loss(loss: Loss) {
    if let Some(slot) = LOSSES.get_ptr_mut(loss as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU while the program runs.
        unsafe { *slot += 1 };
    }
}

#[inline(always)]
fn is_target(tgid: u32) -> bool {
    // SAFETY: read-only lookup; the value is not used.
    if unsafe { TARGET_PIDS.get(&tgid) }.is_some() {
        return true;
    }
    // SAFETY: the agent writes this global before load; it is constant afterwards.
    let want: [u8; COMM_BYTES] = unsafe { core::ptr::read_volatile(&raw const TARGET_COMM) };
    if want[0] == 0 {
        return false;
    }
    match bpf_get_current_comm() {
        Ok(comm) => comm == want,
        Err(_) => false,
    }
}

#[inline(always)]
fn arg(ctx: &TracePointContext, n: usize) -> u64 {
    // SAFETY: the offset lies inside every sys_enter record for the argument counts used here.
    unsafe { ctx.read_at::<u64>(ARG0 + 8 * n) }.unwrap_or(0)
}

#[inline(always)]
fn remember(ctx: &TracePointContext, kind: EventKind, shape: BufShape, buf_arg: usize) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !is_target((pid_tgid >> 32) as u32) {
        return 0;
    }
    let entry = Inflight { buf: arg(ctx, buf_arg), fd: arg(ctx, 0) as i32, shape, kind, _pad: 0 };
    if INFLIGHT.insert(&pid_tgid, &entry, 0).is_err() {
        count_loss(Loss::InflightFull);
    }
    0
}

/// Fills the common header fields in the staging buffer and returns it.
#[inline(always)]
fn stage(kind: EventKind, fd: i32, ret: i64) -> Option<&'static mut Staging> {
    let staging = STAGING.get_ptr_mut(0)?;
    // SAFETY: per-CPU buffer, exclusively ours for the duration of this program run.
    let staging = unsafe { &mut *staging };
    let pid_tgid = bpf_get_current_pid_tgid();
    let header = &mut staging.header;
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
    Some(staging)
}

/// Clamps a length to the staging buffer in a way the verifier sees: the comparison with a
/// constant happens on the register that is then passed to the helper.
#[inline(always)]
fn bounded(len: u64) -> u64 {
    let len = core::hint::black_box(len);
    if len > STAGING_BYTES as u64 { STAGING_BYTES as u64 } else { len }
}

#[inline(always)]
fn emit(staging: &Staging, payload: u64) {
    let size = (EventHeader::SIZE as u64) + bounded(payload);
    // SAFETY: `size` is at most the size of `Staging`, which `staging` points to.
    let ret = unsafe {
        bpf_ringbuf_output(
            (&raw const EVENTS).cast_mut().cast(),
            core::ptr::from_ref(staging).cast_mut().cast(),
            size,
            0,
        )
    };
    if ret < 0 {
        count_loss(Loss::RingFull);
    }
}

#[inline(always)]
fn read_addr(staging: &mut Staging, user_addr: u64) {
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

/// Resolves the first user buffer of the call and how many bytes of it may hold data.
#[inline(always)]
fn first_segment(shape: BufShape, buf: u64, ret: u64) -> Option<(u64, u64)> {
    match shape {
        BufShape::Plain => Some((buf, ret)),
        BufShape::Iovec => iovec_at(buf, ret),
        BufShape::Msghdr => {
            // struct msghdr { void *msg_name; int msg_namelen; struct iovec *msg_iov; ... }
            // SAFETY: helper read of user memory.
            let iov = unsafe { bpf_probe_read_user((buf + 16) as *const u64) }.ok()?;
            iovec_at(iov, ret)
        }
        BufShape::AcceptAddr | BufShape::Splice => None,
    }
}

#[inline(always)]
fn iovec_at(iov: u64, ret: u64) -> Option<(u64, u64)> {
    // struct iovec { void *iov_base; size_t iov_len; }
    // SAFETY: helper reads of user memory.
    let base = unsafe { bpf_probe_read_user(iov as *const u64) }.ok()?;
    let len = unsafe { bpf_probe_read_user((iov + 8) as *const u64) }.ok()?;
    Some((base, if len < ret { len } else { ret }))
}

#[inline(always)]
fn on_exit(ctx: &TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    // SAFETY: the entry is copied out before it is removed.
    let Some(entry) = (unsafe { INFLIGHT.get(&pid_tgid) }).copied() else {
        return 0;
    };
    let _ = INFLIGHT.remove(&pid_tgid);
    // SAFETY: `ret` is inside every sys_exit record.
    let ret: i64 = unsafe { ctx.read_at::<i64>(RET) }.unwrap_or(-1);
    if ret < 0 {
        // EAGAIN and friends: nothing moved, nothing to say.
        return 0;
    }
    if entry.shape == BufShape::Splice {
        // Bytes moved in the kernel (HAProxy's `option splice-*`): the process read `ret` bytes
        // from one fd and wrote them to the other without seeing them.
        if ret > 0 {
            for (kind, fd) in [(EventKind::Read, entry.fd), (EventKind::Write, entry.buf as i32)] {
                if let Some(staging) = stage(kind, fd, ret) {
                    emit(staging, 0);
                }
            }
        }
        return 0;
    }
    match entry.kind {
        EventKind::Accept => {
            // `ret` carries the listening fd: the agent maps it to the bind address.
            let Some(staging) = stage(EventKind::Accept, ret as i32, i64::from(entry.fd)) else {
                return 0;
            };
            read_addr(staging, entry.buf);
            emit(staging, 0);
        }
        EventKind::Read | EventKind::Write => {
            if ret == 0 && entry.kind == EventKind::Write {
                return 0;
            }
            let Some(staging) = stage(entry.kind, entry.fd, ret) else {
                return 0;
            };
            let mut copied = 0u64;
            if ret > 0 {
                if let Some((base, available)) = first_segment(entry.shape, entry.buf, ret as u64) {
                    // SAFETY: the agent writes this global before load.
                    let window = u64::from(unsafe { core::ptr::read_volatile(&raw const CAPTURE_BYTES) });
                    let want = if available < window { available } else { window };
                    let want = bounded(want);
                    if want > 0 {
                        // SAFETY: `want` is bounded by the staging buffer size; the helper
                        // faults safely on bad user addresses.
                        let rc = unsafe {
                            raw_probe_read_user(
                                staging.data.as_mut_ptr().cast(),
                                want as u32,
                                base as *const core::ffi::c_void,
                            )
                        };
                        if rc == 0 {
                            copied = want;
                        } else {
                            count_loss(Loss::ReadFailed);
                        }
                    }
                    if available > want && available >= TAIL_BYTES as u64 {
                        let from = base + available - TAIL_BYTES as u64;
                        // SAFETY: helper read of user memory into a fixed-size field.
                        if let Ok(tail) = unsafe { bpf_probe_read_user(from as *const [u8; TAIL_BYTES]) } {
                            staging.header.tail = tail;
                            staging.header.tail_len = TAIL_BYTES as u32;
                        }
                    }
                }
            }
            staging.header.captured = copied as u32;
            emit(staging, copied);
        }
        EventKind::Connect | EventKind::Close => {}
    }
    0
}

/// Emits an event that needs nothing from the syscall's exit (connect, close).
#[inline(always)]
fn emit_now(ctx: &TracePointContext, kind: EventKind, addr_arg: Option<usize>) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !is_target((pid_tgid >> 32) as u32) {
        return 0;
    }
    let fd = arg(ctx, 0) as i32;
    let Some(staging) = stage(kind, fd, 0) else {
        return 0;
    };
    if let Some(n) = addr_arg {
        read_addr(staging, arg(ctx, n));
    }
    emit(staging, 0);
    0
}

macro_rules! enter_probe {
    ($fn_name:ident, $tp:literal, $kind:expr, $shape:expr, $buf_arg:literal) => {
        #[tracepoint(category = "syscalls", name = $tp)]
        pub fn $fn_name(ctx: TracePointContext) -> u32 {
            remember(&ctx, $kind, $shape, $buf_arg)
        }
    };
}

macro_rules! exit_probe {
    ($fn_name:ident, $tp:literal) => {
        #[tracepoint(category = "syscalls", name = $tp)]
        pub fn $fn_name(ctx: TracePointContext) -> u32 {
            on_exit(&ctx)
        }
    };
}

enter_probe!(enter_accept, "sys_enter_accept", EventKind::Accept, BufShape::AcceptAddr, 1);
enter_probe!(enter_accept4, "sys_enter_accept4", EventKind::Accept, BufShape::AcceptAddr, 1);
enter_probe!(enter_read, "sys_enter_read", EventKind::Read, BufShape::Plain, 1);
enter_probe!(enter_recvfrom, "sys_enter_recvfrom", EventKind::Read, BufShape::Plain, 1);
enter_probe!(enter_readv, "sys_enter_readv", EventKind::Read, BufShape::Iovec, 1);
enter_probe!(enter_recvmsg, "sys_enter_recvmsg", EventKind::Read, BufShape::Msghdr, 1);
enter_probe!(enter_write, "sys_enter_write", EventKind::Write, BufShape::Plain, 1);
enter_probe!(enter_sendto, "sys_enter_sendto", EventKind::Write, BufShape::Plain, 1);
enter_probe!(enter_writev, "sys_enter_writev", EventKind::Write, BufShape::Iovec, 1);
enter_probe!(enter_sendmsg, "sys_enter_sendmsg", EventKind::Write, BufShape::Msghdr, 1);
// splice(fd_in, off_in, fd_out, off_out, len, flags): `buf` keeps fd_out.
enter_probe!(enter_splice, "sys_enter_splice", EventKind::Read, BufShape::Splice, 2);

exit_probe!(exit_accept, "sys_exit_accept");
exit_probe!(exit_accept4, "sys_exit_accept4");
exit_probe!(exit_read, "sys_exit_read");
exit_probe!(exit_recvfrom, "sys_exit_recvfrom");
exit_probe!(exit_readv, "sys_exit_readv");
exit_probe!(exit_recvmsg, "sys_exit_recvmsg");
exit_probe!(exit_write, "sys_exit_write");
exit_probe!(exit_sendto, "sys_exit_sendto");
exit_probe!(exit_writev, "sys_exit_writev");
exit_probe!(exit_sendmsg, "sys_exit_sendmsg");
exit_probe!(exit_splice, "sys_exit_splice");

#[tracepoint(category = "syscalls", name = "sys_enter_connect")]
pub fn enter_connect(ctx: TracePointContext) -> u32 {
    emit_now(&ctx, EventKind::Connect, Some(1))
}

#[tracepoint(category = "syscalls", name = "sys_enter_close")]
pub fn enter_close(ctx: TracePointContext) -> u32 {
    emit_now(&ctx, EventKind::Close, None)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";

//! TLS plaintext: uprobes on the TLS library's `SSL_read`, `SSL_write` and `SSL_do_handshake`
//! (entry and return), attached by the agent to each traced process that maps a library (or a
//! static binary) exporting them.
//!
//! Tying plaintext to its socket: `HAProxy` gives OpenSSL a BIO of its own, so `SSL_get_fd` means
//! nothing, but the BIO reads and writes the socket with `recv`/`send` on the calling thread,
//! *inside* the `SSL_*` call. So:
//! - at entry, the thread's call is noted in `SSL_CALLS` (the `SSL *` and the buffer);
//! - a read or write syscall that exits on a thread with a call noted ([`bind`], from `sys_exit`)
//!   names the socket of that `SSL *`: `SSL_CONNS` keeps it (with the connection's opening time,
//!   its identity), and the connection is flagged TLS: its ciphertext is no longer reported;
//! - at return, the plaintext (`buf`, the returned length) is reported as a `Read`/`Write` record
//!   of that socket, numbered in the connection's sequence, after a `TlsOpen` record that tells
//!   the agent the connection's later records are plaintext (and the protocol version, when the
//!   library's layout lets it be read).
//!
//! Two ways to probe a function:
//! - at its entry and return (`uprobe` + `uretprobe`): works on any build, but the kernel must
//!   single-step the function's first instruction out of line (a debug exception per call, which
//!   costs several microseconds in a virtual machine) and hijack the return address;
//! - at the call inside it (`*_call`) and at the conditional jump right after that call
//!   (`*_done`), on builds whose code the agent recognises (OpenSSL 3's `SSL_read`/`SSL_write`
//!   call their `_ex` internals with `&readbytes` in `rcx`, then test the result): the kernel
//!   emulates calls and conditional jumps, so each costs one breakpoint trap and nothing else.
//!   The byte count is then the `size_t` the internal call wrote through its fourth argument.
//!
//! The handshake is the first I/O of a TLS connection (after a PROXY protocol, SOCKS4 or CIP
//! header, if any) and always reaches the socket, so every connection is bound before its first
//! plaintext. A connection whose first record started like HTTP instead is cleartext and never
//! asked again (`CONN_CLEARTEXT`, see `plaintext` in the common crate). Plaintext whose `SSL *` names no live
//! connection (opened before the probes, or closed since) is counted in `LOSSES`, never guessed.
//! Only sockets numbered in `CONNS` are bound (the others carry no identity to check against).

use aya_ebpf::{
    EbpfContext as _,
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user, generated::bpf_get_attach_cookie},
    macros::{map, uprobe, uretprobe},
    maps::{Array, HashMap, LruHashMap},
    programs::{ProbeContext, RetProbeContext},
};
use tracetap_ebpf_common::{EventKind, Loss, MAX_NUMBERED_CONNECTIONS, TLS_COOKIE_ANY_PROCESS};

use crate::arch::call_result;
use crate::conns::{
    CONN_DECIDED, CONN_TLS, CONN_TLS_ANNOUNCED, CONNS, ConnState, capture_window, conn_key, decide_h2,
    drop_opaque_mark, payload_unwanted_at, take_seq,
};
use crate::payload::{BufShape, emit_data};
use crate::ring::{count_loss, emit, emit_header_only, stage};
use crate::targets::is_target;

/// Threads inside an `SSL_*` call: `pid_tgid` to the call.
#[map]
static SSL_CALLS: HashMap<u64, SslCall> = HashMap::with_max_entries(16_384, 0);

/// `SSL *` (per process) to the socket it was seen reading or writing. An entry goes when its
/// connection closes (`forget`); LRU only for connections whose close the probes never saw (the
/// process exited), twice the size of `CONNS` so that live entries are not what it evicts.
#[map]
static SSL_CONNS: LruHashMap<SslKey, SslConn> = LruHashMap::with_max_entries(2 * MAX_NUMBERED_CONNECTIONS, 0);

/// Nonzero once the agent attached the TLS probes to some process: until then the syscall probe
/// does not look for a call in `SSL_CALLS` (an array lookup the JIT inlines).
#[map]
static TLS_HOOKED: Array<u32> = Array::with_max_entries(1, 0);

#[repr(C)]
#[derive(Copy, Clone)]
struct SslCall {
    ssl: u64,
    buf: u64,
    /// Call-site probes: where the internal call writes the byte count (`size_t *`).
    out: u64,
    /// One of the `CALL_*` values.
    call: u32,
    _pad: u32,
}

#[repr(C)]
struct SslKey {
    ssl: u64,
    tgid: u32,
    _pad: u32,
}

#[repr(C)]
#[derive(Copy, Clone)]
struct SslConn {
    /// `ts_ns` of the connection's `accept`/`connect` (see `ConnState::opened_ns`).
    opened_ns: u64,
    fd: i32,
    _pad: u32,
}

const CALL_READ: u32 = 1;
const CALL_WRITE: u32 = 2;
const CALL_HANDSHAKE: u32 = 3;

/// From `sys_exit`, for a read or write on the numbered socket `fd` whose connection is not
/// flagged TLS yet: when the thread is inside an `SSL_*` call, binds that call's `SSL *` to the
/// socket and flags the connection. True when bound (the record is ciphertext: not reported).
#[inline(always)]
pub(crate) fn bind(pid_tgid: u64, tgid: u32, fd: i32, state: *mut ConnState) -> bool {
    if TLS_HOOKED.get(0).is_none_or(|hooked| *hooked == 0) {
        return false;
    }
    // SAFETY: read-only lookup of a plain value, copied out.
    let Some(call) = (unsafe { SSL_CALLS.get(pid_tgid) }).copied() else { return false };
    let key = SslKey { ssl: call.ssl, tgid, _pad: 0 };
    // An `SSL *` bound to another connection that is still open is not taken from it: a call
    // noted but never finished (its return probe missed) must not turn a cleartext socket the
    // thread uses later into a TLS one. A handle reused after its connection closed is free.
    // SAFETY: read-only lookup of a plain value, copied out.
    if let Some(bound) = (unsafe { SSL_CONNS.get(&key) }).copied()
        && bound.fd != fd
        && is_open(tgid, bound)
    {
        return false;
    }
    // SAFETY: map value pointer, see `take_seq`.
    let opened_ns = unsafe { (*state).opened_ns };
    if SSL_CONNS.insert(&key, SslConn { opened_ns, fd, _pad: 0 }, 0).is_err() {
        return false;
    }
    // SAFETY: as above.
    unsafe {
        // The plaintext's first bytes decide HTTP/2 afresh: ciphertext may have decided it before
        // (a handshake that ran before the probes reached the process).
        (*state).flags = ((*state).flags | CONN_TLS) & !CONN_DECIDED;
        (*state).ssl = call.ssl;
    }
    drop_opaque_mark(tgid, fd, state);
    true
}

/// Whether the connection an `SSL *` was bound to is still the one open on its fd.
#[inline(always)]
fn is_open(tgid: u32, bound: SslConn) -> bool {
    // SAFETY: read-only lookup of a plain value.
    unsafe { CONNS.get(conn_key(tgid, bound.fd)) }.is_some_and(|state| state.opened_ns == bound.opened_ns)
}

/// A TLS connection closed: its `SSL *` binding goes with it.
#[inline(always)]
pub(crate) fn forget(tgid: u32, ssl: u64) {
    let _ = SSL_CONNS.remove(&SslKey { ssl, tgid, _pad: 0 });
}

/// A thread exited: a call it left noted (killed inside `SSL_read`) goes with it, so that a later
/// thread with the same id does not inherit it.
#[inline(always)]
pub(crate) fn thread_exit(pid_tgid: u64) {
    if TLS_HOOKED.get(0).is_some_and(|hooked| *hooked != 0) {
        let _ = SSL_CALLS.remove(pid_tgid);
    }
}

/// Notes a call. At a call site, the attach cookie says which argument of the internal call
/// points at the byte count: 3 (`ssl_{read,write}_internal(s, buf, num, &bytes)`, OpenSSL 3.0
/// and 3.1) or 4 (OpenSSL 3.2's `ssl_write_internal(s, buf, num, flags, &written)`); at a
/// function entry it is 0 and unused.
///
/// A probe attached for every process that maps the library ([`TLS_COOKIE_ANY_PROCESS`]) notes
/// calls of traced processes only; a call noted twice (that probe and the process's own, over a
/// reload) is one entry, and the closing probe that takes it first reports it, once.
#[inline(always)]
fn enter(ctx: &ProbeContext, call: u32) -> u32 {
    // SAFETY: the helper only reads the cookie of the program's attachment.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    let pid_tgid = bpf_get_current_pid_tgid();
    if cookie & TLS_COOKIE_ANY_PROCESS != 0 && !is_target((pid_tgid >> 32) as u32) {
        return 0;
    }
    let ssl: u64 = ctx.arg(0).unwrap_or(0);
    let buf: u64 = ctx.arg(1).unwrap_or(0);
    // Both loaded first, as plain values: the verifier refuses a load through a context pointer
    // the compiler moved (which a select between the two registers' offsets would be).
    let fourth: u64 = core::hint::black_box(ctx.arg(3).unwrap_or(0));
    let fifth: u64 = core::hint::black_box(ctx.arg(4).unwrap_or(0));
    let out = if cookie & !TLS_COOKIE_ANY_PROCESS == 4 { fifth } else { fourth };
    let _ = SSL_CALLS.insert(pid_tgid, SslCall { ssl, buf, out, call, _pad: 0 }, 0);
    0
}

/// Takes the thread's noted call, if it is a `call`.
#[inline(always)]
fn take_call(pid_tgid: u64, call: u32) -> Option<SslCall> {
    // SAFETY: read-only lookup of a plain value, copied out before the entry is removed.
    let noted = (unsafe { SSL_CALLS.get(pid_tgid) }).copied()?;
    let _ = SSL_CALLS.remove(pid_tgid);
    (noted.call == call).then_some(noted)
}

/// At the return of `SSL_read`/`SSL_write`/`SSL_do_handshake`.
#[inline(always)]
fn leave(ctx: &RetProbeContext, call: u32) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(noted) = take_call(pid_tgid, call) else { return 0 };
    let ret: i32 = ctx.ret();
    let wanted = match call {
        CALL_READ => ret >= 0,
        CALL_WRITE => ret > 0,
        _ => ret == 1,
    };
    if wanted {
        report(pid_tgid, noted, call, i64::from(ret));
    }
    0
}

/// Right after the internal call of a call-site probe: `eax` is its result (1: done), and the
/// byte count is where the fourth argument pointed.
#[inline(always)]
fn done(ctx: &ProbeContext, call: u32) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(noted) = take_call(pid_tgid, call) else { return 0 };
    // SAFETY: `regs` is the probe's context, a `struct pt_regs` the verifier lets us read.
    let result = call_result(unsafe { &*ctx.regs }) as i32;
    if result <= 0 {
        return 0;
    }
    // SAFETY: a helper read of user memory, which faults safely.
    let Ok(len) = (unsafe { bpf_probe_read_user(noted.out as *const u64) }) else {
        count_loss(Loss::ReadFailed);
        return 0;
    };
    if len > 0 {
        report(pid_tgid, noted, call, len.min(i32::MAX as u64) as i64);
    }
    0
}

/// Reports a finished call that moved `len` bytes of plaintext (0: end of stream; for the
/// handshake, its success).
#[inline(always)]
fn report(pid_tgid: u64, noted: SslCall, call: u32, len: i64) {
    let tgid = (pid_tgid >> 32) as u32;
    let key = SslKey { ssl: noted.ssl, tgid, _pad: 0 };
    // SAFETY: read-only lookup of a plain value, copied out.
    let Some(conn) = (unsafe { SSL_CONNS.get(&key) }).copied() else {
        count_loss(Loss::TlsUnbound);
        return;
    };
    let Some(state) = CONNS.get_ptr_mut(conn_key(tgid, conn.fd)) else {
        count_loss(Loss::TlsUnbound);
        return;
    };
    // SAFETY: map value pointer, see `take_seq`.
    if unsafe { (*state).opened_ns } != conn.opened_ns {
        // The socket closed and its fd was reused since the handle was bound.
        count_loss(Loss::TlsUnbound);
        return;
    }
    announce(state, conn.fd, noted.ssl);
    if call == CALL_HANDSHAKE {
        return;
    }
    let kind = if call == CALL_READ { EventKind::Read } else { EventKind::Write };
    let seq = take_seq(state);
    if payload_unwanted_at(tgid, conn.fd, state) {
        // The agent stopped reading the connection (`mode tcp`, a tunnel, lost HTTP/2 state).
        emit_header_only(kind, conn.fd, len, seq);
        return;
    }
    let window = capture_window(decide_h2(state, Some(noted.buf), len));
    emit_data(kind, conn.fd, len, seq, BufShape::Plain, noted.buf, 0, window);
}

/// Sends the connection's `TlsOpen` record once, before its first plaintext.
#[inline(always)]
fn announce(state: *mut ConnState, fd: i32, ssl: u64) {
    // SAFETY: map value pointer, see `take_seq`.
    if unsafe { (*state).flags } & CONN_TLS_ANNOUNCED != 0 {
        return;
    }
    // SAFETY: as above.
    unsafe { (*state).flags |= CONN_TLS_ANNOUNCED };
    let Some(staging) = stage(EventKind::TlsOpen, fd, i64::from(protocol_version(ssl))) else { return };
    staging.header.seq = take_seq(state);
    emit(staging, 0);
}

/// The negotiated protocol version (`0x0303` for TLS 1.2), or 0 when it cannot be read. OpenSSL
/// 1.1 to 3.1 keep it in the first field of `struct ssl_st`; later layouts (and other
/// libraries) keep something else there, which the range check turns into "unknown".
#[inline(always)]
fn protocol_version(ssl: u64) -> u32 {
    // SAFETY: a helper read of user memory, which faults safely.
    match unsafe { bpf_probe_read_user(ssl as *const i32) } {
        Ok(v) if (0x0300..=0x0304).contains(&v) => v as u32,
        _ => 0,
    }
}

#[uprobe]
pub fn ssl_read_entry(ctx: ProbeContext) -> u32 {
    enter(&ctx, CALL_READ)
}

#[uretprobe]
pub fn ssl_read_return(ctx: RetProbeContext) -> u32 {
    leave(&ctx, CALL_READ)
}

#[uprobe]
pub fn ssl_write_entry(ctx: ProbeContext) -> u32 {
    enter(&ctx, CALL_WRITE)
}

#[uretprobe]
pub fn ssl_write_return(ctx: RetProbeContext) -> u32 {
    leave(&ctx, CALL_WRITE)
}

#[uprobe]
pub fn ssl_read_call(ctx: ProbeContext) -> u32 {
    enter(&ctx, CALL_READ)
}

#[uprobe]
pub fn ssl_read_done(ctx: ProbeContext) -> u32 {
    done(&ctx, CALL_READ)
}

#[uprobe]
pub fn ssl_write_call(ctx: ProbeContext) -> u32 {
    enter(&ctx, CALL_WRITE)
}

#[uprobe]
pub fn ssl_write_done(ctx: ProbeContext) -> u32 {
    done(&ctx, CALL_WRITE)
}

#[uprobe]
pub fn ssl_handshake_entry(ctx: ProbeContext) -> u32 {
    enter(&ctx, CALL_HANDSHAKE)
}

#[uretprobe]
pub fn ssl_handshake_return(ctx: RetProbeContext) -> u32 {
    leave(&ctx, CALL_HANDSHAKE)
}

/// The TLS floor of `make bench` (`TRACETAP_PROBE_MODE=floor`): attached where the TLS programs
/// would be, it does nothing, so that a measurement can tell what the uprobe traps cost from what
/// the TLS programs' work costs.
#[uprobe]
pub fn ssl_floor(_ctx: ProbeContext) -> u32 {
    0
}

/// See [`ssl_floor`]: in place of the return programs of entry and return probes.
#[uretprobe]
pub fn ssl_floor_return(_ctx: RetProbeContext) -> u32 {
    0
}

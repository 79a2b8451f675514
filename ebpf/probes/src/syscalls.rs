//! The syscall hooks: `sys_exit` reports what a traced process read and wrote on its sockets,
//! accepted and connected (and its forks, see [`crate::process`]); `sys_enter` reports `close`.

use aya_ebpf::{helpers::bpf_get_current_pid_tgid, macros::btf_tracepoint, programs::BtfTracePointContext};
use tracetap_ebpf_common::EventKind;

use crate::arch::{Arg, arg, is_fork, nr, syscall_nr};
use crate::conns::{CONN_ACCEPTED, CONN_TLS, CONNS, DataPlan, conn_key, next_seq, open_conn, plan_data, take_seq};
use crate::head;
use crate::payload::{BufShape, emit_data, read_addr};
use crate::process::{process_forked, process_started};
use crate::ring::{emit, emit_header_only, stage};
use crate::targets::is_target;
use crate::tls;

/// `recv` flag: look at the data without taking it (HAProxy peeks at a PROXY protocol header).
pub(crate) const MSG_PEEK: u64 = 2;
pub(crate) const EINPROGRESS: i64 = 115;

#[btf_tracepoint(function = "sys_exit")]
pub fn sys_exit(ctx: BtfTracePointContext) -> i32 {
    // TP_PROTO(struct pt_regs *regs, long ret)
    let regs: u64 = ctx.arg(0);
    let ret: i64 = ctx.arg(1);
    let nr = syscall_nr(regs);
    let (kind, shape) = match nr {
        // `splice` is taken apart below (a read and a write, no payload).
        nr::READ | nr::RECVFROM | nr::SPLICE => (EventKind::Read, BufShape::Plain),
        nr::READV => (EventKind::Read, BufShape::Iovec),
        nr::RECVMSG => (EventKind::Read, BufShape::Msghdr),
        nr::WRITE | nr::SENDTO => (EventKind::Write, BufShape::Plain),
        nr::WRITEV => (EventKind::Write, BufShape::Iovec),
        nr::SENDMSG => (EventKind::Write, BufShape::Msghdr),
        nr::ACCEPT | nr::ACCEPT4 => (EventKind::Accept, BufShape::Plain),
        nr::CONNECT => (EventKind::Connect, BufShape::Plain),
        nr if is_fork(nr) => {
            // 0: this is the new task, returning from the call that made it; more: the parent,
            // with the new task's id.
            if ret == 0 {
                process_started();
            } else if ret > 0 {
                process_forked(regs, nr, ret as u32);
            }
            return 0;
        }
        _ => return 0,
    };
    // Failed calls move nothing (EAGAIN is most of them); a non-blocking connect is in progress;
    // a read or write that found the connection broken is where HAProxy saw the peer go.
    let broken = ret < 0 && matches!(kind, EventKind::Read | EventKind::Write) && nr != nr::SPLICE && peer_gone(ret);
    if ret < 0 && !broken && !(kind == EventKind::Connect && ret == -EINPROGRESS) {
        return 0;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if !is_target(tgid) {
        return 0;
    }
    // A peek leaves the bytes in the socket: the real read that follows reports them.
    let recv_flags = match nr {
        nr::RECVMSG => arg(regs, Arg::Third),
        nr::RECVFROM => arg(regs, Arg::Fourth),
        _ => 0,
    };
    if recv_flags & MSG_PEEK != 0 {
        return 0;
    }
    let fd = arg(regs, Arg::First) as i32;
    if broken {
        emit_broken(kind, tgid, fd, ret);
        return 0;
    }
    // The address or buffer, and the length or (splice) the fd written to.
    let (second, third) = (arg(regs, Arg::Second), arg(regs, Arg::Third));
    match kind {
        EventKind::Accept => {
            // `fd` is the new connection; `ret` carries the listening fd for the bind address.
            let Some(staging) = stage(EventKind::Accept, ret as i32, i64::from(fd)) else { return 0 };
            staging.header.seq = open_conn(tgid, ret as i32, staging.header.ts_ns, CONN_ACCEPTED);
            read_addr(staging, second);
            emit(staging, 0);
        }
        EventKind::Connect => {
            let Some(staging) = stage(EventKind::Connect, fd, 0) else { return 0 };
            staging.header.seq = open_conn(tgid, fd, staging.header.ts_ns, 0);
            read_addr(staging, second);
            emit(staging, 0);
        }
        EventKind::Close
        | EventKind::TlsOpen
        | EventKind::ProcessStart
        | EventKind::ProcessExit
        | EventKind::ProcessExec
        | EventKind::DroppedRequest => {}
        EventKind::Read | EventKind::Write if nr == nr::SPLICE => {
            // splice(fd_in, off_in, fd_out, ...): bytes moved in the kernel (HAProxy's
            // `option splice-*`); the process read them from one fd and wrote them to the other
            // without seeing them.
            if ret > 0 {
                for (kind, fd) in [(EventKind::Read, fd), (EventKind::Write, third as i32)] {
                    if let Some(staging) = stage(kind, fd, ret) {
                        staging.header.seq = next_seq(tgid, fd);
                        emit(staging, 0);
                    }
                }
            }
        }
        EventKind::Read | EventKind::Write => {
            if ret == 0 && kind == EventKind::Write {
                return 0;
            }
            let plain_buf = if shape == BufShape::Plain { Some(second) } else { None };
            match plan_data(pid_tgid, tgid, fd, plain_buf, ret) {
                DataPlan::Skip => {}
                DataPlan::HeaderOnly { seq } => emit_header_only(kind, fd, ret, seq),
                DataPlan::Copy { seq, window, flags }
                    if kind == EventKind::Read && shape == BufShape::Plain && head::scans(flags, ret, window) =>
                {
                    head::emit_request_read(fd, ret, seq, second);
                }
                DataPlan::Copy { seq, window, .. } => emit_data(kind, fd, ret, seq, shape, second, third, window),
            }
        }
    }
    0
}

/// Errors of a read or write that say the peer is gone (`ECONNRESET`, `EPIPE`, `ETIMEDOUT`).
#[inline(always)]
pub(crate) fn peer_gone(ret: i64) -> bool {
    matches!(-ret, 104 | 32 | 110)
}

/// Reports a read or write that failed with `ret` (see [`peer_gone`]) on a numbered connection,
/// in its sequence and without payload. Connections not numbered are left out: nothing ties the
/// failure to an exchange there.
#[inline(always)]
pub(crate) fn emit_broken(kind: EventKind, tgid: u32, fd: i32, ret: i64) {
    let Some(state) = CONNS.get_ptr_mut(conn_key(tgid, fd)) else { return };
    let seq = take_seq(state);
    emit_header_only(kind, fd, ret, seq);
}

/// `close` is reported at entry, while the fd still belongs to the connection: at exit another
/// thread may already have been handed the same fd number by `accept`, and its record could reach
/// the ring buffer first.
#[btf_tracepoint(function = "sys_enter")]
pub fn sys_enter(ctx: BtfTracePointContext) -> i32 {
    // TP_PROTO(struct pt_regs *regs, long id)
    let id: u64 = ctx.arg(1);
    if id != nr::CLOSE {
        return 0;
    }
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if !is_target(tgid) {
        return 0;
    }
    let fd = arg(ctx.arg(0), Arg::First) as i32;
    if let Some(staging) = stage(EventKind::Close, fd, 0) {
        let key = conn_key(tgid, fd);
        staging.header.seq = match CONNS.get_ptr_mut(key) {
            Some(state) => {
                // SAFETY: map value pointer, see `take_seq`.
                let (flags, ssl) = unsafe { ((*state).flags, (*state).ssl) };
                if flags & CONN_TLS != 0 {
                    tls::forget(tgid, ssl);
                }
                take_seq(state)
            }
            None => 0,
        };
        let _ = CONNS.remove(key);
        emit(staging, 0);
    }
    0
}

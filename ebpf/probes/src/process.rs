//! Processes starting, replacing their program and ending: the agent is told at once (it hooks a
//! new HAProxy worker's TLS library before the worker's first connection), and the verdicts of
//! [`crate::targets`] follow.

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    macros::btf_tracepoint,
    programs::BtfTracePointContext,
};
use tracetap_ebpf_common::EventKind;

use crate::arch::{Arg, arg, nr};
use crate::ring::{emit, emit_at_once, send_at_once, stage};
use crate::targets::{TARGET_PIDS, TARGET_SET, comm_verdict, is_target};
use crate::tls;

/// A process replaced its program: with a command filter, its cached verdict is redone from the
/// new name (HAProxy's master re-executes itself on reload, keeping its pid).
#[btf_tracepoint(function = "sched_process_exec")]
pub fn sched_process_exec(_ctx: BtfTracePointContext) -> i32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if let Some(verdict) = comm_verdict() {
        let _ = TARGET_PIDS.insert(tgid, u8::from(verdict), 0);
    }
    if is_target(tgid) {
        emit_at_once(EventKind::ProcessExec);
    }
    0
}

/// A process ended (its main thread exits): the agent is told (a traced one), and its verdict
/// goes, so a later process with the same pid is judged afresh.
#[btf_tracepoint(function = "sched_process_exit")]
pub fn sched_process_exit(_ctx: BtfTracePointContext) -> i32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    // Every exiting thread (this runs for each): a call it left noted must not bind another.
    tls::thread_exit(pid_tgid);
    let tgid = (pid_tgid >> 32) as u32;
    if tgid == pid_tgid as u32 {
        if is_target(tgid)
            && let Some(staging) = stage(EventKind::ProcessExit, -1, 0)
        {
            emit(staging, 0);
        }
        // Its verdict goes with it (the agent untraces it too): a later process with the pid is
        // judged afresh, and one the probes marked traced at its fork leaves no stray entry.
        let _ = TARGET_PIDS.remove(tgid);
    }
    0
}

/// In a task returning from the `fork`/`clone` that made it: a new traced process (not a thread:
/// its id is its process id) is reported at once, waking the agent (see
/// [`EventKind::ProcessStart`]).
#[inline(always)]
pub(crate) fn process_started() {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if tgid != pid_tgid as u32 || !is_target(tgid) {
        return;
    }
    emit_at_once(EventKind::ProcessStart);
}

/// `clone` flag: the new task is a thread of the caller's process.
pub(crate) const CLONE_THREAD: u64 = 0x0001_0000;

/// In a traced parent returning from the `fork`/`clone` that made process `child` (not a thread):
/// the child is traced from now on without waiting for the agent (`TARGET_PIDS`, and the target
/// set is no longer complete until the agent rewrites it), which matters where no command-name
/// filter traces it already (`TRACETAP_TARGET_PIDS`, a pod selector), and it is reported (the
/// agent hooks it once whichever of this and [`process_started`] comes first).
#[inline(always)]
pub(crate) fn process_forked(regs: u64, nr: u64, child: u32) {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if !is_target(tgid) {
        return;
    }
    let flags = match nr {
        nr::CLONE => arg(regs, Arg::First),
        // SAFETY: a helper read of user memory (`struct clone_args`, flags first), which faults
        // safely; an unreadable one is taken for a thread.
        nr::CLONE3 => unsafe { bpf_probe_read_user(arg(regs, Arg::First) as *const u64) }.unwrap_or(CLONE_THREAD),
        _ => 0,
    };
    if flags & CLONE_THREAD != 0 {
        return;
    }
    let _ = TARGET_PIDS.insert(child, 1, 0);
    if let Some(set) = TARGET_SET.get_ptr_mut(0) {
        // SAFETY: the array's one value; a racing write by the agent only makes this moot.
        unsafe { (*set).complete = 0 };
    }
    let Some(staging) = stage(EventKind::ProcessStart, -1, 0) else { return };
    staging.header.tgid = child;
    staging.header.tid = child;
    send_at_once(staging);
}

//! Which processes are traced: the agent's selection (`TARGET_PIDS`, and `TARGET_SET` while it is
//! small) and, under a command filter, the probes' own cached verdicts (see [`is_target`]).

use aya_ebpf::{
    helpers::bpf_get_current_comm,
    macros::map,
    maps::{Array, LruHashMap},
};
use tracetap_ebpf_common::{COMM_BYTES, MAX_PROCESS_VERDICTS, TargetSet};

use crate::TARGET_COMM;

/// Processes (tgid) and whether to trace them (1) or not (0). The agent's discovery writes 1 for
/// the processes it selected and removes them when they go; with a command filter the probes add
/// their own verdicts (see [`is_target`]). LRU, so cached verdicts of short-lived processes never
/// fill it; the agent's entries are the busiest and stay.
#[map]
pub(crate) static TARGET_PIDS: LruHashMap<u32, u8> = LruHashMap::with_max_entries(MAX_PROCESS_VERDICTS, 0);

/// The traced processes when they are few (see [`TargetSet`]): the fast path of [`is_target`].
#[map]
pub(crate) static TARGET_SET: Array<TargetSet> = Array::with_max_entries(1, 0);

/// Whether the current process is traced: the few traced processes are found in `TARGET_SET`;
/// otherwise one lookup in `TARGET_PIDS`. With a command filter, a process seen for the first time has its name
/// compared once and the verdict cached (`0`: not traced), so that other processes do not pay a
/// name read per call. `sched_process_exec` refreshes a cached verdict (a new program, a new
/// name) and `sched_process_exit` forgets it, so a reused pid starts over.
#[inline(always)]
pub(crate) fn is_target(tgid: u32) -> bool {
    // An array lookup the JIT inlines, then at most eight compares.
    if let Some(set) = TARGET_SET.get(0) {
        for slot in set.tgids {
            if slot == tgid {
                return true;
            }
        }
        if set.complete != 0 {
            return false;
        }
    }
    // SAFETY: read-only lookup of a plain value.
    if let Some(verdict) = unsafe { TARGET_PIDS.get(tgid) } {
        return *verdict != 0;
    }
    let Some(verdict) = comm_verdict() else { return false };
    // NOEXIST: never overwrite what the agent wrote meanwhile.
    let _ = TARGET_PIDS.insert(tgid, u8::from(verdict), BPF_NOEXIST);
    verdict
}

/// Whether the current task's command name is the one traced; `None` without a command filter.
#[inline(always)]
pub(crate) fn comm_verdict() -> Option<bool> {
    // SAFETY: the agent writes this global before load; it is constant afterwards.
    let want: [u8; COMM_BYTES] = unsafe { core::ptr::read_volatile(&raw const TARGET_COMM) };
    if want[0] == 0 {
        return None;
    }
    Some(bpf_get_current_comm().is_ok_and(|comm| comm == want))
}

/// `bpf_map_update_elem` flag: only create.
pub(crate) const BPF_NOEXIST: u64 = 1;

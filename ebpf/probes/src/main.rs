//! tracetap's kernel side: a BTF tracepoint (`tp_btf`) on `sys_exit` (and one on `sys_enter` for
//! `close`) that copies what a target process read from and wrote to its sockets into one BPF
//! ring buffer.
//!
//! How a call flows:
//! - `sys_exit` runs at the exit of every syscall of every process (`sys_enter` only reports
//!   `close`, see there). It loads the syscall number from the saved user registers (`pt_regs`,
//!   which still hold the arguments at exit; a plain load, see [`reg`]) and stops at once for
//!   syscalls it does not follow.
//! - For the syscalls it follows it asks [`is_target`] (one hash lookup; a process seen for the
//!   first time under a command filter has its name compared once); non-targets stop there.
//! - For a target it emits a record: an `EventHeader` followed by the first `CAPTURE_BYTES` bytes
//!   the syscall moved (and the last few, when the window cut them).
//! - Records are staged in a per-CPU buffer and copied into the ring buffer with one
//!   `bpf_ringbuf_output`, sized to what was captured, so a 100-byte read costs 100 bytes of ring.
//!
//! Why one exit probe: a classic syscall tracepoint pair costs a perf record per call and an entry
//! in a hash map between enter and exit; reading the arguments back from `pt_regs` at exit needs
//! neither, which is most of what a traced HAProxy pays.
//!
//! Invariants:
//! - Nothing here blocks or writes to user memory: the probes only read.
//! - Every record that cannot be delivered is counted in `LOSSES` (per CPU), by reason.
//! - Payload lengths are clamped to `STAGING_BYTES` right before each copy (see [`bounded`]), so the
//!   verifier can prove every access stays inside the staging buffer; the logical bound
//!   (`CAPTURE_BYTES`) is applied first.
//! - Syscall numbers and `pt_regs` offsets are those of x86_64.
#![no_std]
#![no_main]

use core::ffi::c_void;

mod tls;

use aya_ebpf::{
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user,
        generated::{bpf_loop, bpf_probe_read_user as raw_probe_read_user, bpf_ringbuf_output},
    },
    macros::{btf_tracepoint, map},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::BtfTracePointContext,
};
use tracetap_ebpf_common::{
    COMM_BYTES, EventHeader, EventKind, LOSS_SLOTS, Loss, MAX_NUMBERED_CONNECTIONS, MAX_PROCESS_VERDICTS,
    SOCKADDR_BYTES, STAGING_BYTES, TAIL_BYTES, TargetSet,
};

/// Payload bytes copied per syscall. Set by the agent at load time.
#[unsafe(no_mangle)]
static CAPTURE_BYTES: u32 = 4096;

/// Command name to trace (NUL padded); all zero means only `TARGET_PIDS` are traced.
#[unsafe(no_mangle)]
static TARGET_COMM: [u8; COMM_BYTES] = [0; COMM_BYTES];

/// Bytes waiting in the ring buffer before a record wakes the agent. Set by the agent at load time.
#[unsafe(no_mangle)]
static WAKEUP_BYTES: u32 = 1024 * 1024;

/// Default ring size; the agent resizes it from `TRACETAP_RING_BYTES` before loading.
const DEFAULT_RING_BYTES: u32 = 8 * 1024 * 1024;

#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(DEFAULT_RING_BYTES, 0);

#[map]
static LOSSES: PerCpuArray<u64> = PerCpuArray::with_max_entries(LOSS_SLOTS, 0);

/// Processes (tgid) and whether to trace them (1) or not (0). The agent's discovery writes 1 for
/// the processes it selected and removes them when they go; with a command filter the probes add
/// their own verdicts (see [`is_target`]). LRU, so cached verdicts of short-lived processes never
/// fill it; the agent's entries are the busiest and stay.
#[map]
static TARGET_PIDS: LruHashMap<u32, u8> = LruHashMap::with_max_entries(MAX_PROCESS_VERDICTS, 0);

/// The traced processes when they are few (see [`TargetSet`]): the fast path of [`is_target`].
#[map]
static TARGET_SET: Array<TargetSet> = Array::with_max_entries(1, 0);

/// Per connection (`tgid << 32 | fd`) seen opened by `accept`/`connect`: when it was opened (its
/// identity, see [`OPAQUE_CONNS`]) and the sequence number of its last record. Numbering happens
/// before delivery, so a record the ring had no room for leaves a gap the agent sees. LRU:
/// connections whose close we never saw (process exit) age out.
#[map]
pub(crate) static CONNS: LruHashMap<u64, ConnState> = LruHashMap::with_max_entries(MAX_NUMBERED_CONNECTIONS, 0);

#[repr(C)]
pub(crate) struct ConnState {
    /// `ts_ns` of the connection's `accept`/`connect` record.
    pub(crate) opened_ns: u64,
    seq: u32,
    /// The `OPAQUE_GENERATION` at which `opaque` was last looked up (0: never).
    checked_generation: u32,
    /// Whether `OPAQUE_CONNS` marked this connection, as of `checked_generation`.
    opaque: u32,
    /// `CONN_*` bits.
    pub(crate) flags: u32,
    /// With `CONN_TLS`: the `SSL *` bound to this connection (see the `tls` module), forgotten
    /// with the connection.
    pub(crate) ssl: u64,
}

/// The connection carries TLS: its socket bytes are ciphertext and not reported; the plaintext
/// comes from the TLS library probes (see the `tls` module).
pub(crate) const CONN_TLS: u32 = 1;
/// The agent was told that the connection carries TLS (its `TlsOpen` record was sent).
pub(crate) const CONN_TLS_ANNOUNCED: u32 = 2;
/// The connection speaks HTTP/2 (its bytes began with the client preface): every byte of its
/// frame headers and header blocks is needed to keep the HPACK state, so its records are copied
/// up to the staging buffer's size whatever the capture window says.
const CONN_H2: u32 = 4;
/// The first record with payload was seen, and `CONN_H2` decided from its first bytes.
pub(crate) const CONN_DECIDED: u32 = 8;

/// Connections whose bytes the agent does not want (they do not speak HTTP/1: TLS, `mode tcp`,
/// tunnels), as `tgid << 32 | fd` to the `ts_ns` of their `accept`/`connect` record. Only the
/// agent writes it, and it never holds more than the map's size (a plain hash map, so nothing is
/// evicted behind the agent's back). A read or write on such a connection is still reported,
/// for its size and sequence number, but without payload. The opening time makes a mark that
/// arrives after the connection closed and its fd was reused (the agent lags the probes) match
/// nothing.
#[map]
static OPAQUE_CONNS: HashMap<u64, u64> = HashMap::with_max_entries(MAX_NUMBERED_CONNECTIONS, 0);

/// 0 while `OPAQUE_CONNS` is empty; otherwise a number the agent changes after every mark it
/// adds. A connection looks the map up only when this differs from what it last saw, so that
/// reads and writes pay no hash lookup in steady state, even while some long-lived connection
/// (a resolver's socket, a WebSocket) stays marked. An array lookup the JIT inlines.
#[map]
static OPAQUE_GENERATION: Array<u32> = Array::with_max_entries(1, 0);

#[inline(always)]
pub(crate) fn conn_key(tgid: u32, fd: i32) -> u64 {
    (u64::from(tgid) << 32) | u64::from(fd as u32)
}

/// Starts numbering a new connection's records; its first record carries 1.
#[inline(always)]
fn open_conn(tgid: u32, fd: i32, opened_ns: u64) -> u32 {
    let state = ConnState { opened_ns, seq: 1, checked_generation: 0, opaque: 0, flags: 0, ssl: 0 };
    // A full table evicts the least recently used entry; insert fails only on memory pressure.
    if CONNS.insert(&conn_key(tgid, fd), &state, 0).is_ok() { 1 } else { 0 }
}

/// Takes the next sequence number of a numbered connection (see `CONNS`).
#[inline(always)]
pub(crate) fn take_seq(state: *mut ConnState) -> u32 {
    // SAFETY: map value pointer; a racing update from another thread on the same fd can only
    // make the agent see a gap that was not one, never hide one.
    unsafe {
        let seq = (*state).seq.wrapping_add(1);
        (*state).seq = seq;
        seq
    }
}

/// The next sequence number of a connection's records (0 for connections not numbered).
#[inline(always)]
fn next_seq(tgid: u32, fd: i32) -> u32 {
    CONNS.get_ptr_mut(&conn_key(tgid, fd)).map_or(0, take_seq)
}

/// What a read or write on a socket gets: nothing (the bytes are TLS ciphertext, whose plaintext
/// the TLS probes report), a header without payload (the agent marked the connection opaque), or
/// a copy of up to `window` bytes.
#[derive(Copy, Clone)]
enum DataPlan {
    Skip,
    HeaderOnly { seq: u32 },
    Copy { seq: u32, window: u64 },
}

/// The plan for a read or write of `ret` bytes at `buf` (its first bytes decide `CONN_H2`, see
/// [`decide_h2`]).
#[inline(always)]
fn plan_data(pid_tgid: u64, tgid: u32, fd: i32, plain_buf: Option<u64>, ret: i64) -> DataPlan {
    let key = conn_key(tgid, fd);
    let Some(state) = CONNS.get_ptr_mut(&key) else {
        return DataPlan::Copy { seq: 0, window: capture_window(0) };
    };
    // SAFETY: map value pointer, see `take_seq`.
    let flags = unsafe { (*state).flags };
    if flags & CONN_TLS != 0 || tls::bind(pid_tgid, tgid, fd, state) {
        return DataPlan::Skip;
    }
    let seq = take_seq(state);
    if payload_unwanted(key, state) {
        DataPlan::HeaderOnly { seq }
    } else {
        DataPlan::Copy { seq, window: capture_window(decide_h2(state, plain_buf, ret)) }
    }
}

/// [`payload_unwanted`] for a connection known by its `tgid` and `fd`.
#[inline(always)]
pub(crate) fn payload_unwanted_at(tgid: u32, fd: i32, state: *mut ConnState) -> bool {
    payload_unwanted(conn_key(tgid, fd), state)
}

/// How many bytes of a record to copy on a connection with these `CONN_*` flags.
#[inline(always)]
pub(crate) fn capture_window(flags: u32) -> u64 {
    if flags & CONN_H2 != 0 {
        return STAGING_BYTES as u64;
    }
    // SAFETY: the agent writes this global before load.
    u64::from(unsafe { core::ptr::read_volatile(&raw const CAPTURE_BYTES) })
}

/// The HTTP/2 client preface starts with these bytes (`PRI `, little endian); no HTTP/1 request
/// does.
const H2_PREFACE_START: u32 = u32::from_le_bytes(*b"PRI ");

/// On a connection's first record with payload (`ret` bytes at `buf`, a plain buffer; `None`
/// for vectored calls, which `HAProxy` does not start connections with), decides `CONN_H2` from
/// its first bytes: one 4-byte read per connection, before the window of that very record is
/// chosen, so that the preface's flight is copied whole too. Returns the connection's flags.
#[inline(always)]
pub(crate) fn decide_h2(state: *mut ConnState, buf: Option<u64>, ret: i64) -> u32 {
    // SAFETY: map value pointer, see `take_seq`.
    let flags = unsafe { (*state).flags };
    if flags & CONN_DECIDED != 0 || ret <= 0 {
        return flags;
    }
    let mut decided = flags | CONN_DECIDED;
    if ret >= 4
        && let Some(buf) = buf
        // SAFETY: a helper read of user memory, which faults safely.
        && unsafe { bpf_probe_read_user(buf as *const u32) }.is_ok_and(|first| first == H2_PREFACE_START)
    {
        decided |= CONN_H2;
    }
    // SAFETY: as above.
    unsafe { (*state).flags = decided };
    decided
}

#[inline(always)]
fn payload_unwanted(key: u64, state: *mut ConnState) -> bool {
    let generation = OPAQUE_GENERATION.get(0).map_or(0, |g| *g);
    if generation == 0 {
        return false;
    }
    // SAFETY: map value pointer, see `take_seq`; a stale cache only costs a lookup or a copy.
    unsafe {
        if (*state).checked_generation != generation {
            // SAFETY: read-only lookup of a plain value.
            let marked = OPAQUE_CONNS.get(&key).is_some_and(|opened| *opened == (*state).opened_ns);
            (*state).opaque = u32::from(marked);
            (*state).checked_generation = generation;
        }
        (*state).opaque != 0
    }
}

/// Drops the agent's opaque mark of a connection the TLS probes just bound: the mark came from its
/// handshake's ciphertext (see `tls::bind`), and its plaintext is wanted from the first record.
/// Should the connection be opaque for another reason, the agent marks it again.
#[inline(always)]
pub(crate) fn drop_opaque_mark(tgid: u32, fd: i32, state: *mut ConnState) {
    if payload_unwanted_at(tgid, fd, state) {
        let _ = OPAQUE_CONNS.remove(&conn_key(tgid, fd));
        // SAFETY: map value pointer, see `take_seq`; the cached verdict follows the map.
        unsafe { (*state).opaque = 0 };
    }
}

/// A record being built: header, then payload.
#[repr(C)]
struct Staging {
    header: EventHeader,
    data: [u8; STAGING_BYTES],
}

#[map]
static STAGING: PerCpuArray<Staging> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
pub(crate) fn count_loss(loss: Loss) {
    if let Some(slot) = LOSSES.get_ptr_mut(loss as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU while the program runs.
        unsafe { *slot += 1 };
    }
}

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
    if let Some(verdict) = unsafe { TARGET_PIDS.get(&tgid) } {
        return *verdict != 0;
    }
    let Some(verdict) = comm_verdict() else { return false };
    // NOEXIST: never overwrite what the agent wrote meanwhile.
    let _ = TARGET_PIDS.insert(&tgid, &u8::from(verdict), BPF_NOEXIST);
    verdict
}

/// Whether the current task's command name is the one traced; `None` without a command filter.
#[inline(always)]
fn comm_verdict() -> Option<bool> {
    // SAFETY: the agent writes this global before load; it is constant afterwards.
    let want: [u8; COMM_BYTES] = unsafe { core::ptr::read_volatile(&raw const TARGET_COMM) };
    if want[0] == 0 {
        return None;
    }
    Some(bpf_get_current_comm().is_ok_and(|comm| comm == want))
}

/// `bpf_map_update_elem` flag: only create.
const BPF_NOEXIST: u64 = 1;

/// A process replaced its program: with a command filter, its cached verdict is redone from the
/// new name (HAProxy's master re-executes itself on reload, keeping its pid).
#[btf_tracepoint(function = "sched_process_exec")]
pub fn sched_process_exec(_ctx: BtfTracePointContext) -> i32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if let Some(verdict) = comm_verdict() {
        let _ = TARGET_PIDS.insert(&tgid, &u8::from(verdict), 0);
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
        let _ = TARGET_PIDS.remove(&tgid);
    }
    0
}

/// In a task returning from the `fork`/`clone` that made it: a new traced process (not a thread:
/// its id is its process id) is reported at once, waking the agent (see
/// [`EventKind::ProcessStart`]).
#[inline(always)]
fn process_started() {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if tgid != pid_tgid as u32 || !is_target(tgid) {
        return;
    }
    emit_at_once(EventKind::ProcessStart);
}

/// `clone` flag: the new task is a thread of the caller's process.
const CLONE_THREAD: u64 = 0x0001_0000;

/// In a traced parent returning from the `fork`/`clone` that made process `child` (not a thread):
/// the child is traced from now on without waiting for the agent (`TARGET_PIDS`, and the target
/// set is no longer complete until the agent rewrites it), which matters where no command-name
/// filter traces it already (`TRACETAP_TARGET_PIDS`, a pod selector), and it is reported (the
/// agent hooks it once whichever of this and [`process_started`] comes first).
#[inline(always)]
fn process_forked(regs: u64, nr: u64, child: u32) {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if !is_target(tgid) {
        return;
    }
    let flags = match nr {
        nr::CLONE => reg(regs, PT_REGS_DI),
        // SAFETY: a helper read of user memory (`struct clone_args`, flags first), which faults
        // safely; an unreadable one is taken for a thread.
        nr::CLONE3 => unsafe { bpf_probe_read_user(reg(regs, PT_REGS_DI) as *const u64) }.unwrap_or(CLONE_THREAD),
        _ => 0,
    };
    if flags & CLONE_THREAD != 0 {
        return;
    }
    let _ = TARGET_PIDS.insert(&child, &1, 0);
    if let Some(set) = TARGET_SET.get_ptr_mut(0) {
        // SAFETY: the array's one value; a racing write by the agent only makes this moot.
        unsafe { (*set).complete = 0 };
    }
    let Some(staging) = stage(EventKind::ProcessStart, -1, 0) else { return };
    staging.header.tgid = child;
    staging.header.tid = child;
    send_at_once(staging);
}

/// Emits a record of `kind` for the current process, without payload, and wakes the agent.
#[inline(always)]
fn emit_at_once(kind: EventKind) {
    if let Some(staging) = stage(kind, -1, 0) {
        send_at_once(staging);
    }
}

/// Sends the header of `staging`, waking the agent.
#[inline(always)]
fn send_at_once(staging: &mut Staging) {
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
fn fill_header(header: &mut EventHeader, kind: EventKind, fd: i32, ret: i64) {
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
fn bounded(len: u64) -> u64 {
    let len = core::hint::black_box(len);
    if len > STAGING_BYTES as u64 { STAGING_BYTES as u64 } else { len }
}

/// `bpf_ringbuf_query` flag: bytes waiting to be consumed.
const BPF_RB_AVAIL_DATA: u64 = 0;
/// `bpf_ringbuf_output` flags.
const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;

/// Bumped for every record the ring had no room for (see `EventHeader::loss_epoch`). Two CPUs
/// losing at once may bump it once: it only has to change. A global (direct access, no lookup
/// branch) keeps the verifier's work per record path small.
#[unsafe(no_mangle)]
static mut LOSS_EPOCH: u32 = 0;

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
fn wakeup_flags(before: u64, after: u64) -> u64 {
    // SAFETY: the agent writes this global before load.
    let threshold = u64::from(unsafe { core::ptr::read_volatile(&raw const WAKEUP_BYTES) });
    if before < threshold && after >= threshold { BPF_RB_FORCE_WAKEUP } else { BPF_RB_NO_WAKEUP }
}

/// Counts a record the ring had no room for, and moves the loss epoch on.
#[inline(always)]
fn ring_full() {
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
const SMALL_PAYLOAD: usize = 512;

/// A ring record reserved in place (see [`SMALL_PAYLOAD`]); the agent reads `captured` bytes.
#[repr(C)]
struct SmallRecord {
    header: EventHeader,
    data: [u8; SMALL_PAYLOAD],
}

/// Emits a plain read or write of `len` bytes (`0 < len <= SMALL_PAYLOAD`, and within the
/// capture window) at `buf`, copied straight into the ring.
#[inline(always)]
fn emit_small(kind: EventKind, fd: i32, ret: i64, seq: u32, buf: u64, len: u64) {
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

#[inline(always)]
fn iovec_at(iov: u64, ret: u64) -> Option<(u64, u64)> {
    // struct iovec { void *iov_base; size_t iov_len; }
    // SAFETY: helper reads of user memory.
    let base = unsafe { bpf_probe_read_user(iov as *const u64) }.ok()?;
    let len = unsafe { bpf_probe_read_user((iov + 8) as *const u64) }.ok()?;
    Some((base, if len < ret { len } else { ret }))
}

/// x86_64 syscall numbers of the calls we follow.
mod nr {
    pub const READ: u64 = 0;
    pub const WRITE: u64 = 1;
    pub const CLOSE: u64 = 3;
    pub const READV: u64 = 19;
    pub const WRITEV: u64 = 20;
    pub const CONNECT: u64 = 42;
    pub const ACCEPT: u64 = 43;
    pub const SENDTO: u64 = 44;
    pub const RECVFROM: u64 = 45;
    pub const SENDMSG: u64 = 46;
    pub const RECVMSG: u64 = 47;
    pub const SPLICE: u64 = 275;
    pub const ACCEPT4: u64 = 288;
    pub const CLONE: u64 = 56;
    pub const FORK: u64 = 57;
    pub const VFORK: u64 = 58;
    pub const CLONE3: u64 = 435;
}

/// Offset of `dx` in `struct pt_regs` (x86_64).
const PT_REGS_DX: usize = 96;
/// Offset of `r10` (the fourth syscall argument) in `struct pt_regs` (x86_64).
const PT_REGS_R10: usize = 56;
/// `recv` flag: look at the data without taking it (HAProxy peeks at a PROXY protocol header).
const MSG_PEEK: u64 = 2;
const EINPROGRESS: i64 = 115;

/// Offset of `orig_ax` (the syscall number) in `struct pt_regs` (x86_64).
const PT_REGS_ORIG_AX: usize = 120;
/// Offsets of `si` and `di` (the second and first syscall arguments) in `struct pt_regs`.
const PT_REGS_SI: usize = 104;
const PT_REGS_DI: usize = 112;

/// Reads a saved register. `regs` is the BTF-typed `struct pt_regs *` of a `tp_btf` program, so
/// this is a plain load the verifier checks against the kernel's BTF (and that faults safely),
/// not a helper call: the cheapest way to learn the syscall number on every syscall exit.
#[inline(always)]
fn reg(regs: u64, offset: usize) -> u64 {
    // SAFETY: see above; the offsets are those of x86_64's `struct pt_regs`.
    unsafe { core::ptr::read_volatile((regs as usize + offset) as *const u64) }
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
const MAX_IOVECS: u64 = 8;
/// Later segments of a vectored call are copied only while fewer bytes than this were taken, and
/// at most this many each: offset and length then each stay below it, which the verifier can see,
/// so every copy stays inside the staging buffer (`2 * SEGMENT_BYTES == STAGING_BYTES`).
const SEGMENT_BYTES: u64 = STAGING_BYTES as u64 / 2;

/// Where the buffers of a data call are: `(array of struct iovec, count)`, or one plain buffer.
#[inline(always)]
fn iovecs(shape: BufShape, buf: u64, count: u64) -> Option<(u64, u64)> {
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

#[btf_tracepoint(function = "sys_exit")]
pub fn sys_exit(ctx: BtfTracePointContext) -> i32 {
    // TP_PROTO(struct pt_regs *regs, long ret)
    let regs: u64 = ctx.arg(0);
    let ret: i64 = ctx.arg(1);
    let nr = reg(regs, PT_REGS_ORIG_AX);
    let (kind, shape) = match nr {
        nr::READ | nr::RECVFROM => (EventKind::Read, BufShape::Plain),
        nr::READV => (EventKind::Read, BufShape::Iovec),
        nr::RECVMSG => (EventKind::Read, BufShape::Msghdr),
        nr::WRITE | nr::SENDTO => (EventKind::Write, BufShape::Plain),
        nr::WRITEV => (EventKind::Write, BufShape::Iovec),
        nr::SENDMSG => (EventKind::Write, BufShape::Msghdr),
        nr::ACCEPT | nr::ACCEPT4 => (EventKind::Accept, BufShape::Plain),
        nr::CONNECT => (EventKind::Connect, BufShape::Plain),
        nr::SPLICE => (EventKind::Read, BufShape::Plain),
        nr::CLONE | nr::CLONE3 | nr::FORK | nr::VFORK => {
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
        nr::RECVMSG => reg(regs, PT_REGS_DX),
        nr::RECVFROM => reg(regs, PT_REGS_R10),
        _ => 0,
    };
    if recv_flags & MSG_PEEK != 0 {
        return 0;
    }
    let fd = reg(regs, PT_REGS_DI) as i32;
    if broken {
        emit_broken(kind, tgid, fd, ret);
        return 0;
    }
    let (si, dx) = (reg(regs, PT_REGS_SI), reg(regs, PT_REGS_DX));
    match kind {
        EventKind::Accept => {
            // `fd` is the new connection; `ret` carries the listening fd for the bind address.
            let Some(staging) = stage(EventKind::Accept, ret as i32, i64::from(fd)) else { return 0 };
            staging.header.seq = open_conn(tgid, ret as i32, staging.header.ts_ns);
            read_addr(staging, si);
            emit(staging, 0);
        }
        EventKind::Connect => {
            let Some(staging) = stage(EventKind::Connect, fd, 0) else { return 0 };
            staging.header.seq = open_conn(tgid, fd, staging.header.ts_ns);
            read_addr(staging, si);
            emit(staging, 0);
        }
        EventKind::Close
        | EventKind::TlsOpen
        | EventKind::ProcessStart
        | EventKind::ProcessExit
        | EventKind::ProcessExec => {}
        EventKind::Read | EventKind::Write if nr == nr::SPLICE => {
            // splice(fd_in, off_in, fd_out, ...): bytes moved in the kernel (HAProxy's
            // `option splice-*`); the process read them from one fd and wrote them to the other
            // without seeing them.
            if ret > 0 {
                for (kind, fd) in [(EventKind::Read, fd), (EventKind::Write, dx as i32)] {
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
            let plain_buf = if shape == BufShape::Plain { Some(si) } else { None };
            match plan_data(pid_tgid, tgid, fd, plain_buf, ret) {
                DataPlan::Skip => {}
                DataPlan::HeaderOnly { seq } => emit_header_only(kind, fd, ret, seq),
                DataPlan::Copy { seq, window } => emit_data(kind, fd, ret, seq, shape, si, dx, window),
            }
        }
    }
    0
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

/// Errors of a read or write that say the peer is gone (`ECONNRESET`, `EPIPE`, `ETIMEDOUT`).
#[inline(always)]
fn peer_gone(ret: i64) -> bool {
    matches!(-ret, 104 | 32 | 110)
}

/// Reports a read or write that failed with `ret` (see [`peer_gone`]) on a numbered connection,
/// in its sequence and without payload. Connections not numbered are left out: nothing ties the
/// failure to an exchange there.
#[inline(always)]
fn emit_broken(kind: EventKind, tgid: u32, fd: i32, ret: i64) {
    let Some(state) = CONNS.get_ptr_mut(&conn_key(tgid, fd)) else { return };
    let seq = take_seq(state);
    emit_header_only(kind, fd, ret, seq);
}

/// Emits a read or write without payload (a connection the agent marked opaque).
#[inline(always)]
pub(crate) fn emit_header_only(kind: EventKind, fd: i32, ret: i64, seq: u32) {
    let Some(staging) = stage(kind, fd, ret) else { return };
    staging.header.seq = seq;
    emit(staging, 0);
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
    let fd = reg(ctx.arg(0), PT_REGS_DI) as i32;
    if let Some(staging) = stage(EventKind::Close, fd, 0) {
        let key = conn_key(tgid, fd);
        staging.header.seq = match CONNS.get_ptr_mut(&key) {
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
        let _ = CONNS.remove(&key);
        emit(staging, 0);
    }
    0
}

/// Copies the first `window` bytes of the call's bytes (across the `iovec`s of a vectored call,
/// see [`SEGMENT_BYTES`]), and the last `TAIL_BYTES` of the whole call when the window cut them.
/// Returns how many bytes follow the header.
#[inline(always)]
fn copy_payload(staging: &mut Staging, shape: BufShape, buf: u64, count: u64, ret: u64, window: u64) -> u64 {
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
struct IovecWalk {
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
fn copy_segment(staging: &mut Staging, offset: u64, from: u64, len: u64) -> u64 {
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
        raw_probe_read_user(
            staging.data.as_mut_ptr().add(offset as usize).cast(),
            len as u32,
            from as *const core::ffi::c_void,
        )
    };
    if rc == 0 {
        len
    } else {
        count_loss(Loss::ReadFailed);
        0
    }
}

#[inline(always)]
fn copy_tail(staging: &mut Staging, from: u64) {
    // SAFETY: helper read of user memory into a fixed-size field.
    if let Ok(tail) = unsafe { bpf_probe_read_user(from as *const [u8; TAIL_BYTES]) } {
        staging.header.tail = tail;
        staging.header.tail_len = TAIL_BYTES as u32;
    }
}

/// The floor of `make bench`: the same hooks with nothing done, so that a measurement can tell
/// what the hooks cost from what the work in them costs (`TRACETAP_PROBE_MODE=floor`).
#[btf_tracepoint(function = "sys_exit")]
pub fn sys_exit_floor(_ctx: BtfTracePointContext) -> i32 {
    0
}

/// See [`sys_exit_floor`].
#[btf_tracepoint(function = "sys_enter")]
pub fn sys_enter_floor(_ctx: BtfTracePointContext) -> i32 {
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";

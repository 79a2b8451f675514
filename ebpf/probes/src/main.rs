//! tracetap's kernel side: a BTF tracepoint (`tp_btf`) on `sys_exit` (and one on `sys_enter` for
//! `close`) that copies what a target process read from and wrote to its sockets into one BPF
//! ring buffer.
//!
//! How a call flows:
//! - `sys_exit` runs at the exit of every syscall of every process (`sys_enter` only reports
//!   `close`, see there). It loads the syscall number from the saved user registers (`pt_regs`,
//!   which still hold the arguments at exit; a plain load, see [`arch::syscall_nr`]) and stops at once for
//!   syscalls it does not follow.
//! - For the syscalls it follows it asks [`targets::is_target`] (one hash lookup; a process seen for the
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
//! - Payload lengths are clamped to `STAGING_BYTES` right before each copy (see [`ring::bounded`]), so the
//!   verifier can prove every access stays inside the staging buffer; the logical bound
//!   (`CAPTURE_BYTES`) is applied first.
//! - Syscall numbers and `pt_regs` offsets are those of the architecture the agent is built for
//!   (`x86_64` or `aarch64`, `bpf_target_arch`), all in `arch`.
//!
//! Modules, one job each: `syscalls` (the two syscall hooks), `process` (process start, exec and
//! exit), `targets` (which processes are traced), `conns` (per connection state: numbering, opaque
//! marks, TLS and HTTP/2 flags), `payload` (copying a call's bytes), `head` (frontend request heads dropped in the probe), `ring` (staging, the ring
//! buffer, losses, wake-ups), `arch` (each architecture's syscall numbers and registers), `tls` (the TLS
//! library's uprobes). The globals the agent sets at load time stay here.
#![no_std]
#![no_main]
// The workspace lints apply here too (ebpf/probes/Cargo.toml), with two exceptions of BPF's own.
#![expect(
    clippy::inline_always,
    reason = "every helper is inlined on purpose: BPF-to-BPF calls cost the verifier more states and limit the stack, and a \
              call the compiler chose not to inline may not verify"
)]
#![expect(
    clippy::needless_pass_by_value,
    reason = "a program's context is passed by value: that is the signature aya's program macros expect"
)]

mod arch;
mod conns;
mod head;
mod payload;
mod process;
mod ring;
mod syscalls;
mod targets;
mod tls;

use aya_ebpf::{macros::btf_tracepoint, programs::BtfTracePointContext};
use tracetap_ebpf_common::COMM_BYTES;

/// Payload bytes copied per syscall. Set by the agent at load time.
#[unsafe(no_mangle)]
static CAPTURE_BYTES: u32 = 4096;

/// Command name to trace (NUL padded); all zero means only `TARGET_PIDS` are traced.
#[unsafe(no_mangle)]
static TARGET_COMM: [u8; COMM_BYTES] = [0; COMM_BYTES];

/// Bytes waiting in the ring buffer before a record wakes the agent. Set by the agent at load time.
#[unsafe(no_mangle)]
static WAKEUP_BYTES: u32 = 1024 * 1024;

/// Which frontend requests are dropped at their head (`head_drop::RULE_*`; none by default). Set
/// by the agent at load time, from its sampler.
#[unsafe(no_mangle)]
static DROP_RULE: u32 = 0;

/// The rejection threshold of `head_drop::RULE_TRACE_ID_BELOW`. Set by the agent at load time.
#[unsafe(no_mangle)]
static DROP_THRESHOLD: u64 = 0;

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

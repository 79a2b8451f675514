//! Wire types shared by the kernel probes (`tracetap-ebpf`) and the agent.
//!
//! Invariants:
//! - Every type is `#[repr(C)]`, has no padding the compiler could fill with garbage that the
//!   other side reads, and has an alignment of at most 8 (a ring buffer record is 8-aligned).
//! - A ring buffer record is an [`EventHeader`] immediately followed by `header.captured` bytes
//!   of payload (`captured <= MAX_CAPTURE_BYTES`). Only data events carry payload.
//! - `ret` is what the syscall returned for data events: the byte count (which may exceed
//!   `captured`: only the first bytes are copied). For accepts, `fd` is the new connection and
//!   `ret` the listening socket it came from.
//! - `seq` numbers the records of one connection (`tgid`, `fd`) from 1 at its `accept`/`connect`,
//!   counting records that could not be delivered too, so the agent sees every gap. It is 0 for
//!   descriptors the probes did not see open (older than the probes, or not sockets).
//! - A read or write on a connection the agent marked as opaque (`OPAQUE_CONNS`) carries no
//!   payload (`captured == 0`) whatever `ret` says.
//! - A `Read`/`Write` record with a negative `ret` is a call that failed because the peer was
//!   gone (`-ECONNRESET`, `-EPIPE`, `-ETIMEDOUT`): no payload, numbered like the rest. Other
//!   failed calls (`EAGAIN` above all) are not reported.
//! - On a TLS connection, after its [`EventKind::TlsOpen`] record, `Read`/`Write` records carry
//!   the plaintext the process got from or gave to its TLS library; its socket bytes (the
//!   ciphertext) are not reported. Those records are numbered in the connection's sequence too.
#![no_std]

pub mod head_drop;
mod line_starts;
pub mod plaintext;
mod swar;
#[cfg(test)]
mod test_heads;

/// Largest capture window a user may configure (`TRACETAP_CAPTURE_BYTES`).
pub const MAX_CAPTURE_BYTES: u32 = 16 * 1024;
/// Size of the per-CPU staging buffer for payload (a per-CPU map value may not exceed 32 KiB).
pub const STAGING_BYTES: usize = MAX_CAPTURE_BYTES as usize;
/// Size of the copied socket address: `sizeof(struct sockaddr_in6)`.
pub const SOCKADDR_BYTES: usize = 28;
/// Connections whose records the probes number (`CONNS`); the least recently used are forgotten
/// beyond this, and their records then carry `seq == 0`.
pub const MAX_NUMBERED_CONNECTIONS: u32 = 65_536;
/// Processes whose verdict (traced or not) the probes keep (`TARGET_PIDS`, LRU).
pub const MAX_PROCESS_VERDICTS: u32 = 16_384;
/// Bytes copied from the end of a payload that is longer than the capture window.
pub const TAIL_BYTES: usize = 16;
/// Smallest capture window a user may configure.
pub const MIN_CAPTURE_BYTES: u32 = 64;
/// Length of a task command name, including the trailing NUL (`TASK_COMM_LEN`).
pub const COMM_BYTES: usize = 16;
/// Attach-cookie bit of a TLS probe attached for every process that maps its library (the agent's
/// bridge over an `HAProxy` reload, see its `capture/uprobes.rs`), not for one process: the probe
/// then acts only for traced processes. The other bits keep their meaning.
pub const TLS_COOKIE_ANY_PROCESS: u64 = 1 << 63;

/// What a ring buffer record describes.
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// `accept`/`accept4` returned a new connection `fd`; `addr` is the peer and `ret` the
    /// listening socket's fd (so the agent can find the bind address).
    Accept = 1,
    /// `connect` was called on `fd`; `addr` is the destination.
    Connect = 2,
    /// `close(fd)` was called.
    Close = 3,
    /// The process read `ret` bytes from `fd` (`ret == 0` is end of stream).
    Read = 4,
    /// The process wrote `ret` bytes to `fd`.
    Write = 5,
    /// `fd` carries TLS: its later `Read`/`Write` records are plaintext. `ret` is the protocol
    /// version as on the wire (`0x0303`: TLS 1.2, `0x0304`: TLS 1.3), 0 when unknown.
    TlsOpen = 6,
    /// A traced process started: `tgid` is the new process, seen as it returns from the `fork`
    /// or `clone` that made it, before it runs any code of its own. The record wakes the agent at
    /// once, so that the TLS probes reach a new `HAProxy` worker before its first connection.
    ProcessStart = 7,
    /// A traced process ended (its main thread exited): what the agent keeps for it goes at once.
    ProcessExit = 8,
    /// A process replaced its program and is traced with the new one (`HAProxy`'s master
    /// re-executes itself on a reload, then forks new workers): wakes the agent at once, which
    /// readies itself to hook those workers fast (see the agent's `capture/uprobes.rs`).
    ProcessExec = 9,
    /// The process read `ret` bytes from `fd`, a frontend connection, that the probes found to be
    /// one whole request head without a body, which the sampler drops by its own `traceparent`
    /// (see [`head_drop`]): no payload; `addr` holds that context
    /// ([`head_drop::DroppedContext::to_addr`], `addr_len` is [`head_drop::DROPPED_CONTEXT_BYTES`]).
    /// Numbered like the `Read` it stands for.
    DroppedRequest = 10,
}

impl EventKind {
    /// Decodes the raw `kind` field of a header.
    #[must_use]
    pub fn from_raw(raw: u32) -> Option<Self> {
        Some(match raw {
            1 => Self::Accept,
            2 => Self::Connect,
            3 => Self::Close,
            4 => Self::Read,
            5 => Self::Write,
            6 => Self::TlsOpen,
            7 => Self::ProcessStart,
            8 => Self::ProcessExit,
            9 => Self::ProcessExec,
            10 => Self::DroppedRequest,
            _ => return None,
        })
    }
}

/// Fixed part of every ring buffer record.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct EventHeader {
    /// `bpf_ktime_get_ns()` at the syscall exit (monotonic clock).
    pub ts_ns: u64,
    /// What the syscall returned (bytes moved, or the new fd for accepts).
    pub ret: i64,
    pub tgid: u32,
    pub tid: u32,
    pub fd: i32,
    /// An [`EventKind`] as `u32`.
    pub kind: u32,
    /// Number of payload bytes that follow the header.
    pub captured: u32,
    /// Number of valid bytes in `addr` (0 when the syscall carried no address).
    pub addr_len: u32,
    /// Raw `struct sockaddr_in`/`sockaddr_in6` as the process passed or received it.
    pub addr: [u8; SOCKADDR_BYTES],
    /// Number of valid bytes in `tail` (0 unless the payload was cut by the capture window).
    pub tail_len: u32,
    /// The last bytes the syscall moved, when they lie beyond the captured prefix: enough to see
    /// the end of a chunked body (`0\r\n\r\n`) that the prefix does not show.
    pub tail: [u8; TAIL_BYTES],
    /// Position of this record among its connection's records (see the module notes); 0: none.
    pub seq: u32,
    /// How many records the ring had no room for before this one was sent (all CPUs, wrapping):
    /// when it changes, records were lost somewhere, and the agent knows it before it handles any
    /// record sent after the loss.
    pub loss_epoch: u32,
}

impl EventHeader {
    pub const SIZE: usize = size_of::<Self>();
}

/// How many traced processes [`TargetSet`] holds.
pub const TARGET_SLOTS: usize = 8;

/// The traced processes, when there are few (the usual case: an `HAProxy` master and its
/// worker), as the single value of the `TARGET_SET` array. The probes compare the current tgid
/// with each slot, which is cheaper than a hash lookup on every followed syscall. The agent
/// writes it after `TARGET_PIDS`, and it is its only writer.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct TargetSet {
    /// Traced tgids; 0 marks an unused slot (no process has tgid 0).
    pub tgids: [u32; TARGET_SLOTS],
    /// 1 when `tgids` holds every traced process and the probes judge no process by its name:
    /// a tgid not in the slots is then not traced, without a lookup in `TARGET_PIDS`.
    pub complete: u32,
}

/// Indexes into the per-CPU `LOSSES` array: why an event never reached the ring buffer.
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Loss {
    /// The ring buffer had no room for the record.
    RingFull = 0,
    /// Copying the payload or address from user memory failed.
    ReadFailed = 1,
    /// TLS plaintext whose `SSL *` names no live connection the probes numbered (opened before
    /// they were loaded, or closed since).
    TlsUnbound = 2,
}

/// Number of entries in the `LOSSES` array.
pub const LOSS_SLOTS: u32 = 3;

/// Global variables the agent sets before loading the probes (`EbpfLoader::set_global`).
pub mod globals {
    /// `u32`: how many payload bytes to copy per syscall (`TRACETAP_CAPTURE_BYTES`).
    pub const CAPTURE_BYTES: &str = "CAPTURE_BYTES";
    /// `[u8; COMM_BYTES]`: command name to trace; all zero means "pid list only".
    pub const TARGET_COMM: &str = "TARGET_COMM";
    /// `u32`: bytes waiting in the ring buffer before a record wakes the agent up.
    pub const WAKEUP_BYTES: &str = "WAKEUP_BYTES";
    /// `u32`: which frontend requests the probes drop at their head (`head_drop::RULE_*`).
    pub const DROP_RULE: &str = "DROP_RULE";
    /// `u64`: the rejection threshold of `head_drop::RULE_TRACE_ID_BELOW`.
    pub const DROP_THRESHOLD: &str = "DROP_THRESHOLD";
}

/// Names of the maps the agent opens.
pub mod maps {
    pub const EVENTS: &str = "EVENTS";
    pub const LOSSES: &str = "LOSSES";
    pub const TARGET_PIDS: &str = "TARGET_PIDS";
    pub const TARGET_SET: &str = "TARGET_SET";
    pub const CONNS: &str = "CONNS";
    pub const OPAQUE_CONNS: &str = "OPAQUE_CONNS";
    pub const OPAQUE_GENERATION: &str = "OPAQUE_GENERATION";
    pub const TLS_HOOKED: &str = "TLS_HOOKED";
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: plain-old-data, repr(C), every bit pattern is a valid value.
    unsafe impl aya::Pod for super::EventHeader {}
    // SAFETY: plain-old-data, repr(C), every bit pattern is a valid value.
    unsafe impl aya::Pod for super::TargetSet {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_layout_is_stable_and_aligned() {
        assert_eq!(EventHeader::SIZE % 8, 0, "records must keep 8-byte alignment");
        assert_eq!(EventHeader::SIZE, 96);
    }

    // A per-CPU map value may not exceed 32 KiB.
    const _: () = assert!(EventHeader::SIZE + STAGING_BYTES <= 32 * 1024);
}

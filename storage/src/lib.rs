//! tracetap's tail-sampling buffer: recorded spans wait here until their trace is decided, and the
//! decisions are remembered so that late spans follow them, across restarts.
//!
//! # Model
//!
//! A trace is *pending* from its first span until it is decided. Its spans are opaque byte strings
//! (the agent stores encoded OTLP `Span` messages) appended, as *fragments* that also carry the
//! trace's first-seen and root-ended times, to the *partition* the trace was given when its first
//! span arrived. Partitions are time slices of first-seen time, so that every span of a trace lives
//! in one partition and a partition whose traces are all decided and exported is removed whole,
//! never key by key.
//!
//! Appends are grouped: one sled value holds the fragments of many traces (up to
//! [`sled_store::GROUP_BYTES`]), because sled's cost is per insert and grows with the value count
//! of a leaf (measured: 2 spans per insert gave 80 000 spans/s per core, 64 spans per insert
//! 340 000). A pending trace has no record of its own: it is pending because its fragments are in
//! a live partition and it has no decision record; [`TailStore::recover`] derives the pending set
//! from the partitions.
//!
//! A decided trace has one decision record, and every later transition rewrites that one record:
//! decided (kept, not yet exported: the *outbox*) -> decided and exported -> forgotten. sled makes a
//! single-key write atomic cheaply, while its multi-key batches force a synchronous log write each
//! (measured: about 60 µs apiece), so the layout avoids batches altogether.
//!
//! # Invariants (checked by the model test in `tests/model.rs` against [`memory::MemoryStore`])
//!
//! - A trace in a partition is pending, or decided: deciding is one write, so after a crash it is
//!   still pending or it is decided, never neither and never twice. Deciding again replaces the
//!   decision.
//! - A decision is forgotten only after its partition was dropped (else the trace would turn
//!   pending again); the memory model panics on a violation, so the agent's tests catch it.
//! - Spans are returned in the order they were appended, only those of the asked trace, only from
//!   the asked partition and sequence range.
//! - A reopened store holds exactly what was written before it was closed (sled recovers a prefix of
//!   the writes after a crash).
//! - Sequence numbers are never 0 and only grow, across restarts too.
//!
//! # Layout on sled
//!
//! - tree `state`: partition (8 bytes, big endian) + trace id -> decision record (sequence,
//!   outcome, threshold, span range, exported). Recent partitions sort last, so writes stay in a
//!   small, cached part of the tree.
//! - tree `spans/{partition:016x}`: append sequence (8 bytes, big endian) -> fragments, each the
//!   trace id, first-seen and root-ended times and its spans, length-prefixed. Keys only grow, so
//!   appends go to the right edge of the tree. Dropping the partition is `drop_tree`.
#![forbid(unsafe_code)]

pub mod memory;
pub mod sled_store;

pub use memory::MemoryStore;
pub use sled_store::{SledOptions, SledStore};

/// A W3C trace id.
pub type TraceId = [u8; 16];

/// A partition number: first-seen time divided by the partition width.
pub type Partition = u64;

/// Where a trace's spans are: its partition, and the sequence numbers of its first and last append
/// there (a trace usually has one append: its SERVER span with the CLIENT spans under it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpanRange {
    pub partition: Partition,
    pub first: u64,
    pub last: u64,
}

impl SpanRange {
    /// The range of a single append.
    #[must_use]
    pub fn one(partition: Partition, seq: u64) -> Self {
        Self { partition, first: seq, last: seq }
    }

    /// This range grown to hold a later append.
    #[must_use]
    pub fn with(self, seq: u64) -> Self {
        Self { first: self.first.min(seq), last: self.last.max(seq), ..self }
    }
}

/// What the store knows about a trace that is not decided yet, from its fragments: the earliest
/// first-seen time, the latest root end, the range of their appends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingTrace {
    /// Wall-clock time of the trace's first span here, in ns since the Unix epoch (it must survive
    /// a restart, so it is not monotonic time).
    pub first_seen_unix_ns: u64,
    /// When this host's root span of the trace ended, once it has.
    pub root_ended_unix_ns: Option<u64>,
    pub spans: SpanRange,
}

impl PendingTrace {
    /// This trace with one more fragment, appended at `seq` of `partition`.
    #[must_use]
    pub fn merge(this: Option<Self>, partition: Partition, seq: u64, first_seen: u64, root_ended: Option<u64>) -> Self {
        match this {
            None => Self {
                first_seen_unix_ns: first_seen,
                root_ended_unix_ns: root_ended,
                spans: SpanRange::one(partition, seq),
            },
            Some(p) => Self {
                first_seen_unix_ns: p.first_seen_unix_ns.min(first_seen),
                root_ended_unix_ns: p.root_ended_unix_ns.max(root_ended),
                spans: p.spans.with(seq),
            },
        }
    }
}

/// How a trace was decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Exported with this consistent-sampling rejection threshold (56 bits) in its `tracestate`.
    Kept {
        threshold: u64,
    },
    Dropped,
}

/// A trace's decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecisionRecord {
    /// Grows with every decision, across restarts.
    pub seq: u64,
    pub trace: TraceId,
    pub partition: Partition,
    pub outcome: Outcome,
}

/// A kept trace whose spans were not yet handed to the exporter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutboxEntry {
    pub trace: TraceId,
    pub spans: SpanRange,
    pub threshold: u64,
}

/// Everything a reopened store holds, for the agent to re-arm its timers and caches.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Sorted by partition, then trace id.
    pub pending: Vec<(TraceId, PendingTrace)>,
    /// Sorted by sequence.
    pub decisions: Vec<DecisionRecord>,
    /// Sorted by partition, then trace id.
    pub outbox: Vec<OutboxEntry>,
    /// Every partition that holds spans, ascending.
    pub partitions: Vec<Partition>,
}

/// Errors of a store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store: {0}")]
    Sled(#[from] sled::Error),
    #[error("store record {what} is corrupt ({len} bytes)")]
    Corrupt { what: &'static str, len: usize },
}

/// Spans of one trace to append, with what the store must remember about the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fragment<'a> {
    pub trace: TraceId,
    /// Wall-clock time of the trace's first span here, in ns since the Unix epoch.
    pub first_seen_unix_ns: u64,
    /// When the trace's root span here ended, if this fragment holds it.
    pub root_ended_unix_ns: Option<u64>,
    pub spans: &'a [&'a [u8]],
}

/// The tail buffer's storage, behind a trait so that the backend can change and so that the agent's
/// engine can be tested against [`MemoryStore`]. Records of a trace are addressed by its partition
/// and trace id, which the agent always knows.
pub trait TailStore {
    /// Appends fragments to a partition; returns the sequence number each landed at (never 0; they
    /// grow with every append, across restarts too).
    fn append(&mut self, partition: Partition, fragments: &[Fragment<'_>]) -> Result<Vec<u64>, StoreError>;

    /// The spans of a trace within a range, in append order.
    fn spans(&self, trace: &TraceId, range: &SpanRange) -> Result<Vec<Vec<u8>>, StoreError>;

    /// Decides a trace in one atomic write: it is no longer pending, the decision is recorded, and a
    /// kept trace enters the outbox. Returns the decision's sequence number.
    fn decide(&mut self, trace: &TraceId, spans: &SpanRange, outcome: Outcome) -> Result<u64, StoreError>;

    /// A kept trace's spans were handed to the exporter: it leaves the outbox.
    fn exported(&mut self, trace: &TraceId, partition: Partition) -> Result<(), StoreError>;

    /// Forgets a decision (the agent bounds its decision cache), outbox entry included; a `seq` that
    /// is no longer the trace's current decision is ignored. Only after `partition` was dropped.
    fn forget_decision(&mut self, trace: &TraceId, partition: Partition, seq: u64) -> Result<(), StoreError>;

    /// Removes a partition and every span in it (decision records stay until forgotten).
    fn drop_partition(&mut self, partition: Partition) -> Result<(), StoreError>;

    /// Reads back everything the store holds (at start, after a restart or a crash); the pending
    /// traces are derived from the partitions.
    fn recover(&self) -> Result<Recovered, StoreError>;

    /// Makes everything written so far durable.
    fn flush(&self) -> Result<(), StoreError>;

    /// Bytes the store occupies on disk (for a memory store: bytes of span data held).
    fn disk_bytes(&self) -> u64;
}

//! tracetap's tail-sampling buffer: recorded spans wait here until their trace is decided, and the
//! decisions are remembered so that late spans follow them, across restarts.
//!
//! # Model
//!
//! A trace is *pending* from its first span until it is decided. Its spans are opaque byte strings
//! (the agent stores encoded OTLP `Span` messages) appended to the *partition* the trace was given
//! when its first span arrived: partitions are time slices of first-seen time, so that every span of
//! a trace lives in one partition and a partition whose traces are all decided and exported is
//! removed whole, never key by key.
//!
//! Each trace has one state record, and every transition rewrites that one record:
//! pending -> decided (kept, not yet exported: the *outbox*) -> decided and exported -> forgotten.
//! sled makes a single-key write atomic cheaply, while its multi-key batches force a synchronous
//! log write each (measured: about 60 µs apiece), so the layout avoids batches altogether.
//!
//! # Invariants (checked by the model test in `tests/model.rs` against [`memory::MemoryStore`])
//!
//! - A trace has at most one state record: pending, or decided. Deciding again replaces the
//!   decision; after a crash a trace is still pending or it is decided, never neither and never twice.
//! - Spans are returned in the order they were appended, only those of the asked trace, only from
//!   the asked partition and sequence range.
//! - A reopened store holds exactly what was written before it was closed (sled recovers a prefix of
//!   the writes after a crash).
//! - Decision sequence numbers only grow, across restarts too.
//!
//! # Layout on sled
//!
//! - tree `state`: partition (8 bytes, big endian) + trace id -> pending record (first seen, root
//!   ended, span range) or decision record (sequence, outcome, threshold, span range, exported).
//!   New traces land in the newest partition, so writes stay in a small, cached part of the tree.
//! - tree `spans/{partition:016x}`: append sequence (8 bytes, big endian) -> trace id + the spans of
//!   one append, each prefixed with its length. Keys only grow, so appends go to the right edge of
//!   the tree (random keys made sled rewrite and re-read whole leaves: 3x slower). A trace's spans
//!   are found from the span range in its record. Dropping the partition is `drop_tree`.
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

/// What the store knows about a trace that is not decided yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingTrace {
    /// Wall-clock time of the trace's first span here, in ns since the Unix epoch (it must survive
    /// a restart, so it is not monotonic time).
    pub first_seen_unix_ns: u64,
    /// When this host's root span of the trace ended, once it has.
    pub root_ended_unix_ns: Option<u64>,
    pub spans: SpanRange,
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

/// The tail buffer's storage, behind a trait so that the backend can change and so that the agent's
/// engine can be tested against [`MemoryStore`]. Records of a trace are addressed by its partition
/// and trace id, which the agent always knows.
pub trait TailStore {
    /// Appends spans of a trace to a partition; returns the append's sequence number (never 0; it
    /// grows with every append, across restarts too).
    fn append(&mut self, partition: Partition, trace: &TraceId, spans: &[&[u8]]) -> Result<u64, StoreError>;

    /// Records a pending trace, or updates it (more spans, root span ended). Written after the
    /// spans it points at, so a recovered pending trace always finds them.
    fn put_pending(&mut self, trace: &TraceId, pending: &PendingTrace) -> Result<(), StoreError>;

    /// The spans of a trace within a range, in append order.
    fn spans(&self, trace: &TraceId, range: &SpanRange) -> Result<Vec<Vec<u8>>, StoreError>;

    /// Decides a trace in one atomic write: it is no longer pending, the decision is recorded, and a
    /// kept trace enters the outbox. Returns the decision's sequence number.
    fn decide(&mut self, trace: &TraceId, spans: &SpanRange, outcome: Outcome) -> Result<u64, StoreError>;

    /// A kept trace's spans were handed to the exporter: it leaves the outbox.
    fn exported(&mut self, trace: &TraceId, partition: Partition) -> Result<(), StoreError>;

    /// Forgets a decision (the agent bounds its decision cache), outbox entry included; a `seq` that
    /// is no longer the trace's current decision is ignored.
    fn forget_decision(&mut self, trace: &TraceId, partition: Partition, seq: u64) -> Result<(), StoreError>;

    /// Removes a partition and every span in it (trace records stay until decided and forgotten).
    fn drop_partition(&mut self, partition: Partition) -> Result<(), StoreError>;

    /// Reads back everything the store holds (at start, after a restart or a crash).
    fn recover(&self) -> Result<Recovered, StoreError>;

    /// Makes everything written so far durable.
    fn flush(&self) -> Result<(), StoreError>;

    /// Bytes the store occupies on disk (for a memory store: bytes of span data held).
    fn disk_bytes(&self) -> u64;
}

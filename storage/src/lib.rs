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
//! a live partition and no decision record covers them; [`TailStore::recover`] derives the pending
//! set from the partitions.
//!
//! Decisions are logged in batches: [`TailStore::decide`] records a decision in memory and
//! [`TailStore::commit`] (every tick of the agent) writes all of them as one value, because a sled
//! insert per decided trace cost more than the rest of the tail stage together (measured: 6 to 8 µs
//! per span with an insert per decision, 2.4 to 3 without). A decision that was not committed when
//! the agent died is simply made again after the restart, from the same spans: the agent commits
//! and flushes before any kept trace goes to the exporter, so nothing that left the agent is ever
//! decided twice. A kept decision stays in the *outbox* until its trace's exported marker (a read
//! and a small write per kept decision) reaches it: the marker holds the latest decision reported
//! exported, so the agent must report a trace's kept decisions in the order they were made (it
//! sends them in that order, the restart's outbox first). Multi-key `sled::Batch`es are avoided:
//! each forces a synchronous log write (measured: about 60 µs).

//! # Invariants (checked by the model test in `tests/model.rs` against [`memory::MemoryStore`])
//!
//! - A fragment is decided when a decision of its trace in its partition covers it (the
//!   decision's span range holds its append; a decision's range holds the appends it decided and
//!   no other), and pending otherwise: a part of a trace appended before another part's decision
//!   but decided after it (it follows that decision) is pending again if a crash comes in between,
//!   never taken for decided. A trace may have several decisions in a partition (one per part),
//!   each in the outbox until exported. A committed decision survives a crash, an uncommitted one
//!   is lost whole, never half.
//! - Decisions are forgotten in sequence order, and only once their partitions were dropped (else
//!   the traces would turn pending again); the memory model panics on a violation, so the agent's
//!   tests catch it.
//! - Spans are returned in the order they were appended, only those of the asked trace, only from
//!   the asked partition and sequence range.
//! - A reopened store holds exactly what was written before it was closed (sled recovers a prefix of
//!   the writes after a crash).
//! - Sequence numbers are never 0 and only grow, across restarts too.
//!
//! # Layout on sled
//!
//! - tree `meta`: `format` -> the layout's version (4 bytes, big endian), [`sled_store::FORMAT`].
//!   A store without it was written before versions were recorded, in version 1's layout; one with
//!   another version is refused ([`StoreError::Version`]) rather than misread.
//! - tree `decisions`: batch sequence (8 bytes, big endian) -> the decisions of one commit, each
//!   partition, trace id, sequence, outcome, threshold and span range (57 bytes).
//! - tree `state`: partition (8 bytes, big endian) + trace id -> exported marker of a kept trace
//!   (the sequence of the latest of its decisions exported: every kept decision up to it was).
//! - tree `spans/{partition:016x}`: append sequence (8 bytes, big endian) -> fragments, each the
//!   trace id, first-seen and root-ended times and its spans, length-prefixed. Keys only grow, so
//!   appends go to the right edge of the tree. Dropping the partition is `drop_tree`.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

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

    /// Whether the append at `seq` of this range's partition is in it.
    #[must_use]
    pub fn covers(&self, seq: u64) -> bool {
        (self.first..=self.last.max(self.first)).contains(&seq)
    }
}

/// What the store knows about a run of a trace's appends that no decision covers, from its
/// fragments: the earliest first-seen time, the latest root end, the range of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingTrace {
    /// Wall-clock time of the trace's first span here, in ns since the Unix epoch (it must survive
    /// a restart, so it is not monotonic time).
    pub first_seen_unix_ns: u64,
    /// When this host's root span of the trace ended, once it has (the agent records when the root
    /// span reached it, at or after its end, since its grace runs from there).
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
    /// The appends it decided (its partition, and the range that covers them).
    pub spans: SpanRange,
    pub outcome: Outcome,
}

/// A kept trace whose spans were not yet handed to the exporter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutboxEntry {
    pub trace: TraceId,
    /// The decision it was kept under (what [`TailStore::exported`] names).
    pub seq: u64,
    pub spans: SpanRange,
    pub threshold: u64,
}

impl OutboxEntry {
    /// The outbox entry of a decision, if it kept its trace.
    #[must_use]
    pub fn of(d: &DecisionRecord) -> Option<Self> {
        match d.outcome {
            Outcome::Kept { threshold } => Some(Self { trace: d.trace, seq: d.seq, spans: d.spans, threshold }),
            Outcome::Dropped => None,
        }
    }
}

/// Whether one of a trace's decisions in a partition covers its append at `seq` there.
fn covered(decisions: &[DecisionRecord], seq: u64) -> bool {
    decisions.iter().any(|d| d.spans.covers(seq))
}

/// The pending traces of a recovery, built from a partition's appends in order: each run of a
/// trace's appends that no decision covers is one [`PendingTrace`], so that a pending range never
/// takes in an append a decision covers (reading it back would export or decide it again).
#[derive(Default)]
struct PendingRuns {
    /// Per partition and trace: its runs, and whether a covered append came after the last one.
    runs: BTreeMap<(Partition, TraceId), (Vec<PendingTrace>, bool)>,
}

impl PendingRuns {
    /// The next append (in sequence order within its partition) that holds a fragment of `trace`.
    fn fragment(
        &mut self,
        partition: Partition,
        trace: TraceId,
        seq: u64,
        first_seen: u64,
        root_ended: Option<u64>,
        covered: bool,
    ) {
        let (runs, broken) = self.runs.entry((partition, trace)).or_default();
        if covered {
            *broken = true;
        } else if let (false, Some(run)) = (*broken, runs.last_mut()) {
            *run = PendingTrace::merge(Some(*run), partition, seq, first_seen, root_ended);
        } else {
            runs.push(PendingTrace::merge(None, partition, seq, first_seen, root_ended));
            *broken = false;
        }
    }

    /// By partition, then trace id, then append order.
    fn into_sorted(self) -> Vec<(TraceId, PendingTrace)> {
        self.runs.into_iter().flat_map(|((_, trace), (runs, _))| runs.into_iter().map(move |p| (trace, p))).collect()
    }
}

/// Everything a reopened store holds, for the agent to re-arm its timers and caches.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Sorted by partition, then trace id, then append order: a trace is here once per run of its
    /// appends in a partition that no decision covers (usually once).
    pub pending: Vec<(TraceId, PendingTrace)>,
    /// Every decision, sorted by sequence (a trace may have several in a partition, one per part
    /// decided; the latest counts for parts to come). The agent forgets decisions in sequence
    /// order, once their partitions are gone, so it must know each of them.
    pub decisions: Vec<DecisionRecord>,
    /// Every kept decision whose spans were not reported exported; sorted by partition, then trace
    /// id, then sequence.
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
    #[error("store format {found} is not the one this agent reads ({expected})")]
    Version { found: u32, expected: u32 },
}

impl StoreError {
    /// Whether the error says the store's contents are damaged (a record that does not decode,
    /// another format, sled's own corruption report), as opposed to the system refusing the store
    /// (another process holding its lock, permissions, descriptors: plain I/O errors).
    #[must_use]
    pub fn is_damage(&self) -> bool {
        !matches!(self, Self::Sled(sled::Error::Io(_)))
    }
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

/// A fragment read back from one append ([`TailStore::fragments`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppendedFragment {
    pub trace: TraceId,
    pub first_seen_unix_ns: u64,
    pub root_ended_unix_ns: Option<u64>,
    pub spans: Vec<Vec<u8>>,
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

    /// Every fragment stored under one sequence number of a partition (what one [`TailStore::append`]
    /// call returned it for: the whole call, or the part of it one value holds), in append order;
    /// empty if the partition or the sequence number is gone. One read, whatever the number of
    /// traces: the agent decides traces that went to the store together this way, with no
    /// per-trace index in memory.
    fn fragments(&self, partition: Partition, seq: u64) -> Result<Vec<AppendedFragment>, StoreError>;

    /// Decides the appends of a trace in `spans` (and no other: they are no longer pending); a kept
    /// decision enters the outbox. Returns the decision's sequence number. Held in memory until
    /// [`TailStore::commit`].
    fn decide(&mut self, trace: &TraceId, spans: &SpanRange, outcome: Outcome) -> Result<u64, StoreError>;

    /// Writes the decisions made since the last commit, as one write (durable at the next flush).
    fn commit(&mut self) -> Result<(), StoreError>;

    /// A kept trace's spans were handed to the exporter under decision `seq`: it leaves the outbox,
    /// with every earlier kept decision of the trace in that partition (callers report a trace's
    /// decisions in the order they were made).
    fn exported(&mut self, trace: &TraceId, partition: Partition, seq: u64) -> Result<(), StoreError>;

    /// Forgets every decision up to sequence `up_to` (the agent bounds its decision cache), outbox
    /// entries included. Only for decisions whose partitions were dropped.
    fn forget_decisions(&mut self, up_to: u64) -> Result<(), StoreError>;

    /// Removes a partition and every span in it (decision records stay until forgotten).
    fn drop_partition(&mut self, partition: Partition) -> Result<(), StoreError>;

    /// Reads back everything the store holds (at start, after a restart or a crash); the pending
    /// traces are derived from the partitions.
    fn recover(&self) -> Result<Recovered, StoreError>;

    /// Commits, then makes everything written so far durable.
    fn flush(&mut self) -> Result<(), StoreError>;

    /// Bytes the store occupies on disk (for a memory store: bytes of span data held).
    fn disk_bytes(&self) -> u64;
}

//! The tail engine: waiting traces, their decision times and the partitions, over a [`TailStore`];
//! it uses the rooms beside it for a trace's spans in memory (`span_buf`), the latest decisions
//! (`decision_cache`), the export requests being assembled (`outgoing`) and the write-ahead
//! journal of what waits in memory (`journal`). Single-threaded (owned by the tail thread); time is passed in, so tests
//! drive it with a fake clock and a [`tracetap_storage::MemoryStore`]. See the module note of
//! `tail` for the invariants.
//!
//! Memory first: a trace's spans stay in memory ([`Hot`]) and a trace whose local fragment completes
//! (its root SERVER span arrived `grace` ago) is decided there, never written to the store. The store
//! takes only what must wait: a trace still undecided `spill_after` after its first span, or the
//! oldest hot traces while memory is over `max_memory_bytes`. A spilled trace is *pending* in the
//! store's sense and follows the store's rules (decided once, at least once across crashes). What
//! happens to traces in memory (their spans, decisions, reported exports, moves to the store) is
//! written ahead to the [`Journal`], which a restart replays ([`Engine::take_back`]); their
//! decisions are remembered in memory (and in the journal), those of spilled traces in the store.
//!
//! The pending index is on disk. The engine keeps no entry per trace in the store: traces that
//! went to the store in one append (one sequence number: a spill, or a batch with memory off) form
//! a [`Group`], decided together, from one read of the store ([`TailStore::fragments`]), when the
//! last of them is due. Traces spilled together were first seen close together, so they are due
//! close together; a group's traces are decided at most that spread late. What the store holds
//! about each trace (its times, its spans) is read back at the decision. Memory for 2.5 million
//! waiting traces: about 20 MiB (docs/PERFORMANCE.md), against 285 MiB for a hash map entry and a
//! heap entry per trace. Two things need a trace id in memory, and both are bounded by time, not
//! by how many traces wait:
//! - the *join window* ([`JOIN_WINDOW_NS`]): for a moment after a trace went to the store, a later
//!   fragment of it (another process, the next batch) waits in memory ([`Hot::joins`]) and is
//!   decided with the stored part; later than that, a fragment is a part of its own;
//! - the decision cache: a part decided after another part of its trace follows that decision (it
//!   is counted with the late spans), so a trace is decided once even in parts.
//!
//! Traces recovered from the store after a restart are tracked one by one (`pending`), as they
//! were written: they drain within the decision wait.
//!
//! Span format, in memory and in the store: the process id (4 bytes, big endian: the `process.pid`
//! of its resource), then the OTLP `Span` message, as the capture thread encoded it.
//!
//! One encoding: a span's bytes are copied once, from the capture thread's batch into its trace's
//! buffer ([`SpanBuf`], one allocation per trace, not per span), and from there into an export
//! request (or into the store, and from the store into an export request). What the policies read
//! (times, status) is taken when the batch is parsed, so a decision in memory parses nothing; a
//! kept span whose threshold must rise has its `trace_state` field replaced at the byte level; the
//! export request is assembled around the span bytes ([`crate::encode::write_request`]). Nothing
//! on this path builds a prost message.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::sync::Mutex;

use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use rustc_hash::FxHashMap;
use tracetap_proxy::trace_context::parse_ot_tracestate;
use tracetap_storage::{
    AppendedFragment, Fragment, Outcome, Partition, Recovered, SpanRange, StoreError, TailStore, TraceId,
};

use super::decision_cache::{Cached, DecisionCache};
use super::journal::{self, Held, Journal, Replayed};
use super::outgoing::Outgoing;
pub use super::outgoing::{Delivery, Export};
use super::policy::{PolicySet, SpanFacts, TraceData};
use super::span_buf::SpanBuf;
use super::wheel::Wheel;
use super::wire::{self, WireError};
use crate::metrics::{self, DecisionKey, Metrics};
use crate::sampling::randomness;

/// Resolution of the due times of traces in memory: a trace is decided at the first tick at least
/// its due time rounded up to this.
const HOT_DUE_WIDTH_NS: u64 = 10_000_000;

/// Width of a partition: traces first seen within the same 5 s share one.
const PARTITION_NS: u64 = 5_000_000_000;
/// A trace in memory: its spans, and what decides when it is due.
#[derive(Debug)]
struct Hot {
    first_seen: u64,
    /// When the root span arrived (the later of its end and its arrival: the grace runs from
    /// arrival); 0: it has not (here). Called "root ended" in the store.
    root_ended: u64,
    /// The `rv` of the first span's `tracestate` that has one.
    randomness: Option<u64>,
    spans: SpanBuf,
    /// A later fragment of a trace that went to the store moments before (into this partition):
    /// it waits here to be decided with the stored part ([`Engine::decide_group`]), and is decided
    /// on its own only if that has not happened by the decision wait. It never spills.
    joins: Option<Partition>,
    /// The journal segments its spans are in (`None`: not journaled).
    journal: Option<Held>,
}

impl Hot {
    fn decision_due(&self, limits: &Limits) -> u64 {
        if self.joins.is_some() {
            return self.first_seen.saturating_add(limits.decision_wait_ns);
        }
        limits.decision_due(self.first_seen, self.root_ended)
    }

    fn spill_due(&self, limits: &Limits) -> u64 {
        if self.joins.is_some() {
            return u64::MAX;
        }
        self.first_seen.saturating_add(limits.spill_after_ns)
    }

    /// What the policies read of its spans (taken when they arrived: nothing is parsed).
    fn facts(&self) -> impl Iterator<Item = SpanFacts<'_>> {
        self.spans.entries().map(|(t, record)| SpanFacts {
            start_unix_ns: t.start_unix_ns,
            end_unix_ns: t.end_unix_ns,
            status: t.status,
            span: &record[4..],
        })
    }

    /// When something is next to be done with it: decided, or spilled.
    fn next_due(&self, limits: &Limits) -> u64 {
        self.decision_due(limits).min(self.spill_due(limits))
    }
}

/// What an append the store refused (in part) did not store.
#[derive(Debug)]
struct Refused {
    error: StoreError,
    traces: rustc_hash::FxHashSet<TraceId>,
}

/// Traces that went to the store in one append (one store sequence number of a partition): they
/// are decided together, from one read, when the last of them is due. The engine keeps no entry
/// per stored trace: this, 40 bytes for dozens of traces, is its index of them.
#[derive(Debug, Clone, Copy)]
struct Group {
    /// When the last of its traces is due (each trace's due time as in [`Limits::decision_due`];
    /// traces that go to the store together were first seen close together, so they are due
    /// close together).
    due: u64,
    /// Traces of it not decided yet, and their spans.
    undecided: u32,
    spans_left: u32,
    /// Fragments of it already decided, in the store's order: a decision that failed half-way
    /// goes on from there.
    done: u32,
    failures: u8,
}

/// A later fragment of a trace that went to the store within this long waits in memory for the
/// stored part's decision (and is decided with it). Fragments of one trace arrive within about
/// 100 ms of each other (docs/PERFORMANCE.md); one arriving later is decided on its own, and
/// follows the decision if the trace's other part was decided first.
const JOIN_WINDOW_NS: u64 = 1_000_000_000;

/// A trace whose decision the store failed to take is tried again this much later...
const DECIDE_RETRY_NS: u64 = 1_000_000_000;
/// ...at most this many times in all.
const MAX_DECIDE_FAILURES: u8 = 5;

/// Timing and bounds of the engine.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub grace_ns: u64,
    pub decision_wait_ns: u64,
    pub max_disk_bytes: u64,
    pub decision_cache: usize,
    pub export_batch_spans: usize,
    /// A trace still undecided this long after its first span goes to the store (0: at once).
    pub spill_after_ns: u64,
    /// Bytes of spans held in memory; past it the oldest traces go to the store.
    pub max_memory_bytes: u64,
}

impl Limits {
    /// When a trace is decided, in memory or in the store: `grace` after its root span here arrived
    /// (`root_ended` 0: not yet), or `decision_wait` after its first span, whichever comes first.
    fn decision_due(&self, first_seen: u64, root_ended: u64) -> u64 {
        let by_wait = first_seen.saturating_add(self.decision_wait_ns);
        if root_ended == 0 { by_wait } else { by_wait.min(root_ended.saturating_add(self.grace_ns)) }
    }
}

#[derive(Debug, Clone, Copy)]
/// A trace recovered from the store at start, tracked on its own until decided (after a restart
/// with millions waiting, millions of these for up to the decision wait), so it is packed into 40
/// bytes: `root_ended` 0 means not yet, the partition fits 32 bits (5 s partitions of Unix time:
/// 680 years), the span count too.
struct Pending {
    first_seen: u64,
    root_ended: u64,
    first: u64,
    last: u64,
    partition: u32,
    span_count: u32,
}

impl Pending {
    fn new(first_seen: u64, root_ended: Option<u64>, spans: SpanRange, span_count: usize) -> Self {
        Self {
            first_seen,
            root_ended: root_ended.unwrap_or(0),
            first: spans.first,
            last: spans.last,
            partition: spans.partition as u32,
            span_count: span_count as u32,
        }
    }

    fn spans(&self) -> SpanRange {
        SpanRange { partition: Partition::from(self.partition), first: self.first, last: self.last }
    }

    fn add(&mut self, seq: u64, spans: usize, root_ended: Option<u64>) {
        self.first = self.first.min(seq);
        self.last = self.last.max(seq);
        self.span_count = self.span_count.saturating_add(spans as u32);
        self.root_ended = self.root_ended.max(root_ended.unwrap_or(0));
    }

    fn deadline(&self, limits: &Limits) -> u64 {
        limits.decision_due(self.first_seen, self.root_ended)
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct PartitionState {
    pending: usize,
    outbox: usize,
    bytes: u64,
}

/// Counters the engine keeps itself and publishes on every loop.
#[derive(Debug, Default)]
struct Counts {
    late_kept: u64,
    late_dropped: u64,
    early: u64,
    store_errors: u64,
    /// Spans lost because the store failed to take them.
    spans_lost: u64,
    decisions: BTreeMap<DecisionKey, u64>,
    /// Traces decided from memory, never written to the store.
    decided_in_memory: u64,
    /// Traces written to the store to wait (too long undecided, or memory over its budget).
    spilled: u64,
    /// Later fragments that joined a trace in memory, and the longest gap between a trace's first
    /// fragment and a later one.
    fragments_joined: u64,
    fragment_gap_max_ns: u64,
    /// Kept traces the journal brought back undelivered at a start, exported again.
    resent: u64,
}

/// Counts a decision by deciding policy and outcome. Found by a scan of a few entries (policies x
/// outcomes), so a decision allocates no key.
fn count_decision(counts: &mut Counts, policy: Option<&str>, kept: bool) {
    match counts.decisions.iter_mut().find(|(k, _)| k.kept == kept && k.policy.as_deref() == policy) {
        Some((_, n)) => *n += 1,
        None => {
            counts.decisions.insert(DecisionKey { policy: policy.map(str::to_owned), kept }, 1);
        }
    }
}

#[derive(Debug)]
pub struct Engine<S> {
    store: S,
    policies: PolicySet,
    limits: Limits,
    pending: FxHashMap<TraceId, Pending>,
    /// Traces in memory (never written to the store).
    hot: FxHashMap<TraceId, Hot>,
    /// Their span bytes, and spans.
    hot_bytes: u64,
    hot_spans: u64,
    /// Hot traces in arrival order, for spilling the oldest: `[0]` those whose root span has not
    /// arrived, `[1]` those whose has (a trace moves when its root arrives). Entries of traces that
    /// left memory or moved are skipped.
    hot_order: [VecDeque<TraceId>; 2],
    /// Due times of traces in the store (stale entries are skipped when popped).
    deadlines: BinaryHeap<Reverse<(u64, TraceId)>>,
    /// Due times of traces in memory (next decision or spill; stale entries are skipped), apart:
    /// the disk bound's early decisions walk the store's traces only.
    hot_deadlines: Wheel<TraceId>,
    /// The traces [`Wheel::take_due`] gives a tick (kept to reuse its allocation).
    due_scratch: Vec<TraceId>,
    /// Failed decisions per stored trace whose spans the store could not give back.
    decide_failures: FxHashMap<TraceId, u8>,
    /// Traces this run put in the store, by append ([`Group`]); `pending` holds only traces
    /// recovered from the store at start.
    groups: FxHashMap<(Partition, u64), Group>,
    /// Their due times (stale entries, whose group is gone or has another due time, are skipped).
    group_deadlines: BinaryHeap<Reverse<(u64, Partition, u64)>>,
    /// Undecided traces in groups.
    group_traces: u64,
    /// Traces that went to the store within [`JOIN_WINDOW_NS`], with their partition: a later
    /// fragment of one waits in memory to be decided with it.
    joining: FxHashMap<TraceId, (Partition, u64)>,
    joining_order: VecDeque<(u64, TraceId)>,
    partitions: BTreeMap<Partition, PartitionState>,
    cache: DecisionCache,
    /// Kept spans on their way to the exporter.
    outgoing: Outgoing,
    counts: Counts,
    error_log: Option<std::time::Instant>,
    /// Spans of pending traces (the sum of their `span_count`, kept as it changes).
    spans_pending: u64,
    /// Calls of [`Engine::publish`] so far.
    publications: u64,
    /// Decisions written since the store was last made durable.
    unflushed_decisions: bool,
    /// What waits in memory, written ahead (`None`: `TRACETAP_TAIL_JOURNAL=off`, or it could not
    /// be opened).
    journal: Option<Journal>,
    /// The latest time the engine was given (the journal's segments start by it).
    now: u64,
}

impl<S: TailStore> Engine<S> {
    /// Opens the engine over a store, re-arming everything the store holds: pending traces get
    /// their deadlines from their persisted times, kept traces still in the outbox are queued for
    /// export again, and the decision cache is rebuilt (oldest decisions forgotten past its size).
    pub fn open(
        store: S,
        policies: PolicySet,
        limits: Limits,
        resource: Vec<(String, String)>,
        now: u64,
    ) -> Result<Self, StoreError> {
        Self::open_journaled(store, None, policies, limits, resource, now)
    }

    /// [`Engine::open`] with a journal: after the store's traces, what the journal replayed is
    /// taken back (see [`Engine::take_back`]), written again into the journal's new segment, and
    /// the old segments are removed once that is written.
    pub fn open_journaled(
        store: S,
        journal: Option<(Journal, Replayed)>,
        policies: PolicySet,
        limits: Limits,
        resource: Vec<(String, String)>,
        now: u64,
    ) -> Result<Self, StoreError> {
        let recovered = store.recover()?;
        let mut engine = Self {
            store,
            policies,
            limits,
            pending: FxHashMap::default(),
            hot: FxHashMap::default(),
            hot_bytes: 0,
            hot_spans: 0,
            hot_order: [VecDeque::new(), VecDeque::new()],
            deadlines: BinaryHeap::new(),
            hot_deadlines: Wheel::new(HOT_DUE_WIDTH_NS, now),
            due_scratch: Vec::new(),
            decide_failures: FxHashMap::default(),
            groups: FxHashMap::default(),
            group_deadlines: BinaryHeap::new(),
            group_traces: 0,
            joining: FxHashMap::default(),
            joining_order: VecDeque::new(),
            partitions: BTreeMap::new(),
            cache: DecisionCache::new(limits.decision_cache),
            outgoing: Outgoing::new(resource),
            counts: Counts::default(),
            error_log: None,
            spans_pending: 0,
            unflushed_decisions: false,
            publications: 0,
            journal: None,
            now,
        };
        engine.rearm(&recovered, now)?;
        if let Some((journal, replayed)) = journal {
            engine.journal = Some(journal);
            engine.take_back(replayed, now)?;
            engine.commit_journal();
            // Only if everything taken back was written again (else the old segments stay).
            if let Some(journal) = &mut engine.journal {
                journal.retire_replayed();
            }
        }
        engine.tick(now);
        Ok(engine)
    }

    /// Takes back what the journal replayed after a crash: undecided traces wait in memory for the
    /// rest of their grace (journaled again), kept traces not reported exported are exported again
    /// (counted as re-sent), and the other decisions go to the cache so that late spans follow
    /// them. A trace the store holds pending too (it moved there, and the crash came before the
    /// journal recorded it; or a part that waited in memory to join it) is the store's: the spans
    /// the store lacks are appended to it.
    fn take_back(&mut self, replayed: Replayed, now: u64) -> Result<(), StoreError> {
        for (r, threshold) in replayed.unexported {
            let Some(spans) = self.journaled_spans(&r) else { continue };
            let journal = self.journal.as_mut().expect("taking back from the journal");
            let held = journal.fragment(&r.trace, r.first_seen, r.root_ended, &spans.bytes, None);
            journal.decided(&r.trace, true, threshold);
            self.counts.resent += 1;
            if !self.cache.contains(&r.trace) {
                let cached = Cached::in_memory(now, PARTITION_NS, true, threshold);
                self.cache.remember(r.trace, cached);
            }
            self.queue_kept(spans.records(), threshold);
            self.outgoing.deliver(Delivery::Journaled { trace: r.trace, held });
            self.outgoing.traces += 1;
        }
        for r in replayed.undecided {
            let Some(spans) = self.journaled_spans(&r) else { continue };
            if let Some(p) = self.pending.get(&r.trace).copied() {
                let stored = self.store.spans(&r.trace, &p.spans())?;
                let stored: rustc_hash::FxHashSet<&[u8]> = stored.iter().map(Vec::as_slice).collect();
                let missing = spans.filtered(|record| !stored.contains(record));
                if missing.len() > 0 {
                    let part = Hot {
                        first_seen: r.first_seen,
                        root_ended: r.root_ended,
                        randomness: None,
                        spans: missing,
                        joins: None,
                        journal: None,
                    };
                    let items = [(r.trace, part)];
                    if let Err(refused) = self.append(p.spans().partition, &items, now) {
                        self.store_error(&refused.error);
                        self.counts.spans_lost += items[0].1.spans.len() as u64;
                    }
                }
                continue;
            }
            if let Some(cached) = self.cache.get(&r.trace) {
                if cached.kept {
                    self.counts.late_kept += spans.len() as u64;
                    self.queue_kept(spans.records(), cached.threshold);
                } else {
                    self.counts.late_dropped += spans.len() as u64;
                }
                continue;
            }
            let randomness = spans
                .records()
                .filter_map(|record| wire::span(record.get(4..)?).ok())
                .find_map(|span| parse_ot_tracestate(span.trace_state).randomness);
            let hot = Hot {
                first_seen: r.first_seen,
                root_ended: r.root_ended,
                randomness,
                spans,
                joins: None,
                journal: None,
            };
            self.hold(r.trace, hot);
        }
        for (trace, kept, threshold) in replayed.decided {
            if !self.cache.contains(&trace) {
                let cached = Cached::in_memory(now, PARTITION_NS, kept, threshold);
                self.cache.remember(trace, cached);
            }
        }
        self.flush_export();
        Ok(())
    }

    /// A replayed trace's spans, checked (the journal is read from disk: hostile until parsed).
    fn journaled_spans(&mut self, r: &journal::ReplayedTrace) -> Option<SpanBuf> {
        let spans = SpanBuf::parse(&r.spans);
        if spans.is_none() {
            // Its frame's checksum held, so the agent wrote it so: counted, never trusted.
            self.counts.spans_lost += 1;
        }
        spans
    }

    fn rearm(&mut self, recovered: &Recovered, now: u64) -> Result<(), StoreError> {
        for partition in &recovered.partitions {
            self.partitions.entry(*partition).or_default();
        }
        // Decisions first: a recovered part of a trace decided before follows that decision.
        for d in &recovered.decisions {
            let (kept, threshold) = match d.outcome {
                Outcome::Kept { threshold } => (true, threshold),
                Outcome::Dropped => (false, 0),
            };
            self.cache
                .remember(d.trace, Cached { partition: d.partition, seq: d.seq, kept, threshold, first: 0, last: 0 });
        }
        for (trace, p) in &recovered.pending {
            if self.pending.contains_key(trace) {
                // The trace waits in two partitions (parts that went to the store apart): the
                // earlier part is decided now, and this one follows it when due.
                self.counts.early += 1;
                if !self.decide_logged(*trace, now)
                    && let Some(lost) = self.untrack(trace)
                {
                    // Not decided (the store refused): counted lost here; the next start meets it again.
                    self.counts.spans_lost += u64::from(lost.span_count);
                }
            }
            let spans = self.store.spans(trace, &p.spans)?;
            let state = self.partitions.entry(p.spans.partition).or_default();
            state.pending += 1;
            state.bytes += spans.iter().map(|s| s.len() as u64).sum::<u64>();
            let pending = Pending::new(p.first_seen_unix_ns, p.root_ended_unix_ns, p.spans, spans.len());
            self.spans_pending += spans.len() as u64;
            self.track(*trace, pending);
        }
        for entry in &recovered.outbox {
            let spans = self.store.spans(&entry.trace, &entry.spans)?;
            self.partitions.entry(entry.spans.partition).or_default().outbox += 1;
            self.queue_kept(spans.iter().map(Vec::as_slice), entry.threshold);
            self.outgoing.deliver(Delivery::Stored {
                trace: entry.trace,
                partition: entry.spans.partition,
                seq: entry.seq,
            });
            self.outgoing.traces += 1;
        }
        self.flush_export();
        Ok(())
    }

    /// Stops tracking a recovered trace (decided, or given up), with the counts that include it.
    fn untrack(&mut self, trace: &TraceId) -> Option<Pending> {
        let p = self.pending.remove(trace)?;
        self.spans_pending -= u64::from(p.span_count);
        if let Some(state) = self.partitions.get_mut(&p.spans().partition) {
            state.pending -= 1;
        }
        Some(p)
    }

    fn track(&mut self, trace: TraceId, pending: Pending) {
        self.deadlines.push(Reverse((pending.deadline(&self.limits), trace)));
        self.pending.insert(trace, pending);
    }

    /// Takes in a batch of kept spans from the capture thread.
    pub fn ingest(&mut self, request: &[u8], now: u64) -> Result<(), WireError> {
        self.now = self.now.max(now);
        let mut fragments: FxHashMap<TraceId, Hot> = FxHashMap::default();
        let resources = &mut self.outgoing.resources;
        let mut last_resource: *const u8 = std::ptr::null();
        wire::request_spans(request, |origin, span| {
            let pid = origin.pid;
            // Spans of one ResourceSpans share its resource: compare it once, not per span.
            if origin.resource.as_ptr() != last_resource {
                last_resource = origin.resource.as_ptr();
                if resources.get(&pid).is_none_or(|r| r.as_slice() != origin.resource) {
                    resources.insert(pid, origin.resource.to_vec());
                }
            }
            let Ok(trace) = TraceId::try_from(span.trace_id) else { return };
            let hot = fragments.entry(trace).or_insert_with(|| Hot {
                first_seen: now,
                root_ended: 0,
                randomness: None,
                spans: SpanBuf::default(),
                joins: None,
                journal: None,
            });
            if span.kind == SpanKind::Server as i32 {
                // The grace runs from the root's arrival (see the module note of `tail`).
                hot.root_ended = hot.root_ended.max(span.end_unix_ns).max(now);
            }
            if hot.randomness.is_none() && !span.trace_state.is_empty() {
                hot.randomness = parse_ot_tracestate(span.trace_state).randomness;
            }
            hot.spans.push(pid, &span);
        })?;
        // Late fragments follow their cached decision; the others are appended, grouped by the
        // partition of their trace (new traces: the current one).
        let mut by_partition: BTreeMap<Partition, Vec<(TraceId, Hot)>> = BTreeMap::new();
        for (trace, fragment) in fragments {
            if let Some(cached) = self.cache.get(&trace) {
                if cached.kept {
                    self.counts.late_kept += fragment.spans.len() as u64;
                    self.queue_kept(fragment.spans.records(), cached.threshold);
                } else {
                    self.counts.late_dropped += fragment.spans.len() as u64;
                }
                continue;
            }
            if let Some(p) = self.pending.get(&trace) {
                // Recovered from the store: the rest of it goes to the store too.
                by_partition.entry(p.spans().partition).or_default().push((trace, fragment));
            } else if let Some(&(partition, _)) = self.joining.get(&trace)
                && !self.hot.contains_key(&trace)
                && !self.memory_off()
            {
                // Went to the store moments ago: this part waits in memory to be decided with it.
                self.hold(trace, Hot { joins: Some(partition), ..fragment });
            } else if self.memory_off() && !self.hot.contains_key(&trace) {
                // Memory off: every trace waits in the store (a part that follows one that went
                // there a moment ago goes to the same partition, where a restart finds them as one).
                let partition = self.joining.get(&trace).map_or(now / PARTITION_NS, |&(p, _)| p);
                by_partition.entry(partition).or_default().push((trace, fragment));
            } else {
                self.hold(trace, fragment);
            }
        }
        for (partition, items) in by_partition {
            if let Err(refused) = self.append(partition, &items, now) {
                self.store_error(&refused.error);
                let lost = items.iter().filter(|(t, _)| refused.traces.contains(t));
                self.counts.spans_lost += lost.map(|(_, f)| f.spans.len() as u64).sum::<u64>();
            }
        }
        if self.outgoing.spans >= self.limits.export_batch_spans as u64 {
            self.flush_export();
        }
        if self.journal.as_ref().is_some_and(|j| j.buffered() >= journal::GROUP_BYTES) {
            self.commit_journal();
        }
        Ok(())
    }

    /// Every trace waits in the store (`TRACETAP_TAIL_SPILL_AFTER=0` or
    /// `TRACETAP_TAIL_MAX_MEMORY_BYTES=0`).
    fn memory_off(&self) -> bool {
        self.limits.spill_after_ns == 0 || self.limits.max_memory_bytes == 0
    }

    /// Keeps a fragment in memory, arming its trace's due times.
    fn hold(&mut self, trace: TraceId, mut fragment: Hot) {
        self.hot_spans += fragment.spans.len() as u64;
        let held = self.journal.as_mut().map(|j| {
            let before = self.hot.get(&trace).and_then(|h| h.journal);
            j.fragment(&trace, fragment.first_seen, fragment.root_ended, &fragment.spans.bytes, before)
        });
        let limits = self.limits;
        // One due time in the heap per change of it: usually one push and one pop per trace (the
        // heap holds every waiting trace, so its size is what each of them costs).
        match self.hot.entry(trace) {
            std::collections::hash_map::Entry::Occupied(e) => {
                let hot = e.into_mut();
                self.counts.fragments_joined += 1;
                let gap = fragment.first_seen.saturating_sub(hot.first_seen);
                self.counts.fragment_gap_max_ns = self.counts.fragment_gap_max_ns.max(gap);
                let before = hot.next_due(&limits);
                if hot.root_ended == 0 && fragment.root_ended != 0 {
                    self.hot_order[1].push_back(trace);
                }
                hot.journal = held.or(hot.journal);
                let held = hot.spans.byte_len();
                hot.spans.append(fragment.spans);
                // What the buffer holds now (it grows, or takes the fragment's).
                self.hot_bytes = self.hot_bytes - held + hot.spans.byte_len();
                hot.root_ended = hot.root_ended.max(fragment.root_ended);
                hot.randomness = hot.randomness.or(fragment.randomness);
                let due = hot.next_due(&limits);
                if due != before {
                    self.hot_deadlines.push(due, trace);
                }
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                if fragment.joins.is_none() {
                    self.hot_order[usize::from(fragment.root_ended != 0)].push_back(trace);
                }
                self.hot_bytes += fragment.spans.byte_len();
                fragment.journal = held;
                let hot = e.insert(fragment);
                self.hot_deadlines.push(hot.next_due(&limits), trace);
            }
        }
    }

    /// Writes hot traces to the store, where they wait as pending traces: grouped by partition, as
    /// appends from the capture thread are (sled's cost is per insert).
    fn spill(&mut self, traces: &[TraceId], now: u64) {
        let mut by_partition: BTreeMap<Partition, Vec<(TraceId, Hot)>> = BTreeMap::new();
        for trace in traces {
            let Some(hot) = self.hot.remove(trace) else { continue };
            self.hot_bytes -= hot.spans.byte_len();
            self.hot_spans -= hot.spans.len() as u64;
            // A part that joins a stored trace goes where that is (only at a clean stop: then the
            // next start recovers both as one trace).
            let partition = hot.joins.unwrap_or(hot.first_seen / PARTITION_NS);
            by_partition.entry(partition).or_default().push((*trace, hot));
        }
        for (partition, items) in by_partition {
            let refused = self.append(partition, &items, now).err();
            let refused_traces = refused.as_ref().map_or(0, |r| r.traces.len());
            self.counts.spilled += (items.len() - refused_traces) as u64;
            if let Some(journal) = &mut self.journal {
                // The store holds them now (the journal says so once the store is durable).
                for (trace, hot) in &items {
                    if let Some(held) = hot.journal
                        && refused.as_ref().is_none_or(|r| !r.traces.contains(trace))
                    {
                        journal.released(trace, held);
                    }
                }
            }
            if let Some(refused) = refused {
                // The store did not take them: they stay in memory (over its budget, if that is
                // why they were leaving) and are decided there when due.
                self.store_error(&refused.error);
                for (trace, hot) in items {
                    if refused.traces.contains(&trace) {
                        if hot.joins.is_none() {
                            self.hot_order[usize::from(hot.root_ended != 0)].push_back(trace);
                        }
                        self.hot_bytes += hot.spans.byte_len();
                        self.hot_spans += hot.spans.len() as u64;
                        self.hot_deadlines.push(hot.decision_due(&self.limits), trace);
                        self.hot.insert(trace, hot);
                    }
                }
            }
        }
    }

    /// Decides a trace held in memory: nothing is written to the store, and nothing parsed.
    fn decide_hot(&mut self, trace: TraceId, now: u64) {
        let Some(hot) = self.take_hot(&trace) else { return };
        let facts: Vec<SpanFacts<'_>> = hot.facts().collect();
        let verdict = self.policies.evaluate(&TraceData {
            spans: &facts,
            randomness: hot.randomness.unwrap_or_else(|| randomness(&trace)),
            now_second: now / 1_000_000_000,
        });
        let (keep, threshold) = (verdict.keep, verdict.min_threshold);
        count_decision(&mut self.counts, verdict.policy, keep);
        drop(facts);
        self.counts.decided_in_memory += 1;
        self.cache.remember(trace, Cached::in_memory(now, PARTITION_NS, keep, threshold));
        if let (Some(journal), Some(held)) = (&mut self.journal, hot.journal) {
            journal.decided(&trace, keep, threshold);
            if keep {
                self.outgoing.deliver(Delivery::Journaled { trace, held });
            } else {
                journal.let_go(held);
            }
        }
        if keep {
            self.queue_kept(hot.spans.records(), threshold);
            self.outgoing.traces += 1;
            if self.outgoing.spans >= self.limits.export_batch_spans as u64 {
                self.flush_export();
            }
        }
    }

    /// The randomness and the policies' view of a trace's spans as the store gave them back.
    fn stored_facts<'s>(trace: &TraceId, stored: &'s [Vec<u8>]) -> (u64, Vec<SpanFacts<'s>>) {
        let fields: Vec<wire::SpanFields<'_>> =
            stored.iter().filter_map(|b| b.get(4..)).filter_map(|b| wire::span(b).ok()).collect();
        let randomness = fields
            .iter()
            .find_map(|s| parse_ot_tracestate(s.trace_state).randomness)
            .unwrap_or_else(|| randomness(trace));
        let facts = fields
            .iter()
            .map(|f| SpanFacts {
                start_unix_ns: f.start_unix_ns,
                end_unix_ns: f.end_unix_ns,
                status: f.status,
                span: f.bytes,
            })
            .collect();
        (randomness, facts)
    }

    /// Appends fragments of one partition. A trace recovered from the store (in `pending`) grows;
    /// any other becomes part of its append's [`Group`] and may be joined for a moment.
    fn append(&mut self, partition: Partition, items: &[(TraceId, Hot)], now: u64) -> Result<(), Refused> {
        // A group is decided when its last trace is due: traces whose root arrived (due within the
        // grace) and traces without one (due at the decision wait) go in separate appends, each in
        // order of due time, so that no group holds both. More of a trace recovered at start goes
        // in an append of its own: a group's appends hold its traces only.
        let due = |f: &Hot| self.limits.decision_due(f.first_seen, f.root_ended);
        let (recovered, new): (Vec<_>, Vec<_>) = items.iter().partition(|(t, _)| self.pending.contains_key(t));
        let (mut rooted, mut rootless): (Vec<_>, Vec<_>) = new.into_iter().partition(|(_, f)| f.root_ended != 0);
        rooted.sort_by_key(|(_, f)| due(f));
        rootless.sort_by_key(|(_, f)| due(f));
        let mut refused: Option<Refused> = None;
        for class in [recovered, rooted, rootless] {
            if class.is_empty() {
                continue;
            }
            if let Err(error) = self.append_in_order(partition, &class, now) {
                let traces = class.iter().map(|(t, _)| *t);
                match &mut refused {
                    Some(r) => r.traces.extend(traces),
                    None => refused = Some(Refused { error, traces: traces.collect() }),
                }
            }
        }
        refused.map_or(Ok(()), Err)
    }

    fn append_in_order(&mut self, partition: Partition, items: &[&(TraceId, Hot)], now: u64) -> Result<(), StoreError> {
        let views: Vec<Vec<&[u8]>> = items.iter().map(|(_, f)| f.spans.records().collect()).collect();
        let fragments: Vec<Fragment<'_>> = items
            .iter()
            .zip(&views)
            .map(|((trace, f), spans)| Fragment {
                trace: *trace,
                first_seen_unix_ns: self.pending.get(trace).map_or(f.first_seen, |p| p.first_seen),
                root_ended_unix_ns: (f.root_ended != 0).then_some(f.root_ended),
                spans,
            })
            .collect();
        let seqs = self.store.append(partition, &fragments)?;
        let mut touched: Vec<u64> = Vec::new();
        for (((trace, f), seq), views) in items.iter().zip(seqs).zip(&views) {
            let bytes: u64 = views.iter().map(|s| s.len() as u64).sum();
            let (spans, root_ended) = (f.spans.len(), (f.root_ended != 0).then_some(f.root_ended));
            self.partitions.entry(partition).or_default().bytes += bytes;
            self.spans_pending += spans as u64;
            if let Some(mut p) = self.pending.get(trace).copied() {
                p.add(seq, spans, root_ended);
                if root_ended.is_some() {
                    self.deadlines.push(Reverse((p.deadline(&self.limits), *trace)));
                }
                self.pending.insert(*trace, p);
                continue;
            }
            let due = self.limits.decision_due(f.first_seen, f.root_ended);
            let group = self.groups.entry((partition, seq)).or_insert(Group {
                due: 0,
                undecided: 0,
                spans_left: 0,
                done: 0,
                failures: 0,
            });
            group.due = group.due.max(due);
            group.undecided += 1;
            group.spans_left = group.spans_left.saturating_add(spans as u32);
            if touched.last() != Some(&seq) {
                touched.push(seq);
            }
            self.group_traces += 1;
            self.partitions.entry(partition).or_default().pending += 1;
            self.joining.insert(*trace, (partition, now));
            self.joining_order.push_back((now, *trace));
        }
        for seq in touched {
            let due = self.groups[&(partition, seq)].due;
            self.group_deadlines.push(Reverse((due, partition, seq)));
        }
        Ok(())
    }

    /// Decides the traces that are due (in memory, recovered from the store, in groups), spills
    /// what must wait, decides the soonest due early when the store is over its bound, and drops
    /// partitions with nothing left to decide or export.
    pub fn tick(&mut self, now: u64) {
        self.now = self.now.max(now);
        let mut to_spill = Vec::new();
        let mut due = std::mem::take(&mut self.due_scratch);
        self.hot_deadlines.take_due(now, &mut due);
        for trace in due.drain(..) {
            // Stale entries (the trace left memory, or its due time changed) are skipped.
            let Some(hot) = self.hot.get(&trace) else { continue };
            if hot.decision_due(&self.limits) <= now {
                self.decide_hot(trace, now);
            } else if hot.spill_due(&self.limits) <= now {
                to_spill.push(trace);
            } else {
                // Not due: a stale entry (its due time moved later), or the wall clock stepped
                // back. Armed again, so that no trace is left without a due time.
                let next = hot.next_due(&self.limits);
                self.hot_deadlines.push(next, trace);
            }
        }
        self.due_scratch = due;
        let mut retry = Vec::new();
        while let Some(Reverse((deadline, trace))) = self.deadlines.peek().copied() {
            if deadline > now {
                break;
            }
            self.deadlines.pop();
            // Stale entries (an earlier deadline already decided the trace) are skipped.
            if self.pending.get(&trace).is_some_and(|p| p.deadline(&self.limits) <= now)
                && !self.decide_logged(trace, now)
            {
                retry.push(trace);
            }
        }
        let mut retry_groups = Vec::new();
        while let Some(Reverse((due, partition, seq))) = self.group_deadlines.peek().copied() {
            if due > now {
                break;
            }
            self.group_deadlines.pop();
            if self.groups.get(&(partition, seq)).is_some_and(|g| g.due == due)
                && !self.decide_group_logged(partition, seq, now)
            {
                retry_groups.push((partition, seq));
            }
        }
        while let Some(&(at, trace)) = self.joining_order.front() {
            if at.saturating_add(JOIN_WINDOW_NS) > now {
                break;
            }
            self.joining_order.pop_front();
            if self.joining.get(&trace).is_some_and(|&(_, since)| since == at) {
                self.joining.remove(&trace);
            }
        }
        self.spill(&to_spill, now);
        let over_budget = self.pick_spills_over_budget();
        self.spill(&over_budget, now);
        for (class, order) in self.hot_order.iter_mut().enumerate() {
            if order.len() > 2 * self.hot.len() + 64 {
                // Entries of traces that left memory or moved: dropped in one pass once they
                // outnumber the rest.
                let hot = &self.hot;
                order.retain(|t| hot.get(t).is_some_and(|h| usize::from(h.root_ended != 0) == class));
            }
        }
        self.bound_disk(now, &mut retry, &mut retry_groups);
        // What the store failed to decide is tried again a second later (put back only now, so
        // that no loop above meets it twice).
        let again = now.saturating_add(DECIDE_RETRY_NS);
        for trace in retry {
            if self.pending.contains_key(&trace) {
                self.deadlines.push(Reverse((again, trace)));
            }
        }
        for (partition, seq) in retry_groups {
            if let Some(group) = self.groups.get_mut(&(partition, seq)) {
                group.due = again;
                self.group_deadlines.push(Reverse((again, partition, seq)));
            }
        }
        self.drop_finished_partitions(now);
        self.forget_evicted();
        // The tick's decisions as one write; durable at the next flush (before any export).
        if let Err(e) = self.store.commit() {
            self.store_error(&e);
        }
        self.flush_export();
        // The tick's group commit (flush_export made one if it had kept traces to send).
        self.commit_journal();
        self.bound_journal();
    }

    /// Over the disk bound: the stored traces due soonest (the oldest, mostly) are decided now,
    /// recovered ones first, then groups.
    fn bound_disk(&mut self, now: u64, retry: &mut Vec<TraceId>, retry_groups: &mut Vec<(Partition, u64)>) {
        let mut excess = self.buffered_bytes().saturating_sub(self.limits.max_disk_bytes);
        // A partition frees its bytes once its last trace is decided.
        let freed = |engine: &Self, partition: Partition| {
            engine.partitions.get(&partition).filter(|s| s.pending == 0).map_or(0, |s| s.bytes)
        };
        while excess > 0 {
            let Some(Reverse((_, trace))) = self.deadlines.pop() else { break };
            let Some(partition) = self.pending.get(&trace).map(|p| p.spans().partition) else { continue };
            self.counts.early += 1;
            if !self.decide_logged(trace, now) {
                retry.push(trace);
                continue;
            }
            excess = excess.saturating_sub(freed(self, partition));
        }
        while excess > 0 {
            let Some(Reverse((due, partition, seq))) = self.group_deadlines.pop() else { break };
            let Some(group) = self.groups.get(&(partition, seq)).filter(|g| g.due == due) else { continue };
            self.counts.early += u64::from(group.undecided);
            if !self.decide_group_logged(partition, seq, now) {
                retry_groups.push((partition, seq));
                continue;
            }
            excess = excess.saturating_sub(freed(self, partition));
        }
    }

    /// Past the disk bound with the journal's segments counted (after the tick's group commit
    /// removed those nothing holds): the oldest segments go, whatever holds them (counted: those
    /// traces are still decided from memory, but a crash would lose them). The journal never
    /// makes the store's traces be decided early.
    fn bound_journal(&mut self) {
        let store = self.buffered_bytes();
        let Some(journal) = &mut self.journal else { return };
        let mut excess = (store + journal.disk_bytes()).saturating_sub(self.limits.max_disk_bytes);
        while excess > 0 {
            let freed = journal.drop_oldest();
            if freed == 0 {
                break;
            }
            excess = excess.saturating_sub(freed);
        }
    }

    /// Decides a group; on a store failure the group stays (the caller tries it again a second
    /// later, from the fragment it stopped at) and `false` is returned. After
    /// [`MAX_DECIDE_FAILURES`] failures what is left of it is given up: counted lost.
    fn decide_group_logged(&mut self, partition: Partition, seq: u64, now: u64) -> bool {
        let Err(e) = self.decide_group(partition, seq, now) else { return true };
        self.store_error(&e);
        let Some(group) = self.groups.get_mut(&(partition, seq)) else { return true };
        group.failures += 1;
        if group.failures < MAX_DECIDE_FAILURES {
            return false;
        }
        self.forget_group(partition, seq);
        true
    }

    /// Removes a group; traces of it still undecided (the store gave back fewer, or it was given
    /// up) are counted lost.
    fn forget_group(&mut self, partition: Partition, seq: u64) {
        let Some(group) = self.groups.remove(&(partition, seq)) else { return };
        self.counts.spans_lost += u64::from(group.spans_left);
        self.spans_pending -= u64::from(group.spans_left);
        self.group_traces -= u64::from(group.undecided);
        if let Some(state) = self.partitions.get_mut(&partition) {
            state.pending -= group.undecided as usize;
        }
    }

    /// Decides the traces of one group from one read of the store: each is decided from its
    /// stored spans and a part of it waiting in memory ([`Hot::joins`]), or follows the decision
    /// of another part decided before. As in [`Engine::decide`], nothing in memory changes for a
    /// trace before its store call succeeded.
    fn decide_group(&mut self, partition: Partition, seq: u64, now: u64) -> Result<(), StoreError> {
        let fragments = self.store.fragments(partition, seq)?;
        let start = self.groups.get(&(partition, seq)).map_or(0, |g| g.done as usize);
        for (i, fragment) in fragments.iter().enumerate().skip(start) {
            // An append of a group holds its traces only; more than it counted is not its own.
            if self.groups.get(&(partition, seq)).is_none_or(|g| g.undecided == 0) {
                break;
            }
            self.decide_stored_fragment(partition, seq, fragment, now)?;
            let spans = fragment.spans.len() as u32;
            if let Some(group) = self.groups.get_mut(&(partition, seq)) {
                group.done = i as u32 + 1;
                group.undecided -= 1;
                group.spans_left = group.spans_left.saturating_sub(spans);
                self.group_traces -= 1;
                self.spans_pending -= u64::from(spans);
                if let Some(state) = self.partitions.get_mut(&partition) {
                    state.pending -= 1;
                }
            }
        }
        self.forget_group(partition, seq);
        Ok(())
    }

    /// Records that a part of `trace` stored at `part` follows the decision another part got
    /// before (`cached`), like any decision (kept: in the outbox). On the same partition as that
    /// decision's record, the new record's range covers both parts (a partition holds one record
    /// per trace, the latest), so that a crash before their export re-exports both.
    fn follow(&mut self, trace: TraceId, part: SpanRange, cached: Cached) -> Result<u64, StoreError> {
        let range = if cached.seq != 0 && cached.partition == part.partition && cached.last != 0 {
            SpanRange {
                partition: part.partition,
                first: cached.first.min(part.first),
                last: cached.last.max(part.last),
            }
        } else {
            part
        };
        let outcome = if cached.kept { Outcome::Kept { threshold: cached.threshold } } else { Outcome::Dropped };
        let decision = self.store.decide(&trace, &range, outcome)?;
        self.unflushed_decisions = true;
        let (first, last) = (range.first, range.last);
        self.cache.remember(trace, Cached { partition: part.partition, seq: decision, first, last, ..cached });
        Ok(decision)
    }

    fn decide_stored_fragment(
        &mut self,
        partition: Partition,
        seq: u64,
        fragment: &AppendedFragment,
        now: u64,
    ) -> Result<(), StoreError> {
        let trace = fragment.trace;
        let range = SpanRange::one(partition, seq);
        let joined = self.hot.get(&trace).is_some_and(|h| h.joins == Some(partition));
        if let Some(cached) = self.cache.get(&trace) {
            // Another part was decided first: this one follows.
            let decision = self.follow(trace, range, cached)?;
            let part = if joined { self.take_hot(&trace) } else { None };
            if let Some(part) = &part {
                self.release_journaled(&trace, part);
            }
            let spans = fragment.spans.len() as u64 + part.as_ref().map_or(0, |h| h.spans.len() as u64);
            if cached.kept {
                self.counts.late_kept += spans;
                self.queue_kept(fragment.spans.iter().map(Vec::as_slice), cached.threshold);
                if let Some(part) = &part {
                    self.queue_kept(part.spans.records(), cached.threshold);
                }
                self.partitions.entry(partition).or_default().outbox += 1;
                self.outgoing.deliver(Delivery::Stored { trace, partition, seq: decision });
            } else {
                self.counts.late_dropped += spans;
            }
            return Ok(());
        }
        // The part in memory is taken out while the policies read it, and put back if the store
        // refuses the decision.
        let part = if joined { self.take_hot(&trace) } else { None };
        let (randomness, mut facts) = Self::stored_facts(&trace, &fragment.spans);
        if let Some(part) = &part {
            facts.extend(part.facts());
        }
        let randomness = part.as_ref().and_then(|p| p.randomness).unwrap_or(randomness);
        let verdict = self.policies.evaluate(&TraceData { spans: &facts, randomness, now_second: now / 1_000_000_000 });
        let (keep, threshold) = (verdict.keep, verdict.min_threshold);
        let outcome = if keep { Outcome::Kept { threshold } } else { Outcome::Dropped };
        let decision = match self.store.decide(&trace, &range, outcome) {
            Ok(decision) => decision,
            Err(e) => {
                if let Some(part) = part {
                    self.put_back_hot(trace, part);
                }
                return Err(e);
            }
        };
        count_decision(&mut self.counts, verdict.policy, keep);
        drop(facts);
        self.unflushed_decisions = true;
        self.cache.remember(trace, Cached { partition, seq: decision, kept: keep, threshold, first: seq, last: seq });
        if let Some(part) = &part {
            self.counts.fragments_joined += 1;
            self.release_journaled(&trace, part);
        }
        if keep {
            self.partitions.entry(partition).or_default().outbox += 1;
            self.queue_kept(fragment.spans.iter().map(Vec::as_slice), threshold);
            if let Some(part) = &part {
                // From memory (the journal let it go with the store's decision; see
                // `release_journaled`).
                self.queue_kept(part.spans.records(), threshold);
            }
            self.outgoing.deliver(Delivery::Stored { trace, partition, seq: decision });
            self.outgoing.traces += 1;
            if self.outgoing.spans >= self.limits.export_batch_spans as u64 {
                self.flush_export();
            }
        }
        Ok(())
    }

    /// A part in memory decided with its trace's part in the store: the store's decision (durable
    /// at the next store flush) covers the trace from there on, so the journal lets the part go
    /// then. (Kept, the part is exported from memory: a crash after that flush and before the
    /// export loses this part; the store's outbox brings back the stored part.)
    fn release_journaled(&mut self, trace: &TraceId, part: &Hot) {
        if let (Some(journal), Some(held)) = (&mut self.journal, part.journal) {
            journal.released(trace, held);
        }
    }

    /// Writes the journal's buffered records as one group commit. Traces that moved to the store
    /// are released in it only once the store is durable (flushed here first); a store that fails
    /// to flush holds back those releases only (the traces come back from the journal at a
    /// restart, and the engine keeps what the store lacks), never the rest.
    pub fn commit_journal(&mut self) {
        let Some(journal) = &self.journal else { return };
        if journal.needs_store_flush() {
            match self.store.flush() {
                Ok(()) => self.store_durable(),
                Err(e) => self.store_error(&e),
            }
        }
        if let Some(journal) = &mut self.journal {
            journal.commit(self.now);
        }
    }

    /// The store made everything written to it durable.
    fn store_durable(&mut self) {
        self.unflushed_decisions = false;
        if let Some(journal) = &mut self.journal {
            journal.store_durable();
        }
    }

    /// Takes a trace out of memory.
    fn take_hot(&mut self, trace: &TraceId) -> Option<Hot> {
        let hot = self.hot.remove(trace)?;
        self.hot_bytes -= hot.spans.byte_len();
        self.hot_spans -= hot.spans.len() as u64;
        Some(hot)
    }

    /// Puts a trace taken out of memory back, due as it was.
    fn put_back_hot(&mut self, trace: TraceId, hot: Hot) {
        self.hot_bytes += hot.spans.byte_len();
        self.hot_spans += hot.spans.len() as u64;
        self.hot_deadlines.push(hot.next_due(&self.limits), trace);
        self.hot.insert(trace, hot);
    }

    /// Over the memory budget: picks hot traces to go to the store, oldest first among those whose
    /// root span has not arrived (they will wait longest: long requests, streams), then the oldest
    /// of the others (due within the grace) only if that is not enough.
    fn pick_spills_over_budget(&mut self) -> Vec<TraceId> {
        let mut over = self.hot_bytes.saturating_sub(self.limits.max_memory_bytes);
        let mut picked = Vec::new();
        for (class, order) in self.hot_order.iter_mut().enumerate() {
            while over > 0 {
                let Some(trace) = order.pop_front() else { break };
                // Skipped: traces that left memory, or moved to the other class.
                if let Some(hot) = self.hot.get(&trace)
                    && usize::from(hot.root_ended != 0) == class
                {
                    over = over.saturating_sub(hot.spans.byte_len());
                    picked.push(trace);
                }
            }
        }
        picked
    }

    /// Decides a trace; on a store failure the trace stays pending (the caller tries it again a
    /// second later) and `false` is returned. After [`MAX_DECIDE_FAILURES`] failures the trace is
    /// given up: its spans are counted lost and it leaves the pending set (its records stay in the
    /// store, where the next start's recovery meets them).
    fn decide_logged(&mut self, trace: TraceId, now: u64) -> bool {
        match self.decide(trace, now) {
            Ok(()) => {
                self.decide_failures.remove(&trace);
                true
            }
            Err(e) => {
                self.store_error(&e);
                let failures = self.decide_failures.entry(trace).or_default();
                *failures += 1;
                if *failures < MAX_DECIDE_FAILURES {
                    return false;
                }
                self.decide_failures.remove(&trace);
                if let Some(p) = self.untrack(&trace) {
                    self.counts.spans_lost += u64::from(p.span_count);
                }
                // Given up: nothing to retry.
                true
            }
        }
    }

    /// Reads the trace's spans, evaluates the policies and records the decision in the store; only
    /// then does the engine's memory change (pending set, partitions, cache, export batch), so a
    /// failed store call leaves the trace pending as it was. (The policies' rate-limiting budget is
    /// the one thing spent before: evaluation needs it, and the store call needs the outcome.)
    fn decide(&mut self, trace: TraceId, now: u64) -> Result<(), StoreError> {
        let Some(p) = self.pending.get(&trace).copied() else { return Ok(()) };
        let range = p.spans();
        let stored = self.store.spans(&trace, &range)?;
        if let Some(cached) = self.cache.get(&trace) {
            // Another part of it (in another partition) was decided first: this one follows.
            let decision = self.follow(trace, range, cached)?;
            self.untrack(&trace);
            if cached.kept {
                self.counts.late_kept += stored.len() as u64;
                self.partitions.entry(range.partition).or_default().outbox += 1;
                self.queue_kept(stored.iter().map(Vec::as_slice), cached.threshold);
                self.outgoing.deliver(Delivery::Stored { trace, partition: range.partition, seq: decision });
            } else {
                self.counts.late_dropped += stored.len() as u64;
            }
            return Ok(());
        }
        let (randomness, facts) = Self::stored_facts(&trace, &stored);
        let verdict = self.policies.evaluate(&TraceData { spans: &facts, randomness, now_second: now / 1_000_000_000 });
        let (keep, threshold) = (verdict.keep, verdict.min_threshold);
        drop(facts);
        let outcome = if keep { Outcome::Kept { threshold } } else { Outcome::Dropped };
        let seq = self.store.decide(&trace, &range, outcome)?;
        count_decision(&mut self.counts, verdict.policy, keep);
        self.untrack(&trace);
        self.unflushed_decisions = true;
        let (first, last) = (range.first, range.last);
        self.cache.remember(trace, Cached { partition: range.partition, seq, kept: keep, threshold, first, last });
        if keep {
            self.partitions.entry(range.partition).or_default().outbox += 1;
            self.queue_kept(stored.iter().map(Vec::as_slice), threshold);
            self.outgoing.deliver(Delivery::Stored { trace, partition: range.partition, seq });
            self.outgoing.traces += 1;
            if self.outgoing.spans >= self.limits.export_batch_spans as u64 {
                self.flush_export();
            }
        }
        Ok(())
    }

    /// Lets the store forget the evicted decisions whose partitions are gone, oldest first.
    fn forget_evicted(&mut self) {
        let partitions = &self.partitions;
        if let Some(up_to) = self.cache.forgettable(|partition| partitions.contains_key(&partition))
            && let Err(e) = self.store.forget_decisions(up_to)
        {
            self.store_error(&e);
        }
    }

    /// Adds stored spans (pid + `Span`) to the export batch (see [`Outgoing::queue_kept`]); a span
    /// whose bytes do not parse is counted lost rather than exported.
    fn queue_kept<'r>(&mut self, stored: impl Iterator<Item = &'r [u8]>, min_threshold: u64) {
        self.counts.spans_lost += self.outgoing.queue_kept(stored, min_threshold);
    }

    /// Closes the current export batch (if it holds anything). The decisions behind it are made
    /// durable first: a kept trace must never reach the exporter while a crash could still undo its
    /// decision, or it would be decided, and exported, twice.
    pub fn flush_export(&mut self) {
        if self.outgoing.is_empty() {
            return;
        }
        if self.unflushed_decisions {
            match self.store.flush() {
                Ok(()) => self.store_durable(),
                Err(e) => {
                    // Not durable: the batch waits (a crash would decide its traces again, and they
                    // must not have been exported then). Tried again at the next flush.
                    self.store_error(&e);
                    return;
                }
            }
        }
        // The journal's decisions of the traces in it, written before they leave (a journal that
        // fails to write does not hold the export back: a crash would then decide them again).
        if self.journal.as_ref().is_some_and(|j| j.buffered() > 0) {
            self.commit_journal();
        }
        self.outgoing.close_batch();
    }

    /// The next batch of kept spans for the exporter.
    pub fn take_export(&mut self) -> Option<Export> {
        self.outgoing.take()
    }

    /// The exporter is done with these kept traces: they leave the outbox.
    pub fn delivered(&mut self, deliveries: &[Delivery]) {
        for delivery in deliveries {
            match *delivery {
                Delivery::Stored { trace, partition, seq } => {
                    if let Some(state) = self.partitions.get_mut(&partition) {
                        state.outbox = state.outbox.saturating_sub(1);
                    }
                    if let Err(e) = self.store.exported(&trace, partition, seq) {
                        self.store_error(&e);
                    }
                }
                Delivery::Journaled { trace, held } => {
                    if let Some(journal) = &mut self.journal {
                        journal.exported(&trace);
                        journal.let_go(held);
                    }
                }
            }
        }
    }

    fn drop_finished_partitions(&mut self, now: u64) {
        let current = now / PARTITION_NS;
        let finished: Vec<Partition> = self
            .partitions
            .iter()
            .filter(|(p, s)| **p < current && s.pending == 0 && s.outbox == 0)
            .map(|(p, _)| *p)
            .collect();
        for partition in finished {
            match self.store.drop_partition(partition) {
                Ok(()) => {
                    self.partitions.remove(&partition);
                }
                Err(e) => self.store_error(&e),
            }
        }
    }

    fn buffered_bytes(&self) -> u64 {
        self.partitions.values().map(|s| s.bytes).sum()
    }

    fn store_error(&mut self, e: &StoreError) {
        self.counts.store_errors += 1;
        let now = std::time::Instant::now();
        if self.error_log.is_none_or(|t| now.duration_since(t).as_secs() >= 10) {
            tracing::warn!(error = %e, errors = self.counts.store_errors, "tail store operation failed");
            self.error_log = Some(now);
        }
    }

    /// Writes every trace in memory to the store (at a clean stop: they are decided after the next
    /// start, as if the agent had never stopped).
    pub fn spill_all(&mut self, now: u64) {
        let traces: Vec<TraceId> = self.hot.keys().copied().collect();
        self.spill(&traces, now);
        self.hot_order.iter_mut().for_each(VecDeque::clear);
    }

    /// Makes the store durable (at a clean stop).
    pub fn close(&mut self) {
        if let Err(e) = self.store.flush() {
            self.store_error(&e);
        }
        self.commit_journal();
    }

    /// Publishes gauges and counters.
    pub fn publish(&mut self, m: &Metrics) {
        metrics::set(&m.tail_traces_pending, self.pending_traces() as u64);
        metrics::set(&m.tail_traces_in_memory, self.hot.len() as u64);
        metrics::set(&m.tail_memory_bytes, self.hot_bytes);
        metrics::set(&m.tail_decided_in_memory, self.counts.decided_in_memory);
        metrics::set(&m.tail_spilled_traces, self.counts.spilled);
        metrics::set(&m.tail_fragments_joined, self.counts.fragments_joined);
        metrics::set(&m.tail_fragment_gap_max_ms, self.counts.fragment_gap_max_ns / 1_000_000);
        metrics::set(&m.tail_outbox_traces, self.partitions.values().map(|s| s.outbox as u64).sum());
        metrics::set(&m.tail_spans_buffered, self.spans_pending + self.hot_spans);
        metrics::set(&m.tail_buffered_bytes, self.buffered_bytes());
        // sled's figure walks its files (a stat per blob file): once every ten publications.
        if self.publications.is_multiple_of(10) {
            metrics::set(&m.tail_disk_bytes, self.store.disk_bytes());
        }
        self.publications = self.publications.wrapping_add(1);
        metrics::set(&m.tail_late_spans_kept, self.counts.late_kept);
        metrics::set(&m.tail_late_spans_dropped, self.counts.late_dropped);
        metrics::set(&m.tail_early_decisions, self.counts.early);
        metrics::set(&m.tail_store_errors, self.counts.store_errors);
        metrics::set(&m.tail_spans_lost, self.counts.spans_lost);
        metrics::set(&m.tail_resent_traces, self.counts.resent);
        if let Some(journal) = &self.journal {
            let counts = journal.counts();
            metrics::set(&m.tail_journal_bytes, journal.disk_bytes());
            metrics::set(&m.tail_journal_write_errors, counts.write_errors);
            metrics::set(&m.tail_journal_quarantined, counts.quarantined);
            metrics::set(&m.tail_journal_dropped_traces, counts.dropped_traces);
        }
        publish_decisions(&m.tail_decisions, &self.counts.decisions);
    }

    /// Counts spans lost before they reached the store (a batch that did not parse).
    pub fn count_lost(&mut self, spans: u64) {
        self.counts.spans_lost += spans;
    }

    /// Traces waiting for a decision, in memory or in the store.
    #[must_use]
    pub fn pending_traces(&self) -> usize {
        self.stored_pending_traces() + self.hot.len()
    }

    /// Kept traces the journal brought back undelivered, exported again.
    #[must_use]
    pub fn resent_traces(&self) -> u64 {
        self.counts.resent
    }

    /// Traces decided from memory, and traces written to the store to wait, so far.
    #[must_use]
    pub fn memory_counts(&self) -> (u64, u64) {
        (self.counts.decided_in_memory, self.counts.spilled)
    }

    /// Traces waiting for a decision in the store (spilled, or recovered after a restart).
    #[must_use]
    pub fn stored_pending_traces(&self) -> usize {
        self.pending.len() + self.group_traces as usize
    }

    /// Gives the store back (tests simulate a restart with it).
    #[must_use]
    pub fn into_store(self) -> S {
        self.store
    }
}

fn publish_decisions(target: &Mutex<BTreeMap<DecisionKey, u64>>, counts: &BTreeMap<DecisionKey, u64>) {
    if let Ok(mut t) = target.lock()
        && *t != *counts
    {
        t.clone_from(counts);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
    use opentelemetry_proto::tonic::resource::v1::Resource;
    use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span, Status, status::StatusCode};
    use prost::Message as _;
    use tracetap_storage::{DecisionRecord, MemoryStore};

    use super::*;
    use crate::tail::policy::{NamedPolicy, Policy};

    const S: u64 = 1_000_000_000;
    const T0: u64 = 1_800_000_000 * S;

    fn limits() -> Limits {
        Limits {
            grace_ns: 2 * S,
            decision_wait_ns: 30 * S,
            max_disk_bytes: 1 << 30,
            decision_cache: 1000,
            export_batch_spans: 512,
            spill_after_ns: 0,
            max_memory_bytes: 1 << 30,
        }
    }

    fn policies() -> PolicySet {
        PolicySet::new(vec![
            NamedPolicy { name: "errors".into(), policy: Policy::StatusCode { codes: vec![StatusCode::Error] } },
            NamedPolicy { name: "half".into(), policy: Policy::Probabilistic { threshold: 1 << 55 } },
        ])
    }

    fn trace(n: u8, lucky: bool) -> [u8; 16] {
        let mut id = [n; 16];
        id[9] = if lucky { 0xff } else { 0 };
        id
    }

    fn span(trace: [u8; 16], id: u8, kind: SpanKind, end: u64, error: bool) -> Span {
        Span {
            trace_id: trace.to_vec(),
            span_id: vec![id; 8],
            kind: kind as i32,
            start_time_unix_nano: end - 1_000_000,
            end_time_unix_nano: end,
            status: Some(Status { code: if error { StatusCode::Error as i32 } else { 0 }, message: String::new() }),
            ..Span::default()
        }
    }

    fn request(spans: Vec<Span>) -> ExportTraceServiceRequest {
        let resource = Resource {
            attributes: vec![KeyValue {
                key: "process.pid".into(),
                value: Some(AnyValue { value: Some(any_value::Value::IntValue(42)) }),
                ..KeyValue::default()
            }],
            ..Resource::default()
        };
        ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(resource),
                scope_spans: vec![ScopeSpans { spans, ..ScopeSpans::default() }],
                ..ResourceSpans::default()
            }],
        }
    }

    /// An exchange: SERVER span and its CLIENT span, ended at `end`.
    fn exchange(trace: [u8; 16], end: u64, error: bool) -> ExportTraceServiceRequest {
        request(vec![span(trace, 1, SpanKind::Server, end, error), span(trace, 2, SpanKind::Client, end, false)])
    }

    fn exported<S: TailStore>(engine: &mut Engine<S>) -> Vec<Span> {
        let mut spans = Vec::new();
        while let Some(out) = engine.take_export() {
            engine.delivered(&out.deliveries);
            for rs in ExportTraceServiceRequest::decode(out.request.as_slice()).unwrap().resource_spans {
                let pid = &rs.resource.as_ref().unwrap().attributes.last().unwrap().value;
                assert_eq!(pid.as_ref().unwrap().value, Some(any_value::Value::IntValue(42)));
                spans.extend(rs.scope_spans.into_iter().flat_map(|ss| ss.spans));
            }
        }
        spans
    }

    fn open(store: MemoryStore, now: u64) -> Engine<MemoryStore> {
        Engine::open(store, policies(), limits(), vec![("service.name".into(), "haproxy".into())], now).unwrap()
    }

    #[test]
    fn decides_after_the_grace_keeps_errors_and_the_lucky_half() {
        let mut e = open(MemoryStore::new(), T0);
        e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
        e.ingest(&exchange(trace(2, false), T0, false).encode_to_vec(), T0).unwrap();
        e.ingest(&exchange(trace(3, true), T0, false).encode_to_vec(), T0).unwrap();
        e.tick(T0 + S);
        assert_eq!(e.pending_traces(), 3, "grace not over");
        assert!(exported(&mut e).is_empty());
        e.tick(T0 + 2 * S);
        assert_eq!(e.pending_traces(), 0);
        let spans = exported(&mut e);
        assert_eq!(spans.len(), 4);
        let error = spans.iter().find(|s| s.trace_id == trace(1, false)).unwrap();
        assert_eq!(error.trace_state, "", "kept by a non-ratio policy: threshold unchanged");
        let lucky = spans.iter().find(|s| s.trace_id == trace(3, true)).unwrap();
        assert_eq!(lucky.trace_state, "ot=th:8", "kept by the ratio: threshold raised to it");
        assert!(!spans.iter().any(|s| s.trace_id == trace(2, false)));
        let decisions = &e.counts.decisions;
        assert_eq!(decisions[&DecisionKey { policy: Some("errors".to_owned()), kept: true }], 1);
        assert_eq!(decisions[&DecisionKey { policy: None, kept: false }], 1);
    }

    /// Memory first: spill after 5 s, a memory budget of `memory` bytes.
    fn memory_first(memory: u64) -> Limits {
        Limits { spill_after_ns: 5 * S, max_memory_bytes: memory, ..limits() }
    }

    #[test]
    fn a_complete_trace_is_decided_from_memory_and_never_stored() {
        let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(1 << 30), Vec::new(), T0).unwrap();
        e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
        e.ingest(&exchange(trace(2, false), T0, false).encode_to_vec(), T0).unwrap();
        e.tick(T0 + S);
        assert_eq!((e.pending_traces(), e.stored_pending_traces()), (2, 0), "in memory, grace not over");
        e.tick(T0 + 2 * S);
        assert_eq!(e.pending_traces(), 0);
        assert_eq!(exported(&mut e).len(), 2, "the error trace, both spans");
        assert_eq!((e.counts.decided_in_memory, e.counts.spilled), (2, 0));
        // A late span follows the decision remembered in memory.
        e.ingest(&request(vec![span(trace(1, false), 3, SpanKind::Client, T0, false)]).encode_to_vec(), T0 + 3 * S)
            .unwrap();
        e.tick(T0 + 3 * S);
        assert_eq!(exported(&mut e).len(), 1);
        let store = e.into_store();
        assert_eq!(store.disk_bytes(), 0, "nothing was written to the store");
        assert_eq!(store.recover().unwrap(), Recovered::default());
    }

    /// An engine over `store` with the journal in `dir`, memory first, as the agent runs.
    fn journaled(store: MemoryStore, dir: &std::path::Path, now: u64) -> Engine<MemoryStore> {
        let journal = Journal::open(dir, journal::Sync::None, now).unwrap();
        Engine::open_journaled(store, Some(journal), policies(), memory_first(1 << 30), Vec::new(), now).unwrap()
    }

    /// A crash: the engine is gone without closing; the store keeps what it holds (the memory
    /// store has no unflushed state), the journal what was committed.
    fn crash_and_restart(e: Engine<MemoryStore>, dir: &std::path::Path, now: u64) -> Engine<MemoryStore> {
        journaled(e.into_store(), dir, now)
    }

    #[test]
    fn traces_waiting_in_memory_survive_a_crash_through_the_journal_and_wait_out_their_grace() {
        let dir = tempfile::tempdir().unwrap();
        let mut e = journaled(MemoryStore::new(), dir.path(), T0);
        e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
        e.ingest(&exchange(trace(2, false), T0, false).encode_to_vec(), T0).unwrap();
        e.tick(T0 + S / 10);
        // Arrived after the last group commit: lost with the process, as the journal says.
        e.ingest(&exchange(trace(3, false), T0, true).encode_to_vec(), T0 + S / 5).unwrap();
        let mut e = crash_and_restart(e, dir.path(), T0 + S);
        assert_eq!(e.pending_traces(), 2, "both committed traces are back in memory");
        assert_eq!(e.stored_pending_traces(), 0);
        e.tick(T0 + S + S / 2);
        assert!(exported(&mut e).is_empty(), "the grace runs from the root's arrival before the crash");
        e.tick(T0 + 2 * S);
        let spans = exported(&mut e);
        assert_eq!(spans.len(), 2, "the error trace, whole");
        assert!(spans.iter().all(|s| s.trace_id == trace(1, false)));
        assert_eq!(e.resent_traces(), 0, "nothing had been exported");
        assert_eq!(e.store.recover().unwrap(), Recovered::default(), "the store was never used");
    }

    #[test]
    fn a_kept_trace_whose_export_was_not_reported_is_sent_again_once_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let mut e = journaled(MemoryStore::new(), dir.path(), T0);
        e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
        e.ingest(&exchange(trace(2, false), T0, true).encode_to_vec(), T0).unwrap();
        e.tick(T0 + 2 * S);
        let out = e.take_export().expect("both kept");
        assert_eq!(out.traces, 2);
        // The exporter reports trace 1 done; trace 2 is still in flight at the crash.
        let done: Vec<Delivery> = out
            .deliveries
            .iter()
            .copied()
            .filter(|d| matches!(d, Delivery::Journaled { trace: t, .. } if *t == trace(1, false)))
            .collect();
        assert_eq!(done.len(), 1);
        e.delivered(&done);
        e.tick(T0 + 2 * S + S / 10);
        let mut e = crash_and_restart(e, dir.path(), T0 + 3 * S);
        assert_eq!(e.resent_traces(), 1);
        let spans = exported(&mut e);
        assert_eq!(spans.len(), 2);
        assert!(spans.iter().all(|s| s.trace_id == trace(2, false)), "only the one not reported done");
        // Reported done this time: a second crash sends nothing again, and a late span follows.
        e.tick(T0 + 3 * S + S / 10);
        let mut e = crash_and_restart(e, dir.path(), T0 + 4 * S);
        assert_eq!(e.resent_traces(), 0);
        assert!(exported(&mut e).is_empty());
        e.ingest(&request(vec![span(trace(2, false), 3, SpanKind::Client, T0, false)]).encode_to_vec(), T0 + 4 * S)
            .unwrap();
        e.tick(T0 + 4 * S + S / 10);
        assert_eq!(exported(&mut e).len(), 1, "the late span follows the decision the journal kept");
    }

    #[test]
    fn a_dropped_trace_stays_dropped_and_a_spilled_one_is_the_stores_after_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let mut e = journaled(MemoryStore::new(), dir.path(), T0);
        e.ingest(&exchange(trace(1, false), T0, false).encode_to_vec(), T0).unwrap();
        // No root: it waits, and spills after 5 s.
        e.ingest(&request(vec![span(trace(2, false), 2, SpanKind::Client, T0, true)]).encode_to_vec(), T0).unwrap();
        e.tick(T0 + 2 * S);
        assert!(exported(&mut e).is_empty(), "trace 1 dropped");
        e.tick(T0 + 5 * S);
        assert_eq!(e.stored_pending_traces(), 1, "trace 2 spilled");
        e.tick(T0 + 5 * S + S / 10);
        let mut e = crash_and_restart(e, dir.path(), T0 + 6 * S);
        assert_eq!(e.pending_traces(), 1, "trace 2, from the store only: not twice");
        assert_eq!(e.stored_pending_traces(), 1);
        e.tick(T0 + 30 * S);
        let spans = exported(&mut e);
        assert_eq!(spans.len(), 1);
        assert_eq!(spans[0].trace_id, trace(2, false));
    }

    #[test]
    fn a_part_waiting_to_join_its_stored_trace_is_given_to_the_store_after_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let mut e = journaled(MemoryStore::new(), dir.path(), T0);
        let client = |id, at| request(vec![span(trace(1, false), id, SpanKind::Client, at, true)]).encode_to_vec();
        e.ingest(&client(2, T0), T0).unwrap();
        e.tick(T0 + 5 * S);
        assert_eq!(e.stored_pending_traces(), 1, "spilled: no root, undecided past spill_after");
        e.ingest(&client(3, T0 + 5 * S), T0 + 5 * S + S / 2).unwrap();
        assert!(e.hot.get(&trace(1, false)).is_some_and(|h| h.joins.is_some()), "the later part waits to join");
        e.tick(T0 + 5 * S + 6 * S / 10);
        let mut e = crash_and_restart(e, dir.path(), T0 + 6 * S);
        assert_eq!((e.pending_traces(), e.stored_pending_traces()), (1, 1), "one trace, in the store");
        e.tick(T0 + 30 * S);
        let mut ids: Vec<Vec<u8>> = exported(&mut e).into_iter().map(|s| s.span_id).collect();
        ids.sort();
        assert_eq!(ids, vec![vec![2; 8], vec![3; 8]], "both parts, once each");
    }

    #[test]
    fn a_trace_that_spilled_just_before_a_crash_is_not_doubled() {
        let dir = tempfile::tempdir().unwrap();
        let mut e = journaled(MemoryStore::new(), dir.path(), T0);
        let client = |id, at| request(vec![span(trace(1, false), id, SpanKind::Client, at, true)]).encode_to_vec();
        e.ingest(&client(2, T0), T0).unwrap();
        e.tick(T0 + S / 10);
        // The journal as it was before the spill: the crash comes after the store took the trace
        // and before the journal recorded the move.
        let before = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(dir.path()).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, before.path().join(path.file_name().unwrap())).unwrap();
        }
        e.tick(T0 + 5 * S);
        assert_eq!(e.stored_pending_traces(), 1);
        let mut e = journaled(e.into_store(), before.path(), T0 + 6 * S);
        assert_eq!((e.pending_traces(), e.stored_pending_traces()), (1, 1));
        e.tick(T0 + 30 * S);
        assert_eq!(exported(&mut e).len(), 1, "its one span, once");
    }

    #[test]
    fn the_journal_keeps_only_what_is_not_done_with() {
        let dir = tempfile::tempdir().unwrap();
        let mut e = journaled(MemoryStore::new(), dir.path(), T0);
        for n in 1..=50u8 {
            e.ingest(&exchange(trace(n, false), T0, n % 2 == 0).encode_to_vec(), T0).unwrap();
        }
        e.tick(T0 + S / 10);
        assert!(e.journal.as_ref().unwrap().disk_bytes() > 50 * 100);
        e.tick(T0 + 2 * S);
        exported(&mut e);
        e.tick(T0 + 3 * S);
        e.tick(T0 + 5 * S);
        let segments = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(segments, 1, "every trace decided and exported: only the active segment is left");
        assert!(e.journal.as_ref().unwrap().disk_bytes() < 4096);
    }

    #[test]
    fn a_trace_undecided_past_spill_after_waits_in_the_store_and_is_decided_once_after_a_restart() {
        let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(1 << 30), Vec::new(), T0).unwrap();
        // A CLIENT span only: no root, so the decision waits for the decision wait (30 s).
        let client = |id, at| request(vec![span(trace(1, false), id, SpanKind::Client, at, true)]).encode_to_vec();
        e.ingest(&client(2, T0), T0).unwrap();
        e.tick(T0 + 4 * S);
        assert_eq!(e.stored_pending_traces(), 0, "not yet");
        e.tick(T0 + 5 * S);
        assert_eq!((e.pending_traces(), e.stored_pending_traces(), e.counts.spilled), (1, 1, 1), "spilled");
        // The rest of a trace that just went to the store waits in memory to be decided with it;
        // at a clean stop it goes to the same partition.
        e.ingest(&client(3, T0 + 5 * S), T0 + 5 * S + 500_000_000).unwrap();
        assert_eq!(e.hot.get(&trace(1, false)).map(|h| h.joins), Some(Some(T0 / PARTITION_NS)));
        e.spill_all(T0 + 6 * S);
        e.flush_export();
        let mut e = Engine::open(e.into_store(), policies(), memory_first(1 << 30), Vec::new(), T0 + 7 * S).unwrap();
        assert_eq!(e.stored_pending_traces(), 1, "recovered from the store");
        e.tick(T0 + 29 * S);
        assert!(exported(&mut e).is_empty());
        e.tick(T0 + 30 * S);
        assert_eq!(exported(&mut e).len(), 2, "decided once, with both fragments");
        e.tick(T0 + 40 * S);
        assert!(exported(&mut e).is_empty());
    }

    #[test]
    fn past_the_memory_budget_the_oldest_traces_spill() {
        let one = u64::try_from(exchange(trace(1, false), T0, false).encode_to_vec().len()).unwrap();
        let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(one), Vec::new(), T0).unwrap();
        for n in 1..=3 {
            let root_less = request(vec![span(trace(n, false), 2, SpanKind::Client, T0, false)]);
            e.ingest(&root_less.encode_to_vec(), T0 + u64::from(n)).unwrap();
        }
        e.tick(T0 + 10);
        assert!(e.hot_bytes <= one, "under the budget after the tick");
        assert!(e.stored_pending_traces() >= 1);
        assert!(!e.hot.contains_key(&trace(1, false)), "the oldest went first");
        assert_eq!(e.pending_traces(), 3, "nothing lost");
    }

    #[test]
    fn over_the_budget_traces_still_without_their_root_spill_before_older_complete_ones() {
        // The budget: what two complete exchanges take in memory.
        let mut probe = Engine::open(MemoryStore::new(), policies(), memory_first(1 << 30), Vec::new(), T0).unwrap();
        for n in 1..=2 {
            probe.ingest(&exchange(trace(n, false), T0, false).encode_to_vec(), T0).unwrap();
        }
        let one = probe.hot_bytes / 2;
        let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(2 * one), Vec::new(), T0).unwrap();
        // Oldest: two complete exchanges (due within the grace); newest: one without its root.
        e.ingest(&exchange(trace(1, false), T0, false).encode_to_vec(), T0).unwrap();
        e.ingest(&exchange(trace(2, false), T0, false).encode_to_vec(), T0 + 1).unwrap();
        let root_less = request(vec![span(trace(3, false), 2, SpanKind::Client, T0, false)]);
        e.ingest(&root_less.encode_to_vec(), T0 + 2).unwrap();
        e.tick(T0 + 3);
        assert!(e.hot_bytes <= 2 * one);
        assert!(!e.hot.contains_key(&trace(3, false)), "the root-less trace went to the store");
        assert!(e.hot.contains_key(&trace(1, false)) && e.hot.contains_key(&trace(2, false)));
        // Still over with complete traces only: the oldest of them goes.
        for n in 4..=5 {
            e.ingest(&exchange(trace(n, false), T0, false).encode_to_vec(), T0 + 10).unwrap();
        }
        e.tick(T0 + 11);
        assert!(!e.hot.contains_key(&trace(1, false)), "then the oldest complete one");
        assert_eq!(e.pending_traces(), 5, "nothing lost");
    }

    #[test]
    fn the_grace_runs_from_the_roots_arrival_and_a_later_fragment_joins_it() {
        let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(1 << 30), Vec::new(), T0).unwrap();
        // Ended at T0, reached the tail stage 5 s later (a slow batch): the grace starts then.
        e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0 + 5 * S).unwrap();
        e.tick(T0 + 6 * S);
        assert_eq!(e.pending_traces(), 1, "grace (2 s) from arrival not over");
        let other_process = request(vec![span(trace(1, false), 7, SpanKind::Client, T0, false)]);
        e.ingest(&other_process.encode_to_vec(), T0 + 6 * S + 250_000_000).unwrap();
        assert_eq!((e.counts.fragments_joined, e.counts.fragment_gap_max_ns), (1, S + 250_000_000));
        e.tick(T0 + 7 * S);
        assert_eq!(exported(&mut e).len(), 3, "decided once, with the joined fragment");
        assert_eq!(e.counts.late_kept, 0);
    }

    #[test]
    fn a_raised_threshold_replaces_th_and_keeps_the_rest_of_the_tracestate() {
        let mut e = open(MemoryStore::new(), T0);
        let lucky = trace(3, true);
        let mut spans = vec![span(lucky, 1, SpanKind::Server, T0, false), span(lucky, 2, SpanKind::Client, T0, false)];
        spans[0].trace_state = "vendor=x,ot=rv:ffffffffffffff".into();
        spans[1].name = "kept as it was".into();
        e.ingest(&request(spans.clone()).encode_to_vec(), T0).unwrap();
        e.tick(T0 + 3 * S);
        let mut out = exported(&mut e);
        out.sort_by_key(|s| s.span_id.clone());
        assert_eq!(out[0], Span { trace_state: "ot=th:8;rv:ffffffffffffff,vendor=x".into(), ..spans[0].clone() });
        assert_eq!(out[1], Span { trace_state: "ot=th:8".into(), ..spans[1].clone() }, "the rest byte for byte");
    }

    #[test]
    fn traces_that_went_to_the_store_together_are_decided_together_from_one_read_with_no_entry_each() {
        let store = FailingDecisions::new(false);
        let reads = std::rc::Rc::clone(&store.reads);
        let mut e = Engine::open(store, policies(), limits(), Vec::new(), T0).unwrap();
        let batch: Vec<Span> = (1..=20u8)
            .flat_map(|n| {
                let t = trace(n, n % 2 == 0);
                [span(t, 1, SpanKind::Server, T0, n == 1), span(t, 2, SpanKind::Client, T0, false)]
            })
            .collect();
        e.ingest(&request(batch).encode_to_vec(), T0).unwrap();
        assert_eq!(
            (e.stored_pending_traces(), e.pending.len(), e.groups.len()),
            (20, 0, 1),
            "one group, no entry per trace"
        );
        e.tick(T0 + S);
        assert_eq!(reads.get(), 0, "not due");
        e.tick(T0 + 2 * S);
        assert_eq!(reads.get(), 1, "one read for all of them");
        assert_eq!(e.stored_pending_traces(), 0);
        let kept: BTreeSet<Vec<u8>> = exported(&mut e).into_iter().map(|s| s.trace_id).collect();
        let want: BTreeSet<Vec<u8>> =
            (1..=20u8).filter(|n| *n == 1 || n % 2 == 0).map(|n| trace(n, n % 2 == 0).to_vec()).collect();
        assert_eq!(kept, want, "the error trace and the lucky half");
        let recovered = e.into_store().inner.recover().unwrap();
        assert!(recovered.pending.is_empty());
        assert_eq!(recovered.decisions.len(), 20, "each decided once, on the record");
    }

    #[test]
    fn a_trace_without_its_root_does_not_hold_back_those_that_went_to_the_store_with_it() {
        let mut e = open(MemoryStore::new(), T0);
        let mut batch = vec![span(trace(9, false), 2, SpanKind::Client, T0, true)];
        batch.extend(exchange(trace(1, false), T0, true).resource_spans[0].scope_spans[0].spans.clone());
        e.ingest(&request(batch).encode_to_vec(), T0).unwrap();
        e.tick(T0 + 2 * S);
        let out = exported(&mut e);
        assert_eq!(out.len(), 2, "the complete trace at its grace");
        assert!(out.iter().all(|s| s.trace_id == trace(1, false)));
        e.tick(T0 + 30 * S);
        assert_eq!(exported(&mut e).len(), 1, "the root-less one at the decision wait");
    }

    #[test]
    fn a_fragment_arriving_just_after_its_trace_went_to_the_store_is_decided_with_it() {
        // A memory budget of one byte: the trace goes to the store at the first tick.
        let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(1), Vec::new(), T0).unwrap();
        // Neither error nor lucky: dropped, unless the decision sees the error in the later part.
        e.ingest(&exchange(trace(1, false), T0, false).encode_to_vec(), T0).unwrap();
        e.tick(T0 + 1);
        assert_eq!(e.stored_pending_traces(), 1);
        let other_process = request(vec![span(trace(1, false), 7, SpanKind::Client, T0, true)]);
        e.ingest(&other_process.encode_to_vec(), T0 + 100_000_000).unwrap();
        e.tick(T0 + 200_000_000);
        assert_eq!(e.hot.len(), 1, "waits in memory with the stored part, over the budget or not");
        e.tick(T0 + 3 * S);
        assert_eq!(exported(&mut e).len(), 3, "kept for the error in the later part, all three spans");
        assert_eq!(e.hot.len(), 0);
        assert_eq!((e.counts.fragments_joined, e.counts.late_kept), (1, 0));
        let decided: u64 = e.counts.decisions.values().sum();
        assert_eq!(decided, 1);
    }

    #[test]
    fn a_part_decided_first_decides_for_the_part_in_the_store() {
        let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(1 << 30), Vec::new(), T0).unwrap();
        // A root-less part goes to the store after 5 s and waits for the decision wait...
        let root_less = request(vec![span(trace(1, false), 2, SpanKind::Client, T0, false)]);
        e.ingest(&root_less.encode_to_vec(), T0).unwrap();
        e.tick(T0 + 5 * S);
        assert_eq!(e.stored_pending_traces(), 1);
        // ...and, past the join window, the root arrives with an error: decided from memory first.
        e.tick(T0 + 7 * S);
        e.ingest(&exchange(trace(1, false), T0 + 7 * S, true).encode_to_vec(), T0 + 7 * S).unwrap();
        assert_eq!(e.hot.get(&trace(1, false)).map(|h| h.joins), Some(None), "a part of its own");
        e.tick(T0 + 9 * S);
        assert_eq!(exported(&mut e).len(), 2, "the root's part, kept for its error");
        // The stored part follows that decision when due.
        e.tick(T0 + 30 * S);
        assert_eq!(exported(&mut e).len(), 1, "the stored part follows");
        assert_eq!(e.counts.late_kept, 1);
        let decided: u64 = e.counts.decisions.values().sum();
        assert_eq!(decided, 1, "one decision for the trace");
        let recovered = e.into_store().recover().unwrap();
        assert!(recovered.pending.is_empty() && recovered.outbox.is_empty(), "decided on the record, and delivered");
        assert!(matches!(recovered.decisions[..], [DecisionRecord { outcome: Outcome::Kept { .. }, .. }]));
    }

    /// A memory store whose `decide` fails while `fail` is set (and `append` too with `appends`),
    /// and that counts the reads of whole appends.
    struct FailingDecisions {
        inner: MemoryStore,
        fail: std::rc::Rc<std::cell::Cell<bool>>,
        appends: bool,
        reads: std::rc::Rc<std::cell::Cell<u32>>,
        /// Decisions taken before `decide` starts failing (until set again).
        decisions_left: std::rc::Rc<std::cell::Cell<u32>>,
        /// `flush` fails while set.
        fail_flush: std::rc::Rc<std::cell::Cell<bool>>,
    }

    impl FailingDecisions {
        fn new(appends: bool) -> Self {
            Self {
                inner: MemoryStore::new(),
                fail: std::rc::Rc::default(),
                appends,
                reads: std::rc::Rc::default(),
                decisions_left: std::rc::Rc::new(std::cell::Cell::new(u32::MAX)),
                fail_flush: std::rc::Rc::default(),
            }
        }
    }

    impl TailStore for FailingDecisions {
        fn append(&mut self, partition: Partition, fragments: &[Fragment<'_>]) -> Result<Vec<u64>, StoreError> {
            if self.appends && self.fail.get() {
                return Err(StoreError::Corrupt { what: "test: append refused", len: 0 });
            }
            self.inner.append(partition, fragments)
        }
        fn spans(&self, trace: &TraceId, range: &SpanRange) -> Result<Vec<Vec<u8>>, StoreError> {
            self.inner.spans(trace, range)
        }
        fn fragments(&self, partition: Partition, seq: u64) -> Result<Vec<AppendedFragment>, StoreError> {
            self.reads.set(self.reads.get() + 1);
            self.inner.fragments(partition, seq)
        }
        fn decide(&mut self, trace: &TraceId, spans: &SpanRange, outcome: Outcome) -> Result<u64, StoreError> {
            if self.fail.get() || self.decisions_left.get() == 0 {
                return Err(StoreError::Corrupt { what: "test: decide refused", len: 0 });
            }
            self.decisions_left.set(self.decisions_left.get() - 1);
            self.inner.decide(trace, spans, outcome)
        }
        fn commit(&mut self) -> Result<(), StoreError> {
            self.inner.commit()
        }
        fn exported(&mut self, trace: &TraceId, partition: Partition, seq: u64) -> Result<(), StoreError> {
            self.inner.exported(trace, partition, seq)
        }
        fn forget_decisions(&mut self, up_to: u64) -> Result<(), StoreError> {
            self.inner.forget_decisions(up_to)
        }
        fn drop_partition(&mut self, partition: Partition) -> Result<(), StoreError> {
            self.inner.drop_partition(partition)
        }
        fn recover(&self) -> Result<Recovered, StoreError> {
            self.inner.recover()
        }
        fn flush(&mut self) -> Result<(), StoreError> {
            if self.fail_flush.get() {
                return Err(StoreError::Corrupt { what: "test: flush refused", len: 0 });
            }
            self.inner.flush()
        }
        fn disk_bytes(&self) -> u64 {
            self.inner.disk_bytes()
        }
    }

    #[test]
    fn a_group_whose_decisions_fail_half_way_goes_on_from_there() {
        let store = FailingDecisions::new(false);
        let left = std::rc::Rc::clone(&store.decisions_left);
        left.set(2);
        let mut e = Engine::open(store, policies(), limits(), Vec::new(), T0).unwrap();
        let batch: Vec<Span> = (1..=4u8)
            .flat_map(|n| {
                [
                    span(trace(n, false), 1, SpanKind::Server, T0, true),
                    span(trace(n, false), 2, SpanKind::Client, T0, false),
                ]
            })
            .collect();
        e.ingest(&request(batch).encode_to_vec(), T0).unwrap();
        e.tick(T0 + 2 * S);
        assert_eq!(e.stored_pending_traces(), 2, "two decided, then the store refused");
        left.set(u32::MAX);
        e.tick(T0 + 2 * S + DECIDE_RETRY_NS);
        assert_eq!(e.stored_pending_traces(), 0);
        let kept: Vec<Vec<u8>> = exported(&mut e).into_iter().map(|s| s.trace_id).collect();
        assert_eq!(kept.len(), 8, "every error trace once, both spans");
        assert_eq!(kept.iter().collect::<BTreeSet<_>>().len(), 4);
        assert_eq!(e.into_store().inner.recover().unwrap().decisions.len(), 4, "each decided once");
    }

    #[test]
    fn a_trace_waiting_in_two_partitions_after_a_restart_is_decided_once_and_leaves_nothing_behind() {
        let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(1 << 30), Vec::new(), T0).unwrap();
        let root_less =
            |id, at| request(vec![span(trace(1, false), id, SpanKind::Client, at, id == 3)]).encode_to_vec();
        // A root-less part spills at 5 s (partition of T0); another arrives past the join window
        // and spills in its own partition.
        e.ingest(&root_less(2, T0), T0).unwrap();
        e.tick(T0 + 5 * S);
        e.tick(T0 + 7 * S);
        e.ingest(&root_less(3, T0 + 7 * S), T0 + 7 * S).unwrap();
        e.tick(T0 + 12 * S);
        assert_eq!(e.stored_pending_traces(), 2);
        e.flush_export();
        let mut e = Engine::open(e.into_store(), policies(), memory_first(1 << 30), Vec::new(), T0 + 13 * S).unwrap();
        e.tick(T0 + 40 * S);
        assert_eq!(e.stored_pending_traces(), 0);
        // The earlier part is decided at the start, from its own spans (no error, unlucky:
        // dropped); the later one follows that decision whatever it holds.
        assert!(exported(&mut e).is_empty());
        let decided: u64 = e.counts.decisions.values().sum();
        assert_eq!(decided, 1, "one decision, the other part follows it");
        assert_eq!((e.counts.early, e.counts.late_dropped), (1, 1));
        e.tick(T0 + 60 * S);
        let recovered = e.into_store().recover().unwrap();
        assert!(recovered.pending.is_empty() && recovered.partitions.is_empty(), "nothing left behind: {recovered:?}");
    }

    #[test]
    fn a_later_part_in_the_same_partition_follows_and_its_record_covers_both_parts() {
        let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(1), Vec::new(), T0).unwrap();
        // Part A, complete, goes to the store at once (budget) and is kept for its error at 2 s.
        e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
        e.tick(T0 + 1);
        // Part B, root-less, past the join window: to the store in the same partition.
        e.tick(T0 + 1_500_000_000);
        let b = request(vec![span(trace(1, false), 5, SpanKind::Client, T0, false)]);
        e.ingest(&b.encode_to_vec(), T0 + 1_500_000_000).unwrap();
        e.tick(T0 + 1_500_000_001);
        assert_eq!(e.stored_pending_traces(), 2);
        e.tick(T0 + 2 * S);
        assert_eq!(e.take_export().map(|x| x.spans), Some(2), "part A kept (not reported exported yet)");
        e.tick(T0 + 35 * S);
        assert_eq!(e.take_export().map(|x| x.spans), Some(1), "part B follows");
        // Neither export reported done: a crash now re-exports both parts from the one record.
        let recovered = e.into_store().recover().unwrap();
        let [entry] = recovered.outbox[..] else { panic!("one outbox entry: {:?}", recovered.outbox) };
        let store_spans = recovered.decisions.len();
        assert_eq!(store_spans, 1, "the partition's record of the trace, covering both parts");
        assert!(entry.spans.first < entry.spans.last);
    }

    #[test]
    fn a_store_that_cannot_flush_holds_back_only_the_journals_record_of_moves_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = FailingDecisions::new(false);
        let fail_flush = std::rc::Rc::clone(&store.fail_flush);
        let journal = Journal::open(dir.path(), journal::Sync::None, T0).unwrap();
        let mut e =
            Engine::open_journaled(store, Some(journal), policies(), memory_first(1 << 30), Vec::new(), T0).unwrap();
        // Trace 1 has no root: it spills at 5 s. Trace 2 is an error: kept when its grace is over.
        let client = request(vec![span(trace(1, false), 2, SpanKind::Client, T0, true)]).encode_to_vec();
        e.ingest(&client, T0).unwrap();
        e.tick(T0 + S / 10);
        fail_flush.set(true);
        e.ingest(&exchange(trace(2, false), T0 + 4 * S, true).encode_to_vec(), T0 + 4 * S).unwrap();
        e.tick(T0 + 5 * S);
        assert_eq!(e.stored_pending_traces(), 1, "trace 1 went to the store, which cannot flush");
        let journal = e.journal.as_ref().unwrap();
        assert!(journal.needs_store_flush(), "its move waits for the store");
        assert_eq!(journal.buffered(), 0, "the rest of the group commit was written all the same");
        e.tick(T0 + 6 * S);
        let spans = exported(&mut e);
        assert_eq!(spans.len(), 2, "trace 2 is exported: a store that cannot flush does not hold it back");
        e.tick(T0 + 6 * S + S / 10);
        fail_flush.set(false);
        let mut e = journaled(e.into_store().inner, dir.path(), T0 + 7 * S);
        assert_eq!((e.pending_traces(), e.stored_pending_traces(), e.resent_traces()), (1, 1, 0));
        e.tick(T0 + 30 * S);
        let spans = exported(&mut e);
        assert_eq!(spans.len(), 1, "trace 1 once, from the store");
        assert_eq!(spans[0].trace_id, trace(1, false));
    }

    #[test]
    fn a_decision_the_store_refuses_leaves_the_trace_pending_and_is_tried_again() {
        let store = FailingDecisions::new(false);
        let fail = std::rc::Rc::clone(&store.fail);
        fail.set(true);
        let mut e = Engine::open(store, policies(), limits(), Vec::new(), T0).unwrap();
        e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
        e.tick(T0 + 3 * S);
        assert_eq!(e.pending_traces(), 1, "still pending: nothing in memory changed");
        assert_eq!(e.spans_pending, 2);
        assert!(e.counts.decisions.is_empty() && e.counts.store_errors == 1);
        assert!(e.take_export().is_none());
        fail.set(false);
        e.tick(T0 + 3 * S + DECIDE_RETRY_NS);
        assert_eq!(e.pending_traces(), 0, "decided at the retry");
        assert_eq!(e.take_export().map(|x| x.spans), Some(2));
    }

    #[test]
    fn a_spill_the_store_refuses_leaves_the_traces_in_memory() {
        let store = FailingDecisions::new(true);
        let fail = std::rc::Rc::clone(&store.fail);
        fail.set(true);
        let mut e = Engine::open(store, policies(), memory_first(1 << 30), Vec::new(), T0).unwrap();
        let root_less = request(vec![span(trace(1, false), 2, SpanKind::Client, T0, true)]);
        e.ingest(&root_less.encode_to_vec(), T0).unwrap();
        e.tick(T0 + 5 * S);
        assert_eq!((e.hot.len(), e.stored_pending_traces(), e.counts.spans_lost), (1, 0, 0), "kept in memory");
        assert_eq!((e.hot_bytes > 0, e.hot_spans), (true, 1));
        e.tick(T0 + 30 * S);
        assert_eq!(exported(&mut e).len(), 1, "decided from memory at its decision wait");
    }

    #[test]
    fn a_trace_without_a_root_waits_for_the_decision_wait() {
        let mut e = open(MemoryStore::new(), T0);
        e.ingest(&request(vec![span(trace(1, false), 2, SpanKind::Client, T0, true)]).encode_to_vec(), T0).unwrap();
        e.tick(T0 + 29 * S);
        assert_eq!(e.pending_traces(), 1);
        e.tick(T0 + 30 * S);
        assert_eq!(exported(&mut e).len(), 1);
    }

    #[test]
    fn late_spans_follow_the_decision() {
        let mut e = open(MemoryStore::new(), T0);
        e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
        e.ingest(&exchange(trace(2, false), T0, false).encode_to_vec(), T0).unwrap();
        e.tick(T0 + 3 * S);
        assert_eq!(exported(&mut e).len(), 2);
        e.ingest(&request(vec![span(trace(1, false), 9, SpanKind::Client, T0, false)]).encode_to_vec(), T0 + 4 * S)
            .unwrap();
        e.ingest(&request(vec![span(trace(2, false), 9, SpanKind::Client, T0, false)]).encode_to_vec(), T0 + 4 * S)
            .unwrap();
        e.flush_export();
        let late = exported(&mut e);
        assert_eq!(late.len(), 1);
        assert_eq!(late[0].trace_id, trace(1, false));
        assert_eq!((e.counts.late_kept, e.counts.late_dropped), (1, 1));
    }

    #[test]
    fn a_restart_rearms_pending_traces_and_re_exports_the_outbox() {
        let mut e = open(MemoryStore::new(), T0);
        e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
        e.tick(T0 + 2 * S);
        let _undelivered = e.take_export().unwrap();
        e.ingest(&exchange(trace(2, false), T0 + S, true).encode_to_vec(), T0 + S).unwrap();
        let store = e.into_store();
        // Down for a minute: trace 2 is overdue and decided at once; trace 1 is exported again
        // because its export was never reported done.
        let mut e = open(store, T0 + 60 * S);
        assert_eq!(e.pending_traces(), 0);
        let spans = exported(&mut e);
        assert_eq!(spans.len(), 4);
        e.tick(T0 + 60 * S);
        let store = e.into_store();
        let r = store.recover().unwrap();
        assert!(r.outbox.is_empty() && r.pending.is_empty());
        assert_eq!(r.decisions.len(), 2, "each trace decided once");
        assert!(r.partitions.is_empty(), "finished partitions dropped");
    }

    #[test]
    fn a_recovered_trace_sharing_an_append_with_new_ones_is_decided_once() {
        let mut e = open(MemoryStore::new(), T0);
        let root_less = request(vec![span(trace(1, false), 2, SpanKind::Client, T0, true)]);
        e.ingest(&root_less.encode_to_vec(), T0).unwrap();
        let mut e = open(e.into_store(), T0 + S);
        assert_eq!(e.pending.len(), 1, "recovered, tracked on its own");
        // Its root and a new trace arrive in one batch: one append holds both.
        let mut batch = exchange(trace(1, false), T0 + S, false).resource_spans[0].scope_spans[0].spans.clone();
        batch.extend(exchange(trace(2, false), T0 + S, false).resource_spans[0].scope_spans[0].spans.clone());
        e.ingest(&request(batch).encode_to_vec(), T0 + S).unwrap();
        e.tick(T0 + 4 * S);
        assert_eq!(exported(&mut e).len(), 3, "trace 1, kept for its error, all three spans, once");
        let decided: u64 = e.counts.decisions.values().sum();
        assert_eq!(decided, 2);
        assert_eq!(e.into_store().recover().unwrap().decisions.len(), 2);
    }

    #[test]
    fn past_the_disk_bound_the_oldest_traces_are_decided_early() {
        let mut e =
            Engine::open(MemoryStore::new(), policies(), Limits { max_disk_bytes: 1, ..limits() }, Vec::new(), T0)
                .unwrap();
        e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
        e.ingest(&exchange(trace(2, false), T0 + 6 * S, true).encode_to_vec(), T0 + 6 * S).unwrap();
        e.tick(T0 + 6 * S);
        assert!(e.counts.early >= 1);
        assert_eq!(exported(&mut e).len(), 2 * (2 - e.pending_traces()));
    }

    #[test]
    fn the_decision_cache_is_bounded_on_disk_once_partitions_are_gone() {
        let mut e =
            Engine::open(MemoryStore::new(), policies(), Limits { decision_cache: 2, ..limits() }, Vec::new(), T0)
                .unwrap();
        for n in 1..=5 {
            e.ingest(&exchange(trace(n, false), T0, false).encode_to_vec(), T0).unwrap();
        }
        e.tick(T0 + 3 * S);
        assert_eq!(e.cache.len(), 2);
        let on_disk = |e: Engine<MemoryStore>| {
            let n = e.store.recover().unwrap().decisions.len();
            (n, e)
        };
        let (n, mut e) = on_disk(e);
        assert_eq!(n, 5, "forgetting waits until the partition is dropped, or the traces would turn pending again");
        e.tick(T0 + 6 * S);
        assert_eq!(on_disk(e).0, 2);
    }
}

//! The tail engine: waiting traces, their decision times and the partitions, over a [`TailStore`];
//! it uses the rooms beside it for a trace's spans in memory (`span_buf`), the latest decisions
//! (`decision_cache`), the export requests being assembled (`outgoing`) and the write-ahead
//! journal of what waits in memory (`journal`). Single-threaded (owned by the tail thread); time
//! is passed in, so tests drive it with a fake clock and a [`tracetap_storage::MemoryStore`]. See
//! the module note of `tail` for the invariants.
//!
//! This file holds the engine's state, its batches in ([`Engine::ingest`]) and its clock
//! ([`Engine::tick`], which orders what the rooms below do); each room opens with its own rules:
//! `hot` (traces in memory: budget, due times, order), `memory` (holding, deciding and spilling
//! them), `stored` (traces waiting in the store: appends, groups, joins, the disk bound),
//! `stored_decisions` (deciding those), `recovery` (a start from the store and the journal),
//! `outbound` (export requests, deliveries, the journal's group commits), `counts`.
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

use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use rustc_hash::FxHashMap;
use tracetap_proxy::trace_context::parse_ot_tracestate;
use tracetap_storage::{Partition, SpanRange, StoreError, TailStore, TraceId};

mod counts;
mod hot;
mod memory;
mod outbound;
mod recovery;
mod stored;
mod stored_decisions;

use counts::{Counts, publish_decisions};
use hot::{Hot, HotTraces};

use super::decision_cache::DecisionCache;
use super::journal::{self, Journal};
use super::outgoing::Outgoing;
pub use super::outgoing::{Delivery, Export};
use super::policy::PolicySet;
use super::span_buf::SpanBuf;
use super::wire::{self, WireError};
use crate::metrics::{self, Metrics};

/// Width of a partition: traces first seen within the same 5 s share one.
const PARTITION_NS: u64 = 5_000_000_000;
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

#[derive(Debug)]
pub struct Engine<S> {
    store: S,
    policies: PolicySet,
    limits: Limits,
    pending: FxHashMap<TraceId, Pending>,
    /// Traces in memory (never written to the store).
    hot: HotTraces,
    /// Due times of traces in the store (stale entries are skipped when popped).
    deadlines: BinaryHeap<Reverse<(u64, TraceId)>>,
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
                && !self.hot.contains(&trace)
                && !self.memory_off()
            {
                // Went to the store moments ago: this part waits in memory to be decided with it.
                self.hold(trace, Hot { joins: Some(partition), ..fragment });
            } else if self.memory_off() && !self.hot.contains(&trace) {
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

    /// Decides the traces that are due (in memory, recovered from the store, in groups), spills
    /// what must wait, decides the soonest due early when the store is over its bound, and drops
    /// partitions with nothing left to decide or export.
    pub fn tick(&mut self, now: u64) {
        self.now = self.now.max(now);
        let (mut to_decide, mut to_spill) = (Vec::new(), Vec::new());
        self.hot.take_due(now, &self.limits, &mut to_decide, &mut to_spill);
        for trace in to_decide {
            self.decide_hot(trace, now);
        }
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
        let over_budget = self.hot.pick_over_budget(self.limits.max_memory_bytes);
        self.spill(&over_budget, now);
        self.hot.compact_order();
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

    fn store_error(&mut self, e: &StoreError) {
        self.counts.store_errors += 1;
        let now = std::time::Instant::now();
        if self.error_log.is_none_or(|t| now.duration_since(t).as_secs() >= 10) {
            tracing::warn!(error = %e, errors = self.counts.store_errors, "tail store operation failed");
            self.error_log = Some(now);
        }
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
        metrics::set(&m.tail_memory_bytes, self.hot.bytes());
        metrics::set(&m.tail_decided_in_memory, self.counts.decided_in_memory);
        metrics::set(&m.tail_spilled_traces, self.counts.spilled);
        metrics::set(&m.tail_fragments_joined, self.counts.fragments_joined);
        metrics::set(&m.tail_fragment_gap_max_ms, self.counts.fragment_gap_max_ns / 1_000_000);
        metrics::set(&m.tail_outbox_traces, self.partitions.values().map(|s| s.outbox as u64).sum());
        metrics::set(&m.tail_spans_buffered, self.spans_pending + self.hot.spans());
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

#[cfg(test)]
mod tests;

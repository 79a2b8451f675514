//! Traces in memory ([`HotTraces`]): their spans, the bytes and spans they hold against the memory
//! budget, their due times (on a timing wheel) and their arrival order, by whether their root span
//! arrived, for spilling the oldest. Invariants: `bytes` and `spans` are the sums over the traces
//! held; every trace held has a due time in the wheel (stale entries, whose trace left or whose due
//! time moved, are skipped when they come up, and a trace not due yet is armed again); the order
//! queues may hold stale entries (a trace that left, or moved to the other queue), skipped when
//! popped and dropped in one pass once they outnumber the rest ([`HotTraces::compact_order`]).

use std::collections::VecDeque;

use rustc_hash::FxHashMap;
use tracetap_storage::{Partition, TraceId};

use super::Limits;
use crate::tail::journal::Held;
use crate::tail::policy::SpanFacts;
use crate::tail::span_buf::SpanBuf;
use crate::tail::wheel::Wheel;

/// Resolution of the due times of traces in memory: a trace is decided at the first tick at least
/// its due time rounded up to this.
const DUE_WIDTH_NS: u64 = 10_000_000;

/// A trace in memory: its spans, and what decides when it is due.
#[derive(Debug)]
pub(super) struct Hot {
    pub(super) first_seen: u64,
    /// When the root span arrived (the later of its end and its arrival: the grace runs from
    /// arrival); 0: it has not (here). Called "root ended" in the store.
    pub(super) root_ended: u64,
    /// The `rv` of the first span's `tracestate` that has one.
    pub(super) randomness: Option<u64>,
    pub(super) spans: SpanBuf,
    /// A later fragment of a trace that went to the store moments before (into this partition):
    /// it waits here to be decided with the stored part ([`super::Engine::decide_group`]), and is decided
    /// on its own only if that has not happened by the decision wait. It never spills.
    pub(super) joins: Option<Partition>,
    /// The journal segments its spans are in (`None`: not journaled).
    pub(super) journal: Option<Held>,
}

impl Hot {
    pub(super) fn decision_due(&self, limits: &Limits) -> u64 {
        if self.joins.is_some() {
            return self.first_seen.saturating_add(limits.decision_wait_ns);
        }
        limits.decision_due(self.first_seen, self.root_ended)
    }

    pub(super) fn spill_due(&self, limits: &Limits) -> u64 {
        if self.joins.is_some() {
            return u64::MAX;
        }
        self.first_seen.saturating_add(limits.spill_after_ns)
    }

    /// What the policies read of its spans (taken when they arrived: nothing is parsed).
    pub(super) fn facts(&self) -> impl Iterator<Item = SpanFacts<'_>> {
        self.spans.entries().map(|(t, record)| SpanFacts {
            start_unix_ns: t.start_unix_ns,
            end_unix_ns: t.end_unix_ns,
            status: t.status,
            span: &record[4..],
        })
    }

    /// When something is next to be done with it: decided, or spilled.
    pub(super) fn next_due(&self, limits: &Limits) -> u64 {
        self.decision_due(limits).min(self.spill_due(limits))
    }
}

/// The traces in memory, with what the engine needs to know of them at once.
#[derive(Debug)]
pub(super) struct HotTraces {
    traces: FxHashMap<TraceId, Hot>,
    /// Their span bytes (as allocated), and spans.
    bytes: u64,
    spans: u64,
    /// In arrival order, for spilling the oldest: `[0]` those whose root span has not arrived,
    /// `[1]` those whose has (a trace moves when its root arrives).
    order: [VecDeque<TraceId>; 2],
    /// Due times (next decision or spill), apart from the stored traces' due times: the disk
    /// bound's early decisions walk the store's traces only.
    deadlines: Wheel<TraceId>,
    /// The traces [`Wheel::take_due`] gives a tick (kept to reuse its allocation).
    due_scratch: Vec<TraceId>,
}

impl HotTraces {
    pub(super) fn new(now: u64) -> Self {
        Self {
            traces: FxHashMap::default(),
            bytes: 0,
            spans: 0,
            order: [VecDeque::new(), VecDeque::new()],
            deadlines: Wheel::new(DUE_WIDTH_NS, now),
            due_scratch: Vec::new(),
        }
    }

    pub(super) fn get(&self, trace: &TraceId) -> Option<&Hot> {
        self.traces.get(trace)
    }

    pub(super) fn contains(&self, trace: &TraceId) -> bool {
        self.traces.contains_key(trace)
    }

    pub(super) fn len(&self) -> usize {
        self.traces.len()
    }

    /// Bytes of spans held (what the memory budget counts).
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(super) fn spans(&self) -> u64 {
        self.spans
    }

    /// Keeps a fragment in memory (`held`: where the journal wrote it), joining the trace's part
    /// already here, and arms the trace's due time. Returns how long after the trace's first
    /// fragment this one came, when there was one.
    pub(super) fn hold(
        &mut self,
        trace: TraceId,
        mut fragment: Hot,
        held: Option<Held>,
        limits: &Limits,
    ) -> Option<u64> {
        self.spans += fragment.spans.len() as u64;
        // One due time on the wheel per change of it: usually one push and one take per trace.
        match self.traces.entry(trace) {
            std::collections::hash_map::Entry::Occupied(e) => {
                let hot = e.into_mut();
                let gap = fragment.first_seen.saturating_sub(hot.first_seen);
                let before = hot.next_due(limits);
                if hot.root_ended == 0 && fragment.root_ended != 0 {
                    self.order[1].push_back(trace);
                }
                hot.journal = held.or(hot.journal);
                let held = hot.spans.byte_len();
                hot.spans.append(fragment.spans);
                // What the buffer holds now (it grows, or takes the fragment's).
                self.bytes = self.bytes - held + hot.spans.byte_len();
                hot.root_ended = hot.root_ended.max(fragment.root_ended);
                hot.randomness = hot.randomness.or(fragment.randomness);
                let due = hot.next_due(limits);
                if due != before {
                    self.deadlines.push(due, trace);
                }
                Some(gap)
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                if fragment.joins.is_none() {
                    self.order[usize::from(fragment.root_ended != 0)].push_back(trace);
                }
                self.bytes += fragment.spans.byte_len();
                fragment.journal = held;
                let hot = e.insert(fragment);
                self.deadlines.push(hot.next_due(limits), trace);
                None
            }
        }
    }

    /// Takes a trace out of memory.
    pub(super) fn take(&mut self, trace: &TraceId) -> Option<Hot> {
        let hot = self.traces.remove(trace)?;
        self.bytes -= hot.spans.byte_len();
        self.spans -= hot.spans.len() as u64;
        Some(hot)
    }

    /// Puts a trace taken out of memory back, due as it was.
    pub(super) fn put_back(&mut self, trace: TraceId, hot: Hot, limits: &Limits) {
        self.bytes += hot.spans.byte_len();
        self.spans += hot.spans.len() as u64;
        self.deadlines.push(hot.next_due(limits), trace);
        self.traces.insert(trace, hot);
    }

    /// Puts back a trace the store refused to take: in its arrival queue again, and due for its
    /// decision (it is not spilled again).
    pub(super) fn put_back_refused(&mut self, trace: TraceId, hot: Hot, limits: &Limits) {
        if hot.joins.is_none() {
            self.order[usize::from(hot.root_ended != 0)].push_back(trace);
        }
        self.bytes += hot.spans.byte_len();
        self.spans += hot.spans.len() as u64;
        self.deadlines.push(hot.decision_due(limits), trace);
        self.traces.insert(trace, hot);
    }

    /// The traces due by `now`: those to decide go to `decide`, those to spill to `spill`; a trace
    /// not due (a stale entry whose due time moved later, or the wall clock stepped back) is armed
    /// again, so that no trace is left without a due time.
    pub(super) fn take_due(&mut self, now: u64, limits: &Limits, decide: &mut Vec<TraceId>, spill: &mut Vec<TraceId>) {
        let mut due = std::mem::take(&mut self.due_scratch);
        self.deadlines.take_due(now, &mut due);
        for trace in due.drain(..) {
            // Stale entries (the trace left memory) are skipped.
            let Some(hot) = self.traces.get(&trace) else { continue };
            if hot.decision_due(limits) <= now {
                decide.push(trace);
            } else if hot.spill_due(limits) <= now {
                spill.push(trace);
            } else {
                self.deadlines.push(hot.next_due(limits), trace);
            }
        }
        self.due_scratch = due;
    }

    /// Over the memory budget (`max_bytes`): picks traces to go to the store, oldest first among
    /// those whose root span has not arrived (they will wait longest: long requests, streams),
    /// then the oldest of the others (due within the grace) only if that is not enough.
    pub(super) fn pick_over_budget(&mut self, max_bytes: u64) -> Vec<TraceId> {
        let mut over = self.bytes.saturating_sub(max_bytes);
        let mut picked = Vec::new();
        for (class, order) in self.order.iter_mut().enumerate() {
            while over > 0 {
                let Some(trace) = order.pop_front() else { break };
                // Skipped: traces that left memory, or moved to the other class.
                if let Some(hot) = self.traces.get(&trace)
                    && usize::from(hot.root_ended != 0) == class
                {
                    over = over.saturating_sub(hot.spans.byte_len());
                    picked.push(trace);
                }
            }
        }
        picked
    }

    /// Drops the arrival queues' stale entries in one pass, once they outnumber the rest.
    pub(super) fn compact_order(&mut self) {
        for (class, order) in self.order.iter_mut().enumerate() {
            if order.len() > 2 * self.traces.len() + 64 {
                let traces = &self.traces;
                order.retain(|t| traces.get(t).is_some_and(|h| usize::from(h.root_ended != 0) == class));
            }
        }
    }

    /// Every trace held.
    pub(super) fn traces(&self) -> Vec<TraceId> {
        self.traces.keys().copied().collect()
    }

    /// Empties the arrival queues (everything left memory, or is leaving it for good).
    pub(super) fn clear_order(&mut self) {
        self.order.iter_mut().for_each(VecDeque::clear);
    }
}

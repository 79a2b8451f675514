//! A start: the engine opened over what the store recovered (pending traces re-armed from their
//! persisted times, the outbox queued for export again, the decision cache rebuilt) and over what
//! the journal replayed after a crash (undecided traces wait out the rest of their grace, kept
//! traces not reported exported are sent again and counted, other decisions remembered). A trace
//! both hold is the store's: the journal only gives it the spans the store lacks.

use std::collections::{BTreeMap, BinaryHeap, VecDeque};

use rustc_hash::FxHashMap;
use tracetap_proxy::trace_context::parse_ot_tracestate;
use tracetap_storage::{Outcome, Recovered, StoreError, TailStore};

use super::counts::Counts;
use super::hot::{Hot, HotTraces};
use super::{Engine, Limits, PARTITION_NS, Pending};
use crate::tail::decision_cache::{Cached, DecisionCache};
use crate::tail::journal::{self, Journal, Replayed};
use crate::tail::outgoing::{Delivery, Outgoing};
use crate::tail::policy::PolicySet;
use crate::tail::span_buf::SpanBuf;
use crate::tail::wire;

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
            hot: HotTraces::new(now),
            deadlines: BinaryHeap::new(),
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
    pub(super) fn take_back(&mut self, replayed: Replayed, now: u64) -> Result<(), StoreError> {
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
    pub(super) fn journaled_spans(&mut self, r: &journal::ReplayedTrace) -> Option<SpanBuf> {
        let spans = SpanBuf::parse(&r.spans);
        if spans.is_none() {
            // Its frame's checksum held, so the agent wrote it so: counted, never trusted.
            self.counts.spans_lost += 1;
        }
        spans
    }

    pub(super) fn rearm(&mut self, recovered: &Recovered, now: u64) -> Result<(), StoreError> {
        for partition in &recovered.partitions {
            self.partitions.entry(*partition).or_default();
        }
        // Decisions first: a recovered part of a trace decided before follows that decision.
        for d in &recovered.decisions {
            let (kept, threshold) = match d.outcome {
                Outcome::Kept { threshold } => (true, threshold),
                Outcome::Dropped => (false, 0),
            };
            self.cache.remember(d.trace, Cached { partition: d.spans.partition, seq: d.seq, kept, threshold });
        }
        // The outbox before anything this start decides: the store's exported marker of a trace
        // holds the latest of its decisions reported exported, so a trace's kept decisions must
        // reach the exporter in the order they were made (a pending part that follows below gets
        // a newer record; exported first, it would take the older one out of the outbox).
        for entry in &recovered.outbox {
            let spans = self.store.spans(&entry.trace, &entry.spans)?;
            self.partitions.entry(entry.spans.partition).or_default().outbox += 1;
            self.queue_kept(spans.iter().map(Vec::as_slice), entry.threshold);
            self.deliver_decided(Delivery::Stored {
                trace: entry.trace,
                partition: entry.spans.partition,
                seq: entry.seq,
            });
        }
        for (trace, p) in &recovered.pending {
            if self.pending.contains_key(trace) {
                // Another part of the trace waits too (in another partition, or in the same one
                // with a decided append between them): the earlier part is decided now, and this
                // one follows it when due.
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
        self.flush_export();
        Ok(())
    }
}

//! Traces in memory, as the engine moves them: held (journaled first), decided there when due
//! (nothing written to the store, nothing parsed), or spilled to the store when they must wait
//! longer or memory is over its budget (grouped by partition; what the store refuses stays in
//! memory and is decided there). What memory holds and when it is due is [`super::hot`]'s.

use std::collections::BTreeMap;

use tracetap_storage::{Partition, TailStore, TraceId};

use super::{Engine, Hot, PARTITION_NS};
use crate::sampling::randomness;
use crate::tail::decision_cache::Cached;
use crate::tail::outgoing::Delivery;
use crate::tail::policy::{SpanFacts, TraceData};

impl<S: TailStore> Engine<S> {
    /// Every trace waits in the store (`TRACETAP_TAIL_SPILL_AFTER=0` or
    /// `TRACETAP_TAIL_MAX_MEMORY_BYTES=0`).
    pub(super) fn memory_off(&self) -> bool {
        self.limits.spill_after_ns == 0 || self.limits.max_memory_bytes == 0
    }

    /// Keeps a fragment in memory, journaled, arming its trace's due times.
    pub(super) fn hold(&mut self, trace: TraceId, fragment: Hot) {
        let held = self.journal.as_mut().map(|j| {
            let before = self.hot.get(&trace).and_then(|h| h.journal);
            j.fragment(&trace, fragment.first_seen, fragment.root_ended, &fragment.spans.bytes, before)
        });
        if let Some(gap) = self.hot.hold(trace, fragment, held, &self.limits) {
            self.counts.fragments_joined += 1;
            self.counts.fragment_gap_max_ns = self.counts.fragment_gap_max_ns.max(gap);
        }
    }

    /// Writes hot traces to the store, where they wait as pending traces: grouped by partition, as
    /// appends from the capture thread are (sled's cost is per insert).
    pub(super) fn spill(&mut self, traces: &[TraceId], now: u64) {
        let mut by_partition: BTreeMap<Partition, Vec<(TraceId, Hot)>> = BTreeMap::new();
        for trace in traces {
            let Some(hot) = self.hot.take(trace) else { continue };
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
                        self.hot.put_back_refused(trace, hot, &self.limits);
                    }
                }
            }
        }
    }

    /// Decides a trace held in memory: nothing is written to the store, and nothing parsed.
    pub(super) fn decide_hot(&mut self, trace: TraceId, now: u64) {
        let Some(hot) = self.hot.take(&trace) else { return };
        let facts: Vec<SpanFacts<'_>> = hot.facts().collect();
        let verdict = self.policies.evaluate(&TraceData {
            spans: &facts,
            randomness: hot.randomness.unwrap_or_else(|| randomness(&trace)),
            now_second: now / 1_000_000_000,
        });
        let (keep, threshold) = (verdict.keep, verdict.min_threshold);
        self.counts.decision(verdict.policy, keep);
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

    /// Writes every trace in memory to the store (at a clean stop: they are decided after the next
    /// start, as if the agent had never stopped).
    pub fn spill_all(&mut self, now: u64) {
        let traces = self.hot.traces();
        self.spill(&traces, now);
        self.hot.clear_order();
    }
}

//! An in-memory [`TailStore`]: the model the sled store is tested against, and the baseline its
//! benchmark compares with. It loses everything on restart, like the OpenTelemetry Collector's
//! in-memory tail sampler.

use std::collections::BTreeMap;

use crate::{
    AppendedFragment, DecisionRecord, Fragment, OutboxEntry, Outcome, Partition, PendingRuns, Recovered, SpanRange,
    StoreError, TailStore, TraceId, covered,
};

/// A stored fragment: trace, first seen, root ended, spans.
type StoredFragment = (TraceId, u64, Option<u64>, Vec<Vec<u8>>);

#[derive(Debug, Default, Clone)]
pub struct MemoryStore {
    /// Every decision of each trace in each partition, in decision order, until forgotten.
    decisions: BTreeMap<(Partition, TraceId), Vec<DecisionRecord>>,
    /// Exported markers: every kept decision of the trace up to this sequence was exported.
    exported: BTreeMap<(Partition, TraceId), u64>,
    partitions: BTreeMap<Partition, BTreeMap<u64, Vec<StoredFragment>>>,
    next_append: u64,
    next_decision: u64,
    bytes: u64,
}

impl MemoryStore {
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }
}

impl TailStore for MemoryStore {
    fn append(&mut self, partition: Partition, fragments: &[Fragment<'_>]) -> Result<Vec<u64>, StoreError> {
        self.next_append += 1;
        let stored = fragments
            .iter()
            .map(|f| {
                self.bytes += f.spans.iter().map(|s| s.len() as u64).sum::<u64>();
                (f.trace, f.first_seen_unix_ns, f.root_ended_unix_ns, f.spans.iter().map(|s| s.to_vec()).collect())
            })
            .collect();
        self.partitions.entry(partition).or_default().insert(self.next_append, stored);
        Ok(vec![self.next_append; fragments.len()])
    }

    fn spans(&self, trace: &TraceId, range: &SpanRange) -> Result<Vec<Vec<u8>>, StoreError> {
        let Some(appends) = self.partitions.get(&range.partition) else { return Ok(Vec::new()) };
        Ok(appends
            .range(range.first..=range.last.max(range.first))
            .flat_map(|(_, fragments)| fragments)
            .filter(|(t, ..)| t == trace)
            .flat_map(|(.., spans)| spans.iter().cloned())
            .collect())
    }

    fn fragments(&self, partition: Partition, seq: u64) -> Result<Vec<AppendedFragment>, StoreError> {
        let stored = self.partitions.get(&partition).and_then(|appends| appends.get(&seq));
        Ok(stored
            .into_iter()
            .flatten()
            .map(|(trace, first_seen, root_ended, spans)| AppendedFragment {
                trace: *trace,
                first_seen_unix_ns: *first_seen,
                root_ended_unix_ns: *root_ended,
                spans: spans.clone(),
            })
            .collect())
    }

    fn decide(&mut self, trace: &TraceId, spans: &SpanRange, outcome: Outcome) -> Result<u64, StoreError> {
        self.next_decision += 1;
        let record = DecisionRecord { seq: self.next_decision, trace: *trace, spans: *spans, outcome };
        self.decisions.entry((spans.partition, *trace)).or_default().push(record);
        Ok(self.next_decision)
    }

    fn commit(&mut self) -> Result<(), StoreError> {
        Ok(())
    }

    fn exported(&mut self, trace: &TraceId, partition: Partition, seq: u64) -> Result<(), StoreError> {
        let marker = self.exported.entry((partition, *trace)).or_default();
        *marker = (*marker).max(seq);
        Ok(())
    }

    fn forget_decisions(&mut self, up_to: u64) -> Result<(), StoreError> {
        for (&(partition, _), of_trace) in &self.decisions {
            for d in of_trace {
                assert!(
                    d.seq > up_to || !self.partitions.contains_key(&partition),
                    "a decision was forgotten while its partition {partition} still holds the trace: it would turn pending again"
                );
            }
        }
        for of_trace in self.decisions.values_mut() {
            of_trace.retain(|d| d.seq > up_to);
        }
        self.decisions.retain(|_, of_trace| !of_trace.is_empty());
        self.exported.retain(|_, marker| *marker > up_to);
        Ok(())
    }

    fn drop_partition(&mut self, partition: Partition) -> Result<(), StoreError> {
        if let Some(appends) = self.partitions.remove(&partition) {
            let freed: usize = appends.values().flatten().flat_map(|(.., spans)| spans).map(Vec::len).sum();
            self.bytes -= freed as u64;
        }
        Ok(())
    }

    fn recover(&self) -> Result<Recovered, StoreError> {
        let mut out = Recovered { partitions: self.partitions.keys().copied().collect(), ..Recovered::default() };
        let mut pending = PendingRuns::default();
        for (&partition, appends) in &self.partitions {
            for (&seq, fragments) in appends {
                for &(trace, first_seen, root_ended, _) in fragments {
                    let covered = self.decisions.get(&(partition, trace)).is_some_and(|of| covered(of, seq));
                    pending.fragment(partition, trace, seq, first_seen, root_ended, covered);
                }
            }
        }
        out.pending = pending.into_sorted();
        for (key, of_trace) in &self.decisions {
            let marker = self.exported.get(key).copied().unwrap_or(0);
            out.decisions.extend(of_trace.iter().copied());
            out.outbox.extend(of_trace.iter().filter(|d| d.seq > marker).filter_map(OutboxEntry::of));
        }
        out.decisions.sort_by_key(|d| d.seq);
        Ok(out)
    }

    fn flush(&mut self) -> Result<(), StoreError> {
        Ok(())
    }

    fn disk_bytes(&self) -> u64 {
        self.bytes
    }
}

//! An in-memory [`TailStore`]: the model the sled store is tested against, and the baseline its
//! benchmark compares with. It loses everything on restart, like the OpenTelemetry Collector's
//! in-memory tail sampler.

use std::collections::BTreeMap;

use crate::{
    AppendedFragment, DecisionRecord, Fragment, OutboxEntry, Outcome, Partition, PendingTrace, Recovered, SpanRange,
    StoreError, TailStore, TraceId,
};

/// A decided trace's record (see the crate note).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Decided {
    seq: u64,
    outcome: Outcome,
    spans: SpanRange,
    exported: bool,
}

/// A stored fragment: trace, first seen, root ended, spans.
type StoredFragment = (TraceId, u64, Option<u64>, Vec<Vec<u8>>);

#[derive(Debug, Default, Clone)]
pub struct MemoryStore {
    /// The latest decision of each trace in each partition.
    decided: BTreeMap<(Partition, TraceId), Decided>,
    /// Every decision's sequence and span range, until forgotten: what they cover is decided.
    coverage: BTreeMap<(Partition, TraceId), Vec<(u64, SpanRange)>>,
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
        let record = Decided { seq: self.next_decision, outcome, spans: *spans, exported: false };
        self.decided.insert((spans.partition, *trace), record);
        self.coverage.entry((spans.partition, *trace)).or_default().push((self.next_decision, *spans));
        Ok(self.next_decision)
    }

    fn commit(&mut self) -> Result<(), StoreError> {
        Ok(())
    }

    fn exported(&mut self, trace: &TraceId, partition: Partition, seq: u64) -> Result<(), StoreError> {
        if let Some(d) = self.decided.get_mut(&(partition, *trace))
            && d.seq == seq
        {
            d.exported = true;
        }
        Ok(())
    }

    fn forget_decisions(&mut self, up_to: u64) -> Result<(), StoreError> {
        for (&(partition, _), d) in &self.decided {
            assert!(
                d.seq > up_to || !self.partitions.contains_key(&partition),
                "a decision was forgotten while its partition {partition} still holds the trace: it would turn pending again"
            );
        }
        self.decided.retain(|_, d| d.seq > up_to);
        for ranges in self.coverage.values_mut() {
            ranges.retain(|&(seq, _)| seq > up_to);
        }
        self.coverage.retain(|_, ranges| !ranges.is_empty());
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
        let mut pending: BTreeMap<(Partition, TraceId), PendingTrace> = BTreeMap::new();
        for (&partition, appends) in &self.partitions {
            for (&seq, fragments) in appends {
                for &(trace, first_seen, root_ended, _) in fragments {
                    let ranges = self.coverage.get(&(partition, trace));
                    if ranges.is_some_and(|r| r.iter().any(|(_, range)| range.covers(seq))) {
                        continue;
                    }
                    let merged = PendingTrace::merge(
                        pending.get(&(partition, trace)).copied(),
                        partition,
                        seq,
                        first_seen,
                        root_ended,
                    );
                    pending.insert((partition, trace), merged);
                }
            }
        }
        out.pending = pending.into_iter().map(|((_, trace), p)| (trace, p)).collect();
        for (&(_, trace), d) in &self.decided {
            out.decisions.push(DecisionRecord { seq: d.seq, trace, spans: d.spans, outcome: d.outcome });
            if let (Outcome::Kept { threshold }, false) = (d.outcome, d.exported) {
                out.outbox.push(OutboxEntry { trace, seq: d.seq, spans: d.spans, threshold });
            }
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

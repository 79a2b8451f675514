//! An in-memory [`TailStore`]: the model the sled store is tested against, and the baseline its
//! benchmark compares with. It loses everything on restart, like the OpenTelemetry Collector's
//! in-memory tail sampler.

use std::collections::BTreeMap;

use crate::{
    DecisionRecord, OutboxEntry, Outcome, Partition, PendingTrace, Recovered, SpanRange, StoreError, TailStore, TraceId,
};

/// A trace's one state record (see the crate note).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Pending(PendingTrace),
    Decided { seq: u64, outcome: Outcome, spans: SpanRange, exported: bool },
}

type Appends = BTreeMap<u64, (TraceId, Vec<Vec<u8>>)>;

#[derive(Debug, Default, Clone)]
pub struct MemoryStore {
    states: BTreeMap<(Partition, TraceId), State>,
    partitions: BTreeMap<Partition, Appends>,
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
    fn append(&mut self, partition: Partition, trace: &TraceId, spans: &[&[u8]]) -> Result<u64, StoreError> {
        self.next_append += 1;
        self.bytes += spans.iter().map(|s| s.len() as u64).sum::<u64>();
        let spans = spans.iter().map(|s| s.to_vec()).collect();
        self.partitions.entry(partition).or_default().insert(self.next_append, (*trace, spans));
        Ok(self.next_append)
    }

    fn put_pending(&mut self, trace: &TraceId, pending: &PendingTrace) -> Result<(), StoreError> {
        self.states.insert((pending.spans.partition, *trace), State::Pending(*pending));
        Ok(())
    }

    fn spans(&self, trace: &TraceId, range: &SpanRange) -> Result<Vec<Vec<u8>>, StoreError> {
        let Some(appends) = self.partitions.get(&range.partition) else { return Ok(Vec::new()) };
        Ok(appends
            .range(range.first..=range.last.max(range.first))
            .filter(|(_, (t, _))| t == trace)
            .flat_map(|(_, (_, spans))| spans.iter().cloned())
            .collect())
    }

    fn decide(&mut self, trace: &TraceId, spans: &SpanRange, outcome: Outcome) -> Result<u64, StoreError> {
        self.next_decision += 1;
        let state = State::Decided { seq: self.next_decision, outcome, spans: *spans, exported: false };
        self.states.insert((spans.partition, *trace), state);
        Ok(self.next_decision)
    }

    fn exported(&mut self, trace: &TraceId, partition: Partition) -> Result<(), StoreError> {
        if let Some(State::Decided { exported, .. }) = self.states.get_mut(&(partition, *trace)) {
            *exported = true;
        }
        Ok(())
    }

    fn forget_decision(&mut self, trace: &TraceId, partition: Partition, seq: u64) -> Result<(), StoreError> {
        let key = (partition, *trace);
        if matches!(self.states.get(&key), Some(State::Decided { seq: s, .. }) if *s == seq) {
            self.states.remove(&key);
        }
        Ok(())
    }

    fn drop_partition(&mut self, partition: Partition) -> Result<(), StoreError> {
        if let Some(appends) = self.partitions.remove(&partition) {
            let freed: usize = appends.values().flat_map(|(_, spans)| spans).map(Vec::len).sum();
            self.bytes -= freed as u64;
        }
        Ok(())
    }

    fn recover(&self) -> Result<Recovered, StoreError> {
        let mut out = Recovered { partitions: self.partitions.keys().copied().collect(), ..Recovered::default() };
        for (&(partition, trace), state) in &self.states {
            match *state {
                State::Pending(p) => out.pending.push((trace, p)),
                State::Decided { seq, outcome, spans, exported } => {
                    out.decisions.push(DecisionRecord { seq, trace, partition, outcome });
                    if let (Outcome::Kept { threshold }, false) = (outcome, exported) {
                        out.outbox.push(OutboxEntry { trace, spans, threshold });
                    }
                }
            }
        }
        out.decisions.sort_by_key(|d| d.seq);
        Ok(out)
    }

    fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn disk_bytes(&self) -> u64 {
        self.bytes
    }
}

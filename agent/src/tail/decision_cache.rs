//! The decision cache: the latest decisions, so that a trace's late spans and its later parts
//! follow the decision its first part got (a trace is so decided once, as long as its decision is
//! among the `TRACETAP_TAIL_DECISION_CACHE` latest).
//!
//! Decisions of traces that went to the sled store are recorded there too (`seq` != 0). The store
//! may forget such a record only once it left the cache *and* its partition was dropped: before
//! that, forgetting it would turn the trace pending again. [`DecisionCache::forgettable`] says how
//! far the store may forget, in sequence order.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;
use tracetap_storage::{Partition, TraceId};

/// A remembered decision.
#[derive(Debug, Clone, Copy)]
pub(super) struct Cached {
    pub(super) partition: Partition,
    /// The decision's sequence number in the store; 0: made in memory, not recorded there.
    pub(super) seq: u64,
    pub(super) kept: bool,
    pub(super) threshold: u64,
}

impl Cached {
    /// A decision made in memory (no record in the store), at `now`.
    pub(super) fn in_memory(now: u64, partition_ns: u64, kept: bool, threshold: u64) -> Self {
        Self { partition: now / partition_ns, seq: 0, kept, threshold }
    }
}

#[derive(Debug)]
pub(super) struct DecisionCache {
    entries: FxHashMap<TraceId, Cached>,
    /// Insertion order, for eviction (an entry replaced since is skipped: its `seq` differs).
    order: VecDeque<(TraceId, u64, Partition)>,
    capacity: usize,
    /// Store records evicted from the cache, oldest first, that the store has not forgotten yet.
    evicted: VecDeque<(u64, Partition)>,
}

impl DecisionCache {
    pub(super) fn new(capacity: usize) -> Self {
        Self { entries: FxHashMap::default(), order: VecDeque::new(), capacity, evicted: VecDeque::new() }
    }

    pub(super) fn get(&self, trace: &TraceId) -> Option<Cached> {
        self.entries.get(trace).copied()
    }

    pub(super) fn contains(&self, trace: &TraceId) -> bool {
        self.entries.contains_key(trace)
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Remembers a decision; past the capacity the oldest leaves (its store record, if any, is
    /// queued to be forgotten).
    pub(super) fn remember(&mut self, trace: TraceId, cached: Cached) {
        self.entries.insert(trace, cached);
        self.order.push_back((trace, cached.seq, cached.partition));
        while self.order.len() > self.capacity {
            let Some((old, seq, partition)) = self.order.pop_front() else { break };
            if self.entries.get(&old).is_some_and(|e| e.seq == seq) {
                self.entries.remove(&old);
            }
            // A decision made in memory (seq 0) has no record in the store to forget.
            if seq != 0 {
                self.evicted.push_back((seq, partition));
            }
        }
    }

    /// The newest store record the store may forget now (with every one before it): evicted
    /// records oldest first, up to the first whose partition is still `live`.
    pub(super) fn forgettable(&mut self, live: impl Fn(Partition) -> bool) -> Option<u64> {
        let mut up_to = None;
        while let Some(&(seq, partition)) = self.evicted.front() {
            if live(partition) {
                break;
            }
            up_to = Some(seq);
            self.evicted.pop_front();
        }
        up_to
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(partition: Partition, seq: u64) -> Cached {
        Cached { partition, seq, kept: true, threshold: 0 }
    }

    #[test]
    fn the_oldest_leave_and_the_store_forgets_only_records_of_dropped_partitions_in_order() {
        let mut cache = DecisionCache::new(2);
        cache.remember([1; 16], decision(1, 10));
        cache.remember([2; 16], decision(2, 0));
        cache.remember([3; 16], decision(1, 11));
        cache.remember([4; 16], decision(1, 12));
        assert!(!cache.contains(&[1; 16]) && !cache.contains(&[2; 16]));
        assert_eq!(cache.get(&[4; 16]).map(|c| c.seq), Some(12));
        assert_eq!(cache.forgettable(|p| p == 1), None, "partition 1 is live: nothing yet");
        assert_eq!(cache.forgettable(|_| false), Some(10), "the in-memory decision had no record");
    }

    #[test]
    fn a_decision_remembered_again_is_not_evicted_by_its_older_entry() {
        let mut cache = DecisionCache::new(2);
        cache.remember([1; 16], decision(1, 1));
        cache.remember([1; 16], decision(1, 2));
        cache.remember([2; 16], decision(1, 3));
        assert_eq!(cache.get(&[1; 16]).map(|c| c.seq), Some(2), "the stale entry of seq 1 left, not the trace");
    }
}

//! Traces in the store, waiting: appends (a trace recovered at start grows; any other joins its
//! append's [`Group`], and may be joined in memory for [`super::JOIN_WINDOW_NS`]), the recovered traces
//! tracked one by one (`pending`, with their deadlines), the disk bound's early decisions, and the
//! partitions' bookkeeping. Invariants: `spans_pending` is the sum of the pending traces' and the
//! groups' spans; a partition's `pending` counts its undecided traces, and it is dropped only when
//! nothing in it is left to decide or export.

use std::cmp::Reverse;

use tracetap_storage::{Fragment, Partition, StoreError, TailStore, TraceId};

use super::{Engine, Group, Hot, PARTITION_NS, Pending, Refused};

impl<S: TailStore> Engine<S> {
    pub(super) fn track(&mut self, trace: TraceId, pending: Pending) {
        self.deadlines.push(Reverse((pending.deadline(&self.limits), trace)));
        self.pending.insert(trace, pending);
    }

    /// Stops tracking a recovered trace (decided, or given up), with the counts that include it.
    pub(super) fn untrack(&mut self, trace: &TraceId) -> Option<Pending> {
        let p = self.pending.remove(trace)?;
        self.spans_pending -= u64::from(p.span_count);
        if let Some(state) = self.partitions.get_mut(&p.spans().partition) {
            state.pending -= 1;
        }
        Some(p)
    }

    /// Appends fragments of one partition. A trace recovered from the store (in `pending`) grows;
    /// any other becomes part of its append's [`Group`] and may be joined for a moment.
    pub(super) fn append(&mut self, partition: Partition, items: &[(TraceId, Hot)], now: u64) -> Result<(), Refused> {
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

    pub(super) fn append_in_order(
        &mut self,
        partition: Partition,
        items: &[&(TraceId, Hot)],
        now: u64,
    ) -> Result<(), StoreError> {
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

    /// Over the disk bound: the stored traces due soonest (the oldest, mostly) are decided now,
    /// recovered ones first, then groups.
    pub(super) fn bound_disk(&mut self, now: u64, retry: &mut Vec<TraceId>, retry_groups: &mut Vec<(Partition, u64)>) {
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

    /// Lets the store forget the evicted decisions whose partitions are gone, oldest first.
    pub(super) fn forget_evicted(&mut self) {
        let partitions = &self.partitions;
        if let Some(up_to) = self.cache.forgettable(|partition| partitions.contains_key(&partition))
            && let Err(e) = self.store.forget_decisions(up_to)
        {
            self.store_error(&e);
        }
    }

    pub(super) fn drop_finished_partitions(&mut self, now: u64) {
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

    pub(super) fn buffered_bytes(&self) -> u64 {
        self.partitions.values().map(|s| s.bytes).sum()
    }
}

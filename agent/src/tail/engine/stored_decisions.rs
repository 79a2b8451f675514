//! Deciding traces that wait in the store: a recovered trace alone, a group from one read of the
//! store, a part that follows the decision another part of its trace got before. Nothing in
//! memory changes for a trace before its store call succeeded: a failed call leaves it pending as
//! it was (tried again a second later, given up and counted after [`MAX_DECIDE_FAILURES`]).

use tracetap_proxy::trace_context::parse_ot_tracestate;
use tracetap_storage::{AppendedFragment, Outcome, Partition, SpanRange, StoreError, TailStore, TraceId};

use super::{Engine, MAX_DECIDE_FAILURES};
use crate::sampling::randomness;
use crate::tail::decision_cache::Cached;
use crate::tail::outgoing::Delivery;
use crate::tail::policy::{SpanFacts, TraceData};
use crate::tail::wire;

impl<S: TailStore> Engine<S> {
    /// Decides a trace; on a store failure the trace stays pending (the caller tries it again a
    /// second later) and `false` is returned. After [`MAX_DECIDE_FAILURES`] failures the trace is
    /// given up: its spans are counted lost and it leaves the pending set (its records stay in the
    /// store, where the next start's recovery meets them).
    pub(super) fn decide_logged(&mut self, trace: TraceId, now: u64) -> bool {
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
    pub(super) fn decide(&mut self, trace: TraceId, now: u64) -> Result<(), StoreError> {
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
                self.deliver_decided(Delivery::Stored { trace, partition: range.partition, seq: decision });
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
        self.counts.decision(verdict.policy, keep);
        self.untrack(&trace);
        self.unflushed_decisions = true;
        self.cache.remember(trace, Cached { partition: range.partition, seq, kept: keep, threshold });
        if keep {
            self.partitions.entry(range.partition).or_default().outbox += 1;
            self.queue_kept(stored.iter().map(Vec::as_slice), threshold);
            self.deliver_decided(Delivery::Stored { trace, partition: range.partition, seq });
        }
        Ok(())
    }

    /// Decides a group; on a store failure the group stays (the caller tries it again a second
    /// later, from the fragment it stopped at) and `false` is returned. After
    /// [`MAX_DECIDE_FAILURES`] failures what is left of it is given up: counted lost.
    pub(super) fn decide_group_logged(&mut self, partition: Partition, seq: u64, now: u64) -> bool {
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
    pub(super) fn forget_group(&mut self, partition: Partition, seq: u64) {
        let Some(group) = self.groups.remove(&(partition, seq)) else { return };
        self.counts.spans_lost += u64::from(group.spans_left);
        self.spans_pending -= u64::from(group.spans_left);
        self.group_traces -= u64::from(group.undecided);
        if let Some(state) = self.partitions.get_mut(&partition) {
            state.pending -= group.undecided as usize;
        }
    }

    /// Decides the traces of one group from one read of the store: each is decided from its
    /// stored spans and a part of it waiting in memory ([`super::hot::Hot::joins`]), or follows the decision
    /// of another part decided before. As in [`Engine::decide`], nothing in memory changes for a
    /// trace before its store call succeeded.
    pub(super) fn decide_group(&mut self, partition: Partition, seq: u64, now: u64) -> Result<(), StoreError> {
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

    pub(super) fn decide_stored_fragment(
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
            let part = if joined { self.hot.take(&trace) } else { None };
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
                self.deliver_decided(Delivery::Stored { trace, partition, seq: decision });
            } else {
                self.counts.late_dropped += spans;
            }
            return Ok(());
        }
        // The part in memory is taken out while the policies read it, and put back if the store
        // refuses the decision.
        let part = if joined { self.hot.take(&trace) } else { None };
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
                    self.hot.put_back(trace, part, &self.limits);
                }
                return Err(e);
            }
        };
        self.counts.decision(verdict.policy, keep);
        drop(facts);
        self.unflushed_decisions = true;
        self.cache.remember(trace, Cached { partition, seq: decision, kept: keep, threshold });
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
            self.deliver_decided(Delivery::Stored { trace, partition, seq: decision });
        }
        Ok(())
    }

    /// Records that a part of `trace` stored at `part` follows the decision another part got
    /// before (`cached`), like any decision (kept: in the outbox). The record covers this part
    /// only: a decision covers the appends it decided and no other (the store's note), and each
    /// kept decision stays in the outbox until it is exported.
    pub(super) fn follow(&mut self, trace: TraceId, part: SpanRange, cached: Cached) -> Result<u64, StoreError> {
        let outcome = if cached.kept { Outcome::Kept { threshold: cached.threshold } } else { Outcome::Dropped };
        let decision = self.store.decide(&trace, &part, outcome)?;
        self.unflushed_decisions = true;
        self.cache.remember(trace, Cached { partition: part.partition, seq: decision, ..cached });
        Ok(decision)
    }

    /// The randomness and the policies' view of a trace's spans as the store gave them back.
    pub(super) fn stored_facts<'s>(trace: &TraceId, stored: &'s [Vec<u8>]) -> (u64, Vec<SpanFacts<'s>>) {
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
}

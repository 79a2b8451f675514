//! What the engine counts itself, published on every loop: decisions by policy and outcome, late
//! spans, spills, joins, store failures, spans lost, traces re-sent after a crash.

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::metrics::DecisionKey;

/// Counters the engine keeps itself and publishes on every loop.
#[derive(Debug, Default)]
pub(super) struct Counts {
    pub(super) late_kept: u64,
    pub(super) late_dropped: u64,
    pub(super) early: u64,
    pub(super) store_errors: u64,
    /// Spans lost because the store failed to take them.
    pub(super) spans_lost: u64,
    pub(super) decisions: BTreeMap<DecisionKey, u64>,
    /// Traces decided from memory, never written to the store.
    pub(super) decided_in_memory: u64,
    /// Traces written to the store to wait (too long undecided, or memory over its budget).
    pub(super) spilled: u64,
    /// Later fragments that joined a trace in memory, and the longest gap between a trace's first
    /// fragment and a later one.
    pub(super) fragments_joined: u64,
    pub(super) fragment_gap_max_ns: u64,
    /// Kept traces the journal brought back undelivered at a start, exported again.
    pub(super) resent: u64,
}

impl Counts {
    /// Counts a decision by deciding policy and outcome. Found by a scan of a few entries
    /// (policies x outcomes), so a decision allocates no key.
    pub(super) fn decision(&mut self, policy: Option<&str>, kept: bool) {
        match self.decisions.iter_mut().find(|(k, _)| k.kept == kept && k.policy.as_deref() == policy) {
            Some((_, n)) => *n += 1,
            None => {
                self.decisions.insert(DecisionKey { policy: policy.map(str::to_owned), kept }, 1);
            }
        }
    }
}

/// Publishes the decision counts (the metrics registry holds a copy, replaced when they changed).
pub(super) fn publish_decisions(target: &Mutex<BTreeMap<DecisionKey, u64>>, counts: &BTreeMap<DecisionKey, u64>) {
    if let Ok(mut t) = target.lock()
        && *t != *counts
    {
        t.clone_from(counts);
    }
}

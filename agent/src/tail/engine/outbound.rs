//! What leaves the engine: kept spans assembled into export requests (the exporter reports their
//! delivery, which the journal and the store's outbox record), and the journal's group commits
//! (moves to the store are released only once the store is durable) within the disk bound.

use tracetap_storage::{TailStore, TraceId};

use super::{Engine, Hot};
use crate::tail::outgoing::{Delivery, Export};

impl<S: TailStore> Engine<S> {
    /// Adds stored spans (pid + `Span`) to the export batch (see [`crate::tail::outgoing::Outgoing::queue_kept`]); a span
    /// whose bytes do not parse is counted lost rather than exported.
    pub(super) fn queue_kept<'r>(&mut self, stored: impl Iterator<Item = &'r [u8]>, min_threshold: u64) {
        self.counts.spans_lost += self.outgoing.queue_kept(stored, min_threshold);
    }

    /// A decided trace's spans were queued: its delivery goes with them (reported back once they
    /// are exported), and the export batch is closed once it holds a batch's worth of spans (a
    /// restart's outbox, or a burst of decisions, never makes one oversized request).
    pub(super) fn deliver_decided(&mut self, delivery: Delivery) {
        self.outgoing.deliver(delivery);
        self.outgoing.traces += 1;
        if self.outgoing.spans >= self.limits.export_batch_spans as u64 {
            self.flush_export();
        }
    }

    /// Closes the current export batch (if it holds anything). The decisions behind it are made
    /// durable first: a kept trace must never reach the exporter while a crash could still undo its
    /// decision, or it would be decided, and exported, twice.
    pub fn flush_export(&mut self) {
        if self.outgoing.is_empty() {
            return;
        }
        if self.unflushed_decisions {
            match self.store.flush() {
                Ok(()) => self.store_durable(),
                Err(e) => {
                    // Not durable: the batch waits (a crash would decide its traces again, and they
                    // must not have been exported then). Tried again at the next flush.
                    self.store_error(&e);
                    return;
                }
            }
        }
        // The journal's decisions of the traces in it, written before they leave (a journal that
        // fails to write does not hold the export back: a crash would then decide them again).
        if self.journal.as_ref().is_some_and(|j| j.buffered() > 0) {
            self.commit_journal();
        }
        self.outgoing.close_batch();
    }

    /// The next batch of kept spans for the exporter.
    pub fn take_export(&mut self) -> Option<Export> {
        self.outgoing.take()
    }

    /// The exporter is done with these kept traces: they leave the outbox.
    pub fn delivered(&mut self, deliveries: &[Delivery]) {
        for delivery in deliveries {
            match *delivery {
                Delivery::Stored { trace, partition, seq } => {
                    if let Some(state) = self.partitions.get_mut(&partition) {
                        state.outbox = state.outbox.saturating_sub(1);
                    }
                    if let Err(e) = self.store.exported(&trace, partition, seq) {
                        self.store_error(&e);
                    }
                }
                Delivery::Journaled { trace, held } => {
                    if let Some(journal) = &mut self.journal {
                        journal.exported(&trace);
                        journal.let_go(held);
                    }
                }
            }
        }
    }

    /// A part in memory decided with its trace's part in the store: the store's decision (durable
    /// at the next store flush) covers the trace from there on, so the journal lets the part go
    /// then. (Kept, the part is exported from memory: a crash after that flush and before the
    /// export loses this part; the store's outbox brings back the stored part.)
    pub(super) fn release_journaled(&mut self, trace: &TraceId, part: &Hot) {
        if let (Some(journal), Some(held)) = (&mut self.journal, part.journal) {
            journal.released(trace, held);
        }
    }

    /// Writes the journal's buffered records as one group commit. Traces that moved to the store
    /// are released in it only once the store is durable (flushed here first); a store that fails
    /// to flush holds back those releases only (the traces come back from the journal at a
    /// restart, and the engine keeps what the store lacks), never the rest.
    pub fn commit_journal(&mut self) {
        let Some(journal) = &self.journal else { return };
        if journal.needs_store_flush() {
            match self.store.flush() {
                Ok(()) => self.store_durable(),
                Err(e) => self.store_error(&e),
            }
        }
        if let Some(journal) = &mut self.journal {
            journal.commit(self.now);
        }
    }

    /// The store made everything written to it durable.
    pub(super) fn store_durable(&mut self) {
        self.unflushed_decisions = false;
        if let Some(journal) = &mut self.journal {
            journal.store_durable();
        }
    }

    /// Past the disk bound with the journal's segments counted (after the tick's group commit
    /// removed those nothing holds): the oldest segments go, whatever holds them (counted: those
    /// traces are still decided from memory, but a crash would lose them). The journal never
    /// makes the store's traces be decided early.
    pub(super) fn bound_journal(&mut self) {
        let store = self.buffered_bytes();
        let Some(journal) = &mut self.journal else { return };
        let mut excess = (store + journal.disk_bytes()).saturating_sub(self.limits.max_disk_bytes);
        while excess > 0 {
            let freed = journal.drop_oldest();
            if freed == 0 {
                break;
            }
            excess = excess.saturating_sub(freed);
        }
    }
}

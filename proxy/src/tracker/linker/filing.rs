//! The end of a backend exchange's link: filed under its frontend exchange, let go, or given up
//! (tainted by a capture gap or a loss of records), with the per-request counters that decide
//! when a frontend exchange is handed out kept right on every move.

use super::{Evidence, LinkStrength, Linker, POOL_LIMIT, Relay};
use crate::exchange::Outcome;

impl Linker {
    /// A backend exchange is over. It is filed under its frontend exchange now, unless its
    /// response still waits to be claimed by the relay (see [`Linker::claim_relay`]).
    pub(in crate::tracker) fn end_backend(&mut self, back_id: u64, ts: u64, outcome: Outcome) {
        let Some(back) = self.backs.get_mut(&back_id) else { return };
        back.ended = true;
        back.exchange.end_ns = ts;
        back.exchange.outcome = outcome;
        let (front, relay) = (back.front, back.relay);
        let mut front_done = true;
        if let Some(f) = front.and_then(|id| self.fronts.get_mut(&id)) {
            f.open_backends = f.open_backends.saturating_sub(1);
            f.last_activity_ns = ts;
            front_done = f.done;
        }
        match relay {
            // The relay decides.
            Relay::Pending { .. } if self.backs[&back_id].evidence.claimable() && (front.is_none() || !front_done) => {}
            Relay::Pending { .. } | Relay::Awaiting => self.settle_unrelayed(back_id),
            Relay::Claimed => self.file_backend(back_id),
        }
    }

    /// An ended backend exchange that no relay claimed and none will claim through its current
    /// link: filed under that link when it is sure; a guessed one is let go (a relay may still
    /// claim it while its response waits; otherwise it is dropped and counted as unlinked).
    pub(super) fn settle_unrelayed(&mut self, back_id: u64) {
        let Some(back) = self.backs.get_mut(&back_id) else { return };
        // Tainted ones were counted when given up, unlinked ones when they found no link (file_backend
        // drops both); confirmed ones are filed under their link.
        if matches!(back.evidence, Evidence::Tainted | Evidence::Unlinked) || back.evidence.confirmed() {
            self.file_backend(back_id);
            return;
        }
        let front = back.front.take();
        let waits = matches!(back.relay, Relay::Pending { .. });
        self.move_link_counts(front, u64::MAX, true);
        if let Some(front) = front {
            self.hand_out_if_ready(front);
        }
        if !waits {
            self.stats.unlinked_backend_requests += 1;
            self.file_backend(back_id);
        }
    }

    /// Files an ended backend exchange under its frontend exchange. One that no frontend request
    /// claimed (a health check, or a request whose frontend exchange was already handed out) is
    /// only counted: a CLIENT span without its SERVER span is no trace an operator can use.
    pub(super) fn file_backend(&mut self, back_id: u64) {
        let Some(back) = self.backs.remove(&back_id) else { return };
        if matches!(back.relay, Relay::Pending { .. })
            && let Some(pos) = self.relays.iter().position(|b| *b == back_id)
        {
            self.relays.remove(pos);
        }
        let Some(front) = back.front.and_then(|id| self.fronts.get_mut(&id)) else {
            if back.front.is_some() {
                // Linked, but the frontend exchange was handed out already (expired or lingered).
                self.stats.late_backend_exchanges += 1;
            }
            if self.head_pool.len() < POOL_LIMIT {
                self.head_pool.push(back.exchange.request);
            }
            return;
        };
        front.exchange.clients.push(back.exchange);
        front.unfiled_backends = front.unfiled_backends.saturating_sub(1);
        let id = back.front.expect("linked");
        self.hand_out_if_ready(id);
    }

    /// Moves one linked backend exchange's share of the counters from `from` to `to`.
    pub(super) fn move_link_counts(&mut self, from: Option<u64>, to: u64, ended: bool) {
        if let Some(f) = from.and_then(|from| self.fronts.get_mut(&from)) {
            f.unfiled_backends = f.unfiled_backends.saturating_sub(1);
            if !ended {
                f.open_backends = f.open_backends.saturating_sub(1);
            }
        }
        if let Some(f) = self.fronts.get_mut(&to) {
            f.unfiled_backends += 1;
            f.links = f.links.max(LinkStrength::Guessed);
            if !ended {
                f.open_backends += 1;
            }
        }
    }

    /// Takes a frontend request off the link candidates (it is usually near the front: the list is
    /// in arrival order and requests are answered roughly in that order).
    pub(super) fn drop_candidate(&mut self, id: u64) {
        if let Some(pos) = self.candidates.iter().position(|c| c.id == id) {
            self.candidates.remove(pos);
        }
    }

    /// A request's own backend request arrived: backend exchanges only guessed to be its own
    /// (alike headers) are let go; the relay may still give them to the right request.
    pub(super) fn drop_guessed_links(&mut self, id: u64) {
        let guessed: Vec<u64> = self
            .backs
            .iter()
            .filter(|(_, b)| b.front == Some(id) && b.evidence == Evidence::Guessed && b.relay != Relay::Claimed)
            .map(|(bid, _)| *bid)
            .collect();
        for bid in guessed {
            let b = self.backs.get_mut(&bid).expect("present");
            b.front = None;
            let ended = b.ended;
            if let Some(f) = self.fronts.get_mut(&id) {
                f.unfiled_backends = f.unfiled_backends.saturating_sub(1);
                if !ended {
                    f.open_backends = f.open_backends.saturating_sub(1);
                }
            }
        }
    }

    /// A capture gap in process `tgid`: every link guessed from headers alone is given up, and
    /// those backend exchanges are never exported (see [`Evidence::Tainted`]).
    pub(in crate::tracker) fn taint_guessed_links(&mut self, tgid: u32) {
        let guessed: Vec<u64> = self
            .backs
            .iter()
            .filter(|(_, b)| b.tgid == tgid && b.evidence == Evidence::Guessed && b.relay != Relay::Claimed)
            .map(|(bid, _)| *bid)
            .collect();
        for bid in guessed {
            self.stats.unlinked_backend_requests += 1;
            self.taint(bid);
        }
    }

    /// Records were lost somewhere: links whose evidence matches `doubtful` (and that no relay
    /// confirmed) are given up and counted as quarantined.
    pub(super) fn quarantine_links(&mut self, doubtful: impl Fn(Evidence) -> bool) {
        let ids: Vec<u64> = self
            .backs
            .iter()
            .filter(|(_, b)| doubtful(b.evidence) && b.relay != Relay::Claimed)
            .map(|(bid, _)| *bid)
            .collect();
        for bid in ids {
            self.stats.quarantined_backend_exchanges += 1;
            self.taint(bid);
        }
    }

    /// Gives up a backend exchange's link for good: detached from its request (which no longer
    /// waits for it), never claimed, dropped when it ends (the caller counts it).
    fn taint(&mut self, bid: u64) {
        let b = self.backs.get_mut(&bid).expect("present");
        b.evidence = Evidence::Tainted;
        let (front, ended) = (b.front.take(), b.ended);
        self.move_link_counts(front, u64::MAX, ended);
        if let Some(front) = front {
            self.hand_out_if_ready(front);
        }
        if ended {
            self.file_backend(bid);
        }
    }
}

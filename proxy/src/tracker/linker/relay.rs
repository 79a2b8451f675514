//! Linking a backend exchange for good when `HAProxy` relays its response: the frontend response
//! head written to a client claims the backend response it relayed (see
//! [`Linker::claim_relay`]). Responses pass through here on both sides: a backend response head
//! makes its exchange claimable, a frontend one claims.

use std::hash::BuildHasher as _;

use rustc_hash::FxBuildHasher;

use super::{BackRecord, Evidence, LinkStrength, Linker, Relay};
use crate::framing::BodyFraming;
use crate::head::ResponseHead;
use crate::trace_context::TraceParent;
use crate::tracker::types::Ctx;

/// Longest time between reading a backend response head and relaying it to the client for the
/// relay to take a backend exchange that is not linked to the relaying request (see
/// [`Linker::claim_relay`]). `HAProxy` relays within one pass over its events, microseconds
/// apart; 100 ms leaves room for a preempted thread on a loaded machine.
pub(super) const RELAY_WINDOW_NS: u64 = 100_000_000;

/// The backend exchange's request carried `tp` (the same trace and parent ids).
fn carries(b: &BackRecord, tp: &TraceParent) -> bool {
    b.exchange.request.parsed_traceparent.is_some_and(|p| p.trace_id == tp.trace_id && p.parent_id == tp.parent_id)
}

impl Linker {
    /// Records the response head of frontend exchange `id`, written to the client on `ctx`: the
    /// relay of a backend response (see [`Linker::claim_relay`]). Returns how its body is framed.
    pub(in crate::tracker) fn front_response_head(&mut self, id: u64, ctx: Ctx, response: ResponseHead) -> BodyFraming {
        let Some(front) = self.fronts.get_mut(&id) else { return BodyFraming::Empty };
        front.last_activity_ns = ctx.ts;
        if response.is_interim() {
            return BodyFraming::Empty;
        }
        front.responding = true;
        front.exchange.response = Some(response);
        let method = front.exchange.request.as_ref().map_or("GET", |r| r.method.as_str());
        let framing = response.framing(method);
        self.drop_candidate(id);
        self.claim_relay(id, ctx, response);
        framing
    }

    /// Records the response head of backend exchange `back_id`, read from the server on `ctx`
    /// (its first byte read at `started`): from now on a frontend response on the same thread may
    /// claim it. Returns how its body is framed.
    pub(in crate::tracker) fn back_response_head(
        &mut self,
        back_id: u64,
        ctx: Ctx,
        response: ResponseHead,
        started: u64,
    ) -> BodyFraming {
        let Some(back) = self.backs.get_mut(&back_id) else { return response.framing("GET") };
        if response.is_interim() {
            return BodyFraming::Empty;
        }
        back.exchange.response = Some(response);
        back.exchange.response_start_ns = Some(started);
        back.exchange.response_head_ns = Some(ctx.ts);
        if back.evidence.claimable() && back.relay == Relay::Awaiting {
            back.relay = Relay::Pending { tid: ctx.tid, read_ns: ctx.ts };
            self.relays.push_back(back_id);
        }
        response.framing(&back.exchange.request.method)
    }

    /// The frontend exchange `id` starts its response on thread `ctx.tid`: it claims the backend
    /// response `HAProxy` relayed, the earliest unclaimed one read on this thread with the same
    /// status. A claim that takes a backend exchange tentatively linked elsewhere moves it here,
    /// and moves one of this exchange's unclaimed backend exchanges the other way (the two were
    /// swapped; that one stays unconfirmed until its own relay).
    pub(super) fn claim_relay(&mut self, id: u64, ctx: Ctx, relayed: ResponseHead) {
        let status = relayed.status;
        let tgid = ctx.key.0;
        let relayable = |b: &BackRecord| {
            b.tgid == tgid
                && b.evidence.claimable()
                && matches!(b.relay, Relay::Pending { tid, .. } if tid == ctx.tid)
                && b.exchange.response.is_some_and(|r| r.status == status)
        };
        let Some((links, front_start)) = self.fronts.get(&id).map(|f| (f.links, f.exchange.start_ns)) else { return };
        // HAProxy configured with `tracetap haproxy-snippet --response` gives the client the
        // `traceparent` it forwarded to the server: that names the backend exchange exactly.
        // Only a traceparent other than the client's own is HAProxy's: a backend that echoes the
        // one it received, for a client that sent the same one on several requests, names
        // nothing exactly.
        let own = self.fronts.get(&id).and_then(|f| f.exchange.request.as_ref()).and_then(|r| r.parsed_traceparent);
        let exact = relayed
            .traceparent
            .filter(|tp| own.is_none_or(|o| (o.trace_id, o.parent_id) != (tp.trace_id, tp.parent_id)))
            .and_then(|tp| {
                self.relays.iter().position(|b| {
                    self.backs
                        .get(b)
                        .is_some_and(|b| relayable(b) && b.exchange.start_ns >= front_start && carries(b, &tp))
                })
            });
        let pos = match exact {
            Some(pos) => pos,
            None => match self.best_relay(id, ctx, relayed, (links, own), front_start, &relayable) {
                Some(pos) => pos,
                None => return,
            },
        };
        self.claim(id, pos);
    }

    /// The position in `relays` of the backend exchange a relay by `id` claims, by the rules of
    /// [`Linker::claim_relay`], when no `traceparent` names it.
    fn best_relay(
        &self,
        id: u64,
        ctx: Ctx,
        relayed: ResponseHead,
        (links, own): (LinkStrength, Option<TraceParent>),
        front_start: u64,
        relayable: &dyn Fn(&BackRecord) -> bool,
    ) -> Option<usize> {
        // HAProxy writes a response head to the client in the same pass over its events as it read
        // it from the server; an older unclaimed response belongs to a request whose records were
        // lost, not to this one.
        let recent = |b: &BackRecord| matches!(b.relay, Relay::Pending { read_ns, .. } if ctx.ts.saturating_sub(read_ns) <= RELAY_WINDOW_NS);
        if links == LinkStrength::None {
            // No backend request was ever linked to it: HAProxy answered by itself (`return`,
            // `deny`, `redirect`, a cache hit), and another request's response is not its own.
            return None;
        }
        // Shortly after a loss, only a request's own sole link is trusted (a lost response read
        // would let a request take another's).
        let only_own = links == LinkStrength::Sole || self.quarantined(ctx.ts);
        let own_sole = |b: &BackRecord| relayable(b) && b.evidence == Evidence::Sole && b.front == Some(id);
        // HAProxy cannot have written a backend request before it read the client's request.
        let open_to_claim = |b: &BackRecord| {
            relayable(b)
                && !(b.evidence == Evidence::Sole && b.front.is_some_and(|f| f != id))
                && (b.front == Some(id) || recent(b))
                && b.exchange.start_ns >= front_start
        };
        // A backend request in this request's trace first (`HAProxy` keeps a valid incoming trace
        // id, and starts a new trace only for a request without one): that is evidence, where
        // identical requests and responses leave only the read order. Where the trace ids tell
        // nothing (no propagation, or a scheme that restarts every trace) all rank alike.
        let own_trace = own.map(|o| FxBuildHasher.hash_one(o.trace_id));
        let in_own_trace = |b: &BackRecord| match own_trace {
            Some(k) => b.trace_key == Some(k),
            None => b.new_trace,
        };
        // Among those, the response relayed unchanged (same header lines) first, else the most
        // alike headers, else the earliest read: HAProxy does not always relay responses of one
        // thread in the order it read them, and identical requests often get responses that only
        // their headers (`Date`, `ETag`, a request id, `Content-Length`) tell apart.
        let closeness = |b: &BackRecord| {
            let (same, alike) = b.exchange.response.map_or((false, 0), |r| {
                (r.header_digest == relayed.header_digest, (r.header_sig & relayed.header_sig).count_ones())
            });
            (in_own_trace(b), same, alike)
        };
        let best = |accept: &dyn Fn(&BackRecord) -> bool| {
            self.relays
                .iter()
                .enumerate()
                .filter_map(|(pos, b)| self.backs.get(b).filter(|b| accept(b)).map(|b| (pos, closeness(b))))
                .max_by_key(|(pos, close)| (*close, std::cmp::Reverse(*pos)))
                .map(|(pos, _)| pos)
        };
        best(&own_sole).or_else(|| if only_own { None } else { best(&open_to_claim) })
    }

    /// Request `id` claims the backend exchange at `pos` in `relays`: its link is final.
    fn claim(&mut self, id: u64, pos: usize) {
        let back_id = self.relays.remove(pos).expect("in range");
        let back = self.backs.get_mut(&back_id).expect("relays hold live backend exchanges");
        back.relay = Relay::Claimed;
        back.evidence = Evidence::Relayed;
        let ended = back.ended;
        let previous = back.front.replace(id);
        if previous != Some(id) {
            self.stats.relinked_backend_exchanges += u64::from(previous.is_some());
            self.move_link_counts(previous, id, ended);
            // The one this exchange held in its place, if any, belongs to the other.
            if let Some(other) = previous
                && self.fronts.contains_key(&other)
            {
                let swapped = self
                    .backs
                    .iter()
                    .filter(|(bid, b)| **bid != back_id && b.front == Some(id) && b.relay != Relay::Claimed)
                    .map(|(bid, _)| *bid)
                    .min();
                if let Some(swapped) = swapped {
                    let b = self.backs.get_mut(&swapped).expect("present");
                    b.front = Some(other);
                    b.evidence = Evidence::Guessed;
                    let ended = b.ended;
                    self.move_link_counts(Some(id), other, ended);
                    if ended && self.fronts.get(&other).is_some_and(|f| f.done) {
                        // Nothing will settle it later: its new request is done already.
                        self.settle_unrelayed(swapped);
                    }
                }
                self.hand_out_if_ready(other);
            }
        }
        if ended {
            self.file_backend(back_id);
        }
    }
}

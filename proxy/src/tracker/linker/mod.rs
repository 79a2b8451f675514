//! The exchanges between their first head and their hand-out, and which frontend request each
//! backend exchange belongs to. The tracker frames bytes and follows connections; the [`Linker`]
//! owns the exchange records and decides links, and the tracker reaches them only through its
//! methods. Its parts: record keeping and hand-out here, write-time links in `link`, relays in
//! `relay`, filing and giving up links in `filing`.
//!
//! A backend request is linked in two steps (see `docs/ARCHITECTURE.md`, "Linking model"):
//! - tentatively when `HAProxy` writes it ([`Linker::link`]): by `traceparent`, else by trace id
//!   (`HAProxy` propagating under a new parent id), else by target with alike headers, else (a
//!   rewritten target) by alike headers alone;
//! - for good when `HAProxy` relays its response ([`Linker::claim_relay`]): a frontend response
//!   head that carries the `traceparent` a backend request carried claims that one; otherwise it
//!   claims an unclaimed backend response of its thread with the same status, one in its own
//!   trace first, then the closest headers, then the earliest read.
//!
//! Invariants:
//! - A backend exchange is filed (exported under a frontend request) at most once, and only when
//!   its [`Evidence`] is confirmed: by `traceparent` or target, or by a relay. A guessed link that no
//!   relay confirmed is counted as unlinked, never exported.
//! - A frontend request's `unfiled_backends` counts the backend exchanges linked to it and not yet
//!   filed; every relink moves that share with it ([`Linker::move_link_counts`]), so a request is
//!   handed out exactly when its last backend exchange is filed.
//! - A relay never takes a backend exchange whose link had no rival ([`Evidence::Sole`]) from its
//!   request, and takes one linked elsewhere only within [`relay::RELAY_WINDOW_NS`] of its response;
//!   except that a response carrying a `traceparent` `HAProxy` made (not the client's own) takes
//!   the backend exchange whose request carried it, whatever its link: that is exact.
//! - On a capture gap every guessed link of the process is given up ([`Evidence::Tainted`]).
//! - A frontend exchange is handed out once it is done *and* every backend exchange linked to it
//!   is filed, so a SERVER span always leaves with all its CLIENT spans.

use std::collections::VecDeque;
use std::net::SocketAddr;

use rustc_hash::FxHashMap;

use super::types::{Ctx, Limits, TrackerStats};
use crate::exchange::{ClientExchange, Outcome, ServerExchange, TlsInfo};
use crate::head::RequestHead;

mod filing;
mod link;
mod relay;

use link::{Candidate, Link};
use relay::RELAY_WINDOW_NS;

/// How long after a loss of records no new link is trusted: the lost record may have been a
/// frontend request whose backend request is still to come, and would link to the wrong one.
pub const QUARANTINE_NS: u64 = 1_000_000_000;

/// Most recycled heads (and client lists) kept for reuse.
const POOL_LIMIT: usize = 4096;

/// Where a backend exchange stands with the relay of its response (see [`Linker::claim_relay`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Relay {
    /// No final response head read yet.
    Awaiting,
    /// Its response head was read on this thread at `read_ns`; no frontend response claimed it yet.
    Pending { tid: u32, read_ns: u64 },
    /// A frontend response head claimed it: its link is final.
    Claimed,
}

/// What a backend exchange's link to its frontend request rests on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Evidence {
    /// Never linked (a health check, or no waiting request matched): counted, never exported, and
    /// never taken by a relay.
    Unlinked,
    /// Its guessed link was given up on a capture gap in the process: the lost record may have
    /// been its own frontend request, or the backend request of the one it was guessed for. Never
    /// exported.
    Tainted,
    /// Guessed from alike headers (a rewritten target), or swapped by a relay: exported only once
    /// a relay confirms it.
    Guessed,
    /// The same target, but other waiting requests of the thread had it too.
    Target,
    /// The same `traceparent`, or a target no other waiting request of the thread had: a relay
    /// never takes it from its request (a lost record must not let another request's response
    /// steal it).
    Sole,
    /// Claimed by the relay of its request's response.
    Relayed,
}

impl Evidence {
    fn of(link: Option<Link>) -> Self {
        match link {
            None => Self::Unlinked,
            Some(l) if l.strength == LinkStrength::Sole => Self::Sole,
            Some(l) if l.strength == LinkStrength::Target => Self::Target,
            Some(_) => Self::Guessed,
        }
    }

    /// A relay may take it (see [`Linker::claim_relay`]).
    pub(super) fn claimable(self) -> bool {
        matches!(self, Self::Guessed | Self::Target | Self::Sole)
    }

    /// Filed under its link even if no relay ever confirms it.
    pub(super) fn confirmed(self) -> bool {
        matches!(self, Self::Target | Self::Sole | Self::Relayed)
    }
}

/// The strongest link a frontend request received, or what a tentative link rests on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum LinkStrength {
    None,
    /// Alike headers only.
    Guessed,
    /// The same target, with rivals.
    Target,
    /// The same `traceparent`, or a target without rivals.
    Sole,
}

/// A backend exchange from its request until it is filed under its frontend exchange.
#[derive(Debug)]
pub(super) struct BackRecord {
    /// The frontend request it is linked to (tentatively until [`Relay::Claimed`]).
    pub(super) front: Option<u64>,
    pub(super) tgid: u32,
    /// Hash of its request's single `traceparent` value: a retry resends the same one.
    pub(super) traceparent_key: Option<u64>,
    /// Hash of that value's trace id, when valid (as [`Candidate::trace_key`]).
    pub(super) trace_key: Option<u64>,
    /// That trace id was no waiting request's when it was written: `HAProxy` started a new trace
    /// (the snippet's lines do, for a request without a valid `traceparent`).
    pub(super) new_trace: bool,
    pub(super) relay: Relay,
    /// What the link rests on.
    pub(super) evidence: Evidence,
    /// The exchange is over (response complete, or the connection closed).
    pub(super) ended: bool,
    pub(super) exchange: ClientExchange,
}

/// A frontend request from its head until it is handed out.
#[derive(Debug)]
pub(super) struct FrontRecord {
    pub(super) exchange: ServerExchange,
    /// Linked backend exchanges not ended yet.
    open_backends: u32,
    /// Linked backend exchanges not filed under this one yet (ended ones may wait for their relay).
    unfiled_backends: u32,
    /// The strongest link it received. From [`LinkStrength::Sole`] on, its relay only ever claims
    /// its own backend exchanges; a guessed link does not keep it from its own backend request.
    links: LinkStrength,
    /// The response started: no more links.
    pub(super) responding: bool,
    /// The frontend exchange ended; waiting for `open_backends` to reach 0.
    done: bool,
    pub(super) last_activity_ns: u64,
}

/// The connection a frontend request was read on, as its exchange records it.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct FrontConn {
    pub(super) peer: Option<SocketAddr>,
    pub(super) local: Option<SocketAddr>,
    /// The client a PROXY header named.
    pub(super) client: Option<SocketAddr>,
    pub(super) tls: Option<TlsInfo>,
}

/// The connection a backend request was written on, as its exchange records it.
#[derive(Clone, Copy, Debug)]
pub(super) struct BackConn {
    pub(super) server: Option<SocketAddr>,
    pub(super) tls: Option<TlsInfo>,
    /// When its `connect` ran, for the connection's first request only.
    pub(super) connect_ns: Option<u64>,
    /// HTTP/1: when the request before this one on the connection ended.
    pub(super) free_since_ns: Option<u64>,
}

/// The counters the linker keeps (its share of [`TrackerStats`], same names).
#[derive(Clone, Copy, Debug, Default)]
struct LinkStats {
    frontend_requests: u64,
    backend_requests: u64,
    unlinked_backend_requests: u64,
    late_backend_exchanges: u64,
    expired_exchanges: u64,
    relinked_backend_exchanges: u64,
    quarantined_backend_exchanges: u64,
}

/// The open exchanges and their links. Fed by the tracker as heads and message ends are framed;
/// hands out finished frontend exchanges with their backend exchanges ([`Linker::drain`]).
#[derive(Debug, Default)]
pub(super) struct Linker {
    fronts: FxHashMap<u64, FrontRecord>,
    /// Frontend requests that may still be linked, oldest first.
    candidates: VecDeque<Candidate>,
    /// Backend exchanges from their request until they are filed.
    backs: FxHashMap<u64, BackRecord>,
    /// Ids of backend exchanges in [`Relay::Pending`], in the order their response heads were read.
    relays: VecDeque<u64>,
    /// Until then, records were lost too recently to trust a new link (see [`Linker::records_lost`]).
    quarantine_until_ns: u64,
    next_id: u64,
    stats: LinkStats,
    finished: Vec<ServerExchange>,
    /// Request heads and client lists of handed-out exchanges, reused so that parsing a request
    /// allocates nothing in steady state (see [`Linker::recycle`]).
    head_pool: Vec<RequestHead>,
    clients_pool: Vec<Vec<ClientExchange>>,
}

/// What the tracker reads and touches of the records, and the pool of spare heads.
impl Linker {
    /// Adds the linker's counters to the tracker's.
    pub(super) fn add_stats(&self, stats: &mut TrackerStats) {
        let s = self.stats;
        stats.frontend_requests += s.frontend_requests;
        stats.backend_requests += s.backend_requests;
        stats.unlinked_backend_requests += s.unlinked_backend_requests;
        stats.late_backend_exchanges += s.late_backend_exchanges;
        stats.expired_exchanges += s.expired_exchanges;
        stats.relinked_backend_exchanges += s.relinked_backend_exchanges;
        stats.quarantined_backend_exchanges += s.quarantined_backend_exchanges;
    }

    /// Number of frontend exchanges currently open.
    pub(super) fn open_fronts(&self) -> usize {
        self.fronts.len()
    }

    pub(super) fn front_mut(&mut self, id: u64) -> Option<&mut FrontRecord> {
        self.fronts.get_mut(&id)
    }

    pub(super) fn front(&self, id: u64) -> Option<&FrontRecord> {
        self.fronts.get(&id)
    }

    pub(super) fn back_mut(&mut self, id: u64) -> Option<&mut BackRecord> {
        self.backs.get_mut(&id)
    }

    pub(super) fn back(&self, id: u64) -> Option<&BackRecord> {
        self.backs.get(&id)
    }

    /// Bytes of the frontend exchanges `ids` moved at `ts`: they are active.
    pub(super) fn touch_fronts(&mut self, ids: impl Iterator<Item = u64>, ts: u64) {
        for id in ids {
            if let Some(f) = self.fronts.get_mut(&id) {
                f.last_activity_ns = ts;
            }
        }
    }

    /// Bytes of the backend exchanges `ids` moved at `ts`: their frontend exchanges are active.
    pub(super) fn touch_backs(&mut self, ids: impl Iterator<Item = u64>, ts: u64) {
        for id in ids {
            if let Some(f) = self.backs.get(&id).and_then(|b| b.front).and_then(|f| self.fronts.get_mut(&f)) {
                f.last_activity_ns = ts;
            }
        }
    }

    /// A request head to parse into, from the pool when one is spare.
    pub(super) fn spare_head(&mut self) -> RequestHead {
        self.head_pool.pop().unwrap_or_default()
    }

    /// Takes back a request head that made no exchange.
    pub(super) fn return_head(&mut self, head: RequestHead) {
        if self.head_pool.len() < POOL_LIMIT {
            self.head_pool.push(head);
        }
    }

    /// The pool of spare heads, for a decoder that parses several at once (HTTP/2).
    pub(super) fn head_pool(&mut self) -> &mut Vec<RequestHead> {
        &mut self.head_pool
    }
}

/// Records: opened, ended, expired and handed out.
impl Linker {
    /// Takes back a handed-out exchange so its buffers serve the next requests.
    pub(super) fn recycle(&mut self, mut ex: ServerExchange) {
        for client in ex.clients.drain(..) {
            if self.head_pool.len() < POOL_LIMIT {
                self.head_pool.push(client.request);
            }
        }
        if self.clients_pool.len() < POOL_LIMIT {
            self.clients_pool.push(ex.clients);
        }
        if let Some(request) = ex.request
            && self.head_pool.len() < POOL_LIMIT
        {
            self.head_pool.push(request);
        }
    }

    /// Moves the finished exchanges out.
    pub(super) fn drain(&mut self) -> std::vec::Drain<'_, ServerExchange> {
        self.finished.drain(..)
    }

    /// Records were lost (the probes' loss epoch changed) before the record about to be handled,
    /// which came at `ts_ns`: which connection lost them is not known yet (a gap shows when its next
    /// record comes), but any link could now join a request to another's backend exchange. Links
    /// that had rivals or rest on headers alone are given up, and for [`QUARANTINE_NS`] no new link
    /// is made and a relay only confirms a request's own sole link. What is given up is counted in
    /// [`TrackerStats::quarantined_backend_exchanges`]; SERVER spans are still exported.
    pub(super) fn records_lost(&mut self, ts_ns: u64) {
        let already = self.quarantined(ts_ns);
        self.quarantine_until_ns = ts_ns.saturating_add(QUARANTINE_NS);
        if !already {
            // Within a quarantine no link is made, and those open to doubt were given up when it
            // began: under sustained loss this scan runs once, not per record.
            self.quarantine_links(|e| matches!(e, Evidence::Guessed | Evidence::Target));
        }
    }

    pub(super) fn quarantined(&self, ts_ns: u64) -> bool {
        ts_ns < self.quarantine_until_ns
    }

    /// Expires exchanges idle for too long and hands out finished exchanges that waited too long
    /// for their backends; returns the frontend exchanges it handed out, which their connections
    /// must forget.
    pub(super) fn expire(&mut self, now_ns: u64, limits: &Limits) -> Vec<u64> {
        let timeout = limits.exchange_timeout_ns;
        let linger = limits.linger_ns;
        let stale: Vec<u64> = self
            .fronts
            .iter()
            .filter(|(_, f)| {
                let idle = now_ns.saturating_sub(f.last_activity_ns);
                (f.done && idle > linger) || idle > timeout
            })
            .map(|(id, _)| *id)
            .collect();
        // Let-go backend exchanges whose response no relay claimed. A relay claims one without a
        // link only within `RELAY_WINDOW_NS` of its response (see `claim_relay`), so past that
        // nothing can: filed at once rather than after the linger, so that a burst of them (the
        // streams a client's abrupt close leaves behind) does not lengthen every claim's scan.
        let unclaimable = |b: &BackRecord| match b.relay {
            Relay::Pending { read_ns, .. } => now_ns.saturating_sub(read_ns) > RELAY_WINDOW_NS,
            _ => now_ns.saturating_sub(b.exchange.end_ns) > linger,
        };
        let unclaimed: Vec<u64> = self
            .relays
            .iter()
            .filter(|b| self.backs.get(b).is_some_and(|b| b.front.is_none() && b.ended && unclaimable(b)))
            .copied()
            .collect();
        for bid in unclaimed {
            self.stats.unlinked_backend_requests += 1;
            self.file_backend(bid);
        }
        let mut handed_out = Vec::with_capacity(stale.len());
        for id in stale {
            // Backend exchanges that ended and only waited for a relay are settled (a guessed
            // link is not exported unconfirmed).
            let waiting: Vec<u64> =
                self.backs.iter().filter(|(_, b)| b.ended && b.front == Some(id)).map(|(bid, _)| *bid).collect();
            for bid in waiting {
                self.settle_unrelayed(bid);
            }
            let Some(mut front) = self.fronts.remove(&id) else { continue };
            if !front.done {
                self.stats.expired_exchanges += 1;
                front.exchange.outcome = Outcome::Expired;
                front.exchange.end_ns = now_ns;
            }
            self.drop_candidate(id);
            handed_out.push(id);
            self.finished.push(front.exchange);
        }
        handed_out
    }

    /// Opens a frontend exchange read on `conn` (without a request: an answer to bytes that made
    /// none); returns its id.
    pub(super) fn insert_front(
        &mut self,
        ctx: Ctx,
        request: Option<RequestHead>,
        started: u64,
        conn: FrontConn,
    ) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let FrontConn { peer, local, client, tls } = conn;
        let head_end_ns = request.as_ref().map(|_| ctx.ts);
        self.fronts.insert(
            id,
            FrontRecord {
                exchange: ServerExchange {
                    tgid: ctx.key.0,
                    request,
                    response: None,
                    peer,
                    local,
                    client,
                    start_ns: started,
                    end_ns: started,
                    head_end_ns,
                    rejected: None,
                    client_closed: false,
                    outcome: Outcome::Complete,
                    tls,
                    clients: self.clients_pool.pop().unwrap_or_default(),
                },
                open_backends: 0,
                unfiled_backends: 0,
                links: LinkStrength::None,
                responding: false,
                done: false,
                last_activity_ns: ctx.ts,
            },
        );
        id
    }

    /// A request read on a frontend; returns its exchange id.
    pub(super) fn new_front(&mut self, ctx: Ctx, request: RequestHead, started: u64, conn: FrontConn) -> u64 {
        self.stats.frontend_requests += 1;
        let id = self.insert_front(ctx, Some(request), started, conn);
        self.candidates.push_back(Candidate::new(id, ctx, self.fronts[&id].exchange.request.as_ref()));
        id
    }

    /// A request written on a backend; returns its exchange id.
    pub(super) fn new_backend(&mut self, ctx: Ctx, request: RequestHead, started: u64, conn: BackConn) -> u64 {
        self.stats.backend_requests += 1;
        let quarantined = self.quarantined(ctx.ts);
        // Keys hashed once, for linking and for the relay's preference.
        let keys = Candidate::new(0, ctx, Some(&request));
        let new_trace = self.is_new_trace(&keys);
        let link = if quarantined { None } else { self.link(ctx, &request, &keys, new_trace) };
        let front = link.map(|l| l.id);
        if let Some(id) = front {
            if let Some(f) = self.fronts.get_mut(&id) {
                f.open_backends += 1;
                f.unfiled_backends += 1;
                f.last_activity_ns = ctx.ts;
            }
        } else if quarantined {
            self.stats.quarantined_backend_exchanges += 1;
        } else {
            self.stats.unlinked_backend_requests += 1;
        }
        let back_id = self.next_id;
        self.next_id += 1;
        let BackConn { server, tls, connect_ns, free_since_ns } = conn;
        self.backs.insert(
            back_id,
            BackRecord {
                front,
                tgid: ctx.key.0,
                traceparent_key: keys.traceparent_key,
                trace_key: keys.trace_key,
                new_trace,
                relay: Relay::Awaiting,
                evidence: if quarantined { Evidence::Tainted } else { Evidence::of(link) },
                ended: false,
                exchange: ClientExchange {
                    request,
                    response: None,
                    server,
                    start_ns: started,
                    end_ns: started,
                    connect_ns,
                    free_since_ns,
                    response_start_ns: None,
                    response_head_ns: None,
                    server_closed: false,
                    outcome: Outcome::Complete,
                    tls,
                },
            },
        );
        back_id
    }

    /// The frontend exchange `id` ended (its response, or its connection): handed out once its
    /// backend exchanges are filed.
    pub(super) fn finish_front(&mut self, id: u64, ts: u64, outcome: Outcome) {
        self.drop_candidate(id);
        let Some(front) = self.fronts.get_mut(&id) else { return };
        front.exchange.end_ns = ts;
        front.exchange.outcome = outcome;
        front.done = true;
        front.last_activity_ns = ts;
        // Its backend exchanges that ended without being relayed: retried attempts are its own;
        // a guessed link may still be claimed by the right one.
        let leftovers: Vec<u64> = self
            .relays
            .iter()
            .filter(|b| self.backs.get(b).is_some_and(|b| b.ended && b.front == Some(id)))
            .copied()
            .collect();
        for back_id in leftovers {
            self.settle_unrelayed(back_id);
        }
        self.hand_out_if_ready(id);
    }

    /// Hands out a frontend exchange that is done and has all its backend exchanges filed.
    pub(super) fn hand_out_if_ready(&mut self, id: u64) {
        if self.fronts.get(&id).is_some_and(|f| f.done && f.unfiled_backends == 0) {
            let front = self.fronts.remove(&id).expect("present");
            self.finished.push(front.exchange);
        }
    }
}

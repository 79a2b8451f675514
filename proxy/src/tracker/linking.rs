//! Which frontend request a backend exchange belongs to, and when it may be exported under it.
//!
//! A backend request is linked in two steps (see `docs/ARCHITECTURE.md`, "Linking model"):
//! - tentatively when `HAProxy` writes it ([`Tracker::link`]): by `traceparent`, else by trace id
//!   (`HAProxy` propagating under a new parent id), else by target with alike headers, else (a
//!   rewritten target) by alike headers alone;
//! - for good when `HAProxy` relays its response ([`Tracker::claim_relay`]): a frontend response
//!   head that carries the `traceparent` a backend request carried claims that one; otherwise it
//!   claims an unclaimed backend response of its thread with the same status, one in its own
//!   trace first, then the closest headers, then the earliest read.
//!
//! Invariants:
//! - A backend exchange is filed (exported under a frontend request) at most once, and only when
//!   its [`Evidence`] is confirmed: by `traceparent` or target, or by a relay. A guessed link that no
//!   relay confirmed is counted as unlinked, never exported.
//! - A frontend request's `unfiled_backends` counts the backend exchanges linked to it and not yet
//!   filed; every relink moves that share with it ([`Tracker::move_link_counts`]), so a request is
//!   handed out exactly when its last backend exchange is filed.
//! - A relay never takes a backend exchange whose link had no rival ([`Evidence::Sole`]) from its
//!   request, and takes one linked elsewhere only within [`RELAY_WINDOW_NS`] of its response;
//!   except that a response carrying a `traceparent` `HAProxy` made (not the client's own) takes
//!   the backend exchange whose request carried it, whatever its link: that is exact.
//! - On a capture gap every guessed link of the process is given up ([`Evidence::Tainted`]).

use std::hash::BuildHasher as _;

use rustc_hash::FxBuildHasher;

use super::{Ctx, FrontRecord, POOL_LIMIT, Tracker};
use crate::exchange::{ClientExchange, Outcome};
use crate::head::{self, RequestHead, ResponseHead, TraceparentField};
use crate::trace_context::{TraceParent, parse_traceparent, trace_id_field};

/// Where a backend exchange stands with the relay of its response (see [`Tracker::claim_relay`]).
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
    pub(super) fn of(link: Option<Link>) -> Self {
        match link {
            None => Self::Unlinked,
            Some(l) if l.strength == LinkStrength::Sole => Self::Sole,
            Some(l) if l.strength == LinkStrength::Target => Self::Target,
            Some(_) => Self::Guessed,
        }
    }

    /// A relay may take it (see [`Tracker::claim_relay`]).
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

/// Longest time between reading a backend response head and relaying it to the client for the
/// relay to take a backend exchange that is not linked to the relaying request (see
/// [`Tracker::claim_relay`]). `HAProxy` relays within one pass over its events, microseconds
/// apart; 100 ms leaves room for a preempted thread on a loaded machine.
pub(super) const RELAY_WINDOW_NS: u64 = 100_000_000;

/// A tentative link (see [`Tracker::link`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct Link {
    pub(super) id: u64,
    pub(super) strength: LinkStrength,
}

/// A frontend request that may still be linked, with what linking compares hashed in advance.
#[derive(Clone, Copy, Debug)]
pub(super) struct Candidate {
    pub(super) id: u64,
    pub(super) tgid: u32,
    pub(super) tid: u32,
    /// Hash of method and target.
    pub(super) request_key: u64,
    /// Hash of the `traceparent` value, when there is exactly one.
    pub(super) traceparent_key: Option<u64>,
    /// Hash of that value's trace id, when the value is valid: `HAProxy` configured to propagate
    /// (`tracetap haproxy-snippet`) forwards a new parent id in the same trace, and a new trace for
    /// a request without a valid one.
    pub(super) trace_key: Option<u64>,
    /// Hash of the method alone (for rewritten targets).
    pub(super) method_key: u64,
    /// [`RequestHead::header_sig`].
    pub(super) header_sig: u64,
}

impl Candidate {
    pub(super) fn new(id: u64, ctx: Ctx, request: Option<&RequestHead>) -> Self {
        let (request_key, (traceparent_key, trace_key), method_key, header_sig) = match request {
            Some(r) => (
                FxBuildHasher.hash_one((&r.method, &r.target)),
                // A valid one only: `HAProxy` keeps the trace of a valid parent alone.
                (traceparent_key(r), trace_key(r)),
                FxBuildHasher.hash_one(&r.method),
                r.header_sig,
            ),
            None => (0, (None, None), 0, 0),
        };
        Self { id, tgid: ctx.key.0, tid: ctx.tid, request_key, traceparent_key, trace_key, method_key, header_sig }
    }
}

/// Hash of the trace id of a request's single valid `traceparent` (as [`Candidate`] keys it).
pub(super) fn trace_key(request: &RequestHead) -> Option<u64> {
    match &request.traceparent {
        TraceparentField::One(v) => parse_traceparent(v).map(|p| FxBuildHasher.hash_one(p.trace_id)),
        _ => None,
    }
}

/// Hash of a request's single `traceparent` value (as [`Candidate`] keys it).
pub(super) fn traceparent_key(request: &RequestHead) -> Option<u64> {
    match &request.traceparent {
        TraceparentField::One(v) => Some(FxBuildHasher.hash_one(v)),
        _ => None,
    }
}

/// The backend exchange's request carried `tp` (the same trace and parent ids).
fn carries(b: &BackRecord, tp: &TraceParent) -> bool {
    matches!(&b.exchange.request.traceparent, TraceparentField::One(v)
        if parse_traceparent(v).is_some_and(|p| p.trace_id == tp.trace_id && p.parent_id == tp.parent_id))
}

impl Tracker {
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
        let own = self.fronts.get(&id).and_then(|f| f.exchange.request.as_ref()).and_then(|r| match &r.traceparent {
            TraceparentField::One(v) => parse_traceparent(v),
            _ => None,
        });
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
    /// [`Tracker::claim_relay`], when no `traceparent` names it.
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

    /// Finds the frontend request that most likely caused a backend request (the tentative link;
    /// see the module notes): by identical `traceparent`; else on the same thread, by method and
    /// target with alike headers; else by method and the most alike headers (a rewritten target).
    /// Earliest first. A frontend request that already has a backend exchange is taken only for a
    /// re-sent request (HAProxy's `retry-on`): when no unlinked one matches and its earlier
    /// attempts are over.
    /// `keys` are the backend request's (`Candidate::new(0, ctx, Some(request))`), `new_trace`
    /// what [`Tracker::is_new_trace`] says of them.
    pub(super) fn link(&mut self, ctx: Ctx, request: &RequestHead, keys: &Candidate, new_trace: bool) -> Option<Link> {
        let tgid = ctx.key.0;
        if let Some(link) = self.link_retry(keys) {
            return Some(link);
        }
        let same_traceparent = |c: &Candidate, f: &FrontRecord| match (&request.traceparent, &f.exchange.request) {
            (TraceparentField::One(value), Some(r)) => {
                c.traceparent_key == keys.traceparent_key
                    && matches!(&r.traceparent, TraceparentField::One(v) if v == value)
            }
            _ => false,
        };
        let same_request = |_: &Candidate, f: &FrontRecord| matches!(&f.exchange.request, Some(r) if r.method == request.method && r.target == request.target);
        for retry in [false, true] {
            // A guessed (header-only) link does not keep a request from its own backend request.
            let eligible = |f: &FrontRecord| {
                if retry {
                    f.links >= LinkStrength::Target && f.open_backends == 0
                } else {
                    f.links < LinkStrength::Target
                }
            };
            // Keys are compared before the record is looked up, so a scan costs no hashing.
            let find = |rule: &dyn Fn(&Candidate, &FrontRecord) -> bool, key_matches: &dyn Fn(&Candidate) -> bool| {
                self.candidates
                    .iter()
                    .filter(|c| c.tgid == tgid && key_matches(c))
                    .find(|c| self.fronts.get(&c.id).is_some_and(|f| eligible(f) && rule(c, f)))
                    .map(|c| c.id)
            };
            let by_traceparent = keys
                .traceparent_key
                .and_then(|k| find(&same_traceparent, &|c: &Candidate| c.traceparent_key == Some(k)));
            // HAProxy forwards a client's header lines (adding and rewriting some), so a backend
            // request without any header line is no client request that had some: a health check.
            let forwarded = |c: &Candidate| keys.header_sig != 0 || c.header_sig == 0;
            let same_key = |c: &Candidate| c.tid == ctx.tid && c.request_key == keys.request_key && forwarded(c);
            // A backend request in the trace of a waiting request is one of that trace's requests;
            // when none of them can take it on the first pass (they hold links already), the
            // retry pass looks again rather than give it to a request of another trace.
            let by_trace_only = !retry && !new_trace && keys.trace_key.is_some();
            let found = by_traceparent
                .map(|id| Link { id, strength: LinkStrength::Sole })
                .or_else(|| self.link_by_trace(keys, request, &eligible))
                .or_else(|| {
                    if by_trace_only {
                        return None;
                    }
                    // Among the same target's requests, the one whose header lines the backend
                    // request carries most of (a cookie, a token, a request id tell clients apart),
                    // earliest among equals; a rival is another as alike.
                    let alike = |c: &Candidate| {
                        (!new_trace || c.trace_key.is_none(), (c.header_sig & keys.header_sig).count_ones())
                    };
                    let matching = || {
                        self.candidates
                            .iter()
                            .filter(|c| c.tgid == tgid && same_key(c))
                            .filter(|c| self.fronts.get(&c.id).is_some_and(|f| same_request(c, f)))
                    };
                    let chosen = matching()
                        .filter(|c| self.fronts.get(&c.id).is_some_and(&eligible))
                        .max_by_key(|c| (alike(c), std::cmp::Reverse(c.id)))?;
                    let rivals = matching().any(|c| c.id != chosen.id && alike(c) >= alike(chosen));
                    Some(Link {
                        id: chosen.id,
                        strength: if rivals { LinkStrength::Target } else { LinkStrength::Sole },
                    })
                })
                .or_else(|| if by_trace_only || retry { None } else { self.link_rewritten(keys, request, new_trace) });
            if let Some(link) = found {
                // Only a request that holds a guessed link has any to drop (this scans open backend
                // exchanges, so it is not done per request).
                if link.strength >= LinkStrength::Target
                    && self.fronts.get(&link.id).is_some_and(|f| f.links == LinkStrength::Guessed)
                {
                    self.drop_guessed_links(link.id);
                }
                if let Some(f) = self.fronts.get_mut(&link.id) {
                    f.links = f.links.max(link.strength);
                }
                return Some(link);
            }
        }
        None
    }

    /// A backend request whose valid traceparent names no waiting request's trace (of its
    /// process) was given a new trace by `HAProxy` (the snippet's lines), which it does only for a
    /// request without a valid one: among alike requests, those come first, and a relay prefers
    /// such backend exchanges for them.
    pub(super) fn is_new_trace(&self, keys: &Candidate) -> bool {
        keys.trace_key.is_some_and(|k| !self.candidates.iter().any(|c| c.tgid == keys.tgid && c.trace_key == Some(k)))
    }

    /// A rewritten target (first pass only): the most alike headers among the same method's
    /// requests of the thread that have no link yet; a *guessed* link.
    fn link_rewritten(&self, keys: &Candidate, request: &RequestHead, new_trace: bool) -> Option<Link> {
        self.candidates
            .iter()
            .filter(|c| {
                c.tgid == keys.tgid
                    && c.tid == keys.tid
                    && c.method_key == keys.method_key
                    && head::shares_headers(c.header_sig, keys.header_sig)
            })
            .filter(|c| {
                self.fronts.get(&c.id).is_some_and(|f| {
                    f.links == LinkStrength::None
                        && matches!(&f.exchange.request, Some(r) if r.method == request.method)
                })
            })
            .max_by_key(|c| {
                // Earliest among the most alike: `max_by_key` keeps the last maximum.
                (
                    !new_trace || c.trace_key.is_none(),
                    (c.header_sig & keys.header_sig).count_ones(),
                    std::cmp::Reverse((c.header_sig ^ keys.header_sig).count_ones()),
                    std::cmp::Reverse(c.id),
                )
            })
            .map(|c| Link { id: c.id, strength: LinkStrength::Guessed })
    }

    /// A backend request carrying the very `traceparent` of an earlier backend exchange of a
    /// waiting request, which no waiting request carries itself: `HAProxy` made that value (the
    /// snippet's lines run once per request) and resent the request, a retry (`retry-on`,
    /// `redispatch`). Without the lines a client's own `traceparent` is forwarded unchanged and
    /// some waiting request carries it, so this never applies.
    fn link_retry(&mut self, keys: &Candidate) -> Option<Link> {
        let key = keys.traceparent_key?;
        if self.candidates.iter().any(|c| c.tgid == keys.tgid && c.traceparent_key == Some(key)) {
            return None;
        }
        // The earlier attempt is still open, or already filed under its request (it ended).
        let front = self
            .backs
            .values()
            .filter(|b| b.tgid == keys.tgid && b.traceparent_key == Some(key))
            .find_map(|b| b.front.filter(|f| self.fronts.contains_key(f)))
            .or_else(|| {
                self.candidates.iter().filter(|c| c.tgid == keys.tgid).map(|c| c.id).find(|id| {
                    self.fronts.get(id).is_some_and(|f| {
                        f.exchange.clients.iter().any(|attempt| traceparent_key(&attempt.request) == Some(key))
                    })
                })
            })?;
        let f = self.fronts.get_mut(&front)?;
        f.links = f.links.max(LinkStrength::Sole);
        Some(Link { id: front, strength: LinkStrength::Sole })
    }

    /// A backend request in the trace of a waiting request, under a new parent id: `HAProxy`
    /// configured to propagate (`tracetap haproxy-snippet`) keeps a valid incoming trace id. A
    /// trace id is random, so it names the request unless the client sent it on several at
    /// once; then the same target and the most alike headers choose, and a relay may correct it.
    fn link_by_trace(
        &self,
        keys: &Candidate,
        request: &RequestHead,
        eligible: &dyn Fn(&FrontRecord) -> bool,
    ) -> Option<Link> {
        let key = keys.trace_key?;
        let TraceparentField::One(value) = &request.traceparent else { return None };
        let trace = trace_id_field(value)?;
        let same_trace = |c: &&Candidate| {
            c.tgid == keys.tgid
                && c.trace_key == Some(key)
                && self.fronts.get(&c.id).is_some_and(|f| {
                    matches!(&f.exchange.request, Some(r) if matches!(&r.traceparent, TraceparentField::One(v) if trace_id_field(v) == Some(trace)))
                })
        };
        // HAProxy writes a backend request on the thread that read its client's request: with two
        // connections sending one trace at once, the thread tells them apart before the target
        // and headers do.
        let alike = |c: &Candidate| {
            (c.tid == keys.tid, c.request_key == keys.request_key, (c.header_sig & keys.header_sig).count_ones())
        };
        let chosen = self
            .candidates
            .iter()
            .filter(same_trace)
            .filter(|c| self.fronts.get(&c.id).is_some_and(eligible))
            .max_by_key(|c| (alike(c), std::cmp::Reverse(c.id)))?;
        let rivals = self.candidates.iter().filter(same_trace).any(|c| c.id != chosen.id);
        let strength = match (rivals, chosen.request_key == keys.request_key) {
            (false, _) => LinkStrength::Sole,
            (true, true) => LinkStrength::Target,
            // Rivals in the trace and a rewritten target: headers alone chose, as for any
            // rewritten target, so a relay must confirm it.
            (true, false) => LinkStrength::Guessed,
        };
        Some(Link { id: chosen.id, strength })
    }

    /// A capture gap in process `tgid`: every link guessed from headers alone is given up, and
    /// those backend exchanges are never exported (see [`Evidence::Tainted`]).
    pub(super) fn taint_guessed_links(&mut self, tgid: u32) {
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

    /// A backend exchange is over. It is filed under its frontend exchange now, unless its
    /// response still waits to be claimed by the relay (see [`Tracker::claim_relay`]).
    pub(super) fn end_backend(&mut self, back_id: u64, ts: u64, outcome: Outcome) {
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
}

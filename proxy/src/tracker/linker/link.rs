//! Linking a backend request when `HAProxy` writes it: the tentative link to the frontend
//! request that caused it (see the parent module's notes and `docs/ARCHITECTURE.md`, "Linking
//! model"), by `traceparent`, else trace id, else target with alike headers, else alike headers
//! alone. Keys are hashed once per request ([`Candidate`]) so a scan over the waiting requests
//! costs no hashing.

use std::hash::BuildHasher as _;

use rustc_hash::FxBuildHasher;

use super::{FrontRecord, LinkStrength, Linker};
use crate::head::{self, RequestHead, TraceparentField};
use crate::trace_context::trace_id_field;
use crate::tracker::types::Ctx;

/// A tentative link (see [`Linker::link`]).
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
    request.parsed_traceparent.map(|p| FxBuildHasher.hash_one(p.trace_id))
}

/// Hash of a request's single `traceparent` value (as [`Candidate`] keys it).
pub(super) fn traceparent_key(request: &RequestHead) -> Option<u64> {
    match &request.traceparent {
        TraceparentField::One(v) => Some(FxBuildHasher.hash_one(v)),
        _ => None,
    }
}

impl Linker {
    /// Finds the frontend request that most likely caused a backend request (the tentative link;
    /// see the module notes): by identical `traceparent`; else on the same thread, by method and
    /// target with alike headers; else by method and the most alike headers (a rewritten target).
    /// Earliest first. A frontend request that already has a backend exchange is taken only for a
    /// re-sent request (HAProxy's `retry-on`): when no unlinked one matches and its earlier
    /// attempts are over.
    /// `keys` are the backend request's (`Candidate::new(0, ctx, Some(request))`), `new_trace`
    /// what [`Linker::is_new_trace`] says of them.
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

    /// True when a waiting frontend request of process `tgid` carries the trace of `request`'s
    /// single valid `traceparent`.
    pub(in crate::tracker) fn waits_in_trace(&self, tgid: u32, request: &RequestHead) -> bool {
        trace_key(request).is_some_and(|k| self.candidates.iter().any(|c| c.tgid == tgid && c.trace_key == Some(k)))
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
}

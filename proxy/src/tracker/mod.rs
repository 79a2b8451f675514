//! Turns the syscall events of the watched processes into finished exchanges.
//!
//! Model:
//! - A connection is keyed by `(tgid, fd)`. `accept`/`connect` start a new connection on that key
//!   and `close` ends it, so a reused fd number is always a new connection.
//! - A connection's role comes from what flows on it: `HAProxy` *reads* requests on frontend sockets
//!   and *writes* requests on backend sockets. Accepted sockets start as frontends, connected ones as
//!   backends; sockets the tracker never saw open (older than the agent) get their role from their
//!   first bytes; anything that does not speak HTTP becomes opaque and is ignored until closed.
//! - A connection speaks HTTP/1 or HTTP/2, decided by its first request bytes: the HTTP/2 preface
//!   (cleartext `proto h2` and h2c with prior knowledge, or ALPN h2 inside TLS) makes it an HTTP/2
//!   connection, decoded by the `http2` module. HTTP/2 needs the connection's start (the HPACK
//!   state is built from the first header block on), so one seen mid-way is opaque.
//! - TLS: [`Op::Tls`] says the connection's bytes from then on are the TLS plaintext, parsed like
//!   cleartext; its exchanges carry [`TlsInfo`](crate::exchange::TlsInfo).
//! - HTTP/1 responses pair with requests in order (HTTP/1 has no other way); HTTP/2 ones by stream
//!   id. Interim 1xx responses are skipped.
//! - Each backend request is linked to the frontend request that caused it, whatever HTTP version
//!   either speaks: tentatively when it is written (by `traceparent`, target, or alike headers),
//!   for good when `HAProxy` relays its response to a client on the same thread; see the `linker`
//!   module.
//! - A frontend exchange is handed out once its response is done *and* every backend exchange
//!   linked to it is filed, so a SERVER span always leaves with all its CLIENT spans.
//! - Capture gaps: records carry a per-connection sequence number ([`SyscallEvent::seq`]). When one
//!   is missing the connection may have lost bytes: its open exchanges end with
//!   [`Outcome::CaptureGap`] and both directions of an HTTP/1 connection resynchronise at the next
//!   message start, so a response is never paired with the wrong request. An HTTP/2 connection
//!   cannot resynchronise (its HPACK state is lost) and becomes opaque.
//!
//! - Sampled out at the head ([`Limits::sampled_out`], `crate::sampled_out`): a frontend request
//!   whose own `traceparent` drops it takes the place of an exchange in its connection's queue as
//!   [`SAMPLED_OUT`] (on HTTP/2, its stream carries it, and its context is kept with the stream's
//!   number, as streams end in any order), so that its response still pairs with it, and is never
//!   an exchange: not a link candidate, not claimed by a relay, not handed out. A backend request
//!   (HTTP/1 or HTTP/2) in the trace of such a request, in the same process, is decided as the
//!   agent would later ([`at_head`]) and, dropped, left out the same way (so is one forwarded as
//!   sampled when no kept request of that trace waits, counted: [`AtHead::Disagrees`]). A backend
//!   request of any other trace is linked as always, so a context `HAProxy` made for a request is
//!   still followed.
//!
//! - Connections that turn out not to speak HTTP (opaque, `mode tcp`, tunnels after an upgrade or
//!   CONNECT, HTTP/2 connections that lost their HPACK state) are reported through
//!   [`Tracker::take_opaque_marks`], so that the probes can stop copying their bytes; records
//!   without payload on them are then expected.
//!
//! Invariants: memory is bounded by the number of open connections and open exchanges; exchanges
//! idle longer than [`Limits::exchange_timeout_ns`] are expired by [`Tracker::expire`] and counted.

use rustc_hash::FxHashMap;

use crate::exchange::{Outcome, ServerExchange};
use crate::framing::Chunk;
use crate::h2;
use crate::head::RequestHead;
use crate::proxy_protocol;
use crate::sampled_out::{SampledOutRule, answer_frames_like_get};
use crate::trace_context::TraceParent;

mod connection;
mod http1;
mod http2;
mod lifecycle;
mod linker;
mod types;

use connection::Connection;
pub use linker::QUARANTINE_NS;
use linker::{BackConn, Linker};
use types::Ctx;
pub use types::{Limits, Op, OpaqueMark, SyscallEvent, TrackerStats};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// Opened before we watched; role decided by the first bytes.
    Unknown,
    Frontend,
    Backend,
    /// Not HTTP (or an HTTP/2 connection whose HPACK state was lost); ignored until closed.
    Opaque,
}

/// Why a connection is opaque.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpaqueCause {
    /// Its first bytes were not HTTP, before any TLS was declared: they may be a TLS handshake
    /// that ran before the TLS probes reached the process (a worker hooked just after it
    /// started), so a later [`Op::Tls`] starts the connection over, as plaintext.
    FirstBytes,
    /// Anything else (`mode tcp`, bytes after TLS was declared, a bad PROXY header).
    Other,
}

/// The tracker. Feed it with [`Tracker::handle`]; take results with [`Tracker::drain`].
#[derive(Debug, Default)]
pub struct Tracker {
    limits: Limits,
    conns: FxHashMap<(u32, i32), Connection>,
    /// The open exchanges and their links.
    linker: Linker,
    /// The tracker's own counters (the linker keeps its share, see [`Tracker::stats`]).
    stats: TrackerStats,
    /// Connections that became opaque since [`Tracker::take_opaque_marks`] was last called.
    opaque_marks: Vec<OpaqueMark>,
    /// Events of the HTTP/2 call being handled, kept to reuse the allocation.
    h2_events: Vec<h2::Event>,
    /// The traces of the frontend requests sampled out and not answered yet.
    sampled_out: SampledOutTraces,
}

/// Takes the place of an exchange id in a connection's queue for a request sampled out at its
/// head (see the module notes). The linker numbers exchanges from 0 up and never reaches it; every
/// linker call ignores it, as it does an id it does not know.
pub(super) const SAMPLED_OUT: u64 = u64::MAX;

/// The contexts of the frontend requests sampled out and not answered yet, per process: how many
/// such requests carry each trace id, and each exact context (trace and parent id). Bounded by
/// the requests in connections' queues.
#[derive(Debug, Default)]
struct SampledOutTraces {
    traces: FxHashMap<(u32, [u8; 16]), u32>,
    contexts: FxHashMap<(u32, [u8; 16], [u8; 8]), u32>,
}

impl SampledOutTraces {
    fn add(&mut self, tgid: u32, context: &TraceParent) {
        *self.traces.entry((tgid, context.trace_id)).or_default() += 1;
        *self.contexts.entry((tgid, context.trace_id, context.parent_id)).or_default() += 1;
    }

    fn release(&mut self, tgid: u32, context: &TraceParent) {
        count_down(&mut self.traces, (tgid, context.trace_id));
        count_down(&mut self.contexts, (tgid, context.trace_id, context.parent_id));
    }

    fn has_trace(&self, tgid: u32, trace: &[u8; 16]) -> bool {
        self.traces.contains_key(&(tgid, *trace))
    }

    /// True when a waiting dropped request carries this very context: `HAProxy` forwarded it
    /// unchanged (it did not make one of its own).
    fn has_context(&self, tgid: u32, context: &TraceParent) -> bool {
        self.contexts.contains_key(&(tgid, context.trace_id, context.parent_id))
    }
}

fn count_down<K: std::hash::Hash + Eq>(counts: &mut FxHashMap<K, u32>, key: K) {
    if let std::collections::hash_map::Entry::Occupied(mut waiting) = counts.entry(key) {
        *waiting.get_mut() -= 1;
        if *waiting.get() == 0 {
            waiting.remove();
        }
    }
}

/// What a request's head decides before any exchange exists (see the module notes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AtHead {
    /// An exchange, linked as always.
    Kept,
    /// Only paired: a frontend request its own context drops (that context), or a backend
    /// request in the trace of such a frontend request of the same process that is dropped too:
    /// it carries that very context (forwarded unchanged, decided like it), or a context `HAProxy`
    /// made, not sampled (the backend follows that flag).
    SampledOut(TraceParent),
    /// Only paired too, and counted: a backend request in such a trace with a context `HAProxy`
    /// made, sampled, when no kept frontend request of that trace waits. `HAProxy` forwarded
    /// "sampled" for a request the sampler dropped at its head (lines made for another sampler);
    /// that request is no exchange, and linking its backend request to another would put that
    /// one in its trace.
    Disagrees,
}

impl AtHead {
    fn is_kept(self) -> bool {
        self == Self::Kept
    }
}

/// [`AtHead`] for a request process `tgid` read (frontend) or wrote (backend). `HEAD` and
/// `CONNECT` requests are always kept: a request sampled out keeps no method, and its response is
/// framed as a `GET`'s.
fn at_head(
    drop_rule: SampledOutRule,
    waiting: &SampledOutTraces,
    linker: &Linker,
    role: Role,
    tgid: u32,
    request: &RequestHead,
) -> AtHead {
    if !answer_frames_like_get(&request.method) {
        return AtHead::Kept;
    }
    if role == Role::Frontend {
        return drop_rule.dropped_parent(request).map_or(AtHead::Kept, AtHead::SampledOut);
    }
    let Some(context) = request.parsed_traceparent else { return AtHead::Kept };
    if !waiting.has_trace(tgid, &context.trace_id) {
        return AtHead::Kept;
    }
    // As the agent decides later (`propagated_context`): a context HAProxy made decides by its
    // flag; one forwarded unchanged, as the request it came with.
    let dropped = if waiting.has_context(tgid, &context) {
        drop_rule.drops(&context, request.tracestate.as_deref())
    } else {
        !context.sampled()
    };
    if dropped {
        AtHead::SampledOut(context)
    } else if linker.waits_in_trace(tgid, request) {
        AtHead::Kept
    } else {
        AtHead::Disagrees
    }
}

/// Most marks kept for [`Tracker::take_opaque_marks`]: a caller that never takes them (tests,
/// fuzzing) must not make the tracker grow. A mark left out only costs copies.
const MAX_PENDING_MARKS: usize = 1024;

/// Notes that the connection `key` became opaque, when the probes have a name for it.
fn mark_opaque(marks: &mut Vec<OpaqueMark>, key: (u32, i32), opened_ns: u64) {
    if opened_ns != 0 && marks.len() < MAX_PENDING_MARKS {
        marks.push(OpaqueMark { tgid: key.0, fd: key.1, opened_ns });
    }
}

/// Records a client whose first bytes were not HTTP may send before `HAProxy` answers them: past
/// this, the connection is taken for something other than HTTP and turns opaque.
const MAX_UNANSWERED_RECORDS: usize = 4;

impl Tracker {
    #[must_use]
    pub fn new(limits: Limits) -> Self {
        Self { limits, ..Self::default() }
    }

    #[must_use]
    pub fn stats(&self) -> TrackerStats {
        let mut stats = self.stats;
        self.linker.add_stats(&mut stats);
        stats
    }

    /// Connections that became opaque since the last call (see [`OpaqueMark`]).
    pub fn take_opaque_marks(&mut self) -> std::vec::Drain<'_, OpaqueMark> {
        self.opaque_marks.drain(..)
    }

    /// Number of connections currently tracked.
    #[must_use]
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Number of frontend exchanges currently open.
    #[must_use]
    pub fn open_exchanges(&self) -> usize {
        self.linker.open_fronts()
    }

    /// Takes back a handed-out exchange so its buffers serve the next requests.
    pub fn recycle(&mut self, ex: ServerExchange) {
        self.linker.recycle(ex);
    }

    /// Moves the finished exchanges out.
    pub fn drain(&mut self) -> std::vec::Drain<'_, ServerExchange> {
        self.linker.drain()
    }

    pub fn handle(&mut self, ev: &SyscallEvent<'_>) {
        let key = (ev.tgid, ev.fd);
        match ev.op {
            Op::Accept { peer, local } => {
                self.close(key, ev.ts_ns);
                let mut conn = Connection::new(Role::Frontend, peer);
                conn.local = local;
                conn.last_seq = ev.seq;
                conn.opened_ns = if ev.seq == 0 { 0 } else { ev.ts_ns };
                conn.expect_proxy_header = true;
                self.conns.insert(key, conn);
                return;
            }
            Op::Connect { server } => {
                self.close(key, ev.ts_ns);
                let mut conn = Connection::new(Role::Backend, server);
                conn.connect_ns = Some(ev.ts_ns);
                conn.last_seq = ev.seq;
                conn.opened_ns = if ev.seq == 0 { 0 } else { ev.ts_ns };
                conn.expect_proxy_header = true;
                self.conns.insert(key, conn);
                return;
            }
            Op::Close => {
                // Numbered like the rest: a record lost just before the close is a gap too.
                self.check_sequence(key, ev);
                self.close(key, ev.ts_ns);
                return;
            }
            Op::Ignore => {
                let opened_ns = self.conns.get(&key).map_or(0, |c| c.opened_ns);
                self.close(key, ev.ts_ns);
                let mut conn = Connection::new(Role::Opaque, None);
                conn.opened_ns = opened_ns;
                self.conns.insert(key, conn);
                mark_opaque(&mut self.opaque_marks, key, opened_ns);
                return;
            }
            Op::Tls { version } => {
                self.tls(key, ev, version);
                return;
            }
            Op::PeerGone => {
                self.check_sequence(key, ev);
                self.end_of_stream(key, ev.ts_ns, false);
                return;
            }
            Op::DroppedRequest { len, context } => {
                self.dropped_request(key, ev, len, context);
                return;
            }
            Op::Read(_) | Op::Write(_) => {}
        }
        match ev.op {
            Op::Read(chunk) if chunk.total == 0 => {
                self.check_sequence(key, ev);
                self.end_of_stream(key, ev.ts_ns, true);
            }
            Op::Read(chunk) => self.data(key, ev, chunk, Direction::Ingress),
            Op::Write(chunk) => self.data(key, ev, chunk, Direction::Egress),
            _ => {}
        }
    }

    /// Records were lost (the probes' loss epoch changed) before the record about to be handled,
    /// which came at `ts_ns`: which connection lost them is not known yet (a gap shows when its next
    /// record comes), but any link could now join a request to another's backend exchange. Links
    /// that had rivals or rest on headers alone are given up, and for [`QUARANTINE_NS`] no new link
    /// is made and a relay only confirms a request's own sole link. What is given up is counted in
    /// [`TrackerStats::quarantined_backend_exchanges`]; SERVER spans are still exported.
    pub fn records_lost(&mut self, ts_ns: u64) {
        self.linker.records_lost(ts_ns);
    }

    /// Forgets a process that exited: its open exchanges end as if its sockets closed.
    pub fn forget_process(&mut self, tgid: u32, now_ns: u64) {
        let keys: Vec<_> = self.conns.keys().filter(|(t, _)| *t == tgid).copied().collect();
        for key in keys {
            self.close(key, now_ns);
        }
    }

    /// Expires exchanges idle for too long and hands out finished exchanges that waited too long
    /// for their backends. Call it periodically with the current monotonic time.
    pub fn expire(&mut self, now_ns: u64) {
        let handed_out = self.linker.expire(now_ns, &self.limits);
        for id in handed_out {
            for conn in self.conns.values_mut() {
                conn.fronts.retain(|c| *c != id);
                if let Some(h2) = &mut conn.h2 {
                    h2.streams.retain(|(_, c)| *c != id);
                }
            }
        }
    }

    fn data(&mut self, key: (u32, i32), ev: &SyscallEvent<'_>, chunk: Chunk<'_>, dir: Direction) {
        let mut conn = self.conns.entry(key).or_insert_with(|| Connection::new(Role::Unknown, None));
        // The sequence check, on the lookup this record needs anyway.
        if conn.take_seq(ev.seq, &mut self.stats) {
            self.capture_gap(key, ev.ts_ns);
            conn = self.conns.get_mut(&key).expect("present");
        }
        if conn.role == Role::Unknown && chunk.known.is_empty() {
            // Bytes we cannot see (spliced, or cut by the window) say nothing about the role.
            return;
        }
        if conn.role == Role::Unknown {
            conn.role = match (classify(chunk.known), dir) {
                (Some(Kind::Request), Direction::Ingress) | (Some(Kind::Response), Direction::Egress) => Role::Frontend,
                (Some(Kind::Request), Direction::Egress) | (Some(Kind::Response), Direction::Ingress) => Role::Backend,
                (None, _) => Role::Opaque,
            };
            if conn.role == Role::Opaque {
                conn.opaque_cause = if conn.tls.is_none() { OpaqueCause::FirstBytes } else { OpaqueCause::Other };
                self.stats.unknown_descriptors += 1;
            }
        }
        let role = conn.role;
        let mut chunk = chunk;
        if conn.expect_proxy_header
            && matches!((role, dir), (Role::Frontend, Direction::Ingress) | (Role::Backend, Direction::Egress))
        {
            match proxy_protocol::parse(chunk.known, chunk.total) {
                proxy_protocol::Start::Header { len, source } => {
                    conn.expect_proxy_header = false;
                    if role == Role::Frontend {
                        conn.proxy_client = source;
                    }
                    let rest = chunk.total - len;
                    if rest == 0 {
                        return;
                    }
                    let skip = usize::try_from(len).map_or(chunk.known.len(), |l| l.min(chunk.known.len()));
                    chunk = Chunk { known: &chunk.known[skip..], total: rest, tail: chunk.tail };
                }
                proxy_protocol::Start::Invalid => {
                    conn.expect_proxy_header = false;
                    self.stats.parse_errors += 1;
                    conn.role = Role::Opaque;
                    self.stats.opaque_connections += 1;
                    mark_opaque(&mut self.opaque_marks, key, conn.opened_ns);
                    return;
                }
                // HAProxy peeks at a header and then reads exactly it, so a header arrives whole: a
                // call that only starts like one (a lone CRLF before a request) is no header.
                proxy_protocol::Start::NotProxy | proxy_protocol::Start::Incomplete => {
                    conn.expect_proxy_header = false;
                }
            }
        }
        let ctx = Ctx { key, tid: ev.tid, ts: ev.ts_ns };
        let Some(held) = conn.detect_h2(role, dir, chunk, &mut self.stats) else { return };
        let mut framed = false;
        if held > 0 {
            framed = self.dispatch(ctx, role, Chunk::complete(&h2::PREFACE[..held]), dir);
        }
        framed |= self.dispatch(ctx, role, chunk, dir);
        if !framed {
            // Only body bytes: a head or a message end already counted as activity.
            self.touch(key, role, ev.ts_ns);
        }
    }

    /// Hands one call's bytes to the parser of their connection and direction; true when they held
    /// a head or a message end (see [`Tracker::frame`]).
    fn dispatch(&mut self, ctx: Ctx, role: Role, chunk: Chunk<'_>, dir: Direction) -> bool {
        if self.conns.get(&ctx.key).is_some_and(|c| c.h2.is_some()) {
            return self.h2_data(ctx, role, chunk, dir);
        }
        match (role, dir) {
            (Role::Frontend, Direction::Ingress) | (Role::Backend, Direction::Egress) => {
                self.frame(ctx, chunk, dir, Kind::Request)
            }
            (Role::Frontend, Direction::Egress) | (Role::Backend, Direction::Ingress) => {
                self.frame(ctx, chunk, dir, Kind::Response)
            }
            (Role::Unknown | Role::Opaque, _) => true,
        }
    }

    /// Any bytes on a connection are activity of its current exchange: a body that streams for
    /// longer than the expiry is not expired mid-stream.
    fn touch(&mut self, key: (u32, i32), role: Role, ts: u64) {
        let Some(conn) = self.conns.get(&key) else { return };
        // HTTP/1 bytes belong to the oldest exchange; HTTP/2 bytes may be any open stream's.
        let n = if conn.h2.is_some() { usize::MAX } else { 1 };
        match role {
            Role::Frontend => self.linker.touch_fronts(conn.fronts.iter().take(n).copied(), ts),
            Role::Backend => self.linker.touch_backs(conn.backs.iter().take(n).copied(), ts),
            Role::Unknown | Role::Opaque => {}
        }
    }

    /// A request read on an HTTP/1 frontend: an exchange, unless its head decided otherwise.
    fn new_h1_front(&mut self, ctx: Ctx, request: RequestHead, started: u64, at_head: AtHead) {
        let AtHead::SampledOut(context) = at_head else {
            self.new_front(ctx, request, started);
            return;
        };
        self.linker.return_head(request);
        self.sample_out_front(ctx, 0, context);
        self.conns.get_mut(&ctx.key).expect("present").fronts.push_back(SAMPLED_OUT);
    }

    /// A frontend request dropped at its head (on HTTP/2, on `stream`): counted, its context
    /// waiting until it is answered.
    fn sample_out_front(&mut self, ctx: Ctx, stream: u32, context: TraceParent) {
        self.stats.frontend_requests += 1;
        self.stats.sampled_out_requests += 1;
        self.sampled_out.add(ctx.key.0, &context);
        let conn = self.conns.get_mut(&ctx.key).expect("present");
        conn.sampled_out_contexts.push_back((stream, context));
        conn.gapped = false;
        conn.spoke_http = true;
        conn.rejected = None;
    }

    /// A request read on a frontend; returns its exchange id.
    fn new_front(&mut self, ctx: Ctx, request: RequestHead, started: u64) -> u64 {
        let conn = self.conns.get_mut(&ctx.key).expect("present");
        let id = self.linker.new_front(ctx, request, started, conn.front_conn());
        conn.fronts.push_back(id);
        conn.gapped = false;
        conn.spoke_http = true;
        conn.rejected = None;
        id
    }

    /// A request written on a backend; returns its exchange id, or [`SAMPLED_OUT`] when its head
    /// decided so ([`at_head`]).
    fn new_backend(&mut self, ctx: Ctx, request: RequestHead, started: u64, at_head: AtHead) -> u64 {
        let conn = self.conns.get_mut(&ctx.key).expect("present");
        let origin = BackConn {
            server: conn.addr,
            tls: conn.tls,
            // Only the connection's first request waited for its connect; a later one on an
            // HTTP/1 connection waited for the one before it (HTTP/2 ones share the connection).
            connect_ns: conn.connect_ns.take(),
            free_since_ns: if conn.h2.is_none() { conn.free_since_ns } else { None },
        };
        conn.spoke_http = true;
        let id = if at_head.is_kept() {
            self.linker.new_backend(ctx, request, started, origin)
        } else {
            self.linker.return_head(request);
            self.stats.backend_requests += 1;
            if at_head == AtHead::Disagrees {
                self.stats.head_disagreements += 1;
            } else {
                self.stats.sampled_out_backend_requests += 1;
            }
            SAMPLED_OUT
        };
        self.conns.get_mut(&ctx.key).expect("present").backs.push_back(id);
        id
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    Ingress,
    Egress,
}

impl Direction {
    fn reverse(self) -> Self {
        match self {
            Self::Ingress => Self::Egress,
            Self::Egress => Self::Ingress,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Request,
    Response,
}

/// Guesses what the first bytes of a connection's stream are.
fn classify(bytes: &[u8]) -> Option<Kind> {
    if bytes.starts_with(b"HTTP/1.") {
        return Some(Kind::Response);
    }
    let sp = bytes.iter().take(33).position(|b| *b == b' ')?;
    let method = &bytes[..sp];
    let is_token = !method.is_empty() && method.iter().all(|b| b.is_ascii_uppercase() || *b == b'-' || *b == b'_');
    let rest = &bytes[sp + 1..];
    (is_token
        && (rest.starts_with(b"/") || rest.starts_with(b"http") || rest.starts_with(b"*") || method == b"CONNECT"))
        .then_some(Kind::Request)
}

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
//!   cleartext; its exchanges carry [`TlsInfo`].
//! - HTTP/1 responses pair with requests in order (HTTP/1 has no other way); HTTP/2 ones by stream
//!   id. Interim 1xx responses are skipped.
//! - Each backend request is linked to the frontend request that caused it, whatever HTTP version
//!   either speaks: tentatively when it is written (by `traceparent`, target, or alike headers),
//!   for good when `HAProxy` relays its response to a client on the same thread; see the `linking`
//!   module.
//! - A frontend exchange is handed out once its response is done *and* every backend exchange
//!   linked to it is filed, so a SERVER span always leaves with all its CLIENT spans.
//! - Capture gaps: records carry a per-connection sequence number ([`SyscallEvent::seq`]). When one
//!   is missing the connection may have lost bytes: its open exchanges end with
//!   [`Outcome::CaptureGap`] and both directions of an HTTP/1 connection resynchronise at the next
//!   message start, so a response is never paired with the wrong request. An HTTP/2 connection
//!   cannot resynchronise (its HPACK state is lost) and becomes opaque.
//!
//! - Connections that turn out not to speak HTTP (opaque, `mode tcp`, tunnels after an upgrade or
//!   CONNECT, HTTP/2 connections that lost their HPACK state) are reported through
//!   [`Tracker::take_opaque_marks`], so that the probes can stop copying their bytes; records
//!   without payload on them are then expected.
//!
//! Invariants: memory is bounded by the number of open connections and open exchanges; exchanges
//! idle longer than [`Limits::exchange_timeout_ns`] are expired by [`Tracker::expire`] and counted.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::exchange::{ClientExchange, Outcome, ServerExchange, TlsInfo};
use crate::framing::{Chunk, Framer};
use crate::h2;
use crate::head::RequestHead;
use crate::proxy_protocol;

mod connection;
mod http1;
mod http2;
mod linking;
mod types;

use connection::Connection;
pub use types::{Limits, Op, OpaqueMark, SyscallEvent, TrackerStats};

use linking::{BackRecord, Candidate, Evidence, LinkStrength, Relay};

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

/// A frontend request from its head until it is handed out.
#[derive(Debug)]
struct FrontRecord {
    exchange: ServerExchange,
    /// Linked backend exchanges not ended yet.
    open_backends: u32,
    /// Linked backend exchanges not filed under this one yet (ended ones may wait for their relay).
    unfiled_backends: u32,
    /// The strongest link it received. From [`LinkStrength::Sole`] on, its relay only ever claims
    /// its own backend exchanges; a guessed link does not keep it from its own backend request.
    links: LinkStrength,
    /// The response started: no more links.
    responding: bool,
    /// The frontend exchange ended; waiting for `open_backends` to reach 0.
    done: bool,
    last_activity_ns: u64,
}

/// The tracker. Feed it with [`Tracker::handle`]; take results with [`Tracker::drain`].
#[derive(Debug, Default)]
pub struct Tracker {
    limits: Limits,
    conns: FxHashMap<(u32, i32), Connection>,
    fronts: FxHashMap<u64, FrontRecord>,
    /// Frontend requests that may still be linked, oldest first.
    candidates: VecDeque<Candidate>,
    /// Backend exchanges from their request until they are filed.
    backs: FxHashMap<u64, BackRecord>,
    /// Ids of backend exchanges in [`Relay::Pending`], in the order their response heads were read.
    relays: VecDeque<u64>,
    /// Until then, records were lost too recently to trust a new link (see [`Tracker::records_lost`]).
    quarantine_until_ns: u64,
    next_id: u64,
    stats: TrackerStats,
    finished: Vec<ServerExchange>,
    /// Request heads and client lists of handed-out exchanges, reused so that parsing a request
    /// allocates nothing in steady state (see [`Tracker::recycle`]).
    head_pool: Vec<RequestHead>,
    clients_pool: Vec<Vec<ClientExchange>>,
    /// Connections that became opaque since [`Tracker::take_opaque_marks`] was last called.
    opaque_marks: Vec<OpaqueMark>,
    /// Events of the HTTP/2 call being handled, kept to reuse the allocation.
    h2_events: Vec<h2::Event>,
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

/// How long after a loss of records no new link is trusted: the lost record may have been a
/// frontend request whose backend request is still to come, and would link to the wrong one.
pub const QUARANTINE_NS: u64 = 1_000_000_000;

/// Records a client whose first bytes were not HTTP may send before `HAProxy` answers them: past
/// this, the connection is taken for something other than HTTP and turns opaque.
const MAX_UNANSWERED_RECORDS: usize = 4;

/// Most recycled heads (and client lists) kept for reuse.
const POOL_LIMIT: usize = 4096;

impl Tracker {
    #[must_use]
    pub fn new(limits: Limits) -> Self {
        Self { limits, ..Self::default() }
    }

    #[must_use]
    pub fn stats(&self) -> TrackerStats {
        self.stats
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
        self.fronts.len()
    }

    /// Takes back a handed-out exchange so its buffers serve the next requests.
    pub fn recycle(&mut self, mut ex: ServerExchange) {
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
    pub fn drain(&mut self) -> std::vec::Drain<'_, ServerExchange> {
        self.finished.drain(..)
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

    /// The connection `key` runs in TLS: its exchanges carry `tls`, and its bytes from now on are
    /// the plaintext, parsed from scratch (a PROXY header came before the handshake, if any).
    fn tls(&mut self, key: (u32, i32), ev: &SyscallEvent<'_>, version: u16) {
        if ev.seq != 0 {
            self.check_sequence(key, ev);
        }
        let conn = self.conns.entry(key).or_insert_with(|| Connection::new(Role::Unknown, None));
        conn.tls = Some(TlsInfo::from_wire(version));
        conn.expect_proxy_header = false;
        if conn.role == Role::Opaque && conn.opaque_cause == OpaqueCause::FirstBytes {
            // The bytes before were the handshake's ciphertext, not another protocol. The probes
            // dropped the connection's opaque mark when they bound it (so that its plaintext is
            // copied from the first record on); the agent forgets its mark on this record too.
            conn.role = Role::Unknown;
            conn.opaque_cause = OpaqueCause::Other;
        } else if conn.role == Role::Opaque {
            // Opaque for another reason (`mode tcp`): marked again, as binding dropped the mark.
            let opened_ns = conn.opened_ns;
            mark_opaque(&mut self.opaque_marks, key, opened_ns);
            return;
        }
        if conn.role != Role::Opaque {
            conn.ingress = Framer::new();
            conn.egress = Framer::new();
            conn.ingress_start = None;
            conn.egress_start = None;
            conn.preface_held = 0;
            conn.h2 = None;
            conn.rejected = None;
        }
    }

    /// Detects a record missing before `ev` on its connection. The first numbered record of a
    /// connection the tracker does not know (its `accept`/`connect` was lost, or it predates us)
    /// starts the count.
    fn check_sequence(&mut self, key: (u32, i32), ev: &SyscallEvent<'_>) {
        if let Some(conn) = self.conns.get_mut(&key)
            && conn.take_seq(ev.seq, &mut self.stats)
        {
            self.capture_gap(key, ev.ts_ns);
        }
    }

    /// A record of this connection was lost: bytes of either direction may be missing. Its open
    /// exchanges end as [`Outcome::CaptureGap`] (a response seen later cannot be told from the
    /// answer to a later request) and its framing starts over at the next message start.
    fn capture_gap(&mut self, key: (u32, i32), ts: u64) {
        self.stats.capture_gaps += 1;
        let Some(conn) = self.conns.get_mut(&key) else { return };
        if matches!(conn.role, Role::Opaque | Role::Unknown) {
            return;
        }
        if conn.h2.is_some() {
            // HTTP/2 has no message start to resynchronise at, and the HPACK state is lost.
            self.h2_lost(key, ts);
            return;
        }
        conn.ingress.abandon();
        conn.egress.abandon();
        conn.gapped = true;
        conn.ingress_start = None;
        conn.egress_start = None;
        self.lose_open_exchanges(key, ts);
    }

    /// Bytes of the connection `key` were lost: its open exchanges end as
    /// [`Outcome::CaptureGap`], and links guessed in its process are given up (the lost bytes may
    /// have held a frontend request whose backend request would link to another).
    fn lose_open_exchanges(&mut self, key: (u32, i32), ts: u64) {
        let Some(conn) = self.conns.get_mut(&key) else { return };
        let fronts: Vec<u64> = conn.fronts.drain(..).collect();
        let backs: Vec<u64> = conn.backs.drain(..).collect();
        if !self.quarantined(ts) {
            // (In a quarantine no guessed link exists: they were given up when it began.)
            self.taint_guessed_links(key.0);
        }
        self.stats.gap_exchanges += (fronts.len() + backs.len()) as u64;
        for id in fronts {
            self.finish_front(id, ts, Outcome::CaptureGap);
        }
        for id in backs {
            self.end_backend(id, ts, Outcome::CaptureGap);
        }
    }

    /// Records were lost (the probes' loss epoch changed) before the record about to be handled,
    /// which came at `ts_ns`: which connection lost them is not known yet (a gap shows when its next
    /// record comes), but any link could now join a request to another's backend exchange. Links
    /// that had rivals or rest on headers alone are given up, and for [`QUARANTINE_NS`] no new link
    /// is made and a relay only confirms a request's own sole link. What is given up is counted in
    /// [`TrackerStats::quarantined_backend_exchanges`]; SERVER spans are still exported.
    pub fn records_lost(&mut self, ts_ns: u64) {
        let already = self.quarantined(ts_ns);
        self.quarantine_until_ns = ts_ns.saturating_add(QUARANTINE_NS);
        if !already {
            // Within a quarantine no link is made, and those open to doubt were given up when it
            // began: under sustained loss this scan runs once, not per record.
            self.quarantine_links(|e| matches!(e, Evidence::Guessed | Evidence::Target));
        }
    }

    fn quarantined(&self, ts_ns: u64) -> bool {
        ts_ns < self.quarantine_until_ns
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
        let timeout = self.limits.exchange_timeout_ns;
        let linger = self.limits.linger_ns;
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
            Relay::Pending { read_ns, .. } => now_ns.saturating_sub(read_ns) > linking::RELAY_WINDOW_NS,
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
            for conn in self.conns.values_mut() {
                conn.fronts.retain(|c| *c != id);
                if let Some(h2) = &mut conn.h2 {
                    h2.streams.retain(|(_, c)| *c != id);
                }
            }
            self.finished.push(front.exchange);
        }
    }

    /// The peer closed its side of the connection `key` (a read returned end of stream: `clean`),
    /// or is gone (a read or write failed).
    fn end_of_stream(&mut self, key: (u32, i32), ts: u64, clean: bool) {
        let Some(conn) = self.conns.get_mut(&key) else { return };
        match conn.role {
            Role::Backend => {
                // Only a clean end of stream completes a body delimited by the close.
                if clean
                    && conn.ingress.finish()
                    && let Some(id) = conn.backs.pop_front()
                {
                    self.end_backend(id, ts, Outcome::Complete);
                }
                let conn = self.conns.get_mut(&key).expect("present");
                if conn.h2.is_some() {
                    return;
                }
                // Nothing more can come from the server: what is still open on an HTTP/1
                // connection ends now, where HAProxy saw the failure, not at its later close.
                let open: Vec<u64> = conn.backs.drain(..).collect();
                for id in open {
                    let Some(back) = self.backs.get_mut(&id) else { continue };
                    back.exchange.server_closed = true;
                    let outcome = if back.exchange.response.is_some() {
                        Outcome::ClosedDuringResponse
                    } else {
                        Outcome::ClosedBeforeResponse
                    };
                    self.end_backend(id, ts, outcome);
                }
            }
            Role::Frontend => {
                // A client may half-close after its request and still read the answer: a clean
                // end of stream counts only once the response is under way; a failed call always.
                for id in &conn.fronts {
                    if let Some(front) = self.fronts.get_mut(id)
                        && (front.responding || !clean)
                    {
                        front.exchange.client_closed = true;
                    }
                }
            }
            Role::Unknown | Role::Opaque => {}
        }
    }

    fn close(&mut self, key: (u32, i32), ts: u64) {
        let Some(mut conn) = self.conns.remove(&key) else { return };
        match conn.role {
            Role::Frontend => {
                let completes_body = conn.egress.finish();
                while let Some(id) = conn.fronts.pop_front() {
                    let responding = self.fronts.get(&id).is_some_and(|f| f.responding);
                    let outcome = match (responding, completes_body) {
                        (true, true) => Outcome::Complete,
                        (true, false) => Outcome::ClosedDuringResponse,
                        (false, _) => Outcome::ClosedBeforeResponse,
                    };
                    self.finish_front(id, ts, outcome);
                }
            }
            Role::Backend => {
                let completes_body = conn.ingress.finish();
                while let Some(id) = conn.backs.pop_front() {
                    let has_response = self.backs.get(&id).is_some_and(|b| b.exchange.response.is_some());
                    let outcome = match (has_response, completes_body) {
                        (true, true) => Outcome::Complete,
                        (true, false) => Outcome::ClosedDuringResponse,
                        (false, _) => Outcome::ClosedBeforeResponse,
                    };
                    self.end_backend(id, ts, outcome);
                }
            }
            Role::Unknown | Role::Opaque => {}
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
    /// a head or a message end (see [`Tracker::requests`]).
    fn dispatch(&mut self, ctx: Ctx, role: Role, chunk: Chunk<'_>, dir: Direction) -> bool {
        if self.conns.get(&ctx.key).is_some_and(|c| c.h2.is_some()) {
            return self.h2_data(ctx, role, chunk, dir);
        }
        match (role, dir) {
            (Role::Frontend, Direction::Ingress) | (Role::Backend, Direction::Egress) => self.requests(ctx, chunk, dir),
            (Role::Frontend, Direction::Egress) | (Role::Backend, Direction::Ingress) => {
                self.responses(ctx, chunk, dir)
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
        let fronts: &mut dyn Iterator<Item = u64> = match role {
            Role::Frontend => &mut conn.fronts.iter().take(n).copied(),
            Role::Backend => &mut conn.backs.iter().take(n).filter_map(|b| self.backs.get(b)).filter_map(|b| b.front),
            Role::Unknown | Role::Opaque => &mut std::iter::empty(),
        };
        for id in fronts {
            if let Some(f) = self.fronts.get_mut(&id) {
                f.last_activity_ns = ts;
            }
        }
    }

    fn insert_front(&mut self, ctx: Ctx, request: Option<RequestHead>, started: u64) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let (peer, local, client, tls) =
            self.conns.get(&ctx.key).map_or((None, None, None, None), |c| (c.addr, c.local, c.proxy_client, c.tls));
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
    fn new_front(&mut self, ctx: Ctx, request: RequestHead, started: u64) -> u64 {
        self.stats.frontend_requests += 1;
        let id = self.insert_front(ctx, Some(request), started);
        self.candidates.push_back(Candidate::new(id, ctx, self.fronts[&id].exchange.request.as_ref()));
        let conn = self.conns.get_mut(&ctx.key).expect("present");
        conn.fronts.push_back(id);
        conn.gapped = false;
        conn.spoke_http = true;
        conn.rejected = None;
        id
    }

    /// A request written on a backend; returns its exchange id.
    fn new_backend(&mut self, ctx: Ctx, request: RequestHead, started: u64) -> u64 {
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
        let conn = self.conns.get_mut(&ctx.key).expect("present");
        let (server, tls) = (conn.addr, conn.tls);
        // Only the connection's first request waited for its connect; a later one on an HTTP/1
        // connection waited for the one before it (HTTP/2 ones share the connection).
        let connect_ns = conn.connect_ns.take();
        let free_since_ns = if conn.h2.is_none() { conn.free_since_ns } else { None };
        conn.backs.push_back(back_id);
        conn.spoke_http = true;
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

    fn finish_front(&mut self, id: u64, ts: u64, outcome: Outcome) {
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
    fn hand_out_if_ready(&mut self, id: u64) {
        if self.fronts.get(&id).is_some_and(|f| f.done && f.unfiled_backends == 0) {
            let front = self.fronts.remove(&id).expect("present");
            self.finished.push(front.exchange);
        }
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

#[derive(Clone, Copy, Debug)]
struct Ctx {
    key: (u32, i32),
    tid: u32,
    ts: u64,
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

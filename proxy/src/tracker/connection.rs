//! One connection as the tracker follows it: its role, its two directions' framers and when
//! their messages started, the requests waiting for their answers, its sequence numbers, TLS,
//! PROXY protocol and HTTP/2 state. What the tracker does with it is in the parent module and in
//! `http1` and `http2`; the exchanges themselves are the `linker`'s.

use std::collections::VecDeque;
use std::net::SocketAddr;

use super::http2::H2Connection;
use super::{Direction, OpaqueCause, Role, SampledOutTraces, TrackerStats};
use crate::exchange::TlsInfo;
use crate::framing::Framer;
use crate::rejected::Rejected;
use crate::trace_context::TraceParent;

#[derive(Debug)]
pub(super) struct Connection {
    pub(super) role: Role,
    /// Frontend: the client. Backend: the server.
    pub(super) addr: Option<SocketAddr>,
    /// Frontend: the address the client connected to (HAProxy's bind address).
    pub(super) local: Option<SocketAddr>,
    /// Bytes the process read.
    pub(super) ingress: Framer,
    /// Bytes the process wrote.
    pub(super) egress: Framer,
    /// When the message being framed in each direction started (its first byte's read or write).
    pub(super) ingress_start: Option<u64>,
    pub(super) egress_start: Option<u64>,
    /// Backend: when the `connect` that opened it ran, until its first request takes it (the
    /// connect timer of `HAProxy`'s log, see [`crate::timers`]).
    pub(super) connect_ns: Option<u64>,
    /// HTTP/1 backend: when its last exchange ended (the response read whole), the moment the
    /// connection was free for the next request (see [`crate::timers`]).
    pub(super) free_since_ns: Option<u64>,
    /// Frontend: a request whose framing or head failed, until `HAProxy`'s answer to it (the
    /// SERVER span of a rejected request) or the next request.
    pub(super) rejected: Option<Rejected>,
    /// Frontend: ids of requests read and not yet answered, oldest first.
    pub(super) fronts: VecDeque<u64>,
    /// Backend: ids of requests written and not yet answered, oldest first.
    pub(super) backs: VecDeque<u64>,
    /// Frontend: the trace contexts of the requests sampled out at their head
    /// ([`super::SAMPLED_OUT`]) and not answered yet, each with its HTTP/2 stream (0 on HTTP/1,
    /// where they are in `fronts`, in the same order).
    pub(super) sampled_out_contexts: VecDeque<(u32, TraceParent)>,
    /// Sequence number of the last record seen (0: the probes do not number this connection).
    pub(super) last_seq: u32,
    /// `ts_ns` of the `accept`/`connect` record when the probes number the connection (their
    /// name for it, see [`super::OpaqueMark`]); 0 otherwise.
    pub(super) opened_ns: u64,
    /// A capture gap hit the connection and no request was framed since.
    pub(super) gapped: bool,
    /// The first bytes of the request direction may be a PROXY protocol header (see
    /// [`crate::proxy_protocol`]): set at `accept`/`connect`, cleared by the first bytes.
    pub(super) expect_proxy_header: bool,
    /// Frontend: the client named by the PROXY header it started with.
    pub(super) proxy_client: Option<SocketAddr>,
    /// A message head parsed on this connection: from then on, bad bytes are parse errors; before,
    /// they mean the connection speaks something else (TLS, DNS, a `mode tcp` protocol).
    pub(super) spoke_http: bool,
    /// The connection runs in TLS (its bytes are the plaintext).
    pub(super) tls: Option<TlsInfo>,
    /// Why the connection is opaque (meaningful while its role is [`Role::Opaque`]).
    pub(super) opaque_cause: OpaqueCause,
    /// First client bytes held back because they may start the HTTP/2 preface or an HTTP/1
    /// request alike ("P", "PR"); they are `h2::PREFACE[..preface_held]`.
    pub(super) preface_held: u8,
    /// The connection speaks HTTP/2 (boxed: most connections speak HTTP/1, and the HPACK
    /// decoders are not small). `ingress`/`egress` then stay idle.
    pub(super) h2: Option<Box<H2Connection>>,
}

impl Connection {
    /// What a frontend exchange records of this connection.
    pub(super) fn front_conn(&self) -> super::linker::FrontConn {
        super::linker::FrontConn { peer: self.addr, local: self.local, client: self.proxy_client, tls: self.tls }
    }

    pub(super) fn new(role: Role, addr: Option<SocketAddr>) -> Self {
        Self {
            role,
            addr,
            local: None,
            ingress: Framer::new(),
            egress: Framer::new(),
            ingress_start: None,
            egress_start: None,
            connect_ns: None,
            free_since_ns: None,
            rejected: None,
            fronts: VecDeque::new(),
            backs: VecDeque::new(),
            sampled_out_contexts: VecDeque::new(),
            last_seq: 0,
            opened_ns: 0,
            gapped: false,
            expect_proxy_header: false,
            proxy_client: None,
            spoke_http: false,
            tls: None,
            opaque_cause: OpaqueCause::Other,
            preface_held: 0,
            h2: None,
        }
    }
}

impl Connection {
    /// True when the oldest request waiting for its answer on this HTTP/1 connection (a frontend's
    /// or a backend's, as `role` says) was sampled out at its head.
    pub(super) fn answers_sampled_out(&self, role: Role) -> bool {
        let oldest = if role == Role::Frontend { self.fronts.front() } else { self.backs.front() };
        oldest == Some(&super::SAMPLED_OUT)
    }

    /// Forgets the requests of this connection sampled out at their head (their ids stay in the
    /// queues for the caller to drain): their traces no longer wait for an answer.
    pub(super) fn release_sampled_out(&mut self, tgid: u32, waiting: &mut SampledOutTraces) {
        for (_, context) in self.sampled_out_contexts.drain(..) {
            waiting.release(tgid, &context);
        }
    }

    /// Takes a record's sequence number; true when records of this connection were lost before
    /// it. A numbered connection whose records arrive unnumbered (the probes' table forgot it)
    /// can no longer show gaps: counted once.
    pub(super) fn take_seq(&mut self, seq: u32, stats: &mut TrackerStats) -> bool {
        if seq == 0 {
            if self.last_seq != 0 {
                self.last_seq = 0;
                stats.unnumbered_connections += 1;
            }
            return false;
        }
        let gap = self.last_seq != 0 && seq != self.last_seq.wrapping_add(1);
        self.last_seq = seq;
        gap
    }

    /// True when a capture gap hit this connection and no request was read since: a response now
    /// answers a request the gap swallowed.
    pub(super) fn egress_resynced_after_gap(&self) -> bool {
        self.fronts.is_empty() && self.gapped
    }

    pub(super) fn direction(&mut self, dir: Direction) -> (&mut Framer, &mut Option<u64>) {
        match dir {
            Direction::Ingress => (&mut self.ingress, &mut self.ingress_start),
            Direction::Egress => (&mut self.egress, &mut self.egress_start),
        }
    }
}

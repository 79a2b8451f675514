//! What goes into the tracker and what it reports besides exchanges: one syscall record
//! ([`SyscallEvent`], [`Op`]), its counters ([`TrackerStats`]), the connections that turned opaque
//! ([`OpaqueMark`]) and its time limits ([`Limits`]).

use std::net::SocketAddr;

use crate::framing::Chunk;
use crate::sampled_out::SampledOutRule;
use crate::trace_context::TraceParent;

/// One syscall of a watched process, as the tracker needs it.
#[derive(Clone, Copy, Debug)]
pub struct SyscallEvent<'a> {
    pub ts_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    pub fd: i32,
    /// Position of this record among the records of its connection, from 1 at `accept`/`connect`;
    /// 0 when the probes do not number the connection's records (opened before they were loaded).
    pub seq: u32,
    pub op: Op<'a>,
}

#[derive(Clone, Copy, Debug)]
pub enum Op<'a> {
    /// A connection was accepted on `fd`, from `peer`, on the listening address `local`.
    Accept {
        peer: Option<SocketAddr>,
        local: Option<SocketAddr>,
    },
    /// `fd` is connecting to `server`.
    Connect {
        server: Option<SocketAddr>,
    },
    /// The process read these bytes; a chunk with `total == 0` is end of stream.
    Read(Chunk<'a>),
    /// A read or write failed because the peer was gone (reset, broken pipe, timed out): like an
    /// end of stream, where the process saw it.
    PeerGone,
    /// The process wrote these bytes.
    Write(Chunk<'a>),
    /// The process read `len` bytes on a frontend connection that the probes found to be one
    /// whole request head without a body, dropped by its own `context` (see
    /// `tracetap_ebpf_common::head_drop`): not copied.
    DroppedRequest {
        len: u64,
        context: TraceParent,
    },
    Close,
    /// Stop parsing this connection until it closes (it belongs to a `mode tcp` proxy).
    Ignore,
    /// The connection runs in TLS, with this protocol version as sent on the wire (`0x0303` for
    /// TLS 1.2; 0 when unknown). It comes once, after the `accept`/`connect` and before any data:
    /// from then on the connection's `Read`/`Write` chunks are the TLS plaintext.
    Tls {
        version: u16,
    },
}

/// Counters of what the tracker could not turn into exchanges. Nothing is dropped silently.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrackerStats {
    /// Heads or bodies that could not be parsed (framing lost on a direction).
    pub parse_errors: u64,
    /// Connections that turned out not to speak HTTP (tcp mode, TLS not decrypted, garbage).
    pub opaque_connections: u64,
    /// Descriptors never seen opened by `accept`/`connect` whose first bytes are not HTTP (HTTP/2
    /// frames of a connection older than the probes among them, as its HPACK state is unknown): files
    /// `HAProxy` reads (its configuration, certificates, shared libraries at start), its thread
    /// wake-up pipes, sockets older than the probes. Ignored until closed.
    pub unknown_descriptors: u64,
    /// Responses seen with no request to pair with.
    pub unpaired_responses: u64,
    /// Backend requests that matched no frontend request (health checks, or a link we missed).
    pub unlinked_backend_requests: u64,
    /// Backend exchanges that ended after their frontend exchange was handed out.
    pub late_backend_exchanges: u64,
    /// Exchanges given up after the expiry timeout.
    pub expired_exchanges: u64,
    /// Request heads cut by the capture window (traced from their first lines).
    pub truncated_heads: u64,
    /// Connections on which a record was missing (a sequence gap): their open exchanges ended with
    /// [`crate::exchange::Outcome::CaptureGap`].
    pub capture_gaps: u64,
    /// Exchanges ended because of a capture gap.
    pub gap_exchanges: u64,
    /// Connections whose records stopped being numbered (the probes' table of connections was
    /// full): gaps on them can no longer be seen.
    pub unnumbered_connections: u64,
    /// Backend exchanges moved to another frontend request when their response was relayed.
    pub relinked_backend_exchanges: u64,
    /// Backend exchanges not exported because records were lost (anywhere) while their link was
    /// still open to doubt: linked with rivals or by headers before the loss, or linked at all
    /// within [`super::QUARANTINE_NS`] after it.
    pub quarantined_backend_exchanges: u64,
    /// Frontend requests parsed.
    pub frontend_requests: u64,
    /// Backend requests parsed.
    pub backend_requests: u64,
    /// Frontend requests dropped by their own trace context ([`Limits::sampled_out`]) as their
    /// head was parsed: framed and paired, never an exchange. Also in `frontend_requests`.
    pub sampled_out_requests: u64,
    /// Those of them the probes dropped at their head, not copied ([`Op::DroppedRequest`]).
    pub requests_dropped_in_probe: u64,
    /// Backend requests left out with them: they carried the trace of a frontend request sampled
    /// out, and their own context drops them too. Also in `backend_requests`.
    pub sampled_out_backend_requests: u64,
    /// Backend requests of such a trace whose own context keeps it, when no kept frontend request
    /// of that trace waits: `HAProxy` forwarded "sampled" for a request its own parent dropped.
    /// Left out like those (its frontend request is no exchange to link to); also in
    /// `backend_requests`.
    pub head_disagreements: u64,
    /// Connections that started with the HTTP/2 preface: cleartext (`proto h2`, h2c with prior
    /// knowledge) or in TLS (ALPN h2).
    pub h2_connections: u64,
    /// HTTP/2 streams opened (request heads read or written); also counted in
    /// `frontend_requests` or `backend_requests`.
    pub h2_streams: u64,
    /// `RST_STREAM` frames seen, either way (those that ended an open exchange ended it with
    /// [`crate::exchange::Outcome::StreamReset`]).
    pub h2_resets: u64,
    /// `GOAWAY` frames seen, either way.
    pub h2_goaways: u64,
    /// HTTP/2 connections whose HPACK state was lost (a header block the capture window cut, a
    /// capture gap, frames that cannot be decoded): their open streams ended with
    /// [`crate::exchange::Outcome::CaptureGap`] and the connection became opaque, never decoded wrongly.
    pub h2_desyncs: u64,
}

/// A connection whose bytes the tracker no longer reads: the probes need not copy them. It names
/// the connection by its `accept`/`connect` record's time, so that a mark that arrives after the
/// fd was reused matches nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpaqueMark {
    pub tgid: u32,
    pub fd: i32,
    /// `ts_ns` of the connection's `accept`/`connect` record.
    pub opened_ns: u64,
}

/// Bounds on how long the tracker keeps state.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// An exchange with no activity for this long is expired.
    pub exchange_timeout_ns: u64,
    /// A finished frontend exchange waits at most this long for its open backend exchanges.
    pub linger_ns: u64,
    /// Requests the head sampler drops from their own `traceparent`: the tracker frames them and
    /// pairs their responses, and keeps nothing else (see [`crate::sampled_out`]).
    pub sampled_out: SampledOutRule,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            exchange_timeout_ns: 300 * 1_000_000_000,
            linger_ns: 5 * 1_000_000_000,
            sampled_out: SampledOutRule::Never,
        }
    }
}

/// Where and when a record happened: its connection, thread and time.
#[derive(Clone, Copy, Debug)]
pub(super) struct Ctx {
    pub(super) key: (u32, i32),
    pub(super) tid: u32,
    pub(super) ts: u64,
}

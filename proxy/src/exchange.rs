//! What the tracker hands to the agent: finished exchanges, ready to become spans.

use std::net::SocketAddr;

use crate::head::{RequestHead, ResponseHead};

/// How an exchange ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The whole response was seen.
    Complete,
    /// The response head started a tunnel (101, CONNECT 2xx); the exchange ends at the head.
    Upgraded,
    /// The connection closed before any response head.
    ClosedBeforeResponse,
    /// The connection closed in the middle of the response body.
    ClosedDuringResponse,
    /// Nothing happened on the exchange for longer than the tracker's expiry; it was given up.
    Expired,
    /// A record of the connection was lost (ring buffer full): the exchange's bytes are incomplete,
    /// so it ends here rather than risk pairing a later response with it.
    CaptureGap,
}

impl Outcome {
    /// The `error.type` value for an exchange that did not complete, per the HTTP conventions.
    #[must_use]
    pub fn error_type(self) -> Option<&'static str> {
        match self {
            Self::Complete | Self::Upgraded => None,
            Self::ClosedBeforeResponse => Some("connection_closed_before_response"),
            Self::ClosedDuringResponse => Some("connection_closed_during_response"),
            Self::Expired => Some("timeout"),
            Self::CaptureGap => Some("tracetap.capture_gap"),
        }
    }
}

/// An exchange between `HAProxy` and a backend server (becomes a CLIENT span).
#[derive(Clone, Debug)]
pub struct ClientExchange {
    pub request: RequestHead,
    pub response: Option<ResponseHead>,
    /// Where `HAProxy` connected to (the server).
    pub server: Option<SocketAddr>,
    /// Monotonic ns of the write that started the request.
    pub start_ns: u64,
    /// Monotonic ns of the read that ended the response (or of the close).
    pub end_ns: u64,
    pub outcome: Outcome,
}

/// An exchange between a client and `HAProxy` (becomes a SERVER span), with the backend exchanges it
/// caused.
#[derive(Clone, Debug)]
pub struct ServerExchange {
    /// `HAProxy` process that handled it.
    pub tgid: u32,
    /// `None` when `HAProxy` answered without a request the tracker could parse (e.g. 408, 400).
    pub request: Option<RequestHead>,
    pub response: Option<ResponseHead>,
    /// The client (peer of the accepted socket).
    pub peer: Option<SocketAddr>,
    /// The address the client connected to: the HAProxy `bind` it came through.
    pub local: Option<SocketAddr>,
    /// The client named by a PROXY protocol header (`accept-proxy`): the original client when a
    /// load balancer sits in front of `HAProxy`. `peer` stays the socket's peer.
    pub client: Option<SocketAddr>,
    /// Monotonic ns of the read that brought the first byte of the request head.
    pub start_ns: u64,
    /// Monotonic ns of the write that ended the response (or of the close).
    pub end_ns: u64,
    pub outcome: Outcome,
    pub clients: Vec<ClientExchange>,
}

//! What the tracker hands to the agent: finished exchanges, ready to become spans.

use std::net::SocketAddr;

use crate::head::{RequestHead, ResponseHead};
use crate::rejected::Rejected;

/// How an exchange ended.
///
/// [`Outcome::error_type`] gives the `error.type` of those that failed. HTTP/2 streams ended by
/// the peer name the frame and its RFC 9113 error code: `http2.rst_stream.<CODE>` for a
/// `RST_STREAM` (either side), `http2.goaway.<CODE>` for a `GOAWAY` that left the stream
/// unprocessed, with `<CODE>` one of `NO_ERROR`, `PROTOCOL_ERROR`, `INTERNAL_ERROR`,
/// `FLOW_CONTROL_ERROR`, `SETTINGS_TIMEOUT`, `STREAM_CLOSED`, `FRAME_SIZE_ERROR`,
/// `REFUSED_STREAM`, `CANCEL`, `COMPRESSION_ERROR`, `CONNECT_ERROR`, `ENHANCE_YOUR_CALM`,
/// `INADEQUATE_SECURITY`, `HTTP_1_1_REQUIRED`, or `UNKNOWN_ERROR` for any other code (the set
/// stays small whatever a peer sends).
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
    /// An HTTP/2 `RST_STREAM` with this error code ended the stream (sent by either side).
    StreamReset(u32),
    /// An HTTP/2 `GOAWAY` with this error code ended the connection before the stream was
    /// processed (its id was above the frame's last stream id).
    GoAway(u32),
}

/// RFC 9113 section 7 error codes, by value, then the name of any other code.
const RST_STREAM_ERRORS: [&str; 15] = [
    "http2.rst_stream.NO_ERROR",
    "http2.rst_stream.PROTOCOL_ERROR",
    "http2.rst_stream.INTERNAL_ERROR",
    "http2.rst_stream.FLOW_CONTROL_ERROR",
    "http2.rst_stream.SETTINGS_TIMEOUT",
    "http2.rst_stream.STREAM_CLOSED",
    "http2.rst_stream.FRAME_SIZE_ERROR",
    "http2.rst_stream.REFUSED_STREAM",
    "http2.rst_stream.CANCEL",
    "http2.rst_stream.COMPRESSION_ERROR",
    "http2.rst_stream.CONNECT_ERROR",
    "http2.rst_stream.ENHANCE_YOUR_CALM",
    "http2.rst_stream.INADEQUATE_SECURITY",
    "http2.rst_stream.HTTP_1_1_REQUIRED",
    "http2.rst_stream.UNKNOWN_ERROR",
];
const GOAWAY_ERRORS: [&str; 15] = [
    "http2.goaway.NO_ERROR",
    "http2.goaway.PROTOCOL_ERROR",
    "http2.goaway.INTERNAL_ERROR",
    "http2.goaway.FLOW_CONTROL_ERROR",
    "http2.goaway.SETTINGS_TIMEOUT",
    "http2.goaway.STREAM_CLOSED",
    "http2.goaway.FRAME_SIZE_ERROR",
    "http2.goaway.REFUSED_STREAM",
    "http2.goaway.CANCEL",
    "http2.goaway.COMPRESSION_ERROR",
    "http2.goaway.CONNECT_ERROR",
    "http2.goaway.ENHANCE_YOUR_CALM",
    "http2.goaway.INADEQUATE_SECURITY",
    "http2.goaway.HTTP_1_1_REQUIRED",
    "http2.goaway.UNKNOWN_ERROR",
];

/// The name of an HTTP/2 error code in `names` (unknown codes share the last one).
fn error_name(names: &[&'static str; 15], code: u32) -> &'static str {
    names[usize::try_from(code).map_or(14, |c| c.min(14))]
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
            Self::StreamReset(code) => Some(error_name(&RST_STREAM_ERRORS, code)),
            Self::GoAway(code) => Some(error_name(&GOAWAY_ERRORS, code)),
        }
    }
}

/// What is known of the TLS session a connection ran in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TlsInfo {
    /// The `tls.protocol.version` value ("1.0" to "1.3"), when the probes saw it.
    pub version: Option<&'static str>,
}

impl TlsInfo {
    /// From the protocol version as sent on the wire (`0x0303` for TLS 1.2); 0 or any other value
    /// is unknown.
    #[must_use]
    pub fn from_wire(version: u16) -> Self {
        let version = match version {
            0x0301 => Some("1.0"),
            0x0302 => Some("1.1"),
            0x0303 => Some("1.2"),
            0x0304 => Some("1.3"),
            _ => None,
        };
        Self { version }
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
    /// Monotonic ns of the `connect` that opened the connection, when this exchange was the first
    /// on it; `None` on a connection reused from an earlier exchange (or opened before the probes).
    pub connect_ns: Option<u64>,
    /// On an HTTP/1 connection reused from an earlier exchange: monotonic ns of the read that
    /// ended that exchange's response, when the connection became free for this one.
    pub free_since_ns: Option<u64>,
    /// Monotonic ns of the read that brought the first byte of the (final) response head, or of
    /// the first response bytes at all when no head could be parsed from them.
    pub response_start_ns: Option<u64>,
    /// Monotonic ns of the read that completed the (final) response head.
    pub response_head_ns: Option<u64>,
    /// The server went away (`HAProxy` read its end of stream, or a call failed: a reset) before
    /// the exchange was complete: the exchange ended then, not at `HAProxy`'s later close.
    pub server_closed: bool,
    pub outcome: Outcome,
    /// The connection to the server ran in TLS (`ssl` on the server line): `url.scheme` is
    /// `https`.
    pub tls: Option<TlsInfo>,
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
    /// Monotonic ns of the read that completed the request head (`None` without a request).
    pub head_end_ns: Option<u64>,
    /// A request `HAProxy` rejected as malformed (`request` is `None`): the escaped request line
    /// the client sent, and whether it was cut short (see [`crate::rejected`]).
    pub rejected: Option<Rejected>,
    /// The client closed its side or went away (`HAProxy` read its end of stream, or a call on
    /// its connection failed) while the exchange was open.
    pub client_closed: bool,
    pub outcome: Outcome,
    /// The client connection ran in TLS (`ssl` on the bind line): `url.scheme` is `https`.
    pub tls: Option<TlsInfo>,
    pub clients: Vec<ClientExchange>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http2_error_types_are_named_by_frame_and_code() {
        assert_eq!(Outcome::StreamReset(8).error_type(), Some("http2.rst_stream.CANCEL"));
        assert_eq!(Outcome::StreamReset(0xd).error_type(), Some("http2.rst_stream.HTTP_1_1_REQUIRED"));
        assert_eq!(Outcome::StreamReset(0xe).error_type(), Some("http2.rst_stream.UNKNOWN_ERROR"));
        assert_eq!(Outcome::GoAway(0).error_type(), Some("http2.goaway.NO_ERROR"));
        assert_eq!(Outcome::GoAway(u32::MAX).error_type(), Some("http2.goaway.UNKNOWN_ERROR"));
        for code in 0..14 {
            let name = Outcome::GoAway(code).error_type().unwrap();
            assert_eq!(Outcome::StreamReset(code).error_type().unwrap()[17..], name[13..], "same code names");
        }
    }

    #[test]
    fn tls_versions() {
        assert_eq!(TlsInfo::from_wire(0x0304).version, Some("1.3"));
        assert_eq!(TlsInfo::from_wire(0x0301).version, Some("1.0"));
        assert_eq!(TlsInfo::from_wire(0).version, None);
        assert_eq!(TlsInfo::from_wire(0x0300).version, None);
    }
}

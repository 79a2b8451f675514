//! Requests `HAProxy` rejected as malformed: what the client sent, kept as a short, printable
//! prefix for the SERVER span of `HAProxy`'s answer (the rest is never parsed, never exported).
//!
//! The prefix is the request line only (up to the first CR or LF: header lines, where credentials
//! and cookies travel, are never kept), at most [`MAX_CHARS`] characters of printable ASCII: bytes
//! outside it, and the backslash, are written as `\xNN` (`\\` for the backslash), never cut in
//! half. So whatever a client sends, the value is safe to show, to log and to put in a terminal.
//! Credentials in its query or userinfo are the agent's to redact, as for any URL.

/// Most characters of a rejected request's prefix.
pub const MAX_CHARS: usize = 128;

/// A frontend request whose framing or head failed, waiting for `HAProxy`'s answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejected {
    /// [`escape`]d first bytes.
    pub prefix: Box<str>,
    /// Monotonic ns of the read that brought its first byte.
    pub start_ns: u64,
    /// The head was incomplete as far as the tracker knows (`HAProxy` answered before it ended,
    /// or the capture window cut it): a timeout, the client giving up, or a head too long, which
    /// the syscalls do not tell apart. Otherwise bytes the tracker saw made it fail.
    pub pending: bool,
    /// Its first bytes do not even look like a start line: the client may speak something else.
    pub not_http: bool,
    /// Records the client sent since, still unanswered (see the tracker's bound).
    pub records_since: u8,
}

impl Rejected {
    /// A request whose framing or head failed, from its first `bytes`.
    #[must_use]
    pub fn failed(bytes: &[u8], start_ns: u64) -> Self {
        Self { prefix: escape(request_line(bytes)), start_ns, pending: false, not_http: false, records_since: 0 }
    }

    /// A request whose first bytes do not look like a start line.
    #[must_use]
    pub fn not_http(bytes: &[u8], start_ns: u64) -> Self {
        Self { not_http: true, ..Self::failed(bytes, start_ns) }
    }

    /// A head still incomplete when `HAProxy` answered.
    #[must_use]
    pub fn pending(bytes: &[u8], start_ns: u64) -> Self {
        Self { pending: true, ..Self::failed(bytes, start_ns) }
    }
}

/// `bytes` up to the first CR or LF.
fn request_line(bytes: &[u8]) -> &[u8] {
    memchr::memchr2(b'\r', b'\n', bytes).map_or(bytes, |end| &bytes[..end])
}

/// Statuses `HAProxy` answers a request it rejects with, before any backend: bad syntax, request
/// timeout, too large, URI too long, header fields too large, not implemented (an unknown
/// transfer coding).
#[must_use]
pub fn is_rejection_status(status: u16) -> bool {
    matches!(status, 400 | 408 | 413 | 414 | 431 | 501)
}

/// `bytes` as printable ASCII, at most [`MAX_CHARS`] characters (see the module note).
#[must_use]
pub fn escape(bytes: &[u8]) -> Box<str> {
    let mut out = String::with_capacity(MAX_CHARS.min(bytes.len() * 4));
    for &b in bytes {
        let escaped_len = match b {
            b'\\' => 2,
            0x20..=0x7e => 1,
            _ => 4,
        };
        if out.len() + escaped_len > MAX_CHARS {
            break;
        }
        match b {
            b'\\' => out.push_str("\\\\"),
            0x20..=0x7e => out.push(char::from(b)),
            _ => {
                use std::fmt::Write as _;
                let _ = write!(out, "\\x{b:02x}");
            }
        }
    }
    out.into_boxed_str()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_request_line_is_kept() {
        let r = Rejected::failed(b"GET /a\x01 HTTP/1.1\r\nAuthorization: Bearer secret\r\n\r\n", 5);
        assert_eq!(&*r.prefix, "GET /a\\x01 HTTP/1.1");
        assert_eq!(&*Rejected::pending(b"GET /x\nCookie: a=b", 5).prefix, "GET /x");
        assert!(!Rejected::failed(b"\x01\x02", 1).pending && Rejected::pending(b"G", 1).pending);
    }

    #[test]
    fn printable_bytes_stay_and_others_are_escaped() {
        assert_eq!(&*escape(b"GET /a\x01b HTTP/1.1\r\n"), "GET /a\\x01b HTTP/1.1\\x0d\\x0a");
        assert_eq!(&*escape(b"a\\b\xff"), "a\\\\b\\xff");
    }

    #[test]
    fn never_longer_than_the_bound_and_never_a_cut_escape() {
        let cut = escape(&[0x01; 100]);
        assert_eq!(cut.len(), 128);
        assert!(cut.ends_with("\\x01"));
        assert_eq!(escape(&[b'a'; 500]).len(), MAX_CHARS);
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_give_a_bounded_printable_value(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..300)) {
            let out = escape(&bytes);
            proptest::prop_assert!(out.len() <= MAX_CHARS);
            proptest::prop_assert!(out.bytes().all(|b| (0x20..=0x7e).contains(&b)));
        }
    }
}

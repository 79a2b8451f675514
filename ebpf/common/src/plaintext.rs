//! Whether the first bytes a socket carries are HTTP in the clear: the probes stop asking whether
//! such a connection is bound to a TLS call (a hash lookup per record), as `HAProxy` starts TLS
//! on no connection that carried HTTP.
//!
//! Other plaintext may come before a TLS handshake on one socket: a PROXY protocol header (v1
//! starts with `PROXY`, v2 with `\r\n\r\n`), a SOCKS4 request (`0x04`), a client IP header of
//! `accept-netscaler-cip` (its magic number, whatever the configuration says). So the test is a
//! list of the 4-byte starts of HTTP/1 requests and responses and of the HTTP/2 preface, not a
//! character class: only a CIP magic number configured to spell one of them could be taken for
//! HTTP. No TLS record starts with a letter (its first byte is a content type, 20 to 24, or 0x80
//! and up for the hello of SSL version 2).

#![expect(
    clippy::inline_always,
    reason = "the probes build this code too, where every helper is inlined on purpose (see ebpf/probes/src/main.rs)"
)]

/// The 4-byte starts taken for HTTP: request methods (RFC 9110, and `PATCH`), a response's
/// status line, the HTTP/2 client preface.
const HTTP_STARTS: [[u8; 4]; 11] =
    [*b"GET ", *b"POST", *b"PUT ", *b"HEAD", *b"DELE", *b"OPTI", *b"PATC", *b"TRAC", *b"CONN", *b"HTTP", *b"PRI "];

/// Whether a record's first 4 bytes, read as a little-endian `u32` (memory order), are the start
/// of HTTP in the clear.
#[inline(always)]
#[must_use]
pub fn starts_like_http(first: u32) -> bool {
    let mut found = false;
    for start in HTTP_STARTS {
        found |= first == u32::from_le_bytes(start);
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn starts(bytes: [u8; 4]) -> bool {
        starts_like_http(u32::from_le_bytes(bytes))
    }

    #[test]
    fn http_starts_are_taken_and_what_may_come_before_tls_is_not() {
        for start in [b"GET ", b"POST", b"PUT ", b"DELE", b"OPTI", b"HTTP", b"PRI "] {
            assert!(starts(*start), "{start:?}");
        }
        // PROXY v1 and v2, SOCKS4, TLS records of every content type, an SSLv2 hello, lower case.
        for other in [b"PROX", b"\r\n\r\n", b"\x04\x01\x00\x50", b"get ", b"GETX", b"\x80\x2e\x01\x03"] {
            assert!(!starts(*other), "{other:?}");
        }
        for content_type in 20..=24u8 {
            assert!(!starts([content_type, 3, 1, 0]));
        }
    }
}

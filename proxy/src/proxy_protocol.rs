//! PROXY protocol headers (v1 text, v2 binary) at the start of a connection's bytes: the one a load
//! balancer sends before the client's first request (`bind ... accept-proxy`), and the one `HAProxy`
//! writes to a server before its first request (`server ... send-proxy`). Neither is request bytes;
//! the first names the real client. Parsing is `ppp`'s; this module only finds where a header ends
//! when the capture window cut it.

use std::net::{IpAddr, SocketAddr};

/// The 12 bytes every v2 header starts with.
const V2_SIGNATURE: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";
/// Fixed part of a v2 header: signature, version/command, family/protocol, length.
const V2_FIXED: usize = 16;
/// A v1 header is at most 107 bytes, CRLF included.
const V1_MAX: usize = 107;

/// What the start of a connection's bytes holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// No PROXY header: the bytes are the protocol itself.
    NotProxy,
    /// A header of `len` bytes; `source` is the client it names (`None` for `LOCAL`/`UNKNOWN`, or
    /// when the address part was not captured).
    Header { len: u64, source: Option<SocketAddr> },
    /// The known bytes start a header that does not end in them.
    Incomplete,
    /// A header signature followed by bytes that are no valid header.
    Invalid,
}

/// Looks for a PROXY header at the start of `known`, the captured prefix of a syscall that moved
/// `total` bytes.
#[must_use]
pub fn parse(known: &[u8], total: u64) -> Start {
    if known.starts_with(b"PROXY ") {
        return parse_v1(known);
    }
    if known.len() >= V2_SIGNATURE.len() && known.starts_with(V2_SIGNATURE) {
        return parse_v2(known, total);
    }
    if !known.is_empty() && (V2_SIGNATURE.starts_with(known) || b"PROXY ".starts_with(known)) {
        return Start::Incomplete;
    }
    Start::NotProxy
}

fn parse_v1(known: &[u8]) -> Start {
    let Some(end) = known.iter().take(V1_MAX).position(|b| *b == b'\n') else {
        return if known.len() < V1_MAX { Start::Incomplete } else { Start::Invalid };
    };
    let line = &known[..=end];
    match ppp::v1::Header::try_from(line) {
        Ok(header) => {
            let source = match header.addresses {
                ppp::v1::Addresses::Tcp4(a) => Some(SocketAddr::new(IpAddr::V4(a.source_address), a.source_port)),
                ppp::v1::Addresses::Tcp6(a) => Some(SocketAddr::new(IpAddr::V6(a.source_address), a.source_port)),
                ppp::v1::Addresses::Unknown => None,
            };
            Start::Header { len: line.len() as u64, source }
        }
        Err(_) => Start::Invalid,
    }
}

fn parse_v2(known: &[u8], total: u64) -> Start {
    let Some(fixed) = known.get(..V2_FIXED) else { return Start::Incomplete };
    let len = V2_FIXED as u64 + u64::from(u16::from_be_bytes([fixed[14], fixed[15]]));
    if (known.len() as u64) < len {
        // Cut by the capture window (large TLVs): the length still says where the header ends.
        return if total >= len { Start::Header { len, source: None } } else { Start::Incomplete };
    }
    match ppp::v2::Header::try_from(&known[..len as usize]) {
        Ok(header) => {
            let source = match (header.command, header.addresses) {
                (ppp::v2::Command::Proxy, ppp::v2::Addresses::IPv4(a)) => {
                    Some(SocketAddr::new(IpAddr::V4(a.source_address), a.source_port))
                }
                (ppp::v2::Command::Proxy, ppp::v2::Addresses::IPv6(a)) => {
                    Some(SocketAddr::new(IpAddr::V6(a.source_address), a.source_port))
                }
                _ => None,
            };
            Start::Header { len, source }
        }
        Err(_) => Start::Invalid,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn v2(command: u8, family: u8, addresses: &[u8], tlvs: &[u8]) -> Vec<u8> {
        let mut h = V2_SIGNATURE.to_vec();
        h.push(0x20 | command);
        h.push(family);
        h.extend_from_slice(&((addresses.len() + tlvs.len()) as u16).to_be_bytes());
        h.extend_from_slice(addresses);
        h.extend_from_slice(tlvs);
        h
    }

    #[test]
    fn v1_tcp4_tcp6_and_unknown() {
        let h = b"PROXY TCP4 192.0.2.7 10.0.0.1 51234 80\r\nGET / HTTP/1.1\r\n\r\n";
        assert_eq!(
            parse(h, h.len() as u64),
            Start::Header { len: 40, source: Some("192.0.2.7:51234".parse().unwrap()) }
        );
        let h = b"PROXY TCP6 2001:db8::1 2001:db8::2 4000 443\r\n";
        assert_eq!(
            parse(h, h.len() as u64),
            Start::Header { len: h.len() as u64, source: Some("[2001:db8::1]:4000".parse().unwrap()) }
        );
        let h = b"PROXY UNKNOWN\r\n";
        assert_eq!(parse(h, h.len() as u64), Start::Header { len: h.len() as u64, source: None });
        assert_eq!(parse(b"PROXY TCP4 1.2.3.4", 18), Start::Incomplete);
        assert_eq!(parse(b"PROXY TCP9 x y 1 2\r\n", 20), Start::Invalid);
    }

    #[test]
    fn v2_proxy_local_and_cut_tlvs() {
        let mut addresses = vec![198, 51, 100, 9, 127, 0, 0, 1];
        addresses.extend_from_slice(&40000u16.to_be_bytes());
        addresses.extend_from_slice(&8080u16.to_be_bytes());
        let h = v2(1, 0x11, &addresses, &[]);
        assert_eq!(
            parse(&h, h.len() as u64),
            Start::Header { len: 28, source: Some("198.51.100.9:40000".parse().unwrap()) }
        );
        let local = v2(0, 0x00, &[], &[]);
        assert_eq!(parse(&local, 16), Start::Header { len: 16, source: None });
        // TLVs beyond the capture window: the header still ends where its length says.
        let big = v2(1, 0x11, &addresses, &[0x04; 3000]);
        assert_eq!(parse(&big[..64], big.len() as u64 + 100), Start::Header { len: big.len() as u64, source: None });
        assert_eq!(parse(&big[..64], 64), Start::Incomplete);
    }

    #[test]
    fn requests_and_prefixes() {
        assert_eq!(parse(b"GET / HTTP/1.1\r\n\r\n", 18), Start::NotProxy);
        assert_eq!(parse(b"PRO", 3), Start::Incomplete);
        assert_eq!(parse(b"\r\n\r\n", 4), Start::Incomplete);
        assert_eq!(parse(b"\r\n\r\n\0\r\nQUIX\n1234", 17), Start::NotProxy);
    }

    proptest! {
        #[test]
        fn never_panics_and_headers_fit_the_call(bytes in proptest::collection::vec(any::<u8>(), 0..300), extra in 0u64..100_000) {
            let total = bytes.len() as u64 + extra;
            if let Start::Header { len, .. } = parse(&bytes, total) {
                prop_assert!(len <= total);
            }
            let mut prefixed = V2_SIGNATURE.to_vec();
            prefixed.extend_from_slice(&bytes);
            let total = prefixed.len() as u64 + extra;
            if let Start::Header { len, .. } = parse(&prefixed, total) {
                prop_assert!(len <= total);
            }
        }
    }
}

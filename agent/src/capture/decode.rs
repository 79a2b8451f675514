//! Decoding ring buffer records (bytes from the kernel) into the tracker's events. Records are
//! untrusted input: every length is checked against the record before use.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use tracetap_ebpf_common::{EventHeader, EventKind, TAIL_BYTES, head_drop::DroppedContext};
use tracetap_proxy::{Chunk, Op, SyscallEvent};

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;

/// Why a record could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("record shorter than its header")]
    Short,
    #[error("unknown event kind {0}")]
    Kind(u32),
    #[error("payload length exceeds the record")]
    Payload,
}

/// Reads the header of a record.
pub fn header(record: &[u8]) -> Result<EventHeader, DecodeError> {
    if record.len() < EventHeader::SIZE {
        return Err(DecodeError::Short);
    }
    Ok(super::loader::read_header(record))
}

/// A traced process's start or end, which the capture loop handles itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    /// The process, and when it started (monotonic ns).
    Start(u32, u64),
    Exit(u32),
    Exec(u32),
}

/// The [`Lifecycle`] event a record carries, if it is one.
#[must_use]
pub fn lifecycle(h: &EventHeader) -> Option<Lifecycle> {
    match EventKind::from_raw(h.kind)? {
        EventKind::ProcessStart => Some(Lifecycle::Start(h.tgid, h.ts_ns)),
        EventKind::ProcessExit => Some(Lifecycle::Exit(h.tgid)),
        EventKind::ProcessExec => Some(Lifecycle::Exec(h.tgid)),
        _ => None,
    }
}

/// Turns a record into a tracker event borrowing the record's payload.
pub fn event<'a>(h: &'a EventHeader, record: &'a [u8]) -> Result<SyscallEvent<'a>, DecodeError> {
    let kind = EventKind::from_raw(h.kind).ok_or(DecodeError::Kind(h.kind))?;
    let captured = h.captured as usize;
    let payload = record.get(EventHeader::SIZE..EventHeader::SIZE + captured).ok_or(DecodeError::Payload)?;
    let total = u64::try_from(h.ret).unwrap_or(0).max(captured as u64);
    let tail = &h.tail[..(h.tail_len as usize).min(TAIL_BYTES)];
    let chunk = Chunk { known: payload, total, tail };
    let op = match kind {
        // The bind address is resolved by the caller from the listening fd (`h.ret`), once per socket.
        EventKind::Accept => {
            Op::Accept { peer: sockaddr(&h.addr[..(h.addr_len as usize).min(h.addr.len())]), local: None }
        }
        EventKind::Connect => Op::Connect { server: sockaddr(&h.addr[..(h.addr_len as usize).min(h.addr.len())]) },
        EventKind::Close => Op::Close,
        // The call failed: the peer reset or broke the connection (see the common crate).
        EventKind::Read | EventKind::Write if h.ret < 0 => Op::PeerGone,
        EventKind::Read => Op::Read(chunk),
        EventKind::Write => Op::Write(chunk),
        EventKind::DroppedRequest => Op::DroppedRequest {
            len: u64::try_from(h.ret).unwrap_or(0),
            context: DroppedContext::from_addr(&h.addr).into(),
        },
        EventKind::TlsOpen => Op::Tls { version: u16::try_from(h.ret).unwrap_or(0) },
        // Not the tracker's: the capture loop takes them first (see [`lifecycle`]).
        EventKind::ProcessStart | EventKind::ProcessExit | EventKind::ProcessExec => Op::Ignore,
    };
    Ok(SyscallEvent { ts_ns: h.ts_ns, tgid: h.tgid, tid: h.tid, fd: h.fd, seq: h.seq, op })
}

/// Parses a raw `sockaddr_in`/`sockaddr_in6` (native-endian family, network-order port).
#[must_use]
pub fn sockaddr(raw: &[u8]) -> Option<SocketAddr> {
    let family = u16::from_ne_bytes(raw.get(0..2)?.try_into().ok()?);
    let port = u16::from_be_bytes(raw.get(2..4)?.try_into().ok()?);
    match family {
        AF_INET => {
            let ip: [u8; 4] = raw.get(4..8)?.try_into().ok()?;
            Some(SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(ip), port)))
        }
        AF_INET6 => {
            let ip: [u8; 16] = raw.get(8..24)?.try_into().ok()?;
            let ip = Ipv6Addr::from(ip);
            // HAProxy on a dual-stack socket sees IPv4 clients as ::ffff:a.b.c.d.
            Some(match ip.to_ipv4_mapped() {
                Some(v4) => SocketAddr::V4(SocketAddrV4::new(v4, port)),
                None => SocketAddr::V6(SocketAddrV6::new(ip, port, 0, 0)),
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_and_ipv6() {
        let mut v4 = [0u8; 28];
        v4[0..2].copy_from_slice(&AF_INET.to_ne_bytes());
        v4[2..4].copy_from_slice(&8080u16.to_be_bytes());
        v4[4..8].copy_from_slice(&[127, 0, 0, 1]);
        assert_eq!(sockaddr(&v4), Some("127.0.0.1:8080".parse().unwrap()));
        let mut v6 = [0u8; 28];
        v6[0..2].copy_from_slice(&AF_INET6.to_ne_bytes());
        v6[2..4].copy_from_slice(&443u16.to_be_bytes());
        v6[8..24].copy_from_slice(&Ipv6Addr::LOCALHOST.octets());
        assert_eq!(sockaddr(&v6), Some("[::1]:443".parse().unwrap()));
        assert_eq!(sockaddr(&[1, 0, 0]), None);
        assert_eq!(sockaddr(&[0u8; 28]), None, "AF_UNSPEC / unix sockets carry no address");
    }

    #[test]
    fn a_failed_read_or_write_is_the_peer_gone_not_an_end_of_stream() {
        let record = vec![0u8; EventHeader::SIZE];
        let mut h = header(&record).unwrap();
        for kind in [EventKind::Read, EventKind::Write] {
            h.kind = kind as u32;
            h.ret = -104;
            assert!(matches!(event(&h, &record).unwrap().op, Op::PeerGone));
            h.ret = 0;
            assert!(!matches!(event(&h, &record).unwrap().op, Op::PeerGone));
        }
    }

    #[test]
    fn short_or_lying_records_are_rejected() {
        assert_eq!(header(&[0u8; 10]).unwrap_err(), DecodeError::Short);
        let mut record = vec![0u8; EventHeader::SIZE];
        let mut h = header(&record).unwrap();
        h.kind = EventKind::Read as u32;
        h.captured = 5;
        assert_eq!(event(&h, &record).unwrap_err(), DecodeError::Payload);
        record.extend_from_slice(b"hello");
        h.ret = 5;
        let ev = event(&h, &record).unwrap();
        assert!(matches!(ev.op, Op::Read(c) if c.known == b"hello" && c.total == 5));
        h.kind = 99;
        assert_eq!(event(&h, &record).unwrap_err(), DecodeError::Kind(99));
    }
}

//! A raw HTTP/2 client over cleartext TCP (prior knowledge), for what load generators do not do:
//! resetting streams, going away. It writes frames as told and reads what comes back; headers are
//! HPACK-encoded by `loona-hpack`.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0;
const HEADERS: u8 = 1;
const RST_STREAM: u8 = 3;
const SETTINGS: u8 = 4;
const GOAWAY: u8 = 7;
const END_STREAM: u8 = 1;
const END_HEADERS: u8 = 4;
const ACK: u8 = 1;
/// RFC 9113 error code CANCEL.
pub const CANCEL: u32 = 8;

/// One connection.
pub struct H2Conn {
    stream: TcpStream,
    encoder: loona_hpack::Encoder<'static>,
    /// Bytes read and not yet taken as frames.
    pending: Vec<u8>,
}

/// A frame read from the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
}

impl H2Conn {
    /// Connects and sends the preface and an empty SETTINGS frame.
    ///
    /// # Errors
    /// When the connection fails.
    pub fn connect(addr: SocketAddr) -> std::io::Result<Self> {
        let stream = TcpStream::connect(addr)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut conn = Self { stream, encoder: loona_hpack::Encoder::new(), pending: Vec::new() };
        conn.stream.write_all(PREFACE)?;
        conn.frame(SETTINGS, 0, 0, &[])?;
        Ok(conn)
    }

    fn frame(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) -> std::io::Result<()> {
        let len = u32::try_from(payload.len()).expect("small frame").to_be_bytes();
        let mut bytes = vec![len[1], len[2], len[3], kind, flags];
        bytes.extend_from_slice(&stream.to_be_bytes());
        bytes.extend_from_slice(payload);
        self.stream.write_all(&bytes)
    }

    /// Sends a request's HEADERS on `stream` (`GET` without a body ends the stream).
    ///
    /// # Errors
    /// When the write fails.
    pub fn request(&mut self, stream: u32, method: &str, path: &str, authority: &str) -> std::io::Result<()> {
        self.request_with(stream, method, path, authority, &[])
    }

    /// [`H2Conn::request`] with more header fields (names lower case, as HTTP/2 wants them).
    ///
    /// # Errors
    /// When the write fails.
    pub fn request_with(
        &mut self,
        stream: u32,
        method: &str,
        path: &str,
        authority: &str,
        headers: &[(&str, &str)],
    ) -> std::io::Result<()> {
        let pseudo: [(&[u8], &[u8]); 4] = [
            (b":method", method.as_bytes()),
            (b":scheme", b"http"),
            (b":path", path.as_bytes()),
            (b":authority", authority.as_bytes()),
        ];
        let fields = pseudo.into_iter().chain(headers.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())));
        let block = self.encoder.encode(fields);
        self.frame(HEADERS, END_HEADERS | END_STREAM, stream, &block)
    }

    /// Resets `stream` with `code`.
    ///
    /// # Errors
    /// When the write fails.
    pub fn reset(&mut self, stream: u32, code: u32) -> std::io::Result<()> {
        self.frame(RST_STREAM, 0, stream, &code.to_be_bytes())
    }

    /// Sends GOAWAY naming `last_stream` as the last one processed.
    ///
    /// # Errors
    /// When the write fails.
    pub fn go_away(&mut self, last_stream: u32, code: u32) -> std::io::Result<()> {
        let mut payload = last_stream.to_be_bytes().to_vec();
        payload.extend_from_slice(&code.to_be_bytes());
        self.frame(GOAWAY, 0, 0, &payload)
    }

    /// Reads frames until one on `stream` ends it (`END_STREAM` on HEADERS or DATA, or `RST_STREAM`),
    /// acknowledging the server's SETTINGS on the way. Returns the frames of `stream`.
    ///
    /// # Errors
    /// When the connection fails or closes first.
    pub fn read_until_end(&mut self, stream: u32) -> std::io::Result<Vec<Frame>> {
        let mut out = Vec::new();
        loop {
            let frame = self.next_frame()?;
            if frame.kind == SETTINGS && frame.flags & ACK == 0 {
                self.frame(SETTINGS, ACK, 0, &[])?;
            }
            if frame.stream != stream {
                continue;
            }
            let ends =
                matches!(frame.kind, HEADERS | DATA) && frame.flags & END_STREAM != 0 || frame.kind == RST_STREAM;
            out.push(frame);
            if ends {
                return Ok(out);
            }
        }
    }

    /// [`H2Conn::read_until_end`] for several streams at once (their frames interleave): returns
    /// each stream's frames once every one of them ended.
    ///
    /// # Errors
    /// When the connection fails or closes first.
    pub fn read_until_all_end(&mut self, streams: &[u32]) -> std::io::Result<Vec<Vec<Frame>>> {
        let mut out: Vec<Vec<Frame>> = streams.iter().map(|_| Vec::new()).collect();
        let mut open = streams.len();
        while open > 0 {
            let frame = self.next_frame()?;
            if frame.kind == SETTINGS && frame.flags & ACK == 0 {
                self.frame(SETTINGS, ACK, 0, &[])?;
            }
            let Some(i) = streams.iter().position(|s| *s == frame.stream) else { continue };
            let ends =
                matches!(frame.kind, HEADERS | DATA) && frame.flags & END_STREAM != 0 || frame.kind == RST_STREAM;
            out[i].push(frame);
            open -= usize::from(ends);
        }
        Ok(out)
    }

    fn next_frame(&mut self) -> std::io::Result<Frame> {
        loop {
            if self.pending.len() >= 9 {
                let len = usize::from(self.pending[0]) << 16
                    | usize::from(self.pending[1]) << 8
                    | usize::from(self.pending[2]);
                if self.pending.len() >= 9 + len {
                    let head: Vec<u8> = self.pending.drain(..9 + len).collect();
                    return Ok(Frame {
                        kind: head[3],
                        flags: head[4],
                        stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff,
                        payload: head[9..].to_vec(),
                    });
                }
            }
            let mut buf = [0u8; 16 * 1024];
            let n = self.stream.read(&mut buf)?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            self.pending.extend_from_slice(&buf[..n]);
        }
    }
}

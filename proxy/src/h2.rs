//! One direction of an HTTP/2 connection (RFC 9113): frames, and header blocks decoded with
//! `loona-hpack`, turned into per-stream [`Event`]s.
//!
//! Each direction has its own HPACK state, which every header block changes. A block that is not
//! seen whole (bytes the capture window did not copy, a record lost) leaves the state unknown,
//! and every later block might decode to wrong fields; so the decoder never guesses:
//! - bytes arrive as [`Chunk`]s, one syscall each, whose middle may be unknown (only a prefix and
//!   the last few bytes are copied). Unknown bytes inside a payload that is only skipped (DATA,
//!   SETTINGS, PING, ...) cost nothing: frames are skipped by length. Unknown bytes in a frame
//!   header, a HEADERS / `PUSH_PROMISE` / CONTINUATION payload or the preface, an HPACK error, a
//!   header block over [`MAX_BLOCK`], or frames that break the CONTINUATION rules make
//!   [`Decoder::feed`] return an error, once; the direction is then desynced for good and
//!   ignores everything after.
//! - The client's direction starts with the connection preface, checked and skipped.
//!
//! Invariant: memory per direction is bounded: a frame header, at most [`MAX_BLOCK`] of header
//! block, [`MAX_FIELD_BYTES`] of decoded fields, and an HPACK table of at most
//! [`MAX_TABLE_SIZE`] (a peer's size updates above it are an HPACK error).

use loona_hpack::decoder::DecoderError;

use crate::framing::{Chunk, MAX_HEAD_BYTES};
use crate::head::{self, RequestHead, ResponseHead};

/// What an HTTP/2 client sends first.
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Largest header block (HEADERS plus CONTINUATION fragments) kept for decoding.
pub const MAX_BLOCK: usize = MAX_HEAD_BYTES;
/// Largest dynamic table a peer may ask for (`HAProxy` advertises 4 KiB by default and at most
/// 64 KiB).
pub const MAX_TABLE_SIZE: usize = 64 * 1024;
/// Most bytes of decoded names and values kept per block: indexed fields let a small block expand
/// to far more (an HPACK bomb); a head past this is [`Event::Malformed`] (the state stays good).
pub const MAX_FIELD_BYTES: usize = 2 * MAX_HEAD_BYTES;
/// Most fields kept per block, for the same reason.
const MAX_FIELDS: usize = 1024;

/// Buffer capacity kept between header blocks (most blocks are a few hundred bytes).
const KEPT_CAPACITY: usize = 4096;

/// A frame length is 24 bits, so a frame is at most 16 MiB: skipped ones need no other bound, and
/// header blocks are bounded by [`MAX_BLOCK`].
const FRAME_HEADER_LEN: usize = 9;

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const PUSH_PROMISE: u8 = 0x5;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;

const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// Error code given to a `RST_STREAM` whose code the capture window cut (an unknown code).
pub const UNKNOWN_CODE: u32 = u32::MAX;

/// Who sends the bytes of a direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sender {
    /// The client: starts with the preface; its heads are requests.
    Client,
    /// The server: its heads are responses.
    Server,
}

/// What a direction's frames say about its streams, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A request head (client direction).
    Request { stream: u32, head: RequestHead, end_stream: bool },
    /// A response head (server direction), interim 1xx ones included.
    Response { stream: u32, head: ResponseHead, end_stream: bool },
    /// A header block without pseudo-headers: trailers, which end the stream.
    Trailers { stream: u32 },
    /// A DATA frame with `END_STREAM`: the sender's message on the stream is complete.
    StreamEnd { stream: u32 },
    /// `RST_STREAM`: the stream is over ([`UNKNOWN_CODE`] when the code was not captured).
    Reset { stream: u32, code: u32 },
    /// `GOAWAY`: the sender will not process streams of its peer above `last_stream`.
    GoAway { last_stream: u32, code: u32 },
    /// A header block that decoded (the HPACK state is good) but is no valid head: a missing
    /// pseudo-header, or fields past [`MAX_FIELD_BYTES`].
    Malformed { stream: u32, end_stream: bool },
}

/// Why a direction was given up. Returned once; the decoder ignores all later bytes.
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
pub enum H2Error {
    #[error("not the HTTP/2 connection preface")]
    BadPreface,
    #[error("a frame header or header block was not captured")]
    Uncaptured,
    #[error("header block larger than {MAX_BLOCK} bytes")]
    BlockTooLarge,
    #[error("frames break HTTP/2 framing: {0}")]
    Protocol(&'static str),
    #[error("HPACK: {0}")]
    Hpack(DecoderError),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FrameHeader {
    len: u32,
    kind: u8,
    flags: u8,
    stream: u32,
}

impl FrameHeader {
    fn parse(b: &[u8; FRAME_HEADER_LEN]) -> Self {
        Self {
            len: u32::from_be_bytes([0, b[0], b[1], b[2]]),
            kind: b[3],
            flags: b[4],
            stream: u32::from_be_bytes([b[5], b[6], b[7], b[8]]) & 0x7fff_ffff,
        }
    }

    /// How many payload bytes must be kept: all of a header block fragment, the fixed part of a
    /// `RST_STREAM` or `GOAWAY`, none of the rest.
    fn kept(&self) -> usize {
        match self.kind {
            HEADERS | PUSH_PROMISE | CONTINUATION => self.len as usize,
            RST_STREAM => 4,
            GOAWAY => 8,
            _ => 0,
        }
        .min(self.len as usize)
    }

    fn carries_block(&self) -> bool {
        matches!(self.kind, HEADERS | PUSH_PROMISE | CONTINUATION)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// This many bytes of the preface were seen.
    Preface(usize),
    /// Collecting a frame header in `frame_header`.
    FrameHeader,
    /// In the payload of `frame`, `left` bytes to go.
    Payload {
        frame: FrameHeader,
        left: u32,
    },
    Desynced,
}

/// A header block waiting for its CONTINUATION frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct OpenBlock {
    stream: u32,
    end_stream: bool,
    /// A `PUSH_PROMISE` block: decoded for the HPACK state, not reported.
    promise: bool,
}

/// The bytes of a [`Chunk`] by position: the known prefix, unknown bytes, then the known tail.
struct View<'a> {
    known: &'a [u8],
    /// The copied last bytes of the call, without those the prefix already holds.
    tail: &'a [u8],
    tail_start: u64,
    total: u64,
    pos: u64,
}

impl<'a> View<'a> {
    fn new(chunk: Chunk<'a>) -> Self {
        let known_len = chunk.known.len() as u64;
        let total = chunk.total.max(known_len);
        let beyond = usize::try_from(total - known_len).unwrap_or(usize::MAX);
        let tail = &chunk.tail[chunk.tail.len().saturating_sub(beyond)..];
        Self { known: chunk.known, tail, tail_start: total - tail.len() as u64, total, pos: 0 }
    }

    fn remaining(&self) -> u64 {
        self.total - self.pos
    }

    /// The known bytes from the current position on, up to the next unknown one (empty when the
    /// current one is unknown, or at the end).
    fn run(&self) -> &'a [u8] {
        if self.pos < self.known.len() as u64 {
            &self.known[self.pos as usize..]
        } else if self.pos >= self.tail_start {
            &self.tail[(self.pos - self.tail_start) as usize..]
        } else {
            &[]
        }
    }

    fn skip(&mut self, n: u64) {
        self.pos = self.pos.saturating_add(n).min(self.total);
    }
}

/// The decoder of one direction of one HTTP/2 connection.
pub struct Decoder {
    sender: Sender,
    state: State,
    hpack: loona_hpack::Decoder<'static>,
    frame_header: [u8; FRAME_HEADER_LEN],
    frame_header_len: usize,
    /// The kept payload of the current frame (see [`FrameHeader::kept`]).
    payload: Vec<u8>,
    /// Part of the kept payload was not captured (only possible outside header blocks).
    payload_lost: bool,
    /// Header block fragments gathered so far.
    block: Vec<u8>,
    open_block: Option<OpenBlock>,
    /// Decoded names and values of the last block, and where each field lies in it.
    fields: Vec<u8>,
    field_spans: Vec<(u32, u32, u32)>,
}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder").field("sender", &self.sender).field("state", &self.state).finish_non_exhaustive()
    }
}

impl Decoder {
    #[must_use]
    pub fn new(sender: Sender) -> Self {
        let mut hpack = loona_hpack::Decoder::new();
        hpack.set_max_allowed_table_size(MAX_TABLE_SIZE);
        Self {
            sender,
            state: if sender == Sender::Client { State::Preface(0) } else { State::FrameHeader },
            hpack,
            frame_header: [0; FRAME_HEADER_LEN],
            frame_header_len: 0,
            payload: Vec::new(),
            payload_lost: false,
            block: Vec::new(),
            open_block: None,
            fields: Vec::new(),
            field_spans: Vec::new(),
        }
    }

    /// True once the direction was given up.
    #[must_use]
    pub fn is_desynced(&self) -> bool {
        self.state == State::Desynced
    }

    /// Decodes one call's bytes, appending what they say to `events`. Request heads reuse the
    /// heads in `heads` (recycled ones). An error gives up the direction: it is returned once,
    /// after the events of the bytes before it, and later calls do nothing.
    pub fn feed(
        &mut self,
        chunk: Chunk<'_>,
        events: &mut Vec<Event>,
        heads: &mut Vec<RequestHead>,
    ) -> Result<(), H2Error> {
        let mut view = View::new(chunk);
        let result = self.run(&mut view, events, heads);
        if result.is_err() {
            // Nothing decoded from here on could be trusted: free what the direction held.
            *self = Self { state: State::Desynced, ..Self::new(self.sender) };
        }
        result
    }

    fn run(
        &mut self,
        view: &mut View<'_>,
        events: &mut Vec<Event>,
        heads: &mut Vec<RequestHead>,
    ) -> Result<(), H2Error> {
        loop {
            match self.state {
                State::Desynced => return Ok(()),
                _ if view.remaining() == 0 => return Ok(()),
                State::Preface(seen) => {
                    let run = view.run();
                    if run.is_empty() {
                        return Err(H2Error::Uncaptured);
                    }
                    let n = run.len().min(PREFACE.len() - seen);
                    if run[..n] != PREFACE[seen..seen + n] {
                        return Err(H2Error::BadPreface);
                    }
                    view.skip(n as u64);
                    self.state = if seen + n == PREFACE.len() { State::FrameHeader } else { State::Preface(seen + n) };
                }
                State::FrameHeader => {
                    let run = view.run();
                    if run.is_empty() {
                        return Err(H2Error::Uncaptured);
                    }
                    let n = run.len().min(FRAME_HEADER_LEN - self.frame_header_len);
                    self.frame_header[self.frame_header_len..self.frame_header_len + n].copy_from_slice(&run[..n]);
                    self.frame_header_len += n;
                    view.skip(n as u64);
                    if self.frame_header_len == FRAME_HEADER_LEN {
                        self.frame_header_len = 0;
                        let frame = FrameHeader::parse(&self.frame_header);
                        self.start_frame(frame)?;
                        if frame.len == 0 {
                            self.end_frame(frame, events, heads)?;
                        }
                    }
                }
                State::Payload { frame, mut left } => {
                    // Once part of it was lost, later bytes would land at the wrong offsets.
                    let want = if self.payload_lost { 0 } else { frame.kept().saturating_sub(self.payload.len()) };
                    let want = want.min(left as usize);
                    if want == 0 {
                        let n = view.remaining().min(u64::from(left));
                        view.skip(n);
                        left -= n as u32;
                    } else {
                        let run = view.run();
                        if run.is_empty() {
                            if frame.carries_block() {
                                return Err(H2Error::Uncaptured);
                            }
                            // A control frame's code cut by the window: reported as unknown.
                            self.payload_lost = true;
                        }
                        let n = run.len().min(want);
                        self.payload.extend_from_slice(&run[..n]);
                        view.skip(n as u64);
                        left -= n as u32;
                    }
                    self.state = State::Payload { frame, left };
                    if left == 0 {
                        self.end_frame(frame, events, heads)?;
                    }
                }
            }
        }
    }

    /// Checks a frame header against the CONTINUATION rules and the block limit.
    fn start_frame(&mut self, frame: FrameHeader) -> Result<(), H2Error> {
        match (self.open_block, frame.kind) {
            (Some(open), CONTINUATION) if open.stream == frame.stream => {}
            (Some(_), _) => return Err(H2Error::Protocol("a header block was interrupted")),
            (None, CONTINUATION) => return Err(H2Error::Protocol("CONTINUATION without a header block")),
            _ => {}
        }
        if frame.carries_block() && self.block.len() + frame.len as usize > MAX_BLOCK {
            return Err(H2Error::BlockTooLarge);
        }
        self.payload.clear();
        self.payload_lost = false;
        self.state = State::Payload { frame, left: frame.len };
        Ok(())
    }

    fn end_frame(
        &mut self,
        frame: FrameHeader,
        events: &mut Vec<Event>,
        heads: &mut Vec<RequestHead>,
    ) -> Result<(), H2Error> {
        self.state = State::FrameHeader;
        let stream = frame.stream;
        match frame.kind {
            DATA if frame.flags & END_STREAM != 0 && stream != 0 => events.push(Event::StreamEnd { stream }),
            HEADERS | PUSH_PROMISE => {
                let mut fragment = &self.payload[..];
                if frame.flags & PADDED != 0 {
                    let (&pad, rest) = fragment.split_first().ok_or(H2Error::Protocol("padding"))?;
                    fragment =
                        rest.get(..rest.len().wrapping_sub(usize::from(pad))).ok_or(H2Error::Protocol("padding"))?;
                }
                let fixed = match frame.kind {
                    HEADERS if frame.flags & PRIORITY != 0 => 5,
                    HEADERS => 0,
                    _ => 4, // the promised stream id
                };
                fragment = fragment.get(fixed..).ok_or(H2Error::Protocol("frame too short"))?;
                self.block.extend_from_slice(fragment);
                self.open_block = Some(OpenBlock {
                    stream,
                    end_stream: frame.kind == HEADERS && frame.flags & END_STREAM != 0,
                    promise: frame.kind == PUSH_PROMISE,
                });
            }
            CONTINUATION => self.block.extend_from_slice(&self.payload),
            RST_STREAM if frame.len == 4 && stream != 0 => {
                let code = if self.payload_lost { UNKNOWN_CODE } else { be32(&self.payload) };
                events.push(Event::Reset { stream, code });
            }
            // A GOAWAY whose last stream was not captured says nothing usable.
            GOAWAY if frame.len >= 8 && !self.payload_lost => events
                .push(Event::GoAway { last_stream: be32(&self.payload) & 0x7fff_ffff, code: be32(&self.payload[4..]) }),
            _ => {}
        }
        if frame.carries_block() && frame.flags & END_HEADERS != 0 {
            let open = self.open_block.take().expect("a block frame opens a block");
            self.decode_block(open, events, heads)?;
        }
        Ok(())
    }

    /// Decodes a complete header block (always: it changes the HPACK state) and reports it.
    fn decode_block(
        &mut self,
        open: OpenBlock,
        events: &mut Vec<Event>,
        heads: &mut Vec<RequestHead>,
    ) -> Result<(), H2Error> {
        self.fields.clear();
        self.fields.shrink_to(KEPT_CAPACITY);
        self.field_spans.clear();
        let (fields, spans) = (&mut self.fields, &mut self.field_spans);
        let mut overflow = false;
        let decoded = self.hpack.decode_with_cb(&self.block, |name, value| {
            if overflow || fields.len() + name.len() + value.len() > MAX_FIELD_BYTES || spans.len() == MAX_FIELDS {
                overflow = true;
                return;
            }
            let start = fields.len() as u32;
            fields.extend_from_slice(&name);
            fields.extend_from_slice(&value);
            spans.push((start, name.len() as u32, value.len() as u32));
        });
        self.block.clear();
        // A rare large block must not keep its buffers' size on every connection that saw one.
        self.block.shrink_to(KEPT_CAPACITY);
        self.payload.shrink_to(KEPT_CAPACITY);
        decoded.map_err(H2Error::Hpack)?;
        let OpenBlock { stream, end_stream, promise } = open;
        if promise || stream == 0 {
            return Ok(());
        }
        let fields = &self.fields;
        let iter = || {
            self.field_spans.iter().map(|&(start, name_len, value_len)| {
                let (start, name_end) = (start as usize, (start + name_len) as usize);
                (&fields[start..name_end], &fields[name_end..name_end + value_len as usize])
            })
        };
        let malformed = Event::Malformed { stream, end_stream };
        if overflow {
            events.push(malformed);
            return Ok(());
        }
        if !iter().next().is_some_and(|(name, _)| name.starts_with(b":")) {
            events.push(Event::Trailers { stream });
            return Ok(());
        }
        events.push(match self.sender {
            Sender::Client => {
                let mut head = heads.pop().unwrap_or_default();
                if head::request_from_fields(iter(), &mut head).is_ok() {
                    Event::Request { stream, head, end_stream }
                } else {
                    heads.push(head);
                    malformed
                }
            }
            Sender::Server => match head::response_from_fields(iter()) {
                Ok(head) => Event::Response { stream, head, end_stream },
                Err(_) => malformed,
            },
        });
        Ok(())
    }
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// True when `bytes` (the first bytes of a connection's server direction) start with a SETTINGS
/// frame header, the server's preface: a server may send it before it reads the client's.
#[must_use]
pub fn starts_with_settings(bytes: &[u8]) -> bool {
    let Some(header) = bytes.first_chunk::<FRAME_HEADER_LEN>() else { return false };
    let frame = FrameHeader::parse(header);
    frame.kind == 0x4 && frame.flags & !0x1 == 0 && frame.stream == 0 && frame.len.is_multiple_of(6) && header[5] == 0
}

#[cfg(test)]
mod tests;

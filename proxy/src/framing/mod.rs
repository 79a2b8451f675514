//! HTTP/1 message framing over one direction of a connection, fed with syscall-sized chunks of
//! which only a prefix may be known.
//!
//! The probes copy the first `TRACETAP_CAPTURE_BYTES` of each syscall and the last few bytes (the
//! tail). A [`Chunk`] therefore has `known` bytes, then `total - known.len()` bytes that passed
//! through the socket but were not copied. The framer must stay in step anyway:
//! - a head must lie inside known bytes; a head cut by unknown bytes is an error (the caller
//!   decides whether and how to resynchronise);
//! - Content-Length bodies are counted, so unknown bytes inside them cost nothing;
//! - chunked bodies are parsed; when unknown bytes hide a chunk-size line the framer switches to
//!   `ChunkedLost` and ends the message at the last-chunk marker `\r\n0\r\n\r\n`
//!   (what every HTTP/1 sender `HAProxy` talks to writes without trailers): found in a call's known
//!   bytes (the bytes after it are the next message), in the tail of a call cut by the window, or
//!   split between the end of one call and the start of the next.
//!
//! Invariant: the framer never holds more than [`MAX_HEAD_BYTES`] of a head, or
//! [`MAX_CHUNK_LINE`] of a chunk-size line, so memory per connection is bounded.

use std::sync::LazyLock;

use memchr::memmem;

/// Longest head (request or status line plus headers) the framer accepts.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Bytes of a message whose framing failed that the framer keeps (see [`Framer::failed_bytes`]).
pub const FAILED_BYTES_KEPT: usize = 64;
/// Longest chunk-size line (with extensions) the framer accepts.
pub const MAX_CHUNK_LINE: usize = 1024;
/// Marker the sender writes after the last chunk when there are no trailers.
const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// One syscall's worth of bytes of one direction.
#[derive(Clone, Copy, Debug)]
pub struct Chunk<'a> {
    /// The bytes that were copied: a prefix of the syscall's bytes.
    pub known: &'a [u8],
    /// How many bytes the syscall moved in all (`>= known.len()`).
    pub total: u64,
    /// The last bytes of the syscall's bytes, when `total > known.len()`.
    pub tail: &'a [u8],
}

impl<'a> Chunk<'a> {
    /// A chunk whose bytes are all known.
    #[must_use]
    pub fn complete(bytes: &'a [u8]) -> Self {
        Self { known: bytes, total: bytes.len() as u64, tail: &[] }
    }
}

/// How the body of a message is delimited, decided by the caller from the head.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BodyFraming {
    /// No body follows the head.
    #[default]
    Empty,
    /// Exactly this many bytes follow.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// The body runs until the connection closes.
    UntilClose,
    /// The connection stops speaking HTTP after this head (101 Switching Protocols, CONNECT).
    Tunnel,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChunkPart {
    SizeLine,
    Data(u64),
    DataCrlf(u8),
    Trailers,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BodyState {
    Length(u64),
    Chunked(ChunkPart),
    /// Unknown bytes hid the chunk framing; waiting for a tail that ends with the last chunk.
    ChunkedLost,
    UntilClose,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Collecting a head in `buf`.
    Head,
    /// A head was returned; waiting for the caller's [`Framer::set_body`].
    AwaitingFraming,
    Body(BodyState),
    Tunnel,
    /// Out of step; everything is ignored until [`Framer::resync`].
    Desync,
}

/// What one step of the framer found.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// A complete head. The bytes are in [`Framer::head_bytes`] until the next step; the caller must
    /// call [`Framer::set_body`] before stepping again.
    Head,
    /// The current message ended.
    MessageEnd,
    /// The framer lost sync; it ignores input until resynchronised.
    Error(FramingError),
    /// The chunk is used up.
    NeedMore,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FramingError {
    #[error("message head longer than {MAX_HEAD_BYTES} bytes")]
    HeadTooLarge,
    #[error("message head cut by bytes that were not captured")]
    HeadTruncated,
    #[error("malformed message head")]
    BadHead,
    #[error("malformed chunked body")]
    BadChunk,
}

/// Position inside a [`Chunk`] while the framer consumes it.
#[derive(Debug)]
pub struct Cursor<'a> {
    chunk: Chunk<'a>,
    pos: usize,
    unknown_left: u64,
}

impl<'a> Cursor<'a> {
    #[must_use]
    pub fn new(chunk: Chunk<'a>) -> Self {
        let unknown_left = chunk.total.saturating_sub(chunk.known.len() as u64);
        Self { chunk, pos: 0, unknown_left }
    }

    fn known(&self) -> &'a [u8] {
        &self.chunk.known[self.pos..]
    }

    /// True when no byte of the chunk is left, known or not.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.pos == self.chunk.known.len() && self.unknown_left == 0
    }

    fn remaining(&self) -> u64 {
        (self.chunk.known.len() - self.pos) as u64 + self.unknown_left
    }

    /// Skips `n` bytes (known first, then unknown).
    fn skip(&mut self, n: u64) {
        let known_left = (self.chunk.known.len() - self.pos) as u64;
        let from_known = n.min(known_left);
        self.pos += from_known as usize;
        self.unknown_left -= (n - from_known).min(self.unknown_left);
    }

    fn skip_all(&mut self) {
        self.pos = self.chunk.known.len();
        self.unknown_left = 0;
    }
}

/// The framing state machine of one direction of one connection.
#[derive(Debug)]
pub struct Framer {
    state: State,
    buf: Vec<u8>,
    /// Length of the head in `buf` after [`Step::Head`].
    head_len: usize,
    /// The head in `buf` was cut by the capture window.
    truncated: bool,
    /// In [`BodyState::ChunkedLost`]: the last bytes of the previous call, when known, to find a
    /// last-chunk marker split between two calls.
    recent: [u8; LOST_MARKER.len()],
    recent_len: u8,
}

/// The end of a chunked body as seen in lost mode: the CRLF closing the last data chunk, then the
/// last chunk.
const LOST_MARKER: &[u8] = b"\r\n0\r\n\r\n";

impl Default for Framer {
    fn default() -> Self {
        Self::new()
    }
}

impl Framer {
    #[must_use]
    pub fn new() -> Self {
        Self {
            state: State::Head,
            buf: Vec::new(),
            head_len: 0,
            truncated: false,
            recent: [0; LOST_MARKER.len()],
            recent_len: 0,
        }
    }

    /// The head returned by the last [`Step::Head`].
    #[must_use]
    pub fn head_bytes(&self) -> &[u8] {
        &self.buf[..self.head_len]
    }

    /// True between messages: no byte of a next message has been seen.
    #[must_use]
    pub fn is_idle(&self) -> bool {
        self.state == State::Head && self.buf.is_empty()
    }

    /// True when `len` bytes the caller did not see all fall inside the current message (a body
    /// of a length not reached by them, one that runs until close, or a tunnel): counted into it,
    /// they leave the framing right. False when they may hold a message's end and what follows.
    #[must_use]
    pub fn takes_unseen(&self, len: u64) -> bool {
        match self.state {
            State::Body(BodyState::Length(left)) => left >= len,
            State::Body(BodyState::UntilClose) | State::Tunnel => true,
            State::Head | State::AwaitingFraming | State::Body(_) | State::Desync => false,
        }
    }

    /// True when the direction carries opaque tunnel bytes.
    #[must_use]
    pub fn is_tunnel(&self) -> bool {
        self.state == State::Tunnel
    }

    /// True when the framer gave up on this direction.
    #[must_use]
    pub fn is_desynced(&self) -> bool {
        self.state == State::Desync
    }

    /// The first bytes of the message whose framing failed, while the framer is desynchronised
    /// by that failure (at most [`FAILED_BYTES_KEPT`]; empty after [`Framer::abandon`]).
    #[must_use]
    pub fn failed_bytes(&self) -> &[u8] {
        if self.state == State::Desync { &self.buf } else { &[] }
    }

    /// The first bytes of a head still being read (at most [`FAILED_BYTES_KEPT`]): what a client
    /// had sent when `HAProxy` answered before the head was complete (408, 400).
    #[must_use]
    pub fn pending_head(&self) -> &[u8] {
        if self.state == State::Head { &self.buf[..self.buf.len().min(FAILED_BYTES_KEPT)] } else { &[] }
    }

    /// Starts looking for a head again at the start of the next chunk.
    pub fn resync(&mut self) {
        self.buf.clear();
        self.head_len = 0;
        self.state = State::Head;
    }

    /// Stops framing: the direction now carries opaque bytes (after 101 or CONNECT).
    pub fn enter_tunnel(&mut self) {
        self.buf.clear();
        self.head_len = 0;
        self.state = State::Tunnel;
    }

    /// Gives up on this direction until [`Framer::resync`].
    pub fn abandon(&mut self) {
        self.buf.clear();
        self.head_len = 0;
        self.state = State::Desync;
    }

    /// Tells the framer how the body of the head it just returned is delimited.
    pub fn set_body(&mut self, framing: BodyFraming) {
        debug_assert_eq!(self.state, State::AwaitingFraming);
        self.buf.drain(..self.head_len);
        self.head_len = 0;
        self.state = match framing {
            // Callers map `Length(0)` to `Empty`; both end the message at the head.
            BodyFraming::Empty | BodyFraming::Length(0) => State::Head,
            BodyFraming::Length(n) => State::Body(BodyState::Length(n)),
            BodyFraming::Chunked => State::Body(BodyState::Chunked(ChunkPart::SizeLine)),
            BodyFraming::UntilClose => State::Body(BodyState::UntilClose),
            BodyFraming::Tunnel => State::Tunnel,
        };
        // Bytes after the head stay in the cursor; `buf` only ever held bytes of the head itself.
        self.buf.clear();
    }

    /// The stream ended (peer closed): ends a body that runs until close.
    /// Returns true when that completed a message.
    pub fn finish(&mut self) -> bool {
        if self.state == State::Body(BodyState::UntilClose) {
            self.state = State::Head;
            return true;
        }
        false
    }

    /// Consumes bytes of `cursor` until something happens.
    pub fn step(&mut self, cursor: &mut Cursor<'_>) -> Step {
        match self.state {
            State::AwaitingFraming => {
                debug_assert!(false, "set_body not called after Step::Head");
                self.state = State::Desync;
                Step::Error(FramingError::BadHead)
            }
            State::Desync | State::Tunnel => {
                cursor.skip_all();
                Step::NeedMore
            }
            State::Head => self.step_head(cursor),
            State::Body(body) => self.step_body(body, cursor),
        }
    }

    fn fail(&mut self, err: FramingError, cursor: &mut Cursor<'_>) -> Step {
        self.state = State::Desync;
        // The start of what failed stays for [`Framer::failed_bytes`]: a request HAProxy rejects
        // is reported with it.
        self.buf.truncate(FAILED_BYTES_KEPT);
        self.head_len = 0;
        cursor.skip_all();
        Step::Error(err)
    }

    fn step_head(&mut self, cursor: &mut Cursor<'_>) -> Step {
        let known = cursor.known();
        if known.is_empty() {
            if cursor.unknown_left > 0 {
                return self.fail(FramingError::HeadTruncated, cursor);
            }
            return Step::NeedMore;
        }
        // Empty lines before a message are allowed and ignored (RFC 9112, section 2.2).
        if self.buf.is_empty() {
            let blank = known.iter().take_while(|b| **b == b'\r' || **b == b'\n').count();
            if blank > 0 {
                cursor.skip(blank as u64);
                return self.step_head(cursor);
            }
        }
        let before = self.buf.len();
        // Search for the end of the head only where it can be: in what we add plus 3 bytes back.
        let search_from = before.saturating_sub(3);
        let room = MAX_HEAD_BYTES - before;
        let take = known.len().min(room);
        self.buf.extend_from_slice(&known[..take]);
        if let Some(end) = find_head_end(&self.buf[search_from..]) {
            let head_len = search_from + end;
            let consumed = head_len - before;
            cursor.skip(consumed as u64);
            self.buf.truncate(head_len);
            self.head_len = head_len;
            self.truncated = false;
            self.state = State::AwaitingFraming;
            return Step::Head;
        }
        if take < known.len() {
            return self.fail(FramingError::HeadTooLarge, cursor);
        }
        cursor.skip(take as u64);
        if cursor.unknown_left > 0 {
            return self.truncated_head(cursor);
        }
        if !looks_like_start_line(&self.buf) {
            return self.fail(FramingError::BadHead, cursor);
        }
        Step::NeedMore
    }

    /// The capture window cut the head. Keep its complete lines, assume the head ends where the
    /// syscall's bytes end (a client writes its head in one go, and HAProxy reads and writes it in
    /// one go), and hand it out marked as truncated. Without a complete start line it is an error.
    fn truncated_head(&mut self, cursor: &mut Cursor<'_>) -> Step {
        let Some(last_newline) = memchr::memrchr(b'\n', &self.buf) else {
            return self.fail(FramingError::HeadTruncated, cursor);
        };
        if !looks_like_start_line(&self.buf) {
            return self.fail(FramingError::BadHead, cursor);
        }
        self.buf.truncate(last_newline + 1);
        self.buf.extend_from_slice(b"\r\n");
        cursor.skip_all();
        self.head_len = self.buf.len();
        self.truncated = true;
        self.state = State::AwaitingFraming;
        Step::Head
    }

    /// True when the head of the last [`Step::Head`] was cut by the capture window: only its first
    /// lines are known.
    #[must_use]
    pub fn head_truncated(&self) -> bool {
        self.truncated
    }
}

/// Offset just past `\r\n\r\n` (or a bare `\n\n`), if the head ends in `buf`.
///
/// The head ends at the first `\n` followed by `\r\n` or by `\n`. The usual end is searched for in
/// one vectorised pass (stopping at every `\n` of a head cost a search call per line), then a bare
/// `\n\n` only before it.
fn find_head_end(buf: &[u8]) -> Option<usize> {
    static CRLF_END: LazyLock<memmem::Finder<'static>> = LazyLock::new(|| memmem::Finder::new(b"\n\r\n"));
    static LF_END: LazyLock<memmem::Finder<'static>> = LazyLock::new(|| memmem::Finder::new(b"\n\n"));
    let crlf = CRLF_END.find(buf);
    // A `\n\n` counts only when its first `\n` comes before the `\n` of the `\n\r\n` found (they
    // cannot start at the same byte), so it ends at most at that byte.
    let bare = LF_END.find(&buf[..crlf.map_or(buf.len(), |i| i + 1)]);
    match (bare, crlf) {
        (Some(i), _) => Some(i + 2),
        (None, Some(i)) => Some(i + 3),
        (None, None) => None,
    }
}

/// A cheap check that a partial head could become an HTTP/1 request or status line, so garbage is
/// rejected at once instead of after [`MAX_HEAD_BYTES`].
fn looks_like_start_line(buf: &[u8]) -> bool {
    let first_line = buf.split(|b| *b == b'\n').next().unwrap_or(buf);
    let token_end = first_line.iter().position(|b| *b == b' ').unwrap_or(first_line.len());
    let token = &first_line[..token_end];
    if token.len() > 32 {
        return false;
    }
    token.iter().all(u8::is_ascii_graphic)
}

mod body;

#[cfg(test)]
mod tests {
    proptest::proptest! {
        /// The memmem search finds the same head end as a byte-at-a-time scan.
        #[test]
        fn find_head_end_agrees_with_a_byte_scan(bytes in proptest::collection::vec(proptest::sample::select(vec![b'\r', b'\n', b'a', b':']), 0..64)) {
            let scan = (0..bytes.len()).find_map(|i| {
                (bytes[i] == b'\n').then(|| {
                    if bytes[i + 1..].starts_with(b"\r\n") { Some(i + 3) } else if bytes[i + 1..].starts_with(b"\n") { Some(i + 2) } else { None }
                }).flatten()
            });
            proptest::prop_assert_eq!(find_head_end(&bytes), scan);
        }
    }

    use super::*;

    /// Feeds `chunks` and records the steps, answering each head with `framing`.
    fn run(framer: &mut Framer, chunks: &[Chunk<'_>], framing: BodyFraming) -> Vec<Step> {
        let mut steps = Vec::new();
        for chunk in chunks {
            let mut cursor = Cursor::new(*chunk);
            loop {
                let step = framer.step(&mut cursor);
                match step {
                    Step::NeedMore => break,
                    Step::Head => framer.set_body(framing),
                    _ => {}
                }
                steps.push(step);
            }
        }
        steps
    }

    #[test]
    fn head_split_over_reads() {
        let mut f = Framer::new();
        let steps = run(
            &mut f,
            &[Chunk::complete(b"GET / HT"), Chunk::complete(b"TP/1.1\r\nHost: a\r"), Chunk::complete(b"\n\r\n")],
            BodyFraming::Empty,
        );
        assert_eq!(steps, vec![Step::Head]);
        assert!(f.is_idle());
    }

    #[test]
    fn pipelined_heads_in_one_read() {
        let mut f = Framer::new();
        let steps =
            run(&mut f, &[Chunk::complete(b"GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\n\r\n")], BodyFraming::Empty);
        assert_eq!(steps, vec![Step::Head, Step::Head]);
    }

    #[test]
    fn content_length_body_counts_unknown_bytes() {
        let mut f = Framer::new();
        let head = b"HTTP/1.1 200 OK\r\nContent-Length: 10000\r\n\r\nxxxx";
        let chunk = Chunk { known: head, total: head.len() as u64 + 9996, tail: b"" };
        let mut cursor = Cursor::new(chunk);
        assert_eq!(f.step(&mut cursor), Step::Head);
        f.set_body(BodyFraming::Length(10000));
        assert_eq!(f.step(&mut cursor), Step::MessageEnd);
        assert!(cursor.is_empty());
    }

    #[test]
    fn chunked_body_parsed_across_reads() {
        let mut f = Framer::new();
        let steps = run(
            &mut f,
            &[
                Chunk::complete(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel"),
                Chunk::complete(b"lo\r\n3;ext=1\r\nabc\r"),
                Chunk::complete(b"\n0\r\nX-T: 1\r\n\r\n"),
            ],
            BodyFraming::Chunked,
        );
        assert_eq!(steps, vec![Step::Head, Step::MessageEnd]);
        assert!(f.is_idle());
    }

    #[test]
    fn chunked_body_with_lost_framing_ends_on_tail_marker() {
        let mut f = Framer::new();
        let head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n";
        // 2 known chunk bytes, then 50000 bytes not captured whose last bytes are the last chunk.
        let first = Chunk { known: head, total: head.len() as u64 + 50000, tail: b"xx\r\n0\r\n\r\n" };
        let steps = run(&mut f, &[first], BodyFraming::Chunked);
        assert_eq!(steps, vec![Step::Head, Step::MessageEnd]);
    }

    #[test]
    fn lost_chunked_marker_split_across_calls_and_bytes_after_it_kept() {
        let head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n";
        // The framing is lost in the second call; the marker is split between calls 3 and 4.
        for split in 1..LOST_MARKER.len() {
            let mut f = Framer::new();
            let lost = Chunk { known: b"", total: 5000, tail: b"" };
            let mut third = b"ccccccccccccccccccccc".to_vec();
            third.extend_from_slice(&LOST_MARKER[..split]);
            let mut fourth = LOST_MARKER[split..].to_vec();
            fourth.extend_from_slice(b"HTTP/1.1 204 No Content\r\n\r\n");
            let steps = run(
                &mut f,
                &[Chunk::complete(head), lost, Chunk::complete(&third), Chunk::complete(&fourth)],
                BodyFraming::Chunked,
            );
            assert_eq!(steps, vec![Step::Head, Step::MessageEnd, Step::Head], "split at {split}");
        }
        // A call cut by the window whose tail ends part way into the marker.
        let mut f = Framer::new();
        let cut = Chunk { known: b"zz", total: 9000, tail: b"xxxxxxxxxxxxx\r\n0" };
        let steps = run(
            &mut f,
            &[Chunk::complete(head), Chunk { known: b"", total: 10, tail: b"" }, cut, Chunk::complete(b"\r\n\r\n")],
            BodyFraming::Chunked,
        );
        assert_eq!(steps, vec![Step::Head, Step::MessageEnd]);
        assert!(f.is_idle());
    }

    #[test]
    fn head_cut_by_uncaptured_bytes_keeps_its_complete_lines() {
        let mut f = Framer::new();
        let chunk = Chunk { known: b"GET /x HTTP/1.1\r\nHost: a\r\nCookie: aaaa", total: 9000, tail: b"" };
        let mut cursor = Cursor::new(chunk);
        assert_eq!(f.step(&mut cursor), Step::Head);
        assert!(f.head_truncated());
        assert_eq!(f.head_bytes(), b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n");
        assert!(cursor.is_empty(), "the rest of the syscall is taken as the rest of the head");
        f.set_body(BodyFraming::Empty);
        assert!(f.is_idle());
        let mut next = Cursor::new(Chunk::complete(b"GET /y HTTP/1.1\r\n\r\n"));
        assert_eq!(f.step(&mut next), Step::Head);
        assert!(!f.head_truncated());
    }

    #[test]
    fn head_without_a_complete_start_line_is_an_error() {
        let mut f = Framer::new();
        let chunk = Chunk { known: b"GET /very-long-url", total: 9000, tail: b"" };
        let steps = run(&mut f, &[chunk], BodyFraming::Empty);
        assert_eq!(steps, vec![Step::Error(FramingError::HeadTruncated)]);
        assert!(f.is_desynced());
    }

    #[test]
    fn garbage_is_rejected_at_once() {
        let mut f = Framer::new();
        let steps = run(&mut f, &[Chunk::complete(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])], BodyFraming::Empty);
        assert_eq!(steps, vec![Step::Error(FramingError::BadHead)]);
    }

    #[test]
    fn until_close_ends_on_finish() {
        let mut f = Framer::new();
        let steps = run(&mut f, &[Chunk::complete(b"HTTP/1.0 200 OK\r\n\r\nbody")], BodyFraming::UntilClose);
        assert_eq!(steps, vec![Step::Head]);
        assert!(f.finish());
    }
}

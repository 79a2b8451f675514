//! Stepping through a message body once its head is framed: counted by length, parsed chunk by
//! chunk, or followed to the last-chunk marker when the capture window hid a chunk-size line
//! (see the parent module's notes).

use super::{BodyState, ChunkPart, Cursor, Framer, FramingError, LAST_CHUNK, LOST_MARKER, MAX_CHUNK_LINE, State, Step};

impl Framer {
    pub(super) fn step_body(&mut self, body: BodyState, cursor: &mut Cursor<'_>) -> Step {
        match body {
            BodyState::Length(left) => {
                let n = left.min(cursor.remaining());
                cursor.skip(n);
                if n == left {
                    self.state = State::Head;
                    Step::MessageEnd
                } else {
                    self.state = State::Body(BodyState::Length(left - n));
                    Step::NeedMore
                }
            }
            BodyState::UntilClose => {
                cursor.skip_all();
                Step::NeedMore
            }
            BodyState::ChunkedLost => self.step_chunked_lost(cursor),
            BodyState::Chunked(part) => self.step_chunked(part, cursor),
        }
    }

    /// Looks for the end of a chunked body whose framing was lost (see the module notes).
    pub(super) fn step_chunked_lost(&mut self, cursor: &mut Cursor<'_>) -> Step {
        let chunk = cursor.chunk;
        let known = cursor.known();
        let fully_known = chunk.total == chunk.known.len() as u64;
        let done = |framer: &mut Self| {
            framer.state = State::Head;
            framer.recent_len = 0;
            Step::MessageEnd
        };
        // Split between the end of the previous call and the start of this one.
        let n = usize::from(self.recent_len);
        let mut joined = [0u8; 2 * LOST_MARKER.len()];
        joined[..n].copy_from_slice(&self.recent[..n]);
        let m = known.len().min(LOST_MARKER.len());
        joined[n..n + m].copy_from_slice(&known[..m]);
        if let Some(at) = memchr::memmem::find(&joined[..n + m], LOST_MARKER)
            && at + LOST_MARKER.len() > n
        {
            cursor.skip((at + LOST_MARKER.len() - n) as u64);
            return done(self);
        }
        if let Some(at) = memchr::memmem::find(known, LOST_MARKER) {
            // Inside the known bytes: what follows is the next message (pipelined).
            cursor.skip((at + LOST_MARKER.len()) as u64);
            return done(self);
        }
        if !fully_known && chunk.tail.ends_with(LAST_CHUNK) {
            cursor.skip_all();
            return done(self);
        }
        let end: &[u8] = if fully_known { known } else { chunk.tail };
        let keep = end.len().min(LOST_MARKER.len());
        if fully_known && known.len() < LOST_MARKER.len() {
            // A short call: append to what we had.
            let mut merged = [0u8; 2 * LOST_MARKER.len()];
            merged[..n].copy_from_slice(&self.recent[..n]);
            merged[n..n + known.len()].copy_from_slice(known);
            let total = n + known.len();
            let from = total.saturating_sub(LOST_MARKER.len());
            let len = total - from;
            self.recent[..len].copy_from_slice(&merged[from..total]);
            self.recent_len = len as u8;
        } else {
            self.recent[..keep].copy_from_slice(&end[end.len() - keep..]);
            self.recent_len = keep as u8;
        }
        cursor.skip_all();
        Step::NeedMore
    }

    pub(super) fn step_chunked(&mut self, mut part: ChunkPart, cursor: &mut Cursor<'_>) -> Step {
        loop {
            if cursor.is_empty() {
                self.state = State::Body(BodyState::Chunked(part));
                return Step::NeedMore;
            }
            let known = cursor.known();
            if known.is_empty() && !matches!(part, ChunkPart::Data(_)) {
                // Framing bytes were not captured: fall back to watching for the last chunk.
                self.buf.clear();
                self.recent_len = 0;
                self.state = State::Body(BodyState::ChunkedLost);
                return self.step_body(BodyState::ChunkedLost, cursor);
            }
            part = match part {
                ChunkPart::Data(left) => {
                    let n = left.min(cursor.remaining());
                    cursor.skip(n);
                    if n == left { ChunkPart::DataCrlf(0) } else { ChunkPart::Data(left - n) }
                }
                ChunkPart::DataCrlf(seen) => {
                    let want: &[u8] = if seen == 0 { b"\r\n" } else { b"\n" };
                    let n = want.len().min(known.len());
                    if known[..n] != want[..n] {
                        return self.fail(FramingError::BadChunk, cursor);
                    }
                    cursor.skip(n as u64);
                    if seen as usize + n == 2 { ChunkPart::SizeLine } else { ChunkPart::DataCrlf(1) }
                }
                ChunkPart::SizeLine | ChunkPart::Trailers => {
                    let Some(line_end) = memchr::memchr(b'\n', known) else {
                        if self.buf.len() + known.len() > MAX_CHUNK_LINE {
                            return self.fail(FramingError::BadChunk, cursor);
                        }
                        self.buf.extend_from_slice(known);
                        cursor.skip(known.len() as u64);
                        continue;
                    };
                    self.buf.extend_from_slice(&known[..line_end]);
                    cursor.skip(line_end as u64 + 1);
                    // `None`: the message ended; `Some(None)`: a bad size line.
                    let next = if part == ChunkPart::Trailers {
                        let line = self.buf.strip_suffix(b"\r").unwrap_or(&self.buf);
                        (!line.is_empty()).then_some(Some(ChunkPart::Trailers))
                    } else {
                        Some(match parse_chunk_size(&mut self.buf) {
                            Some(0) => Some(ChunkPart::Trailers),
                            Some(size) => Some(ChunkPart::Data(size)),
                            None => None,
                        })
                    };
                    // Cleared, not replaced: the buffer keeps its capacity for the next line.
                    self.buf.clear();
                    match next {
                        None => {
                            self.state = State::Head;
                            return Step::MessageEnd;
                        }
                        Some(None) => return self.fail(FramingError::BadChunk, cursor),
                        Some(Some(next)) => next,
                    }
                }
            };
        }
    }
}

/// Most hex digits of a chunk size read (a chunk of up to 2^60 bytes).
const MAX_CHUNK_SIZE_DIGITS: usize = 15;

/// The size a chunk-size line announces, read by `httparse`. `line` holds the line up to its
/// `\n` (a `\r` before it or not: a bare line feed ends a line here as elsewhere in the framer);
/// it is completed with the CRLF `httparse` wants. Refused before `httparse` reads it: a line that
/// does not start with a hex digit (`httparse` would read an empty one as the last chunk), and a
/// size of more than 15 hex digits (`httparse` takes 16, a chunk of up to 2^64 bytes that would
/// hold the framer until the connection closes; no sender writes one).
fn parse_chunk_size(line: &mut Vec<u8>) -> Option<u64> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 || digits > MAX_CHUNK_SIZE_DIGITS {
        return None;
    }
    if !line.ends_with(b"\r") {
        line.push(b'\r');
    }
    line.push(b'\n');
    match httparse::parse_chunk_size(line) {
        Ok(httparse::Status::Complete((_, size))) => Some(size),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_size_rejects_garbage() {
        let size = |line: &[u8]| parse_chunk_size(&mut line.to_vec());
        assert_eq!(size(b"1a"), Some(26));
        assert_eq!(size(b"1a\r"), Some(26));
        assert_eq!(size(b"1A;x=y"), Some(26));
        assert_eq!(size(b"1a ;x=y\r"), Some(26));
        assert_eq!(size(b"0"), Some(0));
        assert_eq!(size(b""), None);
        assert_eq!(size(b"\r"), None);
        assert_eq!(size(b";x"), None);
        assert_eq!(size(b"zz"), None);
        assert_eq!(size(b"1a zz"), None);
        assert_eq!(size(b"1\r2"), None);
        assert_eq!(size(b"fffffffffffffff"), Some(0x0fff_ffff_ffff_ffff), "15 digits");
        assert_eq!(size(b"ffffffffffffffff"), None, "16 digits: no sender writes such a chunk");
        assert_eq!(size(b"fffffffffffffffff"), None, "17 digits overflow");
    }
}

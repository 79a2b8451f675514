//! A frontend request dropped at its head, decided in the probes: the one definition of the
//! sampling threshold both sides compare with, and the scan of a request head for its
//! `traceparent` that the probes run before they copy a frontend read to the ring.
//!
//! The probes' decision is a strict subset of the agent's (`tracetap_proxy::sampled_out`):
//! whenever [`HeadScan`] drops a head, the agent, given the same bytes, would have parsed them as
//! one whole request head without a body and dropped it at its head by its own context, the same
//! one. The scan therefore accepts only a plain grammar (upper-case method of at most 8 letters,
//! not `HEAD` or `CONNECT`; an origin-form target; `HTTP/1.0` or `HTTP/1.1`; CRLF line ends;
//! header names of letters, digits, `-`, `_` and `.`; values of visible ASCII, space and tab),
//! exactly one valid version-00 `traceparent`, no `Content-Length` or `Transfer-Encoding`, and
//! the head ending exactly where the read ends. Anything else goes to the agent whole, which
//! decides as it always did. A property test in the proxy crate holds the two to this.
//!
//! That holds for a read at a message start: the agent checks that it is one before it takes a
//! dropped head as a request (a read in the middle of a message is that message's bytes to it).
//!
//! The code is written for the probes' verifier as much as for the agent: no indexing, no
//! panics, plain integers for the state; 8 bytes at a time through [`HeadScan::feed_word`], which
//! takes a word of plain header value bytes, or of 8 hex digits inside one id of the
//! `traceparent`, at once, and steps through the others a byte at a time.

#![expect(
    clippy::inline_always,
    reason = "the probes build this code too, where every helper is inlined on purpose (see ebpf/probes/src/main.rs)"
)]

/// `DROP_RULE` global: the probes drop no request at its head (`always_on`, or a ratio of 1).
pub const RULE_NONE: u32 = 0;
/// `DROP_RULE` global: a request whose valid `traceparent` is not sampled is dropped (the
/// parent-based samplers).
pub const RULE_UNSAMPLED_PARENT: u32 = 1;
/// `DROP_RULE` global: a request whose valid `traceparent`'s trace id has a randomness below
/// `DROP_THRESHOLD` is dropped, unless it carries a `tracestate` (whose `ot=rv:` would decide
/// instead): `traceidratio` below 1 (`always_off` loads no probe at all).
pub const RULE_TRACE_ID_BELOW: u32 = 2;

/// The randomness of a trace id as W3C Trace Context level 2 defines it: its lowest 56 bits
/// (`trace_id_low` is the trace id's last 8 bytes, big endian).
#[inline(always)]
#[must_use]
pub const fn trace_id_randomness(trace_id_low: u64) -> u64 {
    trace_id_low & ((1 << 56) - 1)
}

/// Whether a trace of this randomness is dropped under this 56-bit rejection threshold: the one
/// comparison every sampling decision of the agent and the probes makes.
#[inline(always)]
#[must_use]
pub const fn randomness_drops(randomness: u64, threshold: u64) -> bool {
    randomness < threshold
}

/// Largest read the probes scan: reads up to this size are staged anyway, and a request head
/// with a `traceparent` longer than this is rare.
pub const MAX_SCANNED_BYTES: u32 = 512;
/// Bytes of `EventHeader::addr` a [`crate::EventKind::DroppedRequest`] record fills with its
/// context (trace id, parent id, flags).
pub const DROPPED_CONTEXT_BYTES: u32 = 16 + 8 + 1;

/// The context of a request dropped at its head, as the probes found it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DroppedContext {
    pub trace_id: [u8; 16],
    pub parent_id: [u8; 8],
    pub flags: u8,
}

impl DroppedContext {
    /// The record's `addr` field for this context (see [`DROPPED_CONTEXT_BYTES`]).
    #[must_use]
    pub fn to_addr(&self) -> [u8; crate::SOCKADDR_BYTES] {
        let mut addr = [0; crate::SOCKADDR_BYTES];
        let (trace, rest) = addr.split_at_mut(16);
        trace.copy_from_slice(&self.trace_id);
        let (parent, rest) = rest.split_at_mut(8);
        parent.copy_from_slice(&self.parent_id);
        if let Some(flags) = rest.first_mut() {
            *flags = self.flags;
        }
        addr
    }

    /// The context a record's `addr` field holds.
    #[must_use]
    pub fn from_addr(addr: &[u8; crate::SOCKADDR_BYTES]) -> Self {
        let mut context = Self::default();
        let (trace, rest) = addr.split_at(16);
        context.trace_id.copy_from_slice(trace);
        let (parent, rest) = rest.split_at(8);
        context.parent_id.copy_from_slice(parent);
        context.flags = rest.first().copied().unwrap_or(0);
        context
    }
}

// Scanner states.
const METHOD: u32 = 0;
const TARGET_START: u32 = 1;
const TARGET: u32 = 2;
const VERSION: u32 = 3;
const EXPECT_LF: u32 = 4;
const LINE_START: u32 = 5;
const NAME: u32 = 6;
const VALUE: u32 = 7;
const TRACEPARENT_LEAD: u32 = 8;
const TRACEPARENT: u32 = 9;
const TRACEPARENT_TRAIL: u32 = 10;
const END_LF: u32 = 11;
const DONE: u32 = 12;
const FAILED: u32 = 13;

/// Header lines a scanned head may have (the agent parses up to 128).
const MAX_LINES: u32 = 64;
/// Bytes of a method the scan accepts (`OPTIONS` and `CONNECT` are 7).
const MAX_METHOD: u32 = 8;
/// Length of a version-00 `traceparent` value.
const TRACEPARENT_LEN: u32 = 55;

/// `bytes` packed little endian, as the scan packs what it reads (first byte lowest).
const fn pack(bytes: &[u8]) -> u64 {
    let mut word = 0u64;
    let mut i = bytes.len();
    while i > 0 {
        i -= 1;
        word = (word << 8) | bytes[i] as u64;
    }
    word
}

/// Methods are packed the other way (first byte highest), as they are read.
const fn pack_method(bytes: &[u8]) -> u64 {
    let mut word = 0u64;
    let mut i = 0;
    while i < bytes.len() {
        word = (word << 8) | bytes[i] as u64;
        i += 1;
    }
    word
}

const HEAD: u64 = pack_method(b"HEAD");
const CONNECT: u64 = pack_method(b"CONNECT");
const HTTP_1: u64 = pack(b"HTTP/1.");

/// A set of ASCII bytes as a 128-bit map (two words).
#[derive(Clone, Copy)]
struct ByteSet(u64, u64);

impl ByteSet {
    const fn with(mut self, b: u8) -> Self {
        if b < 64 {
            self.0 |= 1 << b;
        } else {
            self.1 |= 1 << (b - 64);
        }
        self
    }

    const fn of(bytes: &[u8]) -> Self {
        let mut set = Self(0, 0);
        let mut i = 0;
        while i < bytes.len() {
            set = set.with(bytes[i]);
            i += 1;
        }
        set
    }

    const fn range(mut self, from: u8, to: u8) -> Self {
        let mut b = from;
        while b <= to {
            self = self.with(b);
            b += 1;
        }
        self
    }

    #[inline(always)]
    const fn has(self, b: u8) -> bool {
        if b < 64 {
            (self.0 >> b) & 1 != 0
        } else if b < 128 {
            (self.1 >> (b - 64)) & 1 != 0
        } else {
            false
        }
    }
}

/// Every byte of `word` is in `0x20..=0x7e` (the "hasless" and "hasmore" tests of Sean Anderson's
/// bit twiddling hacks, exact for whether any byte is outside).
#[inline(always)]
const fn all_visible_or_space(word: u64) -> bool {
    const ONES: u64 = u64::MAX / 255;
    const HIGH: u64 = ONES * 0x80;
    let below_space = word.wrapping_sub(ONES * 0x20) & !word & HIGH;
    // Adding 0x7f - 0x7e to each byte sets its high bit exactly when it was above 0x7e.
    let above_tilde = (word.wrapping_add(ONES) | word) & HIGH;
    below_space | above_tilde == 0
}

/// The value of 8 lower-case hex digits, `word` little endian (the first digit lowest), or `None`
/// when a byte is not one: every byte tested at once, then the nibbles gathered in three steps.
#[inline(always)]
fn hex_digits(word: u64) -> Option<u32> {
    const ONES: u64 = u64::MAX / 255;
    const HIGH: u64 = ONES * 0x80;
    // For bytes below 0x80, the high bit of `(byte | 0x80) - c` says `byte >= c` (no borrow
    // crosses into the next byte).
    let at_least = |c: u64| ((word | HIGH).wrapping_sub(ONES * c)) & HIGH;
    let digit = at_least(0x30) & !at_least(0x3a);
    let letter = at_least(0x61) & !at_least(0x67);
    if word & HIGH != 0 || (digit | letter) != HIGH {
        return None;
    }
    // `0`-`9` are 0x30-0x39 and `a`-`f` 0x61-0x66: the low nibble, plus 9 for letters (bit 6).
    let nibbles = (word & (ONES * 0x0f)) + ((word >> 6) & ONES) * 9;
    // The first digit most significant: bytes reversed, then pairs, quads and halves joined.
    let n = nibbles.swap_bytes();
    let n = ((n >> 4) | n) & 0x00ff_00ff_00ff_00ff;
    let n = ((n >> 8) | n) & 0x0000_ffff_0000_ffff;
    let n = ((n >> 16) | n) & 0xffff_ffff;
    Some(n as u32)
}

/// Header name bytes the scan accepts (all of them are `tchar`s).
const NAME_BYTES: ByteSet = ByteSet::of(b"-_.").range(b'0', b'9').range(b'A', b'Z').range(b'a', b'z');
/// Target bytes the scan accepts: RFC 3986's unreserved, sub-delims, `:`, `@`, `/`, `?`, `%`.
const TARGET_BYTES: ByteSet =
    ByteSet::of(b"-._~!$&'()*+,;=:@/?%").range(b'0', b'9').range(b'A', b'Z').range(b'a', b'z');

/// Header names the scan tells apart, packed lower case: the first 8 bytes and the next 8.
const TRACEPARENT_NAME: (u64, u64) = (pack(b"tracepar"), pack(b"ent"));
const TRACESTATE_NAME: (u64, u64) = (pack(b"tracesta"), pack(b"te"));
const CONTENT_LENGTH_NAME: (u64, u64) = (pack(b"content-"), pack(b"length"));
/// `transfer-encoding` is 17 bytes: a name whose first 16 are these is taken for it.
const TRANSFER_ENCODING_START: (u64, u64) = (pack(b"transfer"), pack(b"-encodin"));

/// A cheap look before the scan: whether some line of a read may start with `t` or `T`, as a
/// `traceparent` line must (the scan takes a header name only right after a line feed). A read in
/// which no line feed is followed by either is no head the scan drops, whatever its other bytes:
/// the probes send it as it is without scanning it, which spares most requests without a
/// `traceparent` the scan's cost. Fed the read's words in order ([`LineStarts::feed_word`]);
/// bytes past the read's end may only add a false "maybe".
#[derive(Clone, Copy, Debug, Default)]
pub struct LineStarts {
    /// The high bit of the last byte of the word before, when it was a line feed.
    carry: u64,
    maybe: bool,
}

impl LineStarts {
    /// Reads the next 8 bytes, little endian (the first byte lowest).
    #[inline(always)]
    pub const fn feed_word(&mut self, word: u64) {
        const ONES: u64 = u64::MAX / 255;
        const HIGH: u64 = ONES * 0x80;
        // The high bit of each byte equal to `c` (below 0x80): exact for every byte, as
        // `(byte | 0x80) - c` never borrows.
        const fn equal(word: u64, c: u64) -> u64 {
            let at_least_c = (word | HIGH).wrapping_sub(ONES * c) & HIGH;
            let above_c = (word | HIGH).wrapping_sub(ONES * (c + 1)) & HIGH;
            at_least_c & !above_c & !word
        }
        let line_feeds = equal(word, b'\n' as u64);
        let t = equal(word | (ONES * 0x20), b't' as u64);
        // A line feed's flag moved onto the byte after it, the last one's onto the next word.
        self.maybe |= ((line_feeds << 8) | self.carry) & t != 0;
        self.carry = line_feeds >> 56;
    }

    /// Whether a line may start with `t` or `T`: the read must be scanned.
    #[inline(always)]
    #[must_use]
    pub const fn maybe(&self) -> bool {
        self.maybe
    }

    /// [`LineStarts::maybe`] over `bytes` whole (the tests' way).
    #[must_use]
    pub fn of(bytes: &[u8]) -> bool {
        let mut starts = Self::default();
        for chunk in bytes.chunks(8) {
            let mut word = [0; 8];
            if let Some(start) = word.get_mut(..chunk.len()) {
                start.copy_from_slice(chunk);
            }
            starts.feed_word(u64::from_le_bytes(word));
        }
        starts.maybe()
    }
}

/// The scan of one read's bytes, a byte at a time ([`HeadScan::step`]), then [`HeadScan::dropped`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HeadScan {
    state: u32,
    /// Bytes into the current method, name, version or `traceparent` value.
    pos: u32,
    lines: u32,
    traceparents: u32,
    tracestates: u32,
    trace_flags: u32,
    method: u64,
    name_low: u64,
    name_high: u64,
    trace_high: u64,
    trace_low: u64,
    parent: u64,
}

impl HeadScan {
    /// True once the bytes cannot be a head the probes drop: the rest need not be read.
    #[inline(always)]
    #[must_use]
    pub const fn failed(&self) -> bool {
        self.state == FAILED
    }

    /// Reads the next 8 bytes, `word` little endian (the first byte lowest), of which only the
    /// first `valid` are the read's. Two kinds of whole word are taken at once: plain value bytes
    /// (visible ASCII and space: no line end) inside a header value, which is most of a head, and
    /// 8 lower-case hex digits inside one id of the `traceparent`.
    #[inline(always)]
    pub fn feed_word(&mut self, word: u64, valid: u64) {
        if valid >= 8 && self.state == VALUE && all_visible_or_space(word) {
            return;
        }
        if valid >= 8 && self.state == TRACEPARENT && self.hex_word(word) {
            return;
        }
        let mut k = 0;
        while k < 8 {
            if k < valid {
                self.step((word >> (8 * k)) as u8);
            }
            k += 1;
        }
    }

    /// Reads the next byte.
    #[inline(always)]
    pub fn step(&mut self, b: u8) {
        self.state = match self.state {
            METHOD => self.method_byte(b),
            TARGET_START if b == b'/' => TARGET,
            TARGET if TARGET_BYTES.has(b) => TARGET,
            TARGET if b == b' ' => {
                self.pos = 0;
                VERSION
            }
            VERSION => self.version_byte(b),
            EXPECT_LF if b == b'\n' => LINE_START,
            LINE_START if b == b'\r' => END_LF,
            LINE_START if NAME_BYTES.has(b) && self.lines < MAX_LINES => {
                self.lines += 1;
                self.name_low = 0;
                self.name_high = 0;
                self.pos = 0;
                self.name_byte(b);
                NAME
            }
            NAME if NAME_BYTES.has(b) => {
                self.name_byte(b);
                NAME
            }
            NAME if b == b':' => self.name_end(),
            VALUE if b == b'\r' => EXPECT_LF,
            VALUE if b == b'\t' || (b' '..=b'~').contains(&b) => VALUE,
            TRACEPARENT_LEAD if b == b' ' || b == b'\t' => TRACEPARENT_LEAD,
            TRACEPARENT_LEAD | TRACEPARENT => self.traceparent_byte(b),
            TRACEPARENT_TRAIL if b == b' ' || b == b'\t' => TRACEPARENT_TRAIL,
            TRACEPARENT_TRAIL if b == b'\r' => EXPECT_LF,
            END_LF if b == b'\n' => DONE,
            _ => FAILED,
        };
    }

    #[inline(always)]
    fn method_byte(&mut self, b: u8) -> u32 {
        if b.is_ascii_uppercase() && self.pos < MAX_METHOD {
            self.method = (self.method << 8) | u64::from(b);
            self.pos += 1;
            METHOD
        } else if b == b' ' && self.pos > 0 && self.method != HEAD && self.method != CONNECT {
            TARGET_START
        } else {
            FAILED
        }
    }

    #[inline(always)]
    fn version_byte(&mut self, b: u8) -> u32 {
        let pos = self.pos;
        self.pos += 1;
        let fits = match pos {
            0..=6 => (HTTP_1 >> (8 * pos)) & 0xff == u64::from(b),
            7 => b == b'0' || b == b'1',
            8 => return if b == b'\r' { EXPECT_LF } else { FAILED },
            _ => false,
        };
        if fits { VERSION } else { FAILED }
    }

    #[inline(always)]
    fn name_byte(&mut self, b: u8) {
        let lower = u64::from(if b.is_ascii_uppercase() { b | 0x20 } else { b });
        let pos = self.pos;
        if pos < 8 {
            self.name_low |= lower << (8 * pos);
        } else if pos < 16 {
            self.name_high |= lower << (8 * (pos - 8));
        }
        self.pos = pos + 1;
    }

    #[inline(always)]
    fn name_end(&mut self) -> u32 {
        let name = (self.name_low, self.name_high);
        let len = self.pos;
        self.pos = 0;
        if (len == 14 && name == CONTENT_LENGTH_NAME) || (len >= 16 && name == TRANSFER_ENCODING_START) {
            // A body follows, or may: not for the probes.
            return FAILED;
        }
        if len == 11 && name == TRACEPARENT_NAME {
            if self.traceparents > 0 {
                return FAILED;
            }
            self.traceparents = 1;
            return TRACEPARENT_LEAD;
        }
        if len == 10 && name == TRACESTATE_NAME {
            self.tracestates += 1;
        }
        VALUE
    }

    /// Takes 8 hex digits of the `traceparent` at once when they all lie in one id (of the trace
    /// id's two halves, or the parent id) and all are lower-case hex; false otherwise.
    #[inline(always)]
    fn hex_word(&mut self, word: u64) -> bool {
        let pos = self.pos;
        let in_one_id = (3..=11).contains(&pos) || (19..=27).contains(&pos) || (36..=44).contains(&pos);
        if !in_one_id {
            return false;
        }
        let Some(digits) = hex_digits(word) else { return false };
        let digits = u64::from(digits);
        if pos < 19 {
            self.trace_high = (self.trace_high << 32) | digits;
        } else if pos < 35 {
            self.trace_low = (self.trace_low << 32) | digits;
        } else {
            self.parent = (self.parent << 32) | digits;
        }
        self.pos = pos + 8;
        true
    }

    #[inline(always)]
    fn traceparent_byte(&mut self, b: u8) -> u32 {
        let pos = self.pos;
        if pos == TRACEPARENT_LEN {
            return match b {
                b' ' | b'\t' => TRACEPARENT_TRAIL,
                b'\r' => EXPECT_LF,
                _ => FAILED,
            };
        }
        self.pos = pos + 1;
        let fits = match pos {
            0 | 1 => b == b'0',
            2 | 35 | 52 => b == b'-',
            _ => {
                let nibble = u64::from(match b {
                    b'0'..=b'9' => b - b'0',
                    b'a'..=b'f' => b - b'a' + 10,
                    _ => return FAILED,
                });
                match pos {
                    3..=18 => self.trace_high = (self.trace_high << 4) | nibble,
                    19..=34 => self.trace_low = (self.trace_low << 4) | nibble,
                    36..=51 => self.parent = (self.parent << 4) | nibble,
                    _ => self.trace_flags = (self.trace_flags << 4) | nibble as u32,
                }
                true
            }
        };
        if fits { TRACEPARENT } else { FAILED }
    }

    /// After the read's last byte: the context of a head this rule drops (see the module notes),
    /// or `None` (the agent decides from the bytes).
    #[inline(always)]
    #[must_use]
    pub fn dropped(&self, rule: u32, threshold: u64) -> Option<DroppedContext> {
        if self.state != DONE || self.traceparents != 1 || self.parent == 0 || (self.trace_high | self.trace_low) == 0 {
            return None;
        }
        let drops = match rule {
            RULE_UNSAMPLED_PARENT => self.trace_flags & 1 == 0,
            RULE_TRACE_ID_BELOW => {
                self.tracestates == 0 && randomness_drops(trace_id_randomness(self.trace_low), threshold)
            }
            _ => false,
        };
        if !drops {
            return None;
        }
        let mut trace_id = [0; 16];
        let (high, low) = trace_id.split_at_mut(8);
        high.copy_from_slice(&self.trace_high.to_be_bytes());
        low.copy_from_slice(&self.trace_low.to_be_bytes());
        Some(DroppedContext { trace_id, parent_id: self.parent.to_be_bytes(), flags: self.trace_flags as u8 })
    }

    /// Scans `bytes` whole (the agent's and the tests' way; the probes step through a word at a
    /// time) and says whether this rule drops them.
    #[must_use]
    pub fn scan(bytes: &[u8], rule: u32, threshold: u64) -> Option<DroppedContext> {
        if bytes.len() > MAX_SCANNED_BYTES as usize {
            return None;
        }
        let mut scan = Self::default();
        for chunk in bytes.chunks(8) {
            let mut word = [0; 8];
            if let Some(start) = word.get_mut(..chunk.len()) {
                start.copy_from_slice(chunk);
            }
            scan.feed_word(u64::from_le_bytes(word), chunk.len() as u64);
        }
        scan.dropped(rule, threshold)
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::prelude::rust_2024::*;

    use super::*;

    const SAMPLED: &[u8] = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    const UNSAMPLED: &[u8] = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";

    fn head(lines: &[&[u8]]) -> Vec<u8> {
        let mut out = b"GET /a?b=c HTTP/1.1\r\n".to_vec();
        for line in lines {
            out.extend_from_slice(line);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out
    }

    fn traceparent(value: &[u8]) -> Vec<u8> {
        [b"traceparent: ".as_slice(), value].concat()
    }

    #[test]
    fn a_word_is_taken_at_once_exactly_when_all_its_bytes_are_visible_or_space() {
        for b in 0..=255u8 {
            for at in 0..8 {
                let mut bytes = *b"abc ~xyz";
                bytes[at] = b;
                let plain = bytes.iter().all(|b| (0x20..=0x7e).contains(b));
                assert_eq!(all_visible_or_space(u64::from_le_bytes(bytes)), plain, "{bytes:?}");
            }
        }
    }

    #[test]
    fn eight_hex_digits_are_read_at_once_exactly_as_one_at_a_time() {
        let digits = *b"0af76519";
        assert_eq!(hex_digits(u64::from_le_bytes(digits)), Some(0x0af7_6519));
        assert_eq!(hex_digits(u64::from_le_bytes(*b"fedcba98")), Some(0xfedc_ba98));
        for b in 0..=255u8 {
            for at in 0..8 {
                let mut bytes = digits;
                bytes[at] = b;
                let one_at_a_time = core::str::from_utf8(&bytes)
                    .ok()
                    .filter(|s| s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
                    .and_then(|s| u32::from_str_radix(s, 16).ok());
                assert_eq!(hex_digits(u64::from_le_bytes(bytes)), one_at_a_time, "{bytes:?}");
            }
        }
    }

    #[test]
    fn a_line_starting_with_t_is_seen_wherever_it_falls() {
        let plain = head(&[b"Host: x", b"Accept: */*"]);
        assert!(!LineStarts::of(&plain));
        // A header line of every length before it puts the line feed at every place in a word.
        for pad in 0..16 {
            let line = [vec![b'a'; pad], b"x: y".to_vec()].concat();
            let padded = head(&[&line, &traceparent(UNSAMPLED)]);
            assert!(LineStarts::of(&padded), "{}", String::from_utf8_lossy(&padded));
            let upper = head(&[&line, b"TE: trailers"]);
            assert!(LineStarts::of(&upper), "{}", String::from_utf8_lossy(&upper));
        }
        for b in 0..=255u8 {
            let bytes = [b'\n', b, b'\n', b'a', b'\r', b'\n', b'x', b'\n', b];
            assert_eq!(LineStarts::of(&bytes), b == b't' || b == b'T', "{bytes:?}");
        }
    }

    #[test]
    fn the_w3c_example_unsampled_is_dropped_with_its_context() {
        let bytes = head(&[b"Host: x", &traceparent(UNSAMPLED), b"Accept: */*"]);
        let context = HeadScan::scan(&bytes, RULE_UNSAMPLED_PARENT, 0).expect("dropped");
        assert_eq!(context.trace_id, 0x0af7_6519_16cd_43dd_8448_eb21_1c80_319c_u128.to_be_bytes());
        assert_eq!(context.parent_id, 0xb7ad_6b71_6920_3331_u64.to_be_bytes());
        assert_eq!(context.flags, 0);
        assert_eq!(DroppedContext::from_addr(&context.to_addr()), context);
        assert_eq!(HeadScan::scan(&head(&[&traceparent(SAMPLED)]), RULE_UNSAMPLED_PARENT, 0), None);
        assert_eq!(HeadScan::scan(&bytes, RULE_NONE, 0), None);
    }

    #[test]
    fn a_ratio_drops_by_the_trace_ids_low_56_bits_unless_a_tracestate_may_say_otherwise() {
        let bytes = head(&[&traceparent(SAMPLED)]);
        let randomness = 0x0048_eb21_1c80_319c;
        assert_eq!(HeadScan::scan(&bytes, RULE_TRACE_ID_BELOW, randomness), None);
        assert!(HeadScan::scan(&bytes, RULE_TRACE_ID_BELOW, randomness + 1).is_some());
        let with_state = head(&[&traceparent(SAMPLED), b"tracestate: ot=rv:ffffffffffffff"]);
        assert_eq!(HeadScan::scan(&with_state, RULE_TRACE_ID_BELOW, 1 << 56), None);
    }

    #[test]
    fn anything_but_one_plain_bodiless_head_is_left_to_the_agent() {
        let tp = traceparent(UNSAMPLED);
        let drops = |bytes: &[u8]| HeadScan::scan(bytes, RULE_UNSAMPLED_PARENT, 0).is_some();
        assert!(drops(&head(&[&tp])));
        assert!(drops(&head(&[b"TraceParent:\t  00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00 "])));
        let cases: &[Vec<u8>] = &[
            head(&[&tp, &tp]),
            head(&[&tp, b"Content-Length: 0"]),
            head(&[&tp, b"transfer-encoding: chunked"]),
            head(&[b"Transfer-Encodingx: chunked", &tp]),
            head(&[&traceparent(b"00-00000000000000000000000000000000-b7ad6b7169203331-00")]),
            head(&[&traceparent(b"00-0af7651916cd43dd8448eb211c80319c-0000000000000000-00")]),
            head(&[&traceparent(b"00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-00")]),
            head(&[&traceparent(b"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00")]),
            head(&[&traceparent(b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00-")]),
            head(&[b"traceparent : 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"]),
            head(&[&tp, b" folded"]),
            head(&[&tp, b"x: \x01"]),
            head(&[&tp, b"x: caf\xc3\xa9"]),
            [head(&[&tp]), b"GET / HTTP/1.1\r\n\r\n".to_vec()].concat(),
            head(&[&tp])[..40].to_vec(),
            [b"HEAD".as_slice(), &head(&[&tp])[3..]].concat(),
            [b"CONNECT".as_slice(), &head(&[&tp])[3..]].concat(),
            [b"get".as_slice(), &head(&[&tp])[3..]].concat(),
            head(&[&tp]).iter().copied().filter(|b| *b != b'\r').collect(),
        ];
        for case in cases {
            assert!(!drops(case), "{}", String::from_utf8_lossy(case));
        }
    }
}

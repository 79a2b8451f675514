//! A frontend request dropped at its head, decided in the probes: the one definition of the
//! sampling threshold both sides compare with, and the scan of a request head for its
//! `traceparent` that the probes run before they copy a frontend read to the ring.
//!
//! The probes' decision is a strict subset of the agent's (`tracetap_proxy::sampled_out`):
//! whenever [`HeadScan`] drops a head, the agent, given the same bytes, would have parsed them as
//! one whole request head without a body and dropped it at its head by its own context, the same
//! one. The scan therefore accepts only a plain grammar (upper-case method of at most 8 letters,
//! not `HEAD` or `CONNECT`; an origin-form target of visible ASCII; `HTTP/1.0` or `HTTP/1.1`;
//! CRLF line ends;
//! header names of letters, digits, `-`, `_` and `.`; values of visible ASCII, space and tab),
//! exactly one valid version-00 `traceparent`, no `Content-Length` or `Transfer-Encoding`, and
//! the head ending exactly where the read ends. Anything else goes to the agent whole, which
//! decides as it always did. A property test in the proxy crate holds the two to this.
//!
//! That holds for a read at a message start: the agent checks that it is one before it takes a
//! dropped head as a request (a read in the middle of a message is that message's bytes to it).
//!
//! The code is written for the probes' verifier as much as for the agent: no indexing, no
//! panics, plain integers for the state. The grammar is a byte-at-a-time machine
//! ([`HeadScan::step`]); the probes read in rounds ([`HeadScan::feed`], one `bpf_loop` iteration
//! each, which the verifier checks once): a whole version or `traceparent` value, or a run of
//! bytes that leave the state as it is (tested 8 at a time, SWAR) with the byte that ends it, a
//! line end, the next line's start and the run after it; a target or value run that fills its word
//! goes on over up to 3 more words (at most 32 bytes of it in a round). A round's bytes go through
//! the same transitions as stepping them, and a property test in the proxy crate holds what the
//! rounds find to what the machine finds (12 rounds for `h2load`'s 146-byte head, 26 for a
//! 422-byte browser head, where stepping takes one per byte).
//!
//! The rounds keep no state in registers from one to the next: a loop of rounds inside one
//! iteration makes the verifier follow every path through every round (it refused such a loop,
//! "infinite loop detected", then "the sequence of 8193 jumps is too complex").

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

pub use crate::line_starts::LineStarts;
use crate::swar::{
    blank_run, byte_at, first_bytes, hex_digits, is_name_byte, lower_case, name_run, run_from, two_hex_digits,
    upper_run,
};

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

const HEAD: u64 = pack(b"HEAD");
const CONNECT: u64 = pack(b"CONNECT");
const HTTP_1: u64 = pack(b"HTTP/1.");
const HTTP_1_0: u64 = pack(b"HTTP/1.0");
const HTTP_1_1: u64 = pack(b"HTTP/1.1");
const CRLF: u64 = pack(b"\r\n");
/// A version-00 `traceparent` value's first 3 bytes.
const VERSION_00: u64 = pack(b"00-");

/// Header names the scan tells apart, packed lower case: the first 8 bytes and the next 8.
const TRACEPARENT_NAME: (u64, u64) = (pack(b"tracepar"), pack(b"ent"));
const TRACESTATE_NAME: (u64, u64) = (pack(b"tracesta"), pack(b"te"));
const CONTENT_LENGTH_NAME: (u64, u64) = (pack(b"content-"), pack(b"length"));
/// `transfer-encoding` is 17 bytes: a name whose first 16 are these is taken for it.
const TRANSFER_ENCODING_START: (u64, u64) = (pack(b"transfer"), pack(b"-encodin"));

/// The bytes of one read as the scan reads them: 8 at a time from any offset.
pub trait ReadBytes {
    /// How many bytes the read has (at most [`MAX_SCANNED_BYTES`]).
    fn read_len(&self) -> u32;
    /// The 8 bytes from `at`, little endian (the first lowest); those past the read's end may be
    /// anything.
    fn word(&self, at: u32) -> u64;
}

/// A read in memory, for the agent and the tests: past its end, [`ReadBytes::word`] gives name,
/// value and hex bytes, which no round may take for the read's.
#[derive(Clone, Copy, Debug)]
pub struct Padded<'a>(pub &'a [u8]);

impl ReadBytes for Padded<'_> {
    fn read_len(&self) -> u32 {
        u32::try_from(self.0.len()).unwrap_or(u32::MAX)
    }

    fn word(&self, at: u32) -> u64 {
        let mut word = [b'a'; 8];
        for (k, out) in word.iter_mut().enumerate() {
            if let Some(b) = self.0.get(at as usize + k) {
                *out = *b;
            }
        }
        u64::from_le_bytes(word)
    }
}

/// What a scan found in a head it read to its end: the same from [`HeadScan::fed`] and
/// [`HeadScan::stepped`] (the tests hold them to it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    pub traceparents: u32,
    pub tracestates: u32,
    pub trace_id: (u64, u64),
    pub parent_id: u64,
    pub flags: u32,
}

/// The scan of one read's bytes, in rounds ([`HeadScan::feed`]) or a byte at a time
/// ([`HeadScan::step`], the model the rounds are held to), then [`HeadScan::dropped`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeadScan {
    state: u32,
    /// Bytes read by the rounds.
    at: u32,
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

/// More words a target or value run goes on over in one round, after the word it filled: long
/// paths, user agents and cookies take a round per 32 bytes, not per 8. A fixed count keeps the
/// round's instructions bounded for the verifier (the loop unrolls).
const MORE_RUN_WORDS: u32 = 3;

/// Where a run of bytes from `lowest` to `~` that filled the word before `at` ends: at the first
/// other byte, the read's end, or after [`MORE_RUN_WORDS`] more words. Run bytes leave the state as
/// it is (`step` keeps a target or a value on them), so only the position moves.
#[inline(always)]
fn run_on(bytes: &impl ReadBytes, at: u32, len: u32, lowest: u8) -> u32 {
    let mut at = at;
    for _ in 0..MORE_RUN_WORDS {
        if at >= len {
            break;
        }
        let room = if len - at < 8 { len - at } else { 8 };
        let run = run_from(bytes.word(at), lowest);
        at += if run < room { run } else { room };
        if run < 8 {
            break;
        }
    }
    at
}

impl HeadScan {
    /// True once the bytes cannot be a head the probes drop: the rest need not be read.
    #[inline(always)]
    #[must_use]
    pub const fn failed(&self) -> bool {
        self.state == FAILED
    }

    /// Bytes the rounds read so far.
    #[inline(always)]
    #[must_use]
    pub const fn read(&self) -> u32 {
        self.at
    }

    /// One round of the scan of `bytes`, from where it stands: at least one byte, at most the
    /// read's end. A whole version (`HTTP/1.1` and its line end) or `traceparent` value is taken at
    /// once; otherwise the run of bytes that leave the state as it is (method, target, name or
    /// value bytes, tested 8 at a time), the byte that ends it, a line end and the next line's
    /// first byte, and a run of that name or value. A target or value run that fills its word goes
    /// on over up to [`MORE_RUN_WORDS`] more words and ends the round there. Each byte goes
    /// through the same transitions as [`HeadScan::step`], so the rounds leave what stepping
    /// leaves.
    #[inline(always)]
    pub fn feed(&mut self, bytes: &impl ReadBytes) {
        let len = bytes.read_len();
        let at = self.at;
        if at >= len {
            return;
        }
        if self.whole_version(bytes, at, len) || self.whole_traceparent(bytes, at, len) {
            return;
        }
        let word = bytes.word(at);
        let room = if len - at < 8 { len - at } else { 8 };
        let run = match self.state {
            METHOD => self.method_run(word, room),
            TARGET => run_from(word, b'!'),
            NAME => self.name_bytes(word, room),
            VALUE => run_from(word, b' '),
            _ => 0,
        };
        let mut k = if run < room { run } else { room };
        if k == 8
            && let Some(lowest) = self.run_class()
        {
            // A target or value run that fills its word goes on over the next words, and ends
            // the round: the byte that ends it is the next round's first.
            self.at = run_on(bytes, at + 8, len, lowest);
            return;
        }
        if k < room {
            self.step(byte_at(word, k));
            k += 1;
        }
        // A line end, and the next line's first byte (a name's, or the blank line's).
        if k < room && self.state == EXPECT_LF {
            self.step(byte_at(word, k));
            k += 1;
        }
        if k < room && self.state == LINE_START {
            self.step(byte_at(word, k));
            k += 1;
        }
        if k < room && self.state == END_LF {
            self.step(byte_at(word, k));
            k += 1;
        }
        if k < room {
            let rest = word >> (8 * k);
            let run = match self.state {
                TARGET => run_from(rest, b'!'),
                NAME => self.name_bytes(rest, room - k),
                VALUE => run_from(rest, b' '),
                _ => 0,
            };
            k += if run < room - k { run } else { room - k };
            if k == 8
                && let Some(lowest) = self.run_class()
            {
                self.at = run_on(bytes, at + 8, len, lowest);
                return;
            }
        }
        self.at = at + k;
    }

    /// The lowest byte of the state's run, for a target or a value (see [`run_on`]); `None` for
    /// the other states, whose runs stay within one word.
    #[inline(always)]
    fn run_class(&self) -> Option<u8> {
        match self.state {
            TARGET => Some(b'!'),
            VALUE => Some(b' '),
            _ => None,
        }
    }

    /// The version and its line end at once (`HTTP/1.1\r\n` or `HTTP/1.0\r\n`), when the
    /// scan is at the version's start; false otherwise (the bytes are then stepped).
    #[inline(always)]
    fn whole_version(&mut self, bytes: &impl ReadBytes, at: u32, len: u32) -> bool {
        if self.state != VERSION || self.pos != 0 || len - at < 10 {
            return false;
        }
        let version = bytes.word(at);
        if (version != HTTP_1_1 && version != HTTP_1_0) || bytes.word(at + 8) & 0xffff != CRLF {
            return false;
        }
        self.pos = 9;
        self.state = LINE_START;
        self.at = at + 10;
        true
    }

    /// The `traceparent` value at once (after its leading blanks, which a round takes first), when
    /// the scan is at its start and it is a whole valid version-00 value; false otherwise (the
    /// bytes are then stepped, and fail where stepping fails).
    #[inline(always)]
    fn whole_traceparent(&mut self, bytes: &impl ReadBytes, at: u32, len: u32) -> bool {
        if self.state != TRACEPARENT_LEAD {
            return false;
        }
        let word = bytes.word(at);
        let room = if len - at < 8 { len - at } else { 8 };
        let blanks = blank_run(word);
        if blanks >= room {
            self.at = at + room;
            return true;
        }
        let v = at + blanks;
        if len - v < TRACEPARENT_LEN {
            return false;
        }
        let dash = |at: u32| bytes.word(at) & 0xff == u64::from(b'-');
        let (Some(t0), Some(t1), Some(t2), Some(t3), Some(p0), Some(p1), Some(flags)) = (
            hex_digits(bytes.word(v + 3)),
            hex_digits(bytes.word(v + 11)),
            hex_digits(bytes.word(v + 19)),
            hex_digits(bytes.word(v + 27)),
            hex_digits(bytes.word(v + 36)),
            hex_digits(bytes.word(v + 44)),
            two_hex_digits(bytes.word(v + 53)),
        ) else {
            return false;
        };
        if bytes.word(v) & 0x00ff_ffff != VERSION_00 || !dash(v + 35) || !dash(v + 52) {
            return false;
        }
        self.trace_high = (t0 << 32) | t1;
        self.trace_low = (t2 << 32) | t3;
        self.parent = (p0 << 32) | p1;
        self.trace_flags = flags as u32;
        self.pos = TRACEPARENT_LEN;
        self.state = TRACEPARENT;
        self.at = v + TRACEPARENT_LEN;
        true
    }

    /// Takes the upper-case letters at the start of `word` (at most `room`, and what the method
    /// has room for): how many.
    #[inline(always)]
    fn method_run(&mut self, word: u64, room: u32) -> u32 {
        let pos = self.pos;
        if pos >= MAX_METHOD {
            return 0;
        }
        let run = upper_run(word);
        let fits = if room < MAX_METHOD - pos { room } else { MAX_METHOD - pos };
        let run = if run < fits { run } else { fits };
        self.method |= (word & first_bytes(run)) << (8 * pos);
        self.pos = pos + run;
        run
    }

    /// Takes the name bytes at the start of `word` (at most `room`): how many.
    #[inline(always)]
    fn name_bytes(&mut self, word: u64, room: u32) -> u32 {
        let run = name_run(word);
        let run = if run < room { run } else { room };
        self.add_name_bytes(lower_case(word) & first_bytes(run), run);
        run
    }

    /// Adds `n` name bytes (lower case, the first lowest) to the name's first 16, which tell the
    /// names the scan knows apart.
    #[inline(always)]
    fn add_name_bytes(&mut self, bytes: u64, n: u32) {
        let pos = self.pos;
        if pos < 8 {
            self.name_low |= bytes << (8 * pos);
            if pos > 0 {
                self.name_high |= bytes >> (64 - 8 * pos);
            }
        } else if pos < 16 {
            self.name_high |= bytes << (8 * (pos - 8));
        }
        self.pos = pos + n;
    }

    /// Reads the next byte.
    #[inline(always)]
    pub fn step(&mut self, b: u8) {
        self.state = match self.state {
            METHOD => self.method_byte(b),
            TARGET_START if b == b'/' => TARGET,
            TARGET if (b'!'..=b'~').contains(&b) => TARGET,
            TARGET if b == b' ' => {
                self.pos = 0;
                VERSION
            }
            VERSION => self.version_byte(b),
            EXPECT_LF if b == b'\n' => LINE_START,
            LINE_START if b == b'\r' => END_LF,
            LINE_START if is_name_byte(b) && self.lines < MAX_LINES => {
                self.lines += 1;
                self.name_low = 0;
                self.name_high = 0;
                self.pos = 0;
                self.name_byte(b);
                NAME
            }
            NAME if is_name_byte(b) => {
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
            self.method |= u64::from(b) << (8 * self.pos);
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
        self.add_name_bytes(u64::from(b.to_ascii_lowercase()), 1);
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

    /// What the scan found, once it read a whole head (`None` before, or when it failed).
    #[must_use]
    pub const fn found(&self) -> Option<Found> {
        if self.state != DONE {
            return None;
        }
        Some(Found {
            traceparents: self.traceparents,
            tracestates: self.tracestates,
            trace_id: (self.trace_high, self.trace_low),
            parent_id: self.parent,
            flags: self.trace_flags,
        })
    }

    /// The scan of `bytes` in rounds, as the probes feed it, until it fails or has read them all.
    #[must_use]
    pub fn fed(bytes: &[u8]) -> Self {
        let read = Padded(bytes);
        let mut scan = Self::default();
        while scan.at < read.read_len() && !scan.failed() {
            scan.feed(&read);
        }
        scan
    }

    /// The scan of `bytes` a byte at a time, until it fails (counting the bytes it read as the
    /// rounds do): the model of [`HeadScan::feed`]. After any round, the rounds' scan equals the
    /// model's of the bytes they read (the tests hold them to it).
    #[must_use]
    pub fn stepped(bytes: &[u8]) -> Self {
        let mut scan = Self::default();
        for b in bytes {
            if scan.failed() {
                break;
            }
            scan.step(*b);
            scan.at += 1;
        }
        scan
    }

    /// Scans `bytes` whole (the agent's and the tests' way) and says whether this rule drops them.
    #[must_use]
    pub fn scan(bytes: &[u8], rule: u32, threshold: u64) -> Option<DroppedContext> {
        if bytes.len() > MAX_SCANNED_BYTES as usize {
            return None;
        }
        Self::fed(bytes).dropped(rule, threshold)
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
        crate::test_heads::request_head(b"GET /a?b=c HTTP/1.1", lines)
    }

    fn traceparent(value: &[u8]) -> Vec<u8> {
        [b"traceparent: ".as_slice(), value].concat()
    }

    #[test]
    fn every_byte_of_a_traceparent_value_is_checked_as_stepping_checks_it() {
        for lead in [0, 1, 7, 8, 9] {
            for at in 0..UNSAMPLED.len() {
                for b in 0..=255u8 {
                    let mut value = [vec![b' '; lead], UNSAMPLED.to_vec()].concat();
                    value[lead + at] = b;
                    let bytes = head(&[b"Host: x", &traceparent(&value)]);
                    let fed = HeadScan::fed(&bytes);
                    assert_eq!(fed, HeadScan::stepped(&bytes), "{}", String::from_utf8_lossy(&bytes));
                }
            }
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

//! Request and response heads, keeping only the fields spans need: parsed from complete HTTP/1
//! heads (from [`Framer`](crate::framing::Framer)) with `httparse`, or built from the decoded
//! fields of HTTP/2 HEADERS blocks (from [`crate::h2`]). Both go through the same per-line code,
//! so that a request and the one `HAProxy` relays in the other version sign alike. Sensitive headers (Authorization, Proxy-Authorization, Cookie,
//! Set-Cookie) are never copied out of the captured bytes.

use std::mem::MaybeUninit;

use crate::framing::BodyFraming;
use crate::trace_context::{TraceParent, parse_traceparent};

/// Most headers a head may carry; more is a parse error.
const MAX_HEADERS: usize = 128;
// `parse_request_unless` marks the signing lines of a head in a `u128`.
const _: () = assert!(MAX_HEADERS <= 128);

/// Room for a head's header lines, left uninitialised: `httparse` writes the lines it finds and
/// hands back only those, so the 4 KiB of empty headers `[EMPTY_HEADER; MAX_HEADERS]` would cost
/// per parse (four parses per proxied request) are never written.
fn header_room<'b>() -> [MaybeUninit<httparse::Header<'b>>; MAX_HEADERS] {
    [const { MaybeUninit::uninit() }; MAX_HEADERS]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    #[error("invalid HTTP/1 head: {0}")]
    Invalid(&'static str),
    #[error("head not complete")]
    Partial,
    #[error("invalid Content-Length")]
    BadContentLength,
}

/// The HTTP version a message was sent with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HttpVersion {
    Http10,
    #[default]
    Http11,
    Http2,
}

impl HttpVersion {
    /// The `network.protocol.version` value: "1.0", "1.1" or "2".
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Http10 => "1.0",
            Self::Http11 => "1.1",
            Self::Http2 => "2",
        }
    }

    /// From the minor version of an HTTP/1 start line.
    fn from_minor(minor: u8) -> Self {
        if minor == 0 { Self::Http10 } else { Self::Http11 }
    }
}

/// How many `traceparent` headers a request carried, and the value when there was exactly one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TraceparentField {
    #[default]
    Absent,
    One(String),
    /// Two or more: per W3C Trace Context the request starts a new trace.
    Repeated,
}

/// What a span needs from a request head.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    /// The request target as sent (origin form `/path?query`, or absolute form).
    pub target: String,
    pub version: HttpVersion,
    pub host: Option<String>,
    pub user_agent: Option<String>,
    pub traceparent: TraceparentField,
    /// The `traceparent`, parsed: `Some` when there was exactly one and it was valid. Parsed once
    /// with the head, as linking and sampling read it several times per request.
    pub parsed_traceparent: Option<TraceParent>,
    pub tracestate: Option<String>,
    pub framing: BodyFraming,
    /// The client asked to switch protocols (`Upgrade`) or to open a tunnel (`CONNECT`).
    pub wants_tunnel: bool,
    /// `Connection: close`, or HTTP/1.0 without keep-alive.
    pub closes: bool,
    /// The capture window cut the head: headers after the first `TRACETAP_CAPTURE_BYTES` (a
    /// `traceparent` among them) are unknown.
    pub truncated: bool,
    /// A fingerprint of the header lines `HAProxy` forwards unchanged (see `header_signature_bit`):
    /// a frontend request and the backend request it caused share most bits even when a rule
    /// rewrote the target or added or removed a header.
    pub header_sig: u64,
}

/// What a header line is to the head parsers, told from its name alone (ASCII case folded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Name {
    Host,
    UserAgent,
    Traceparent,
    Tracestate,
    Upgrade,
    ContentLength,
    TransferEncoding,
    Connection,
    /// Another of the headers a proxy rewrites (see [`Name::is_unstable`]).
    OtherUnstable,
    /// Any other header.
    Other,
}

impl Name {
    /// A header a proxy rewrites on the way (hop-by-hop ones, and those `HAProxy` adds or replaces
    /// for the server): `Connection`, `Transfer-Encoding`, `Keep-Alive`, `Proxy-Connection`, `TE`,
    /// `Upgrade`, `Forwarded`, `Via`, `X-Forwarded-For`, `-Proto`, `-Host`, `-Port`, `X-Real-IP`,
    /// `traceparent` and `tracestate`. They are left out of [`RequestHead::header_sig`] and of the
    /// response signature and digest. `Transfer-Encoding` is among them: `HAProxy` drops it when it
    /// relays an HTTP/1 response to an HTTP/2 client (and may add it towards an HTTP/1 client), so
    /// it would keep the two responses from ever sharing a digest. So are the trace context
    /// headers: the lines `tracetap haproxy-snippet` prints give every forwarded request (and,
    /// optionally, response) a new `traceparent` and may rewrite `tracestate`; linking compares
    /// them separately.
    fn is_unstable(self) -> bool {
        matches!(
            self,
            Self::Traceparent
                | Self::Tracestate
                | Self::Upgrade
                | Self::TransferEncoding
                | Self::Connection
                | Self::OtherUnstable
        )
    }
}

/// Classifies a header name once per line (every header of every request and response goes
/// through here): the length picks the few names it can be, so a line costs a length test and at
/// most four comparisons (most lines one or none), where asking each question apart compared the
/// same name with a dozen others.
fn classify(name: &[u8]) -> Name {
    let is = |known: &[u8]| name.eq_ignore_ascii_case(known);
    match name.len() {
        2 if is(b"te") => Name::OtherUnstable,
        3 if is(b"via") => Name::OtherUnstable,
        4 if is(b"host") => Name::Host,
        7 if is(b"upgrade") => Name::Upgrade,
        9 if is(b"forwarded") || is(b"x-real-ip") => Name::OtherUnstable,
        10 if is(b"user-agent") => Name::UserAgent,
        10 if is(b"connection") => Name::Connection,
        10 if is(b"tracestate") => Name::Tracestate,
        10 if is(b"keep-alive") => Name::OtherUnstable,
        11 if is(b"traceparent") => Name::Traceparent,
        14 if is(b"content-length") => Name::ContentLength,
        15 if is(b"x-forwarded-for") => Name::OtherUnstable,
        16 if is(b"proxy-connection") || is(b"x-forwarded-host") || is(b"x-forwarded-port") => Name::OtherUnstable,
        17 if is(b"transfer-encoding") => Name::TransferEncoding,
        17 if is(b"x-forwarded-proto") => Name::OtherUnstable,
        _ => Name::Other,
    }
}

/// The bit of one header line in [`RequestHead::header_sig`]: a hash of the name (ASCII case
/// folded, as `HAProxy` lower-cases names towards servers) and the trimmed value, reduced to one
/// of 64 bits. Collisions only make two requests look a little more alike.
fn header_signature_bit(name: &[u8], value: &[u8]) -> u64 {
    1u64 << (header_line_hash(name, value) >> 58)
}

/// A 64-bit hash of one header line: the name ASCII case folded, the value trimmed. It runs for
/// every header of every request and response, so it takes 8 bytes a step (the Fx step), and
/// ends with `MurmurHash3`'s finalizer so that every input bit moves every output bit (the bit a line
/// gets in a signature is taken from the high bits).
fn header_line_hash(name: &[u8], value: &[u8]) -> u64 {
    // Setting bit 5 of every byte folds ASCII letters to lower case; it also merges a few
    // punctuation pairs, which only makes two names a little likelier to look alike.
    let h = hash_words(0, name, 0x2020_2020_2020_2020);
    let mut h = hash_words(h, value.trim_ascii(), 0);
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// Mixes `bytes` into `h` 8 bytes (little endian, OR-ed with `fold`) at a time, then their length.
fn hash_words(mut h: u64, bytes: &[u8], fold: u64) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let step = |h: u64, w: u64| (h.rotate_left(5) ^ w).wrapping_mul(K);
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        h = step(h, u64::from_le_bytes(c.try_into().expect("8 bytes")) | fold);
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let present = u64::MAX >> (8 * (8 - rest.len()));
        // The last 1 to 7 bytes as a little-endian word, zero above them. With 8 bytes before them
        // this is one load of the last 8 bytes, shifted: a copy into a padded array cost a call to
        // memcpy per header line.
        let last = match bytes.last_chunk::<8>() {
            Some(tail) => u64::from_le_bytes(*tail) >> (8 * (8 - rest.len())),
            None => rest.iter().rev().fold(0u64, |w, &b| (w << 8) | u64::from(b)),
        };
        h = step(h, last | (fold & present));
    }
    step(h, bytes.len() as u64)
}

/// True when two header signatures share a header line, or neither carries any: the least a
/// rewritten request must have in common with the client request it came from to be guessed as
/// its own. Guesses are ranked by how many lines they share, and only exported once the relayed
/// response confirms them, so this only rules out requests with nothing in common.
#[must_use]
pub fn shares_headers(a: u64, b: u64) -> bool {
    (a & b) != 0 || (a | b) == 0
}

impl RequestHead {
    /// The path part of the target, without query (for `url.path`).
    #[must_use]
    pub fn path(&self) -> &str {
        let target = self.target.as_str();
        let path = match target.find("://") {
            Some(scheme_end) => {
                let rest = &target[scheme_end + 3..];
                rest.find('/').map_or("/", |i| &rest[i..])
            }
            None => target,
        };
        path.split(['?', '#']).next().unwrap_or(path)
    }

    /// The query string without `?`, if any.
    #[must_use]
    pub fn query(&self) -> Option<&str> {
        let q = self.target.split_once('?')?.1;
        Some(q.split('#').next().unwrap_or(q))
    }
}

/// What a span needs from a response head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResponseHead {
    pub status: u16,
    pub version: HttpVersion,
    content_length: Option<u64>,
    chunked: bool,
    pub closes: bool,
    /// The header lines `HAProxy` relays unchanged (hop-by-hop ones left out), as a set of bits
    /// like [`RequestHead::header_sig`]: a relayed response shares most of them with the backend
    /// response it came from.
    pub header_sig: u64,
    /// The same lines hashed in full and summed (order does not matter): equal for a response
    /// relayed unchanged, and almost never for two different ones (`Date`, `ETag`, `Set-Cookie`,
    /// a request id usually differ between responses).
    pub header_digest: u64,
    /// A single valid `traceparent`. `HAProxy` adds it to a response when configured with `tracetap
    /// haproxy-snippet --response`: then it is the one forwarded to the server, or the one
    /// generated for a request `HAProxy` answered itself.
    pub traceparent: Option<TraceParent>,
}

impl ResponseHead {
    /// A 1xx response other than 101: another response for the same request follows.
    #[must_use]
    pub fn is_interim(&self) -> bool {
        (100..200).contains(&self.status) && self.status != 101
    }

    /// Body framing per RFC 9112 section 6.3, given the request method it answers.
    #[must_use]
    pub fn framing(&self, request_method: &str) -> BodyFraming {
        if self.status == 101 || (request_method == "CONNECT" && (200..300).contains(&self.status)) {
            return BodyFraming::Tunnel;
        }
        if request_method == "HEAD" || self.is_interim() || self.status == 204 || self.status == 304 {
            return BodyFraming::Empty;
        }
        if self.chunked {
            return BodyFraming::Chunked;
        }
        match self.content_length {
            Some(0) => BodyFraming::Empty,
            Some(n) => BodyFraming::Length(n),
            None => BodyFraming::UntilClose,
        }
    }
}

fn parse_content_length(value: &[u8]) -> Result<u64, HeadError> {
    let text = std::str::from_utf8(value).map_err(|_| HeadError::BadContentLength)?.trim();
    // Repeated identical values ("5, 5") are allowed by RFC 9110; anything else is an error.
    let mut values = text.split(',').map(str::trim);
    let first: u64 = values.next().and_then(|v| v.parse().ok()).ok_or(HeadError::BadContentLength)?;
    if values.all(|v| v.parse() == Ok(first)) { Ok(first) } else { Err(HeadError::BadContentLength) }
}

fn is_chunked(value: &[u8]) -> bool {
    value.rsplit(|b| *b == b',').next().is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"))
}

fn has_token(value: &[u8], token: &[u8]) -> bool {
    value.split(|b| *b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// Parses a complete request head.
pub fn parse_request(bytes: &[u8]) -> Result<RequestHead, HeadError> {
    let mut head = RequestHead::default();
    parse_request_into(bytes, &mut head)?;
    Ok(head)
}

/// Replaces `into`'s value with `value`, reusing its capacity.
fn set(into: &mut String, value: &str) {
    into.clear();
    into.push_str(value);
}

/// Replaces an optional field, reusing the capacity of the string it held.
fn set_opt(into: &mut Option<String>, value: Option<&str>, spare: &mut String) {
    if let Some(old) = into.take() {
        *spare = old;
    }
    if let Some(v) = value {
        let mut s = std::mem::take(spare);
        set(&mut s, v);
        *into = Some(s);
    }
}

/// What the header lines of any message say about its framing and its connection.
#[derive(Default)]
struct MessageLines {
    content_length: Option<Result<u64, HeadError>>,
    chunked: bool,
    closes: bool,
    keep_alive: bool,
}

impl MessageLines {
    fn line(&mut self, name: Name, value: &[u8]) {
        match name {
            // The last one counts, unless an earlier one was already invalid.
            Name::ContentLength if !matches!(self.content_length, Some(Err(_))) => {
                self.content_length = Some(parse_content_length(value));
            }
            Name::TransferEncoding => self.chunked = is_chunked(value),
            Name::Connection => {
                self.closes |= has_token(value, b"close");
                self.keep_alive |= has_token(value, b"keep-alive");
            }
            _ => {}
        }
    }

    fn content_length(&self) -> Result<Option<u64>, HeadError> {
        self.content_length.transpose()
    }
}

/// The fields of a request head built from its header lines, one line at a time: shared by
/// HTTP/1 heads (`httparse`) and HTTP/2 heads (HPACK fields), so that both sign and read headers
/// alike (a frontend h2 request and the HTTP/1 request `HAProxy` writes for it must share a
/// [`RequestHead::header_sig`]).
struct RequestLines<'a> {
    host: Option<&'a str>,
    user_agent: Option<&'a str>,
    traceparent: String,
    traceparents: u32,
    tracestate: String,
    tracestates: u32,
    header_sig: u64,
    upgrade: bool,
    message: MessageLines,
}

impl<'a> RequestLines<'a> {
    /// Starts with the strings of a recycled head, so that their capacity serves again.
    fn new(head: &mut RequestHead) -> Self {
        let mut traceparent = match std::mem::take(&mut head.traceparent) {
            TraceparentField::One(s) => s,
            TraceparentField::Absent | TraceparentField::Repeated => String::new(),
        };
        traceparent.clear();
        let mut tracestate = head.tracestate.take().unwrap_or_default();
        tracestate.clear();
        // Set again by `finish`; cleared now so that a head left by a failed parse says nothing.
        head.parsed_traceparent = None;
        Self {
            host: None,
            user_agent: None,
            traceparent,
            traceparents: 0,
            tracestate,
            tracestates: 0,
            header_sig: 0,
            upgrade: false,
            message: MessageLines::default(),
        }
    }

    /// Adds one header line: it signs the head (unless a proxy rewrites it on the way) and fills
    /// the fields spans need.
    fn line(&mut self, name: &[u8], value: &'a [u8]) {
        let kind = classify(name);
        self.sign(name, kind, value);
        self.read(kind, value);
    }

    /// Adds one header line to [`RequestHead::header_sig`], unless a proxy rewrites it on the way.
    fn sign(&mut self, name: &[u8], kind: Name, value: &[u8]) {
        if !kind.is_unstable() {
            self.header_sig |= header_signature_bit(name, value);
        }
    }

    /// Fills the fields spans need from one header line of this `kind`.
    fn read(&mut self, kind: Name, value: &'a [u8]) {
        let text = || std::str::from_utf8(value).ok().map(str::trim);
        match kind {
            Name::Host => self.host = text(),
            Name::UserAgent => self.user_agent = text(),
            Name::Traceparent => {
                self.traceparents += 1;
                if let Some(v) = text() {
                    set(&mut self.traceparent, v);
                }
            }
            Name::Tracestate => {
                // Several tracestate headers are one list (W3C Trace Context, section 3.3.1).
                if self.tracestates > 0 {
                    self.tracestate.push(',');
                }
                self.tracestate.push_str(text().unwrap_or_default());
                self.tracestates += 1;
            }
            Name::Upgrade => self.upgrade = true,
            _ => self.message.line(kind, value),
        }
    }

    /// Moves the fields into `head` (its method, target and version are the caller's).
    fn finish(self, head: &mut RequestHead) {
        let mut spare = String::new();
        set_opt(&mut head.host, self.host, &mut spare);
        set_opt(&mut head.user_agent, self.user_agent, &mut spare);
        head.traceparent = match self.traceparents {
            0 => TraceparentField::Absent,
            1 if !self.traceparent.is_empty() => TraceparentField::One(self.traceparent),
            _ => TraceparentField::Repeated,
        };
        head.parsed_traceparent = match &head.traceparent {
            TraceparentField::One(value) => parse_traceparent(value),
            TraceparentField::Absent | TraceparentField::Repeated => None,
        };
        head.tracestate = (self.tracestates > 0).then_some(self.tracestate);
        head.header_sig = self.header_sig;
        head.truncated = false;
    }
}

/// Parses a complete request head into `head`, reusing the capacity of its strings: a recycled
/// head parses the next request without allocating.
pub fn parse_request_into(bytes: &[u8], head: &mut RequestHead) -> Result<(), HeadError> {
    parse_request_unless(bytes, head, |_| false).map(drop)
}

/// [`parse_request_into`], except that the header lines are signed last, and only when
/// `dropped`, shown the head with every other field parsed, says false: a request the sampler
/// drops from its head alone is never linked, and signing its lines is most of what its parse
/// would cost beyond `httparse`. Its `header_sig` is then 0. Returns what `dropped` said.
pub fn parse_request_unless(
    bytes: &[u8],
    head: &mut RequestHead,
    dropped: impl FnOnce(&RequestHead) -> bool,
) -> Result<bool, HeadError> {
    let mut headers = header_room();
    let mut req = httparse::Request::new(&mut []);
    complete(req.parse_with_uninit_headers(bytes, &mut headers))?;
    let method = req.method.unwrap_or_default();
    set(&mut head.method, method);
    set(&mut head.target, req.path.unwrap_or_default());
    head.version = HttpVersion::from_minor(req.version.unwrap_or(1));
    let mut lines = RequestLines::new(head);
    // Which lines sign the head, found while reading them (httparse gives at most `MAX_HEADERS`).
    let mut signing = 0u128;
    for (i, h) in req.headers.iter().enumerate() {
        let kind = classify(h.name.as_bytes());
        signing |= u128::from(!kind.is_unstable()) << i;
        lines.read(kind, h.value);
    }
    let content_length = lines.message.content_length()?;
    let (chunked, closes, keep_alive, upgrade) =
        (lines.message.chunked, lines.message.closes, lines.message.keep_alive, lines.upgrade);
    lines.finish(head);
    head.wants_tunnel = method == "CONNECT" || upgrade;
    head.closes = closes || (head.version == HttpVersion::Http10 && !keep_alive);
    head.framing = match (chunked, content_length) {
        (true, _) => BodyFraming::Chunked,
        (false, None | Some(0)) => BodyFraming::Empty,
        (false, Some(n)) => BodyFraming::Length(n),
    };
    if dropped(head) {
        return Ok(true);
    }
    let mut sig = 0;
    for (i, h) in req.headers.iter().enumerate() {
        if signing & (1 << i) != 0 {
            sig |= header_signature_bit(h.name.as_bytes(), h.value);
        }
    }
    head.header_sig = sig;
    Ok(false)
}

/// Builds a request head from the decoded fields of an HTTP/2 HEADERS block (names lower case,
/// pseudo-headers first), reusing the capacity of `head`'s strings.
///
/// `:method` gives the method, `:path` the target (`:authority` for CONNECT), `:authority` the
/// host (a `host` field otherwise). `:authority` signs the head as the `host` line `HAProxy`
/// writes for it towards HTTP/1 servers, and split `cookie` fields are signed as the one line
/// they are joined into (RFC 9113, section 8.2.3); other pseudo-headers do not sign it. Messages
/// end with `END_STREAM`, so the body framing is [`BodyFraming::Empty`].
pub fn request_from_fields<'a>(
    fields: impl Iterator<Item = (&'a [u8], &'a [u8])>,
    head: &mut RequestHead,
) -> Result<(), HeadError> {
    let (mut method, mut path, mut authority) = (None, None, None);
    let mut lines = RequestLines::new(head);
    let mut cookies = Cookies::default();
    for (name, value) in fields {
        match name {
            b":method" => method = Some(value),
            b":path" => path = Some(value),
            b":authority" => {
                authority = std::str::from_utf8(value).ok().map(str::trim);
                lines.line(b"host", value);
            }
            b"cookie" => cookies.add(value),
            _ if name.starts_with(b":") => {}
            _ => lines.line(name, value),
        }
    }
    lines.header_sig |= cookies.signature_bit();
    let method = method.and_then(|m| std::str::from_utf8(m).ok()).ok_or(HeadError::Invalid(":method"))?;
    let target = if method == "CONNECT" { authority } else { path.and_then(|p| std::str::from_utf8(p).ok()) };
    let target = target.ok_or(HeadError::Invalid(":path"))?;
    if authority.is_some() {
        lines.host = authority;
    }
    set(&mut head.method, method);
    set(&mut head.target, target);
    lines.finish(head);
    head.version = HttpVersion::Http2;
    head.wants_tunnel = method == "CONNECT";
    head.closes = false;
    head.framing = BodyFraming::Empty;
    Ok(())
}

/// The `cookie` fields of an HTTP/2 request: signed as the one line `"; "`-joined a proxy sends
/// to an HTTP/1 server. Joining allocates only when a request splits its cookies.
#[derive(Default)]
struct Cookies<'a> {
    first: Option<&'a [u8]>,
    joined: Vec<u8>,
}

impl<'a> Cookies<'a> {
    fn add(&mut self, value: &'a [u8]) {
        match self.first {
            None => self.first = Some(value),
            Some(first) => {
                if self.joined.is_empty() {
                    self.joined.extend_from_slice(first);
                }
                self.joined.extend_from_slice(b"; ");
                self.joined.extend_from_slice(value);
            }
        }
    }

    fn signature_bit(&self) -> u64 {
        match self.first {
            None => 0,
            Some(_) if !self.joined.is_empty() => header_signature_bit(b"cookie", &self.joined),
            Some(first) => header_signature_bit(b"cookie", first),
        }
    }
}

/// The lines of a response head that spans and relay matching need.
#[derive(Default)]
struct ResponseLines {
    /// Only the framing is wanted (see [`parse_response_framing`]): no line is hashed.
    framing_only: bool,
    header_sig: u64,
    header_digest: u64,
    traceparent: Option<TraceParent>,
    traceparents: u32,
    message: MessageLines,
}

impl ResponseLines {
    fn line(&mut self, name: &[u8], value: &[u8]) {
        let kind = classify(name);
        if self.framing_only {
            self.message.line(kind, value);
            return;
        }
        if !kind.is_unstable() {
            let line = header_line_hash(name, value);
            self.header_sig |= 1u64 << (line >> 58);
            self.header_digest = self.header_digest.wrapping_add(line);
        } else if kind == Name::Traceparent {
            self.traceparents += 1;
            self.traceparent = std::str::from_utf8(value).ok().and_then(parse_traceparent);
        }
        self.message.line(kind, value);
    }

    /// The `traceparent`, when there was exactly one and it was valid.
    fn traceparent(&self) -> Option<TraceParent> {
        self.traceparent.filter(|_| self.traceparents == 1)
    }
}

/// Parses a complete response head.
pub fn parse_response(bytes: &[u8]) -> Result<ResponseHead, HeadError> {
    parse_response_lines(bytes, ResponseLines::default())
}

/// Parses a complete response head for its status and framing only, as for the answer to a
/// request dropped at its head: `header_sig` and `header_digest` are 0 and `traceparent` is
/// `None` (nothing matches or names that response).
pub fn parse_response_framing(bytes: &[u8]) -> Result<ResponseHead, HeadError> {
    parse_response_lines(bytes, ResponseLines { framing_only: true, ..ResponseLines::default() })
}

fn parse_response_lines(bytes: &[u8], mut lines: ResponseLines) -> Result<ResponseHead, HeadError> {
    let mut headers = header_room();
    let mut resp = httparse::Response::new(&mut []);
    complete(httparse::ParserConfig::default().parse_response_with_uninit_headers(&mut resp, bytes, &mut headers))?;
    for h in resp.headers.iter() {
        lines.line(h.name.as_bytes(), h.value);
    }
    let version = HttpVersion::from_minor(resp.version.unwrap_or(1));
    Ok(ResponseHead {
        status: resp.code.unwrap_or_default(),
        version,
        content_length: lines.message.content_length()?,
        chunked: lines.message.chunked,
        closes: lines.message.closes || (version == HttpVersion::Http10 && !lines.message.keep_alive),
        header_sig: lines.header_sig,
        header_digest: lines.header_digest,
        traceparent: lines.traceparent(),
    })
}

/// Builds a response head from the decoded fields of an HTTP/2 HEADERS block: the status from
/// `:status`, the other pseudo-headers left out of the signature and digest. A relayed response
/// keeps the digest of the HTTP/1 response it came from: `HAProxy` lower-cases names (the hash
/// folds case anyway) and drops only hop-by-hop lines, which are left out of both.
pub fn response_from_fields<'a>(fields: impl Iterator<Item = (&'a [u8], &'a [u8])>) -> Result<ResponseHead, HeadError> {
    let mut status = None;
    let mut lines = ResponseLines::default();
    for (name, value) in fields {
        if name == b":status" {
            status =
                std::str::from_utf8(value).ok().and_then(|s| s.parse::<u16>().ok()).filter(|s| (100..1000).contains(s));
        } else if !name.starts_with(b":") {
            lines.line(name, value);
        }
    }
    Ok(ResponseHead {
        status: status.ok_or(HeadError::Invalid(":status"))?,
        version: HttpVersion::Http2,
        // A wrong length is the stream's problem, not the head's: h2 bodies end with END_STREAM.
        content_length: lines.message.content_length().ok().flatten(),
        chunked: false,
        closes: false,
        header_sig: lines.header_sig,
        header_digest: lines.header_digest,
        traceparent: lines.traceparent(),
    })
}

/// What httparse said of a head, as the parsers' error: a head from the framer is whole, so
/// `Partial` is an error too.
fn complete(parsed: httparse::Result<usize>) -> Result<(), HeadError> {
    match parsed {
        Ok(httparse::Status::Complete(_)) => Ok(()),
        Ok(httparse::Status::Partial) => Err(HeadError::Partial),
        Err(e) => Err(HeadError::Invalid(httparse_reason(e))),
    }
}

fn httparse_reason(e: httparse::Error) -> &'static str {
    match e {
        httparse::Error::HeaderName => "header name",
        httparse::Error::HeaderValue => "header value",
        httparse::Error::NewLine => "new line",
        httparse::Error::Status => "status",
        httparse::Error::Token => "token",
        httparse::Error::TooManyHeaders => "too many headers",
        httparse::Error::Version => "version",
    }
}

#[cfg(test)]
mod tests;

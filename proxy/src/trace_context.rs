//! W3C Trace Context: parsing the `traceparent` header that clients send and HAProxy forwards.

use tracetap_ebpf_common::head_drop::{DroppedContext, trace_id_randomness};

/// A valid `traceparent` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub parent_id: [u8; 8],
    pub flags: u8,
}

/// The context the probes found in a request head they dropped.
impl From<DroppedContext> for TraceParent {
    fn from(context: DroppedContext) -> Self {
        Self { trace_id: context.trace_id, parent_id: context.parent_id, flags: context.flags }
    }
}

impl TraceParent {
    /// The `sampled` flag.
    #[must_use]
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

/// The W3C `random` trace flag: the trace id's lowest 56 bits are random.
pub const FLAG_RANDOM: u8 = 0x02;

/// Parses a `traceparent` header value per W3C Trace Context level 2, section 3.2:
/// lower-case hex only, version `ff` invalid, all-zero ids invalid, and a future version may
/// carry more fields after a `-` (which are ignored).
#[must_use]
pub fn parse_traceparent(value: &str) -> Option<TraceParent> {
    let v = value.trim_matches([' ', '\t']).as_bytes();
    if v.len() < 55 || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let [version] = decode_hex::<1>(&v[0..2])?;
    if version == 0xff {
        return None;
    }
    if version == 0 && v.len() != 55 {
        return None;
    }
    if version > 0 && v.len() > 55 && v[55] != b'-' {
        return None;
    }
    let trace_id = decode_hex::<16>(&v[3..35])?;
    let parent_id = decode_hex::<8>(&v[36..52])?;
    let [flags] = decode_hex::<1>(&v[53..55])?;
    if trace_id == [0; 16] || parent_id == [0; 8] {
        return None;
    }
    Some(TraceParent { trace_id, parent_id, flags })
}

/// The trace id field of a `traceparent`-shaped value, unchecked: a cheap key for comparing the
/// trace of two requests (a frontend request and the backend request `HAProxy` wrote for it).
#[must_use]
pub fn trace_id_field(value: &str) -> Option<&str> {
    let v = value.trim_matches([' ', '\t']);
    (v.len() >= 55 && v.as_bytes()[2] == b'-' && v.as_bytes()[35] == b'-').then(|| &v[3..35])
}

/// Each byte's value as a lower-case hex digit, or `0xff`: W3C Trace Context allows `0-9a-f` only.
const HEX_VALUE: [u8; 256] = {
    let mut table = [0xff; 256];
    let mut i = 0;
    while i < 16 {
        table[b"0123456789abcdef"[i] as usize] = i as u8;
        i += 1;
    }
    table
};

/// Decodes the `2 * N` lower-case hex digits of `hex` (at least that long); `None` on any other
/// byte. The digits are checked all at once (an OR of the looked-up values) rather than with a
/// branch each: a `traceparent` is read several times per request (issue 32).
fn decode_hex<const N: usize>(hex: &[u8]) -> Option<[u8; N]> {
    let mut out = [0u8; N];
    let mut invalid = 0u8;
    for (i, byte) in out.iter_mut().enumerate() {
        let (high, low) = (HEX_VALUE[usize::from(hex[2 * i])], HEX_VALUE[usize::from(hex[2 * i + 1])]);
        invalid |= high | low;
        *byte = (high << 4) | low;
    }
    (invalid & 0xf0 == 0).then_some(out)
}

/// The OpenTelemetry entry (`ot=...`) of a `tracestate`, as consistent probability sampling reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OtTraceState {
    /// `th`: the rejection threshold (56 bits) the trace was sampled with upstream.
    pub threshold: Option<u64>,
    /// `rv`: explicit randomness (56 bits), which replaces the trace id's lowest 56 bits.
    pub randomness: Option<u64>,
}

/// Largest value of a 56-bit threshold or randomness, plus one.
pub const MAX_THRESHOLD: u64 = 1 << 56;

/// The lowest 56 bits of a trace id: the trace's consistent-sampling randomness, unless the `ot`
/// entry of its `tracestate` gives an `rv`. One definition for every decision taken on it (the
/// head sampler, [`crate::sampled_out`], shedding, the tail's `probabilistic` policy).
#[must_use]
pub fn randomness(trace_id: &[u8; 16]) -> u64 {
    let mut low = [0u8; 8];
    low.copy_from_slice(&trace_id[8..]);
    trace_id_randomness(u64::from_be_bytes(low))
}

/// Reads the `ot` entry of a `tracestate` header (W3C list; OpenTelemetry's `ot` value is
/// `;`-separated `key:value` pairs). Malformed `th`/`rv` values are ignored, as the spec asks.
#[must_use]
pub fn parse_ot_tracestate(tracestate: &str) -> OtTraceState {
    let mut out = OtTraceState::default();
    let Some(ot) = tracestate.split(',').map(str::trim).find_map(|member| member.strip_prefix("ot=")) else {
        return out;
    };
    for field in ot.split(';') {
        if let Some(th) = field.strip_prefix("th:") {
            out.threshold = parse_threshold(th);
        } else if let Some(rv) = field.strip_prefix("rv:") {
            out.randomness = (rv.len() == 14).then(|| u64::from_str_radix(rv, 16).ok()).flatten();
        }
    }
    out
}

/// `th` is 1 to 14 lower-case hex digits with trailing zeros dropped.
fn parse_threshold(th: &str) -> Option<u64> {
    if th.is_empty() || th.len() > 14 || !th.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    let value = u64::from_str_radix(th, 16).ok()?;
    Some(value << (4 * (14 - th.len())))
}

/// Encodes a 56-bit threshold as `th` does: 14 hex digits, trailing zeros dropped (`0` for zero).
#[must_use]
pub fn encode_threshold(threshold: u64) -> String {
    let mut out = String::with_capacity(14);
    push_threshold(&mut out, threshold);
    out
}

/// Appends [`encode_threshold`]'s digits to `out`. Written by hand rather than with `format!`: it
/// runs for every kept request, where formatting was a twentieth of the agent's work (issue 32).
pub fn push_threshold(out: &mut String, threshold: u64) {
    let t = threshold.min(MAX_THRESHOLD - 1);
    // Trailing zero digits are trailing zero nibbles; zero itself keeps one digit.
    let digits = 14 - (t.trailing_zeros() / 4).min(13);
    for i in 0..digits {
        let nibble = (t >> (4 * (13 - i))) & 0xf;
        out.push(char::from_digit(nibble as u32, 16).expect("a nibble is a hex digit"));
    }
}

/// A `tracestate` with the `ot` entry's `th` set to `threshold`, moved to the front (W3C: a
/// modified entry moves left); other `ot` fields and other vendors' entries (at most 31) are kept.
/// One allocation: it runs for every kept request.
#[must_use]
pub fn with_threshold(tracestate: Option<&str>, threshold: u64) -> String {
    let members = tracestate.unwrap_or("").split(',').map(str::trim).filter(|m| !m.is_empty());
    let mut out = String::with_capacity(20 + tracestate.map_or(0, str::len));
    out.push_str("ot=th:");
    push_threshold(&mut out, threshold);
    for ot in members.clone().filter_map(|m| m.strip_prefix("ot=")) {
        for field in ot.split(';').filter(|f| !f.starts_with("th:") && !f.is_empty()) {
            out.push(';');
            out.push_str(field);
        }
    }
    for member in members.filter(|m| !m.starts_with("ot=")).take(31) {
        out.push(',');
        out.push_str(member);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn valid() {
        let tp = parse_traceparent(GOOD).unwrap();
        assert_eq!(tp.trace_id[0], 0x0a);
        assert_eq!(tp.parent_id[7], 0x31);
        assert!(tp.sampled());
        assert!(!parse_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00").unwrap().sampled());
    }

    #[test]
    fn invalid() {
        for bad in [
            "",
            "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "0x-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00_0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ] {
            assert_eq!(parse_traceparent(bad), None, "{bad}");
        }
    }

    #[test]
    fn ot_tracestate_fields() {
        let ot = parse_ot_tracestate("vendor=x, ot=th:8;rv:0123456789abcd;foo:bar");
        assert_eq!(ot.threshold, Some(0x8 << 52));
        assert_eq!(ot.randomness, Some(0x0001_2345_6789_abcd));
        assert_eq!(parse_ot_tracestate("ot=th:XYZ;rv:12").threshold, None);
        assert_eq!(parse_ot_tracestate("ot=th:XYZ;rv:12").randomness, None);
        assert_eq!(parse_ot_tracestate("nothing=here"), OtTraceState::default());
    }

    #[test]
    fn threshold_round_trip() {
        for t in [0, 1, 0x8 << 52, (1 << 56) - 1, 0x0000_c000_0000_0000] {
            let encoded = encode_threshold(t);
            assert_eq!(parse_threshold(&encoded), Some(t), "{encoded}");
        }
        assert_eq!(encode_threshold(0), "0");
        assert_eq!(encode_threshold(0x8 << 52), "8");
        assert_eq!(encode_threshold(1), "00000000000001");
        assert_eq!(encode_threshold(u64::MAX), "ffffffffffffff");
    }

    proptest::proptest! {
        /// The hand-written digits are `format!`'s, trimmed: the definition in the specification.
        #[test]
        fn threshold_digits_are_the_formatted_ones(t in 0u64..(1 << 56), shift in 0u32..56) {
            let t = (t >> shift) << shift;
            let full = format!("{:014x}", t.min(MAX_THRESHOLD - 1));
            let trimmed = full.trim_end_matches('0');
            proptest::prop_assert_eq!(encode_threshold(t), if trimmed.is_empty() { "0" } else { trimmed });
        }
    }

    #[test]
    fn threshold_replaces_and_moves_left() {
        assert_eq!(with_threshold(None, 0x8 << 52), "ot=th:8");
        assert_eq!(
            with_threshold(Some("a=1,ot=th:4;rv:0123456789abcd,b=2"), 0xc << 52),
            "ot=th:c;rv:0123456789abcd,a=1,b=2"
        );
        assert_eq!(with_threshold(Some(" ot=rv:0123456789abcd;th:1 , ,ot=x:1"), 0), "ot=th:0;rv:0123456789abcd;x:1");
        let many: Vec<String> = (0..40).map(|i| format!("v{i}=1")).collect();
        assert_eq!(with_threshold(Some(&many.join(",")), 0).matches(',').count(), 31);
    }

    /// The digit-at-a-time parse the table replaced: the reference.
    fn reference_parse(value: &str) -> Option<TraceParent> {
        let digit = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        let byte = |two: &[u8]| Some((digit(two[0])? << 4) | digit(two[1])?);
        let v = value.trim_matches([' ', '\t']).as_bytes();
        if v.len() < 55 || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
            return None;
        }
        let version = byte(&v[0..2])?;
        if version == 0xff || (version == 0 && v.len() != 55) || (version > 0 && v.len() > 55 && v[55] != b'-') {
            return None;
        }
        let mut trace_id = [0u8; 16];
        for (i, b) in trace_id.iter_mut().enumerate() {
            *b = byte(&v[3 + 2 * i..5 + 2 * i])?;
        }
        let mut parent_id = [0u8; 8];
        for (i, b) in parent_id.iter_mut().enumerate() {
            *b = byte(&v[36 + 2 * i..38 + 2 * i])?;
        }
        let flags = byte(&v[53..55])?;
        (trace_id != [0; 16] && parent_id != [0; 8]).then_some(TraceParent { trace_id, parent_id, flags })
    }

    proptest::proptest! {
        /// The table parse agrees with the reference on traceparent-shaped strings with any
        /// characters where the digits go (upper case, punctuation, the bytes around the table's
        /// ranges), and on valid ones.
        #[test]
        fn table_parse_agrees_with_the_reference(
            digits in "[0-9a-fA-FgG/:@`\\-]{55}",
            valid in "[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}",
        ) {
            let mut shaped = digits.into_bytes();
            for (at, dash) in [(2, b'-'), (35, b'-'), (52, b'-')] {
                shaped[at] = dash;
            }
            let shaped = String::from_utf8(shaped).expect("ASCII");
            for value in [shaped.as_str(), valid.as_str()] {
                proptest::prop_assert_eq!(parse_traceparent(value), reference_parse(value), "{}", value);
            }
        }
    }

    proptest::proptest! {
        /// One byte that is not a lower-case hex digit, anywhere among a valid value's digits,
        /// makes it invalid: the high and the low digit of every pair are checked.
        #[test]
        fn one_bad_digit_anywhere_is_refused(
            valid in "00-[0-9a-f]{31}[1-9a-f]-[0-9a-f]{15}[1-9a-f]-0[01]",
            at in proptest::sample::select((0..55).filter(|i| ![2, 35, 52].contains(i)).collect::<Vec<usize>>()),
            bad in proptest::sample::select(b"ABCDEFGgz/:@`'-. ".to_vec()),
        ) {
            proptest::prop_assert!(parse_traceparent(&valid).is_some());
            let mut bytes = valid.into_bytes();
            bytes[at] = bad;
            let value = String::from_utf8(bytes).expect("ASCII");
            proptest::prop_assert_eq!(parse_traceparent(&value), None, "{}", value);
        }
    }

    #[test]
    fn future_versions() {
        assert!(parse_traceparent("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01").is_some());
        assert!(
            parse_traceparent("cc-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-what-the-future-holds")
                .is_some()
        );
        assert!(parse_traceparent("cc-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01x").is_none());
    }
}

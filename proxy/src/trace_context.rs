//! W3C Trace Context: parsing the `traceparent` header that clients send and HAProxy forwards.

/// A valid `traceparent` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub parent_id: [u8; 8],
    pub flags: u8,
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
    let version = hex_byte(&v[0..2])?;
    if version == 0xff {
        return None;
    }
    if version == 0 && v.len() != 55 {
        return None;
    }
    if version > 0 && v.len() > 55 && v[55] != b'-' {
        return None;
    }
    let mut trace_id = [0u8; 16];
    for (i, b) in trace_id.iter_mut().enumerate() {
        *b = hex_byte(&v[3 + 2 * i..5 + 2 * i])?;
    }
    let mut parent_id = [0u8; 8];
    for (i, b) in parent_id.iter_mut().enumerate() {
        *b = hex_byte(&v[36 + 2 * i..38 + 2 * i])?;
    }
    let flags = hex_byte(&v[53..55])?;
    if trace_id == [0; 16] || parent_id == [0; 8] {
        return None;
    }
    Some(TraceParent { trace_id, parent_id, flags })
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

fn hex_byte(two: &[u8]) -> Option<u8> {
    Some(hex_digit(two[0])? << 4 | hex_digit(two[1])?)
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
    fn future_versions() {
        assert!(parse_traceparent("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01").is_some());
        assert!(
            parse_traceparent("cc-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-what-the-future-holds")
                .is_some()
        );
        assert!(parse_traceparent("cc-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01x").is_none());
    }
}

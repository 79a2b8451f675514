//! A cheap look before the probes' head scan (see `head_drop`): whether a read may hold a
//! `traceparent` line at all.

#![expect(
    clippy::inline_always,
    reason = "the probes build this code too, where every helper is inlined on purpose (see ebpf/probes/src/main.rs)"
)]

use crate::swar::{ONES, in_range};

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
        let line_feeds = in_range(word, b'\n', b'\n');
        let t = in_range(word | (ONES * 0x20), b't', b't');
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

#[cfg(test)]
mod tests {
    extern crate std;
    use std::prelude::rust_2024::*;

    use super::*;

    fn head(lines: &[&[u8]]) -> Vec<u8> {
        crate::test_heads::request_head(b"GET /a HTTP/1.1", lines)
    }

    const TRACEPARENT: &[u8] = b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";

    #[test]
    fn a_line_starting_with_t_is_seen_wherever_it_falls() {
        let plain = head(&[b"Host: x", b"Accept: */*"]);
        assert!(!LineStarts::of(&plain));
        // A header line of every length before it puts the line feed at every place in a word.
        for pad in 0..16 {
            let line = [vec![b'a'; pad], b"x: y".to_vec()].concat();
            let padded = head(&[&line, TRACEPARENT]);
            assert!(LineStarts::of(&padded), "{}", String::from_utf8_lossy(&padded));
            let upper = head(&[&line, b"TE: trailers"]);
            assert!(LineStarts::of(&upper), "{}", String::from_utf8_lossy(&upper));
        }
        for b in 0..=255u8 {
            let bytes = [b'\n', b, b'\n', b'a', b'\r', b'\n', b'x', b'\n', b];
            assert_eq!(LineStarts::of(&bytes), b == b't' || b == b'T', "{bytes:?}");
        }
    }
}

//! A trace's spans in memory, in one buffer (one allocation per trace, not per span), with what the
//! policies read of each taken when it arrived, so that deciding a trace in memory parses nothing.
//! The journal writes these bytes as they are, and reads them back through [`SpanBuf::parse`].

use super::wire;

/// What the policies read of a span, taken when it arrives.
#[derive(Debug, Clone, Copy)]
pub(super) struct SpanTimes {
    pub(super) start_unix_ns: u64,
    pub(super) end_unix_ns: u64,
    pub(super) status: i32,
}

/// Spans of one trace in one buffer (one allocation per trace, not per span), laid end to end,
/// each as its length (4 bytes), what the policies read of it ([`SpanTimes`], 20 bytes), then its
/// stored form (pid + `Span`). Little endian, and only ever read back by [`SpanBuf::entries`].
#[derive(Debug, Default)]
pub(super) struct SpanBuf {
    /// Read as they are by the journal (`journal::Journal::fragment`).
    pub(super) bytes: Vec<u8>,
    count: u32,
}

/// Length, start, end, status.
pub(super) const SPAN_HEADER: usize = 4 + 8 + 8 + 4;

impl SpanBuf {
    pub(super) fn push(&mut self, pid: u32, span: &wire::SpanFields<'_>) {
        let len = u32::try_from(4 + span.bytes.len()).expect("a span in a batch is far below 4 GiB");
        if self.bytes.is_empty() {
            // Room for a second span like it: a trace here is mostly a SERVER span and its CLIENT
            // span, arriving together (the budget counts what is allocated, room included).
            self.bytes.reserve(2 * (SPAN_HEADER + len as usize));
        }
        self.bytes.extend_from_slice(&len.to_le_bytes());
        self.bytes.extend_from_slice(&span.start_unix_ns.to_le_bytes());
        self.bytes.extend_from_slice(&span.end_unix_ns.to_le_bytes());
        self.bytes.extend_from_slice(&span.status.to_le_bytes());
        self.bytes.extend_from_slice(&pid.to_be_bytes());
        self.bytes.extend_from_slice(span.bytes);
        self.count += 1;
    }

    /// Spans as [`SpanBuf::push`] lays them out, from untrusted bytes (the journal's); `None`
    /// unless every entry is whole and holds at least a pid.
    pub(super) fn parse(bytes: &[u8]) -> Option<Self> {
        let mut rest = bytes;
        let mut count = 0u32;
        while !rest.is_empty() {
            let (header, tail) = rest.split_first_chunk::<SPAN_HEADER>()?;
            let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) as usize;
            if len < 4 || len > tail.len() {
                return None;
            }
            rest = &tail[len..];
            count = count.checked_add(1)?;
        }
        Some(Self { bytes: bytes.to_vec(), count })
    }

    /// A buffer of the spans whose stored form (pid + `Span`) `keep` says to keep, in order.
    pub(super) fn filtered(&self, mut keep: impl FnMut(&[u8]) -> bool) -> Self {
        let mut out = Self::default();
        let mut rest = self.bytes.as_slice();
        while let Some((header, tail)) = rest.split_first_chunk::<SPAN_HEADER>() {
            let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) as usize;
            let (record, tail) = tail.split_at(len);
            if keep(record) {
                out.bytes.extend_from_slice(header);
                out.bytes.extend_from_slice(record);
                out.count += 1;
            }
            rest = tail;
        }
        out
    }

    pub(super) fn append(&mut self, mut other: SpanBuf) {
        if self.bytes.is_empty() {
            *self = other;
            return;
        }
        self.bytes.append(&mut other.bytes);
        self.count += other.count;
    }

    /// Each span's times and stored form (pid + `Span`), in order.
    pub(super) fn entries(&self) -> impl Iterator<Item = (SpanTimes, &[u8])> {
        let mut rest = self.bytes.as_slice();
        std::iter::from_fn(move || {
            let (header, tail) = rest.split_first_chunk::<SPAN_HEADER>()?;
            let field = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().expect("8 bytes"));
            let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) as usize;
            let times = SpanTimes {
                start_unix_ns: field(4),
                end_unix_ns: field(12),
                status: i32::from_le_bytes(header[20..24].try_into().expect("4 bytes")),
            };
            let (record, tail) = tail.split_at(len);
            rest = tail;
            Some((times, record))
        })
    }

    /// The stored spans (pid + `Span`), in order.
    pub(super) fn records(&self) -> impl Iterator<Item = &[u8]> {
        self.entries().map(|(_, record)| record)
    }

    pub(super) fn len(&self) -> usize {
        self.count as usize
    }

    /// Bytes held, as the memory budget counts them: what is allocated.
    pub(super) fn byte_len(&self) -> u64 {
        self.bytes.capacity() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// The journal's span bytes are read from disk: whatever they are, parsing them never
        /// panics, and what parses walks back whole.
        #[test]
        fn journaled_span_bytes_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)) {
            if let Some(spans) = SpanBuf::parse(&bytes) {
                proptest::prop_assert_eq!(spans.entries().count(), spans.len());
                proptest::prop_assert!(spans.records().all(|r| r.len() >= 4));
            }
        }
    }
}

//! Reading the journal back at a start: segments into what each trace's records said
//! ([`Replayed`]). The bytes are read from disk and treated as hostile: a frame or record that does
//! not parse ends its segment, never the process (property-tested below).

use std::collections::HashMap;

use tracetap_storage::TraceId;

use super::{DECIDED, EXPORTED, FRAGMENT, FRAME_HEADER, MAGIC, MAX_FRAME, RELEASED, Replayed, ReplayedTrace};

/// How reading a segment ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SegmentEnd {
    Clean,
    /// A frame cut short at the file's end.
    Torn,
    Corrupt,
}

/// A trace's records so far, at replay.
#[derive(Debug)]
struct Part {
    first_seen: u64,
    root_ended: u64,
    spans: Vec<u8>,
    decision: Option<(bool, u64)>,
    exported: bool,
}

/// Replay state: the traces seen, by id (one entry per trace, its latest part), and the parts
/// finished before (a trace decided, then journaled again after its decision was forgotten).
#[derive(Debug, Default)]
pub(super) struct Replay {
    traces: HashMap<TraceId, Part>,
    finished: Vec<(TraceId, Part)>,
    decided_only: Vec<(TraceId, bool, u64)>,
}

/// Reads `N` bytes at the front of `rest`.
fn take<'a, const N: usize>(rest: &mut &'a [u8]) -> Option<&'a [u8; N]> {
    let (head, tail) = rest.split_first_chunk::<N>()?;
    *rest = tail;
    Some(head)
}

impl Replay {
    pub(super) fn segment(&mut self, bytes: &[u8]) -> SegmentEnd {
        let Some(mut rest) = bytes.strip_prefix(MAGIC.as_slice()) else {
            return if MAGIC.starts_with(bytes) { SegmentEnd::Torn } else { SegmentEnd::Corrupt };
        };
        while !rest.is_empty() {
            let Some(header) = take::<FRAME_HEADER>(&mut rest) else { return SegmentEnd::Torn };
            let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) as usize;
            let crc = u32::from_le_bytes(header[4..].try_into().expect("4 bytes"));
            if len > MAX_FRAME {
                return SegmentEnd::Corrupt;
            }
            let Some(payload) = rest.get(..len) else { return SegmentEnd::Torn };
            rest = &rest[len..];
            if crc32fast::hash(payload) != crc || self.frame(payload).is_none() {
                return SegmentEnd::Corrupt;
            }
        }
        SegmentEnd::Clean
    }

    /// Applies one frame's records; `None` if one does not parse (those before it count).
    fn frame(&mut self, mut rest: &[u8]) -> Option<()> {
        while let Some((&tag, tail)) = rest.split_first() {
            rest = tail;
            let trace = *take::<16>(&mut rest)?;
            match tag {
                FRAGMENT => {
                    let first_seen = u64::from_le_bytes(*take::<8>(&mut rest)?);
                    let root_ended = u64::from_le_bytes(*take::<8>(&mut rest)?);
                    let len = u32::from_le_bytes(*take::<4>(&mut rest)?) as usize;
                    let spans = rest.get(..len)?;
                    rest = &rest[len..];
                    self.fragment(trace, first_seen, root_ended, spans);
                }
                DECIDED => {
                    let kept = match take::<1>(&mut rest)? {
                        [0] => false,
                        [1] => true,
                        _ => return None,
                    };
                    let threshold = u64::from_le_bytes(*take::<8>(&mut rest)?);
                    match self.traces.get_mut(&trace) {
                        Some(part) => {
                            part.decision = Some((kept, threshold));
                            if !kept {
                                // Done with: its spans are not needed (replay memory stays bounded by
                                // what waits).
                                part.spans = Vec::new();
                            }
                        }
                        None => self.decided_only.push((trace, kept, threshold)),
                    }
                }
                EXPORTED => self.exported(&trace),
                RELEASED => {
                    // The sled store holds it from here on (and decides it).
                    self.traces.remove(&trace);
                }
                _ => return None,
            }
        }
        Some(())
    }

    /// A kept part's export was reported done: the latest part of the trace that waits for that (a
    /// newer part may have begun since, its decision having left the engine's cache).
    fn exported(&mut self, trace: &TraceId) {
        let waiting = |p: &Part| p.decision.is_some_and(|(kept, _)| kept) && !p.exported;
        let part = match self.traces.get_mut(trace) {
            Some(part) if waiting(part) => Some(part),
            _ => self.finished.iter_mut().rev().find(|(t, p)| t == trace && waiting(p)).map(|(_, p)| p),
        };
        if let Some(part) = part {
            part.exported = true;
            part.spans = Vec::new();
        }
    }

    fn fragment(&mut self, trace: TraceId, first_seen: u64, root_ended: u64, spans: &[u8]) {
        if let Some(part) = self.traces.get_mut(&trace) {
            if part.decision.is_none() {
                part.first_seen = part.first_seen.min(first_seen);
                part.root_ended = part.root_ended.max(root_ended);
                part.spans.extend_from_slice(spans);
                return;
            }
            // Spans after a decision: a new part (its decision had left the engine's cache).
            let done = self.traces.remove(&trace).expect("present");
            self.finished.push((trace, done));
        }
        let part = Part { first_seen, root_ended, spans: spans.to_vec(), decision: None, exported: false };
        self.traces.insert(trace, part);
    }

    pub(super) fn finish(self) -> Replayed {
        let mut out = Replayed { decided: self.decided_only, ..Replayed::default() };
        let mut parts: Vec<(TraceId, Part)> = self.finished;
        parts.extend(self.traces);
        // Oldest first, so that the engine re-arms them in arrival order.
        parts.sort_by_key(|(trace, p)| (p.first_seen, *trace));
        for (trace, part) in parts {
            let replayed =
                |p: Part| ReplayedTrace { trace, first_seen: p.first_seen, root_ended: p.root_ended, spans: p.spans };
            match part.decision {
                None => out.undecided.push(replayed(part)),
                Some((true, threshold)) if !part.exported => out.unexported.push((replayed(part), threshold)),
                Some((kept, threshold)) => out.decided.push((trace, kept, threshold)),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Hostile bytes in a segment: replay returns, never panics, and a clean journal's records
        /// before them still count.
        #[test]
        fn replay_of_any_bytes_never_panics(tail in proptest::collection::vec(any::<u8>(), 0..512), framed: bool) {
            let mut replay = Replay::default();
            let mut bytes = MAGIC.to_vec();
            if framed {
                bytes.extend_from_slice(&(tail.len() as u32).to_le_bytes());
                bytes.extend_from_slice(&crc32fast::hash(&tail).to_le_bytes());
            }
            bytes.extend_from_slice(&tail);
            let _ = replay.segment(&bytes);
            let _ = replay.segment(&tail);
            let _ = replay.finish();
        }
    }
}

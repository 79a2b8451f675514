//! The tail journal: what waits for a tail decision in memory, written ahead to disk so that a
//! killed agent (`kill -9`, the OOM killer, an eviction) finds it again at the next start.
//!
//! # Design
//!
//! Traces wait in memory first (see `engine`): a trace whose spans all arrive is decided there and
//! never touches the sled store. Without a journal they were lost at a crash. The journal is an
//! append-only log of what happens to them, written in *group commits*: the engine buffers records
//! as spans arrive and decisions are made, and writes them as one `write` every tick (100 ms) or
//! when [`GROUP_BYTES`] are buffered, whichever comes first, on the tail thread (never on the
//! capture thread). A span is journaled as the bytes it already has in memory: one copy, no second
//! encoding.
//!
//! It is not in sled: sled's cost is per byte too (each insert rewrites its leaf, docs/PERFORMANCE.md
//! measured about 3 µs per span into the store), and every span of every trace goes through the
//! journal; a plain file takes a group commit as one `write` (about 0.1 µs per span).
//!
//! Records: a trace's *fragment* (its spans as they arrived, with its first-seen and root times),
//! its *decision* (kept with a threshold, or dropped), *exported* (the exporter reported a kept
//! trace done), and *released* (it left memory for the sled store, which holds it from then on).
//!
//! Segments: the log is a series of files (`<id>.seg`, ids only grow); a new one is started every
//! [`SEGMENT_NS`] or [`SEGMENT_BYTES`]. A trace *holds* every segment from the first to the last
//! that has spans of it, until it is dropped, exported, or released. Segments are removed oldest
//! first, once nothing holds them: that is the compaction.
//!
//! # Invariants
//!
//! - Segments are removed in order. A trace's decision, export and release records are written
//!   after its spans, so they are in the same segment or a later one: a segment that is still there
//!   has every later record of the traces it holds spans of.
//! - A record is written before anything that depends on it: a kept trace's decision before its
//!   spans go to the exporter; a release after the sled store has made the trace durable (the
//!   engine flushes the store first); a segment is removed only after the records that freed it
//!   were written.
//! - Replay never panics and never loops: a frame whose checksum fails, or a record that does not
//!   parse, ends the reading of its segment (what came before counts), and the segment is set aside
//!   in `quarantine/`. A frame cut short at a file's end (a write that a power loss interrupted) ends
//!   it too, without the quarantine.
//! - After a replay, everything still live is written again into a new segment (the engine does it
//!   through the normal paths), made durable, and only then are the old segments removed.
//!
//! # What a crash can lose
//!
//! A process kill loses the records buffered since the last group commit: at most the last 100 ms.
//! With [`Sync::Data`] (the default) each group commit is also `fdatasync`ed, so a power loss or a
//! kernel crash loses the same; with [`Sync::None`] they can lose what the kernel had not written
//! back (up to about 30 s with Linux's defaults).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use tracetap_storage::TraceId;

use replay::{Replay, SegmentEnd};

mod replay;

/// The first bytes of every segment (and the format's version).
const MAGIC: &[u8; 8] = b"TTJRNL01";
/// A group commit is written at least this often when there is something to write (the engine's
/// tick), and also as soon as this much is buffered.
pub const GROUP_BYTES: usize = 1 << 20;
/// A new segment is started when the active one is this old...
pub const SEGMENT_NS: u64 = 1_000_000_000;
/// ...or this large.
pub const SEGMENT_BYTES: u64 = 16 << 20;
/// A frame longer than this is not one the agent wrote.
const MAX_FRAME: usize = 256 << 20;
/// A frame's header: the length and the CRC-32 of its records.
const FRAME_HEADER: usize = 8;
/// Quarantined segments kept for a post-mortem.
const KEEP_QUARANTINED: usize = 4;

const FRAGMENT: u8 = 1;
const DECIDED: u8 = 2;
const EXPORTED: u8 = 3;
const RELEASED: u8 = 4;

/// When group commits are made durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sync {
    /// `fdatasync` after each group commit.
    Data,
    /// Left to the kernel's writeback.
    None,
}

/// The segments a trace holds: `first..=last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    first: u32,
    last: u32,
}

#[derive(Debug, Default, Clone, Copy)]
struct SegmentState {
    /// Traces holding it.
    holders: u64,
    /// Those of them whose first segment it is (a dropped segment counts each trace once).
    firsts: u64,
    bytes: u64,
}

/// Counters the journal keeps; the engine publishes them.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    pub write_errors: u64,
    /// Segments set aside at replay because they did not read back.
    pub quarantined: u64,
    /// Traces whose segment was removed to keep within the disk bound before they were done with.
    pub dropped_traces: u64,
}

/// What a trace's records said, at replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayedTrace {
    pub trace: TraceId,
    pub first_seen: u64,
    /// 0: its root span had not arrived.
    pub root_ended: u64,
    /// Its fragments' span bytes, concatenated, as the engine gave them.
    pub spans: Vec<u8>,
}

/// Everything a replay found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Replayed {
    /// Traces with no decision: they wait out the rest of their grace.
    pub undecided: Vec<ReplayedTrace>,
    /// Kept traces not reported exported: exported again (possibly a second time).
    pub unexported: Vec<(ReplayedTrace, u64)>,
    /// Decisions of traces done with (dropped, or kept and exported): late spans follow them.
    pub decided: Vec<(TraceId, bool, u64)>,
    /// Segments read, and frames cut short at a file's end.
    pub segments: usize,
    pub torn: usize,
}

/// The journal of one state directory.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    sync: Sync,
    active: u32,
    file: File,
    active_since: u64,
    /// Every segment on disk, the active one included, but those replayed and not yet retired.
    segments: BTreeMap<u32, SegmentState>,
    /// Segments read at replay and their bytes, removed once what they held is written again.
    replayed: Vec<(u32, u64)>,
    /// The next frame: [`FRAME_HEADER`] bytes left for its header, then the records since the last
    /// group commit (one copy of them, written as they are).
    buf: Vec<u8>,
    /// Traces that moved to the sled store: their release is written (and their segments let go)
    /// only once the store is durable ([`Journal::store_durable`]).
    releases: Vec<(TraceId, Held)>,
    counts: Counts,
}

fn segment_path(dir: &Path, id: u32) -> PathBuf {
    dir.join(format!("{id:08x}.seg"))
}

/// The id of a segment file's name: exactly as [`segment_path`] writes it (8 lower-case hex
/// digits), so that no two names mean one id.
fn segment_id(name: &str) -> Option<u32> {
    let hex = name.strip_suffix(".seg")?;
    let canonical = hex.len() == 8 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    canonical.then(|| u32::from_str_radix(hex, 16).ok()).flatten()
}

impl Journal {
    /// Opens the journal in `dir` (created if missing), replays what it holds, and starts a new
    /// segment. The replayed segments stay until [`Journal::retire_replayed`].
    pub fn open(dir: &Path, sync: Sync, now: u64) -> std::io::Result<(Self, Replayed)> {
        std::fs::create_dir_all(dir)?;
        let mut ids: Vec<u32> = std::fs::read_dir(dir)?
            .filter_map(Result::ok)
            .filter_map(|e| segment_id(e.file_name().to_str()?))
            .collect();
        ids.sort_unstable();
        let mut replay = Replay::default();
        let mut counts = Counts::default();
        let mut torn = 0;
        let mut sizes = Vec::with_capacity(ids.len());
        for &id in &ids {
            let path = segment_path(dir, id);
            let bytes = match std::fs::metadata(&path) {
                Ok(m) if m.len() > (SEGMENT_BYTES + MAX_FRAME as u64) => None,
                Ok(_) => std::fs::read(&path).ok(),
                Err(_) => None,
            };
            sizes.push((id, bytes.as_ref().map_or(0, |b| b.len() as u64)));
            let end = match bytes.as_deref() {
                Some(bytes) => replay.segment(bytes),
                None => SegmentEnd::Corrupt,
            };
            match end {
                SegmentEnd::Clean => {}
                SegmentEnd::Torn => torn += 1,
                SegmentEnd::Corrupt => {
                    counts.quarantined += 1;
                    sizes.pop();
                    if let Err(e) = quarantine(dir, &path) {
                        tracing::warn!(error = %e, file = %path.display(), "setting a damaged tail journal segment aside");
                    }
                }
            }
        }
        // One id a second lasts 136 years: a name at the end of the range was not written here.
        let active = match ids.last() {
            None => 1,
            Some(id) => id.checked_add(1).ok_or_else(|| {
                std::io::Error::other(format!(
                    "segment ids exhausted ({}): move the directory aside",
                    segment_path(dir, *id).display()
                ))
            })?,
        };
        let file = create_segment(dir, active, sync)?;
        let mut segments = BTreeMap::new();
        segments.insert(active, SegmentState { holders: 0, firsts: 0, bytes: MAGIC.len() as u64 });
        let mut replayed = replay.finish();
        replayed.segments = ids.len();
        replayed.torn = torn;
        let journal = Self {
            dir: dir.to_owned(),
            sync,
            active,
            file,
            active_since: now,
            segments,
            replayed: sizes,
            buf: vec![0; FRAME_HEADER],
            releases: Vec::new(),
            counts,
        };
        Ok((journal, replayed))
    }

    /// Journals spans of a trace that arrived (`spans`: the engine's bytes for them, opaque here);
    /// returns the segments the trace holds now (`held`: those it held before).
    pub fn fragment(
        &mut self,
        trace: &TraceId,
        first_seen: u64,
        root_ended: u64,
        spans: &[u8],
        held: Option<Held>,
    ) -> Held {
        self.buf.push(FRAGMENT);
        self.buf.extend_from_slice(trace);
        self.buf.extend_from_slice(&first_seen.to_le_bytes());
        self.buf.extend_from_slice(&root_ended.to_le_bytes());
        let len = u32::try_from(spans.len()).expect("a fragment is far below 4 GiB");
        self.buf.extend_from_slice(&len.to_le_bytes());
        self.buf.extend_from_slice(spans);
        let active = self.active;
        let (first, from) = match held {
            None => {
                if let Some(s) = self.segments.get_mut(&active) {
                    s.firsts += 1;
                }
                (active, active)
            }
            Some(h) if h.last < active => (h.first, h.last + 1),
            Some(h) => return h,
        };
        for id in from..=active {
            if let Some(s) = self.segments.get_mut(&id) {
                s.holders += 1;
            }
        }
        Held { first, last: active }
    }

    /// Journals a trace's decision.
    pub fn decided(&mut self, trace: &TraceId, kept: bool, threshold: u64) {
        self.buf.push(DECIDED);
        self.buf.extend_from_slice(trace);
        self.buf.push(u8::from(kept));
        self.buf.extend_from_slice(&threshold.to_le_bytes());
    }

    /// Journals that a kept trace's export was reported done.
    pub fn exported(&mut self, trace: &TraceId) {
        self.buf.push(EXPORTED);
        self.buf.extend_from_slice(trace);
    }

    /// A trace left memory for the sled store: once the store says it is durable
    /// ([`Journal::store_durable`]), the release is journaled and the trace lets its segments go.
    /// Until then the journal keeps bringing it back at a restart (the store then holds it too,
    /// and the engine keeps only what the store lacks).
    pub fn released(&mut self, trace: &TraceId, held: Held) {
        self.releases.push((*trace, held));
    }

    /// The sled store made everything written to it durable: the releases waiting for that are
    /// journaled (in the next group commit).
    pub fn store_durable(&mut self) {
        for (trace, held) in std::mem::take(&mut self.releases) {
            self.buf.push(RELEASED);
            self.buf.extend_from_slice(&trace);
            self.let_go(held);
        }
    }

    /// A trace no longer holds its segments (decided and dropped, exported, or released).
    pub fn let_go(&mut self, held: Held) {
        if let Some(s) = self.segments.get_mut(&held.first) {
            s.firsts = s.firsts.saturating_sub(1);
        }
        for id in held.first..=held.last {
            if let Some(s) = self.segments.get_mut(&id) {
                s.holders = s.holders.saturating_sub(1);
            }
        }
    }

    /// Whether releases wait for the store to be durable.
    #[must_use]
    pub fn needs_store_flush(&self) -> bool {
        !self.releases.is_empty()
    }

    /// Bytes waiting for the next group commit.
    #[must_use]
    pub fn buffered(&self) -> usize {
        self.buf.len() - FRAME_HEADER
    }

    /// Writes the buffered records as one frame, makes them durable as [`Sync`] says, starts a new
    /// segment if the active one is due, and removes the oldest segments nothing holds. On a write
    /// error the records are lost (counted; the traces are still decided from memory) and a new
    /// segment is started, so that a frame cut half-way is never followed by readable ones.
    pub fn commit(&mut self, now: u64) {
        if self.buffered() > 0 {
            let written = self.write_frame();
            self.buf.truncate(FRAME_HEADER);
            if let Err(e) = written {
                self.counts.write_errors += 1;
                tracing::warn!(error = %e, errors = self.counts.write_errors, "writing the tail journal");
                self.rotate(now);
            }
        }
        let active_bytes = self.segments.get(&self.active).map_or(0, |s| s.bytes);
        if active_bytes > MAGIC.len() as u64
            && (now.saturating_sub(self.active_since) >= SEGMENT_NS || active_bytes >= SEGMENT_BYTES)
        {
            self.rotate(now);
        }
        while let Some((&id, state)) = self.segments.first_key_value() {
            if id == self.active || state.holders > 0 {
                break;
            }
            self.remove(id);
        }
    }

    fn write_frame(&mut self) -> std::io::Result<()> {
        let (header, records) = self.buf.split_at_mut(FRAME_HEADER);
        let len = u32::try_from(records.len()).map_err(|_| std::io::Error::other("a group commit over 4 GiB"))?;
        header[..4].copy_from_slice(&len.to_le_bytes());
        header[4..].copy_from_slice(&crc32fast::hash(records).to_le_bytes());
        self.file.write_all(&self.buf)?;
        if self.sync == Sync::Data {
            self.file.sync_data()?;
        }
        if let Some(s) = self.segments.get_mut(&self.active) {
            s.bytes += self.buf.len() as u64;
        }
        Ok(())
    }

    fn rotate(&mut self, now: u64) {
        let Some(next) = self.active.checked_add(1) else {
            self.counts.write_errors += 1;
            return;
        };
        match create_segment(&self.dir, next, self.sync) {
            Ok(file) => {
                self.file = file;
                self.active = next;
                self.active_since = now;
                self.segments.insert(next, SegmentState { holders: 0, firsts: 0, bytes: MAGIC.len() as u64 });
            }
            Err(e) => {
                self.counts.write_errors += 1;
                tracing::warn!(error = %e, "starting a tail journal segment");
            }
        }
    }

    fn remove(&mut self, id: u32) {
        self.segments.remove(&id);
        let path = segment_path(&self.dir, id);
        if let Err(e) = std::fs::remove_file(&path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(error = %e, file = %path.display(), "removing a tail journal segment");
        }
    }

    /// Removes the segments read at replay, once what they held is committed again: unless a write
    /// failed since the journal was opened (then they stay, the only copy, for the next start).
    pub fn retire_replayed(&mut self) {
        if self.counts.write_errors > 0 {
            return;
        }
        for (id, _) in std::mem::take(&mut self.replayed) {
            if self.segments.contains_key(&id) {
                continue;
            }
            let path = segment_path(&self.dir, id);
            if let Err(e) = std::fs::remove_file(&path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(error = %e, file = %path.display(), "removing a replayed tail journal segment");
            }
        }
    }

    /// Over the disk bound: removes the oldest segment (not the active one) whatever holds it;
    /// returns the bytes freed (0: nothing left to remove). The traces holding it are still
    /// decided from memory, but a crash would lose them: counted.
    pub fn drop_oldest(&mut self) -> u64 {
        let Some((&id, &state)) = self.segments.first_key_value() else { return 0 };
        if id == self.active {
            return 0;
        }
        self.counts.dropped_traces += state.firsts;
        self.remove(id);
        state.bytes
    }

    /// Bytes the journal's segments hold on disk.
    #[must_use]
    pub fn disk_bytes(&self) -> u64 {
        self.segments.values().map(|s| s.bytes).sum::<u64>() + self.replayed.iter().map(|(_, b)| b).sum::<u64>()
    }

    #[must_use]
    pub fn counts(&self) -> Counts {
        self.counts
    }
}

fn create_segment(dir: &Path, id: u32, sync: Sync) -> std::io::Result<File> {
    let path = segment_path(dir, id);
    let mut file = std::fs::OpenOptions::new().create(true).truncate(true).write(true).open(&path)?;
    file.write_all(MAGIC)?;
    if sync == Sync::Data {
        file.sync_data()?;
        // The new name must survive a power loss too.
        File::open(dir)?.sync_all()?;
    }
    Ok(file)
}

fn quarantine(dir: &Path, path: &Path) -> std::io::Result<()> {
    let aside = dir.join("quarantine");
    std::fs::create_dir_all(&aside)?;
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("segment");
    std::fs::rename(path, aside.join(format!("{stamp}-{name}")))?;
    let mut kept: Vec<PathBuf> = std::fs::read_dir(&aside)?.filter_map(Result::ok).map(|e| e.path()).collect();
    // Names start with the time they were set aside: newest last.
    kept.sort_unstable();
    let excess = kept.len().saturating_sub(KEEP_QUARANTINED);
    for old in kept.into_iter().take(excess) {
        std::fs::remove_file(old)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T1: TraceId = [1; 16];
    const T2: TraceId = [2; 16];
    const T3: TraceId = [3; 16];

    fn open(dir: &Path) -> (Journal, Replayed) {
        Journal::open(dir, Sync::None, 0).expect("open")
    }

    fn segments(dir: &Path) -> Vec<u32> {
        let mut ids: Vec<u32> =
            std::fs::read_dir(dir).unwrap().filter_map(|e| segment_id(e.unwrap().file_name().to_str()?)).collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn a_replay_sorts_traces_by_what_their_records_said() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, replayed) = open(dir.path());
        assert_eq!(replayed, Replayed::default());
        j.fragment(&T1, 10, 0, b"one", None);
        let h2 = j.fragment(&T2, 20, 25, b"two", None);
        let h3 = j.fragment(&T3, 30, 35, b"three", None);
        j.fragment(&T1, 11, 15, b"+more", Some(h2));
        j.decided(&T2, true, 7);
        j.decided(&T3, false, 0);
        j.let_go(h3);
        j.commit(1);
        j.decided(&T1, true, 0);
        assert!(j.buffered() > 0, "never written: lost with the process");
        drop(j);
        let (_, replayed) = open(dir.path());
        assert_eq!(
            replayed.undecided,
            vec![ReplayedTrace { trace: T1, first_seen: 10, root_ended: 15, spans: b"one+more".to_vec() }]
        );
        assert_eq!(
            replayed.unexported,
            vec![(ReplayedTrace { trace: T2, first_seen: 20, root_ended: 25, spans: b"two".to_vec() }, 7)]
        );
        assert_eq!(replayed.decided, vec![(T3, false, 0)]);
    }

    #[test]
    fn exported_and_released_traces_are_not_brought_back() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _) = open(dir.path());
        j.fragment(&T1, 10, 10, b"a", None);
        let held = j.fragment(&T2, 10, 10, b"b", None);
        j.decided(&T1, true, 0);
        j.exported(&T1);
        j.released(&T2, held);
        assert!(j.needs_store_flush());
        j.commit(1);
        drop(j);
        let (mut j, replayed) = open(dir.path());
        assert_eq!(replayed.undecided.len(), 1, "the store was not durable yet: the release waits");
        j.released(&T2, Held { first: 2, last: 2 });
        j.store_durable();
        assert!(!j.needs_store_flush());
        j.commit(2);
        j.retire_replayed();
        drop(j);
        let (_, replayed) = open(dir.path());
        assert!(replayed.undecided.is_empty() && replayed.unexported.is_empty());
        assert_eq!(replayed.decided, vec![]);
    }

    #[test]
    fn an_export_reported_after_a_newer_part_began_marks_the_part_it_was_for() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _) = open(dir.path());
        j.fragment(&T1, 10, 10, b"first", None);
        j.decided(&T1, true, 0);
        j.fragment(&T1, 20, 20, b"second", None);
        j.exported(&T1);
        j.decided(&T1, true, 0);
        j.commit(1);
        drop(j);
        let (_, replayed) = open(dir.path());
        let resent: Vec<&[u8]> = replayed.unexported.iter().map(|(r, _)| r.spans.as_slice()).collect();
        assert_eq!(resent, vec![b"second".as_slice()], "the first part was reported; the second must go again");
    }

    #[test]
    fn only_names_the_journal_writes_are_segments() {
        for name in ["0000000A.seg", "+000000a.seg", "0000000a.seg.tmp", "000000a.seg", "0000000g.seg"] {
            assert_eq!(segment_id(name), None, "{name}");
        }
        assert_eq!(segment_id("0000000a.seg"), Some(10));
    }

    #[test]
    fn spans_after_a_decision_start_a_new_part_and_the_first_is_still_re_exported() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _) = open(dir.path());
        j.fragment(&T1, 10, 10, b"a", None);
        j.decided(&T1, true, 3);
        j.fragment(&T1, 50, 0, b"late", None);
        j.commit(1);
        drop(j);
        let (_, replayed) = open(dir.path());
        assert_eq!(replayed.unexported.len(), 1);
        assert_eq!(replayed.unexported[0].0.spans, b"a");
        assert_eq!(replayed.undecided.len(), 1);
        assert_eq!(replayed.undecided[0].spans, b"late");
    }

    #[test]
    fn segments_are_removed_oldest_first_once_nothing_holds_them() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _) = open(dir.path());
        let old = j.fragment(&T1, 0, 0, b"a", None);
        j.commit(0);
        j.commit(SEGMENT_NS);
        let newer = j.fragment(&T2, SEGMENT_NS, 0, b"b", None);
        j.commit(SEGMENT_NS);
        j.commit(2 * SEGMENT_NS);
        assert_eq!(segments(dir.path()), vec![1, 2, 3]);
        j.let_go(newer);
        j.decided(&T2, false, 0);
        j.commit(2 * SEGMENT_NS);
        assert_eq!(segments(dir.path()), vec![1, 2, 3], "the oldest is still held: nothing after it goes");
        j.let_go(old);
        j.commit(2 * SEGMENT_NS);
        assert_eq!(segments(dir.path()), vec![3], "the active segment stays");
    }

    #[test]
    fn a_trace_holds_every_segment_from_its_first_spans_to_its_last() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _) = open(dir.path());
        let held = j.fragment(&T1, 0, 0, b"a", None);
        j.commit(SEGMENT_NS);
        j.fragment(&T2, 0, 0, b"x", None);
        j.commit(2 * SEGMENT_NS);
        j.commit(3 * SEGMENT_NS);
        assert_eq!(segments(dir.path()), vec![1, 2, 3], "an empty segment is not rotated");
        let held = j.fragment(&T1, 0, 1, b"b", Some(held));
        assert_eq!(held, Held { first: 1, last: 3 });
        assert_eq!(j.segments.values().map(|s| s.holders).collect::<Vec<_>>(), vec![1, 2, 1]);
        j.let_go(held);
        j.commit(4 * SEGMENT_NS);
        assert_eq!(segments(dir.path()), vec![2, 3, 4], "segment 2 is still held by the other trace");
    }

    #[test]
    fn the_disk_bound_drops_the_oldest_segment_and_counts_what_held_it() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _) = open(dir.path());
        let held = j.fragment(&T1, 0, 0, &[7; 100], None);
        j.commit(SEGMENT_NS);
        assert!(j.disk_bytes() > 100);
        assert!(j.drop_oldest() > 100);
        assert_eq!(j.drop_oldest(), 0, "never the active segment");
        assert_eq!(j.counts().dropped_traces, 1);
        j.let_go(held);
        assert_eq!(segments(dir.path()), vec![2]);
    }

    #[test]
    fn a_damaged_segment_keeps_what_came_before_and_is_set_aside_a_cut_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _) = open(dir.path());
        j.fragment(&T1, 10, 0, b"first", None);
        j.commit(0);
        j.fragment(&T2, 20, 0, b"second", None);
        j.commit(0);
        // Segment 2 starts, empty.
        j.commit(SEGMENT_NS);
        drop(j);
        let path = segment_path(dir.path(), 1);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        // A cut frame in the next segment.
        let mut cut = std::fs::read(segment_path(dir.path(), 2)).unwrap();
        cut.extend_from_slice(&100u32.to_le_bytes());
        std::fs::write(segment_path(dir.path(), 2), &cut).unwrap();
        let (j, replayed) = open(dir.path());
        assert_eq!(replayed.undecided.len(), 1, "the frame before the damage counts");
        assert_eq!(replayed.undecided[0].trace, T1);
        assert_eq!((j.counts().quarantined, replayed.torn), (1, 1));
        assert_eq!(std::fs::read_dir(dir.path().join("quarantine")).unwrap().count(), 1);
    }

    /// A journal holding one undecided trace, reopened: the segment it was in is replayed.
    fn reopened_with_one_trace(dir: &Path) -> Journal {
        let (mut j, _) = open(dir);
        j.fragment(&T1, 10, 0, b"a", None);
        j.commit(0);
        drop(j);
        let (j, replayed) = open(dir);
        assert_eq!(replayed.undecided.len(), 1);
        assert_eq!(segments(dir), vec![1, 2]);
        j
    }

    #[test]
    fn replayed_segments_go_only_when_retired() {
        let dir = tempfile::tempdir().unwrap();
        let mut j = reopened_with_one_trace(dir.path());
        j.retire_replayed();
        assert_eq!(segments(dir.path()), vec![2]);
    }

    #[test]
    fn after_a_write_error_the_replayed_segments_stay_for_the_next_start() {
        let dir = tempfile::tempdir().unwrap();
        let mut j = reopened_with_one_trace(dir.path());
        j.counts.write_errors = 1;
        j.retire_replayed();
        drop(j);
        assert_eq!(open(dir.path()).1.undecided.len(), 1, "still there");
    }

    /// A trace's parts in the model test (decision, exported), and whether the last is still open.
    type ModelParts = (Vec<(Option<bool>, bool)>, bool);

    proptest! {
        /// Model: whatever sequence of records is journaled and committed, a replay classifies each
        /// part of each trace as its records say (a part begins with spans after a decision; an
        /// export report is for the latest kept part not yet reported; a release ends the part).
        #[test]
        fn replay_agrees_with_a_model(ops in proptest::collection::vec((0u8..4, 0u8..3, any::<bool>()), 0..48)) {
            let dir = tempfile::tempdir().unwrap();
            let (mut j, _) = open(dir.path());
            // Per trace: its parts (decision, exported), and whether the last one is still open.
            let mut model: BTreeMap<u8, ModelParts> = BTreeMap::new();
            for (op, t, kept) in ops {
                let trace = [t + 1; 16];
                let (parts, open_part) = model.entry(t).or_default();
                match op {
                    0 => {
                        j.fragment(&trace, 1, 0, &[t], None);
                        let appends = *open_part && parts.last().is_some_and(|p| p.0.is_none());
                        if !appends {
                            parts.push((None, false));
                            *open_part = true;
                        }
                    }
                    1 if *open_part && parts.last().is_some_and(|p| p.0.is_none()) => {
                        j.decided(&trace, kept, 0);
                        parts.last_mut().unwrap().0 = Some(kept);
                    }
                    2 => {
                        if let Some(p) = parts.iter_mut().rev().find(|p| p.0 == Some(true) && !p.1) {
                            j.exported(&trace);
                            p.1 = true;
                        }
                    }
                    3 if *open_part => {
                        j.released(&trace, Held { first: 1, last: 1 });
                        j.store_durable();
                        parts.pop();
                        *open_part = false;
                    }
                    _ => {}
                }
            }
            j.commit(0);
            drop(j);
            let (_, replayed) = open(dir.path());
            let mut undecided: Vec<u8> = Vec::new();
            let mut unexported: Vec<u8> = Vec::new();
            for (t, (parts, _)) in &model {
                undecided.extend(parts.iter().filter(|p| p.0.is_none()).map(|_| t + 1));
                unexported.extend(parts.iter().filter(|p| p.0 == Some(true) && !p.1).map(|_| t + 1));
            }
            let mut got_undecided: Vec<u8> = replayed.undecided.iter().map(|r| r.trace[0]).collect();
            let mut got_unexported: Vec<u8> = replayed.unexported.iter().map(|(r, _)| r.trace[0]).collect();
            got_undecided.sort_unstable();
            got_unexported.sort_unstable();
            prop_assert_eq!(got_undecided, undecided);
            prop_assert_eq!(got_unexported, unexported);
        }
    }
}

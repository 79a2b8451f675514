//! The [`TailStore`] on sled: see the crate note for the layout and invariants.
//!
//! Durability: sled writes through its own log and makes writes durable every
//! [`SledOptions::flush_every_ms`]; after a crash it recovers a prefix of the writes. A trace whose
//! spans were appended but not flushed when the agent died is therefore lost whole or in part; a
//! decision batch is one write, in the prefix or not.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use crate::{
    AppendedFragment, DecisionRecord, Fragment, OutboxEntry, Outcome, Partition, PendingRuns, Recovered, SpanRange,
    StoreError, TailStore, TraceId, covered,
};

/// The version of the layout below (the crate note): bump it with any change to a key or value.
pub const FORMAT: u32 = 1;
const META_TREE: &str = "meta";
const FORMAT_KEY: &[u8] = b"format";
const STATE_TREE: &str = "state";
const SPANS_TREE_PREFIX: &str = "spans/";
const DECISIONS_TREE: &str = "decisions";
const EXPORTED: u8 = b'E';
const EXPORTED_LEN: usize = 9;
/// Partition, trace id, sequence, outcome, threshold, first and last append.
const DECISION_LEN: usize = 8 + 16 + 8 + 1 + 8 + 8 + 8;
/// Bytes of fragments grouped into one sled value. Bigger groups cost fewer inserts. sled writes
/// a node over 128 KiB (a quarter of its 512 KiB segment) as a separate blob file, which a full
/// leaf (16 values) of these groups is; smaller groups avoid the blobs but measured worse at scale
/// (6 KiB groups: 600 000 spans/s per core for 1 million spans, 157 000 and a 2 GiB peak RSS for 5
/// million), so the blobs stay.
pub const GROUP_BYTES: usize = 32 * 1024;
/// Trace id, first seen, root ended, span count.
const FRAGMENT_HEADER: usize = 16 + 8 + 8 + 4;
const DROPPED: u8 = 0;
const KEPT: u8 = 1;

/// sled's tuning knobs that matter for a tail buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SledOptions {
    /// Bytes of sled's page cache (sled's default is 1 GiB, far more than a node agent may take).
    pub cache_bytes: u64,
    /// How often sled makes writes durable; a crash loses at most this much.
    pub flush_every_ms: u64,
}

impl Default for SledOptions {
    fn default() -> Self {
        Self { cache_bytes: 64 * 1024 * 1024, flush_every_ms: 200 }
    }
}

/// Sequence numbers that grow across restarts: a persistent epoch from sled's `generate_id` (plus
/// one, so that no sequence number is 0), taken at open and again whenever the 32-bit counter under
/// it runs out.
#[derive(Debug)]
struct Sequence {
    epoch: u64,
    next: u32,
}

impl Sequence {
    fn new(db: &sled::Db) -> Result<Self, StoreError> {
        Ok(Self { epoch: db.generate_id()? + 1, next: 0 })
    }

    fn next(&mut self, db: &sled::Db) -> Result<u64, StoreError> {
        if self.next == u32::MAX {
            *self = Self::new(db)?;
        }
        let seq = (self.epoch << 32) | u64::from(self.next);
        self.next += 1;
        Ok(seq)
    }
}

#[derive(Debug)]
pub struct SledStore {
    db: sled::Db,
    /// Exported markers of kept traces.
    state: sled::Tree,
    /// Decision batches: one value per commit.
    decision_log: sled::Tree,
    partitions: HashMap<Partition, sled::Tree>,
    appends: Sequence,
    decisions: Sequence,
    batches: Sequence,
    /// Decisions made since the last commit.
    uncommitted: Vec<DecisionRecord>,
}

impl SledStore {
    /// Opens (or creates) the store in `dir`. An existing store is reopened as it was left.
    pub fn open(dir: &Path, options: SledOptions) -> Result<Self, StoreError> {
        let db = sled::Config::new()
            .path(dir)
            .cache_capacity(options.cache_bytes)
            .flush_every_ms(Some(options.flush_every_ms))
            .open()?;
        check_format(&db)?;
        let state = db.open_tree(STATE_TREE)?;
        let decision_log = db.open_tree(DECISIONS_TREE)?;
        let appends = Sequence::new(&db)?;
        let decisions = Sequence::new(&db)?;
        let batches = Sequence::new(&db)?;
        Ok(Self {
            db,
            state,
            decision_log,
            partitions: HashMap::new(),
            appends,
            decisions,
            batches,
            uncommitted: Vec::new(),
        })
    }

    fn partition_tree(&mut self, partition: Partition) -> Result<&sled::Tree, StoreError> {
        if !self.partitions.contains_key(&partition) {
            let tree = self.db.open_tree(partition_name(partition))?;
            self.partitions.insert(partition, tree);
        }
        Ok(&self.partitions[&partition])
    }
}

/// Checks the store's recorded layout version, recording it on a store that has none (a new one,
/// or one written before versions were recorded, which used version 1's layout).
fn check_format(db: &sled::Db) -> Result<(), StoreError> {
    let meta = db.open_tree(META_TREE)?;
    match meta.get(FORMAT_KEY)? {
        None => {
            meta.insert(FORMAT_KEY, &FORMAT.to_be_bytes())?;
            Ok(())
        }
        Some(v) => {
            let found = <[u8; 4]>::try_from(v.as_ref())
                .map(u32::from_be_bytes)
                .map_err(|_| StoreError::Corrupt { what: "format version", len: v.len() })?;
            if found == FORMAT { Ok(()) } else { Err(StoreError::Version { found, expected: FORMAT }) }
        }
    }
}

fn partition_name(partition: Partition) -> String {
    format!("{SPANS_TREE_PREFIX}{partition:016x}")
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(bytes[at..at + 8].try_into().expect("caller checked the length"))
}

/// The state tree's key of a trace: partition first, so new traces cluster at the right edge.
fn state_key(partition: Partition, trace: &TraceId) -> [u8; 24] {
    let mut k = [0u8; 24];
    k[..8].copy_from_slice(&partition.to_be_bytes());
    k[8..].copy_from_slice(trace);
    k
}

fn decode_state_key(k: &[u8]) -> Result<(Partition, TraceId), StoreError> {
    if k.len() != 24 {
        return Err(StoreError::Corrupt { what: "trace key", len: k.len() });
    }
    Ok((u64_at(k, 0), k[8..].try_into().expect("16 bytes")))
}

fn encode_decision(d: &DecisionRecord, out: &mut Vec<u8>) {
    out.extend_from_slice(&d.spans.partition.to_be_bytes());
    out.extend_from_slice(&d.trace);
    out.extend_from_slice(&d.seq.to_be_bytes());
    let (kind, threshold) = match d.outcome {
        Outcome::Kept { threshold } => (KEPT, threshold),
        Outcome::Dropped => (DROPPED, 0),
    };
    out.push(kind);
    out.extend_from_slice(&threshold.to_be_bytes());
    out.extend_from_slice(&d.spans.first.to_be_bytes());
    out.extend_from_slice(&d.spans.last.to_be_bytes());
}

/// Every decision of each decided trace in each partition, in decision order.
type Decisions = BTreeMap<(Partition, TraceId), Vec<DecisionRecord>>;

/// Decisions per value of the log: a full leaf (16 values) stays under the 128 KiB at which sled
/// writes a node as a blob file of its own.
const DECISIONS_PER_VALUE: usize = 120;

/// Splits a decision batch into its records.
fn decode_decisions(v: &[u8]) -> Result<Vec<DecisionRecord>, StoreError> {
    if !v.len().is_multiple_of(DECISION_LEN) {
        return Err(StoreError::Corrupt { what: "decision batch", len: v.len() });
    }
    v.chunks_exact(DECISION_LEN)
        .map(|r| {
            let partition = u64_at(r, 0);
            let outcome = match r[32] {
                KEPT => Outcome::Kept { threshold: u64_at(r, 33) },
                DROPPED => Outcome::Dropped,
                _ => return Err(StoreError::Corrupt { what: "decision batch", len: v.len() }),
            };
            Ok(DecisionRecord {
                seq: u64_at(r, 24),
                trace: r[8..24].try_into().expect("16 bytes"),
                spans: SpanRange { partition, first: u64_at(r, 41), last: u64_at(r, 49) },
                outcome,
            })
        })
        .collect()
}

/// The exported marker of a kept trace: the latest of its decisions reported exported.
fn decode_exported(v: &[u8]) -> Result<u64, StoreError> {
    match (v.first(), v.len()) {
        (Some(&EXPORTED), EXPORTED_LEN) => Ok(u64_at(v, 1)),
        _ => Err(StoreError::Corrupt { what: "exported marker", len: v.len() }),
    }
}

fn encode_fragment(f: &Fragment<'_>, out: &mut Vec<u8>) {
    out.extend_from_slice(&f.trace);
    out.extend_from_slice(&f.first_seen_unix_ns.to_be_bytes());
    // 0 means "not ended": a root span cannot end at the epoch.
    out.extend_from_slice(&f.root_ended_unix_ns.unwrap_or(0).to_be_bytes());
    out.extend_from_slice(&(f.spans.len() as u32).to_be_bytes());
    for span in f.spans {
        out.extend_from_slice(&(span.len() as u32).to_be_bytes());
        out.extend_from_slice(span);
    }
}

/// A fragment read back: trace, first seen, root ended, and its spans, still length-prefixed.
struct StoredFragment<'v> {
    trace: TraceId,
    first_seen: u64,
    root_ended: Option<u64>,
    count: u32,
    spans: &'v [u8],
}

impl<'v> StoredFragment<'v> {
    /// The spans' bytes (the group was checked when it was split).
    fn spans(&self) -> impl Iterator<Item = &'v [u8]> {
        let mut rest = self.spans;
        (0..self.count).map(move |_| {
            let len = u32::from_be_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
            let span = &rest[4..4 + len];
            rest = &rest[4 + len..];
            span
        })
    }
}

/// Splits a group value into its fragments, checking every length; allocates nothing.
fn fragments(mut v: &[u8]) -> impl Iterator<Item = Result<StoredFragment<'_>, StoreError>> {
    std::iter::from_fn(move || {
        if v.is_empty() {
            return None;
        }
        let corrupt = StoreError::Corrupt { what: "span group", len: v.len() };
        let Some(header) = v.get(..FRAGMENT_HEADER) else {
            v = &[];
            return Some(Err(corrupt));
        };
        let count = u32::from_be_bytes(header[32..36].try_into().expect("4 bytes"));
        let mut end = FRAGMENT_HEADER;
        for _ in 0..count {
            let Some(len) = v.get(end..end + 4).map(|l| u32::from_be_bytes(l.try_into().expect("4 bytes")) as usize)
            else {
                v = &[];
                return Some(Err(corrupt));
            };
            end += 4 + len;
            if end > v.len() {
                v = &[];
                return Some(Err(corrupt));
            }
        }
        let ended = u64_at(header, 24);
        let fragment = StoredFragment {
            trace: header[..16].try_into().expect("16 bytes"),
            first_seen: u64_at(header, 16),
            root_ended: (ended != 0).then_some(ended),
            count,
            spans: &v[FRAGMENT_HEADER..end],
        };
        v = &v[end..];
        Some(Ok(fragment))
    })
}

impl SledStore {
    /// Every decision of every decided trace, per partition and trace, in decision order (the log's
    /// batches are in that order, and the uncommitted decisions come after them).
    fn all_decisions(&self) -> Result<Decisions, StoreError> {
        let mut all = Decisions::new();
        for batch in self.decision_log.iter().values() {
            for d in decode_decisions(&batch?)? {
                all.entry((d.spans.partition, d.trace)).or_default().push(d);
            }
        }
        for d in &self.uncommitted {
            all.entry((d.spans.partition, d.trace)).or_default().push(*d);
        }
        Ok(all)
    }

    fn existing_partition(&self, partition: Partition) -> Result<Option<sled::Tree>, StoreError> {
        if let Some(t) = self.partitions.get(&partition) {
            return Ok(Some(t.clone()));
        }
        let name = partition_name(partition);
        if self.db.tree_names().iter().any(|n| n.as_ref() == name.as_bytes()) {
            return Ok(Some(self.db.open_tree(name)?));
        }
        Ok(None)
    }
}

impl SledStore {
    /// Every span the store holds of each trace (as appended), decided or not, in every live
    /// partition: what a crash left on disk, for inspection tools (the crash test's
    /// `tail-store-dump`), whatever the decisions say of it.
    pub fn stored_spans(&self) -> Result<BTreeMap<TraceId, Vec<Vec<u8>>>, StoreError> {
        let mut out: BTreeMap<TraceId, Vec<Vec<u8>>> = BTreeMap::new();
        for name in self.db.tree_names() {
            if !name.starts_with(SPANS_TREE_PREFIX.as_bytes()) {
                continue;
            }
            for value in self.db.open_tree(name)?.iter().values() {
                for f in fragments(&value?) {
                    let f = f?;
                    out.entry(f.trace).or_default().extend(f.spans().map(<[u8]>::to_vec));
                }
            }
        }
        Ok(out)
    }

    /// The values of one append, each fragment in the value it lands in; `written` gets the key of
    /// every value written, for [`TailStore::append`] to take back on an error.
    fn append_values(
        &mut self,
        partition: Partition,
        fragments: &[Fragment<'_>],
        written: &mut Vec<u64>,
    ) -> Result<Vec<u64>, StoreError> {
        let mut seqs = Vec::with_capacity(fragments.len());
        let mut group = Vec::with_capacity(GROUP_BYTES + 4096);
        let mut seq = self.appends.next(&self.db)?;
        for (i, fragment) in fragments.iter().enumerate() {
            encode_fragment(fragment, &mut group);
            seqs.push(seq);
            if group.len() >= GROUP_BYTES || i + 1 == fragments.len() {
                self.partition_tree(partition)?.insert(seq.to_be_bytes(), std::mem::take(&mut group))?;
                written.push(seq);
                if i + 1 < fragments.len() {
                    seq = self.appends.next(&self.db)?;
                    group = Vec::with_capacity(GROUP_BYTES + 4096);
                }
            }
        }
        Ok(seqs)
    }
}

impl TailStore for SledStore {
    fn append(&mut self, partition: Partition, fragments: &[Fragment<'_>]) -> Result<Vec<u64>, StoreError> {
        let mut written = Vec::new();
        let result = self.append_values(partition, fragments, &mut written);
        if result.is_err() {
            // All or nothing: the caller takes the whole append as refused (and keeps its traces
            // elsewhere), so the values already written go (best effort: one whose removal fails
            // too is met again by the next start's recovery).
            if let Some(tree) = self.partitions.get(&partition) {
                for key in written {
                    let _ = tree.remove(u64::to_be_bytes(key));
                }
            }
        }
        result
    }

    fn spans(&self, trace: &TraceId, range: &SpanRange) -> Result<Vec<Vec<u8>>, StoreError> {
        let Some(tree) = self.existing_partition(range.partition)? else { return Ok(Vec::new()) };
        let mut out = Vec::new();
        let (first, last) = (range.first.to_be_bytes(), range.last.max(range.first).to_be_bytes());
        for value in tree.range(first..=last).values() {
            let value = value?;
            for fragment in fragments(&value) {
                let fragment = fragment?;
                if fragment.trace == *trace {
                    out.extend(fragment.spans().map(<[u8]>::to_vec));
                }
            }
        }
        Ok(out)
    }

    fn fragments(&self, partition: Partition, seq: u64) -> Result<Vec<AppendedFragment>, StoreError> {
        let Some(tree) = self.existing_partition(partition)? else { return Ok(Vec::new()) };
        let Some(value) = tree.get(seq.to_be_bytes())? else { return Ok(Vec::new()) };
        fragments(&value)
            .map(|f| {
                let f = f?;
                Ok(AppendedFragment {
                    trace: f.trace,
                    first_seen_unix_ns: f.first_seen,
                    root_ended_unix_ns: f.root_ended,
                    spans: f.spans().map(<[u8]>::to_vec).collect(),
                })
            })
            .collect()
    }

    fn decide(&mut self, trace: &TraceId, spans: &SpanRange, outcome: Outcome) -> Result<u64, StoreError> {
        let seq = self.decisions.next(&self.db)?;
        self.uncommitted.push(DecisionRecord { seq, trace: *trace, spans: *spans, outcome });
        Ok(seq)
    }

    fn commit(&mut self) -> Result<(), StoreError> {
        if self.uncommitted.is_empty() {
            return Ok(());
        }
        for chunk in self.uncommitted.chunks(DECISIONS_PER_VALUE) {
            let mut batch = Vec::with_capacity(chunk.len() * DECISION_LEN);
            for d in chunk {
                encode_decision(d, &mut batch);
            }
            let key = self.batches.next(&self.db)?;
            self.decision_log.insert(key.to_be_bytes(), batch)?;
        }
        self.uncommitted.clear();
        Ok(())
    }

    fn exported(&mut self, trace: &TraceId, partition: Partition, seq: u64) -> Result<(), StoreError> {
        let key = state_key(partition, trace);
        // The marker only grows: it says every kept decision up to it was exported.
        if let Some(v) = self.state.get(key)?
            && decode_exported(&v)? >= seq
        {
            return Ok(());
        }
        let mut marker = [EXPORTED; EXPORTED_LEN];
        marker[1..].copy_from_slice(&seq.to_be_bytes());
        self.state.insert(key, &marker[..])?;
        Ok(())
    }

    fn forget_decisions(&mut self, up_to: u64) -> Result<(), StoreError> {
        self.commit()?;
        // Batches are in decision order: forget from the oldest until a batch holds newer ones.
        for entry in &self.decision_log {
            let (key, value) = entry?;
            let records = decode_decisions(&value)?;
            let (old, keep): (Vec<_>, Vec<_>) = records.into_iter().partition(|d| d.seq <= up_to);
            // Only kept traces have exported markers; one that names no decision left goes (the
            // trace's decisions after it, if any, are newer: in the outbox without it too).
            for d in old.iter().filter(|d| matches!(d.outcome, Outcome::Kept { .. })) {
                let marker = state_key(d.spans.partition, &d.trace);
                if let Some(v) = self.state.get(marker)?
                    && decode_exported(&v)? <= up_to
                {
                    self.state.remove(marker)?;
                }
            }
            if keep.is_empty() {
                self.decision_log.remove(key)?;
                continue;
            }
            if !old.is_empty() {
                let mut rest = Vec::with_capacity(keep.len() * DECISION_LEN);
                for d in &keep {
                    encode_decision(d, &mut rest);
                }
                self.decision_log.insert(key, rest)?;
            }
            break;
        }
        Ok(())
    }

    fn drop_partition(&mut self, partition: Partition) -> Result<(), StoreError> {
        self.partitions.remove(&partition);
        self.db.drop_tree(partition_name(partition))?;
        Ok(())
    }

    fn recover(&self) -> Result<Recovered, StoreError> {
        let mut out = Recovered::default();
        let mut exported: HashMap<(Partition, TraceId), u64> = HashMap::new();
        for entry in &self.state {
            let (k, v) = entry?;
            exported.insert(decode_state_key(&k)?, decode_exported(&v)?);
        }
        let decisions = self.all_decisions()?;
        for (key, of_trace) in &decisions {
            let marker = exported.get(key).copied().unwrap_or(0);
            out.decisions.extend(of_trace.iter().copied());
            out.outbox.extend(of_trace.iter().filter(|d| d.seq > marker).filter_map(OutboxEntry::of));
        }
        out.decisions.sort_by_key(|d| d.seq);
        for name in self.db.tree_names() {
            let Some(hex) = name.strip_prefix(SPANS_TREE_PREFIX.as_bytes()) else { continue };
            let partition = std::str::from_utf8(hex)
                .ok()
                .and_then(|h| u64::from_str_radix(h, 16).ok())
                .ok_or(StoreError::Corrupt { what: "partition name", len: name.len() })?;
            out.partitions.push(partition);
        }
        out.partitions.sort_unstable();
        let mut pending = PendingRuns::default();
        for &partition in &out.partitions {
            let tree = self.db.open_tree(partition_name(partition))?;
            for entry in &tree {
                let (k, v) = entry?;
                let key: [u8; 8] =
                    k.as_ref().try_into().map_err(|_| StoreError::Corrupt { what: "append key", len: k.len() })?;
                let seq = u64::from_be_bytes(key);
                for f in fragments(&v) {
                    let f = f?;
                    let covered = decisions.get(&(partition, f.trace)).is_some_and(|of| covered(of, seq));
                    pending.fragment(partition, f.trace, seq, f.first_seen, f.root_ended, covered);
                }
            }
        }
        out.pending = pending.into_sorted();
        Ok(out)
    }

    fn flush(&mut self) -> Result<(), StoreError> {
        self.commit()?;
        self.db.flush()?;
        Ok(())
    }

    fn disk_bytes(&self) -> u64 {
        self.db.size_on_disk().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opens the store in `dir`. A store just dropped may still hold its file lock for a moment
    /// (sled's flusher thread lets go of it last), so a lock refusal is tried again, for 10 s at
    /// most; any other outcome is returned.
    fn try_open(dir: &Path) -> Result<SledStore, StoreError> {
        for _ in 0..500 {
            match SledStore::open(dir, SledOptions::default()) {
                Err(e) if e.to_string().contains("could not acquire lock") => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                opened => return opened,
            }
        }
        panic!("the store in {} stayed locked", dir.display());
    }

    fn open(dir: &Path) -> SledStore {
        try_open(dir).unwrap()
    }

    fn fragment<'a>(trace: u8, first_seen: u64, root_ended: Option<u64>, spans: &'a [&'a [u8]]) -> Fragment<'a> {
        Fragment { trace: [trace; 16], first_seen_unix_ns: first_seen, root_ended_unix_ns: root_ended, spans }
    }

    #[test]
    fn a_store_of_another_format_is_refused_and_a_bad_record_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = open(dir.path());
            s.db.open_tree(META_TREE).unwrap().insert(FORMAT_KEY, &2u32.to_be_bytes()).unwrap();
            s.db.flush().unwrap();
        }
        match try_open(dir.path()) {
            Err(StoreError::Version { found: 2, expected: FORMAT }) => {}
            other => panic!("a store of format 2 must be refused: {other:?}"),
        }
        let dir = tempfile::tempdir().unwrap();
        let mut s = open(dir.path());
        s.append(3, &[fragment(1, 5, None, &[b"a"])]).unwrap();
        // A value that does not decode as fragments, as a torn or foreign write would leave it.
        s.partition_tree(3).unwrap().insert(u64::MAX.to_be_bytes(), &b"\xff\xff garbage"[..]).unwrap();
        assert!(matches!(s.recover(), Err(StoreError::Corrupt { .. })), "recovery must report it, not skip it");
    }

    #[test]
    fn reopens_what_was_written() {
        let dir = tempfile::tempdir().unwrap();
        let (kept, seq) = {
            let mut s = open(dir.path());
            s.decide(&[7; 16], &SpanRange::one(3, 1), Outcome::Dropped).unwrap();
            s.commit().unwrap();
            s.append(3, &[fragment(1, 5, None, &[b"a", b"b"]), fragment(2, 6, Some(7), &[b"c"])]).unwrap();
            let later = s.append(3, &[fragment(1, 8, Some(9), &[b"d"])]).unwrap();
            assert_eq!(later.len(), 1);
            let recovered = s.recover().unwrap();
            let kept = recovered.pending.iter().find(|(t, _)| *t == [2; 16]).unwrap().1.spans;
            let seq = s.decide(&[2; 16], &kept, Outcome::Kept { threshold: 7 }).unwrap();
            s.flush().unwrap();
            (kept, seq)
        };
        let s = open(dir.path());
        let r = s.recover().unwrap();
        assert_eq!(r.pending.len(), 1);
        let (trace, pending) = r.pending[0];
        assert_eq!(trace, [1; 16]);
        assert_eq!((pending.first_seen_unix_ns, pending.root_ended_unix_ns), (5, Some(9)), "fragments merged");
        let decision = DecisionRecord { seq, trace: [2; 16], spans: kept, outcome: Outcome::Kept { threshold: 7 } };
        assert_eq!(r.decisions.len(), 2);
        assert_eq!(r.decisions[1], decision);
        assert_eq!(r.outbox, vec![OutboxEntry { trace: [2; 16], seq, spans: kept, threshold: 7 }]);
        assert_eq!(r.partitions, vec![3]);
        let want: Vec<Vec<u8>> = vec![b"a".to_vec(), b"b".to_vec(), b"d".to_vec()];
        assert_eq!(s.spans(&[1; 16], &pending.spans).unwrap(), want);
        assert_eq!(s.spans(&[2; 16], &kept).unwrap(), vec![b"c".to_vec()]);
    }

    #[test]
    fn a_part_that_was_to_follow_its_traces_decision_is_pending_after_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let trace = [1; 16];
        let kept = Outcome::Kept { threshold: 0 };
        let (client, late, root_decision) = {
            let mut s = open(dir.path());
            // Three parts of one trace in three appends; the middle one (its root) is decided
            // first, as the engine decides a rooted group before a rootless one, and the store is
            // flushed: the crash comes before the other two follow that decision.
            let client = s.append(3, &[fragment(1, 5, None, &[b"client"])]).unwrap()[0];
            let server = s.append(3, &[fragment(1, 6, Some(7), &[b"server"])]).unwrap()[0];
            let late = s.append(3, &[fragment(1, 8, None, &[b"late"])]).unwrap()[0];
            let root_decision = s.decide(&trace, &SpanRange::one(3, server), kept).unwrap();
            s.flush().unwrap();
            (client, late, root_decision)
        };
        let mut s = open(dir.path());
        let r = s.recover().unwrap();
        // One pending entry per run of appends no decision covers: the decided root between them
        // is read back by neither (it would be exported, or decided, again).
        let runs: Vec<(TraceId, SpanRange, Vec<Vec<u8>>)> =
            r.pending.iter().map(|(t, p)| (*t, p.spans, s.spans(t, &p.spans).unwrap())).collect();
        assert_eq!(
            runs,
            vec![
                (trace, SpanRange::one(3, client), vec![b"client".to_vec()]),
                (trace, SpanRange::one(3, late), vec![b"late".to_vec()]),
            ]
        );
        assert_eq!(r.outbox.len(), 1, "the decided part waits for its export");
        assert_eq!(s.spans(&trace, &r.outbox[0].spans).unwrap(), vec![b"server".to_vec()]);
        // The other parts follow, each with a decision of its own: nothing is pending, and each
        // kept decision stays in the outbox until the marker reaches it.
        let for_client = s.decide(&trace, &SpanRange::one(3, client), kept).unwrap();
        let for_late = s.decide(&trace, &SpanRange::one(3, late), kept).unwrap();
        s.exported(&trace, 3, root_decision).unwrap();
        s.commit().unwrap();
        let r = s.recover().unwrap();
        assert!(r.pending.is_empty());
        assert_eq!(r.outbox.iter().map(|o| o.seq).collect::<Vec<_>>(), vec![for_client, for_late]);
        let decisions: Vec<u64> = r.decisions.iter().map(|d| d.seq).collect();
        assert_eq!(decisions, vec![root_decision, for_client, for_late], "every decision, in order");
        s.exported(&trace, 3, for_late).unwrap();
        s.exported(&trace, 3, for_client).unwrap();
        assert!(s.recover().unwrap().outbox.is_empty(), "the marker only grows");
    }

    #[test]
    fn big_appends_are_split_into_groups() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = open(dir.path());
        let span = vec![7u8; 10_000];
        let spans: [&[u8]; 1] = [&span];
        let fragments: Vec<Fragment<'_>> = (0..10).map(|t| fragment(t, 1, None, &spans)).collect();
        let seqs = s.append(0, &fragments).unwrap();
        assert!(seqs.windows(2).all(|w| w[0] <= w[1]));
        assert!(seqs.first() < seqs.last(), "100 kB of fragments span several groups: {seqs:?}");
        for (t, seq) in seqs.iter().enumerate() {
            assert_eq!(s.spans(&[t as u8; 16], &SpanRange::one(0, *seq)).unwrap(), vec![span.clone()]);
        }
    }

    #[test]
    fn sequences_grow_across_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let range = SpanRange::one(0, 1);
        let first = open(dir.path()).decide(&[1; 16], &range, Outcome::Dropped).unwrap();
        let second = open(dir.path()).decide(&[1; 16], &range, Outcome::Dropped).unwrap();
        assert!(second > first);
        let a = open(dir.path()).append(0, &[fragment(1, 1, None, &[b"x"])]).unwrap();
        let b = open(dir.path()).append(0, &[fragment(1, 1, None, &[b"x"])]).unwrap();
        assert!(b[0] > a[0] && a[0] > 0);
    }

    #[test]
    fn dropped_partition_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = open(dir.path());
        let x = s.append(1, &[fragment(1, 1, None, &[b"x"])]).unwrap()[0];
        let y = s.append(2, &[fragment(1, 1, None, &[b"y"])]).unwrap()[0];
        s.drop_partition(1).unwrap();
        let r = s.recover().unwrap();
        assert_eq!(r.partitions, vec![2]);
        assert_eq!(r.pending.len(), 1, "a trace's fragments in a dropped partition are gone");
        assert!(s.spans(&[1; 16], &SpanRange::one(1, x)).unwrap().is_empty());
        assert_eq!(s.spans(&[1; 16], &SpanRange::one(2, y)).unwrap(), vec![b"y".to_vec()]);
    }

    #[test]
    fn corrupt_records_are_errors_not_panics() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = open(dir.path());
            s.decision_log.insert(1u64.to_be_bytes(), &[1u8, 2, 3][..]).unwrap();
        }
        assert!(matches!(open(dir.path()).recover(), Err(StoreError::Corrupt { what: "decision batch", len: 3 })));
        let dir = tempfile::tempdir().unwrap();
        {
            let mut s = open(dir.path());
            s.partition_tree(4).unwrap().insert(1u64.to_be_bytes(), &[1u8; 20][..]).unwrap();
        }
        assert!(matches!(open(dir.path()).recover(), Err(StoreError::Corrupt { what: "span group", .. })));
    }

    proptest::proptest! {
        /// Bytes read back from disk are hostile: any value decodes to fragments or an error.
        #[test]
        fn any_group_value_decodes_or_errs(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
            let _ = fragments(&bytes).map(|f| f.map(|f| f.spans().count())).collect::<Vec<_>>();
            let _ = decode_decisions(&bytes);
            let _ = decode_exported(&bytes);
        }

        /// What `encode_fragment` writes, `fragments` reads back.
        #[test]
        fn fragments_round_trip(
            spans in proptest::collection::vec(proptest::collection::vec(proptest::prelude::any::<u8>(), 0..50), 0..5),
            first_seen in 1..u64::MAX,
            root_ended in proptest::option::of(1..u64::MAX),
        ) {
            let views: Vec<&[u8]> = spans.iter().map(Vec::as_slice).collect();
            let mut value = Vec::new();
            let f = fragment(9, first_seen, root_ended, &views);
            encode_fragment(&f, &mut value);
            encode_fragment(&f, &mut value);
            let back: Vec<StoredFragment<'_>> = fragments(&value).collect::<Result<_, _>>().unwrap();
            proptest::prop_assert_eq!(back.len(), 2);
            proptest::prop_assert_eq!(back[1].trace, [9; 16]);
            proptest::prop_assert_eq!((back[1].first_seen, back[1].root_ended), (first_seen, root_ended));
            proptest::prop_assert_eq!(&back[1].spans().collect::<Vec<_>>(), &views);
        }
    }
}

//! The [`TailStore`] on sled: see the crate note for the layout and invariants.
//!
//! Durability: sled writes through its own log and makes writes durable every
//! [`SledOptions::flush_every_ms`]; after a crash it recovers a prefix of the writes. A trace whose
//! spans were appended but not flushed when the agent died is therefore lost whole or in part, never
//! decided twice: its decision is a single write of its record on the `state` tree.

use std::collections::HashMap;
use std::path::Path;

use crate::{
    DecisionRecord, OutboxEntry, Outcome, Partition, PendingTrace, Recovered, SpanRange, StoreError, TailStore, TraceId,
};

const STATE_TREE: &str = "state";
const SPANS_TREE_PREFIX: &str = "spans/";
const PENDING: u8 = b'P';
const DECIDED: u8 = b'D';
const PENDING_LEN: usize = 33;
const DECIDED_LEN: usize = 35;
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
    state: sled::Tree,
    partitions: HashMap<Partition, sled::Tree>,
    appends: Sequence,
    decisions: Sequence,
}

impl SledStore {
    /// Opens (or creates) the store in `dir`. An existing store is reopened as it was left.
    pub fn open(dir: &Path, options: SledOptions) -> Result<Self, StoreError> {
        let db = sled::Config::new()
            .path(dir)
            .cache_capacity(options.cache_bytes)
            .flush_every_ms(Some(options.flush_every_ms))
            .open()?;
        let state = db.open_tree(STATE_TREE)?;
        let appends = Sequence::new(&db)?;
        let decisions = Sequence::new(&db)?;
        Ok(Self { db, state, partitions: HashMap::new(), appends, decisions })
    }

    fn partition_tree(&mut self, partition: Partition) -> Result<&sled::Tree, StoreError> {
        if !self.partitions.contains_key(&partition) {
            let tree = self.db.open_tree(partition_name(partition))?;
            self.partitions.insert(partition, tree);
        }
        Ok(&self.partitions[&partition])
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

fn encode_pending(p: &PendingTrace) -> [u8; PENDING_LEN] {
    let mut v = [PENDING; PENDING_LEN];
    v[1..9].copy_from_slice(&p.first_seen_unix_ns.to_be_bytes());
    // 0 means "not ended": a root span cannot end at the epoch.
    v[9..17].copy_from_slice(&p.root_ended_unix_ns.unwrap_or(0).to_be_bytes());
    v[17..25].copy_from_slice(&p.spans.first.to_be_bytes());
    v[25..].copy_from_slice(&p.spans.last.to_be_bytes());
    v
}

/// A decision record: tag, seq, outcome, threshold, span range, exported.
fn encode_decided(seq: u64, outcome: Outcome, spans: &SpanRange, exported: bool) -> [u8; DECIDED_LEN] {
    let mut v = [DECIDED; DECIDED_LEN];
    v[1..9].copy_from_slice(&seq.to_be_bytes());
    let (kind, threshold) = match outcome {
        Outcome::Kept { threshold } => (KEPT, threshold),
        Outcome::Dropped => (DROPPED, 0),
    };
    v[9] = kind;
    v[10..18].copy_from_slice(&threshold.to_be_bytes());
    v[18..26].copy_from_slice(&spans.first.to_be_bytes());
    v[26..34].copy_from_slice(&spans.last.to_be_bytes());
    v[34] = u8::from(exported);
    v
}

enum State {
    Pending(PendingTrace),
    Decided { seq: u64, outcome: Outcome, spans: SpanRange, exported: bool },
}

fn decode_state(partition: Partition, v: &[u8]) -> Result<State, StoreError> {
    match (v.first(), v.len()) {
        (Some(&PENDING), PENDING_LEN) => {
            let ended = u64_at(v, 9);
            Ok(State::Pending(PendingTrace {
                first_seen_unix_ns: u64_at(v, 1),
                root_ended_unix_ns: (ended != 0).then_some(ended),
                spans: SpanRange { partition, first: u64_at(v, 17), last: u64_at(v, 25) },
            }))
        }
        (Some(&DECIDED), DECIDED_LEN) if v[9] <= KEPT && v[34] <= 1 => Ok(State::Decided {
            seq: u64_at(v, 1),
            outcome: if v[9] == KEPT { Outcome::Kept { threshold: u64_at(v, 10) } } else { Outcome::Dropped },
            spans: SpanRange { partition, first: u64_at(v, 18), last: u64_at(v, 26) },
            exported: v[34] == 1,
        }),
        _ => Err(StoreError::Corrupt { what: "trace state", len: v.len() }),
    }
}

/// One append: the trace id, then each span prefixed with its length (u32, big endian).
fn encode_append(trace: &TraceId, spans: &[&[u8]]) -> Vec<u8> {
    let mut v = Vec::with_capacity(16 + spans.iter().map(|s| 4 + s.len()).sum::<usize>());
    v.extend_from_slice(trace);
    for span in spans {
        v.extend_from_slice(&(span.len() as u32).to_be_bytes());
        v.extend_from_slice(span);
    }
    v
}

fn decode_spans(mut v: &[u8], out: &mut Vec<Vec<u8>>) -> Result<(), StoreError> {
    let corrupt = |v: &[u8]| StoreError::Corrupt { what: "span record", len: v.len() };
    while !v.is_empty() {
        let len = v
            .get(..4)
            .map(|l| u32::from_be_bytes(l.try_into().expect("4 bytes")) as usize)
            .ok_or_else(|| corrupt(v))?;
        let span = v.get(4..4 + len).ok_or_else(|| corrupt(v))?;
        out.push(span.to_vec());
        v = &v[4 + len..];
    }
    Ok(())
}

impl SledStore {
    fn state_of(&self, partition: Partition, trace: &TraceId) -> Result<Option<State>, StoreError> {
        self.state.get(state_key(partition, trace))?.map(|v| decode_state(partition, &v)).transpose()
    }
}

impl TailStore for SledStore {
    fn append(&mut self, partition: Partition, trace: &TraceId, spans: &[&[u8]]) -> Result<u64, StoreError> {
        let seq = self.appends.next(&self.db)?;
        self.partition_tree(partition)?.insert(seq.to_be_bytes(), encode_append(trace, spans))?;
        Ok(seq)
    }

    fn put_pending(&mut self, trace: &TraceId, pending: &PendingTrace) -> Result<(), StoreError> {
        self.state.insert(state_key(pending.spans.partition, trace), &encode_pending(pending)[..])?;
        Ok(())
    }

    fn spans(&self, trace: &TraceId, range: &SpanRange) -> Result<Vec<Vec<u8>>, StoreError> {
        let name = partition_name(range.partition);
        let tree = match self.partitions.get(&range.partition) {
            Some(t) => t.clone(),
            None if self.db.tree_names().iter().any(|n| n.as_ref() == name.as_bytes()) => self.db.open_tree(name)?,
            None => return Ok(Vec::new()),
        };
        let mut out = Vec::new();
        let (first, last) = (range.first.to_be_bytes(), range.last.max(range.first).to_be_bytes());
        for value in tree.range(first..=last).values() {
            let value = value?;
            if value.get(..16) == Some(&trace[..]) {
                decode_spans(&value[16..], &mut out)?;
            }
        }
        Ok(out)
    }

    fn decide(&mut self, trace: &TraceId, spans: &SpanRange, outcome: Outcome) -> Result<u64, StoreError> {
        let seq = self.decisions.next(&self.db)?;
        self.state.insert(state_key(spans.partition, trace), &encode_decided(seq, outcome, spans, false)[..])?;
        Ok(seq)
    }

    fn exported(&mut self, trace: &TraceId, partition: Partition) -> Result<(), StoreError> {
        if let Some(State::Decided { seq, outcome, spans, exported: false }) = self.state_of(partition, trace)? {
            self.state.insert(state_key(partition, trace), &encode_decided(seq, outcome, &spans, true)[..])?;
        }
        Ok(())
    }

    fn forget_decision(&mut self, trace: &TraceId, partition: Partition, seq: u64) -> Result<(), StoreError> {
        if let Some(State::Decided { seq: current, .. }) = self.state_of(partition, trace)?
            && current == seq
        {
            self.state.remove(state_key(partition, trace))?;
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
        for entry in &self.state {
            let (k, v) = entry?;
            let (partition, trace) = decode_state_key(&k)?;
            match decode_state(partition, &v)? {
                State::Pending(p) => out.pending.push((trace, p)),
                State::Decided { seq, outcome, spans, exported } => {
                    out.decisions.push(DecisionRecord { seq, trace, partition, outcome });
                    if let (Outcome::Kept { threshold }, false) = (outcome, exported) {
                        out.outbox.push(OutboxEntry { trace, spans, threshold });
                    }
                }
            }
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
        Ok(out)
    }

    fn flush(&self) -> Result<(), StoreError> {
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

    fn open(dir: &Path) -> SledStore {
        SledStore::open(dir, SledOptions::default()).unwrap()
    }

    #[test]
    fn reopens_what_was_written() {
        let dir = tempfile::tempdir().unwrap();
        let (pending, kept, seq) = {
            let mut s = open(dir.path());
            let a = s.append(3, &[1; 16], &[b"a", b"b"]).unwrap();
            let c = s.append(3, &[2; 16], &[b"c"]).unwrap();
            let d = s.append(3, &[1; 16], &[b"d"]).unwrap();
            let pending = PendingTrace {
                first_seen_unix_ns: 5,
                root_ended_unix_ns: Some(9),
                spans: SpanRange::one(3, a).with(d),
            };
            s.put_pending(&[1; 16], &pending).unwrap();
            let kept = SpanRange::one(3, c);
            s.put_pending(&[2; 16], &PendingTrace { root_ended_unix_ns: None, spans: kept, ..pending }).unwrap();
            let seq = s.decide(&[2; 16], &kept, Outcome::Kept { threshold: 7 }).unwrap();
            s.flush().unwrap();
            (pending, kept, seq)
        };
        let s = open(dir.path());
        let r = s.recover().unwrap();
        assert_eq!(r.pending, vec![([1; 16], pending)]);
        let decision = DecisionRecord { seq, trace: [2; 16], partition: 3, outcome: Outcome::Kept { threshold: 7 } };
        assert_eq!(r.decisions, vec![decision]);
        assert_eq!(r.outbox, vec![OutboxEntry { trace: [2; 16], spans: kept, threshold: 7 }]);
        assert_eq!(r.partitions, vec![3]);
        let want: Vec<Vec<u8>> = vec![b"a".to_vec(), b"b".to_vec(), b"d".to_vec()];
        assert_eq!(s.spans(&[1; 16], &pending.spans).unwrap(), want);
    }

    #[test]
    fn sequences_grow_across_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let range = SpanRange::one(0, 0);
        let first = open(dir.path()).decide(&[1; 16], &range, Outcome::Dropped).unwrap();
        let second = open(dir.path()).decide(&[1; 16], &range, Outcome::Dropped).unwrap();
        assert!(second > first);
        let a = open(dir.path()).append(0, &[1; 16], &[b"x"]).unwrap();
        let b = open(dir.path()).append(0, &[1; 16], &[b"x"]).unwrap();
        assert!(b > a);
    }

    #[test]
    fn dropped_partition_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = open(dir.path());
        let x = s.append(1, &[1; 16], &[b"x"]).unwrap();
        let y = s.append(2, &[1; 16], &[b"y"]).unwrap();
        s.drop_partition(1).unwrap();
        assert_eq!(s.recover().unwrap().partitions, vec![2]);
        assert!(s.spans(&[1; 16], &SpanRange::one(1, x)).unwrap().is_empty());
        assert_eq!(s.spans(&[1; 16], &SpanRange::one(2, y)).unwrap(), vec![b"y".to_vec()]);
    }

    #[test]
    fn corrupt_state_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = open(dir.path());
            s.state.insert(state_key(0, &[1; 16]), &[PENDING, 2, 3]).unwrap();
        }
        assert!(matches!(open(dir.path()).recover(), Err(StoreError::Corrupt { what: "trace state", len: 3 })));
    }
}

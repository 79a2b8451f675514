//! Model-based test: under any sequence of appends, decisions, exports, expiries and reopenings,
//! the sled store behaves like the in-memory model.

use std::collections::BTreeMap;

use proptest::prelude::*;
use tracetap_storage::{
    AppendedFragment, Fragment, MemoryStore, Outcome, Partition, SledOptions, SledStore, SpanRange, TailStore, TraceId,
};

const TRACES: u8 = 4;
const PARTITIONS: u64 = 3;

type FragmentSpec = (u8, u64, Option<u64>, Vec<Vec<u8>>);

#[derive(Clone, Debug)]
enum Op {
    Append {
        partition: u64,
        fragments: Vec<FragmentSpec>,
    },
    /// `part`: one of the trace's appends there (by index), as the engine decides a part that
    /// follows another's decision; `None`: all of them so far.
    Decide {
        trace: u8,
        partition: u64,
        kept: Option<u64>,
        part: Option<u8>,
    },
    Exported {
        trace: u8,
        partition: u64,
    },
    Commit,
    ForgetDecisionsOfDroppedPartitions,
    DropPartition {
        partition: u64,
    },
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    let trace = 0..TRACES;
    let partition = 0..PARTITIONS;
    let spans = proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 1..4);
    let fragment = (trace.clone(), 1..1_000u64, proptest::option::of(1..1_000u64), spans);
    prop_oneof![
        4 => (partition.clone(), proptest::collection::vec(fragment, 1..4))
            .prop_map(|(partition, fragments)| Op::Append { partition, fragments }),
        2 => (trace.clone(), partition.clone(), proptest::option::of(0..(1u64 << 56)), proptest::option::of(0..4u8))
            .prop_map(|(trace, partition, kept, part)| Op::Decide { trace, partition, kept, part }),
        1 => (trace, partition.clone()).prop_map(|(trace, partition)| Op::Exported { trace, partition }),
        1 => Just(Op::Commit),
        1 => Just(Op::ForgetDecisionsOfDroppedPartitions),
        1 => partition.prop_map(|partition| Op::DropPartition { partition }),
        1 => Just(Op::Reopen),
    ]
}

fn id(trace: u8) -> TraceId {
    [trace; 16]
}

/// A store under test and the append sequence numbers it gave (each store numbers its own).
struct Subject<S> {
    store: S,
    appends: BTreeMap<(u8, Partition), SpanRange>,
    /// The latest decision's sequence number per (trace, partition).
    decisions: BTreeMap<(u8, Partition), u64>,
    /// Every fragment appended, with the partition and sequence number it landed at.
    landed: Vec<(Partition, u64, AppendedFragment)>,
}

impl<S: TailStore> Subject<S> {
    fn range(&self, trace: u8, partition: Partition) -> SpanRange {
        self.appends.get(&(trace, partition)).copied().unwrap_or(SpanRange::one(partition, 0))
    }

    fn apply(&mut self, op: &Op) {
        let store = &mut self.store;
        match op {
            Op::Append { partition, fragments } => {
                let spans: Vec<Vec<&[u8]>> =
                    fragments.iter().map(|f| f.3.iter().map(Vec::as_slice).collect()).collect();
                let frags: Vec<Fragment<'_>> = fragments
                    .iter()
                    .zip(&spans)
                    .map(|(f, spans)| Fragment {
                        trace: id(f.0),
                        first_seen_unix_ns: f.1,
                        root_ended_unix_ns: f.2,
                        spans,
                    })
                    .collect();
                let seqs = store.append(*partition, &frags).unwrap();
                assert_eq!(seqs.len(), fragments.len());
                for ((f, seq), frag) in fragments.iter().zip(seqs).zip(&frags) {
                    let appended = AppendedFragment {
                        trace: frag.trace,
                        first_seen_unix_ns: frag.first_seen_unix_ns,
                        root_ended_unix_ns: frag.root_ended_unix_ns,
                        spans: frag.spans.iter().map(|s| s.to_vec()).collect(),
                    };
                    self.landed.push((*partition, seq, appended));
                    let grown =
                        self.appends.get(&(f.0, *partition)).map_or(SpanRange::one(*partition, seq), |r| r.with(seq));
                    self.appends.insert((f.0, *partition), grown);
                }
            }
            Op::Decide { trace, partition, kept, part } => {
                let outcome = kept.map_or(Outcome::Dropped, |threshold| Outcome::Kept { threshold });
                let seqs: Vec<u64> = self
                    .landed
                    .iter()
                    .filter(|(p, _, f)| p == partition && f.trace == id(*trace))
                    .map(|(_, seq, _)| *seq)
                    .collect();
                let range = match part {
                    Some(i) if !seqs.is_empty() => SpanRange::one(*partition, seqs[usize::from(*i) % seqs.len()]),
                    _ => self.range(*trace, *partition),
                };
                let seq = self.store.decide(&id(*trace), &range, outcome).unwrap();
                self.decisions.insert((*trace, *partition), seq);
            }
            Op::Exported { trace, partition } => {
                if let Some(seq) = self.decisions.get(&(*trace, *partition)) {
                    store.exported(&id(*trace), *partition, *seq).unwrap();
                }
            }
            Op::Commit => store.commit().unwrap(),
            Op::ForgetDecisionsOfDroppedPartitions => {
                // The oldest decisions, up to the first whose partition still exists.
                let r = store.recover().unwrap();
                let up_to =
                    r.decisions.iter().take_while(|d| !r.partitions.contains(&d.spans.partition)).last().map(|d| d.seq);
                if let Some(up_to) = up_to {
                    store.forget_decisions(up_to).unwrap();
                }
            }
            Op::DropPartition { partition } => store.drop_partition(*partition).unwrap(),
            Op::Reopen => {}
        }
    }

    /// What the store shows from outside, with its own sequence numbers replaced by what they
    /// point at, or by their order.
    fn observe(&self) -> Observed {
        let r = self.store.recover().unwrap();
        let spans = |trace: &TraceId, range: &SpanRange| self.store.spans(trace, range).unwrap();
        Observed {
            pending: r
                .pending
                .iter()
                .map(|(t, p)| (*t, p.first_seen_unix_ns, p.root_ended_unix_ns, p.spans.partition, spans(t, &p.spans)))
                .collect(),
            decisions: r.decisions.iter().map(|d| (d.trace, d.spans.partition, d.outcome)).collect(),
            outbox: r
                .outbox
                .iter()
                .map(|o| (o.trace, o.spans.partition, o.threshold, spans(&o.trace, &o.spans)))
                .collect(),
            partitions: r.partitions,
            appended: self.appends.iter().map(|(&(t, p), range)| (t, p, spans(&id(t), range))).collect(),
            // Each fragment is among those its sequence number reads back, in append order, until
            // its partition is dropped.
            read_back: self
                .landed
                .iter()
                .map(|(p, seq, f)| {
                    let group = self.store.fragments(*p, *seq).unwrap();
                    let same_call = self.landed.iter().filter(|(q, s, _)| q == p && s == seq).map(|(.., g)| g);
                    assert!(
                        group.iter().eq(same_call) || group.is_empty(),
                        "a sequence number reads back its appends, in order"
                    );
                    group.contains(f)
                })
                .collect(),
        }
    }
}

type Spans = Vec<Vec<u8>>;

#[derive(Debug, PartialEq)]
struct Observed {
    pending: Vec<(TraceId, u64, Option<u64>, Partition, Spans)>,
    decisions: Vec<(TraceId, Partition, Outcome)>,
    outbox: Vec<(TraceId, Partition, u64, Spans)>,
    partitions: Vec<Partition>,
    appended: Vec<(u8, Partition, Spans)>,
    read_back: Vec<bool>,
}

/// Reopens a store just closed in this process. sled's flusher thread lets go of the directory lock
/// a moment after the `Db` is dropped, so a reopen in the same process may have to wait for it (a
/// restarted agent is a new process and never does).
fn reopen(dir: &std::path::Path, options: SledOptions) -> SledStore {
    let mut last_error = None;
    for _ in 0..50 {
        match SledStore::open(dir, options) {
            Ok(store) => return store,
            Err(e) => last_error = Some(e),
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    panic!("store does not reopen: {last_error:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn sled_store_behaves_like_the_model(ops in proptest::collection::vec(op(), 1..40)) {
        let dir = tempfile::tempdir().unwrap();
        let options = SledOptions { cache_bytes: 1 << 20, flush_every_ms: 1_000 };
        let mut sled = Subject { store: SledStore::open(dir.path(), options).unwrap(), appends: BTreeMap::new(), decisions: BTreeMap::new(), landed: Vec::new() };
        let mut model = Subject { store: MemoryStore::new(), appends: BTreeMap::new(), decisions: BTreeMap::new(), landed: Vec::new() };
        for op in &ops {
            if matches!(op, Op::Reopen) {
                sled.store.flush().unwrap();
                drop(sled.store);
                sled.store = reopen(dir.path(), options);
            }
            sled.apply(op);
            model.apply(op);
            prop_assert_eq!(sled.observe(), model.observe(), "after {:?}", op);
        }
    }
}

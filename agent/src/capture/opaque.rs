//! Connections whose bytes the agent does not read, told to the probes so that they stop copying
//! them (`OPAQUE_CONNS` in the probes).
//!
//! The tracker reports a connection as opaque once ([`tracetap_proxy::OpaqueMark`]): `mode tcp`
//! at its `accept`/`connect`, TLS or another protocol at its first bytes, a tunnel after an upgrade
//! or CONNECT. From then on its records arrive without payload (size and sequence number only).
//!
//! Invariants:
//! - A mark names its connection by `(tgid, fd)` and the time of its `accept`/`connect` record,
//!   so a mark written after the connection closed and its fd was reused matches nothing: the new
//!   connection keeps its payload. The agent lags the probes; this is why it may.
//! - The agent is the only writer of the probes' marks, and removes a mark when it sees its
//!   connection close or its process go, so the probes' map holds what [`OpaqueMarks`] holds
//!   (at most [`MAX_MARKS`], the size of that map).
//! - The probes' map is a plain hash map of [`MAX_MARKS`] entries: the agent holds at most that
//!   many marks, so the kernel never evicts one behind its back.
//! - The generation the agent publishes is 0 exactly while no mark exists, and takes a value it
//!   never had before after every mark added: a connection that checked the map at one
//!   generation must look again once a mark was added, and only then (the probes cache the
//!   answer per connection with the generation they saw).

use rustc_hash::FxHashMap;
use tracetap_ebpf_common::MAX_NUMBERED_CONNECTIONS;
use tracetap_proxy::OpaqueMark;

/// Most marks held at once: the size of the probes' map.
pub const MAX_MARKS: usize = MAX_NUMBERED_CONNECTIONS as usize;

/// Where marks go: the probes' maps (or a model of them in tests).
pub trait MarkSink {
    /// Writes the mark of `key` (`tgid << 32 | fd`); false when the map refused it.
    fn insert(&mut self, key: u64, opened_ns: u64) -> bool;
    fn remove(&mut self, key: u64);
    /// Publishes the marks' generation (0: there are none).
    fn publish(&mut self, generation: u32);
}

/// What marking did, for the agent's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MarkStats {
    /// Connections whose payload the probes were told to skip.
    pub marked: u64,
    /// Marks not written: the map was full or refused the write (the connection's bytes are
    /// still copied, and ignored).
    pub refused: u64,
}

#[derive(Debug, Default)]
pub struct OpaqueMarks {
    /// `tgid << 32 | fd` to the opening time written for it.
    marks: FxHashMap<u64, u64>,
    /// The last generation published after a mark was added (never reused, never 0).
    generation: u32,
    stats: MarkStats,
}

fn key(tgid: u32, fd: i32) -> u64 {
    (u64::from(tgid) << 32) | u64::from(fd.cast_unsigned())
}

impl OpaqueMarks {
    #[must_use]
    pub fn stats(&self) -> MarkStats {
        self.stats
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.marks.is_empty()
    }

    /// Tells the probes to stop copying the connection's bytes.
    pub fn mark(&mut self, sink: &mut impl MarkSink, mark: OpaqueMark) {
        let key = key(mark.tgid, mark.fd);
        if self.marks.len() >= MAX_MARKS && !self.marks.contains_key(&key) {
            self.stats.refused += 1;
            return;
        }
        if !sink.insert(key, mark.opened_ns) {
            self.stats.refused += 1;
            return;
        }
        self.stats.marked += 1;
        self.marks.insert(key, mark.opened_ns);
        // After the map write: a probe that sees the new generation finds the mark.
        self.generation = self.generation.checked_add(1).unwrap_or(1);
        sink.publish(self.generation);
    }

    /// The connection `(tgid, fd)` closed: its mark, if any, goes.
    pub fn closed(&mut self, sink: &mut impl MarkSink, tgid: u32, fd: i32) {
        let key = key(tgid, fd);
        if self.marks.remove(&key).is_some() {
            sink.remove(key);
            if self.marks.is_empty() {
                sink.publish(0);
            }
        }
    }

    /// The process is gone (or no longer traced): all its marks go.
    pub fn forget_process(&mut self, sink: &mut impl MarkSink, tgid: u32) {
        let before = self.marks.len();
        self.marks.retain(|key, _| {
            let keep = (key >> 32) as u32 != tgid;
            if !keep {
                sink.remove(*key);
            }
            keep
        });
        if before > 0 && self.marks.is_empty() {
            sink.publish(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    /// A model of the probes' maps.
    #[derive(Debug, Default)]
    struct Model {
        map: BTreeMap<u64, u64>,
        generation: u32,
        /// Every non-zero generation published, in order.
        published: Vec<u32>,
        refuse: bool,
    }

    impl MarkSink for Model {
        fn insert(&mut self, key: u64, opened_ns: u64) -> bool {
            if self.refuse {
                return false;
            }
            self.map.insert(key, opened_ns);
            true
        }
        fn remove(&mut self, key: u64) {
            self.map.remove(&key);
        }
        fn publish(&mut self, generation: u32) {
            self.generation = generation;
            if generation != 0 {
                self.published.push(generation);
            }
        }
    }

    #[derive(Clone, Debug)]
    enum Step {
        Mark { tgid: u32, fd: i32, opened_ns: u64 },
        Close { tgid: u32, fd: i32 },
        Forget { tgid: u32 },
        Refuse(bool),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (1u32..4, 0i32..6, 1u64..1000).prop_map(|(tgid, fd, opened_ns)| Step::Mark { tgid, fd, opened_ns }),
            (1u32..4, 0i32..6).prop_map(|(tgid, fd)| Step::Close { tgid, fd }),
            (1u32..4).prop_map(|tgid| Step::Forget { tgid }),
            any::<bool>().prop_map(Step::Refuse),
        ]
    }

    proptest! {
        /// The probes' map always holds exactly the agent's marks; the generation is 0 exactly
        /// while it holds none, and every mark added publishes a generation never seen before.
        #[test]
        fn the_probes_hold_what_the_agent_holds(steps in proptest::collection::vec(step(), 0..64)) {
            let (mut marks, mut model) = (OpaqueMarks::default(), Model::default());
            for step in steps {
                let published = model.published.len();
                match step {
                    Step::Mark { tgid, fd, opened_ns } => {
                        let before = marks.stats().marked;
                        marks.mark(&mut model, OpaqueMark { tgid, fd, opened_ns });
                        if marks.stats().marked > before {
                            prop_assert_eq!(model.published.len(), published + 1);
                            let new = model.published[published];
                            prop_assert!(!model.published[..published].contains(&new));
                        }
                    }
                    Step::Close { tgid, fd } => marks.closed(&mut model, tgid, fd),
                    Step::Forget { tgid } => marks.forget_process(&mut model, tgid),
                    Step::Refuse(r) => model.refuse = r,
                }
                let agent: BTreeMap<u64, u64> = marks.marks.iter().map(|(k, v)| (*k, *v)).collect();
                prop_assert_eq!(&agent, &model.map);
                prop_assert_eq!(model.generation != 0, !agent.is_empty());
            }
        }
    }

    #[test]
    fn a_refused_mark_is_counted_and_not_held() {
        let (mut marks, mut model) = (OpaqueMarks::default(), Model { refuse: true, ..Model::default() });
        marks.mark(&mut model, OpaqueMark { tgid: 7, fd: 3, opened_ns: 5 });
        assert_eq!(marks.stats(), MarkStats { marked: 0, refused: 1 });
        assert!(marks.is_empty() && model.generation == 0);
    }

    #[test]
    fn closing_one_process_keeps_the_others_marks() {
        let mut marks = OpaqueMarks::default();
        let mut model = Model::default();
        marks.mark(&mut model, OpaqueMark { tgid: 7, fd: 3, opened_ns: 5 });
        marks.mark(&mut model, OpaqueMark { tgid: 8, fd: 3, opened_ns: 6 });
        marks.forget_process(&mut model, 7);
        assert_eq!(model.map.into_iter().collect::<Vec<_>>(), vec![(key(8, 3), 6)]);
        assert_ne!(model.generation, 0);
    }
}

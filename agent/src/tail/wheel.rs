//! Due times of the traces waiting in memory, as a timing wheel: the tail thread decides at ticks
//! (every 100 ms), so the order of traces due within one tick does not matter, and a bucket per
//! tick replaces a heap (whose log-n pop per trace, over every waiting trace, was the tail
//! thread's top symbol: 4% of the agent's samples at 12 000 req/s).
//!
//! Invariant: an entry pushed with due time `d` is returned by the first [`Wheel::take_due`] whose
//! `now` is at least `d` rounded up to a multiple of the width, never earlier (it sits in bucket
//! `ceil(d / width)`, and a call drains the buckets up to `floor(now / width)`); an entry pushed
//! already due by that rule comes out at the next call. Entries further ahead than the wheel's span wait in a heap
//! until they come within it, so a long decision wait costs no empty buckets.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// Buckets the wheel holds ahead of its first (at the engine's 10 ms: 41 s).
const SPAN: u64 = 4096;

#[derive(Debug)]
pub struct Wheel<T> {
    width: u64,
    /// Bucket number of `buckets[0]`: one past the last bucket drained.
    base: u64,
    buckets: VecDeque<Vec<T>>,
    /// Entries pushed already due (their bucket was drained): returned by the next take.
    overdue: Vec<T>,
    /// Entries due beyond the span, by bucket number.
    far: BinaryHeap<Reverse<(u64, T)>>,
}

impl<T: Ord + Copy> Wheel<T> {
    /// A wheel of buckets `width` ns wide (at least 1), as if drained at `now`.
    #[must_use]
    pub fn new(width: u64, now: u64) -> Self {
        let width = width.max(1);
        Self { width, base: now / width + 1, buckets: VecDeque::new(), overdue: Vec::new(), far: BinaryHeap::new() }
    }

    /// Adds an entry due at `due` (ns).
    pub fn push(&mut self, due: u64, entry: T) {
        let bucket = due.div_ceil(self.width);
        if bucket < self.base {
            // Its bucket was drained: due no later than the last take's `now`.
            self.overdue.push(entry);
        } else if bucket - self.base >= SPAN {
            self.far.push(Reverse((bucket, entry)));
        } else {
            self.put(bucket, entry);
        }
    }

    fn put(&mut self, bucket: u64, entry: T) {
        let at = (bucket - self.base) as usize;
        if self.buckets.len() <= at {
            self.buckets.resize_with(at + 1, Vec::new);
        }
        self.buckets[at].push(entry);
    }

    /// Takes every entry due at or before `now`, into `out`.
    pub fn take_due(&mut self, now: u64, out: &mut Vec<T>) {
        out.append(&mut self.overdue);
        let last = now / self.width;
        while self.base <= last {
            let Some(mut bucket) = self.buckets.pop_front() else {
                // Nothing in between: jump.
                self.base = last + 1;
                break;
            };
            out.append(&mut bucket);
            self.base += 1;
        }
        // Far entries that came within the span move in (or out, if already due).
        while let Some(&Reverse((bucket, entry))) = self.far.peek() {
            if bucket >= self.base + SPAN {
                break;
            }
            self.far.pop();
            if bucket < self.base {
                out.push(entry);
            } else {
                self.put(bucket, entry);
            }
        }
    }

    /// Entries held (stale ones included).
    #[must_use]
    pub fn len(&self) -> usize {
        self.buckets.iter().map(Vec::len).sum::<usize>() + self.overdue.len() + self.far.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Against a list: every entry comes out at the first take whose `now` reaches its due time
        /// rounded up to the width, never before, whatever the order of pushes and takes.
        #[test]
        fn entries_come_out_at_the_first_take_at_or_after_their_due_time(
            steps in proptest::collection::vec((any::<bool>(), 0u64..20_000_000, 0u64..300_000), 1..200),
            width in 1u64..200,
        ) {
            let mut now = 1_800_000_000_000_000_000u64;
            let mut wheel = Wheel::new(width, now);
            let mut model: Vec<(u64, u32)> = Vec::new();
            for (i, (push, ahead, advance)) in steps.into_iter().enumerate() {
                if push {
                    let due = now - 50_000 + ahead * 4;
                    wheel.push(due, i as u32);
                    model.push((due.div_ceil(width) * width, i as u32));
                } else {
                    now += advance;
                    let mut got = Vec::new();
                    wheel.take_due(now, &mut got);
                    got.sort_unstable();
                    let mut want: Vec<u32> = model.iter().filter(|(d, _)| *d <= now).map(|(_, e)| *e).collect();
                    want.sort_unstable();
                    model.retain(|(d, _)| *d > now);
                    prop_assert_eq!(got, want);
                }
            }
            prop_assert_eq!(wheel.len(), model.len());
        }
    }
}

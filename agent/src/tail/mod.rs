//! Tail sampling: kept spans wait, in memory first and in the store (`tracetap-storage`, sled) when
//! they must wait long, until their trace is decided by the policies; only kept traces are exported.
//!
//! Flow: the capture thread batches and encodes spans as without tail sampling, but hands the
//! batches to the [`TailQueue`] instead of the exporter; the tail thread ([`run`]) reads them,
//! holds each trace's spans in memory and arms its decision time; on every tick it decides the
//! traces that are due (from memory, or from the store for those that spilled there, see
//! `engine`) and queues the kept ones for export.
//!
//! Invariants:
//! - A trace is decided `grace` after its root span here (a SERVER span: its parent is remote or
//!   absent) reached the tail stage, or `decision_wait` after its first span did, whichever comes
//!   first. Arrival, not the span's end time: the grace is there for the trace's other fragments
//!   (other processes, exchanges, batches) to arrive, which is measured from arrival too
//!   (`tracetap_tail_fragment_gap_max_ms`). Times are wall-clock, persisted with the trace, so a
//!   restarted agent decides as if it had never stopped.
//! - A trace decided in memory never touches the store; the journal (`journal`) brings it back
//!   after a crash: undecided, it waits out its grace; kept and not reported exported, it is
//!   exported again. A crash loses the last group commit's records at most (100 ms). What follows
//!   is about traces in the store.
//! - A tick's decisions are committed to the store as one write, and made durable before any kept
//!   span of them is queued for export; a kept trace stays in the store's outbox until the exporter
//!   reports its batch done (sent, or failed for good and counted), so a crash in between
//!   re-exports it after the restart rather than losing it. A decision that was not yet durable at
//!   a crash concerned a trace nothing was exported of: it is made again from the same spans.
//!   Export is therefore at least once across crashes; nothing exported was decided twice. A trace
//!   that reached the agent in parts is decided once as long as the decision cache still holds
//!   the first part's decision when the others are decided (see `engine`).
//! - Late spans (their trace already decided, and still in the bounded decision cache) follow the
//!   decision: exported at once or dropped, and counted.
//! - The capture thread never blocks on this stage: when the queue backs up, whole traces are shed
//!   by their randomness, as a lower sampling ratio would (see [`TailQueue::shed_threshold`]).
//! - Memory is bounded: past `max_memory_bytes` the oldest traces in memory go to the store. Disk is
//!   bounded: past `max_disk_bytes` of spans in the store the oldest traces there are decided early.

mod decision_cache;
pub mod engine;
pub mod journal;
mod outgoing;
pub mod policy;
pub mod policy_file;
mod span_buf;
pub mod store;
pub mod wheel;
pub mod wire;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use tracetap_proxy::trace_context::MAX_THRESHOLD;
use tracetap_storage::TailStore;

use crate::export::BatchQueue;
use crate::metrics::{self, Metrics};
use crate::pipeline::{Delivered, EncodedBatch};
use engine::Engine;
use policy::NamedPolicy;

/// How often the tail thread decides due traces, drops finished partitions and publishes metrics.
const TICK: Duration = Duration::from_millis(100);

/// While exports are out, the tail thread looks for their reports this often (not only when a
/// batch arrives or a tick is due): a kept trace is sent again after a crash if its report was not
/// journaled, so the shorter this window, the fewer re-sent traces.
const ACK_POLL: Duration = Duration::from_millis(5);

/// The longest a partial batch of kept spans waits on the capture thread before it is handed to
/// the tail stage (`OTEL_BSP_SCHEDULE_DELAY` applies to exports, which the tail stage makes): a
/// trace's fragments that fall into two batches arrive at most about this far apart.
pub const HANDOFF_DELAY: Duration = Duration::from_millis(100);

/// Where the policies come from.
#[derive(Debug, Clone, PartialEq)]
pub enum PolicySource {
    /// Built from `TRACETAP_TAIL_KEEP_ERRORS`, `_LATENCY_MS`, `_RATIO`, `_MAX_SPANS_PER_SEC`.
    Env(Vec<NamedPolicy>),
    /// `TRACETAP_TAIL_POLICY_FILE`, read and validated at start.
    File(PathBuf),
}

#[derive(Debug, Clone, PartialEq)]
pub struct TailConfig {
    pub state_dir: PathBuf,
    pub grace: Duration,
    pub decision_wait: Duration,
    /// `TRACETAP_TAIL_SPILL_AFTER`.
    pub spill_after: Duration,
    /// `TRACETAP_TAIL_MAX_MEMORY_BYTES`.
    pub max_memory_bytes: u64,
    pub max_disk_bytes: u64,
    /// `TRACETAP_TAIL_JOURNAL` (`None`: off).
    pub journal: Option<journal::Sync>,
    pub decision_cache: usize,
    pub policies: PolicySource,
}

/// The capture thread's end of the queue to the tail thread.
#[derive(Debug, Clone)]
pub struct TailQueue {
    tx: std_mpsc::SyncSender<EncodedBatch>,
    depth: Arc<AtomicUsize>,
    capacity: usize,
    metrics: Arc<Metrics>,
}

/// The tail thread's end.
#[derive(Debug)]
pub struct TailReceiver {
    rx: std_mpsc::Receiver<EncodedBatch>,
    depth: Arc<AtomicUsize>,
}

/// A queue of `capacity` batches.
#[must_use]
pub fn queue(capacity: usize, metrics: Arc<Metrics>) -> (TailQueue, TailReceiver) {
    let (tx, rx) = std_mpsc::sync_channel(capacity);
    let depth = Arc::new(AtomicUsize::new(0));
    (TailQueue { tx, depth: Arc::clone(&depth), capacity, metrics }, TailReceiver { rx, depth })
}

impl TailQueue {
    /// The rejection threshold below which the capture thread sheds traces: 0 while the queue is
    /// at most half full, then rising linearly to shed everything when it is full. Shedding by
    /// randomness keeps whole traces (and the same traces on every tier), like a lower ratio.
    #[must_use]
    pub fn shed_threshold(&self) -> u64 {
        let depth = self.depth.load(Relaxed);
        let half = self.capacity / 2;
        if depth <= half {
            return 0;
        }
        let over = (depth - half) as f64 / (self.capacity - half).max(1) as f64;
        (over.min(1.0) * MAX_THRESHOLD as f64) as u64
    }

    /// Counts a trace shed by the capture thread.
    pub fn shed(&self, traces: u64) {
        metrics::add(&self.metrics.tail_shed_traces, traces);
    }

    /// Queues a batch without blocking; a full queue sheds its traces, counted.
    pub fn push(&self, batch: EncodedBatch) {
        let traces = batch.traces;
        self.depth.fetch_add(1, Relaxed);
        if self.tx.try_send(batch).is_err() {
            self.depth.fetch_sub(1, Relaxed);
            self.shed(traces);
        }
    }
}

/// Without a store (not even a fresh one could be opened): takes the capture thread's batches and
/// counts their spans as lost, until the capture thread drops its queue end.
pub fn run_without_store(input: &TailReceiver, metrics: &Metrics) {
    while let Ok(batch) = input.rx.recv() {
        input.depth.fetch_sub(1, Relaxed);
        metrics::add(&metrics.tail_spans_lost, batch.spans);
    }
}

/// Runs the tail thread until the capture thread drops its queue end; then hands the last kept
/// traces to the exporter and waits (at most `ack_wait`) for it to report them done, so that a
/// clean stop does not export them again at the next start. Pending traces stay in the store.
pub fn run<S: TailStore>(
    mut engine: Engine<S>,
    input: &TailReceiver,
    export: &BatchQueue,
    metrics: &Metrics,
    ack_wait: Duration,
) {
    let (ack_tx, ack_rx) = std_mpsc::channel::<Vec<engine::Delivery>>();
    let mut outstanding = 0usize;
    let mut last_tick = Instant::now();
    let send = |engine: &mut Engine<S>, outstanding: &mut usize| {
        while let Some(out) = engine.take_export() {
            let body = out.request.into();
            let (deliveries, ack_tx) = (out.deliveries, ack_tx.clone());
            // The tail thread may be gone at shutdown; the outbox then re-exports at the next start.
            let delivered = Delivered::new(move || drop(ack_tx.send(deliveries)));
            let batch = EncodedBatch { body, spans: out.spans, traces: out.traces, delivered: Some(delivered) };
            // Blocking is fine here (this is not the capture thread); it is the backpressure that
            // makes the capture thread shed when the exporter cannot keep up.
            if export.push_waiting(batch).is_err() {
                return;
            }
            *outstanding += 1;
        }
    };
    loop {
        let wait = if outstanding > 0 { ACK_POLL } else { TICK };
        match input.rx.recv_timeout(wait) {
            Ok(batch) => {
                input.depth.fetch_sub(1, Relaxed);
                if engine.ingest(&batch.body, unix_now_ns()).is_err() {
                    // Our own encoder wrote it; count rather than trust.
                    engine.count_lost(batch.spans);
                }
            }
            Err(std_mpsc::RecvTimeoutError::Timeout) => {}
            Err(std_mpsc::RecvTimeoutError::Disconnected) => break,
        }
        let mut acked = false;
        while let Ok(done) = ack_rx.try_recv() {
            outstanding -= 1;
            engine.delivered(&done);
            acked = true;
        }
        if acked {
            // Journaled at once (see ACK_POLL).
            engine.commit_journal();
        }
        if last_tick.elapsed() >= TICK {
            engine.tick(unix_now_ns());
            // Gauges once a tick, not per batch: they sum over partitions and ask sled its size.
            engine.publish(metrics);
            last_tick = Instant::now();
        }
        send(&mut engine, &mut outstanding);
    }
    // Traces still in memory wait in the store for the next start, like any pending trace.
    engine.spill_all(unix_now_ns());
    engine.flush_export();
    send(&mut engine, &mut outstanding);
    let deadline = Instant::now() + ack_wait;
    while outstanding > 0 {
        let Some(left) = deadline.checked_duration_since(Instant::now()) else { break };
        match ack_rx.recv_timeout(left) {
            Ok(done) => {
                outstanding -= 1;
                engine.delivered(&done);
            }
            Err(_) => break,
        }
    }
    engine.close();
    engine.publish(metrics);
}

/// Wall-clock time in ns since the Unix epoch.
#[must_use]
pub fn unix_now_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn sheds_by_randomness_once_half_full_and_counts_what_a_full_queue_refuses() {
        let metrics = Arc::new(Metrics::default());
        let (queue, input) = queue(4, Arc::clone(&metrics));
        assert_eq!(queue.shed_threshold(), 0, "empty: nothing shed");
        let batch = || EncodedBatch::new(Bytes::from_static(b""), 2, 1);
        queue.push(batch());
        queue.push(batch());
        assert_eq!(queue.shed_threshold(), 0, "half full: nothing shed yet");
        queue.push(batch());
        assert_eq!(queue.shed_threshold(), MAX_THRESHOLD / 2, "three quarters: the lower half of randomness");
        queue.push(batch());
        assert_eq!(queue.shed_threshold(), MAX_THRESHOLD, "full: everything");
        queue.push(batch());
        assert_eq!(metrics.tail_shed_traces.load(Relaxed), 1, "the refused batch's trace is counted");
        let _ = input.rx.try_recv().unwrap();
        input.depth.fetch_sub(1, Relaxed);
        assert_eq!(queue.shed_threshold(), MAX_THRESHOLD / 2);
    }
}

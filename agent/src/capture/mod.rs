//! Capture: the thread that drains the ring buffer, keeps the target set current, runs the tracker
//! and turns finished exchanges into spans for the export queue.
//!
//! One thread owns the tracker, so the per-event path takes no lock. The probes do not wake it per
//! record (that would cost the traced thread an interrupt per syscall): it drains the ring every
//! [`POLL`] while records arrive, backing off to [`IDLE_POLL`] while none do, or earlier when the
//! probes force a wake-up because the ring is filling, and does its housekeeping (discovery,
//! expiry, loss counters) every 250 ms.

mod awaiting;
pub mod decode;
mod detach;
pub mod discovery;
pub mod loader;
pub mod opaque;
mod per_process;
pub mod pods;
pub mod tls;
pub mod tls_hooks;
mod tls_route;
pub mod uprobes;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use tracetap_ebpf_common::Loss;
use tracetap_proxy::haproxy_config::ProxyNames;
use tracetap_proxy::{Limits, ServerExchange, Tracker};

use crate::batch::Batcher;
use crate::config::Config;
use crate::export::BatchQueue;
use crate::metrics::{self, Metrics};
use crate::names::Names;
use crate::pipeline::EncodedBatch;
use crate::procfs::sockets::ListenAddrs;
use crate::sampling::randomness;
use crate::spans::{Decision, SpanBuilder};
use crate::tail::TailQueue;
use awaiting::Staging;
use loader::Probes;
use per_process::PerProcess;
use pods::Pods;
use tracetap_proxy::Op;

const HOUSEKEEPING: Duration = Duration::from_millis(250);
/// The ring is drained this often while records arrive...
const POLL: Duration = Duration::from_millis(10);
/// ...and, while none do, at intervals that double up to this (an idle agent wakes 50 times a
/// second, not 200). Not longer: what arrives in one interval is handed out at once, and at
/// 20 000 req/s 20 ms of spans (800) must fit the export queue (2048 by default), or a burst
/// after a quiet spell would be dropped.
const IDLE_POLL: Duration = Duration::from_millis(20);

/// Where encoded batches go: straight to the exporter, or to the tail thread.
#[derive(Debug)]
pub enum Output {
    Export(BatchQueue),
    Tail(TailQueue),
}

impl Output {
    fn push(&self, batch: EncodedBatch) {
        match self {
            Self::Export(q) => q.push(batch),
            Self::Tail(q) => q.push(batch),
        }
    }

    /// How long a partial batch waits. The tail stage is in this process and decides by arrival
    /// (its grace runs from when a trace's root span reaches it): partial batches go to it within
    /// [`crate::tail::HANDOFF_DELAY`], not after the export delay, which applies to its exports.
    fn batch_delay(&self, config: &Config) -> Duration {
        match self {
            Self::Export(_) => config.schedule_delay,
            Self::Tail(_) => config.schedule_delay.min(crate::tail::HANDOFF_DELAY),
        }
    }

    /// True when a kept trace must be shed because the tail stage is behind (see
    /// [`TailQueue::shed_threshold`]); counted.
    fn sheds(&self, trace_id: &[u8; 16]) -> bool {
        let Self::Tail(q) = self else { return false };
        let threshold = q.shed_threshold();
        let shed = threshold > 0 && randomness(trace_id) < threshold;
        if shed {
            q.shed(1);
        }
        shed
    }
}

/// Set once the first disagreement the tracker saw at a backend request's head was logged.
static WARNED_AT_HEAD: AtomicBool = AtomicBool::new(false);

/// Runs until `stop` is set, then hands out nothing more and returns (dropping the queue sender
/// lets the exporter, or the tail thread, flush and finish).
#[expect(clippy::needless_pass_by_value, reason = "the queue is dropped on return, which lets the exporter finish")]
#[expect(
    clippy::too_many_lines,
    reason = "the capture loop owns every per-event structure, so that no event takes a lock; split, its steps would pass a dozen of them around"
)]
pub fn run(mut probes: Probes, config: &Config, metrics: &Metrics, queue: Output, pods: Pods, stop: &Arc<AtomicBool>) {
    let mut tracker = Tracker::new(Limits {
        exchange_timeout_ns: config.exchange_idle_timeout.as_nanos() as u64,
        sampled_out: config.sampler.sampled_out_rule(),
        ..Limits::default()
    });
    let mut builder = SpanBuilder::new(config.sampler, loader::monotonic_to_unix_offset_ns())
        .with_value_length_limit(config.attribute_value_length_limit)
        .with_rejected_limit(config.rejected_spans_per_second);
    let mut targets: BTreeSet<u32> = BTreeSet::new();
    let mut staging = Staging::default();
    let mut per_process = PerProcess {
        opaque: opaque::OpaqueMarks::default(),
        listeners: ListenAddrs::new(Path::new("/proc")),
        names: Names::new(Path::new("/proc"), config.runtime_api),
        batcher: Batcher::new(config.max_export_batch_size, queue.batch_delay(config), config.resource()),
        pods,
    };
    let mut last_housekeeping: Option<Instant> = None;
    // Walking /proc happens on the discovery thread; until its first result, nothing is selected.
    // A command filter also acts in the kernel, which traces a new HAProxy from its first
    // syscall: discovery then only has to learn of it for names and metrics, and walks half as
    // often. Traced pids have children only discovery can find (forked workers).
    // A pod selector turns the kernel's name filter off (see `Probes::load`): discovery is then
    // what adds a new HAProxy, at the housekeeping period.
    let walk_period = match config.targets {
        crate::config::Targets::Comm(_) if config.pod_selector.is_none() => 2 * HOUSEKEEPING,
        crate::config::Targets::Comm(_) | crate::config::Targets::Pids(_) => HOUSEKEEPING,
    };
    let discovery = match discovery::Discovery::start("/proc".into(), config.targets.clone(), walk_period) {
        Ok(d) => d,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the discovery thread; no process will be traced");
            return;
        }
    };
    let mut candidates: BTreeSet<u32> = BTreeSet::new();
    // The probes' count of records the ring had no room for, as the last record carried it.
    let mut loss_epoch: Option<u32> = None;
    let mut poll = POLL;
    let mut payload_bytes = 0u64;
    let mut lifecycles = Lifecycles::default();
    while !stop.load(Relaxed) {
        if last_housekeeping.is_none_or(|t| t.elapsed() >= HOUSEKEEPING) || lifecycles.exits_pending {
            if let Some(latest) = discovery.latest() {
                candidates = latest;
            }
            lifecycles.expire(&candidates);
            per_process.pods.keep_only(&candidates);
            let selected: BTreeSet<u32> = candidates
                .iter()
                .copied()
                .filter(|pid| per_process.pods.selected(*pid) && !lifecycles.exited(*pid))
                .collect();
            metrics::set(&metrics.k8s_targets_not_selected, (candidates.len() - selected.len()) as u64);
            let ended = lifecycles.take_ended();
            for pid in refresh_targets(&mut probes, selected, &mut targets, &mut tracker, metrics, ended) {
                per_process.forget(&mut probes.opaque, pid);
            }
            per_process.pods.refresh(&targets, &mut per_process.batcher);
            per_process.names.refresh(&targets, metrics, loader::monotonic_ns());
            // Ready once a target's configuration names are in (or known unreadable), so that the
            // connections made after /readyz are named and their mode known.
            metrics.ready.store(probes.attached > 0 && per_process.names.any_settled(&targets), Relaxed);
            tracker.expire(loader::monotonic_ns());
            lifecycles.unhook_strays(&mut probes, &targets);
            publish(&probes, &tracker, metrics);
            last_housekeeping = Some(Instant::now());
        }
        probes.wait(poll.min(HOUSEKEEPING.saturating_sub(last_housekeeping.map_or(Duration::ZERO, |t| t.elapsed()))));
        let mut events = 0u64;
        // A process's start or end is handled as soon as it is read (which needs the probes the
        // ring borrows from): the drain stops there and goes on after it.
        let mut lifecycle = None;
        loop {
            if let Some(event) = lifecycle.take() {
                lifecycles.handle(event, &mut probes, metrics);
            }
            let Some(record) = probes.ring.next() else { break };
            events += 1;
            let Ok(header) = decode::header(&record) else {
                metrics::add(&metrics.events_malformed, 1);
                continue;
            };
            if let Some(event) = decode::lifecycle(&header) {
                lifecycle = Some(event);
                continue;
            }
            payload_bytes += u64::from(header.captured);
            if loss_epoch.replace(header.loss_epoch).is_some_and(|e| e != header.loss_epoch) {
                // Records were lost just before this one: the tracker stops trusting links first.
                tracker.records_lost(header.ts_ns);
            }
            match decode::event(&header, &record) {
                Ok(mut ev) => {
                    if let Op::Accept { local, .. } = &mut ev.op {
                        *local = per_process.listeners.local_addr(ev.tgid, header.ret as i32);
                    }
                    // A close ends a connection's mark; so does a new connection on the same fd (the
                    // close record of the old one may have been lost, or the fd closed by exec).
                    // A TLS binding drops the connection's mark in the probes (see the tracker's `tls`).
                    if matches!(ev.op, Op::Close | Op::Accept { .. } | Op::Connect { .. } | Op::Tls { .. })
                        && !per_process.opaque.is_empty()
                    {
                        per_process.opaque.closed(&mut probes.opaque, ev.tgid, ev.fd);
                    }
                    tracker.handle(&ev);
                    if is_tcp_mode(&ev, &mut per_process.names) {
                        tracker.handle(&tracetap_proxy::SyscallEvent { op: Op::Ignore, ..ev });
                    }
                    for mark in tracker.take_opaque_marks() {
                        per_process.opaque.mark(&mut probes.opaque, mark);
                    }
                }
                Err(_) => metrics::add(&metrics.events_malformed, 1),
            }
            if events.is_multiple_of(64) {
                hand_out(&mut tracker, &mut staging, &mut builder, &mut per_process, &queue, metrics);
            }
        }
        probes.tls.end_bridges_when_due();
        for pid in probes.tls.retry_pending() {
            hook_tls(&mut probes, pid, metrics);
        }
        poll = if events == 0 { (poll * 2).min(IDLE_POLL) } else { POLL };
        metrics::add(&metrics.events_captured, events);
        metrics::add(&metrics.payload_bytes_captured, std::mem::take(&mut payload_bytes));
        publish_marks(&per_process.opaque, metrics);
        hand_out(&mut tracker, &mut staging, &mut builder, &mut per_process, &queue, metrics);
        publish_tracker(&tracker, metrics);
    }
    // What waits for its names goes with the best table so far.
    staging.release_all(&mut per_process.names, &mut |ex, decision, n| {
        add_and_flush(ex, &decision, n.as_deref(), &mut per_process.batcher, &mut builder, &mut tracker, &queue);
    });
    flush(&mut per_process.batcher, &queue);
    publish(&probes, &tracker, metrics);
    if tracker.open_exchanges() > 0 {
        tracing::info!(open = tracker.open_exchanges(), "exchanges still open at shutdown are not exported");
    }
}

/// What the capture loop does with processes starting and ending (see
/// [`tracetap_ebpf_common::EventKind::ProcessStart`]): a new traced process gets its TLS probes at
/// once, not at the next discovery walk, so that a new `HAProxy` worker has them before it accepts
/// its first connection; an ended one is untraced at once, with everything kept for it.
#[derive(Default)]
struct Lifecycles {
    /// Processes that ended, and when: discovery may still list them for a walk or two, and they
    /// must not be traced again. Kept only a few walks (a pid is reused eventually).
    exited: std::collections::HashMap<u32, Instant>,
    /// Processes hooked at their start, and when (discovery adds them to the targets later).
    started: std::collections::HashMap<u32, Instant>,
    /// An exit arrived since the last housekeeping, which then runs at once.
    exits_pending: bool,
    /// Processes that ended since the last housekeeping, to forget whether or not they were
    /// targets.
    ended: Vec<u32>,
}

/// How long an ended process stays excluded from discovery's results, and a started one may stay
/// hooked before discovery selects it.
const LIFECYCLE_GRACE: Duration = Duration::from_secs(2);

impl Lifecycles {
    fn handle(&mut self, event: decode::Lifecycle, probes: &mut Probes, metrics: &Metrics) {
        match event {
            decode::Lifecycle::Start(pid, started_ns) => {
                // A pid reused at once is a new process: not the one that ended.
                self.exited.remove(&pid);
                self.ended.retain(|p| *p != pid);
                if self.started.insert(pid, Instant::now()).is_some() && probes.tls.settled(pid) {
                    // Reported by its parent and by itself: hooked on the first report.
                    return;
                }
                let seen_us = loader::monotonic_ns().saturating_sub(started_ns) / 1000;
                hook_tls(probes, pid, metrics);
                let hooked_us = loader::monotonic_ns().saturating_sub(started_ns) / 1000;
                tracing::debug!(pid, seen_us, hooked_us, "process started");
                probes.new_process_hooked();
            }
            decode::Lifecycle::Exec(pid) => {
                // A process with a reused pid may be reported by its exec alone (its parent is not
                // traced): not the one that ended.
                self.exited.remove(&pid);
                match probes.tls.expect_new_workers(pid) {
                    Some(Ok(links)) => tracing::debug!(pid, links, "traced process executed a program; TLS bridge up"),
                    Some(Err(error)) => {
                        tracing::warn!(pid, %error, "cannot bridge the TLS probes over this reload; the new workers' first connections may go untraced");
                    }
                    None => tracing::debug!(pid, "traced process executed a program"),
                }
            }
            decode::Lifecycle::Exit(pid) => {
                self.started.remove(&pid);
                self.exited.insert(pid, Instant::now());
                probes.unhook_tls(pid);
                self.exits_pending = true;
                self.ended.push(pid);
            }
        }
    }

    fn take_ended(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.ended)
    }

    fn exited(&self, pid: u32) -> bool {
        self.exited.contains_key(&pid)
    }

    /// Forgets exits older than the grace (or no longer listed by discovery), and clears the
    /// pending flag: housekeeping is running.
    fn expire(&mut self, candidates: &BTreeSet<u32>) {
        self.exits_pending = false;
        self.exited.retain(|pid, at| candidates.contains(pid) && at.elapsed() < LIFECYCLE_GRACE);
    }

    /// Unhooks processes hooked at their start that discovery never selected within the grace
    /// (a fork that went on to `exec` another program, or one the pod selector leaves out).
    fn unhook_strays(&mut self, probes: &mut Probes, targets: &BTreeSet<u32>) {
        self.started.retain(|pid, at| {
            if targets.contains(pid) {
                return false;
            }
            if at.elapsed() < LIFECYCLE_GRACE {
                return true;
            }
            probes.unhook_tls(*pid);
            false
        });
    }
}

/// Takes the sampling decision for every finished exchange, batches the kept ones and queues the
/// batches that are due. Dropped exchanges go straight back to the tracker for reuse.
fn hand_out(
    tracker: &mut Tracker,
    staging: &mut Staging,
    builder: &mut SpanBuilder,
    per_process: &mut PerProcess,
    queue: &Output,
    metrics: &Metrics,
) {
    let PerProcess { names, batcher, .. } = per_process;
    names.tick(loader::monotonic_ns());
    let add = |ex,
               decision: Decision,
               n: Option<Arc<ProxyNames>>,
               batcher: &mut Batcher,
               builder: &mut SpanBuilder,
               tracker: &mut Tracker| {
        let spans = add_and_flush(ex, &decision, n.as_deref(), batcher, builder, tracker, queue);
        metrics::add(&metrics.spans_built, spans as u64);
    };
    staging.release(names, &mut |ex, decision, n| add(ex, decision, n, batcher, builder, tracker));
    let mut scratch = std::mem::take(&mut staging.scratch);
    scratch.extend(tracker.drain());
    for ex in scratch.drain(..) {
        if !builder.admit(&ex) {
            tracker.recycle(ex);
            continue;
        }
        match builder.decide(&ex) {
            None => {
                metrics::add(&metrics.sampled_out, 1);
                tracker.recycle(ex);
            }
            Some(decision) if queue.sheds(&decision.trace_id) => tracker.recycle(ex),
            Some(decision) => {
                metrics::add(&metrics.sampled_in, 1);
                // Named as HAProxy's servers were when it sent the backend request: with the
                // runtime API in use, that may mean waiting for its next table read.
                if let Some((ex, decision, n)) = staging.names_for(names, ex, decision) {
                    add(ex, decision, n, batcher, builder, tracker);
                }
            }
        }
    }
    staging.scratch = scratch;
    if batcher.is_due(Instant::now()) {
        flush(batcher, queue);
    }
    let decided = builder.stats();
    metrics::set(&metrics.propagated, decided.propagated);
    // The tracker counts the disagreements it sees at a backend request's head (a "sampled" flag
    // forwarded for a request dropped at its head); the builder, those it sees when it follows one.
    let at_head = tracker.stats().head_disagreements;
    if at_head > 0 && !WARNED_AT_HEAD.swap(true, Relaxed) {
        tracing::warn!(
            "HAProxy forwarded a sampled flag for a request whose own traceparent OTEL_TRACES_SAMPLER drops; that \
             request was decided at its head, so its backend request is left out. Print the lines again with \
             `tracetap haproxy-snippet` under this agent's sampler settings."
        );
    }
    metrics::set(&metrics.sampling_disagreements, decided.disagreements + at_head);
    metrics::set(&metrics.server_names_ambiguous, decided.ambiguous_servers);
    metrics::set(&metrics.rejected_spans_dropped, decided.rejected_dropped);
    metrics::set(&metrics.server_names_waiting, staging.waiting() as u64);
    metrics::set(&metrics.server_names_unsettled, staging.unsettled);
}

fn publish_marks(opaque: &opaque::OpaqueMarks, metrics: &Metrics) {
    let marks = opaque.stats();
    metrics::set(&metrics.opaque_marks, marks.marked);
    metrics::set(&metrics.opaque_marks_refused, marks.refused);
}

/// Adds a kept exchange's spans to the batch (flushed when full) and gives the exchange back to
/// the tracker; returns how many spans.
fn add_and_flush(
    ex: ServerExchange,
    decision: &Decision,
    names: Option<&ProxyNames>,
    batcher: &mut Batcher,
    builder: &mut SpanBuilder,
    tracker: &mut Tracker,
    queue: &Output,
) -> usize {
    let spans = batcher.add(&ex, decision, names, builder);
    tracker.recycle(ex);
    if batcher.is_full() {
        flush(batcher, queue);
    }
    spans
}

fn flush(batcher: &mut Batcher, queue: &Output) {
    if let Some(batch) = batcher.flush() {
        queue.push(batch);
    }
}

/// True for a connection accepted by, or opened for, a `mode tcp` section of HAProxy's config.
fn is_tcp_mode(ev: &tracetap_proxy::SyscallEvent<'_>, names: &mut Names) -> bool {
    let addr_is_tcp =
        |names: &mut Names, check: &dyn Fn(&ProxyNames) -> bool| names.of(ev.tgid).is_some_and(|n| check(&n));
    match ev.op {
        Op::Accept { local: Some(local), .. } => addr_is_tcp(names, &|n| n.bind(local).is_some_and(|b| b.tcp)),
        Op::Connect { server: Some(server) } => addr_is_tcp(names, &|n| n.server_line(server).is_some_and(|s| s.tcp)),
        _ => false,
    }
}

/// Makes `now` the traced set; returns the processes no longer traced, with those of `ended` that
/// were not targets: a traced process that ended before discovery ever selected it (a short-lived
/// HAProxy the kernel traced by its name) has connections in the tracker all the same.
fn refresh_targets(
    probes: &mut Probes,
    now: BTreeSet<u32>,
    targets: &mut BTreeSet<u32>,
    tracker: &mut Tracker,
    metrics: &Metrics,
    ended: Vec<u32>,
) -> Vec<u32> {
    for pid in now.difference(targets) {
        if let Err(e) = probes.trace(*pid) {
            tracing::warn!(pid, error = %e, "cannot add target process to the probe filter");
        } else {
            tracing::info!(pid, "tracing process");
        }
        hook_tls(probes, *pid, metrics);
    }
    let mut gone: Vec<u32> = targets.difference(&now).copied().collect();
    for pid in &gone {
        probes.untrace(*pid);
        probes.unhook_tls(*pid);
        tracker.forget_process(*pid, loader::monotonic_ns());
        tracing::info!(pid, "process gone");
    }
    for pid in ended {
        if !targets.contains(&pid) {
            tracker.forget_process(pid, loader::monotonic_ns());
            gone.push(pid);
        }
    }
    *targets = now;
    probes.write_target_set(&targets.iter().copied().collect::<Vec<_>>());
    metrics::set(&metrics.targets, targets.len() as u64);
    gone
}

/// Attaches the TLS probes to a newly traced process, when it maps a TLS library.
fn hook_tls(probes: &mut Probes, pid: u32, metrics: &Metrics) {
    if !probes.tls.captures() || probes.tls.settled(pid) {
        return;
    }
    // A process that ended meanwhile (a short-lived child reported at its fork) is no failure.
    let ended = || !Path::new("/proc").join(pid.to_string()).exists();
    let objects = match tls::objects_of(Path::new("/proc"), pid) {
        Ok(objects) => objects,
        Err(e) if ended() => {
            tracing::debug!(pid, error = %e, "process ended before its TLS library was found");
            return;
        }
        Err(e) => {
            tracing::warn!(pid, error = %e, "cannot read the process's memory maps; its TLS connections are not traced");
            metrics::add(&metrics.tls_hook_failures, 1);
            return;
        }
    };
    let hooked = probes.hook_tls(pid, &objects.usable);
    if !matches!(
        hooked,
        tls_hooks::TlsHook::Attached { .. } | tls_hooks::TlsHook::AlreadyHooked | tls_hooks::TlsHook::Pending
    ) && ended()
    {
        tracing::debug!(pid, ?hooked, "process ended before its TLS probes were attached");
        return;
    }
    match hooked {
        tls_hooks::TlsHook::Attached { object, call_sites } => {
            // Functions whose call sites were not recognised (any other build, and every
            // non-x86_64 library) are probed at their entries and returns, which costs more.
            let placement = if call_sites == 0 { "entry and return" } else { "call sites" };
            tracing::info!(pid, object = %object.display(), call_sites, placement, "TLS probes attached");
        }
        tls_hooks::TlsHook::NoLibrary if !objects.unreachable.is_empty() => {
            tracing::warn!(pid, libraries = ?objects.unreachable, "the process maps a TLS library the agent cannot open (deleted or replaced since it was mapped, or on a mount the agent does not see); its TLS connections are not traced");
            metrics::add(&metrics.tls_hook_failures, 1);
        }
        tls_hooks::TlsHook::NoLibrary => tracing::debug!(pid, "no TLS library mapped"),
        tls_hooks::TlsHook::AlreadyHooked => {}
        tls_hooks::TlsHook::Pending => {
            tracing::debug!(pid, "TLS probes wait: the library is being read for its plan, or the old links detached");
        }
        tls_hooks::TlsHook::Failed { object, error } if probes.tls.route().is_err() => {
            // The one message was logged at start (and is on /readyz); each process is counted.
            tracing::warn!(pid, object = %object.display(), "cannot attach the TLS probes: no route to the kernel on this node (see the message at start or /readyz); this process's TLS connections are not traced");
            tracing::debug!(pid, %error);
            metrics::add(&metrics.tls_hook_failures, 1);
        }
        tls_hooks::TlsHook::Failed { object, error } => {
            tracing::warn!(pid, object = %object.display(), %error, "cannot attach the TLS probes; this process's TLS connections are not traced");
            metrics::add(&metrics.tls_hook_failures, 1);
        }
    }
}

fn publish(probes: &Probes, tracker: &Tracker, metrics: &Metrics) {
    let losses = probes.losses();
    metrics::set(&metrics.events_lost_ring_full, losses[Loss::RingFull as usize]);
    metrics::set(&metrics.events_lost_read_failed, losses[Loss::ReadFailed as usize]);
    metrics::set(&metrics.events_lost_tls_unbound, losses[Loss::TlsUnbound as usize]);
    metrics::set(&metrics.tls_processes, probes.tls.hooked_processes() as u64);
    metrics::set(&metrics.tls_links_detaching, probes.tls.links_detaching() as u64);
    let (runs, ns) = probes.run_stats();
    metrics::set(&metrics.probe_runs, runs);
    metrics::set(&metrics.probe_run_time_ns, ns);
    publish_tracker(tracker, metrics);
}

/// Mirrors the tracker's counters (plain stores: cheap enough for every wake-up).
fn publish_tracker(tracker: &Tracker, metrics: &Metrics) {
    let s = tracker.stats();
    metrics::set(&metrics.parse_errors, s.parse_errors);
    metrics::set(&metrics.opaque_connections, s.opaque_connections);
    metrics::set(&metrics.unknown_descriptors, s.unknown_descriptors);
    metrics::set(&metrics.unpaired_responses, s.unpaired_responses);
    metrics::set(&metrics.requests_seen, s.frontend_requests);
    metrics::set(&metrics.backend_requests_seen, s.backend_requests);
    metrics::set(&metrics.backend_unlinked, s.unlinked_backend_requests);
    // The tracker's drops at the head join the sampler's later ones in `sampled_out`, which the
    // capture loop adds to; this is the only writer of `sampled_out_at_head`.
    let before = metrics.sampled_out_at_head.swap(s.sampled_out_requests, Relaxed);
    metrics::add(&metrics.sampled_out, s.sampled_out_requests.saturating_sub(before));
    metrics::set(&metrics.sampled_out_in_probe, s.requests_dropped_in_probe);
    metrics::set(&metrics.backend_sampled_out_at_head, s.sampled_out_backend_requests);
    metrics::set(&metrics.backend_late, s.late_backend_exchanges);
    metrics::set(&metrics.truncated_heads, s.truncated_heads);
    metrics::set(&metrics.exchanges_expired, s.expired_exchanges);
    metrics::set(&metrics.capture_gaps, s.capture_gaps);
    metrics::set(&metrics.gap_exchanges, s.gap_exchanges);
    metrics::set(&metrics.unnumbered_connections, s.unnumbered_connections);
    metrics::set(&metrics.backend_relinked, s.relinked_backend_exchanges);
    metrics::set(&metrics.backend_quarantined, s.quarantined_backend_exchanges);
    metrics::set(&metrics.h2_connections, s.h2_connections);
    metrics::set(&metrics.h2_streams, s.h2_streams);
    metrics::set(&metrics.h2_resets, s.h2_resets);
    metrics::set(&metrics.h2_goaways, s.h2_goaways);
    metrics::set(&metrics.h2_desyncs, s.h2_desyncs);
    metrics::set(&metrics.connections, tracker.connections() as u64);
    metrics::set(&metrics.open_exchanges, tracker.open_exchanges() as u64);
}

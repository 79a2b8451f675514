//! The engine's unit tests: a fake clock and a `MemoryStore`.

use std::collections::BTreeSet;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span, Status, status::StatusCode};
use prost::Message as _;
use tracetap_storage::{AppendedFragment, DecisionRecord, Fragment, MemoryStore, Outcome, Recovered};

use super::*;
use crate::metrics::DecisionKey;
use crate::tail::policy::{NamedPolicy, Policy};

const S: u64 = 1_000_000_000;
const T0: u64 = 1_800_000_000 * S;

fn limits() -> Limits {
    Limits {
        grace_ns: 2 * S,
        decision_wait_ns: 30 * S,
        max_disk_bytes: 1 << 30,
        decision_cache: 1000,
        export_batch_spans: 512,
        spill_after_ns: 0,
        max_memory_bytes: 1 << 30,
    }
}

fn policies() -> PolicySet {
    PolicySet::new(vec![
        NamedPolicy { name: "errors".into(), policy: Policy::StatusCode { codes: vec![StatusCode::Error] } },
        NamedPolicy { name: "half".into(), policy: Policy::Probabilistic { threshold: 1 << 55 } },
    ])
}

fn trace(n: u8, lucky: bool) -> [u8; 16] {
    let mut id = [n; 16];
    id[9] = if lucky { 0xff } else { 0 };
    id
}

fn span(trace: [u8; 16], id: u8, kind: SpanKind, end: u64, error: bool) -> Span {
    Span {
        trace_id: trace.to_vec(),
        span_id: vec![id; 8],
        kind: kind as i32,
        start_time_unix_nano: end - 1_000_000,
        end_time_unix_nano: end,
        status: Some(Status { code: if error { StatusCode::Error as i32 } else { 0 }, message: String::new() }),
        ..Span::default()
    }
}

fn request(spans: Vec<Span>) -> ExportTraceServiceRequest {
    let resource = Resource {
        attributes: vec![KeyValue {
            key: "process.pid".into(),
            value: Some(AnyValue { value: Some(any_value::Value::IntValue(42)) }),
            ..KeyValue::default()
        }],
        ..Resource::default()
    };
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(resource),
            scope_spans: vec![ScopeSpans { spans, ..ScopeSpans::default() }],
            ..ResourceSpans::default()
        }],
    }
}

/// An exchange: SERVER span and its CLIENT span, ended at `end`.
fn exchange(trace: [u8; 16], end: u64, error: bool) -> ExportTraceServiceRequest {
    request(vec![span(trace, 1, SpanKind::Server, end, error), span(trace, 2, SpanKind::Client, end, false)])
}

fn exported<S: TailStore>(engine: &mut Engine<S>) -> Vec<Span> {
    let mut spans = Vec::new();
    while let Some(out) = engine.take_export() {
        engine.delivered(&out.deliveries);
        for rs in ExportTraceServiceRequest::decode(out.request.as_slice()).unwrap().resource_spans {
            let pid = &rs.resource.as_ref().unwrap().attributes.last().unwrap().value;
            assert_eq!(pid.as_ref().unwrap().value, Some(any_value::Value::IntValue(42)));
            spans.extend(rs.scope_spans.into_iter().flat_map(|ss| ss.spans));
        }
    }
    spans
}

fn open(store: MemoryStore, now: u64) -> Engine<MemoryStore> {
    Engine::open(store, policies(), limits(), vec![("service.name".into(), "haproxy".into())], now).unwrap()
}

#[test]
fn decides_after_the_grace_keeps_errors_and_the_lucky_half() {
    let mut e = open(MemoryStore::new(), T0);
    e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
    e.ingest(&exchange(trace(2, false), T0, false).encode_to_vec(), T0).unwrap();
    e.ingest(&exchange(trace(3, true), T0, false).encode_to_vec(), T0).unwrap();
    e.tick(T0 + S);
    assert_eq!(e.pending_traces(), 3, "grace not over");
    assert!(exported(&mut e).is_empty());
    e.tick(T0 + 2 * S);
    assert_eq!(e.pending_traces(), 0);
    let spans = exported(&mut e);
    assert_eq!(spans.len(), 4);
    let error = spans.iter().find(|s| s.trace_id == trace(1, false)).unwrap();
    assert_eq!(error.trace_state, "", "kept by a non-ratio policy: threshold unchanged");
    let lucky = spans.iter().find(|s| s.trace_id == trace(3, true)).unwrap();
    assert_eq!(lucky.trace_state, "ot=th:8", "kept by the ratio: threshold raised to it");
    assert!(!spans.iter().any(|s| s.trace_id == trace(2, false)));
    let decisions = &e.counts.decisions;
    assert_eq!(decisions[&DecisionKey { policy: Some("errors".to_owned()), kept: true }], 1);
    assert_eq!(decisions[&DecisionKey { policy: None, kept: false }], 1);
}

/// Memory first: spill after 5 s, a memory budget of `memory` bytes.
fn memory_first(memory: u64) -> Limits {
    Limits { spill_after_ns: 5 * S, max_memory_bytes: memory, ..limits() }
}

#[test]
fn a_complete_trace_is_decided_from_memory_and_never_stored() {
    let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(1 << 30), Vec::new(), T0).unwrap();
    e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
    e.ingest(&exchange(trace(2, false), T0, false).encode_to_vec(), T0).unwrap();
    e.tick(T0 + S);
    assert_eq!((e.pending_traces(), e.stored_pending_traces()), (2, 0), "in memory, grace not over");
    e.tick(T0 + 2 * S);
    assert_eq!(e.pending_traces(), 0);
    assert_eq!(exported(&mut e).len(), 2, "the error trace, both spans");
    assert_eq!((e.counts.decided_in_memory, e.counts.spilled), (2, 0));
    // A late span follows the decision remembered in memory.
    e.ingest(&request(vec![span(trace(1, false), 3, SpanKind::Client, T0, false)]).encode_to_vec(), T0 + 3 * S)
        .unwrap();
    e.tick(T0 + 3 * S);
    assert_eq!(exported(&mut e).len(), 1);
    let store = e.into_store();
    assert_eq!(store.disk_bytes(), 0, "nothing was written to the store");
    assert_eq!(store.recover().unwrap(), Recovered::default());
}

/// An engine over `store` with the journal in `dir`, memory first, as the agent runs.
fn journaled(store: MemoryStore, dir: &std::path::Path, now: u64) -> Engine<MemoryStore> {
    let journal = Journal::open(dir, journal::Sync::None, now).unwrap();
    Engine::open_journaled(store, Some(journal), policies(), memory_first(1 << 30), Vec::new(), now).unwrap()
}

/// A crash: the engine is gone without closing; the store keeps what it holds (the memory
/// store has no unflushed state), the journal what was committed.
fn crash_and_restart(e: Engine<MemoryStore>, dir: &std::path::Path, now: u64) -> Engine<MemoryStore> {
    journaled(e.into_store(), dir, now)
}

#[test]
fn traces_waiting_in_memory_survive_a_crash_through_the_journal_and_wait_out_their_grace() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = journaled(MemoryStore::new(), dir.path(), T0);
    e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
    e.ingest(&exchange(trace(2, false), T0, false).encode_to_vec(), T0).unwrap();
    e.tick(T0 + S / 10);
    // Arrived after the last group commit: lost with the process, as the journal says.
    e.ingest(&exchange(trace(3, false), T0, true).encode_to_vec(), T0 + S / 5).unwrap();
    let mut e = crash_and_restart(e, dir.path(), T0 + S);
    assert_eq!(e.pending_traces(), 2, "both committed traces are back in memory");
    assert_eq!(e.stored_pending_traces(), 0);
    e.tick(T0 + S + S / 2);
    assert!(exported(&mut e).is_empty(), "the grace runs from the root's arrival before the crash");
    e.tick(T0 + 2 * S);
    let spans = exported(&mut e);
    assert_eq!(spans.len(), 2, "the error trace, whole");
    assert!(spans.iter().all(|s| s.trace_id == trace(1, false)));
    assert_eq!(e.resent_traces(), 0, "nothing had been exported");
    assert_eq!(e.store.recover().unwrap(), Recovered::default(), "the store was never used");
}

#[test]
fn a_kept_trace_whose_export_was_not_reported_is_sent_again_once_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = journaled(MemoryStore::new(), dir.path(), T0);
    e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
    e.ingest(&exchange(trace(2, false), T0, true).encode_to_vec(), T0).unwrap();
    e.tick(T0 + 2 * S);
    let out = e.take_export().expect("both kept");
    assert_eq!(out.traces, 2);
    // The exporter reports trace 1 done; trace 2 is still in flight at the crash.
    let done: Vec<Delivery> = out
        .deliveries
        .iter()
        .copied()
        .filter(|d| matches!(d, Delivery::Journaled { trace: t, .. } if *t == trace(1, false)))
        .collect();
    assert_eq!(done.len(), 1);
    e.delivered(&done);
    e.tick(T0 + 2 * S + S / 10);
    let mut e = crash_and_restart(e, dir.path(), T0 + 3 * S);
    assert_eq!(e.resent_traces(), 1);
    let spans = exported(&mut e);
    assert_eq!(spans.len(), 2);
    assert!(spans.iter().all(|s| s.trace_id == trace(2, false)), "only the one not reported done");
    // Reported done this time: a second crash sends nothing again, and a late span follows.
    e.tick(T0 + 3 * S + S / 10);
    let mut e = crash_and_restart(e, dir.path(), T0 + 4 * S);
    assert_eq!(e.resent_traces(), 0);
    assert!(exported(&mut e).is_empty());
    e.ingest(&request(vec![span(trace(2, false), 3, SpanKind::Client, T0, false)]).encode_to_vec(), T0 + 4 * S)
        .unwrap();
    e.tick(T0 + 4 * S + S / 10);
    assert_eq!(exported(&mut e).len(), 1, "the late span follows the decision the journal kept");
}

#[test]
fn a_dropped_trace_stays_dropped_and_a_spilled_one_is_the_stores_after_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = journaled(MemoryStore::new(), dir.path(), T0);
    e.ingest(&exchange(trace(1, false), T0, false).encode_to_vec(), T0).unwrap();
    // No root: it waits, and spills after 5 s.
    e.ingest(&request(vec![span(trace(2, false), 2, SpanKind::Client, T0, true)]).encode_to_vec(), T0).unwrap();
    e.tick(T0 + 2 * S);
    assert!(exported(&mut e).is_empty(), "trace 1 dropped");
    e.tick(T0 + 5 * S);
    assert_eq!(e.stored_pending_traces(), 1, "trace 2 spilled");
    e.tick(T0 + 5 * S + S / 10);
    let mut e = crash_and_restart(e, dir.path(), T0 + 6 * S);
    assert_eq!(e.pending_traces(), 1, "trace 2, from the store only: not twice");
    assert_eq!(e.stored_pending_traces(), 1);
    e.tick(T0 + 30 * S);
    let spans = exported(&mut e);
    assert_eq!(spans.len(), 1);
    assert_eq!(spans[0].trace_id, trace(2, false));
}

#[test]
fn a_part_waiting_to_join_its_stored_trace_is_given_to_the_store_after_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = journaled(MemoryStore::new(), dir.path(), T0);
    let client = |id, at| request(vec![span(trace(1, false), id, SpanKind::Client, at, true)]).encode_to_vec();
    e.ingest(&client(2, T0), T0).unwrap();
    e.tick(T0 + 5 * S);
    assert_eq!(e.stored_pending_traces(), 1, "spilled: no root, undecided past spill_after");
    e.ingest(&client(3, T0 + 5 * S), T0 + 5 * S + S / 2).unwrap();
    assert!(e.hot.get(&trace(1, false)).is_some_and(|h| h.joins.is_some()), "the later part waits to join");
    e.tick(T0 + 5 * S + 6 * S / 10);
    let mut e = crash_and_restart(e, dir.path(), T0 + 6 * S);
    assert_eq!((e.pending_traces(), e.stored_pending_traces()), (1, 1), "one trace, in the store");
    e.tick(T0 + 30 * S);
    let mut ids: Vec<Vec<u8>> = exported(&mut e).into_iter().map(|s| s.span_id).collect();
    ids.sort();
    assert_eq!(ids, vec![vec![2; 8], vec![3; 8]], "both parts, once each");
}

#[test]
fn a_trace_that_spilled_just_before_a_crash_is_not_doubled() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = journaled(MemoryStore::new(), dir.path(), T0);
    let client = |id, at| request(vec![span(trace(1, false), id, SpanKind::Client, at, true)]).encode_to_vec();
    e.ingest(&client(2, T0), T0).unwrap();
    e.tick(T0 + S / 10);
    // The journal as it was before the spill: the crash comes after the store took the trace
    // and before the journal recorded the move.
    let before = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, before.path().join(path.file_name().unwrap())).unwrap();
    }
    e.tick(T0 + 5 * S);
    assert_eq!(e.stored_pending_traces(), 1);
    let mut e = journaled(e.into_store(), before.path(), T0 + 6 * S);
    assert_eq!((e.pending_traces(), e.stored_pending_traces()), (1, 1));
    e.tick(T0 + 30 * S);
    assert_eq!(exported(&mut e).len(), 1, "its one span, once");
}

#[test]
fn the_journal_keeps_only_what_is_not_done_with() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = journaled(MemoryStore::new(), dir.path(), T0);
    for n in 1..=50u8 {
        e.ingest(&exchange(trace(n, false), T0, n % 2 == 0).encode_to_vec(), T0).unwrap();
    }
    e.tick(T0 + S / 10);
    assert!(e.journal.as_ref().unwrap().disk_bytes() > 50 * 100);
    e.tick(T0 + 2 * S);
    exported(&mut e);
    e.tick(T0 + 3 * S);
    e.tick(T0 + 5 * S);
    let segments = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(segments, 1, "every trace decided and exported: only the active segment is left");
    assert!(e.journal.as_ref().unwrap().disk_bytes() < 4096);
}

#[test]
fn a_trace_undecided_past_spill_after_waits_in_the_store_and_is_decided_once_after_a_restart() {
    let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(1 << 30), Vec::new(), T0).unwrap();
    // A CLIENT span only: no root, so the decision waits for the decision wait (30 s).
    let client = |id, at| request(vec![span(trace(1, false), id, SpanKind::Client, at, true)]).encode_to_vec();
    e.ingest(&client(2, T0), T0).unwrap();
    e.tick(T0 + 4 * S);
    assert_eq!(e.stored_pending_traces(), 0, "not yet");
    e.tick(T0 + 5 * S);
    assert_eq!((e.pending_traces(), e.stored_pending_traces(), e.counts.spilled), (1, 1, 1), "spilled");
    // The rest of a trace that just went to the store waits in memory to be decided with it;
    // at a clean stop it goes to the same partition.
    e.ingest(&client(3, T0 + 5 * S), T0 + 5 * S + 500_000_000).unwrap();
    assert_eq!(e.hot.get(&trace(1, false)).map(|h| h.joins), Some(Some(T0 / PARTITION_NS)));
    e.spill_all(T0 + 6 * S);
    e.flush_export();
    let mut e = Engine::open(e.into_store(), policies(), memory_first(1 << 30), Vec::new(), T0 + 7 * S).unwrap();
    assert_eq!(e.stored_pending_traces(), 1, "recovered from the store");
    e.tick(T0 + 29 * S);
    assert!(exported(&mut e).is_empty());
    e.tick(T0 + 30 * S);
    assert_eq!(exported(&mut e).len(), 2, "decided once, with both fragments");
    e.tick(T0 + 40 * S);
    assert!(exported(&mut e).is_empty());
}

#[test]
fn past_the_memory_budget_the_oldest_traces_spill() {
    let one = u64::try_from(exchange(trace(1, false), T0, false).encode_to_vec().len()).unwrap();
    let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(one), Vec::new(), T0).unwrap();
    for n in 1..=3 {
        let root_less = request(vec![span(trace(n, false), 2, SpanKind::Client, T0, false)]);
        e.ingest(&root_less.encode_to_vec(), T0 + u64::from(n)).unwrap();
    }
    e.tick(T0 + 10);
    assert!(e.hot.bytes() <= one, "under the budget after the tick");
    assert!(e.stored_pending_traces() >= 1);
    assert!(!e.hot.contains(&trace(1, false)), "the oldest went first");
    assert_eq!(e.pending_traces(), 3, "nothing lost");
}

#[test]
fn over_the_budget_traces_still_without_their_root_spill_before_older_complete_ones() {
    // The budget: what two complete exchanges take in memory.
    let mut probe = Engine::open(MemoryStore::new(), policies(), memory_first(1 << 30), Vec::new(), T0).unwrap();
    for n in 1..=2 {
        probe.ingest(&exchange(trace(n, false), T0, false).encode_to_vec(), T0).unwrap();
    }
    let one = probe.hot.bytes() / 2;
    let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(2 * one), Vec::new(), T0).unwrap();
    // Oldest: two complete exchanges (due within the grace); newest: one without its root.
    e.ingest(&exchange(trace(1, false), T0, false).encode_to_vec(), T0).unwrap();
    e.ingest(&exchange(trace(2, false), T0, false).encode_to_vec(), T0 + 1).unwrap();
    let root_less = request(vec![span(trace(3, false), 2, SpanKind::Client, T0, false)]);
    e.ingest(&root_less.encode_to_vec(), T0 + 2).unwrap();
    e.tick(T0 + 3);
    assert!(e.hot.bytes() <= 2 * one);
    assert!(!e.hot.contains(&trace(3, false)), "the root-less trace went to the store");
    assert!(e.hot.contains(&trace(1, false)) && e.hot.contains(&trace(2, false)));
    // Still over with complete traces only: the oldest of them goes.
    for n in 4..=5 {
        e.ingest(&exchange(trace(n, false), T0, false).encode_to_vec(), T0 + 10).unwrap();
    }
    e.tick(T0 + 11);
    assert!(!e.hot.contains(&trace(1, false)), "then the oldest complete one");
    assert_eq!(e.pending_traces(), 5, "nothing lost");
}

#[test]
fn the_grace_runs_from_the_roots_arrival_and_a_later_fragment_joins_it() {
    let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(1 << 30), Vec::new(), T0).unwrap();
    // Ended at T0, reached the tail stage 5 s later (a slow batch): the grace starts then.
    e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0 + 5 * S).unwrap();
    e.tick(T0 + 6 * S);
    assert_eq!(e.pending_traces(), 1, "grace (2 s) from arrival not over");
    let other_process = request(vec![span(trace(1, false), 7, SpanKind::Client, T0, false)]);
    e.ingest(&other_process.encode_to_vec(), T0 + 6 * S + 250_000_000).unwrap();
    assert_eq!((e.counts.fragments_joined, e.counts.fragment_gap_max_ns), (1, S + 250_000_000));
    e.tick(T0 + 7 * S);
    assert_eq!(exported(&mut e).len(), 3, "decided once, with the joined fragment");
    assert_eq!(e.counts.late_kept, 0);
}

#[test]
fn a_raised_threshold_replaces_th_and_keeps_the_rest_of_the_tracestate() {
    let mut e = open(MemoryStore::new(), T0);
    let lucky = trace(3, true);
    let mut spans = vec![span(lucky, 1, SpanKind::Server, T0, false), span(lucky, 2, SpanKind::Client, T0, false)];
    spans[0].trace_state = "vendor=x,ot=rv:ffffffffffffff".into();
    spans[1].name = "kept as it was".into();
    e.ingest(&request(spans.clone()).encode_to_vec(), T0).unwrap();
    e.tick(T0 + 3 * S);
    let mut out = exported(&mut e);
    out.sort_by_key(|s| s.span_id.clone());
    assert_eq!(out[0], Span { trace_state: "ot=th:8;rv:ffffffffffffff,vendor=x".into(), ..spans[0].clone() });
    assert_eq!(out[1], Span { trace_state: "ot=th:8".into(), ..spans[1].clone() }, "the rest byte for byte");
}

#[test]
fn traces_that_went_to_the_store_together_are_decided_together_from_one_read_with_no_entry_each() {
    let store = FailingDecisions::new(false);
    let reads = std::rc::Rc::clone(&store.reads);
    let mut e = Engine::open(store, policies(), limits(), Vec::new(), T0).unwrap();
    let batch: Vec<Span> = (1..=20u8)
        .flat_map(|n| {
            let t = trace(n, n % 2 == 0);
            [span(t, 1, SpanKind::Server, T0, n == 1), span(t, 2, SpanKind::Client, T0, false)]
        })
        .collect();
    e.ingest(&request(batch).encode_to_vec(), T0).unwrap();
    assert_eq!(
        (e.stored_pending_traces(), e.pending.len(), e.groups.len()),
        (20, 0, 1),
        "one group, no entry per trace"
    );
    e.tick(T0 + S);
    assert_eq!(reads.get(), 0, "not due");
    e.tick(T0 + 2 * S);
    assert_eq!(reads.get(), 1, "one read for all of them");
    assert_eq!(e.stored_pending_traces(), 0);
    let kept: BTreeSet<Vec<u8>> = exported(&mut e).into_iter().map(|s| s.trace_id).collect();
    let want: BTreeSet<Vec<u8>> =
        (1..=20u8).filter(|n| *n == 1 || n % 2 == 0).map(|n| trace(n, n % 2 == 0).to_vec()).collect();
    assert_eq!(kept, want, "the error trace and the lucky half");
    let recovered = e.into_store().inner.recover().unwrap();
    assert!(recovered.pending.is_empty());
    assert_eq!(recovered.decisions.len(), 20, "each decided once, on the record");
}

#[test]
fn a_trace_without_its_root_does_not_hold_back_those_that_went_to_the_store_with_it() {
    let mut e = open(MemoryStore::new(), T0);
    let mut batch = vec![span(trace(9, false), 2, SpanKind::Client, T0, true)];
    batch.extend(exchange(trace(1, false), T0, true).resource_spans[0].scope_spans[0].spans.clone());
    e.ingest(&request(batch).encode_to_vec(), T0).unwrap();
    e.tick(T0 + 2 * S);
    let out = exported(&mut e);
    assert_eq!(out.len(), 2, "the complete trace at its grace");
    assert!(out.iter().all(|s| s.trace_id == trace(1, false)));
    e.tick(T0 + 30 * S);
    assert_eq!(exported(&mut e).len(), 1, "the root-less one at the decision wait");
}

#[test]
fn a_fragment_arriving_just_after_its_trace_went_to_the_store_is_decided_with_it() {
    // A memory budget of one byte: the trace goes to the store at the first tick.
    let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(1), Vec::new(), T0).unwrap();
    // Neither error nor lucky: dropped, unless the decision sees the error in the later part.
    e.ingest(&exchange(trace(1, false), T0, false).encode_to_vec(), T0).unwrap();
    e.tick(T0 + 1);
    assert_eq!(e.stored_pending_traces(), 1);
    let other_process = request(vec![span(trace(1, false), 7, SpanKind::Client, T0, true)]);
    e.ingest(&other_process.encode_to_vec(), T0 + 100_000_000).unwrap();
    e.tick(T0 + 200_000_000);
    assert_eq!(e.hot.len(), 1, "waits in memory with the stored part, over the budget or not");
    e.tick(T0 + 3 * S);
    assert_eq!(exported(&mut e).len(), 3, "kept for the error in the later part, all three spans");
    assert_eq!(e.hot.len(), 0);
    assert_eq!((e.counts.fragments_joined, e.counts.late_kept), (1, 0));
    let decided: u64 = e.counts.decisions.values().sum();
    assert_eq!(decided, 1);
}

#[test]
fn a_part_decided_first_decides_for_the_part_in_the_store() {
    let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(1 << 30), Vec::new(), T0).unwrap();
    // A root-less part goes to the store after 5 s and waits for the decision wait...
    let root_less = request(vec![span(trace(1, false), 2, SpanKind::Client, T0, false)]);
    e.ingest(&root_less.encode_to_vec(), T0).unwrap();
    e.tick(T0 + 5 * S);
    assert_eq!(e.stored_pending_traces(), 1);
    // ...and, past the join window, the root arrives with an error: decided from memory first.
    e.tick(T0 + 7 * S);
    e.ingest(&exchange(trace(1, false), T0 + 7 * S, true).encode_to_vec(), T0 + 7 * S).unwrap();
    assert_eq!(e.hot.get(&trace(1, false)).map(|h| h.joins), Some(None), "a part of its own");
    e.tick(T0 + 9 * S);
    assert_eq!(exported(&mut e).len(), 2, "the root's part, kept for its error");
    // The stored part follows that decision when due.
    e.tick(T0 + 30 * S);
    assert_eq!(exported(&mut e).len(), 1, "the stored part follows");
    assert_eq!(e.counts.late_kept, 1);
    let decided: u64 = e.counts.decisions.values().sum();
    assert_eq!(decided, 1, "one decision for the trace");
    let recovered = e.into_store().recover().unwrap();
    assert!(recovered.pending.is_empty() && recovered.outbox.is_empty(), "decided on the record, and delivered");
    assert!(matches!(recovered.decisions[..], [DecisionRecord { outcome: Outcome::Kept { .. }, .. }]));
}

/// A memory store whose `decide` fails while `fail` is set (and `append` too with `appends`),
/// and that counts the reads of whole appends.
struct FailingDecisions {
    inner: MemoryStore,
    fail: std::rc::Rc<std::cell::Cell<bool>>,
    appends: bool,
    reads: std::rc::Rc<std::cell::Cell<u32>>,
    /// Decisions taken before `decide` starts failing (until set again).
    decisions_left: std::rc::Rc<std::cell::Cell<u32>>,
    /// `flush` fails while set.
    fail_flush: std::rc::Rc<std::cell::Cell<bool>>,
}

impl FailingDecisions {
    fn new(appends: bool) -> Self {
        Self {
            inner: MemoryStore::new(),
            fail: std::rc::Rc::default(),
            appends,
            reads: std::rc::Rc::default(),
            decisions_left: std::rc::Rc::new(std::cell::Cell::new(u32::MAX)),
            fail_flush: std::rc::Rc::default(),
        }
    }
}

impl TailStore for FailingDecisions {
    fn append(&mut self, partition: Partition, fragments: &[Fragment<'_>]) -> Result<Vec<u64>, StoreError> {
        if self.appends && self.fail.get() {
            return Err(StoreError::Corrupt { what: "test: append refused", len: 0 });
        }
        self.inner.append(partition, fragments)
    }
    fn spans(&self, trace: &TraceId, range: &SpanRange) -> Result<Vec<Vec<u8>>, StoreError> {
        self.inner.spans(trace, range)
    }
    fn fragments(&self, partition: Partition, seq: u64) -> Result<Vec<AppendedFragment>, StoreError> {
        self.reads.set(self.reads.get() + 1);
        self.inner.fragments(partition, seq)
    }
    fn decide(&mut self, trace: &TraceId, spans: &SpanRange, outcome: Outcome) -> Result<u64, StoreError> {
        if self.fail.get() || self.decisions_left.get() == 0 {
            return Err(StoreError::Corrupt { what: "test: decide refused", len: 0 });
        }
        self.decisions_left.set(self.decisions_left.get() - 1);
        self.inner.decide(trace, spans, outcome)
    }
    fn commit(&mut self) -> Result<(), StoreError> {
        self.inner.commit()
    }
    fn exported(&mut self, trace: &TraceId, partition: Partition, seq: u64) -> Result<(), StoreError> {
        self.inner.exported(trace, partition, seq)
    }
    fn forget_decisions(&mut self, up_to: u64) -> Result<(), StoreError> {
        self.inner.forget_decisions(up_to)
    }
    fn drop_partition(&mut self, partition: Partition) -> Result<(), StoreError> {
        self.inner.drop_partition(partition)
    }
    fn recover(&self) -> Result<Recovered, StoreError> {
        self.inner.recover()
    }
    fn flush(&mut self) -> Result<(), StoreError> {
        if self.fail_flush.get() {
            return Err(StoreError::Corrupt { what: "test: flush refused", len: 0 });
        }
        self.inner.flush()
    }
    fn disk_bytes(&self) -> u64 {
        self.inner.disk_bytes()
    }
}

#[test]
fn a_group_whose_decisions_fail_half_way_goes_on_from_there() {
    let store = FailingDecisions::new(false);
    let left = std::rc::Rc::clone(&store.decisions_left);
    left.set(2);
    let mut e = Engine::open(store, policies(), limits(), Vec::new(), T0).unwrap();
    let batch: Vec<Span> = (1..=4u8)
        .flat_map(|n| {
            [
                span(trace(n, false), 1, SpanKind::Server, T0, true),
                span(trace(n, false), 2, SpanKind::Client, T0, false),
            ]
        })
        .collect();
    e.ingest(&request(batch).encode_to_vec(), T0).unwrap();
    e.tick(T0 + 2 * S);
    assert_eq!(e.stored_pending_traces(), 2, "two decided, then the store refused");
    left.set(u32::MAX);
    e.tick(T0 + 2 * S + DECIDE_RETRY_NS);
    assert_eq!(e.stored_pending_traces(), 0);
    let kept: Vec<Vec<u8>> = exported(&mut e).into_iter().map(|s| s.trace_id).collect();
    assert_eq!(kept.len(), 8, "every error trace once, both spans");
    assert_eq!(kept.iter().collect::<BTreeSet<_>>().len(), 4);
    assert_eq!(e.into_store().inner.recover().unwrap().decisions.len(), 4, "each decided once");
}

#[test]
fn a_trace_waiting_in_two_partitions_after_a_restart_is_decided_once_and_leaves_nothing_behind() {
    let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(1 << 30), Vec::new(), T0).unwrap();
    let root_less = |id, at| request(vec![span(trace(1, false), id, SpanKind::Client, at, id == 3)]).encode_to_vec();
    // A root-less part spills at 5 s (partition of T0); another arrives past the join window
    // and spills in its own partition.
    e.ingest(&root_less(2, T0), T0).unwrap();
    e.tick(T0 + 5 * S);
    e.tick(T0 + 7 * S);
    e.ingest(&root_less(3, T0 + 7 * S), T0 + 7 * S).unwrap();
    e.tick(T0 + 12 * S);
    assert_eq!(e.stored_pending_traces(), 2);
    e.flush_export();
    let mut e = Engine::open(e.into_store(), policies(), memory_first(1 << 30), Vec::new(), T0 + 13 * S).unwrap();
    e.tick(T0 + 40 * S);
    assert_eq!(e.stored_pending_traces(), 0);
    // The earlier part is decided at the start, from its own spans (no error, unlucky:
    // dropped); the later one follows that decision whatever it holds.
    assert!(exported(&mut e).is_empty());
    let decided: u64 = e.counts.decisions.values().sum();
    assert_eq!(decided, 1, "one decision, the other part follows it");
    assert_eq!((e.counts.early, e.counts.late_dropped), (1, 1));
    e.tick(T0 + 60 * S);
    let recovered = e.into_store().recover().unwrap();
    assert!(recovered.pending.is_empty() && recovered.partitions.is_empty(), "nothing left behind: {recovered:?}");
}

#[test]
fn a_later_part_in_the_same_partition_follows_with_a_record_of_its_own() {
    let mut e = Engine::open(MemoryStore::new(), policies(), memory_first(1), Vec::new(), T0).unwrap();
    // Part A, complete, goes to the store at once (budget) and is kept for its error at 2 s.
    e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
    e.tick(T0 + 1);
    // Part B, root-less, past the join window: to the store in the same partition.
    e.tick(T0 + 1_500_000_000);
    let b = request(vec![span(trace(1, false), 5, SpanKind::Client, T0, false)]);
    e.ingest(&b.encode_to_vec(), T0 + 1_500_000_000).unwrap();
    e.tick(T0 + 1_500_000_001);
    assert_eq!(e.stored_pending_traces(), 2);
    e.tick(T0 + 2 * S);
    assert_eq!(e.take_export().map(|x| x.spans), Some(2), "part A kept (not reported exported yet)");
    e.tick(T0 + 35 * S);
    assert_eq!(e.take_export().map(|x| x.spans), Some(1), "part B follows");
    // Neither export reported done: a crash now re-exports both parts, each from its own record
    // (a record covers the appends it decided and no other).
    let store = e.into_store();
    let recovered = store.recover().unwrap();
    let [a, b] = recovered.outbox[..] else { panic!("two outbox entries: {:?}", recovered.outbox) };
    assert_eq!(recovered.decisions.len(), 2, "one record per part");
    assert_eq!(a.spans.first, a.spans.last, "part A's record covers its one append");
    assert!(a.spans.last < b.spans.first, "the records do not overlap: {a:?} {b:?}");
    let spans = |entry: &tracetap_storage::OutboxEntry| store.spans(&entry.trace, &entry.spans).unwrap().len();
    assert_eq!((spans(&a), spans(&b)), (2, 1));
    assert!(recovered.pending.is_empty());
}

#[test]
fn a_store_that_cannot_flush_holds_back_only_the_journals_record_of_moves_to_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = FailingDecisions::new(false);
    let fail_flush = std::rc::Rc::clone(&store.fail_flush);
    let journal = Journal::open(dir.path(), journal::Sync::None, T0).unwrap();
    let mut e =
        Engine::open_journaled(store, Some(journal), policies(), memory_first(1 << 30), Vec::new(), T0).unwrap();
    // Trace 1 has no root: it spills at 5 s. Trace 2 is an error: kept when its grace is over.
    let client = request(vec![span(trace(1, false), 2, SpanKind::Client, T0, true)]).encode_to_vec();
    e.ingest(&client, T0).unwrap();
    e.tick(T0 + S / 10);
    fail_flush.set(true);
    e.ingest(&exchange(trace(2, false), T0 + 4 * S, true).encode_to_vec(), T0 + 4 * S).unwrap();
    e.tick(T0 + 5 * S);
    assert_eq!(e.stored_pending_traces(), 1, "trace 1 went to the store, which cannot flush");
    let journal = e.journal.as_ref().unwrap();
    assert!(journal.needs_store_flush(), "its move waits for the store");
    assert_eq!(journal.buffered(), 0, "the rest of the group commit was written all the same");
    e.tick(T0 + 6 * S);
    let spans = exported(&mut e);
    assert_eq!(spans.len(), 2, "trace 2 is exported: a store that cannot flush does not hold it back");
    e.tick(T0 + 6 * S + S / 10);
    fail_flush.set(false);
    let mut e = journaled(e.into_store().inner, dir.path(), T0 + 7 * S);
    assert_eq!((e.pending_traces(), e.stored_pending_traces(), e.resent_traces()), (1, 1, 0));
    e.tick(T0 + 30 * S);
    let spans = exported(&mut e);
    assert_eq!(spans.len(), 1, "trace 1 once, from the store");
    assert_eq!(spans[0].trace_id, trace(1, false));
}

#[test]
fn a_decision_the_store_refuses_leaves_the_trace_pending_and_is_tried_again() {
    let store = FailingDecisions::new(false);
    let fail = std::rc::Rc::clone(&store.fail);
    fail.set(true);
    let mut e = Engine::open(store, policies(), limits(), Vec::new(), T0).unwrap();
    e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
    e.tick(T0 + 3 * S);
    assert_eq!(e.pending_traces(), 1, "still pending: nothing in memory changed");
    assert_eq!(e.spans_pending, 2);
    assert!(e.counts.decisions.is_empty() && e.counts.store_errors == 1);
    assert!(e.take_export().is_none());
    fail.set(false);
    e.tick(T0 + 3 * S + DECIDE_RETRY_NS);
    assert_eq!(e.pending_traces(), 0, "decided at the retry");
    assert_eq!(e.take_export().map(|x| x.spans), Some(2));
}

#[test]
fn a_spill_the_store_refuses_leaves_the_traces_in_memory() {
    let store = FailingDecisions::new(true);
    let fail = std::rc::Rc::clone(&store.fail);
    fail.set(true);
    let mut e = Engine::open(store, policies(), memory_first(1 << 30), Vec::new(), T0).unwrap();
    let root_less = request(vec![span(trace(1, false), 2, SpanKind::Client, T0, true)]);
    e.ingest(&root_less.encode_to_vec(), T0).unwrap();
    e.tick(T0 + 5 * S);
    assert_eq!((e.hot.len(), e.stored_pending_traces(), e.counts.spans_lost), (1, 0, 0), "kept in memory");
    assert_eq!((e.hot.bytes() > 0, e.hot.spans()), (true, 1));
    e.tick(T0 + 30 * S);
    assert_eq!(exported(&mut e).len(), 1, "decided from memory at its decision wait");
}

#[test]
fn a_trace_without_a_root_waits_for_the_decision_wait() {
    let mut e = open(MemoryStore::new(), T0);
    e.ingest(&request(vec![span(trace(1, false), 2, SpanKind::Client, T0, true)]).encode_to_vec(), T0).unwrap();
    e.tick(T0 + 29 * S);
    assert_eq!(e.pending_traces(), 1);
    e.tick(T0 + 30 * S);
    assert_eq!(exported(&mut e).len(), 1);
}

#[test]
fn late_spans_follow_the_decision() {
    let mut e = open(MemoryStore::new(), T0);
    e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
    e.ingest(&exchange(trace(2, false), T0, false).encode_to_vec(), T0).unwrap();
    e.tick(T0 + 3 * S);
    assert_eq!(exported(&mut e).len(), 2);
    e.ingest(&request(vec![span(trace(1, false), 9, SpanKind::Client, T0, false)]).encode_to_vec(), T0 + 4 * S)
        .unwrap();
    e.ingest(&request(vec![span(trace(2, false), 9, SpanKind::Client, T0, false)]).encode_to_vec(), T0 + 4 * S)
        .unwrap();
    e.flush_export();
    let late = exported(&mut e);
    assert_eq!(late.len(), 1);
    assert_eq!(late[0].trace_id, trace(1, false));
    assert_eq!((e.counts.late_kept, e.counts.late_dropped), (1, 1));
}

#[test]
fn a_restart_rearms_pending_traces_and_re_exports_the_outbox() {
    let mut e = open(MemoryStore::new(), T0);
    e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
    e.tick(T0 + 2 * S);
    let _undelivered = e.take_export().unwrap();
    e.ingest(&exchange(trace(2, false), T0 + S, true).encode_to_vec(), T0 + S).unwrap();
    let store = e.into_store();
    // Down for a minute: trace 2 is overdue and decided at once; trace 1 is exported again
    // because its export was never reported done.
    let mut e = open(store, T0 + 60 * S);
    assert_eq!(e.pending_traces(), 0);
    let spans = exported(&mut e);
    assert_eq!(spans.len(), 4);
    e.tick(T0 + 60 * S);
    let store = e.into_store();
    let r = store.recover().unwrap();
    assert!(r.outbox.is_empty() && r.pending.is_empty());
    assert_eq!(r.decisions.len(), 2, "each trace decided once");
    assert!(r.partitions.is_empty(), "finished partitions dropped");
}

#[test]
fn a_recovered_trace_sharing_an_append_with_new_ones_is_decided_once() {
    let mut e = open(MemoryStore::new(), T0);
    let root_less = request(vec![span(trace(1, false), 2, SpanKind::Client, T0, true)]);
    e.ingest(&root_less.encode_to_vec(), T0).unwrap();
    let mut e = open(e.into_store(), T0 + S);
    assert_eq!(e.pending.len(), 1, "recovered, tracked on its own");
    // Its root and a new trace arrive in one batch: one append holds both.
    let mut batch = exchange(trace(1, false), T0 + S, false).resource_spans[0].scope_spans[0].spans.clone();
    batch.extend(exchange(trace(2, false), T0 + S, false).resource_spans[0].scope_spans[0].spans.clone());
    e.ingest(&request(batch).encode_to_vec(), T0 + S).unwrap();
    e.tick(T0 + 4 * S);
    assert_eq!(exported(&mut e).len(), 3, "trace 1, kept for its error, all three spans, once");
    let decided: u64 = e.counts.decisions.values().sum();
    assert_eq!(decided, 2);
    assert_eq!(e.into_store().recover().unwrap().decisions.len(), 2);
}

#[test]
fn past_the_disk_bound_the_oldest_traces_are_decided_early() {
    let mut e =
        Engine::open(MemoryStore::new(), policies(), Limits { max_disk_bytes: 1, ..limits() }, Vec::new(), T0).unwrap();
    e.ingest(&exchange(trace(1, false), T0, true).encode_to_vec(), T0).unwrap();
    e.ingest(&exchange(trace(2, false), T0 + 6 * S, true).encode_to_vec(), T0 + 6 * S).unwrap();
    e.tick(T0 + 6 * S);
    assert!(e.counts.early >= 1);
    assert_eq!(exported(&mut e).len(), 2 * (2 - e.pending_traces()));
}

#[test]
fn the_decision_cache_is_bounded_on_disk_once_partitions_are_gone() {
    let mut e =
        Engine::open(MemoryStore::new(), policies(), Limits { decision_cache: 2, ..limits() }, Vec::new(), T0).unwrap();
    for n in 1..=5 {
        e.ingest(&exchange(trace(n, false), T0, false).encode_to_vec(), T0).unwrap();
    }
    e.tick(T0 + 3 * S);
    assert_eq!(e.cache.len(), 2);
    let on_disk = |e: Engine<MemoryStore>| {
        let n = e.store.recover().unwrap().decisions.len();
        (n, e)
    };
    let (n, mut e) = on_disk(e);
    assert_eq!(n, 5, "forgetting waits until the partition is dropped, or the traces would turn pending again");
    e.tick(T0 + 6 * S);
    assert_eq!(on_disk(e).0, 2);
}

#[test]
fn a_part_stored_before_its_traces_decision_and_decided_after_survives_a_crash() {
    let t = trace(1, false);
    let mut e = open(MemoryStore::new(), T0);
    // Two batches, two appends: the CLIENT span first (rootless: due at the decision wait), then
    // its root (due at the grace). The root's group is decided first; the crash comes before the
    // CLIENT span's group follows that decision.
    e.ingest(&request(vec![span(t, 2, SpanKind::Client, T0, false)]).encode_to_vec(), T0).unwrap();
    e.ingest(&request(vec![span(t, 1, SpanKind::Server, T0, true)]).encode_to_vec(), T0).unwrap();
    e.tick(T0 + 2 * S);
    let root_only = e.take_export().expect("the root's group is decided at the grace");
    assert_eq!(root_only.spans, 1);
    let store = e.into_store();
    let r = store.recover().unwrap();
    assert_eq!(r.pending.len(), 1, "the CLIENT span is not covered by the root's decision: still pending");
    // After the restart the root is exported again (its export was never reported done), and the
    // CLIENT span follows the decision when it is due: both spans, each once after the restart.
    // Each part has its record, both reported exported: after another restart nothing waits or
    // goes again.
    assert_eq!(restart_until_decided(store), 2, "the root again and the CLIENT span");
}

/// Restarts at `T0 + 3 s` on `store`, runs past the decision wait, and returns how many spans
/// left, asserting that each left once and that a second restart finds nothing left to do.
fn restart_until_decided(store: MemoryStore) -> usize {
    let mut e = open(store, T0 + 3 * S);
    let mut spans = exported(&mut e);
    e.tick(T0 + 31 * S);
    spans.extend(exported(&mut e));
    let ids: BTreeSet<Vec<u8>> = spans.iter().map(|s| s.span_id.clone()).collect();
    assert_eq!(spans.len(), ids.len(), "each span once after the restart: {spans:?}");
    let mut e = open(e.into_store(), T0 + 32 * S);
    assert_eq!(e.pending_traces(), 0);
    assert!(exported(&mut e).is_empty(), "nothing decided or exported twice");
    spans.len()
}

#[test]
fn a_rootless_part_between_two_decided_parts_survives_a_crash() {
    let t = trace(1, false);
    let mut e = open(MemoryStore::new(), T0);
    // Three batches, three appends of one trace: a root, a rootless part (due at the decision
    // wait), another root. Both roots' groups are decided at the grace, the second following the
    // first; the crash comes before the rootless part follows them.
    e.ingest(&request(vec![span(t, 1, SpanKind::Server, T0, true)]).encode_to_vec(), T0).unwrap();
    e.ingest(&request(vec![span(t, 2, SpanKind::Client, T0, false)]).encode_to_vec(), T0).unwrap();
    e.ingest(&request(vec![span(t, 3, SpanKind::Server, T0, false)]).encode_to_vec(), T0).unwrap();
    e.tick(T0 + 2 * S);
    let roots: u64 = std::iter::from_fn(|| e.take_export()).map(|x| x.spans).sum();
    assert_eq!(roots, 2, "both roots decided at the grace (not reported exported)");
    let store = e.into_store();
    let r = store.recover().unwrap();
    let pending: Vec<Vec<Vec<u8>>> = r.pending.iter().map(|(t, p)| store.spans(t, &p.spans).unwrap()).collect();
    assert_eq!(pending.len(), 1, "the rootless part, and nothing the roots' records cover: {:?}", r.pending);
    assert_eq!(pending[0].len(), 1);
    // After the restart: both roots again (never reported exported), then the rootless part.
    assert_eq!(restart_until_decided(store), 3, "the two roots and the rootless part");
}

#[test]
fn a_restart_exports_a_traces_kept_decisions_in_the_order_they_were_made() {
    let t = trace(1, false);
    let record = |span: Span| [42u32.to_be_bytes().as_slice(), &span.encode_to_vec()].concat();
    let (client, root, late) = (
        record(span(t, 2, SpanKind::Client, T0, false)),
        record(span(t, 1, SpanKind::Server, T0, true)),
        record(span(t, 3, SpanKind::Client, T0, false)),
    );
    let mut store = MemoryStore::new();
    let partition = T0 / PARTITION_NS;
    let mut append = |spans: &[&[u8]], root_ended: Option<u64>| {
        let fragment = Fragment { trace: t, first_seen_unix_ns: T0, root_ended_unix_ns: root_ended, spans };
        store.append(partition, &[fragment]).unwrap()[0]
    };
    // A crash left the root's part decided (kept, not exported) between two parts still to follow.
    let (_, root_seq, _) = (append(&[&client], None), append(&[&root], Some(T0)), append(&[&late], None));
    store.decide(&t, &SpanRange::one(partition, root_seq), Outcome::Kept { threshold: 0 }).unwrap();
    // One span per export request: the restart's kept decisions leave in separate requests.
    let mut e =
        Engine::open(store, policies(), Limits { export_batch_spans: 1, ..limits() }, Vec::new(), T0 + 40 * S).unwrap();
    let first = e.take_export().expect("an export at the restart");
    let first_spans = ExportTraceServiceRequest::decode(first.request.as_slice()).unwrap().resource_spans[0]
        .scope_spans[0]
        .spans
        .clone();
    assert_eq!(first_spans[0].span_id, vec![1; 8], "the oldest kept decision (the root's) goes first");
    // Only that request is reported done before the next crash: the parts that followed stay in
    // the outbox, each under its own record, and nothing of the trace is lost.
    e.delivered(&first.deliveries);
    let store = e.into_store();
    let r = store.recover().unwrap();
    let waiting: Vec<Vec<Vec<u8>>> = r.outbox.iter().map(|o| store.spans(&o.trace, &o.spans).unwrap()).collect();
    assert_eq!(waiting, vec![vec![client], vec![late]], "the two parts that followed, in the outbox");
    assert!(r.pending.is_empty());
}

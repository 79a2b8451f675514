//! Kept spans on their way to the exporter: the export request being assembled around the span
//! bytes (per process, under the resource its spans came with), and the batches ready to go.
//! Nothing here builds a prost message: spans are copied as they are, or with their `trace_state`
//! field replaced when a raised threshold must go with them.

use std::collections::{BTreeMap, VecDeque};

use rustc_hash::FxHashMap;
use tracetap_proxy::trace_context::{parse_ot_tracestate, with_threshold};
use tracetap_storage::{Partition, TraceId};

use super::journal::Held;
use super::wire;
use crate::encode::{self, Attr, Value};

/// A kept trace handed to the exporter; reported back through `Engine::delivered`.
#[derive(Debug, Clone, Copy)]
pub enum Delivery {
    /// Decided from the store: it leaves the store's outbox (`seq`: its decision).
    Stored { trace: TraceId, partition: Partition, seq: u64 },
    /// Decided in memory: the journal records it exported and lets its segments go.
    Journaled { trace: TraceId, held: Held },
}

/// Kept spans on their way to the exporter.
#[derive(Debug)]
pub struct Export {
    /// An encoded `ExportTraceServiceRequest`.
    pub request: Vec<u8>,
    pub spans: u64,
    pub traces: u64,
    /// The decided traces in it (late spans are not listed: they have no outbox entry).
    pub deliveries: Vec<Delivery>,
}

/// The batch being assembled, and the ones ready.
#[derive(Debug)]
pub(super) struct Outgoing {
    /// Resource attributes shared by every process, for one not seen since a restart.
    resource: Vec<(String, String)>,
    /// The encoded resource each process's spans came with (its container and pod included); a
    /// process not seen since a restart gets `resource` and its pid.
    pub(super) resources: FxHashMap<u32, Vec<u8>>,
    /// Kept spans per process, each framed as a `ScopeSpans.spans` field ([`encode::push_span`]).
    by_pid: BTreeMap<u32, Vec<u8>>,
    /// Spans and decided traces in the batch.
    pub(super) spans: u64,
    pub(super) traces: u64,
    deliveries: Vec<Delivery>,
    ready: VecDeque<Export>,
}

impl Outgoing {
    pub(super) fn new(resource: Vec<(String, String)>) -> Self {
        Self {
            resource,
            resources: FxHashMap::default(),
            by_pid: BTreeMap::new(),
            spans: 0,
            traces: 0,
            deliveries: Vec::new(),
            ready: VecDeque::new(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.spans == 0 && self.deliveries.is_empty()
    }

    /// A decided trace in the batch, to be reported back when the exporter is done with it.
    pub(super) fn deliver(&mut self, delivery: Delivery) {
        self.deliveries.push(delivery);
    }

    /// Adds stored spans (pid + `Span`) to the export batch, raising their threshold if needed:
    /// copied as they are, or with their `trace_state` field replaced (the rest of the bytes as
    /// they are). Returns how many spans did not parse (not exported).
    pub(super) fn queue_kept<'r>(&mut self, stored: impl Iterator<Item = &'r [u8]>, min_threshold: u64) -> u64 {
        let mut lost = 0;
        for record in stored {
            let Some((pid, span)) = record.split_first_chunk::<4>() else {
                lost += 1;
                continue;
            };
            let out = self.by_pid.entry(u32::from_be_bytes(*pid)).or_default();
            if min_threshold == 0 {
                encode::push_span(out, span);
            } else {
                let Ok(parts) = wire::without_trace_state(span) else {
                    lost += 1;
                    continue;
                };
                let head = parse_ot_tracestate(parts.trace_state).threshold.unwrap_or(0);
                if min_threshold > head {
                    let raised = with_threshold(Some(parts.trace_state), min_threshold);
                    encode::push_span_with_trace_state(out, &parts.rest, &raised);
                } else {
                    encode::push_span(out, span);
                }
            }
            self.spans += 1;
        }
        lost
    }

    /// Closes the batch: its request is assembled and queued for [`Outgoing::take`].
    pub(super) fn close_batch(&mut self) {
        let by_pid = std::mem::take(&mut self.by_pid);
        let resources: Vec<std::borrow::Cow<'_, [u8]>> = by_pid.keys().map(|pid| self.resource_for(*pid)).collect();
        let mut request = Vec::with_capacity(by_pid.values().map(Vec::len).sum::<usize>() + 256 * by_pid.len());
        encode::write_request(
            &mut request,
            resources.iter().map(AsRef::as_ref).zip(by_pid.values().map(Vec::as_slice)),
        );
        self.ready.push_back(Export {
            request,
            spans: std::mem::take(&mut self.spans),
            traces: std::mem::take(&mut self.traces),
            deliveries: std::mem::take(&mut self.deliveries),
        });
    }

    pub(super) fn take(&mut self) -> Option<Export> {
        self.ready.pop_front()
    }

    /// The encoded resource of a process's spans: as it came with them, or (a process not seen
    /// since a restart) the shared attributes and its pid.
    fn resource_for(&self, pid: u32) -> std::borrow::Cow<'_, [u8]> {
        if let Some(resource) = self.resources.get(&pid) {
            return resource.as_slice().into();
        }
        encode::resource(
            self.resource
                .iter()
                .map(|(k, v)| Attr { key: k, value: Value::Str(v) })
                .chain(std::iter::once(Attr { key: "process.pid", value: Value::Int(i64::from(pid)) })),
        )
        .into()
    }
}

//! Batching on the capture thread: kept exchanges wait here until a batch is full
//! (`OTEL_BSP_MAX_EXPORT_BATCH_SIZE` spans) or the oldest has waited `OTEL_BSP_SCHEDULE_DELAY`;
//! then their spans are written into a per-batch arena as views, encoded once into OTLP bytes and
//! queued for the exporter.
//!
//! Memory: the arena and the encoder's output buffer are reset and reused for every batch, so in
//! steady state a batch costs one allocation (the bytes handed to the exporter) however many spans
//! and attributes it holds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bumpalo::Bump;
use bumpalo::collections::Vec as BumpVec;
use bytes::Bytes;
use tracetap_proxy::ServerExchange;
use tracetap_proxy::haproxy_config::ProxyNames;

use crate::encode::{BatchEncoder, SpanView};
use crate::pipeline::EncodedBatch;
use crate::spans::{Decision, SpanBuilder};

/// A kept exchange waiting for its batch.
#[derive(Debug)]
struct Pending {
    exchange: ServerExchange,
    decision: Decision,
    names: Option<Arc<ProxyNames>>,
}

#[derive(Debug)]
pub struct Batcher {
    pending: Vec<Pending>,
    spans: usize,
    oldest: Option<Instant>,
    max_spans: usize,
    delay: Duration,
    bump: Bump,
    encoder: BatchEncoder,
}

impl Batcher {
    #[must_use]
    pub fn new(max_spans: usize, delay: Duration, resource: Vec<(String, String)>) -> Self {
        Self {
            pending: Vec::with_capacity(max_spans),
            spans: 0,
            oldest: None,
            max_spans,
            delay,
            bump: Bump::with_capacity(256 * 1024),
            encoder: BatchEncoder::new(resource),
        }
    }

    /// Sets the resource attributes of one traced process (see [`BatchEncoder::set_process_attributes`]).
    pub fn set_process_attributes(&mut self, pid: u32, attributes: Vec<(String, String)>) {
        self.encoder.set_process_attributes(pid, attributes);
    }

    /// Forgets a process that exited.
    pub fn forget_process(&mut self, pid: u32) {
        self.encoder.forget_process(pid);
    }

    /// Adds a kept exchange; returns how many spans it will make.
    pub fn add(&mut self, exchange: ServerExchange, decision: Decision, names: Option<Arc<ProxyNames>>) -> usize {
        let spans = 1 + exchange.clients.len();
        self.spans += spans;
        self.oldest.get_or_insert_with(Instant::now);
        self.pending.push(Pending { exchange, decision, names });
        spans
    }

    /// True when the batch should go: full, or its oldest exchange waited long enough.
    #[must_use]
    pub fn is_due(&self, now: Instant) -> bool {
        self.is_full() || self.oldest.is_some_and(|t| now.duration_since(t) >= self.delay)
    }

    /// True when the batch holds `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` spans or more.
    #[must_use]
    pub fn is_full(&self) -> bool {
        self.spans >= self.max_spans
    }

    /// Encodes the current batch (one `ResourceSpans` per process) and starts a new one; the
    /// exchanges go back through `recycle`.
    pub fn flush(
        &mut self,
        builder: &mut SpanBuilder,
        recycle: &mut impl FnMut(ServerExchange),
    ) -> Option<EncodedBatch> {
        if self.pending.is_empty() {
            return None;
        }
        self.bump.reset();
        self.pending.sort_by_key(|p| p.exchange.tgid);
        let bump = &self.bump;
        let mut groups: BumpVec<(u32, &[SpanView<'_>])> = BumpVec::new_in(bump);
        for run in self.pending.chunk_by(|a, b| a.exchange.tgid == b.exchange.tgid) {
            let mut views = BumpVec::with_capacity_in(run.len() * 2, bump);
            for p in run {
                builder.views(&p.exchange, &p.decision, p.names.as_deref(), bump, &mut views);
            }
            groups.push((run[0].exchange.tgid, views.into_bump_slice()));
        }
        let body = Bytes::from(self.encoder.encode_owned(groups.iter().copied()));
        drop(groups);
        let batch = EncodedBatch::new(body, self.spans as u64, self.pending.len() as u64);
        for pending in self.pending.drain(..) {
            recycle(pending.exchange);
        }
        self.spans = 0;
        self.oldest = None;
        Some(batch)
    }
}

//! Batching on the capture thread: a kept exchange's spans are written as views into an arena and
//! encoded into OTLP bytes as soon as it is added, then the exchange goes back for reuse; the
//! batch holds only those bytes, one buffer per traced process, until it is full
//! (`OTEL_BSP_MAX_EXPORT_BATCH_SIZE` spans) or its oldest span has waited
//! `OTEL_BSP_SCHEDULE_DELAY`, when each process's spans are wrapped in its `ResourceSpans` and
//! the request is queued for the exporter.
//!
//! Why at once: an exchange is in the cache right after the tracker hands it out. Kept until the
//! batch was full (256 exchanges at the default size, two polls of the ring at 12 000 requests a
//! second), the exchanges and their strings had gone cold by the time they were encoded, and the
//! tracker's pools held a batch's worth of them: the capture thread took a fifth more CPU per
//! request (5.46 against 4.55 µs end to end at 12 000 req/s; docs/PERFORMANCE.md, issue 32).
//!
//! Invariant: the bytes are those [`BatchEncoder::encode`] writes for the same spans, grouped by
//! process in ascending pid order, each process's spans in the order they were added (a process's
//! resource attributes are read at flush, as before).
//!
//! Memory: the arena is reset for every exchange; a process's buffer is kept while it has spans in
//! every batch (one that skips a batch gives its buffer up); the request's bytes are handed to the
//! exporter in a buffer of their own, and the next batch gets a new one of the same size. So in
//! steady state a batch costs an allocation or two however many spans and attributes it holds.

use std::time::{Duration, Instant};

use bumpalo::Bump;
use bumpalo::collections::Vec as BumpVec;
use bytes::Bytes;
use tracetap_proxy::ServerExchange;
use tracetap_proxy::haproxy_config::ProxyNames;

use crate::encode::{self, BatchEncoder};
use crate::pipeline::EncodedBatch;
use crate::spans::{Decision, SpanBuilder};

/// The spans of one traced process in the current batch, encoded (see [`encode::write_spans`]).
#[derive(Debug)]
struct ProcessSpans {
    tgid: u32,
    spans: Vec<u8>,
}

#[derive(Debug)]
pub struct Batcher {
    /// One per process with spans in the current batch (and those of the last batch, empty, so
    /// that their buffers serve again).
    processes: Vec<ProcessSpans>,
    spans: usize,
    exchanges: usize,
    oldest: Option<Instant>,
    max_spans: usize,
    delay: Duration,
    /// One exchange's views, reset for the next.
    bump: Bump,
    encoder: BatchEncoder,
}

impl Batcher {
    #[must_use]
    pub fn new(max_spans: usize, delay: Duration, resource: Vec<(String, String)>) -> Self {
        Self {
            processes: Vec::new(),
            spans: 0,
            exchanges: 0,
            oldest: None,
            max_spans,
            delay,
            bump: Bump::with_capacity(16 * 1024),
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

    /// Writes a kept exchange's spans into the batch; returns how many. The exchange is the
    /// caller's again (to recycle) as soon as this returns.
    pub fn add(
        &mut self,
        exchange: &ServerExchange,
        decision: &Decision,
        names: Option<&ProxyNames>,
        builder: &mut SpanBuilder,
    ) -> usize {
        self.bump.reset();
        let mut views = BumpVec::new_in(&self.bump);
        builder.views(exchange, decision, names, &self.bump, &mut views);
        let tgid = exchange.tgid;
        let at = if let Some(at) = self.processes.iter().position(|p| p.tgid == tgid) {
            at
        } else {
            self.processes.push(ProcessSpans { tgid, spans: Vec::new() });
            self.processes.len() - 1
        };
        encode::write_spans(&mut self.processes[at].spans, &views);
        self.spans += views.len();
        self.exchanges += 1;
        self.oldest.get_or_insert_with(Instant::now);
        views.len()
    }

    /// True when the batch should go: full, or its oldest span waited long enough.
    #[must_use]
    pub fn is_due(&self, now: Instant) -> bool {
        self.is_full() || self.oldest.is_some_and(|t| now.duration_since(t) >= self.delay)
    }

    /// True when the batch holds `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` spans or more.
    #[must_use]
    pub fn is_full(&self) -> bool {
        self.spans >= self.max_spans
    }

    /// Wraps the current batch into a request (one `ResourceSpans` per process, in pid order) and
    /// starts a new one.
    pub fn flush(&mut self) -> Option<EncodedBatch> {
        if self.exchanges == 0 {
            return None;
        }
        // Processes without spans in this batch have gone quiet (or ended): their buffers go.
        self.processes.retain(|p| !p.spans.is_empty());
        self.processes.sort_unstable_by_key(|p| p.tgid);
        let body =
            Bytes::from(self.encoder.encode_written_owned(self.processes.iter().map(|p| (p.tgid, p.spans.as_slice()))));
        for process in &mut self.processes {
            process.spans.clear();
        }
        let batch = EncodedBatch::new(body, self.spans as u64, self.exchanges as u64);
        self.spans = 0;
        self.exchanges = 0;
        self.oldest = None;
        Some(batch)
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    use prost::Message;
    use tracetap_proxy::{Chunk, Op, SyscallEvent, Tracker};

    use super::*;
    use crate::sampling::Sampler;

    /// One proxied request of process `tgid` for `path` (keep-alive: client fd 10, server fd 11).
    fn exchange(tracker: &mut Tracker, tgid: u32, path: &str, ts: &mut u64) -> ServerExchange {
        let request = format!("GET {path} HTTP/1.1\r\nHost: shop.example.com\r\n\r\n");
        let response = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
        let mut ev = |fd: i32, op: Op<'_>| {
            *ts += 1000;
            tracker.handle(&SyscallEvent { ts_ns: *ts, tgid, tid: tgid, fd, seq: 0, op });
        };
        ev(10, Op::Accept { peer: None, local: None });
        ev(11, Op::Connect { server: None });
        ev(10, Op::Read(Chunk::complete(request.as_bytes())));
        ev(11, Op::Write(Chunk::complete(request.as_bytes())));
        ev(11, Op::Read(Chunk::complete(response)));
        ev(10, Op::Write(Chunk::complete(response)));
        ev(10, Op::Close);
        ev(11, Op::Close);
        let mut done: Vec<_> = tracker.drain().collect();
        assert_eq!(done.len(), 1, "one exchange for {path}");
        done.pop().expect("one")
    }

    /// Per `ResourceSpans` of a request: its `process.pid` and its spans' `url.path`s, in order.
    fn paths_by_process(body: &[u8]) -> Vec<(i64, Vec<String>)> {
        let request = ExportTraceServiceRequest::decode(body).expect("decodes");
        request
            .resource_spans
            .iter()
            .map(|rs| {
                let attrs = &rs.resource.as_ref().expect("resource").attributes;
                let pid = attrs.iter().find(|a| a.key == "process.pid").and_then(|a| a.value.as_ref());
                let Some(Value::IntValue(pid)) = pid.and_then(|v| v.value.clone()) else { panic!("process.pid") };
                let paths = rs.scope_spans[0]
                    .spans
                    .iter()
                    .filter_map(|s| s.attributes.iter().find(|a| a.key == "url.path"))
                    .filter_map(|a| match a.value.as_ref().and_then(|v| v.value.clone()) {
                        Some(Value::StringValue(s)) => Some(s),
                        _ => None,
                    })
                    .collect();
                (pid, paths)
            })
            .collect()
    }

    /// Exchanges of two processes added in turn: each process's spans come in one `ResourceSpans`,
    /// processes in pid order and spans in the order added; a process without spans in the next
    /// batch has no `ResourceSpans` there.
    #[test]
    fn spans_are_grouped_by_process_in_pid_order_and_kept_in_the_order_added() {
        let mut tracker = Tracker::default();
        let mut builder = SpanBuilder::new(Sampler::default(), 0);
        let mut batcher = Batcher::new(512, Duration::from_mins(1), Vec::new());
        let mut ts = 10;
        let mut spans = 0;
        for (tgid, path) in [(9, "/a"), (7, "/b"), (9, "/c")] {
            let ex = exchange(&mut tracker, tgid, path, &mut ts);
            let decision = builder.decide(&ex).expect("kept");
            spans += batcher.add(&ex, &decision, None, &mut builder);
            tracker.recycle(ex);
        }
        let batch = batcher.flush().expect("a batch");
        assert_eq!((batch.spans, batch.traces, spans), (6, 3, 6), "a SERVER and a CLIENT span per exchange");
        let paths = |list: &[&str]| list.iter().map(|p| (*p).to_owned()).collect::<Vec<_>>();
        assert_eq!(paths_by_process(&batch.body), [(7, paths(&["/b", "/b"])), (9, paths(&["/a", "/a", "/c", "/c"]))]);
        assert!(batcher.flush().is_none(), "an empty batch is not sent");

        let ex = exchange(&mut tracker, 9, "/d", &mut ts);
        let decision = builder.decide(&ex).expect("kept");
        batcher.add(&ex, &decision, None, &mut builder);
        let batch = batcher.flush().expect("a batch");
        assert_eq!(paths_by_process(&batch.body), [(9, paths(&["/d", "/d"]))]);
    }
}

//! What the stages pass along: encoded export requests, and the acknowledgement a stage that
//! must know (tail sampling's outbox) attaches to them. A leaf module: the exporter, the batcher
//! and the tail thread depend on it, and it on none of them.

use bytes::Bytes;

/// An encoded `ExportTraceServiceRequest` and how many spans it holds.
#[derive(Debug)]
pub struct EncodedBatch {
    pub body: Bytes,
    pub spans: u64,
    /// Traces (exchanges) it holds, for counting what a full queue sheds.
    pub traces: u64,
    /// Called when the exporter is done with the batch (tail sampling's outbox).
    pub delivered: Option<Delivered>,
}

impl EncodedBatch {
    /// A batch nobody waits on.
    #[must_use]
    pub fn new(body: Bytes, spans: u64, traces: u64) -> Self {
        Self { body, spans, traces, delivered: None }
    }
}

/// Tells the stage that made a batch that the exporter is done with it: sent, or failed for good
/// (and counted as such). A batch dropped without it (a crash) is the maker's to redo.
pub struct Delivered(Box<dyn FnOnce() + Send>);

impl Delivered {
    #[must_use]
    pub fn new(done: impl FnOnce() + Send + 'static) -> Self {
        Self(Box::new(done))
    }

    pub fn done(self) {
        (self.0)();
    }
}

impl std::fmt::Debug for Delivered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Delivered")
    }
}

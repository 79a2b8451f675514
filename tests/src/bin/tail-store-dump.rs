//! Prints what a tail store holds, one line per trace: `pending|outbox|decided <trace id hex>
//! <spans>`, and `stored <trace id hex> <span ids hex, comma-separated>` for every span on disk,
//! decided or not. The crash test runs it between a `kill -9` of the agent and its restart: a
//! separate process, so that the store's directory lock is surely released when it exits.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use tracetap_storage::{Outcome, SledOptions, SledStore, TailStore};

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::with_capacity(2 * bytes.len()), |mut s, b| {
        let _ = std::fmt::Write::write_fmt(&mut s, format_args!("{b:02x}"));
        s
    })
}

fn main() {
    let dir: PathBuf = std::env::args_os().nth(1).expect("usage: tail-store-dump DIR").into();
    let store = SledStore::open(&dir, SledOptions::default()).unwrap_or_else(|e| panic!("store does not open: {e}"));
    let recovered = store.recover().unwrap_or_else(|e| panic!("store does not recover: {e}"));
    for (trace, pending) in &recovered.pending {
        let spans = store.spans(trace, &pending.spans).expect("spans");
        println!("pending {} {}", hex(trace), spans.len());
    }
    for entry in &recovered.outbox {
        let spans = store.spans(&entry.trace, &entry.spans).expect("spans");
        println!("outbox {} {}", hex(&entry.trace), spans.len());
    }
    for (trace, spans) in store.stored_spans().unwrap_or_else(|e| panic!("store does not read back: {e}")) {
        // Each record: the process id (4 bytes), then the OTLP `Span` the agent encoded.
        let ids: Vec<String> = spans
            .iter()
            .map(|record| {
                let span = record.get(4..).and_then(|bytes| Span::decode(bytes).ok());
                span.map_or_else(|| "undecodable".to_owned(), |s| hex(&s.span_id))
            })
            .collect();
        println!("stored {} {}", hex(&trace), ids.join(","));
    }
    for d in &recovered.decisions {
        let outcome = if matches!(d.outcome, Outcome::Kept { .. }) { "kept" } else { "dropped" };
        println!("decided {} {outcome}", hex(&d.trace));
    }
}

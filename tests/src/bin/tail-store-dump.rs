//! Prints what a tail store holds, one line per trace: `pending|outbox|decided <trace id hex>
//! <spans>`, and `stored <trace id hex> <spans>` for every span on disk, decided or not. The
//! crash test runs it between a `kill -9` of the agent and its restart: a separate process, so
//! that the store's directory lock is surely released when it exits.
#![forbid(unsafe_code)]

use std::path::PathBuf;

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
        println!("stored {} {spans}", hex(&trace));
    }
    for d in &recovered.decisions {
        let outcome = if matches!(d.outcome, Outcome::Kept { .. }) { "kept" } else { "dropped" };
        println!("decided {} {outcome}", hex(&d.trace));
    }
}

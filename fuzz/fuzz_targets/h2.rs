//! One direction of an HTTP/2 connection (frames, HPACK) fed with arbitrary calls, each a prefix
//! of known bytes, `extra` bytes the capture window cut, and a tail: it never panics, reports an
//! error at most once, and reports nothing after it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tracetap_proxy::Chunk;
use tracetap_proxy::h2::{Decoder, PREFACE, Sender};

fuzz_target!(|input: (bool, bool, Vec<(&[u8], u16, &[u8])>)| {
    let (client, with_preface, calls) = input;
    let mut decoder = Decoder::new(if client { Sender::Client } else { Sender::Server });
    let (mut events, mut heads) = (Vec::new(), Vec::new());
    if client && with_preface {
        decoder.feed(Chunk::complete(PREFACE), &mut events, &mut heads).unwrap();
    }
    let mut failed = false;
    for (known, extra, tail) in calls {
        let total = known.len() as u64 + u64::from(extra);
        let tail = if extra > 0 { &tail[..tail.len().min(16)] } else { &[] };
        let before = events.len();
        if decoder.feed(Chunk { known, total, tail }, &mut events, &mut heads).is_err() {
            assert!(!failed, "an error is reported once");
            failed = true;
        } else if failed {
            assert_eq!(events.len(), before, "nothing after an error");
        }
        events.clear();
    }
});

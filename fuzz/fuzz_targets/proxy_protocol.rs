//! PROXY protocol detection on the first bytes of a connection (a prefix of a call that moved
//! `extra` more bytes): never panics, and a header never claims more bytes than the call moved.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tracetap_proxy::proxy_protocol::{Start, parse};

fuzz_target!(|input: (&[u8], u16)| {
    let (known, extra) = input;
    let total = known.len() as u64 + u64::from(extra);
    if let Start::Header { len, .. } = parse(known, total) {
        assert!(len > 0 && len <= total);
    }
});

//! `traceparent` parsing on arbitrary text: never panics, and what it accepts is well formed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tracetap_proxy::trace_context::parse_traceparent;

fuzz_target!(|text: &str| {
    if let Some(tp) = parse_traceparent(text) {
        assert_ne!(tp.trace_id, [0; 16]);
        assert_ne!(tp.parent_id, [0; 8]);
        assert!(text.trim_matches([' ', '\t']).len() >= 55);
    }
});

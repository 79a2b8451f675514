//! HAProxy configuration parsing on arbitrary text: never panics, stays within its limits, and
//! lookups on what it produced never panic either. Form feeds split the input into the files of
//! one configuration (`defaults` carry over from one to the next).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tracetap_proxy::haproxy_config::{self, ConfigParser};

fuzz_target!(|text: &str| {
    let mut parser = ConfigParser::new();
    for file in text.split('\x0c') {
        parser.add_file(file);
    }
    let names = parser.finish();
    assert!(names.frontends.len() <= haproxy_config::MAX_BINDS);
    assert!(names.skipped.len() <= haproxy_config::MAX_SKIPPED_KEPT);
    assert!(names.skipped.iter().all(|l| l.len() <= haproxy_config::MAX_SKIPPED_LINE_BYTES));
    for port in [0u16, 80, 8080, 65535] {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let _ = names.frontend(addr);
        let _ = names.server(addr);
    }
});

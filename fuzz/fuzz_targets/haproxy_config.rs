//! HAProxy configuration parsing on arbitrary text: never panics; lookups on what it produced
//! never panic either.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tracetap_proxy::haproxy_config;

fuzz_target!(|text: &str| {
    let names = haproxy_config::parse(text);
    for port in [0u16, 80, 8080, 65535] {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let _ = names.frontend(addr);
        let _ = names.server(addr);
    }
});

//! The runtime API's `show servers state` answer on arbitrary text (what any process listening
//! on a stats socket path may write): never panics, stays within its cap, and a configuration's
//! names take the table without panicking. Text after a `\x01` is a configuration to apply it to.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tracetap_proxy::haproxy_config;
use tracetap_proxy::haproxy_runtime::{self, parse_servers_state};

fuzz_target!(|text: &str| {
    let (answer, config) = text.split_once('\x01').unwrap_or((text, ""));
    let Ok(state) = parse_servers_state(answer) else { return };
    assert!(state.servers.len() <= haproxy_runtime::MAX_RUNTIME_SERVERS);
    let names = haproxy_config::parse(config).with_runtime_servers(&state);
    for port in [0u16, 1, 80, 8080, 65535] {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let _ = names.server_for(addr, Some("f"));
        let _ = names.server_for(addr, None);
    }
});

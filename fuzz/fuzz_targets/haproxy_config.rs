//! HAProxy configuration parsing on arbitrary text: never panics, stays within its limits, and
//! lookups on what it produced never panic either. Text before a `\x01` is the process's
//! environment (`/proc/PID/environ`, lines for its NUL-separated entries), for `"${VAR}"`; form
//! feeds split the rest into the files of one configuration (`defaults` carry over from one to
//! the next).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tracetap_proxy::haproxy_config::{self, ConfigParser};
use tracetap_proxy::haproxy_words::Environment;

fuzz_target!(|text: &str| {
    let (environ, config) = text.split_once('\x01').unwrap_or(("", text));
    let env = Environment::from_environ(environ.replace('\n', "\0").as_bytes());
    let mut parser = ConfigParser::with_environment(env);
    for file in config.split('\x0c') {
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

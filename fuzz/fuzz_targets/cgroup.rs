//! `/proc/PID/cgroup` parsing on arbitrary text: never panics, and what it finds is well formed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tracetap_proxy::cgroup;

fuzz_target!(|text: &str| {
    let ids = cgroup::parse(text);
    if let Some(id) = ids.container_id {
        assert!(id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit()));
    }
    if let Some(uid) = ids.pod_uid {
        assert_eq!(uid.len(), 36);
    }
});

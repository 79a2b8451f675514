//! The probes' request head scan on arbitrary bytes, under each rule: never panics, what it drops
//! the tracker drops too, by the same context (`SampledOutRule::dropped_whole_head`), and it drops
//! nothing in which the look before it (`LineStarts`) found no line starting with `t`; its rounds
//! find what stepping the bytes one at a time finds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tracetap_ebpf_common::head_drop::{HeadScan, LineStarts};
use tracetap_proxy::sampled_out::SampledOutRule;
use tracetap_proxy::trace_context::TraceParent;

fuzz_target!(|input: (u8, u64, &[u8])| {
    let (which, threshold, bytes) = input;
    let rule = match which % 3 {
        0 => SampledOutRule::UnsampledParent,
        1 => SampledOutRule::RandomnessBelow(threshold >> 8),
        _ => SampledOutRule::Never,
    };
    assert_eq!(HeadScan::fed(bytes).found(), HeadScan::stepped(bytes).found());
    let (kind, threshold) = rule.in_probes();
    if let Some(dropped) = HeadScan::scan(bytes, kind, threshold) {
        assert!(LineStarts::of(bytes), "the look before the scan would have skipped it");
        let agent = rule.dropped_whole_head(bytes).expect("the tracker drops it too");
        assert_eq!(agent, TraceParent::from(dropped));
    }
});

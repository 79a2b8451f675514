//! The probes' head scan (`tracetap_ebpf_common::head_drop`) against the agent's own path: a
//! request head the scan drops is one the agent frames as one whole bodiless head, parses, and
//! drops at its head by the same context (the probes' decision is a subset of the agent's); and
//! a plain head with an unsampled or low-randomness `traceparent` is dropped by the scan (the
//! subset is not empty). Heads are built from parts a hostile client may send: odd methods,
//! targets and versions, bare line ends, duplicated or malformed `traceparent`s, bodies, folded
//! lines, control and non-ASCII bytes, a second request behind the first. The scan's rounds, which
//! take runs of bytes and whole tokens at once, are held to its byte-at-a-time model.

use std::fmt::Write as _;

use proptest::prelude::*;
use tracetap_ebpf_common::head_drop::{HeadScan, LineStarts, Padded};
use tracetap_proxy::sampled_out::SampledOutRule;
use tracetap_proxy::trace_context::{MAX_THRESHOLD, TraceParent};

fn agent_drops(bytes: &[u8], rule: SampledOutRule) -> Option<TraceParent> {
    rule.dropped_whole_head(bytes)
}

fn probe_drops(bytes: &[u8], rule: SampledOutRule) -> Option<TraceParent> {
    let (kind, threshold) = rule.in_probes();
    HeadScan::scan(bytes, kind, threshold).map(TraceParent::from)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut out, b| {
        let _ = write!(out, "{b:02x}");
        out
    })
}

fn rules() -> impl Strategy<Value = SampledOutRule> {
    prop_oneof![
        Just(SampledOutRule::Never),
        Just(SampledOutRule::UnsampledParent),
        Just(SampledOutRule::RandomnessBelow(MAX_THRESHOLD)),
        (0..MAX_THRESHOLD).prop_map(SampledOutRule::RandomnessBelow),
    ]
}

fn traceparent_values() -> impl Strategy<Value = String> {
    let ids = (any::<[u8; 16]>(), any::<[u8; 8]>(), any::<u8>());
    prop_oneof![
        4 => ids.prop_map(|(t, p, f)| format!("00-{}-{}-{:02x}", hex(&t), hex(&p), f & 1)),
        1 => ids.prop_map(|(t, p, f)| format!("00-{}-{}-{:02x}", hex(&t), hex(&p), f)),
        1 => ids.prop_map(|(t, p, f)| format!("00-{}-{}-{:02X}", hex(&t), hex(&p), f).to_uppercase()),
        1 => ids.prop_map(|(_, p, f)| format!("00-{}-{}-{:02x}", "0".repeat(32), hex(&p), f & 1)),
        1 => ids.prop_map(|(t, _, f)| format!("00-{}-{}-{:02x}", hex(&t), "0".repeat(16), f & 1)),
        1 => ids.prop_map(|(t, p, f)| format!("01-{}-{}-{:02x}-extra", hex(&t), hex(&p), f & 1)),
        1 => ids.prop_map(|(t, p, f)| format!("ff-{}-{}-{:02x}", hex(&t), hex(&p), f & 1)),
        1 => ids.prop_map(|(t, p, f)| format!(" \t00-{}-{}-{:02x}\t ", hex(&t), hex(&p), f & 1)),
        1 => ids.prop_map(|(t, p, f)| format!("00-{}-{}-{:02x}x", hex(&t), hex(&p), f & 1)),
        1 => ids.prop_map(|(t, p, f)| format!("00-{}-{}-{:02x}", hex(&t[1..]), hex(&p), f & 1)),
        1 => ids.prop_map(|(t, p, f)| format!("{}00-{}-{}-{:02x}", " ".repeat(9), hex(&t), hex(&p), f & 1)),
        // One byte of a valid value made anything (a dash, the version, a digit's case).
        2 => (ids, prop_oneof![Just(0usize), Just(2), Just(35), Just(52), Just(53), 0..55usize], any::<u8>())
            .prop_map(|((t, p, f), at, b)| {
            let mut value = format!("00-{}-{}-{:02x}", hex(&t), hex(&p), f & 1).into_bytes();
            value[at] = b;
            String::from_utf8_lossy(&value).into_owned()
        }),
    ]
}

fn header_lines() -> impl Strategy<Value = Vec<u8>> {
    let plain_name = "[A-Za-z0-9_.-]{1,18}";
    let any_name = proptest::collection::vec(any::<u8>(), 1..12);
    let value = proptest::collection::vec(prop_oneof![8 => 0x20u8..0x7f, 1 => Just(b'\t'), 1 => any::<u8>()], 0..24);
    prop_oneof![
        6 => traceparent_values().prop_map(|v| format!("traceparent: {v}").into_bytes()),
        1 => (prop_oneof![Just("TraceParent"), Just("TRACEPARENT"), Just("traceparent "), Just("traceparentx")],
              traceparent_values()).prop_map(|(n, v)| format!("{n}:{v}").into_bytes()),
        1 => "ot=(rv|th):[0-9a-f]{1,14}".prop_map(|v| format!("tracestate: {v}").into_bytes()),
        1 => (prop_oneof![Just("Content-Length"), Just("content-length"), Just("Transfer-Encoding"),
              Just("transfer-encoding")], "0|5|chunked|x").prop_map(|(n, v)| format!("{n}: {v}").into_bytes()),
        4 => (plain_name, value.clone()).prop_map(|(n, v)| [n.as_bytes(), b": ", &v].concat()),
        // Long runs of value bytes (user agents, cookies), which a round takes over several words;
        // a tab ends a run (stepping keeps it in the value).
        2 => (plain_name, "[ -~\t]{8,72}").prop_map(|(n, v)| format!("{n}: {v}").into_bytes()),
        1 => (any_name, value).prop_map(|(n, v)| [n.as_slice(), b":", &v].concat()),
        1 => Just(b" folded".to_vec()),
    ]
}

prop_compose! {
    fn heads()(
        method in prop_oneof![
            6 => Just("GET"), 1 => Just("POST"), 1 => Just("DELETE"), 1 => Just("OPTIONS"), 1 => Just("HEAD"),
            1 => Just("ABCDEFGH"), 1 => Just("ABCDEFGHI"),
            1 => Just("CONNECT"), 1 => Just("get"), 1 => Just("GETTINGSOMETHING"), 1 => Just("G\x01T"),
        ],
        target in prop_oneof![
            6 => "/[a-z0-9/?=&%.-]{0,20}", 2 => "/[!-~]{8,72}", 1 => Just("*".to_owned()), 1 => Just("http://x/".to_owned()),
            1 => Just("/a b".to_owned()), 1 => Just("/\u{e9}".to_owned()), 1 => Just("/<>\"".to_owned()),
            1 => Just(String::new()),
        ],
        version in prop_oneof![
            6 => Just("HTTP/1.1"), 1 => Just("HTTP/1.0"), 1 => Just("HTTP/2.0"), 1 => Just("http/1.1"),
        ],
        line_end in prop_oneof![9 => Just("\r\n"), 1 => Just("\n")],
        lines in proptest::collection::vec(header_lines(), 0..6),
        after in prop_oneof![
            8 => Just(Vec::new()), 1 => Just(b"body".to_vec()), 1 => Just(b"GET / HTTP/1.1\r\n\r\n".to_vec()),
        ],
        cut in prop_oneof![9 => Just(None), 1 => (0usize..200).prop_map(Some)],
    ) -> Vec<u8> {
        let mut bytes = format!("{method} {target} {version}{line_end}").into_bytes();
        for line in lines {
            bytes.extend_from_slice(&line);
            bytes.extend_from_slice(line_end.as_bytes());
        }
        bytes.extend_from_slice(line_end.as_bytes());
        bytes.extend_from_slice(&after);
        if let Some(cut) = cut {
            bytes.truncate(cut);
        }
        bytes
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

    #[test]
    fn what_the_probes_drop_the_agent_drops_by_the_same_context(bytes in heads(), rule in rules()) {
        if let Some(context) = probe_drops(&bytes, rule) {
            prop_assert_eq!(agent_drops(&bytes, rule), Some(context), "{}", String::from_utf8_lossy(&bytes));
        }
    }

    #[test]
    fn each_round_leaves_the_scan_as_stepping_its_bytes_does(
        bytes in prop_oneof![4 => heads(), 1 => proptest::collection::vec(any::<u8>(), 0..80)],
    ) {
        let read = Padded(&bytes);
        let mut scan = HeadScan::default();
        while (scan.read() as usize) < bytes.len() && !scan.failed() {
            let before = scan.read();
            scan.feed(&read);
            prop_assert!(scan.read() > before, "a round read nothing");
            let model = HeadScan::stepped(&bytes[..(scan.read() as usize).min(bytes.len())]);
            prop_assert_eq!(scan, model, "{}", String::from_utf8_lossy(&bytes));
        }
        prop_assert_eq!(HeadScan::fed(&bytes).found(), HeadScan::stepped(&bytes).found());
    }

    #[test]
    fn a_read_without_a_line_starting_with_t_is_never_dropped(bytes in heads(), rule in rules()) {
        if !LineStarts::of(&bytes) {
            prop_assert_eq!(probe_drops(&bytes, rule), None, "{}", String::from_utf8_lossy(&bytes));
        }
    }

    #[test]
    fn plain_heads_the_agent_drops_the_probes_drop_too(
        trace_id in any::<[u8; 16]>().prop_filter("valid", |t| *t != [0; 16]),
        parent_id in any::<[u8; 8]>().prop_filter("valid", |p| *p != [0; 8]),
        sampled in any::<bool>(),
        rule in rules(),
        path in "/[a-z0-9/]{0,40}",
        others in proptest::collection::vec(("[A-Za-z][A-Za-z0-9-]{0,15}", "[ -~]{0,40}"), 0..5),
    ) {
        let mut bytes = format!("GET {path} HTTP/1.1\r\n").into_bytes();
        for (name, value) in others.iter().filter(|(n, _)| !n.to_ascii_lowercase().starts_with("trace")) {
            bytes.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
        }
        let traceparent = format!("00-{}-{}-0{}", hex(&trace_id), hex(&parent_id), u8::from(sampled));
        bytes.extend_from_slice(format!("traceparent: {traceparent}\r\n\r\n").as_bytes());
        prop_assume!(bytes.len() <= 512);
        let lowercase = |n: &str| n.to_ascii_lowercase();
        prop_assume!(!others.iter().any(|(n, _)| ["content-length", "transfer-encoding"].contains(&lowercase(n).as_str())));
        prop_assert_eq!(probe_drops(&bytes, rule), agent_drops(&bytes, rule), "{}", String::from_utf8_lossy(&bytes));
    }
}

#[test]
fn the_w3c_example_is_dropped_alike_by_both() {
    let bytes =
        b"GET /x HTTP/1.1\r\nhost: a\r\ntraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00\r\n\r\n";
    let dropped = probe_drops(bytes, SampledOutRule::UnsampledParent);
    assert!(dropped.is_some());
    assert_eq!(dropped, agent_drops(bytes, SampledOutRule::UnsampledParent));
    // Its randomness is 0x0048_eb21_1c80_319c: a ratio drops it only below a higher threshold.
    for threshold in [0x0048_eb21_1c80_319c, 0x0048_eb21_1c80_319d] {
        let rule = SampledOutRule::RandomnessBelow(threshold);
        assert_eq!(probe_drops(bytes, rule), agent_drops(bytes, rule));
        assert_eq!(probe_drops(bytes, rule).is_some(), threshold > 0x0048_eb21_1c80_319c);
    }
}

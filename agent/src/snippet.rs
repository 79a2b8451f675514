//! `tracetap haproxy-snippet`: `HAProxy` configuration lines with which `HAProxy` propagates W3C
//! trace context itself, so that backends continue traces under tracetap's CLIENT spans.
//!
//! tracetap never writes to `HAProxy`'s memory or sockets; `HAProxy` does the writing, with sample
//! fetches and variables. The lines, per request:
//! - keep a valid incoming `traceparent`'s trace id (exactly one header, W3C Trace Context level
//!   2), else generate one from `uuid` (its last 14 hex digits are random, so the W3C random flag
//!   is set);
//! - forward a `traceparent` with a fresh parent id (the last 16 hex digits of another `uuid`);
//!   the agent makes that the CLIENT span's id (`spans::propagated_context`). `HAProxy` runs them
//!   once per request, so every attempt of a retried request carries the same one;
//! - set its sampled flag to the agent's decision: a valid parent's flag for parent-based
//!   samplers, else the consistent-probability rule on the trace id's last 14 hex digits, written
//!   as a regular expression that accepts exactly the digit strings at least the rejection
//!   threshold (so the lines and the agent agree on every trace id: no rounding beyond the 56-bit
//!   threshold both use);
//! - give the backend the `tracestate` the agent's spans carry (`ot=th:` for a ratio decision).
//!
//! What the lines cannot do (said in their comments and the README): read `ot=rv:` from an
//! incoming `tracestate` (tracetap does, for non-parent-based ratio samplers with a valid parent;
//! a difference is counted by the agent), keep more than the last of several `tracestate` header
//! lines where they rewrite it, or give each retry its own parent id.
//!
//! Tail sampling cannot be expressed: it decides after `HAProxy` has forwarded the request.

use std::fmt::Write as _;

use tracetap_proxy::trace_context::{MAX_THRESHOLD, encode_threshold};

use crate::config::{ConfigError, parse_flag};
use crate::sampling::{RootSampler, Sampler};

/// Choices of `tracetap haproxy-snippet` beyond the sampler.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Options {
    /// Also give every response the `traceparent` (`--response`): clients and local answers
    /// (`deny`, `return`, 503) show their trace id, and the agent pairs each response with the
    /// backend request it relays exactly.
    pub response: bool,
}

/// The lines for the sampler the variables configure (`OTEL_TRACES_SAMPLER`,
/// `OTEL_TRACES_SAMPLER_ARG`), or the variable that makes them impossible.
pub fn from_lookup(get: impl Fn(&str) -> Option<String>, options: Options) -> Result<String, ConfigError> {
    let get = |var: &str| get(var).filter(|v| !v.trim().is_empty());
    let sampler = Sampler::from_vars(get("OTEL_TRACES_SAMPLER").as_deref(), get("OTEL_TRACES_SAMPLER_ARG").as_deref())?;
    if parse_flag("TRACETAP_TAIL_ENABLED", get("TRACETAP_TAIL_ENABLED").as_deref(), false)? {
        return Err(ConfigError {
            var: "TRACETAP_TAIL_ENABLED",
            value: "true".into(),
            expected: "false for `tracetap haproxy-snippet`: tail sampling decides after HAProxy has forwarded the \
                       request, so no sampled flag HAProxy sets can carry its decision"
                .into(),
        });
    }
    let described = format!(
        "OTEL_TRACES_SAMPLER={} OTEL_TRACES_SAMPLER_ARG={}",
        get("OTEL_TRACES_SAMPLER").as_deref().map_or("parentbased_always_on (default)", str::trim),
        get("OTEL_TRACES_SAMPLER_ARG").as_deref().map_or("(unset)", str::trim),
    );
    Ok(lines(&sampler, &described, options))
}

/// How the root of a trace (no valid incoming parent, or a sampler that is not parent-based) is
/// decided, in terms the configuration can express.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Root {
    Always,
    Never,
    /// Kept when the trace id matches this expression, with this `th`.
    Ratio {
        pattern: String,
        th: String,
    },
}

fn root_of(sampler: &Sampler) -> Root {
    match sampler.root {
        RootSampler::AlwaysOn => Root::Always,
        RootSampler::AlwaysOff => Root::Never,
        RootSampler::Ratio { threshold, .. } => match trace_id_at_least(threshold) {
            Some(pattern) if threshold == 0 => {
                debug_assert!(pattern.is_empty());
                Root::Always
            }
            Some(pattern) => Root::Ratio { pattern, th: encode_threshold(threshold) },
            None => Root::Never,
        },
    }
}

/// W3C's random trace flag, set on the trace ids the lines make.
const RANDOM: u8 = 2;

/// Variables the lines set (transaction scope).
const IN: &str = "txn.tracetap_in";
const TRACE: &str = "txn.tracetap_trace";
const FLAGS: &str = "txn.tracetap_flags";
const TRACEPARENT: &str = "txn.tracetap_traceparent";

/// A valid single `traceparent`: a version other than `ff`, lower-case hex ids, and a version 00
/// value exactly 55 characters long. The second expression rejects all-zero ids.
const VALID: &str = "^([0-9a-e][0-9a-f]|f[0-9a-e])-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-|$)";
const INVALID: &str = "^(00-.{52}.|.{3}0{32}-|.{36}0{16}-)";

/// The configuration lines for `sampler` (`described` says which, in the comments).
#[must_use]
pub fn lines(sampler: &Sampler, described: &str, options: Options) -> String {
    let root = root_of(sampler);
    let mut out = String::new();
    let mut line = |text: &str| {
        out.push_str(text);
        out.push('\n');
    };
    line(&format!("# tracetap haproxy-snippet (tracetap {}), for {described}.", env!("CARGO_PKG_VERSION")));
    line("# HAProxy propagates W3C trace context itself: tracetap's CLIENT spans take the parent id it");
    line("# forwards, so a backend's spans continue the trace under them.");
    line("# Paste these lines into every traced `frontend` or `listen` section, before its other");
    line("# `http-request` rules (so that requests it denies or answers itself have a trace id too).");
    line("# HAProxy 2.6 or later. Print them again whenever the sampler settings change: tracetap follows");
    line("# the sampled flag HAProxy forwards and counts any difference from its own decision in");
    line("# tracetap_sampling_disagreements_total.");
    match &root {
        Root::Ratio { th, .. } => {
            line("# Ratio decisions: kept when the trace id's last 14 hex digits are at least the rejection threshold");
            line(&format!(
                "# th:{th} (the same 56-bit threshold tracetap uses, so no rounding: they agree on every trace id)."
            ));
            line("# The lines do not read `ot=rv:` from an incoming tracestate; tracetap does.");
        }
        Root::Always | Root::Never => {}
    }
    line("");
    line("# A valid incoming traceparent (exactly one, W3C Trace Context level 2) is continued.");
    line(&format!(
        "http-request set-var({IN}) req.hdr(traceparent) if {{ req.hdr_cnt(traceparent) eq 1 }} \
         {{ req.hdr(traceparent) -m reg {VALID} }} !{{ req.hdr(traceparent) -m reg {INVALID} }}"
    ));
    line("# Its trace id, or a new random one.");
    line(&format!("http-request set-var({TRACE}) var({IN}),field(2,-)"));
    line(&format!("http-request set-var({TRACE}) uuid,regsub(-,,g) unless {{ var({IN}) -m found }}"));
    // A parent's flags, masked to what version 00 defines (sampled and random); a trace id made
    // here gets the random flag.
    let from_parent = if sampler.parent_based {
        line("# The sampled flag: a valid parent's (with its random flag), else the root decision on the new");
        line("# trace id (random flag set).");
        "and(3)"
    } else {
        line("# The sampled flag: decided on the trace id whatever a parent said; the random flag is the");
        line("# parent's, or set for a new trace id.");
        "and(2)"
    };
    let sampled_root = |flags: u8| if matches!(root, Root::Always) { flags | 1 } else { flags };
    let parent_flags = if !sampler.parent_based && matches!(root, Root::Always) { ",or(1)" } else { "" };
    line(&format!("http-request set-var({FLAGS}) var({IN}),field(4,-),hex2i,{from_parent}{parent_flags}"));
    line(&format!("http-request set-var({FLAGS}) int({}) unless {{ var({IN}) -m found }}", sampled_root(RANDOM)));
    if let Root::Ratio { pattern, .. } = &root {
        if sampler.parent_based {
            line(&format!(
                "http-request set-var({FLAGS}) int({}) if !{{ var({IN}) -m found }} {{ var({TRACE}) -m reg {pattern} }}",
                RANDOM | 1
            ));
        } else {
            line(&format!("http-request set-var({FLAGS}) var({FLAGS}),or(1) if {{ var({TRACE}) -m reg {pattern} }}"));
        }
    }
    let traceparent = format!("\"00-%[var({TRACE})]-%[uuid,regsub('^.{{19}}|-','','g')]-0%[var({FLAGS})]\"");
    line("# The forwarded traceparent, with a new parent id: the CLIENT span's id in tracetap.");
    if options.response {
        line(&format!("http-request set-var-fmt({TRACEPARENT}) {traceparent}"));
        line(&format!("http-request set-header traceparent %[var({TRACEPARENT})]"));
    } else {
        line(&format!("http-request set-header traceparent {traceparent}"));
    }
    write_tracestate(&mut line, sampler, &root);
    if options.response {
        line("# Every response, local answers included, carries the request's traceparent.");
        line(&format!(
            "http-after-response set-header traceparent %[var({TRACEPARENT})] if {{ var({TRACEPARENT}) -m found }}"
        ));
    }
    out
}

/// The `tracestate` lines: the one tracetap's spans carry. A parent-based decision under a valid
/// parent keeps the incoming one as it is; a root decision starts a new one (an incoming
/// `tracestate` without a valid parent is not part of the trace), with `ot=th:` when a ratio or
/// always-on sampler kept it; a non-parent-based decision under a valid parent puts `ot=th:` in
/// front of the other vendors' entries.
fn write_tracestate(line: &mut impl FnMut(&str), sampler: &Sampler, root: &Root) {
    let th = match root {
        Root::Always => "0",
        Root::Ratio { th, .. } => th.as_str(),
        Root::Never => {
            line("# The tracestate of an invalid or absent parent is not this trace's.");
            line(&format!("http-request del-header tracestate unless {{ var({IN}) -m found }}"));
            return;
        }
    };
    line("# The tracestate tracetap's spans carry: the sampling threshold of a decision taken here.");
    line(&format!("http-request set-header tracestate ot=th:{th} unless {{ var({IN}) -m found }}"));
    if !sampler.parent_based {
        // Under a valid parent: `ot=th:` in front of the other vendors' entries (an incoming `ot`
        // entry is replaced), then without the comma if there were none. Only the last tracestate
        // line is read: HAProxy has no fetch that joins them.
        line(&format!(
            "http-request set-header tracestate \"ot=th:{th},%[req.fhdr(tracestate),regsub('(^|,)[[:blank:]]*ot=[^,]*','','g'),regsub('^[[:blank:]]*,','')]\" \
             if {{ var({IN}) -m found }} {{ req.fhdr(tracestate) -m found }}"
        ));
        line(&format!("http-request replace-header tracestate ^(ot=th:{th}),$ \\1 if {{ var({IN}) -m found }}"));
        line(&format!(
            "http-request set-header tracestate ot=th:{th} if {{ var({IN}) -m found }} !{{ req.fhdr(tracestate) -m found }}"
        ));
    }
}

/// A regular expression (POSIX extended, so any `HAProxy` build takes it) matching a 32-digit
/// lower-case hex trace id whose last 14 digits, read as a number, are at least `threshold`.
/// `Some("")` matches everything (threshold 0); `None` nothing (threshold 2^56: ratio 0).
///
/// Digit strings of equal length compare like their numbers, so "at least t" is: a greater digit
/// where the first i digits equal t's, for some i, or all of t's significant digits equal (the
/// digits after them only add). `th` drops trailing zeros, so branches stop at its last digit.
#[must_use]
pub fn trace_id_at_least(threshold: u64) -> Option<String> {
    if threshold >= MAX_THRESHOLD {
        return None;
    }
    if threshold == 0 {
        return Some(String::new());
    }
    let digits: Vec<u8> = encode_threshold(threshold).into_bytes();
    let mut branches = Vec::new();
    for (i, &d) in digits.iter().enumerate() {
        let prefix = std::str::from_utf8(&digits[..i]).expect("hex digits");
        let last = i + 1 == digits.len();
        let class = if last { Some(digits_from(d)) } else { next_digit(d).map(digits_from) };
        if let Some(class) = class {
            branches.push(format!("{prefix}{class}"));
        }
    }
    let mut pattern = String::from("^.{18}");
    if branches.len() == 1 {
        pattern.push_str(&branches[0]);
    } else {
        let _ = write!(pattern, "({})", branches.join("|"));
    }
    Some(pattern)
}

/// The hex digit after `d` (`None` after `f`).
fn next_digit(d: u8) -> Option<u8> {
    match d {
        b'9' => Some(b'a'),
        b'f' => None,
        _ => Some(d + 1),
    }
}

/// A bracket expression for the hex digits from `d` to `f`.
fn digits_from(d: u8) -> String {
    debug_assert!(d.is_ascii_hexdigit() && !d.is_ascii_uppercase());
    match d {
        b'0'..=b'8' => format!("[{}-9a-f]", d as char),
        b'9' => "[9a-f]".to_owned(),
        b'a'..=b'e' => format!("[{}-f]", d as char),
        _ => "f".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{randomness, threshold_for};
    use proptest::prelude::*;

    fn hex(id: &[u8; 16]) -> String {
        id.iter().fold(String::new(), |mut out, b| {
            let _ = write!(out, "{b:02x}");
            out
        })
    }

    fn matches(pattern: &str, id: &[u8; 16]) -> bool {
        regex::Regex::new(pattern).unwrap().is_match(&hex(id))
    }

    #[test]
    fn the_half_ratio_is_one_bracket_and_the_ends_are_always_and_never() {
        assert_eq!(trace_id_at_least(threshold_for(0.5)).as_deref(), Some("^.{18}[8-9a-f]"));
        assert_eq!(trace_id_at_least(threshold_for(0.25)).as_deref(), Some("^.{18}[c-f]"));
        assert_eq!(trace_id_at_least(0).as_deref(), Some(""));
        assert_eq!(trace_id_at_least(threshold_for(0.0)), None);
        // 2/3 rejected: one branch per significant digit of the threshold.
        let third = trace_id_at_least(threshold_for(1.0 / 3.0)).unwrap();
        assert_eq!(third.matches('|').count() + 1, encode_threshold(threshold_for(1.0 / 3.0)).len(), "{third}");
        assert!(third.starts_with("^.{18}([b-f]|a[b-f]|aa[b-f]|"), "{third}");
    }

    #[test]
    fn digit_classes() {
        assert_eq!(digits_from(b'0'), "[0-9a-f]");
        assert_eq!(digits_from(b'9'), "[9a-f]");
        assert_eq!(digits_from(b'a'), "[a-f]");
        assert_eq!(digits_from(b'f'), "f");
        assert_eq!(next_digit(b'9'), Some(b'a'));
        assert_eq!(next_digit(b'f'), None);
    }

    proptest! {
        /// The expression agrees with the agent's rule (`randomness >= threshold`) on every trace
        /// id, for any threshold: ids drawn around the threshold, where a wrong digit shows.
        #[test]
        fn the_expression_keeps_exactly_what_the_sampler_keeps(
            threshold in 1u64..MAX_THRESHOLD,
            delta in -300i64..300,
            high in any::<u64>(),
            random_low in any::<bool>(),
            low in 0u64..MAX_THRESHOLD,
        ) {
            let pattern = trace_id_at_least(threshold).unwrap();
            let r = if random_low { low } else { threshold.saturating_add_signed(delta).min(MAX_THRESHOLD - 1) };
            let mut id = [0u8; 16];
            id[..8].copy_from_slice(&high.to_be_bytes());
            id[8] = (high >> 3) as u8;
            id[9..].copy_from_slice(&r.to_be_bytes()[1..]);
            prop_assert_eq!(randomness(&id), r);
            prop_assert_eq!(matches(&pattern, &id), r >= threshold, "{} on {}", pattern, hex(&id));
        }
    }

    fn sampler(name: &str, arg: Option<&str>) -> Sampler {
        Sampler::from_vars(Some(name), arg).unwrap()
    }

    #[test]
    fn parent_based_lines_keep_the_parents_flag_and_decide_roots_by_ratio() {
        let text = lines(&sampler("parentbased_traceidratio", Some("0.5")), "test", Options::default());
        assert!(text.contains("field(4,-),hex2i,and(3)"), "{text}");
        assert!(text.contains(
            "int(3) if !{ var(txn.tracetap_in) -m found } { var(txn.tracetap_trace) -m reg ^.{18}[8-9a-f] }"
        ));
        assert!(text.contains("set-header tracestate ot=th:8 unless"));
        assert!(!text.contains("http-after-response"), "the response header is optional");
        assert!(text.contains("th:8 (the same 56-bit threshold"), "the output says how the ratio is applied");
        let every = lines(&sampler("parentbased_traceidratio", Some("0.5")), "test", Options { response: true });
        assert!(every.contains("http-after-response set-header traceparent %[var(txn.tracetap_traceparent)]"));
    }

    #[test]
    fn other_samplers() {
        let on = lines(&sampler("always_on", None), "", Options::default());
        assert!(on.contains("hex2i,and(2),or(1)\n") && on.contains("int(3) unless"), "{on}");
        assert!(on.contains("ot=th:0,%[req.fhdr(tracestate)"));
        let off = lines(&sampler("always_off", None), "", Options::default());
        assert!(!off.contains("or(1)") && off.contains("del-header tracestate"), "{off}");
        let ratio = lines(&sampler("traceidratio", Some("0.25")), "", Options::default());
        assert!(ratio.contains("or(1) if { var(txn.tracetap_trace) -m reg ^.{18}[c-f] }"), "{ratio}");
        let pb_on = lines(&sampler("parentbased_always_on", None), "", Options::default());
        assert!(
            pb_on.contains("int(3) unless { var(txn.tracetap_in) -m found }\n") && !pb_on.contains("int(2)"),
            "{pb_on}"
        );
        let zero = lines(&sampler("parentbased_traceidratio", Some("0")), "", Options::default());
        assert!(!zero.contains("int(3)"), "ratio 0 never samples a root: {zero}");
        let one = lines(&sampler("parentbased_traceidratio", Some("1")), "", Options::default());
        assert!(one.contains("int(3) unless { var(txn.tracetap_in) -m found }\n") && one.contains("ot=th:0"), "{one}");
    }

    #[test]
    fn tail_sampling_cannot_be_expressed_and_bad_values_name_their_variable() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| (*v).to_owned())
        };
        let e = from_lookup(vars(&[("TRACETAP_TAIL_ENABLED", "true")]), Options::default()).unwrap_err();
        assert_eq!(e.var, "TRACETAP_TAIL_ENABLED");
        assert!(e.expected.contains("after HAProxy has forwarded"), "{e}");
        let e = from_lookup(vars(&[("OTEL_TRACES_SAMPLER", "jaeger_remote")]), Options::default()).unwrap_err();
        assert_eq!(e.var, "OTEL_TRACES_SAMPLER");
        let e = from_lookup(
            vars(&[("OTEL_TRACES_SAMPLER", "traceidratio"), ("OTEL_TRACES_SAMPLER_ARG", "1.5")]),
            Options::default(),
        )
        .unwrap_err();
        assert_eq!(e.var, "OTEL_TRACES_SAMPLER_ARG");
        let text = from_lookup(
            vars(&[("OTEL_TRACES_SAMPLER", "traceidratio"), ("OTEL_TRACES_SAMPLER_ARG", "0.5")]),
            Options::default(),
        )
        .unwrap();
        assert!(text.contains("OTEL_TRACES_SAMPLER=traceidratio OTEL_TRACES_SAMPLER_ARG=0.5"), "{text}");
    }
}

//! `tracetap haproxy-snippet`: `HAProxy` configuration lines with which `HAProxy` propagates W3C
//! trace context itself, so that backends continue traces under tracetap's CLIENT spans.
//!
//! tracetap never writes to `HAProxy`'s memory or sockets; `HAProxy` does the writing, with sample
//! fetches, converters and one variable. The lines, per request:
//! - keep a valid incoming `traceparent`'s trace id (exactly one header, W3C Trace Context level
//!   2); otherwise make one: the current Unix second (`date`) in its high 64 bits and 64 bits of
//!   a `uuid` in its low ones, 62 of them random and the last 56 among them (W3C level 2's
//!   random flag is set);
//! - forward a `traceparent` with a new parent id (60 random bits of a `uuid` and its version
//!   digit, so never zero); the agent makes that the CLIENT span's id
//!   (`spans::propagated_context`). `HAProxy` runs them once per request, so every attempt of a
//!   retried request carries the same one;
//! - set its sampled flag to the agent's decision: a valid parent's flag for parent-based
//!   samplers, else the consistent-probability rule on the trace id's last 14 hex digits, written
//!   as a regular expression that accepts exactly the digit strings at least the rejection
//!   threshold (so the lines and the agent agree on every trace id: no rounding beyond the 56-bit
//!   threshold both use);
//! - give the backend the `tracestate` the agent's spans carry (`ot=th:` for a decision taken here).
//!
//! Cost shapes the lines (docs/PERFORMANCE.md, "Propagation lines"): in `HAProxy` each sample
//! expression in a log-format string and each variable costs a few hundred nanoseconds a request,
//! a converter or an ACL on a header far less. So a request without a valid incoming parent (most
//! requests at the edge) takes one `set-header` whose value is two expressions, `date` and one
//! `uuid` rearranged by `regsub` (plus one `regsub` setting the sampled flag under a ratio), and
//! one `set-header` for `tracestate`; no variable. Only a request with a valid `traceparent` is
//! stored in a variable, to be read back.
//!
//! What the lines cannot do (said in their comments and docs/traces.md): read `ot=rv:` from an
//! incoming `tracestate` (tracetap does, for non-parent-based ratio samplers with a valid parent;
//! a difference is counted by the agent), keep more than the last of several `tracestate` header
//! lines where they rewrite it, or give each retry its own parent id.
//!
//! Tail sampling cannot be expressed: it decides after `HAProxy` has forwarded the request.

use tracetap_proxy::trace_context::{MAX_THRESHOLD, encode_threshold};

use crate::config_error::{ConfigError, parse_flag};
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

/// The variables the lines set (transaction scope): a valid incoming `traceparent`, and (with
/// `--response`) the forwarded one.
const IN: &str = "txn.tracetap_in";
const TRACEPARENT: &str = "txn.tracetap_traceparent";

/// A valid single `traceparent`: a version other than `ff`, lower-case hex ids, and a version 00
/// value exactly 55 characters long. The second expression rejects all-zero ids.
const VALID: &str = "^([0-9a-e][0-9a-f]|f[0-9a-e])-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-|$)";
const INVALID: &str = "^(00-.{52}.|.{3}0{32}-|.{36}0{16}-)";

/// A `uuid` (`xxxxxxxx-xxxx-4xxx-yxxx-xxxxxxxxxxxx`, lower case) rearranged into the low half of a
/// new trace id (its last two groups: the variant digit `y` first, then 15 random digits), a `-`,
/// and a parent id (its first three groups: 15 random digits and the version digit `4`), then
/// `-0` and the flags digit the caller appends.
const NEW_IDS: &str = "regsub('^(.{8})-(.{4})-(.{4})-(.{4})-(.{12})','\\4\\5-\\1\\2\\3-0";
/// A `uuid`'s first three groups: a parent id.
const NEW_PARENT: &str = "uuid,regsub('^(.{8})-(.{4})-(.{4}).*','\\1\\2\\3')";

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
    line("# tracetap_sampling_disagreements_total (a request whose own traceparent it drops is decided");
    line("# at its head: a sampled flag forwarded for it is counted, not followed).");
    if let Root::Ratio { th, .. } = &root {
        line("# Ratio decisions: kept when the trace id's last 14 hex digits are at least the rejection threshold");
        line(&format!(
            "# th:{th} (the same 56-bit threshold tracetap uses, so no rounding: they agree on every trace id)."
        ));
        line("# The lines do not read `ot=rv:` from an incoming tracestate; tracetap does.");
    }
    line("");
    line("# A valid incoming traceparent (exactly one, W3C Trace Context level 2) is continued.");
    line(&format!(
        "http-request set-var({IN}) req.hdr(traceparent) if {{ req.hdr_cnt(traceparent) eq 1 }} \
         {{ req.hdr(traceparent) -m reg {VALID} }} !{{ req.hdr(traceparent) -m reg {INVALID} }}"
    ));
    write_continued(&mut line, sampler, &root);
    write_new_trace(&mut line, &root);
    write_tracestate(&mut line, sampler, &root);
    if options.response {
        line("# Every response, local answers included, carries the request's traceparent.");
        line(&format!("http-request set-var({TRACEPARENT}) req.hdr(traceparent)"));
        line(&format!(
            "http-after-response set-header traceparent %[var({TRACEPARENT})] if {{ var({TRACEPARENT}) -m found }}"
        ));
    }
    out
}

/// Under a valid parent: its trace id, a new parent id, and the flags (masked to what version 00
/// defines: sampled and random). A parent-based sampler keeps the parent's sampled flag; another
/// decides on the trace id and keeps only the parent's random flag.
fn write_continued(line: &mut impl FnMut(&str), sampler: &Sampler, root: &Root) {
    let value =
        |flags: &str| format!("\"00-%[var({IN}),field(2,-)]-%[{NEW_PARENT}]-0%[var({IN}),field(4,-),hex2i,{flags}]\"");
    let found = format!("{{ var({IN}) -m found }}");
    if sampler.parent_based {
        line("# Under it: its trace id and flags, with a new parent id (the CLIENT span's id in tracetap).");
        line(&format!("http-request set-header traceparent {} if {found}", value("and(3)")));
        return;
    }
    line("# Under it: its trace id and random flag, with a new parent id (the CLIENT span's id in");
    line("# tracetap), sampled by the trace id whatever the parent decided.");
    match root {
        Root::Always => line(&format!("http-request set-header traceparent {} if {found}", value("and(2),or(1)"))),
        Root::Never => line(&format!("http-request set-header traceparent {} if {found}", value("and(2)"))),
        Root::Ratio { pattern, .. } => {
            // The trace id's last 14 digits start at offset 21 of a traceparent.
            let kept = format!("{{ var({IN}) -m reg ^.{{21}}{pattern} }}");
            line(&format!("http-request set-header traceparent {} if {found} {kept}", value("and(2),or(1)")));
            line(&format!("http-request set-header traceparent {} if {found} !{kept}", value("and(2)")));
        }
    }
}

/// Without a valid parent: a new trace id and parent id from one `uuid` (see [`NEW_IDS`]), the
/// random flag set, and the root decision on the new trace id.
fn write_new_trace(line: &mut impl FnMut(&str), root: &Root) {
    line("# Otherwise a new trace id (the current second, then 64 bits of a uuid), a new parent id, and");
    line("# the root decision on the trace id's last 14 hex digits (random flag set).");
    let flags = match root {
        Root::Always => 3,
        Root::Never | Root::Ratio { .. } => 2,
    };
    // Under a ratio, a second `regsub` turns the flags digit 2 into 3 when the trace id's last 14
    // digits (from the third character of the rearranged uuid) are at least the threshold.
    let decide = match root {
        Root::Ratio { pattern, .. } => format!(",regsub('^(..{pattern}[^-]*-.{{16}}-0)2','\\13')"),
        Root::Always | Root::Never => String::new(),
    };
    line(&format!(
        "http-request set-header traceparent \"00-%[date,hex,lower]%[uuid,{NEW_IDS}{flags}'){decide}]\" \
         unless {{ var({IN}) -m found }}"
    ));
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

/// A regular expression (POSIX extended, so any `HAProxy` build takes it) matching a string of
/// lower-case hex digits that starts with 14 digits which, read as a number, are at least
/// `threshold` (callers anchor it where a trace id's last 14 digits are). `Some("")` matches
/// everything (threshold 0); `None` nothing (threshold 2^56: ratio 0).
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
    Some(if branches.len() == 1 { branches.remove(0) } else { format!("({})", branches.join("|")) })
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
    use std::fmt::Write as _;

    use super::*;
    use crate::sampling::{randomness, threshold_for};
    use proptest::prelude::*;

    fn hex(id: &[u8; 16]) -> String {
        id.iter().fold(String::new(), |mut out, b| {
            let _ = write!(out, "{b:02x}");
            out
        })
    }

    /// As the lines anchor it on a traceparent's trace id (its last 14 digits start at 18).
    fn matches(pattern: &str, id: &[u8; 16]) -> bool {
        regex::Regex::new(&format!("^.{{18}}{pattern}")).unwrap().is_match(&hex(id))
    }

    #[test]
    fn the_half_ratio_is_one_bracket_and_the_ends_are_always_and_never() {
        assert_eq!(trace_id_at_least(threshold_for(0.5)).as_deref(), Some("[8-9a-f]"));
        assert_eq!(trace_id_at_least(threshold_for(0.25)).as_deref(), Some("[c-f]"));
        assert_eq!(trace_id_at_least(0).as_deref(), Some(""));
        assert_eq!(trace_id_at_least(threshold_for(0.0)), None);
        // 2/3 rejected: one branch per significant digit of the threshold.
        let third = trace_id_at_least(threshold_for(1.0 / 3.0)).unwrap();
        assert_eq!(third.matches('|').count() + 1, encode_threshold(threshold_for(1.0 / 3.0)).len(), "{third}");
        assert!(third.starts_with("([b-f]|a[b-f]|aa[b-f]|"), "{third}");
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

    /// The non-comment lines.
    fn rules(sampler_name: &str, arg: Option<&str>, options: Options) -> Vec<String> {
        lines(&sampler(sampler_name, arg), "", options)
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn a_request_without_a_parent_costs_one_header_built_from_one_uuid_and_no_variable() {
        let half = rules("parentbased_traceidratio", Some("0.5"), Options::default());
        let new_trace: Vec<&String> =
            half.iter().filter(|l| l.contains("unless { var(txn.tracetap_in) -m found }")).collect();
        assert_eq!(new_trace.len(), 2, "traceparent and tracestate: {half:#?}");
        assert_eq!(new_trace[0].matches("%[").count(), 2, "two expressions, `date` and one `uuid`: {}", new_trace[0]);
        assert!(new_trace[0].contains(",regsub('^(..[8-9a-f][^-]*-.{16}-0)2','\\13')]"), "{}", new_trace[0]);
        assert!(!new_trace[0].split(" unless ").next().unwrap().contains("var("), "no variable read: {}", new_trace[0]);
        assert_eq!(new_trace[1], "http-request set-header tracestate ot=th:8 unless { var(txn.tracetap_in) -m found }");
        assert!(half.iter().any(|l| l.contains("field(4,-),hex2i,and(3)")), "a parent's flags are kept: {half:#?}");
        assert!(!half.iter().any(|l| l.contains("http-after-response")), "the response header is optional");
        let text = lines(&sampler("parentbased_traceidratio", Some("0.5")), "test", Options::default());
        assert!(text.contains("th:8 (the same 56-bit threshold"), "the output says how the ratio is applied");
        let every = rules("parentbased_traceidratio", Some("0.5"), Options { response: true });
        assert!(every.contains(&"http-after-response set-header traceparent %[var(txn.tracetap_traceparent)] if { var(txn.tracetap_traceparent) -m found }".to_owned()));
    }

    #[test]
    fn other_samplers() {
        let on = rules("always_on", None, Options::default()).join("\n");
        assert!(on.contains("hex2i,and(2),or(1)]\" if {") && on.contains("-03')]\" unless"), "{on}");
        assert!(on.contains("ot=th:0,%[req.fhdr(tracestate)"));
        let off = rules("always_off", None, Options::default()).join("\n");
        assert!(
            !off.contains("or(1)") && off.contains("-02')]\" unless") && off.contains("del-header tracestate"),
            "{off}"
        );
        let ratio = rules("traceidratio", Some("0.25"), Options::default()).join("\n");
        assert!(
            ratio.contains(
                "and(2),or(1)]\" if { var(txn.tracetap_in) -m found } { var(txn.tracetap_in) -m reg ^.{21}[c-f] }"
            ),
            "{ratio}"
        );
        assert!(
            ratio.contains(
                "and(2)]\" if { var(txn.tracetap_in) -m found } !{ var(txn.tracetap_in) -m reg ^.{21}[c-f] }"
            ),
            "{ratio}"
        );
        let pb_on = rules("parentbased_always_on", None, Options::default()).join("\n");
        assert!(pb_on.contains("-03')]\" unless") && !pb_on.contains("-02')"), "{pb_on}");
        let zero = rules("parentbased_traceidratio", Some("0"), Options::default()).join("\n");
        assert!(zero.contains("-02')]\" unless") && !zero.contains("\\13"), "ratio 0 never samples a root: {zero}");
        let one = rules("parentbased_traceidratio", Some("1"), Options::default()).join("\n");
        assert!(one.contains("-03')]\" unless") && one.contains("ot=th:0"), "{one}");
    }

    #[test]
    fn the_readme_shows_the_lines_as_printed() {
        let readme = include_str!("../../docs/traces.md");
        let printed = lines(&sampler("parentbased_traceidratio", Some("0.5")), "", Options::default());
        let printed: Vec<&str> = printed.lines().filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
        let start =
            readme.find("```\nhttp-request set-var(txn.tracetap_in)").expect("docs/traces.md shows the lines") + 4;
        let shown: Vec<&str> = readme[start..].lines().take_while(|l| *l != "```").collect();
        assert_eq!(shown, printed, "docs/traces.md, Connected traces: the lines for parentbased_traceidratio 0.5");
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

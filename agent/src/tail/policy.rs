//! Tail-sampling policies, with the OpenTelemetry Collector's `tail_sampling` names and meanings
//! where they overlap, evaluated over every buffered span of a trace.
//!
//! Evaluation, as in the Collector: if any `drop` policy matches, the trace is dropped; otherwise it
//! is kept when any other policy samples it. `probabilistic` uses consistent probability sampling
//! (the randomness of the head decision, not a hash), so a trace kept only by it is exported with
//! its rejection threshold raised to the tail ratio's: the tail stage may only raise the threshold,
//! and counts stay extrapolatable. A trace kept by any other policy keeps the head's threshold.

use opentelemetry_proto::tonic::trace::v1::status::StatusCode;

use super::wire::{self, AttrValue};

/// A validated policy.
#[derive(Debug, Clone, PartialEq)]
pub enum Policy {
    AlwaysSample,
    /// Trace duration (earliest start to latest end) at least `threshold_ms`, and below
    /// `upper_threshold_ms` when set.
    Latency {
        threshold_ms: u64,
        upper_threshold_ms: Option<u64>,
    },
    /// Some span has one of these status codes.
    StatusCode {
        codes: Vec<StatusCode>,
    },
    /// Some span has a string attribute `key` with one of `values` (or, inverted, no span does).
    StringAttribute {
        key: String,
        values: Vec<String>,
        invert: bool,
    },
    /// Some span has an integer attribute `key` within `min..=max` (or, inverted, no span does).
    NumericAttribute {
        key: String,
        min: i64,
        max: i64,
        invert: bool,
    },
    /// Consistent probability sampling at this rejection threshold (56 bits).
    Probabilistic {
        threshold: u64,
    },
    /// Keeps traces while the spans kept by this policy in the current second stay within the rate.
    RateLimiting {
        spans_per_second: u64,
    },
    /// The trace has `min..=max` spans.
    SpanCount {
        min: u64,
        max: u64,
    },
    /// Every sub-policy samples.
    And(Vec<Policy>),
    /// Every sub-policy samples: then the trace is dropped, whatever the other policies say.
    Drop(Vec<Policy>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct NamedPolicy {
    pub name: String,
    pub policy: Policy,
}

/// What the policies read of a span.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpanFacts<'a> {
    pub start_unix_ns: u64,
    pub end_unix_ns: u64,
    /// `Status.code`: 0 unset, 1 ok, 2 error.
    pub status: i32,
    /// The encoded `Span` message: attribute policies read their attribute from it (nothing else
    /// decodes attributes).
    pub span: &'a [u8],
}

/// What the policies see of a trace.
#[derive(Debug)]
pub struct TraceData<'a> {
    pub spans: &'a [SpanFacts<'a>],
    /// Consistent-sampling randomness (56 bits): the `rv` of the tracestate or the trace id's
    /// lowest 56 bits.
    pub randomness: u64,
    /// Wall-clock second of the decision, for rate limiting.
    pub now_second: u64,
}

/// The outcome of evaluating a policy set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict<'p> {
    pub keep: bool,
    /// The policy that decided (`None`: no policy matched, the trace is dropped).
    pub policy: Option<&'p str>,
    /// The rejection threshold the kept spans must carry at least (0: unchanged).
    pub min_threshold: u64,
}

/// Per-policy state of `rate_limiting` policies.
#[derive(Debug, Clone, Default)]
struct RateWindow {
    second: u64,
    spans: u64,
}

/// The configured policies and their rate-limiting state.
#[derive(Debug, Clone)]
pub struct PolicySet {
    policies: Vec<NamedPolicy>,
    windows: Vec<RateWindow>,
}

/// Whether a policy samples, and the threshold it requires if it does.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sample {
    No,
    Yes { threshold: u64 },
}

impl PolicySet {
    #[must_use]
    pub fn new(policies: Vec<NamedPolicy>) -> Self {
        let windows = vec![RateWindow::default(); policies.len()];
        Self { policies, windows }
    }

    #[must_use]
    pub fn policies(&self) -> &[NamedPolicy] {
        &self.policies
    }

    /// Decides a trace.
    pub fn evaluate(&mut self, trace: &TraceData<'_>) -> Verdict<'_> {
        for (named, window) in self.policies.iter().zip(&mut self.windows) {
            if let Policy::Drop(subs) = &named.policy
                && subs.iter().all(|p| sample(p, trace, window) != Sample::No)
            {
                return Verdict { keep: false, policy: Some(&named.name), min_threshold: 0 };
            }
        }
        let mut kept_by_ratio: Option<(&str, u64)> = None;
        for (named, window) in self.policies.iter().zip(&mut self.windows) {
            if matches!(named.policy, Policy::Drop(_)) {
                continue;
            }
            match sample(&named.policy, trace, window) {
                Sample::No => {}
                Sample::Yes { threshold: 0 } => {
                    return Verdict { keep: true, policy: Some(&named.name), min_threshold: 0 };
                }
                Sample::Yes { threshold } => {
                    if kept_by_ratio.is_none_or(|(_, t)| threshold < t) {
                        kept_by_ratio = Some((&named.name, threshold));
                    }
                }
            }
        }
        match kept_by_ratio {
            Some((name, threshold)) => Verdict { keep: true, policy: Some(name), min_threshold: threshold },
            None => Verdict { keep: false, policy: None, min_threshold: 0 },
        }
    }
}

fn sample(policy: &Policy, trace: &TraceData<'_>, window: &mut RateWindow) -> Sample {
    let yes = |b: bool| if b { Sample::Yes { threshold: 0 } } else { Sample::No };
    match policy {
        Policy::AlwaysSample => yes(true),
        Policy::Latency { threshold_ms, upper_threshold_ms } => {
            let start = trace.spans.iter().map(|s| s.start_unix_ns).min().unwrap_or(0);
            let end = trace.spans.iter().map(|s| s.end_unix_ns).max().unwrap_or(0);
            let ms = end.saturating_sub(start) / 1_000_000;
            yes(ms >= *threshold_ms && upper_threshold_ms.is_none_or(|upper| ms < upper))
        }
        Policy::StatusCode { codes } => yes(trace.spans.iter().any(|s| codes.iter().any(|c| *c as i32 == s.status))),
        Policy::StringAttribute { key, values, invert } => {
            let found = trace
                .spans
                .iter()
                .any(|s| matches!(attribute(s, key), AttrValue::Str(text) if values.iter().any(|w| w == text)));
            yes(found != *invert)
        }
        Policy::NumericAttribute { key, min, max, invert } => {
            let found = trace
                .spans
                .iter()
                .any(|s| matches!(attribute(s, key), AttrValue::Int(i) if (*min..=*max).contains(&i)));
            yes(found != *invert)
        }
        Policy::Probabilistic { threshold } => {
            if trace.randomness >= *threshold {
                Sample::Yes { threshold: *threshold }
            } else {
                Sample::No
            }
        }
        Policy::RateLimiting { spans_per_second } => {
            if window.second != trace.now_second {
                *window = RateWindow { second: trace.now_second, spans: 0 };
            }
            let spans = trace.spans.len() as u64;
            if window.spans + spans <= *spans_per_second {
                window.spans += spans;
                yes(true)
            } else {
                Sample::No
            }
        }
        Policy::SpanCount { min, max } => yes((*min..=*max).contains(&(trace.spans.len() as u64))),
        Policy::And(subs) => {
            let mut threshold = 0;
            for sub in subs {
                match sample(sub, trace, window) {
                    Sample::No => return Sample::No,
                    Sample::Yes { threshold: t } => threshold = threshold.max(t),
                }
            }
            Sample::Yes { threshold }
        }
        // A drop policy inside `and` or another drop means "all of these match".
        Policy::Drop(subs) => yes(subs.iter().all(|p| sample(p, trace, window) != Sample::No)),
    }
}

/// A span's attribute; a span whose bytes do not parse has none.
fn attribute<'s>(span: &SpanFacts<'s>, key: &str) -> AttrValue<'s> {
    wire::attribute(span.span, key).ok().flatten().unwrap_or(AttrValue::Other)
}

#[cfg(test)]
mod tests {
    use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
    use opentelemetry_proto::tonic::trace::v1::Span;
    use prost::Message as _;

    use super::*;

    /// Facts of a span with these attributes (its bytes leak: a test's few spans).
    fn span(start_ms: u64, end_ms: u64, code: StatusCode, attrs: Vec<(&str, any_value::Value)>) -> SpanFacts<'static> {
        let encoded = Span {
            attributes: attrs
                .into_iter()
                .map(|(k, v)| KeyValue {
                    key: k.into(),
                    value: Some(AnyValue { value: Some(v) }),
                    ..KeyValue::default()
                })
                .collect(),
            ..Span::default()
        }
        .encode_to_vec();
        SpanFacts {
            start_unix_ns: start_ms * 1_000_000,
            end_unix_ns: end_ms * 1_000_000,
            status: code as i32,
            span: Vec::leak(encoded),
        }
    }

    fn named(name: &str, policy: Policy) -> NamedPolicy {
        NamedPolicy { name: name.into(), policy }
    }

    fn data<'a>(spans: &'a [SpanFacts<'a>], randomness: u64) -> TraceData<'a> {
        TraceData { spans, randomness, now_second: 1 }
    }

    #[test]
    fn errors_latency_and_ratio() {
        let mut set = PolicySet::new(vec![
            named("errors", Policy::StatusCode { codes: vec![StatusCode::Error] }),
            named("slow", Policy::Latency { threshold_ms: 200, upper_threshold_ms: None }),
            named("some", Policy::Probabilistic { threshold: 3 << 54 }),
        ]);
        let error = [span(0, 10, StatusCode::Error, vec![])];
        assert_eq!(set.evaluate(&data(&error, 0)), Verdict { keep: true, policy: Some("errors"), min_threshold: 0 });
        let slow = [span(0, 150, StatusCode::Unset, vec![]), span(100, 300, StatusCode::Unset, vec![])];
        assert_eq!(set.evaluate(&data(&slow, 0)).policy, Some("slow"));
        let plain = [span(0, 10, StatusCode::Unset, vec![])];
        assert_eq!(set.evaluate(&data(&plain, 0)), Verdict { keep: false, policy: None, min_threshold: 0 });
        let lucky = set.evaluate(&data(&plain, u64::MAX >> 8));
        assert_eq!(lucky, Verdict { keep: true, policy: Some("some"), min_threshold: 3 << 54 });
    }

    #[test]
    fn drop_wins_and_and_needs_all() {
        let health = Policy::StringAttribute { key: "url.path".into(), values: vec!["/health".into()], invert: false };
        let mut set = PolicySet::new(vec![
            named("all", Policy::AlwaysSample),
            named("no-health", Policy::Drop(vec![health])),
            named(
                "big-and-slow",
                Policy::And(vec![
                    Policy::SpanCount { min: 2, max: u64::MAX },
                    Policy::NumericAttribute { key: "code".into(), min: 500, max: 599, invert: false },
                ]),
            ),
        ]);
        let h = [span(0, 1, StatusCode::Unset, vec![("url.path", any_value::Value::StringValue("/health".into()))])];
        assert_eq!(set.evaluate(&data(&h, 0)).policy, Some("no-health"));
        assert!(!set.evaluate(&data(&h, 0)).keep);
        let mut only_and = PolicySet::new(set.policies()[2..].to_vec());
        let one = [span(0, 1, StatusCode::Unset, vec![("code", any_value::Value::IntValue(503))])];
        assert!(!only_and.evaluate(&data(&one, 0)).keep);
        let two = [one[0], span(0, 1, StatusCode::Unset, vec![])];
        assert!(only_and.evaluate(&data(&two, 0)).keep);
    }

    #[test]
    fn rate_limiting_counts_spans_per_second() {
        let mut set = PolicySet::new(vec![named("rate", Policy::RateLimiting { spans_per_second: 3 })]);
        let two = [span(0, 1, StatusCode::Unset, vec![]), span(0, 1, StatusCode::Unset, vec![])];
        assert!(set.evaluate(&data(&two, 0)).keep);
        assert!(!set.evaluate(&data(&two, 0)).keep, "4 spans in one second exceed 3");
        let next_second = TraceData { now_second: 2, ..data(&two, 0) };
        assert!(set.evaluate(&next_second).keep);
    }

    #[test]
    fn latency_upper_bound_and_inverted_string_match() {
        let mut set =
            PolicySet::new(vec![named("mid", Policy::Latency { threshold_ms: 10, upper_threshold_ms: Some(20) })]);
        assert!(set.evaluate(&data(&[span(0, 15, StatusCode::Unset, vec![])], 0)).keep);
        assert!(!set.evaluate(&data(&[span(0, 25, StatusCode::Unset, vec![])], 0)).keep);
        let mut not_get = PolicySet::new(vec![named(
            "not-get",
            Policy::StringAttribute { key: "m".into(), values: vec!["GET".into()], invert: true },
        )]);
        let get = [span(0, 1, StatusCode::Unset, vec![("m", any_value::Value::StringValue("GET".into()))])];
        assert!(!not_get.evaluate(&data(&get, 0)).keep);
        assert!(not_get.evaluate(&data(&[span(0, 1, StatusCode::Unset, vec![])], 0)).keep);
    }
}

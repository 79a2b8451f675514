//! Head sampling, decided once per incoming request from its head alone, before any span exists.
//!
//! Ratio decisions follow OpenTelemetry's consistent probability sampling: the randomness is the
//! `rv` of the incoming `tracestate` or else the lowest 56 bits of the trace id, the trace is kept
//! when it is at least the rejection threshold, and kept spans carry that threshold as `ot=th:` in
//! their `tracestate`. Every tier with the same ratio keeps the same traces, and a backend can
//! extrapolate counts from `th`.

use crate::config_error::ConfigError;
use tracetap_ebpf_common::head_drop::randomness_drops;
use tracetap_proxy::sampled_out::SampledOutRule;
pub use tracetap_proxy::trace_context::randomness;
use tracetap_proxy::trace_context::{MAX_THRESHOLD, TraceParent, with_threshold};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RootSampler {
    AlwaysOn,
    AlwaysOff,
    /// Keep a trace when its randomness is at least this rejection threshold.
    Ratio {
        ratio: f64,
        threshold: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampler {
    pub root: RootSampler,
    /// Follow the sampled flag of a valid incoming parent.
    pub parent_based: bool,
}

impl Default for Sampler {
    fn default() -> Self {
        Self { root: RootSampler::AlwaysOn, parent_based: true }
    }
}

const SAMPLERS: &str =
    "always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off, parentbased_traceidratio";

impl Sampler {
    /// Builds the sampler from `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`.
    pub fn from_vars(name: Option<&str>, arg: Option<&str>) -> Result<Self, ConfigError> {
        let name = name.map_or("parentbased_always_on", str::trim);
        let ratio = || -> Result<RootSampler, ConfigError> {
            let ratio = match arg.map(str::trim) {
                None => 1.0,
                Some(a) => a.parse::<f64>().ok().filter(|r| (0.0..=1.0).contains(r)).ok_or_else(|| ConfigError {
                    var: "OTEL_TRACES_SAMPLER_ARG",
                    value: a.to_owned(),
                    expected: "a ratio from 0.0 to 1.0".into(),
                })?,
            };
            Ok(RootSampler::Ratio { ratio, threshold: threshold_for(ratio) })
        };
        let (root, parent_based) = match name {
            "always_on" => (RootSampler::AlwaysOn, false),
            "always_off" => (RootSampler::AlwaysOff, false),
            "traceidratio" => (ratio()?, false),
            "parentbased_always_on" => (RootSampler::AlwaysOn, true),
            "parentbased_always_off" => (RootSampler::AlwaysOff, true),
            "parentbased_traceidratio" => (ratio()?, true),
            other => {
                return Err(ConfigError {
                    var: "OTEL_TRACES_SAMPLER",
                    value: other.to_owned(),
                    expected: format!("one of {SAMPLERS}"),
                });
            }
        };
        Ok(Self { root, parent_based })
    }

    /// True when no request can be kept, whatever its trace context: `always_off`, and
    /// `traceidratio` at 0 (its threshold is above every randomness). The parent-based samplers
    /// still keep what a sampled parent asks for. Such a sampler needs no probes at all.
    #[must_use]
    pub fn keeps_nothing(&self) -> bool {
        !self.parent_based && self.threshold() >= MAX_THRESHOLD
    }

    /// Decides whether the trace of a request is recorded.
    #[must_use]
    pub fn should_sample(&self, parent: Option<&TraceParent>, trace_id: &[u8; 16]) -> bool {
        self.decide(parent, None, trace_id).is_some()
    }

    /// Decides whether the trace of a request is recorded, from its parent, its `tracestate` and
    /// its trace id. `None` drops it; `Some` is the `tracestate` its spans carry. With a valid
    /// parent, the verdict is [`Sampler::sampled_out_rule`]'s, which the tracker applies to
    /// request heads.
    #[must_use]
    pub fn decide(
        &self,
        parent: Option<&TraceParent>,
        tracestate: Option<&str>,
        trace_id: &[u8; 16],
    ) -> Option<String> {
        if let Some(parent) = parent {
            if self.sampled_out_rule().drops(parent, tracestate) {
                return None;
            }
            if self.parent_based {
                return Some(tracestate.unwrap_or_default().to_owned());
            }
            return Some(with_threshold(tracestate, self.threshold()));
        }
        // Without a valid traceparent, an incoming tracestate is not part of this trace.
        if self.root == RootSampler::AlwaysOff {
            return None;
        }
        let threshold = self.threshold();
        (!randomness_drops(randomness(trace_id), threshold)).then(|| with_threshold(None, threshold))
    }

    /// What a valid incoming `traceparent` alone decides (see [`SampledOutRule`]).
    #[must_use]
    pub fn sampled_out_rule(&self) -> SampledOutRule {
        if self.parent_based {
            return SampledOutRule::UnsampledParent;
        }
        match self.root {
            RootSampler::AlwaysOn => SampledOutRule::Never,
            RootSampler::AlwaysOff | RootSampler::Ratio { .. } => SampledOutRule::RandomnessBelow(self.threshold()),
        }
    }

    /// The root sampler's rejection threshold (above every randomness for `always_off`).
    fn threshold(&self) -> u64 {
        match self.root {
            RootSampler::AlwaysOn => 0,
            RootSampler::AlwaysOff => MAX_THRESHOLD,
            RootSampler::Ratio { threshold, .. } => threshold,
        }
    }
}

/// Rejection threshold for a ratio: traces whose randomness is below it are dropped.
/// The rejection threshold of a ratio (56 bits; 0 keeps everything).
#[must_use]
pub fn threshold_for(ratio: f64) -> u64 {
    let t = (1.0 - ratio) * MAX_THRESHOLD as f64;
    (t.round() as u64).min(MAX_THRESHOLD)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tid(low: u64) -> [u8; 16] {
        let mut id = [0xab; 16];
        id[8..].copy_from_slice(&low.to_be_bytes());
        id
    }

    #[test]
    fn ratio_uses_lowest_56_bits() {
        let s = Sampler::from_vars(Some("traceidratio"), Some("0.5")).unwrap();
        assert!(!s.should_sample(None, &tid(0)));
        assert!(!s.should_sample(None, &tid((1 << 55) - 1)));
        assert!(s.should_sample(None, &tid(1 << 55)));
        let none = Sampler::from_vars(Some("traceidratio"), Some("0")).unwrap();
        assert!(!none.should_sample(None, &tid(u64::MAX)));
        let all = Sampler::from_vars(Some("traceidratio"), Some("1")).unwrap();
        assert!(all.should_sample(None, &tid(0)));
    }

    #[test]
    fn parent_based_follows_parent() {
        let parent = |flags| TraceParent { trace_id: [1; 16], parent_id: [1; 8], flags };
        let s = Sampler::from_vars(Some("parentbased_always_on"), None).unwrap();
        assert!(!s.should_sample(Some(&parent(0)), &[1; 16]));
        assert!(s.should_sample(Some(&parent(1)), &[1; 16]));
        assert!(s.should_sample(None, &[1; 16]));
        let s = Sampler::from_vars(Some("always_on"), None).unwrap();
        assert!(s.should_sample(Some(&parent(0)), &[1; 16]));
    }

    #[test]
    fn kept_spans_carry_the_threshold_and_rv_wins_over_the_trace_id() {
        let half = Sampler::from_vars(Some("traceidratio"), Some("0.5")).unwrap();
        assert_eq!(half.decide(None, None, &tid(1 << 55)).as_deref(), Some("ot=th:8"));
        assert_eq!(half.decide(None, None, &tid(0)), None);
        let parent = TraceParent { trace_id: tid(0), parent_id: [1; 8], flags: 1 };
        // rv says "high randomness" although the trace id's bits are zero.
        let kept = half.decide(Some(&parent), Some("ot=rv:ffffffffffffff,x=y"), &tid(0));
        assert_eq!(kept.as_deref(), Some("ot=th:8;rv:ffffffffffffff,x=y"));
        let on = Sampler::from_vars(Some("always_on"), None).unwrap();
        assert_eq!(on.decide(None, Some("ignored=1"), &tid(0)).as_deref(), Some("ot=th:0"));
        let pb = Sampler::default();
        assert_eq!(
            pb.decide(Some(&parent), Some("a=b"), &tid(0)).as_deref(),
            Some("a=b"),
            "parent-based keeps the upstream state"
        );
    }

    #[test]
    fn two_tiers_with_the_same_ratio_agree() {
        let a = Sampler::from_vars(Some("traceidratio"), Some("0.25")).unwrap();
        let b = Sampler::from_vars(Some("parentbased_traceidratio"), Some("0.25")).unwrap();
        let mut rng = fastrand::Rng::with_seed(3);
        let mut kept = 0;
        for _ in 0..10_000 {
            let id = rng.u128(..).to_be_bytes();
            let (x, y) = (a.should_sample(None, &id), b.should_sample(None, &id));
            assert_eq!(x, y);
            kept += usize::from(x);
        }
        assert!((2_200..2_800).contains(&kept), "{kept} of 10000 kept at 0.25");
    }

    #[test]
    fn unknown_sampler_lists_accepted_values() {
        let e = Sampler::from_vars(Some("nope"), None).unwrap_err();
        assert_eq!(e.var, "OTEL_TRACES_SAMPLER");
        assert!(e.expected.contains("parentbased_traceidratio"));
        let e = Sampler::from_vars(Some("traceidratio"), Some("2")).unwrap_err();
        assert_eq!(e.var, "OTEL_TRACES_SAMPLER_ARG");
    }

    fn every_sampler() -> Vec<Sampler> {
        let mut all = Vec::new();
        for name in ["always_on", "always_off", "parentbased_always_on", "parentbased_always_off"] {
            all.push(Sampler::from_vars(Some(name), None).unwrap());
        }
        for name in ["traceidratio", "parentbased_traceidratio"] {
            for arg in ["0", "0.0", "0.000001", "0.5", "1"] {
                all.push(Sampler::from_vars(Some(name), Some(arg)).unwrap());
            }
        }
        all
    }

    #[test]
    fn only_always_off_and_traceidratio_zero_keep_nothing() {
        let nothing: Vec<Sampler> = every_sampler().into_iter().filter(Sampler::keeps_nothing).collect();
        assert_eq!(
            nothing,
            [
                Sampler::from_vars(Some("always_off"), None).unwrap(),
                Sampler::from_vars(Some("traceidratio"), Some("0")).unwrap(),
                Sampler::from_vars(Some("traceidratio"), Some("0.0")).unwrap(),
            ]
        );
    }

    proptest::proptest! {
        /// With a valid parent, the tracker's rule and the sampler agree, and both say what the
        /// specifications say (written out here on their own): a parent-based sampler follows the
        /// parent's sampled flag; another keeps the trace when its randomness (the `ot=rv:` of the
        /// tracestate, else the trace id's lowest 56 bits) is at least its threshold.
        #[test]
        fn with_a_valid_parent_the_rule_the_sampler_and_the_specification_agree(
            trace_id: [u8; 16],
            parent_id: [u8; 8],
            flags in 0u8..=255,
            rv in 0u64..(1 << 56),
            rv_form in 0u8..4,
            ratio in 0.0f64..=1.0,
        ) {
            let parent = TraceParent { trace_id, parent_id, flags };
            // Well-formed, absent, malformed (13 digits: ignored) and beside another vendor's entry.
            let tracestate = match rv_form {
                0 => None,
                1 => Some(format!("ot=rv:{rv:014x}")),
                2 => Some(format!("ot=rv:{:013x}", rv >> 4)),
                _ => Some(format!("vendor=x,ot=th:0;rv:{rv:014x}")),
            };
            let tracestate = tracestate.as_deref();
            let arg = ratio.to_string();
            let mut samplers = every_sampler();
            samplers.push(Sampler::from_vars(Some("traceidratio"), Some(&arg)).unwrap());
            samplers.push(Sampler::from_vars(Some("parentbased_traceidratio"), Some(&arg)).unwrap());
            let low56 = u64::from_be_bytes([0, trace_id[9], trace_id[10], trace_id[11], trace_id[12], trace_id[13], trace_id[14], trace_id[15]]);
            let randomness = if matches!(rv_form, 1 | 3) { rv } else { low56 };
            for sampler in samplers {
                let specified = if sampler.parent_based {
                    flags & 1 == 1
                } else {
                    match sampler.root {
                        RootSampler::AlwaysOn => true,
                        RootSampler::AlwaysOff => false,
                        RootSampler::Ratio { threshold, .. } => randomness >= threshold,
                    }
                };
                let kept = sampler.decide(Some(&parent), tracestate, &trace_id).is_some();
                let dropped_by_rule = sampler.sampled_out_rule().drops(&parent, tracestate);
                proptest::prop_assert_eq!(kept, specified, "{:?}", sampler);
                proptest::prop_assert_eq!(dropped_by_rule, !specified, "{:?}", sampler);
            }
        }

        /// A sampler said to keep nothing keeps no request, whatever its parent, its `rv` and its
        /// trace id; every other sampler keeps some request of the inputs tried.
        #[test]
        fn a_sampler_that_keeps_nothing_keeps_no_request(
            trace_id: [u8; 16],
            parent_id: [u8; 8],
            flags in 0u8..=3,
            rv in 0u64..(1 << 56),
            with_parent: bool,
            with_rv: bool,
        ) {
            let parent = TraceParent { trace_id, parent_id, flags };
            let tracestate = format!("ot=rv:{rv:014x}");
            for sampler in every_sampler().into_iter().filter(Sampler::keeps_nothing) {
                let kept = sampler.decide(with_parent.then_some(&parent), with_rv.then_some(tracestate.as_str()), &trace_id);
                proptest::prop_assert!(kept.is_none(), "{sampler:?} kept {kept:?}");
            }
        }
    }

    /// The examples of W3C Trace Context (section 3.2.2.5, and the version 00 header of its
    /// examples), and OpenTelemetry's probability sampling example (`th` 8: ratio 0.5).
    #[test]
    fn the_specifications_examples_are_decided_as_written() {
        use tracetap_proxy::trace_context::parse_traceparent;
        let sampled = parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        let unsampled = parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap();
        let pb = Sampler::default();
        assert_eq!(pb.sampled_out_rule(), SampledOutRule::UnsampledParent);
        assert!(!pb.sampled_out_rule().drops(&sampled, None));
        assert!(pb.sampled_out_rule().drops(&unsampled, None));
        // The trace id's lowest 56 bits are 0xce929d0e0e4736, at least 2^55: a ratio of 0.5 keeps
        // it whatever the flag, unless an `rv` below the threshold says otherwise.
        let half = Sampler::from_vars(Some("traceidratio"), Some("0.5")).unwrap();
        assert_eq!(half.sampled_out_rule(), SampledOutRule::RandomnessBelow(1 << 55));
        assert!(!half.sampled_out_rule().drops(&unsampled, None));
        assert!(half.sampled_out_rule().drops(&sampled, Some("ot=rv:7fffffffffffff")));
        assert!(!half.sampled_out_rule().drops(&unsampled, Some("ot=rv:80000000000000")));
        assert_eq!(Sampler::from_vars(Some("always_on"), None).unwrap().sampled_out_rule(), SampledOutRule::Never);
    }

    #[test]
    fn every_other_sampler_keeps_something() {
        let parent = TraceParent { trace_id: [0xff; 16], parent_id: [1; 8], flags: 1 };
        for sampler in every_sampler().into_iter().filter(|s| !s.keeps_nothing()) {
            let kept = sampler.decide(Some(&parent), None, &[0xff; 16]).is_some()
                || sampler.decide(None, None, &[0xff; 16]).is_some();
            assert!(kept, "{sampler:?}");
        }
    }
}

//! Head sampling, decided once per incoming request from its head alone, before any span exists.
//!
//! Ratio decisions follow OpenTelemetry's consistent probability sampling: the randomness is the
//! `rv` of the incoming `tracestate` or else the lowest 56 bits of the trace id, the trace is kept
//! when it is at least the rejection threshold, and kept spans carry that threshold as `ot=th:` in
//! their `tracestate`. Every tier with the same ratio keeps the same traces, and a backend can
//! extrapolate counts from `th`.

use crate::config_error::ConfigError;
use tracetap_proxy::trace_context::{MAX_THRESHOLD, TraceParent, parse_ot_tracestate, with_threshold};

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
        !self.parent_based
            && match self.root {
                RootSampler::AlwaysOff => true,
                RootSampler::AlwaysOn => false,
                RootSampler::Ratio { threshold, .. } => threshold >= MAX_THRESHOLD,
            }
    }

    /// Decides whether the trace of a request is recorded.
    #[must_use]
    pub fn should_sample(&self, parent: Option<&TraceParent>, trace_id: &[u8; 16]) -> bool {
        self.decide(parent, None, trace_id).is_some()
    }

    /// Decides whether the trace of a request is recorded, from its parent, its `tracestate` and
    /// its trace id. `None` drops it; `Some` is the `tracestate` its spans carry.
    #[must_use]
    pub fn decide(
        &self,
        parent: Option<&TraceParent>,
        tracestate: Option<&str>,
        trace_id: &[u8; 16],
    ) -> Option<String> {
        if self.parent_based
            && let Some(parent) = parent
        {
            return parent.sampled().then(|| tracestate.unwrap_or_default().to_owned());
        }
        // Without a valid traceparent, an incoming tracestate is not part of this trace.
        let tracestate = tracestate.filter(|_| parent.is_some());
        let threshold = match self.root {
            RootSampler::AlwaysOff => return None,
            RootSampler::AlwaysOn => 0,
            RootSampler::Ratio { threshold, .. } => threshold,
        };
        let randomness =
            tracestate.and_then(|ts| parse_ot_tracestate(ts).randomness).unwrap_or_else(|| randomness(trace_id));
        (randomness >= threshold).then(|| with_threshold(tracestate, threshold))
    }
}

/// Rejection threshold for a ratio: traces whose randomness is below it are dropped.
/// The rejection threshold of a ratio (56 bits; 0 keeps everything).
#[must_use]
pub fn threshold_for(ratio: f64) -> u64 {
    let t = (1.0 - ratio) * MAX_THRESHOLD as f64;
    (t.round() as u64).min(MAX_THRESHOLD)
}

/// The lowest 56 bits of the trace id.
/// A trace id's consistent-sampling randomness: its lowest 56 bits.
#[must_use]
pub fn randomness(trace_id: &[u8; 16]) -> u64 {
    let mut low = [0u8; 8];
    low[1..].copy_from_slice(&trace_id[9..]);
    u64::from_be_bytes(low)
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

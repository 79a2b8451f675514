//! Head sampling, decided once per incoming request from its head alone, before any span exists.
//!
//! Ratio decisions compare the lowest 56 bits of the trace id with a rejection threshold, as the
//! OpenTelemetry consistent probability sampling spec does, so every tier with the same ratio keeps
//! the same traces.

use crate::config::ConfigError;
use tracetap_proxy::trace_context::TraceParent;

/// 2^56: the size of the randomness space.
const MAX_THRESHOLD: u64 = 1 << 56;

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

    /// Decides whether the trace of a request is recorded.
    #[must_use]
    pub fn should_sample(&self, parent: Option<&TraceParent>, trace_id: &[u8; 16]) -> bool {
        if self.parent_based
            && let Some(parent) = parent
        {
            return parent.sampled();
        }
        match self.root {
            RootSampler::AlwaysOn => true,
            RootSampler::AlwaysOff => false,
            RootSampler::Ratio { threshold, .. } => randomness(trace_id) >= threshold,
        }
    }
}

/// Rejection threshold for a ratio: traces whose randomness is below it are dropped.
fn threshold_for(ratio: f64) -> u64 {
    #[expect(clippy::cast_precision_loss, reason = "2^56 is exact in an f64")]
    let t = (1.0 - ratio) * MAX_THRESHOLD as f64;
    (t.round() as u64).min(MAX_THRESHOLD)
}

/// The lowest 56 bits of the trace id.
fn randomness(trace_id: &[u8; 16]) -> u64 {
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
    fn unknown_sampler_lists_accepted_values() {
        let e = Sampler::from_vars(Some("nope"), None).unwrap_err();
        assert_eq!(e.var, "OTEL_TRACES_SAMPLER");
        assert!(e.expected.contains("parentbased_traceidratio"));
        let e = Sampler::from_vars(Some("traceidratio"), Some("2")).unwrap_err();
        assert_eq!(e.var, "OTEL_TRACES_SAMPLER_ARG");
    }
}

//! The tail policy file (`TRACETAP_TAIL_POLICY_FILE`): YAML or JSON (JSON is YAML), in the shape of
//! the OpenTelemetry Collector's `tail_sampling` processor:
//!
//! ```yaml
//! policies:
//!   - name: errors
//!     type: status_code
//!     status_code: { status_codes: [ERROR] }
//!   - name: slow
//!     type: latency
//!     latency: { threshold_ms: 200 }
//! ```
//!
//! Parsing is strict: unknown fields, a type whose settings are missing, settings for another type,
//! and out-of-range values are errors that name the policy and the field.

use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use serde::Deserialize;

use super::policy::{NamedPolicy, Policy};
use crate::sampling::threshold_for;

/// A policy file that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyFileError {
    #[error("{0}")]
    Syntax(String),
    #[error("policy {policy:?}: {field}: {problem}")]
    Invalid { policy: String, field: String, problem: String },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    policies: Vec<Raw>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    name: String,
    #[serde(rename = "type")]
    kind: String,
    latency: Option<Latency>,
    status_code: Option<StatusCodes>,
    string_attribute: Option<StringAttribute>,
    numeric_attribute: Option<NumericAttribute>,
    probabilistic: Option<Probabilistic>,
    rate_limiting: Option<RateLimiting>,
    span_count: Option<SpanCount>,
    and: Option<And>,
    drop: Option<Drop>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Latency {
    threshold_ms: u64,
    upper_threshold_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StatusCodes {
    status_codes: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StringAttribute {
    key: String,
    values: Vec<String>,
    #[serde(default)]
    invert_match: bool,
    #[serde(default)]
    enabled_regex_matching: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NumericAttribute {
    key: String,
    min_value: Option<i64>,
    max_value: Option<i64>,
    #[serde(default)]
    invert_match: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Probabilistic {
    sampling_percentage: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RateLimiting {
    spans_per_second: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SpanCount {
    min_spans: u64,
    max_spans: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct And {
    and_sub_policy: Vec<Raw>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Drop {
    drop_sub_policy: Vec<Raw>,
}

/// The policy types this file accepts.
pub const TYPES: &str = "always_sample, latency, status_code, string_attribute, numeric_attribute, probabilistic, rate_limiting, span_count, and, drop";

/// Parses and validates a policy file's text.
pub fn parse(text: &str) -> Result<Vec<NamedPolicy>, PolicyFileError> {
    let file: File = serde_yaml_ng::from_str(text).map_err(|e| PolicyFileError::Syntax(e.to_string()))?;
    if file.policies.is_empty() {
        return Err(PolicyFileError::Syntax("`policies` is empty: nothing would ever be kept".into()));
    }
    let mut names = std::collections::BTreeSet::new();
    let mut out = Vec::with_capacity(file.policies.len());
    for raw in file.policies {
        if !names.insert(raw.name.clone()) {
            return Err(invalid(&raw.name, "name", "two policies have this name"));
        }
        let name = raw.name.clone();
        out.push(NamedPolicy { name, policy: validate(raw, true)? });
    }
    Ok(out)
}

fn invalid(policy: &str, field: &str, problem: impl Into<String>) -> PolicyFileError {
    PolicyFileError::Invalid { policy: policy.to_owned(), field: field.to_owned(), problem: problem.into() }
}

/// Fails when a policy carries settings for another type than its own.
fn check_settings_match(raw: &Raw) -> Result<(), PolicyFileError> {
    let present: Vec<&str> = [
        ("latency", raw.latency.is_some()),
        ("status_code", raw.status_code.is_some()),
        ("string_attribute", raw.string_attribute.is_some()),
        ("numeric_attribute", raw.numeric_attribute.is_some()),
        ("probabilistic", raw.probabilistic.is_some()),
        ("rate_limiting", raw.rate_limiting.is_some()),
        ("span_count", raw.span_count.is_some()),
        ("and", raw.and.is_some()),
        ("drop", raw.drop.is_some()),
    ]
    .into_iter()
    .filter_map(|(field, set)| set.then_some(field))
    .collect();
    match present.iter().find(|f| **f != raw.kind) {
        Some(other) => {
            Err(invalid(&raw.name, other, format!("settings for `{other}` on a policy of type `{}`", raw.kind)))
        }
        None => Ok(()),
    }
}

fn validate(raw: Raw, top_level: bool) -> Result<Policy, PolicyFileError> {
    check_settings_match(&raw)?;
    let name = raw.name.as_str();
    let missing =
        || invalid(name, &raw.kind, format!("a policy of type `{}` needs its `{}` settings", raw.kind, raw.kind));
    Ok(match raw.kind.as_str() {
        "always_sample" => Policy::AlwaysSample,
        "latency" => {
            let l = raw.latency.ok_or_else(missing)?;
            if l.upper_threshold_ms.is_some_and(|u| u <= l.threshold_ms) {
                return Err(invalid(name, "latency.upper_threshold_ms", "must be greater than threshold_ms"));
            }
            Policy::Latency { threshold_ms: l.threshold_ms, upper_threshold_ms: l.upper_threshold_ms }
        }
        "status_code" => {
            let s = raw.status_code.ok_or_else(missing)?;
            if s.status_codes.is_empty() {
                return Err(invalid(name, "status_code.status_codes", "lists no status code"));
            }
            let codes = s
                .status_codes
                .iter()
                .map(|c| match c.as_str() {
                    "ERROR" => Ok(StatusCode::Error),
                    "OK" => Ok(StatusCode::Ok),
                    "UNSET" => Ok(StatusCode::Unset),
                    other => {
                        Err(invalid(name, "status_code.status_codes", format!("`{other}` is not ERROR, OK or UNSET")))
                    }
                })
                .collect::<Result<_, _>>()?;
            Policy::StatusCode { codes }
        }
        "string_attribute" => {
            let s = raw.string_attribute.ok_or_else(missing)?;
            if s.enabled_regex_matching {
                return Err(invalid(
                    name,
                    "string_attribute.enabled_regex_matching",
                    "regular expressions are not supported; list exact values",
                ));
            }
            if s.key.is_empty() || s.values.is_empty() {
                return Err(invalid(name, "string_attribute", "needs a key and at least one value"));
            }
            Policy::StringAttribute { key: s.key, values: s.values, invert: s.invert_match }
        }
        "numeric_attribute" => {
            let n = raw.numeric_attribute.ok_or_else(missing)?;
            let (min, max) = (n.min_value.unwrap_or(i64::MIN), n.max_value.unwrap_or(i64::MAX));
            if n.key.is_empty() || min > max || (n.min_value.is_none() && n.max_value.is_none()) {
                return Err(invalid(
                    name,
                    "numeric_attribute",
                    "needs a key and min_value and/or max_value with min <= max",
                ));
            }
            Policy::NumericAttribute { key: n.key, min, max, invert: n.invert_match }
        }
        "probabilistic" => {
            let p = raw.probabilistic.ok_or_else(missing)?;
            if !(0.0..=100.0).contains(&p.sampling_percentage) {
                return Err(invalid(name, "probabilistic.sampling_percentage", "must be from 0 to 100"));
            }
            Policy::Probabilistic { threshold: threshold_for(p.sampling_percentage / 100.0) }
        }
        "rate_limiting" => {
            let r = raw.rate_limiting.ok_or_else(missing)?;
            if r.spans_per_second == 0 {
                return Err(invalid(name, "rate_limiting.spans_per_second", "must be positive"));
            }
            Policy::RateLimiting { spans_per_second: r.spans_per_second }
        }
        "span_count" => {
            let s = raw.span_count.ok_or_else(missing)?;
            let max = s.max_spans.unwrap_or(u64::MAX);
            if s.min_spans > max {
                return Err(invalid(name, "span_count", "min_spans is greater than max_spans"));
            }
            Policy::SpanCount { min: s.min_spans, max }
        }
        "and" => Policy::And(subs(name, "and.and_sub_policy", raw.and.ok_or_else(missing)?.and_sub_policy)?),
        "drop" => {
            if !top_level {
                return Err(invalid(name, "type", "`drop` is only allowed at the top level"));
            }
            Policy::Drop(subs(name, "drop.drop_sub_policy", raw.drop.ok_or_else(missing)?.drop_sub_policy)?)
        }
        other => return Err(invalid(name, "type", format!("`{other}` is not one of {TYPES}"))),
    })
}

fn subs(name: &str, field: &str, raws: Vec<Raw>) -> Result<Vec<Policy>, PolicyFileError> {
    if raws.is_empty() {
        return Err(invalid(name, field, "lists no sub-policy"));
    }
    raws.into_iter()
        .map(|r| {
            if matches!(r.kind.as_str(), "and" | "drop") {
                return Err(invalid(name, field, format!("sub-policy {:?} cannot be `{}`", r.name, r.kind)));
            }
            validate(r, false)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collector_shaped_yaml() {
        let text = r"
policies:
  - name: errors
    type: status_code
    status_code: { status_codes: [ERROR] }
  - name: slow
    type: latency
    latency: { threshold_ms: 200 }
  - name: one-percent
    type: probabilistic
    probabilistic: { sampling_percentage: 1 }
  - name: no-health
    type: drop
    drop:
      drop_sub_policy:
        - name: health
          type: string_attribute
          string_attribute: { key: url.path, values: [/healthz] }
";
        let policies = parse(text).unwrap();
        assert_eq!(policies.len(), 4);
        assert_eq!(policies[0].policy, Policy::StatusCode { codes: vec![StatusCode::Error] });
        assert_eq!(policies[1].policy, Policy::Latency { threshold_ms: 200, upper_threshold_ms: None });
        assert!(matches!(policies[3].policy, Policy::Drop(ref subs) if subs.len() == 1));
    }

    #[test]
    fn json_is_accepted() {
        let text = r#"{"policies": [{"name": "all", "type": "always_sample"},
            {"name": "ab", "type": "and", "and": {"and_sub_policy": [
                {"name": "n", "type": "numeric_attribute", "numeric_attribute": {"key": "k", "min_value": 500}},
                {"name": "c", "type": "span_count", "span_count": {"min_spans": 2}}]}}]}"#;
        let policies = parse(text).unwrap();
        assert_eq!(policies[0].policy, Policy::AlwaysSample);
        assert!(matches!(&policies[1].policy, Policy::And(subs) if subs.len() == 2));
    }

    #[test]
    fn errors_name_the_policy_and_the_field() {
        let cases = [
            (
                "policies: [{name: a, type: latency}]",
                "policy \"a\": latency: a policy of type `latency` needs its `latency` settings",
            ),
            (
                "policies: [{name: b, type: latency, latency: {threshold_ms: 5, upper_threshold_ms: 5}}]",
                "policy \"b\": latency.upper_threshold_ms",
            ),
            (
                "policies: [{name: c, type: status_code, status_code: {status_codes: [BAD]}}]",
                "`BAD` is not ERROR, OK or UNSET",
            ),
            (
                "policies: [{name: d, type: probabilistic, probabilistic: {sampling_percentage: 101}}]",
                "probabilistic.sampling_percentage",
            ),
            ("policies: [{name: e, type: nope}]", "policy \"e\": type: `nope` is not one of"),
            (
                "policies: [{name: f, type: always_sample, latency: {threshold_ms: 1}}]",
                "policy \"f\": latency: settings for `latency`",
            ),
            ("policies: [{name: g, type: always_sample}, {name: g, type: always_sample}]", "policy \"g\": name"),
            (
                "policies: [{name: h, type: rate_limiting, rate_limiting: {spans_per_second: 0}}]",
                "rate_limiting.spans_per_second",
            ),
        ];
        for (text, want) in cases {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
        let unknown = parse("policies: [{name: a, type: always_sample, colour: red}]").unwrap_err().to_string();
        assert!(unknown.contains("unknown field `colour`"), "{unknown}");
        assert!(parse("policies: []").is_err());
        assert!(parse("{").is_err());
    }
}

//! Kubernetes label selectors in their string form (`TRACETAP_K8S_POD_SELECTOR`), as `kubectl -l`
//! takes them: requirements separated by commas, all of which must hold:
//! `key=value`, `key==value`, `key!=value`, `key in (a,b)`, `key notin (a,b)`, `key`, `!key`.

use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed selector; the empty selector matches every pod.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LabelSelector {
    requirements: Vec<Requirement>,
}

impl LabelSelector {
    /// Parses the string form; the error says what is wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut requirements = Vec::new();
        for part in split_top_level(text)? {
            let part = part.trim();
            if part.is_empty() {
                return Err("an empty requirement (two commas in a row, or a trailing comma)".into());
            }
            requirements.push(requirement(part)?);
        }
        Ok(Self { requirements })
    }

    /// True when every requirement holds for these labels.
    #[must_use]
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|r| match r {
            Requirement::In(k, values) => labels.get(k).is_some_and(|v| values.contains(v)),
            // As Kubernetes: `notin` and `!=` also match pods without the label.
            Requirement::NotIn(k, values) => labels.get(k).is_none_or(|v| !values.contains(v)),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::NotExists(k) => !labels.contains_key(k),
        })
    }
}

/// Splits on commas outside parentheses.
fn split_top_level(text: &str) -> Result<Vec<&str>, String> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err("unbalanced or nested parentheses".into());
        }
    }
    if depth != 0 {
        return Err("unbalanced parentheses".into());
    }
    if !text.trim().is_empty() {
        parts.push(&text[start..]);
    }
    Ok(parts)
}

fn requirement(part: &str) -> Result<Requirement, String> {
    if let Some(key) = part.strip_prefix('!') {
        return Ok(Requirement::NotExists(key_of(key)?));
    }
    if let Some((key, value)) = part.split_once("!=") {
        return Ok(Requirement::NotIn(key_of(key)?, vec![value_of(value)?]));
    }
    if let Some((key, value)) = part.split_once("==").or_else(|| part.split_once('=')) {
        return Ok(Requirement::In(key_of(key)?, vec![value_of(value)?]));
    }
    let words: Vec<&str> = part.splitn(2, char::is_whitespace).collect();
    if let [key, rest] = words[..] {
        let rest = rest.trim_start();
        let (negate, list) = if let Some(list) = rest.strip_prefix("notin") {
            (true, list)
        } else if let Some(list) = rest.strip_prefix("in") {
            (false, list)
        } else {
            return Err(format!("`{part}`: expected `in (...)` or `notin (...)` after the key"));
        };
        let inner = list
            .trim()
            .strip_prefix('(')
            .and_then(|l| l.strip_suffix(')'))
            .ok_or_else(|| format!("`{part}`: the values go in parentheses"))?;
        let values = inner.split(',').map(value_of).collect::<Result<Vec<_>, _>>()?;
        let key = key_of(key)?;
        return Ok(if negate { Requirement::NotIn(key, values) } else { Requirement::In(key, values) });
    }
    Ok(Requirement::Exists(key_of(part)?))
}

/// A label key: an optional DNS prefix and `/`, then a name of letters, digits, `-`, `_`, `.`.
fn key_of(key: &str) -> Result<String, String> {
    let key = key.trim();
    let name = key.rsplit('/').next().unwrap_or(key);
    let ok = !name.is_empty()
        && key.len() <= 317
        && key.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
        && key.matches('/').count() <= 1;
    if ok { Ok(key.to_owned()) } else { Err(format!("`{key}` is not a label key")) }
}

fn value_of(value: &str) -> Result<String, String> {
    let value = value.trim();
    let ok = value.len() <= 63 && value.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok { Ok(value.to_owned()) } else { Err(format!("`{value}` is not a label value")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn requirements_as_kubectl_reads_them() {
        let pod = labels(&[("app", "haproxy"), ("tier", "edge"), ("app.kubernetes.io/part-of", "ingress")]);
        let cases = [
            ("", true),
            ("app=haproxy", true),
            ("app==haproxy", true),
            ("app!=haproxy", false),
            ("app=nginx", false),
            ("tier in (edge, internal)", true),
            ("tier notin (edge)", false),
            ("tier notin (internal)", true),
            ("app.kubernetes.io/part-of", true),
            ("!canary", true),
            ("!app", false),
            ("app=haproxy,tier in (edge),!canary", true),
            ("app=haproxy,tier=internal", false),
            ("missing!=x", true),
            ("missing in (x)", false),
        ];
        for (text, want) in cases {
            assert_eq!(LabelSelector::parse(text).unwrap().matches(&pod), want, "{text}");
        }
    }

    #[test]
    fn malformed_selectors_say_why() {
        for text in
            ["=x", "a,,b", "a,", "tier in edge", "tier in (a", "tier maybe (a)", "a b", "app=has space", "x/y/z"]
        {
            assert!(LabelSelector::parse(text).is_err(), "{text}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_text_parses_or_errs(text in "\\PC{0,60}") {
            let _ = LabelSelector::parse(&text);
        }
    }
}

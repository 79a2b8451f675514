//! The error every configuration parser returns: the variable, its value and what it accepts.
//! A leaf module, so that the parsers of the parts (sampling, export settings, the snippet) do not
//! depend on the module that assembles the whole configuration.

/// A bad configuration value; `main` turns it into exit status 2.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?} is invalid: {expected}")]
pub struct ConfigError {
    pub var: &'static str,
    pub value: String,
    pub expected: String,
}

impl ConfigError {
    #[must_use]
    pub fn new(var: &'static str, value: &str, expected: impl Into<String>) -> Self {
        Self { var, value: value.to_owned(), expected: expected.into() }
    }
}

/// A boolean variable: `true`/`1` or `false`/`0`, `default` when unset.
pub fn parse_flag(var: &'static str, value: Option<&str>, default: bool) -> Result<bool, ConfigError> {
    match value.map(str::trim) {
        None => Ok(default),
        Some("false" | "0") => Ok(false),
        Some("true" | "1") => Ok(true),
        Some(v) => Err(ConfigError::new(var, v, "true or false")),
    }
}

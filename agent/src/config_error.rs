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

/// The bad values of one configuration, in the order the variables are read, each once: an
/// operator fixes them in one go rather than one restart each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl ConfigErrors {
    /// `errors` without repeats (the spans' and the metrics' exporters read the same general
    /// `OTEL_EXPORTER_OTLP_*` variables, and would both report a bad one).
    #[must_use]
    pub fn new(errors: Vec<ConfigError>) -> Self {
        let mut unique: Vec<ConfigError> = Vec::with_capacity(errors.len());
        for e in errors {
            if !unique.contains(&e) {
                unique.push(e);
            }
        }
        Self(unique)
    }

    /// The first bad value.
    #[must_use]
    pub fn first(&self) -> Option<&ConfigError> {
        self.0.first()
    }
}

impl From<ConfigError> for ConfigErrors {
    fn from(e: ConfigError) -> Self {
        Self(vec![e])
    }
}

impl std::fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// A boolean variable: `true`/`1` or `false`/`0`, `default` when unset.
pub fn parse_flag(var: &'static str, value: Option<&str>, default: bool) -> Result<bool, ConfigError> {
    match value.map(str::trim) {
        None => Ok(default),
        Some("false" | "0") => Ok(false),
        Some("true" | "1") => Ok(true),
        Some(v) => Err(ConfigError::new(var, v, "true or false")),
    }
}

//! The command line: a pure parse of the arguments into what `main` does. The agent itself is
//! configured with environment variables (`config`); arguments only choose a command.

use std::ffi::OsString;
use std::path::PathBuf;

use crate::snippet;

/// What the binary was asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// No argument: run the agent.
    Run,
    /// `--help`: the usage and the configuration table.
    Help,
    /// `--version`.
    Version,
    /// `haproxy-snippet`: print the `HAProxy` lines that propagate trace context.
    Snippet(snippet::Options),
    /// `haproxy-snippet --help`.
    SnippetHelp,
    /// `view [FILE]`: the stdout sink's spans as waterfalls, from FILE or standard input.
    View(Option<PathBuf>),
}

/// Arguments that name no command; `main` prints it with [`USAGE`] and exits 2.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

pub const USAGE: &str = "\
usage: tracetap                      run the agent (configured with environment variables)
       tracetap haproxy-snippet [--response]
                                     print HAProxy configuration lines that propagate trace
                                     context for this sampler (OTEL_TRACES_SAMPLER and
                                     OTEL_TRACES_SAMPLER_ARG)
       tracetap view [FILE]          print the spans the agent wrote as JSON lines (no endpoint
                                     set) as one waterfall per trace; FILE or standard input
       tracetap --help               this text and every configuration variable
       tracetap --version";

pub const SNIPPET_USAGE: &str = "\
usage: tracetap haproxy-snippet [--response]

Prints HAProxy configuration lines for a `frontend` or `listen` section with which HAProxy
propagates W3C trace context itself: a request without a valid traceparent gets a new trace id,
every forwarded request a new parent id (tracetap's CLIENT span id) and the sampled flag tracetap
decides under OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG, read from the environment.

  --response   also set the traceparent on every response, local answers (deny, return, 503)
               included, so that clients see their trace id";

/// Parses the arguments after the program name.
pub fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Command, UsageError> {
    let args: Vec<OsString> = args.into_iter().collect();
    let words: Vec<&str> = args
        .iter()
        .map(|a| a.to_str().ok_or_else(|| UsageError(format!("argument {} is not UTF-8", a.to_string_lossy()))))
        .collect::<Result<_, _>>()?;
    match words.as_slice() {
        [] => Ok(Command::Run),
        ["--help" | "-h" | "help"] => Ok(Command::Help),
        ["--version" | "-V"] => Ok(Command::Version),
        ["haproxy-snippet", rest @ ..] => {
            let mut options = snippet::Options::default();
            for word in rest {
                match *word {
                    "--response" => options.response = true,
                    "--help" | "-h" => return Ok(Command::SnippetHelp),
                    other => return Err(UsageError(format!("haproxy-snippet: unknown option {other:?}"))),
                }
            }
            Ok(Command::Snippet(options))
        }
        ["view"] | ["view", "-"] => Ok(Command::View(None)),
        ["view", file] if !file.starts_with('-') => Ok(Command::View(Some(PathBuf::from(file)))),
        ["view", ..] => Err(UsageError("view takes one file (or none: standard input)".into())),
        [first, ..] => Err(UsageError(format!("unknown argument {first:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(args: &[&str]) -> Result<Command, UsageError> {
        parse(args.iter().map(OsString::from))
    }

    #[test]
    fn commands() {
        assert_eq!(parsed(&[]), Ok(Command::Run));
        assert_eq!(parsed(&["--help"]), Ok(Command::Help));
        assert_eq!(parsed(&["-h"]), Ok(Command::Help));
        assert_eq!(parsed(&["--version"]), Ok(Command::Version));
        assert_eq!(parsed(&["haproxy-snippet"]), Ok(Command::Snippet(snippet::Options { response: false })));
        assert_eq!(
            parsed(&["haproxy-snippet", "--response"]),
            Ok(Command::Snippet(snippet::Options { response: true }))
        );
        assert_eq!(parsed(&["haproxy-snippet", "--help"]), Ok(Command::SnippetHelp));
        assert_eq!(parsed(&["view"]), Ok(Command::View(None)));
        assert_eq!(parsed(&["view", "-"]), Ok(Command::View(None)));
        assert_eq!(parsed(&["view", "spans.jsonl"]), Ok(Command::View(Some("spans.jsonl".into()))));
    }

    #[test]
    fn anything_else_is_a_usage_error_naming_it() {
        assert_eq!(parsed(&["--verbose"]), Err(UsageError("unknown argument \"--verbose\"".into())));
        assert!(parsed(&["--help", "extra"]).is_err());
        assert!(parsed(&["--version", "--help"]).is_err());
        assert!(parsed(&["view", "a", "b"]).is_err());
        assert!(parsed(&["view", "--color"]).is_err());
        let e = parsed(&["haproxy-snippet", "--respons"]).unwrap_err();
        assert!(e.0.contains("--respons"), "{e}");
    }
}

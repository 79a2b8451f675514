//! Runs nghttp2's `h2load`, the load generator for concurrent HTTP/2 streams (and HTTP/1.1 with
//! `--h1`), and reads its summary.

use std::process::Command;

/// What `h2load` reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Outcome {
    pub succeeded: usize,
    pub failed: usize,
    pub errored: usize,
    /// Requests answered with a 2xx, 3xx, 4xx and 5xx status.
    pub statuses: [usize; 4],
}

impl Outcome {
    /// Requests that got a response, whatever its status (`h2load` counts 4xx and 5xx as failed).
    #[must_use]
    pub fn answered(&self) -> usize {
        self.statuses.iter().sum()
    }
}

/// Runs `h2load` with `args` (the URL last) and parses its summary.
///
/// # Panics
/// When `h2load` cannot be run (run `make setup`) or prints no summary.
#[must_use]
pub fn run(args: &[&str]) -> Outcome {
    let out = Command::new("h2load").args(args).output().expect("run h2load (make setup installs nghttp2-client)");
    let text = String::from_utf8_lossy(&out.stdout);
    parse(&text).unwrap_or_else(|| panic!("no h2load summary in:\n{text}\n{}", String::from_utf8_lossy(&out.stderr)))
}

/// Reads `requests: N total, N started, N done, N succeeded, N failed, N errored, N timeout` and
/// `status codes: N 2xx, N 3xx, N 4xx, N 5xx`.
#[must_use]
pub fn parse(text: &str) -> Option<Outcome> {
    let count = |line: &str, label: &str| -> Option<usize> {
        line.split(',').find_map(|part| part.trim().strip_suffix(label)?.trim().rsplit(' ').next()?.parse().ok())
    };
    let requests = text.lines().find(|l| l.starts_with("requests:"))?;
    let statuses = text.lines().find(|l| l.starts_with("status codes:"))?;
    Some(Outcome {
        succeeded: count(requests, "succeeded")?,
        failed: count(requests, "failed")?,
        errored: count(requests, "errored")?,
        statuses: [count(statuses, "2xx")?, count(statuses, "3xx")?, count(statuses, "4xx")?, count(statuses, "5xx")?],
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_the_summary() {
        let text = "finished in 1.2s, 800 req/s\nrequests: 1000 total, 1000 started, 1000 done, 998 succeeded, 2 failed, 1 errored, 0 timeout\nstatus codes: 600 2xx, 0 3xx, 398 4xx, 0 5xx\n";
        let got = super::parse(text).unwrap();
        assert_eq!(got.succeeded, 998);
        assert_eq!(got.failed, 2);
        assert_eq!(got.errored, 1);
        assert_eq!(got.statuses, [600, 0, 398, 0]);
    }
}

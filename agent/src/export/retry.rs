//! Retries per the OTLP specification, shared by both protocols: what one attempt came to, how
//! long to wait before the next (exponential backoff, or what the server asked for with
//! `Retry-After` or gRPC's `RetryInfo`), and the budget after which a request fails for good.

use std::time::{Duration, SystemTime};

use super::tls_failure::TlsFailure;

/// Most attempts for one export request.
pub const MAX_ATTEMPTS: u32 = 5;
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// The longest wait honoured between attempts, whatever the server asks: the exporter sends one
/// request at a time, so a longer wait only moves the loss to the queue.
pub const MAX_WAIT: Duration = Duration::from_secs(30);

/// What one attempt came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// Accepted; `rejected` spans of it were refused (OTLP partial success), with the server's
    /// message.
    Accepted { rejected: u64, message: String },
    /// Failed in a way the specification says to retry, after `after` if the server said.
    Retryable { reason: String, after: Option<Duration> },
    /// Failed for good.
    Permanent { reason: String },
    /// The TLS handshake failed: retried until the cause is fixed, the request held meanwhile
    /// (later ones wait in the bounded queue, whose overflow is counted).
    Tls(TlsFailure),
}

/// The wait before attempt `attempt + 1` (`attempt` counts from 1): the server's wish when it
/// gave one, else 100 ms doubling, with up to half of it added at random so that agents restarted
/// together do not retry together; never past [`MAX_WAIT`].
#[must_use]
pub fn wait_before_next(attempt: u32, asked: Option<Duration>) -> Duration {
    let wait = asked.unwrap_or_else(|| {
        let base = FIRST_BACKOFF.saturating_mul(1 << attempt.saturating_sub(1).min(16));
        base + base.mul_f64(fastrand::f64() / 2.0)
    });
    wait.min(MAX_WAIT)
}

/// An HTTP `Retry-After` value: delay-seconds or an HTTP date (RFC 9110 section 10.2.3).
#[must_use]
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let when = httpdate::parse_http_date(value).ok()?;
    Some(when.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Whether an OTLP/HTTP status is retryable (429, 502, 503, 504).
#[must_use]
pub fn http_status_retryable(status: u16) -> bool {
    matches!(status, 429 | 502 | 503 | 504)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_takes_seconds_and_dates() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(parse_retry_after("7", now), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("Sun, 06 Nov 1994 08:49:40 GMT", now), Some(Duration::from_secs(3)));
        // A date in the past means now.
        assert_eq!(parse_retry_after("Sun, 06 Nov 1994 08:49:00 GMT", now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("-1", now), None);
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        let first = wait_before_next(1, None);
        assert!(first >= Duration::from_millis(100) && first <= Duration::from_millis(150));
        let fourth = wait_before_next(4, None);
        assert!(fourth >= Duration::from_millis(800) && fourth <= Duration::from_millis(1200));
        assert_eq!(wait_before_next(40, None), MAX_WAIT);
        assert_eq!(wait_before_next(1, Some(Duration::from_hours(1))), MAX_WAIT);
        assert_eq!(wait_before_next(3, Some(Duration::from_secs(2))), Duration::from_secs(2));
    }

    #[test]
    fn retryable_statuses_are_the_specifications() {
        for s in [429, 502, 503, 504] {
            assert!(http_status_retryable(s));
        }
        for s in [400, 401, 403, 404, 413, 500, 501] {
            assert!(!http_status_retryable(s));
        }
    }
}

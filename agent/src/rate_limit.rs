//! A token bucket on the monotonic clock the probes stamp records with, so that it needs no clock
//! of its own and tests drive it with plain numbers. It admits up to `per_second` at once, then
//! `per_second` a second; time that seems to go back (records of different CPUs) adds nothing.

/// See the module note.
#[derive(Debug, Clone)]
pub struct RateLimit {
    per_second: u32,
    /// Tokens, in billionths (a token is `1e9`), so that refills need no floating point.
    nano_tokens: u64,
    last_ns: u64,
}

const TOKEN: u64 = 1_000_000_000;

impl RateLimit {
    /// A full bucket of `per_second` tokens; 0 admits nothing.
    #[must_use]
    pub fn new(per_second: u32) -> Self {
        Self { per_second, nano_tokens: u64::from(per_second) * TOKEN, last_ns: 0 }
    }

    /// Takes a token at `now_ns`, if there is one.
    pub fn admit(&mut self, now_ns: u64) -> bool {
        let capacity = u64::from(self.per_second) * TOKEN;
        if now_ns > self.last_ns {
            let refill = (now_ns - self.last_ns).saturating_mul(u64::from(self.per_second));
            self.nano_tokens = self.nano_tokens.saturating_add(refill).min(capacity);
            self.last_ns = now_ns;
        }
        if self.nano_tokens >= TOKEN {
            self.nano_tokens -= TOKEN;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_the_rate() {
        let mut limit = RateLimit::new(10);
        let start = 5 * TOKEN;
        assert_eq!((0..25).filter(|_| limit.admit(start)).count(), 10, "a burst of as many as a second's");
        assert!(!limit.admit(start + 50_000_000), "half a token after 50 ms");
        assert!(limit.admit(start + 100_000_000), "one after 100 ms");
        assert_eq!((0..25).filter(|_| limit.admit(start + 10 * TOKEN)).count(), 10, "never more than the burst");
    }

    #[test]
    fn zero_admits_nothing_and_time_going_back_adds_nothing() {
        let mut none = RateLimit::new(0);
        assert!(!none.admit(u64::MAX));
        let mut limit = RateLimit::new(1);
        assert!(limit.admit(10 * TOKEN));
        assert!(!limit.admit(TOKEN));
        assert!(!limit.admit(10 * TOKEN));
    }

    proptest::proptest! {
        /// Over any run of times, no more are admitted than the burst plus the rate times the span.
        #[test]
        fn never_more_than_the_rate_allows(per_second in 0u32..1000, steps in proptest::collection::vec(0u64..2 * TOKEN, 1..200)) {
            let mut limit = RateLimit::new(per_second);
            let mut now = TOKEN;
            let mut admitted = 0u64;
            for step in &steps {
                now += step;
                admitted += u64::from(limit.admit(now));
            }
            let elapsed = now - TOKEN;
            let most = u64::from(per_second) + u64::from(per_second) * elapsed / TOKEN + 1;
            proptest::prop_assert!(admitted <= most);
        }
    }
}

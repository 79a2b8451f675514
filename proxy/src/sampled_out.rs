//! Requests sampled out by their own trace context, told from their head alone.
//!
//! The head sampler decides a request that carries a valid `traceparent` from that context alone
//! (its sampled flag under a parent-based sampler, its randomness under a ratio). Such a request
//! is decided as soon as its head is parsed, and when it is dropped the tracker keeps only what
//! pairing needs: no exchange, no link candidate, no relay claim. Its backend requests are left
//! out the same way, when `HAProxy` forwarded the dropped context (see the tracker's module
//! notes). [`SampledOutRule`] is that part of the sampler, and the agent's `Sampler::decide`
//! takes its verdict on such requests from the same rule. The agent's later decision may still
//! differ: it follows a flag `HAProxy` forwarded, which a request dropped at its head never gets
//! to (the tracker counts the backend requests that show such a difference).
//!
//! A request without a valid `traceparent` is never dropped here: its trace id is made later,
//! and `HAProxy` may forward a context of its own that the decision must follow.

use tracetap_ebpf_common::head_drop::{RULE_NONE, RULE_TRACE_ID_BELOW, RULE_UNSAMPLED_PARENT, randomness_drops};

use crate::framing::{Chunk, Cursor, Framer, Step};
use crate::head::{RequestHead, parse_request_into};
use crate::trace_context::{TraceParent, parse_ot_tracestate, randomness};

/// What a valid incoming `traceparent` alone decides: which requests carrying one are dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SampledOutRule {
    /// None (`always_on`, and tracker users that do not sample).
    #[default]
    Never,
    /// Those whose parent is not sampled (the parent-based samplers).
    UnsampledParent,
    /// Those whose randomness is below this 56-bit rejection threshold (`traceidratio`;
    /// `always_off` with a threshold above every randomness).
    RandomnessBelow(u64),
}

impl SampledOutRule {
    /// True when a request with this valid parent and `tracestate` is dropped.
    #[must_use]
    pub fn drops(self, parent: &TraceParent, tracestate: Option<&str>) -> bool {
        match self {
            Self::Never => false,
            Self::UnsampledParent => !parent.sampled(),
            Self::RandomnessBelow(threshold) => {
                let randomness = tracestate
                    .and_then(|ts| parse_ot_tracestate(ts).randomness)
                    .unwrap_or_else(|| randomness(&parent.trace_id));
                randomness_drops(randomness, threshold)
            }
        }
    }

    /// The context of a frontend request dropped at its head: one this rule drops from its own
    /// valid `traceparent`, and, under a ratio, whose trace id's bits drop it too. `HAProxy`'s
    /// lines (`tracetap haproxy-snippet`) decide a ratio on the trace id, as they cannot read an
    /// `ot=rv:`: a request an `rv` alone drops is left to the later decision, which follows the
    /// flag they forwarded and counts the difference. `None`: kept, or not decided from the head.
    #[must_use]
    pub fn dropped_parent(self, request: &RequestHead) -> Option<TraceParent> {
        let parent = request.parsed_traceparent?;
        let by_trace_id_too = match self {
            Self::RandomnessBelow(threshold) => randomness_drops(randomness(&parent.trace_id), threshold),
            Self::Never | Self::UnsampledParent => true,
        };
        (self.drops(&parent, request.tracestate.as_deref()) && by_trace_id_too).then_some(parent)
    }

    /// What the tracker decides from `bytes` read at once on a frontend: the dropped context when
    /// they are exactly one request head without a body that this rule drops at its head. The
    /// reference the probes' scan is held to (`tracetap_ebpf_common::head_drop`; its tests and
    /// fuzz target), by the tracker's own framer and parser.
    #[must_use]
    pub fn dropped_whole_head(self, bytes: &[u8]) -> Option<TraceParent> {
        let mut framer = Framer::new();
        let mut cursor = Cursor::new(Chunk::complete(bytes));
        if framer.step(&mut cursor) != Step::Head {
            return None;
        }
        let mut head = RequestHead::default();
        parse_request_into(framer.head_bytes(), &mut head).ok()?;
        framer.set_body(head.framing);
        let whole = cursor.is_empty() && framer.is_idle();
        if !whole || !answer_frames_like_get(&head.method) {
            return None;
        }
        self.dropped_parent(&head)
    }

    /// The rule the probes apply to frontend request heads (`DROP_RULE`, `DROP_THRESHOLD`; see
    /// `tracetap_ebpf_common::head_drop`): what they drop, this rule drops in [`Self::dropped_parent`].
    #[must_use]
    pub fn in_probes(self) -> (u32, u64) {
        match self {
            Self::Never | Self::RandomnessBelow(0) => (RULE_NONE, 0),
            Self::UnsampledParent => (RULE_UNSAMPLED_PARENT, 0),
            Self::RandomnessBelow(threshold) => (RULE_TRACE_ID_BELOW, threshold),
        }
    }
}

/// Whether the answer to a request of this method frames as a `GET`'s: not `HEAD` (no body
/// whatever its length says) or `CONNECT` (a tunnel). Only such requests are dropped at their head,
/// as a request sampled out keeps no method to frame its answer by.
#[must_use]
pub fn answer_frames_like_get(method: &str) -> bool {
    method != "HEAD" && method != "CONNECT"
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parent(low: u64, flags: u8) -> TraceParent {
        let mut trace_id = [0xab; 16];
        trace_id[8..].copy_from_slice(&low.to_be_bytes());
        TraceParent { trace_id, parent_id: [1; 8], flags }
    }

    #[test]
    fn each_rule_drops_what_its_sampler_drops() {
        assert!(!SampledOutRule::Never.drops(&parent(0, 0), None));
        assert!(SampledOutRule::UnsampledParent.drops(&parent(u64::MAX, 0), None));
        assert!(!SampledOutRule::UnsampledParent.drops(&parent(0, 1), None));
        let half = SampledOutRule::RandomnessBelow(1 << 55);
        assert!(half.drops(&parent((1 << 55) - 1, 1), None), "the flag does not matter to a ratio");
        assert!(!half.drops(&parent(1 << 55, 0), None));
        // `rv` replaces the trace id's bits.
        assert!(!half.drops(&parent(0, 0), Some("ot=rv:ffffffffffffff")));
        assert!(half.drops(&parent(u64::MAX, 0), Some("x=y,ot=rv:00000000000000")));
    }

    fn head(parent: TraceParent, tracestate: Option<&str>) -> RequestHead {
        RequestHead {
            parsed_traceparent: Some(parent),
            tracestate: tracestate.map(str::to_owned),
            ..RequestHead::default()
        }
    }

    #[test]
    fn at_the_head_a_ratio_drops_only_what_the_trace_id_drops_too() {
        let half = SampledOutRule::RandomnessBelow(1 << 55);
        let low = parent(1, 1);
        assert_eq!(half.dropped_parent(&head(low, None)), Some(low));
        assert_eq!(half.dropped_parent(&head(low, Some("ot=rv:00000000000002"))), Some(low));
        // Dropped by its `rv` alone: left to the later decision.
        let high = parent(u64::MAX, 1);
        assert!(half.drops(&high, Some("ot=rv:00000000000002")));
        assert_eq!(half.dropped_parent(&head(high, Some("ot=rv:00000000000002"))), None);
        // The parent-based rule does not look at the trace id.
        assert_eq!(
            SampledOutRule::UnsampledParent.dropped_parent(&head(parent(u64::MAX, 0), None)),
            Some(parent(u64::MAX, 0))
        );
        assert_eq!(SampledOutRule::UnsampledParent.dropped_parent(&RequestHead::default()), None);
    }
}

//! Kept exchanges whose spans wait for their names: while `HAProxy`'s runtime API is read for a
//! process, a span reports the server names a table read *after* its request was sent gives (see
//! [`Names::settled_at`]), so a slot moved just before the request is not named after its old
//! server. The wait is one table read (a few hundred milliseconds, well inside the export batch
//! delay); it never exceeds [`MAX_NAME_WAIT`], past which the exchange's spans carry no server
//! names (its frontend's, yes) and it is counted; nor do more than [`MAX_AWAITING`] wait (past
//! that, the same). The queue is looked at only when a table read came in or its oldest entry's
//! wait ran out, so waiting costs the capture thread nothing per event.
//!
//! Exchanges that need no wait (no runtime API in use, or no backend connection) do not queue
//! behind those that do; the waiting ones leave in the order they came.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracetap_proxy::ServerExchange;
use tracetap_proxy::haproxy_config::ProxyNames;

use crate::names::{Names, NamesAt};
use crate::spans::Decision;

/// Longest wait for a table read (longer than a read's own timeout, so a hung socket costs one
/// timeout, then the configuration's names).
pub const MAX_NAME_WAIT: Duration = Duration::from_secs(3);
/// Most exchanges waiting at once (at 20 000 kept requests a second, a second and a half of them).
pub const MAX_AWAITING: usize = 32_768;

/// Exchanges handed out by the tracker, and those waiting for their names.
#[derive(Default)]
pub struct Staging {
    /// Reused for the tracker's hand-out.
    pub scratch: Vec<ServerExchange>,
    awaiting: VecDeque<Awaiting>,
    /// Exchanges whose spans went without server names: they waited [`MAX_NAME_WAIT`], did not
    /// fit in [`MAX_AWAITING`], or were still waiting at shutdown.
    pub unsettled: u64,
    /// [`Names::generation`] when the queue was last looked at.
    seen_generation: u64,
}

struct Awaiting {
    exchange: ServerExchange,
    decision: Decision,
    since: Instant,
}

/// When `HAProxy` sent the exchange's (first) backend request: the moment its names must be true for.
#[must_use]
pub fn sent_ns(ex: &ServerExchange) -> u64 {
    ex.clients.first().map_or(ex.start_ns, |c| c.start_ns)
}

impl Staging {
    /// Names for a kept exchange, or `None` when it now waits here.
    pub fn names_for(
        &mut self,
        names: &mut Names,
        exchange: ServerExchange,
        decision: Decision,
    ) -> Option<(ServerExchange, Decision, Option<Arc<ProxyNames>>)> {
        let sent = sent_ns(&exchange);
        if exchange.clients.is_empty() {
            // No backend connection, no server to name.
            let n = names.of(exchange.tgid);
            return Some((exchange, decision, n));
        }
        if let NamesAt::Ready(n) = names.settled_at(exchange.tgid, sent) {
            return Some((exchange, decision, n));
        }
        if self.awaiting.len() >= MAX_AWAITING {
            self.unsettled += 1;
            let n = names.unsettled(exchange.tgid);
            return Some((exchange, decision, n));
        }
        self.awaiting.push_back(Awaiting { exchange, decision, since: Instant::now() });
        None
    }

    /// The waiting exchanges whose names are now known (or that waited too long), in order, to
    /// `out`.
    pub fn release(
        &mut self,
        names: &mut Names,
        out: &mut dyn FnMut(ServerExchange, Decision, Option<Arc<ProxyNames>>),
    ) {
        let now = Instant::now();
        let generation = names.generation();
        let oldest_due = self.awaiting.front().is_some_and(|a| now.duration_since(a.since) >= MAX_NAME_WAIT);
        if generation == self.seen_generation && !oldest_due {
            return;
        }
        self.seen_generation = generation;
        for _ in 0..self.awaiting.len() {
            let Some(a) = self.awaiting.pop_front() else { break };
            match names.settled_at(a.exchange.tgid, sent_ns(&a.exchange)) {
                NamesAt::Ready(n) => out(a.exchange, a.decision, n),
                NamesAt::Wait if now.duration_since(a.since) >= MAX_NAME_WAIT => {
                    self.unsettled += 1;
                    let n = names.unsettled(a.exchange.tgid);
                    out(a.exchange, a.decision, n);
                }
                NamesAt::Wait => self.awaiting.push_back(a),
            }
        }
    }

    /// Everything still waiting, without server names (at shutdown).
    pub fn release_all(
        &mut self,
        names: &mut Names,
        out: &mut dyn FnMut(ServerExchange, Decision, Option<Arc<ProxyNames>>),
    ) {
        while let Some(a) = self.awaiting.pop_front() {
            self.unsettled += 1;
            let n = names.unsettled(a.exchange.tgid);
            out(a.exchange, a.decision, n);
        }
    }

    #[must_use]
    pub fn waiting(&self) -> usize {
        self.awaiting.len()
    }
}

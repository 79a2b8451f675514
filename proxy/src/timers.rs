//! `HAProxy`'s timers, as its log names them (`TR`, `Tw`, `Tc`, `Tr`, `Ta`), computed from the times
//! of the syscalls an exchange is made of, without touching `HAProxy`'s configuration.
//!
//! Where each one starts and ends (all monotonic ns of syscall exits):
//! - `TR` (request head): from the read that brought the request's first byte to the read that
//!   completed its head;
//! - `Tw` (queue): from that read until the request had its backend connection: the `connect` of
//!   a new one; on a reused HTTP/1 connection, the end of the exchange before it on that
//!   connection when that came later (the request waited for the server's slot), else no wait;
//! - `Tc` (connect): from the `connect` until the request's first write (`HAProxy` writes once the
//!   connection is established); 0 on a reused connection, as `HAProxy` logs it;
//! - `Tr` (server response): from the connection being established (the request's first write on
//!   a new connection; the moment `Tw` ended on a reused one) until the read that completed the
//!   response head. On a reused connection, `HAProxy` counts the time it takes to
//!   write the request there too: taking an idle connection over from another thread can take a
//!   few milliseconds, which its log shows in `Tr`, not in `Tw`;
//! - `Ta` (active): from the request's first byte to the write that ended the response.
//!
//! The backend part comes from the exchange's last backend attempt that got a response (the one
//! `HAProxy` relayed), or its last attempt when none did. An exchange `HAProxy` answered without a
//! backend (a redirect, a deny, an error it generated) has no `Tw`, `Tc` or `Tr`, as in its log
//! (where they show -1). An exchange without a parsed request has no timers at all: nothing is
//! guessed.

use crate::exchange::{ClientExchange, ServerExchange};

/// The timers of one frontend exchange, in ns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timers {
    /// `TR`.
    pub request_head_ns: u64,
    /// `Tw`, when a backend request was written.
    pub queue_ns: Option<u64>,
    /// `Tc`, when a backend request was written.
    pub connect_ns: Option<u64>,
    /// `Tr`, when a backend response started.
    pub response_ns: Option<u64>,
    /// `Ta`.
    pub active_ns: u64,
}

/// The moments a span's timeline can show, in monotonic ns (see [`moments`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Moments {
    /// The request head was complete.
    pub head_end_ns: u64,
    /// The backend connection was started (`None` on a reused connection or without a backend).
    pub connect_ns: Option<u64>,
    /// The request was first written to the server.
    pub request_sent_ns: Option<u64>,
    /// The server's response started.
    pub response_start_ns: Option<u64>,
}

/// The backend attempt whose times make `Tw`, `Tc` and `Tr` (and whose end makes the termination
/// state): the last one that got a response, else the last one.
pub(crate) fn relayed_attempt(ex: &ServerExchange) -> Option<&ClientExchange> {
    let answered = ex.clients.iter().filter(|c| c.response.is_some()).max_by_key(|c| c.start_ns);
    answered.or_else(|| ex.clients.iter().max_by_key(|c| c.start_ns))
}

/// The moments of `ex`'s timeline; `None` without a parsed request.
#[must_use]
pub fn moments(ex: &ServerExchange) -> Option<Moments> {
    let head_end_ns = ex.request.as_ref().and(ex.head_end_ns)?;
    let attempt = relayed_attempt(ex);
    Some(Moments {
        head_end_ns,
        connect_ns: attempt.and_then(|c| c.connect_ns),
        request_sent_ns: attempt.map(|c| c.start_ns),
        // Only a response that had a head: bytes that never made one are no response.
        response_start_ns: attempt.filter(|c| c.response.is_some()).and_then(|c| c.response_start_ns),
    })
}

/// `ex`'s timers; `None` without a parsed request.
#[must_use]
pub fn timers(ex: &ServerExchange) -> Option<Timers> {
    let head_end = ex.request.as_ref().and(ex.head_end_ns)?;
    let attempt = relayed_attempt(ex);
    // When the request had its connection, and when that connection was established.
    let (assigned, established) = match attempt {
        Some(ClientExchange { connect_ns: Some(connect), start_ns, .. }) => (Some(*connect), Some(*start_ns)),
        Some(ClientExchange { connect_ns: None, free_since_ns, .. }) => {
            let assigned = free_since_ns.map_or(head_end, |free| free.max(head_end));
            (Some(assigned), Some(assigned))
        }
        None => (None, None),
    };
    Some(Timers {
        request_head_ns: head_end.saturating_sub(ex.start_ns),
        queue_ns: assigned.map(|at| at.saturating_sub(head_end)),
        connect_ns: attempt.map(|c| c.connect_ns.map_or(0, |connect| c.start_ns.saturating_sub(connect))),
        response_ns: established
            .zip(attempt.and_then(|c| c.response_head_ns))
            .map(|(from, head)| head.saturating_sub(from)),
        active_ns: ex.end_ns.saturating_sub(ex.start_ns),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exchange::Outcome;
    use crate::head::{parse_request, parse_response};

    fn client(start_ns: u64, connect_ns: Option<u64>, response_start_ns: Option<u64>) -> ClientExchange {
        reused(start_ns, connect_ns, None, response_start_ns)
    }

    fn reused(
        start_ns: u64,
        connect_ns: Option<u64>,
        free_since_ns: Option<u64>,
        response_start_ns: Option<u64>,
    ) -> ClientExchange {
        ClientExchange {
            request: parse_request(b"GET / HTTP/1.1\r\n\r\n").unwrap(),
            response: response_start_ns.map(|_| parse_response(b"HTTP/1.1 200 OK\r\n\r\n").unwrap()),
            server: None,
            start_ns,
            end_ns: start_ns + 50,
            connect_ns,
            free_since_ns,
            response_start_ns,
            response_head_ns: response_start_ns,
            server_closed: false,
            outcome: Outcome::Complete,
            tls: None,
        }
    }

    fn server(clients: Vec<ClientExchange>) -> ServerExchange {
        ServerExchange {
            tgid: 1,
            request: Some(parse_request(b"GET / HTTP/1.1\r\n\r\n").unwrap()),
            response: None,
            peer: None,
            local: None,
            client: None,
            start_ns: 1_000,
            end_ns: 9_000,
            head_end_ns: Some(1_200),
            rejected: None,
            client_closed: false,
            outcome: Outcome::Complete,
            tls: None,
            clients,
        }
    }

    #[test]
    fn a_new_backend_connection() {
        let t = timers(&server(vec![client(2_000, Some(1_500), Some(7_000))])).unwrap();
        assert_eq!(
            t,
            Timers {
                request_head_ns: 200,
                queue_ns: Some(300),
                connect_ns: Some(500),
                response_ns: Some(5_000),
                active_ns: 8_000
            }
        );
    }

    #[test]
    fn a_reused_connection_connects_in_no_time_and_the_wait_to_write_is_the_servers() {
        // Free since before the head: no queue; the 200 ns until the write count in Tr.
        let t = timers(&server(vec![reused(1_400, None, Some(900), Some(3_000))])).unwrap();
        assert_eq!((t.queue_ns, t.connect_ns, t.response_ns), (Some(0), Some(0), Some(1_800)));
        // HTTP/2, or not known since when: the same.
        let t = timers(&server(vec![client(1_400, None, Some(3_000))])).unwrap();
        assert_eq!((t.queue_ns, t.connect_ns, t.response_ns), (Some(0), Some(0), Some(1_800)));
    }

    #[test]
    fn a_request_that_waited_for_the_connection_to_be_free_was_queued() {
        let t = timers(&server(vec![reused(5_100, None, Some(5_000), Some(6_000))])).unwrap();
        assert_eq!((t.queue_ns, t.connect_ns, t.response_ns), (Some(3_800), Some(0), Some(1_000)));
    }

    #[test]
    fn the_answered_attempt_counts_not_a_failed_retry() {
        // The first attempt went unanswered; the retry on a new connection was relayed.
        let t =
            timers(&server(vec![client(1_300, Some(1_250), None), client(4_000, Some(3_900), Some(6_000))])).unwrap();
        assert_eq!((t.queue_ns, t.connect_ns, t.response_ns), (Some(2_700), Some(100), Some(2_000)));
    }

    #[test]
    fn without_a_backend_only_the_client_side_timers() {
        let t = timers(&server(Vec::new())).unwrap();
        assert_eq!((t.request_head_ns, t.queue_ns, t.connect_ns, t.response_ns), (200, None, None, None));
    }

    #[test]
    fn an_unanswered_attempt_has_no_response_timer() {
        let t = timers(&server(vec![client(2_000, Some(1_500), None)])).unwrap();
        assert_eq!((t.connect_ns, t.response_ns), (Some(500), None));
    }

    #[test]
    fn no_request_no_timers() {
        let mut ex = server(Vec::new());
        ex.request = None;
        assert_eq!(timers(&ex), None);
        assert_eq!(moments(&ex), None);
    }

    proptest::proptest! {
        /// Whatever order hostile or reordered times come in, no timer underflows or exceeds `Ta`
        /// plus the distance to the furthest time.
        #[test]
        fn never_panics_or_wraps(times in proptest::array::uniform6(0u64..u64::MAX / 4)) {
            let [start, head, connect, sent, first, end] = times;
            let mut ex = server(vec![client(sent, Some(connect), Some(first))]);
            ex.start_ns = start;
            ex.head_end_ns = Some(head);
            ex.end_ns = end;
            let t = timers(&ex).unwrap();
            let most = times.iter().max().unwrap() - times.iter().min().unwrap();
            for v in [Some(t.request_head_ns), t.queue_ns, t.connect_ns, t.response_ns, Some(t.active_ns)].into_iter().flatten() {
                proptest::prop_assert!(v <= most);
            }
        }
    }
}

//! `HAProxy`'s termination state (the `%ts` of its log: who ended the session and in which
//! phase), for the cases the syscalls of an exchange show beyond doubt. Anything else gets no
//! state: a wrong one would send an operator after the wrong side.
//!
//! | state | when | what the syscalls show |
//! |---|---|---|
//! | `--` | normal end | the response relayed from a backend exchange, both complete |
//! | `CD` | the client went away during the response | `HAProxy` read the client's end of stream, or a call on its connection failed (reset, broken pipe), then the response was cut |
//! | `SD` | the server went away during the response | the server's end of stream or a failed call, inside the response body |
//! | `SH` | the server went away before answering | the server's end of stream or a failed call (a reset), no response byte, and `HAProxy` answered 502 |
//! | `sH` | server timeout before the response head | no response byte and the server never closed, and `HAProxy` answered 504 |
//! | `cR` | client timeout while reading the request | a head still incomplete when `HAProxy` answered 408 |
//! | `PR` | the proxy rejected the request | a request whose bytes failed to frame or parse (not a head the capture window cut), answered 400 by `HAProxy` |
//!
//! `--` also needs the client's status to be the server's (an `http-response deny` makes the
//! answer `HAProxy`'s: `PH`), and `CD` a client that went away once the response was under way or
//! with a failed call (a client may half-close after its request and still read the answer).
//!
//! A hang-up `HAProxy` learns of from its poller alone, without a read that returns it (data and
//! the close arriving together), shows no end of stream: then no state.
//!
//! Left out on purpose: answers `HAProxy` made without a backend for a request it parsed (`PR`
//! for a deny, `LR` for a redirect or `return`: the syscalls look alike), a refused connection
//! (`SC`: an unused connection looks like a health check), and client timeouts during the response (`cD`, which looks like `CD` without the
//! client's end of stream).

use crate::exchange::{Outcome, ServerExchange};
use crate::timers::relayed_attempt;

/// `HAProxy`'s termination state of `ex` (see the module note), when the syscalls show it.
#[must_use]
pub fn termination_state(ex: &ServerExchange) -> Option<&'static str> {
    let status = ex.response.map(|r| r.status);
    if let Some(rejected) = &ex.rejected {
        // A head cut short and answered 400 may be the client's abort (`CR`) as well: no state.
        // Other rejection statuses (413, 414, 431, 501) are not checked against HAProxy's log.
        return match (status?, rejected.pending) {
            (408, true) => Some("cR"),
            (400, false) => Some("PR"),
            _ => None,
        };
    }
    let attempt = relayed_attempt(ex)?;
    match (attempt.response.is_some(), attempt.outcome, ex.outcome) {
        (false, _, _) if attempt.response_start_ns.is_some() => None,
        (false, _, _) => match status? {
            502 if attempt.server_closed => Some("SH"),
            504 if !attempt.server_closed => Some("sH"),
            _ => None,
        },
        (true, Outcome::ClosedDuringResponse, _) if attempt.server_closed => Some("SD"),
        // HAProxy then gives up the server's response too.
        (true, _, Outcome::ClosedDuringResponse) if ex.client_closed && !attempt.server_closed => Some("CD"),
        // The client got what the server answered (not a response HAProxy blocked, `PH`).
        (true, Outcome::Complete, Outcome::Complete) if status == attempt.response.map(|r| r.status) => Some("--"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exchange::ClientExchange;
    use crate::head::{parse_request, parse_response};

    fn response(status: u16) -> crate::ResponseHead {
        parse_response(format!("HTTP/1.1 {status} X\r\n\r\n").as_bytes()).unwrap()
    }

    fn attempt(status: Option<u16>, outcome: Outcome, server_closed: bool) -> ClientExchange {
        ClientExchange {
            request: parse_request(b"GET / HTTP/1.1\r\n\r\n").unwrap(),
            response: status.map(response),
            server: None,
            start_ns: 10,
            end_ns: 20,
            connect_ns: None,
            free_since_ns: None,
            response_start_ns: status.map(|_| 15),
            response_head_ns: status.map(|_| 16),
            server_closed,
            outcome,
            tls: None,
        }
    }

    fn front(status: u16, outcome: Outcome, clients: Vec<ClientExchange>) -> ServerExchange {
        ServerExchange {
            tgid: 1,
            request: Some(parse_request(b"GET / HTTP/1.1\r\n\r\n").unwrap()),
            response: Some(response(status)),
            peer: None,
            local: None,
            client: None,
            start_ns: 0,
            end_ns: 30,
            head_end_ns: Some(1),
            rejected: None,
            client_closed: false,
            outcome,
            tls: None,
            clients,
        }
    }

    #[test]
    fn each_state_the_syscalls_show() {
        let complete = || attempt(Some(200), Outcome::Complete, false);
        assert_eq!(termination_state(&front(200, Outcome::Complete, vec![complete()])), Some("--"));
        assert_eq!(termination_state(&front(502, Outcome::Complete, vec![complete()])), None, "PH: blocked");
        let mut aborted = front(200, Outcome::ClosedDuringResponse, vec![complete()]);
        assert_eq!(termination_state(&aborted), None, "cut without the client's end of stream: not known");
        aborted.client_closed = true;
        assert_eq!(termination_state(&aborted), Some("CD"));
        let given_up = attempt(Some(200), Outcome::ClosedDuringResponse, false);
        let mut left = front(200, Outcome::ClosedDuringResponse, vec![given_up]);
        left.client_closed = true;
        assert_eq!(termination_state(&left), Some("CD"), "HAProxy gives up the server's response too");
        let cut = attempt(Some(200), Outcome::ClosedDuringResponse, true);
        assert_eq!(termination_state(&front(200, Outcome::ClosedDuringResponse, vec![cut])), Some("SD"));
        let hung_up = attempt(None, Outcome::ClosedBeforeResponse, true);
        assert_eq!(termination_state(&front(502, Outcome::Complete, vec![hung_up])), Some("SH"));
        let silent = attempt(None, Outcome::ClosedBeforeResponse, false);
        assert_eq!(termination_state(&front(504, Outcome::Complete, vec![silent.clone()])), Some("sH"));
        assert_eq!(termination_state(&front(502, Outcome::Complete, vec![silent])), None, "no hang-up seen");
    }

    #[test]
    fn garbage_from_the_server_or_no_backend_gives_no_state() {
        let mut garbled = attempt(None, Outcome::ClosedBeforeResponse, true);
        garbled.response_start_ns = Some(12);
        assert_eq!(termination_state(&front(502, Outcome::Complete, vec![garbled])), None);
        assert_eq!(termination_state(&front(403, Outcome::Complete, Vec::new())), None, "deny or return: alike");
    }

    #[test]
    fn rejected_requests() {
        let mut ex = front(408, Outcome::Complete, Vec::new());
        ex.request = None;
        ex.rejected = Some(crate::rejected::Rejected::pending(b"GET / HT", 0));
        assert_eq!(termination_state(&ex), Some("cR"));
        ex.response = Some(response(400));
        assert_eq!(termination_state(&ex), None, "a head cut short and 400: the client's abort or not");
        ex.rejected = Some(crate::rejected::Rejected::failed(b"G(ET / HTTP/1.1", 0));
        assert_eq!(termination_state(&ex), Some("PR"));
        ex.response = Some(response(408));
        assert_eq!(termination_state(&ex), None, "408 to a head that failed: not a state we checked");
        ex.response = Some(response(414));
        assert_eq!(termination_state(&ex), None, "other rejection statuses: not checked against the log");
        ex.response = None;
        assert_eq!(termination_state(&ex), None);
    }
}

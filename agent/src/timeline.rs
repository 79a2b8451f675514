//! `HAProxy`'s log timers on a SERVER span: the `haproxy.timer.*` attributes and the span events
//! that mark the same moments on its timeline (the times come from `tracetap_proxy::timers`).
//!
//! Attributes are doubles in milliseconds, rounded to the microsecond, under names that say what
//! each measures; the letters of `HAProxy`'s log are given in docs/traces.md:
//! `haproxy.timer.request_head` (`TR`), `haproxy.timer.queue` (`Tw`), `haproxy.timer.connect`
//! (`Tc`), `haproxy.timer.response` (`Tr`), `haproxy.timer.active` (`Ta`). A timer that does not
//! apply (no backend) is left out, never written as 0 or -1.

use bumpalo::Bump;
use bumpalo::collections::Vec as BumpVec;
use tracetap_proxy::ServerExchange;
use tracetap_proxy::timers::{self, Moments};

use crate::encode::{Attr, EventView, Value};

pub const REQUEST_HEAD: &str = "haproxy.timer.request_head";
pub const QUEUE: &str = "haproxy.timer.queue";
pub const CONNECT: &str = "haproxy.timer.connect";
pub const RESPONSE: &str = "haproxy.timer.response";
pub const ACTIVE: &str = "haproxy.timer.active";

/// Event: the request head was complete.
pub const HEAD_RECEIVED: &str = "haproxy.request.head_received";
/// Event: `HAProxy` started the connection to the server.
pub const BACKEND_CONNECT: &str = "haproxy.backend.connect";
/// Event: the request was written to the server.
pub const REQUEST_SENT: &str = "haproxy.backend.request_sent";
/// Event: the server's response started.
pub const RESPONSE_STARTED: &str = "haproxy.backend.response_started";

/// Milliseconds with microsecond precision.
fn millis(ns: u64) -> f64 {
    (ns / 1_000) as f64 / 1_000.0
}

/// Adds `ex`'s timers to a SERVER span's attributes.
pub fn push_attributes<'a>(attrs: &mut BumpVec<'a, Attr<'a>>, ex: &ServerExchange) {
    let Some(t) = timers::timers(ex) else { return };
    let timers = [
        (REQUEST_HEAD, Some(t.request_head_ns)),
        (QUEUE, t.queue_ns),
        (CONNECT, t.connect_ns),
        (RESPONSE, t.response_ns),
        (ACTIVE, Some(t.active_ns)),
    ];
    for (key, ns) in timers {
        if let Some(ns) = ns {
            attrs.push(Attr { key, value: Value::Double(millis(ns)) });
        }
    }
}

/// The events of `ex`'s timeline, in time order, with times made Unix by `unix_ns`.
pub fn events<'a>(ex: &ServerExchange, bump: &'a Bump, unix_ns: impl Fn(u64) -> u64) -> &'a [EventView<'a>] {
    let Some(Moments { head_end_ns, connect_ns, request_sent_ns, response_start_ns }) = timers::moments(ex) else {
        return &[];
    };
    let mut events = BumpVec::with_capacity_in(4, bump);
    let moments = [
        (HEAD_RECEIVED, Some(head_end_ns)),
        (BACKEND_CONNECT, connect_ns),
        (REQUEST_SENT, request_sent_ns),
        (RESPONSE_STARTED, response_start_ns),
    ];
    for (name, ns) in moments {
        if let Some(ns) = ns {
            events.push(EventView { time_unix_ns: unix_ns(ns), name });
        }
    }
    // Nearly always in order already; stable, so moments at one time keep their causal order.
    if !events.is_sorted_by_key(|e| e.time_unix_ns) {
        events.sort_by_key(|e| e.time_unix_ns);
    }
    events.into_bump_slice()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracetap_proxy::head::{parse_request, parse_response};
    use tracetap_proxy::{ClientExchange, Outcome};

    fn exchange() -> ServerExchange {
        ServerExchange {
            tgid: 1,
            request: Some(parse_request(b"GET / HTTP/1.1\r\n\r\n").unwrap()),
            response: Some(parse_response(b"HTTP/1.1 200 OK\r\n\r\n").unwrap()),
            peer: None,
            local: None,
            client: None,
            start_ns: 10_000_000,
            end_ns: 131_234_567,
            head_end_ns: Some(10_250_000),
            rejected: None,
            client_closed: false,
            outcome: Outcome::Complete,
            tls: None,
            clients: vec![ClientExchange {
                request: parse_request(b"GET / HTTP/1.1\r\n\r\n").unwrap(),
                response: Some(parse_response(b"HTTP/1.1 200 OK\r\n\r\n").unwrap()),
                server: None,
                start_ns: 11_000_000,
                end_ns: 131_000_000,
                connect_ns: Some(10_400_000),
                free_since_ns: None,
                response_start_ns: Some(130_999_999),
                response_head_ns: Some(130_999_999),
                server_closed: false,
                outcome: Outcome::Complete,
                tls: None,
            }],
        }
    }

    #[test]
    fn timers_in_milliseconds_to_the_microsecond() {
        let bump = Bump::new();
        let mut attrs = BumpVec::new_in(&bump);
        push_attributes(&mut attrs, &exchange());
        let got: Vec<_> = attrs.iter().map(|a| (a.key, a.value)).collect();
        assert_eq!(
            got,
            [
                (REQUEST_HEAD, Value::Double(0.25)),
                (QUEUE, Value::Double(0.15)),
                (CONNECT, Value::Double(0.6)),
                (RESPONSE, Value::Double(119.999)),
                (ACTIVE, Value::Double(121.234)),
            ]
        );
    }

    #[test]
    fn no_backend_no_backend_timers_or_events() {
        let mut ex = exchange();
        ex.clients.clear();
        let bump = Bump::new();
        let mut attrs = BumpVec::new_in(&bump);
        push_attributes(&mut attrs, &ex);
        assert_eq!(attrs.iter().map(|a| a.key).collect::<Vec<_>>(), [REQUEST_HEAD, ACTIVE]);
        let names: Vec<_> = events(&ex, &bump, |ns| ns).iter().map(|e| e.name).collect();
        assert_eq!(names, [HEAD_RECEIVED]);
    }

    #[test]
    fn events_in_time_order_made_unix() {
        let bump = Bump::new();
        let got: Vec<_> = events(&exchange(), &bump, |ns| ns + 5).iter().map(|e| (e.name, e.time_unix_ns)).collect();
        assert_eq!(
            got,
            [
                (HEAD_RECEIVED, 10_250_005),
                (BACKEND_CONNECT, 10_400_005),
                (REQUEST_SENT, 11_000_005),
                (RESPONSE_STARTED, 131_000_004)
            ]
        );
    }
}

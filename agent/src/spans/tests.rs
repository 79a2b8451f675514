//! Tests of the span builder: trace context, sampling decisions and the views of spans.

use opentelemetry_proto::tonic::common::v1::any_value;
use opentelemetry_proto::tonic::trace::v1::status;

use super::*;
use tracetap_proxy::Outcome;
use tracetap_proxy::head::{parse_request, parse_response};
use tracetap_proxy::rejected::Rejected;

fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a any_value::Value> {
    span.attributes.iter().find(|kv| kv.key == key).and_then(|kv| kv.value.as_ref()?.value.as_ref())
}

fn exchange(request: &[u8], status: &[u8], outcome: Outcome) -> ServerExchange {
    let req = parse_request(request).unwrap();
    ServerExchange {
        tgid: 42,
        clients: vec![ClientExchange {
            request: req.clone(),
            response: Some(parse_response(status).unwrap()),
            server: Some("127.0.0.1:8080".parse().unwrap()),
            start_ns: 20,
            end_ns: 30,
            connect_ns: None,
            free_since_ns: None,
            response_start_ns: None,
            response_head_ns: None,
            server_closed: false,
            outcome,
            tls: None,
        }],
        request: Some(req),
        response: Some(parse_response(status).unwrap()),
        peer: Some("10.1.2.3:5555".parse().unwrap()),
        local: None,
        client: None,
        start_ns: 10,
        end_ns: 40,
        head_end_ns: None,
        rejected: None,
        client_closed: false,
        outcome,
        tls: None,
    }
}

#[test]
fn incoming_traceparent_is_continued() {
    let ex = exchange(
        b"GET /x?y=1 HTTP/1.1\r\nHost: shop:8443\r\ntraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\ntracestate: a=b\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\n",
        Outcome::Complete,
    );
    let mut b = SpanBuilder::new(Sampler::default(), 1000);
    let mut out = Vec::new();
    assert_eq!(b.build(&ex, None, &mut out), Built::Sampled { spans: 2 });
    let (server, client) = (&out[0].span, &out[1].span);
    assert_eq!(hex(&server.trace_id), "0af7651916cd43dd8448eb211c80319c");
    assert_eq!(hex(&server.parent_span_id), "b7ad6b7169203331");
    assert_eq!(server.trace_state, "a=b", "parent-based: the upstream tracestate is kept");
    assert_eq!(client.trace_state, "a=b");
    assert_eq!(client.trace_id, server.trace_id);
    assert_eq!(client.parent_span_id, server.span_id);
    assert_eq!(server.start_time_unix_nano, 1010);
    assert_eq!(server.kind, span::SpanKind::Server as i32);
    assert_eq!(attr(server, "url.path"), Some(&any_value::Value::StringValue("/x".into())));
    assert_eq!(attr(server, "server.port"), Some(&any_value::Value::IntValue(8443)));
    assert_eq!(attr(server, "client.address"), Some(&any_value::Value::StringValue("10.1.2.3".into())));
    assert_eq!(attr(server, "network.peer.address"), Some(&any_value::Value::StringValue("10.1.2.3".into())));
    assert_eq!(attr(client, "server.port"), Some(&any_value::Value::IntValue(8080)));
    // Behind a load balancer speaking the PROXY protocol.
    let mut proxied = ex.clone();
    proxied.client = Some("192.0.2.7:51234".parse().unwrap());
    out.clear();
    b.build(&proxied, None, &mut out);
    let server = &out[0].span;
    assert_eq!(attr(server, "client.address"), Some(&any_value::Value::StringValue("192.0.2.7".into())));
    assert_eq!(attr(server, "client.port"), Some(&any_value::Value::IntValue(51234)));
    assert_eq!(attr(server, "network.peer.address"), Some(&any_value::Value::StringValue("10.1.2.3".into())));
    assert_eq!(server.status.as_ref().unwrap().code, 0);
}

/// An exchange whose frontend request carried `incoming` (a header line, or "") and whose
/// backend requests (one per attempt) carried `forwarded`.
fn propagated(incoming: &str, forwarded: &[&str]) -> ServerExchange {
    let front = format!("GET /p HTTP/1.1\r\nHost: h\r\n{incoming}\r\n");
    let mut ex = exchange(front.as_bytes(), b"HTTP/1.1 200 OK\r\n\r\n", Outcome::Complete);
    let attempt = ex.clients.pop().unwrap();
    for line in forwarded {
        let back = format!("GET /p HTTP/1.1\r\nHost: h\r\n{line}\r\n");
        ex.clients.push(ClientExchange { request: parse_request(back.as_bytes()).unwrap(), ..attempt.clone() });
    }
    ex
}

const TRACE: &str = "0af7651916cd43dd8448eb211c80319c";

#[test]
fn a_context_haproxy_forwarded_names_the_client_span_and_gives_the_trace() {
    // No incoming traceparent: HAProxy generated the trace id and the CLIENT span's id.
    let fwd = format!("traceparent: 00-{TRACE}-00f067aa0ba902b7-03\r\n");
    let ex = propagated("", &[&fwd]);
    let mut b = SpanBuilder::with_seed(Sampler::default(), 0, 7);
    let mut out = Vec::new();
    assert_eq!(b.build(&ex, None, &mut out), Built::Sampled { spans: 2 });
    let (server, client) = (&out[0].span, &out[1].span);
    assert_eq!(hex(&server.trace_id), TRACE);
    assert_eq!(server.parent_span_id, Vec::<u8>::new(), "a root span");
    assert_eq!(server.flags, SAMPLED | u32::from(FLAG_RANDOM) | HAS_IS_REMOTE);
    assert_eq!(hex(&client.span_id), "00f067aa0ba902b7");
    assert_eq!(client.parent_span_id, server.span_id);
    assert_eq!(client.trace_id, server.trace_id);
    assert_eq!(b.stats(), DecideStats { propagated: 1, disagreements: 0, ambiguous_servers: 0, rejected_dropped: 0 });

    // With an incoming parent in the same trace, the SERVER span stays its child.
    let incoming = format!("traceparent: 00-{TRACE}-b7ad6b7169203331-01\r\n");
    let fwd = format!("traceparent: 00-{TRACE}-00f067aa0ba902b7-01\r\n");
    out.clear();
    b.build(&propagated(&incoming, &[&fwd]), None, &mut out);
    assert_eq!(hex(&out[0].span.parent_span_id), "b7ad6b7169203331");
    assert_eq!(hex(&out[1].span.span_id), "00f067aa0ba902b7");
}

#[test]
fn the_forwarded_sampled_flag_decides_and_a_disagreement_is_counted() {
    // traceidratio 0.5 keeps randomness from 2^55 up: this trace id's low bits are below it.
    let low = "0af7651916cd43dd0000000000000001";
    let half = Sampler::from_vars(Some("parentbased_traceidratio"), Some("0.5")).unwrap();
    let mut b = SpanBuilder::with_seed(half, 0, 7);
    let mut out = Vec::new();
    let unsampled = format!("traceparent: 00-{low}-00f067aa0ba902b7-02\r\n");
    assert_eq!(b.build(&propagated("", &[&unsampled]), None, &mut out), Built::Dropped);
    assert_eq!(b.stats(), DecideStats { propagated: 1, disagreements: 0, ambiguous_servers: 0, rejected_dropped: 0 });
    // Lines made for another ratio said "sampled": HAProxy's flag stands, and it is counted.
    let sampled = format!("traceparent: 00-{low}-00f067aa0ba902b7-03\r\n");
    ex_sampled(&mut b, &sampled);
    assert_eq!(b.stats(), DecideStats { propagated: 2, disagreements: 1, ambiguous_servers: 0, rejected_dropped: 0 });
    // The forwarded context of an unchanged traceparent is no propagation.
    let same = format!("traceparent: 00-{TRACE}-b7ad6b7169203331-01\r\n");
    b.build(&propagated(&same, &[&same]), None, &mut out);
    assert_eq!(b.stats().propagated, 2);
}

fn ex_sampled(b: &mut SpanBuilder, forwarded: &str) {
    let mut out = Vec::new();
    assert_eq!(b.build(&propagated("", &[forwarded]), None, &mut out), Built::Sampled { spans: 2 });
}

#[test]
fn a_retried_request_gives_its_forwarded_id_to_the_last_attempt_only() {
    let fwd = format!("traceparent: 00-{TRACE}-00f067aa0ba902b7-03\r\n");
    let mut b = SpanBuilder::with_seed(Sampler::default(), 0, 7);
    let mut out = Vec::new();
    assert_eq!(b.build(&propagated("", &[&fwd, &fwd]), None, &mut out), Built::Sampled { spans: 3 });
    let ids: Vec<String> = out[1..].iter().map(|r| hex(&r.span.span_id)).collect();
    assert_ne!(ids[0], "00f067aa0ba902b7", "the first attempt gets an id of its own");
    assert_eq!(ids[1], "00f067aa0ba902b7", "the backend that answered continued this one");
    // The tracker may file the failed first attempt after the relayed retry.
    let mut filed_late = propagated("", &[&fwd, &fwd]);
    filed_late.clients[0].start_ns = 25;
    filed_late.clients[1].start_ns = 20;
    out.clear();
    b.build(&filed_late, None, &mut out);
    assert_eq!(hex(&out[1].span.span_id), "00f067aa0ba902b7", "the attempt sent last");
    assert_ne!(hex(&out[2].span.span_id), "00f067aa0ba902b7");
}

#[test]
fn a_local_answer_takes_the_trace_of_the_traceparent_haproxy_put_in_its_response() {
    let mut ex = propagated("", &[]);
    ex.response = Some(
        parse_response(
            format!("HTTP/1.1 403 Forbidden\r\ntraceparent: 00-{TRACE}-00f067aa0ba902b7-03\r\n\r\n").as_bytes(),
        )
        .unwrap(),
    );
    let mut b = SpanBuilder::with_seed(Sampler::default(), 0, 7);
    let mut out = Vec::new();
    assert_eq!(b.build(&ex, None, &mut out), Built::Sampled { spans: 1 });
    assert_eq!(hex(&out[0].span.trace_id), TRACE);
    // A backend's response is never read for it.
    let mut proxied = propagated("", &["x-a: 1\r\n"]);
    proxied.response = ex.response;
    out.clear();
    b.build(&proxied, None, &mut out);
    assert_ne!(hex(&out[0].span.trace_id), TRACE);
}

#[test]
fn sampled_out_parent_builds_nothing() {
    let ex = exchange(
        b"GET / HTTP/1.1\r\ntraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\n",
        Outcome::Complete,
    );
    let mut out = Vec::new();
    assert_eq!(SpanBuilder::new(Sampler::default(), 0).build(&ex, None, &mut out), Built::Dropped);
    assert!(out.is_empty());
}

fn rejected(end_ns: u64) -> ServerExchange {
    let mut ex = exchange(b"GET / HTTP/1.1\r\n\r\n", b"HTTP/1.1 400 Bad request\r\n\r\n", Outcome::Complete);
    ex.request = None;
    ex.clients.clear();
    ex.rejected = Some(Rejected::failed(b"GET /\x01 HTTP/1.1?sig=x", 0));
    ex.end_ns = end_ns;
    ex
}

#[test]
fn a_rejected_request_is_an_error_with_what_the_client_sent() {
    let mut out = Vec::new();
    SpanBuilder::new(Sampler::default(), 0).build(&rejected(1), None, &mut out);
    let span = &out[0].span;
    assert_eq!(span.status.as_ref().unwrap().code, status::StatusCode::Error as i32);
    assert_eq!(attr(span, "error.type"), Some(&any_value::Value::StringValue("400".into())));
    assert_eq!(
        attr(span, REJECTED_PREFIX),
        Some(&any_value::Value::StringValue("GET /\\x01 HTTP/1.1?sig=REDACTED".into()))
    );
    assert_eq!(attr(span, "http.request.method"), Some(&any_value::Value::StringValue("_OTHER".into())));
}

#[test]
fn rejected_requests_are_admitted_within_the_rate_and_the_rest_counted() {
    let mut b = SpanBuilder::new(Sampler::default(), 0).with_rejected_limit(3);
    let admitted = (0..10).filter(|_| b.admit(&rejected(1_000))).count();
    assert_eq!((admitted, b.stats().rejected_dropped), (3, 7));
    let ordinary = exchange(b"GET / HTTP/1.1\r\n\r\n", b"HTTP/1.1 400 Bad request\r\n\r\n", Outcome::Complete);
    assert!(b.admit(&ordinary), "the limit is for rejected requests only");
    assert!(b.admit(&rejected(1_000 + 400_000_000)), "a token back after a third of a second");
    assert!(!SpanBuilder::new(Sampler::default(), 0).with_rejected_limit(0).admit(&rejected(5)));
}

#[test]
fn errors_are_marked() {
    let ex = exchange(b"GET / HTTP/1.1\r\n\r\n", b"HTTP/1.1 503 Service Unavailable\r\n\r\n", Outcome::Complete);
    let mut out = Vec::new();
    SpanBuilder::new(Sampler::default(), 0).build(&ex, None, &mut out);
    assert_eq!(out[0].span.status.as_ref().unwrap().code, status::StatusCode::Error as i32);
    assert_eq!(attr(&out[0].span, "error.type"), Some(&any_value::Value::StringValue("503".into())));
    let ex = exchange(b"GET / HTTP/1.1\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n", Outcome::ClosedBeforeResponse);
    out.clear();
    SpanBuilder::new(Sampler::default(), 0).build(&ex, None, &mut out);
    assert_eq!(
        attr(&out[0].span, "error.type"),
        Some(&any_value::Value::StringValue("connection_closed_before_response".into()))
    );
}

#[test]
fn names_from_the_config() {
    let mut ex = exchange(b"GET / HTTP/1.1\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n", Outcome::Complete);
    ex.local = Some("127.0.0.1:80".parse().unwrap());
    let names = tracetap_proxy::haproxy_config::parse(
        "frontend fe_main\n bind 127.0.0.1:80\nbackend be_app\n server app1 127.0.0.1:8080\n",
    );
    let mut out = Vec::new();
    SpanBuilder::new(Sampler::default(), 0).build(&ex, Some(&names), &mut out);
    assert_eq!(out[0].span.name, "GET fe_main");
    assert_eq!(attr(&out[0].span, "haproxy.frontend"), Some(&any_value::Value::StringValue("fe_main".into())));
    assert_eq!(out[1].span.name, "GET be_app");
    assert_eq!(attr(&out[1].span, "haproxy.server"), Some(&any_value::Value::StringValue("app1".into())));
}

fn str_attr<'a>(span: &'a Span, key: &str) -> Option<&'a str> {
    match attr(span, key)? {
        any_value::Value::StringValue(s) => Some(s),
        _ => None,
    }
}

fn build(ex: &ServerExchange, limit: Option<usize>) -> Vec<SpanRecord> {
    let mut out = Vec::new();
    SpanBuilder::new(Sampler::default(), 0).with_value_length_limit(limit).build(ex, None, &mut out);
    out
}

#[test]
fn credentials_in_the_query_are_redacted_on_both_spans() {
    let ex = exchange(
        b"GET /o?X-Goog-Signature=abc&design=1&sig=s3cret HTTP/1.1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\n",
        Outcome::Complete,
    );
    let out = build(&ex, None);
    let (server, client) = (&out[0].span, &out[1].span);
    assert_eq!(str_attr(server, "url.query"), Some("X-Goog-Signature=REDACTED&design=1&sig=REDACTED"));
    assert_eq!(str_attr(client, "url.query"), str_attr(server, "url.query"));
    assert_eq!(
        str_attr(client, "url.full"),
        Some("http://127.0.0.1:8080/o?X-Goog-Signature=REDACTED&design=1&sig=REDACTED")
    );
    let exported = format!("{out:?}");
    assert!(!exported.contains("s3cret") && !exported.contains("abc"), "{exported}");
}

#[test]
fn url_full_of_an_absolute_form_target_has_no_userinfo() {
    let mut ex = exchange(
        b"GET http://bob:hunter2@[2001:db8::7]:8443/a/b?Signature=x&q=1 HTTP/1.1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\n",
        Outcome::Complete,
    );
    ex.clients[0].server = Some("[2001:db8::7]:8443".parse().unwrap());
    let out = build(&ex, None);
    let (server, client) = (&out[0].span, &out[1].span);
    assert_eq!(
        str_attr(client, "url.full"),
        Some("http://REDACTED:REDACTED@[2001:db8::7]:8443/a/b?Signature=REDACTED&q=1")
    );
    assert_eq!(str_attr(client, "server.address"), Some("2001:db8::7"));
    assert_eq!(str_attr(server, "url.path"), Some("/a/b"));
    assert_eq!(str_attr(server, "url.query"), Some("Signature=REDACTED&q=1"));
    assert!(!format!("{out:?}").contains("hunter2"));
}

#[test]
fn url_full_without_query_and_with_an_ipv6_server() {
    let mut ex = exchange(b"GET /plain HTTP/1.1\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n", Outcome::Complete);
    ex.clients[0].server = Some("[::1]:9000".parse().unwrap());
    let out = build(&ex, None);
    assert_eq!(str_attr(&out[1].span, "url.full"), Some("http://[::1]:9000/plain"));
    assert_eq!(attr(&out[0].span, "url.query"), None);
    let mut ex = exchange(b"GET http://h:81 HTTP/1.1\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n", Outcome::Complete);
    ex.clients[0].server = None;
    let out = build(&ex, None);
    assert_eq!(str_attr(&out[1].span, "url.full"), Some("http://h:81"), "the target names the host itself");
    assert_eq!(str_attr(&out[1].span, "url.path"), Some("/"));
}

#[test]
fn string_values_are_cut_to_the_limit_in_characters() {
    let mut request = b"GET /\xc3\xa9t\xc3\xa9?q=\xe6\x97\xa5\xe6\x9c\xac HTTP/1.1\r\nUser-Agent: ".to_vec();
    request.extend_from_slice("agent-日本語-long".as_bytes());
    request.extend_from_slice(b"\r\n\r\n");
    let ex = exchange(&request, b"HTTP/1.1 503 Service Unavailable\r\n\r\n", Outcome::Complete);
    let out = build(&ex, Some(3));
    let server = &out[0].span;
    assert_eq!(str_attr(server, "url.path"), Some("/ét"), "é is one character of two bytes");
    assert_eq!(str_attr(server, "url.query"), Some("q=日"));
    assert_eq!(str_attr(server, "user_agent.original"), Some("age"));
    assert_eq!(str_attr(server, "error.type"), Some("503"));
    assert_eq!(attr(server, "http.response.status_code"), Some(&any_value::Value::IntValue(503)), "ints are not cut");
    assert_eq!(server.name, "GET", "names are not attributes");
    assert_eq!(str_attr(&out[1].span, "url.full"), Some("htt"));
    let unlimited = build(&ex, None);
    assert_eq!(str_attr(&unlimited[0].span, "user_agent.original"), Some("agent-日本語-long"));
}

#[test]
fn new_ids_are_not_zero() {
    let mut rng = fastrand::Rng::with_seed(7);
    assert_ne!(new_trace_id(&mut rng), [0; 16]);
    assert_ne!(new_span_id(&mut rng), [0; 8]);
}

#[test]
fn host_splitting() {
    assert_eq!(split_host("a:1"), ("a", Some(1)));
    assert_eq!(split_host("a"), ("a", None));
    assert_eq!(split_host("[::1]:8080"), ("::1", Some(8080)));
    assert_eq!(split_host("::1"), ("::1", None));
}

fn hex(b: &[u8]) -> String {
    b.iter().fold(String::new(), |mut s, x| {
        let _ = std::fmt::Write::write_fmt(&mut s, format_args!("{x:02x}"));
        s
    })
}

proptest::proptest! {
    /// The arena's IPv4 text is `Ipv4Addr`'s `Display`, for every address.
    #[test]
    fn ipv4_text_is_the_standard_one(octets in proptest::array::uniform4(proptest::num::u8::ANY), port in 0u16..) {
        let bump = Bump::new();
        let addr = SocketAddr::from((octets, port));
        proptest::prop_assert_eq!(ip_in(&bump, addr), addr.ip().to_string());
    }
}

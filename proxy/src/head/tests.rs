//! Tests of head parsing (HTTP/1 bytes and HTTP/2 fields) and of the header fingerprint.

/// The headers a proxy rewrites on the way, as `Name::is_unstable` documents them.
const UNSTABLE_HEADERS: [&[u8]; 15] = [
    b"connection",
    b"transfer-encoding",
    b"keep-alive",
    b"proxy-connection",
    b"te",
    b"upgrade",
    b"forwarded",
    b"via",
    b"x-forwarded-for",
    b"x-forwarded-proto",
    b"x-forwarded-host",
    b"x-forwarded-port",
    b"x-real-ip",
    b"traceparent",
    b"tracestate",
];

/// Every name `classify` knows, with what it must say of it; any other name is `Name::Other`.
const KNOWN_NAMES: [(&[u8], Name); 18] = [
    (b"host", Name::Host),
    (b"user-agent", Name::UserAgent),
    (b"content-length", Name::ContentLength),
    (b"traceparent", Name::Traceparent),
    (b"tracestate", Name::Tracestate),
    (b"upgrade", Name::Upgrade),
    (b"transfer-encoding", Name::TransferEncoding),
    (b"connection", Name::Connection),
    (b"keep-alive", Name::OtherUnstable),
    (b"proxy-connection", Name::OtherUnstable),
    (b"te", Name::OtherUnstable),
    (b"forwarded", Name::OtherUnstable),
    (b"via", Name::OtherUnstable),
    (b"x-forwarded-for", Name::OtherUnstable),
    (b"x-forwarded-proto", Name::OtherUnstable),
    (b"x-forwarded-host", Name::OtherUnstable),
    (b"x-forwarded-port", Name::OtherUnstable),
    (b"x-real-ip", Name::OtherUnstable),
];

/// What `classify` must say of `name`: a plain lookup in [`KNOWN_NAMES`].
fn reference_class(name: &[u8]) -> Name {
    KNOWN_NAMES.iter().find(|(known, _)| known.eq_ignore_ascii_case(name)).map_or(Name::Other, |(_, kind)| *kind)
}

#[test]
fn every_unstable_name_is_found_in_any_case_and_the_usual_others_are_not() {
    for name in UNSTABLE_HEADERS {
        assert!(classify(name).is_unstable() && classify(&name.to_ascii_uppercase()).is_unstable(), "{name:?}");
    }
    for name in [&b"host"[..], b"user-agent", b"accept-encoding", b"content-length", b"x-request-id", b"", &[b'x'; 40]]
    {
        assert!(!classify(name).is_unstable(), "{name:?}");
    }
    // The known names that are unstable are exactly the list.
    let unstable: Vec<_> = KNOWN_NAMES.iter().filter(|(_, kind)| kind.is_unstable()).map(|(n, _)| *n).collect();
    assert_eq!(unstable.len(), UNSTABLE_HEADERS.len());
    assert!(UNSTABLE_HEADERS.iter().all(|u| unstable.contains(u)));
}

/// Each known name, in lower and upper case, gets its own kind.
#[test]
fn classify_gives_each_known_name_its_kind() {
    for (name, kind) in KNOWN_NAMES {
        assert_eq!(classify(name), kind, "{name:?}");
        assert_eq!(classify(&name.to_ascii_uppercase()), kind, "{name:?}");
    }
    for name in [&b"hosts"[..], b"host ", b"content-lengths", b"x-traceparent", b"connectio", b"accept", b"set-cookie"]
    {
        assert_eq!(classify(name), Name::Other, "{name:?}");
    }
}

proptest::proptest! {
    /// Names near the known ones (one byte changed or cut, any case) and random ones get what a
    /// plain lookup in `KNOWN_NAMES` gives.
    #[test]
    fn classify_agrees_with_a_lookup_of_the_known_names(
        pick in 0..KNOWN_NAMES.len(),
        edit in proptest::option::of((0usize..20, proptest::prelude::any::<u8>())),
        cut in proptest::prelude::any::<bool>(),
        upper in proptest::collection::vec(proptest::prelude::any::<bool>(), 20),
        random in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..20),
        use_random in proptest::prelude::any::<bool>(),
    ) {
        let mut name = if use_random { random } else { KNOWN_NAMES[pick].0.to_vec() };
        if let Some((at, byte)) = edit.filter(|(at, _)| *at < name.len()) {
            name[at] = byte;
        }
        if cut {
            name.pop();
        }
        for (b, up) in name.iter_mut().zip(&upper) {
            if *up {
                b.make_ascii_uppercase();
            }
        }
        proptest::prop_assert_eq!(classify(&name), reference_class(&name));
    }
}

proptest::proptest! {
    /// The word-at-a-time tail read is the zero-padded little-endian word it replaced.
    #[test]
    fn hash_words_reads_the_tail_as_a_zero_padded_word(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40), fold: bool) {
        let fold = if fold { 0x2020_2020_2020_2020 } else { 0 };
        let reference = {
            const K: u64 = 0x517c_c1b7_2722_0a95;
            let step = |h: u64, w: u64| (h.rotate_left(5) ^ w).wrapping_mul(K);
            let mut h = 7;
            for c in bytes.chunks(8) {
                let mut word = [0u8; 8];
                word[..c.len()].copy_from_slice(c);
                let present = u64::MAX >> (8 * (8 - c.len()));
                h = step(h, u64::from_le_bytes(word) | (fold & present));
            }
            step(h, bytes.len() as u64)
        };
        proptest::prop_assert_eq!(hash_words(7, &bytes, fold), reference);
    }
}

use super::*;

#[test]
fn request_fields() {
    let head = parse_request(
        b"POST /a/b?x=1 HTTP/1.1\r\nHost: example.com:8080\r\nUser-Agent: curl/8\r\n\
          traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n\
          Authorization: secret\r\nContent-Length: 5\r\n\r\n",
    )
    .unwrap();
    assert_eq!(head.method, "POST");
    assert_eq!(head.path(), "/a/b");
    assert_eq!(head.query(), Some("x=1"));
    assert_eq!(head.host.as_deref(), Some("example.com:8080"));
    assert_eq!(head.user_agent.as_deref(), Some("curl/8"));
    assert!(matches!(head.traceparent, TraceparentField::One(ref v) if v.starts_with("00-0af7")));
    assert_eq!(head.framing, BodyFraming::Length(5));
    assert!(!head.closes);
    assert!(!format!("{head:?}").contains("secret"), "sensitive headers must not be kept");
}

#[test]
fn recycled_head_is_overwritten_completely() {
    let mut head = parse_request(
        b"POST /a HTTP/1.0\r\nHost: h\r\nUser-Agent: u\r\ntraceparent: t\r\ntracestate: a=1\r\ntracestate: b=2\r\nContent-Length: 3\r\n\r\n",
    )
    .unwrap();
    assert_eq!(head.tracestate.as_deref(), Some("a=1,b=2"));
    parse_request_into(b"GET /b HTTP/1.1\r\n\r\n", &mut head).unwrap();
    assert_eq!(head, parse_request(b"GET /b HTTP/1.1\r\n\r\n").unwrap());
}

#[test]
fn repeated_traceparent_is_marked() {
    let head = parse_request(b"GET / HTTP/1.1\r\ntraceparent: a\r\nTraceparent: b\r\n\r\n").unwrap();
    assert_eq!(head.traceparent, TraceparentField::Repeated);
}

/// The parsed `traceparent` is there for exactly one valid line, and a recycled head with one
/// does not keep it.
#[test]
fn the_traceparent_is_parsed_once_with_the_head() {
    const VALID: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let one = parse_request(format!("GET / HTTP/1.1\r\ntraceparent: {VALID}\r\n\r\n").as_bytes()).unwrap();
    assert_eq!(one.parsed_traceparent, parse_traceparent(VALID));
    assert!(one.parsed_traceparent.is_some());
    for other in [
        format!("GET / HTTP/1.1\r\ntraceparent: {VALID}\r\ntraceparent: {VALID}\r\n\r\n"),
        "GET / HTTP/1.1\r\ntraceparent: 00-zz\r\n\r\n".to_owned(),
        "GET / HTTP/1.1\r\n\r\n".to_owned(),
    ] {
        let mut recycled = one.clone();
        parse_request_into(other.as_bytes(), &mut recycled).unwrap();
        assert_eq!(recycled.parsed_traceparent, None, "{other:?}");
    }
}

#[test]
fn http10_closes_by_default() {
    assert!(parse_request(b"GET / HTTP/1.0\r\n\r\n").unwrap().closes);
    assert!(!parse_request(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n").unwrap().closes);
}

#[test]
fn response_framing_rules() {
    let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n").unwrap();
    assert_eq!(r.framing("GET"), BodyFraming::Length(3));
    assert_eq!(r.framing("HEAD"), BodyFraming::Empty);
    let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n").unwrap();
    assert_eq!(r.framing("GET"), BodyFraming::Empty, "an empty body ends the message at the head");
    let r = parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n").unwrap();
    assert_eq!(r.framing("GET"), BodyFraming::Chunked);
    let r = parse_response(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n").unwrap();
    assert_eq!(r.framing("GET"), BodyFraming::Tunnel);
    let r = parse_response(b"HTTP/1.1 100 Continue\r\n\r\n").unwrap();
    assert!(r.is_interim());
    let r = parse_response(b"HTTP/1.0 200 OK\r\n\r\n").unwrap();
    assert_eq!(r.framing("GET"), BodyFraming::UntilClose);
    assert_eq!(parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n"), Err(HeadError::BadContentLength));
}

#[test]
fn header_signature_survives_case_and_forwarding_headers() {
    let front = parse_request(
        b"GET /a HTTP/1.1\r\nHost: h\r\nUser-Agent: u\r\nAccept: */*\r\nX-Id: 7\r\nConnection: keep-alive\r\n\r\n",
    )
    .unwrap();
    let back = parse_request(
        b"GET /v2/a HTTP/1.1\r\nhost: h\r\nuser-agent: u\r\naccept: */*\r\nx-id: 7\r\nx-forwarded-for: 1.2.3.4\r\nx-added: 1\r\n\r\n",
    )
    .unwrap();
    assert_eq!(
        (front.header_sig & back.header_sig).count_ones(),
        front.header_sig.count_ones(),
        "every client line kept"
    );
    assert!(shares_headers(front.header_sig, back.header_sig));
    // A client that sends only Host, and a proxy that rewrites Host and adds three headers.
    let bare = parse_request(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n").unwrap();
    assert!(!shares_headers(bare.header_sig, 0), "a bare request shares nothing with one with headers");
    let added = parse_request(b"GET /x HTTP/1.1\r\nHost: a\r\nX-Request-ID: 1\r\nX-A: 1\r\n\r\n").unwrap();
    assert!(shares_headers(bare.header_sig, added.header_sig));
    let check = parse_request(b"OPTIONS / HTTP/1.0\r\n\r\n").unwrap();
    assert_eq!(check.header_sig, 0);
    assert!(shares_headers(0, 0), "two requests without headers are alike");
}

#[test]
fn header_lines_that_differ_in_their_last_byte_get_different_bits() {
    let sig =
        |v: u16| parse_request(format!("GET / HTTP/1.1\r\nx-want-status: {v}\r\n\r\n").as_bytes()).unwrap().header_sig;
    let distinct: std::collections::HashSet<u64> = (200..264).map(sig).collect();
    // 64 values over 64 bits: a good hash leaves about 40 distinct; a blind one leaves 1.
    assert!(distinct.len() > 30, "only {} distinct bits", distinct.len());
}

fn fields<'a>(list: &'a [(&'a str, &'a str)]) -> impl Iterator<Item = (&'a [u8], &'a [u8])> {
    list.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes()))
}

#[test]
fn an_h2_request_signs_like_the_http1_request_haproxy_writes_for_it() {
    let mut h2 = RequestHead::default();
    request_from_fields(
        fields(&[
            (":method", "GET"),
            (":scheme", "https"),
            (":authority", "example.com"),
            (":path", "/a?b=1"),
            ("user-agent", "curl/8"),
            ("cookie", "a=1"),
            ("cookie", "b=2"),
            ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            ("te", "trailers"),
        ]),
        &mut h2,
    )
    .unwrap();
    let h1 = parse_request(
        b"GET /a?b=1 HTTP/1.1\r\nuser-agent: curl/8\r\ncookie: a=1; b=2\r\n\
          traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\nhost: example.com\r\n\
          x-forwarded-for: 10.0.0.1\r\nconnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(h2.header_sig, h1.header_sig);
    assert_eq!((h2.method.as_str(), h2.target.as_str()), ("GET", "/a?b=1"));
    assert_eq!(h2.host.as_deref(), Some("example.com"));
    assert_eq!(h2.traceparent, h1.traceparent);
    assert_eq!((h2.version, h1.version), (HttpVersion::Http2, HttpVersion::Http11));
    assert_eq!(h2.version.as_str(), "2");
    // CONNECT targets the authority; a missing :method or :path is no head.
    let mut connect = RequestHead::default();
    request_from_fields(fields(&[(":method", "CONNECT"), (":authority", "db:5432")]), &mut connect).unwrap();
    assert_eq!((connect.target.as_str(), connect.wants_tunnel), ("db:5432", true));
    assert!(request_from_fields(fields(&[(":path", "/")]), &mut RequestHead::default()).is_err());
    assert!(request_from_fields(fields(&[(":method", "GET")]), &mut RequestHead::default()).is_err());
}

#[test]
fn a_recycled_head_builds_an_h2_request_like_a_new_one() {
    let mut head = parse_request(b"POST /x HTTP/1.0\r\nHost: h\r\ntracestate: a=1\r\nUser-Agent: u\r\n\r\n").unwrap();
    let list = [(":method", "GET"), (":path", "/y")];
    request_from_fields(fields(&list), &mut head).unwrap();
    let mut fresh = RequestHead::default();
    request_from_fields(fields(&list), &mut fresh).unwrap();
    assert_eq!(head, fresh);
}

#[test]
fn an_http1_response_relayed_to_an_h2_client_keeps_its_digest() {
    let h1 = parse_response(
        b"HTTP/1.1 200 OK\r\nDate: Mon, 1 Jan 2024 00:00:00 GMT\r\nContent-Type: text/plain\r\n\
          Transfer-Encoding: chunked\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\nETag: \"a\"\r\n\r\n",
    )
    .unwrap();
    let relayed = [
        (":status", "200"),
        ("date", "Mon, 1 Jan 2024 00:00:00 GMT"),
        ("content-type", "text/plain"),
        ("etag", "\"a\""),
    ];
    let h2 = response_from_fields(fields(&relayed)).unwrap();
    assert_eq!(h2.status, 200);
    assert_eq!(h2.header_digest, h1.header_digest);
    assert_eq!(h2.header_sig, h1.header_sig);
    assert_eq!(h2.version, HttpVersion::Http2);
    // And back: an h2 response relayed to an HTTP/1 client, which gets a chunked body.
    let back = parse_response(
        b"HTTP/1.1 200 OK\r\ndate: Mon, 1 Jan 2024 00:00:00 GMT\r\ncontent-type: text/plain\r\n\
          etag: \"a\"\r\ntransfer-encoding: chunked\r\n\r\n",
    )
    .unwrap();
    assert_eq!(back.header_digest, h2.header_digest);
    let other = response_from_fields(fields(&[(":status", "200"), ("etag", "\"b\"")])).unwrap();
    assert_ne!(other.header_digest, h2.header_digest);
    assert!(response_from_fields(fields(&[("etag", "x")])).is_err(), ":status is required");
    assert!(response_from_fields(fields(&[(":status", "2000")])).is_err());
}

#[test]
fn absolute_form_path() {
    let head = parse_request(b"GET http://h/x/y?q HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(head.path(), "/x/y");
}

/// Header lines a head may carry, in any order and case: framing, trace context, rewritten and
/// plain ones.
const LINES: [&str; 10] = [
    "Host: example.com",
    "User-Agent: load/1",
    "traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
    "tracestate: ot=rv:00000000000001",
    "Content-Length: 12",
    "Transfer-Encoding: chunked",
    "Connection: close",
    "X-Forwarded-For: 10.0.0.1",
    "Cookie: a=1",
    "Accept: */*",
];

/// A head of the given lines, each upper-cased or not.
fn head_of(start: &str, picks: &[(usize, bool)]) -> Vec<u8> {
    let mut head = format!("{start}\r\n");
    for &(i, upper) in picks {
        let line = LINES[i % LINES.len()];
        head.push_str(&if upper { line.to_ascii_uppercase() } else { line.to_owned() });
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    head.into_bytes()
}

proptest::proptest! {
    /// A request dropped at its head parses to the same head as a kept one but for its unsigned
    /// lines, and the caller decides on a head whose other fields are final.
    #[test]
    fn a_request_dropped_at_its_head_differs_only_by_its_signature(
        picks in proptest::collection::vec((0usize..10, proptest::prelude::any::<bool>()), 0..12),
        method in proptest::sample::select(vec!["GET", "POST", "HEAD"]),
    ) {
        let bytes = head_of(&format!("{method} /p?q=1 HTTP/1.1"), &picks);
        let mut kept = RequestHead::default();
        let full = parse_request_into(&bytes, &mut kept);
        let mut dropped = RequestHead::default();
        let mut seen = None;
        let said = parse_request_unless(&bytes, &mut dropped, |head| {
            seen = Some(head.clone());
            true
        });
        proptest::prop_assert_eq!(full.is_ok(), said.is_ok());
        if full.is_ok() {
            proptest::prop_assert_eq!(said, Ok(true));
            proptest::prop_assert_eq!(dropped.header_sig, 0);
            let unsigned = RequestHead { header_sig: 0, ..kept.clone() };
            proptest::prop_assert_eq!(&dropped, &unsigned);
            proptest::prop_assert_eq!(seen.as_ref(), Some(&unsigned), "decided on the final fields");
        }
    }

    /// The answer to a request dropped at its head frames as a full parse says.
    #[test]
    fn a_framing_only_response_parse_frames_as_a_full_one(
        picks in proptest::collection::vec((0usize..10, proptest::prelude::any::<bool>()), 0..12),
        status in proptest::sample::select(vec![100u16, 101, 200, 204, 304, 404]),
        minor in 0u8..2,
    ) {
        let bytes = head_of(&format!("HTTP/1.{minor} {status} X"), &picks);
        let (full, framing) = (parse_response(&bytes), parse_response_framing(&bytes));
        proptest::prop_assert_eq!(full.is_ok(), framing.is_ok());
        if let (Ok(full), Ok(framing)) = (full, framing) {
            let unsigned = ResponseHead { header_sig: 0, header_digest: 0, traceparent: None, ..full };
            proptest::prop_assert_eq!(framing, unsigned);
            for method in ["GET", "HEAD", "CONNECT"] {
                proptest::prop_assert_eq!(framing.framing(method), full.framing(method));
            }
        }
    }
}

proptest::proptest! {
    /// An HTTP/1 head, signed last (`parse_request_unless`), signs like the HTTP/2 fields of the
    /// same lines, signed as they are read (`RequestLines::line`), in any order and case.
    #[test]
    fn an_http1_head_signed_last_signs_like_the_same_lines_as_http2_fields(
        lines in proptest::prelude::Strategy::prop_shuffle(
            proptest::sample::subsequence((0..LINES.len()).collect::<Vec<_>>(), 0..=LINES.len()),
        ),
        upper: bool,
    ) {
        let picks: Vec<(usize, bool)> = lines.iter().map(|&i| (i, upper)).collect();
        let mut h1 = RequestHead::default();
        let said = parse_request_unless(&head_of("GET /p HTTP/1.1", &picks), &mut h1, |_| false);
        proptest::prop_assert_eq!(said, Ok(false));
        let split: Vec<(String, String)> = lines
            .iter()
            .map(|&i| {
                let line = if upper { LINES[i].to_ascii_uppercase() } else { LINES[i].to_owned() };
                let (name, value) = line.split_once(": ").expect("a header line");
                (name.to_ascii_lowercase(), value.to_owned())
            })
            .collect();
        let pseudo = [(":method", "GET"), (":scheme", "http"), (":path", "/p")];
        let all = pseudo
            .iter()
            .map(|(n, v)| (n.as_bytes(), v.as_bytes()))
            .chain(split.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())));
        let mut h2 = RequestHead::default();
        request_from_fields(all, &mut h2).expect("fields");
        proptest::prop_assert_eq!(h1.header_sig, h2.header_sig);
    }
}

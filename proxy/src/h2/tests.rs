use proptest::prelude::*;

use super::*;
use crate::head::HttpVersion;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.push(kind);
    f.push(flags);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

fn block(encoder: &mut loona_hpack::Encoder<'_>, fields: &[(&str, &str)]) -> Vec<u8> {
    encoder.encode(fields.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())))
}

/// Feeds whole chunks; returns the events and the error, if any.
fn run(decoder: &mut Decoder, chunks: &[Chunk<'_>]) -> (Vec<Event>, Option<H2Error>) {
    let (mut events, mut heads, mut error) = (Vec::new(), Vec::new(), None);
    for chunk in chunks {
        if let Err(e) = decoder.feed(*chunk, &mut events, &mut heads) {
            assert!(error.is_none(), "an error is reported once");
            error = Some(e);
        }
    }
    (events, error)
}

const GET: [(&str, &str); 5] =
    [(":method", "GET"), (":scheme", "https"), (":path", "/a?x=1"), (":authority", "example.com"), ("user-agent", "u")];

#[test]
fn request_after_the_preface() {
    let mut enc = loona_hpack::Encoder::new();
    let mut bytes = PREFACE.to_vec();
    bytes.extend(frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100]));
    bytes.extend(frame(HEADERS, END_HEADERS | END_STREAM, 1, &block(&mut enc, &GET)));
    let (events, error) = run(&mut Decoder::new(Sender::Client), &[Chunk::complete(&bytes)]);
    assert_eq!(error, None);
    let [Event::Request { stream: 1, head, end_stream: true }] = &events[..] else { panic!("{events:?}") };
    assert_eq!((head.method.as_str(), head.path(), head.query()), ("GET", "/a", Some("x=1")));
    assert_eq!(head.host.as_deref(), Some("example.com"));
    assert_eq!(head.user_agent.as_deref(), Some("u"));
    assert_eq!(head.version, HttpVersion::Http2);
}

#[test]
fn padding_priority_and_continuation() {
    let mut enc = loona_hpack::Encoder::new();
    let b = block(&mut enc, &GET);
    let (first, rest) = b.split_at(5);
    let mut payload = vec![3]; // pad length
    payload.extend([0x80, 0, 0, 3, 15]); // priority: exclusive dependency on 3, weight 15
    payload.extend(first);
    payload.extend([0; 3]);
    let mut bytes = PREFACE.to_vec();
    bytes.extend(frame(HEADERS, PADDED | PRIORITY, 5, &payload));
    bytes.extend(frame(CONTINUATION, 0, 5, &rest[..2]));
    bytes.extend(frame(CONTINUATION, END_HEADERS, 5, &rest[2..]));
    // A padded DATA frame ending the request.
    bytes.extend(frame(DATA, PADDED | END_STREAM, 5, &[2, b'h', b'i', 0, 0]));
    let (events, error) = run(&mut Decoder::new(Sender::Client), &[Chunk::complete(&bytes)]);
    assert_eq!(error, None);
    assert!(matches!(
        &events[..],
        [Event::Request { stream: 5, end_stream: false, .. }, Event::StreamEnd { stream: 5 }]
    ));
}

#[test]
fn responses_resets_and_goaway() {
    let mut enc = loona_hpack::Encoder::new();
    let mut bytes = frame(0x4, 0, 0, &[]);
    bytes.extend(frame(HEADERS, END_HEADERS, 1, &block(&mut enc, &[(":status", "103"), ("link", "</s>")])));
    bytes.extend(frame(HEADERS, END_HEADERS, 1, &block(&mut enc, &[(":status", "200"), ("etag", "\"a\"")])));
    bytes.extend(frame(DATA, 0, 1, b"body"));
    bytes.extend(frame(HEADERS, END_HEADERS | END_STREAM, 1, &block(&mut enc, &[("grpc-status", "0")])));
    bytes.extend(frame(RST_STREAM, 0, 3, &8u32.to_be_bytes()));
    bytes.extend(frame(GOAWAY, 0, 0, &[0, 0, 0, 5, 0, 0, 0, 2, b'd', b'b', b'g']));
    let (events, error) = run(&mut Decoder::new(Sender::Server), &[Chunk::complete(&bytes)]);
    assert_eq!(error, None);
    let statuses: Vec<u16> = events
        .iter()
        .filter_map(|e| if let Event::Response { head, .. } = e { Some(head.status) } else { None })
        .collect();
    assert_eq!(statuses, [103, 200]);
    assert_eq!(
        events[2..],
        [Event::Trailers { stream: 1 }, Event::Reset { stream: 3, code: 8 }, Event::GoAway { last_stream: 5, code: 2 }]
    );
}

#[test]
fn uncaptured_data_is_skipped_and_the_tail_shows_the_last_frame() {
    let mut enc = loona_hpack::Encoder::new();
    let mut bytes = frame(HEADERS, END_HEADERS, 1, &block(&mut enc, &[(":status", "200")]));
    bytes.extend(frame(DATA, 0, 1, &[7; 5000]));
    bytes.extend(frame(DATA, END_STREAM, 1, b"end"));
    let tail_len = 16;
    let chunk = Chunk { known: &bytes[..100], total: bytes.len() as u64, tail: &bytes[bytes.len() - tail_len..] };
    let (events, error) = run(&mut Decoder::new(Sender::Server), &[chunk]);
    assert_eq!(error, None);
    assert!(matches!(&events[..], [Event::Response { .. }, Event::StreamEnd { stream: 1 }]), "{events:?}");
}

#[test]
fn an_uncaptured_header_block_desyncs_for_good() {
    let mut enc = loona_hpack::Encoder::new();
    let mut bytes = frame(DATA, 0, 1, &[0; 100]);
    let headers = frame(HEADERS, END_HEADERS, 3, &block(&mut enc, &[(":status", "200"), ("x-long", &"v".repeat(50))]));
    bytes.extend(&headers);
    let cut = Chunk { known: &bytes[..120], total: bytes.len() as u64, tail: &[] };
    let next = frame(DATA, END_STREAM, 3, b"");
    let mut decoder = Decoder::new(Sender::Server);
    let (events, error) = run(&mut decoder, &[cut, Chunk::complete(&next)]);
    assert_eq!(error, Some(H2Error::Uncaptured));
    assert!(events.is_empty(), "nothing after the loss: {events:?}");
    assert!(decoder.is_desynced());
}

#[test]
fn bad_preface_and_broken_continuation_are_errors() {
    let (_, error) = run(&mut Decoder::new(Sender::Client), &[Chunk::complete(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n")]);
    assert_eq!(error, Some(H2Error::BadPreface));
    let mut bytes = frame(HEADERS, 0, 1, &[0x82]);
    bytes.extend(frame(DATA, 0, 1, b""));
    let (_, error) = run(&mut Decoder::new(Sender::Server), &[Chunk::complete(&bytes)]);
    assert!(matches!(error, Some(H2Error::Protocol(_))));
}

#[test]
fn hpack_errors_and_oversized_tables_desync() {
    // A dynamic table size update to 1 MiB (above MAX_TABLE_SIZE), then an indexed field.
    let mut update = vec![0x3f];
    let mut n = (1usize << 20) - 31;
    while n >= 128 {
        update.push((n % 128) as u8 | 0x80);
        n /= 128;
    }
    update.push(n as u8);
    update.push(0x88);
    let (_, error) =
        run(&mut Decoder::new(Sender::Server), &[Chunk::complete(&frame(HEADERS, END_HEADERS, 1, &update))]);
    assert!(matches!(error, Some(H2Error::Hpack(_))), "{error:?}");
    // An index past the tables.
    let (_, error) =
        run(&mut Decoder::new(Sender::Server), &[Chunk::complete(&frame(HEADERS, END_HEADERS, 1, &[0xff, 0x20]))]);
    assert!(matches!(error, Some(H2Error::Hpack(_))), "{error:?}");
}

#[test]
fn a_block_that_expands_too_far_is_malformed_but_the_state_is_kept() {
    let mut enc = loona_hpack::Encoder::new();
    let big = "b".repeat(3000);
    let mut first = block(&mut enc, &[(":status", "200"), ("x-big", &big)]);
    // The same (now indexed) field a hundred times: one byte each, 3 KB each decoded.
    let again = block(&mut enc, &[("x-big", &big)]);
    assert_eq!(again.len(), 1);
    first.extend(std::iter::repeat_n(again[0], 100));
    let mut bytes = frame(HEADERS, END_HEADERS | END_STREAM, 1, &first);
    bytes.extend(frame(HEADERS, END_HEADERS, 3, &block(&mut enc, &[(":status", "204"), ("x-big", &big)])));
    let (events, error) = run(&mut Decoder::new(Sender::Server), &[Chunk::complete(&bytes)]);
    assert_eq!(error, None);
    assert!(matches!(events[0], Event::Malformed { stream: 1, end_stream: true }));
    assert!(matches!(&events[1], Event::Response { stream: 3, head, .. } if head.status == 204));
}

#[test]
fn settings_detection() {
    assert!(starts_with_settings(&frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100])));
    assert!(!starts_with_settings(&frame(0x4, 0, 1, &[])));
    assert!(!starts_with_settings(b"HTTP/1.1 200 OK\r\n"));
}

/// One frame (or header block) of a generated direction.
#[derive(Clone, Debug)]
enum Item {
    Head { stream: u32, fields: Vec<(String, String)>, end_stream: bool, pad: Option<u8>, priority: bool, split: usize },
    Data { stream: u32, len: usize, pad: Option<u8>, end_stream: bool },
    Reset { stream: u32, code: u32 },
    GoAway { last_stream: u32, code: u32 },
    Skipped { kind: u8, len: usize },
}

fn fields(sender: Sender) -> impl Strategy<Value = Vec<(String, String)>> {
    let pseudo: BoxedStrategy<Vec<(String, String)>> = match sender {
        Sender::Client => (prop::sample::select(vec!["GET", "POST", "HEAD"]), "/[a-z]{0,8}", "[a-z]{1,6}")
            .prop_map(|(m, p, a)| {
                vec![
                    (":method".into(), m.into()),
                    (":scheme".into(), "https".into()),
                    (":path".into(), p),
                    (":authority".into(), a),
                ]
            })
            .boxed(),
        Sender::Server => prop::sample::select(vec!["100", "200", "404", "503"])
            .prop_map(|s| vec![(":status".to_string(), s.to_string())])
            .boxed(),
    };
    let names =
        prop::sample::select(vec!["user-agent", "accept", "cookie", "x-id", "traceparent", "tracestate", "etag"]);
    (any::<bool>(), pseudo, prop::collection::vec((names, "[a-z0-9=;]{0,12}"), 0..6)).prop_map(
        |(trailers, mut p, rest)| {
            if trailers {
                p.clear();
            }
            p.extend(rest.into_iter().map(|(n, v)| (n.to_string(), v)));
            p
        },
    )
}

fn items(sender: Sender) -> impl Strategy<Value = Vec<Item>> {
    let stream = prop::sample::select(vec![1u32, 3, 5, 7]);
    let item = prop_oneof![
        4 => (stream.clone(), fields(sender), any::<bool>(), prop::option::of(0u8..20), any::<bool>(), 0usize..40)
            .prop_map(|(stream, fields, end_stream, pad, priority, split)| Item::Head { stream, fields, end_stream, pad, priority, split }),
        3 => (stream.clone(), 0usize..300, prop::option::of(0u8..20), any::<bool>())
            .prop_map(|(stream, len, pad, end_stream)| Item::Data { stream, len, pad, end_stream }),
        1 => (stream, 0u32..20).prop_map(|(stream, code)| Item::Reset { stream, code }),
        1 => (0u32..9, 0u32..20).prop_map(|(last_stream, code)| Item::GoAway { last_stream, code }),
        1 => (prop::sample::select(vec![0x2u8, 0x4, 0x6, 0x8, 0xa, 0xfe]), 0usize..40)
            .prop_map(|(kind, len)| Item::Skipped { kind, len }),
    ];
    prop::collection::vec(item, 0..12)
}

/// The bytes of a direction, and the events a decoder must report for them.
fn encode(sender: Sender, items: &[Item]) -> (Vec<u8>, Vec<Event>) {
    let mut enc = loona_hpack::Encoder::new();
    let mut bytes = if sender == Sender::Client { PREFACE.to_vec() } else { Vec::new() };
    let mut expected = Vec::new();
    for item in items {
        match item {
            Item::Head { stream, fields, end_stream, pad, priority, split } => {
                let b = enc.encode(fields.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())));
                let split = (*split).min(b.len());
                let mut payload = Vec::new();
                let mut flags = if split == b.len() { END_HEADERS } else { 0 };
                flags |= if *end_stream { END_STREAM } else { 0 };
                if let Some(p) = pad {
                    payload.push(*p);
                    flags |= PADDED;
                }
                if *priority {
                    payload.extend([0, 0, 0, 0, 16]);
                    flags |= PRIORITY;
                }
                payload.extend(&b[..split]);
                payload.extend(vec![0; usize::from(pad.unwrap_or(0))]);
                bytes.extend(frame(HEADERS, flags, *stream, &payload));
                if split < b.len() {
                    bytes.extend(frame(CONTINUATION, 0, *stream, &b[split..split + (b.len() - split) / 2]));
                    bytes.extend(frame(CONTINUATION, END_HEADERS, *stream, &b[split + (b.len() - split) / 2..]));
                }
                let iter = fields.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes()));
                let (stream, end_stream) = (*stream, *end_stream);
                expected.push(if fields.first().is_none_or(|(n, _)| !n.starts_with(':')) {
                    Event::Trailers { stream }
                } else if sender == Sender::Client {
                    let mut head = RequestHead::default();
                    head::request_from_fields(iter, &mut head).unwrap();
                    Event::Request { stream, head, end_stream }
                } else {
                    Event::Response { stream, head: head::response_from_fields(iter).unwrap(), end_stream }
                });
            }
            Item::Data { stream, len, pad, end_stream } => {
                let mut payload = Vec::new();
                let mut flags = if *end_stream { END_STREAM } else { 0 };
                if let Some(p) = pad {
                    payload.push(*p);
                    flags |= PADDED;
                }
                payload.extend(vec![b'd'; *len]);
                payload.extend(vec![0; usize::from(pad.unwrap_or(0))]);
                bytes.extend(frame(DATA, flags, *stream, &payload));
                if *end_stream {
                    expected.push(Event::StreamEnd { stream: *stream });
                }
            }
            Item::Reset { stream, code } => {
                bytes.extend(frame(RST_STREAM, 0, *stream, &code.to_be_bytes()));
                expected.push(Event::Reset { stream: *stream, code: *code });
            }
            Item::GoAway { last_stream, code } => {
                let mut payload = last_stream.to_be_bytes().to_vec();
                payload.extend(code.to_be_bytes());
                payload.extend(b"debug");
                bytes.extend(frame(GOAWAY, 0, 0, &payload));
                expected.push(Event::GoAway { last_stream: *last_stream, code: *code });
            }
            Item::Skipped { kind, len } => bytes.extend(frame(*kind, 0, 0, &vec![1; *len])),
        }
    }
    (bytes, expected)
}

fn sender() -> impl Strategy<Value = Sender> {
    prop_oneof![Just(Sender::Client), Just(Sender::Server)]
}

proptest! {
    #[test]
    fn any_split_gives_the_events_of_one_chunk(
        (sender, items) in sender().prop_flat_map(|s| (Just(s), items(s))),
        cuts in prop::collection::vec(0usize..4000, 0..8),
    ) {
        let (bytes, expected) = encode(sender, &items);
        let (whole, error) = run(&mut Decoder::new(sender), &[Chunk::complete(&bytes)]);
        prop_assert_eq!(error, None);
        prop_assert_eq!(&whole, &expected);
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
        cuts.sort_unstable();
        cuts.push(bytes.len());
        let mut chunks = Vec::new();
        let mut from = 0;
        for cut in cuts {
            chunks.push(Chunk::complete(&bytes[from..cut]));
            from = cut;
        }
        let (split, error) = run(&mut Decoder::new(sender), &chunks);
        prop_assert_eq!(error, None);
        prop_assert_eq!(split, expected);
    }

    #[test]
    fn arbitrary_bytes_never_panic(
        sender in sender(),
        calls in prop::collection::vec((prop::collection::vec(any::<u8>(), 0..64), 0u64..64, prop::collection::vec(any::<u8>(), 0..16)), 0..8),
        with_preface in any::<bool>(),
    ) {
        let mut decoder = Decoder::new(sender);
        let (mut events, mut heads) = (Vec::new(), Vec::new());
        if with_preface && sender == Sender::Client {
            decoder.feed(Chunk::complete(PREFACE), &mut events, &mut heads).unwrap();
        }
        for (known, unknown, tail) in &calls {
            let total = known.len() as u64 + unknown;
            let tail = if *unknown > 0 { &tail[..] } else { &[] };
            let _ = decoder.feed(Chunk { known, total, tail }, &mut events, &mut heads);
        }
    }

    #[test]
    fn arbitrary_header_blocks_never_panic(
        sender in sender(),
        blocks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..48), 1..6),
    ) {
        // Well-framed, so that the bytes reach HPACK (and the head builders) on one decoder.
        let mut bytes = if sender == Sender::Client { PREFACE.to_vec() } else { Vec::new() };
        for (i, b) in blocks.iter().enumerate() {
            bytes.extend(frame(HEADERS, END_HEADERS, 2 * i as u32 + 1, b));
        }
        let _ = run(&mut Decoder::new(sender), &[Chunk::complete(&bytes)]);
    }
}

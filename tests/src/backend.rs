//! The backend server behind `HAProxy` in the tests (hyper, HTTP/1.1 keep-alive).
//!
//! - `/status/NNN` answers with status NNN;
//! - `/slow/MS` answers 200 after MS milliseconds;
//! - `/big/N` answers N bytes with a Content-Length;
//! - `/chunked/N` answers N bytes with chunked transfer coding, 1000 bytes a chunk;
//! - `/ws` with `Upgrade: websocket` switches protocols and echoes what it receives;
//! - anything else answers 200 `ok`, after reading the whole request body.
//!
//! Whatever the path, a request with `x-want-status: NNN` is answered with status NNN and a small
//! body naming it, and one with `x-delay-ms: N` is answered after N milliseconds (the linking
//! tests send identical requests that each ask for their own status and delay). With
//! `x-want-status: cycle` the backend picks the status itself, the next of
//! [`crate::linking::statuses`] in turn, and with `x-delay-ms: random` a delay of 0-15 ms: requests
//! that are identical byte for byte still get statuses no concurrent request has. Such an answer
//! also says what reached the backend: `x-seen-target` (the request target after `HAProxy`'s
//! rewrites) and `x-seen-headers` (the request's header names, lowercase, comma-separated).
//!
//! Every answer echoes the request's `x-request-id` header, so a test knows which backend request
//! a frontend request caused.
//!
//! A request with `x-token-echo: 1` draws a token (a process-wide counter, so unique across
//! backends), answered in an `x-token` header (with `x-seen-target` as above), and the backend
//! records, for that token, when it received the request head and when it started writing the
//! response, in unix ns from `CLOCK_REALTIME` (the clock span timestamps are converted to):
//! [`Backend::token_exchanges`]. The times come from the connection's socket calls, not from the
//! handler: *received* is the return of the last read that brought bytes before the handler ran
//! (`HAProxy` does not pipeline requests to servers, so that read brought the request head), and
//! *sent* is taken just before the first write that put bytes of the response on the socket.
//! Both lie inside the backend exchange `HAProxy` sees (its write of the request, its read of the
//! response's end), up to the scheduling delay between a syscall delivering its bytes and its
//! return (see [`crate::linking::timing`]).

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, SystemTime};

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt as _, Full};
use hyper::body::{Body, Frame};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, ReadBuf};

#[derive(Debug, Clone, Copy)]
pub struct Backend {
    pub addr: SocketAddr,
}

impl Backend {
    #[must_use]
    pub fn start(rt: &tokio::runtime::Runtime) -> Self {
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind backend");
        let addr = listener.local_addr().expect("addr");
        rt.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                tokio::spawn(async move {
                    let times = Arc::new(Mutex::new(ConnTimes::default()));
                    let io = Timed { inner: stream, times: Arc::clone(&times), backend: addr };
                    let service = hyper::service::service_fn(move |req| {
                        let times = Arc::clone(&times);
                        async move { Ok::<_, Infallible>(answer(req, &times).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(io), service)
                        .with_upgrades()
                        .await;
                });
            }
        });
        Self { addr }
    }

    /// What this backend recorded for each token it drew (`x-token-echo: 1`), by token. A token
    /// appears once the first bytes of its response were written.
    #[must_use]
    pub fn token_exchanges(&self) -> BTreeMap<u64, TokenExchange> {
        TOKEN_EXCHANGES.lock().expect("lock").get(&self.addr).cloned().unwrap_or_default()
    }
}

/// When the backend exchange that drew a token happened, in unix ns (`CLOCK_REALTIME`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenExchange {
    /// Return of the read that brought the request head.
    pub received_ns: u64,
    /// Just before the write that put the response's first bytes on the socket.
    pub sent_ns: u64,
}

/// Every backend's token records, by backend address.
static TOKEN_EXCHANGES: LazyLock<Mutex<HashMap<SocketAddr, BTreeMap<u64, TokenExchange>>>> =
    LazyLock::new(Mutex::default);

/// The last token drawn (process-wide, so tokens are unique across backends).
static TOKENS: AtomicU64 = AtomicU64::new(0);

/// Now, in unix ns.
fn unix_now_ns() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// What a connection's socket calls tell its handler.
#[derive(Debug, Default)]
struct ConnTimes {
    /// When the last read that brought bytes returned.
    last_read_ns: u64,
    /// Tokens whose response was handed to hyper and not written yet, with their received time.
    unsent: Vec<(u64, u64)>,
}

/// The backend's side of a connection, timing its reads and writes for the token records.
struct Timed {
    inner: tokio::net::TcpStream,
    times: Arc<Mutex<ConnTimes>>,
    backend: SocketAddr,
}

impl Timed {
    /// Files the tokens waiting for a write, as sent at `before` (taken before the write that
    /// succeeded).
    fn wrote(&self, before: u64) {
        let unsent = std::mem::take(&mut self.times.lock().expect("lock").unsent);
        if unsent.is_empty() {
            return;
        }
        let mut all = TOKEN_EXCHANGES.lock().expect("lock");
        let mine = all.entry(self.backend).or_default();
        for (token, received_ns) in unsent {
            mine.insert(token, TokenExchange { received_ns, sent_ns: before });
        }
    }
}

impl AsyncRead for Timed {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.times.lock().expect("lock").last_read_ns = unix_now_ns();
        }
        polled
    }
}

impl AsyncWrite for Timed {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        let before = unix_now_ns();
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.wrote(before);
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let before = unix_now_ns();
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.wrote(before);
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

type AnyBody = BoxBody<Bytes, Infallible>;

/// A body of `left` bytes sent in 1000-byte frames with no size hint, so hyper chunks it.
struct Chunks {
    left: usize,
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let n = self.left.min(1000);
        self.left -= n;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'c'; n])))))
    }
}

fn full(bytes: impl Into<Bytes>) -> AnyBody {
    Full::new(bytes.into()).boxed()
}

async fn answer(mut req: Request<hyper::body::Incoming>, times: &Mutex<ConnTimes>) -> Response<AnyBody> {
    let token = (req.headers().get("x-token-echo").map(hyper::header::HeaderValue::as_bytes) == Some(b"1"))
        .then(|| (TOKENS.fetch_add(1, Ordering::Relaxed) + 1, times.lock().expect("lock").last_read_ns));
    if req.uri().path() == "/ws" && req.headers().contains_key("upgrade") {
        let upgrade = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            let Ok(upgraded) = upgrade.await else { return };
            let mut io = TokioIo::new(upgraded);
            let mut buf = [0u8; 1024];
            while let Ok(n) = io.read(&mut buf).await {
                if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        });
        return Response::builder()
            .status(StatusCode::SWITCHING_PROTOCOLS)
            .header("upgrade", "websocket")
            .header("connection", "upgrade")
            // The accept value for the key the tests send (RFC 6455, section 1.3).
            .header("sec-websocket-accept", "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")
            .body(full(Bytes::new()))
            .expect("response");
    }
    let (parts, body) = req.into_parts();
    if body.collect().await.is_err() {
        return Response::builder().status(StatusCode::BAD_REQUEST).body(full(Bytes::new())).expect("response");
    }
    let path = parts.uri.path();
    let number = |prefix: &str| path.strip_prefix(prefix).and_then(|n| n.parse::<usize>().ok());
    let mut status = StatusCode::OK;
    let mut body = full(Bytes::from_static(b"ok"));
    if let Some(code) = path.strip_prefix("/status/") {
        status = code.parse().ok().and_then(|c| StatusCode::from_u16(c).ok()).unwrap_or(StatusCode::BAD_REQUEST);
    } else if let Some(ms) = number("/slow/") {
        tokio::time::sleep(Duration::from_millis(ms as u64)).await;
    } else if let Some(n) = number("/big/") {
        body = full(vec![b'b'; n]);
    } else if let Some(n) = number("/chunked/") {
        body = Chunks { left: n }.boxed();
    }
    let delay = match parts.headers.get("x-delay-ms").map(hyper::header::HeaderValue::as_bytes) {
        Some(b"random") => Some(pick(&DELAYS) % 16),
        _ => header_number(&parts.headers, "x-delay-ms"),
    };
    if let Some(ms) = delay {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let code = match parts.headers.get("x-want-status").map(hyper::header::HeaderValue::as_bytes) {
        Some(b"cycle") => {
            let all = crate::linking::statuses();
            Some(u64::from(all[(STATUSES.fetch_add(1, Ordering::Relaxed) as usize) % all.len()]))
        }
        _ => header_number(&parts.headers, "x-want-status"),
    };
    if let Some(code) = code {
        status = u16::try_from(code).ok().and_then(|c| StatusCode::from_u16(c).ok()).unwrap_or(StatusCode::BAD_REQUEST);
        body = full(format!("status {code}\n"));
    }
    let mut resp = Response::builder().status(status);
    if let Some((token, received_ns)) = token {
        resp = resp.header("x-token", token);
        times.lock().expect("lock").unsent.push((token, received_ns));
    }
    if parts.headers.contains_key("x-want-status") || token.is_some() {
        let target = parts.uri.path_and_query().map_or("", hyper::http::uri::PathAndQuery::as_str);
        let names: Vec<&str> = parts.headers.keys().map(hyper::header::HeaderName::as_str).collect();
        resp = resp.header("x-seen-target", target).header("x-seen-headers", names.join(","));
    }
    if let Some(id) = parts.headers.get("x-request-id") {
        resp = resp.header("x-request-id", id);
    }
    resp.body(body).expect("response")
}

/// The next status for `x-want-status: cycle`, and the state of the delays for `x-delay-ms: random`
/// (shared by every backend of the process: the requests only need statuses no concurrent request has).
static STATUSES: AtomicU64 = AtomicU64::new(0);
static DELAYS: AtomicU64 = AtomicU64::new(0);

/// A pseudo-random number from `state` (splitmix64).
fn pick(state: &AtomicU64) -> u64 {
    let mut z = state.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A header's value as a number, when it is one.
fn header_number(headers: &hyper::HeaderMap, name: &str) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.trim().parse().ok()
}

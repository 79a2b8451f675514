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

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt as _, Full};
use hyper::body::{Body, Frame};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

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
                    let service =
                        hyper::service::service_fn(|req| async move { Ok::<_, Infallible>(answer(req).await) });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .with_upgrades()
                        .await;
                });
            }
        });
        Self { addr }
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

async fn answer(mut req: Request<hyper::body::Incoming>) -> Response<AnyBody> {
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
    if parts.headers.contains_key("x-want-status") {
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

//! The backend server behind `HAProxy` in the tests (hyper, HTTP/1.1 keep-alive).
//!
//! - `/status/NNN` answers with status NNN;
//! - `/slow/MS` answers 200 after MS milliseconds;
//! - anything else answers 200 `ok`, after reading the whole request body.
//!
//! Every answer echoes the request's `x-request-id` header, so a test knows which backend request
//! a frontend request caused.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

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
                        .await;
                });
            }
        });
        Self { addr }
    }
}

async fn answer(req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    if body.collect().await.is_err() {
        return Response::builder().status(StatusCode::BAD_REQUEST).body(Full::default()).expect("response");
    }
    let path = parts.uri.path();
    let mut status = StatusCode::OK;
    if let Some(code) = path.strip_prefix("/status/") {
        status = code.parse().ok().and_then(|c| StatusCode::from_u16(c).ok()).unwrap_or(StatusCode::BAD_REQUEST);
    } else if let Some(ms) = path.strip_prefix("/slow/") {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap_or(100))).await;
    }
    let mut resp = Response::builder().status(status);
    if let Some(id) = parts.headers.get("x-request-id") {
        resp = resp.header("x-request-id", id);
    }
    resp.body(Full::new(Bytes::from_static(b"ok"))).expect("response")
}

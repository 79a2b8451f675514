//! Admin HTTP endpoint: `/readyz` (200 once probes are attached to at least one target),
//! `/healthz` (200 while the process serves) and `/metrics` (Prometheus text).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::metrics::Metrics;

/// Serves the admin endpoint on an already bound listener until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let metrics = Arc::clone(&metrics);
                async move { Ok::<_, Infallible>(route(&req, &metrics)) }
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

fn route<B>(req: &Request<B>, metrics: &Metrics) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: String, content_type: &'static str| {
        Response::builder()
            .status(status)
            .header("content-type", content_type)
            .body(Full::new(Bytes::from(body)))
            .expect("static response parts are valid")
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n".into(), "text/plain");
    }
    match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n".into(), "text/plain"),
        "/readyz" if metrics.ready.load(Relaxed) => text(StatusCode::OK, "ready\n".into(), "text/plain"),
        "/readyz" => {
            text(StatusCode::SERVICE_UNAVAILABLE, "probes not attached to any target yet\n".into(), "text/plain")
        }
        "/metrics" => text(StatusCode::OK, metrics.render(), "text/plain; version=0.0.4"),
        _ => text(StatusCode::NOT_FOUND, "try /readyz, /healthz or /metrics\n".into(), "text/plain"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_follows_the_flag() {
        let m = Metrics::default();
        let req = Request::get("/readyz").body(()).unwrap();
        assert_eq!(route(&req, &m).status(), StatusCode::SERVICE_UNAVAILABLE);
        m.ready.store(true, Relaxed);
        assert_eq!(route(&req, &m).status(), StatusCode::OK);
        assert_eq!(route(&Request::get("/nope").body(()).unwrap(), &m).status(), StatusCode::NOT_FOUND);
    }
}

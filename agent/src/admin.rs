//! Admin HTTP endpoint: `/readyz` (200 once probes are attached to at least one target),
//! `/healthz` (200 while the process serves) and `/metrics` (Prometheus text), within [`Limits`].

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::metrics::{self, Metrics};

/// Bounds on what a client of the admin endpoint can hold. It is reachable from the pod network
/// (the kubelet's probes, Prometheus), so a client that opens connections and sends nothing, or
/// sends slowly, must not take it away from the liveness probe.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Time to send a request head, from the connection's start or the last answer.
    pub header_timeout: Duration,
    /// Longest life of one connection (keep-alive included).
    pub connection_timeout: Duration,
    /// Connections served at once; more wait in the kernel's backlog.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self { header_timeout: Duration::from_secs(5), connection_timeout: Duration::from_mins(1), max_connections: 32 }
    }
}

/// Serves the admin endpoint on an already bound listener until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, limits: Limits, prometheus: bool) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut backoff = AcceptBackoff::default();
    loop {
        let slot = Arc::clone(&slots).acquire_owned().await.expect("the semaphore is never closed");
        let stream = match listener.accept().await {
            Ok((stream, _)) => {
                backoff.reset();
                stream
            }
            Err(e) => {
                // Out of descriptors or memory, most likely: retrying at once would spin.
                metrics::add(&metrics.admin_accept_errors, 1);
                let wait = backoff.next();
                tracing::warn!(error = %e, retry_in = ?wait, "admin endpoint: accept failed");
                tokio::time::sleep(wait).await;
                continue;
            }
        };
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let metrics = Arc::clone(&metrics);
                async move { Ok::<_, Infallible>(route(&req, &metrics, prometheus)) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .serve_connection(TokioIo::new(stream), service);
            let mut connection = std::pin::pin!(connection);
            if tokio::time::timeout(limits.connection_timeout, connection.as_mut()).await.is_err() {
                // At the end of its life a connection finishes the answer in flight, then closes.
                connection.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(limits.header_timeout, connection).await;
            }
            drop(slot);
        });
    }
}

/// Waits between failed `accept`s: 10 ms, doubling to at most 1 s, back to 10 ms after a success.
#[derive(Debug, Default)]
struct AcceptBackoff {
    failures: u32,
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(10);
    const MAX: Duration = Duration::from_secs(1);

    fn next(&mut self) -> Duration {
        let wait = Self::FIRST.saturating_mul(1 << self.failures.min(10)).min(Self::MAX);
        self.failures += 1;
        wait
    }

    fn reset(&mut self) {
        self.failures = 0;
    }
}

fn route<B>(req: &Request<B>, metrics: &Metrics, prometheus: bool) -> Response<Full<Bytes>> {
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
        "/readyz" => {
            let mut tls = metrics.tls_route.get().map(|route| format!("{route}\n")).unwrap_or_default();
            // Readiness is the probes'; a failing export is said, not made a restart reason.
            if let Some(why) = metrics.export_failing.lock().ok().and_then(|f| f.clone()) {
                tls = tls + "export: failing: " + &why + "\n";
            }
            if metrics.ready.load(Relaxed) {
                text(StatusCode::OK, format!("ready\n{tls}"), "text/plain")
            } else {
                text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("probes not attached to any target yet\n{tls}"),
                    "text/plain",
                )
            }
        }
        "/metrics" if prometheus => text(StatusCode::OK, metrics.render(), "text/plain; version=0.0.4"),
        "/metrics" => text(
            StatusCode::NOT_FOUND,
            "the Prometheus text is off: OTEL_METRICS_EXPORTER does not list prometheus\n".into(),
            "text/plain",
        ),
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
        assert_eq!(route(&req, &m, true).status(), StatusCode::SERVICE_UNAVAILABLE);
        m.ready.store(true, Relaxed);
        assert_eq!(route(&req, &m, true).status(), StatusCode::OK);
        assert_eq!(route(&Request::get("/nope").body(()).unwrap(), &m, true).status(), StatusCode::NOT_FOUND);
        let metrics = Request::get("/metrics").body(()).unwrap();
        assert_eq!(route(&metrics, &m, true).status(), StatusCode::OK);
        assert_eq!(route(&metrics, &m, false).status(), StatusCode::NOT_FOUND);
    }

    #[test]
    fn accept_backoff_doubles_to_a_second_and_resets() {
        let mut b = AcceptBackoff::default();
        let waits: Vec<_> = (0..9).map(|_| b.next().as_millis()).collect();
        assert_eq!(waits, [10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        b.reset();
        assert_eq!(b.next(), Duration::from_millis(10));
    }
}

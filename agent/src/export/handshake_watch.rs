//! A connector that remembers why a connection's TLS failed after the handshake looked done.
//!
//! With TLS 1.3 a client counts the handshake done once it sent its Finished; a collector that
//! wants a client certificate, or refuses ours, says so with an alert that arrives at the first
//! read. Over HTTP/2 (OTLP/gRPC) that read belongs to hyper's connection task, which ends with the
//! alert, while the request in flight only learns that it was cancelled; and when the client
//! writes first (HTTP/2's preface), the write fails with a broken pipe before any read, the alert
//! unread. So each connection's reads and writes note the TLS failure they meet in a slot the
//! transport shares, a write the peer hung up on fails only once what the peer said last was
//! read, and the
//! transport reads the slot when a request fails in the client without a cause (`super::grpc`,
//! `super::http`); an answer from the collector, or a connect that failed, clears it.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use hyper::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection};

use super::tls_failure::{self, TlsFailure};

/// The last TLS failure the endpoint's connections met, until an export succeeds. It is kept,
/// not taken: a peer that sends its alert and hangs up can be seen hanging up before its alert
/// arrives, and the requests it cancels meanwhile have the same cause.
#[derive(Debug, Clone, Default)]
pub struct LastTlsFailure(Arc<Mutex<Option<TlsFailure>>>);

impl LastTlsFailure {
    /// The failure noted last, if no export succeeded since.
    #[must_use]
    pub fn get(&self) -> Option<TlsFailure> {
        self.0.lock().ok()?.clone()
    }

    /// Why a request failed in the client without a cause: the TLS failure its connection met,
    /// unless the connect itself failed, which says its own cause (and that TLS is no longer what
    /// fails).
    #[must_use]
    pub fn explain(&self, connect_failed: bool) -> Option<TlsFailure> {
        if connect_failed {
            self.clear();
            return None;
        }
        self.get()
    }

    /// An export succeeded.
    pub fn clear(&self) {
        if let Ok(mut slot) = self.0.lock() {
            *slot = None;
        }
    }

    fn note<T>(&self, result: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if let Poll::Ready(Err(e)) = &result
            && let Some(failure) = tls_failure::classify(e)
            && let Ok(mut slot) = self.0.lock()
        {
            *slot = Some(failure);
        }
        result
    }
}

/// `inner`, its connections watched.
#[derive(Debug, Clone)]
pub struct Watched<C> {
    inner: C,
    last: LastTlsFailure,
}

impl<C> Watched<C> {
    pub fn new(inner: C, last: LastTlsFailure) -> Self {
        Self { inner, last }
    }
}

impl<C> tower_service::Service<Uri> for Watched<C>
where
    C: tower_service::Service<Uri>,
    C::Future: Send + 'static,
    C::Response: Send + 'static,
{
    type Response = WatchedIo<C::Response>;
    type Error = C::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let last = self.last.clone();
        let connecting = self.inner.call(uri);
        Box::pin(async move { Ok(WatchedIo { io: connecting.await?, last, hung_up: None }) })
    }
}

/// A connection whose I/O errors are noted in its [`LastTlsFailure`].
#[derive(Debug)]
pub struct WatchedIo<T> {
    io: T,
    last: LastTlsFailure,
    /// A write's error when the peer hung up, held until its last words are read.
    hung_up: Option<io::Error>,
}

impl<T: Read + Unpin> Read for WatchedIo<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: ReadBufCursor<'_>) -> Poll<io::Result<()>> {
        let result = Pin::new(&mut self.io).poll_read(cx, buf);
        self.last.note(result)
    }
}

impl<T: Read + Unpin> WatchedIo<T> {
    /// A write the peer hung up on is held (`hung_up`) until the peer's last words (a TLS alert
    /// sent before it closed) are read and noted, or the read ends otherwise; then the write's own
    /// error is what the caller gets. The read cannot be a single try: the runtime may not have
    /// seen the socket readable yet, so a `Pending` read waits for it like any read.
    fn poll_hung_up<R>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<R>> {
        loop {
            let mut bytes = [0u8; 256];
            let mut buf = hyper::rt::ReadBuf::new(&mut bytes);
            match Pin::new(&mut self.io).poll_read(cx, buf.unfilled()) {
                Poll::Pending => return Poll::Pending,
                // Application data after a hang-up means nothing now: read on to the end.
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => {}
                end @ Poll::Ready(_) => {
                    let _ = self.last.note(end);
                    let error = self.hung_up.take().unwrap_or_else(|| io::ErrorKind::BrokenPipe.into());
                    return Poll::Ready(Err(error));
                }
            }
        }
    }

    /// `result` of a write: noted, or, when the peer hung up, held for [`Self::poll_hung_up`].
    fn after_write<R>(&mut self, cx: &mut Context<'_>, result: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        match result {
            Poll::Ready(Err(e)) if matches!(e.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset) => {
                self.hung_up = Some(e);
                self.poll_hung_up(cx)
            }
            other => self.last.note(other),
        }
    }
}

impl<T: Read + Write + Unpin> Write for WatchedIo<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.hung_up.is_some() {
            return self.poll_hung_up(cx);
        }
        let result = Pin::new(&mut self.io).poll_write(cx, buf);
        self.after_write(cx, result)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.hung_up.is_some() {
            return self.poll_hung_up(cx);
        }
        let result = Pin::new(&mut self.io).poll_flush(cx);
        self.after_write(cx, result)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.hung_up.is_some() {
            return self.poll_hung_up(cx);
        }
        let result = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.after_write(cx, result)
    }
}

impl<T: Connection> Connection for WatchedIo<T> {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_alert_met_in_a_read_is_kept_until_cleared() {
        let last = LastTlsFailure::default();
        let alert = rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRequired);
        let _ = last.note::<()>(Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, alert))));
        let _ = last.note::<()>(Poll::Ready(Err(io::Error::other("connection reset"))));
        assert_eq!(last.get().map(|f| f.reason()), Some("handshake_refused"));
        assert_eq!(last.get().map(|f| f.reason()), Some("handshake_refused"));
        last.clear();
        assert_eq!(last.get(), None);
    }
}

//! A connection with no request in progress may stay silent for `header_timeout` at most, then
//! it is closed (SPEC §12 `[server]`). hyper bounds an HTTP/1 connection waiting for a head;
//! nothing bounds an HTTP/2 one that sent its preface and settings and then nothing, so that a
//! few hundred of them would hold every connection the proxy serves. Counted per connection:
//! the requests in progress ([`Busy`]: from the request's arrival to the end of its response
//! body) and the time since the client last sent a byte.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The requests of one connection in progress.
#[derive(Clone, Default)]
pub struct Busy(Arc<AtomicUsize>);

impl Busy {
    /// A request began: it counts until the guard is dropped.
    pub fn begin(&self) -> BusyGuard {
        self.0.fetch_add(1, Ordering::Relaxed);
        BusyGuard(self.0.clone())
    }

    pub fn idle(&self) -> bool {
        self.0.load(Ordering::Relaxed) == 0
    }
}

pub struct BusyGuard(Arc<AtomicUsize>);

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body that holds its request's [`BusyGuard`] until it is done or dropped.
pub struct Counted<B> {
    pub inner: B,
    pub _guard: BusyGuard,
}

impl<B: Body<Data = Bytes> + Unpin> Body for Counted<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The connection's IO, closed with `TimedOut` once it has been idle (no request in progress)
/// and silent for `timeout`.
pub struct Idle<T> {
    inner: T,
    busy: Busy,
    timeout: Duration,
    /// When the client last sent a byte: the timer is moved only when it fires, not on every
    /// read.
    heard: tokio::time::Instant,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl<T> Idle<T> {
    pub fn new(inner: T, busy: Busy, timeout: Duration) -> Idle<T> {
        Idle {
            inner,
            busy,
            timeout,
            heard: tokio::time::Instant::now(),
            deadline: Box::pin(tokio::time::sleep(timeout)),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Idle<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        match &polled {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                self.heard = tokio::time::Instant::now();
            }
            Poll::Pending => loop {
                if self.deadline.as_mut().poll(cx).is_pending() {
                    break;
                }
                let now = tokio::time::Instant::now();
                let quiet_until = self.heard + self.timeout;
                if quiet_until <= now && self.busy.idle() {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "idle connection: no request within header_timeout",
                    )));
                }
                // Heard from since, or a request is in progress (a slow answer): look again.
                let at = quiet_until.max(now + self.timeout / 4);
                self.deadline.as_mut().reset(at);
            },
            _ => {}
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Idle<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

//! Request-smuggling guard for HTTP/1 connections (SPEC §2).
//!
//! hyper resolves ambiguous framing safely but silently: with both `Content-Length` and
//! `Transfer-Encoding` it drops the length, and it merges identical duplicate `Content-Length`
//! lines. The contract is stricter: such requests are refused with 400 and the connection closed.
//! The service cannot see what hyper dropped, so this wrapper reads the bytes first. It follows
//! HTTP/1 message framing (heads, fixed-length and chunked bodies), and when a head is ambiguous it
//! renames the offending `Content-Length` line to [`MARK`] (same length, so nothing shifts). hyper
//! then parses the request exactly as before, and the proxy answers the marked request with a 400
//! problem and `Connection: close`.
//!
//! It also bounds each request head in time (`header_timeout`), in place of hyper's own header
//! timer, which allocates and registers a timer for every request: here one timer serves the
//! connection, moved only when it fires.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The header a rewritten ambiguous `Content-Length` line becomes (14 bytes, like the original).
pub const MARK: &str = "oncegate-badcl";

/// The header a rewritten `Transfer-Encoding` line becomes (17 bytes, like the original), when it
/// follows a `Content-Length`.
pub const MARK_TE: &str = "oncegate-badframe";

/// Lines longer than this are passed through unguarded; hyper rejects them anyway (431).
const MAX_LINE: usize = 512 * 1024;

/// Reads from the connection take up to this much at a time, and at least `READ_MIN`.
const READ_SIZE: usize = 16 * 1024;
const READ_MIN: usize = 4 * 1024;

/// What one head has shown so far.
#[derive(Debug, Clone, Default, PartialEq)]
struct Head {
    started: bool,
    content_length: Option<Option<u64>>,
    /// `Some(chunked-is-last)` once a Transfer-Encoding line was seen.
    te_chunked: Option<bool>,
}

#[derive(Debug, Clone, PartialEq)]
enum State {
    /// At the start of a connection: HTTP/2 prior knowledge is passed through.
    Start,
    Head(Head),
    Fixed(u64),
    ChunkSize(Vec<u8>),
    ChunkData(u64),
    ChunkEnd(u8),
    Trailers(Vec<u8>),
    /// Guarding stopped (HTTP/2, a head too large, or framing hyper will reject).
    Off,
}

/// An I/O wrapper that marks ambiguously framed HTTP/1 requests, and closes a connection that
/// does not deliver its first whole request head within `header_timeout` of opening. hyper's
/// own header timer (which covers every later head, from the previous response on) starts only
/// once the connection's protocol is known, which for a client that sends nothing, or one byte,
/// is never: hyper-util's version sniffing waits for bytes with no limit.
pub struct FramingGuard<IO> {
    inner: IO,
    state: State,
    /// Bytes read from `inner` that hyper has not been given yet.
    buf: BytesMut,
    /// How many leading bytes of `buf` are scanned and may be handed to hyper.
    ready: usize,
    /// The bound on each head's time (with `with_header_timeout`).
    clock: Option<HeadClock>,
    /// Request heads scanned whole.
    heads: u64,
}

/// One timer for all of a connection's heads: it fires at or before the head in progress is
/// due, and is moved on when it fires early.
struct HeadClock {
    sleep: Pin<Box<tokio::time::Sleep>>,
    timeout: std::time::Duration,
    /// When the head in progress began: the connection's opening for the first head, its first
    /// byte for a later one; `None` between heads.
    began: Option<tokio::time::Instant>,
    /// Requests in progress on the connection: a later head's clock does not run while the
    /// answer to an earlier request is awaited (a pipelined head waits for it).
    busy: crate::idle::Busy,
}

impl<IO> FramingGuard<IO> {
    pub fn new(inner: IO) -> Self {
        FramingGuard {
            inner,
            state: State::Start,
            buf: BytesMut::new(),
            ready: 0,
            clock: None,
            heads: 0,
        }
    }

    /// Also closes the connection when its first request head does not arrive whole within
    /// `timeout` of opening, or a later one within `timeout` of its first byte (or of the end of
    /// the requests `busy` counts, if later).
    pub fn with_header_timeout(
        mut self,
        timeout: std::time::Duration,
        busy: crate::idle::Busy,
    ) -> Self {
        self.clock = Some(HeadClock {
            sleep: Box::pin(tokio::time::sleep(timeout)),
            timeout,
            began: Some(tokio::time::Instant::now()),
            busy,
        });
        self
    }

    /// Whether a head has begun and is not whole yet: a line of it scanned, or a partial line
    /// held back until its end arrives.
    fn in_head(&self) -> bool {
        matches!(&self.state, State::Head(h) if h.started || !self.buf.is_empty())
    }

    /// Follows the heads after a read: a head whole ends its clock, a new one starts one.
    fn note_heads(&mut self, heads_before: u64) {
        let in_head = self.in_head();
        let (done, off) = (self.heads != heads_before, matches!(self.state, State::Off));
        let Some(clock) = self.clock.as_mut() else {
            return;
        };
        if done || off {
            clock.began = None;
        }
        if clock.began.is_none() && in_head {
            clock.began = Some(tokio::time::Instant::now());
        }
    }

    /// `Err` once the head in progress is past its deadline; registers the waker.
    fn check_deadline(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let Some(clock) = self.clock.as_mut() else {
            return Ok(());
        };
        // Between heads the timer may fire; it is looked at again when a head begins.
        while let Some(began) = clock.began {
            if clock.sleep.as_mut().poll(cx).is_pending() {
                break;
            }
            let now = tokio::time::Instant::now();
            let due = if clock.busy.idle() {
                began + clock.timeout
            } else {
                // A pipelined head waits for the answer before it: its clock starts again.
                clock.began = Some(now);
                now + clock.timeout
            };
            if due <= now {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no whole request head within header_timeout",
                ));
            }
            clock.sleep.as_mut().reset(due);
        }
        Ok(())
    }

    /// Scans unscanned bytes of `buf`, moving `ready` forward. Returns whether it made progress.
    fn scan(&mut self) -> bool {
        let n = scan(
            &mut self.state,
            &mut self.buf[self.ready..],
            &mut self.heads,
        );
        self.ready += n;
        n > 0
    }
}

/// Scans `bytes` from the state the bytes before them left, marking ambiguous framing in place.
/// Returns how many leading bytes are scanned and may be handed to hyper: all but a trailing
/// partial line (or HTTP/2 preface) that the next bytes complete.
/// `heads` counts the request heads completed (the first one ends the opening deadline).
fn scan(state: &mut State, bytes: &mut [u8], heads: &mut u64) -> usize {
    let mut ready = 0;
    loop {
        let avail = bytes.len() - ready;
        if avail == 0 {
            break;
        }
        let rest = &bytes[ready..];
        match state {
            State::Start => {
                const PREFACE: &[u8] = b"PRI * HTTP/2.0";
                let n = rest.len().min(PREFACE.len());
                if rest[..n] != PREFACE[..n] {
                    *state = State::Head(Head::default());
                } else if n == PREFACE.len() {
                    *state = State::Off;
                } else {
                    break;
                }
            }
            State::Off => ready = bytes.len(),
            State::Head(head) => {
                // Each complete line is inspected, and handed over at once: only a partial
                // line is held back, so hyper's header timeout keeps running.
                let Some(i) = memchr::memchr(b'\n', rest) else {
                    if rest.len() > MAX_LINE {
                        *state = State::Off;
                        continue;
                    }
                    break;
                };
                let line = &mut bytes[ready..ready + i + 1];
                ready += i + 1;
                let blank = line.iter().all(|c| *c == b'\r' || *c == b'\n');
                if blank && !head.started {
                    // Empty lines before a request line are ignored (RFC 9112 §2.2).
                } else if blank {
                    *state = framing(head);
                    *heads += 1;
                } else if !head.started {
                    head.started = true;
                } else {
                    inspect_line(head, line);
                }
            }
            State::Fixed(n) => {
                let k = (*n).min(avail as u64);
                *n -= k;
                ready += k as usize;
                if *n == 0 {
                    *state = State::Head(Head::default());
                }
            }
            State::ChunkSize(line) | State::Trailers(line) => {
                let (take, done) = match memchr::memchr(b'\n', rest) {
                    Some(i) => (i + 1, true),
                    None => (rest.len(), false),
                };
                if line.len() + take > 4096 {
                    *state = State::Off;
                    continue;
                }
                line.extend_from_slice(&rest[..take]);
                ready += take;
                if done {
                    let text = String::from_utf8_lossy(line).trim().to_string();
                    *state = match &*state {
                        State::ChunkSize(_) => {
                            let size = text.split(';').next().unwrap_or("").trim();
                            match u64::from_str_radix(size, 16) {
                                Ok(0) => State::Trailers(Vec::new()),
                                Ok(n) => State::ChunkData(n),
                                Err(_) => State::Off,
                            }
                        }
                        _ if text.is_empty() => State::Head(Head::default()),
                        _ => State::Trailers(Vec::new()),
                    };
                }
            }
            State::ChunkData(n) => {
                let k = (*n).min(avail as u64);
                *n -= k;
                ready += k as usize;
                if *n == 0 {
                    *state = State::ChunkEnd(2);
                }
            }
            State::ChunkEnd(left) => {
                // CRLF after the chunk data; a bare LF is tolerated like hyper does.
                let b = rest[0];
                ready += 1;
                if b == b'\n' || *left == 1 {
                    *state = State::ChunkSize(Vec::new());
                } else {
                    *left -= 1;
                }
            }
        }
    }
    ready
}

/// Notes a header line; marks it when it makes the framing ambiguous.
fn inspect_line(head: &mut Head, line: &mut [u8]) {
    let Some(colon) = line.iter().position(|c| *c == b':') else {
        return;
    };
    let name = &line[..colon];
    let content_length = name.eq_ignore_ascii_case(b"content-length");
    if !content_length && !name.eq_ignore_ascii_case(b"transfer-encoding") {
        // Every other header line: nothing to read in its value.
        return;
    }
    let value = String::from_utf8_lossy(&line[colon + 1..])
        .trim()
        .to_string();
    if content_length {
        if head.content_length.is_some() || head.te_chunked.is_some() {
            line[..MARK.len()].copy_from_slice(MARK.as_bytes());
        } else {
            head.content_length = Some(value.parse().ok());
        }
    } else if head.content_length.is_some() {
        // A `Transfer-Encoding` after a `Content-Length`.
        line[..MARK_TE.len()].copy_from_slice(MARK_TE.as_bytes());
    } else {
        let last = value
            .rsplit(',')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        head.te_chunked = Some(last == "chunked");
    }
}

/// The body framing of a complete head.
fn framing(head: &Head) -> State {
    match (head.te_chunked, head.content_length) {
        (Some(true), _) => State::ChunkSize(Vec::new()),
        (Some(false), _) => State::Off,
        (None, Some(Some(n))) => State::Fixed(n),
        (None, Some(None)) => State::Off,
        (None, None) => State::Head(Head::default()),
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for FramingGuard<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let heads_before = this.heads;
        let result = Self::read_guarded(this, cx, out);
        this.note_heads(heads_before);
        if result.is_pending() {
            // Waiting on the client: give up at the head deadline.
            if let Err(e) = this.check_deadline(cx) {
                return Poll::Ready(Err(e));
            }
        }
        result
    }
}

impl<IO: AsyncRead + Unpin> FramingGuard<IO> {
    fn read_guarded(
        this: &mut Self,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            if this.ready > 0 {
                let n = this.ready.min(out.remaining());
                out.put_slice(&this.buf[..n]);
                this.buf.advance(n);
                this.ready -= n;
                return Poll::Ready(Ok(()));
            }
            if this.buf.is_empty() {
                // Nothing held back: read straight into hyper's buffer and scan the bytes there
                // (marks are written in place); only a trailing partial line is taken back.
                let before = out.filled().len();
                match Pin::new(&mut this.inner).poll_read(cx, out) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Ready(Ok(())) => {}
                }
                let new = &mut out.filled_mut()[before..];
                if new.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                let n = scan(&mut this.state, new, &mut this.heads);
                if n < new.len() {
                    this.buf.extend_from_slice(&new[n..]);
                    out.set_filled(before + n);
                }
                if n > 0 {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            if this.scan() {
                continue;
            }
            // Into the buffer's spare room: no zeroing, no second copy.
            if this.buf.capacity() - this.buf.len() < READ_MIN {
                this.buf.reserve(READ_SIZE);
            }
            match tokio_util::io::poll_read_buf(Pin::new(&mut this.inner), cx, &mut this.buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                // EOF inside a head (this path always holds bytes back): hand over what there
                // is; hyper reports it.
                Poll::Ready(Ok(0)) => this.state = State::Off,
                Poll::Ready(Ok(_)) => {}
            }
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for FramingGuard<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
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
}

/// A stream that is guarded or not, decided per connection.
pub enum Guarded<IO> {
    Plain(IO),
    Guarded(FramingGuard<IO>),
}

impl<IO: AsyncRead + Unpin> AsyncRead for Guarded<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Guarded::Plain(io) => Pin::new(io).poll_read(cx, out),
            Guarded::Guarded(g) => Pin::new(g).poll_read(cx, out),
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Guarded<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Guarded::Plain(io) => Pin::new(io).poll_write(cx, buf),
            Guarded::Guarded(g) => Pin::new(g).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Guarded::Plain(io) => Pin::new(io).poll_flush(cx),
            Guarded::Guarded(g) => Pin::new(g).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Guarded::Plain(io) => Pin::new(io).poll_shutdown(cx),
            Guarded::Guarded(g) => Pin::new(g).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    async fn through(input: &[u8]) -> Vec<u8> {
        let mut g = FramingGuard::new(input);
        let mut out = Vec::new();
        g.read_to_end(&mut out).await.expect("reads");
        out
    }

    #[tokio::test]
    async fn clean_requests_pass_unchanged_across_keep_alive() {
        let input = b"POST /a HTTP/1.1\r\nContent-Length: 5\r\n\r\nhelloPOST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nworld\r\n0\r\nX-T: 1\r\n\r\nGET /c HTTP/1.1\r\nContent-Length: 0\r\n\r\n";
        assert_eq!(through(input).await, input);
    }

    #[tokio::test]
    async fn ambiguous_heads_are_marked_even_after_other_requests() {
        let input = b"POST /a HTTP/1.1\r\nContent-Length: 21\r\n\r\nContent-Length: 9\r\n\r\nPOST /b HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nPOST /c HTTP/1.1\r\ncontent-length: 1\r\nContent-Length: 1\r\n\r\nx";
        let out = String::from_utf8(through(input).await).expect("ascii");
        // The first body merely looks like a header: untouched.
        assert!(
            out.contains("\r\n\r\nContent-Length: 9\r\n\r\nPOST /b"),
            "{out}"
        );
        assert!(
            out.contains("Content-Length: 3\r\noncegate-badframe: chunked"),
            "{out}"
        );
        assert!(
            out.contains("content-length: 1\r\noncegate-badcl: 1"),
            "{out}"
        );
    }

    /// Hands its input over `step` bytes per read.
    struct Trickle<'a> {
        input: &'a [u8],
        step: usize,
    }

    impl AsyncRead for Trickle<'_> {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            out: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let n = self.step.min(self.input.len()).min(out.remaining());
            out.put_slice(&self.input[..n]);
            self.input = &self.input[n..];
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn heads_split_across_reads_are_guarded_alike() {
        let clean: &[u8] = b"POST /a HTTP/1.1\r\nContent-Length: 5\r\n\r\nhelloPOST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nworld\r\n0\r\n\r\nGET /c HTTP/1.1\r\n\r\n";
        let bad: &[u8] = b"POST /c HTTP/1.1\r\ncontent-length: 1\r\nContent-Length: 1\r\n\r\nxPOST /d HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        for step in [1, 2, 3, 7, 16, 40, 4096] {
            let mut out = Vec::new();
            let mut g = FramingGuard::new(Trickle { input: clean, step });
            g.read_to_end(&mut out).await.expect("reads");
            assert_eq!(out, clean, "step {step}");
            let mut out = Vec::new();
            let mut g = FramingGuard::new(Trickle { input: bad, step });
            g.read_to_end(&mut out).await.expect("reads");
            let out = String::from_utf8(out).expect("ascii");
            assert!(
                out.contains("content-length: 1\r\noncegate-badcl: 1\r\n"),
                "step {step}: {out}"
            );
            assert!(
                out.contains("Content-Length: 3\r\noncegate-badframe: chunked"),
                "step {step}: {out}"
            );
            assert_eq!(out.len(), bad.len(), "step {step}");
        }
    }

    #[tokio::test]
    async fn http2_preface_passes_through() {
        let input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x12\x04\x00\x00\x00\x00\x00Content-Length: 1\r\n";
        assert_eq!(through(input).await, input);
    }

    #[tokio::test]
    async fn bare_lf_heads_are_guarded_too() {
        let out = through(b"POST / HTTP/1.1\nContent-Length: 1\nContent-Length: 1\n\nx").await;
        assert!(String::from_utf8_lossy(&out).contains("oncegate-badcl: 1"));
    }
}

//! Resumable streams (SEP-1699, SPEC §14.3): a 2025-11-25 server may end a tool call's POST
//! stream after an event that carries an `id`, and deliver the final response on a stream the
//! client resumes with `Last-Event-ID`. The proxy does not answer for that call: the end passes
//! through, the action stays `in_flight`, and it is settled from the final response when that
//! passes on a stream of the session; when no client resumes within the attempt's `timeout`,
//! the proxy resumes the stream upstream itself. One JSON-RPC id gets exactly one response.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body::{Body, Frame};

use super::relay::LATE_PATIENCE;
use super::*;
use crate::mcp::calls::{session_of, Resumes};
use crate::mcp::stream;
use crate::upstream::{BoxError, ProxyBody};

impl Proxy {
    /// The final response of a call whose POST stream the server ended after event `last_id`,
    /// or why there is none.
    pub(super) async fn resumed(
        &self,
        job: &WriteJob,
        call: &McpCall,
        mut last_id: String,
    ) -> Result<Bytes, String> {
        let session = session_of(&job.headers);
        let seen = self.resumes.wait(&job.upstream.name, &session, &call.id);
        tokio::select! {
            last = seen => if let Ok(last) = last {
                return Ok(last);
            },
            () = tokio::time::sleep(job.policy.timeout) => {}
            () = self.deadline.cancelled() => {
                return Err("the proxy stopped (drain_timeout) while the call waited for its resumed stream".into());
            }
        }
        // No client resumed within the timeout: the proxy does, from the last event it saw, and
        // again each time the server ends the stream, for as long as a late answer is awaited.
        let give_up = tokio::time::Instant::now() + LATE_PATIENCE;
        loop {
            let mut headers = job.headers.clone();
            for h in ["content-type", "content-length", "mcp-method", "mcp-name"] {
                headers.remove(h);
            }
            headers.insert(
                http::header::ACCEPT,
                HeaderValue::from_static("text/event-stream"),
            );
            let id = HeaderValue::from_str(&last_id)
                .map_err(|_| format!("the server's event id {last_id:?} cannot be sent back"))?;
            headers.insert("last-event-id", id);
            let out = Outgoing::from_owned(
                &job.upstream,
                &Method::GET,
                headers,
                &job.rest,
                job.query.as_deref(),
                None,
            )
            .map_err(|e| format!("cannot build the resuming request: {e}"))?;
            let resp = self
                .upstreams
                .forward_read(&job.upstream, &job.policy, out, crate::upstream::empty())
                .await
                .map_err(|e| {
                    format!("resuming the stream after event {last_id:?} failed: {e:?}")
                })?;
            if !resp.status().is_success() || !crate::upstream::is_event_stream(resp.headers()) {
                return Err(format!(
                    "resuming the stream after event {last_id:?} was answered {}",
                    resp.status()
                ));
            }
            let mut body = resp.into_body();
            let mut events = stream::Events::default();
            loop {
                let frame = tokio::select! {
                    f = tokio::time::timeout(job.policy.timeout, body.frame()) => f,
                    () = self.deadline.cancelled() => {
                        return Err("the proxy stopped (drain_timeout) while the resumed stream was read".into());
                    }
                };
                let data = match frame {
                    Err(_) => {
                        return Err(format!(
                            "no event within {:?} on the resumed stream, and no final response",
                            job.policy.timeout
                        ))
                    }
                    Ok(None) => break,
                    Ok(Some(Err(e))) => return Err(format!("the resumed stream broke: {e}")),
                    Ok(Some(Ok(f))) => match f.into_data() {
                        Ok(d) => d,
                        Err(_) => continue,
                    },
                };
                for ev in events.push(&data) {
                    if let Some(id) = ev.id {
                        last_id = id;
                    }
                    if stream::final_response(ev.data.as_bytes(), &call.id).is_some() {
                        return Ok(Bytes::from(ev.data));
                    }
                }
            }
            // The server ended this stream too (polling): resume again, a little later.
            if tokio::time::Instant::now() >= give_up {
                return Err("the resumed streams ended without the final response".into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A stream of an MCP session on its way to the client, read along: a final response that a
/// call waits for ([`Resumes`]) settles it.
pub(super) struct Watch {
    pub(super) inner: ProxyBody,
    pub(super) events: stream::Events,
    pub(super) resumes: Arc<Resumes>,
    pub(super) upstream: String,
    pub(super) session: String,
}

impl Body for Watch {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(d) = frame.data_ref() {
                let this = &mut *self;
                for ev in this.events.push(d) {
                    this.resumes
                        .seen(&this.upstream, &this.session, ev.data.as_bytes());
                }
                if this.events.pending() > 1 << 20 {
                    // An event too large to be a final response worth reading here.
                    this.events.take_rest();
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

//! Phase `classify` of an MCP upstream (SPEC §14.1): a POST is read for what it is. A
//! `tools/call` classed a write takes the write path with an MCP [`Call`]; everything else is
//! forwarded as a read. Problems about a tool call are answered as JSON-RPC (§14.4).

use std::pin::Pin;
use std::task::{Context, Poll};

use http_body::{Body, Frame};

use super::*;
use crate::config::McpRules;
use crate::mcp::calls::CallRef;
use crate::mcp::{self, answer, Intake};

/// The largest `tools/list` answer read for annotations; a larger one passes through unread.
const LIST_MAX: usize = 4 << 20;

impl Proxy {
    pub(super) async fn mcp(
        self: &Arc<Self>,
        t: Target<'_>,
        rules: &McpRules,
        req: Request<Incoming>,
        labels: &mut (&'static str, &'static str),
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let host = super::oauth::host_of(&req);
        let up = t.upstream.clone();
        let mut resp = self.mcp_message(t, rules, req, labels).await?;
        // A challenge names the proxy's metadata for this upstream (SPEC §14.6).
        self.name_our_metadata(&up, host.as_ref(), &mut resp);
        Ok(resp)
    }

    async fn mcp_message(
        self: &Arc<Self>,
        t: Target<'_>,
        rules: &McpRules,
        req: Request<Incoming>,
        labels: &mut (&'static str, &'static str),
    ) -> Result<Response<ProxyBody>, ProxyError> {
        // Every message but a guarded tool call is a read (SPEC §14.1).
        *labels = (t.upstream.label, Class::Read.as_str());
        // The server's own DNS rebinding check, made here: it would see the proxy's `Host`.
        let host = req
            .headers()
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .or_else(|| req.uri().authority().map(|a| a.as_str()));
        let origin = req
            .headers()
            .get(http::header::ORIGIN)
            .map(|o| o.as_bytes());
        if let Some(why) = mcp::origin::foreign(origin, host, self.local, &rules.allowed_origins) {
            *labels = (t.upstream.label, Class::Deny.as_str());
            let e = ProxyError::ForeignOrigin(why);
            tracing::info!(error = %e, upstream = t.upstream.label, "refused an MCP request");
            let principal = identity::principal(req.headers(), t.policy, &self.keyer);
            let path = || t.rest.to_string();
            self.note_problem(&e, t.upstream, req.method(), path, &principal, None);
            let mut resp = answer::invalid(&e, None);
            *resp.status_mut() = http::StatusCode::FORBIDDEN;
            return Ok(resp);
        }
        if req.method() != Method::POST {
            // GET (a stream the server opens) and DELETE (a session's end): never a tool call.
            // A GET of a session whose call waits for a resumed stream is read along.
            let session = crate::mcp::calls::session_of(req.headers());
            let upstream = t.upstream.name.clone();
            let watch = req.method() == Method::GET && self.resumes.waiting(&upstream, &session);
            let resp = self.read(t, req).await?;
            if !watch {
                return Ok(resp);
            }
            let resumes = self.resumes.clone();
            return Ok(resp.map(|inner| {
                super::resume::Watch {
                    inner,
                    events: mcp::stream::Events::default(),
                    resumes,
                    upstream,
                    session,
                }
                .boxed_unsync()
            }));
        }
        let (parts, body) = req.into_parts();
        let (body, held) = self.buffer(&parts.headers, body).await?;
        let principal = identity::principal(&parts.headers, t.policy, &self.keyer);
        // A refused message or a problem about a call, in the write log (SPEC §11).
        let note = |e: &ProxyError, tool: Option<&str>| {
            let path = || t.rest.to_string();
            self.note_problem(e, t.upstream, &parts.method, path, &principal, tool);
        };
        let refuse = |why: String, id: Option<&Value>, tool: Option<&str>| {
            let e = ProxyError::BadRequest(why);
            tracing::info!(error = %e, upstream = t.upstream.label, "refused an MCP message");
            note(&e, tool);
            answer::invalid(&e, id)
        };
        let intake = match mcp::intake(&body) {
            Ok(i) => i,
            Err(why) => return Ok(refuse(why, None, None)),
        };
        let class_of = |tool: &str| {
            mcp::classify::classify(rules, t.policy, &self.annotations, &t.upstream.name, tool)
        };
        let call = match intake {
            Intake::Other { tools_list } => {
                let learn = tools_list && rules.trust_annotations;
                return self.mcp_read(&t, t.policy, parts, body, learn).await;
            }
            Intake::Batch { tools } => {
                if let Some(tool) = tools.iter().find(|n| class_of(n).0 != Class::Read) {
                    let why = format!(
                        "a JSON-RPC batch calls tool {tool:?}, which is guarded: send each guarded tools/call alone"
                    );
                    return Ok(refuse(why, None, Some(tool)));
                }
                return self.mcp_read(&t, t.policy, parts, body, false).await;
            }
            Intake::Cancel { request_id } => {
                let call = CallRef::new(&t.upstream.name, &principal, &parts.headers, &request_id);
                if let Some(action) = self.calls.action(&call) {
                    if let Some(resp) = self.absorb_cancel(&action).await {
                        return Ok(resp);
                    }
                }
                return self.mcp_read(&t, t.policy, parts, body, false).await;
            }
            Intake::Call(call) => call,
        };
        // The transport headers of revision 2026-07-28 must say what the body says: a server
        // routing by header must not run another tool than the one classified here.
        for (header, want) in [
            ("mcp-name", call.name.as_str()),
            ("mcp-method", "tools/call"),
        ] {
            if let Some(v) = parts.headers.get(header) {
                if v.as_bytes() != want.as_bytes() {
                    let why = format!(
                        "the {header} header ({:?}) differs from the message ({want:?})",
                        String::from_utf8_lossy(v.as_bytes())
                    );
                    return Ok(refuse(why, Some(&call.id), Some(&call.name)));
                }
            }
        }
        let modern = call.modern(&parts.headers);
        let (class, policy) = class_of(&call.name);
        *labels = (t.upstream.label, class.as_str());
        let span = tracing::Span::current();
        span.record("upstream", t.upstream.name.as_str());
        span.record("class", class.as_str());
        span.record("tool", call.name.as_str());
        let problem = |e: ProxyError| {
            tracing::info!(error = %e, upstream = t.upstream.label, tool = %call.name, "problem");
            note(&e, Some(&call.name));
            answer::tool_error(&e, &call.id, modern)
        };
        match class {
            Class::Read => self.mcp_read(&t, policy, parts, body, false).await,
            Class::Deny => Ok(problem(ProxyError::RouteDenied {
                method: "tools/call".into(),
                path: call.name.clone(),
            })),
            Class::Write => {
                let tool_principal = identity::principal(&parts.headers, policy, &self.keyer);
                let id = mcp::identity::identify(
                    &t.upstream.name,
                    &tool_principal,
                    &parts.headers,
                    &body,
                    &call,
                    policy,
                    &self.keyer,
                );
                let identity = match id {
                    Ok(id) => id,
                    Err(KeyError::Invalid(m)) => return Ok(problem(ProxyError::KeyInvalid(m))),
                    Err(KeyError::Required) => return Ok(problem(ProxyError::KeyRequired)),
                };
                span.record("action", identity.action_id.as_str());
                span.record("key_source", identity.source.as_str());
                let named = CallRef::new(&t.upstream.name, &principal, &parts.headers, &call.id);
                self.calls.started(named, &identity.action_id);
                let job = WriteJob {
                    upstream: t.upstream.clone(),
                    policy: policy.clone(),
                    method: parts.method.clone(),
                    headers: parts.headers.clone(),
                    rest: t.rest.to_string(),
                    query: parts.uri.query().map(str::to_string),
                    body,
                    identity,
                    call: Call::Mcp(McpCall {
                        id: call.id.clone(),
                        tool: call.name.clone(),
                        modern,
                    }),
                    early: None,
                    _held: held,
                };
                match self.claim(job).await {
                    Ok(resp) => Ok(resp),
                    Err(e) => Ok(problem(e)),
                }
            }
        }
    }

    /// A client's cancel of guarded call `action` (SPEC §14.3): while the call runs (or its
    /// claim is being made), the cancel is not forwarded, since the server would stop a call
    /// that may already have taken effect; it is noted in the write log, and answered 202 as
    /// the server answers a notification. `None`: the call has ended, the cancel goes on.
    async fn absorb_cancel(&self, action: &str) -> Option<Response<ProxyBody>> {
        // Unsure whether the call runs (a store error): the cancel is held back, on the side
        // of the write.
        let rec = self.store.get(action).await.unwrap_or_default();
        let running = rec.as_ref().is_none_or(|r| {
            r.state == State::InFlight
                || (r.state == State::Unknown
                    && r.evidence.last().is_some_and(|a| a.ended_at.is_none()))
        });
        if !running {
            return None;
        }
        tracing::info!(
            action,
            "a client's cancel of a guarded tool call was not forwarded"
        );
        if let Some(r) = &rec {
            self.store.note(
                LogEvent::for_record(Event::Rejected, r, Actor::Proxy)
                    .outcome("in-flight")
                    .detail("cancel-requested: not forwarded, the call runs to its end"),
            );
        }
        let mut resp = Response::new(crate::upstream::empty());
        *resp.status_mut() = http::StatusCode::ACCEPTED;
        Some(resp)
    }

    /// A read on an MCP upstream, its body already buffered. `learn`: the answer lists the
    /// server's tools, and the upstream trusts their annotations.
    async fn mcp_read(
        &self,
        t: &Target<'_>,
        policy: &Policy,
        parts: http::request::Parts,
        body: Bytes,
        learn: bool,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let resp = self
            .forward(t, policy, parts, http_body_util::Full::new(body))
            .await?;
        Ok(if learn {
            let upstream = t.upstream.name.clone();
            let annotations = self.annotations.clone();
            resp.map(|b| {
                Learn {
                    inner: b,
                    seen: Vec::new(),
                    done: Some(Box::new(move |answer: &[u8]| {
                        annotations.learn(&upstream, answer)
                    })),
                }
                .boxed_unsync()
            })
        } else {
            resp.map(|b| b.map_err(Into::into).boxed_unsync())
        })
    }
}

type Learned = Box<dyn FnOnce(&[u8]) + Send>;

/// A `tools/list` answer on its way to the client, read along to learn the tools' annotations
/// once it is complete.
struct Learn {
    inner: Incoming,
    seen: Vec<u8>,
    done: Option<Learned>,
}

impl Learn {
    fn finish(&mut self) {
        if let Some(done) = self.done.take() {
            done(&self.seen);
        }
    }
}

impl Body for Learn {
    type Data = Bytes;
    type Error = crate::upstream::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(d) = frame.data_ref() {
                    if self.seen.len() + d.len() <= LIST_MAX {
                        self.seen.extend_from_slice(d);
                    } else {
                        self.done = None; // too large to read: passed through unread
                    }
                }
                if self.inner.is_end_stream() {
                    self.finish();
                }
            }
            Poll::Ready(None) => self.finish(),
            _ => {}
        }
        polled.map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

//! The request path, as named phases (SPEC §5):
//!
//! ```text
//! frame → route → classify ─ read ──→ forward (streamed both ways)
//!                           ├ deny ──→ 403 route-denied
//!                           └ write ─→ buffer → identify → claim ─┬→ replay / in-flight / unknown / …
//!                                                                  └→ send → settle → answer
//! ```
//! Each phase returns early with a [`ProxyError`]; `error.rs` turns it into the problem response.
//! From the claim on, a write runs in the action's own task: it belongs to the action, not to the
//! client's connection, so a client that goes away cancels neither the claim nor the attempt.
//!
//! - this file: the proxy, `frame → route → classify`, and reads;
//! - `write.rs`: `buffer → identify → claim`, replays and problems about an existing action;
//! - `attempt.rs`: `send → settle → answer`, in the action's task;
//! - `own.rs`: the proxy's own paths (`/_oncegate/tasks/{task}`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue};
use http::{Method, Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

mod attempt;
mod detach;
mod mcp;
mod oauth;
mod own;
mod protocol;
mod relay;
mod resume;
mod write;

use protocol::{Call, McpCall};

pub use attempt::{external_id, stamp, SETTLE_PATIENCE};
use attempt::{write_headers, Unsettled};
pub use own::task_entry;

use crate::action::{
    BodyRef, Claim, ClaimRequest, Clock, Millis, Record, RequestInfo, SettleError, Settlement,
    Source, State, StoredResponse, Try, TwinGuard,
};
use crate::config::{Config, Policy, Protocol, Upstream};
use crate::error::{action_json, ActionCtx, Completed, Outcome, ProxyError};
use crate::identity::{self, Identity, KeyError};
use crate::log::{Actor, Event, LogEvent};
use crate::lookup;
use crate::metrics::Metrics;
use crate::redact::Redactor;
use crate::route::{route, Class, RouteError, Target};
use crate::store::{BoxFuture, Filter, SettleRequest, Store, StoreError};
use crate::upstream::{
    full, strip_not_forwarded, AttemptResult, Outgoing, Prefixed, ProxyBody, Unfenced, Upstreams,
};

/// The largest response head (header names and values) stored for replay. A succeeded write
/// whose head is larger reaches its client whole, but a duplicate gets 409 `already-applied`, as
/// for a body over `max_stored_response`: it keeps records small (`store::sled::RECORD_MAX`).
pub const STORED_HEAD_MAX: usize = 16 * 1024;

/// The header every answer of the proxy's own carries its outcome in.
static OUTCOME: http::HeaderName = http::HeaderName::from_static("oncegate-outcome");

/// Wakes requests waiting for an in-flight attempt of the same action, by action id
/// ([`crate::FastMap`]).
#[derive(Default)]
struct Waiters(Mutex<crate::FastMap<String, Arc<Notify>>>);

impl Waiters {
    fn get(&self, id: &str) -> Arc<Notify> {
        let mut m = self
            .0
            .lock()
            .expect("waiters lock is never poisoned: no panics inside");
        m.entry(id.to_string()).or_default().clone()
    }

    /// Drops a waiter's registration; the entry goes once nobody waits on it.
    fn release(&self, id: &str, mine: Arc<Notify>) {
        drop(mine);
        let mut m = self
            .0
            .lock()
            .expect("waiters lock is never poisoned: no panics inside");
        if m.get(id).is_some_and(|n| Arc::strong_count(n) == 1) {
            m.remove(id);
        }
    }

    fn wake(&self, id: &str) {
        let n = self
            .0
            .lock()
            .expect("waiters lock is never poisoned: no panics inside")
            .remove(id);
        if let Some(n) = n {
            n.notify_waiters();
        }
    }
}

/// The proxy: shared by every connection.
pub struct Proxy {
    pub(crate) config: Arc<Config>,
    pub(crate) upstreams: Arc<Upstreams>,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) redactor: Redactor,
    pub(crate) clock: Clock,
    /// This process's identity as the owner of in-flight claims.
    pub(crate) owner: String,
    /// The store's secret, which keys principals, fingerprints and body digests (SPEC §13).
    pub(crate) keyer: crate::identity::Keyer,
    waiters: Waiters,
    /// Attempts running in their own tasks; drained on shutdown.
    attempts: TaskTracker,
    /// Cancelled at the drain deadline: attempts still running are cut and recorded unknown.
    deadline: CancellationToken,
    /// Cancelled when shutdown starts: exchanges kept open for a late answer are let go.
    stopping: CancellationToken,
    /// Read-only tools learned from trusted MCP servers' `tools/list` answers (SPEC §14.1).
    annotations: Arc<crate::mcp::Annotations>,
    /// The proxy listener's address: a loopback one makes MCP upstreams check `Host` too
    /// (SPEC §14.6).
    pub(crate) local: Option<std::net::SocketAddr>,
    /// Guarded MCP tool calls seen, for the cancels that name them (SPEC §14.3).
    calls: crate::mcp::calls::Calls,
    /// Calls whose stream the server ended for the client to resume (SPEC §14.3).
    resumes: Arc<crate::mcp::calls::Resumes>,
    /// Where each MCP upstream's server said its OAuth metadata is (SPEC §14.6).
    metadata_paths: Mutex<std::collections::HashMap<String, String>>,
    /// Bytes of request bodies held in memory now, all requests together (`max_buffered`).
    buffered: Arc<std::sync::atomic::AtomicU64>,
}

/// What a claim leads to.
enum Next {
    /// The action's attempt is this request's: its record as claimed, and when the claim was
    /// asked for (the claim's commit fences the attempt's first try, SPEC §13).
    Attempt(Arc<Record>, std::time::Instant),
    Replay(Arc<Record>),
}

/// The request as the write path keeps it.
struct WriteJob {
    upstream: Arc<Upstream>,
    policy: Arc<Policy>,
    method: Method,
    headers: HeaderMap,
    rest: String,
    query: Option<String>,
    body: Bytes,
    identity: Identity,
    /// Plain HTTP, or an MCP tool call: the protocol seam.
    call: Call,
    /// Where an answer that streams (a relayed SSE answer) is handed to the client while the
    /// action's task goes on reading it.
    early: Option<tokio::sync::oneshot::Sender<Response<ProxyBody>>>,
    /// The body's share of `max_buffered`, given back when the job ends.
    _held: write::Held,
}

fn content_length(h: &HeaderMap) -> Option<u64> {
    h.get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Refuses ambiguous framing (request smuggling): CL + TE, or more than one Content-Length.
/// hyper hides both cases; the connection's [`crate::framing::FramingGuard`] marks them.
fn check_framing(h: &HeaderMap) -> Result<(), ProxyError> {
    // One pass over the names, no hashing: the guard's marks are rare.
    if h.keys()
        .any(|k| matches!(k.as_str(), crate::framing::MARK | crate::framing::MARK_TE))
    {
        return Err(ProxyError::BadRequest(
            "the request has both Content-Length and Transfer-Encoding, or more than one Content-Length".into(),
        ));
    }
    let cls = h.get_all(http::header::CONTENT_LENGTH).iter().count();
    if cls > 1 {
        return Err(ProxyError::BadRequest(
            "the request has more than one Content-Length".into(),
        ));
    }
    if cls == 1 && h.contains_key(http::header::TRANSFER_ENCODING) {
        return Err(ProxyError::BadRequest(
            "the request has both Content-Length and Transfer-Encoding".into(),
        ));
    }
    Ok(())
}

fn store_unavailable(e: StoreError, ctx: Option<Box<ActionCtx>>) -> ProxyError {
    ProxyError::StoreUnavailable {
        error: e.to_string(),
        ctx,
    }
}

impl Proxy {
    pub fn new(
        config: Arc<Config>,
        store: Arc<dyn Store>,
        metrics: Arc<Metrics>,
        clock: Clock,
    ) -> Result<Proxy, String> {
        if !store.keyer().is_keyed() {
            tracing::warn!(
                "store: made before stores had a secret, so the principals, fingerprints and body digests it keeps are plain SHA-256, against which a reader of its write log can test a guessed body or credential; a new store keys them (docs/operations.md, \"A store without a secret\")"
            );
        }
        metrics.prepare(config.upstreams.iter().map(|u| u.label));
        Ok(Proxy {
            clock,
            upstreams: Arc::new(Upstreams::new(&config)?),
            metrics,
            redactor: Redactor::new(&config),
            owner: format!("{}-{:08x}", std::process::id(), rand::random::<u32>()),
            config,
            keyer: store.keyer(),
            store,
            waiters: Waiters::default(),
            attempts: TaskTracker::new(),
            deadline: CancellationToken::new(),
            stopping: CancellationToken::new(),
            annotations: Arc::default(),
            local: None,
            calls: Default::default(),
            resumes: Arc::default(),
            metadata_paths: Mutex::default(),
            buffered: Arc::default(),
        })
    }

    pub fn attempts(&self) -> &TaskTracker {
        &self.attempts
    }

    /// Shutdown has started: stops waiting for late answers to calls already recorded unknown.
    pub fn stop_listening(&self) {
        self.stopping.cancel();
    }

    /// Whether shutdown has started (`/readyz` says so).
    pub fn draining(&self) -> bool {
        self.stopping.is_cancelled()
    }

    /// Cuts the attempts still running: the drain deadline has come.
    pub fn cut_attempts(&self) {
        self.deadline.cancel();
    }

    /// Serves one request. Errors are logged here, once, and answered as problems.
    pub async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<ProxyBody> {
        // A debug span: free unless asked for (RUST_LOG=oncegate=debug, or `[telemetry]`).
        let span = tracing::debug_span!(
            "request",
            method = %req.method(),
            path = %self.redactor.path(req.uri().path(), req.uri().query()),
            upstream = tracing::field::Empty,
            class = tracing::field::Empty,
            action = tracing::field::Empty,
            key_source = tracing::field::Empty,
            tool = tracing::field::Empty,
            outcome = tracing::field::Empty,
            status = tracing::field::Empty,
        );
        crate::telemetry::continue_trace(&span, req.headers());
        async move {
            let mut labels: (&'static str, &'static str) = ("-", "-");
            let (resp, outcome) = match self.call(req, &mut labels).await {
                Ok(resp) => {
                    tracing::debug!(status = resp.status().as_u16(), "answered");
                    // MCP problems are answered, not raised (SPEC §14.4): their outcome is
                    // in the header, as every other answer's.
                    let outcome = match resp.headers().get(&OUTCOME) {
                        None => crate::metrics::FORWARDED,
                        Some(v) => {
                            Outcome::from_header(v.as_bytes()).map_or("other", Outcome::as_str)
                        }
                    };
                    (resp, outcome)
                }
                Err(err) => {
                    tracing::info!(error = %err, upstream = labels.0, "problem");
                    let outcome = err.outcome().as_str();
                    (err.into_response(), outcome)
                }
            };
            self.metrics.request(labels.0, labels.1, outcome);
            let span = tracing::Span::current();
            if !span.is_disabled() {
                span.record("outcome", outcome);
                span.record("status", resp.status().as_u16());
            }
            resp
        }
        .instrument(span)
        .await
    }

    /// Routes and classifies; `labels` receives the upstream and class for metrics.
    async fn call(
        self: &Arc<Self>,
        req: Request<Incoming>,
        labels: &mut (&'static str, &'static str),
    ) -> Result<Response<ProxyBody>, ProxyError> {
        check_framing(req.headers())?;
        // A clone of the URI shares its bytes: the path outlives `req`, which the phases take.
        let uri = req.uri().clone();
        let path = uri.path();
        if path == "/_oncegate" || path.starts_with("/_oncegate/") {
            // Boxed, like the write path below: the read path's future stays small (it is
            // moved into hyper's connection task for every request).
            return Box::pin(self.own(req, path)).await;
        }
        if let Some(at) = self.oauth_path(req.method(), path) {
            // An MCP server's OAuth metadata, as the proxy's own (SPEC §14.6).
            return Box::pin(self.oauth(at, req)).await;
        }
        let target = route(&self.config, req.method(), path, uri.query(), req.headers()).map_err(
            |e| match e {
                RouteError::NoRoute => ProxyError::NoRoute(path.to_string()),
                RouteError::BadPath(why) => ProxyError::BadRequest(why),
            },
        )?;
        *labels = (target.upstream.label, target.class.as_str());
        if let Protocol::Mcp(rules) = &target.upstream.protocol {
            // The one protocol seam of this phase: MCP classifies by message (SPEC §14.1).
            return Box::pin(self.mcp(target, rules, req, labels)).await;
        }
        let span = tracing::Span::current();
        span.record("upstream", target.upstream.name.as_str());
        span.record("class", target.class.as_str());
        if target.class == Class::Read {
            return self.read(target, req).await;
        }
        // Writes and denied requests are audited: keep what the write log needs (the principal
        // is computed once, for the action's identity and for the log).
        let method = req.method().clone();
        let query = req.uri().query().map(str::to_string);
        let principal = identity::principal(req.headers(), target.policy, &self.keyer);
        let result = match target.class {
            Class::Deny => Err(ProxyError::RouteDenied {
                method: method.to_string(),
                path: self.redactor.path(path, req.uri().query()),
            }),
            _ => Box::pin(self.write(&target, req, &principal)).await,
        };
        if let Err(e) = &result {
            let shown = || self.redactor.path(&target.rest, query.as_deref());
            self.note_problem(e, target.upstream, &method, shown, &principal, None);
        }
        result
    }

    /// Logs a refused write (`rejected`) or a duplicate turned away (`conflict`). Outcomes of
    /// attempts are logged by the store with the state change itself.
    fn note_problem(
        &self,
        e: &ProxyError,
        up: &Upstream,
        method: &Method,
        path: impl FnOnce() -> String,
        principal: &str,
        tool: Option<&str>,
    ) {
        let event = match e {
            ProxyError::KeyReused(_)
            | ProxyError::InFlight { .. }
            | ProxyError::OutcomeUnknown {
                lost_now: false, ..
            }
            | ProxyError::AttemptsExhausted(_)
            | ProxyError::PossibleDuplicate(_)
            | ProxyError::AlreadyApplied(_) => Event::Conflict,
            ProxyError::KeyInvalid(_)
            | ProxyError::KeyRequired
            | ProxyError::BodyTooLarge { .. }
            | ProxyError::BodyTimeout(_)
            | ProxyError::Busy { .. }
            | ProxyError::RouteDenied { .. }
            | ProxyError::ForeignOrigin(_)
            | ProxyError::BadRequest(_) => Event::Rejected,
            _ => return,
        };
        let ev = match e.record() {
            Some(r) => LogEvent::for_record(event, r, Actor::Proxy),
            None => {
                let mut ev = LogEvent::bare(event, Actor::Proxy);
                ev.upstream = Some(up.name.clone());
                ev.method = Some(method.to_string());
                ev.path = Some(path());
                ev.principal = Some(identity::principal_short(principal).to_string());
                ev.tool = tool.map(str::to_string);
                ev
            }
        };
        self.store
            .note(ev.outcome(e.outcome().as_str()).detail(e.name()));
    }

    /// Phase `forward`: a read, streamed both ways.
    async fn read(
        &self,
        t: Target<'_>,
        req: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let (parts, body) = req.into_parts();
        let resp = self.forward(&t, t.policy, parts, body).await?;
        Ok(resp.map(|b| b.map_err(Into::into).boxed_unsync()))
    }

    /// Sends a read upstream and answers its response head; the body streams.
    async fn forward<B>(
        &self,
        t: &Target<'_>,
        policy: &Policy,
        parts: http::request::Parts,
        body: B,
    ) -> Result<Response<Incoming>, ProxyError>
    where
        B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<crate::upstream::BoxError>,
    {
        let out = Outgoing::from_owned(
            t.upstream,
            &parts.method,
            parts.headers,
            &t.rest,
            parts.uri.query(),
            None,
        )
        .map_err(|e| ProxyError::BadRequest(format!("cannot build the upstream request: {e}")))?;
        let started = std::time::Instant::now();
        let answer = self
            .upstreams
            .forward_read(t.upstream, policy, out, body)
            .await;
        self.metrics
            .upstream_latency(t.upstream.label, started.elapsed().as_secs_f64());
        match answer {
            Ok(resp) => {
                let (mut head, body) = resp.into_parts();
                strip_not_forwarded(&mut head.headers);
                Ok(Response::from_parts(head, body))
            }
            Err(crate::upstream::ReadFailure::Unreachable(error)) => {
                Err(ProxyError::UpstreamUnreachable { ctx: None, error })
            }
            Err(crate::upstream::ReadFailure::Timeout(d)) => Err(ProxyError::UpstreamTimeout(d)),
            Err(crate::upstream::ReadFailure::Failed(e)) => Err(ProxyError::UpstreamFailed(e)),
        }
    }
}

//! The request path, as named phases (SPEC §5):
//!
//! ```text
//! frame → route → classify ─ read ──→ forward (streamed both ways)
//!                           ├ deny ──→ 403 route-denied
//!                           └ write ─→ buffer → identify → claim ─┬→ replay / in-flight / unknown / …
//!                                                                  └→ send → settle → answer
//! ```
//! Each phase returns early with a [`ProxyError`]; `error.rs` turns it into the problem response.
//! The attempt (send + settle) runs in its own task: it belongs to the action, not to the client's
//! connection, so a client that goes away does not cancel it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue};
use http::{Method, Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::action::{
    BodyRef, Claim, ClaimRequest, Clock, Millis, Record, RequestInfo, Settlement, Source, State,
    StoredResponse, Try,
};
use crate::config::{Config, Policy, Upstream};
use crate::error::{action_json, ActionCtx, Completed, Outcome, ProxyError};
use crate::identity::{self, Identity, KeyError};
use crate::log::{Actor, Event, LogEvent};
use crate::lookup;
use crate::metrics::Metrics;
use crate::redact::{latin1, Redactor};
use crate::replay::replay;
use crate::route::{route, Class, RouteError, Target};
use crate::store::{Filter, SettleRequest, Store, StoreError};
use crate::upstream::{
    full, is_applied, strip_hop_by_hop, AttemptResult, Outgoing, Prefixed, ProxyBody, Upstreams,
};

/// The largest response head (header names and values) stored for replay. A succeeded write
/// whose head is larger reaches its client whole, but a duplicate gets 409 `already-applied`, as
/// for a body over `max_stored_response`: it keeps records small (`store::sled::RECORD_MAX`).
pub const STORED_HEAD_MAX: usize = 16 * 1024;

/// How long the outcome of an attempt is retried against a store that cannot take it: longer
/// than a routine database restart (SPEC §6).
pub const SETTLE_PATIENCE: Duration = Duration::from_secs(30);

/// A task aborted when its handle is dropped: a lease renewer ends with its attempt, however
/// the attempt ends (a panic included).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Statuses after which sending the same write again unchanged is not expected to work.
const NEEDS_DECISION: &[u16] = &[400, 401, 403, 404, 405, 409, 410, 422];

/// Wakes requests waiting for an in-flight attempt of the same action.
#[derive(Default)]
struct Waiters(Mutex<HashMap<String, Arc<Notify>>>);

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
    waiters: Waiters,
    /// Attempts running in their own tasks; drained on shutdown.
    attempts: TaskTracker,
    /// Cancelled at the drain deadline: attempts still running are cut and recorded unknown.
    deadline: CancellationToken,
}

/// What a claim leads to.
enum Next {
    Attempt(Record),
    Replay(Record),
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
    if h.contains_key(crate::framing::MARK) || h.contains_key(crate::framing::MARK_TE) {
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

/// Takes the external id from a response: `header:NAME` or a JSON pointer into the body.
pub fn external_id(spec: &str, headers: &HeaderMap, body: &[u8]) -> Option<String> {
    if let Some(name) = spec.strip_prefix("header:") {
        return headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
    }
    let v: Value = serde_json::from_slice(body).ok()?;
    match v.pointer(spec)? {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    }
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
        Ok(Proxy {
            clock,
            upstreams: Arc::new(Upstreams::new(&config)?),
            metrics,
            redactor: Redactor::new(&config),
            owner: format!("{}-{:08x}", std::process::id(), rand::random::<u32>()),
            config,
            store,
            waiters: Waiters::default(),
            attempts: TaskTracker::new(),
            deadline: CancellationToken::new(),
        })
    }

    pub fn attempts(&self) -> &TaskTracker {
        &self.attempts
    }

    /// Cuts the attempts still running: the drain deadline has come.
    pub fn cut_attempts(&self) {
        self.deadline.cancel();
    }

    /// Serves one request. Errors are logged here, once, and answered as problems.
    pub async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<ProxyBody> {
        // A debug span: free unless asked for (RUST_LOG=oncegate=debug).
        let span = tracing::debug_span!(
            "request",
            method = %req.method(),
            path = %self.redactor.path(req.uri().path(), req.uri().query()),
            upstream = tracing::field::Empty,
            class = tracing::field::Empty,
            action = tracing::field::Empty,
        );
        async move {
            let mut labels: (&'static str, &'static str) = ("-", "-");
            let (resp, outcome) = match self.call(req, &mut labels).await {
                Ok(resp) => {
                    tracing::debug!(status = resp.status().as_u16(), "answered");
                    let outcome = match resp.headers().get("oncegate-outcome").map(|v| v.as_bytes())
                    {
                        None => "forwarded",
                        Some(b"sent") => Outcome::Sent.as_str(),
                        Some(b"replayed") => Outcome::Replayed.as_str(),
                        Some(b"unknown") => Outcome::Unknown.as_str(),
                        Some(b"not-applied") => Outcome::NotApplied.as_str(),
                        Some(_) => "other",
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
        let target =
            route(&self.config, req.method(), path, req.headers()).map_err(|e| match e {
                RouteError::NoRoute => ProxyError::NoRoute(path.to_string()),
                RouteError::BadPath(why) => ProxyError::BadRequest(why),
            })?;
        *labels = (target.upstream.label, target.class.as_str());
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
        let principal = identity::principal(req.headers(), target.policy);
        let result = match target.class {
            Class::Deny => Err(ProxyError::RouteDenied {
                method: method.to_string(),
                path: self.redactor.path(path, req.uri().query()),
            }),
            _ => Box::pin(self.write(&target, req, &principal)).await,
        };
        if let Err(e) = &result {
            let shown = || self.redactor.path(&target.rest, query.as_deref());
            self.note_problem(e, target.upstream, &method, shown, &principal);
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
    ) {
        let event = match e {
            ProxyError::KeyReused(_)
            | ProxyError::InFlight { .. }
            | ProxyError::OutcomeUnknown {
                lost_now: false, ..
            }
            | ProxyError::AttemptsExhausted(_)
            | ProxyError::AlreadyApplied(_) => Event::Conflict,
            ProxyError::KeyInvalid(_)
            | ProxyError::KeyRequired
            | ProxyError::BodyTooLarge { .. }
            | ProxyError::BodyTimeout(_)
            | ProxyError::RouteDenied { .. }
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
            .forward_read(t.upstream, t.policy, &out, body)
            .await;
        self.metrics
            .upstream_latency(t.upstream.label, started.elapsed().as_secs_f64());
        match answer {
            Ok(resp) => {
                let (mut head, body) = resp.into_parts();
                strip_hop_by_hop(&mut head.headers);
                Ok(Response::from_parts(
                    head,
                    body.map_err(Into::into).boxed_unsync(),
                ))
            }
            Err(crate::upstream::ReadFailure::Unreachable(error)) => {
                Err(ProxyError::UpstreamUnreachable { ctx: None, error })
            }
            Err(crate::upstream::ReadFailure::Timeout(d)) => Err(ProxyError::UpstreamTimeout(d)),
            Err(crate::upstream::ReadFailure::Failed(e)) => Err(ProxyError::UpstreamFailed(e)),
        }
    }

    /// Phases `buffer` and `identify`, then `claim`.
    async fn write(
        self: &Arc<Self>,
        t: &Target<'_>,
        req: Request<Incoming>,
        principal: &str,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let (parts, body) = req.into_parts();
        let max = self.config.server.max_body;
        if content_length(&parts.headers).is_some_and(|n| n > max) {
            return Err(ProxyError::BodyTooLarge { limit: max });
        }
        let limit = self.config.server.body_timeout;
        let body = tokio::time::timeout(
            limit,
            http_body_util::Limited::new(body, max as usize).collect(),
        )
        .await
        .map_err(|_| ProxyError::BodyTimeout(limit))?
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                ProxyError::BodyTooLarge { limit: max }
            } else {
                ProxyError::BadRequest(format!("could not read the request body: {e}"))
            }
        })?
        .to_bytes();
        let query = parts.uri.query().map(str::to_string);
        let identity = identity::identify(
            &identity::WriteRequest {
                upstream: &t.upstream.name,
                method: parts.method.as_str(),
                rest: &t.rest,
                query: query.as_deref().unwrap_or(""),
                headers: &parts.headers,
                body: &body,
                principal,
            },
            t.policy,
        )
        .map_err(|e| match e {
            KeyError::Invalid(m) => ProxyError::KeyInvalid(m),
            KeyError::Required => ProxyError::KeyRequired,
        })?;
        tracing::Span::current().record("action", identity.action_id.as_str());
        let job = WriteJob {
            upstream: t.upstream.clone(),
            policy: t.policy.clone(),
            method: parts.method,
            headers: parts.headers,
            rest: t.rest.to_string(),
            query,
            body,
            identity,
        };
        let resp = self.claim(job).await?;
        Ok(resp)
    }

    fn fresh_record(&self, job: &WriteJob) -> Record {
        let id = &job.identity;
        Record {
            upstream: job.upstream.name.clone(),
            principal: id.principal.clone(),
            key: id.key.clone(),
            method: job.method.to_string(),
            path: self.redactor.path(&job.rest, job.query.as_deref()),
            task: id.task.clone(),
            step: id.step.clone(),
            retention_ms: job.policy.retention.as_millis() as u64,
            request: RequestInfo {
                headers: self.redactor.headers(&job.headers),
                headers_dropped: 0,
                body_size: job.body.len() as u64,
                body_sha256: hex::encode(Sha256::digest(&job.body)),
            },
            ..Record::new(id.action_id.clone(), id.fingerprint.clone())
        }
    }

    /// How long an attempt may run, at most: its lease.
    fn lease(policy: &Policy) -> Millis {
        let tries = u64::from(policy.retries) + 1;
        policy.timeout.as_millis() as u64 * tries
            + policy.max_retry_wait.as_millis() as u64 * u64::from(policy.retries)
            + 2_000
    }

    /// Phase `claim`: decides what this request gets (SPEC §5 step 2), then acts on it.
    ///
    /// From the claim on, the work belongs to the action, not to the client's connection (SPEC
    /// §5 step 4): it runs in a task of its own, so a client that goes away while its claim is
    /// being made durable (or its attempt runs) cancels nothing, and the action never stays
    /// `in_flight` with no attempt behind it.
    async fn claim(self: &Arc<Self>, job: WriteJob) -> Result<Response<ProxyBody>, ProxyError> {
        // A duplicate of a write that succeeded, held in memory: the answer a claim would give,
        // without building the fresh record or asking the writer.
        if let Some((rec, body)) = self.store.cached(&job.identity.action_id) {
            if rec.fingerprint == job.identity.fingerprint && !rec.is_expired((self.clock)()) {
                return self.replay(&rec, body).await;
            }
        }
        let me = self.clone();
        let claimed = Arc::new(Mutex::new(None));
        let slot = claimed.clone();
        let span = tracing::Span::current();
        let task = self
            .attempts
            .spawn(async move { me.claim_and_act(job, slot).await }.instrument(span));
        match task.await {
            Ok(r) => r,
            Err(e) => {
                let claimed = claimed
                    .lock()
                    .expect("the claimed slot is never poisoned: it is only set")
                    .take();
                self.after_panic(e, claimed).await
            }
        }
    }

    /// The claim and what follows it, in the action's own task. `claimed` receives the record
    /// once this task owns an attempt, for [`Proxy::after_panic`].
    async fn claim_and_act(
        self: Arc<Self>,
        job: WriteJob,
        claimed: Arc<Mutex<Option<Record>>>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let fresh = self.fresh_record(&job);
        let mut waiter = None;
        let next = self.decide(&job, &fresh, &mut waiter).await;
        if let Some(w) = waiter {
            self.waiters.release(&fresh.id, w);
        }
        match next? {
            Next::Attempt(rec) => {
                if let Ok(mut slot) = claimed.lock() {
                    *slot = Some(rec.clone());
                }
                self.run_attempt(job, rec).await
            }
            Next::Replay(rec) => self.replay(&rec, None).await,
        }
    }

    /// The action's task ended in a panic (a bug). If it had claimed an attempt, the request may
    /// have left: the action is recorded `unknown` and the client told so (SPEC §6), never
    /// "nothing was sent".
    async fn after_panic(
        &self,
        e: tokio::task::JoinError,
        claimed: Option<Record>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        tracing::error!(error = %e, "the task of a write ended without an answer");
        let Some(rec) = claimed else {
            // It ended before owning an attempt: nothing was sent.
            return Err(ProxyError::StoreUnavailable {
                error: format!("internal error before the write was sent: {e}"),
                ctx: None,
            });
        };
        let reason = format!(
            "internal error during the attempt ({e}); the request may have reached the upstream"
        );
        let req = SettleRequest {
            id: rec.id.clone(),
            attempt: rec.attempts,
            settlement: Settlement {
                state: State::Unknown,
                tries: vec![Try {
                    at: (self.clock)(),
                    phase: Some(crate::action::Phase::Send),
                    error: Some(reason.clone()),
                    ..Try::default()
                }],
                response: None,
                external_id: None,
                needs_decision: false,
                now: (self.clock)(),
            },
            body: None,
        };
        let rec = self.settle(req, &rec).await?;
        Err(ProxyError::OutcomeUnknown {
            ctx: self.ctx(rec).await,
            lost_now: true,
            reason,
        })
    }

    /// Claims the action, waiting up to `in_flight_wait` for a running attempt to end.
    async fn decide(
        &self,
        job: &WriteJob,
        fresh: &Record,
        waiter: &mut Option<Arc<Notify>>,
    ) -> Result<Next, ProxyError> {
        let wait_until = tokio::time::Instant::now() + job.policy.in_flight_wait;
        // What this request's lookup concluded, when it ran and settled nothing.
        let mut looked_up: Option<String> = None;
        loop {
            // Registered only once a wait is needed, so other answers leave nothing behind.
            let notify = waiter.clone().unwrap_or_default();
            let notified = notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let claim = self
                .store
                .claim(ClaimRequest {
                    fresh: fresh.clone(),
                    key_source: job.identity.source,
                    max_attempts: job.policy.max_attempts,
                    owner: self.owner.clone(),
                    lease: Self::lease(&job.policy),
                    now: (self.clock)(),
                })
                .await
                .map_err(|e| store_unavailable(e, None))?;
            let rec = match claim {
                Claim::Claimed(rec) => return Ok(Next::Attempt(rec)),
                Claim::KeyReused(rec) => return Err(ProxyError::KeyReused(self.ctx(rec).await)),
                Claim::Exhausted(rec) => {
                    return Err(ProxyError::AttemptsExhausted(self.ctx(rec).await))
                }
                Claim::Existing(rec) => rec,
            };
            match rec.state {
                State::Succeeded => return Ok(Next::Replay(rec)),
                State::InFlight => {
                    let now = tokio::time::Instant::now();
                    if now < wait_until {
                        if waiter.is_none() {
                            *waiter = Some(self.waiters.get(&fresh.id));
                            continue;
                        }
                        // Woken when the attempt settles here; polled for other proxies.
                        let slice = (wait_until - now).min(Duration::from_millis(100));
                        let _ = tokio::time::timeout(slice, notified).await;
                        continue;
                    }
                    let secs = (job.policy.timeout.as_secs() / 2).clamp(1, 30);
                    return Err(ProxyError::InFlight {
                        ctx: self.ctx(rec).await,
                        retry_after_secs: secs,
                    });
                }
                State::Unknown if job.policy.lookup.is_some() && looked_up.is_none() => {
                    // SPEC §9: a duplicate asks the upstream (with its own credentials) first.
                    looked_up = Some(String::from("the lookup could not run"));
                    let verdict = lookup::lookup(
                        &self.upstreams,
                        self.store.as_ref(),
                        &job.upstream,
                        &rec,
                        Some(&job.headers),
                        (self.clock)(),
                    )
                    .await;
                    match verdict {
                        Ok(v) => {
                            self.metrics.lookup(v.label());
                            if let lookup::Verdict::Unknown(why) = v {
                                looked_up = Some(why);
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "lookup could not settle"),
                    }
                    // Settled (or settled meanwhile): claim again and act on the new state.
                    continue;
                }
                State::Unknown => {
                    let mut reason = String::from(
                        "an earlier attempt may have been applied; nothing is sent until it is settled",
                    );
                    if let Some(why) = looked_up {
                        reason = format!("{reason} (status lookup: {why})");
                    }
                    return Err(ProxyError::OutcomeUnknown {
                        ctx: self.ctx(rec).await,
                        lost_now: false,
                        reason,
                    });
                }
                // A claim never leaves a claimable `failed` record as `Existing`.
                State::Failed => return Err(ProxyError::AttemptsExhausted(self.ctx(rec).await)),
            }
        }
    }

    /// The problem context of a record: the record and its task's completed work.
    async fn ctx(&self, record: Record) -> Box<ActionCtx> {
        let completed = match &record.task {
            None => Vec::new(),
            Some(task) => self
                .store
                .scan(
                    Filter {
                        state: Some(State::Succeeded),
                        upstream: Some(record.upstream.clone()),
                        principal: Some(record.principal.clone()),
                        task: Some(task.clone()),
                        ..Filter::default()
                    },
                    1000,
                )
                .await
                .unwrap_or_default()
                .into_iter()
                .map(|r| Completed {
                    action: r.id,
                    step: r.step,
                    status: r.response.as_ref().map(|s| s.status),
                    external_id: r.external_id,
                })
                .collect(),
        };
        Box::new(ActionCtx { record, completed })
    }

    /// Phase `replay` (SPEC §7).
    /// `body`: the stored body when the caller holds it already.
    async fn replay(
        &self,
        rec: &Record,
        body: Option<Bytes>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let stored = rec.response.as_ref().filter(|r| r.body != BodyRef::Absent);
        if stored.is_none() {
            return Err(ProxyError::AlreadyApplied(self.ctx(rec.clone()).await));
        }
        let body = match body {
            Some(b) => b,
            None => match self.store.body(rec).await {
                Ok(Some(b)) => b,
                // The body is gone for good: the write is applied all the same.
                Ok(None) => return Err(ProxyError::AlreadyApplied(self.ctx(rec.clone()).await)),
                // It cannot be read at this moment: ask again later, and get the replay (SPEC §6).
                Err(e) => return Err(store_unavailable(e, None)),
            },
        };
        let mut resp = replay(rec, body);
        write_headers(resp.headers_mut(), rec, Outcome::Replayed);
        self.store.note(
            LogEvent::for_record(Event::Replayed, rec, Actor::Proxy)
                .status(rec.response.as_ref().map(|r| r.status))
                .outcome(Outcome::Replayed.as_str()),
        );
        Ok(resp)
    }

    /// Phases `send`, `settle` and `answer`, in the action's task.
    async fn run_attempt(
        self: Arc<Self>,
        job: WriteJob,
        rec: Record,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let policy = &job.policy;
        let key_header = policy
            .key_header
            .as_ref()
            .map(|h| (h, job.identity.key.as_str()));
        // Stamping writes the key into the body (after fingerprinting, which saw the original).
        let (headers, body) = match &policy.stamp {
            Some(at) => {
                let body = stamp(&job.headers, &job.body, at, &job.identity.key);
                let mut h = job.headers.clone();
                h.insert(http::header::CONTENT_LENGTH, HeaderValue::from(body.len()));
                (std::borrow::Cow::Owned(h), body)
            }
            None => (std::borrow::Cow::Borrowed(&job.headers), job.body.clone()),
        };
        let out = Outgoing::new(
            &job.upstream,
            &job.method,
            &headers,
            &job.rest,
            job.query.as_deref(),
            key_header,
        );
        // While the attempt runs, its lease is renewed, so that other proxies sharing the store
        // never take a slow attempt for a dead one.
        let renewer = {
            let (store, id, owner) = (self.store.clone(), rec.id.clone(), self.owner.clone());
            let (lease, clock) = (Self::lease(policy), self.clock.clone());
            AbortOnDrop(tokio::spawn(async move {
                let every = Duration::from_millis((lease / 3).max(100));
                loop {
                    tokio::time::sleep(every).await;
                    if let Err(e) = store.renew(&id, &owner, lease, clock()).await {
                        tracing::warn!(error = %e, "could not renew the lease of an attempt");
                    }
                }
            }))
        };
        let mut tries: Vec<Try> = Vec::new();
        let result = match out {
            Ok(out) => {
                let started = std::time::Instant::now();
                let send = self.upstreams.send_write(
                    &job.upstream,
                    policy,
                    &out,
                    body,
                    self.config.server.max_stored_response,
                    &mut tries,
                );
                // At the drain deadline an attempt still waiting for its answer is cut: its
                // outcome is recorded unknown and its client answered 504, before the proxy
                // stops (SPEC §5 step 6), rather than a dropped connection.
                let cut = tokio::select! {
                    r = send => Ok(r),
                    () = self.deadline.cancelled() => Err(crate::action::Phase::Response),
                };
                let r = cut.unwrap_or_else(|phase| {
                    let error = "the proxy stopped (drain_timeout) during this attempt".to_string();
                    tries.push(Try {
                        at: crate::action::now_millis(),
                        phase: Some(phase),
                        error: Some(error.clone()),
                        ..Try::default()
                    });
                    AttemptResult::Lost { phase, error }
                });
                self.metrics
                    .upstream_latency(job.upstream.label, started.elapsed().as_secs_f64());
                r
            }
            // Nothing can be sent: treated as a try that did not reach the upstream.
            Err(e) => AttemptResult::Unreachable(format!("cannot build the upstream request: {e}")),
        };
        drop(renewer);
        let now = (self.clock)();
        let attempt = rec.attempts;
        let settle = |state, response, external_id, needs_decision, body| SettleRequest {
            id: rec.id.clone(),
            attempt,
            settlement: Settlement {
                state,
                tries: tries.clone(),
                response,
                external_id,
                needs_decision,
                now,
            },
            body,
        };
        let answer = match result {
            AttemptResult::Answered(ans) => {
                let status = ans.head.status;
                let state = if is_applied(status) {
                    State::Succeeded
                } else if policy.unknown_statuses.contains(&status) {
                    State::Unknown
                } else {
                    State::Failed
                };
                // A succeeded response is replayed only when all of it is kept: its body
                // (within `max_stored_response`) and its head (within STORED_HEAD_MAX).
                let kept = state == State::Succeeded
                    && ans.rest.is_none()
                    && (ans.head.headers.iter())
                        .map(|(k, v)| k.as_str().len() + v.len())
                        .sum::<usize>()
                        <= STORED_HEAD_MAX;
                let (stored, ext) = if state == State::Succeeded {
                    let stored = StoredResponse {
                        status: status.as_u16(),
                        headers: if kept {
                            (ans.head.headers.iter())
                                .map(|(k, v)| (k.as_str().to_string(), latin1(v.as_bytes())))
                                .collect()
                        } else {
                            Vec::new()
                        },
                        size: ans.body.len() as u64,
                        body: if kept {
                            BodyRef::Inline
                        } else {
                            BodyRef::Absent
                        },
                        source: Source::Upstream,
                    };
                    let ext = policy
                        .external_id
                        .as_deref()
                        .and_then(|spec| external_id(spec, &ans.head.headers, &ans.body));
                    (Some(stored), ext)
                } else {
                    (None, None)
                };
                let needs = state == State::Failed && NEEDS_DECISION.contains(&status.as_u16());
                let body = kept.then(|| ans.body.clone());
                let req = settle(state, stored, ext, needs, body);
                let rec = self.settle(req, &rec).await?;
                let outcome = match state {
                    State::Succeeded => Outcome::Sent,
                    State::Unknown => Outcome::Unknown,
                    _ => Outcome::NotApplied,
                };
                let body = match ans.rest {
                    None => full(ans.body),
                    Some(rest) => Prefixed::new(ans.body, rest).boxed_unsync(),
                };
                let mut resp = Response::from_parts(ans.head, body);
                write_headers(resp.headers_mut(), &rec, outcome);
                if state == State::Unknown {
                    // The upstream's own 5xx left the write unknown: an SDK that retried it on
                    // its own would only meet `outcome-unknown`, and hide this answer.
                    crate::error::no_retry(resp.headers_mut());
                }
                Ok(resp)
            }
            AttemptResult::Unreachable(error) => {
                let rec = self
                    .settle(settle(State::Failed, None, None, false, None), &rec)
                    .await?;
                Err(ProxyError::UpstreamUnreachable {
                    ctx: Some(self.ctx(rec).await),
                    error,
                })
            }
            AttemptResult::Lost { error, .. } => {
                let rec = self
                    .settle(settle(State::Unknown, None, None, false, None), &rec)
                    .await?;
                Err(ProxyError::OutcomeUnknown {
                    ctx: self.ctx(rec).await,
                    lost_now: true,
                    reason: format!("{error}; the request may have reached the upstream"),
                })
            }
        };
        answer
    }

    /// Phase `settle`: the outcome is durable before the client hears it. The outcome is known
    /// here, so a store that is away for a while (a database restart) is given up to
    /// [`SETTLE_PATIENCE`] before the action is left for recovery as unknown (SPEC §6). A store
    /// that broke for good (the embedded store after a failed write) is not waited for.
    async fn settle(&self, req: SettleRequest, claimed: &Record) -> Result<Record, ProxyError> {
        let id = req.id.clone();
        let give_up = tokio::time::Instant::now() + SETTLE_PATIENCE;
        let mut wait = Duration::from_millis(50);
        let mut result = self.store.settle(req.clone()).await;
        while let Err(StoreError::Unavailable(e)) = &result {
            let now = tokio::time::Instant::now();
            if now >= give_up {
                break;
            }
            tracing::warn!(error = %e, "recording the outcome failed; trying again");
            tokio::time::sleep(wait.min(give_up - now)).await;
            wait = (wait * 2).min(Duration::from_secs(1));
            result = self.store.settle(req.clone()).await;
        }
        self.waiters.wake(&id);
        match result {
            Ok(rec) => Ok(rec),
            Err(e) => {
                tracing::error!(error = %e, "could not record the outcome of an attempt");
                Err(store_unavailable(e, Some(self.ctx(claimed.clone()).await)))
            }
        }
    }

    /// The proxy's own paths on the main listener (SPEC §10.1).
    async fn own(
        &self,
        req: Request<Incoming>,
        path: &str,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let task = path
            .strip_prefix("/_oncegate/tasks/")
            .filter(|t| !t.is_empty() && !t.contains('/') && req.method() == Method::GET)
            .ok_or_else(|| ProxyError::NoRoute(path.to_string()))?;
        let task = percent_decode(task);
        let records = self
            .store
            .scan(
                Filter {
                    task: Some(task.clone()),
                    ..Filter::default()
                },
                10_000,
            )
            .await
            .map_err(|e| store_unavailable(e, None))?;
        // Only the caller's own actions: the principal as each record's upstream computes it.
        let mine: Vec<Value> = records
            .iter()
            .filter(|r| {
                self.config
                    .upstreams
                    .iter()
                    .find(|u| u.name == r.upstream)
                    .is_some_and(|u| identity::principal(req.headers(), &u.policy) == r.principal)
            })
            .map(task_entry)
            .collect();
        let body = json!({ "task": task, "actions": mine });
        let mut resp = Response::new(full(serde_json::to_vec(&body).expect("JSON serializes")));
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        Ok(resp)
    }
}

/// One action in a task view (SPEC §10.1).
pub fn task_entry(r: &Record) -> Value {
    let mut v = action_json(r);
    v["status"] = json!(r.response.as_ref().map(|s| s.status).or_else(|| {
        r.evidence
            .last()
            .and_then(|a| a.tries.iter().rev().find_map(|t| t.status))
    }));
    v
}

/// Decodes `%XX` escapes of a path segment (`+` stays `+`).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Writes the key into a write's body (SPEC §12 `stamp`): at a JSON pointer for JSON bodies
/// (creating objects on the way), or as a form field for form bodies. Other bodies, and JSON
/// that does not parse, are sent unchanged.
pub fn stamp(headers: &HeaderMap, body: &Bytes, at: &str, key: &str) -> Bytes {
    if identity::is_json(headers) {
        let Ok(mut v) = serde_json::from_slice::<Value>(body) else {
            return body.clone();
        };
        let mut cur = &mut v;
        let parts: Vec<String> = at
            .split('/')
            .skip(1)
            .map(|p| p.replace("~1", "/").replace("~0", "~"))
            .collect();
        for (i, p) in parts.iter().enumerate() {
            if !cur.is_object() {
                return body.clone();
            }
            let obj = cur.as_object_mut().expect("checked above");
            if i + 1 == parts.len() {
                obj.insert(p.clone(), Value::String(key.to_string()));
                return Bytes::from(serde_json::to_vec(&v).expect("JSON serializes"));
            }
            cur = obj.entry(p.clone()).or_insert_with(|| json!({}));
        }
        body.clone()
    } else if identity::is_form(headers) {
        let field: String = form_urlencoded::Serializer::new(String::new())
            .append_pair(at, key)
            .finish();
        if !form_urlencoded::parse(body).any(|(k, _)| k == at) {
            // Appended, so the client's own bytes go out unchanged.
            let mut out = body.to_vec();
            if !out.is_empty() {
                out.push(b'&');
            }
            out.extend_from_slice(field.as_bytes());
            return Bytes::from(out);
        }
        let mut pairs: Vec<(String, String)> = form_urlencoded::parse(body)
            .into_owned()
            .filter(|(k, _)| k != at)
            .collect();
        pairs.push((at.to_string(), key.to_string()));
        Bytes::from(
            form_urlencoded::Serializer::new(String::new())
                .extend_pairs(pairs)
                .finish(),
        )
    } else {
        body.clone()
    }
}

/// `Oncegate-Outcome`, `Oncegate-Action` and `Idempotency-Key` on every write response.
fn write_headers(h: &mut HeaderMap, rec: &Record, outcome: Outcome) {
    h.insert(
        "oncegate-outcome",
        HeaderValue::from_static(outcome.as_str()),
    );
    if let Ok(v) = HeaderValue::from_str(&rec.id) {
        h.insert("oncegate-action", v);
    }
    if let Ok(v) = HeaderValue::from_str(&rec.key) {
        h.insert("idempotency-key", v);
    }
}

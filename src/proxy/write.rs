//! Phases `buffer`, `identify` and `claim` of a write, and the answers that need no attempt:
//! a replay, or a problem about the existing action.

use std::sync::atomic::{AtomicU32, Ordering};

use super::detach::{join_message, panic_message, CatchUnwind, Detached};
use super::*;
use bytes::BytesMut;

/// `fingerprint_window` where it applies: a write keyed by its fingerprint, on a route that sets
/// one (otherwise the retention decides alone).
fn window(job: &WriteJob) -> Option<Millis> {
    (job.identity.source == identity::KeySource::Fingerprint)
        .then_some(job.policy.fingerprint_window)
        .flatten()
        .map(|w| w.as_millis() as Millis)
}

/// What a replay says of itself (SPEC §4.1): which write it repeats, when that was sent, and how
/// to make a new one. In `Oncegate-Detail`, and in an MCP result's `_meta`.
pub(super) fn replay_detail(rec: &Record) -> String {
    format!(
        "replayed the answer of action {}, first sent {}; nothing was sent now. To make a new, identical write, send it with a new Idempotency-Key (MCP: _meta[\"oncegate/key\"])",
        rec.id,
        crate::action::rfc3339(rec.created_at)
    )
}

/// A body's share of `max_buffered`, given back when dropped.
pub(super) struct Held {
    total: Arc<std::sync::atomic::AtomicU64>,
    bytes: u64,
    limit: u64,
}

impl Held {
    /// Takes `n` bytes more, or refuses (503 `busy`) when all requests together would hold more
    /// than the limit.
    fn take(&mut self, n: u64) -> Result<(), ProxyError> {
        let before = self.total.fetch_add(n, Ordering::Relaxed);
        if before + n > self.limit {
            self.total.fetch_sub(n, Ordering::Relaxed);
            return Err(ProxyError::Busy { limit: self.limit });
        }
        self.bytes += n;
        Ok(())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl Proxy {
    /// Phases `buffer` and `identify`, then `claim`.
    pub(super) async fn write(
        self: &Arc<Self>,
        t: &Target<'_>,
        req: Request<Incoming>,
        principal: &str,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let (parts, body) = req.into_parts();
        let (body, held) = self.buffer(&parts.headers, body).await?;
        if identity::is_form(&parts.headers) {
            // A form that tunnels a denied method (`_method=DELETE`) is denied as that method.
            if let Some(m) = crate::route::form_tunnels_denied(t.upstream, &t.rest, &body) {
                return Err(ProxyError::RouteDenied {
                    method: m.to_string(),
                    path: self.redactor.path(&t.rest, parts.uri.query()),
                });
            }
        }
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
                keyer: &self.keyer,
            },
            t.policy,
        )
        .map_err(|e| match e {
            KeyError::Invalid(m) => ProxyError::KeyInvalid(m),
            KeyError::Required => ProxyError::KeyRequired,
        })?;
        let span = tracing::Span::current();
        span.record("action", identity.action_id.as_str());
        span.record("key_source", identity.source.as_str());
        let job = WriteJob {
            upstream: t.upstream.clone(),
            policy: t.policy.clone(),
            method: parts.method,
            headers: parts.headers,
            rest: t.rest.to_string(),
            query,
            body,
            identity,
            call: Call::Http,
            early: None,
            _held: held,
        };
        let resp = self.claim(job).await?;
        Ok(resp)
    }

    /// Phase `buffer`: the whole body, within `max_body` and `body_timeout`, and within what
    /// all requests together may hold (`max_buffered`): a declared length is reserved before
    /// anything is read, a streamed body as it arrives. Past it: 503 `busy`, nothing sent.
    pub(super) async fn buffer(
        &self,
        headers: &HeaderMap,
        mut body: Incoming,
    ) -> Result<(Bytes, Held), ProxyError> {
        let max = self.config.server.max_body;
        let declared = content_length(headers);
        if declared.is_some_and(|n| n > max) {
            return Err(ProxyError::BodyTooLarge { limit: max });
        }
        let mut held = Held {
            total: self.buffered.clone(),
            bytes: 0,
            limit: self.config.server.max_buffered,
        };
        if let Some(n) = declared {
            held.take(n)?;
        }
        let limit = self.config.server.body_timeout;
        let read = async {
            // A body of one frame is kept as it came. Past one, frames are copied into one
            // buffer as they arrive, so that each frame's memory (and the read buffer it may
            // share, as HTTP/2's do) goes at once, and no copy of the whole is made at the end:
            // the held total is what is held (the buffer's capacity), never twice it.
            let (mut first, mut buf): (Option<Bytes>, Option<BytesMut>) = (None, None);
            let mut size = 0u64;
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| {
                    ProxyError::BadRequest(format!("could not read the request body: {e}"))
                })?;
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                size += data.len() as u64;
                if size > max {
                    return Err(ProxyError::BodyTooLarge { limit: max });
                }
                match (&mut buf, first.take()) {
                    (Some(b), _) => b.extend_from_slice(&data),
                    (None, None) => first = Some(data),
                    (None, Some(f)) => {
                        let cap = declared.map_or(2 * size, |n| n.max(size));
                        let mut b = BytesMut::with_capacity(cap as usize);
                        b.extend_from_slice(&f);
                        b.extend_from_slice(&data);
                        buf = Some(b);
                    }
                }
                let holding = buf.as_ref().map_or(size, |b| b.capacity() as u64);
                if holding > held.bytes {
                    held.take(holding - held.bytes)?;
                }
            }
            Ok(match (buf, first) {
                (Some(b), _) => b.freeze(),
                (None, Some(f)) => f,
                (None, None) => Bytes::new(),
            })
        };
        let bytes = tokio::time::timeout(limit, read)
            .await
            .map_err(|_| ProxyError::BodyTimeout(limit))??;
        Ok((bytes, held))
    }

    fn fresh_record(&self, job: &WriteJob) -> Record {
        let client_key = job.identity.client_key.clone();
        let id = &job.identity;
        Record {
            upstream: job.upstream.name.clone(),
            principal: id.principal.clone(),
            key: id.key.clone(),
            method: job.method.to_string(),
            path: self.redactor.path(&job.rest, job.query.as_deref()),
            task: id.task.clone(),
            step: id.step.clone(),
            tool: job.call.tool().map(str::to_string),
            retention_ms: job.policy.retention.as_millis() as u64,
            client_key,
            request: RequestInfo {
                headers: self.redactor.headers(&job.headers),
                headers_dropped: 0,
                body_size: job.body.len() as u64,
                body_sha256: self.keyer.body(&job.body),
                body: self.redactor.body(
                    job.headers
                        .get(http::header::CONTENT_TYPE)
                        .map(|v| v.as_bytes()),
                    &job.body,
                ),
            },
            ..Record::new(id.action_id.clone(), id.fingerprint.clone())
        }
    }

    /// How long an attempt may run, at most: its lease.
    pub(super) fn lease(policy: &Policy) -> Millis {
        let tries = u64::from(policy.retries) + 1;
        policy.timeout.as_millis() as u64 * tries
            + policy.max_retry_wait.as_millis() as u64 * u64::from(policy.retries)
            + 2_000
    }

    /// Phase `claim`: decides what this request gets (SPEC §5 step 2), then acts on it.
    ///
    /// From the claim on, the work belongs to the action, not to the client's connection (SPEC
    /// §5 step 4): it runs in this request's task but is handed to a task of its own if the
    /// request's future is dropped ([`Detached`]; an action whose answer streams runs in its own
    /// task from the start), so a client that goes away while its claim is being made durable
    /// (or its attempt runs) cancels nothing, and the action never stays `in_flight` with no
    /// attempt behind it.
    pub(super) async fn claim(
        self: &Arc<Self>,
        mut job: WriteJob,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        // A duplicate of a write that succeeded, held in memory: the answer a claim would give,
        // without building the fresh record or asking the writer.
        if let Some((rec, body)) = self.store.cached(&job.identity.action_id) {
            if rec.fingerprint == job.identity.fingerprint
                && !rec.outlived((self.clock)(), window(&job))
            {
                return self.replay(&rec, body, &job.call).await;
            }
        }
        // The volume is nearly full: no new record, nothing sent (the reserve is for the
        // settlements of writes already sent).
        // (Where, and how much is free, is for the operator: `/readyz` and the log say it.)
        if self.store.full().is_some() {
            return Err(ProxyError::StoreFull);
        }
        if !job.call.relays() {
            // Its whole answer comes when the action ends: the action runs in this request's
            // task, and is handed to a task of its own only if the request goes away first.
            let span = tracing::Span::current();
            let action = Box::pin(self.clone().guarded(job).instrument(span));
            return Detached::new(action, self.attempts.clone()).await;
        }
        // An answer that streams from the action (MCP): the action runs in a task of its own,
        // and the request waits for the first of its answer and its end.
        let me = self.clone();
        let id = job.identity.action_id.clone();
        // The attempt this task owns, once it owns one (0: none yet).
        let claimed = Arc::new(AtomicU32::new(0));
        let slot = claimed.clone();
        let (early_tx, mut early_rx) = tokio::sync::oneshot::channel();
        job.early = job.call.relays().then_some(early_tx);
        let span = tracing::Span::current();
        let mut task = self
            .attempts
            .spawn(async move { me.claim_and_act(job, slot).await }.instrument(span));
        // The answer first: an action that streamed a short answer may well have ended by
        // the time this task looks, and its end's own value is not the client's answer.
        let early = tokio::select! {
            biased;
            Ok(resp) = &mut early_rx => resp,
            r = &mut task => return match r {
                Ok(r) => r,
                Err(e) => {
                    self.after_panic(&join_message(e), &id, claimed.load(Ordering::SeqCst))
                        .await
                }
            },
        };
        // The answer streams from the action's task, which goes on alone: a panic there is
        // still recorded (the client's answer then ends without its final event).
        let me = self.clone();
        self.attempts.spawn(async move {
            if let Err(e) = task.await {
                let _ = me
                    .after_panic(&join_message(e), &id, claimed.load(Ordering::SeqCst))
                    .await;
            }
        });
        Ok(early)
    }

    /// [`Proxy::claim_and_act`], with a panic in it recorded and answered as
    /// [`Proxy::after_panic`] does (a panic must not end an action without its record).
    async fn guarded(self: Arc<Self>, job: WriteJob) -> Result<Response<ProxyBody>, ProxyError> {
        let id = job.identity.action_id.clone();
        let claimed = Arc::new(AtomicU32::new(0));
        let acted = CatchUnwind(Box::pin(self.clone().claim_and_act(job, claimed.clone()))).await;
        match acted {
            Ok(r) => r,
            Err(panic) => {
                let attempt = claimed.load(Ordering::SeqCst);
                self.after_panic(&panic_message(&*panic), &id, attempt)
                    .await
            }
        }
    }

    /// The claim and what follows it, for the action. `claimed` receives the number of the
    /// attempt the action owns, once it owns one, for [`Proxy::after_panic`].
    async fn claim_and_act(
        self: Arc<Self>,
        job: WriteJob,
        claimed: Arc<AtomicU32>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let mut waiter = None;
        let next = self.decide(&job, &mut waiter).await;
        if let Some(w) = waiter {
            self.waiters.release(&job.identity.action_id, w);
        }
        match next? {
            Next::Attempt(rec, asked) => {
                claimed.store(rec.attempts, Ordering::SeqCst);
                let span = tracing::debug_span!(
                    "attempt",
                    action = %rec.id,
                    attempt = rec.attempts,
                    upstream = %job.upstream.name,
                    tool = job.call.tool(),
                    outcome = tracing::field::Empty,
                    status = tracing::field::Empty,
                );
                // Boxed: the task is spawned, moved and completed at its future's size.
                let done = Box::pin(self.run_attempt(job, rec, asked))
                    .instrument(span.clone())
                    .await;
                if !span.is_disabled() {
                    if let Ok(r) = &done {
                        let outcome = r.headers().get("oncegate-outcome");
                        span.record("outcome", outcome.and_then(|v| v.to_str().ok()));
                        span.record("status", r.status().as_u16());
                    }
                }
                done
            }
            Next::Replay(rec) => self.replay(&rec, None, &job.call).await,
        }
    }

    /// The action ended in a panic (a bug; `e` says what it said). If it had claimed an attempt,
    /// the request may have left: the action is recorded `unknown` and the client told so (SPEC
    /// §6), never "nothing was sent".
    async fn after_panic(
        &self,
        e: &str,
        id: &str,
        attempt: u32,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        tracing::error!(error = %e, "the task of a write ended without an answer");
        if attempt == 0 {
            // It ended before owning an attempt: nothing was sent.
            return Err(ProxyError::StoreUnavailable {
                error: format!("internal error before the write was sent: {e}"),
                ctx: None,
            });
        }
        // The record as claimed, for the problem's context should the store fail too.
        let claimed = match self.store.get(id).await {
            Ok(Some(r)) => r,
            _ => Record::new(id, ""),
        };
        let reason = format!(
            "internal error during the attempt ({e}); the request may have reached the upstream"
        );
        let req = SettleRequest {
            id: id.to_string(),
            attempt,
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
        let rec = self.settle(req, &claimed).await?;
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
            let started = std::time::Instant::now();
            let claim = self
                .store
                .claim(ClaimRequest {
                    // Built for each claim, not cloned: the store takes it, and a claim is
                    // made again only after a wait.
                    fresh: self.fresh_record(job),
                    key_source: job.identity.source,
                    max_attempts: job.policy.max_attempts,
                    owner: self.owner.clone(),
                    lease: Self::lease(&job.policy),
                    now: (self.clock)(),
                    twin: job.policy.twin_guard.then(|| TwinGuard {
                        key: job.identity.twin_key(&job.upstream.name),
                        allow: job.identity.allow_twin.clone(),
                    }),
                    window: window(job),
                })
                .await
                .map_err(|e| store_unavailable(e, None))?;
            self.metrics
                .write_phase("claim", started.elapsed().as_secs_f64());
            let rec = match claim {
                Claim::Claimed(rec) => return Ok(Next::Attempt(rec, started)),
                Claim::KeyReused(rec) => return Err(ProxyError::KeyReused(self.ctx(rec).await)),
                Claim::Exhausted(rec) => {
                    return Err(ProxyError::AttemptsExhausted(self.ctx(rec).await))
                }
                Claim::Twin(rec) => return Err(ProxyError::PossibleDuplicate(self.ctx(rec).await)),
                Claim::Existing(rec) => rec,
            };
            match rec.state {
                State::Succeeded => return Ok(Next::Replay(rec)),
                State::InFlight => {
                    let now = tokio::time::Instant::now();
                    if now < wait_until {
                        if waiter.is_none() {
                            *waiter = Some(self.waiters.get(&job.identity.action_id));
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
                    let verdict = Box::pin(lookup::lookup(
                        &self.upstreams,
                        self.store.as_ref(),
                        &job.upstream,
                        &rec,
                        Some(&job.headers),
                        (self.clock)(),
                    ))
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

    /// The problem context of a record: the record and its task's completed work. Boxed: it is
    /// awaited only on the problem paths, and would otherwise set the size of every write's
    /// future.
    pub(super) fn ctx(&self, record: impl Into<Arc<Record>>) -> BoxFuture<'_, Box<ActionCtx>> {
        Box::pin(self.ctx_inner(Arc::unwrap_or_clone(record.into())))
    }

    async fn ctx_inner(&self, record: Record) -> Box<ActionCtx> {
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

    /// Whether `rec` is no longer in the store as it was: removed, past its retention, or
    /// replaced by a new action under its key.
    async fn expired_meanwhile(&self, rec: &Record) -> bool {
        match self.store.get(&rec.id).await {
            Ok(Some(now)) => now.created_at != rec.created_at || now.outlived((self.clock)(), None),
            Ok(None) => true,
            Err(_) => false,
        }
    }

    /// Phase `replay` (SPEC §7).
    /// `body`: the stored body when the caller holds it already.
    pub(super) async fn replay(
        &self,
        rec: &Record,
        body: Option<Bytes>,
        call: &Call,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let stored = rec.response.as_ref().filter(|r| r.body != BodyRef::Absent);
        if stored.is_none() {
            return Err(ProxyError::AlreadyApplied(self.ctx(rec.clone()).await));
        }
        let body = match body {
            Some(b) => b,
            None => match self.store.body(rec).await {
                Ok(Some(b)) => b,
                // The action reached its retention as this duplicate arrived, and the sweeper
                // removed it between the claim and this read: it is a new action now, not an
                // applied one without its answer. Asked again, the request is sent as one.
                Ok(None) if self.expired_meanwhile(rec).await => {
                    return Err(ProxyError::StoreUnavailable {
                        error: format!(
                            "action {} expired (its retention ended) as this request arrived; the same request again is a new write",
                            rec.id
                        ),
                        ctx: None,
                    })
                }
                // The body is gone for good: the write is applied all the same.
                Ok(None) => return Err(ProxyError::AlreadyApplied(self.ctx(rec.clone()).await)),
                // It cannot be read at this moment: ask again later, and get the replay (SPEC §6).
                Err(e) => return Err(store_unavailable(e, None)),
            },
        };
        let mut resp = call.replay(rec, body);
        write_headers(resp.headers_mut(), rec, Outcome::Replayed);
        if let Ok(v) = HeaderValue::from_str(&replay_detail(rec)) {
            resp.headers_mut().insert("oncegate-detail", v);
        }
        self.store.note(
            LogEvent::for_record(Event::Replayed, rec, Actor::Proxy)
                .status(rec.response.as_ref().map(|r| r.status))
                .outcome(Outcome::Replayed.as_str()),
        );
        Ok(resp)
    }
}

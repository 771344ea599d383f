//! Phases `send`, `settle` and `answer`: one attempt of an action, in the action's own task.

use super::*;

/// How long the outcome of an attempt is retried against a store that cannot take it: longer
/// than a routine database restart (SPEC §6).
pub const SETTLE_PATIENCE: Duration = Duration::from_secs(30);

impl Proxy {
    /// Phases `send`, `settle` and `answer`, in the action's task.
    pub(super) async fn run_attempt(
        self: Arc<Self>,
        mut job: WriteJob,
        rec: Arc<Record>,
        claim_asked: std::time::Instant,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let policy = &job.policy.clone();
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
        // never take a slow attempt for a dead one: a future polled beside the send (and the
        // relay), dropped as soon as they end. Dropped, not merely left unpolled: a renewal
        // suspended mid-call would hold its store call (a pooled PostgreSQL connection, the sled
        // writer's count of calls in flight) through the settle.
        let mut renewal = Box::pin(self.renew_lease(rec.id.clone(), policy));
        let mut tries: Vec<Try> = Vec::new();
        let (id, attempt) = (rec.id.as_str(), rec.attempts);
        let me: &Proxy = &self;
        // The claim's own commit made this attempt the action's, under this owner and within
        // its lease: it fences the first try as a separate statement would, if that try leaves
        // within half a lease of when the claim was asked for. Every later try is fenced anew.
        let first = std::sync::atomic::AtomicBool::new(true);
        let fence = move || {
            let claimed = first
                .swap(false, std::sync::atomic::Ordering::Relaxed)
                .then_some(claim_asked);
            me.fence(id, attempt, policy, claimed)
        };
        let result = match out {
            Ok(out) => {
                let started = std::time::Instant::now();
                let send = self.upstreams.send_write(
                    &job.upstream,
                    policy,
                    &out,
                    body,
                    self.config.server.max_stored_response,
                    job.call.relays(),
                    &mut tries,
                    fence,
                );
                // At the drain deadline an attempt still waiting for its answer is cut: its
                // outcome is recorded unknown and its client answered 504, before the proxy
                // stops (SPEC §5 step 6), rather than a dropped connection.
                let cut = tokio::select! {
                    r = send => Ok(r),
                    () = self.deadline.cancelled() => Err(crate::action::Phase::Response),
                    never = &mut renewal => match never {},
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
                let took = started.elapsed().as_secs_f64();
                self.metrics.upstream_latency(job.upstream.label, took);
                self.metrics.write_phase("send", took);
                r
            }
            // Nothing can be sent: treated as a try that did not reach the upstream.
            Err(e) => AttemptResult::Unreachable(format!("cannot build the upstream request: {e}")),
        };
        // An SSE answer is relayed while the lease is still renewed: the call runs until its
        // final response, however long its progress events take.
        let result = match result {
            // Boxed, like the other rare paths: an action's task is spawned, moved and completed
            // with its future's full size, which its largest path sets.
            AttemptResult::Streaming { head, body } => {
                let relayed = Box::pin(async {
                    tokio::select! {
                        r = self.relay(&mut job, &rec, head, body, &mut tries) => r,
                        never = &mut renewal => match never {},
                    }
                })
                .await;
                drop(renewal);
                return Box::pin(self.settle_relayed(&job, rec, relayed, tries)).await;
            }
            other => other,
        };
        drop(renewal);
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
                let (state, needs) = job
                    .call
                    .judge(status, &ans.body, ans.rest.is_none(), policy);
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
                            job.call.kept_headers(&ans.head.headers)
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
                let body = kept.then(|| ans.body.clone());
                let req = settle(state, stored, ext, needs, body);
                let rec = match self.settle(req, &rec).await {
                    Ok(rec) => rec,
                    // An answer that says the write happened is the better evidence to its
                    // client than a record that says it did not (an operator's mistake).
                    Err(Unsettled::Moved(now))
                        if state == State::Succeeded && now.state != State::Succeeded =>
                    {
                        tracing::error!(action = %now.id, recorded = now.state.as_str(),
                            "an attempt succeeded after its action was settled otherwise");
                        Arc::new(*now)
                    }
                    Err(Unsettled::Moved(now)) => {
                        return Box::pin(self.moved_on(&job, *now, state)).await
                    }
                    Err(Unsettled::Failed(e)) => return Err(e),
                };
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
                let rec = match self
                    .settle(settle(State::Failed, None, None, false, None), &rec)
                    .await
                {
                    Ok(rec) => rec,
                    Err(Unsettled::Moved(now)) => {
                        return Box::pin(self.moved_on(&job, *now, State::Failed)).await
                    }
                    Err(Unsettled::Failed(e)) => return Err(e),
                };
                Err(ProxyError::UpstreamUnreachable {
                    ctx: Some(self.ctx(rec).await),
                    error,
                })
            }
            // Relayed above.
            AttemptResult::Streaming { .. } => unreachable!("a streamed answer is relayed"),
            AttemptResult::Quiet { error, pending } => {
                let rec = match self
                    .settle(settle(State::Unknown, None, None, false, None), &rec)
                    .await
                {
                    Ok(rec) => rec,
                    Err(Unsettled::Moved(now)) => {
                        return Box::pin(self.moved_on(&job, *now, State::Unknown)).await
                    }
                    Err(Unsettled::Failed(e)) => return Err(e),
                };
                let err = ProxyError::OutcomeUnknown {
                    ctx: self.ctx(rec.clone()).await,
                    lost_now: true,
                    reason: format!("{error}; the request may have reached the upstream"),
                };
                // The client hears now; the exchange stays open for a late answer.
                match (&job.call, job.early.take()) {
                    (Call::Mcp(c), Some(early)) => {
                        let _ = early.send(crate::mcp::answer::tool_error(&err, &c.id, c.modern));
                        Box::pin(self.await_late(&job, &rec.id, pending)).await;
                        Ok(Response::new(crate::upstream::empty()))
                    }
                    _ => Err(err),
                }
            }
            AttemptResult::Abandoned(why) => Box::pin(self.abandoned(&job, &rec, why)).await,
            AttemptResult::Lost { error, .. } => {
                let rec = match self
                    .settle(settle(State::Unknown, None, None, false, None), &rec)
                    .await
                {
                    Ok(rec) => rec,
                    Err(Unsettled::Moved(now)) => {
                        return Box::pin(self.moved_on(&job, *now, State::Unknown)).await
                    }
                    Err(Unsettled::Failed(e)) => return Err(e),
                };
                Err(ProxyError::OutcomeUnknown {
                    ctx: self.ctx(rec).await,
                    lost_now: true,
                    reason: format!("{error}; the request may have reached the upstream"),
                })
            }
        };
        answer
    }

    /// Whether a try of attempt `attempt` of action `id` may leave now (SPEC §13, fencing): the
    /// store records it as sending, under this owner and attempt and within its lease, and it
    /// took less than half a lease to say so (a proxy paused in between could be past its lease
    /// by the time the try left). Stores used by one process need no fence.
    async fn fence(
        &self,
        id: &str,
        attempt: u32,
        policy: &Policy,
        claimed: Option<std::time::Instant>,
    ) -> Result<(), Unfenced> {
        if !self.store.fences() {
            return Ok(());
        }
        let lease = Self::lease(policy);
        if claimed.is_some_and(|asked| asked.elapsed() < Duration::from_millis(lease / 2)) {
            return Ok(());
        }
        // A database that drops a pooled connection (a restart) gets a few short chances: the
        // pool opens another.
        let mut chances = 3;
        let (started, fenced) = loop {
            let started = std::time::Instant::now();
            let fenced = self
                .store
                .fence(id, &self.owner, attempt, lease, (self.clock)())
                .await;
            chances -= 1;
            match fenced {
                Err(StoreError::Unavailable(_)) if chances > 0 => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                other => break (started, other),
            }
        };
        match fenced {
            Ok(true) if started.elapsed() < Duration::from_millis(lease / 2) => Ok(()),
            Ok(true) => Err(Unfenced::Lost(format!(
                "recording the try as sending took {:?}, more than half its lease: this proxy may have been paused past it",
                started.elapsed()
            ))),
            Ok(false) => Err(Unfenced::Lost(
                "the action is no longer this attempt's: its lease ran out, or another proxy, a lookup or an operator moved it on".into(),
            )),
            Err(e) => Err(Unfenced::Unrecorded(format!(
                "the try could not be recorded as sending, so it was not sent: {e}"
            ))),
        }
    }

    /// An attempt that gave up a try unsent because the action was no longer its own (SPEC
    /// §13): nothing is recorded, since the action belongs to whoever moved it on; the client
    /// is answered as a duplicate arriving now would be.
    async fn abandoned(
        &self,
        job: &WriteJob,
        claimed: &Record,
        why: String,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        tracing::warn!(action = %claimed.id, reason = %why, "a try was abandoned unsent");
        self.waiters.wake(&claimed.id);
        let rec = match self.store.get(&claimed.id).await {
            Ok(Some(r)) => r,
            Ok(None) | Err(_) => claimed.clone(),
        };
        self.as_it_stands(job, rec, why).await
    }

    /// The answer a duplicate arriving now would get for `rec`: an attempt whose action was
    /// moved on by another answers its client with the action's own outcome.
    async fn as_it_stands(
        &self,
        job: &WriteJob,
        rec: Record,
        why: String,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        match rec.state {
            State::Succeeded => self.replay(&rec, None, &job.call).await,
            State::InFlight => Err(ProxyError::InFlight {
                ctx: self.ctx(rec).await,
                retry_after_secs: 1,
            }),
            State::Unknown => Err(ProxyError::OutcomeUnknown {
                ctx: self.ctx(rec).await,
                lost_now: false,
                reason: format!("this proxy's attempt sent nothing more ({why})"),
            }),
            State::Failed => Err(ProxyError::UpstreamUnreachable {
                ctx: Some(self.ctx(rec).await),
                error: why,
            }),
        }
    }

    /// An attempt whose outcome the store refused because the action was moved on meanwhile
    /// (a lookup or an operator settled it, after this proxy was paused past its lease): its
    /// client gets the action's outcome as it stands, as a duplicate arriving now would. The
    /// outcome this attempt saw is only in the proxy's log.
    async fn moved_on(
        &self,
        job: &WriteJob,
        rec: Record,
        ours: State,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        tracing::warn!(
            action = %rec.id,
            seen = ours.as_str(),
            recorded = rec.state.as_str(),
            "the outcome of an attempt came after another had settled its action"
        );
        let why = format!(
            "this attempt ended {} after its action was settled {} by another",
            ours.as_str(),
            rec.state.as_str()
        );
        self.as_it_stands(job, rec, why).await
    }

    /// Renews the lease of attempt `id` every third of it, for as long as it is polled; never
    /// ends. Polled within the attempt's own task rather than spawned beside it: a task spawned
    /// per write took the worker's next-task slot, so the upstream connection's wake-up that
    /// followed made tokio wake the other worker to steal it, for nothing.
    async fn renew_lease(&self, id: String, policy: &Policy) -> std::convert::Infallible {
        let lease = Self::lease(policy);
        let every = Duration::from_millis((lease / 3).max(100));
        loop {
            tokio::time::sleep(every).await;
            match self
                .store
                .renew(&id, &self.owner, lease, (self.clock)())
                .await
            {
                Ok(true) => {}
                // The next try, if any, finds it too, and is not sent (`fence`).
                Ok(false) => tracing::warn!(
                    action = %id,
                    "the lease of an attempt was lost: the action was moved on"
                ),
                Err(e) => tracing::warn!(error = %e, "could not renew the lease of an attempt"),
            }
        }
    }

    /// Phase `settle`: the outcome is durable before the client hears it. The outcome is known
    /// here, so a store that is away for a while (a database restart) is given up to
    /// [`SETTLE_PATIENCE`] before the action is left for recovery as unknown (SPEC §6). A store
    /// that broke for good (the embedded store after a failed write) is not waited for.
    pub(super) async fn settle(
        &self,
        req: SettleRequest,
        claimed: &Record,
    ) -> Result<Arc<Record>, Unsettled> {
        let id = req.id.clone();
        let give_up = tokio::time::Instant::now() + SETTLE_PATIENCE;
        let mut wait = Duration::from_millis(50);
        let started = std::time::Instant::now();
        let mut result = self.store.settle(req.clone()).await;
        self.metrics
            .write_phase("settle", started.elapsed().as_secs_f64());
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
            Err(StoreError::Settle(SettleError::Stale { .. })) => match self.store.get(&id).await {
                Ok(Some(now)) => Err(Unsettled::Moved(Box::new(now))),
                Ok(None) | Err(_) => Err(Unsettled::Failed(store_unavailable(
                    StoreError::Unavailable("the action was settled by another".into()),
                    Some(self.ctx(claimed.clone()).await),
                ))),
            },
            Err(e) => {
                tracing::error!(error = %e, "could not record the outcome of an attempt");
                Err(Unsettled::Failed(store_unavailable(
                    e,
                    Some(self.ctx(claimed.clone()).await),
                )))
            }
        }
    }
}

/// Why an attempt's outcome was not recorded.
pub(super) enum Unsettled {
    /// Another proxy's lookup or an operator settled the action first (this proxy was paused
    /// past its lease): the record as it stands.
    Moved(Box<Record>),
    Failed(ProxyError),
}

/// Where an attempt cannot answer otherwise: the outcome could not be recorded (SPEC §6).
impl From<Unsettled> for ProxyError {
    fn from(u: Unsettled) -> Self {
        match u {
            Unsettled::Failed(e) => e,
            Unsettled::Moved(rec) => ProxyError::StoreUnavailable {
                error: format!(
                    "the outcome was not recorded: action {} was settled {} by another first",
                    rec.id,
                    rec.state.as_str()
                ),
                ctx: None,
            },
        }
    }
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
pub(super) fn write_headers(h: &mut HeaderMap, rec: &Record, outcome: Outcome) {
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

//! One error type for the request path, and the single place where it becomes an RFC 9457 problem
//! response (SPEC §8). Errors carry their source: the client's request, the upstream, or the store.

use http::header::{HeaderName, HeaderValue};
use http::{Response, StatusCode};
use serde::Serialize;
use serde_json::{json, Value};

use crate::action::{rfc3339, Record, State};
use crate::upstream::{full, ProxyBody};

/// The `Oncegate-Outcome` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Sent,
    Unknown,
    NotApplied,
    Replayed,
    Rejected,
    InFlight,
    Applied,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Sent => "sent",
            Outcome::Unknown => "unknown",
            Outcome::NotApplied => "not-applied",
            Outcome::Replayed => "replayed",
            Outcome::Rejected => "rejected",
            Outcome::InFlight => "in-flight",
            Outcome::Applied => "applied",
        }
    }

    /// The outcome an `Oncegate-Outcome` header value names.
    pub fn from_header(v: &[u8]) -> Option<Outcome> {
        [
            Outcome::Sent,
            Outcome::Unknown,
            Outcome::NotApplied,
            Outcome::Replayed,
            Outcome::Rejected,
            Outcome::InFlight,
            Outcome::Applied,
        ]
        .into_iter()
        .find(|o| o.as_str().as_bytes() == v)
    }
}

/// When a caller may try again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    Now,
    Later,
    AfterCorrection,
    AfterResolution,
    Never,
}

impl Retry {
    fn as_str(self) -> &'static str {
        match self {
            Retry::Now => "now",
            Retry::Later => "later",
            Retry::AfterCorrection => "after-correction",
            Retry::AfterResolution => "after-resolution",
            Retry::Never => "never",
        }
    }
}

/// A succeeded step of the action's task: the accepted work a resumed worker keeps.
#[derive(Debug, Clone, Serialize)]
pub struct Completed {
    pub action: String,
    pub step: Option<String>,
    pub status: Option<u16>,
    pub external_id: Option<String>,
}

/// The action a problem is about, with its task's completed work.
#[derive(Debug, Clone)]
pub struct ActionCtx {
    pub record: Record,
    pub completed: Vec<Completed>,
}

/// Everything that can go wrong on the request path.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("no upstream is configured for path {0}")]
    NoRoute(String),
    #[error("{method} {path} is denied by the route configuration")]
    RouteDenied { method: String, path: String },
    #[error("{0}")]
    KeyInvalid(String),
    #[error("this route requires an Idempotency-Key header")]
    KeyRequired,
    #[error("the request body is larger than max_body ({limit} bytes)")]
    BodyTooLarge { limit: u64 },
    #[error("the request body did not arrive within body_timeout ({0:?})")]
    BodyTimeout(std::time::Duration),
    /// The request bodies held in memory reached `max_buffered`.
    #[error("the proxy holds max_buffered ({limit} bytes) of request bodies already")]
    Busy { limit: u64 },
    #[error("the store's volume has less free space than store.reserve")]
    StoreFull,
    #[error("{0}")]
    BadRequest(String),
    /// A browser page of another origin, or a rebound host name, reached an MCP upstream (DNS
    /// rebinding, SPEC §14.6).
    #[error("{0}")]
    ForeignOrigin(String),
    #[error("this key was already used for a different request")]
    KeyReused(Box<ActionCtx>),
    #[error("another attempt of this action is being sent now")]
    InFlight {
        ctx: Box<ActionCtx>,
        retry_after_secs: u64,
    },
    #[error("the outcome of this write is unknown")]
    OutcomeUnknown {
        ctx: Box<ActionCtx>,
        /// This request's own attempt lost its answer (504); otherwise a later duplicate (409).
        lost_now: bool,
        reason: String,
    },
    #[error("this action failed on every one of its attempts")]
    AttemptsExhausted(Box<ActionCtx>),
    /// An identical write under another key is `in_flight` or `unknown` (the unsettled-twin
    /// guard, SPEC §4.1); the context is that action.
    #[error("an identical write under another key is not settled: action {}", .0.record.id)]
    PossibleDuplicate(Box<ActionCtx>),
    #[error("could not reach the upstream: {error}")]
    UpstreamUnreachable {
        ctx: Option<Box<ActionCtx>>,
        error: String,
    },
    #[error("the upstream did not answer within {0:?}")]
    UpstreamTimeout(std::time::Duration),
    #[error("the exchange with the upstream failed: {0}")]
    UpstreamFailed(String),
    #[error("this action was applied, but no response is stored to replay")]
    AlreadyApplied(Box<ActionCtx>),
    #[error("the store cannot record the action: {error}")]
    StoreUnavailable {
        error: String,
        /// Set when the upstream was already called (the outcome could not be recorded).
        ctx: Option<Box<ActionCtx>>,
    },
}

/// Tells the SDKs not to retry on their own: `x-should-retry` (OpenAI, Anthropic) and
/// `Stripe-Should-Retry` (Stripe); each honours only its own.
pub fn no_retry(h: &mut http::HeaderMap) {
    h.insert("x-should-retry", HeaderValue::from_static("false"));
    h.insert("stripe-should-retry", HeaderValue::from_static("false"));
}

/// The `action` member of a problem (and of the tasks views).
pub fn action_json(r: &Record) -> Value {
    let mut v = json!({
        "id": r.id,
        "key": r.key,
        "upstream": r.upstream,
        "method": r.method,
        "path": r.path,
        "task": r.task,
        "step": r.step,
        "state": r.state.as_str(),
        "attempts": r.attempts,
        "created_at": rfc3339(r.created_at),
        "updated_at": rfc3339(r.updated_at),
        "expires_at": r.expires_at.map(rfc3339),
        "external_id": r.external_id,
    });
    if let Some(tool) = &r.tool {
        v["tool"] = Value::String(tool.clone());
    }
    v
}

/// The `evidence` member: every attempt and try, times as RFC 3339.
pub fn evidence_json(r: &Record) -> Value {
    Value::Array(
        r.evidence
            .iter()
            .map(|a| {
                json!({
                    "attempt": a.n,
                    "started_at": rfc3339(a.started_at),
                    "ended_at": a.ended_at.map(rfc3339),
                    "state": a.state.map(State::as_str),
                    "tries": a.tries.iter().map(|t| json!({
                        "at": rfc3339(t.at),
                        "phase": t.phase,
                        "error": t.error,
                        "status": t.status,
                        "body": t.body,
                        "request_id": t.request_id,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect(),
    )
}

/// What a problem is about, as the model reading it knows it: the tool it called, or the
/// request it made.
fn what(c: &ActionCtx) -> String {
    match &c.record.tool {
        Some(tool) => format!("The tool call {tool}"),
        None => format!("The request {} {}", c.record.method, c.record.path),
    }
}

/// [`what`], inside a sentence.
fn what_bare(c: &ActionCtx) -> String {
    match &c.record.tool {
        Some(tool) => format!("call of the tool {tool}"),
        None => format!("request {} {}", c.record.method, c.record.path),
    }
}

/// How to ask again for an action's result: the same call, or the same request.
fn again(c: &ActionCtx) -> &'static str {
    if c.record.tool.is_some() {
        "Call it again with the same arguments"
    } else {
        "Send the same request again"
    }
}

struct Shape {
    name: &'static str,
    title: &'static str,
    status: StatusCode,
    outcome: Outcome,
    duplicate_risk: bool,
    retry: Retry,
    next_step: String,
    no_retry_headers: bool,
}

impl ProxyError {
    fn ctx(&self) -> Option<&ActionCtx> {
        match self {
            ProxyError::KeyReused(c)
            | ProxyError::InFlight { ctx: c, .. }
            | ProxyError::OutcomeUnknown { ctx: c, .. }
            | ProxyError::AttemptsExhausted(c)
            | ProxyError::PossibleDuplicate(c)
            | ProxyError::AlreadyApplied(c) => Some(c),
            ProxyError::UpstreamUnreachable { ctx, .. }
            | ProxyError::StoreUnavailable { ctx, .. } => ctx.as_deref(),
            _ => None,
        }
    }

    fn shape(&self) -> Shape {
        let s = |name, title, status, outcome, duplicate_risk, retry, next_step: &str| Shape {
            name,
            title,
            status,
            outcome,
            duplicate_risk,
            retry,
            next_step: next_step.to_string(),
            // SPEC §8: every problem but `in-flight`, `body-timeout` and `store-unavailable`
            // (and `busy`, §12) tells the SDKs not to retry it themselves.
            no_retry_headers: true,
        };
        match self {
            ProxyError::NoRoute(_) => s(
                "no-route",
                "No route",
                StatusCode::NOT_FOUND,
                Outcome::Rejected,
                false,
                Retry::AfterCorrection,
                "Send the request under one of the proxy's configured upstream prefixes (see `oncegate check`).",
            ),
            ProxyError::RouteDenied { .. } => s(
                "route-denied",
                "Route denied",
                StatusCode::FORBIDDEN,
                Outcome::Rejected,
                false,
                Retry::Never,
                "This operation is not allowed through the proxy; ask an operator if it should be.",
            ),
            ProxyError::KeyInvalid(_) => s(
                "key-invalid",
                "Invalid key",
                StatusCode::BAD_REQUEST,
                Outcome::Rejected,
                false,
                Retry::AfterCorrection,
                "Send Idempotency-Key as 1 to 255 visible ASCII characters, and Oncegate-Task / Oncegate-Step as 1 to 128.",
            ),
            ProxyError::KeyRequired => s(
                "key-required",
                "Idempotency-Key required",
                StatusCode::BAD_REQUEST,
                Outcome::Rejected,
                false,
                Retry::AfterCorrection,
                "Send an Idempotency-Key header that stays the same on every retry of this write.",
            ),
            ProxyError::BodyTooLarge { .. } => s(
                "body-too-large",
                "Body too large",
                StatusCode::PAYLOAD_TOO_LARGE,
                Outcome::Rejected,
                false,
                Retry::AfterCorrection,
                "Send a smaller body, or raise server.max_body.",
            ),
            ProxyError::BodyTimeout(_) => Shape {
                no_retry_headers: false,
                ..s(
                    "body-timeout",
                    "Body timeout",
                    StatusCode::REQUEST_TIMEOUT,
                    Outcome::Rejected,
                    false,
                    Retry::Now,
                    "Nothing was sent; send the whole request again, its body without pauses.",
                )
            },
            ProxyError::StoreFull => s(
                "store-full",
                "Store full",
                StatusCode::SERVICE_UNAVAILABLE,
                Outcome::Rejected,
                false,
                Retry::Later,
                "Nothing was sent: the proxy's disk is nearly full and it records every write before sending it. Try again once an operator has freed space.",
            ),
            ProxyError::Busy { .. } => Shape {
                no_retry_headers: false,
                ..s(
                    "busy",
                    "Busy",
                    StatusCode::SERVICE_UNAVAILABLE,
                    Outcome::Rejected,
                    false,
                    Retry::Later,
                    "Nothing was sent: the proxy is holding as many request bodies as it may. Send the whole request again in a moment.",
                )
            },
            ProxyError::BadRequest(_) => s(
                "bad-request",
                "Bad request",
                StatusCode::BAD_REQUEST,
                Outcome::Rejected,
                false,
                Retry::AfterCorrection,
                "Correct the request as the detail says (its framing or its path), then send it again.",
            ),
            ProxyError::ForeignOrigin(_) => s(
                "foreign-origin",
                "Foreign origin",
                StatusCode::FORBIDDEN,
                Outcome::Rejected,
                false,
                Retry::Never,
                "Nothing was sent: this MCP server takes no requests from web pages of other origins or for other host names (DNS rebinding protection). If this page should reach it, add its origin to the upstream's allowed_origins.",
            ),
            ProxyError::KeyReused(c) => s(
                "key-reused",
                "Key reused",
                StatusCode::UNPROCESSABLE_ENTITY,
                Outcome::Rejected,
                c.record.state != State::Failed,
                Retry::AfterCorrection,
                &format!("{} was not sent: an earlier, different request was made under the same identity, and it may have been applied. Send exactly the earlier request again to get its result; do not change this one to get past this, and tell the user if unsure.", what(c)),
            ),
            ProxyError::InFlight { ctx, .. } => Shape {
                no_retry_headers: false,
                ..s(
                    "in-flight",
                    "Write in flight",
                    StatusCode::CONFLICT,
                    Outcome::InFlight,
                    true,
                    Retry::Later,
                    &format!("{} is still running and its result is not in yet. {} in a few seconds to get that result; never change it to get past this.", what(ctx), again(ctx)),
                )
            },
            ProxyError::PossibleDuplicate(c) => s(
                "possible-duplicate",
                "Possible duplicate",
                StatusCode::CONFLICT,
                Outcome::Rejected,
                true,
                Retry::AfterResolution,
                &format!("An identical {} made at {} may have been applied, and its outcome is not known yet, so this one was not sent: it could have done the same thing twice. Do not send it again in another form; tell the user it may already have happened. Only if a second, identical one is truly meant, send it with the header Oncegate-Allow-Twin: {}.", what_bare(c), rfc3339(c.record.created_at), c.record.id),
            ),
            ProxyError::OutcomeUnknown { lost_now, ctx, .. } => s(
                "outcome-unknown",
                "Outcome unknown",
                if *lost_now {
                    StatusCode::GATEWAY_TIMEOUT
                } else {
                    StatusCode::CONFLICT
                },
                Outcome::Unknown,
                true,
                Retry::AfterResolution,
                &format!("{} may have been applied: its answer was lost, so whether it happened is not known, and it will not be sent again until that is settled. {} later to get its result; never change it to get past this, and if it stays unknown, tell the user it may have happened.", what(ctx), again(ctx)),
            ),
            ProxyError::AttemptsExhausted(c) => s(
                "attempts-exhausted",
                "Attempts exhausted",
                StatusCode::CONFLICT,
                Outcome::Rejected,
                false,
                Retry::AfterCorrection,
                &format!("{} failed on each of its attempts and was not applied; it will not be tried again as it is. Tell the user what failed (the evidence has the service's answers) before changing anything.", what(c)),
            ),
            // The proxy has already tried again (`retries`): the SDKs are told not to add their
            // own tries at once (SPEC §8), and `Retry-After` says when a later one makes sense.
            ProxyError::UpstreamUnreachable { .. } => s(
                "upstream-unreachable",
                "Upstream unreachable",
                StatusCode::BAD_GATEWAY,
                Outcome::NotApplied,
                false,
                Retry::Later,
                "Nothing reached the service, though the proxy tried again; sending the same request later with the same key is safe.",
            ),
            ProxyError::UpstreamTimeout(_) => s(
                "upstream-timeout",
                "Upstream timeout",
                StatusCode::GATEWAY_TIMEOUT,
                Outcome::Unknown,
                false,
                Retry::Later,
                "The service did not answer this read in time, though the proxy tried again; try it later.",
            ),
            ProxyError::UpstreamFailed(_) => s(
                "upstream-failed",
                "Upstream exchange failed",
                StatusCode::BAD_GATEWAY,
                Outcome::Unknown,
                false,
                Retry::Later,
                "The connection to the service failed during this read, though the proxy tried again; try it later.",
            ),
            ProxyError::AlreadyApplied(c) => s(
                "already-applied",
                "Already applied",
                StatusCode::CONFLICT,
                Outcome::Applied,
                true,
                Retry::Never,
                &match &c.record.external_id {
                    Some(x) => format!("{} was already applied (its result is {x}); do not send it again.", what(c)),
                    None => format!("{} was already applied; do not send it again.", what(c)),
                },
            ),
            ProxyError::StoreUnavailable { ctx, .. } => Shape {
                no_retry_headers: false,
                ..s(
                    "store-unavailable",
                    "Store unavailable",
                    StatusCode::SERVICE_UNAVAILABLE,
                    if ctx.is_some() { Outcome::Unknown } else { Outcome::Rejected },
                    ctx.is_some(),
                    if ctx.is_some() { Retry::AfterResolution } else { Retry::Later },
                    if ctx.is_some() {
                        "The service was called but the proxy could not record its answer; once the store is back the action shows as unknown: settle it before sending again."
                    } else {
                        "Nothing was sent; try again when the store is back."
                    },
                )
            },
        }
    }

    /// The problem's name (`urn:oncegate:problem:NAME`).
    pub fn name(&self) -> &'static str {
        self.shape().name
    }

    /// The `Oncegate-Outcome` of this problem.
    pub fn outcome(&self) -> Outcome {
        self.shape().outcome
    }

    /// The action this problem is about, if any.
    pub fn record(&self) -> Option<&Record> {
        self.ctx().map(|c| &c.record)
    }

    /// The problem object (SPEC §8): the body of an HTTP problem, and the `structuredContent` of
    /// an MCP tool error (SPEC §14.4).
    pub fn problem_json(&self) -> Value {
        let shape = self.shape();
        let ctx = self.ctx();
        let next_step = shape.next_step;
        let mut body = json!({
            "type": format!("urn:oncegate:problem:{}", shape.name),
            "title": shape.title,
            "status": shape.status.as_u16(),
            "detail": self.to_string(),
            "outcome": shape.outcome.as_str(),
            "duplicate_risk": shape.duplicate_risk,
            "retry": shape.retry.as_str(),
            // The member the Stripe, OpenAI and Anthropic SDKs read the message they show from.
            "error": {
                "type": "oncegate_error",
                "code": shape.name,
                "message": format!("{}: {next_step}", shape.title),
            },
            "next_step": next_step,
        });
        match &self {
            ProxyError::OutcomeUnknown { reason, ctx, .. } => {
                body["detail"] = Value::String(format!(
                    "{self}: {reason}. For an operator: check at the service whether it happened (key {}), then settle it with POST /v1/actions/{}/lookup or /resolve on the admin API (oncegate actions lookup|resolve).",
                    ctx.record.key, ctx.record.id
                ));
            }
            ProxyError::PossibleDuplicate(ctx) => {
                body["detail"] = Value::String(format!(
                    "{self}, {} since {}, under key {}. This write was not sent. For an operator: settle that action (POST /v1/actions/{}/lookup or /resolve on the admin API); a client that means a second, identical write sends Oncegate-Allow-Twin: {}.",
                    ctx.record.state.as_str(),
                    rfc3339(ctx.record.created_at),
                    ctx.record.key,
                    ctx.record.id,
                    ctx.record.id
                ));
            }
            _ => {}
        }
        if let Some(c) = ctx {
            body["action"] = action_json(&c.record);
            body["evidence"] = evidence_json(&c.record);
            if c.record.task.is_some() {
                body["completed"] = serde_json::to_value(&c.completed).unwrap_or(Value::Null);
            }
        }
        body
    }

    /// The headers every rendering of this problem carries: `Oncegate-Outcome`, the SDKs'
    /// no-retry headers, `Retry-After`, and the action's id and key.
    pub fn problem_headers(&self, h: &mut http::HeaderMap) {
        let shape = self.shape();
        h.insert(
            HeaderName::from_static("oncegate-outcome"),
            HeaderValue::from_static(shape.outcome.as_str()),
        );
        if shape.no_retry_headers {
            no_retry(h);
        }
        if let ProxyError::InFlight {
            retry_after_secs, ..
        } = &self
        {
            h.insert(
                http::header::RETRY_AFTER,
                HeaderValue::from(*retry_after_secs),
            );
        }
        if let ProxyError::Busy { .. }
        | ProxyError::UpstreamUnreachable { .. }
        | ProxyError::UpstreamTimeout(_)
        | ProxyError::UpstreamFailed(_) = &self
        {
            h.insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let Some(c) = self.ctx() {
            if let Ok(v) = HeaderValue::from_str(&c.record.id) {
                h.insert(HeaderName::from_static("oncegate-action"), v);
            }
            if let Ok(v) = HeaderValue::from_str(&c.record.key) {
                h.insert(HeaderName::from_static("idempotency-key"), v);
            }
        }
    }

    /// The one mapping from errors to HTTP responses (RFC 9457).
    pub fn into_response(self) -> Response<ProxyBody> {
        let body = self.problem_json();
        let mut resp = Response::new(full(
            serde_json::to_vec(&body).expect("a JSON value always serializes"),
        ));
        *resp.status_mut() = self.shape().status;
        let h = resp.headers_mut();
        h.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        self.problem_headers(h);
        if let ProxyError::BadRequest(_) | ProxyError::BodyTimeout(_) = &self {
            h.insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

//! The action record (SPEC §5): what a store keeps about one logical write. Its state machine,
//! the pure transitions every backend applies atomically (claim, settle, resolve, recover), is
//! [`machine`].

use serde::{Deserialize, Serialize};

pub(crate) mod machine;
pub use machine::*;

/// Current record format. Bumped when the stored shape changes; readers accept older versions.
pub const RECORD_VERSION: u32 = 1;

/// Bytes of an upstream body kept as evidence.
pub const EVIDENCE_BODY_MAX: usize = 4096;

/// Milliseconds since the Unix epoch. Every time in the store is one of these.
pub type Millis = u64;

/// Where the proxy reads the time for records (creation, expiry). Injectable so that tests can
/// move time forward instead of sleeping.
pub type Clock = std::sync::Arc<dyn Fn() -> Millis + Send + Sync>;

/// The wall clock.
pub fn system_clock() -> Clock {
    std::sync::Arc::new(now_millis)
}

pub fn now_millis() -> Millis {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as Millis)
        .unwrap_or(0)
}

/// RFC 3339, UTC, millisecond precision.
pub fn rfc3339(ms: Millis) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
        .to_string()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    InFlight,
    Succeeded,
    /// Definitely not applied.
    Failed,
    Unknown,
}

impl State {
    /// Every state, in declaration order (`state as usize` indexes it).
    pub const ALL: [State; 4] = [
        State::InFlight,
        State::Succeeded,
        State::Failed,
        State::Unknown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::InFlight => "in_flight",
            State::Succeeded => "succeeded",
            State::Failed => "failed",
            State::Unknown => "unknown",
        }
    }

    pub fn parse(s: &str) -> Option<State> {
        State::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

/// Which step of a try failed (SPEC §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Connect,
    Send,
    Response,
    Body,
}

/// One connection attempt inside an attempt: the evidence of what happened.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Try {
    pub at: Millis,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// The first 4 KiB of the upstream body (lossy UTF-8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// The upstream's `request-id` / `x-request-id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// The body was dropped to keep the record within the embedded store's bound
    /// (`store::sled::RECORD_MAX`); everything else about the try is kept.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub body_dropped: bool,
}

/// One time the proxy sent (or tried to send) the action upstream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Attempt {
    pub n: u32,
    pub started_at: Millis,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<Millis>,
    /// The state this attempt ended in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<State>,
    #[serde(default)]
    pub tries: Vec<Try>,
    /// Tries dropped, oldest first, to keep the record within the embedded store's bound; the
    /// attempt's last try is always kept.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tries_dropped: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Where a stored body lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BodyRef {
    /// In the store, beside the record.
    Inline,
    /// A content-addressed file beside the database (bodies over 64 KiB).
    File { sha256: String },
    /// Not stored (larger than `max_stored_response`, or settled without one).
    Absent,
}

/// Who produced a stored response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    Upstream,
    Lookup,
}

/// The response replayed to duplicates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredResponse {
    pub status: u16,
    /// Header names and values; values are kept byte for byte as Latin-1 strings.
    pub headers: Vec<(String, String)>,
    pub size: u64,
    pub body: BodyRef,
    pub source: Source,
}

/// What the proxy knows of the request that created the action (never a credential).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestInfo {
    /// Redacted headers.
    pub headers: Vec<(String, String)>,
    /// Headers dropped, last first, to keep the record within the embedded store's bound.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub headers_dropped: u32,
    pub body_size: u64,
    pub body_sha256: String,
    /// The body itself, redacted, when it is a small JSON or form body
    /// ([`crate::redact::Redactor::body`]): what an operator checks at the service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
}

/// One logical write, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub v: u32,
    pub id: String,
    pub upstream: String,
    /// Full hex hash of the principal, or `anonymous`.
    pub principal: String,
    pub key: String,
    pub fingerprint: String,
    pub method: String,
    /// `{rest}` plus the query with redacted parameters.
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
    /// The MCP tool a `tools/call` named (SPEC §14.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    pub state: State,
    /// Attempts started.
    pub attempts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_until: Option<Millis>,
    pub created_at: Millis,
    pub updated_at: Millis,
    pub retention_ms: u64,
    /// When a settled (`succeeded` or `failed`) record may be deleted: `retention` after it
    /// settled. `None` while `in_flight` or `unknown`: such an action is never released by time
    /// alone (SPEC §5).
    #[serde(default)]
    pub expires_at: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_id: Option<String>,
    #[serde(default)]
    pub needs_decision: bool,
    pub request: RequestInfo,
    #[serde(default)]
    pub evidence: Vec<Attempt>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<StoredResponse>,
    /// How an `unknown` action was settled, when it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolution: Option<Resolution>,
    /// Only in storage, with encryption at rest: the request and response heads and the
    /// evidence's body excerpts, sealed (`store::seal`). `None` in every record a caller sees.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sealed: Option<String>,
    /// The client's own `Idempotency-Key` when it was not the action's key (task and step
    /// outranked it, or `client_keys = "per-call"`): evidence (SPEC §4.1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key: Option<String>,
    /// Guarded by the unsettled-twin guard: while unsettled, this action stops an identical
    /// write under another key (SPEC §4.1). `false` for a declared twin and where the guard is
    /// off.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub twin: bool,
}

/// Who settled an unknown action, how and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Resolution {
    pub at: Millis,
    /// `lookup` or `admin`.
    pub actor: String,
    pub applied: bool,
    pub reason: String,
}

impl Record {
    /// A record for a new action, not yet claimed: the identity is given, every other field
    /// starts empty (callers add the rest with struct update syntax).
    pub fn new(id: impl Into<String>, fingerprint: impl Into<String>) -> Record {
        Record {
            v: RECORD_VERSION,
            id: id.into(),
            upstream: String::new(),
            principal: String::new(),
            key: String::new(),
            fingerprint: fingerprint.into(),
            method: String::new(),
            path: String::new(),
            task: None,
            step: None,
            tool: None,
            state: State::InFlight,
            attempts: 0,
            owner: None,
            lease_until: None,
            created_at: 0,
            updated_at: 0,
            retention_ms: 24 * 3_600_000,
            expires_at: None,
            external_id: None,
            needs_decision: false,
            request: RequestInfo::default(),
            evidence: Vec::new(),
            response: None,
            resolution: None,
            sealed: None,
            client_key: None,
            twin: false,
        }
    }

    /// Whether this action stops its twins now: guarded and unsettled (SPEC §4.1).
    pub fn holds_twin(&self) -> bool {
        self.twin && !self.is_settled()
    }

    /// The key its twins share ([`crate::identity::twin_key`]).
    pub fn twin_key(&self) -> String {
        crate::identity::twin_key(&self.upstream, &self.principal, &self.fingerprint)
    }

    /// Whether this record gives way to a new action under its key at `now`: its retention
    /// passed, or `window` (a fingerprint key's `fingerprint_window`) since it settled.
    pub fn outlived(&self, now: Millis, window: Option<Millis>) -> bool {
        self.is_expired(now)
            || window.is_some_and(|w| {
                self.settled_at()
                    .is_some_and(|at| now >= at.saturating_add(w))
            })
    }

    /// When it settled: `retention` before its expiry.
    pub fn settled_at(&self) -> Option<Millis> {
        self.expires_at
            .filter(|_| self.is_settled())
            .map(|e| e.saturating_sub(self.retention_ms))
    }

    /// Whether the action has settled: `succeeded` or `failed`.
    pub fn is_settled(&self) -> bool {
        matches!(self.state, State::Succeeded | State::Failed)
    }

    /// Records a change at `now`. Retention counts from the settlement; an unsettled record has
    /// no expiry.
    fn touch(&mut self, now: Millis) {
        self.updated_at = now;
        self.expires_at = self
            .is_settled()
            .then(|| now.saturating_add(self.retention_ms));
    }

    /// Whether a settled record's retention has passed. `in_flight` and `unknown` records never
    /// expire, whatever their `expires_at` says (a record written by an older version may carry
    /// one).
    pub fn is_expired(&self, now: Millis) -> bool {
        self.is_settled() && self.expires_at.is_some_and(|e| now >= e)
    }

    /// The latest moment the write may have left the proxy: the newest of the last attempt's
    /// start, end and tries. `None` when it was never sent.
    pub fn last_sent(&self) -> Option<Millis> {
        let a = self.evidence.last()?;
        let tries = a.tries.iter().map(|t| t.at);
        Some(tries.chain(a.ended_at).fold(a.started_at, Millis::max))
    }

    fn start_attempt(&mut self, owner: &str, lease: Millis, now: Millis) {
        self.attempts += 1;
        self.state = State::InFlight;
        self.owner = Some(owner.to_string());
        self.lease_until = Some(now.saturating_add(lease));
        self.needs_decision = false;
        self.evidence.push(Attempt {
            n: self.attempts,
            started_at: now,
            ended_at: None,
            state: None,
            tries: Vec::new(),
            tries_dropped: 0,
        });
        self.touch(now);
    }

    fn end_attempt(&mut self, state: State, tries: Vec<Try>, now: Millis) {
        if let Some(a) = self.evidence.last_mut() {
            a.ended_at = Some(now);
            a.state = Some(state);
            a.tries.extend(tries);
        }
        self.state = state;
        self.owner = None;
        self.lease_until = None;
        self.touch(now);
    }
}

/// Where the key of an action came from (SPEC §4.1). It decides what a different fingerprint
/// under the same key means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySource {
    /// The client's `Idempotency-Key`: a different request under it is a reuse.
    Header,
    /// `Oncegate-Task` + `Oncegate-Step`: one step is one action, whatever body the agent
    /// regenerated for it.
    TaskStep,
    /// The request's own fingerprint.
    Fingerprint,
}

impl KeySource {
    pub fn as_str(self) -> &'static str {
        match self {
            KeySource::Header => "header",
            KeySource::TaskStep => "task-step",
            KeySource::Fingerprint => "fingerprint",
        }
    }
}

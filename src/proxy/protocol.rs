//! The protocol seam: what differs between a plain HTTP write and an MCP tool call (SPEC §14),
//! decided once per request. `write.rs` and `attempt.rs` ask a [`Call`]; they never read MCP
//! messages themselves.

use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};
use serde_json::Value;

use crate::action::{Record, Source, State};
use crate::config::Policy;
use crate::mcp;
use crate::upstream::{is_applied, ProxyBody};

/// Statuses after which sending the same write again unchanged is not expected to work.
const NEEDS_DECISION: &[u16] = &[400, 401, 403, 404, 405, 409, 410, 422];

/// What kind of write this is.
#[derive(Debug, Clone)]
pub(crate) enum Call {
    /// A plain HTTP write, judged by its status (SPEC §6).
    Http,
    /// An MCP `tools/call`, judged by its final JSON-RPC response (SPEC §14.3).
    Mcp(McpCall),
}

#[derive(Debug, Clone)]
pub(crate) struct McpCall {
    /// The JSON-RPC id of this request: every answer to it carries it.
    pub id: Value,
    pub tool: String,
    /// Revision 2026-07-28 or later: results carry `resultType`.
    pub modern: bool,
}

impl Call {
    pub fn tool(&self) -> Option<&str> {
        match self {
            Call::Http => None,
            Call::Mcp(c) => Some(&c.tool),
        }
    }

    /// Whether a successful SSE answer is relayed event by event.
    pub fn relays(&self) -> bool {
        matches!(self, Call::Mcp(_))
    }

    /// The state an answer leaves the write in, and whether sending it again unchanged needs a
    /// decision. `complete`: the whole body was read.
    pub fn judge(
        &self,
        status: StatusCode,
        body: &[u8],
        complete: bool,
        policy: &Policy,
    ) -> (State, bool) {
        if let Call::Mcp(c) = self {
            if status.is_success() {
                let last = complete
                    .then(|| mcp::stream::final_response(body, &c.id))
                    .flatten();
                return match last.as_ref().map(mcp::stream::verdict) {
                    Some(v) => Self::state_of(&v),
                    // No final response to this request: nothing says whether it ran.
                    None => (State::Unknown, false),
                };
            }
        }
        let state = if is_applied(status) {
            State::Succeeded
        } else if policy.unknown_statuses.contains(&status) {
            State::Unknown
        } else {
            State::Failed
        };
        let needs = state == State::Failed && NEEDS_DECISION.contains(&status.as_u16());
        (state, needs)
    }

    pub fn state_of(v: &mcp::stream::Verdict) -> (State, bool) {
        match v {
            mcp::stream::Verdict::Succeeded => (State::Succeeded, false),
            mcp::stream::Verdict::Failed { needs_decision } => (State::Failed, *needs_decision),
            mcp::stream::Verdict::Unknown(_) => (State::Unknown, false),
        }
    }

    /// The response head kept for replays: all of it for HTTP; for MCP only the content type (a
    /// session id or stream headers belong to the original exchange).
    pub fn kept_headers(&self, h: &HeaderMap) -> Vec<(String, String)> {
        let keep = |name: &str| match self {
            Call::Http => true,
            Call::Mcp(_) => name == "content-type",
        };
        h.iter()
            .filter(|(k, _)| keep(k.as_str()))
            .map(|(k, v)| (k.as_str().to_string(), crate::redact::latin1(v.as_bytes())))
            .collect()
    }

    /// A replay of a succeeded record (SPEC §7, §14.4).
    pub fn replay(&self, rec: &Record, body: Bytes) -> Response<ProxyBody> {
        match self {
            Call::Http => crate::replay::replay(rec, body),
            Call::Mcp(c) => {
                let from_lookup = rec.response.as_ref().map(|r| r.source) == Some(Source::Lookup);
                let message = if from_lookup {
                    // The service's own status answer, shown to the model as the tool's result.
                    mcp::answer::lookup_result(&body, &c.id, c.modern)
                } else {
                    let detail = super::write::replay_detail(rec);
                    mcp::answer::with_id(&body, &c.id, c.modern, Some(&detail)).unwrap_or(body)
                };
                let mut resp = crate::replay::replay(rec, message);
                resp.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("application/json"),
                );
                *resp.status_mut() = StatusCode::OK;
                resp
            }
        }
    }
}

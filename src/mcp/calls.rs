//! The guarded tool calls this proxy has seen, by what a client's cancel names them with
//! (SPEC §14.3): a `notifications/cancelled` names a request by its JSON-RPC id on its session.
//! A cancel of a guarded write still running is not forwarded: the server would stop a call
//! that may already have taken effect, and leave it unknown for good.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde_json::Value;

/// Calls remembered; the oldest are forgotten first. A cancel of a forgotten call is forwarded.
const MAX_CALLS: usize = 10_000;

/// What a cancel names a call by: the upstream, the caller, the session and the JSON-RPC id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CallRef {
    upstream: String,
    principal: String,
    session: String,
    id: String,
}

impl CallRef {
    pub fn new(upstream: &str, principal: &str, headers: &http::HeaderMap, id: &Value) -> CallRef {
        CallRef {
            upstream: upstream.to_string(),
            principal: principal.to_string(),
            session: headers
                .get("mcp-session-id")
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .unwrap_or_default(),
            // `1` and `"1"` are different ids.
            id: id.to_string(),
        }
    }
}

/// Guarded calls by [`CallRef`], with their action ids.
#[derive(Default)]
pub struct Calls(Mutex<Inner>);

#[derive(Default)]
struct Inner {
    actions: HashMap<CallRef, String>,
    order: VecDeque<CallRef>,
}

impl Calls {
    /// Remembers that `call` is action `action`.
    pub fn started(&self, call: CallRef, action: &str) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if m.actions.insert(call.clone(), action.to_string()).is_none() {
            m.order.push_back(call);
        }
        while m.order.len() > MAX_CALLS {
            if let Some(old) = m.order.pop_front() {
                m.actions.remove(&old);
            }
        }
    }

    /// The action a guarded call is, if this proxy saw it.
    pub fn action(&self, call: &CallRef) -> Option<String> {
        let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.actions.get(call).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_found_by_upstream_caller_session_and_id_and_the_oldest_are_forgotten() {
        let calls = Calls::default();
        let mut h = http::HeaderMap::new();
        h.insert("mcp-session-id", http::HeaderValue::from_static("s1"));
        let r = |id: Value, h: &http::HeaderMap| CallRef::new("tools", "p", h, &id);
        calls.started(r(Value::from(1), &h), "a1");
        assert_eq!(calls.action(&r(Value::from(1), &h)).as_deref(), Some("a1"));
        assert_eq!(calls.action(&r(Value::from("1"), &h)), None);
        assert_eq!(
            calls.action(&r(Value::from(1), &http::HeaderMap::new())),
            None
        );
        for i in 0..MAX_CALLS as u64 {
            calls.started(r(Value::from(i + 2), &h), "x");
        }
        assert_eq!(calls.action(&r(Value::from(1), &h)), None);
        assert!(calls.action(&r(Value::from(2), &h)).is_some());
    }
}

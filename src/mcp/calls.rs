//! The guarded tool calls this proxy has seen, by what a client's cancel names them with
//! (SPEC §14.3): a `notifications/cancelled` names a request by its JSON-RPC id on its session.
//! A cancel of a guarded write still running is not forwarded: the server would stop a call
//! that may already have taken effect, and leave it unknown for good.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use bytes::Bytes;
use serde_json::Value;
use tokio::sync::oneshot;

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
            session: session_of(headers),
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

/// Calls whose POST stream the server ended after an event with an id (resumable streams,
/// SEP-1699, SPEC §14.3), by upstream and session: each waits for its final response on a
/// stream of its session that the client resumes.
#[derive(Default)]
pub struct Resumes(Mutex<HashMap<(String, String), Vec<Waiting>>>);

/// A call waiting for its final response: its JSON-RPC id (as JSON), and where it is delivered.
type Waiting = (String, oneshot::Sender<Bytes>);

/// The session a request belongs to (empty without one).
pub fn session_of(headers: &http::HeaderMap) -> String {
    headers
        .get("mcp-session-id")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default()
}

impl Resumes {
    /// Waits for the final response to request `id` on upstream `upstream`'s session.
    pub fn wait(&self, upstream: &str, session: &str, id: &Value) -> oneshot::Receiver<Bytes> {
        let (tx, rx) = oneshot::channel();
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let waiting = m
            .entry((upstream.to_string(), session.to_string()))
            .or_default();
        waiting.retain(|(_, tx)| !tx.is_closed());
        waiting.push((id.to_string(), tx));
        rx
    }

    /// Whether a call of this session waits for its final response.
    pub fn waiting(&self, upstream: &str, session: &str) -> bool {
        let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.get(&(upstream.to_string(), session.to_string()))
            .is_some_and(|w| w.iter().any(|(_, tx)| !tx.is_closed()))
    }

    /// Hands a message seen on a stream of the session to the call it is the final response of.
    pub fn seen(&self, upstream: &str, session: &str, data: &[u8]) {
        let Ok(v) = serde_json::from_slice::<Value>(data) else {
            return;
        };
        let Some(id) = v.get("id") else { return };
        if v.get("result").is_none() && v.get("error").is_none() {
            return;
        }
        let id = id.to_string();
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let key = (upstream.to_string(), session.to_string());
        let Some(waiting) = m.get_mut(&key) else {
            return;
        };
        if let Some(i) = waiting.iter().position(|(w, _)| *w == id) {
            let (_, tx) = waiting.swap_remove(i);
            let _ = tx.send(Bytes::copy_from_slice(data));
        }
        waiting.retain(|(_, tx)| !tx.is_closed());
        if waiting.is_empty() {
            m.remove(&key);
        }
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

#[cfg(test)]
mod resume_tests {
    use super::*;

    #[test]
    fn a_final_response_reaches_the_call_that_waits_for_it_only() {
        let r = Resumes::default();
        let mut rx = r.wait("tools", "s1", &Value::from(7));
        assert!(r.waiting("tools", "s1"));
        assert!(!r.waiting("tools", "s2"));
        r.seen(
            "tools",
            "s1",
            br#"{"jsonrpc":"2.0","method":"notifications/progress"}"#,
        );
        r.seen("tools", "s1", br#"{"jsonrpc":"2.0","id":"7","result":{}}"#);
        r.seen("tools", "s2", br#"{"jsonrpc":"2.0","id":7,"result":{}}"#);
        assert!(rx.try_recv().is_err());
        r.seen(
            "tools",
            "s1",
            br#"{"jsonrpc":"2.0","id":7,"result":{"ok":1}}"#,
        );
        assert_eq!(
            &rx.try_recv().expect("delivered")[..],
            br#"{"jsonrpc":"2.0","id":7,"result":{"ok":1}}"#
        );
        assert!(!r.waiting("tools", "s1"));
    }
}

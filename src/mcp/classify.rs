//! A tool's class (SPEC §14.1): the first `[[upstreams.tools]]` rule whose name glob matches,
//! else a read when the upstream trusts its server's annotations and the server's own
//! `tools/list` answer marked the tool `readOnlyHint: true`, else a write.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use serde_json::Value;

use crate::config::{McpRules, Policy};
use crate::route::Class;

/// Tools learned per upstream is bounded: a server cannot grow the proxy's memory without end.
const MAX_LEARNED: usize = 10_000;

/// The read-only tools each trusted MCP upstream's `tools/list` answers named, as they passed
/// through this proxy. Held in memory: after a restart, tools are writes until listed again.
#[derive(Default)]
pub struct Annotations(Mutex<HashMap<String, HashSet<String>>>);

impl Annotations {
    /// Whether the upstream's server marked this tool read-only.
    pub fn read_only(&self, upstream: &str, tool: &str) -> bool {
        self.0
            .lock()
            .expect("annotations lock is never poisoned: no panics inside")
            .get(upstream)
            .is_some_and(|s| s.contains(tool))
    }

    /// Learns from a `tools/list` answer (its JSON body, or its SSE stream's events): each tool
    /// listed takes its `readOnlyHint` as this answer says it.
    pub fn learn(&self, upstream: &str, answer: &[u8]) {
        let mut listed: Vec<(String, bool)> = Vec::new();
        let mut take = |v: &Value| {
            let Some(tools) = v.pointer("/result/tools").and_then(Value::as_array) else {
                return;
            };
            for t in tools {
                if let Some(name) = t.get("name").and_then(Value::as_str) {
                    let ro = t.pointer("/annotations/readOnlyHint") == Some(&Value::Bool(true));
                    listed.push((name.to_string(), ro));
                }
            }
        };
        if let Ok(v) = serde_json::from_slice::<Value>(answer) {
            take(&v);
        } else {
            let mut events = super::stream::Events::default();
            for data in events.push(answer) {
                if let Ok(v) = serde_json::from_slice::<Value>(data.data.as_bytes()) {
                    take(&v);
                }
            }
        }
        if listed.is_empty() {
            return;
        }
        let mut m = self
            .0
            .lock()
            .expect("annotations lock is never poisoned: no panics inside");
        let set = m.entry(upstream.to_string()).or_default();
        for (name, ro) in listed {
            if !ro {
                set.remove(&name);
            } else if set.len() < MAX_LEARNED {
                set.insert(name);
            }
        }
    }
}

/// The class and policy of a call to `tool`.
pub fn classify<'a>(
    rules: &'a McpRules,
    upstream_policy: &'a Arc<Policy>,
    learned: &Annotations,
    upstream: &str,
    tool: &str,
) -> (Class, &'a Arc<Policy>) {
    if let Some(r) = rules.rule(tool) {
        return (r.class, &r.policy);
    }
    if rules.trust_annotations && learned.read_only(upstream, tool) {
        return (Class::Read, upstream_policy);
    }
    (Class::Write, upstream_policy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_read_only_tools_from_json_and_sse_answers() {
        let a = Annotations::default();
        a.learn(
            "m",
            br#"{"jsonrpc":"2.0","id":1,"result":{"tools":[{"name":"search","annotations":{"readOnlyHint":true}},{"name":"send"}]}}"#,
        );
        assert!(a.read_only("m", "search"));
        assert!(!a.read_only("m", "send"));
        assert!(!a.read_only("other", "search"));
        // A later answer says otherwise: the latest word counts.
        a.learn(
            "m",
            b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":2,\"result\":{\"tools\":[{\"name\":\"search\",\"annotations\":{\"readOnlyHint\":false}},{\"name\":\"find\",\"annotations\":{\"readOnlyHint\":true}}]}}\n\n",
        );
        assert!(!a.read_only("m", "search"));
        assert!(a.read_only("m", "find"));
    }
}

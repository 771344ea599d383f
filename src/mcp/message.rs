//! What an MCP POST holds (SPEC §14.1).

use serde_json::{Map, Value};

/// A POST to an MCP upstream, as the proxy sees it.
#[derive(Debug)]
pub enum Intake {
    /// Anything but a `tools/call` (`initialize`, `tools/list`, notifications, a client's
    /// responses, ...): a read. `tools_list` says the answer lists the server's tools.
    Other { tools_list: bool },
    /// One `tools/call` request.
    Call(ToolCall),
    /// A JSON-RPC batch, with the names of the tools it calls.
    Batch { tools: Vec<String> },
    /// A client's `notifications/cancelled`, naming the request it cancels (SPEC §14.3).
    Cancel { request_id: Value },
}

/// One `tools/call` request.
#[derive(Debug, Clone)]
pub struct ToolCall {
    /// The JSON-RPC id (a string or a number), as the client sent it.
    pub id: Value,
    /// `params.name`.
    pub name: String,
    /// `params`: `arguments`, `_meta`, and a continuation's `inputResponses`/`requestState`.
    pub params: Map<String, Value>,
}

/// The first revision whose results must say `resultType`.
const MODERN: &str = "2026-07-28";

impl ToolCall {
    /// A member of `params._meta`.
    pub fn meta(&self, name: &str) -> Option<&Value> {
        self.params.get("_meta")?.get(name)
    }

    /// Whether the call speaks revision 2026-07-28 or later (from its `_meta` envelope or its
    /// `MCP-Protocol-Version` header): its results must carry `resultType`.
    pub fn modern(&self, headers: &http::HeaderMap) -> bool {
        let version = self
            .meta("io.modelcontextprotocol/protocolVersion")
            .and_then(Value::as_str)
            .or_else(|| {
                headers
                    .get("mcp-protocol-version")
                    .and_then(|v| v.to_str().ok())
            });
        // Revisions are dates: they compare as strings.
        version.is_some_and(|v| v >= MODERN)
    }
}

/// Reads a POST body. A body that is not JSON-RPC, or that parsers could read differently (a
/// duplicate key), is refused: nothing that cannot be classified is sent.
pub fn intake(body: &[u8]) -> Result<Intake, String> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| format!("the body is not a JSON-RPC message: {e}"))?;
    if !crate::canonical::is_unambiguous_json(body) {
        return Err(
            "the body has a duplicate key, or is nested too deeply: JSON parsers could read it differently"
                .into(),
        );
    }
    match v {
        Value::Object(m) => {
            if m.get("method")
                .is_some_and(|x| x == "notifications/cancelled")
            {
                if let Some(id) = m.get("params").and_then(|p| p.get("requestId")) {
                    return Ok(Intake::Cancel {
                        request_id: id.clone(),
                    });
                }
            }
            let tools_list = m.get("method").is_some_and(|x| x == "tools/list");
            Ok(match single(m)? {
                Some(call) => Intake::Call(call),
                None => Intake::Other { tools_list },
            })
        }
        Value::Array(items) if !items.is_empty() => {
            let mut tools = Vec::new();
            for item in items {
                let Value::Object(m) = item else {
                    return Err("a batch holds something other than a JSON-RPC message".into());
                };
                if let Some(call) = single(m)? {
                    tools.push(call.name);
                }
            }
            Ok(Intake::Batch { tools })
        }
        _ => Err("the body is not a JSON-RPC message (an object, or a non-empty batch)".into()),
    }
}

/// A `tools/call` request, checked; `None` for any other message.
fn single(mut m: Map<String, Value>) -> Result<Option<ToolCall>, String> {
    let method = match m.get("method") {
        None => return Ok(None), // a response to the server's request
        Some(Value::String(s)) => s.as_str(),
        Some(_) => return Err("`method` is not a string".into()),
    };
    if method != "tools/call" {
        // A server that reads methods without regard to case would run a tool call that the
        // proxy took for something else (SPEC §14.1).
        if method.eq_ignore_ascii_case("tools/call") {
            return Err(format!(
                "the method {method:?} is tools/call written otherwise: send it as \"tools/call\""
            ));
        }
        return Ok(None);
    }
    let id = match m.remove("id") {
        Some(id @ (Value::String(_) | Value::Number(_))) => id,
        _ => return Err("a tools/call needs an `id` (a string or a number)".into()),
    };
    let Some(Value::Object(params)) = m.remove("params") else {
        return Err("a tools/call needs `params`, an object".into());
    };
    let name = match params.get("name") {
        Some(Value::String(n)) if !n.is_empty() => n.clone(),
        _ => return Err("a tools/call needs `params.name`, the tool's name".into()),
    };
    if params.get("arguments").is_some_and(|a| !a.is_object()) {
        return Err("`params.arguments` must be an object".into());
    }
    if params.get("_meta").is_some_and(|a| !a.is_object()) {
        return Err("`params._meta` must be an object".into());
    }
    Ok(Some(ToolCall { id, name, params }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_told_apart() {
        let call = br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"send","arguments":{"a":1}}}"#;
        match intake(call).expect("test input") {
            Intake::Call(c) => {
                assert_eq!(c.id, Value::from(7));
                assert_eq!(c.name, "send");
            }
            other => panic!("{other:?}"),
        }
        let list = br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#;
        assert!(matches!(
            intake(list).expect("test input"),
            Intake::Other { tools_list: true }
        ));
        let note = br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
        assert!(matches!(
            intake(note).expect("test input"),
            Intake::Other { tools_list: false }
        ));
        let cancel = br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":"r-1","reason":"timeout"}}"#;
        assert!(matches!(
            intake(cancel).expect("test input"),
            Intake::Cancel { request_id } if request_id == "r-1"
        ));
        let batch = br#"[{"jsonrpc":"2.0","id":1,"method":"ping"},{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"x"}}]"#;
        assert!(
            matches!(intake(batch).expect("test input"), Intake::Batch { tools } if tools == ["x"])
        );
    }

    #[test]
    fn what_cannot_be_classified_is_refused() {
        for bad in [
            &b"not json"[..],
            b"[]",
            b"42",
            br#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"x"}}"#,
            br#"{"jsonrpc":"2.0","id":null,"method":"tools/call","params":{"name":"x"}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call"}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"arguments":{}}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":[1]}}"#,
            // A duplicate key: one parser sees tools/list, another tools/call.
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/list","method":"tools/call","params":{"name":"x"}}"#,
            br#"[1]"#,
        ] {
            assert!(intake(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }
}

//! Answers to an MCP client, as JSON-RPC (SPEC §14.4): an MCP client reads nothing else.

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Response, StatusCode};
use serde_json::{json, Value};

use crate::error::ProxyError;
use crate::upstream::{full, ProxyBody};

/// `-32600`: the request is not one the proxy may send.
pub const INVALID_REQUEST: i64 = -32600;

fn json_response(status: StatusCode, v: &Value) -> Response<ProxyBody> {
    let mut resp = Response::new(full(serde_json::to_vec(v).expect("JSON serializes")));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// A problem as the tool result the model reads: `isError: true`, one text saying what happened
/// and whether calling again could repeat the action, and the whole problem object.
pub fn tool_error_json(err: &ProxyError, id: &Value, modern: bool) -> Value {
    let problem = err.problem_json();
    let text = problem
        .pointer("/error/message")
        .and_then(Value::as_str)
        .unwrap_or("oncegate could not complete this call")
        .to_string();
    let mut v = json!({
        "jsonrpc": "2.0",
        "id": id,
        "result": {
            "content": [{"type": "text", "text": text}],
            "isError": true,
            "structuredContent": problem,
        }
    });
    if modern {
        v["result"]["resultType"] = json!("complete");
    }
    v
}

/// A problem about a `tools/call`, as an HTTP 200 JSON-RPC response with the `Oncegate-*` headers.
pub fn tool_error(err: &ProxyError, id: &Value, modern: bool) -> Response<ProxyBody> {
    let mut resp = json_response(StatusCode::OK, &tool_error_json(err, id, modern));
    err.problem_headers(resp.headers_mut());
    resp
}

/// A message the proxy refuses to send (SPEC §14.1): HTTP 400, JSON-RPC error `-32600`, with the
/// problem in `error.data`.
pub fn invalid(err: &ProxyError, id: Option<&Value>) -> Response<ProxyBody> {
    let problem = err.problem_json();
    let v = json!({
        "jsonrpc": "2.0",
        "id": id.cloned().unwrap_or(Value::Null),
        "error": {
            "code": INVALID_REQUEST,
            "message": err.to_string(),
            "data": problem,
        }
    });
    let mut resp = json_response(StatusCode::BAD_REQUEST, &v);
    err.problem_headers(resp.headers_mut());
    resp
}

/// The stored final response with its `id` replaced by the new request's (and, for a client of
/// revision 2026-07-28 or later, a `resultType` its results must have). `replayed`: what the
/// replay says of itself, in its result's `_meta["oncegate/replayed"]`.
pub fn with_id(stored: &[u8], id: &Value, modern: bool, replayed: Option<&str>) -> Option<Bytes> {
    let mut v: Value = serde_json::from_slice(stored).ok()?;
    v.as_object_mut()?.insert("id".into(), id.clone());
    if let Some(r) = v.get_mut("result").and_then(Value::as_object_mut) {
        if modern {
            r.entry("resultType").or_insert_with(|| json!("complete"));
        }
        if let Some(detail) = replayed {
            let meta = r.entry("_meta").or_insert_with(|| json!({}));
            if let Some(m) = meta.as_object_mut() {
                m.insert("oncegate/replayed".into(), json!(detail));
            }
        }
    }
    Some(Bytes::from(
        serde_json::to_vec(&v).expect("JSON serializes"),
    ))
}

/// A JSON-RPC message as one SSE event.
pub fn event(message: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(message.len() + 24);
    out.extend_from_slice(b"event: message\ndata: ");
    out.extend_from_slice(message);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// A status lookup's answer (SPEC §9) as the result of the call it settled.
pub fn lookup_result(body: &[u8], id: &Value, modern: bool) -> Bytes {
    let text = String::from_utf8_lossy(body).into_owned();
    let mut result = json!({
        "content": [{"type": "text", "text": text}],
        "isError": false,
    });
    if let Ok(v @ Value::Object(_)) = serde_json::from_slice::<Value>(body) {
        result["structuredContent"] = v;
    }
    if modern {
        result["resultType"] = json!("complete");
    }
    let v = json!({"jsonrpc": "2.0", "id": id, "result": result});
    Bytes::from(serde_json::to_vec(&v).expect("JSON serializes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replays_carry_the_new_id() {
        let stored = br#"{"jsonrpc":"2.0","id":1,"result":{"content":[]}}"#;
        let out = with_id(stored, &json!("resend-7"), true, None).expect("test input");
        let v: Value = serde_json::from_slice(&out).expect("test input");
        assert_eq!(v["id"], "resend-7");
        assert_eq!(
            v["result"],
            json!({"content": [], "resultType": "complete"})
        );
    }

    #[test]
    fn problems_are_tool_results_the_model_can_read() {
        let err = ProxyError::RouteDenied {
            method: "tools/call".into(),
            path: "delete_everything".into(),
        };
        let v = tool_error_json(&err, &json!(4), false);
        assert_eq!(v["id"], 4);
        assert_eq!(v["result"]["isError"], true);
        let text = v["result"]["content"][0]["text"]
            .as_str()
            .expect("test input");
        assert!(text.starts_with("Route denied"), "{text}");
        assert_eq!(
            v["result"]["structuredContent"]["type"],
            "urn:oncegate:problem:route-denied"
        );
    }
}

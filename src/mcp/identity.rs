//! A tool call's identity (SPEC §14.2). Never the JSON-RPC id, `_meta` or a session id: they
//! change between a call and its resend.

use http::HeaderMap;
use serde_json::Value;

use super::ToolCall;
use crate::config::{KeyScope, Policy};
use crate::identity::{
    action_id, allow_twin, choose_key, header_key, header_str, hex32, parse_key, sha256_parts,
    visible, Identity, KeyError, Keyer,
};

/// `params._meta` members a client may set (SPEC §14.2).
pub const META_KEY: &str = "oncegate/key";
pub const META_TASK: &str = "oncegate/task";
pub const META_STEP: &str = "oncegate/step";
/// Aliases of [`META_KEY`]: the community's `params._meta.idempotencyKey`, and
/// `params.idempotencyKey` of the MCP proposal SEP-3182.
pub const META_KEY_ALIAS: &str = "idempotencyKey";
pub const PARAMS_KEY: &str = "idempotencyKey";

fn meta_str<'a>(call: &'a ToolCall, name: &str, max: usize) -> Result<Option<&'a str>, KeyError> {
    string_member(call.meta(name), &format!("_meta[\"{name}\"]"), max)
}

/// A member that must be a string of visible ASCII, when present; `what` names it in the error.
fn string_member<'a>(
    v: Option<&'a Value>,
    what: &str,
    max: usize,
) -> Result<Option<&'a str>, KeyError> {
    match v {
        None => Ok(None),
        Some(Value::String(s)) if visible(s, max) => Ok(Some(s)),
        Some(_) => Err(KeyError::Invalid(format!(
            "{what} must be a string of 1 to {max} visible ASCII characters"
        ))),
    }
}

/// The key a call carries in its body (SPEC §14.2): `_meta["oncegate/key"]`, else the aliases
/// `_meta.idempotencyKey` and `params.idempotencyKey`, in that order.
fn body_key(call: &ToolCall) -> Result<Option<&str>, KeyError> {
    if let Some(k) = meta_str(call, META_KEY, 255)? {
        return Ok(Some(k));
    }
    if let Some(k) = meta_str(call, META_KEY_ALIAS, 255)? {
        return Ok(Some(k));
    }
    string_member(call.params.get(PARAMS_KEY), "params.idempotencyKey", 255)
}

/// What a tool call's identity is made from, read from its body in one parse: the canonical
/// arguments (without `fingerprint_ignore`, pointers relative to the arguments), and for a
/// continuation of a multi-round-trip call, 16 hex characters of SHA-256 over its
/// `inputResponses` and `requestState`.
struct Canon {
    args: Vec<u8>,
    continuation: Option<String>,
}

impl Canon {
    fn of(call: &ToolCall, body: &[u8], ignore: &[String]) -> Canon {
        const NONE: &[String] = &[];
        let members = crate::canonical::json_members(
            body,
            &[
                ("/params/arguments", ignore),
                ("/params/inputResponses", NONE),
                ("/params/requestState", NONE),
            ],
        );
        let Some([args, responses, state]) = members.and_then(|m| <[_; 3]>::try_from(m).ok())
        else {
            // Intake refuses bodies without a canonical form: this is only a fallback.
            let args = serde_json::to_vec(call.params.get("arguments").unwrap_or(&Value::Null))
                .expect("JSON serializes");
            return Canon {
                args,
                continuation: None,
            };
        };
        let continuation = (responses != b"null" || state != b"null").then(|| {
            let d = sha256_parts(&[&responses, &state]);
            hex32(&d)[..16].to_string()
        });
        Canon { args, continuation }
    }

    /// Hex SHA-256 over the tool name, the arguments and a continuation's members, and what
    /// the tool's `key_scope` adds: its session, or this call alone.
    fn fingerprint(&self, call: &ToolCall, scope: &Scoped, keyer: &Keyer) -> String {
        let mut parts: Vec<&[u8]> = vec![call.name.as_bytes(), &self.args];
        if let Some(c) = &self.continuation {
            parts.push(c.as_bytes());
        }
        let mut salt = Vec::new();
        match scope {
            Scoped::Arguments => {}
            Scoped::Session(id) => {
                salt.extend_from_slice(b"session\0");
                salt.extend_from_slice(id.unwrap_or("").as_bytes());
            }
            Scoped::Call(nonce) => {
                salt.extend_from_slice(b"call\0");
                salt.extend_from_slice(nonce);
            }
        }
        if !salt.is_empty() {
            parts.push(&salt);
        }
        crate::identity::hex(&keyer.parts(&parts))
    }
}

/// What a fingerprint covers besides the tool and its arguments (SPEC §14.2 `key_scope`).
enum Scoped<'a> {
    Arguments,
    /// The `Mcp-Session-Id` (none: a revision without sessions, or a first call).
    Session(Option<&'a str>),
    /// A value of this call alone: no other call has its fingerprint.
    Call([u8; 16]),
}

/// Derives a tool call's identity.
pub fn identify(
    upstream: &str,
    principal: &str,
    headers: &HeaderMap,
    body: &[u8],
    call: &ToolCall,
    policy: &Policy,
    keyer: &Keyer,
) -> Result<Identity, KeyError> {
    let canon = Canon::of(call, body, &policy.fingerprint_ignore);
    let scoped = match policy.key_scope {
        KeyScope::Arguments => Scoped::Arguments,
        KeyScope::Session => {
            Scoped::Session(headers.get("mcp-session-id").and_then(|v| v.to_str().ok()))
        }
        KeyScope::Call => Scoped::Call(rand::random()),
    };
    let task = match header_str(headers, "oncegate-task")? {
        Some(t) => Some(t),
        None => meta_str(call, META_TASK, 128)?,
    };
    let step = match header_str(headers, "oncegate-step")? {
        Some(s) => Some(s),
        None => meta_str(call, META_STEP, 128)?,
    };
    // A key in the body (`_meta["oncegate/key"]` or an alias) is set by the client that means
    // it as the action's key, so it is never per-call; the `Idempotency-Key` header may be an
    // SDK's.
    let (client_key, client_keys) = match header_key(headers)? {
        Some(k) => (Some(k), policy.client_keys),
        None => (
            body_key(call)?
                .map(|k| parse_key(k.as_bytes()))
                .transpose()?,
            crate::config::ClientKeys::Stable,
        ),
    };
    // A key the client means as the action's makes the call's identity, whatever the scope:
    // a resend under it is the same call, a different call under it a reuse.
    let keyed = task.is_some() && step.is_some()
        || (client_key.is_some() && client_keys == crate::config::ClientKeys::Stable);
    let fingerprint = canon.fingerprint(
        call,
        if keyed { &Scoped::Arguments } else { &scoped },
        keyer,
    );
    let (key, source, client_key) = choose_key(
        upstream,
        principal,
        &fingerprint,
        task.zip(step),
        client_key,
        client_keys,
        policy.require_key,
    )?;
    // A continuation is an action of its own, under the first leg's key.
    let key = match &canon.continuation {
        Some(c) => format!("{key}:{c}"),
        None => key,
    };
    Ok(Identity {
        action_id: action_id(upstream, principal, &key),
        key,
        source,
        task: task.map(str::to_string),
        step: step.map(str::to_string),
        principal: principal.to_string(),
        fingerprint,
        client_key,
        allow_twin: allow_twin(headers)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::KeySource;
    use crate::mcp::{intake, Intake};

    fn policy() -> Policy {
        crate::config::Config::parse(
            "[server]\n[[upstreams]]\nname='m'\nprefix='/m'\nurl='http://127.0.0.1:1'\nprotocol='mcp'\nfingerprint_ignore=['/trace']\n",
        )
        .expect("valid")
        .upstreams[0]
            .policy
            .as_ref()
            .clone()
    }

    fn id_of(body: &str) -> Identity {
        let Intake::Call(call) = intake(body.as_bytes()).expect("test input") else {
            panic!("not a call")
        };
        identify(
            "m",
            "anonymous",
            &HeaderMap::new(),
            body.as_bytes(),
            &call,
            &policy(),
            &Keyer::unkeyed(),
        )
        .expect("test input")
    }

    #[test]
    fn a_resend_under_a_new_id_and_meta_is_the_same_action() {
        let a = id_of(
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send","arguments":{"to":"a","n":1.50,"trace":"x"},"_meta":{"progressToken":"p1"}}}"#,
        );
        let b = id_of(
            r#"{"id":"resend-2","method":"tools/call","jsonrpc":"2.0","params":{"_meta":{"progressToken":"p2","traceparent":"00-1"},"arguments":{"n":1.50,"to":"a","trace":"y"},"name":"send"}}"#,
        );
        assert_eq!(a.action_id, b.action_id);
        assert_eq!(a.source, KeySource::Fingerprint);
        // Another tool, other arguments, or the number written otherwise: another action.
        for other in [
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send2","arguments":{"to":"a","n":1.50}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send","arguments":{"to":"b","n":1.50}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send","arguments":{"to":"a","n":1.5}}}"#,
        ] {
            assert_ne!(id_of(other).action_id, a.action_id, "{other}");
        }
    }

    fn id_scoped(body: &str, scope: KeyScope, session: Option<&str>) -> Identity {
        let Intake::Call(call) = intake(body.as_bytes()).expect("test input") else {
            panic!("not a call")
        };
        let mut headers = HeaderMap::new();
        if let Some(s) = session {
            headers.insert("mcp-session-id", s.parse().expect("a header value"));
        }
        let mut p = policy();
        p.key_scope = scope;
        identify(
            "m",
            "anonymous",
            &headers,
            body.as_bytes(),
            &call,
            &p,
            &Keyer::unkeyed(),
        )
        .expect("test input")
    }

    #[test]
    fn key_scope_says_what_a_fingerprint_key_covers() {
        let toggle = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"toggle","arguments":{}}}"#;
        let keyed = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"toggle","arguments":{},"_meta":{"oncegate/key":"k1"}}}"#;
        let a = |scope, session| id_scoped(toggle, scope, session).action_id;
        // arguments: one action across calls and sessions.
        assert_eq!(
            a(KeyScope::Arguments, Some("s1")),
            a(KeyScope::Arguments, Some("s2"))
        );
        // session: one action within a session, another in the next.
        assert_eq!(
            a(KeyScope::Session, Some("s1")),
            a(KeyScope::Session, Some("s1"))
        );
        assert_ne!(
            a(KeyScope::Session, Some("s1")),
            a(KeyScope::Session, Some("s2"))
        );
        // call: every call its own action (and its own twin), unless the client sends a key.
        let (c1, c2) = (
            id_scoped(toggle, KeyScope::Call, Some("s1")),
            id_scoped(toggle, KeyScope::Call, Some("s1")),
        );
        assert_ne!(c1.action_id, c2.action_id);
        assert_ne!(c1.twin_key("m"), c2.twin_key("m"));
        let (k1, k2) = (
            id_scoped(keyed, KeyScope::Call, None),
            id_scoped(keyed, KeyScope::Session, Some("s2")),
        );
        assert_eq!(k1.action_id, k2.action_id);
        assert_eq!(
            k1.fingerprint, k2.fingerprint,
            "a keyed resend is no key reuse"
        );
    }

    #[test]
    fn keys_from_meta_and_continuations() {
        let k = id_of(
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send","arguments":{},"_meta":{"oncegate/key":"order-9"}}}"#,
        );
        assert_eq!(k.key, "order-9");
        let ts = id_of(
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send","arguments":{},"_meta":{"oncegate/task":"t1","oncegate/step":"s1"}}}"#,
        );
        assert_eq!(ts.source, KeySource::TaskStep);
        assert_eq!(ts.task.as_deref(), Some("t1"));
        let cont = id_of(
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"send","arguments":{},"_meta":{"oncegate/key":"order-9"},"requestState":"abc"}}"#,
        );
        assert!(cont.key.starts_with("order-9:"), "{}", cont.key);
        // The aliases (SPEC §14.2), after oncegate's own member.
        let alias = id_of(
            r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"send","arguments":{"n":1},"_meta":{"idempotencyKey":"order-9"}}}"#,
        );
        assert_eq!(alias.key, "order-9");
        assert_eq!(alias.action_id, k.action_id);
        let sep = id_of(
            r#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"send","arguments":{"n":2},"idempotencyKey":"order-9"}}"#,
        );
        assert_eq!(sep.action_id, k.action_id);
        let both = id_of(
            r#"{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"send","arguments":{},"idempotencyKey":"other","_meta":{"oncegate/key":"order-9"}}}"#,
        );
        assert_eq!(both.key, "order-9");
        assert_eq!(cont.key.len(), "order-9:".len() + 16);
        assert_ne!(cont.action_id, k.action_id);
        let bad = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send","_meta":{"oncegate/key":5}}}"#;
        let Intake::Call(call) = intake(bad.as_bytes()).expect("test input") else {
            panic!()
        };
        assert!(identify(
            "m",
            "anonymous",
            &HeaderMap::new(),
            bad.as_bytes(),
            &call,
            &policy(),
            &Keyer::unkeyed(),
        )
        .is_err());
    }
}

//! Status lookups (SPEC §9): asking the upstream whether an `unknown` write happened, by its key,
//! and settling the action from the answer. A lookup never sends the write itself.

use std::time::Duration;

use http::header::HeaderMap;
use http::{Method, StatusCode};
use serde_json::Value;

use crate::action::{
    BodyRef, Clock, Millis, Record, Resolve, ResolveError, Source, State, StoredResponse,
};
use crate::config::{LookupConfig, Policy, Upstream};
use crate::log::{Actor, Event, LogEvent};
use crate::store::{Store, StoreError};
use crate::upstream::{Outgoing, Upstreams};

/// What a lookup concluded.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// The write happened; the action is now `succeeded`.
    Applied(Record),
    /// The write did not happen; the action is now `failed` and the next request sends it.
    NotApplied(Record),
    /// The answer settles nothing; the action stays `unknown`.
    Unknown(String),
}

impl Verdict {
    pub fn label(&self) -> &'static str {
        match self {
            Verdict::Applied(_) => "applied",
            Verdict::NotApplied(_) => "not-applied",
            Verdict::Unknown(_) => "unknown",
        }
    }
}

/// URL-encodes a key for a path (every byte outside the unreserved set).
fn encode_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// What a lookup's answer says of the write.
#[derive(Debug, Clone, PartialEq)]
pub enum Found {
    /// The created object exists: its id and the object itself (at `object`; `None`: the whole
    /// answer, kept byte for byte).
    Applied {
        external_id: String,
        object: Option<Value>,
    },
    /// Nothing was found (404, or a 2xx without `found`).
    Absent,
}

/// How the upstream's answer settles the action (pure; table-tested).
pub fn judge(cfg: &LookupConfig, status: StatusCode, body: &[u8]) -> Result<Found, String> {
    if status == StatusCode::NOT_FOUND {
        return Ok(Found::Absent);
    }
    if !status.is_success() {
        return Err(format!("lookup answered {status}"));
    }
    let Ok(answer) = serde_json::from_slice::<Value>(body) else {
        return Ok(Found::Absent);
    };
    let Some(id) = answer.pointer(&cfg.found).filter(|v| !v.is_null()) else {
        return Ok(Found::Absent);
    };
    let external_id = match id {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let object =
        match cfg.object.as_str() {
            "" => None,
            at => Some(answer.pointer(at).cloned().ok_or_else(|| {
                format!("the lookup found {external_id} but nothing at object {at}")
            })?),
        };
    Ok(Found::Applied {
        external_id,
        object,
    })
}

/// The route policy that governs a stored action now.
pub fn policy_for<'a>(up: &'a Upstream, r: &Record) -> &'a Policy {
    let rest = r.path.split('?').next().unwrap_or("");
    let method = Method::from_bytes(r.method.as_bytes()).unwrap_or(Method::POST);
    crate::route::classify(up, &method, rest).1
}

/// Runs the lookup for an `unknown` action and settles it when the answer allows.
/// `headers` are the caller's (a duplicate's credentials), when there is a caller.
pub async fn lookup(
    upstreams: &Upstreams,
    store: &dyn Store,
    up: &Upstream,
    record: &Record,
    headers: Option<&HeaderMap>,
    now: Millis,
) -> Result<Verdict, StoreError> {
    let policy = policy_for(up, record);
    let Some(cfg) = policy.lookup.as_ref() else {
        return Ok(Verdict::Unknown(
            "no lookup is configured for this route".into(),
        ));
    };
    if record.state != State::Unknown {
        return Ok(Verdict::Unknown(format!(
            "the action is {}",
            record.state.as_str()
        )));
    }
    let path = cfg.path.replace("{key}", &encode_key(&record.key));
    // What the resolution's reason names: the path asked, not the template.
    let asked = path.clone();
    let (rest, query) = match path.split_once('?') {
        Some((p, q)) => (p.to_string(), Some(q.to_string())),
        None => (path, None),
    };
    let method = Method::from_bytes(cfg.method.as_bytes()).unwrap_or(Method::GET);
    let mut h = headers.cloned().unwrap_or_default();
    // A lookup is a bodiless request: the write's own framing and type do not apply.
    for name in [
        "content-length",
        "content-type",
        "idempotency-key",
        "transfer-encoding",
    ] {
        h.remove(name);
    }
    // The lookup's own credentials, when configured, over the caller's.
    for (name, value) in &cfg.headers.0 {
        h.insert(name.clone(), value.clone());
    }
    let answer = match Outgoing::new(up, &method, &h, &rest, query.as_deref(), None) {
        Ok(out) => upstreams.fetch(up, policy, &out, policy.timeout).await,
        Err(e) => Err(e.to_string()),
    };
    let verdict_for = |reason: String| {
        store.note(
            LogEvent::for_record(Event::Lookup, record, Actor::Lookup)
                .outcome("unknown")
                .detail(reason.clone()),
        );
        Ok(Verdict::Unknown(reason))
    };
    let (head, body) = match answer {
        Ok(a) => a,
        Err(e) => return verdict_for(format!("lookup failed: {e}")),
    };
    let found = match judge(cfg, head.status, &body) {
        Ok(f) => f,
        Err(reason) => return verdict_for(reason),
    };
    let res = match found {
        Found::Applied {
            external_id,
            object,
        } => {
            // The replay answers what the write itself would have: the created object.
            let body = match object {
                Some(o) => bytes::Bytes::from(serde_json::to_vec(&o).expect("JSON serializes")),
                None => body,
            };
            Resolve {
                applied: true,
                external_id: Some(external_id.clone()),
                response: Some(StoredResponse {
                    status: cfg.status,
                    headers: vec![("content-type".into(), "application/json".into())],
                    size: body.len() as u64,
                    body: BodyRef::Inline,
                    source: Source::Lookup,
                }),
                body: Some(body),
                actor: "lookup".into(),
                reason: format!("lookup {} {asked} found {external_id}", cfg.method),
                now,
                absent_after: None,
            }
        }
        Found::Absent => Resolve {
            applied: false,
            external_id: None,
            response: None,
            body: None,
            actor: "lookup".into(),
            reason: format!(
                "lookup {} {asked} answered {}: not applied",
                cfg.method, head.status
            ),
            now,
            absent_after: Some(cfg.absent_after.0.as_millis() as Millis),
        },
    };
    let applied = res.applied;
    match store.resolve(record.id.clone(), res, Event::Lookup).await {
        Ok(r) if applied => Ok(Verdict::Applied(r)),
        Ok(r) => Ok(Verdict::NotApplied(r)),
        // Found nothing yet, too soon after the send to say it was not applied.
        Err(StoreError::Resolve(e @ ResolveError::TooEarly { .. })) => verdict_for(e.to_string()),
        // Settled meanwhile by someone else: report what it is now.
        Err(StoreError::Resolve(e)) => Ok(Verdict::Unknown(e.to_string())),
        Err(e) => Err(e),
    }
}

/// Keeps looking up `unknown` actions in the background, each at most once per its route's
/// `lookup_interval`.
pub async fn background(
    upstreams: std::sync::Arc<Upstreams>,
    store: std::sync::Arc<dyn Store>,
    config: std::sync::Arc<crate::config::Config>,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    clock: Clock,
) {
    let tick = config
        .upstreams
        .iter()
        .flat_map(|u| std::iter::once(&u.policy).chain(u.routes.iter().map(|r| &r.policy)))
        .filter(|p| p.lookup.is_some())
        .map(|p| p.lookup_interval)
        .min();
    let Some(tick) = tick else {
        return;
    };
    let tick = tick.max(Duration::from_millis(100));
    let mut last: std::collections::HashMap<String, tokio::time::Instant> = Default::default();
    loop {
        tokio::time::sleep(tick).await;
        let unknown = match store
            .scan(
                crate::store::Filter {
                    state: Some(State::Unknown),
                    ..Default::default()
                },
                10_000,
            )
            .await
        {
            Ok(u) => u,
            Err(e) => {
                tracing::warn!(error = %e, "background lookup: cannot scan");
                continue;
            }
        };
        last.retain(|id, _| unknown.iter().any(|r| &r.id == id));
        for r in unknown {
            let Some(up) = config.upstreams.iter().find(|u| u.name == r.upstream) else {
                continue;
            };
            let p = policy_for(up, &r);
            if p.lookup.is_none()
                || last
                    .get(&r.id)
                    .is_some_and(|t| t.elapsed() < p.lookup_interval)
            {
                continue;
            }
            last.insert(r.id.clone(), tokio::time::Instant::now());
            match lookup(&upstreams, store.as_ref(), up, &r, None, clock()).await {
                Ok(v) => {
                    metrics.lookup(v.label());
                    tracing::info!(action = %r.id, result = v.label(), "background lookup");
                }
                Err(e) => tracing::warn!(action = %r.id, error = %e, "background lookup"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn judging_answers() {
        let mut cfg = LookupConfig {
            method: "GET".into(),
            path: "/v1/charges?key={key}".into(),
            found: "/data/0/id".into(),
            object: String::new(),
            status: 200,
            absent_after: crate::config::Dur(Duration::from_secs(600)),
            headers_env: Default::default(),
            headers: Default::default(),
        };
        let ok = StatusCode::OK;
        let applied = |id: &str, object: Option<Value>| {
            Ok(Found::Applied {
                external_id: id.into(),
                object,
            })
        };
        let page = serde_json::json!({"object": "search_result", "data": [{"id": "ch_1", "object": "charge"}]});
        assert_eq!(
            judge(&cfg, ok, page.to_string().as_bytes()),
            applied("ch_1", None)
        );
        assert_eq!(
            judge(&cfg, ok, br#"{"data":[{"id":7}]}"#),
            applied("7", None)
        );
        assert_eq!(judge(&cfg, ok, br#"{"data":[]}"#), Ok(Found::Absent));
        assert_eq!(
            judge(&cfg, ok, br#"{"data":[{"id":null}]}"#),
            Ok(Found::Absent)
        );
        assert_eq!(judge(&cfg, ok, b"not json"), Ok(Found::Absent));
        assert_eq!(judge(&cfg, StatusCode::NOT_FOUND, b""), Ok(Found::Absent));
        assert!(judge(&cfg, StatusCode::INTERNAL_SERVER_ERROR, b"").is_err());
        assert!(judge(&cfg, StatusCode::UNAUTHORIZED, b"").is_err());
        // `object` picks the created object out of a search result.
        cfg.object = "/data/0".into();
        assert_eq!(
            judge(&cfg, ok, page.to_string().as_bytes()),
            applied(
                "ch_1",
                Some(serde_json::json!({"id": "ch_1", "object": "charge"}))
            )
        );
    }

    #[test]
    fn keys_are_url_encoded() {
        assert_eq!(encode_key("a b/c?d&e"), "a%20b%2Fc%3Fd%26e");
        assert_eq!(encode_key("ts-0af3"), "ts-0af3");
    }
}

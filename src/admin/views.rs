//! The admin API's read views: an action as the console shows it, the write log read and
//! verified, and the overview (actions by state, the unknown waiting, the last hour).

use super::*;

/// The whole record as the admin API shows it.
pub fn record_view(r: &Record, redactor: &crate::redact::Redactor) -> Value {
    let mut v = action_json(r);
    v["principal"] = json!(principal_short(&r.principal));
    v["fingerprint"] = json!(r.fingerprint);
    v["needs_decision"] = json!(r.needs_decision);
    // The client's own key when it was not the action's (SPEC §4.1): evidence.
    v["client_key"] = json!(r.client_key);
    v["twin_guard"] = json!(r.twin);
    // The kept body, redacted again by today's rules (a name added to `log.redact_query` since
    // the write applies to it too).
    let content_type = r
        .request
        .headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        .map(|(_, v)| v.as_bytes());
    let body = r
        .request
        .body
        .as_deref()
        .and_then(|b| redactor.body(content_type, b.as_bytes()));
    v["request"] = json!({
        "headers": r.request.headers,
        "body_size": r.request.body_size,
        "body_sha256": r.request.body_sha256,
        "body": body,
    });
    v["evidence"] = evidence_json(r);
    v["response"] = match &r.response {
        None => Value::Null,
        Some(s) => json!({
            "status": s.status,
            "headers": s.headers.iter().map(|(k, val)| {
                let secret = http::HeaderName::from_bytes(k.as_bytes())
                    .map(|n| redactor.is_secret_header(&n))
                    .unwrap_or(false);
                (k.clone(), if secret { REDACTED.to_string() } else { val.clone() })
            }).collect::<Vec<_>>(),
            "size": s.size,
            "stored": s.body != crate::action::BodyRef::Absent,
            "source": s.source,
        }),
    };
    v["resolution"] = match &r.resolution {
        None => Value::Null,
        Some(res) => json!({
            "at": rfc3339(res.at),
            "actor": res.actor,
            "outcome": if res.applied { "applied" } else { "not-applied" },
            "reason": res.reason,
        }),
    };
    v
}

impl Admin {
    /// `GET /v1/log`: entries after `after`, as NDJSON, at most `limit`. With filters (`event`,
    /// `action`, `principal`, `since`, `until`: RFC 3339 times or their prefixes), at most
    /// [`LOG_SCAN`] entries are read per request; `Oncegate-Log-Next` names the last one read, to
    /// continue from (a page costs what it reads, never the whole log).
    pub(super) async fn log(&self, req: &Request<Incoming>) -> Response<ProxyBody> {
        let q = query(req);
        let after = param(&q, "after").and_then(|a| a.parse().ok()).unwrap_or(0);
        let limit = param(&q, "limit")
            .and_then(|a| a.parse().ok())
            .unwrap_or(1000usize)
            .clamp(1, 10_000);
        let want = |name: &str| param(&q, name).filter(|v| !v.is_empty());
        let (event, action, principal) = (want("event"), want("action"), want("principal"));
        let (since, until) = (want("since"), want("until"));
        let filtered = [event, action, principal, since, until]
            .iter()
            .any(Option::is_some);
        let keep = |e: &crate::log::Entry| {
            event.is_none_or(|want| e.event.as_str() == want)
                && action.is_none_or(|a| e.action.as_deref() == Some(a))
                && principal.is_none_or(|p| e.principal.as_deref() == Some(p))
                && since.is_none_or(|t| e.ts.as_str() >= t)
                && until.is_none_or(|t| e.ts.as_str() < t)
        };
        let mut out = Vec::new();
        let (mut cursor, mut read, mut found) = (after, 0usize, 0usize);
        loop {
            let batch = if filtered { 1000 } else { limit };
            let entries = match self.proxy.store.log(cursor, batch).await {
                Ok(e) => e,
                Err(e) => return store_problem(e),
            };
            let n = entries.len();
            for e in entries {
                cursor = e.seq;
                read += 1;
                if keep(&e) {
                    out.extend(serde_json::to_vec(&e).expect("entries serialize"));
                    out.push(b'\n');
                    found += 1;
                    if found >= limit {
                        break;
                    }
                }
            }
            if !filtered || n < batch || found >= limit || read >= LOG_SCAN {
                break;
            }
        }
        let mut r = Response::new(full(Bytes::from(out)));
        r.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/x-ndjson"),
        );
        r.headers_mut()
            .insert("oncegate-log-next", HeaderValue::from(cursor));
        r
    }

    /// `GET /v1/overview`: actions by state, the unknown ones waiting longest (oldest first),
    /// and the last hour by minute (writes by outcome, unknown actions waiting).
    pub(super) async fn overview(&self) -> Response<ProxyBody> {
        let counts = match self.proxy.store.counts().await {
            Ok(c) => c,
            Err(e) => return store_problem(e),
        };
        let unknown = Filter {
            state: Some(State::Unknown),
            ..Filter::default()
        };
        let waiting = match self.proxy.store.scan(unknown, 50).await {
            Ok(rs) => rs,
            Err(e) => return store_problem(e),
        };
        let minutes = &self.proxy.metrics.minutes;
        minutes.waiting(&counts);
        let by_state: serde_json::Map<String, Value> = counts
            .into_iter()
            .map(|(s, n)| (s.as_str().to_string(), json!(n)))
            .collect();
        let now = (self.proxy.clock)();
        let waiting: Vec<Value> = waiting
            .iter()
            .map(|r| {
                let mut v = action_json(r);
                v["waiting_secs"] = json!(now.saturating_sub(r.updated_at) / 1000);
                v
            })
            .collect();
        let head = self.proxy.store.log_head().await.map(|(seq, _)| seq).ok();
        json_response(
            StatusCode::OK,
            &json!({
                "actions": by_state,
                "unknown_oldest": waiting,
                "log_head_seq": head,
                "minutes": minutes_json(&minutes.last_hour()),
            }),
        )
    }

    pub(super) async fn verify(&self) -> Response<ProxyBody> {
        match self.proxy.store.verify_log().await {
            Ok(v) => json_response(
                StatusCode::OK,
                &json!({
                    "ok": v.ok,
                    "entries": v.entries,
                    "head": v.head,
                    "head_seq": v.head_seq,
                    "first_bad_seq": v.first_bad_seq,
                }),
            ),
            Err(e) => store_problem(e),
        }
    }
}

/// The last hour for the console's chart: a minute's start (Unix seconds), its writes by the
/// chart's kinds, and the most unknown actions seen waiting in it (`null`: not sampled).
fn minutes_json(hour: &[crate::minutes::Minute]) -> Value {
    let rows: Vec<Value> = hour
        .iter()
        .map(|m| {
            let mut o = serde_json::Map::new();
            o.insert("at".into(), json!(m.at));
            for (k, n) in crate::minutes::KINDS.iter().zip(m.writes) {
                o.insert((*k).into(), json!(n));
            }
            o.insert("unknown_waiting".into(), json!(m.unknown_waiting));
            Value::Object(o)
        })
        .collect();
    Value::Array(rows)
}

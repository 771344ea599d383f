//! The proxy's own paths on the main listener (SPEC §10.1): a task's actions, as a resumed
//! worker reads them.

use super::*;

impl Proxy {
    /// The proxy's own paths on the main listener (SPEC §10.1).
    pub(super) async fn own(
        &self,
        req: Request<Incoming>,
        path: &str,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let task = path
            .strip_prefix("/_oncegate/tasks/")
            .filter(|t| !t.is_empty() && !t.contains('/') && req.method() == Method::GET)
            .ok_or_else(|| ProxyError::NoRoute(path.to_string()))?;
        let task = percent_decode(task);
        let records = self
            .store
            .scan(
                Filter {
                    task: Some(task.clone()),
                    ..Filter::default()
                },
                10_000,
            )
            .await
            .map_err(|e| store_unavailable(e, None))?;
        // Only the caller's own actions: the principal as each record's upstream computes it.
        let mine: Vec<Value> = records
            .iter()
            .filter(|r| {
                self.config
                    .upstreams
                    .iter()
                    .find(|u| u.name == r.upstream)
                    .is_some_and(|u| {
                        identity::principal(req.headers(), &u.policy, &self.keyer) == r.principal
                    })
            })
            .map(task_entry)
            .collect();
        let body = json!({ "task": task, "actions": mine });
        let mut resp = Response::new(full(serde_json::to_vec(&body).expect("JSON serializes")));
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        Ok(resp)
    }
}

/// One action in a task view (SPEC §10.1).
pub fn task_entry(r: &Record) -> Value {
    let mut v = action_json(r);
    v["status"] = json!(r.response.as_ref().map(|s| s.status).or_else(|| {
        r.evidence
            .last()
            .and_then(|a| a.tries.iter().rev().find_map(|t| t.status))
    }));
    v
}

/// Decodes `%XX` escapes of a path segment (`+` stays `+`).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

//! The admin API (SPEC §10.2) on its own listener: finding, inspecting and settling actions, the
//! task view for every principal, the write log, health and metrics.
//!
//! Everything under `/v1/` needs `Authorization: Bearer <token>` when a token is configured
//! (compared in constant time); `/healthz`, `/readyz` and `/metrics` never do. Nothing here shows a
//! credential: request headers were redacted when stored, and stored response headers are
//! redacted again on the way out.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::action::{rfc3339, Record, Resolve, State};
use crate::error::{action_json, evidence_json};
use crate::identity::principal_short;
use crate::log::Event;
use crate::lookup::{self, Verdict};
use crate::proxy::{task_entry, Proxy};
use crate::redact::REDACTED;
use crate::store::{Filter, StoreError};
use crate::upstream::{full, ProxyBody};

mod views;
pub use views::record_view;

/// The admin service.
pub struct Admin {
    proxy: Arc<Proxy>,
    token: Option<String>,
    /// The listener's own address: requests from a page of another origin are refused.
    local: Option<std::net::SocketAddr>,
}

/// The shortest admin token accepted on a listener that is not loopback (SPEC §10.2).
pub const TOKEN_MIN_REMOTE: usize = 16;

/// Compares two secrets without leaking where they differ.
fn same_secret(a: &str, b: &str) -> bool {
    let (x, y) = (Sha256::digest(a.as_bytes()), Sha256::digest(b.as_bytes()));
    x.iter()
        .zip(y.iter())
        .fold(0u8, |acc, (p, q)| acc | (p ^ q))
        == 0
}

fn json_response(status: StatusCode, v: &Value) -> Response<ProxyBody> {
    let mut r = Response::new(full(serde_json::to_vec(v).expect("JSON serializes")));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// An admin error as an RFC 9457 problem.
fn problem(status: StatusCode, name: &str, detail: impl Into<String>) -> Response<ProxyBody> {
    let mut r = json_response(
        status,
        &json!({
            "type": format!("urn:oncegate:problem:{name}"),
            "title": status.canonical_reason().unwrap_or("Error"),
            "status": status.as_u16(),
            "detail": detail.into(),
        }),
    );
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    if status == StatusCode::UNAUTHORIZED {
        r.headers_mut()
            .insert("www-authenticate", HeaderValue::from_static("Bearer"));
    }
    r
}

fn store_problem(e: StoreError) -> Response<ProxyBody> {
    match e {
        StoreError::Resolve(crate::action::ResolveError::NotFound(id)) => problem(
            StatusCode::NOT_FOUND,
            "not-found",
            format!("no action {id}"),
        ),
        StoreError::Resolve(e @ crate::action::ResolveError::NotUnknown { .. }) => {
            problem(StatusCode::CONFLICT, "not-unknown", e.to_string())
        }
        e => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
            e.to_string(),
        ),
    }
}

/// Query parameters, decoded.
/// The operator's and auditor's console (`src/console/`), embedded: nothing is fetched at run time.
const CONSOLE_HTML: &str = include_str!("console/index.html");
const CONSOLE_JS: &str = include_str!("console/console.js");
const CONSOLE_CSS: &str = include_str!("console/console.css");

/// A console asset, with headers that keep the page to itself: scripts and styles only from
/// this listener, no framing, no referrer, nothing cached.
fn console(body: &'static str, content_type: &'static str) -> Response<ProxyBody> {
    let mut r = Response::new(full(Bytes::from_static(body.as_bytes())));
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        "content-security-policy",
        HeaderValue::from_static(
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; \
             connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
        ),
    );
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    h.insert("x-frame-options", HeaderValue::from_static("DENY"));
    h.insert("referrer-policy", HeaderValue::from_static("no-referrer"));
    h.insert("cache-control", HeaderValue::from_static("no-store"));
    r
}

/// Log entries read at most per filtered `GET /v1/log` request.
const LOG_SCAN: usize = 50_000;

fn query(req: &Request<Incoming>) -> Vec<(String, String)> {
    req.uri()
        .query()
        .map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default()
}

fn param<'a>(q: &'a [(String, String)], name: &str) -> Option<&'a str> {
    q.iter()
        .find(|(k, v)| k == name && !v.is_empty())
        .map(|(_, v)| v.as_str())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResolveBody {
    outcome: String,
    external_id: Option<String>,
    reason: Option<String>,
}

impl Admin {
    pub fn new(
        proxy: Arc<Proxy>,
        token: Option<String>,
        local: Option<std::net::SocketAddr>,
    ) -> Admin {
        Admin {
            proxy,
            token: token.filter(|t| !t.is_empty()),
            local,
        }
    }

    /// Whether a browser page of another origin sent this (CSRF, DNS rebinding): an `Origin`
    /// that is not the listener's own, or, on a loopback listener, a `Host` that names another.
    fn foreign(&self, req: &Request<Incoming>) -> Option<String> {
        let local = self.local?;
        let own = |authority: &str| {
            authority == local.to_string()
                || (local.ip().is_loopback() && authority == format!("localhost:{}", local.port()))
        };
        // A listener on every address (0.0.0.0) is reached under whichever of them the
        // browser used: a page of the same origin is the one whose `Host` it names, on the
        // listener's port.
        let host = req
            .headers()
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok());
        let same_host = |authority: &str| {
            local.ip().is_unspecified()
                && host == Some(authority)
                && authority.rsplit_once(':').map(|(_, p)| p) == Some(&local.port().to_string())
        };
        if let Some(origin) = req.headers().get(http::header::ORIGIN) {
            let o = origin.to_str().unwrap_or("");
            let authority = o.strip_prefix("http://").unwrap_or("\u{0}");
            if !own(authority) && !same_host(authority) {
                return Some(format!("requests from the origin {o:?} are refused"));
            }
        }
        if local.ip().is_loopback() {
            if let Some(host) = req.headers().get(http::header::HOST) {
                let h = host.to_str().unwrap_or("");
                if !own(h) {
                    return Some(format!("requests for the host {h:?} are refused"));
                }
            }
        }
        None
    }

    fn authorized(&self, req: &Request<Incoming>) -> bool {
        let Some(token) = &self.token else {
            // No token configured: everything but health and metrics stays locked.
            return false;
        };
        req.headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|given| same_secret(given.trim(), token))
    }

    pub async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<ProxyBody> {
        let path = req.uri().path().to_string();
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        let m = req.method().clone();
        match (m.clone(), segs.as_slice()) {
            (Method::GET, ["healthz"]) => {
                return json_response(StatusCode::OK, &json!({"ok": true}))
            }
            (Method::GET, ["readyz"]) => return self.ready().await,
            (Method::GET, ["metrics"]) => return self.metrics().await,
            // The console's page and assets hold no data: the data comes from the API, with the
            // token the operator types in.
            (Method::GET, [""]) => return console(CONSOLE_HTML, "text/html; charset=utf-8"),
            (Method::GET, ["console.js"]) => {
                return console(CONSOLE_JS, "text/javascript; charset=utf-8")
            }
            (Method::GET, ["console.css"]) => {
                return console(CONSOLE_CSS, "text/css; charset=utf-8")
            }
            // Browsers ask for one on every page: none, rather than a 401 in the console's log.
            (Method::GET, ["favicon.ico"]) => {
                let mut r = Response::new(full(Bytes::new()));
                *r.status_mut() = StatusCode::NO_CONTENT;
                return r;
            }
            _ => {}
        }
        if let Some(why) = self.foreign(&req) {
            return problem(StatusCode::FORBIDDEN, "forbidden", why);
        }
        let var = &self.proxy.config.admin.token_env;
        if !self.authorized(&req) {
            let detail = if self.token.is_some() {
                format!("send Authorization: Bearer <the token in {var}>")
            } else {
                format!(
                    "the admin API is locked: no token is set; set {var} in the proxy's environment and restart it"
                )
            };
            return problem(StatusCode::UNAUTHORIZED, "unauthorized", detail);
        }
        if m == Method::POST {
            let json = req
                .headers()
                .get(CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split(';').next())
                .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
            if !json {
                // A form a page can post without asking: never an admin command.
                return problem(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported-media-type",
                    "POST bodies must be application/json",
                );
            }
        }
        match (m, segs.as_slice()) {
            (Method::GET, ["v1", "actions"]) => self.list(&req).await,
            (Method::GET, ["v1", "actions", id]) => self.show(id).await,
            (Method::POST, ["v1", "actions", id, "resolve"]) => {
                let id = id.to_string();
                self.resolve(&id, req).await
            }
            (Method::POST, ["v1", "actions", id, "lookup"]) => self.lookup(id).await,
            // A task is any string, percent-encoded into its segment (`/`, `%`, `?`, `#`).
            (Method::GET, ["v1", "tasks", task]) => {
                let task = percent_encoding::percent_decode_str(task).decode_utf8_lossy();
                self.task(&task).await
            }
            (Method::GET, ["v1", "log"]) => self.log(&req).await,
            (Method::GET, ["v1", "log", "verify"]) => self.verify().await,
            (Method::GET, ["v1", "overview"]) => self.overview().await,
            _ => problem(
                StatusCode::NOT_FOUND,
                "not-found",
                format!("no admin endpoint {path}"),
            ),
        }
    }

    async fn ready(&self) -> Response<ProxyBody> {
        if self.proxy.draining() {
            // A drain has begun (SIGTERM): a load balancer sends new work elsewhere.
            return problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "not-ready",
                "draining: the proxy is stopping",
            );
        }
        match self.proxy.store.ready().await {
            Ok(()) => json_response(StatusCode::OK, &json!({"ready": true})),
            Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, "not-ready", e.to_string()),
        }
    }

    async fn metrics(&self) -> Response<ProxyBody> {
        let m = &self.proxy.metrics;
        if let Ok(counts) = self.proxy.store.counts().await {
            for (state, n) in counts {
                m.actions
                    .get_or_create(&crate::metrics::StateLabels {
                        state: state.as_str().to_string(),
                    })
                    .set(n as i64);
            }
        }
        if let Ok((seq, _)) = self.proxy.store.log_head().await {
            m.log_head.set(seq as i64);
        }
        let mut r = Response::new(full(m.encode()));
        r.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        );
        r
    }

    async fn list(&self, req: &Request<Incoming>) -> Response<ProxyBody> {
        let q = query(req);
        let state = match param(&q, "state") {
            None => None,
            Some(s) => match State::parse(s) {
                Some(st) => Some(st),
                None => {
                    return problem(
                        StatusCode::BAD_REQUEST,
                        "bad-request",
                        format!("state {s:?}: expected in_flight, succeeded, failed or unknown"),
                    )
                }
            },
        };
        let limit = match param(&q, "limit").map(str::parse::<usize>) {
            None => 100,
            Some(Ok(n)) if (1..=1000).contains(&n) => n,
            Some(_) => {
                return problem(
                    StatusCode::BAD_REQUEST,
                    "bad-request",
                    "limit must be 1 to 1000",
                )
            }
        };
        // Newest first; the cursor is the last item's `created_at.id`.
        let before = match param(&q, "after") {
            None => None,
            Some(after) => match after
                .split_once('.')
                .and_then(|(at, id)| Some((at.parse().ok()?, id.to_string())))
            {
                Some(c) => Some(c),
                None => {
                    return problem(
                        StatusCode::BAD_REQUEST,
                        "bad-request",
                        "after must be the `next` cursor of an earlier page",
                    )
                }
            },
        };
        let filter = Filter {
            state,
            upstream: param(&q, "upstream").map(str::to_string),
            principal: None,
            task: param(&q, "task").map(str::to_string),
            tool: param(&q, "tool").map(str::to_string),
            newest_first: true,
            before,
        };
        // One more than the page, to know whether another page follows.
        let mut page = match self.proxy.store.scan(filter, limit + 1).await {
            Ok(a) => a,
            Err(e) => return store_problem(e),
        };
        let more = page.len() > limit;
        page.truncate(limit);
        let cursor = |r: &Record| format!("{}.{}", r.created_at, r.id);
        let next = more.then(|| page.last().map(cursor)).flatten();
        let items: Vec<Value> = page
            .iter()
            .map(|r| {
                let mut v = action_json(r);
                v["principal"] = json!(principal_short(&r.principal));
                v
            })
            .collect();
        json_response(StatusCode::OK, &json!({"actions": items, "next": next}))
    }

    async fn record(&self, id: &str) -> Result<Record, Response<ProxyBody>> {
        match self.proxy.store.get(id).await {
            Ok(Some(r)) => Ok(r),
            Ok(None) => Err(problem(
                StatusCode::NOT_FOUND,
                "not-found",
                format!("no action {id}"),
            )),
            Err(e) => Err(store_problem(e)),
        }
    }

    async fn show(&self, id: &str) -> Response<ProxyBody> {
        match self.record(id).await {
            Ok(r) => {
                let mut v = record_view(&r, &self.proxy.redactor);
                let route = (self.proxy.config.upstreams.iter())
                    .find(|u| u.name == r.upstream && r.tool.is_none())
                    .map(|up| lookup::policy_for(up, &r));
                // What the fingerprint leaves out of the body: shown beside it, so an operator
                // knows which differences a retry may carry.
                v["request"]["fingerprint_ignore"] =
                    json!(route.map_or(&[][..], |p| &p.fingerprint_ignore[..]));
                // Whether `POST …/lookup` can ask the service (the console offers it only then).
                v["lookup"] = json!(self
                    .proxy
                    .config
                    .upstreams
                    .iter()
                    .find(|u| u.name == r.upstream)
                    .is_some_and(|up| lookup::policy_for(up, &r).lookup.is_some()));
                json_response(StatusCode::OK, &v)
            }
            Err(resp) => resp,
        }
    }

    async fn resolve(&self, id: &str, req: Request<Incoming>) -> Response<ProxyBody> {
        // Within the server's body_timeout, as a write's body: a trickled body does not hold
        // the admin listener's connection.
        let limit = self.proxy.config.server.body_timeout;
        let read = http_body_util::Limited::new(req.into_body(), 64 * 1024).collect();
        let body = match tokio::time::timeout(limit, read).await {
            Ok(Ok(b)) => b.to_bytes(),
            Ok(Err(e)) => return problem(StatusCode::BAD_REQUEST, "bad-request", e.to_string()),
            Err(_) => {
                return problem(
                    StatusCode::REQUEST_TIMEOUT,
                    "body-timeout",
                    format!("the request body did not arrive within body_timeout ({limit:?})"),
                )
            }
        };
        let b: ResolveBody = match serde_json::from_slice(&body) {
            Ok(b) => b,
            Err(e) => {
                return problem(
                    StatusCode::BAD_REQUEST,
                    "bad-request",
                    format!("expected {{\"outcome\": \"applied\"|\"not-applied\", \"external_id\"?, \"reason\"}}: {e}"),
                )
            }
        };
        let applied = match b.outcome.as_str() {
            "applied" => true,
            "not-applied" => false,
            other => {
                return problem(
                    StatusCode::BAD_REQUEST,
                    "bad-request",
                    format!("outcome {other:?}: expected \"applied\" or \"not-applied\""),
                )
            }
        };
        let Some(reason) = b.reason.filter(|r| !r.trim().is_empty()) else {
            return problem(
                StatusCode::BAD_REQUEST,
                "bad-request",
                "a reason is required",
            );
        };
        let res = Resolve {
            applied,
            external_id: if applied { b.external_id } else { None },
            response: None,
            body: None,
            actor: "admin".into(),
            reason,
            now: (self.proxy.clock)(),
            // An operator's word settles it either way, at once.
            absent_after: None,
        };
        match self
            .proxy
            .store
            .resolve(id.to_string(), res, Event::Resolved)
            .await
        {
            Ok(r) => json_response(StatusCode::OK, &record_view(&r, &self.proxy.redactor)),
            Err(e) => store_problem(e),
        }
    }

    async fn lookup(&self, id: &str) -> Response<ProxyBody> {
        let r = match self.record(id).await {
            Ok(r) => r,
            Err(resp) => return resp,
        };
        let Some(up) = self
            .proxy
            .config
            .upstreams
            .iter()
            .find(|u| u.name == r.upstream)
        else {
            return problem(
                StatusCode::CONFLICT,
                "no-lookup",
                "the action's upstream is no longer configured",
            );
        };
        if lookup::policy_for(up, &r).lookup.is_none() {
            return problem(
                StatusCode::CONFLICT,
                "no-lookup",
                "no lookup is configured for this action's route",
            );
        }
        if r.state != State::Unknown {
            return problem(
                StatusCode::CONFLICT,
                "not-unknown",
                format!("action {id} is {}, not unknown", r.state.as_str()),
            );
        }
        match lookup::lookup(
            &self.proxy.upstreams,
            self.proxy.store.as_ref(),
            up,
            &r,
            None,
            (self.proxy.clock)(),
        )
        .await
        {
            Ok(v) => {
                self.proxy.metrics.lookup(v.label());
                let (action, detail) = match &v {
                    Verdict::Applied(r) | Verdict::NotApplied(r) => (r.clone(), None),
                    Verdict::Unknown(why) => (r, Some(why.clone())),
                };
                json_response(
                    StatusCode::OK,
                    &json!({
                        "result": v.label(),
                        "detail": detail,
                        "action": record_view(&action, &self.proxy.redactor),
                    }),
                )
            }
            Err(e) => store_problem(e),
        }
    }

    async fn task(&self, task: &str) -> Response<ProxyBody> {
        let filter = Filter {
            task: Some(task.to_string()),
            ..Filter::default()
        };
        match self.proxy.store.scan(filter, 10_000).await {
            Ok(rs) => {
                let items: Vec<Value> = rs
                    .iter()
                    .map(|r| {
                        let mut v = task_entry(r);
                        v["principal"] = json!(principal_short(&r.principal));
                        v
                    })
                    .collect();
                json_response(StatusCode::OK, &json!({"task": task, "actions": items}))
            }
            Err(e) => store_problem(e),
        }
    }
}

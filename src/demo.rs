//! `oncegate demo`: the guide's scenario, narrated with real requests on loopback. A small
//! payments service (which can stall after accepting a charge), an MCP mail server (whose answer
//! can come late), the proxy on a temporary store, and an agent that times out, retries, resumes,
//! resends a tool call and audits. Exits 0 only if every expectation
//! held.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};

/// The payments-like service.
#[derive(Default)]
struct Payments {
    /// Charges by the idempotency key they were created with.
    charges: Mutex<HashMap<String, String>>,
    receipts: AtomicU64,
    next: AtomicU64,
    /// The next charge is accepted, then its answer never comes.
    stall_next_charge: AtomicBool,
    /// How many receipt saves fail before one succeeds.
    failing_saves: AtomicU64,
}

type Resp = http::Response<Full<Bytes>>;

fn reply(status: u16, v: Value) -> Resp {
    let mut r = http::Response::new(Full::new(Bytes::from(v.to_string())));
    *r.status_mut() = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::OK);
    r.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    r
}

async fn serve_payments(
    p: Arc<Payments>,
    req: http::Request<hyper::body::Incoming>,
) -> Result<Resp, hyper::Error> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let key = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let _ = req.into_body().collect().await?;
    Ok(match (method.as_str(), path.as_str()) {
        ("POST", "/v1/charges") => {
            let key = key.unwrap_or_default();
            let existing = p
                .charges
                .lock()
                .map(|c| c.get(&key).cloned())
                .ok()
                .flatten();
            let id = match existing {
                Some(id) => id,
                None => {
                    let id = format!("ch_{}", 1000 + p.next.fetch_add(1, Ordering::SeqCst));
                    if let Ok(mut c) = p.charges.lock() {
                        c.insert(key, id.clone());
                    }
                    id
                }
            };
            if p.stall_next_charge.swap(false, Ordering::SeqCst) {
                // Accepted and stored; the answer is lost.
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
            reply(
                201,
                json!({"id": id, "object": "charge", "amount": 4200, "currency": "eur"}),
            )
        }
        ("GET", "/v1/charges") => {
            let key = form_urlencoded::parse(query.as_bytes())
                .find(|(k, _)| k == "idempotency_key")
                .map(|(_, v)| v.into_owned())
                .unwrap_or_default();
            let found = p.charges.lock().ok().and_then(|c| c.get(&key).cloned());
            let data: Vec<Value> = found
                .into_iter()
                .map(|id| json!({"id": id, "object": "charge", "amount": 4200, "currency": "eur"}))
                .collect();
            reply(200, json!({"data": data}))
        }
        ("POST", "/v1/receipts") => {
            if p.failing_saves
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                reply(503, json!({"error": "receipts store is restarting"}))
            } else {
                let n = p.receipts.fetch_add(1, Ordering::SeqCst) + 1;
                reply(201, json!({"id": format!("rcpt_{n}"), "object": "receipt"}))
            }
        }
        _ => reply(404, json!({"error": "no such endpoint"})),
    })
}

/// Serves `handle` on a loopback port of its own; returns the address.
async fn serve<S, F>(
    state: Arc<S>,
    handle: fn(Arc<S>, http::Request<hyper::body::Incoming>) -> F,
) -> Result<SocketAddr, String>
where
    S: Send + Sync + 'static,
    F: std::future::Future<Output = Result<Resp, hyper::Error>> + Send + 'static,
{
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = l.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let state = state.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| handle(state.clone(), req));
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    Ok(addr)
}

/// An MCP server with one tool, `send_email`, answered as an SSE stream. Every execution is
/// counted; the first answer comes after the proxy's timeout.
#[derive(Default)]
struct Mail {
    sent: AtomicU64,
    slow_first: AtomicBool,
}

async fn serve_mail(
    m: Arc<Mail>,
    req: http::Request<hyper::body::Incoming>,
) -> Result<Resp, hyper::Error> {
    let body = req.into_body().collect().await?.to_bytes();
    let msg: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let id = msg["id"].clone();
    let result = if msg["method"] == "tools/call" && msg["params"]["name"] == "send_email" {
        let n = m.sent.fetch_add(1, Ordering::SeqCst) + 1;
        if m.slow_first.swap(false, Ordering::SeqCst) {
            // Sent; the answer is slow to come back.
            tokio::time::sleep(Duration::from_millis(1500)).await;
        }
        json!({"content": [{"type": "text", "text": format!("email #{n} sent to ops@acme.test")}]})
    } else {
        json!({})
    };
    let event = format!(
        "event: message\ndata: {}\n\n",
        json!({"jsonrpc": "2.0", "id": id, "result": result})
    );
    let mut r = http::Response::new(Full::new(Bytes::from(event)));
    r.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("text/event-stream"),
    );
    Ok(r)
}

/// Narration, coloured on a terminal.
struct Say {
    color: bool,
    failures: Vec<String>,
}

impl Say {
    fn paint(&self, code: &str, s: &str) -> String {
        if self.color {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    }
    fn step(&self, n: u32, title: &str) {
        println!("\n{}", self.paint("1", &format!("{n}. {title}")));
    }
    fn agent(&self, s: &str) {
        println!("   {} {s}", self.paint("36", "agent →"));
    }
    fn proxy(&self, s: &str) {
        println!("   {} {s}", self.paint("35", "oncegate ←"));
    }
    fn fact(&self, s: &str) {
        println!("   {} {s}", self.paint("2", "·"));
    }
    fn expect(&mut self, ok: bool, what: &str) {
        if ok {
            println!("   {} {what}", self.paint("32", "✓"));
        } else {
            println!("   {} {what}", self.paint("31", "✗"));
            self.failures.push(what.to_string());
        }
    }
}

struct Agent {
    client: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        Full<Bytes>,
    >,
    proxy: SocketAddr,
}

struct Answer {
    status: u16,
    headers: http::HeaderMap,
    body: Value,
}

impl Answer {
    fn header(&self, n: &str) -> &str {
        self.headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
    }
}

impl Agent {
    async fn call(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Result<Answer, String> {
        let mut req = http::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.proxy))
            .header("authorization", "Bearer sk_demo_agent_7")
            .header("content-type", "application/x-www-form-urlencoded");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| e.to_string())?;
        let resp = self.client.request(req).await.map_err(|e| e.to_string())?;
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(Answer {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        })
    }
}

impl Agent {
    /// An MCP `tools/call` of `send_email` with JSON-RPC id `id`; the answer's final message
    /// (from a JSON body or the last event of an SSE stream).
    async fn tool_call(&self, id: u64) -> Result<Answer, String> {
        let body = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "send_email", "arguments": {"to": "ops@acme.test", "subject": "Your receipt"}}});
        let req = http::Request::post(format!("http://{}/mail/mcp", self.proxy))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| e.to_string())?;
        let resp = self.client.request(req).await.map_err(|e| e.to_string())?;
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        let text = String::from_utf8_lossy(&bytes);
        let last = text
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix("data: "))
            .unwrap_or(&text);
        Ok(Answer {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body: serde_json::from_str(last).unwrap_or(Value::Null),
        })
    }
}

/// What a tool result says, in one line.
fn tool_says(a: &Answer) -> String {
    let text = a.body["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or("-");
    let cut: String = text.chars().take(72).collect();
    format!(
        "id {} · isError: {} · \"{cut}{}\"",
        a.body["id"],
        a.body["result"]["isError"].as_bool().unwrap_or(false),
        if cut.len() < text.len() { "…" } else { "" }
    )
}

/// Runs the scenario. `Err` lists the expectations that did not hold.
pub async fn run(color: bool) -> Result<(), String> {
    let tmp = std::env::temp_dir().join(format!("oncegate-demo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let payments = Arc::new(Payments::default());
    let up = serve(payments.clone(), serve_payments).await?;
    let mail = Arc::new(Mail::default());
    let mail_up = serve(mail.clone(), serve_mail).await?;
    let config = crate::config::Config::parse(&format!(
        r#"
[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[store]
path = {:?}
[defaults]
timeout = "800ms"
[[upstreams]]
name = "payments"
prefix = "/payments"
url = "http://{up}"
external_id = "/id"
lookup = {{ method = "GET", path = "/v1/charges?idempotency_key={{key}}", found = "/data/0/id", object = "/data/0", status = 201 }}
  [[upstreams.routes]]
  methods = ["POST"]
  path = "/v1/receipts"
  retries = 0
[[upstreams]]
name = "mail"
prefix = "/mail"
url = "http://{mail_up}"
protocol = "mcp"
"#,
        tmp.join("store").display().to_string()
    ))
    .map_err(|e| e.to_string())?;
    let metrics = Arc::new(crate::metrics::Metrics::new());
    let options = crate::store_options(&config, &metrics)?;
    let store = crate::open_store(&config, options)
        .await
        .map_err(|e| e.to_string())?;
    let proxy_l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let admin_l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let (proxy, admin) = (
        proxy_l.local_addr().map_err(|e| e.to_string())?,
        admin_l.local_addr().map_err(|e| e.to_string())?,
    );
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    // The demo's own admin token, for the reviewer's step: the admin API always needs one.
    let token = crate::identity::hex(&rand::random::<[u8; 16]>());
    let running = tokio::spawn(crate::run(
        config,
        crate::Listeners {
            proxy: proxy_l,
            admin: Some(admin_l),
        },
        crate::Services::new(store, metrics, Some(token.clone())),
        async move {
            let _ = stop_rx.await;
        },
    ));
    // The admin API, as an operator or a reviewer reads it (the operator commands' client).
    let admin_api = crate::cli::AdminClient {
        base: format!("http://{admin}"),
        token: Some(token.clone()),
        token_env: "the demo's admin token".into(),
    };
    let admin_get = |path: &'static str| admin_api.json(http::Method::GET, path, None);
    let agent = Agent {
        client: hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http(),
        proxy,
    };
    let mut say = Say {
        color,
        failures: Vec::new(),
    };
    let charges = || payments.charges.lock().map(|c| c.len()).unwrap_or(0);
    let task = [
        ("oncegate-task", "onboard-acme"),
        ("oncegate-step", "charge-setup-fee"),
    ];

    println!(
        "oncegate demo: an agent charges a setup fee, then saves a receipt, through oncegate."
    );
    println!("The payments service runs on {up}; oncegate on {proxy} (admin {admin}).");

    say.step(1, "The charge times out after the service accepted it");
    payments.stall_next_charge.store(true, Ordering::SeqCst);
    say.agent("POST /payments/v1/charges amount=4200 (task onboard-acme, step charge-setup-fee)");
    let a = agent
        .call(
            "POST",
            "/payments/v1/charges",
            &task,
            "amount=4200&currency=eur",
        )
        .await?;
    say.proxy(&format!(
        "{} {} · duplicate_risk: {} · evidence: {}",
        a.status,
        a.body["type"]
            .as_str()
            .unwrap_or("-")
            .trim_start_matches("urn:oncegate:problem:"),
        a.body["duplicate_risk"],
        a.body["evidence"][0]["tries"][0]["error"]
            .as_str()
            .unwrap_or("-")
    ));
    say.fact(&format!("the service holds {} charge(s)", charges()));
    say.expect(
        a.status == 504 && a.body["outcome"] == "unknown",
        "the agent is told the outcome is unknown, not that it failed",
    );
    say.expect(charges() == 1, "the charge did happen at the service");

    say.step(
        2,
        "The agent retries; oncegate asks the service instead of charging again",
    );
    say.agent("the same POST again (the SDK's automatic retry)");
    let a = agent
        .call(
            "POST",
            "/payments/v1/charges",
            &task,
            "amount=4200&currency=eur",
        )
        .await?;
    say.proxy(&format!(
        "{} · Oncegate-Outcome: {} · Oncegate-Replay-Source: {} · charge {}",
        a.status,
        a.header("oncegate-outcome"),
        a.header("oncegate-replay-source"),
        a.body["id"].as_str().unwrap_or("-")
    ));
    say.fact(&format!("the service holds {} charge(s)", charges()));
    say.expect(
        a.status == 201 && a.header("oncegate-outcome") == "replayed",
        "the status lookup settled it as applied",
    );
    say.expect(
        a.body["object"] == "charge",
        "the agent gets the charge, as the write itself would have answered",
    );
    say.expect(charges() == 1, "no second charge");

    say.step(
        3,
        "Saving the receipt fails, and is retried without redoing the charge",
    );
    payments.failing_saves.store(1, Ordering::SeqCst);
    let save = [
        ("oncegate-task", "onboard-acme"),
        ("oncegate-step", "save-receipt"),
    ];
    say.agent("POST /payments/v1/receipts (step save-receipt)");
    let a = agent
        .call("POST", "/payments/v1/receipts", &save, "charge=ch_1000")
        .await?;
    say.proxy(&format!(
        "{} · Oncegate-Outcome: {}",
        a.status,
        a.header("oncegate-outcome")
    ));
    say.expect(
        a.status == 503 && a.header("oncegate-outcome") == "not-applied",
        "a failure that may recover, reported as not applied",
    );
    say.agent("retries only the unfinished step");
    let a = agent
        .call("POST", "/payments/v1/receipts", &save, "charge=ch_1000")
        .await?;
    say.proxy(&format!(
        "{} · Oncegate-Outcome: {} · receipt {}",
        a.status,
        a.header("oncegate-outcome"),
        a.body["id"].as_str().unwrap_or("-")
    ));
    say.fact(&format!(
        "the service holds {} charge(s) and {} receipt(s)",
        charges(),
        payments.receipts.load(Ordering::SeqCst)
    ));
    say.expect(a.status == 201, "the receipt is saved");
    say.expect(charges() == 1, "the charge was not redone");

    say.step(4, "A resumed worker asks what its task already did");
    say.agent("GET /_oncegate/tasks/onboard-acme");
    let a = agent
        .call("GET", "/_oncegate/tasks/onboard-acme", &[], "")
        .await?;
    let steps: Vec<String> = a.body["actions"]
        .as_array()
        .map(|v| v.as_slice())
        .unwrap_or_default()
        .iter()
        .map(|x| {
            format!(
                "{} {} ({})",
                x["step"].as_str().unwrap_or("-"),
                x["state"].as_str().unwrap_or("-"),
                x["external_id"].as_str().unwrap_or("-")
            )
        })
        .collect();
    say.proxy(&steps.join(", "));
    say.expect(
        steps.len() == 2 && steps.iter().all(|s| s.contains("succeeded")),
        "both steps are done; nothing is left to send",
    );

    say.step(
        5,
        "An MCP tool call's answer is lost; the agent resends it under a new id",
    );
    mail.slow_first.store(true, Ordering::SeqCst);
    say.agent("tools/call send_email (JSON-RPC id 1) via POST /mail/mcp");
    let a = agent.tool_call(1).await?;
    say.proxy(&tool_says(&a));
    say.fact(&format!(
        "the mail server sent {} email(s)",
        mail.sent.load(Ordering::SeqCst)
    ));
    say.expect(
        a.body["result"]["isError"] == true
            && a.body["result"]["structuredContent"]["outcome"] == "unknown",
        "the model reads that the email may have been sent",
    );
    say.agent("resends it at once, as a new call (id 2)");
    let a = agent.tool_call(2).await?;
    say.proxy(&tool_says(&a));
    say.expect(
        mail.sent.load(Ordering::SeqCst) == 1,
        "the resend is not sent while the outcome is unknown",
    );
    // The answer comes 1.5 s after the call; oncegate, still listening, records it. Waited for
    // (the admin API's count of unknown actions back to none) rather than for a fixed time,
    // which a slow moment of the machine could outlast.
    let recorded = tokio::time::Instant::now() + Duration::from_secs(10);
    while admin_get("/v1/overview").await?["actions"]["unknown"]
        .as_u64()
        .unwrap_or(0)
        > 0
        && tokio::time::Instant::now() < recorded
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    say.agent("the late answer has come in; resends again (id 3)");
    let a = agent.tool_call(3).await?;
    say.proxy(&format!(
        "{} · Oncegate-Outcome: {}",
        tool_says(&a),
        a.header("oncegate-outcome")
    ));
    say.fact(&format!(
        "the mail server sent {} email(s)",
        mail.sent.load(Ordering::SeqCst)
    ));
    say.expect(
        a.header("oncegate-outcome") == "replayed" && a.body["id"] == 3,
        "the resend gets the recorded result, under its own id",
    );
    say.expect(mail.sent.load(Ordering::SeqCst) == 1, "one email");

    say.step(6, "A security reviewer verifies the write log");
    let v = admin_get("/v1/log/verify").await?;
    say.proxy(&format!(
        "ok: {} · entries: {} · head: {}…",
        v["ok"],
        v["entries"],
        v["head"].as_str().unwrap_or("").get(..16).unwrap_or("")
    ));
    say.expect(
        v["ok"] == true,
        "the hash chain verifies, with no credential in it",
    );

    let _ = stop_tx.send(());
    let _ = running.await;
    let _ = std::fs::remove_dir_all(&tmp);
    println!();
    if say.failures.is_empty() {
        println!(
            "{}",
            say.paint(
                "32;1",
                "Every expectation held: one charge, one receipt, one email, nothing sent twice."
            )
        );
        Ok(())
    } else {
        Err(format!("expectations failed: {}", say.failures.join("; ")))
    }
}

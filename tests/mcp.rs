//! MCP tool calls through the proxy (SPEC §14), against the official MCP SDKs: the Python SDK's
//! server (`tests/mcp/server.py`, which counts every execution in its own ledger) and client
//! (`tests/mcp/client.py`), and the TypeScript SDK's client (`tests/mcp/client.mjs`). Those tests
//! need the SDKs (`ONCEGATE_PYTHON`, `ONCEGATE_MCP_NODE`; `.ci/run` installs them) and are marked
//! ignored with what they need. The ones at the top need no SDK: what the proxy refuses unsent.
#![allow(clippy::unwrap_used)]

mod support;

use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};
use support::mcp::{
    call_body, mcp_config, py_client_at, python, run_client, ts_client, McpServer, JSON_SSE,
};
use support::{Behavior, ChildProxy, FakeUpstream, TestClient, TestProxy};

#[tokio::test]
async fn what_cannot_be_classified_is_refused_unsent_as_json_rpc() {
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json(
        200,
        r#"{"jsonrpc":"2.0","id":1,"result":{}}"#,
    ));
    let proxy = TestProxy::start(&mcp_config(&format!("{}/mcp", up.url()), "")).await;
    let c = TestClient::default();
    let url = proxy.url("/mcp");
    let batch = format!(
        "[{},{}]",
        json!({"jsonrpc":"2.0","id":1,"method":"ping"}),
        call_body(2, "send_email", json!({"to": "a"}))
    );
    let mismatch = call_body(3, "send_email", json!({}));
    type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, String);
    let cases: Vec<Case> = vec![
        ("a batch holding a write", vec![], batch),
        ("Mcp-Name differs", vec![("mcp-name", "search")], mismatch),
        ("not JSON", vec![], "{nope".into()),
        (
            "a duplicate key",
            vec![],
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","method":"tools/call","params":{"name":"send_email"}}"#.into(),
        ),
    ];
    for (what, extra, body) in cases {
        let mut headers = JSON_SSE.to_vec();
        headers.extend(extra);
        let r = c.post(&url, &headers, &body).await;
        assert_eq!(r.status, 400, "{what}: {r:?}");
        let v = r.json();
        assert_eq!(v["error"]["code"], -32600, "{what}: {v}");
        assert_eq!(
            v["error"]["data"]["type"], "urn:oncegate:problem:bad-request",
            "{what}: {v}"
        );
    }
    assert_eq!(up.count(), 0, "nothing refused reached the server");
    // A batch of reads passes.
    let reads = format!(
        "[{},{}]",
        json!({"jsonrpc":"2.0","id":1,"method":"ping"}),
        call_body(2, "search", json!({"q": "a"}))
    );
    assert_eq!(c.post(&url, JSON_SSE, &reads).await.status, 200);
    assert_eq!(up.count(), 1);
    proxy.stop().await;
}

/// What the model reads when a tool call's outcome is unknown (SPEC §14.4): the tool's name,
/// what is known, to call again later with the same arguments, never to change them, to tell
/// the user; nothing about keys or the admin API (that is in `detail`). A key in `_meta` that
/// changes between calls is a new action, and the unsettled-twin guard stops it.
#[tokio::test]
async fn an_unknown_tool_call_tells_the_model_to_call_again_unchanged() {
    let up = FakeUpstream::start().await;
    up.push(Behavior::Hang);
    let config = mcp_config(&format!("{}/mcp", up.url()), "timeout = \"300ms\"")
        .replace("in_flight_wait = \"5s\"", "in_flight_wait = \"0s\"");
    let proxy = TestProxy::start(&config).await;
    let c = TestClient::default();
    let url = proxy.url("/mcp");
    let call = |id: u64, key: &str| {
        json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
            "name": "charge_card", "arguments": {"amount": 4200},
            "_meta": {"oncegate/key": key}}})
        .to_string()
    };
    let r = c.post(&url, JSON_SSE, &call(1, "k-1")).await;
    let result = &r.json()["result"];
    assert_eq!(result["isError"], true, "{result}");
    let text = result["content"][0]["text"].as_str().unwrap();
    assert!(
        text.starts_with("Outcome unknown: The tool call charge_card may have been applied"),
        "{text}"
    );
    assert!(
        text.contains("Call it again with the same arguments later"),
        "{text}"
    );
    assert!(text.contains("tell the user"), "{text}");
    for word in ["key", "admin", "/v1/actions"] {
        assert!(!text.contains(word), "{word} in {text}");
    }
    let detail = result["structuredContent"]["detail"].as_str().unwrap();
    assert!(detail.contains("/lookup"), "{detail}");
    // The same call under another key while the first is unknown: not run.
    let r = c.post(&url, JSON_SSE, &call(2, "k-2")).await;
    let result = &r.json()["result"];
    assert_eq!(
        result["structuredContent"]["type"], "urn:oncegate:problem:possible-duplicate",
        "{result}"
    );
    assert_eq!(up.count(), 1, "the tool ran once");
    proxy.stop().await;
}

#[tokio::test]
async fn a_json_answered_write_is_replayed_with_the_new_id_and_logged_with_its_tool() {
    let up = FakeUpstream::start().await;
    up.push(Behavior::json(
        200,
        r#"{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"sent"}]}}"#,
    ));
    let proxy = TestProxy::start(&mcp_config(&format!("{}/mcp", up.url()), "")).await;
    let c = TestClient::default();
    let url = proxy.url("/mcp");
    let first = c
        .post(
            &url,
            JSON_SSE,
            &call_body(1, "send_email", json!({"to": "a", "n": 1})),
        )
        .await;
    assert_eq!(first.status, 200);
    assert_eq!(first.header("oncegate-outcome"), Some("sent"));
    // The resend: a new id, other `_meta`, the arguments in another order.
    let resend = json!({"jsonrpc":"2.0","id":"r-2","method":"tools/call","params":{
        "_meta": {"progressToken": 9}, "arguments": {"n": 1, "to": "a"}, "name": "send_email"}});
    let second = c.post(&url, JSON_SSE, &resend.to_string()).await;
    assert_eq!(second.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(second.json()["id"], "r-2");
    assert_eq!(second.json()["result"]["content"][0]["text"], "sent");
    assert_eq!(up.count(), 1);
    // The record and the write log name the tool; never its arguments.
    let id = first.header("oncegate-action").unwrap().to_string();
    let action = proxy
        .admin("GET", &format!("/v1/actions/{id}"), "")
        .await
        .json();
    assert_eq!(action["tool"], "send_email", "{action}");
    let log = proxy.admin("GET", "/v1/log", "").await;
    let text = String::from_utf8_lossy(&log.body).to_string();
    assert!(text.contains("\"tool\":\"send_email\""), "{text}");
    assert!(
        !text.contains("\"to\""),
        "arguments never reach the log: {text}"
    );
    proxy.stop().await;
}

// ---- against the official SDKs ----

/// The Python with the MCP SDK (`ONCEGATE_PYTHON`).
/// Runs the Python SDK client: `tool` with `args`, plus `flags`; returns what it printed.
async fn py_client(proxy: &TestProxy, tool: &str, args: Value, flags: &[&str]) -> Value {
    py_client_at(&proxy.url("/mcp"), tool, args, flags).await
}

async fn proxy_for(server: &McpServer, extra: &str) -> TestProxy {
    TestProxy::start(&mcp_config(&server.url(), extra)).await
}

#[tokio::test]
#[ignore = "needs the MCP Python SDK (ONCEGATE_PYTHON)"]
async fn sdk_a_read_tool_runs_every_time_and_a_write_tool_once() {
    let server = McpServer::start(&[]);
    let proxy = proxy_for(&server, "").await;
    let reads = py_client(&proxy, "search", json!({"query": "q"}), &["--calls", "2"]).await;
    assert_eq!(server.ran("search"), 2, "{reads}");
    // The agent resends the same call (a new JSON-RPC id each time), then again from a new
    // connection: the server runs it once; every answer is the recorded result.
    let args = json!({"to": "ana@example.com", "subject": "invoice"});
    let first = py_client(&proxy, "send_email", args.clone(), &["--calls", "2"]).await;
    let later = py_client(&proxy, "send_email", args, &[]).await;
    assert_eq!(server.ran("send_email"), 1, "{first} {later}");
    let text = first["calls"][0]["text"].as_str().unwrap();
    assert!(text.starts_with("sent email #"), "{first}");
    assert_eq!(first["calls"][1]["text"], text);
    assert_eq!(later["calls"][0]["text"], text);
    proxy.stop().await;
}

#[tokio::test]
#[ignore = "needs the MCP Python SDK (ONCEGATE_PYTHON)"]
async fn sdk_keys_from_meta_and_headers() {
    let server = McpServer::start(&[]);
    let proxy = proxy_for(&server, "").await;
    // `_meta["oncegate/key"]`: the same key with the same call is one action.
    let meta = r#"{"oncegate/key": "invoice-41"}"#;
    let args = json!({"to": "bo@example.com", "subject": "receipt"});
    py_client(&proxy, "send_email", args.clone(), &["--meta", meta]).await;
    py_client(&proxy, "send_email", args.clone(), &["--meta", meta]).await;
    assert_eq!(server.ran("send_email"), 1);
    // The same key with other arguments is refused, and the model is told why.
    let other = json!({"to": "bo@example.com", "subject": "another"});
    let reused = py_client(&proxy, "send_email", other, &["--meta", meta]).await;
    assert_eq!(reused["calls"][0]["is_error"], true, "{reused}");
    assert_eq!(
        reused["calls"][0]["structured"]["type"], "urn:oncegate:problem:key-reused",
        "{reused}"
    );
    assert_eq!(server.ran("send_email"), 1);
    // Task and step headers: the agent regenerated the subject, it is still one step.
    let h = [
        "--header",
        "Oncegate-Task=onboard-7",
        "--header",
        "Oncegate-Step=welcome",
    ];
    let a = json!({"to": "cy@example.com", "subject": "Welcome!"});
    let b = json!({"to": "cy@example.com", "subject": "Welcome aboard"});
    py_client(&proxy, "send_email", a, &h).await;
    let again = py_client(&proxy, "send_email", b, &h).await;
    assert_eq!(server.ran("send_email"), 2, "{again}");
    assert_eq!(again["calls"][0]["is_error"], false, "{again}");
    // The task view shows the step, with its tool.
    let view = TestClient::default()
        .get(&proxy.url("/_oncegate/tasks/onboard-7"))
        .await
        .json();
    assert_eq!(view["actions"][0]["step"], "welcome", "{view}");
    assert_eq!(view["actions"][0]["tool"], "send_email", "{view}");
    proxy.stop().await;
}

#[tokio::test]
#[ignore = "needs the MCP Python SDK (ONCEGATE_PYTHON)"]
async fn sdk_a_denied_tool_never_runs_and_the_model_is_told() {
    let server = McpServer::start(&[]);
    let proxy = proxy_for(&server, "").await;
    let r = py_client(&proxy, "delete_everything", json!({"confirm": true}), &[]).await;
    let call = &r["calls"][0];
    assert_eq!(call["is_error"], true, "{r}");
    assert!(
        call["text"].as_str().unwrap().starts_with("Route denied"),
        "{r}"
    );
    assert_eq!(call["structured"]["retry"], "never", "{r}");
    assert_eq!(server.ran("delete_everything"), 0);
    proxy.stop().await;
}

#[tokio::test]
#[ignore = "needs the MCP Python SDK (ONCEGATE_PYTHON)"]
async fn sdk_a_late_answer_is_unknown_then_settles_and_the_resend_never_runs() {
    let server = McpServer::start(&[]);
    // The proxy waits 1 s for an event; the charge answers when the test opens its gate (each
    // client is a new Python process, whose start alone can take seconds on a loaded machine).
    let proxy = proxy_for(&server, "").await;
    let gate = server.tmp.path().join("answer");
    let args = json!({"amount": 4200, "seconds": 60, "gate": gate});
    let first = py_client(&proxy, "slow_charge", args.clone(), &[]).await;
    let call = &first["calls"][0];
    assert_eq!(call["is_error"], true, "{first}");
    assert_eq!(call["structured"]["outcome"], "unknown", "{first}");
    assert_eq!(call["structured"]["duplicate_risk"], true, "{first}");
    assert!(
        call["text"]
            .as_str()
            .unwrap()
            .starts_with("Outcome unknown"),
        "{first}"
    );
    // The agent resends at once: the proxy does not send it.
    let resend = py_client(&proxy, "slow_charge", args.clone(), &[]).await;
    assert_eq!(
        resend["calls"][0]["structured"]["outcome"], "unknown",
        "{resend}"
    );
    // The server finishes the charge; the proxy, still reading the stream, records its answer.
    let id = call["structured"]["action"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    std::fs::write(&gate, "").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let rec = proxy.store.get(&id).await.unwrap().unwrap();
        if rec.state != oncegate::action::State::Unknown {
            assert_eq!(rec.state, oncegate::action::State::Succeeded, "{rec:?}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the late answer was never recorded: {rec:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let settled = py_client(&proxy, "slow_charge", args, &[]).await;
    assert_eq!(server.ran("slow_charge"), 1, "{settled}");
    let text = settled["calls"][0]["text"].as_str().unwrap();
    assert!(text.starts_with("charged 4200"), "{settled}");
    proxy.stop().await;
}

#[tokio::test]
#[ignore = "needs the MCP Python SDK (ONCEGATE_PYTHON)"]
async fn sdk_a_client_that_disconnects_does_not_cancel_the_call_and_its_reissue_gets_the_result() {
    let server = McpServer::start(&[]);
    let proxy = proxy_for(&server, r#"timeout = "5s""#).await;
    let args = json!({"amount": 99, "seconds": 1.0});
    // A client sends the call, reads the stream's head, and goes away.
    {
        let req = hyper::Request::post(proxy.url("/mcp"))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(http_body_util::Full::new(bytes::Bytes::from(call_body(
                1,
                "slow_charge",
                args.clone(),
            ))))
            .unwrap();
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Full<bytes::Bytes>>();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        drop(resp);
    }
    // The agent re-issues it under a new id (as MCP 2026-07-28 requires of a broken stream).
    let reissued = py_client(&proxy, "slow_charge", args, &[]).await;
    assert_eq!(server.ran("slow_charge"), 1, "{reissued}");
    assert!(
        reissued["calls"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("charged 99"),
        "{reissued}"
    );
    proxy.stop().await;
}

#[tokio::test]
#[ignore = "needs the MCP Python SDK (ONCEGATE_PYTHON)"]
async fn sdk_progress_notifications_stream_through_before_the_result() {
    let server = McpServer::start(&[]);
    let proxy = proxy_for(&server, "").await;
    let r = py_client(&proxy, "report", json!({"steps": 4}), &["--progress"]).await;
    // The SDK calls back only for progress that arrives before the call's result.
    assert_eq!(r["progress"], json!([1.0, 2.0, 3.0, 4.0]), "{r}");
    assert_eq!(r["calls"][0]["is_error"], false, "{r}");
    assert_eq!(server.ran("report"), 1);
    proxy.stop().await;
}

#[tokio::test]
#[ignore = "needs the MCP Python SDK (ONCEGATE_PYTHON)"]
async fn sdk_a_2025_client_with_a_session_works_too() {
    let server = McpServer::start(&["--stateful"]);
    let proxy = proxy_for(&server, "").await;
    let args = json!({"to": "di@example.com", "subject": "hello"});
    let r = py_client(
        &proxy,
        "send_email",
        args.clone(),
        &["--mode", "legacy", "--list", "--calls", "2"],
    )
    .await;
    assert!(
        r["tools"]
            .as_array()
            .unwrap()
            .contains(&json!("send_email")),
        "{r}"
    );
    assert_eq!(r["calls"][1]["text"], r["calls"][0]["text"], "{r}");
    // Another session, the same call: replayed, not run.
    py_client(&proxy, "send_email", args, &["--mode", "legacy"]).await;
    assert_eq!(server.ran("send_email"), 1);
    proxy.stop().await;
}

#[tokio::test]
#[ignore = "needs the MCP Python SDK (ONCEGATE_PYTHON)"]
async fn sdk_annotations_make_reads_only_when_trusted() {
    let server = McpServer::start(&[]);
    // Untrusted (the default): `lying_read` says it is read-only, and is guarded all the same.
    let proxy = proxy_for(&server, "").await;
    py_client(
        &proxy,
        "lying_read",
        json!({"note": "n"}),
        &["--list", "--calls", "2"],
    )
    .await;
    assert_eq!(server.ran("lying_read"), 1);
    proxy.stop().await;
    // Trusted: once the server's own tools/list said so, it is a read.
    let proxy = proxy_for(&server, "trust_annotations = true").await;
    py_client(
        &proxy,
        "lying_read",
        json!({"note": "m"}),
        &["--list", "--calls", "2"],
    )
    .await;
    assert_eq!(server.ran("lying_read"), 3);
    proxy.stop().await;
}

/// The TypeScript SDK's client (`ONCEGATE_MCP_NODE`: a folder whose node_modules holds
/// `@modelcontextprotocol/sdk`).
#[tokio::test]
#[ignore = "needs the MCP TypeScript SDK (ONCEGATE_MCP_NODE) and the Python SDK (ONCEGATE_PYTHON)"]
async fn sdk_typescript_client_resends_run_once() {
    let server = McpServer::start(&[]);
    let proxy = proxy_for(&server, "").await;
    let args = json!({"to": "ed@example.com", "subject": "ts"});
    let run = || ts_client(&proxy.url("/mcp"), "send_email", &args, &["2"]);
    let a = run_client(run()).await;
    let b = run_client(run()).await;
    assert_eq!(server.ran("send_email"), 1, "{a} {b}");
    assert_eq!(a["calls"][0]["text"], a["calls"][1]["text"], "{a}");
    assert_eq!(b["calls"][0]["text"], a["calls"][0]["text"], "{b}");
    proxy.stop().await;
}

#[tokio::test]
#[ignore = "needs the MCP Python SDK (ONCEGATE_PYTHON)"]
async fn sdk_the_docs_mcp_recipe_runs_and_sends_once() {
    let server = McpServer::start(&[]);
    let proxy = proxy_for(&server, "").await;
    let mut cmd = Command::new(python());
    cmd.args(["-c", &support::recipe("mcp-python")])
        .env("ONCEGATE_URL", proxy.url("").trim_end_matches('/'));
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "the recipe failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.starts_with("sent email #1"), "{stdout}");
    assert_eq!(server.ran("send_email"), 1);
    proxy.stop().await;
}

#[tokio::test]
#[ignore = "needs the MCP Python SDK (ONCEGATE_PYTHON)"]
async fn sdk_a_proxy_killed_mid_call_leaves_it_unknown_and_the_resend_is_not_sent() {
    let server = McpServer::start(&[]);
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("oncegate.toml");
    let text = mcp_config(&server.url(), r#"timeout = "30s""#).replace(
        "[defaults]",
        &format!(
            "[store]\npath = {:?}\n\n[defaults]",
            tmp.path().join("store")
        ),
    );
    std::fs::write(&config, text).unwrap();
    let proxy = ChildProxy::spawn(&config);
    let url = proxy.url("/mcp");
    let args = json!({"amount": 7, "seconds": 1.5});
    // The agent's call is on its way (recorded, sent) when the proxy is killed.
    let call = {
        let body = call_body(1, "slow_charge", args.clone());
        tokio::spawn(async move {
            let req = hyper::Request::post(url)
                .header("content-type", "application/json")
                .header("accept", "application/json, text/event-stream")
                .body(http_body_util::Full::new(bytes::Bytes::from(body)))
                .unwrap();
            let client =
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .build_http::<http_body_util::Full<bytes::Bytes>>();
            let resp = client.request(req).await;
            match resp {
                Ok(r) => http_body_util::BodyExt::collect(r.into_body())
                    .await
                    .is_ok(),
                Err(_) => false,
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(700)).await;
    proxy.kill();
    assert!(
        !call.await.unwrap(),
        "the call's answer was cut by the kill"
    );
    // Restarted, the proxy finds the call in flight with no attempt behind it: unknown. The
    // agent's resend (a new process, a new id) is not sent.
    let proxy = ChildProxy::spawn(&config);
    let resend = py_client_at(&proxy.url("/mcp"), "slow_charge", args, &[]).await;
    let call = &resend["calls"][0];
    assert_eq!(call["is_error"], true, "{resend}");
    assert_eq!(call["structured"]["outcome"], "unknown", "{resend}");
    assert_eq!(
        call["structured"]["action"]["tool"], "slow_charge",
        "{resend}"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(server.ran("slow_charge") <= 1, "never run twice");
}

/// A call answered `unknown` after its timeout is listened to for a late answer, but not past the
/// start of a shutdown: the proxy stops without waiting for it, and the action stays unknown for a
/// lookup or an operator (never settled by an answer nobody heard).
#[tokio::test]
async fn shutdown_lets_go_of_calls_waiting_for_a_late_answer() {
    let up = FakeUpstream::start().await;
    up.push(Behavior::Delay(
        Duration::from_millis(1500),
        Box::new(Behavior::json(
            200,
            r#"{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"charged"}]}}"#,
        )),
    ));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let cfg = mcp_config(&format!("{}/mcp", up.url()), r#"timeout = "200ms""#);
    let proxy = TestProxy::start_in(&cfg, &dir).await;
    let r = TestClient::default()
        .post(
            &proxy.url("/mcp"),
            JSON_SSE,
            &call_body(1, "charge", json!({"amount": 5})),
        )
        .await;
    assert_eq!(
        r.json()["result"]["structuredContent"]["outcome"],
        "unknown"
    );
    let id = r.header("oncegate-action").unwrap().to_string();
    proxy.stop().await;
    let store = oncegate::store::sled::SledStore::open(&dir, Default::default()).unwrap();
    let rec = oncegate::store::Store::get(&store, &id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rec.state, oncegate::action::State::Unknown);
    oncegate::store::Store::close(&store).await.unwrap();
}

/// An answer relayed as events for longer than the attempt's lease keeps the lease renewed: a
/// resend that arrives after the lease would have lapsed waits for the running call and gets its
/// result, instead of taking the call for a dead attempt (unknown). The call ran once.
#[tokio::test]
async fn a_call_relayed_past_its_lease_stays_in_flight_and_its_resend_gets_the_result() {
    let up = FakeUpstream::start().await;
    let event = |v: Value| Bytes::from(format!("event: message\ndata: {v}\n\n"));
    let progress = |n: u32| {
        event(json!({"jsonrpc": "2.0", "method": "notifications/progress",
            "params": {"progressToken": 1, "progress": n}}))
    };
    // Progress every 300 ms (within the 500 ms timeout) for 4.2 s, then the result.
    let mut chunks: Vec<Bytes> = (1..=14).map(progress).collect();
    chunks.push(event(json!({"jsonrpc": "2.0", "id": 1,
        "result": {"content": [{"type": "text", "text": "sent"}]}})));
    up.push(Behavior::Paced {
        every: Duration::from_millis(300),
        chunks,
    });
    // The lease: the timeout once, no retries, and two seconds: 2.5 s, renewed every 833 ms.
    let cfg = mcp_config(
        &format!("{}/mcp", up.url()),
        "timeout = \"500ms\"\nretries = 0",
    );
    let proxy = TestProxy::start(&cfg).await;
    let url = proxy.url("/mcp");
    let call = |id: u64| {
        let url = url.clone();
        tokio::spawn(async move {
            TestClient::default()
                .post(
                    &url,
                    JSON_SSE,
                    &call_body(id, "send_email", json!({"to": "a"})),
                )
                .await
        })
    };
    let first = call(1);
    up.wait_for(1).await;
    // Past the lease as first taken; the resend waits for the running call (in_flight_wait).
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    let resend = call(2).await.unwrap();
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(
        resend.header("oncegate-outcome"),
        Some("replayed"),
        "{}",
        String::from_utf8_lossy(&resend.body)
    );
    assert_eq!(resend.json()["result"]["content"][0]["text"], "sent");
    assert_eq!(up.count(), 1);
    proxy.stop().await;
}

//! An MCP server behind oncegate sees what it would see direct, and its protections hold (issue
//! 57, SPEC §14.6): DNS rebinding is refused in the server's place; every message that is not a
//! guarded tool call counts as a read, and a denied tool as rejected.
#![allow(clippy::unwrap_used)]

mod support;

use serde_json::{json, Value};
use support::mcp::{call_body, mcp_config, JSON_SSE};
use support::{Behavior, FakeUpstream, TestClient, TestProxy};

fn initialize() -> String {
    json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}})
    .to_string()
}

/// A web page whose name was rebound to the loopback proxy sends its own name as `Host` and
/// its own `Origin`: the conformance suite's `dns-rebinding-protection` probe. Direct, the
/// SDK's server answers 403; through oncegate, which rewrites `Host`, it must be 403 too, and
/// nothing reaches the server. The proxy's own loopback names pass, as they do direct.
#[tokio::test]
async fn a_rebound_host_or_a_foreign_origin_is_refused_in_the_servers_place() {
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json(
        200,
        r#"{"jsonrpc":"2.0","id":1,"result":{}}"#,
    ));
    let extra = r#"allowed_origins = ["https://app.example.com"]"#;
    let proxy = TestProxy::start(&mcp_config(&format!("{}/mcp", up.url()), extra)).await;
    let c = TestClient::default();
    let url = proxy.url("/mcp");
    let port = url.split(':').nth(2).unwrap().split('/').next().unwrap();
    let evil = [
        ("host", "evil.example.com"),
        ("origin", "http://evil.example.com"),
    ];
    for (what, headers, body) in [
        ("the probe", evil.to_vec(), initialize()),
        (
            "a rebound Host alone",
            vec![("host", "evil.example.com")],
            initialize(),
        ),
        (
            "a foreign Origin, to a write tool",
            vec![("origin", "https://attacker.example")],
            call_body(2, "send_email", json!({"to": "a"})),
        ),
    ] {
        let mut h = JSON_SSE.to_vec();
        h.extend(headers);
        let r = c.post(&url, &h, &body).await;
        assert_eq!(r.status, 403, "{what}: {r:?}");
        let v = r.json();
        assert_eq!(
            v["error"]["data"]["type"], "urn:oncegate:problem:foreign-origin",
            "{what}: {v}"
        );
    }
    // A GET (the server's stream) is refused the same way.
    let r = c.send("GET", &url, &evil, "").await;
    assert_eq!(r.status, 403);
    assert_eq!(up.count(), 0, "nothing refused reached the server");
    // The valid probe: loopback names, and an allowed origin.
    let local = format!("127.0.0.1:{port}");
    let local_origin = format!("http://{local}");
    let localhost = format!("localhost:{port}");
    for headers in [
        vec![("host", local.as_str()), ("origin", local_origin.as_str())],
        vec![("host", localhost.as_str())],
        vec![("origin", "https://app.example.com")],
        vec![],
    ] {
        let mut h = JSON_SSE.to_vec();
        h.extend(headers.iter().cloned());
        let r = c.post(&url, &h, &initialize()).await;
        assert_eq!(r.status, 200, "{headers:?}: {r:?}");
    }
    assert_eq!(up.count(), 4);
    proxy.stop().await;
}

#[tokio::test]
async fn allowed_origins_must_be_origins_and_apply_to_mcp_upstreams_only() {
    let dir = tempfile::tempdir().unwrap();
    for (extra, mcp, key) in [
        (
            r#"allowed_origins = ["https://app.example.com/"]"#,
            true,
            "allowed_origins",
        ),
        (
            r#"allowed_origins = ["app.example.com"]"#,
            true,
            "allowed_origins",
        ),
        (
            r#"allowed_origins = ["https://a.example"]"#,
            false,
            "allowed_origins",
        ),
    ] {
        let text = if mcp {
            mcp_config("http://127.0.0.1:9/mcp", extra)
        } else {
            support::config("http://127.0.0.1:9", extra)
        };
        let cfg = dir.path().join("c.toml");
        std::fs::write(&cfg, text).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_oncegate"))
            .arg("check")
            .arg("--config")
            .arg(&cfg)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(64), "{extra}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(key), "{extra}: {err}");
    }
}

/// Metrics (issue 57 item 8): `initialize`, `tools/list`, notifications and read tools are reads
/// forwarded; a denied tool is a rejected deny, as a denied HTTP route is.
#[tokio::test]
async fn mcp_messages_are_counted_as_what_they_are() {
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json(
        200,
        r#"{"jsonrpc":"2.0","id":1,"result":{}}"#,
    ));
    let proxy = TestProxy::start(&mcp_config(&format!("{}/mcp", up.url()), "")).await;
    let c = TestClient::default();
    let url = proxy.url("/mcp");
    let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"}).to_string();
    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}).to_string();
    for body in [
        initialize(),
        note,
        list,
        call_body(3, "search", json!({"q": 1})),
    ] {
        assert_eq!(c.post(&url, JSON_SSE, &body).await.status, 200);
    }
    let denied = c
        .post(&url, JSON_SSE, &call_body(4, "delete_all", json!({})))
        .await;
    assert_eq!(denied.status, 200, "a tool result that says it was denied");
    let metrics = c.get(&proxy.admin_url("/metrics")).await;
    let text = String::from_utf8_lossy(&metrics.body).to_string();
    let count = |class: &str, outcome: &str| -> u64 {
        text.lines()
            .find(|l| {
                l.starts_with("oncegate_requests_total{")
                    && l.contains(r#"upstream="tools""#)
                    && l.contains(&format!(r#"class="{class}""#))
                    && l.contains(&format!(r#"outcome="{outcome}""#))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    };
    assert_eq!(count("read", "forwarded"), 4, "{text}");
    assert_eq!(count("deny", "rejected"), 1, "{text}");
    assert_eq!(count("write", "forwarded"), 0, "{text}");
    assert!(!text.contains(r#"outcome="other""#), "{text}");
    proxy.stop().await;
}

/// `key_scope` (SPEC §14.2, issue 57 item 4): a toggle without arguments is a new effect at
/// every call (`call`); a tool whose effect belongs to a session is one action per session
/// (`session`); by default a resend in any session is the same call (`arguments`).
#[tokio::test]
async fn key_scope_makes_each_call_or_each_session_its_own_action() {
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json_rpc(
        r#"{"content":[{"type":"text","text":"done"}]}"#,
    ));
    let rules = r#"
[[upstreams.tools]]
name = "toggle"
class = "write"
key_scope = "call"

[[upstreams.tools]]
name = "start_logging"
class = "write"
key_scope = "session"
"#;
    let cfg = mcp_config(&format!("{}/mcp", up.url()), "").replacen(
        "\n[[upstreams.tools]]",
        &format!("{rules}\n[[upstreams.tools]]"),
        1,
    );
    let proxy = TestProxy::start(&cfg).await;
    let c = TestClient::default();
    let url = proxy.url("/mcp");
    let call = |tool: &'static str, session: &'static str, id: u64| {
        let (c, url) = (c.clone(), url.clone());
        async move {
            let mut h = JSON_SSE.to_vec();
            h.push(("mcp-session-id", session));
            let r = c.post(&url, &h, &call_body(id, tool, json!({}))).await;
            assert_eq!(r.status, 200, "{r:?}");
            r.header("oncegate-outcome").unwrap_or("").to_string()
        }
    };
    let sends = |tool: &str| {
        up.received()
            .iter()
            .filter(|r| String::from_utf8_lossy(&r.body).contains(tool))
            .count()
    };
    // Two toggles in one session: both run.
    assert_eq!(call("toggle", "s1", 1).await, "sent");
    assert_eq!(call("toggle", "s1", 2).await, "sent");
    assert_eq!(sends("toggle"), 2);
    // A session's logging starts once in it, and once in the next session.
    assert_eq!(call("start_logging", "s1", 3).await, "sent");
    assert_eq!(call("start_logging", "s1", 4).await, "replayed");
    assert_eq!(call("start_logging", "s2", 5).await, "sent");
    assert_eq!(sends("start_logging"), 2);
    // Any other tool: the resend in another session is the same call.
    assert_eq!(call("send_email", "s1", 6).await, "sent");
    assert_eq!(call("send_email", "s2", 7).await, "replayed");
    assert_eq!(sends("send_email"), 1);
    proxy.stop().await;
}

/// A client's cancel (SPEC §14.3, issue 57 item 3): session clients send
/// `notifications/cancelled` when their own timeout fires. For a guarded write still running it
/// is not forwarded, so the server does not stop a call that may already have taken effect: the
/// call runs to its end and the resend gets its result. A read's cancel goes on as usual.
#[tokio::test]
async fn a_cancel_of_a_running_write_is_held_back_and_the_resend_gets_the_result() {
    let up = FakeUpstream::start().await;
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    up.push(Behavior::Gate(
        gate.clone(),
        Box::new(Behavior::json_rpc(
            r#"{"content":[{"type":"text","text":"charged"}]}"#,
        )),
    ));
    up.set_default(Behavior::status(202));
    let proxy = TestProxy::start(&mcp_config(&format!("{}/mcp", up.url()), "")).await;
    let c = TestClient::default();
    let url = proxy.url("/mcp");
    let mut h = JSON_SSE.to_vec();
    h.push(("mcp-session-id", "s1"));
    let charge = call_body(7, "charge", json!({"amount": 5}));
    let first = {
        let (c, url, h, charge) = (c.clone(), url.clone(), h.clone(), charge.clone());
        tokio::spawn(async move { c.post(&url, &h, &charge).await })
    };
    up.wait_for(1).await;
    let cancel = |id: Value| {
        json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
               "params": {"requestId": id, "reason": "timed out"}})
        .to_string()
    };
    let r = c.post(&url, &h, &cancel(json!(7))).await;
    assert_eq!(r.status, 202, "{r:?}");
    let cancels = || {
        up.received()
            .iter()
            .filter(|r| String::from_utf8_lossy(&r.body).contains("notifications/cancelled"))
            .count()
    };
    assert_eq!(cancels(), 0, "the server never heard the cancel");
    // Another session's request 7 is not this call: its cancel goes on.
    let mut other = JSON_SSE.to_vec();
    other.push(("mcp-session-id", "s2"));
    c.post(&url, &other, &cancel(json!(7))).await;
    assert_eq!(cancels(), 1);
    gate.notify_one();
    let first = first.await.unwrap();
    assert_eq!(first.header("oncegate-outcome"), Some("sent"));
    let again = c
        .post(&url, &h, &call_body(8, "charge", json!({"amount": 5})))
        .await;
    assert_eq!(again.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(again.json()["id"], 8);
    let runs = up
        .received()
        .iter()
        .filter(|r| String::from_utf8_lossy(&r.body).contains("tools/call"))
        .count();
    assert_eq!(runs, 1, "the tool ran once");
    // Once the call has ended, a cancel naming it goes on (the server ignores it).
    c.post(&url, &h, &cancel(json!(7))).await;
    assert_eq!(cancels(), 2);
    // The write log says a cancel was held back.
    let log = proxy.admin("GET", "/v1/log?limit=50", "").await;
    assert!(
        String::from_utf8_lossy(&log.body).contains("cancel-requested"),
        "{:?}",
        log.body
    );
    proxy.stop().await;
}

/// An SSE response of `events`, each sent 20 ms after the one before; the stream then ends.
fn sse(events: &[&str]) -> Behavior {
    Behavior::Paced {
        every: std::time::Duration::from_millis(20),
        chunks: events
            .iter()
            .map(|e| bytes::Bytes::from(e.to_string()))
            .collect(),
    }
}

const PRIMED: &str = "id: e1\nretry: 100\ndata: \n\n";
const FINAL_7: &str = "id: e2\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"content\":[{\"type\":\"text\",\"text\":\"charged\"}]}}\n\n";

/// Resumable streams (SEP-1699, issue 57 item 2): the server ends the call's POST stream after
/// a primed event and delivers the result on the stream the client resumes (`Last-Event-ID`).
/// The proxy answers nothing in the server's place (one response for one id), keeps the action
/// running, settles it from the result the client's resumed stream carries, and the resend
/// replays it.
#[tokio::test]
async fn a_call_resumed_by_its_client_settles_from_the_resumed_stream() {
    let up = FakeUpstream::start().await;
    up.push(sse(&[PRIMED]));
    up.push(sse(&[FINAL_7]));
    let proxy = TestProxy::start(&mcp_config(&format!("{}/mcp", up.url()), "")).await;
    let c = TestClient::default();
    let url = proxy.url("/mcp");
    let mut h = JSON_SSE.to_vec();
    h.push(("mcp-session-id", "s1"));
    let first = c
        .post(&url, &h, &call_body(7, "charge", json!({"amount": 5})))
        .await;
    assert_eq!(first.status, 200);
    assert_eq!(
        String::from_utf8_lossy(&first.body),
        PRIMED,
        "the POST stream ends as the server ended it, with no answer in its place"
    );
    let resumed = c
        .send(
            "GET",
            &url,
            &[
                ("accept", "text/event-stream"),
                ("mcp-session-id", "s1"),
                ("last-event-id", "e1"),
            ],
            "",
        )
        .await;
    assert_eq!(String::from_utf8_lossy(&resumed.body), FINAL_7);
    let again = c
        .post(&url, &h, &call_body(8, "charge", json!({"amount": 5})))
        .await;
    assert_eq!(
        again.header("oncegate-outcome"),
        Some("replayed"),
        "{again:?}"
    );
    assert_eq!(again.json()["result"]["content"][0]["text"], "charged");
    assert_eq!(up.count_method("POST"), 1);
    proxy.stop().await;
}

/// When no client resumes within the call's timeout, the proxy resumes the stream itself from
/// the last event id it saw, and settles the call from what comes.
#[tokio::test]
async fn a_call_nobody_resumes_is_resumed_by_the_proxy() {
    let up = FakeUpstream::start().await;
    up.push(sse(&[PRIMED]));
    up.push(sse(&[FINAL_7]));
    let cfg = mcp_config(&format!("{}/mcp", up.url()), "timeout = \"1s\"");
    let proxy = TestProxy::start(&cfg).await;
    let c = TestClient::default();
    let url = proxy.url("/mcp");
    let mut h = JSON_SSE.to_vec();
    h.push(("mcp-session-id", "s1"));
    let first = c
        .post(&url, &h, &call_body(7, "charge", json!({"amount": 5})))
        .await;
    assert_eq!(String::from_utf8_lossy(&first.body), PRIMED);
    // The resend waits for the running call (in_flight_wait 5 s), which the proxy resumes.
    let again = c
        .post(&url, &h, &call_body(9, "charge", json!({"amount": 5})))
        .await;
    assert_eq!(
        again.header("oncegate-outcome"),
        Some("replayed"),
        "{again:?}"
    );
    assert_eq!(again.json()["id"], 9);
    let got = up.received();
    let resume = got
        .iter()
        .find(|r| r.method == "GET")
        .expect("the proxy resumed");
    assert_eq!(resume.headers["last-event-id"], "e1");
    assert_eq!(resume.headers["mcp-session-id"], "s1");
    assert_eq!(up.count_method("POST"), 1);
    proxy.stop().await;
}

/// A write whose answer streams and ends at once (one final event): its client gets that
/// stream, every time. The action's task could end before the request took the stream's head,
/// and the request then answered the task's own end, an empty 200 with no content type (seen
/// by the conformance suite's `tools-call-error`, 2 runs in 5, on a loaded machine: many calls
/// at once make one likely here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_that_ends_at_once_reaches_its_client_every_time() {
    let up = FakeUpstream::start().await;
    let event = |i: u64| {
        format!(
            "event: message\ndata: {{\"jsonrpc\":\"2.0\",\"id\":{i},\"result\":{{\"content\":[],\"isError\":true}}}}\n\n"
        )
    };
    up.set_default(Behavior::Paced {
        every: std::time::Duration::ZERO,
        chunks: vec![bytes::Bytes::from(event(1))],
    });
    let proxy = TestProxy::start(&mcp_config(&format!("{}/mcp", up.url()), "")).await;
    let url = proxy.url("/mcp");
    let calls: Vec<_> = (0..200u64)
        .map(|i| {
            let (c, url) = (TestClient::default(), url.clone());
            tokio::spawn(async move {
                c.post(
                    &url,
                    JSON_SSE,
                    &call_body(1, "fail_fast", json!({ "n": i })),
                )
                .await
            })
        })
        .collect();
    for (i, call) in calls.into_iter().enumerate() {
        let r = call.await.unwrap();
        assert_eq!(
            r.header("content-type"),
            Some("text/event-stream"),
            "call {i}: {r:?}"
        );
        assert_eq!(String::from_utf8_lossy(&r.body), event(1), "call {i}");
    }
    proxy.stop().await;
}

//! The official MCP SDKs' clients through oncegate, at both revisions (issue 57): the Python SDK
//! (`mcp`, `legacy` = 2025-11-25 with sessions, `auto` = 2026-07-28) and the TypeScript SDK (1.x
//! at 2025-11-25; the 2.x client negotiating 2026-07-28), each against the Python SDK's server. A
//! resumed stream settles its call (SEP-1699), a client's timeout and cancel leave one execution
//! whose result the resend gets, and `key_scope` holds as SPEC §14.2 says.
#![allow(clippy::unwrap_used)]

mod support;

use serde_json::{json, Value};
use support::mcp::{mcp_config, py_client_at, run_client, ts_client, McpServer};
use support::TestProxy;

/// A client of the matrix: an SDK and the revision it speaks.
#[derive(Clone, Copy, Debug)]
enum Sdk {
    PythonLegacy,
    Python2026,
    TypeScript1,
    TypeScript2026,
}

const ALL: [Sdk; 4] = [
    Sdk::PythonLegacy,
    Sdk::Python2026,
    Sdk::TypeScript1,
    Sdk::TypeScript2026,
];

impl Sdk {
    fn revision(self) -> &'static str {
        match self {
            Sdk::PythonLegacy | Sdk::TypeScript1 => "2025-11-25",
            Sdk::Python2026 | Sdk::TypeScript2026 => "2026-07-28",
        }
    }

    /// Calls `tool` `calls` times on one connection, each call with its timeout in `timeouts_ms`
    /// (none: the SDK's default). Returns the client's report, a call's SDK error as `error`; the
    /// revision it negotiated is checked to be the one this client stands for.
    async fn call(
        self,
        url: &str,
        tool: &str,
        args: Value,
        calls: usize,
        timeouts_ms: &[u64],
    ) -> Value {
        let n = calls.to_string();
        let mut out = match self {
            Sdk::PythonLegacy | Sdk::Python2026 => {
                let mode = if matches!(self, Sdk::PythonLegacy) {
                    "legacy"
                } else {
                    "auto"
                };
                let secs: Vec<f64> = timeouts_ms.iter().map(|ms| *ms as f64 / 1000.0).collect();
                let secs = serde_json::to_string(&secs).unwrap();
                let flags = ["--calls", &n, "--mode", mode, "--read-timeouts", &secs];
                py_client_at(url, tool, args, &flags).await
            }
            Sdk::TypeScript1 | Sdk::TypeScript2026 => {
                let sdk = if matches!(self, Sdk::TypeScript1) {
                    "v1"
                } else {
                    "v2-auto"
                };
                let ms = serde_json::to_string(timeouts_ms).unwrap();
                run_client(ts_client(url, tool, &args, &[&n, &ms, sdk])).await
            }
        };
        assert_eq!(out["protocol_version"], self.revision(), "{self:?}: {out}");
        for c in out["calls"].as_array_mut().unwrap() {
            if let Some(e) = c.get("exception").cloned() {
                c["error"] = e;
            }
        }
        out
    }
}

fn text(out: &Value, i: usize) -> &str {
    out["calls"][i]["text"].as_str().unwrap_or("")
}

/// A client's own timeout fires while the server's charge runs (issue 57 item 3). At 2025-11-25
/// the SDK sends `notifications/cancelled`; at 2026-07-28 it closes the call's stream. Direct, a
/// 2025 server cancels the charge mid-way and the resend charges again; through oncegate the
/// charge runs to its end, once, and the resend (a new id) gets its result.
#[tokio::test]
#[ignore = "needs the MCP TypeScript SDK (ONCEGATE_MCP_NODE) and the Python SDK (ONCEGATE_PYTHON)"]
async fn sdk_a_client_timeout_cancel_leaves_one_execution_and_the_resend_gets_the_result() {
    let server = McpServer::start(&["--stateful"]);
    let proxy = TestProxy::start(&mcp_config(&server.url(), "timeout = \"20s\"")).await;
    for (i, sdk) in ALL.into_iter().enumerate() {
        let gate = server.tmp.path().join(format!("open-{i}"));
        let amount = 40 + i;
        let args = json!({"amount": amount, "seconds": 15, "gate": gate.to_str().unwrap()});
        let url = proxy.url("/mcp");
        let client =
            tokio::spawn(
                async move { sdk.call(&url, "slow_charge", args, 2, &[800, 20_000]).await },
            );
        // The first call times out at the client (0.8 s) and is abandoned; the charge is let
        // through a while after, while the resend waits for it.
        tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
        std::fs::write(&gate, "").unwrap();
        let out = client.await.unwrap();
        assert!(out["calls"][0]["error"].is_string(), "{sdk:?}: {out}");
        assert_eq!(out["calls"][1]["is_error"], false, "{sdk:?}: {out}");
        assert!(
            text(&out, 1).contains(&format!("charged {amount}")),
            "{sdk:?}: {out}"
        );
        assert_eq!(server.ran("slow_charge"), i + 1, "{sdk:?}: {out}");
    }
    proxy.stop().await;
}

/// The Python SDK's server ends `polled_charge`'s stream after its priming event and delivers
/// the result on the stream the client resumes (SEP-1699, issue 57 item 2). Through oncegate the
/// tool runs once per action, the first call gets its result, and a second call (a resend)
/// replays it, for every client that resumes.
#[tokio::test]
#[ignore = "needs the MCP TypeScript SDK (ONCEGATE_MCP_NODE) and the Python SDK (ONCEGATE_PYTHON)"]
async fn sdk_a_resumed_stream_settles_the_call_and_the_resend_replays_it() {
    let server = McpServer::start(&["--stateful", "--resumable"]);
    let proxy = TestProxy::start(&mcp_config(&server.url(), "")).await;
    for (i, sdk) in ALL.into_iter().enumerate() {
        let amount = 3 + i;
        let out = sdk
            .call(
                &proxy.url("/mcp"),
                "polled_charge",
                json!({"amount": amount}),
                2,
                &[],
            )
            .await;
        assert_eq!(out["calls"][0]["is_error"], false, "{sdk:?}: {out}");
        assert!(
            text(&out, 0).contains(&format!("charged {amount}")),
            "{sdk:?}: {out}"
        );
        assert_eq!(text(&out, 1), text(&out, 0), "{sdk:?}: {out}");
        assert_eq!(server.ran("polled_charge"), i + 1, "{sdk:?}: {out}");
    }
    proxy.stop().await;
}

/// `key_scope` (issue 57 item 4, SPEC §14.2), each client against the Python SDK's server. A
/// toggle (`call`) runs at every call. A session's log (`session`) starts once per session at
/// 2025-11-25 (`Mcp-Session-Id`), and again in the next session; 2026-07-28 has no sessions, so
/// a `session` scope holds the arguments only and the next client's call is replayed (the
/// default scope, which replays across sessions, is the other SDK tests').
#[tokio::test]
#[ignore = "needs the MCP TypeScript SDK (ONCEGATE_MCP_NODE) and the Python SDK (ONCEGATE_PYTHON)"]
async fn sdk_key_scope_call_and_session() {
    let server = McpServer::start(&["--stateful"]);
    let rules = "\n[[upstreams.tools]]\nname = \"toggle_feature\"\nclass = \"write\"\nkey_scope = \"call\"\n\n[[upstreams.tools]]\nname = \"start_session_log\"\nclass = \"write\"\nkey_scope = \"session\"\n";
    let cfg = mcp_config(&server.url(), "").replacen(
        "\n[[upstreams.tools]]",
        &format!("{rules}\n[[upstreams.tools]]"),
        1,
    );
    let proxy = TestProxy::start(&cfg).await;
    let url = proxy.url("/mcp");
    let (mut toggles, mut logs) = (0, 0);
    let mut revision_2026_logged = false;
    for sdk in ALL {
        let a = sdk.call(&url, "toggle_feature", json!({}), 2, &[]).await;
        toggles += 2;
        assert_eq!(
            server.ran("toggle_feature"),
            toggles,
            "{sdk:?}: two toggles: {a}"
        );
        assert_ne!(text(&a, 0), text(&a, 1), "{sdk:?}: {a}");
        let b = sdk.call(&url, "start_session_log", json!({}), 2, &[]).await;
        assert_eq!(text(&b, 0), text(&b, 1), "{sdk:?}: {b}");
        if sdk.revision() == "2025-11-25" {
            logs += 1;
        } else if !revision_2026_logged {
            // The first 2026 client's call is a new action (the arguments, no session); the
            // second 2026 client's is the same action, replayed.
            logs += 1;
            revision_2026_logged = true;
        }
        assert_eq!(server.ran("start_session_log"), logs, "{sdk:?}: {b}");
    }
    proxy.stop().await;
}

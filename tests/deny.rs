//! Deny rules have no side doors (SPEC §2, §14.1; issue 58 item 3): path parameters, a method
//! written in lower case, a method tunneled in the query or a form body, an override that lists
//! several methods, a tool name written otherwise, a method name written otherwise. Over real
//! sockets, the requests as an attacker sends them; nothing denied reaches the upstream.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use serde_json::json;
use support::mcp::{call_body, mcp_config, JSON_SSE};
use support::{config, raw, Behavior, FakeUpstream, TestClient, TestProxy};

const RULES: &str = r#"
  [[upstreams.routes]]
  path = "/admin/**"
  class = "deny"

  [[upstreams.routes]]
  methods = ["DELETE"]
  path = "/v1/customers/*"
  class = "deny"
"#;

/// The status of `request` (raw bytes: no client normalizes it on the way).
async fn status(proxy: &TestProxy, request: &str) -> u16 {
    let (resp, _) = raw(proxy.addr, request.as_bytes(), Duration::from_secs(5)).await;
    resp.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_deny_rule_holds_whatever_the_request_dresses_its_method_or_path_in() {
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json(200, "{}"));
    let proxy = TestProxy::start(&config(&up.url(), RULES)).await;
    let head = |method: &str, path: &str, extra: &str, body: &str| {
        format!(
            "{method} {path} HTTP/1.1\r\nhost: x\r\n{extra}content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    let form = "content-type: application/x-www-form-urlencoded\r\n";
    for (what, request, want) in [
        (
            "a parameter on a segment",
            head("POST", "/pay/admin;x=1/y", "", ""),
            403,
        ),
        (
            "a parameter on a middle segment",
            head("DELETE", "/pay/v1/customers;a/cus_1", "", ""),
            403,
        ),
        (
            "a parameter on the last segment",
            head("DELETE", "/pay/v1/customers/cus_1;v=2", "", ""),
            403,
        ),
        (
            "a dot segment with a parameter",
            head("GET", "/pay/v1/..;/admin/x", "", ""),
            400,
        ),
        (
            "a lower-case method",
            head("delete", "/pay/v1/customers/cus_1", "", ""),
            403,
        ),
        (
            "_method in the query",
            head("POST", "/pay/v1/customers/cus_1?_method=DELETE", "", ""),
            403,
        ),
        (
            "_method in the query, lower case",
            head("POST", "/pay/v1/customers/cus_1?a=1&_method=delete", "", ""),
            403,
        ),
        (
            "_method in a form body",
            head(
                "POST",
                "/pay/v1/customers/cus_1",
                form,
                "name=x&_method=DELETE",
            ),
            403,
        ),
        (
            "an override listing methods",
            head(
                "POST",
                "/pay/v1/customers/cus_1",
                "x-http-method-override: GET, DELETE\r\n",
                "",
            ),
            403,
        ),
    ] {
        assert_eq!(status(&proxy, &request).await, want, "{what}");
    }
    assert_eq!(up.count(), 0, "nothing denied reached the upstream");
    // What is not denied still goes: the same paths, other methods.
    assert_eq!(
        status(&proxy, &head("GET", "/pay/v1/customers/cus_1", "", "")).await,
        200
    );
    assert_eq!(
        status(
            &proxy,
            &head(
                "POST",
                "/pay/v1/customers/cus_1",
                form,
                "name=x&_method=PATCH"
            )
        )
        .await,
        200
    );
    assert_eq!(up.count(), 2);
    proxy.stop().await;
}

#[tokio::test]
async fn a_denied_tool_written_otherwise_is_denied_and_a_method_written_otherwise_refused() {
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json_rpc("{}"));
    let proxy = TestProxy::start(&mcp_config(&format!("{}/mcp", up.url()), "")).await;
    let c = TestClient::default();
    let url = proxy.url("/mcp");
    for name in ["delete_all", "Delete_all", " delete_all", "DELETE_ALL\t"] {
        let r = c.post(&url, JSON_SSE, &call_body(1, name, json!({}))).await;
        assert_eq!(r.status, 200, "{name:?}");
        assert_eq!(
            r.json()["result"]["structuredContent"]["type"],
            "urn:oncegate:problem:route-denied",
            "{name:?}: {r:?}"
        );
    }
    // `Tools/Call`: a server that reads methods without regard to case would run it.
    let odd = json!({"jsonrpc":"2.0","id":2,"method":"Tools/Call","params":{"name":"search","arguments":{}}});
    let r = c.post(&url, JSON_SSE, &odd.to_string()).await;
    assert_eq!(r.status, 400, "{r:?}");
    assert_eq!(r.json()["error"]["code"], -32600);
    assert_eq!(up.count(), 0);
    proxy.stop().await;
}

//! Path tricks (SPEC §2): encoded and dotted paths are normalized before routing, classifying,
//! fingerprinting and forwarding; climbing, `%00`, backslashes and encoded slashes are refused
//! before anything is sent; a method override is classified by the strictest method; two key
//! lines are one bad key. Over real sockets, with the request bytes as an attacker sends them.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use support::{config, raw, Behavior, FakeUpstream, TestClient, TestProxy};

const DENY_ADMIN: &str = r#"
  [[upstreams.routes]]
  path = "/admin/**"
  class = "deny"
"#;

/// Sends `GET {path}` as raw bytes (no client normalizes it on the way) and returns the status.
async fn get_raw(proxy: &TestProxy, method: &str, path: &str) -> u16 {
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    );
    let (resp, _) = raw(proxy.addr, req.as_bytes(), Duration::from_secs(5)).await;
    resp.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn encoded_and_dotted_paths_do_not_slip_past_a_deny_rule() {
    let up = FakeUpstream::start().await;
    let proxy = TestProxy::start(&config(&up.url(), DENY_ADMIN)).await;
    for path in [
        "/pay/admin/x",
        "/pay/%61dmin/x",
        "/pay/v1/../admin/x",
        "/pay/./admin/x",
        "/pay/ADMIN/../admin/x",
        "/pay/v1/%2e%2e/admin/x",
        "/%70ay/admin/x",
    ] {
        for method in ["GET", "POST", "DELETE"] {
            assert_eq!(get_raw(&proxy, method, path).await, 403, "{method} {path}");
        }
    }
    assert_eq!(up.count(), 0, "nothing reached the upstream");
}

#[tokio::test]
async fn unsafe_paths_are_refused_and_nothing_is_sent() {
    let up = FakeUpstream::start().await;
    let proxy = TestProxy::start(&config(&up.url(), "")).await;
    for path in [
        "/pay/../secret",
        "/pay/v1/../../etc/passwd",
        "/pay/v1/a%00b",
        "/pay/v1\\a",
        "/pay/v1/a%5Cb",
        "/pay/v1/a%2Fb",
        "/pay/v1/a%2fb",
    ] {
        for method in ["GET", "POST"] {
            assert_eq!(get_raw(&proxy, method, path).await, 400, "{method} {path}");
        }
    }
    assert_eq!(up.count(), 0);
}

#[tokio::test]
async fn the_upstream_receives_the_normalized_path_and_an_encoded_slash_only_where_allowed() {
    let up = FakeUpstream::start().await;
    let extra = format!(
        "[[upstreams]]\nname = \"gitlab\"\nprefix = \"/gitlab\"\nurl = \"{}/api/v4\"\nallow_encoded_slash = true",
        up.url()
    );
    let proxy = TestProxy::start(&config(&up.url(), &extra)).await;
    assert_eq!(
        get_raw(&proxy, "GET", "/pay/v1/x/../%63harges?limit=3").await,
        200
    );
    assert_eq!(
        get_raw(&proxy, "GET", "/gitlab/projects/group%2Fproject/issues").await,
        200
    );
    let seen: Vec<String> = up.received().into_iter().map(|r| r.target).collect();
    assert_eq!(
        seen,
        [
            "/v1/charges?limit=3",
            "/api/v4/projects/group%2Fproject/issues"
        ]
    );
    // Two spellings of one write are one action.
    up.set_default(Behavior::json(201, r#"{"id":"c1"}"#));
    let c = TestClient::default();
    let a = c.post(&proxy.url("/pay/v1/charges"), &[], "amount=5").await;
    let b = c
        .post(&proxy.url("/pay/v1/%63harges"), &[], "amount=5")
        .await;
    assert_eq!(a.header("oncegate-outcome"), Some("sent"));
    assert_eq!(b.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(up.count_method("POST"), 1);
}

#[tokio::test]
async fn a_get_that_overrides_its_method_is_guarded_as_the_write_it_is() {
    let up = FakeUpstream::start().await;
    let proxy = TestProxy::start(&config(&up.url(), DENY_ADMIN)).await;
    up.set_default(Behavior::json(200, r#"{"deleted":true}"#));
    let c = TestClient::default();
    let send = |header: &'static str, method: &'static str, path: &'static str| {
        let c = c.clone();
        let url = proxy.url(path);
        async move {
            c.send(
                "GET",
                &url,
                &[(header, method), ("idempotency-key", "del-1")],
                "",
            )
            .await
        }
    };
    let r = send("x-http-method-override", "DELETE", "/pay/v1/customers/c1").await;
    assert_eq!(
        r.header("oncegate-outcome"),
        Some("sent"),
        "recorded as a write"
    );
    let again = send("x-http-method-override", "DELETE", "/pay/v1/customers/c1").await;
    assert_eq!(again.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(up.count(), 1);
    // Tunnelled into a denied route: denied.
    let r = send("x-method-override", "DELETE", "/pay/admin/users").await;
    assert_eq!(r.problem(), "route-denied");
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn two_idempotency_key_lines_are_a_bad_key() {
    let up = FakeUpstream::start().await;
    let proxy = TestProxy::start(&config(&up.url(), "")).await;
    let req = "POST /pay/v1/charges HTTP/1.1\r\nhost: x\r\nidempotency-key: a\r\nidempotency-key: b\r\ncontent-length: 1\r\nconnection: close\r\n\r\nx";
    let (resp, _) = raw(proxy.addr, req.as_bytes(), Duration::from_secs(5)).await;
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
    assert!(resp.contains("key-invalid"), "{resp}");
    assert_eq!(up.count(), 0);
}

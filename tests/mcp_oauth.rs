//! An MCP server behind OAuth, through oncegate (SPEC §14.6, issue 57 item 5): the server's
//! protected-resource metadata names the server's own URL, which a client that called the proxy
//! refuses. The proxy serves that metadata at its own well-known path for the upstream, naming
//! its own URL, points the server's challenges there, and routes a 2025-03-26 client's fallback
//! paths to the server's origin. Tokens pass through.
#![allow(clippy::unwrap_used)]

mod support;

use support::mcp::{mcp_config, JSON_SSE};
use support::{Behavior, FakeUpstream, TestClient, TestProxy};

#[tokio::test]
async fn the_servers_oauth_metadata_is_served_as_the_proxys_own() {
    let up = FakeUpstream::start().await;
    let server = up.url();
    let challenge = format!(
        r#"Bearer error="invalid_token", resource_metadata="{server}/.well-known/oauth-protected-resource/mcp""#
    );
    up.on(
        "/.well-known/oauth-protected-resource/mcp",
        Behavior::json(
            200,
            &format!(
                r#"{{"resource":"{server}/mcp","authorization_servers":["http://auth.example"]}}"#
            ),
        ),
    );
    up.on(
        "/token",
        Behavior::json(200, r#"{"access_token":"t","token_type":"Bearer"}"#),
    );
    up.set_default(Behavior::status(401).with_header("www-authenticate", &challenge));
    let proxy = TestProxy::start(&mcp_config(&format!("{server}/mcp"), "")).await;
    let c = TestClient::default();
    let me = proxy.url("");
    // The challenge names the proxy's metadata for this upstream.
    let init = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}"#;
    let r = c.post(&proxy.url("/mcp"), JSON_SSE, init).await;
    assert_eq!(r.status, 401);
    assert_eq!(
        r.header("www-authenticate").unwrap(),
        format!(
            r#"Bearer error="invalid_token", resource_metadata="{me}/.well-known/oauth-protected-resource/mcp""#
        )
    );
    // The metadata there names the resource the client called.
    let m = c
        .get(&proxy.url("/.well-known/oauth-protected-resource/mcp"))
        .await;
    assert_eq!(m.status, 200, "{m:?}");
    let v = m.json();
    assert_eq!(v["resource"], format!("{me}/mcp"));
    assert_eq!(v["authorization_servers"][0], "http://auth.example");
    // A 2025-03-26 client's default endpoint at the proxy's root reaches the server's origin,
    // with the client's credentials.
    let t = c
        .post(
            &proxy.url("/token"),
            &[
                ("content-type", "application/x-www-form-urlencoded"),
                ("authorization", "Basic Y2xpZW50OnNlY3JldA=="),
            ],
            "grant_type=authorization_code&code=c",
        )
        .await;
    assert_eq!(t.status, 200, "{t:?}");
    let got = up.received();
    let token = got.iter().find(|r| r.target == "/token").expect("routed");
    assert_eq!(token.method, "POST");
    assert_eq!(token.headers["authorization"], "Basic Y2xpZW50OnNlY3JldA==");
    assert_eq!(&token.body[..], b"grant_type=authorization_code&code=c");
    // Paths no MCP upstream names stay unrouted.
    let other = c
        .get(&proxy.url("/.well-known/oauth-protected-resource/elsewhere"))
        .await;
    assert_eq!(other.status, 404);
    proxy.stop().await;
}

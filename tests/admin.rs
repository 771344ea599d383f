//! The admin API against a hostile neighbour (SPEC §10.2, §10.3): a web page the operator
//! visits (CSRF, DNS rebinding) cannot settle an unknown write, with or without a token set;
//! the token is always required but for health and metrics; a public listener needs a long one;
//! the CLI finds the API and its token through the config and names the variable on a 401.
#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;

use support::{admin_call, config, Behavior, FakeUpstream, TestClient, TestProxy, ADMIN_TOKEN};

const KEY: &str = "idempotency-key";

/// A proxy (with `token` as its admin token) holding one unknown write.
/// A fresh proxy on `text` whose admin API takes [`ADMIN_TOKEN`].
async fn with_token(text: &str) -> TestProxy {
    let cfg = oncegate::config::Config::parse(text).unwrap();
    TestProxy::start_fresh(
        cfg,
        Some(ADMIN_TOKEN.to_string()),
        oncegate::action::system_clock(),
    )
    .await
}

async fn with_unknown_write(token: Option<&str>) -> (FakeUpstream, TestProxy, String) {
    let up = FakeUpstream::start().await;
    let cfg = oncegate::config::Config::parse(&config(&up.url(), "timeout = \"200ms\"")).unwrap();
    let proxy = TestProxy::start_fresh(
        cfg,
        token.map(str::to_string),
        oncegate::action::system_clock(),
    )
    .await;
    up.push(Behavior::Hang);
    let r = TestClient::default()
        .post(&proxy.url("/pay/v1/charges"), &[(KEY, "csrf")], "amount=5")
        .await;
    assert_eq!(r.problem(), "outcome-unknown");
    let id = r.header("oncegate-action").unwrap().to_string();
    (up, proxy, id)
}

const RESOLVE: &str = r#"{"outcome":"not-applied","reason":"a page said so"}"#;

#[tokio::test]
async fn without_a_token_the_admin_api_is_locked_not_open() {
    let (up, proxy, id) = with_unknown_write(None).await;
    let c = TestClient::default();
    let path = format!("/v1/actions/{id}/resolve");
    let r = c
        .send(
            "POST",
            &proxy.admin_url(&path),
            &[("content-type", "application/json")],
            RESOLVE,
        )
        .await;
    assert_eq!(r.status, 401);
    let detail = r.json()["detail"].as_str().unwrap().to_string();
    assert!(detail.contains("ONCEGATE_ADMIN_TOKEN"), "{detail}");
    assert_eq!(c.get(&proxy.admin_url("/v1/actions")).await.status, 401);
    // Health and metrics stay open.
    assert_eq!(c.get(&proxy.admin_url("/healthz")).await.status, 200);
    assert_eq!(c.get(&proxy.admin_url("/metrics")).await.status, 200);
    // The write is still unknown, and a retry is not sent.
    let r = c
        .post(&proxy.url("/pay/v1/charges"), &[(KEY, "csrf")], "amount=5")
        .await;
    assert_eq!(r.problem(), "outcome-unknown");
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn a_web_page_cannot_settle_an_action_even_with_the_operators_token() {
    // The page cannot read the token, but make it as strong as it gets: the browser attaches it.
    let (up, proxy, id) = with_unknown_write(Some(ADMIN_TOKEN)).await;
    let c = TestClient::default();
    let url = proxy.admin_url(&format!("/v1/actions/{id}/resolve"));
    let auth = format!("Bearer {ADMIN_TOKEN}");
    // A cross-site form post: text/plain, a foreign Origin.
    let r = c
        .send(
            "POST",
            &url,
            &[
                ("authorization", &auth),
                ("origin", "https://evil.example"),
                ("content-type", "text/plain"),
            ],
            RESOLVE,
        )
        .await;
    assert_eq!(r.status, 403, "{:?}", r.body);
    // DNS rebinding: the page's own origin and host name, resolved to loopback.
    let r = c
        .send(
            "POST",
            &url,
            &[
                ("authorization", &auth),
                ("host", &format!("evil.example:{}", proxy.admin.port())),
                ("content-type", "application/json"),
            ],
            RESOLVE,
        )
        .await;
    assert_eq!(r.status, 403, "{:?}", r.body);
    // Same origin but not JSON: 415.
    let r = c
        .send(
            "POST",
            &url,
            &[("authorization", &auth), ("content-type", "text/plain")],
            RESOLVE,
        )
        .await;
    assert_eq!(r.status, 415);
    // The listener's own origin, with JSON: the operator's console and CLI get through.
    let own = format!("http://{}", proxy.admin);
    let r = c
        .send(
            "POST",
            &url,
            &[
                ("authorization", &auth),
                ("origin", &own),
                ("content-type", "application/json"),
            ],
            r#"{"outcome":"applied","reason":"seen at the service"}"#,
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let r = c
        .post(&proxy.url("/pay/v1/charges"), &[(KEY, "csrf")], "amount=5")
        .await;
    assert_eq!(r.problem(), "already-applied");
    assert_eq!(up.count(), 1);
    // And the guard's helper (JSON, token) is what the other tests use.
    assert_eq!(
        admin_call(proxy.admin, "GET", "/v1/actions", "")
            .await
            .status,
        200
    );
}

#[tokio::test]
async fn a_public_admin_listener_needs_a_long_token() {
    for (token, ok) in [
        (None, false),
        (Some("x"), false),
        (Some("0123456789abcdef"), true),
    ] {
        let up = FakeUpstream::start().await;
        let cfg = oncegate::config::Config::parse(&config(&up.url(), "")).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let store = Arc::new(
            oncegate::store::sled::SledStore::open(&tmp.path().join("s"), Default::default())
                .unwrap(),
        );
        let result = oncegate::run(
            cfg,
            oncegate::Listeners {
                proxy: tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
                admin: Some(tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap()),
            },
            oncegate::Services::new(store, Default::default(), token.map(str::to_string)),
            // Stops at once when it does start.
            async {},
        )
        .await;
        match (result, ok) {
            (Ok(()), true) => {}
            (Err(oncegate::RunError::Config(e)), false) => {
                assert!(e.contains("at least 16 characters"), "{e}")
            }
            (other, _) => panic!("token {token:?}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn the_cli_finds_the_admin_api_and_its_token_through_the_config() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    // A config whose admin token lives in a variable of its own.
    let path = support::child_config(tmp.path(), &up.url(), "");
    let text = std::fs::read_to_string(&path).unwrap().replace(
        "[admin]\nlisten = \"127.0.0.1:0\"",
        "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"OPS_TOKEN\"",
    );
    std::fs::write(&path, &text).unwrap();
    let proxy = support::ChildProxy::spawn_with(&path, &[("OPS_TOKEN", ADMIN_TOKEN)]);
    // The CLI reads admin.listen from the config; here the port is known only after start.
    let with_port = text.replace(
        "[admin]\nlisten = \"127.0.0.1:0\"",
        &format!("[admin]\nlisten = \"{}\"", proxy.admin),
    );
    let cli_conf = tmp.path().join("cli.toml");
    std::fs::write(&cli_conf, with_port).unwrap();
    let cli = |token: Option<&str>| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_oncegate"));
        c.args(["--config"])
            .arg(&cli_conf)
            .args(["actions", "list"])
            .env_remove("ONCEGATE_ADMIN")
            .env_remove("ONCEGATE_ADMIN_TOKEN")
            .env_remove("OPS_TOKEN");
        if let Some(t) = token {
            c.env("OPS_TOKEN", t);
        }
        c.output().unwrap()
    };
    let out = cli(Some(ADMIN_TOKEN));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for token in [None, Some("wrong-token")] {
        let out = cli(token);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("401") && err.contains("OPS_TOKEN"), "{err}");
    }
}

/// What the console reads: the overview, the write log filtered server-side (a page reads a
/// bounded part of the log and says where to go on), actions filtered by tool.
#[tokio::test]
async fn the_console_reads_an_overview_a_filtered_log_and_actions_by_tool() {
    let (up, proxy, id) = with_unknown_write(Some(ADMIN_TOKEN)).await;
    up.push(Behavior::json(201, r#"{"id":"ch_2"}"#));
    TestClient::default()
        .post(&proxy.url("/pay/v1/charges"), &[(KEY, "other")], "amount=6")
        .await;
    let o = proxy.admin("GET", "/v1/overview", "").await.json();
    assert_eq!(o["actions"]["unknown"], 1, "{o}");
    assert_eq!(o["actions"]["succeeded"], 1, "{o}");
    assert_eq!(o["unknown_oldest"][0]["id"], id.as_str(), "{o}");
    assert!(o["unknown_oldest"][0]["waiting_secs"].is_u64(), "{o}");
    let head = o["log_head_seq"].as_u64().unwrap();
    assert!(head >= 6, "{o}");

    let lines = |r: &support::Resp| -> Vec<serde_json::Value> {
        String::from_utf8_lossy(&r.body)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let r = proxy
        .admin("GET", &format!("/v1/log?event=unknown&action={id}"), "")
        .await;
    let found = lines(&r);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0]["event"], "unknown");
    assert_eq!(
        r.header("oncegate-log-next"),
        Some(head.to_string().as_str())
    );
    // Nothing matches: an empty page, and where the reading stopped.
    let r = proxy.admin("GET", "/v1/log?event=expired", "").await;
    assert!(lines(&r).is_empty());
    assert_eq!(
        r.header("oncegate-log-next"),
        Some(head.to_string().as_str())
    );
    // A time window: nothing before the epoch's end of 2000.
    let r = proxy.admin("GET", "/v1/log?until=2000-01-01", "").await;
    assert!(lines(&r).is_empty());
    let r = proxy
        .admin("GET", "/v1/log?since=2000-01-01&limit=2", "")
        .await;
    assert_eq!(lines(&r).len(), 2);
    assert_eq!(r.header("oncegate-log-next"), Some("2"));

    // No MCP call here: a tool filter finds nothing; without it, both actions.
    let r = proxy
        .admin("GET", "/v1/actions?tool=send_email", "")
        .await
        .json();
    assert_eq!(r["actions"].as_array().unwrap().len(), 0, "{r}");
    let r = proxy.admin("GET", "/v1/actions", "").await.json();
    assert_eq!(r["actions"].as_array().unwrap().len(), 2, "{r}");
    proxy.stop().await;
}

/// An action's page shows what was asked of the service (issue 60 item 10): the body as the
/// record keeps it, secret fields redacted, and what the fingerprint leaves out; the write log
/// and the actions list do not carry it.
#[tokio::test]
async fn an_action_shows_its_request_body_redacted() {
    let up = FakeUpstream::start().await;
    let proxy = with_token(&config(
        &up.url(),
        r#"fingerprint_ignore = ["/metadata/nonce"]"#,
    ))
    .await;
    up.push(Behavior::json(201, r#"{"id":"ch_1"}"#));
    let body = r#"{"amount":4200,"card":{"token":"tok_s3cr3t"},"metadata":{"nonce":"n-1"}}"#;
    let r = TestClient::default()
        .post(
            &proxy.url("/pay/v1/charges"),
            &[(KEY, "body-1"), ("content-type", "application/json")],
            body,
        )
        .await;
    assert_eq!(r.status, 201);
    let id = r.header("oncegate-action").unwrap();
    let a = proxy
        .admin("GET", &format!("/v1/actions/{id}"), "")
        .await
        .json();
    let kept: serde_json::Value =
        serde_json::from_str(a["request"]["body"].as_str().unwrap()).unwrap();
    assert_eq!(
        kept,
        serde_json::json!({"amount": 4200, "card": {"token": "REDACTED"}, "metadata": {"nonce": "n-1"}})
    );
    assert_eq!(
        a["request"]["fingerprint_ignore"],
        serde_json::json!(["/metadata/nonce"])
    );
    // A binary body is not kept: its size and hash only.
    up.push(Behavior::json(201, r#"{"id":"ch_2"}"#));
    let r = TestClient::default()
        .post(
            &proxy.url("/pay/v1/charges"),
            &[
                (KEY, "body-2"),
                ("content-type", "application/octet-stream"),
            ],
            "amount-raw",
        )
        .await;
    let id2 = r.header("oncegate-action").unwrap();
    let b = proxy
        .admin("GET", &format!("/v1/actions/{id2}"), "")
        .await
        .json();
    assert!(b["request"]["body"].is_null(), "{b}");
    assert_eq!(b["request"]["body_size"], 10);
    let [log, list, action] = shown(&proxy, &a).await;
    for (what, text) in [&log, &list, &action] {
        assert!(!text.contains("tok_s3cr3t"), "{what}: {text}");
    }
    assert!(
        !log.1.contains("4200") && !list.1.contains("4200"),
        "{log:?} {list:?}"
    );
    proxy.stop().await;
}

/// What the admin API shows of the writes, as (what, text): the write log, the actions list,
/// and `action` (one action's view).
async fn shown(proxy: &TestProxy, action: &serde_json::Value) -> [(&'static str, String); 3] {
    let log = String::from_utf8_lossy(&proxy.admin("GET", "/v1/log", "").await.body).to_string();
    let list = proxy
        .admin("GET", "/v1/actions", "")
        .await
        .json()
        .to_string();
    [
        ("the write log", log),
        ("the actions list", list),
        ("the action", action.to_string()),
    ]
}

/// A card charged through the proxy the way Stripe's API takes it (a form, `card[number]` and
/// `card[cvc]`): the upstream gets the card whole, and nothing the proxy keeps or shows (the
/// action, the list, the write log) holds its number or its code, whatever the config's secret
/// names, in the body or in the query.
#[tokio::test]
async fn a_card_number_and_its_code_are_sent_but_never_kept_or_shown() {
    let up = FakeUpstream::start().await;
    let proxy = with_token(&config(&up.url(), "")).await;
    up.push(Behavior::json(201, r#"{"id":"ch_1","last4":"4242"}"#));
    let body = "amount=2000&currency=usd&card[number]=4242+4242+4242+4242&card[exp_month]=12&card[cvc]=314";
    let r = TestClient::default()
        .post(
            &proxy.url("/pay/v1/charges?receipt_for=5555555555554444"),
            &[
                (KEY, "card-1"),
                ("content-type", "application/x-www-form-urlencoded"),
            ],
            body,
        )
        .await;
    assert_eq!(r.status, 201);
    let sent = up.received();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].body, body.as_bytes(), "the upstream gets the card");
    assert!(sent[0].target.ends_with("?receipt_for=5555555555554444"));
    let id = r.header("oncegate-action").unwrap();
    let a = proxy
        .admin("GET", &format!("/v1/actions/{id}"), "")
        .await
        .json();
    assert_eq!(
        a["request"]["body"],
        "amount=2000&currency=usd&card[number]=REDACTED&card[exp_month]=12&card[cvc]=REDACTED"
    );
    let [log, list, action] = shown(&proxy, &a).await;
    for (what, text) in [&log, &list, &action] {
        for secret in ["4242+4242", "4242 4242", "5555555555554444", "cvc]=314"] {
            assert!(!text.contains(secret), "{what} holds {secret}: {text}");
        }
    }
    assert!(log.1.contains("receipt_for=REDACTED"), "{log:?}");
    proxy.stop().await;
}

/// The overview's last hour, which the console draws (issue 60 item 12): writes by outcome as the
/// proxy answered them, known counts in, the same counts out; a read is not a write.
#[tokio::test]
async fn the_overview_counts_the_last_hour_of_writes_by_outcome() {
    let (up, proxy, _unknown) = with_unknown_write(Some(ADMIN_TOKEN)).await;
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/charges");
    up.push(Behavior::json(201, r#"{"id":"ch_a"}"#));
    up.push(Behavior::json(201, r#"{"id":"ch_b"}"#));
    up.push(Behavior::json(422, r#"{"error":"card_declined"}"#));
    let outcomes = [
        c.post(&url, &[(KEY, "a")], "amount=1").await,
        c.post(&url, &[(KEY, "b")], "amount=2").await,
        c.post(&url, &[(KEY, "a")], "amount=1").await,
        c.post(&url, &[(KEY, "d")], "amount=4").await,
        // The same key for another body: refused, nothing sent.
        c.post(&url, &[(KEY, "a")], "amount=999").await,
    ]
    .map(|r| r.header("oncegate-outcome").unwrap_or("-").to_string());
    assert_eq!(
        outcomes,
        ["sent", "sent", "replayed", "not-applied", "rejected"]
    );
    for _ in 0..3 {
        c.get(&proxy.url("/pay/v1/charges/ch_a")).await;
    }
    let o = proxy.admin("GET", "/v1/overview", "").await.json();
    let minutes = o["minutes"].as_array().unwrap();
    assert_eq!(minutes.len(), 60, "{o}");
    let ats: Vec<u64> = minutes.iter().map(|m| m["at"].as_u64().unwrap()).collect();
    assert!(ats.windows(2).all(|w| w[1] == w[0] + 60), "{ats:?}");
    let total = |k: &str| -> u64 { minutes.iter().map(|m| m[k].as_u64().unwrap()).sum() };
    let seen: Vec<u64> = ["sent", "replayed", "unknown", "not_applied", "refused"]
        .iter()
        .map(|k| total(k))
        .collect();
    assert_eq!(seen, [2, 1, 1, 1, 1], "{o}");
    // The unknown one waits, sampled as the overview was read.
    let last = minutes.last().unwrap();
    assert_eq!(last["unknown_waiting"], 1, "{o}");
    proxy.stop().await;
}

/// MCP reads (`initialize`, a read tool) are reads in the chart's counts, not writes of
/// another kind; a guarded tool call is a write.
#[tokio::test]
async fn the_overview_counts_mcp_reads_as_reads() {
    use support::mcp::{call_body, mcp_config, JSON_SSE};
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json(
        200,
        r#"{"jsonrpc":"2.0","id":1,"result":{"content":[]}}"#,
    ));
    let proxy = with_token(&mcp_config(&format!("{}/mcp", up.url()), "")).await;
    let c = TestClient::default();
    let url = proxy.url("/mcp");
    let init = r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{}}"#;
    assert_eq!(c.post(&url, JSON_SSE, init).await.status, 200);
    for id in 1..=2 {
        let r = c
            .post(
                &url,
                JSON_SSE,
                &call_body(id, "search", serde_json::json!({"q": "a"})),
            )
            .await;
        assert_eq!(r.status, 200);
    }
    let r = c
        .post(
            &url,
            JSON_SSE,
            &call_body(1, "send_email", serde_json::json!({"to": "a"})),
        )
        .await;
    assert_eq!(r.header("oncegate-outcome"), Some("sent"), "{r:?}");
    let o = proxy.admin("GET", "/v1/overview", "").await.json();
    let writes: u64 = o["minutes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            ["sent", "replayed", "unknown", "not_applied", "refused"]
                .iter()
                .map(|k| m[*k].as_u64().unwrap())
                .sum::<u64>()
        })
        .sum();
    assert_eq!(writes, 1, "{o}");
    let metrics =
        String::from_utf8_lossy(&c.get(&proxy.admin_url("/metrics")).await.body).to_string();
    assert!(
        metrics.contains(r#"class="read",outcome="forwarded"} 3"#),
        "{metrics}"
    );
    proxy.stop().await;
}

/// An admin listener on every address (`0.0.0.0`), reached as `127.0.0.1:port`: the console's
/// own requests carry the origin the browser used, which is the host it names, on the
/// listener's port; they get through, and a foreign origin still does not (issue 58 item 12).
#[tokio::test]
async fn the_console_works_on_an_admin_listener_on_every_address() {
    let up = FakeUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = support::child_config(dir.path(), &up.url(), "")
        .to_string_lossy()
        .to_string();
    let text = std::fs::read_to_string(&cfg).unwrap().replacen(
        "[admin]\nlisten = \"127.0.0.1:0\"",
        "[admin]\nlisten = \"0.0.0.0:0\"",
        1,
    );
    std::fs::write(&cfg, text).unwrap();
    let proxy = tokio::task::spawn_blocking(move || support::ChildProxy::spawn(cfg.as_ref()))
        .await
        .unwrap();
    let port = proxy.admin.port();
    let c = TestClient::default();
    let url =
        format!("http://127.0.0.1:{port}/v1/actions/00000000000000000000000000000000/resolve");
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let send = |origin: String| {
        let (c, url, auth) = (c.clone(), url.clone(), auth.clone());
        async move {
            c.send(
                "POST",
                &url,
                &[
                    ("authorization", &auth),
                    ("origin", &origin),
                    ("content-type", "application/json"),
                ],
                r#"{"outcome":"applied","reason":"x"}"#,
            )
            .await
        }
    };
    // The console's own origin: past the guard (the action does not exist: 404).
    let own = send(format!("http://127.0.0.1:{port}")).await;
    assert_eq!(own.status, 404, "{own:?}");
    for foreign in [
        "https://evil.example".to_string(),
        format!("http://127.0.0.1:{}", port + 1),
    ] {
        assert_eq!(send(foreign.clone()).await.status, 403, "{foreign}");
    }
}

/// A task is any string: one holding `/`, `%`, `?` or `#` is shown by `/v1/tasks/{task}`
/// percent-encoded, as the console asks for it (issue 58 item 13).
#[tokio::test]
async fn a_task_holding_reserved_characters_is_shown() {
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json(201, "{}"));
    let proxy = TestProxy::start(&config(&up.url(), "")).await;
    let c = TestClient::default();
    let task = "onboard/acme%20?x#1";
    let r = c
        .post(
            &proxy.url("/pay/v1/workspaces"),
            &[("oncegate-task", task), ("oncegate-step", "create")],
            "{}",
        )
        .await;
    assert_eq!(r.status, 201);
    let encoded = "onboard%2Facme%2520%3Fx%231";
    let v = proxy
        .admin("GET", &format!("/v1/tasks/{encoded}"), "")
        .await
        .json();
    assert_eq!(v["task"], task, "{v}");
    assert_eq!(v["actions"].as_array().map(Vec::len), Some(1), "{v}");
}

/// The admin API's body is bounded in time too (issue 58 item 14): a resolve whose body trickles
/// gets 408 at `body_timeout` and changes nothing.
#[tokio::test]
async fn a_trickled_admin_body_gets_408_at_body_timeout() {
    let up = FakeUpstream::start().await;
    let cfg = config(&up.url(), "").replace(
        "header_timeout = \"2s\"",
        "header_timeout = \"2s\"\nbody_timeout = \"1s\"",
    );
    let proxy = TestProxy::start(&cfg).await;
    let req = format!(
        "POST /v1/actions/00000000000000000000000000000000/resolve HTTP/1.1\r\nhost: {}\r\nauthorization: Bearer {ADMIN_TOKEN}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"out",
        proxy.admin
    );
    let (resp, _) = support::raw(
        proxy.admin,
        req.as_bytes(),
        std::time::Duration::from_secs(5),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp}");
}

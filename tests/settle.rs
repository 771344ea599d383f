//! Settling the unknown (SPEC §7, §9, §10): status lookups, external ids, stamping, resolution by
//! an operator, the task views, the admin API's guard, and the CLI end to end.
#![allow(clippy::unwrap_used)]

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use support::{config, Behavior, FakeUpstream, TestClient, TestProxy, ADMIN_TOKEN};

const KEY: &str = "idempotency-key";
const LOOKUP: &str = r#"lookup = { method = "GET", path = "/v1/lookup/{key}", found = "/id" }
timeout = "300ms"
external_id = "/id""#;

/// A proxy whose upstream stalls past the timeout on the first write, leaving it unknown.
async fn unknown_write(extra: &str, key: &str) -> (FakeUpstream, TestProxy, String) {
    let up = FakeUpstream::start().await;
    let proxy = TestProxy::start(&config(&up.url(), extra)).await;
    up.push(Behavior::Hang);
    let r = TestClient::default()
        .post(&proxy.url("/pay/v1/charges"), &[(KEY, key)], "amount=5")
        .await;
    assert_eq!(r.problem(), "outcome-unknown");
    let id = r.header("oncegate-action").unwrap().to_string();
    (up, proxy, id)
}

#[tokio::test]
async fn a_duplicate_of_an_unknown_write_is_settled_by_lookup_and_replays_its_answer() {
    let (up, proxy, id) = unknown_write(LOOKUP, "ch-key-1").await;
    up.on(
        "/v1/lookup/",
        Behavior::json(200, r#"{"id":"ch_123","amount":5}"#),
    );
    let r = TestClient::default()
        .post(
            &proxy.url("/pay/v1/charges"),
            &[(KEY, "ch-key-1")],
            "amount=5",
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body, r#"{"id":"ch_123","amount":5}"#);
    assert_eq!(r.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(r.header("oncegate-replay-source"), Some("lookup"));
    assert_eq!(up.count_method("POST"), 1, "the write was not sent again");
    let lookups: Vec<_> = up
        .received()
        .into_iter()
        .filter(|r| r.method == "GET")
        .collect();
    assert_eq!(lookups.len(), 1);
    assert_eq!(lookups[0].target, "/v1/lookup/ch-key-1");
    let a = proxy
        .admin("GET", &format!("/v1/actions/{id}"), "")
        .await
        .json();
    assert_eq!(a["state"], "succeeded");
    assert_eq!(a["external_id"], "ch_123");
    assert_eq!(a["resolution"]["actor"], "lookup");
    // The reason names the path asked, not the template (issue 60 item 15).
    assert_eq!(
        a["resolution"]["reason"],
        "lookup GET /v1/lookup/ch-key-1 found ch_123"
    );
}

/// A proxy on a fresh sled store whose clock the test moves (ms since the epoch).
async fn on_controlled_clock(extra: &str) -> (FakeUpstream, TestProxy, Arc<AtomicU64>) {
    let up = FakeUpstream::start().await;
    let (now, clock) = support::controlled_clock();
    let cfg = oncegate::config::Config::parse(&config(&up.url(), extra)).unwrap();
    let proxy = TestProxy::start_fresh(cfg, Some(ADMIN_TOKEN.to_string()), clock).await;
    (up, proxy, now)
}

#[tokio::test]
async fn a_lookup_that_finds_nothing_keeps_the_write_unknown_until_absent_after() {
    // The route times out; the upstream is still working on the write. A retry moments later
    // asks the lookup, which finds nothing *yet* (SPEC §9): the write must not go again.
    let (up, proxy, now) = on_controlled_clock(LOOKUP).await;
    up.push(Behavior::Hang);
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/charges");
    let first = c.post(&url, &[(KEY, "ch-key-2")], "amount=5").await;
    assert_eq!(first.problem(), "outcome-unknown");
    up.on("/v1/lookup/", Behavior::status(404));
    now.fetch_add(2_300, Ordering::SeqCst);
    let r = c.post(&url, &[(KEY, "ch-key-2")], "amount=5").await;
    assert_eq!(r.status, 409, "{:?}", r.body);
    assert_eq!(r.problem(), "outcome-unknown");
    assert!(
        r.json()["detail"]
            .as_str()
            .unwrap()
            .contains("absent_after"),
        "{:?}",
        r.json()
    );
    assert_eq!(up.count_method("GET"), 1, "the lookup ran");
    assert_eq!(up.count_method("POST"), 1, "the write was not sent again");
    // Ten minutes after the last send, not found means not applied: the next attempt goes, with
    // the same key.
    now.fetch_add(10 * 60_000, Ordering::SeqCst);
    up.push(Behavior::json(201, r#"{"id":"ch_2"}"#));
    let r = c.post(&url, &[(KEY, "ch-key-2")], "amount=5").await;
    assert_eq!(r.status, 201);
    assert_eq!(r.header("oncegate-outcome"), Some("sent"));
    assert_eq!(up.count_method("POST"), 2);
    assert_eq!(
        up.count_key(KEY, "ch-key-2"),
        2,
        "both attempts carried the same key"
    );
}

#[tokio::test]
async fn a_lookup_that_fails_or_stalls_leaves_the_action_unknown() {
    for lookup_behavior in [
        Behavior::json(500, "{}"),
        Behavior::Hang,
        // A 2xx without the field is "not found": too early to say not applied.
        Behavior::json(200, r#"{"id":null}"#),
    ] {
        let (up, proxy, id) = unknown_write(LOOKUP, "ch-key-3").await;
        up.on("/v1/lookup/", lookup_behavior);
        let r = TestClient::default()
            .post(
                &proxy.url("/pay/v1/charges"),
                &[(KEY, "ch-key-3")],
                "amount=5",
            )
            .await;
        assert_eq!(r.status, 409);
        assert_eq!(r.problem(), "outcome-unknown");
        assert_eq!(up.count_method("POST"), 1);
        let a = proxy
            .admin("GET", &format!("/v1/actions/{id}"), "")
            .await
            .json();
        assert_eq!(a["state"], "unknown");
    }
}

#[tokio::test]
async fn a_lookup_replays_the_created_object_not_the_search_result() {
    // Stripe's search answers a list; `object` picks the charge, as `charges.create` returns it.
    let extra = format!("{LOOKUP}\n").replace(
        r#"found = "/id" }"#,
        r#"found = "/data/0/id", object = "/data/0", status = 200 }"#,
    );
    let (up, proxy, _) = unknown_write(&extra, "ch-key-4").await;
    up.on(
        "/v1/lookup/",
        Behavior::json(
            200,
            r#"{"object":"search_result","data":[{"id":"ch_9","object":"charge","amount":5}],"has_more":false}"#,
        ),
    );
    let r = TestClient::default()
        .post(
            &proxy.url("/pay/v1/charges"),
            &[(KEY, "ch-key-4")],
            "amount=5",
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("oncegate-replay-source"), Some("lookup"));
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(
        r.json(),
        serde_json::json!({"id": "ch_9", "object": "charge", "amount": 5})
    );
    assert_eq!(up.count_method("POST"), 1);
}

#[tokio::test]
async fn background_lookups_settle_unknown_actions() {
    let extra = format!("{LOOKUP}\nlookup_interval = \"100ms\"");
    let up = FakeUpstream::start().await;
    // The lookup endpoint answers before the first background tick can ask it.
    up.on("/v1/lookup/", Behavior::json(200, r#"{"id":"ch_bg"}"#));
    let proxy = TestProxy::start(&config(&up.url(), &extra)).await;
    up.push(Behavior::Hang);
    let r = TestClient::default()
        .post(
            &proxy.url("/pay/v1/charges"),
            &[(KEY, "ch-key-4")],
            "amount=5",
        )
        .await;
    assert_eq!(r.problem(), "outcome-unknown");
    let id = r.header("oncegate-action").unwrap().to_string();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let a = proxy
            .admin("GET", &format!("/v1/actions/{id}"), "")
            .await
            .json();
        if a["state"] == "succeeded" {
            assert_eq!(a["external_id"], "ch_bg");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never settled: {a}");
        // The next background lookup, or a moment for this one's resolution to land.
        let _ = tokio::time::timeout(Duration::from_millis(200), up.wait_for(up.count() + 1)).await;
    }
    assert_eq!(up.count_method("POST"), 1);
}

#[tokio::test]
async fn background_lookups_carry_the_lookups_own_credentials_and_never_show_them() {
    // The service's status endpoint wants credentials, and a background lookup has no caller.
    let secret = "Bearer sk_lookup_7d1f";
    std::env::set_var("ONCEGATE_TEST_LOOKUP_AUTH", secret);
    let extra = r#"lookup = { method = "GET", path = "/v1/lookup/{key}", found = "/id", headers_env = { authorization = "ONCEGATE_TEST_LOOKUP_AUTH" } }
timeout = "300ms"
external_id = "/id"
lookup_interval = "100ms""#;
    let up = FakeUpstream::start().await;
    up.on("/v1/lookup/", Behavior::json(200, r#"{"id":"ch_auth"}"#));
    let proxy = TestProxy::start(&config(&up.url(), extra)).await;
    up.push(Behavior::Hang);
    let r = TestClient::default()
        .post(&proxy.url("/pay/v1/charges"), &[(KEY, "ch-auth")], "a=1")
        .await;
    assert_eq!(r.problem(), "outcome-unknown");
    let id = r.header("oncegate-action").unwrap().to_string();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let action = loop {
        let a = proxy.admin("GET", &format!("/v1/actions/{id}"), "").await;
        if a.json()["state"] == "succeeded" {
            break a;
        }
        assert!(tokio::time::Instant::now() < deadline, "never settled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(action.json()["external_id"], "ch_auth");
    let lookups: Vec<_> = up
        .received()
        .into_iter()
        .filter(|r| r.target.starts_with("/v1/lookup/"))
        .collect();
    assert!(!lookups.is_empty());
    assert!(lookups
        .iter()
        .all(|r| r.header("authorization") == Some(secret)));
    // Nowhere to be read back: not the action, not the write log.
    let log = proxy.admin("GET", "/v1/log", "").await;
    assert!(String::from_utf8_lossy(&log.body).contains(&id));
    for text in [&action.body, &log.body] {
        assert!(!String::from_utf8_lossy(text).contains("sk_lookup_7d1f"));
    }
}

#[tokio::test]
async fn an_operator_resolves_unknown_actions_and_only_those() {
    let (up, proxy, id) = unknown_write("timeout = \"300ms\"", "k-op").await;
    let resolve = |outcome: &str| {
        format!(
            r#"{{"outcome":"{outcome}","reason":"checked the dashboard","external_id":"ch_op"}}"#
        )
    };
    // A reason is required.
    let r = proxy
        .admin(
            "POST",
            &format!("/v1/actions/{id}/resolve"),
            r#"{"outcome":"applied"}"#,
        )
        .await;
    assert_eq!(r.status, 400);
    let r = proxy
        .admin(
            "POST",
            &format!("/v1/actions/{id}/resolve"),
            &resolve("applied"),
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.json()["state"], "succeeded");
    assert_eq!(r.json()["external_id"], "ch_op");
    // Now applied without a stored answer: duplicates learn it was applied, nothing is sent.
    let d = TestClient::default()
        .post(&proxy.url("/pay/v1/charges"), &[(KEY, "k-op")], "amount=5")
        .await;
    assert_eq!(d.problem(), "already-applied");
    assert_eq!(d.json()["action"]["external_id"], "ch_op");
    // Only unknown actions can be resolved.
    let r = proxy
        .admin(
            "POST",
            &format!("/v1/actions/{id}/resolve"),
            &resolve("not-applied"),
        )
        .await;
    assert_eq!(r.status, 409);
    assert_eq!(up.count(), 1);
    let r = proxy
        .admin("POST", "/v1/actions/0123/resolve", &resolve("applied"))
        .await;
    assert_eq!(r.status, 404);
}

#[tokio::test]
async fn resolving_not_applied_sends_the_next_attempt_with_the_same_key() {
    let (up, proxy, id) = unknown_write("timeout = \"300ms\"", "k-na").await;
    let r = proxy
        .admin(
            "POST",
            &format!("/v1/actions/{id}/resolve"),
            r#"{"outcome":"not-applied","reason":"not in the ledger"}"#,
        )
        .await;
    assert_eq!(r.json()["state"], "failed");
    let r = TestClient::default()
        .post(&proxy.url("/pay/v1/charges"), &[(KEY, "k-na")], "amount=5")
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(up.count_key(KEY, "k-na"), 2);
}

#[tokio::test]
async fn the_admin_api_needs_the_token_except_for_health_and_metrics() {
    let (_up, proxy, id) = unknown_write("timeout = \"300ms\"", "k-auth").await;
    let c = TestClient::default();
    for path in [
        "/v1/actions",
        &format!("/v1/actions/{id}"),
        "/v1/log",
        "/v1/log/verify",
    ] {
        let r = c.get(&proxy.admin_url(path)).await;
        assert_eq!(r.status, 401, "{path}");
        assert_eq!(r.problem(), "unauthorized");
        let r = c
            .send(
                "GET",
                &proxy.admin_url(path),
                &[("authorization", "Bearer wrong")],
                "",
            )
            .await;
        assert_eq!(r.status, 401, "{path}");
    }
    assert_eq!(c.get(&proxy.admin_url("/healthz")).await.status, 200);
    assert_eq!(c.get(&proxy.admin_url("/readyz")).await.status, 200);
    let m = c.get(&proxy.admin_url("/metrics")).await;
    assert_eq!(m.status, 200);
    let text = String::from_utf8(m.body.to_vec()).unwrap();
    for name in [
        "oncegate_requests_total",
        "oncegate_upstream_latency_seconds",
        "oncegate_actions{state=\"unknown\"} 1",
        "oncegate_store_flush_seconds",
        "oncegate_store_drainer_waits_total{wait=\"eased\"} 0",
        "oncegate_log_head_seq",
    ] {
        assert!(text.contains(name), "metrics lack {name}:\n{text}");
    }
    assert!(!text.contains(ADMIN_TOKEN));
}

#[tokio::test]
async fn the_admin_listener_refuses_a_public_address_without_a_token() {
    let up = FakeUpstream::start().await;
    let config = oncegate::config::Config::parse(&config(&up.url(), "")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let store = std::sync::Arc::new(
        oncegate::store::sled::SledStore::open(&tmp.path().join("s"), Default::default()).unwrap(),
    );
    let result = oncegate::run(
        config,
        oncegate::Listeners {
            proxy: tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
            admin: Some(tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap()),
        },
        oncegate::Services::new(store, Default::default(), None),
        std::future::pending(),
    )
    .await;
    let err = result.unwrap_err();
    assert!(matches!(err, oncegate::RunError::Config(_)));
    assert!(err.to_string().contains("admin.listen"), "{err}");
}

#[tokio::test]
async fn actions_are_listed_newest_first_with_filters_and_a_cursor() {
    let up = FakeUpstream::start().await;
    let proxy = TestProxy::start(&config(&up.url(), "")).await;
    let c = TestClient::default();
    for i in 0..5 {
        c.post(&proxy.url("/pay/v1/a"), &[(KEY, &format!("k{i}"))], "x")
            .await;
    }
    let page = proxy.admin("GET", "/v1/actions?limit=3", "").await.json();
    let keys: Vec<&str> = page["actions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys.len(), 3);
    let next = page["next"].as_str().unwrap();
    let rest = proxy
        .admin("GET", &format!("/v1/actions?limit=3&after={next}"), "")
        .await
        .json();
    let more: Vec<&str> = rest["actions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["key"].as_str().unwrap())
        .collect();
    assert_eq!(more.len(), 2);
    assert!(rest["next"].is_null());
    // A cursor that no page gave is refused, not read as "from the start".
    let bad = proxy.admin("GET", "/v1/actions?after=nonsense", "").await;
    assert_eq!(bad.status, 400);
    let mut all: Vec<&str> = keys.iter().chain(more.iter()).copied().collect();
    all.sort();
    assert_eq!(all, ["k0", "k1", "k2", "k3", "k4"]);
    let none = proxy
        .admin("GET", "/v1/actions?state=unknown", "")
        .await
        .json();
    assert!(none["actions"].as_array().unwrap().is_empty());
    assert_eq!(
        proxy
            .admin("GET", "/v1/actions?state=bogus", "")
            .await
            .status,
        400
    );
}

#[tokio::test]
async fn the_task_view_shows_only_the_callers_actions_in_order() {
    let up = FakeUpstream::start().await;
    let proxy = TestProxy::start(&config(&up.url(), "external_id = \"/id\"")).await;
    let c = TestClient::default();
    let alice = ("authorization", "Bearer alice-secret");
    let bob = ("authorization", "Bearer bob-secret");
    up.push(Behavior::json(201, r#"{"id":"ws_1"}"#));
    up.push(Behavior::json(422, r#"{"error":"bad email"}"#));
    let url = proxy.url("/pay/v1/x");
    c.post(
        &url,
        &[alice, ("oncegate-task", "t-1"), ("oncegate-step", "create")],
        "a",
    )
    .await;
    c.post(
        &url,
        &[alice, ("oncegate-task", "t-1"), ("oncegate-step", "invite")],
        "b",
    )
    .await;
    c.post(
        &url,
        &[bob, ("oncegate-task", "t-1"), ("oncegate-step", "other")],
        "c",
    )
    .await;
    let view = c
        .send("GET", &proxy.url("/_oncegate/tasks/t-1"), &[alice], "")
        .await
        .json();
    let steps: Vec<(String, String)> = view["actions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["step"].as_str().unwrap().into(),
                a["state"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        steps,
        [
            ("create".into(), "succeeded".into()),
            ("invite".into(), "failed".into())
        ]
    );
    assert_eq!(view["actions"][0]["external_id"], "ws_1");
    assert_eq!(view["actions"][0]["status"], 201);
    assert_eq!(view["actions"][1]["status"], 422);
    let stranger = c
        .send(
            "GET",
            &proxy.url("/_oncegate/tasks/t-1"),
            &[("authorization", "Bearer eve")],
            "",
        )
        .await
        .json();
    assert!(stranger["actions"].as_array().unwrap().is_empty());
    // The admin view shows every principal's actions.
    let all = proxy.admin("GET", "/v1/tasks/t-1", "").await.json();
    assert_eq!(all["actions"].as_array().unwrap().len(), 3);
    assert!(
        !String::from_utf8_lossy(&proxy.admin("GET", "/v1/tasks/t-1", "").await.body)
            .contains("secret")
    );
}

#[tokio::test]
async fn stamping_writes_the_key_into_json_and_form_bodies() {
    let up = FakeUpstream::start().await;
    let extra = r#"
[[upstreams.routes]]
methods = ["POST"]
path = "/v1/json"
stamp = "/metadata/oncegate_key"
[[upstreams.routes]]
methods = ["POST"]
path = "/v1/form"
stamp = "metadata[oncegate_key]"
"#;
    let proxy = TestProxy::start(&config(&up.url(), extra)).await;
    let c = TestClient::default();
    let json = [(KEY, "sj-1"), ("content-type", "application/json")];
    c.post(&proxy.url("/pay/v1/json"), &json, r#"{"amount":5}"#)
        .await;
    let form = [
        (KEY, "sf-1"),
        ("content-type", "application/x-www-form-urlencoded"),
    ];
    c.post(&proxy.url("/pay/v1/form"), &form, "amount=5&currency=usd")
        .await;
    let got = up.received();
    let body: Value = serde_json::from_slice(&got[0].body).unwrap();
    assert_eq!(body["metadata"]["oncegate_key"], "sj-1");
    assert_eq!(body["amount"], 5);
    assert_eq!(
        got[1].body,
        "amount=5&currency=usd&metadata%5Boncegate_key%5D=sf-1"
    );
    // The fingerprint is of the client's body: a retry is the same action.
    let r = c
        .post(&proxy.url("/pay/v1/json"), &json, r#"{"amount":5}"#)
        .await;
    assert_eq!(r.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(up.count(), 2);
}

#[tokio::test]
async fn external_ids_come_from_a_header_when_configured() {
    let up = FakeUpstream::start().await;
    let proxy = TestProxy::start(&config(&up.url(), "external_id = \"header:location\"")).await;
    up.set_default(Behavior::json(201, "{}").with_header("location", "/v1/things/th_9"));
    let r = TestClient::default()
        .post(&proxy.url("/pay/v1/things"), &[(KEY, "h1")], "x")
        .await;
    let id = r.header("oncegate-action").unwrap();
    let a = proxy
        .admin("GET", &format!("/v1/actions/{id}"), "")
        .await
        .json();
    assert_eq!(a["external_id"], "/v1/things/th_9");
    assert_eq!(a["response"]["status"], 201);
}

/// Runs `oncegate GROUP --admin ADMIN REST…` (GROUP: `actions` or `log`) with the admin token,
/// as an operator would.
async fn cli(admin: &str, args: &[&str]) -> std::process::Output {
    let (group, rest) = args.split_first().expect("a subcommand group");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_oncegate"));
    cmd.args([*group, "--admin", admin])
        .args(rest)
        .env("ONCEGATE_ADMIN_TOKEN", ADMIN_TOKEN);
    tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap()
}

#[tokio::test]
async fn the_cli_lists_and_resolves_unknown_actions() {
    let (_up, proxy, id) = unknown_write("timeout = \"300ms\"", "k-cli").await;
    let admin = proxy.admin_url("");
    let bin = env!("CARGO_BIN_EXE_oncegate");
    let out = cli(&admin, &["actions", "list", "--state", "unknown"]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains(&id) && text.contains("unknown"), "{text}");
    let reason = "found in the processor's dashboard";
    let out = cli(
        &admin,
        &[
            "actions",
            "resolve",
            &id,
            "--outcome",
            "applied",
            "--reason",
            reason,
        ],
    )
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cli(&admin, &["actions", "show", &id, "--json"]).await;
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["state"], "succeeded");
    assert_eq!(v["resolution"]["reason"], reason);
    // Without the token the CLI fails and says why.
    let out = tokio::task::spawn_blocking({
        let admin = admin.clone();
        move || {
            std::process::Command::new(bin)
                .args(["actions", "--admin", &admin, "list"])
                .env_remove("ONCEGATE_ADMIN_TOKEN")
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("401"));
}

/// Every subcommand that speaks to the admin API, run against a real proxy: `actions list`,
/// `show`, `lookup` (which answered 415 for every call: it posted no JSON body), `resolve`, and
/// `log export` and `log verify`.
#[tokio::test]
async fn every_cli_subcommand_works_against_the_admin_api() {
    let (up, proxy, id) = unknown_write(LOOKUP, "k-cli-all").await;
    let (_up2, other, id2) = unknown_write("timeout = \"300ms\"", "k-cli-2").await;
    let admin = proxy.admin_url("");
    assert!(cli_ok(&admin, &["actions", "list", "--json"])
        .await
        .contains(&id));
    let shown = cli_ok(&admin, &["actions", "show", &id]).await;
    assert!(shown.contains("unknown"), "{shown}");
    // The runbook's first settling step: the lookup finds the charge.
    up.on("/v1/lookup/", Behavior::json(200, r#"{"id":"ch_cli"}"#));
    let looked = cli_ok(&admin, &["actions", "lookup", &id]).await;
    assert!(looked.contains("lookup of"), "{looked}");
    let v: Value =
        serde_json::from_str(&cli_ok(&admin, &["actions", "show", &id, "--json"]).await).unwrap();
    assert_eq!(v["state"], "succeeded", "{v}");
    assert_eq!(v["external_id"], "ch_cli");
    // `resolve`, on the other proxy's unknown action.
    let reason = "absent at the service";
    let args = [
        "actions",
        "resolve",
        &id2,
        "--outcome",
        "not-applied",
        "--reason",
        reason,
    ];
    let resolved = cli_ok(&other.admin_url(""), &args).await;
    assert!(resolved.contains("failed"), "{resolved}");
    let export = cli_ok(&admin, &["log", "export"]).await;
    assert!(
        export.lines().any(|l| l.contains("\"event\":\"lookup\"")),
        "{export}"
    );
    let verified = cli_ok(&admin, &["log", "verify"]).await;
    assert!(verified.contains("ok"), "{verified}");
}

/// [`cli`], which must succeed; its standard output.
async fn cli_ok(admin: &str, args: &[&str]) -> String {
    let out = cli(admin, args).await;
    assert!(
        out.status.success(),
        "oncegate {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

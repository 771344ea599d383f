//! The write-once engine (SPEC §4–§8): the rehearsal the product promises. Each test drives the
//! real proxy against a counting fake upstream and checks what a user would check: how many times
//! the upstream saw the write, and what the agent was told.
#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use support::{config, Behavior, ChildProxy, FakeUpstream, TestClient, TestProxy};
use tokio::sync::Notify;

const KEY: &str = "idempotency-key";

async fn setup(extra: &str) -> (FakeUpstream, TestProxy) {
    let up = FakeUpstream::start().await;
    let proxy = TestProxy::start(&config(&up.url(), extra)).await;
    (up, proxy)
}

fn assert_full_problem(p: &Value) {
    for member in [
        "type",
        "title",
        "status",
        "detail",
        "outcome",
        "duplicate_risk",
        "retry",
        "action",
        "evidence",
        "next_step",
    ] {
        assert!(p.get(member).is_some(), "problem lacks {member}: {p}");
    }
    for field in [
        "id",
        "key",
        "upstream",
        "method",
        "path",
        "state",
        "attempts",
        "created_at",
        "updated_at",
        "expires_at",
    ] {
        assert!(
            p["action"].get(field).is_some(),
            "action lacks {field}: {p}"
        );
    }
}

#[tokio::test]
async fn a_timeout_after_the_upstream_accepted_is_unknown_and_never_sent_again() {
    let (up, proxy) = setup("timeout = \"300ms\"").await;
    // The upstream applies the write, then never answers.
    up.set_default(Behavior::Hang);
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/charges");
    let r = c
        .post(&url, &[(KEY, "charge-1")], r#"{"amount":500}"#)
        .await;
    assert_eq!(r.status, 504);
    assert_eq!(r.problem(), "outcome-unknown");
    assert_eq!(r.header("oncegate-outcome"), Some("unknown"));
    assert_eq!(r.header("x-should-retry"), Some("false"));
    assert_eq!(r.header("stripe-should-retry"), Some("false"));
    let p = r.json();
    assert_full_problem(&p);
    assert_eq!(p["duplicate_risk"], true);
    assert_eq!(p["retry"], "after-resolution");
    assert_eq!(p["action"]["state"], "unknown");
    assert_eq!(p["evidence"][0]["tries"][0]["phase"], "response");
    for _ in 0..10 {
        let r = c
            .post(&url, &[(KEY, "charge-1")], r#"{"amount":500}"#)
            .await;
        assert_eq!(r.status, 409);
        assert_eq!(r.problem(), "outcome-unknown");
        assert_eq!(r.header("x-should-retry"), Some("false"));
    }
    assert_eq!(
        up.count(),
        1,
        "the write reached the upstream more than once"
    );
}

#[tokio::test]
async fn a_dropped_connection_after_sending_is_unknown() {
    let (up, proxy) = setup("").await;
    up.set_default(Behavior::Drop);
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/charges");
    let r = c.post(&url, &[(KEY, "k-drop")], "{}").await;
    assert_eq!(r.status, 504);
    assert_eq!(r.problem(), "outcome-unknown");
    let r = c.post(&url, &[(KEY, "k-drop")], "{}").await;
    assert_eq!(r.status, 409);
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn fifty_concurrent_identical_writes_reach_the_upstream_once() {
    let (up, proxy) = setup("").await;
    up.set_default(Behavior::Delay(
        Duration::from_millis(200),
        Box::new(Behavior::json(201, r#"{"id":"ch_1"}"#)),
    ));
    let url = proxy.url("/pay/v1/charges");
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            TestClient::default()
                .post(&url, &[(KEY, "same-key")], r#"{"amount":1}"#)
                .await
        }));
    }
    let (mut sent, mut replayed, mut in_flight) = (0, 0, 0);
    for t in tasks {
        let r = t.await.unwrap();
        match (r.status.as_u16(), r.header("oncegate-outcome")) {
            (201, Some("sent")) => sent += 1,
            (201, Some("replayed")) => {
                assert_eq!(r.body, r#"{"id":"ch_1"}"#);
                replayed += 1
            }
            (409, Some("in-flight")) => {
                assert_eq!(r.problem(), "in-flight");
                assert!(r.header("retry-after").is_some());
                in_flight += 1
            }
            other => panic!("unexpected answer {other:?}: {r:?}"),
        }
    }
    // Both numbers at once, with what the upstream received, should this ever fail.
    let received: Vec<_> = up
        .received()
        .iter()
        .map(|r| {
            (
                r.method.clone(),
                r.target.clone(),
                r.header("idempotency-key").map(str::to_string),
            )
        })
        .collect();
    assert_eq!((sent, up.count()), (1, 1), "received: {received:?}");
    assert_eq!(sent + replayed + in_flight, 50);
}

#[tokio::test]
async fn duplicates_wait_for_the_attempt_with_in_flight_wait() {
    let (up, proxy) = setup("in_flight_wait = \"5s\"").await;
    let gate = Arc::new(Notify::new());
    up.set_default(Behavior::Gate(
        gate.clone(),
        Box::new(Behavior::json(201, r#"{"id":"x"}"#)),
    ));
    let url = proxy.url("/pay/v1/charges");
    let first = {
        let url = url.clone();
        tokio::spawn(async move { TestClient::default().post(&url, &[(KEY, "w")], "{}").await })
    };
    up.wait_for(1).await;
    let second = {
        let url = url.clone();
        tokio::spawn(async move { TestClient::default().post(&url, &[(KEY, "w")], "{}").await })
    };
    gate.notify_one();
    let (a, b) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!((a.status.as_u16(), b.status.as_u16()), (201, 201));
    assert_eq!(b.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn keyless_sdk_retries_are_one_action_and_different_bodies_two() {
    let (up, proxy) = setup("").await;
    up.set_default(Behavior::json(201, r#"{"id":"file_1"}"#));
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/files");
    let auth = ("authorization", "Bearer sk-agent");
    // As the OpenAI/Anthropic SDKs retry: same body, a growing retry counter header.
    for (i, body) in [
        r#"{"purpose":"batch","name":"a"}"#,
        r#"{"name":"a","purpose":"batch"}"#,
        r#"{ "purpose": "batch", "name": "a" }"#,
    ]
    .iter()
    .enumerate()
    {
        let n = i.to_string();
        let r = c
            .post(
                &url,
                &[
                    auth,
                    ("content-type", "application/json"),
                    ("x-stainless-retry-count", &n),
                ],
                body,
            )
            .await;
        assert_eq!(r.status, 201);
        assert_eq!(
            r.header("oncegate-outcome"),
            Some(if i == 0 { "sent" } else { "replayed" })
        );
        assert!(r.header(KEY).unwrap().starts_with("fp-"));
    }
    assert_eq!(up.count(), 1);
    let key = up.received()[0].header(KEY).unwrap().to_string();
    assert!(key.starts_with("fp-") && key.len() == 35, "{key}");
    let r = c
        .post(
            &url,
            &[auth, ("content-type", "application/json")],
            r#"{"purpose":"batch","name":"b"}"#,
        )
        .await;
    assert_eq!(r.header("oncegate-outcome"), Some("sent"));
    assert_eq!(up.count(), 2);
}

#[tokio::test]
async fn same_key_with_a_different_body_is_key_reused_and_nothing_is_sent() {
    let (up, proxy) = setup("").await;
    up.set_default(Behavior::json(201, r#"{"id":"c1"}"#));
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/customers");
    c.post(&url, &[(KEY, "k1")], "email=a@x.test").await;
    let r = c.post(&url, &[(KEY, "k1")], "email=b@x.test").await;
    assert_eq!(r.status, 422);
    assert_eq!(r.problem(), "key-reused");
    assert_full_problem(&r.json());
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn the_same_key_from_two_principals_is_two_actions() {
    let (up, proxy) = setup("").await;
    up.set_default(Behavior::json(201, r#"{"id":"c1"}"#));
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/customers");
    let a = c
        .post(&url, &[(KEY, "k1"), ("authorization", "Bearer alice")], "x")
        .await;
    let b = c
        .post(&url, &[(KEY, "k1"), ("authorization", "Bearer bob")], "x")
        .await;
    assert_eq!(a.header("oncegate-outcome"), Some("sent"));
    assert_eq!(b.header("oncegate-outcome"), Some("sent"));
    assert_ne!(a.header("oncegate-action"), b.header("oncegate-action"));
    assert_eq!(up.count(), 2);
}

#[tokio::test]
async fn a_regenerated_body_for_a_done_step_is_the_same_action_and_replays_it() {
    let (up, proxy) = setup("external_id = \"/id\"").await;
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/workspaces");
    let step = |s: &'static str| [("oncegate-task", "onboard-acme"), ("oncegate-step", s)];
    up.push(Behavior::json(201, r#"{"id":"ws_1"}"#));
    let first = c
        .post(&url, &step("create-workspace"), r#"{"name":"Acme"}"#)
        .await;
    assert_eq!(first.status, 201);
    assert!(first.header(KEY).unwrap().starts_with("ts-"));
    up.push(Behavior::json(201, r#"{"id":"inv_1"}"#));
    c.post(&url, &step("invite-owner"), r#"{"email":"o@acme.test"}"#)
        .await;
    // The agent restarted and regenerated the first step's body with other words (SPEC §4.1):
    // one step of one task is one action, so it gets the first answer, and nothing is sent.
    let r = c
        .post(&url, &step("create-workspace"), r#"{"name":"ACME Inc"}"#)
        .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(r.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(r.body, r#"{"id":"ws_1"}"#);
    assert_eq!(r.header("oncegate-action"), first.header("oncegate-action"));
    assert_eq!(up.count(), 2);
    // The upstream saw the task/step key.
    assert_eq!(up.received()[0].header(KEY), r.header(KEY));
    // The task view shows both steps done, as a resumed worker reads it.
    let view = c
        .get(&proxy.url("/_oncegate/tasks/onboard-acme"))
        .await
        .json();
    let steps: Vec<(&str, &str)> = view["actions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["step"].as_str().unwrap(),
                a["external_id"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        steps,
        [("create-workspace", "ws_1"), ("invite-owner", "inv_1")]
    );
}

#[tokio::test]
async fn a_storm_of_regenerated_bodies_for_one_step_sends_once() {
    let (up, proxy) = setup("in_flight_wait = \"5s\"").await;
    up.set_default(Behavior::Delay(
        Duration::from_millis(200),
        Box::new(Behavior::json(201, r#"{"id":"tk_1"}"#)),
    ));
    let url = proxy.url("/pay/v1/tickets");
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..50 {
        let url = url.clone();
        calls.spawn(async move {
            TestClient::default()
                .post(
                    &url,
                    &[
                        ("oncegate-task", "support-42"),
                        ("oncegate-step", "create_ticket"),
                        ("content-type", "application/json"),
                    ],
                    &format!(r#"{{"title":"Printer on fire","draft":{i}}}"#),
                )
                .await
        });
    }
    let mut statuses = Vec::new();
    while let Some(r) = calls.join_next().await {
        statuses.push(r.unwrap().status.as_u16());
    }
    assert!(statuses.iter().all(|s| *s == 201), "{statuses:?}");
    assert_eq!(up.count(), 1, "one ticket, however the agent worded it");
}

#[tokio::test]
async fn a_created_response_replays_byte_for_byte() {
    let (up, proxy) = setup("").await;
    let body = "{\"id\": \"cus_9\",\n  \"email\": \"ops@acme.test\", \"n\": 1.50}";
    up.set_default(
        Behavior::json(201, body)
            .with_header("location", "/v1/customers/cus_9")
            .with_header("x-custom", "a")
            .with_header("x-custom", "b")
            .with_header("request-id", "req_123"),
    );
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/customers");
    let first = c
        .post(&url, &[(KEY, "cus-key")], "email=ops@acme.test")
        .await;
    let again = c
        .post(&url, &[(KEY, "cus-key")], "email=ops@acme.test")
        .await;
    assert_eq!(up.count(), 1);
    assert_eq!(again.status, 201);
    assert_eq!(again.body, first.body);
    assert_eq!(again.body, body);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(
        again.header("oncegate-action"),
        first.header("oncegate-action")
    );
    assert_eq!(again.header(KEY), Some("cus-key"));
    for h in ["location", "content-type", "request-id", "content-length"] {
        assert_eq!(again.header(h), first.header(h), "{h}");
    }
    let customs: Vec<_> = again.headers.get_all("x-custom").iter().collect();
    assert_eq!(customs, ["a", "b"]);
    assert!(again.header("date").is_some());
}

#[tokio::test]
async fn a_4xx_fails_the_attempt_and_the_next_goes_out_with_the_same_key() {
    let (up, proxy) = setup("max_attempts = 3").await;
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/charges");
    up.push(Behavior::json(422, r#"{"error":"card_declined"}"#));
    let r = c.post(&url, &[(KEY, "k4")], "amount=5").await;
    assert_eq!(r.status, 422);
    assert_eq!(r.body, r#"{"error":"card_declined"}"#);
    assert_eq!(r.header("oncegate-outcome"), Some("not-applied"));
    let r = c.post(&url, &[(KEY, "k4")], "amount=5").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("oncegate-outcome"), Some("sent"));
    assert_eq!(up.count_key(KEY, "k4"), 2);
    let rec = proxy
        .store
        .get(r.header("oncegate-action").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rec.attempts, 2);
    assert_eq!(rec.evidence[0].tries[0].status, Some(422));
    assert_eq!(
        rec.evidence[0].tries[0].body.as_deref(),
        Some(r#"{"error":"card_declined"}"#)
    );
}

#[tokio::test]
async fn after_max_attempts_the_action_is_exhausted() {
    let (up, proxy) = setup("max_attempts = 2").await;
    up.set_default(Behavior::json(403, r#"{"error":"forbidden"}"#));
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/charges");
    for _ in 0..2 {
        assert_eq!(c.post(&url, &[(KEY, "k5")], "a").await.status, 403);
    }
    let r = c.post(&url, &[(KEY, "k5")], "a").await;
    assert_eq!(r.status, 409);
    assert_eq!(r.problem(), "attempts-exhausted");
    assert_eq!(r.header("x-should-retry"), Some("false"));
    let p = r.json();
    assert_full_problem(&p);
    assert_eq!(p["duplicate_risk"], false);
    assert_eq!(p["evidence"].as_array().unwrap().len(), 2);
    assert_eq!(up.count(), 2);
    let rec = proxy
        .store
        .get(p["action"]["id"].as_str().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert!(rec.needs_decision, "403 needs a new decision");
}

#[tokio::test]
async fn connect_refused_is_unreachable_and_the_action_stays_retryable() {
    // A port that refuses connections, reserved for the test's length.
    let (_reserved, addr) = support::refusing_port();
    let proxy = TestProxy::start(&config(&format!("http://{addr}"), "retries = 2")).await;
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/charges");
    let r = c.post(&url, &[(KEY, "k6")], "a").await;
    assert_eq!(r.status, 502);
    assert_eq!(r.problem(), "upstream-unreachable");
    assert_eq!(r.header("oncegate-outcome"), Some("not-applied"));
    let p = r.json();
    assert_full_problem(&p);
    assert_eq!(p["duplicate_risk"], false);
    assert_eq!(p["action"]["state"], "failed");
    let tries = p["evidence"][0]["tries"].as_array().unwrap();
    assert_eq!(tries.len(), 3, "one try and two proxy-side retries");
    assert!(tries.iter().all(|t| t["phase"] == "connect"));
    // Retryable: the next request is a new attempt, not a refusal.
    let r = c.post(&url, &[(KEY, "k6")], "a").await;
    assert_eq!(r.problem(), "upstream-unreachable");
    assert_eq!(r.json()["action"]["attempts"], 2);
}

#[tokio::test]
async fn retry_statuses_are_tried_again_within_one_attempt() {
    let (up, proxy) = setup("retries = 2").await;
    up.push(Behavior::status(503));
    up.push(Behavior::status(503).with_header("retry-after", "0"));
    up.push(Behavior::json(201, r#"{"id":"ok"}"#));
    let r = TestClient::default()
        .post(&proxy.url("/pay/v1/charges"), &[(KEY, "k7")], "a")
        .await;
    assert_eq!(r.status, 201);
    assert_eq!(up.count_key(KEY, "k7"), 3);
    let rec = proxy
        .store
        .get(r.header("oncegate-action").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rec.attempts, 1, "one action, one attempt");
    let statuses: Vec<_> = rec.evidence[0].tries.iter().map(|t| t.status).collect();
    assert_eq!(statuses, [Some(503), Some(503), Some(201)]);
}

#[tokio::test]
async fn an_unknown_status_is_passed_on_and_blocks_resending() {
    let (up, proxy) = setup("").await;
    up.set_default(Behavior::json(500, r#"{"error":"internal"}"#));
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/charges");
    let r = c.post(&url, &[(KEY, "k8")], "a").await;
    assert_eq!(r.status, 500);
    assert_eq!(r.body, r#"{"error":"internal"}"#);
    assert_eq!(r.header("oncegate-outcome"), Some("unknown"));
    let r = c.post(&url, &[(KEY, "k8")], "a").await;
    assert_eq!(r.status, 409);
    assert_eq!(r.problem(), "outcome-unknown");
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn a_client_that_disconnects_does_not_cancel_the_attempt() {
    let (up, proxy) = setup("in_flight_wait = \"5s\"").await;
    let gate = Arc::new(Notify::new());
    up.set_default(Behavior::Gate(
        gate.clone(),
        Box::new(Behavior::json(201, r#"{"id":"late"}"#)),
    ));
    let url = proxy.url("/pay/v1/charges");
    let client = {
        let url = url.clone();
        tokio::spawn(async move { TestClient::default().post(&url, &[(KEY, "k9")], "a").await })
    };
    up.wait_for(1).await;
    client.abort();
    let _ = client.await;
    gate.notify_one();
    let r = TestClient::default().post(&url, &[(KEY, "k9")], "a").await;
    assert_eq!(r.status, 201);
    assert_eq!(r.body, r#"{"id":"late"}"#);
    assert_eq!(r.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn every_write_response_names_its_action_and_key_and_the_upstream_gets_the_key() {
    let (up, proxy) = setup("").await;
    let c = TestClient::default();
    let r = c
        .post(
            &proxy.url("/pay/v1/charges"),
            &[(KEY, "\"sf-string-key\"")],
            "a",
        )
        .await;
    assert_eq!(r.header(KEY), Some("sf-string-key"));
    assert_eq!(r.header("oncegate-action").map(str::len), Some(32));
    assert_eq!(up.received()[0].header(KEY), Some("sf-string-key"));
}

#[tokio::test]
async fn the_key_header_sent_upstream_is_configurable() {
    let up = FakeUpstream::start().await;
    let cfg = config(&up.url(), "key_header = \"X-Request-Key\"\n[[upstreams]]\nname = \"nokey\"\nprefix = \"/nokey\"\nurl = \"URL\"\nkey_header = \"\"")
        .replace("URL", &up.url());
    let proxy = TestProxy::start(&cfg).await;
    let c = TestClient::default();
    c.post(
        &proxy.url("/pay/v1/a"),
        &[("oncegate-task", "t"), ("oncegate-step", "s")],
        "a",
    )
    .await;
    c.post(
        &proxy.url("/nokey/v1/a"),
        &[("oncegate-task", "t"), ("oncegate-step", "s")],
        "a",
    )
    .await;
    let got = up.received();
    assert!(got[0].header("x-request-key").unwrap().starts_with("ts-"));
    assert!(got[1].header("x-request-key").is_none() && got[1].header(KEY).is_none());
}

#[tokio::test]
async fn malformed_and_missing_keys_are_refused() {
    let (up, proxy) = setup(
        "[[upstreams.routes]]\nmethods = [\"POST\"]\npath = \"/v1/refunds\"\nrequire_key = true",
    )
    .await;
    let c = TestClient::default();
    let r = c
        .post(
            &proxy.url("/pay/v1/charges"),
            &[(KEY, &"k".repeat(256))],
            "a",
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), r.problem().as_str()),
        (400, "key-invalid")
    );
    let r = c
        .post(
            &proxy.url("/pay/v1/charges"),
            &[("oncegate-task", "t"), ("oncegate-step", "")],
            "a",
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), r.problem().as_str()),
        (400, "key-invalid")
    );
    let r = c.post(&proxy.url("/pay/v1/refunds"), &[], "a").await;
    assert_eq!(
        (r.status.as_u16(), r.problem().as_str()),
        (400, "key-required")
    );
    assert_eq!(r.json()["retry"], "after-correction");
    assert_eq!(up.count(), 0);
}

#[tokio::test]
async fn a_body_over_max_body_is_refused_before_anything_is_recorded() {
    let up = FakeUpstream::start().await;
    let cfg = config(&up.url(), "").replace("[server]", "[server]\nmax_body = \"1KiB\"");
    let proxy = TestProxy::start(&cfg).await;
    let big = "x".repeat(2048);
    let r = TestClient::default()
        .post(&proxy.url("/pay/v1/files"), &[(KEY, "big")], &big)
        .await;
    assert_eq!(r.status, 413);
    assert_eq!(r.problem(), "body-too-large");
    assert_eq!(up.count(), 0);
    let all = proxy.store.scan(Default::default(), 10).await.unwrap();
    assert!(all.is_empty(), "a refused body left a record");
}

#[tokio::test]
async fn a_response_over_max_stored_response_reaches_the_client_but_is_not_replayed() {
    let up = FakeUpstream::start().await;
    let cfg = config(&up.url(), "").replace("[server]", "[server]\nmax_stored_response = \"1KiB\"");
    let proxy = TestProxy::start(&cfg).await;
    up.set_default(Behavior::Large(100_000));
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/exports");
    let r = c.post(&url, &[(KEY, "exp")], "a").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body.len(), 100_000);
    let r = c.post(&url, &[(KEY, "exp")], "a").await;
    assert_eq!(r.status, 409);
    assert_eq!(r.problem(), "already-applied");
    assert_eq!(r.header("oncegate-outcome"), Some("applied"));
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn a_response_head_over_16_kib_reaches_the_client_but_is_not_replayed() {
    let (up, proxy) = setup("").await;
    let big = "v".repeat(17 * 1024);
    up.push(Behavior::json(201, r#"{"id":"big"}"#).with_header("x-big", &big));
    up.push(Behavior::json(201, r#"{"id":"small"}"#).with_header("x-small", "v"));
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/charges");
    let r = c.post(&url, &[(KEY, "head-big")], "a").await;
    assert_eq!(r.status, 201);
    assert_eq!(r.header("x-big"), Some(big.as_str()));
    let r = c.post(&url, &[(KEY, "head-big")], "a").await;
    assert_eq!(r.status, 409);
    assert_eq!(r.problem(), "already-applied");
    // A head under the bound is replayed, headers included.
    let r = c.post(&url, &[(KEY, "head-small")], "b").await;
    assert_eq!(r.status, 201);
    let r = c.post(&url, &[(KEY, "head-small")], "b").await;
    assert_eq!(r.status, 201);
    assert_eq!(r.header("x-small"), Some("v"));
    assert_eq!(r.header("idempotent-replayed"), Some("true"));
    assert_eq!(up.count(), 2);
}

#[tokio::test]
async fn stored_responses_survive_a_restart_large_ones_included() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let cfg = config(&up.url(), "");
    let big: String = (0..200_000)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    up.push(Behavior::json(201, &big));
    up.push(Behavior::json(201, r#"{"small":true}"#));
    let proxy = TestProxy::start_in(&cfg, &dir).await;
    let c = TestClient::default();
    assert_eq!(
        c.post(&proxy.url("/pay/v1/a"), &[(KEY, "big")], "a")
            .await
            .body,
        big
    );
    c.post(&proxy.url("/pay/v1/a"), &[(KEY, "small")], "a")
        .await;
    proxy.stop().await;
    let proxy = TestProxy::start_in(&cfg, &dir).await;
    let r = c.post(&proxy.url("/pay/v1/a"), &[(KEY, "big")], "a").await;
    assert_eq!(r.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(r.body, big);
    let r = c
        .post(&proxy.url("/pay/v1/a"), &[(KEY, "small")], "a")
        .await;
    assert_eq!(r.body, r#"{"small":true}"#);
    assert_eq!(up.count(), 2);
    assert_eq!(
        std::fs::read_dir(dir.join("bodies")).unwrap().count(),
        1,
        "one large body file"
    );
}

#[tokio::test]
async fn a_store_that_cannot_record_gets_503_and_nothing_is_sent_but_reads_flow() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let inner: Arc<dyn oncegate::store::Store> = Arc::new(
        oncegate::store::sled::SledStore::open(&tmp.path().join("s"), Default::default()).unwrap(),
    );
    let faulty = Arc::new(support::FaultyStore::new(inner));
    faulty
        .fail_claims
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let proxy = TestProxy::start_with_store(&config(&up.url(), ""), faulty, tmp.path()).await;
    let c = TestClient::default();
    let r = c
        .post(&proxy.url("/pay/v1/charges"), &[(KEY, "k")], "a")
        .await;
    assert_eq!(r.status, 503);
    assert_eq!(r.problem(), "store-unavailable");
    assert_eq!(r.json()["duplicate_risk"], false);
    assert_eq!(up.count(), 0);
    assert_eq!(c.get(&proxy.url("/pay/v1/charges")).await.status, 200);
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn a_proxy_killed_mid_attempt_answers_unknown_after_restart_and_never_resends() {
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::Hang);
    let tmp = tempfile::tempdir().unwrap();
    let cfg_path = support::child_config(tmp.path(), &up.url(), "timeout = \"30s\"");
    let proxy = ChildProxy::spawn(&cfg_path);
    let url = proxy.url("/pay/v1/charges");
    let pending = {
        let url = url.clone();
        tokio::spawn(async move {
            let req = http::Request::post(url)
                .header(KEY, "killed")
                .body(http_body_util::Full::new(bytes::Bytes::from_static(
                    b"amount=9",
                )))
                .unwrap();
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http()
                .request(req)
                .await
        })
    };
    up.wait_for(1).await;
    proxy.kill();
    assert!(
        pending.await.unwrap().is_err(),
        "the client saw the connection die"
    );

    let proxy = ChildProxy::spawn(&cfg_path);
    let c = TestClient::default();
    let r = c
        .post(
            &proxy.url("/pay/v1/charges"),
            &[(KEY, "killed")],
            "amount=9",
        )
        .await;
    assert_eq!(r.status, 409);
    assert_eq!(r.problem(), "outcome-unknown");
    let p = r.json();
    let tries = p["evidence"][0]["tries"].as_array().unwrap();
    assert!(
        tries
            .iter()
            .any(|t| t["error"].as_str().unwrap_or("").contains("proxy stopped")),
        "{p}"
    );
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn problems_carry_the_sdk_error_member_and_say_whether_an_sdk_may_retry() {
    let (up, proxy) = setup("timeout = \"1s\"\nmax_attempts = 1").await;
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/charges");
    let no_retry = |r: &support::Resp| {
        (
            r.header("x-should-retry").map(str::to_string),
            r.header("stripe-should-retry").map(str::to_string),
        )
    };
    let never = (Some("false".to_string()), Some("false".to_string()));
    // outcome-unknown: the SDK shows oncegate's words and does not retry.
    up.push(Behavior::Hang);
    let r = c.post(&url, &[(KEY, "u1")], "a").await;
    assert_eq!(r.problem(), "outcome-unknown");
    let p = r.json();
    assert_eq!(p["error"]["type"], "oncegate_error");
    assert_eq!(p["error"]["code"], "outcome-unknown");
    assert_eq!(
        p["error"]["message"].as_str().unwrap(),
        format!("Outcome unknown: {}", p["next_step"].as_str().unwrap())
    );
    assert_eq!(no_retry(&r), never);
    // An upstream 500 that left the write unknown is forwarded, and marked the same way.
    up.push(Behavior::json(500, r#"{"error":"boom"}"#));
    let r = c.post(&url, &[(KEY, "u2")], "a2").await;
    assert_eq!(
        (r.status.as_u16(), r.header("oncegate-outcome")),
        (500, Some("unknown"))
    );
    assert_eq!(r.body, r#"{"error":"boom"}"#);
    assert_eq!(no_retry(&r), never);
    // attempts-exhausted and key-reused: a retry cannot help.
    up.push(Behavior::status(422));
    c.post(&url, &[(KEY, "u3")], "a3").await;
    let r = c.post(&url, &[(KEY, "u3")], "a3").await;
    assert_eq!(r.problem(), "attempts-exhausted");
    assert_eq!(no_retry(&r), never);
    let r = c.post(&url, &[(KEY, "u3")], "b").await;
    assert_eq!(r.problem(), "key-reused");
    assert_eq!(no_retry(&r), never);
    // possible-duplicate: the same write under another key while the first is unknown.
    let r = c.post(&url, &[(KEY, "u5")], "a").await;
    assert_eq!(r.problem(), "possible-duplicate");
    assert_eq!(no_retry(&r), never);
    // in-flight: the SDK may come back later (with Retry-After).
    let gate = Arc::new(Notify::new());
    up.push(Behavior::Gate(
        gate.clone(),
        Box::new(Behavior::json(201, "{}")),
    ));
    let first = {
        let url = url.clone();
        tokio::spawn(async move { TestClient::default().post(&url, &[(KEY, "u4")], "a4").await })
    };
    up.wait_for(4).await;
    let r = c.post(&url, &[(KEY, "u4")], "a4").await;
    assert_eq!(r.problem(), "in-flight");
    assert_eq!(no_retry(&r), (None, None));
    assert!(r.header("retry-after").is_some());
    gate.notify_one();
    first.await.unwrap();
}

#[tokio::test]
async fn json_writes_that_differ_only_past_float_precision_or_by_a_duplicate_key_are_two_actions() {
    let (up, proxy) = setup("").await;
    up.set_default(Behavior::json(201, r#"{"ok":true}"#));
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/transfers");
    let json = [("content-type", "application/json")];
    for (a, b) in [
        (
            r#"{"amount":18446744073709551616}"#,
            r#"{"amount":18446744073709551617}"#,
        ),
        (
            r#"{"rate":0.1000000000000000001}"#,
            r#"{"rate":0.1000000000000000002}"#,
        ),
        (
            r#"{"to":"alice","to":"bob"}"#,
            r#"{"to":"bob","to":"alice"}"#,
        ),
    ] {
        let before = up.count();
        let ra = c.post(&url, &json, a).await;
        let rb = c.post(&url, &json, b).await;
        assert_eq!(ra.header("oncegate-outcome"), Some("sent"), "{a}");
        assert_eq!(
            rb.header("oncegate-outcome"),
            Some("sent"),
            "{b} is a different write"
        );
        assert_ne!(ra.header("oncegate-action"), rb.header("oncegate-action"));
        assert_eq!(up.count(), before + 2);
    }
    // The same write with its keys reordered and spaced differently is one action.
    let r1 = c.post(&url, &json, r#"{"a":1,"b":[1,2]}"#).await;
    let r2 = c.post(&url, &json, r#"{ "b": [1, 2], "a": 1 }"#).await;
    assert_eq!(r2.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(r1.header("oncegate-action"), r2.header("oncegate-action"));
}

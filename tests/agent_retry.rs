//! The agent's own retry (SPEC §4.1): a tool loop that, after an error, calls the same write
//! again as a new SDK call, often under a new SDK-drawn `Idempotency-Key`. Each test drives the
//! real proxy against a counting upstream and checks how many times the write reached it.
#![allow(clippy::unwrap_used)]

mod support;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use support::{config, Behavior, FakeUpstream, TestClient, TestProxy};
use tokio::sync::Notify;

const KEY: &str = "idempotency-key";
const CHARGE: &str = r#"{"amount":4200,"currency":"eur"}"#;

async fn setup(extra: &str) -> (FakeUpstream, TestProxy) {
    let up = FakeUpstream::start().await;
    let proxy = TestProxy::start(&config(&up.url(), extra)).await;
    (up, proxy)
}

fn json_with(key: &str) -> Vec<(&'static str, String)> {
    vec![
        ("content-type", "application/json".into()),
        (KEY, key.to_string()),
    ]
}

async fn post(proxy: &TestProxy, headers: &[(&str, String)]) -> support::Resp {
    let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    TestClient::default()
        .post(&proxy.url("/pay/v1/charges"), &h, CHARGE)
        .await
}

/// The charge that timed out: the upstream applied it and never answered.
async fn lost_charge(up: &FakeUpstream, proxy: &TestProxy, headers: &[(&str, String)]) -> String {
    up.push(Behavior::Hang);
    let r = post(proxy, headers).await;
    assert_eq!(r.status, 504, "{r:?}");
    assert_eq!(r.problem(), "outcome-unknown");
    r.header("oncegate-action").unwrap().to_string()
}

#[tokio::test]
async fn task_and_step_outrank_a_new_sdk_key_and_the_upstream_sees_the_proxys_key() {
    let (up, proxy) = setup("timeout = \"300ms\"").await;
    let step = |key: &str| {
        let mut h = json_with(key);
        h.push(("oncegate-task", "onboard-42".into()));
        h.push(("oncegate-step", "charge".into()));
        h
    };
    let id = lost_charge(&up, &proxy, &step("sdk-key-1")).await;
    // The agent's tool loop calls again; its SDK draws a new key.
    up.set_default(Behavior::json(200, r#"{"id":"ch_2"}"#));
    let r = post(&proxy, &step("sdk-key-2")).await;
    assert_eq!(r.status, 409, "{r:?}");
    assert_eq!(r.problem(), "outcome-unknown");
    assert_eq!(r.header("oncegate-action"), Some(id.as_str()));
    assert_eq!(up.count_method("POST"), 1, "one charge");
    // Upstream, the key is the step's, not the SDK's: its own idempotency protects it too.
    let sent = &up.received()[0];
    let key = sent.header(KEY).unwrap();
    assert!(key.starts_with("ts-"), "{key}");
    // The SDK's key is kept as evidence.
    let a = proxy
        .admin("GET", &format!("/v1/actions/{id}"), "")
        .await
        .json();
    assert_eq!(a["client_key"], "sdk-key-1", "{a}");
}

#[tokio::test]
async fn per_call_keys_make_a_repeated_call_the_same_action() {
    let (up, proxy) = setup("timeout = \"300ms\"\nclient_keys = \"per-call\"").await;
    let id = lost_charge(&up, &proxy, &json_with("sdk-1")).await;
    up.set_default(Behavior::json(200, r#"{"id":"ch_2"}"#));
    for n in 2..6 {
        let r = post(&proxy, &json_with(&format!("sdk-{n}"))).await;
        assert_eq!(r.problem(), "outcome-unknown", "{r:?}");
        assert_eq!(r.header("oncegate-action"), Some(id.as_str()));
    }
    assert_eq!(up.count_method("POST"), 1, "one charge");
    let key = up.received()[0].header(KEY).unwrap().to_string();
    assert!(
        key.starts_with("fp-"),
        "the proxy's key replaces the SDK's: {key}"
    );
    // Settled as not applied: the next call sends again, under the same key.
    proxy
        .admin(
            "POST",
            &format!("/v1/actions/{id}/resolve"),
            r#"{"outcome":"not-applied","reason":"absent at the service"}"#,
        )
        .await;
    let r = post(&proxy, &json_with("sdk-9")).await;
    assert_eq!(r.status, 200);
    assert_eq!(up.count_method("POST"), 2);
    assert_eq!(up.received()[1].header(KEY), Some(key.as_str()));
    // And once it succeeded, a new SDK call gets its answer.
    let r = post(&proxy, &json_with("sdk-10")).await;
    assert_eq!(r.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(up.count_method("POST"), 2);
}

#[tokio::test]
async fn with_stable_keys_the_twin_guard_stops_a_new_key_while_the_first_is_unknown() {
    let (up, proxy) = setup("timeout = \"300ms\"").await;
    let id = lost_charge(&up, &proxy, &json_with("sdk-1")).await;
    up.set_default(Behavior::json(200, r#"{"id":"ch_2"}"#));
    let r = post(&proxy, &json_with("sdk-2")).await;
    assert_eq!(r.status, 409, "{r:?}");
    assert_eq!(r.problem(), "possible-duplicate");
    assert_eq!(r.header("x-should-retry"), Some("false"));
    assert_eq!(r.header("stripe-should-retry"), Some("false"));
    let p = r.json();
    assert_eq!(p["action"]["id"], id.as_str(), "it names the first: {p}");
    assert_eq!(p["action"]["state"], "unknown");
    assert_eq!(p["duplicate_risk"], true);
    let message = p["error"]["message"].as_str().unwrap();
    assert!(message.contains("POST /v1/charges"), "{message}");
    assert!(
        message.contains(&format!("Oncegate-Allow-Twin: {id}")),
        "{message}"
    );
    assert!(!message.contains("admin"), "{message}");
    assert!(p["detail"].as_str().unwrap().contains("/lookup"), "{p}");
    assert_eq!(up.count_method("POST"), 1, "one charge");
    // The refusal is in the write log, against the action it protected.
    let log = proxy.admin("GET", "/v1/log?after=0&limit=1000", "").await;
    let log = String::from_utf8_lossy(&log.body);
    assert!(
        log.lines().any(|l| l.contains(r#""event":"conflict""#)
            && l.contains("possible-duplicate")
            && l.contains(&id)),
        "{log}"
    );
    // An agent that truly means a second, identical charge says so.
    let mut twin = json_with("sdk-3");
    twin.push(("oncegate-allow-twin", id.clone()));
    let r = post(&proxy, &twin).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(up.count_method("POST"), 2);
    // Once the first is settled, a new key is a new write again.
    proxy
        .admin(
            "POST",
            &format!("/v1/actions/{id}/resolve"),
            r#"{"outcome":"applied","reason":"seen in the dashboard"}"#,
        )
        .await;
    let r = post(&proxy, &json_with("sdk-4")).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(up.count_method("POST"), 3);
}

#[tokio::test]
async fn the_twin_guard_stops_a_new_key_while_the_first_is_in_flight() {
    let (up, proxy) = setup("timeout = \"5s\"").await;
    let gate = Arc::new(Notify::new());
    up.push(Behavior::Gate(
        gate.clone(),
        Box::new(Behavior::json(200, r#"{"id":"ch_1"}"#)),
    ));
    let first = {
        let url = proxy.url("/pay/v1/charges");
        tokio::spawn(async move {
            TestClient::default()
                .post(
                    &url,
                    &[("content-type", "application/json"), (KEY, "sdk-1")],
                    CHARGE,
                )
                .await
        })
    };
    up.wait_for(1).await;
    let r = post(&proxy, &json_with("sdk-2")).await;
    assert_eq!(r.problem(), "possible-duplicate", "{r:?}");
    assert_eq!(r.json()["action"]["state"], "in_flight");
    // A different charge is not a twin.
    let r = TestClient::default()
        .post(
            &proxy.url("/pay/v1/charges"),
            &[("content-type", "application/json"), (KEY, "sdk-3")],
            r#"{"amount":100,"currency":"eur"}"#,
        )
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    gate.notify_one();
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(up.count_method("POST"), 2);
}

#[tokio::test]
async fn twin_guard_off_lets_identical_writes_under_distinct_keys_through() {
    let (up, proxy) = setup("timeout = \"300ms\"\ntwin_guard = false").await;
    lost_charge(&up, &proxy, &json_with("event-1")).await;
    up.set_default(Behavior::json(202, "{}"));
    let r = post(&proxy, &json_with("event-2")).await;
    assert_eq!(r.status, 202, "{r:?}");
    assert_eq!(up.count_method("POST"), 2);
}

#[tokio::test]
async fn an_identical_keyless_write_is_new_after_the_fingerprint_window_and_a_replay_says_so() {
    let up = FakeUpstream::start().await;
    let (now, clock) = support::controlled_clock();
    let proxy = TestProxy::start_fresh(
        oncegate::config::Config::parse(&config(&up.url(), "fingerprint_window = \"1h\"")).unwrap(),
        Some(support::ADMIN_TOKEN.to_string()),
        clock,
    )
    .await;
    up.set_default(Behavior::json(200, r#"{"id":"batch_1"}"#));
    let url = proxy.url("/pay/v1/reports");
    let report = || async {
        TestClient::default()
            .post(
                &url,
                &[("content-type", "application/json")],
                r#"{"report":"daily"}"#,
            )
            .await
    };
    assert_eq!(report().await.status, 200);
    now.fetch_add(59 * 60_000, Ordering::SeqCst);
    let r = report().await;
    assert_eq!(r.header("oncegate-outcome"), Some("replayed"));
    let detail = r.header("oncegate-detail").unwrap();
    assert!(
        detail.contains("first sent 2027-01-15T08:00:00") && detail.contains("new Idempotency-Key"),
        "{detail}"
    );
    assert_eq!(up.count_method("POST"), 1);
    // An hour after it settled: the same report again is a new write.
    now.fetch_add(60_000, Ordering::SeqCst);
    let r = report().await;
    assert_eq!(r.header("oncegate-outcome"), Some("sent"), "{r:?}");
    assert_eq!(up.count_method("POST"), 2);
}

#[tokio::test]
async fn the_unknown_answer_tells_the_model_what_to_do_and_the_operator_how_to_settle() {
    let (up, proxy) = setup("timeout = \"300ms\"").await;
    up.push(Behavior::Hang);
    let r = post(&proxy, &json_with("k")).await;
    let p = r.json();
    let message = p["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("Outcome unknown: The request POST /v1/charges may have been applied"),
        "{message}"
    );
    assert!(
        message.contains("Send the same request again later"),
        "{message}"
    );
    for word in ["key", "admin", "/v1/actions"] {
        assert!(!message.contains(word), "{word} in {message}");
    }
    let detail = p["detail"].as_str().unwrap();
    assert!(
        detail.contains("/lookup") && detail.contains("resolve"),
        "{detail}"
    );
}

//! A full disk under the embedded store: files stop growing mid-run (`ulimit -f`: a write past
//! the limit fails with EFBIG, as with ENOSPC). SPEC §5: a claim the store cannot make durable
//! is answered 503 `store-unavailable` and nothing is sent. What was answered stays true after a
//! restart with room again, the write log verifies, and no write reaches the upstream twice.
#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashMap;

use support::{child_config, Behavior, ChildProxy, FakeUpstream, TestClient};

const KEY: &str = "idempotency-key";

/// How the first answer to a key went.
#[derive(Debug, Clone, Copy, PartialEq)]
enum First {
    Sent,
    /// 503 `store-unavailable`, `duplicate_risk: false`: nothing was sent.
    NotSent,
    /// 503 `store-unavailable`, `duplicate_risk: true`: sent, its outcome not recorded.
    Unrecorded,
}

#[tokio::test]
async fn a_full_disk_stops_writes_before_they_leave_and_a_restart_keeps_every_answer() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let conf = child_config(tmp.path(), &up.url(), "");
    let c = TestClient::default();
    // A body of its own for each key: identical ones under distinct keys would be twins.
    let body = |key: &str| format!("{key}:{}", "x".repeat(2_000));
    up.set_default(Behavior::json(201, r#"{"id":"ch_1"}"#));

    let proxy = ChildProxy::spawn_with_file_limit(&conf, 4_096);
    let mut first: HashMap<String, First> = HashMap::new();
    let mut refused = 0;
    for i in 0..5_000 {
        let key = format!("disk-{i}");
        let r = c
            .post(&proxy.url("/pay/v1/charges"), &[(KEY, &key)], &body(&key))
            .await;
        let how = match r.status.as_u16() {
            201 => First::Sent,
            503 => {
                assert_eq!(r.problem(), "store-unavailable", "{r:?}");
                if r.json()["duplicate_risk"] == true {
                    First::Unrecorded
                } else {
                    First::NotSent
                }
            }
            _ => panic!("unexpected answer: {r:?}"),
        };
        if how == First::NotSent {
            assert_eq!(up.count_key(KEY, &key), 0, "{key} was refused but sent");
            refused += 1;
        }
        first.insert(key, how);
        if refused == 20 {
            break;
        }
    }
    let sent = first.values().filter(|h| **h == First::Sent).count();
    assert!(
        sent > 0,
        "no write went through before the disk filled: {}",
        proxy.stderr.lock().unwrap()
    );
    assert_eq!(refused, 20, "the disk never filled: {first:?}");
    // Reads do not need the store.
    assert_eq!(c.get(&proxy.url("/pay/v1/charges")).await.status, 201);
    let log = proxy.stderr.lock().unwrap().clone();
    let failure = log
        .lines()
        .find(|l| l.contains("store failed"))
        .unwrap_or_else(|| panic!("{log}"));
    assert_eq!(log.matches("store failed").count(), 1, "logged once: {log}");
    println!(
        "full disk: {sent} sent, {} sent but unrecorded, {refused} refused; {}",
        first.values().filter(|h| **h == First::Unrecorded).count(),
        &failure[failure.find("error=").unwrap_or(0)..]
    );
    proxy.kill();

    // Room again: every key retried.
    let proxy = ChildProxy::spawn(&conf);
    let verify = proxy.admin("GET", "/v1/log/verify", "").await;
    assert_eq!(verify.json()["ok"], true, "{verify:?}");
    for (key, how) in &first {
        let r = c
            .post(&proxy.url("/pay/v1/charges"), &[(KEY, key)], &body(key))
            .await;
        match how {
            First::Sent => {
                assert_eq!(r.status, 201, "{key}: {r:?}");
                assert_eq!(r.header("oncegate-outcome"), Some("replayed"), "{key}");
            }
            First::Unrecorded => assert_eq!(r.problem(), "outcome-unknown", "{key}"),
            // Its claim may have reached the disk whole before the write that failed: then it
            // is unknown now (conservatively), else it is sent now, once.
            First::NotSent => assert!(
                r.status == 201 || r.problem() == "outcome-unknown",
                "{key}: {r:?}"
            ),
        }
        assert!(
            up.count_key(KEY, key) <= 1,
            "{key} reached the upstream twice"
        );
    }
    let sent_now = first
        .keys()
        .filter(|k| first[*k] == First::NotSent && up.count_key(KEY, k) == 1)
        .count();
    println!("after the restart: {sent_now} of the {refused} refused writes sent, once");
    proxy.terminate();
}

/// The disk guard (issue 59): while the store's volume has less free space than
/// `store.reserve`, a new write is refused before it is recorded (503 `store-full`, nothing
/// sent, nothing that says it may have happened), reads go on, and `/readyz` says why. Here the
/// reserve is more than any volume holds.
#[tokio::test]
async fn a_volume_below_the_reserve_refuses_new_writes_unsent_and_is_not_ready() {
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json(201, r#"{"id":"ch_1"}"#));
    let tmp = tempfile::tempdir().unwrap();
    let conf = child_config(tmp.path(), &up.url(), "");
    let text = std::fs::read_to_string(&conf).unwrap();
    std::fs::write(
        &conf,
        text.replacen("[store]\n", "[store]\nreserve = \"100000000GiB\"\n", 1),
    )
    .unwrap();
    let proxy = ChildProxy::spawn(&conf);
    let c = TestClient::default();
    let r = c
        .post(
            &proxy.url("/pay/v1/charges"),
            &[(KEY, "full-1")],
            "amount=5",
        )
        .await;
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.problem(), "store-full");
    assert_eq!(r.json()["duplicate_risk"], false);
    assert_eq!(r.header("oncegate-outcome"), Some("rejected"));
    // The error body does not say where the store is.
    assert!(
        !String::from_utf8_lossy(&r.body).contains(&tmp.path().display().to_string()),
        "{r:?}"
    );
    assert_eq!(up.count(), 0, "nothing was sent");
    let read = c.get(&proxy.url("/pay/v1/charges/ch_1")).await;
    assert_eq!(read.status, 201, "reads go on: {read:?}");
    let ready = c.get(&format!("http://{}/readyz", proxy.admin)).await;
    assert_eq!(ready.status, 503, "{ready:?}");
    assert!(
        String::from_utf8_lossy(&ready.body).contains("store.reserve"),
        "{ready:?}"
    );
}

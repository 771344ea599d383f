//! Faults around the write path: retention and expiry on a controlled clock, graceful drain,
//! and a store that fails in the middle of an attempt.
#![allow(clippy::unwrap_used)]

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::{config, Behavior, FakeUpstream, FaultyStore, TestClient, TestProxy};
use tokio::sync::Notify;

const KEY: &str = "idempotency-key";
const HOUR: u64 = 3600 * 1000;

fn sled(dir: &std::path::Path) -> Arc<dyn oncegate::store::Store> {
    Arc::new(oncegate::store::sled::SledStore::open(dir, Default::default()).unwrap())
}

/// A clock the test moves by hand, starting at T0 = 1_800_000_000_000 ms.
/// A proxy on `store` whose clock the test moves (`now`, in ms), with `defaults` for the upstream.
async fn on_controlled_clock(
    up: &FakeUpstream,
    defaults: &str,
    store: Arc<dyn oncegate::store::Store>,
    dir: &std::path::Path,
) -> (Arc<AtomicU64>, TestProxy) {
    let (now, clock) = support::controlled_clock();
    let proxy = TestProxy::start_with_clock(&config(&up.url(), defaults), store, dir, clock).await;
    (now, proxy)
}

#[tokio::test]
async fn records_expire_retention_after_their_last_change_and_the_key_becomes_new() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let store = sled(&tmp.path().join("s"));
    let (now, proxy) =
        on_controlled_clock(&up, "retention = \"2h\"", store.clone(), tmp.path()).await;
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/charges");
    up.push(Behavior::json(201, r#"{"n":1}"#));
    c.post(&url, &[(KEY, "k-exp")], "a").await;
    // Within retention: a replay, which does not change the record.
    now.fetch_add(HOUR, Ordering::SeqCst);
    assert_eq!(
        c.post(&url, &[(KEY, "k-exp")], "a")
            .await
            .header("oncegate-outcome"),
        Some("replayed")
    );
    // The sweeper at 1h59m after the last change keeps it; at 2h it deletes it.
    assert_eq!(
        store
            .expire(1_800_000_000_000 + 2 * HOUR - 1)
            .await
            .unwrap(),
        0
    );
    assert_eq!(store.expire(1_800_000_000_000 + 2 * HOUR).await.unwrap(), 1);
    // After expiry the same key is a new action.
    now.store(1_800_000_000_000 + 2 * HOUR, Ordering::SeqCst);
    up.push(Behavior::json(201, r#"{"n":2}"#));
    let r = c.post(&url, &[(KEY, "k-exp")], "a").await;
    assert_eq!(r.header("oncegate-outcome"), Some("sent"));
    assert_eq!(r.body, r#"{"n":2}"#);
    assert_eq!(up.count(), 2);
}

#[tokio::test]
async fn an_expired_record_is_a_new_action_even_before_the_sweeper_runs() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let (now, proxy) = on_controlled_clock(
        &up,
        "retention = \"1h\"\nmax_attempts = 1",
        sled(&tmp.path().join("s")),
        tmp.path(),
    )
    .await;
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/charges");
    up.push(Behavior::status(400));
    c.post(&url, &[(KEY, "k")], "a").await;
    assert_eq!(
        c.post(&url, &[(KEY, "k")], "a").await.problem(),
        "attempts-exhausted"
    );
    now.fetch_add(HOUR, Ordering::SeqCst);
    let r = c.post(&url, &[(KEY, "k")], "a").await;
    assert_eq!(r.status, 200);
    assert_eq!(up.count(), 2);
}

#[tokio::test]
async fn an_unknown_action_is_not_forgotten_before_its_retention() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let store = sled(&tmp.path().join("s"));
    let proxy = TestProxy::start_with_store(
        &config(&up.url(), "timeout = \"200ms\"\nretention = \"1h\""),
        store.clone(),
        tmp.path(),
    )
    .await;
    up.push(Behavior::Hang);
    let c = TestClient::default();
    c.post(&proxy.url("/pay/v1/c"), &[(KEY, "u")], "a").await;
    let now = oncegate::action::now_millis();
    assert_eq!(store.expire(now + HOUR / 2).await.unwrap(), 0);
    assert_eq!(
        c.post(&proxy.url("/pay/v1/c"), &[(KEY, "u")], "a")
            .await
            .problem(),
        "outcome-unknown"
    );
}

/// Every store a test should hold for: sled, and PostgreSQL when a server is configured (judging
/// time by the proxy's controlled clock, as `caller_clock` allows).
async fn every_store() -> Vec<(
    &'static str,
    Arc<dyn oncegate::store::Store>,
    tempfile::TempDir,
)> {
    let tmp = tempfile::tempdir().unwrap();
    let mut stores = vec![("sled", sled(&tmp.path().join("s")), tmp)];
    if let Some(base) = support::postgres_url_if_set() {
        let url = support::fresh_database(&base).await;
        let options = oncegate::store::StoreOptions {
            caller_clock: true,
            ..Default::default()
        };
        let pg = oncegate::store::postgres::PostgresStore::open(&url, options)
            .await
            .unwrap();
        stores.push(("postgres", Arc::new(pg), tempfile::tempdir().unwrap()));
    }
    stores
}

#[tokio::test]
async fn a_retry_after_retention_while_the_first_attempt_runs_is_not_sent() {
    // retention 2s, timeout 10s; the upstream holds the write for longer than the retention and
    // the agent retries at 3s: records are never released while in flight (SPEC §5, §13).
    for (name, store, tmp) in every_store().await {
        let up = FakeUpstream::start().await;
        let (now, proxy) = on_controlled_clock(
            &up,
            "retention = \"2s\"\ntimeout = \"10s\"",
            store.clone(),
            tmp.path(),
        )
        .await;
        let gate = Arc::new(Notify::new());
        up.push(Behavior::Gate(
            gate.clone(),
            Box::new(Behavior::json(201, r#"{"id":"ch_1"}"#)),
        ));
        let url = proxy.url("/pay/v1/charges");
        let first = {
            let url = url.clone();
            tokio::spawn(async move { TestClient::default().post(&url, &[(KEY, "K")], "a").await })
        };
        up.wait_for(1).await;
        now.fetch_add(3_000, Ordering::SeqCst);
        assert_eq!(
            store.expire(now.load(Ordering::SeqCst)).await.unwrap(),
            0,
            "{name}"
        );
        let r = TestClient::default().post(&url, &[(KEY, "K")], "a").await;
        assert_eq!(r.problem(), "in-flight", "{name}: {:?}", r.body);
        assert_eq!(up.count(), 1, "{name}: the retry was not sent");
        gate.notify_one();
        assert_eq!(first.await.unwrap().status, 201, "{name}");
        // Retention counts from the settlement: 1.9s after it, still a replay.
        now.fetch_add(1_900, Ordering::SeqCst);
        let r = TestClient::default().post(&url, &[(KEY, "K")], "a").await;
        assert_eq!(r.header("oncegate-outcome"), Some("replayed"), "{name}");
        assert_eq!(up.count(), 1, "{name}");
        proxy.stop().await;
    }
}

#[tokio::test]
async fn an_unknown_action_is_never_released_by_expiry() {
    for (name, store, tmp) in every_store().await {
        let up = FakeUpstream::start().await;
        let (now, proxy) = on_controlled_clock(
            &up,
            "timeout = \"200ms\"\nretention = \"1h\"",
            store.clone(),
            tmp.path(),
        )
        .await;
        up.push(Behavior::Hang);
        let c = TestClient::default();
        let url = proxy.url("/pay/v1/c");
        assert_eq!(
            c.post(&url, &[(KEY, "u")], "a").await.problem(),
            "outcome-unknown"
        );
        // A day later, past any retention: the sweeper keeps it, and a retry is not sent.
        now.fetch_add(24 * HOUR, Ordering::SeqCst);
        assert_eq!(
            store.expire(now.load(Ordering::SeqCst)).await.unwrap(),
            0,
            "{name}"
        );
        let r = c.post(&url, &[(KEY, "u")], "a").await;
        assert_eq!(r.problem(), "outcome-unknown", "{name}");
        assert_eq!(up.count(), 1, "{name}");
        let id = r.header("oncegate-action").unwrap().to_string();
        // Settled by an operator, it expires retention after the settlement.
        let done = proxy
            .admin(
                "POST",
                &format!("/v1/actions/{id}/resolve"),
                r#"{"outcome":"applied","reason":"seen in the dashboard"}"#,
            )
            .await;
        assert_eq!(done.status, 200, "{name}: {:?}", done.body);
        let t = now.load(Ordering::SeqCst);
        assert_eq!(store.expire(t + HOUR - 1).await.unwrap(), 0, "{name}");
        assert_eq!(store.expire(t + HOUR).await.unwrap(), 1, "{name}");
        proxy.stop().await;
    }
}

#[tokio::test]
async fn a_drain_lets_running_attempts_finish_and_records_them() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let cfg = config(&up.url(), "timeout = \"10s\"");
    let proxy = TestProxy::start_in(&cfg, &dir).await;
    let gate = Arc::new(Notify::new());
    up.push(Behavior::Gate(
        gate.clone(),
        Box::new(Behavior::json(201, r#"{"done":true}"#)),
    ));
    let url = proxy.url("/pay/v1/c");
    let client = tokio::spawn(async move {
        TestClient::default()
            .post(&url, &[(KEY, "drain-1")], "a")
            .await
    });
    up.wait_for(1).await;
    let stopping = tokio::spawn(proxy.stop());
    gate.notify_one();
    let r = client.await.unwrap();
    assert_eq!(r.status, 201);
    stopping.await.unwrap();
    let proxy = TestProxy::start_in(&cfg, &dir).await;
    let r = TestClient::default()
        .post(&proxy.url("/pay/v1/c"), &[(KEY, "drain-1")], "a")
        .await;
    assert_eq!(r.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn attempts_still_running_at_the_drain_deadline_are_recorded_unknown() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let cfg = config(&up.url(), "timeout = \"30s\"")
        .replace("drain_timeout = \"5s\"", "drain_timeout = \"300ms\"");
    let store = sled(&dir);
    let proxy = TestProxy::start_with_store(&cfg, store.clone(), tmp.path()).await;
    up.push(Behavior::Hang);
    let url = proxy.url("/pay/v1/c");
    let client = tokio::spawn(async move {
        TestClient::default()
            .post(&url, &[(KEY, "stuck")], "a")
            .await
    });
    up.wait_for(1).await;
    tokio::time::timeout(Duration::from_secs(10), proxy.stop())
        .await
        .expect("the drain is bounded by drain_timeout");
    // The client is told, not dropped: its write may have been applied.
    let r = client.await.unwrap();
    assert_eq!(r.status, 504, "{:?}", r.body);
    assert_eq!(r.problem(), "outcome-unknown");
    assert_eq!(r.json()["duplicate_risk"], true);
    // Read what the stopped proxy left behind, before any restart recovery.
    let store = sled(&dir);
    let all = store.scan(Default::default(), 10).await.unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].state, oncegate::action::State::Unknown);
    let why = all[0].evidence[0]
        .tries
        .last()
        .unwrap()
        .error
        .clone()
        .unwrap();
    assert!(why.contains("drain_timeout"), "{why}");
    store.close().await.unwrap();
}

#[tokio::test]
async fn a_store_that_fails_after_sending_never_answers_success_and_the_action_is_unknown_later() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let faulty = Arc::new(FaultyStore::new(sled(&dir)));
    let cfg = config(&up.url(), "");
    let proxy = TestProxy::start_with_store(&cfg, faulty.clone(), tmp.path()).await;
    up.push(Behavior::json(201, r#"{"id":"x"}"#));
    faulty.fail_settles.store(true, Ordering::SeqCst);
    let c = TestClient::default();
    let r = c.post(&proxy.url("/pay/v1/c"), &[(KEY, "sf")], "a").await;
    assert_eq!(r.status, 503);
    assert_eq!(r.problem(), "store-unavailable");
    let p = r.json();
    assert_eq!(p["outcome"], "unknown");
    assert_eq!(p["duplicate_risk"], true);
    assert_eq!(up.count(), 1);
    faulty.fail_settles.store(false, Ordering::SeqCst);
    proxy.stop().await;
    // The claim was durable: after a restart the action is unknown, never re-sent.
    let proxy = TestProxy::start_in(&cfg, &dir).await;
    let r = c.post(&proxy.url("/pay/v1/c"), &[(KEY, "sf")], "a").await;
    assert_eq!(r.problem(), "outcome-unknown");
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn the_drain_deadline_runs_from_the_shutdown_not_from_the_start() {
    // drain_timeout 1s, and a proxy up for longer than that: a write that needs 300 ms when the
    // shutdown comes still gets its whole drain, and its answer.
    let up = FakeUpstream::start().await;
    let cfg = config(&up.url(), "timeout = \"10s\"")
        .replace("drain_timeout = \"5s\"", "drain_timeout = \"1s\"");
    let proxy = TestProxy::start(&cfg).await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    up.push(Behavior::Delay(
        Duration::from_millis(300),
        Box::new(Behavior::json(201, r#"{"id":"late"}"#)),
    ));
    let url = proxy.url("/pay/v1/c");
    let client = tokio::spawn(async move {
        TestClient::default()
            .post(&url, &[(KEY, "drain-late")], "a")
            .await
    });
    up.wait_for(1).await;
    let store = proxy.store.clone();
    proxy.stop().await;
    let r = client.await.unwrap();
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(r.header("oncegate-outcome"), Some("sent"));
    let all = store.scan(Default::default(), 10).await;
    // The store is closed after the stop; what matters is what the client heard.
    drop(all);
}

#[tokio::test]
async fn an_outcome_is_recorded_through_a_store_outage_longer_than_a_database_restart() {
    // A PostgreSQL restart takes seconds; the outcome is known and must not become unknown.
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let faulty = Arc::new(FaultyStore::new(sled(&tmp.path().join("s"))));
    let proxy =
        TestProxy::start_with_store(&config(&up.url(), ""), faulty.clone(), tmp.path()).await;
    up.push(Behavior::json(201, r#"{"id":"ch_r"}"#));
    faulty.away_settles.store(true, Ordering::SeqCst);
    let back = {
        let faulty = faulty.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(2_500)).await;
            faulty.away_settles.store(false, Ordering::SeqCst);
        })
    };
    let c = TestClient::default();
    let r = c
        .post(&proxy.url("/pay/v1/c"), &[(KEY, "restart")], "a")
        .await;
    back.await.unwrap();
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(r.header("oncegate-outcome"), Some("sent"));
    let again = c
        .post(&proxy.url("/pay/v1/c"), &[(KEY, "restart")], "a")
        .await;
    assert_eq!(again.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn a_replay_whose_body_cannot_be_read_now_asks_to_come_back_not_already_applied() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let faulty = Arc::new(FaultyStore::new(sled(&tmp.path().join("s"))));
    let proxy =
        TestProxy::start_with_store(&config(&up.url(), ""), faulty.clone(), tmp.path()).await;
    up.push(Behavior::json(201, r#"{"id":"ch_b"}"#));
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/c");
    assert_eq!(c.post(&url, &[(KEY, "body")], "a").await.status, 201);
    faulty.away_bodies.store(true, Ordering::SeqCst);
    let r = c.post(&url, &[(KEY, "body")], "a").await;
    assert_eq!(r.status, 503, "{:?}", r.body);
    assert_eq!(r.problem(), "store-unavailable");
    assert_eq!(r.json()["duplicate_risk"], false);
    faulty.away_bodies.store(false, Ordering::SeqCst);
    let r = c.post(&url, &[(KEY, "body")], "a").await;
    assert_eq!(r.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(r.body, r#"{"id":"ch_b"}"#);
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn an_attempt_that_panics_is_unknown_and_says_it_may_have_been_applied() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let faulty = Arc::new(FaultyStore::new(sled(&tmp.path().join("s"))));
    let proxy =
        TestProxy::start_with_store(&config(&up.url(), ""), faulty.clone(), tmp.path()).await;
    up.push(Behavior::json(201, r#"{"id":"ch_p"}"#));
    faulty.panic_settles.store(true, Ordering::SeqCst);
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/c");
    let r = c.post(&url, &[(KEY, "panic")], "a").await;
    assert_eq!(r.status, 504, "{:?}", r.body);
    assert_eq!(r.problem(), "outcome-unknown");
    assert_eq!(r.json()["duplicate_risk"], true);
    assert_eq!(r.json()["action"]["state"], "unknown");
    // A retry is not sent: the write reached the upstream.
    let r = c.post(&url, &[(KEY, "panic")], "a").await;
    assert_eq!(r.problem(), "outcome-unknown");
    assert_eq!(up.count(), 1);
}

/// The evidence a panic leaves: what the panic said, in the same words whether the action ran in
/// the request's task (an HTTP write) or in a task of its own (an MCP call, whose answer may
/// stream): `panicked: …`, not the runtime's `task 12 panicked with message …`.
#[tokio::test]
async fn a_panic_is_recorded_in_the_same_words_whichever_task_the_action_ran_in() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let faulty = Arc::new(FaultyStore::new(sled(&tmp.path().join("s"))));
    let mcp = r#"
[[upstreams]]
name = "tools"
prefix = "/mcp"
url = "{up}/mcp"
protocol = "mcp"
"#
    .replace("{up}", &up.url());
    let proxy = TestProxy::start_with_store(
        &format!("{}{mcp}", config(&up.url(), "")),
        faulty.clone(),
        tmp.path(),
    )
    .await;
    let c = TestClient::default();
    let call = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send_email","arguments":{"to":"a"}}}"#;
    let mcp_headers = [
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
    ];
    let mut errors = Vec::new();
    for (path, headers, body, answer) in [
        ("/pay/v1/c", &[(KEY, "panic")][..], "a", r#"{"id":"ch_p"}"#),
        (
            "/mcp",
            &mcp_headers[..],
            call,
            r#"{"jsonrpc":"2.0","id":1,"result":{"content":[]}}"#,
        ),
    ] {
        up.push(Behavior::json(200, answer));
        faulty.panic_settles.store(true, Ordering::SeqCst);
        let r = c.post(&proxy.url(path), headers, body).await;
        let id = r
            .header("oncegate-action")
            .expect("the action's id")
            .to_string();
        let action = proxy
            .admin("GET", &format!("/v1/actions/{id}"), "")
            .await
            .json();
        assert_eq!(action["state"], "unknown", "{path}: {action}");
        errors.push(action["evidence"][0]["tries"][0]["error"].to_string());
    }
    for e in &errors {
        assert!(
            e.contains("(panicked: a bug while settling"),
            "the panic in its own words: {errors:?}"
        );
    }
    assert_eq!(up.count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_go_away_right_after_sending_leave_no_action_without_its_attempt() {
    use tokio::io::AsyncWriteExt;
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json(201, r#"{"ok":true}"#));
    let proxy = TestProxy::start(&config(&up.url(), "")).await;
    const N: usize = 200;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..N {
        let addr = proxy.addr;
        tasks.spawn(async move {
            let body = format!("n={i}");
            let req = format!(
                "POST /pay/v1/c HTTP/1.1\r\nhost: x\r\nidempotency-key: gone-{i}\r\ncontent-type: application/x-www-form-urlencoded\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            // Reset the connection when it is dropped (SO_LINGER 0): the proxy sees it while
            // claiming. Zero lingers without blocking.
            s.set_zero_linger().unwrap();
            let mut s = s.connect(addr).await.unwrap();
            s.write_all(req.as_bytes()).await.unwrap();
            drop(s);
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    // Every claimed action goes on to its attempt: none is left in flight with nothing sent.
    // Reads see what is durable at one moment (they are no barrier for claims still on their
    // way): wait until nothing is in flight and no new action appeared since the last look.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut last_total = usize::MAX;
    let all = loop {
        let all = proxy.store.scan(Default::default(), N).await.unwrap();
        let in_flight = all
            .iter()
            .filter(|r| r.state == oncegate::action::State::InFlight)
            .count();
        if in_flight == 0 && all.len() == last_total {
            break all;
        }
        last_total = all.len();
        assert!(
            tokio::time::Instant::now() < deadline,
            "{in_flight} actions stay in flight with no attempt behind them"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Succeeded, or (on a loaded machine) unknown past the 1 s timeout, or failed to connect:
    // each action sent is sent once, and only those that never connected were not sent.
    let states: Vec<_> = all.iter().map(|r| r.state).collect();
    let sent = all
        .iter()
        .filter(|r| r.state != oncegate::action::State::Failed)
        .count();
    assert!(
        all.iter()
            .filter(|r| r.state == oncegate::action::State::Failed)
            .all(|r| r.evidence[0]
                .tries
                .iter()
                .all(|t| t.phase == Some(oncegate::action::Phase::Connect))),
        "{states:?}"
    );
    assert_eq!(sent, up.count(), "each action sent, sent once: {states:?}");
}

#[tokio::test]
async fn the_sweeper_deletes_large_bodies_no_record_keeps() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let store = sled(&dir);
    let (now, proxy) =
        on_controlled_clock(&up, "retention = \"2h\"", store.clone(), tmp.path()).await;
    // Two actions whose (large) answers are the same bytes: one content-addressed file.
    let big = "b".repeat(100_000);
    up.set_default(Behavior::json(201, &big));
    let c = TestClient::default();
    c.post(&proxy.url("/pay/v1/exports"), &[(KEY, "first")], "a")
        .await;
    now.fetch_add(HOUR, Ordering::SeqCst);
    c.post(&proxy.url("/pay/v1/exports"), &[(KEY, "second")], "b")
        .await;
    let files = || std::fs::read_dir(dir.join("bodies")).unwrap().count();
    assert_eq!(files(), 1);
    // The first expires; the second still keeps the file.
    assert_eq!(store.expire(1_800_000_000_000 + 2 * HOUR).await.unwrap(), 1);
    assert_eq!(files(), 1);
    let r = c
        .post(&proxy.url("/pay/v1/exports"), &[(KEY, "second")], "b")
        .await;
    assert_eq!(r.body, big);
    // Then the second: nothing keeps it any more.
    assert_eq!(store.expire(1_800_000_000_000 + 3 * HOUR).await.unwrap(), 1);
    assert_eq!(files(), 0);
}

/// At the exact retention boundary, a duplicate whose claim still found the action applied, but
/// whose stored answer the sweeper removed before it was read, is never told `already-applied`
/// with `duplicate_risk: true`: the action is over, and the same request again is a new write.
#[tokio::test]
async fn a_replay_racing_the_sweeper_at_the_retention_boundary_is_never_already_applied() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let (now, clock) = support::controlled_clock();
    let store = Arc::new(FaultyStore::new(sled(&tmp.path().join("s"))));
    let proxy = TestProxy::start_with_clock(
        &config(&up.url(), "retention = \"1h\""),
        store.clone(),
        tmp.path(),
        clock,
    )
    .await;
    up.set_default(Behavior::json(201, r#"{"id":"ch_1"}"#));
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/charges");
    assert_eq!(c.post(&url, &[(KEY, "k-edge")], "a").await.status, 201);
    // The last millisecond of its retention; the sweeper, a millisecond later, reaches the
    // record between this duplicate's claim and its read of the stored answer.
    let edge = now.fetch_add(3_600_000 - 1, Ordering::SeqCst) + 3_600_000 - 1;
    store.sweep_before_bodies.store(edge + 1, Ordering::SeqCst);
    let r = c.post(&url, &[(KEY, "k-edge")], "a").await;
    assert_ne!(r.problem(), "already-applied", "{r:?}");
    assert_eq!(r.problem(), "store-unavailable", "{r:?}");
    assert_eq!(r.json()["duplicate_risk"], false);
    assert_eq!(up.count(), 1);
    // Asked again, it is a new write under that key.
    now.fetch_add(1, Ordering::SeqCst);
    let r = c.post(&url, &[(KEY, "k-edge")], "a").await;
    assert_eq!(r.header("oncegate-outcome"), Some("sent"), "{r:?}");
    assert_eq!(up.count(), 2);
}

//! Many proxies, one truth: two proxy processes on one PostgreSQL database (SPEC §13). These run
//! when `ONCEGATE_TEST_POSTGRES` names a server (CI always sets it).
#![allow(clippy::unwrap_used)]

mod support;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use support::{config, Behavior, ChildProxy, FakeUpstream, TestClient};
use tokio::sync::Notify;

const KEY: &str = "idempotency-key";

struct Fleet {
    base: String,
    url: String,
    cfg: PathBuf,
    _tmp: tempfile::TempDir,
}

async fn fleet(up: &FakeUpstream, extra: &str) -> Fleet {
    let base = support::postgres_url();
    let url = support::fresh_database(&base).await;
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("oncegate.toml");
    let text = config(&up.url(), extra).replace(
        "[defaults]",
        "[store]\nbackend = \"postgres\"\nurl_env = \"ONCEGATE_TEST_DB\"\n\n[defaults]",
    );
    std::fs::write(&cfg, text).unwrap();
    Fleet {
        base,
        url,
        cfg,
        _tmp: tmp,
    }
}

impl Fleet {
    async fn proxy(&self) -> ChildProxy {
        let (cfg, url) = (self.cfg.clone(), self.url.clone());
        tokio::task::spawn_blocking(move || {
            ChildProxy::spawn_with(&cfg, &[("ONCEGATE_TEST_DB", &url)])
        })
        .await
        .unwrap()
    }
}

/// Sends `sig` (`-STOP`, `-CONT`) to proxy `p`'s process: a pause as a GC, a frozen VM or
/// `docker pause` makes one.
fn signal(p: &ChildProxy, sig: &str) {
    let pid = p.child.id().to_string();
    let ok = std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .unwrap();
    assert!(ok.success(), "kill {sig} {pid}");
}

/// `n` charges sent at once, alternately to `a` and `b`: the `i`th under key `key(i)`, each with
/// `body`.
fn split(
    a: &ChildProxy,
    b: &ChildProxy,
    n: usize,
    key: impl Fn(usize) -> String,
    body: &'static str,
) -> Vec<tokio::task::JoinHandle<support::Resp>> {
    (0..n)
        .map(|i| {
            let url = [a, b][i % 2].url("/pay/v1/charges");
            let key = key(i);
            tokio::spawn(
                async move { TestClient::default().post(&url, &[(KEY, &key)], body).await },
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn fifty_concurrent_writes_split_across_two_proxies_reach_the_upstream_once() {
    let up = FakeUpstream::start().await;
    let f = fleet(&up, "").await;
    let (a, b) = (f.proxy().await, f.proxy().await);
    up.set_default(Behavior::Delay(
        Duration::from_millis(300),
        Box::new(Behavior::json(201, r#"{"id":"ch_fleet"}"#)),
    ));
    let tasks = split(&a, &b, 50, |_| "fleet-key".to_string(), "amount=5");
    for t in tasks {
        let r = t.await.unwrap();
        match (r.status.as_u16(), r.header("oncegate-outcome")) {
            (201, Some("sent" | "replayed")) | (409, Some("in-flight")) => {}
            other => panic!("unexpected {other:?}: {r:?}"),
        }
    }
    assert_eq!(up.count(), 1);
    // Both proxies replay the one result.
    for p in [&a, &b] {
        let r = TestClient::default()
            .post(&p.url("/pay/v1/charges"), &[(KEY, "fleet-key")], "amount=5")
            .await;
        assert_eq!(r.header("oncegate-outcome"), Some("replayed"));
        assert_eq!(r.body, r#"{"id":"ch_fleet"}"#);
    }
    // One chain across both instances.
    let v = b.admin("GET", "/v1/log/verify", "").await.json();
    assert_eq!(v["ok"], true, "{v}");
}

/// Distinct writes, many at once on both proxies: each proxy's batches chain after a head the
/// other keeps moving, so batches are rolled back and made again under the head's lock. Every
/// write is sent once and answered 201; none gets an error for the other's commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn distinct_writes_on_two_proxies_at_once_are_each_sent_once() {
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json(201, r#"{"id":"ch"}"#));
    let f = fleet(&up, "").await;
    let (a, b) = (f.proxy().await, f.proxy().await);
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(64));
    let tasks: Vec<_> = (0..1200)
        .map(|i| {
            let url = [&a, &b][i % 2].url("/pay/v1/charges");
            let sem = sem.clone();
            tokio::spawn(async move {
                let _p = sem.acquire().await.unwrap();
                let body = format!("amount={i}");
                TestClient::default()
                    .post(&url, &[(KEY, &format!("d{i}"))], &body)
                    .await
            })
        })
        .collect();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 201, "{r:?}");
    }
    assert_eq!(up.count(), 1200);
    let v = b.admin("GET", "/v1/log/verify", "").await.json();
    assert_eq!(v["ok"], true, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn a_write_in_flight_on_one_proxy_is_in_flight_on_the_other() {
    let up = FakeUpstream::start().await;
    let f = fleet(&up, "").await;
    let (a, b) = (f.proxy().await, f.proxy().await);
    let gate = Arc::new(Notify::new());
    up.push(Behavior::Gate(
        gate.clone(),
        Box::new(Behavior::json(201, "{}")),
    ));
    let url = a.url("/pay/v1/charges");
    let first = tokio::spawn(async move {
        TestClient::default()
            .post(&url, &[(KEY, "k-ab")], "x")
            .await
    });
    up.wait_for(1).await;
    let r = TestClient::default()
        .post(&b.url("/pay/v1/charges"), &[(KEY, "k-ab")], "x")
        .await;
    assert_eq!(r.status, 409);
    assert_eq!(r.problem(), "in-flight");
    assert!(r.header("retry-after").is_some());
    gate.notify_one();
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(up.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn a_proxy_killed_mid_attempt_is_unknown_on_the_other_after_its_lease() {
    let up = FakeUpstream::start().await;
    let extra = "timeout = \"500ms\"\nretries = 0";
    let f = fleet(&up, extra).await;
    let (a, b) = (f.proxy().await, f.proxy().await);
    up.set_default(Behavior::Hang);
    let url = a.url("/pay/v1/charges");
    let _pending = tokio::spawn(async move {
        let req = http::Request::post(url)
            .header(KEY, "k-dead")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"x")))
            .unwrap();
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http()
            .request(req)
            .await
    });
    up.wait_for(1).await;
    a.kill();
    let c = TestClient::default();
    let burl = b.url("/pay/v1/charges");
    // While A's lease runs, B cannot know A is dead: in flight.
    let r = c.post(&burl, &[(KEY, "k-dead")], "x").await;
    assert_eq!(r.problem(), "in-flight");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let r = loop {
        let r = c.post(&burl, &[(KEY, "k-dead")], "x").await;
        if r.problem() != "in-flight" {
            break r;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lease never expired"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(r.status, 409);
    assert_eq!(r.problem(), "outcome-unknown");
    let ev = r.json()["evidence"].to_string();
    assert!(ev.contains("lease of proxy"), "{ev}");
    assert_eq!(up.count(), 1, "B never sent it again");
}

/// A lookup that finds nothing yet (a lagging search index, or an upstream still working).
const LOOKUP_404: &str = r#"lookup = { path = "/v1/lookup/{key}", found = "/id" }"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn a_paused_proxy_past_its_lease_never_lets_the_other_send_again() {
    let up = FakeUpstream::start().await;
    let extra = format!("timeout = \"4s\"\nretries = 0\n{LOOKUP_404}");
    let f = fleet(&up, &extra).await;
    up.on("/v1/lookup/", Behavior::status(404));
    let (a, b) = (f.proxy().await, f.proxy().await);
    let gate = Arc::new(Notify::new());
    up.push(Behavior::Gate(
        gate.clone(),
        Box::new(Behavior::json(201, r#"{"id":"ch_p"}"#)),
    ));
    let url = a.url("/pay/v1/charges");
    let first = tokio::spawn(async move {
        TestClient::default()
            .post(&url, &[(KEY, "k-paused")], "x")
            .await
    });
    up.wait_for(1).await;
    // A stops (a long GC pause, a frozen VM) past its lease (4s + 2s): B judges it over.
    let signal = |sig: &str| signal(&a, sig);
    signal("-STOP");
    let c = TestClient::default();
    let burl = b.url("/pay/v1/charges");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let r = loop {
        let r = c.post(&burl, &[(KEY, "k-paused")], "x").await;
        if r.problem() != "in-flight" {
            break r;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lease never expired"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    // Its lookup finds nothing *yet*: that is no proof, so the write stays unknown (SPEC §9).
    assert_eq!(r.problem(), "outcome-unknown", "{:?}", r.json());
    assert!(up.count_method("GET") >= 1, "B asked the lookup");
    assert_eq!(up.count_method("POST"), 1, "B never sent it again");
    // A wakes up. Whether its answer or its own timeout comes first (the pause outlasted it),
    // what A records is what B then answers: a replay, or still unknown; never a second send.
    signal("-CONT");
    gate.notify_one();
    let first = first.await.unwrap();
    let again = c.post(&burl, &[(KEY, "k-paused")], "x").await;
    match first.status.as_u16() {
        201 => assert_eq!(again.header("oncegate-outcome"), Some("replayed")),
        504 => assert_eq!(again.problem(), "outcome-unknown"),
        other => panic!("A answered {other}: {:?}", first.body),
    }
    assert_eq!(up.count_method("POST"), 1);
}

/// The same pause, but the other proxy's lookup finds the charge at the service and settles
/// the action applied. When A wakes, its own attempt ends (with the upstream's answer, or its
/// timeout) after the action was settled: its client gets the action's outcome, a replay, as
/// any duplicate would; not a 503 that says the write may have happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn a_paused_proxy_whose_action_a_lookup_settled_answers_with_the_settled_outcome() {
    let up = FakeUpstream::start().await;
    let extra = format!("timeout = \"2s\"\nretries = 0\n{LOOKUP_404}");
    let f = fleet(&up, &extra).await;
    up.on("/v1/lookup/", Behavior::json(200, r#"{"id":"ch_found"}"#));
    let (a, b) = (f.proxy().await, f.proxy().await);
    let gate = Arc::new(Notify::new());
    up.push(Behavior::Gate(
        gate.clone(),
        Box::new(Behavior::json(201, r#"{"id":"ch_found"}"#)),
    ));
    let url = a.url("/pay/v1/charges");
    let first = tokio::spawn(async move {
        TestClient::default()
            .post(&url, &[(KEY, "k-settled")], "x")
            .await
    });
    up.wait_for(1).await;
    signal(&a, "-STOP");
    let c = TestClient::default();
    let burl = b.url("/pay/v1/charges");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let r = loop {
        let r = c.post(&burl, &[(KEY, "k-settled")], "x").await;
        if r.status.is_success() || r.problem() != "in-flight" {
            break r;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lease never expired"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(r.status.is_success(), "B's lookup found it: {:?}", r.body);
    assert_eq!(r.header("oncegate-outcome"), Some("replayed"));
    gate.notify_one();
    signal(&a, "-CONT");
    let first = first.await.unwrap();
    assert!(
        first.status.is_success(),
        "A's client is told the charge happened: {} {:?}",
        first.status,
        first.body
    );
    assert_eq!(first.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(up.count_method("POST"), 1);
    let v = b.admin("GET", "/v1/log/verify", "").await.json();
    assert_eq!(v["ok"], true, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn a_proxy_whose_clock_runs_ahead_does_not_judge_another_attempt_over() {
    // Two proxies on one database; B's clock is 90 s ahead. Leases are judged by the database's
    // clock (SPEC §13), so B sees A's running attempt as in flight, not as a dead one.
    let base = support::postgres_url();
    let db_url = support::fresh_database(&base).await;
    let up = FakeUpstream::start().await;
    up.on("/v1/lookup/", Behavior::status(404));
    let cfg = config(&up.url(), &format!("timeout = \"10s\"\n{LOOKUP_404}"));
    let tmp = tempfile::tempdir().unwrap();
    let store = || async {
        let s = oncegate::store::postgres::PostgresStore::open(&db_url, Default::default())
            .await
            .unwrap();
        Arc::new(s) as Arc<dyn oncegate::store::Store>
    };
    let a = support::TestProxy::start_with_store(&cfg, store().await, tmp.path()).await;
    let ahead: oncegate::action::Clock = Arc::new(|| oncegate::action::now_millis() + 90_000);
    let b = support::TestProxy::start_with_clock(&cfg, store().await, tmp.path(), ahead).await;
    let gate = Arc::new(Notify::new());
    up.push(Behavior::Gate(
        gate.clone(),
        Box::new(Behavior::json(201, r#"{"id":"ch_s"}"#)),
    ));
    let url = a.url("/pay/v1/charges");
    let first = tokio::spawn(async move {
        TestClient::default()
            .post(&url, &[(KEY, "k-skew")], "x")
            .await
    });
    up.wait_for(1).await;
    let r = TestClient::default()
        .post(&b.url("/pay/v1/charges"), &[(KEY, "k-skew")], "x")
        .await;
    assert_eq!(r.problem(), "in-flight", "{:?}", r.json());
    assert_eq!(up.count_method("POST"), 1);
    // B's sweeper, ahead too, does not turn it unknown either.
    assert_eq!(
        b.store
            .recover(None, oncegate::action::now_millis() + 90_000)
            .await
            .unwrap(),
        0
    );
    gate.notify_one();
    assert_eq!(first.await.unwrap().status, 201);
    let r = TestClient::default()
        .post(&b.url("/pay/v1/charges"), &[(KEY, "k-skew")], "x")
        .await;
    assert_eq!(r.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(up.count_method("POST"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn when_the_database_is_down_writes_get_503_reads_flow_and_the_proxy_recovers() {
    let up = FakeUpstream::start().await;
    let f = fleet(&up, "").await;
    let a = f.proxy().await;
    let c = TestClient::default();
    assert_eq!(
        c.post(&a.url("/pay/v1/c"), &[(KEY, "before")], "x")
            .await
            .status,
        200
    );
    let db = f.url.rsplit('/').next().unwrap().to_string();
    let admin = |sql: String| {
        let base = f.base.clone();
        async move {
            let (client, conn) = tokio_postgres::connect(&base, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(conn);
            client.batch_execute(&sql).await.unwrap();
        }
    };
    admin(format!("ALTER DATABASE {db} ALLOW_CONNECTIONS false")).await;
    support::terminate_connections(&f.base, &f.url).await;
    let r = c.post(&a.url("/pay/v1/c"), &[(KEY, "during")], "x").await;
    assert_eq!(r.status, 503);
    assert_eq!(r.problem(), "store-unavailable");
    assert_eq!(
        up.count_key(KEY, "during"),
        0,
        "nothing is sent without its claim"
    );
    assert_eq!(
        c.get(&a.url("/pay/v1/c")).await.status,
        200,
        "reads keep flowing"
    );
    admin(format!("ALTER DATABASE {db} ALLOW_CONNECTIONS true")).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let r = c.post(&a.url("/pay/v1/c"), &[(KEY, "during")], "x").await;
        if r.status == 200 {
            break;
        }
        assert_eq!(r.problem(), "store-unavailable");
        assert!(
            tokio::time::Instant::now() < deadline,
            "the proxy did not recover"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let r = c.post(&a.url("/pay/v1/c"), &[(KEY, "before")], "x").await;
    assert_eq!(r.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(up.count_key(KEY, "during"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn database_restarts_mid_load_lose_nothing_and_duplicate_nothing() {
    let up = FakeUpstream::start().await;
    let f = fleet(&up, "").await;
    let (a, b) = (f.proxy().await, f.proxy().await);
    let urls = [a.url("/pay/v1/c"), b.url("/pay/v1/c")];
    let mut workers = Vec::new();
    for w in 0..6 {
        let url = urls[w % 2].clone();
        workers.push(tokio::spawn(async move {
            let c = TestClient::default();
            let (mut done, mut unknown) = (Vec::new(), Vec::new());
            for i in 0..40 {
                let key = format!("r{w}-{i}");
                // Retry each write until it has a definite answer.
                loop {
                    // A body of its own: identical ones under distinct keys would be twins.
                    let r = c.post(&url, &[(KEY, &key)], &key).await;
                    let problem = r
                        .header("content-type")
                        .filter(|t| *t == "application/problem+json")
                        .map(|_| r.problem());
                    match (r.status.as_u16(), problem.as_deref()) {
                        (200, None) => {
                            done.push((key.clone(), r.body));
                            break;
                        }
                        (_, Some("outcome-unknown")) => {
                            unknown.push(key.clone());
                            break;
                        }
                        // Not applied (a try that could not be recorded as sending was not
                        // sent): the same write again.
                        (409, Some("in-flight"))
                        | (503, Some("store-unavailable"))
                        | (502, Some("upstream-unreachable")) => {
                            tokio::time::sleep(Duration::from_millis(20)).await
                        }
                        (s, p) => panic!("{key}: {s} {p:?} {:?}", r.body),
                    }
                }
            }
            (done, unknown)
        }));
    }
    let mut terminated = 0;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        terminated += support::terminate_connections(&f.base, &f.url).await;
    }
    let (mut completed, mut unknown) = (Vec::new(), Vec::new());
    for w in workers {
        let (d, u) = w.await.unwrap();
        completed.extend(d);
        unknown.extend(u);
    }
    assert!(terminated > 0, "no connection was ever cut");
    assert_eq!(completed.len() + unknown.len(), 240);
    assert!(completed.len() > 200, "{} completed", completed.len());
    for key in &unknown {
        assert!(up.count_key(KEY, key) <= 1, "{key} applied twice");
        let r = TestClient::default()
            .post(&urls[1], &[(KEY, key)], key)
            .await;
        assert_eq!(r.problem(), "outcome-unknown", "{key}");
    }
    let c = TestClient::default();
    for (key, body) in &completed {
        assert!(up.count_key(KEY, key) <= 1, "{key} applied twice");
        let r = c.post(&urls[0], &[(KEY, key)], key).await;
        // Applied, or unknown if a cut connection hid the outcome: never sent again.
        match r.header("oncegate-outcome") {
            Some("replayed") => assert_eq!(&r.body, body),
            other => panic!("{key}: completed, then {other:?}"),
        }
    }
}

/// The unsettled-twin guard across a fleet (SPEC §4.1): twenty identical charges under twenty
/// keys (a tool loop whose SDK draws a key per call), sent at once half to each proxy, while the
/// first is in flight: one reaches the upstream, every other is told it may be a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn identical_writes_under_new_keys_racing_on_two_proxies_are_sent_once() {
    let up = FakeUpstream::start().await;
    let f = fleet(&up, "").await;
    let (a, b) = (f.proxy().await, f.proxy().await);
    let gate = Arc::new(Notify::new());
    up.set_default(Behavior::Gate(
        gate.clone(),
        Box::new(Behavior::json(201, r#"{"id":"ch_twin"}"#)),
    ));
    let mut tasks = split(&a, &b, 20, |i| format!("sdk-key-{i}"), "amount=4200");
    up.wait_for(1).await;
    let mut stopped = 0;
    // Every request but the one sent is answered while that one is still held at the gate.
    while stopped < 19 {
        let mut still = Vec::new();
        for t in tasks {
            if t.is_finished() {
                let r = t.await.unwrap();
                assert_eq!(r.problem(), "possible-duplicate", "{r:?}");
                stopped += 1;
            } else {
                still.push(t);
            }
        }
        tasks = still;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    gate.notify_one();
    let sent = tasks.pop().unwrap().await.unwrap();
    assert_eq!(sent.status, 201, "{sent:?}");
    assert_eq!(up.count(), 1, "one charge across the fleet");
}

/// Proxy A is answered 503 with `Retry-After`, and is paused (SIGSTOP: a GC pause, a frozen VM,
/// `docker pause`) while it waits to try again, past its lease. B takes the action over, and it
/// is settled as not applied, by B's lookup finding nothing after `absent_after` or by an
/// operator; B sends it. A wakes: its second try must not leave (SPEC §13, fencing).
async fn a_paused_owner_taken_over(by_operator: bool) {
    let up = FakeUpstream::start().await;
    up.on("/v1/lookup/", Behavior::status(404));
    // A lease of 0.5 s × 2 tries + 2 s of waiting + 2 s = 5 s.
    let lookup = r#"lookup = { path = "/v1/lookup/{key}", found = "/id", absent_after = "1s" }"#;
    let extra = format!(
        "timeout = \"500ms\"\nretries = 1\nmax_retry_wait = \"2s\"\n{}",
        if by_operator { "" } else { lookup }
    );
    let f = fleet(&up, &extra).await;
    let (a, b) = (f.proxy().await, f.proxy().await);
    up.push(Behavior::status(503).with_header("retry-after", "2"));
    up.set_default(Behavior::json(201, r#"{"id":"ch_once"}"#));
    let url = a.url("/pay/v1/charges");
    let first = tokio::spawn(async move {
        TestClient::default()
            .post(&url, &[(KEY, "k-fence")], "amount=5")
            .await
    });
    up.wait_for(1).await;
    // Paused once it has read the 503 and waits to try again (the scenario); paused before
    // reading it, A would wake past its 500 ms timeout and find the answer lost instead.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let signal = |sig: &str| signal(&a, sig);
    signal("-STOP");
    let c = TestClient::default();
    let burl = b.url("/pay/v1/charges");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let sent = loop {
        assert!(tokio::time::Instant::now() < deadline, "B never took over");
        let r = c.post(&burl, &[(KEY, "k-fence")], "amount=5").await;
        if r.status == 201 {
            break r;
        }
        match (r.status.as_u16(), r.problem().as_str()) {
            (_, "outcome-unknown") if by_operator => {
                let id = r.header("oncegate-action").unwrap().to_string();
                let body = r#"{"outcome":"not-applied","reason":"no charge at the processor"}"#;
                let resolved = b
                    .admin("POST", &format!("/v1/actions/{id}/resolve"), body)
                    .await;
                assert_eq!(resolved.status, 200, "{:?}", resolved.body);
            }
            (_, "in-flight" | "outcome-unknown") => {}
            other => panic!("B answered {other:?}: {:?}", r.body),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(sent.header("oncegate-outcome"), Some("sent"));
    assert_eq!(up.count_method("POST"), 2, "A's 503, then B's send");
    // A wakes, its wait long over: its next try finds the action moved on, and stays unsent.
    signal("-CONT");
    let first = first.await.unwrap();
    assert_eq!(
        up.count_method("POST"),
        2,
        "the paused proxy sent again: {:?}",
        first.body
    );
    assert_eq!(
        first.status, 201,
        "A's client gets B's result: {:?}",
        first.body
    );
    assert_eq!(first.header("oncegate-outcome"), Some("replayed"));
    let v = b.admin("GET", "/v1/log/verify", "").await.json();
    assert_eq!(v["ok"], true, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn a_paused_owner_never_sends_after_a_lookup_settled_it_and_another_proxy_sent() {
    a_paused_owner_taken_over(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn a_paused_owner_never_sends_after_an_operator_settled_it_and_another_proxy_sent() {
    a_paused_owner_taken_over(true).await;
}
